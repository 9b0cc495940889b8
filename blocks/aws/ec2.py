"""GPU nodes from AWS EC2: created for a run, found again by their tag, terminated at the end.

``Ec2Provider`` is a ``NodeProvider`` over prefect-aws ``AwsCredentials`` (its client parameters
carry the endpoint URL, so any EC2-compatible API, moto's server included, works).

* ``acquire(count, requirements, key)`` reconciles: it lists the instances tagged ``gpuferry:run=<key>``
  that are pending or running, launches only the missing ones (tagged with the key and a Name) and
  waits, up to ``ready_timeout_seconds``, until all are running. Re-running it creates nothing more.
  The instance type is checked against the job's GPU needs before anything is launched. If acquire
  fails after launching, it terminates every instance of the key before raising: nothing acquired
  by a failed acquire is left running (a retry launches fresh ones).
* ``release(nodes)`` terminates the nodes' instances and any other live instance carrying their run
  key; releasing twice is harmless.
* ``inspect(nodes)`` reads the instances' state and IP addresses from EC2 and their GPUs from the
  instance type table below (model, count, memory). The driver and CUDA version are those of the
  AMI, which EC2 does not report.
* ``bootstrap(nodes, requirements)`` with ``ssh`` set hands the instances to ``SshHosts``
  (blocks/hosts/provider.py) at their private addresses, node name = instance id: nvidia-smi preflight,
  the NVIDIA container runtime and, with ``ssh.slurm``, joining the Slurm cluster. The instances'
  SSH host keys come from ``ssh.known_hosts`` or else from their console output, where cloud-init
  prints them (read through the EC2 API, so a key is trusted only from the instance itself).
  Without ``ssh`` it only checks the instance type table. ``release`` takes the nodes out of the
  Slurm cluster (when ``ssh.slurm`` is set) before it terminates them; a failure there is logged
  and the instances are terminated all the same.

Errors: throttling and 5xx answers are left as botocore raised them (``tasks/retry.py`` classifies
them as transient); no capacity becomes a ``TransientError``; a bad AMI, subnet, security group,
quota or permission becomes a ``ConfigurationError`` naming the field and the fix.
"""

from __future__ import annotations

import uuid
from typing import Any

from botocore.exceptions import ClientError
from prefect_aws import AwsCredentials
from pydantic import Field, field_validator

from blocks.aws.access import HOST_KEYS_BEGIN, HOST_KEYS_END, Ec2SshAccess, console_host_keys
from blocks.aws.instance_types import GPU_INSTANCE_TYPES
from blocks.base.backoff import Poll
from blocks.base.log import run_logger
from blocks.base.provider import STATE_ACQUIRED, STATE_FAILED, STATE_READY, NodeProvider, NodeRequirements
from blocks.checks import CheckRow, Probe
from blocks.errors import ConfigurationError, TransientError
from blocks.hosts.provider import SshHost, SshHosts
from blocks.records import GpuInfo, Node
from blocks.ssh.credentials import SshCredentials

RUN_TAG = "gpuferry:run"
LIVE_STATES = ["pending", "running"]

_CONFIG_ERRORS = {
    "InvalidAMIID": "ami_id: the AMI does not exist in this region or is not shared with the account",
    "InvalidSubnetID": "subnet_id: the subnet does not exist in this region",
    "InvalidSubnet": "subnet_id: the subnet is not usable here",
    "InvalidGroup": "security_group_ids: a security group does not exist (in this subnet's VPC)",
    "InvalidKeyPair": "key_name: the key pair does not exist in this region",
    "InvalidParameterValue": "a parameter was rejected: check instance_type, ami_id, subnet_id",
    "InvalidParameterCombination": "the parameters do not fit together (e.g. this AMI's architecture and the type)",
    "Unsupported": "instance_type is not offered in this region/availability zone: choose another subnet or type",
    "VcpuLimitExceeded": "the account's vCPU quota for this instance family is used up: ask AWS for more",
    "InstanceLimitExceeded": "the account's instance quota is used up: ask AWS for more",
    "UnauthorizedOperation": "the credentials may not do this: grant ec2:RunInstances/DescribeInstances/"
    "TerminateInstances/CreateTags",
    "AuthFailure": "the credentials were refused: fix credentials",
    "OptInRequired": "the account is not subscribed to this AMI/region: opt in first",
}
_CAPACITY_ERRORS = {"InsufficientInstanceCapacity", "InsufficientHostCapacity", "InsufficientCapacity"}


def _explain(exc: ClientError, action: str) -> Exception:
    """A ClientError as ours when we know what it means; else unchanged (retry.py classifies it)."""
    code = exc.response.get("Error", {}).get("Code", "")
    message = exc.response.get("Error", {}).get("Message", "")
    if code in _CAPACITY_ERRORS:
        return TransientError(
            f"EC2 has no capacity to {action} now ({code}: {message}); a later attempt may get "
            "it, or use another subnet (availability zone) or instance_type"
        )
    for prefix, fix in _CONFIG_ERRORS.items():
        if code == prefix or code.startswith(prefix + "."):
            return ConfigurationError(f"EC2 refused to {action} ({code}: {message}). Fix: {fix}")
    return exc


class Ec2Provider(NodeProvider):
    """GPU instances on AWS EC2, one set per run (found again by tag), terminated at release."""

    _block_type_name = "gpuferry EC2 Provider"
    _description = (
        "Launches GPU instances on AWS EC2 for a run (tagged with the run, so re-running launches only the "
        "missing ones) and terminates them at the end."
    )

    credentials: AwsCredentials = Field(
        description="AWS credentials and region (prefect-aws); client parameters may set an endpoint URL."
    )
    instance_type: str = Field(description=f"GPU instance type, one of: {', '.join(GPU_INSTANCE_TYPES)}.")
    ami_id: str = Field(description="AMI to boot (a GPU AMI with the NVIDIA driver, e.g. a Deep Learning AMI).")
    subnet_id: str | None = Field(None, description="Subnet to launch in (None: the default VPC's choice).")
    security_group_ids: list[str] = Field(default_factory=list, description="Security groups (empty: the default).")
    key_name: str | None = Field(None, description="EC2 key pair for SSH to the instances (None: none).")
    name_prefix: str = Field("gpuferry", min_length=1, max_length=64, description="Start of the instances' Name tag.")
    tags: dict[str, str] = Field(default_factory=dict, description="Extra tags for every instance (cost allocation).")
    ready_timeout_seconds: float = Field(
        900.0, gt=0, description="How long acquire waits for the instances to be running."
    )
    poll_interval_start: float = Field(1.0, gt=0, description="First wait between two state polls, in seconds.")
    poll_interval_max: float = Field(15.0, gt=0, description="Longest wait between two state polls, in seconds.")
    ssh: Ec2SshAccess | None = Field(
        None,
        description="Bootstrap the instances over SSH at their private addresses (SshHosts: GPU preflight, "
        "NVIDIA container runtime, Slurm join); None: only the instance type table is checked.",
    )

    @field_validator("instance_type")
    @classmethod
    def _known_gpu_type(cls, value: str) -> str:
        if value not in GPU_INSTANCE_TYPES:
            raise ValueError(
                f"instance_type={value!r} is not a GPU instance type this provider knows; choose one of: "
                f"{', '.join(GPU_INSTANCE_TYPES)}"
            )
        return value

    @field_validator("ami_id")
    @classmethod
    def _ami(cls, value: str) -> str:
        if not value.startswith("ami-"):
            raise ValueError(f"ami_id={value!r} is not an AMI id (ami-...)")
        return value

    @field_validator("tags")
    @classmethod
    def _own_tags(cls, value: dict[str, str]) -> dict[str, str]:
        reserved = sorted(k for k in value if k in (RUN_TAG, "Name") or k.startswith("aws:"))
        if reserved:
            raise ValueError(f"tags: {reserved} are set by the provider (or by AWS); remove them")
        return value

    # ---- NodeProvider --------------------------------------------------------------------

    def acquire(self, count: int, requirements: NodeRequirements, key: str) -> list[Node]:
        """``count`` running instances for run ``key``; the live ones tagged with it are reused."""
        self._check_shape(count, requirements)
        try:
            live = self._instances(key)
            missing = count - len(live)
            if missing > 0:
                self._launch(missing, key)
            elif missing < 0:
                run_logger("gpuferry.ec2").warning(
                    "run %s already has %d instances (%d asked for): using the first %d", key, len(live), count, count
                )
            instances = self._wait_running(key, count)
        except BaseException:
            self._terminate_run(key)  # nothing a failed acquire launched stays running
            raise
        return [self._node(i, STATE_ACQUIRED) for i in instances[:count]]

    def inspect(self, nodes: list[Node]) -> list[Node]:
        """The nodes' state and addresses from EC2; GPUs from the instance type table (driver/CUDA: unknown)."""
        if not nodes:
            return []
        described = self._describe([{"Name": "instance-id", "Values": [n.name for n in nodes]}])
        by_id = {i["InstanceId"]: i for i in described}
        out = []
        for node in nodes:
            instance = by_id.get(node.name)
            if instance is None or instance["State"]["Name"] != "running":
                state = instance["State"]["Name"] if instance else "gone"
                labels = {**node.labels, "error": f"{node.name}: instance is {state}"}
                out.append(node.model_copy(update={"state": STATE_FAILED, "labels": labels}))
            else:
                out.append(self._node(instance, STATE_READY))
        return out

    def bootstrap(self, nodes: list[Node], requirements: NodeRequirements) -> list[Node]:
        """With ``ssh``: ``SshHosts.bootstrap`` on the instances' private addresses; else the table check."""
        if self.ssh is None:
            return super().bootstrap(nodes, requirements)
        self.check(nodes, requirements)  # still running, and the type fits
        return self.ssh_hosts(nodes).bootstrap(nodes, requirements)

    def ssh_hosts(self, nodes: list[Node]) -> SshHosts:
        """An ``SshHosts`` block over the nodes' private addresses (node name = instance id)."""
        if self.ssh is None:
            raise ConfigurationError("ssh is not set: the provider has no SSH access to its instances")
        without = [n.name for n in nodes if not n.labels.get("private_ip")]
        if without:
            nodes = self.inspect(nodes)  # the addresses, read again
            without = [n.name for n in nodes if not n.labels.get("private_ip")]
        if without:
            raise TransientError(f"instances {', '.join(without)} have no private IP address (yet)")
        ssh = self.ssh
        hosts = [SshHost(address=n.labels["private_ip"], port=ssh.port, user=ssh.user, name=n.name) for n in nodes]
        known_hosts = (
            ssh.known_hosts
            if ssh.known_hosts is not None
            else self._console_known_hosts(hosts, ssh.host_key_timeout_seconds)
        )
        return SshHosts(
            hosts=hosts,
            connect_attempts=ssh.connect_attempts,
            slurm=ssh.slurm,
            credentials=SshCredentials(
                private_key=ssh.private_key, private_key_passphrase=ssh.private_key_passphrase, known_hosts=known_hosts
            ),
        )

    def _console_known_hosts(self, hosts: list[SshHost], timeout: float) -> str:
        """known_hosts lines from the host keys cloud-init printed to each instance's console."""
        poll = Poll(self.poll_interval_start, self.poll_interval_max, factor=2, timeout=timeout)
        lines: dict[str, list[str]] = {}
        while True:
            for host in hosts:
                if host.node_name in lines:
                    continue
                try:
                    response = self.client().get_console_output(InstanceId=host.node_name, Latest=True)
                except ClientError as exc:
                    raise _explain(exc, f"read the console output of {host.node_name}") from exc
                keys = console_host_keys(response.get("Output") or "")
                if keys:
                    lines[host.node_name] = [f"{host.known_hosts_name} {kind} {key}" for kind, key in keys]
            missing = [h.node_name for h in hosts if h.node_name not in lines]
            if not missing:
                return "".join(line + "\n" for host in hosts for line in lines[host.node_name])
            if poll.expired():
                raise TransientError(
                    f"no SSH host keys in the console output of {', '.join(missing)} after {timeout:.0f} s "
                    f"(cloud-init prints them between "
                    f"{HOST_KEYS_BEGIN} and {HOST_KEYS_END}). Fix: use an AMI with cloud-init, or set "
                    "ssh.known_hosts to the instances' keys"
                )
            poll.wait()

    def check(self, nodes: list[Node], requirements: NodeRequirements) -> list[Node]:
        inspected = super().check(nodes, requirements)
        gone = [n.labels["error"] for n in inspected if n.state != STATE_READY]
        if gone:
            raise TransientError("instances are no longer running: " + "; ".join(gone))
        return inspected

    def release(self, nodes: list[Node]) -> None:
        """Take the nodes out of Slurm (``ssh.slurm``), then terminate the nodes' instances and any live
        instance of their runs; idempotent."""
        if self.ssh is not None and self.ssh.slurm is not None:
            self._leave_slurm(nodes)
        ids = {n.name for n in nodes if n.name.startswith("i-")}
        for run in {n.labels["run"] for n in nodes if n.labels.get("run")}:
            ids |= {i["InstanceId"] for i in self._instances(run)}
        self._terminate(sorted(ids))

    def _leave_slurm(self, nodes: list[Node]) -> None:
        """SshHosts.release on the nodes still running; a failure is logged, never stops the termination."""
        try:
            running = [n for n in self.inspect(nodes) if n.state == STATE_READY]
            if running:
                self.ssh_hosts(running).release(running)
        except Exception as exc:  # noqa: BLE001 - terminating the instances matters more
            run_logger("gpuferry.ec2").error(
                "could not take %s out of the Slurm cluster before terminating them (%s); remove what is left "
                "with `scontrol delete nodename=<instance id>` on the cluster",
                ", ".join(n.name for n in nodes),
                exc,
            )

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """The credentials, the instance type in the region, the AMI and the network the block names (``check.py``);
        nothing is launched."""
        from blocks.aws.check import check_ec2

        check_ec2(self, probe)
        return probe.rows

    # ---- EC2 -----------------------------------------------------------------------------

    def client(self) -> Any:
        """The EC2 client (cached by prefect-aws per credentials)."""
        return self.credentials.get_client("ec2")

    def gpus(self, instance_type: str | None = None) -> list[GpuInfo]:
        """The GPUs of an instance type (default: ``instance_type``) from the table; none for an unknown type."""
        count, model, memory = GPU_INSTANCE_TYPES.get(instance_type or self.instance_type, (0, "", 0))
        return [GpuInfo(index=i, name=model, memory_mib=memory, driver_version="unknown") for i in range(count)]

    def _check_shape(self, count: int, requirements: NodeRequirements) -> None:
        if count < 1:
            raise ConfigurationError(f"resources.nodes={count}: at least one node is needed")
        gpus, model, memory = GPU_INSTANCE_TYPES[self.instance_type]
        if requirements.gpus > gpus:
            raise ConfigurationError(
                f"resources.gpus_per_node={requirements.gpus} but instance_type={self.instance_type} has {gpus} GPU(s) "
                f"({model}); choose a larger instance_type, e.g. one of: "
                f"{', '.join(t for t, v in GPU_INSTANCE_TYPES.items() if v[0] >= requirements.gpus)}"
            )
        if requirements.min_driver_version:
            raise ConfigurationError(
                f"min_driver_version={requirements.min_driver_version}: EC2 does not report the NVIDIA driver of an "
                "instance (it is the AMI's); pick an AMI with that driver, drop min_driver_version, and check the "
                "driver with SshHosts over the instances' private addresses"
            )
        if requirements.min_gpu_memory_mib > memory:
            raise ConfigurationError(
                f"{requirements.min_gpu_memory_mib} MiB per GPU required but instance_type={self.instance_type} has "
                f"{model} with {memory} MiB; choose another instance_type"
            )

    def _describe(self, filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
        instances = []
        try:
            for page in self.client().get_paginator("describe_instances").paginate(Filters=filters):
                for reservation in page["Reservations"]:
                    instances.extend(reservation["Instances"])
        except ClientError as exc:
            raise _explain(exc, "list instances") from exc
        return sorted(instances, key=lambda i: (i.get("LaunchTime") or 0, i["InstanceId"]))

    def _instances(self, key: str) -> list[dict[str, Any]]:
        """Live (pending or running) instances of run ``key``, oldest first."""
        return self._describe(
            [
                {"Name": f"tag:{RUN_TAG}", "Values": [key]},
                {"Name": "instance-state-name", "Values": LIVE_STATES},
            ]
        )

    def _launch(self, count: int, key: str) -> None:
        tags = {**self.tags, RUN_TAG: key, "Name": f"{self.name_prefix}-{key}"[:255]}
        params: dict[str, Any] = {
            "ImageId": self.ami_id,
            "InstanceType": self.instance_type,
            "MinCount": count,
            "MaxCount": count,
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]},
                {"ResourceType": "volume", "Tags": [{"Key": RUN_TAG, "Value": key}]},
            ],
            # botocore resends this same request when an answer is lost: EC2 launches nothing new for it.
            "ClientToken": f"gpuferry-{uuid.uuid4().hex}",
        }
        if self.subnet_id:
            params["SubnetId"] = self.subnet_id
        if self.security_group_ids:
            params["SecurityGroupIds"] = self.security_group_ids
        if self.key_name:
            params["KeyName"] = self.key_name
        try:
            response = self.client().run_instances(**params)
        except ClientError as exc:
            raise _explain(exc, f"launch {count} {self.instance_type} instance(s)") from exc
        ids = [i["InstanceId"] for i in response["Instances"]]
        run_logger("gpuferry.ec2").info(
            "run %s: launched %d %s instance(s): %s", key, len(ids), self.instance_type, ", ".join(ids)
        )

    def _wait_running(self, key: str, count: int) -> list[dict[str, Any]]:
        """Poll (fast at first, then backing off) until ``count`` instances of the run are running."""
        poll = Poll(self.poll_interval_start, self.poll_interval_max, factor=2, timeout=self.ready_timeout_seconds)
        while True:
            instances = self._describe([{"Name": f"tag:{RUN_TAG}", "Values": [key]}])
            dead = [
                i
                for i in instances
                if i["State"]["Name"] in ("shutting-down", "terminated")
                and i.get("StateReason", {}).get("Code") not in (None, "Client.UserInitiatedShutdown")
            ]
            running = [i for i in instances if i["State"]["Name"] == "running"]
            pending = [i for i in instances if i["State"]["Name"] == "pending"]
            if len(running) >= count:
                return running
            if not pending and dead:
                reasons = "; ".join(f"{i['InstanceId']}: {i['StateReason'].get('Message', '')}" for i in dead)
                raise TransientError(f"instances of run {key} stopped while starting ({reasons})")
            if poll.expired():
                waiting = ", ".join(i["InstanceId"] for i in pending) or "none"
                raise TransientError(
                    f"run {key}: {len(running)} of {count} {self.instance_type} instance(s) running after "
                    f"{self.ready_timeout_seconds:.0f} s (pending: {waiting}); "
                    "raise ready_timeout_seconds, or look at the instances' console output"
                )
            poll.wait()

    def _terminate(self, ids: list[str]) -> None:
        if not ids:
            return
        try:
            self.client().terminate_instances(InstanceIds=ids)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "InvalidInstanceID.NotFound":
                raise _explain(exc, "terminate instances") from exc
            # Some are gone already (long terminated): terminate the others one by one.
            for instance_id in ids:
                try:
                    self.client().terminate_instances(InstanceIds=[instance_id])
                except ClientError as one:
                    if one.response.get("Error", {}).get("Code") != "InvalidInstanceID.NotFound":
                        raise _explain(one, "terminate instances") from one
        run_logger("gpuferry.ec2").info("terminated %s", ", ".join(ids))

    def _terminate_run(self, key: str) -> None:
        try:
            self._terminate([i["InstanceId"] for i in self._instances(key)])
        except Exception as exc:  # noqa: BLE001 - the original error is the one to raise
            run_logger("gpuferry.ec2").error(
                "could not terminate the instances of run %s after a failed acquire: %s", key, exc
            )

    def _node(self, instance: dict[str, Any], state: str) -> Node:
        tags = {t["Key"]: t["Value"] for t in instance.get("Tags", [])}
        labels = {
            "run": tags.get(RUN_TAG, ""),
            "instance_type": instance["InstanceType"],
            "private_ip": instance.get("PrivateIpAddress", ""),
            "public_ip": instance.get("PublicIpAddress", ""),
            "availability_zone": instance.get("Placement", {}).get("AvailabilityZone", ""),
            "ami": instance.get("ImageId", ""),
            "ec2_state": instance["State"]["Name"],
        }
        return Node(
            name=instance["InstanceId"],
            provider=self.get_block_type_slug(),
            state=state,
            gpus=self.gpus(instance["InstanceType"]),
            labels={k: v for k, v in labels.items() if v},
        )
