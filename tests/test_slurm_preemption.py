"""Preemption on the real local Slurm as a remote cluster (its own filesystem and Python): a high-QoS job takes
the node of a training job, which Slurm requeues (PreemptMode=REQUEUE) and which then resumes from the
checkpoint it wrote on SIGTERM."""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from blocks.records import JobHandle, JobStatus, TrainingJob
from blocks.slurm.cluster import SlurmCluster
from blocks.specs import Resources
from runtime import contract
from tests.examples import DIGITS, code_of
from tests.stacks import remote_slurm, remove_on_cluster
from tests.test_slurm_cluster import env, key, slurm, wait_for  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster() -> Iterator[SlurmCluster]:
    c = remote_slurm("preemption", poll_interval_start=0.3, poll_interval_max=2.0)
    yield c
    remove_on_cluster(c, c.workdir_root)
    c.close()


def recording_polls(cluster: SlurmCluster) -> list[JobStatus]:
    """Every status `poll` returns from now on (watch polls through it)."""
    seen: list[JobStatus] = []
    original = cluster.poll

    def poll(handles: list[JobHandle]) -> dict[str, JobStatus]:
        statuses = original(handles)
        seen.extend(statuses.values())
        return statuses

    object.__setattr__(cluster, "poll", poll)
    return seen


def test_preempted_training_is_requeued_and_resumes_from_its_checkpoint(
    cluster: SlurmCluster,
    env: dict[str, str],
) -> None:
    gpus = int(env["SLURM_GPUS_PER_NODE"])
    # Both jobs ask for every GPU of node n1: the high-QoS one can only run by preempting the other.
    on_n1 = {"nodelist": "n1"}
    low = cluster.model_copy(update={"qos": "normal", "additional_directives": on_n1})
    seen = recording_polls(low)
    k = key("low")
    job = TrainingJob(
        key=k,
        workdir=cluster.job_workdir(k),
        command=["python", "train.py"],
        code=code_of(DIGITS),
        env={
            contract.HPARAMS: json.dumps({"epochs": 100, "batch_size": 16}),
            contract.CHECKPOINT_EVERY: "25",
            "OMP_NUM_THREADS": "1",
        },
        resources=Resources(gpus_per_node=gpus, mem_gb=1.5, time_limit_minutes=15),
    )
    handle = low.submit(job)

    # Let it train a little (and write a periodic checkpoint or two) before the high-QoS job arrives.
    wait_for(lambda: (low.read_progress(handle) or {}).get("step", 0) >= 60, 180, "the low job training")
    high = cluster.submit_command(
        key("high"), ["sleep", "2"], qos=env["SLURM_QOS_HIGH"], gpus_per_node=gpus, additional=on_n1, time=5
    )

    status = low.watch(handle, timeout_seconds=600)
    assert status.state == "COMPLETED", status
    assert cluster.watch(high, timeout_seconds=120).state == "COMPLETED"
    # The watcher saw the job go around (preempted/requeued/pending again) without stopping there.
    assert any("attempt 2" in s.reason or s.state in ("PREEMPTED", "REQUEUED") for s in seen), seen

    log = low.read_log(handle)[0]
    saved = [int(m) for m in re.findall(r"preempted: saved checkpoint at step (\d+)/", log)]
    resumed = [int(m) for m in re.findall(r"resumed from step-\d+: step (\d+),", log)]
    assert len(saved) == 1 and resumed == saved, log  # it resumed exactly where SIGTERM stopped it
    total = int(re.search(r"training \d+ epochs, (\d+) steps", log)[1])  # type: ignore[index]
    assert f"finished: step {total}/{total}, trained {total - saved[0]} steps in this run" in log, log
    assert "requeueing job" not in log  # Slurm requeued it; the script did not requeue it again

    # Read where it was written, on the cluster: this machine has no such path.
    final_dir = posixpath.join(job.workdir, "checkpoints", contract.FINAL_DIRNAME)
    assert not Path(final_dir).exists() and low.inspect_model(final_dir).pyfunc
    final = low.read_progress(handle) or {}
    assert final["step"] == total and final["metrics"]["val_accuracy"] > 0.9, final

    result = low.result(handle, status)
    assert result.requeues == 1
    rows = [
        line.split("|")
        for line in slurm(
            env, "sacct", "-X", "-D", "-n", "-P", "-j", handle.job_id, "--format=State,ElapsedRaw,AllocTRES"
        ).split()
    ]
    assert [r[0] for r in rows] == ["PREEMPTED", "COMPLETED"], rows
    assert all(f"gres/gpu={gpus}" in r[2] for r in rows)
    # GPU-hours count both attempts: the preempted one held the GPUs too.
    assert result.gpu_hours == pytest.approx(gpus * sum(int(r[1]) for r in rows) / 3600)
    assert result.gpu_hours > gpus * int(rows[-1][1]) / 3600
