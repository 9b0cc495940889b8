"""The Docker backends over the engine's other transports: ``tcp://`` with mutual TLS, and ``ssh://``.

The registry stack's podman socket is offered as ``dockerd --tlsverify`` offers an engine (socat with a CA, a
server certificate and client certificates made by the test) and behind a real sshd of the test's own whose
sessions connect to it (tests/engine_transports.py). Over each, the blocks are configured only through their
fields (``tls`` / ``ssh``: no environment, no ~/.ssh): a training job runs end to end on a GPU chosen by index,
and its model is deployed with DockerServing and answers the smoke request. The engine runs on this machine, so
the job's directory is the same path on both sides: the transport is what is tested here, not a remote host's
own filesystem.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import httpx
import pytest
from prefect_docker.host import DockerHost

from blocks.base.serving import Release
from blocks.base.storage import write_manifest
from blocks.docker.compute import DockerCompute
from blocks.docker.serving import DockerServing
from blocks.docker.transport import DockerTls
from blocks.errors import ConfigurationError
from blocks.local.provider import LocalMachine
from blocks.records import ImageRef, ServerSpec
from blocks.specs import ServingSpec
from blocks.ssh.credentials import SshCredentials
from tests.engine_transports import SshEngine, TlsEngine, ssh_engine, tls_engine
from tests.fake_gpus import FakeGpus
from tests.test_docker_compute import (  # noqa: F401 - fixtures
    compute,
    credentials,
    engine,
    gpus,
    image,
    keys,
    make_job,
    probe,
    stack,
)

pytestmark = pytest.mark.integration


def _socket(stack: dict[str, str]) -> str:
    return stack["DOCKER_HOST"].removeprefix("unix://")


@pytest.fixture(scope="module")
def tls(stack: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsEngine]:
    with tls_engine(_socket(stack), tmp_path_factory.mktemp("tls")) as served:
        yield served


@pytest.fixture(scope="module")
def ssh(stack: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshEngine]:
    with ssh_engine(_socket(stack), tmp_path_factory.mktemp("ssh")) as served:
        yield served


def tls_fields(tls: TlsEngine, **settings: str | None) -> dict:
    given = {"ca_cert": tls.ca_cert, "client_cert": tls.client_cert, "client_key": tls.client_key, **settings}
    return {"docker_host": DockerHost(base_url=tls.url), "tls": DockerTls(**given)}


def ssh_fields(ssh: SshEngine, **settings: str) -> dict:
    given = {"private_key": ssh.private_key, "known_hosts": ssh.known_hosts, **settings}
    return {"docker_host": DockerHost(base_url=ssh.url), "ssh": SshCredentials(**given)}


@pytest.fixture(params=["tls", "ssh"])
def transport(request: pytest.FixtureRequest) -> tuple[dict, object]:
    """The blocks' fields for one transport, and its server (whose log counts the connections it took)."""
    served = request.getfixturevalue(request.param)
    return (tls_fields(served) if request.param == "tls" else ssh_fields(served)), served


def _used(served: object) -> int:
    return served.connections() if isinstance(served, TlsEngine) else served.logins()  # type: ignore[union-attr]


def test_trains_on_the_gpu_asked_for_and_serves_the_model_over_the_transport(
    transport: tuple[dict, object],
    stack: dict[str, str],
    gpus: FakeGpus,
    image: ImageRef,
    engine: docker.DockerClient,
    tmp_path: Path,
    keys: list[str],
) -> None:
    fields, served = transport
    before = _used(served)
    c = compute(stack, gpus, tmp_path, **fields)
    assert c.engine().api == "libpod"  # podman's own API, reached through the transport
    assert _used(served) > before

    job = make_job(c, image, keys, "remote", gpu_devices=["1"], mem_gb=2)
    handle = c.submit(job)
    lines: list[str] = []
    status = c.watch(handle, on_output=lines.append, timeout_seconds=900)
    assert status.state == "COMPLETED", c.log_tail(handle)
    seen = probe(job)
    assert seen["devices"] == ["/dev/nvidia1"]  # the GPU asked for by index, nothing else
    assert seen["env"][gpus.env_name(1)] == gpus.uuids[1]
    assert "step" in "".join(lines)  # the log streamed over the transport
    final = Path(c.result(handle, status).checkpoint_dir) / "final"
    write_manifest(final)
    example = json.loads((final / "serving_input_example.json").read_text())

    serving = DockerServing(
        registry_credentials=credentials(stack),
        cdi_kind=gpus.kind,
        health_interval_seconds=2,
        drain_seconds=5,
        env={
            "WARMUP_ITERATIONS": "1",
            "MODEL_DEVICE": "cpu",
        },  # the stand-in GPUs have no CUDA: the server runs the model on the CPU
        **fields,
    ).with_inventory(LocalMachine(nvidia_smi=gpus.nvidia_smi, nvidia_ctk="/nonexistent").host_inventory())
    assert isinstance(serving, DockerServing)
    service = f"digits-{uuid.uuid4().hex[:6]}"
    try:
        spec = ServingSpec(service_name=service, smoke_request=example, ready_timeout_seconds=300, gpu_devices=["2"])
        release = Release(model_name="digits", version="1", model_uri=final.as_uri(), image=image, server=ServerSpec())
        endpoint = serving.deploy(spec, release)
        assert httpx.post(f"{endpoint.url}/invocations", json=example, timeout=60).status_code == 200
        active = engine.containers.get(serving.active_name(service))
        out = active.exec_run(["sh", "-c", "ls /dev | grep '^nvidia' || true"]).output.decode().split()
        assert out == ["nvidia2"]
    finally:
        serving.undeploy(service)
        serving.close()
        c.close()
    assert engine.containers.list(all=True, filters={"label": f"io.gpuferry.service={service}"}) == []


def test_tls_without_a_client_certificate_or_with_another_ca_is_refused_naming_the_fields(
    tls: TlsEngine,
    stack: dict[str, str],
    gpus: FakeGpus,
    tmp_path: Path,
) -> None:
    no_cert = compute(stack, gpus, tmp_path, **tls_fields(tls, client_cert=None, client_key=None))
    # TLS 1.3 sends the refusal after the handshake: the client reads the alert, or the connection's end first.
    with pytest.raises(
        ConfigurationError,
        match=r"refused this client's certificate .* set tls\.client_cert and "
        r"tls\.client_key .*(CERTIFICATE_REQUIRED|SSLEOFError)",
    ):
        no_cert.engine().client  # noqa: B018 - the property connects, which is what fails
    wrong_ca = compute(stack, gpus, tmp_path, **tls_fields(tls, ca_cert=tls.other_ca_cert))
    with pytest.raises(ConfigurationError, match=r"not one tls\.ca_cert signed .*CERTIFICATE_VERIFY_FAILED"):
        wrong_ca.engine().client  # noqa: B018 - the property connects, which is what fails
    with pytest.raises(ValueError, match=r"set client_cert and client_key together"):
        DockerTls(ca_cert=tls.ca_cert, client_cert=tls.client_cert).check()
    with pytest.raises(ValueError, match=r"TLS needs base_url tcp://"):
        DockerCompute(docker_host=DockerHost(base_url=stack["DOCKER_HOST"]), tls=DockerTls(ca_cert=tls.ca_cert))


def test_ssh_refuses_a_host_key_not_in_known_hosts_and_a_key_it_was_not_given(
    ssh: SshEngine,
    stack: dict[str, str],
    gpus: FakeGpus,
    tmp_path: Path,
) -> None:
    other_host = compute(stack, gpus, tmp_path, **ssh_fields(ssh, known_hosts=ssh.other_known_hosts))
    with pytest.raises(ConfigurationError, match=r"SSH host key of the Docker engine's host 127\.0\.0\.1:\d+ CHANGED"):
        other_host.engine().client  # noqa: B018 - the property connects, which is what fails
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    refused = compute(stack, gpus, tmp_path, **ssh_fields(ssh, private_key=stranger.read_text()))
    with pytest.raises(ConfigurationError, match=r"SSH login as root@127\.0\.0\.1:\d+ was refused"):
        refused.engine().client  # noqa: B018 - the property connects, which is what fails
    with pytest.raises(ValueError, match=r"it must be ssh://USER@HOST\[:PORT\]"):
        DockerCompute(
            docker_host=DockerHost(base_url="ssh://127.0.0.1:22"),
            ssh=SshCredentials(private_key=ssh.private_key, known_hosts=ssh.known_hosts),
        )


def test_ssh_logs_in_as_the_credentials_user_when_base_url_names_none(
    ssh: SshEngine,
    stack: dict[str, str],
    gpus: FakeGpus,
    tmp_path: Path,
) -> None:
    logins = ssh.logins()
    fields = ssh_fields(ssh, user="root")
    fields["docker_host"] = DockerHost(base_url=ssh.url.replace("ssh://root@", "ssh://"))
    c = compute(stack, gpus, tmp_path, **fields)
    assert c.engine().client.ping()
    deadline = time.monotonic() + 60
    while ssh.logins() == logins:  # sshd writes its log line after the login
        assert time.monotonic() < deadline, ssh.log.read_text()[-2000:]
        time.sleep(0.2)
