"""How the Docker backends reach an engine that is not a local socket: ``tcp://`` with TLS, and ``ssh://``.

docker-py takes TLS certificates only as files (``docker.tls.TLSConfig``), and its ``ssh://`` adapter reads the key
from ~/.ssh/config or ~/.ssh/id_* and the host keys from ~/.ssh/known_hosts; prefect-docker's ``DockerHost`` passes
``client_kwargs`` through as plain values, which a stored block cannot hold a ``TLSConfig`` in. ``DockerTls`` and
the block's ``ssh`` (an ``SshCredentials``, the login the Slurm and SSH-host blocks take) carry the same settings
as fields of the block:

* ``DockerTls``: what ``docker --tlsverify --tlscacert --tlscert --tlskey`` takes. The PEM texts go to 0600 files in
  a 0700 directory of their own while the connection lives (the TLS library reads them from files) and are removed
  when it is closed. The engine's certificate is checked against ca_cert even where REQUESTS_CA_BUNDLE or
  CURL_CA_BUNDLE is set (which requests would otherwise put in its place). A refused handshake (a CA that did not
  sign the engine's certificate, an engine that wants a client certificate and got none or one it does not trust)
  is a ``ConfigurationError`` naming these fields.
* ``ssh``: the private key and known_hosts lines, as the other SSH blocks take them. The connection is
  paramiko's, as docker-py's own, but logs in with that key only and refuses a host key that is not in known_hosts
  (``blocks/ssh/connection.py``); each connection runs ``docker system dial-stdio`` on the host, as the docker CLI's
  ``ssh://`` does. A dropped connection is made again on the next request.
"""

from __future__ import annotations

import os
import shutil
import ssl
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import docker
import docker.constants
import docker.tls
import paramiko
import requests.exceptions
from docker.transport.sshconn import SSHHTTPAdapter
from prefect_docker.host import DockerHost
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from blocks.errors import ConfigurationError
from blocks.ssh.credentials import SshCredentials

TLS_SCHEMES = ("tcp", "https")


class DockerTls(BaseModel):
    """TLS for ``docker_host.base_url`` ``tcp://HOST:2376``, as ``dockerd --tlsverify`` serves it."""

    model_config = ConfigDict(extra="forbid")

    ca_cert: str | None = Field(
        None,
        description="PEM text of the CA that signed the engine's certificate (`ca.pem` of DOCKER_CERT_PATH, "
        "what dockerd --tlscacert names). The engine's certificate must be signed by it and name the host of "
        "base_url. None: the system's CAs.",
    )
    client_cert: str | None = Field(
        None,
        description="PEM text of this client's certificate (`cert.pem`), signed by the CA the engine trusts: "
        "an engine run with --tlsverify refuses a client without one. Set together with client_key.",
    )
    client_key: SecretStr | None = Field(
        None,
        description="PEM text of the client certificate's private key (`key.pem`); written to a 0600 file "
        "only while the connection lives.",
    )

    def check(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise ConfigurationError("tls: set client_cert and client_key together (the certificate and its key)")
        for name, text in (
            ("ca_cert", self.ca_cert),
            ("client_cert", self.client_cert),
            ("client_key", self.client_key.get_secret_value() if self.client_key else None),
        ):
            if text is not None and "-----BEGIN " not in text:
                raise ConfigurationError(f"tls.{name} is not PEM text (-----BEGIN ...): paste the file's content")


SSH_CONNECT_TIMEOUT_SECONDS = 30.0  # to connect and log in to the engine's host


def check_transport(base_url: str | None, tls: DockerTls | None, ssh: SshCredentials | None) -> None:
    """``tls`` and ``ssh`` fit ``base_url``'s scheme and their own fields; a ``ConfigurationError`` naming the field."""
    scheme = urlparse(base_url or "").scheme
    if tls is not None:
        if scheme not in TLS_SCHEMES:
            raise ConfigurationError(
                f"tls is set but docker_host.base_url is {base_url!r}: TLS needs base_url tcp://HOST:PORT"
            )
        tls.check()
    if ssh is not None:
        parsed = urlparse(base_url or "")
        if scheme != "ssh" or not parsed.hostname or not (parsed.username or ssh.user):
            raise ConfigurationError(
                f"ssh is set but docker_host.base_url is {base_url!r}: it must be ssh://USER@HOST[:PORT] "
                "(or ssh://HOST[:PORT] with ssh.user set)"
            )
        ssh.key()
        if not ssh.host_keys().keys():
            raise ConfigurationError("ssh.known_hosts has no host key: put the host's `ssh-keyscan` line into it")


def _tls_refused(exc: BaseException) -> bool:
    """An SSL error among the causes of ``exc`` (requests wraps it in errors of its own; under TLS 1.3 a refused client
    certificate shows only on the first answer, as the engine's alert or as the connection's end)."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        item = todo.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, (ssl.SSLError, requests.exceptions.SSLError)):
            return True
        todo += [item.__cause__, item.__context__, *item.args]
    return False


def tls_failure(where: str, what: str, exc: BaseException) -> str | None:
    """What to fix when ``exc`` (a request's failure) is a TLS handshake the engine or this client refused; None
    when it is not one."""
    if not _tls_refused(exc):
        return None
    text = str(exc)
    if "CERTIFICATE_VERIFY_FAILED" in text:
        fix = (
            "the engine's certificate is not one tls.ca_cert signed for the host of base_url: set tls.ca_cert to "
            "the CA the engine's certificate comes from (its --tlscacert signed it; `ca.pem`)"
        )
    else:
        fix = (
            "the engine refused this client's certificate (none, or one its CA did not sign): it runs with "
            "--tlsverify, so set tls.client_cert and tls.client_key to a certificate signed by the CA it trusts"
        )
    return f"the TLS handshake with the Docker engine at {where} failed ({what}): {fix} [{text}]"


class _TlsFiles:
    """The TLS settings as files in a 0700 directory of their own, removed by ``remove`` (or at exit)."""

    def __init__(self, tls: DockerTls) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="gpuferry-docker-tls-"))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        self.ca = self._write("ca.pem", tls.ca_cert)
        self.cert = self._write("cert.pem", tls.client_cert)
        self.key = self._write("key.pem", tls.client_key.get_secret_value() if tls.client_key else None)
        context = ssl.create_default_context()
        try:
            if self.ca:
                context.load_verify_locations(cafile=self.ca)
        except ssl.SSLError as exc:
            self.remove()
            raise ConfigurationError(f"tls.ca_cert is not a PEM certificate: {exc}") from exc
        try:
            if self.cert and self.key:
                context.load_cert_chain(self.cert, self.key)
        except ssl.SSLError as exc:
            self.remove()
            raise ConfigurationError(
                f"tls.client_cert and tls.client_key are not a PEM certificate and its own private key: {exc}"
            ) from exc

    def _write(self, name: str, text: str | None) -> str | None:
        if text is None:
            return None
        path = self.root / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return str(path)

    def config(self) -> docker.tls.TLSConfig:
        """What docker-py's ``--tlsverify`` takes: verify against ca_cert (else the system's CAs)."""
        return docker.tls.TLSConfig(
            client_cert=(self.cert, self.key) if self.cert and self.key else None,
            ca_cert=self.ca,
            verify=self.ca or True,
        )

    def remove(self) -> None:
        self._finalizer()


def _keep_own_ca(api: docker.APIClient) -> None:
    """Verify against the block's CA even where REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE is set: requests lets those
    replace a session's own CA file, and the engine's certificate would then be checked against the system's CAs."""
    merge = api.merge_environment_settings

    def merged(url: Any, proxies: Any, stream: Any, verify: Any, cert: Any) -> dict[str, Any]:
        settings = merge(url, proxies, stream, verify, cert)
        settings["verify"] = api.verify if verify is None or verify is True else verify
        return settings

    api.merge_environment_settings = merged


class _KeyedSshAdapter(SSHHTTPAdapter):
    """docker-py's ``ssh://`` adapter with the connection made by ``connect`` (the block's key and known_hosts)
    instead of ~/.ssh; a connection that dropped is made again on the next request."""

    def __init__(self, base_url: str, connect: Callable[[], paramiko.SSHClient], **kwargs: Any) -> None:
        self._connect_with = connect
        super().__init__(base_url, shell_out=False, **kwargs)

    def _create_paramiko_client(self, base_url: str) -> None:
        self.ssh_client = None

    def _connect(self) -> None:
        old, self.ssh_client = self.ssh_client, self._connect_with()
        if old is not None:
            old.close()

    def get_connection(self, url: Any, proxies: Any = None) -> Any:
        transport = self.ssh_client.get_transport() if self.ssh_client is not None else None
        if transport is None or not transport.is_active():
            with self.pools.lock:
                self.pools.clear()
                self._connect()
        return super().get_connection(url, proxies)


class Connection:
    """A docker-py client for ``host``, with ``tls`` or ``ssh`` when given; ``close`` removes what it wrote."""

    def __init__(self, host: DockerHost, tls: DockerTls | None, ssh: SshCredentials | None) -> None:
        check_transport(host.base_url, tls, ssh)
        self._tls_files: _TlsFiles | None = None
        if tls is not None:
            self._tls_files = _TlsFiles(tls)
            host = host.model_copy(update={"client_kwargs": {**host.client_kwargs, "tls": self._tls_files.config()}})
        if ssh is not None:  # made without connecting, then given the adapter that logs in with the block's key
            host = host.model_copy(update={"client_kwargs": {**host.client_kwargs, "use_ssh_client": True}})
        try:
            self.client = host.get_client()
            if tls is not None:
                _keep_own_ca(self.client.api)
            if ssh is not None:
                self._use_ssh(host, ssh)
        except BaseException:
            self.close()
            raise

    def _use_ssh(self, host: DockerHost, ssh: SshCredentials) -> None:
        url = urlparse(host.base_url or "")
        address, port, user = url.hostname or "", url.port or 22, url.username or ssh.user
        key, known = ssh.key(), ssh.host_keys()  # decrypted once, for every connection of the pool

        def connect() -> paramiko.SSHClient:
            return ssh.get_client(
                address,
                port,
                user=user,
                key=key,
                known=known,
                timeout=SSH_CONNECT_TIMEOUT_SECONDS,
                name=f"the Docker engine's host {address}:{port}",
                check_against="matches the host's own (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` there)",
            )

        api = self.client.api
        adapter = _KeyedSshAdapter(
            host.base_url or "",
            connect,
            timeout=api.timeout,
            pool_connections=docker.constants.DEFAULT_NUM_POOLS_SSH,
            max_pool_size=host.max_pool_size or docker.constants.DEFAULT_MAX_POOL_SIZE,
        )
        old, api._custom_adapter = api._custom_adapter, adapter
        api.mount("http+docker://ssh", adapter)
        old.close()

    def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        if self._tls_files is not None:
            self._tls_files.remove()
