"""What `gpuferry gc` frees on the real local Slurm (`make slurm-up`), reached over SSH as a remote cluster: the
job directories no queued job carries and the code directories no queued job runs in, aged on the cluster's own
filesystem; nothing a queued job uses, and code shipped again counts as used."""

from __future__ import annotations

import posixpath
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from blocks.errors import ConfigurationError
from blocks.records import TrainingJob
from blocks.slurm.cluster import SlurmCluster
from blocks.specs import Resources
from tests.examples import code_of
from tests.stacks import remote_slurm, remove_on_cluster
from tests.test_slurm_cluster import key, remote_exists, wait_for

pytestmark = pytest.mark.integration

DAY = 86400.0


@pytest.fixture
def cluster() -> Iterator[SlurmCluster]:
    c = remote_slurm(f"gc-tests-{key('root')}", poll_interval_start=0.3, poll_interval_max=2.0)
    yield c
    remove_on_cluster(c, c.workdir_root)
    c.close()


def job(cluster: SlurmCluster, code_dir: Path, command: list[str]) -> TrainingJob:
    k = key("gc")
    return TrainingJob(
        key=k,
        workdir=cluster.job_workdir(k),
        command=command,
        code=code_of(code_dir),
        resources=Resources(cpus_per_task=1, time_limit_minutes=10),
    )


def test_gc_lists_and_frees_only_what_no_queued_job_uses(cluster: SlurmCluster, tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "job.py").write_text("print('a')\n")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "job.py").write_text("print('b')\n")
    busy = job(cluster, tmp_path / "a", ["sleep", "300"])
    done = job(cluster, tmp_path / "b", ["true"])
    assert cluster.watch(cluster.submit(done), timeout_seconds=180).state == "COMPLETED"
    running = cluster.submit(busy)
    try:
        wait_for(lambda: cluster.poll([running])[running.job_id].state == "RUNNING", 120, "the busy job running")
        root = cluster.workdir_root
        assert root is not None
        cluster.run(["find", root, "-exec", "touch", "-h", "-d", "40 days ago", "{}", "+"])
        assert busy.code is not None and done.code is not None
        busy_code, done_code = cluster.code_dir(busy.code.sha256), cluster.code_dir(done.code.sha256)
        assert remote_exists(cluster, busy_code) and remote_exists(cluster, done_code)

        listed = {item.where: item for item in cluster.ended_jobs()}
        assert listed[done.workdir].kind == "job directory" and listed[done_code].kind == "code directory"
        assert busy.workdir not in listed and busy_code not in listed, listed  # the queued job's, both
        assert listed[done.workdir].modified < time.time() - 39 * DAY and listed[done.workdir].size_bytes > 0
        assert not any(where in (root, posixpath.dirname(done_code)) for where in listed)  # never a root

        # Another process shipping the same code again: the directory is used now, so it is young.
        again = remote_slurm("unused", workdir_root=root)
        try:
            again.ship_code(done)
        finally:
            again.close()
        young = {item.where: item for item in cluster.ended_jobs()}
        assert young[done_code].modified > time.time() - DAY

        for where in (done.workdir, done_code):
            cluster.remove_job(where)
            assert not remote_exists(cluster, where)
        assert remote_exists(cluster, busy.workdir) and remote_exists(cluster, busy_code)
        for outside in ("/etc", root, posixpath.dirname(done_code), f"{busy.workdir}/..", f"{root}/x/y"):
            with pytest.raises(ConfigurationError, match="is not a job or code directory of this cluster"):
                cluster.remove_job(outside)
    finally:
        cluster.cancel(running)
