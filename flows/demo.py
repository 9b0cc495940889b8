"""``make demo``: the whole pipeline on the embedded stack, then a prediction from the endpoint."""

from __future__ import annotations

import os
import sys

# The embedded Prefect server starts with the run; on a busy 2-core machine that can take a while.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import httpx  # noqa: E402

from blocks.home import gpuferry_home  # noqa: E402
from blocks.specs import ServingSpec  # noqa: E402
from flows.retrain import load_stack, retrain  # noqa: E402
from workload.data import load_digits_split  # noqa: E402


def main() -> int:
    outcome = retrain()
    x_test, y_test = load_digits_split()["test"]
    lines = [
        "",
        "gpuferry demo: done",
        f"  MLflow run:   {outcome.run_url}",
        f"  model:        {outcome.model_version.name} v{outcome.model_version.version} "
        f"({outcome.model_version.metric}={outcome.model_version.value:.4f}, "
        f"{'promoted to champion' if outcome.model_version.promoted else 'not promoted'})",
        f"  checkpoint:   {outcome.checkpoint.uri}",
        f"                sha256 {outcome.checkpoint.sha256}",
    ]
    serving = load_stack(None).serving.current(ServingSpec().service_name)
    if serving is not None:
        response = httpx.post(f"{serving['url']}/predict", json={"inputs": x_test.tolist()}, timeout=60)
        response.raise_for_status()
        predictions = response.json()["predictions"]
        accuracy = sum(int(p == y) for p, y in zip(predictions, y_test.tolist(), strict=True)) / len(y_test)
        lines += [
            f"  endpoint:     {serving['url']}/predict (serving v{serving['version']}"
            f"{'' if outcome.deployed else ', the champion: this run did not beat it'})",
            f"                answered {len(predictions)} held-out digits, accuracy {accuracy:.3f}",
            f"                try: curl -s {serving['url']}/metrics | head",
            "  stop it:      make demo-stop",
        ]
    else:
        lines.append("  endpoint:     none is serving (the new version did not beat the champion: force_deploy=true)")
    lines.append(f"  state:        {gpuferry_home()}")
    print("\n".join(lines))
    return 0


def stop() -> int:
    stopped = load_stack(None).serving.undeploy(ServingSpec().service_name)
    print("stopped the demo's inference server" if stopped else "no demo inference server was running")
    return 0


if __name__ == "__main__":
    sys.exit(stop() if sys.argv[1:] == ["stop"] else main())
