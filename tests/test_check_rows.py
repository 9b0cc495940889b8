"""The checks' reading of what the systems answer (blocks/slurm/check.py, blocks/kubernetes/check.py), on recorded
answers.

tests/golden/slurm/check_facts.txt is the one command `check` runs on a Slurm login node (``_FACTS_SH``),
recorded from the local Slurm 22.05 as the stack's user; check_facts_refused.txt the same command for a user
with no association, an interpreter that does not exist and a jobs' directory that cannot be written. What
they read to is kept next to them as JSON (``GPUFERRY_UPDATE_GOLDEN=1`` rewrites it); the assertions say what
matters in it. The rows are then made from the recorded answer by the block's own checks, with the block's
command runner answering the recording.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from blocks.checks import CheckRow, Probe, run_groups
from blocks.kubernetes.check import deploy_permissions
from blocks.kubernetes.cluster import KubernetesCluster
from blocks.slurm.check import _accounts, _partitions, _runtimes, _sections, check_slurm
from blocks.slurm.cluster import SlurmCluster
from tests.golden_files import GOLDEN as GOLDEN_DIR
from tests.golden_files import check_json

GOLDEN = GOLDEN_DIR / "slurm"


def recorded(name: str) -> str:
    return (GOLDEN / f"{name}.txt").read_text()


def read_facts(name: str) -> dict[str, Any]:
    sections = _sections(recorded(name))
    return {
        "sections": {k: list(v) for k, v in sorted(sections.items())},
        "partitions": _partitions(sections["partitions"][1]),
        "accounts": {k: sorted(v) for k, v in _accounts(sections["assoc"][1]).items()},
        "runtimes": sorted(_runtimes(sections["runtimes"][1])),
    }


def test_the_facts_of_a_login_node() -> None:
    facts = read_facts("check_facts")
    check_json(GOLDEN / "check_facts.json", facts)
    assert set(facts["sections"]) == {"user", "version", "partitions", "assoc", "runtimes", "python", "workdir"}
    assert all(rc == 0 for rc, _ in facts["sections"].values())
    assert facts["sections"]["version"] == [0, "slurm-wlm 22.05.8"]
    # "debug|up|2|gpu:fake:4": 2 nodes with 4 GPUs each; a partition without nodes or gres has none.
    assert facts["partitions"] == {
        "debug": {"state": "up", "nodes": 2, "gpus": 8},
        "joined": {"state": "up", "nodes": 0, "gpus": 0},
    }
    assert facts["accounts"] == {"gpuferry": ["high", "normal"], "root": ["high", "normal"]}
    assert facts["runtimes"] == ["podman"]


def test_the_facts_of_a_refused_user_keep_each_sections_exit_code() -> None:
    facts = read_facts("check_facts_refused")
    check_json(GOLDEN / "check_facts_refused.json", facts)
    sections = facts["sections"]
    assert sections["user"] == [0, "nobody"] and sections["assoc"] == [0, ""] and facts["accounts"] == {}
    assert sections["python"][0] == 127 and "not found" in sections["python"][1]
    assert sections["workdir"] == [1, "/proc/sys"]  # the nearest existing directory, not writable


@pytest.mark.parametrize(
    ("line", "gpus"),
    [
        ("gpu|up|4|gpu:a100:8(S:0-1)", 32),  # a type and the sockets' affinity
        ("gpu|up|2|gpu:4,shard:8", 8),  # other gres beside the GPUs
        ("mig|up|1|gpu:1g.10gb:7", 7),
        ("cpu|up|10|(null)", 0),
        ("mixed|drain|3|gpu:h100:4", 12),
    ],
)
def test_gpus_per_partition_from_sinfo_gres_columns(line: str, gpus: int) -> None:
    """The gres forms of sinfo's %G (Slurm's documentation: NAME[:TYPE]:COUNT[(S:SOCKETS)]), one line each."""
    (entry,) = _partitions(line).values()
    assert entry["gpus"] == gpus


def test_a_partition_on_several_sinfo_lines_adds_its_nodes_and_gpus() -> None:
    # sinfo prints a line per distinct node configuration of a partition.
    found = _partitions("gpu|up|2|gpu:a100:4\ngpu|up|3|gpu:v100:2\nbroken line\n|up|1|gpu:1\n")
    assert found == {"gpu": {"state": "up", "nodes": 5, "gpus": 14}}


def test_an_account_with_an_association_per_partition_has_the_union_of_their_qos() -> None:
    assert _accounts("ml|gpu|normal\nml|debug|high,normal\nother||\n") == {"ml": {"normal", "high"}, "other": set()}


def test_sections_without_their_end_marker_are_left_out() -> None:
    assert _sections("@@a\nx\n@@rc 0\n@@b\ny\n") == {"a": (0, "x")}
    assert _sections("@@a\n@@rc nan\n") == {"a": (1, "")}


# ---- the Slurm rows, from a recorded answer ------------------------------------------------------------


def slurm_rows(monkeypatch: pytest.MonkeyPatch, name: str, needs_image: bool = True, **fields: Any) -> list[CheckRow]:
    answer = recorded(name)
    monkeypatch.setattr(SlurmCluster, "run", lambda self, argv, **kwargs: (0, answer, ""))
    cluster = SlurmCluster(
        **{"local": True, "workdir_root": "/srv/shared/jobs", "container_runtime": "podman", **fields}
    )
    probe = Probe("compute", "SlurmCluster", needs_image=needs_image)
    check_slurm(cluster, probe)
    return probe.rows


def failed(rows: list[CheckRow]) -> dict[str, CheckRow]:
    return {r.check: r for r in rows if r.status == "failed"}


def test_the_recorded_login_node_passes_with_the_stacks_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = slurm_rows(monkeypatch, "check_facts", partition="debug", account="gpuferry", qos="high")
    assert [r for r in rows if r.status != "ok"] == []
    by_check = {r.check: r.detail for r in rows}
    assert by_check["GPUs (gres)"] == "GPUs (gres) per partition: debug: 8, joined: 0"
    assert by_check["container runtime"] == "podman (set)"


@pytest.mark.parametrize(
    ("fields", "check", "detail", "fix"),
    [
        (
            {"partition": "gpu-a100"},
            "partitions",
            "partition 'gpu-a100' does not exist; the cluster has: debug (up, 2 nodes), joined (up, 0 nodes)",
            "set partition to one of: debug, joined",
        ),
        (
            {"account": "ml-team"},
            "account/QoS",
            "user 'root' is not in account 'ml-team'; their accounts: gpuferry, root",
            "set account to one of: gpuferry, root",
        ),
        (
            {"account": "gpuferry", "qos": "premium"},
            "account/QoS",
            "QoS 'premium' is not allowed for 'root'; allowed: high, normal",
            "set qos to one of: high, normal",
        ),
        (
            {"container_runtime": "apptainer"},
            "container runtime",
            "container_runtime='apptainer', but no apptainer on the login node's PATH; the cluster offers: podman",
            "install apptainer on the nodes, or set container_runtime to podman or auto",
        ),
        (
            {"container_runtime": "pyxis"},
            "container runtime",
            "`srun --help` lists no --container-image (no pyxis)",
            "install pyxis on the nodes",
        ),
    ],
)
def test_a_setting_the_cluster_does_not_have_fails_its_row_with_the_choices(
    monkeypatch: pytest.MonkeyPatch, fields: dict[str, Any], check: str, detail: str, fix: str
) -> None:
    rows = slurm_rows(monkeypatch, "check_facts", **fields)
    assert list(failed(rows)) == [check], rows
    assert detail in failed(rows)[check].detail and fix in failed(rows)[check].fix


def test_a_missing_runtime_is_only_a_warning_when_the_stack_builds_no_image(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = slurm_rows(monkeypatch, "check_facts", needs_image=False, container_runtime="apptainer")
    (row,) = [r for r in rows if r.check == "container runtime"]
    assert row.status == "warn" and "not needed: the stack builds no image" in row.detail
    assert [r.check for r in rows if r.check == "python"] == ["python"]  # image-less jobs need the interpreter


def test_a_user_without_associations_an_interpreter_and_a_writable_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = slurm_rows(monkeypatch, "check_facts_refused", needs_image=False, user="nobody", account="gpuferry")
    assert {r.check: r.status for r in rows if r.status != "ok"} == {
        "account/QoS": "warn",
        "python": "failed",
        "jobs' directory": "failed",
    }
    rows_by = {r.check: r for r in rows}
    assert "user 'nobody' has no associations" in rows_by["account/QoS"].detail
    assert "/srv/no-such-env/bin/python: not found" in rows_by["python"].detail
    assert (
        rows_by["jobs' directory"].detail == "/srv/shared/jobs: its nearest existing directory (/proc/sys) is not "
        "writable by nobody"
    )


# ---- Kubernetes -----------------------------------------------------------------------------------------


def test_the_permissions_a_deploy_needs_follow_the_blocks_settings() -> None:
    plain = deploy_permissions(KubernetesCluster(env_from_secret="model-store"))
    assert ("patch", "apps", "deployments", True) in plain and ("list", "", "nodes", False) in plain
    assert len(plain) == len(set(plain)) == 14  # with the route ConfigMap and the pods of a canary or shadow
    own_secret = deploy_permissions(KubernetesCluster())  # the store's Secret is gpuferry's to make
    assert set(own_secret) - set(plain) == {(v, "", "secrets", True) for v in ("get", "create", "update", "delete")}
    assert not any(group in ("autoscaling", "policy") for _, group, _, _ in plain)
    full = deploy_permissions(
        KubernetesCluster(env_from_secret="model-store", autoscale_max_replicas=4, pdb_min_available=1)
    )
    assert set(full) - set(plain) == {
        ("patch", "autoscaling", "horizontalpodautoscalers", True),
        ("delete", "autoscaling", "horizontalpodautoscalers", True),
        ("patch", "policy", "poddisruptionbudgets", True),
        ("delete", "policy", "poddisruptionbudgets", True),
    }


def test_work_on_this_machine_does_not_count_against_a_groups_deadline() -> None:
    """Two groups with the same deadline: one waits for an answer that never comes and is given up on; the other
    imports (inside ``probe.local()``) until that has happened, longer than the deadline, then checks and passes."""
    hung, importing = Probe("hung", "x", timeout=2.0), Probe("importing", "x", timeout=2.0)
    never = threading.Event()

    def imports(probe: Probe) -> None:
        with probe.local():
            deadline = time.monotonic() + 60
            while not hung.closed and time.monotonic() < deadline:
                time.sleep(0.05)
        probe.step("server", lambda: "answers")

    rows = run_groups([(hung, lambda p: p.step("reach", never.wait)), (importing, imports)])
    assert hung.closed and not importing.closed
    assert {(r.step, r.check): (r.status, r.detail) for r in rows} == {
        ("hung", "reach"): ("failed", "no answer within 2 s"),
        ("importing", "server"): ("ok", "answers"),
    }
