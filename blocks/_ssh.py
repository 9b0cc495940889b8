"""SSH pieces shared by the blocks that reach machines over paramiko (Slurm login node, your own hosts)."""

from __future__ import annotations

import base64
import hashlib
import io

import paramiko

from blocks.errors import ConfigurationError


def fingerprint(key: paramiko.PKey) -> str:
    """The key's SHA256 fingerprint as ``ssh-keygen -lf`` prints it."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


def load_private_key(text: str, passphrase: str | None) -> paramiko.PKey:
    """An Ed25519, ECDSA or RSA private key from its OpenSSH/PEM text; a clear error naming the field otherwise."""
    errors = []
    for cls in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
        try:
            return cls.from_private_key(io.StringIO(text), password=passphrase)
        except paramiko.PasswordRequiredException as exc:
            raise ConfigurationError("private_key is encrypted: set private_key_passphrase") from exc
        except (paramiko.SSHException, ValueError) as exc:
            errors.append(f"{cls.__name__}: {exc}")
    raise ConfigurationError(f"private_key is not an OpenSSH/PEM private key ({'; '.join(errors)})")
