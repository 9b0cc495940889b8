"""An MLflow client that talks to a tracking server with credentials of its own.

MLflow's REST stores read the server's credentials (``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``,
``MLFLOW_TRACKING_TOKEN``) from the process's environment on every request, and ``MlflowClient`` takes no
credentials. Putting a block's credentials in ``os.environ`` would hand them to every program this process
starts and mix up two blocks with different accounts, so ``client_with_credentials`` gives the client REST
stores whose ``get_host_creds`` is the block's own (MLflow's usual settings from the environment — TLS, client
certificate — and the block's account instead of the environment's).

The stores also turn the server's refusals (HTTP 401, 403) into a ``ConfigurationError`` that says which block
fields to fix: MLflow raises them as a plain ``MlflowException`` and never retries them, and neither do the
tasks (``tasks/retry.py``), so a wrong password fails at the first request.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.store.model_registry.rest_store import RestStore as RegistryRestStore
from mlflow.store.tracking.rest_store import RestStore as TrackingRestStore
from mlflow.tracking._model_registry.client import ModelRegistryClient
from mlflow.tracking._tracking_service.client import TrackingServiceClient
from mlflow.utils.rest_utils import MlflowHostCreds

from blocks.errors import ConfigurationError
from blocks.tracking.uris import is_server

# (uri) -> the credentials of a request to the server at uri
HostCreds = Callable[[str], MlflowHostCreds]
# (HTTP status, uri, MLflow's message) -> what to tell the user
Refusal = Callable[[int, str, str], str]


class _Refusals:
    """Mixed into a REST store: a 401 or 403 from the server becomes a ``ConfigurationError``."""

    uri: str
    refusal: Refusal

    def _call_endpoint(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._call_endpoint(*args, **kwargs)  # type: ignore[misc]
        except MlflowException as exc:
            status = exc.get_http_status_code()
            if status in (401, 403):
                raise ConfigurationError(self.refusal(status, self.uri, exc.message)) from exc
            raise


class _TrackingStore(_Refusals, TrackingRestStore):  # type: ignore[misc]  # MLflow's RestStore mixes two gateway mixins whose signatures differ
    def __init__(self, uri: str, creds: HostCreds, refusal: Refusal) -> None:
        super().__init__(partial(creds, uri))
        self.uri, self.refusal = uri, refusal


class _RegistryStore(_Refusals, RegistryRestStore):
    def __init__(self, uri: str, creds: HostCreds, refusal: Refusal) -> None:
        super().__init__(partial(creds, uri))
        self.uri, self.refusal = uri, refusal


class _TrackingClient(TrackingServiceClient):
    def __init__(self, uri: str, store: TrackingRestStore) -> None:
        self._store = store
        super().__init__(uri)

    @property
    def store(self) -> TrackingRestStore:
        return self._store


class _RegistryClient(ModelRegistryClient):
    def __init__(self, registry_uri: str, tracking_uri: str, store: RegistryRestStore) -> None:
        self._store = store
        super().__init__(registry_uri, tracking_uri)

    @property
    def store(self) -> RegistryRestStore:
        return self._store


def client_with_credentials(tracking_uri: str, registry_uri: str, creds: HostCreds, refusal: Refusal) -> MlflowClient:
    """``MlflowClient(tracking_uri, registry_uri)`` whose requests to a server (http(s)) carry ``creds(uri)``.

    A local store (sqlite:, file:) is left as MLflow makes it. The client's tracking and registry clients are
    replaced (MLflow 3 builds them in ``MlflowClient.__init__`` and ``_get_registry_client``): the tests against
    a server that requires a login (tests/test_mlflow_auth.py) fail if a later MLflow builds them otherwise.
    """
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri)
    if is_server(tracking_uri):
        client._tracking_client = _TrackingClient(tracking_uri, _TrackingStore(tracking_uri, creds, refusal))
    if is_server(registry_uri):
        store = _RegistryStore(registry_uri, creds, refusal)
        client._registry_client_lazy = _RegistryClient(registry_uri, tracking_uri, store)  # type: ignore[attr-defined]
    return client
