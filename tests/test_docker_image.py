"""DockerImageBuilder against the registry stack (`make registry-up`): podman's Docker API + docker-registry.

Small workloads in tmp_path (on the stack's busybox base) cover tagging, caching and errors; the bundled
examples (on the stack's Debian + Python base) are built, pushed and run under podman: the regressor's
generated image trains with its own train.py, then serves what it trained with gpuferry's model server.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import docker
import httpx
import pytest
from prefect_docker.credentials import DockerRegistryCredentials
from prefect_docker.host import DockerHost

from blocks.base.storage import write_manifest
from blocks.docker.image import DockerImageBuilder, ImageBuildFailed
from blocks.docker.registry import MANIFEST_TYPES, _classify_push_error
from blocks.errors import ConfigurationError, TransientError
from blocks.workload.source import Workload, load_workload
from tasks.retry import is_transient
from tests.examples import DIABETES, DIGITS
from tests.stacks import stack_env

pytestmark = pytest.mark.integration

DEAD_ENGINE = DockerHost(base_url="unix:///nonexistent/gpuferry-no-engine.sock")


@pytest.fixture(scope="module")
def stack() -> dict[str, str]:
    env = stack_env("registry")
    env["REGISTRY_PASSWORD"] = Path(env["REGISTRY_PASSWORD_FILE"]).read_text().strip()
    return env


@pytest.fixture(scope="module")
def engine(stack: dict[str, str]) -> Iterator[docker.DockerClient]:
    client = docker.DockerClient(base_url=stack["DOCKER_HOST"], timeout=600)
    yield client
    client.close()


def credentials(stack: dict[str, str], password: str | None = None) -> DockerRegistryCredentials:
    return DockerRegistryCredentials(
        username=stack["REGISTRY_USER"],
        password=password if password is not None else stack["REGISTRY_PASSWORD"],
        registry_url=f"http://{stack['REGISTRY_URL']}",
    )


def builder(stack: dict[str, str], repository: str, **kwargs: object) -> DockerImageBuilder:
    fields: dict[str, object] = {
        "docker_host": DockerHost(base_url=stack["DOCKER_HOST"]),
        "credentials": credentials(stack),
        "repository": repository,
        "build_args": {"BASE": stack["TINY_BASE_IMAGE"]},
    }
    fields.update(kwargs)
    return DockerImageBuilder(**fields)


# A workload of the busybox base: no Python, so it names its own server (gpuferry's needs Python).
TINY_WORKLOAD = (
    "name: tiny\nimage: {dockerfile: Dockerfile}\ntrain: {command: [sh, -c, 'true']}\n"
    "promotion: {metric: m}\nserve: {command: [sh, -c, 'true'], port: 8080}\n"
)


def tiny(context: Path) -> Workload:
    return load_workload(str(context))


def registry_manifest(stack: dict[str, str], repository: str, reference: str) -> httpx.Response:
    """The registry's own answer, read without the code under test."""
    return httpx.head(
        f"http://{stack['REGISTRY_URL']}/v2/{repository}/manifests/{reference}",
        headers={"Accept": MANIFEST_TYPES},
        auth=(stack["REGISTRY_USER"], stack["REGISTRY_PASSWORD"]),
        timeout=30,
    )


@pytest.fixture
def repository(engine: docker.DockerClient) -> Iterator[str]:
    name = f"gpuferry-test/img-{uuid.uuid4().hex[:10]}"
    yield name
    for image in engine.images.list(name=f"*/{name}"):  # the local tags this test made
        for tag in image.tags:
            engine.images.remove(tag)


@pytest.fixture
def context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(
        "ARG BASE\nFROM ${BASE}\nCOPY app.txt /app/app.txt\nRUN cat /app/app.txt > /app/copy.txt\n"
    )
    (ctx / "app.txt").write_text(f"run {uuid.uuid4()}\n")  # a tag no earlier run has pushed
    (ctx / "notes.log").write_text("ignored\n")
    (ctx / ".dockerignore").write_text("*.log\n")
    (ctx / "gpuferry.yaml").write_text(TINY_WORKLOAD)
    return ctx


def test_build_push_and_digest_read_back(
    stack: dict[str, str], engine: docker.DockerClient, context: Path, repository: str
) -> None:
    b = builder(stack, repository)
    image = b.build(tiny(context))

    assert image.built
    assert image.content_tag == b.context(tiny(context)).tag
    name, _, digest = image.reference.partition("@")
    assert name == f"{stack['REGISTRY_URL']}/{repository}"
    by_tag = registry_manifest(stack, repository, image.content_tag)
    assert by_tag.status_code == 200
    assert digest == by_tag.headers["docker-content-digest"]
    assert registry_manifest(stack, repository, digest).status_code == 200  # pullable by digest
    # The registry digest is that of the pushed (compressed) manifest, not the local image id.
    assert engine.images.get(f"{name}:{image.content_tag}").id != digest


def test_unchanged_context_is_not_rebuilt(stack: dict[str, str], context: Path, repository: str) -> None:
    first = builder(stack, repository).build(tiny(context))
    assert first.built
    (context / "notes.log").write_text("changed, but .dockerignore'd\n")

    # No engine at all: a rebuild attempt would fail.
    started = time.monotonic()
    again = builder(stack, repository, docker_host=DEAD_ENGINE).build(tiny(context))
    elapsed = time.monotonic() - started

    assert not again.built
    assert again.reference == first.reference
    assert again.content_tag == first.content_tag
    assert "build skipped" in again.note
    assert elapsed < 10, f"a tag hit took {elapsed:.1f}s"


def test_one_changed_file_gives_a_new_tag(stack: dict[str, str], context: Path, repository: str) -> None:
    first = builder(stack, repository).build(tiny(context))
    (context / "app.txt").write_text((context / "app.txt").read_text() + "one more line\n")

    second = builder(stack, repository).build(tiny(context))

    assert second.built
    assert second.content_tag != first.content_tag
    assert second.reference != first.reference
    # both stay pinned in the registry
    for image in (first, second):
        assert registry_manifest(stack, repository, image.reference.split("@")[1]).status_code == 200


def test_failing_step_is_named_with_the_log_tail(stack: dict[str, str], context: Path, repository: str) -> None:
    (context / "Dockerfile").write_text(
        "ARG BASE\nFROM ${BASE}\nCOPY app.txt /app/app.txt\n"
        "RUN echo about-to-fail-on-purpose && exit 3\nRUN echo never-reached\n"
    )
    with pytest.raises(ImageBuildFailed) as caught:
        builder(stack, repository).build(tiny(context))

    error = caught.value
    # Four steps of the Dockerfile, then the two gpuferry adds (its runtime, PYTHONPATH).
    assert error.step == "STEP 3/6: RUN echo about-to-fail-on-purpose && exit 3"
    assert "image build failed at STEP 3/6: RUN echo about-to-fail-on-purpose && exit 3" in str(error)
    assert "exit status 3" in str(error)
    assert "about-to-fail-on-purpose" in error.log_tail.splitlines()[-1]
    assert "never-reached" not in error.log_tail
    assert not is_transient(error)
    assert (
        registry_manifest(stack, repository, builder(stack, repository).context(tiny(context)).tag).status_code == 404
    )


def test_unknown_instruction_is_named(stack: dict[str, str], context: Path, repository: str) -> None:
    (context / "Dockerfile").write_text("ARG BASE\nFROM ${BASE}\nFROBNICATE /app\n")
    with pytest.raises(ImageBuildFailed, match=r"(?s)at STEP 2/4: FROBNICATE.*Unknown instruction"):
        builder(stack, repository).build(tiny(context))


def test_wrong_password_is_a_clear_error_before_any_build(
    stack: dict[str, str], context: Path, repository: str
) -> None:
    wrong = "not-the-password-" + uuid.uuid4().hex[:6]
    b = builder(stack, repository, credentials=credentials(stack, wrong), docker_host=DEAD_ENGINE)
    with pytest.raises(ConfigurationError, match="refused the credentials of user") as caught:
        b.build(tiny(context))
    assert "credentials.password" in str(caught.value)
    assert wrong not in str(caught.value)
    assert not is_transient(caught.value)


def test_unreachable_registry_is_transient(stack: dict[str, str], context: Path, repository: str) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    creds = DockerRegistryCredentials(username="u", password="p", registry_url=f"http://127.0.0.1:{port}")
    with pytest.raises(TransientError, match="is unreachable") as caught:
        builder(stack, repository, credentials=creds, docker_host=DEAD_ENGINE).build(tiny(context))
    assert is_transient(caught.value)


class _Unavailable(BaseHTTPRequestHandler):
    def do_HEAD(self) -> None:  # http.server's naming
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD  # noqa: N815 - http.server's handler name

    def log_message(self, *args: object) -> None:
        pass


def test_registry_5xx_is_transient(stack: dict[str, str], context: Path, repository: str) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Unavailable)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        creds = DockerRegistryCredentials(
            username="u", password="p", registry_url=f"http://127.0.0.1:{server.server_address[1]}"
        )
        with pytest.raises(TransientError, match="answered HTTP 503") as caught:
            builder(stack, repository, credentials=creds, docker_host=DEAD_ENGINE).build(tiny(context))
        assert is_transient(caught.value)
    finally:
        server.shutdown()
        server.server_close()


def test_push_errors_are_classified() -> None:
    # The messages podman's Docker API sends in a push stream.
    refused = _classify_push_error(
        "trying to reuse blob sha256:3fd0 at destination: checking whether a blob sha256:3fd0 exists in "
        "127.0.0.1:5090/x: unauthorized: authentication required",
        "127.0.0.1:5090/x:1",
    )
    assert isinstance(refused, ConfigurationError) and "credentials.password" in str(refused)
    https = _classify_push_error('Get "https://h:5000/v2/": http: server gave HTTP response to HTTPS client', "h/x:1")
    assert isinstance(https, ConfigurationError) and "insecure" in str(https)
    reset = _classify_push_error("writing blob: Patch http://h/v2/x/blobs/uploads/1: connection reset by peer", "h/x:1")
    assert isinstance(reset, TransientError) and is_transient(reset)


def test_bad_repository_is_rejected_naming_the_field(stack: dict[str, str], context: Path) -> None:
    with pytest.raises(ValueError, match="repository='Team/Workload:1' is not a valid repository path"):
        builder(stack, "Team/Workload:1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_exit(container: object, timeout: float = 600) -> int:
    return int(container.wait(timeout=timeout)["StatusCode"])  # type: ignore[attr-defined]


def test_an_example_image_trains_then_serves_what_it_trained(
    stack: dict[str, str], engine: docker.DockerClient, tmp_path: Path
) -> None:
    """The regressor's generated image (base + requirements): its train.py writes an MLflow model in the
    container, and gpuferry's model server, added at build time, serves it from the same image."""
    workload = load_workload(str(DIABETES))
    b = builder(stack, "gpuferry-test/diabetes", build_args={"BASE_IMAGE": stack["BASE_IMAGE"]})
    image = b.build(workload)
    assert image.reference and "@sha256:" in image.reference and image.workdir == "/workload"
    auth = {"username": stack["REGISTRY_USER"], "password": stack["REGISTRY_PASSWORD"]}
    pulled = engine.images.pull(image.reference, auth_config=auth)  # exactly the pinned reference
    # The content tag names the same image in the registry (pulled by tag: an earlier run's build of the same
    # content is not rebuilt, so the engine need not have the tag locally).
    by_tag = engine.images.pull(f"{b.image_name()}:{image.content_tag}", auth_config=auth)
    assert pulled.id == by_tag.id

    out = tmp_path / "ckpt"
    out.mkdir()
    out.chmod(0o777)
    trainer = engine.containers.run(
        image.reference,
        ["python", "train.py"],
        detach=True,
        working_dir=image.workdir,
        environment={"CHECKPOINT_DIR": "/ckpt", "HPARAMS": json.dumps({"alpha": 0.05})},
        volumes={str(out): {"bind": "/ckpt", "mode": "rw"}},
    )
    try:
        assert _wait_exit(trainer) == 0, trainer.logs().decode()[-3000:]
    finally:
        trainer.remove(force=True)
    model = out / "final"
    write_manifest(model)  # the server serves only a checkpoint with a manifest
    for path in [model, *model.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)

    port = _free_port()
    container = engine.containers.run(
        image.reference,
        ["python", "/opt/gpuferry/runtime/serve.py"],  # as every backend starts it (blocks/base/serving.py)
        detach=True,
        environment={"MODEL_URI": "file:///model", "HOST": "0.0.0.0", "WARMUP_ITERATIONS": "1"},
        volumes={str(model): {"bind": "/model", "mode": "ro"}},
        ports={"8080/tcp": ("127.0.0.1", port)},
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        ready = None
        while time.monotonic() < deadline:
            container.reload()
            assert container.status in ("created", "running"), container.logs().decode()[-3000:]
            try:
                ready = httpx.get(f"{base}/readyz", timeout=5)
                if ready.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        assert ready is not None and ready.status_code == 200, container.logs().decode()[-3000:]
        example = json.loads((model / "serving_input_example.json").read_text())
        answer = httpx.post(f"{base}/invocations", json=example, timeout=30)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["predictions"]) == len(example["dataframe_split"]["data"])
    finally:
        container.remove(force=True)


def test_the_dockerfile_init_writes_builds_on_the_stacks_base(stack: dict[str, str], tmp_path: Path) -> None:
    """`gpuferry init`'s Dockerfile, its BASE_IMAGE set as a stack sets it: the build installs train.py's
    packages and the model server's, and passes the server's check."""
    from deployments import skeleton

    skeleton.write(tmp_path / "skeleton")
    workload = load_workload(str(tmp_path / "skeleton"))
    assert workload.definition.image is not None and workload.definition.image.dockerfile == "Dockerfile"
    image = builder(stack, "gpuferry-test/skeleton", build_args={"BASE_IMAGE": stack["BASE_IMAGE"]}).build(workload)
    assert image.reference and "@sha256:" in image.reference and image.workdir == "/workload"


def test_the_digits_image_from_its_own_dockerfile(stack: dict[str, str]) -> None:
    """The digits example's own Dockerfile builds on the stack's base, gpuferry's check included."""
    image = builder(stack, "gpuferry-test/digits", build_args={"BASE_IMAGE": stack["BASE_IMAGE"]}).build(
        load_workload(str(DIGITS))
    )
    assert image.reference and image.workdir == "/workload"
