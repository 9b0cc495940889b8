"""How ``Ec2Provider`` reaches its instances over SSH: the login, and the host keys cloud-init prints to an
instance's console (read through EC2's API, so a host key is trusted without a first connection)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from blocks.hosts.slurm_join import SlurmJoin

HOST_KEYS_BEGIN = "-----BEGIN SSH HOST KEY KEYS-----"
HOST_KEYS_END = "-----END SSH HOST KEY KEYS-----"


def console_host_keys(console_output: str) -> list[tuple[str, str]]:
    """(key type, base64 key) of the SSH host keys cloud-init printed to an instance's console."""
    if HOST_KEYS_BEGIN not in console_output:
        return []
    block = console_output.rsplit(HOST_KEYS_BEGIN, 1)[1].split(HOST_KEYS_END, 1)[0]
    keys = []
    for line in block.splitlines():
        parts = line.split()
        if len(parts) >= 2 and (parts[0].startswith("ssh-") or parts[0].startswith("ecdsa-")):
            keys.append((parts[0], parts[1]))
    return keys


class Ec2SshAccess(BaseModel):
    """How ``Ec2Provider`` reaches its instances over SSH (at their private addresses) to bootstrap them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    user: str = Field("ubuntu", min_length=1, description="SSH user of the AMI (root, or a user allowed sudo -n).")
    port: int = Field(22, ge=1, le=65535, description="SSH port.")
    private_key: SecretStr = Field(description="Private key of the instances' key pair (OpenSSH or PEM text).")
    private_key_passphrase: SecretStr | None = Field(None, description="Passphrase of the private key, if any.")
    known_hosts: str | None = Field(
        None,
        description="known_hosts lines of the instances; None: their host keys are read from their console "
        "output (cloud-init prints them).",
    )
    host_key_timeout_seconds: float = Field(
        600.0, gt=0, description="How long to wait for the host keys to appear in the console output."
    )
    connect_attempts: int = Field(
        6, ge=1, le=20, description="SSH connection attempts per instance (sshd may still be starting)."
    )
    slurm: SlurmJoin | None = Field(None, description="Join the instances to this Slurm cluster (see SshHosts).")
