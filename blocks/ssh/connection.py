"""SSH pieces shared by the blocks that reach machines over paramiko (Slurm login node, your own hosts)."""

from __future__ import annotations

import base64
import hashlib
import io
import select
import socket
import time

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


class RefuseUnknownHost(paramiko.MissingHostKeyPolicy):
    """Never trust a host key that is not in known_hosts; say how to check and add it."""

    def __init__(self, check_against: str) -> None:
        self.check_against = check_against

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise ConfigurationError(
            f"the SSH host key of {hostname} is not in known_hosts (it offered {key.get_name()} {fingerprint(key)}); "
            "refusing to connect. Fix: run `ssh-keyscan -p PORT HOST`, check that the fingerprint "
            f"(`ssh-keygen -lf -` on its output) {self.check_against}, and put the line into the block's known_hosts"
        )


def connect_verified(
    *,
    address: str,
    port: int,
    user: str,
    key: paramiko.PKey,
    known: paramiko.HostKeys,
    timeout: float,
    name: str,
    check_against: str,
) -> paramiko.SSHClient:
    """An SSH client connected to ``address`` with a host key from ``known`` only, keepalives on and
    Nagle's algorithm off: each command is a short request and answer, which Nagle would hold back
    for the peer's delayed ACK (~40 ms per channel opened).

    ``name`` is how errors call the host; ``check_against`` says where its real fingerprint is found.
    A changed or unknown host key and a refused login are ``ConfigurationError``; anything else that
    goes wrong on the way (refused connection, timeout, reset) is left to the caller as the
    ``OSError`` / ``EOFError`` / ``paramiko.SSHException`` it is, after the client is closed; a port that
    sends no SSH banner in time is a ``TimeoutError`` saying so.
    """
    client = paramiko.SSHClient()
    host_keys = client.get_host_keys()
    for host_name in known:
        for key_type, host_key in known.lookup(host_name).items():
            host_keys.add(host_name, key_type, host_key)
    client.set_missing_host_key_policy(RefuseUnknownHost(check_against))
    try:
        client.connect(
            address,
            port=port,
            username=user,
            pkey=key,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
            look_for_keys=False,
            allow_agent=False,
        )
    except paramiko.BadHostKeyException as exc:
        client.close()
        raise ConfigurationError(
            f"the SSH host key of {name} CHANGED: known_hosts has {exc.expected_key.get_name()} "
            f"{fingerprint(exc.expected_key)}, the host offered {exc.key.get_name()} {fingerprint(exc.key)}; "
            f"refusing to connect. This is a reinstalled host or someone in between: confirm the new fingerprint "
            f"({check_against}), then replace its line in known_hosts"
        ) from exc
    except paramiko.AuthenticationException as exc:
        client.close()
        raise ConfigurationError(
            f"{name}: SSH login as {user}@{address}:{port} was refused ({exc}): check user and private_key, "
            "and that the public key is in the user's authorized_keys"
        ) from exc
    except paramiko.SSHException as exc:
        transport = client.get_transport()
        client.close()
        if transport is None or not getattr(transport, "remote_version", ""):
            # No banner came: paramiko then says "Error reading SSH protocol banner" or, when its deadline
            # and the handshake's race, "No existing session". Both mean the port said nothing in time.
            raise TimeoutError(
                f"{name}: no SSH answer within {timeout:.0f} s (the port accepts connections but sends no SSH "
                f"banner: is sshd listening on {port}, or is the host overloaded?) [{exc}]"
            ) from exc
        raise
    except BaseException:
        client.close()
        raise
    transport = client.get_transport()
    if transport is not None:
        transport.set_keepalive(30)
        if transport.sock.family in (socket.AF_INET, socket.AF_INET6):
            transport.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client


def parse_known_hosts(text: str) -> paramiko.HostKeys:
    """The keys of a known_hosts text (comments and blank lines skipped); a clear error for a bad line."""
    keys = paramiko.HostKeys()
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                entry = paramiko.hostkeys.HostKeyEntry.from_line(line, number)
            except (paramiko.SSHException, ValueError) as exc:
                raise ConfigurationError(f"known_hosts line {number} is not a known_hosts entry: {exc}") from exc
            if entry is None:
                raise ConfigurationError(f"known_hosts line {number} is not a known_hosts entry: {line[:80]!r}")
            for name in entry.hostnames:
                keys.add(name, entry.key.get_name(), entry.key)
    return keys


def exec_command(
    client: paramiko.SSHClient, command: str, *, timeout: float, open_timeout: float, stdin: bytes | None = None
) -> tuple[int, str, str]:
    """Run ``command`` (one shell string, its words already quoted) on one new channel of ``client``:
    (exit status, stdout, stderr). ``stdin`` is fed to it, then closed. A dead connection, a channel closed
    before the exit status and ``timeout`` passing raise ``OSError`` / ``EOFError`` / ``paramiko.SSHException``
    (``socket.timeout`` is an ``OSError``), for the caller to reconnect or give up."""
    return exec_commands(client, [command], timeout=timeout, open_timeout=open_timeout, stdin=stdin)[0]


def exec_commands(
    client: paramiko.SSHClient, commands: list[str], *, timeout: float, open_timeout: float, stdin: bytes | None = None
) -> list[tuple[int, str, str]]:
    """Several commands at once, one channel each (all started before any is read: a login shell can be slow
    to start), each as ``exec_command`` runs one; ``stdin`` is fed to every one."""
    transport = client.get_transport()
    if transport is None or not transport.is_active():
        raise EOFError("no SSH transport (the connection is closed)")
    channels: list[paramiko.Channel] = []
    try:
        for command in commands:
            chan = transport.open_session(timeout=open_timeout)
            channels.append(chan)
            chan.settimeout(timeout)
            chan.exec_command(command)
            if stdin:
                chan.sendall(stdin)
            shutdown_write(chan)
        deadline = time.monotonic() + timeout
        return [_collect(chan, timeout, deadline) for chan in channels]
    finally:
        for chan in channels:
            chan.close()


def shutdown_write(chan: paramiko.Channel) -> None:
    """``chan.shutdown_write()`` (the EOF that ends the command's stdin), sent while the channel's lock is held.

    paramiko builds the EOF under the channel's lock but sends it after releasing it. When the command has ended
    by then, paramiko's transport thread can answer the server's CLOSE in between, and the EOF reaches the server
    after the CLOSE, for a channel it has freed: OpenSSH's sshd then drops the whole connection ("ieof packet
    referred to nonexistent channel"), failing every other command on it. With the lock held, the transport
    thread's answer to the CLOSE waits for the EOF.

    It must not wait *with* the lock for a key exchange to end (paramiko's ``_send_user_message`` would): the
    transport thread, which runs the exchange, may first need the lock for a message of this channel that came
    before it, and both would wait until paramiko's 30 s timeout. So it takes the lock and the transport's
    send gate together only when no exchange is on, and sends the EOF under both, as ``_send_user_message``
    does under the gate. (paramiko's own method where its internals differ.)"""
    transport = chan.transport
    build = getattr(chan, "_send_eof", None)
    ready, gate, send = (
        getattr(transport, name, None) for name in ("clear_to_send", "clear_to_send_lock", "_send_message")
    )
    if build is None or ready is None or gate is None or send is None:
        chan.shutdown_write()
        return
    deadline = time.monotonic() + float(getattr(transport, "clear_to_send_timeout", 30.0))
    while True:
        with chan.lock, gate:
            if ready.is_set():
                message = build()
                if message is not None:
                    send(message)
                return
        if not transport.is_active():
            return  # as paramiko does: the EOF goes with the connection
        if time.monotonic() > deadline:
            raise paramiko.SSHException("Key-exchange timed out waiting for key negotiation")
        ready.wait(0.1)


def _collect(chan: paramiko.Channel, timeout: float, deadline: float) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a started channel, read until its end or ``deadline``."""
    out, err = bytearray(), bytearray()
    while True:
        progressed = False
        while chan.recv_ready():
            out += chan.recv(1 << 16)
            progressed = True
        while chan.recv_stderr_ready():
            err += chan.recv_stderr(1 << 16)
            progressed = True
        # Done at EOF *and* exit status: sshd may send the status while output is still queued.
        if chan.eof_received and chan.exit_status_ready() and not progressed:
            break
        if chan.closed and not progressed and not chan.exit_status_ready():
            raise EOFError("the SSH channel closed before the command's exit status arrived")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no exit status within {timeout:.0f} s")
        if not progressed:
            select.select([chan], [], [], 0.05)
    # Drain what arrived together with the exit status.
    while chan.recv_ready():
        out += chan.recv(1 << 16)
    while chan.recv_stderr_ready():
        err += chan.recv_stderr(1 << 16)
    return chan.recv_exit_status(), out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
