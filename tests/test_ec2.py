"""GPU instances on EC2, against moto's server (its own process on a free loopback port).

Acquire reconciles by the run tag (a second acquire launches nothing; a bigger one only the missing
instances), release terminates, and a retrain flow whose training step fails after the instances
were acquired still terminates every instance of its run.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from botocore.exceptions import ClientError
from prefect.filesystems import LocalFileSystem
from prefect_aws import AwsClientParameters, AwsCredentials

from blocks.aws.ec2 import RUN_TAG, Ec2Provider, _explain
from blocks.aws.instance_types import GPU_INSTANCE_TYPES
from blocks.base.provider import STATE_ACQUIRED, STATE_READY, NodeRequirements
from blocks.errors import ConfigurationError, TransientError
from blocks.local.compute import LocalProcesses
from blocks.local.images import CurrentEnvironment
from blocks.local.serving import LocalServing
from blocks.local.storage import LocalCheckpointStore
from blocks.records import JobHandle, TrainingJob
from blocks.specs import TrainingSpec
from blocks.stack import Stack
from blocks.tracking.mlflow import MlflowTracking
from tasks.provision import inventory_rows
from tasks.retry import is_transient
from tests.examples import DIABETES

pytestmark = pytest.mark.integration

AMI = "ami-0123456789abcdef0"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's server on a free loopback port, for this module only."""
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    moto = Path(sys.executable).parent / "moto_server"
    with log.open("w") as out:
        proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{endpoint}/moto-api/", timeout=2)
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not answer on {endpoint}: {log.read_text()[-2000:]}")
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def credentials(moto_endpoint: str) -> AwsCredentials:
    return AwsCredentials(
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
        aws_client_parameters=AwsClientParameters(endpoint_url=moto_endpoint),
    )


def provider(credentials: AwsCredentials, **settings: object) -> Ec2Provider:
    options: dict[str, object] = {"instance_type": "g5.12xlarge", "ami_id": AMI, "poll_interval_start": 0.2}
    options.update(settings)
    return Ec2Provider(credentials=credentials, **options)


def instances_of(block: Ec2Provider, key: str) -> dict[str, str]:
    """instance id -> state of every instance tagged with the run, whatever its state."""
    pages = block.client().describe_instances(Filters=[{"Name": f"tag:{RUN_TAG}", "Values": [key]}])
    return {i["InstanceId"]: i["State"]["Name"] for r in pages["Reservations"] for i in r["Instances"]}


def test_unknown_instance_type_is_refused_listing_the_gpu_types(credentials: AwsCredentials) -> None:
    with pytest.raises(ValueError, match=r"instance_type='m5.large' is not a GPU instance type .* g4dn.xlarge, .*p5"):
        provider(credentials, instance_type="m5.large")
    with pytest.raises(ValueError, match=r"ami_id='ubuntu' is not an AMI id"):
        provider(credentials, ami_id="ubuntu")
    with pytest.raises(ValueError, match=r"tags: \['gpuferry:run'\] are set by the provider"):
        provider(credentials, tags={RUN_TAG: "x"})
    families = {"g4dn.xlarge", "g5.xlarge", "g6.xlarge", "p3.2xlarge", "p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge"}
    assert families <= set(GPU_INSTANCE_TYPES)


def test_acquire_twice_creates_no_extra_instance_and_release_terminates(credentials: AwsCredentials) -> None:
    block = provider(credentials, tags={"team": "ml"})
    key = f"run-{uuid.uuid4().hex[:8]}"
    first = block.acquire(2, NodeRequirements(gpus=4), key)
    assert len(first) == 2 and all(n.state == STATE_ACQUIRED for n in first)
    assert first[0].labels["run"] == key and first[0].labels["instance_type"] == "g5.12xlarge"
    assert first[0].labels["private_ip"]
    assert [(g.name, g.memory_mib) for g in first[0].gpus] == [("NVIDIA A10G", 23028)] * 4

    again = block.acquire(2, NodeRequirements(gpus=4), key)
    assert sorted(n.name for n in again) == sorted(n.name for n in first)
    assert sorted(instances_of(block, key)) == sorted(n.name for n in first)  # nothing new was launched

    more = block.acquire(3, NodeRequirements(gpus=4), key)  # only the missing one is launched
    assert len(more) == 3 and {n.name for n in first} < {n.name for n in more}
    assert len(instances_of(block, key)) == 3
    tags = block.client().describe_tags(Filters=[{"Name": "resource-id", "Values": [more[0].name]}])["Tags"]
    assert {t["Key"]: t["Value"] for t in tags} == {RUN_TAG: key, "Name": f"gpuferry-{key}", "team": "ml"}

    checked = block.check(more, NodeRequirements(gpus=4, min_gpu_memory_mib=20000))
    assert [n.state for n in checked] == [STATE_READY] * 3
    assert inventory_rows(checked)[0]["gpus"].startswith("0: NVIDIA A10G (23028 MiB)")

    block.release(more[:1])  # one node of the run: every live instance of that run goes
    assert set(instances_of(block, key).values()) <= {"shutting-down", "terminated"}
    block.release(more)  # twice: harmless
    assert set(instances_of(block, key).values()) <= {"shutting-down", "terminated"}

    # After the release, acquiring for the same run starts afresh (terminated instances are not reused).
    fresh = block.acquire(1, NodeRequirements(), key)
    assert fresh[0].name not in {n.name for n in more}
    block.release(fresh)


def test_job_shape_and_bad_settings_leave_no_instance(credentials: AwsCredentials) -> None:
    block = provider(credentials, instance_type="g5.xlarge")
    key = f"run-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ConfigurationError, match=r"resources.gpus_per_node=4 but instance_type=g5.xlarge has 1 GPU"):
        block.acquire(1, NodeRequirements(gpus=4), key)
    with pytest.raises(ConfigurationError, match=r"40000 MiB per GPU required"):
        block.acquire(1, NodeRequirements(gpus=1, min_gpu_memory_mib=40000), key)
    with pytest.raises(ConfigurationError, match=r"min_driver_version=550: EC2 does not report the NVIDIA driver"):
        block.acquire(1, NodeRequirements(gpus=1, min_driver_version="550"), key)
    assert instances_of(block, key) == {}

    # A subnet that does not exist: EC2's error, explained, naming the field.
    with pytest.raises(ConfigurationError, match=r"InvalidSubnetID.NotFound.*Fix: subnet_id"):
        provider(credentials, subnet_id="subnet-00000000").acquire(1, NodeRequirements(), key)
    assert set(instances_of(block, key).values()) <= {"shutting-down", "terminated"}


def test_ec2_errors_are_classified_for_the_task_retries() -> None:
    def error(code: str, status: int) -> ClientError:
        return ClientError(
            {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "RunInstances"
        )

    assert is_transient(_explain(error("RequestLimitExceeded", 503), "launch"))  # throttling: botocore's own, transient
    assert is_transient(_explain(error("InternalError", 500), "launch"))
    assert is_transient(_explain(error("Unavailable", 503), "launch"))  # any 5xx
    capacity = _explain(error("InsufficientInstanceCapacity", 500), "launch 1 p5.48xlarge instance(s)")
    assert isinstance(capacity, TransientError) and "another subnet" in str(capacity)
    config_errors = [
        ("InvalidAMIID.NotFound", "ami_id"),
        ("VcpuLimitExceeded", "quota"),
        ("UnauthorizedOperation", "ec2:RunInstances"),
    ]
    for code, field in config_errors:
        explained = _explain(error(code, 400), "launch")
        assert isinstance(explained, ConfigurationError) and field in str(explained) and not is_transient(explained)


class FailingTraining(LocalProcesses):
    """Local processes whose submit fails: a training step that breaks after the nodes were acquired."""

    _block_type_name = "gpuferry Test Failing Training"

    def submit(self, job: TrainingJob) -> JobHandle:
        raise ConfigurationError("the training job was rejected (test)")


@pytest.mark.usefixtures("prefect_server")
def test_failure_after_acquire_still_terminates_the_runs_instances(
    credentials: AwsCredentials, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import flows.retrain as retrain_module

    prefix = f"flowtest-{uuid.uuid4().hex[:8]}"
    block = provider(credentials, instance_type="g4dn.xlarge", name_prefix=prefix)
    stack = Stack.model_construct(
        provider=block,
        images=CurrentEnvironment(),
        compute=FailingTraining(),
        storage=LocalCheckpointStore(filesystem=LocalFileSystem(basepath=str(tmp_path / "storage"))),
        tracking=MlflowTracking(),
        serving=LocalServing(),
    )
    monkeypatch.setattr(retrain_module, "load_stack", lambda name: stack)

    with pytest.raises(ConfigurationError, match="the training job was rejected"):
        retrain_module.retrain(workload=str(DIABETES), training=TrainingSpec(model_name="ec2-release-test"))

    pages = block.client().describe_instances(Filters=[{"Name": "tag:Name", "Values": [f"{prefix}-*"]}])
    instances = [i for r in pages["Reservations"] for i in r["Instances"]]
    assert len(instances) == 1  # the run acquired its node ...
    tags = {t["Key"]: t["Value"] for t in instances[0]["Tags"]}
    assert tags[RUN_TAG] and tags["Name"] == f"{prefix}-{tags[RUN_TAG]}"
    assert instances[0]["State"]["Name"] in ("shutting-down", "terminated")  # ... and released it


CLOUD_INIT_CONSOLE = """[   12.3] cloud-init[1021]: Cloud-init v. 23.4 running 'modules:config'
ec2:
ec2: #############################################################
ec2: -----BEGIN SSH HOST KEY FINGERPRINTS-----
ec2: 256 SHA256:Xb7Xj6rIbQ0v3hX6Xn0bUqv1F5m0xY8R2d9q8oVdLk4 root@ip-10-0-1-17 (ECDSA)
ec2: -----END SSH HOST KEY FINGERPRINTS-----
ec2: #############################################################
-----BEGIN SSH HOST KEY KEYS-----
ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBOb4 root@ip-10-0-1-17
ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHn6 root@ip-10-0-1-17
-----END SSH HOST KEY KEYS-----
[   13.0] cloud-init[1021]: Cloud-init v. 23.4 finished
"""


def test_host_keys_are_read_from_cloud_init_console_output() -> None:
    from blocks.aws.access import console_host_keys

    assert console_host_keys(CLOUD_INIT_CONSOLE) == [
        ("ecdsa-sha2-nistp256", "AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBOb4"),
        ("ssh-ed25519", "AAAAC3NzaC1lZDI1NTE5AAAAIHn6"),
    ]
    assert console_host_keys("Linux version 6.1 ... no keys printed yet") == []


def test_bootstrap_goes_over_ssh_to_the_instances_private_addresses(
    credentials: AwsCredentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    """moto's instances cannot be reached over SSH: SshHosts' bootstrap/release are recorded, not run."""
    from blocks.aws.access import Ec2SshAccess
    from blocks.hosts.provider import SshHosts
    from blocks.hosts.slurm_join import SlurmJoin

    calls: list[tuple[str, list[tuple[str, str, int, str]], list[str], dict[str, str]]] = []

    def record(action: str):
        def method(self: SshHosts, nodes: list, *args: object) -> object:
            states = {n.name: s for n, s in ((n, instances_of(block, key).get(n.name)) for n in nodes)}
            calls.append(
                (action, [(h.name, h.address, h.port, h.user) for h in self.hosts], [n.name for n in nodes], states)
            )
            assert self.slurm == join and self.credentials.known_hosts == known_hosts
            return (
                [
                    n.model_copy(update={"state": STATE_READY, "labels": {**n.labels, "bootstrap": "changed"}})
                    for n in nodes
                ]
                if action == "bootstrap"
                else None
            )

        return method

    monkeypatch.setattr(SshHosts, "bootstrap", record("bootstrap"))
    monkeypatch.setattr(SshHosts, "release", record("release"))
    join = SlurmJoin(slurm_conf="SlurmctldHost=ctl(10.0.0.2)\nMaxNodeCount=20\n", features=["joined"])
    known_hosts = "10.0.0.9 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHn6\n"
    ssh = Ec2SshAccess(
        user="ec2-user", private_key="-----BEGIN OPENSSH PRIVATE KEY-----\n...", known_hosts=known_hosts, slurm=join
    )
    block = provider(credentials, ssh=ssh)
    key = f"run-{uuid.uuid4().hex[:8]}"
    nodes = block.acquire(2, NodeRequirements(gpus=4), key)
    pages = block.client().describe_instances(InstanceIds=[n.name for n in nodes])
    private = {i["InstanceId"]: i["PrivateIpAddress"] for r in pages["Reservations"] for i in r["Instances"]}

    ready = block.bootstrap(nodes, NodeRequirements(gpus=4))
    assert [n.state for n in ready] == [STATE_READY] * 2 and ready[0].labels["bootstrap"] == "changed"
    expected_hosts = [(n.name, private[n.name], 22, "ec2-user") for n in nodes]
    assert calls == [("bootstrap", expected_hosts, [n.name for n in nodes], {n.name: "running" for n in nodes})]

    block.release(ready)  # the Slurm nodes leave while their instances still run; then they are terminated
    assert calls[1] == ("release", expected_hosts, [n.name for n in nodes], {n.name: "running" for n in nodes})
    assert set(instances_of(block, key).values()) <= {"shutting-down", "terminated"}
    block.release(ready)  # twice: nothing is running any more, so nothing leaves Slurm again
    assert len(calls) == 2

    # Without known_hosts the keys come from the console output; moto's has none: a clear error, not a guess.
    console = provider(credentials, ssh=ssh.model_copy(update={"known_hosts": None, "host_key_timeout_seconds": 0.5}))
    fresh = console.acquire(1, NodeRequirements(), key)
    try:
        with pytest.raises(
            TransientError,
            match=rf"no SSH host keys in the console output of {fresh[0].name} .*"
            r"set ssh.known_hosts",
        ):
            console.bootstrap(fresh, NodeRequirements())
        assert len(calls) == 2  # nothing was tried over SSH
    finally:
        console.release(fresh)


def test_the_check_reads_credentials_instance_type_and_ami_and_names_what_is_missing(
    credentials: AwsCredentials,
) -> None:
    """``gpuferry check`` on EC2: whose credentials, whether the region offers the type, whether the AMI exists;
    read-only (nothing is launched), each failure naming the field to fix."""
    from blocks.checks import Probe

    ec2 = provider(credentials).client()
    instance = ec2.run_instances(ImageId=AMI, MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    ami = ec2.create_image(InstanceId=instance, Name="gpuferry-check-ami")["ImageId"]
    ec2.terminate_instances(InstanceIds=[instance])

    def rows(block: Ec2Provider) -> dict[str, tuple[str, str, str]]:
        probe = Probe("provider", "Ec2Provider", timeout=60)
        block.self_check(probe)
        return {r.check: (r.status, r.detail, r.fix) for r in probe.rows}

    good = rows(provider(credentials, ami_id=ami))
    assert {k: v[0] for k, v in good.items()} == {"credentials": "ok", "instance type": "ok", "AMI": "ok"}, good
    assert "account 123456789012" in good["credentials"][1] and "region us-east-1" in good["credentials"][1]
    assert good["instance type"][1] == "g5.12xlarge offered in us-east-1 (4x NVIDIA A10G)"
    assert good["AMI"][1] == f"{ami} (gpuferry-check-ami)"
    launched = {i["InstanceId"] for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]}

    bad = rows(provider(credentials, subnet_id="subnet-00000000", key_name="nobody"))
    assert bad["AMI"][0] == "failed" and AMI in bad["AMI"][1] and "set ami_id" in bad["AMI"][2]
    assert bad["subnet"][0] == "failed" and "subnet-00000000" in bad["subnet"][1] and "subnet_id" in bad["subnet"][2]
    assert bad["key pair"][0] == "failed" and "nobody" in bad["key pair"][1]

    elsewhere = AwsCredentials(
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="af-south-1",  # moto's offerings there have no g5
        aws_client_parameters=credentials.aws_client_parameters,
    )
    offered = rows(provider(elsewhere, ami_id=ami))["instance type"]
    assert offered[:2] == ("failed", "af-south-1 does not offer g5.12xlarge") and "region_name" in offered[2]
    after = {i["InstanceId"] for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]}
    assert after == launched  # the checks launched nothing
