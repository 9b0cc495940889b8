"""The login of the test MLflow server (tests/test_mlflow_auth.py): MLflow's basic auth, and a bearer token as a
server behind a token login takes it (``Authorization: Bearer <GPUFERRY_TEST_MLFLOW_TOKEN>``, as the admin).

Named by ``authorization_function`` of the server's basic_auth.ini; it runs inside ``mlflow server``.
"""

from __future__ import annotations

import hmac
import os
from typing import Any


def authenticate() -> Any:
    from flask import make_response, request
    from mlflow.server.auth import authenticate_request_basic_auth
    from werkzeug.datastructures import Authorization

    header = request.headers.get("Authorization", "")
    if not header.startswith("Bearer "):
        return authenticate_request_basic_auth()
    if hmac.compare_digest(header.removeprefix("Bearer ").encode(), os.environ["GPUFERRY_TEST_MLFLOW_TOKEN"].encode()):
        return Authorization("bearer", {"username": os.environ["GPUFERRY_TEST_MLFLOW_TOKEN_USER"]})
    return make_response("the bearer token is not valid", 401)
