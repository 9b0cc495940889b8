"""The slurm stack is a remote cluster: its nodes and its login node have a network of their own (scripts/slurm.sh).

A job reaches this machine's services only where a cluster reaches a site's services: the s3, mlflow and
registry stacks, relayed into the cluster's network on the same addresses. Anything else on this machine's
loopback (here the Prefect server the worker talks to) does not exist for it, and the login node is not on
this machine's loopback either.
"""

from __future__ import annotations

import ipaddress
import json
import uuid
from urllib.parse import urlsplit

import pytest

from tests.stacks import remote_slurm, remove_on_cluster, stack_env

pytestmark = pytest.mark.integration

# Connects to each (name, port) on 127.0.0.1 and prints what happened, as JSON.
PROBE = (
    "import json, socket, sys\n"
    "seen = {}\n"
    "for name, port in json.loads(sys.argv[1]).items():\n"
    "    try:\n"
    "        socket.create_connection(('127.0.0.1', port), timeout=5).close(); seen[name] = 'connected'\n"
    "    except OSError as e:\n"
    "        seen[name] = type(e).__name__\n"
    "print('PROBE ' + json.dumps(seen), flush=True)\n"
)


def _port(url: str) -> int:
    return urlsplit(url).port or 80


def test_the_cluster_reaches_the_relayed_services_and_nothing_else_of_this_machine() -> None:
    ports = {
        "s3": _port(stack_env("s3")["S3_ENDPOINT_URL"]),
        "mlflow": _port(stack_env("mlflow")["MLFLOW_TRACKING_URI"]),
        "prefect": _port(stack_env("prefect")["PREFECT_API_URL"]),
    }
    login = stack_env("slurm")["SLURM_SSH_HOST"]
    assert not ipaddress.ip_address(login).is_loopback, "the login node must not be on this machine's loopback"

    cluster = remote_slurm("topology", poll_interval_start=0.3, poll_interval_max=2.0)
    key = f"t{uuid.uuid4().hex[:10]}-topology"
    try:
        # On the login node (every SSH command) ...
        on_login = cluster.run([cluster.python, "-c", PROBE, json.dumps(ports)])[1]
        # ... and in a job on a compute node.
        handle = cluster.submit_command(key, [cluster.python, "-c", PROBE, json.dumps(ports)])
        status = cluster.watch(handle, timeout_seconds=300)
        assert status.state == "COMPLETED", status
        in_job = cluster.read_log(handle)[0]
    finally:
        remove_on_cluster(cluster, cluster.workdir_root)
        cluster.close()
    for where, text in (("login node", on_login), ("job", in_job)):
        seen = json.loads(text.split("PROBE ", 1)[1].splitlines()[0])
        assert seen["s3"] == "connected" and seen["mlflow"] == "connected", (where, seen)
        assert seen["prefect"] == "ConnectionRefusedError", (where, seen)
