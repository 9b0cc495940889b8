"""An image registry over its HTTP API (the Docker Registry v2 / OCI distribution API): does a tag exist, what is
its manifest's digest, and what a push error means (refused credentials, a missing permission, a passing fault).
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Any

import httpx

from blocks.errors import ConfigurationError, GpuferryError, TransientError
from blocks.values import registry_parts

if TYPE_CHECKING:
    pass


MANIFEST_TYPES = ", ".join(
    (
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
    )
)


_AUTH_WORDS = ("unauthorized", "authentication required", "denied", "forbidden", "incorrect username or password")


def registry_base_url(registry_url: str, *, plain_http: bool = False, field: str = "credentials.registry_url") -> str:
    """The registry's API root from its address as a block writes it: the scheme written (else https, or http with
    ``plain_http``), Docker Hub's API host for ``docker.io``."""
    scheme, host = registry_parts(registry_url, field)
    if host == "docker.io":
        host = "registry-1.docker.io"
    return f"{scheme or ('http' if plain_http else 'https')}://{host}"


class RegistryClient:
    """The few Docker Registry HTTP API v2 calls the builder needs, with Basic or Bearer-token auth."""

    def __init__(self, base_url: str, username: str, password: str, timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._basic = httpx.BasicAuth(username, password)
        self._username = username
        self._http = httpx.Client(timeout=timeout_s)
        self._tokens: dict[str, str] = {}

    def close(self) -> None:
        self._http.close()

    def _token(self, challenge: str, repository: str) -> str:
        params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        realm = params.pop("realm", None)
        if not realm:
            raise ConfigurationError(f"registry {self.base_url} sent an auth challenge without a realm: {challenge!r}")
        params.setdefault("scope", f"repository:{repository}:pull")
        key = f"{realm} {params}"
        if key not in self._tokens:
            response = self._send("GET", realm, auth=self._basic, params=params)
            self._check(response, "token")
            body = response.json()
            self._tokens[key] = body.get("token") or body.get("access_token") or ""
        return self._tokens[key]

    def _send(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, url, **kwargs)
        except (httpx.ConnectError, httpx.TimeoutException, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            raise TransientError(
                f"registry {self.base_url} is unreachable ({type(exc).__name__}: {exc}): is it running, and is "
                "credentials.registry_url right (http:// for a plain-HTTP registry)?"
            ) from exc

    def _refused(self, response: httpx.Response) -> ConfigurationError:
        verb = "refused the credentials of" if response.status_code == 401 else "denies access to"
        return ConfigurationError(
            f"registry {self.base_url} {verb} user {self._username!r} (HTTP {response.status_code}): "
            "fix credentials.username / credentials.password or the user's permissions on the repository"
        )

    def _check(self, response: httpx.Response, what: str) -> None:
        """Refused credentials or permission (401, 403) as a configuration error, else as ``_raise_for_status``."""
        if response.status_code in (401, 403):
            raise self._refused(response)
        self._raise_for_status(response, what)

    def _raise_for_status(self, response: httpx.Response, what: str) -> None:
        if response.status_code == 429 or response.status_code >= 500:
            raise TransientError(f"registry {self.base_url} answered HTTP {response.status_code} to {what}")
        if response.status_code >= 400:
            raise GpuferryError(
                f"registry {self.base_url} answered HTTP {response.status_code} to {what}: {response.text[:300]}"
            )

    def manifest_digest(self, repository: str, tag: str) -> str | None:
        """The digest the registry holds for ``repository:tag``, or None when the tag is not there."""
        url = f"{self.base_url}/v2/{repository}/manifests/{tag}"
        response = self._authorized("HEAD", url, repository, headers={"Accept": MANIFEST_TYPES})
        if response.status_code == 404:
            return None
        self._check(response, f"HEAD {repository}:{tag}")
        digest = response.headers.get("docker-content-digest")
        if digest:
            return digest
        return self.manifest(repository, tag)[0]  # registries need not send the header: the manifest's sha256

    def _authorized(self, method: str, url: str, repository: str, **kwargs: Any) -> httpx.Response:
        """``method url`` with Basic auth, again with a Bearer token when the registry asks for one."""
        response = self._send(method, url, auth=self._basic, **kwargs)
        challenge = response.headers.get("www-authenticate", "")
        if response.status_code == 401 and challenge.lower().startswith("bearer"):
            token = self._token(challenge[len("bearer") :].strip(), repository)
            headers = {**kwargs.pop("headers", {}), "Authorization": f"Bearer {token}"}
            response = self._send(method, url, headers=headers, **kwargs)
        return response

    def tags(self, repository: str) -> list[str]:
        """Every tag of ``repository`` (none when the registry does not know it), its pages read to the end."""
        url: str | None = f"{self.base_url}/v2/{repository}/tags/list?n=1000"
        found: list[str] = []
        while url:
            response = self._authorized("GET", url, repository)
            if response.status_code == 404:
                return found
            self._check(response, f"GET {repository} tags")
            found += response.json().get("tags") or []
            link = re.search(r"<([^>]+)>", response.headers.get("link", ""))
            url = None if link is None else (link[1] if "://" in link[1] else f"{self.base_url}{link[1]}")
        return found

    def manifest(self, repository: str, reference: str) -> tuple[str, dict[str, Any]]:
        """The digest and the parsed manifest (or index) of ``repository`` at a tag or digest."""
        url = f"{self.base_url}/v2/{repository}/manifests/{reference}"
        response = self._authorized("GET", url, repository, headers={"Accept": MANIFEST_TYPES})
        self._check(response, f"GET {repository}:{reference}")
        digest = (
            response.headers.get("docker-content-digest") or "sha256:" + hashlib.sha256(response.content).hexdigest()
        )
        return digest, response.json()

    def blob_json(self, repository: str, digest: str) -> dict[str, Any]:
        """A small JSON blob of ``repository`` (an image's configuration), following the registry's redirect."""
        response = self._authorized("GET", f"{self.base_url}/v2/{repository}/blobs/{digest}", repository)
        if response.is_redirect and response.headers.get("location"):
            response = self._send("GET", response.headers["location"])
        self._raise_for_status(response, f"GET {repository} blob {digest[:19]}")
        return dict(response.json())

    def delete_manifest(self, repository: str, digest: str) -> None:
        """Delete the manifest ``digest`` of ``repository`` and so every tag on it (the registry frees the layers
        no manifest uses when it collects its own garbage)."""
        url = f"{self.base_url}/v2/{repository}/manifests/{digest}"
        response = self._authorized("DELETE", url, repository)
        if response.status_code == 404:
            return
        if response.status_code == 405:
            raise ConfigurationError(
                f"registry {self.base_url} does not allow deleting images (HTTP 405): enable it (distribution's "
                "storage.delete.enabled: true; a hosted registry's retention policy otherwise)"
            )
        if response.status_code in (401, 403):
            raise ConfigurationError(
                f"registry {self.base_url} does not let {self._username!r} delete from {repository} "
                f"(HTTP {response.status_code}): grant the user delete on the repository"
            )
        self._raise_for_status(response, f"DELETE {repository}@{digest}")

    def check_login(self, repository: str = "library/gpuferry-check") -> str:
        """The registry answers its API and takes the credentials (``GET /v2/``)."""
        response = self._authorized("GET", f"{self.base_url}/v2/", repository)
        self._check(response, "GET /v2/")
        return f"{self.base_url} takes the login of {self._username!r}"

    def check_push(self, repository: str) -> str:
        """The credentials may push to ``repository``: a blob upload is started and cancelled, nothing stored."""
        response = self._authorized("POST", f"{self.base_url}/v2/{repository}/blobs/uploads/", repository)
        if response.status_code in (401, 403):
            raise ConfigurationError(
                f"registry {self.base_url} does not let {self._username!r} push to {repository} "
                f"(HTTP {response.status_code}): grant the user push on the repository, or fix repository"
            )
        self._raise_for_status(response, f"POST /v2/{repository}/blobs/uploads/")
        location = response.headers.get("location", "")
        if location:
            url = location if "://" in location else f"{self.base_url}{location}"
            self._authorized("DELETE", url, repository)
        return f"{self._username!r} may push to {repository} (an upload was started and cancelled)"


def _classify_push_error(message: str, image: str) -> GpuferryError:
    lowered = message.lower()
    if any(word in lowered for word in _AUTH_WORDS):
        return ConfigurationError(
            f"push of {image} refused: {message.strip()} — fix credentials.username / credentials.password "
            "or the user's push permission on the repository"
        )
    if "server gave http response to https client" in lowered:
        return ConfigurationError(
            f"push of {image} failed: {message.strip()} — the registry speaks plain HTTP: mark it insecure in the "
            "engine (podman: registries.conf `insecure = true`; Docker: daemon.json `insecure-registries`)"
        )
    return TransientError(f"push of {image} failed: {message.strip()}")
