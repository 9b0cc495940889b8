"""``make demo``: the whole pipeline on the embedded stack for one workload, then a request to its endpoint.

python -m flows.demo WORKLOAD        # train, store, register and serve WORKLOAD (a directory with gpuferry.yaml)
python -m flows.demo stop WORKLOAD   # stop the server it left running
"""

from __future__ import annotations

import json
import os
import sys

# The embedded Prefect server starts with the run; on a busy 2-core machine that can take a while.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import httpx

from blocks.home import gpuferry_home
from blocks.stack import load_stack
from blocks.workload.source import load_workload
from flows.retrain import retrain

USAGE = "usage: python -m flows.demo [stop] WORKLOAD"


def main(workload: str) -> int:
    outcome = retrain(workload=workload)
    v = outcome.model_version
    lines = [
        "",
        "gpuferry demo: done",
        f"  workload:     {workload}",
        f"  MLflow run:   {outcome.run_url}",
        f"  model:        {v.name} v{v.version} ({v.metric}={v.value:.4f}, "
        f"{'promoted to champion' if v.promoted else 'not promoted'})",
        f"  checkpoint:   {outcome.checkpoint.uri}",
        f"                sha256 {outcome.checkpoint.sha256}",
    ]
    service = load_workload(workload).definition.service_name
    stack = load_stack(None)
    serving = stack.serving.current(service)
    if serving is not None:
        from tasks.upload import model_serving_example

        example = model_serving_example.fn(stack.storage, serving["model_uri"])
        response = httpx.post(f"{serving['url']}/invocations", json=example, timeout=60)
        response.raise_for_status()
        answer = json.dumps(response.json()["predictions"])
        lines += [
            f"  endpoint:     {serving['url']}/invocations (serving v{serving['version']}"
            f"{'' if outcome.deployed else ', the champion: this run did not beat it'})",
            f"                the model's own input example → {answer[:100]}{'…' if len(answer) > 100 else ''}",
            f"                try: curl -s {serving['url']}/metrics | head",
            f"  stop it:      make demo-stop DEMO_WORKLOAD={workload}",
        ]
    else:
        lines.append("  endpoint:     none is serving (the new version did not beat the champion: force_deploy=true)")
    lines.append(f"  state:        {gpuferry_home()}")
    print("\n".join(lines))
    return 0


def stop(workload: str) -> int:
    service = load_workload(workload).definition.service_name
    stopped = load_stack(None).serving.undeploy(service)
    print(f"stopped the demo's inference server ({service})" if stopped else f"no {service} server was running")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["stop"] and len(args) == 2:
        sys.exit(stop(args[1]))
    if len(args) == 1 and args[0] != "stop":
        sys.exit(main(args[0]))
    sys.exit(USAGE)
