"""A compute node that dies mid-job, on the real local Slurm as a remote cluster: its slurmd and the job's
processes are killed at once (as when the machine loses power), Slurm marks the node DOWN after SlurmdTimeout,
requeues the job (JobRequeue=1), and the job resumes from its last periodic checkpoint on the other node. The
retrain flow waits through all of it: one MLflow run and one model version in the end."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from blocks.specs import Resources, TrainingSpec
from flows.retrain import retrain
from tests.examples import DIGITS
from tests.stacks import remove_on_cluster, stack_env, stacks_root
from tests.test_pipeline_slurm import slurm_stack
from tests.test_slurm_cluster import slurm, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_server")]

REPO = Path(__file__).resolve().parent.parent
DEADLINE_S = 900


def _job_named(env: dict[str, str], name: str) -> dict[str, Any] | None:
    """The job called ``name`` in the controller's memory (squeue --json lists all; 22.05 ignores -n)."""
    for job in json.loads(slurm(env, "squeue", "--json"))["jobs"]:
        if job["name"] == name:
            return job
    return None


def _process_tree(root_pids: list[int]) -> list[int]:
    """``root_pids`` and every descendant (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    seen, todo = [], list(root_pids)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.append(pid)
            todo.extend(children.get(pid, []))
    return seen


def _kill_node(node: str, job_id: str) -> list[int]:
    """SIGKILL node ``node``'s slurmd and every process of job ``job_id`` on it (its slurmstepd and below)."""
    slurmd = int((stacks_root() / "slurm" / "pids" / f"slurmd-{node}.pid").read_text())
    steps = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(f"slurmstepd: [{job_id}.".encode()):
                steps.append(int(entry.name))
        except OSError:
            continue
    assert steps, f"no slurmstepd of job {job_id} found"
    victims = [slurmd, *_process_tree(steps)]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return victims


def test_a_job_whose_node_dies_is_requeued_and_resumes_on_the_other_node() -> None:
    env = stack_env("slurm")
    stack = slurm_stack("node-failure")
    root = stack.compute.workdir_root
    model = f"digits-nodefail-{uuid.uuid4().hex[:6]}"
    stack.save("slurm-node-failure-test", overwrite=True)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = retrain(
                workload=str(DIGITS),
                training=TrainingSpec(
                    model_name=model,
                    hyperparameters={"epochs": 40, "batch_size": 16},
                    checkpoint_every=20,
                    resources=Resources(mem_gb=1.5, time_limit_minutes=20),
                ),
                stack="slurm-node-failure-test",
            )
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            outcome["error"] = exc

    flow = threading.Thread(target=run, daemon=True)
    flow.start()
    try:

        def running() -> dict[str, Any] | None:
            if "error" in outcome:
                raise AssertionError(f"the flow failed before its job ran: {outcome['error']!r}")
            # The job's directory (named by its key, the job's name) appears on the cluster at submit.
            _, listing, _ = stack.compute.run(["ls", root], check=False)
            keys = [name for name in listing.split() if name.endswith("-train")]
            job = _job_named(env, keys[0]) if keys else None
            return job if job and job["job_state"] == "RUNNING" else None

        job = wait_for(running, DEADLINE_S, "the training job running")
        job_id, node = str(job["job_id"]), job["nodes"]
        workdir = f"{root}/{job['name']}"
        ckpts = f"{workdir}/checkpoints"
        wait_for(lambda: "step-" in stack.compute.run(["ls", ckpts], check=False)[1], 600, "a periodic checkpoint")
        _kill_node(node, job_id)

        flow.join(DEADLINE_S)
        assert not flow.is_alive(), "the flow did not finish"
        assert "error" not in outcome, outcome.get("error")
        result = outcome["result"]

        # Slurm saw the node fail and ran the job again, elsewhere.
        rows = [
            line.split("|")
            for line in slurm(env, "sacct", "-X", "-D", "-n", "-P", "-j", job_id, "--format=State,NodeList").split()
        ]
        assert [r[0] for r in rows] == ["NODE_FAIL", "COMPLETED"], rows
        assert rows[0][1] == node and rows[1][1] != node, rows
        # It resumed from its checkpoint instead of starting over.
        rc, log, _ = stack.compute.run(["cat", f"{workdir}/job.log"])
        assert rc == 0 and "resumed from step-" in log, log[-3000:]
        # One run, one model version.
        client = stack.tracking.client
        run_ = client.get_run(result.run_id)
        assert run_.info.status == "FINISHED" and "val_accuracy" in run_.data.metrics
        versions = client.search_model_versions(f"name='{model}'")
        assert [v.run_id for v in versions] == [result.run_id]
    finally:
        # The node comes back: the stack script starts the missing slurmd (in the cluster's namespace) and
        # resumes the DOWN node, so that the tests after this one have both.
        back = subprocess.run(
            ["bash", str(REPO / "scripts" / "slurm.sh"), "up"], capture_output=True, text=True, timeout=300
        )
        assert back.returncode == 0, back.stderr[-3000:]
        flow.join(60)
        remove_on_cluster(stack.compute, root)
        stack.compute.close()
