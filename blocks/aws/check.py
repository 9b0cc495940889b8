"""The checks of EC2 (``Ec2Provider.self_check``): the credentials are accepted (whose they are), the region offers
the instance type, and the AMI, subnet, security groups and key pair the block names exist there.

Read-only calls, made with the probe's deadline as their timeout and no retries of their own: a check says at
once what does not answer instead of retrying it for minutes as a pipeline step would. Nothing is launched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from blocks.checks import CheckFailed, Probe

if TYPE_CHECKING:
    from blocks.aws.ec2 import Ec2Provider


def _client(provider: Ec2Provider, service: str, timeout: float) -> Any:
    """A client of the provider's credentials (their region and client parameters: an endpoint URL) that gives
    up after ``timeout`` seconds, without retries."""
    from botocore.config import Config

    credentials = provider.credentials
    params = credentials.aws_client_parameters.get_params_override()
    base = params.pop("config", None) or Config()
    params["config"] = base.merge(
        Config(connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": 1, "mode": "standard"})
    )
    return credentials.get_boto3_session().client(service, **params)


def _code(exc: BaseException) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", "")) or type(exc).__name__


def check_ec2(provider: Ec2Provider, probe: Probe) -> None:
    with probe.local():  # botocore's client factory reads its data files: work on this machine, not an answer
        sts = _client(provider, "sts", probe.left)
        ec2 = _client(provider, "ec2", probe.left)
    region = ec2.meta.region_name

    def identity() -> str:
        try:
            found = sts.get_caller_identity()
        except Exception as exc:  # noqa: BLE001 - botocore's errors, named by their code
            raise CheckFailed(
                f"{_code(exc)}: {exc}",
                "fix credentials (aws_access_key_id, aws_secret_access_key, profile_name) or their endpoint",
            ) from None
        return f"{found.get('Arn', '?')} (account {found.get('Account', '?')}), region {region}"

    if not probe.step("credentials", identity):
        return

    def offered() -> str:
        answer = ec2.describe_instance_type_offerings(
            LocationType="region", Filters=[{"Name": "instance-type", "Values": [provider.instance_type]}]
        )
        if not answer.get("InstanceTypeOfferings"):
            raise CheckFailed(
                f"{region} does not offer {provider.instance_type}",
                "choose a region that offers it (credentials.region_name) or another instance_type",
            )
        gpus = provider.gpus()
        return f"{provider.instance_type} offered in {region}" + (f" ({len(gpus)}x {gpus[0].name})" if gpus else "")

    probe.step("instance type", offered)

    def exists(check: str, call: Any, ids_arg: str, ids: list[str], answer: str, id_field: str, fix: str) -> None:
        """The row ``check``: every id of ``ids`` is in ``call(**{ids_arg: ids})[answer]`` (EC2 answers an unknown
        id with an error, or, for some calls, with fewer items)."""

        def found() -> str:
            try:
                items = call(**{ids_arg: ids}).get(answer, [])
            except Exception as exc:  # noqa: BLE001 - botocore's errors, named by their code
                raise CheckFailed(f"{', '.join(ids)}: {_code(exc)} in {region}", fix) from None
            missing = sorted(set(ids) - {item.get(id_field) for item in items})
            if missing:
                raise CheckFailed(f"{', '.join(missing)}: not found in {region}", fix)
            return ", ".join(
                f"{item.get(id_field)} ({item.get('Name') or item.get('GroupName') or 'ok'})" for item in items
            )

        probe.step(check, found)

    exists(
        "AMI",
        ec2.describe_images,
        "ImageIds",
        [provider.ami_id],
        "Images",
        "ImageId",
        "set ami_id to an AMI of this region (a GPU AMI with the NVIDIA driver)",
    )
    if provider.subnet_id:
        exists(
            "subnet",
            ec2.describe_subnets,
            "SubnetIds",
            [provider.subnet_id],
            "Subnets",
            "SubnetId",
            "set subnet_id to a subnet of this region",
        )
    if provider.security_group_ids:
        exists(
            "security groups",
            ec2.describe_security_groups,
            "GroupIds",
            list(provider.security_group_ids),
            "SecurityGroups",
            "GroupId",
            "set security_group_ids to groups of this region's VPC",
        )
    if provider.key_name:
        exists(
            "key pair",
            ec2.describe_key_pairs,
            "KeyNames",
            [provider.key_name],
            "KeyPairs",
            "KeyName",
            "set key_name to a key pair of this region",
        )
