"""The registry stack's podman socket offered as a remote Docker Engine is: over TCP with mutual TLS, and over SSH.

* ``tls_engine``: a CA, a server certificate for 127.0.0.1 and a client certificate, made with ``openssl`` as for
  ``dockerd --tlsverify``; ``socat`` serves the socket on a free loopback port with that certificate and asks every
  client for a certificate of that CA (``verify=1``).
* ``ssh_engine``: an sshd of its own on a free loopback port, its own host key, one authorized client key, and
  ``ForceCommand socat - UNIX-CONNECT:<socket>``, which stands in for the ``docker system dial-stdio`` that a
  Docker client runs on the remote host.

Both log the connections they accept, so a test can tell that the backend's requests went through them. The
engine is this machine's: host paths (the job directories) are the same on both sides.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from blocks.base.proc import free_port
from tests.processes import stop_process_group


@dataclass(frozen=True)
class TlsEngine:
    url: str  # tcp://127.0.0.1:PORT
    ca_cert: str  # PEM texts
    client_cert: str
    client_key: str
    other_ca_cert: str  # a CA that did not sign the engine's certificate
    log: Path  # socat's: one "accepting connection" line per connection

    def connections(self) -> int:
        return self.log.read_text().count("accepting connection")


@dataclass(frozen=True)
class SshEngine:
    url: str  # ssh://root@127.0.0.1:PORT
    private_key: str
    known_hosts: str  # the line ssh-keyscan writes for 127.0.0.1:PORT
    other_known_hosts: str  # the same name with another host key
    log: Path  # sshd's

    def logins(self) -> int:
        return self.log.read_text().count("Accepted publickey")


def _need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None and not Path(t).exists()]
    if missing:
        message = f"{missing} missing: apt-get install socat openssl openssh-server openssh-client"
        if os.environ.get("GPUFERRY_REQUIRE_STACKS") == "1":
            pytest.fail(message)
        pytest.skip(message)


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=120)


def _wait_listening(port: int, proc: subprocess.Popen, log: Path, banner: bytes | None = None) -> None:
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                if banner is None or sock.recv(64).startswith(banner):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing answered on 127.0.0.1:{port} within 60 s: {log.read_text()[-2000:]}")
        time.sleep(0.1)


def _ca(root: Path, name: str) -> tuple[Path, Path]:
    key, cert = root / f"{name}.key", root / f"{name}.pem"
    _run(
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(cert),
        "-days",
        "2",
        "-subj",
        f"/CN=gpuferry test {name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    return key, cert


def _signed(root: Path, name: str, ca: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    key, csr, cert, ext = (root / f"{name}{suffix}" for suffix in (".key", ".csr", ".pem", ".ext"))
    _run(
        "openssl",
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(csr),
        "-subj",
        f"/CN={name}",
    )
    ext.write_text(
        f"basicConstraints=CA:FALSE\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n{extensions}\n"
    )
    _run(
        "openssl",
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca[1]),
        "-CAkey",
        str(ca[0]),
        "-CAcreateserial",
        "-out",
        str(cert),
        "-days",
        "2",
        "-extfile",
        str(ext),
    )
    return key, cert


@contextmanager
def tls_engine(socket_path: str, root: Path) -> Iterator[TlsEngine]:
    """``socket_path`` served on a free loopback port with mutual TLS, as ``dockerd --tlsverify`` serves."""
    _need("openssl", "socat")
    root.mkdir(parents=True, exist_ok=True)
    ca = _ca(root, "ca")
    _other_key, other_ca = _ca(root, "other-ca")
    server_key, server_cert = _signed(root, "server", ca, "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth")
    client_key, client_cert = _signed(root, "client", ca, "extendedKeyUsage=clientAuth")
    port, log = free_port(), root / "socat.log"
    listen = (
        f"OPENSSL-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork,cert={server_cert},key={server_key},"
        f"cafile={ca[1]},verify=1"
    )
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["socat", "-d", "-d", listen, f"UNIX-CONNECT:{socket_path}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_listening(port, proc, log)
        yield TlsEngine(
            url=f"tcp://127.0.0.1:{port}",
            ca_cert=ca[1].read_text(),
            client_cert=client_cert.read_text(),
            client_key=client_key.read_text(),
            other_ca_cert=other_ca.read_text(),
            log=log,
        )
    finally:
        stop_process_group(proc)


@contextmanager
def ssh_engine(socket_path: str, root: Path) -> Iterator[SshEngine]:
    """``socket_path`` reached over a real sshd of the test's own on a free loopback port: each session runs
    ``socat - UNIX-CONNECT:<socket>`` whatever the client asked to run."""
    _need("/usr/sbin/sshd", "ssh-keygen", "socat")
    root.mkdir(parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation directory
    for name in ("host_key", "other_host_key", "client_key"):
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"gpuferry-test-{name}", "-f", str(root / name))
    shutil.copy(root / "client_key.pub", root / "authorized_keys")
    port, log, config = free_port(), root / "sshd.log", root / "sshd_config"
    config.write_text(
        f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {root / 'host_key'}\nPidFile {root / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {root / 'authorized_keys'}\nPermitRootLogin prohibit-password\nPubkeyAuthentication yes\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nLogLevel INFO\n"
        f"ForceCommand socat - UNIX-CONNECT:{shlex.quote(socket_path)}\n"
    )
    proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-f", str(config), "-E", str(log)], start_new_session=True)
    log.touch()
    try:
        _wait_listening(port, proc, log, banner=b"SSH-2.0")

        def line(pub: Path) -> str:
            key_type, key = pub.read_text().split()[:2]
            return f"[127.0.0.1]:{port} {key_type} {key}\n"

        yield SshEngine(
            url=f"ssh://root@127.0.0.1:{port}",
            private_key=(root / "client_key").read_text(),
            known_hosts=line(root / "host_key.pub"),
            other_known_hosts=line(root / "other_host_key.pub"),
            log=log,
        )
    finally:
        stop_process_group(proc)
