"""Reading Slurm's answers (blocks/slurm/state.py) against outputs recorded from the local Slurm 22.05.

The inputs in tests/golden/slurm/ are squeue and sacct output exactly as the argv lists of blocks/slurm/state.py
ask for it: held and released array tasks, a running job, a cancelled one, one that exited 3 and one killed
by SIGKILL, a preempted job's two attempts (sacct_tasks.txt puts attempts like those under one array's
tasks); the jobs of one name as the adopt lookup asks for them (jobs_named.txt: ours finished, held and in an
array, and someone else's of the same name), and sinfo's partitions. What they read to is kept next to them
as JSON (``GPUFERRY_UPDATE_GOLDEN=1`` rewrites it); the assertions below say what matters in it.
"""

from __future__ import annotations

from typing import Any

import pytest

from blocks.errors import ConfigurationError, TransientError
from blocks.slurm.state import (
    JOBS_NAMED_SH,
    KEY_COMMENT_PREFIX,
    NOT_VISIBLE,
    SACCT_STATUS_FORMAT,
    SACCT_TASK_FORMAT,
    SACCT_USAGE_FORMAT,
    SQUEUE_FIELDS,
    accounting_settled,
    aggregate,
    array_task_rows,
    command_error,
    index_ranges,
    job_for_key,
    parse_squeue,
    partitions_from_sinfo,
    release_problems,
    sbatch_job_id,
    split_jobs_named,
    squeue_argv,
    status_from_squeue,
    statuses_from_sacct,
    statuses_from_squeue,
    task_status,
    usage,
    usage_rows,
)
from tests.golden_files import GOLDEN as GOLDEN_DIR
from tests.golden_files import check_json

GOLDEN = GOLDEN_DIR / "slurm"
NOW = 1796175640.0  # a moment after the recorded squeue


def check_golden(name: str, value: Any) -> Any:
    check_json(GOLDEN / f"{name}.json", value)
    return value


def test_the_squeue_command_asks_for_the_fields_it_reads() -> None:
    argv = squeue_argv(["119", "21", "119"])
    assert argv[:3] == ["env", "SLURM_TIME_FORMAT=%s", "squeue"] and "--local" in argv
    assert argv[argv.index("-O") + 1] == ",".join(f"{field}:|" for field, _ in SQUEUE_FIELDS)
    assert argv[-2:] == ["-j", "21,119"]  # each id once, in order
    assert "-j" not in squeue_argv()  # every job the controller holds


def test_squeue_records_and_their_states() -> None:
    records = parse_squeue((GOLDEN / "squeue.txt").read_text() + "\nnot a record\n")
    statuses = [status_from_squeue(r, now=NOW).model_dump() for r in records]
    check_golden("squeue", {"records": records, "statuses": statuses})
    by_id = {s["job_id"]: s for s in statuses}
    assert set(by_id) == {"118_1", "118", "119", "121", "122", "123"}
    held = next(r for r in records if r["job_id"] == 118)
    assert held["array_task_id"] is None and held["job_state"] == "PENDING"  # tasks 0,2-3: one record
    assert by_id["118"]["state"] == "PENDING" and by_id["118"]["reason"] == "Slurm reason: JobHeldUser"
    assert by_id["118_1"]["state"] == "COMPLETED" and by_id["118_1"]["exit_code"] == 0
    assert by_id["119"]["state"] == "RUNNING" and by_id["119"]["elapsed_seconds"] == NOW - 1796175601
    assert by_id["119"]["nodes"] == "n1" and by_id["118"]["nodes"] == "" and by_id["123"]["nodes"] == ""
    assert by_id["121"]["state"] == "FAILED" and by_id["121"]["exit_code"] == 3  # wait status 768 = exit 3
    assert by_id["122"]["exit_code"] == 137 and "SIGKILL" in by_id["122"]["reason"]  # killed by signal 9
    assert by_id["123"]["state"] == "CANCELLED"
    array = aggregate("118", [status_from_squeue(r, now=NOW) for r in records if r["array_job_id"] == 118])
    assert array.state == "PENDING" and "1 tasks finished, 1 records still queued" in array.reason


def test_sacct_statuses_of_jobs_that_left_the_controller() -> None:
    assert SACCT_STATUS_FORMAT.split(",")[:3] == ["JobIDRaw", "JobID", "State"]
    wanted = ["101", "103", "105", "110", "121", "122", "999"]
    statuses = statuses_from_sacct((GOLDEN / "sacct_status.txt").read_text(), wanted)
    check_golden("sacct_status", {k: v.model_dump() for k, v in sorted(statuses.items())})
    assert statuses["101"].state == "COMPLETED"
    assert statuses["103"].state == "FAILED" and statuses["103"].exit_code == 125
    assert statuses["105"].state == "COMPLETED" and statuses["105"].reason == "array: all 3 tasks completed"
    assert statuses["110"].state == "CANCELLED" and "CANCELLED by 0" in statuses["110"].reason
    assert statuses["121"].exit_code == 3 and statuses["122"].exit_code == 137
    assert statuses["999"].state == "PENDING" and statuses["999"].reason == NOT_VISIBLE  # sacct lags, or lost
    assert [job for job, status in statuses.items() if not status.visible] == ["999"]


def test_usage_counts_every_attempt_of_a_preempted_job() -> None:
    assert SACCT_USAGE_FORMAT == "JobIDRaw,JobID,State,ElapsedRaw,AllocTRES,NCPUS"
    rows = usage_rows((GOLDEN / "sacct_usage.txt").read_text())
    assert (
        accounting_settled(rows) and not accounting_settled([]) and not accounting_settled([[*rows[0][:2], "RUNNING"]])
    )
    used = check_golden("sacct_usage", usage(rows))
    assert used == {
        "gpu_hours": 4 * (36 + 31) / 3600,
        "cpu_hours": (36 + 31) / 3600,
        "wall_seconds": 36.0,
        "requeues": 1,
    }


def test_the_final_state_and_usage_of_each_array_task() -> None:
    assert SACCT_TASK_FORMAT.endswith(",ExitCode,Reason")
    per_task = array_task_rows((GOLDEN / "sacct_tasks.txt").read_text())
    finals = {i: task_status(rows) for i, rows in sorted(per_task.items())}
    check_golden(
        "sacct_tasks", {str(i): (s.model_dump() if s else None, usage(per_task[i])) for i, s in finals.items()}
    )
    assert finals[0] is not None and finals[0].state == "COMPLETED"
    assert finals[1] is not None and finals[1].state == "COMPLETED"  # its last attempt
    assert usage(per_task[1])["requeues"] == 1 and usage(per_task[1])["gpu_hours"] == pytest.approx(32 / 3600)
    assert finals[2] is not None and finals[2].state == "FAILED" and finals[2].exit_code == 3
    assert "exit code 3" in finals[2].reason
    assert finals[3] is None  # still running: no final state yet


def test_index_ranges_and_command_errors() -> None:
    assert index_ranges([9, 0, 1, 2, 7, 12, 10, 11, 2]) == "0-2,7,9-12" and index_ranges([]) == ""
    busy = command_error(["env", "SLURM_CONF=/x", "sbatch", "job"], 1, "sbatch: error: Socket timed out on send/recv")
    assert isinstance(busy, TransientError) and str(busy).startswith("sbatch failed (exit 1)")
    wrong = command_error(["squeue"], 1, "squeue: error: Invalid user: nobody\n")
    assert isinstance(wrong, ConfigurationError) and not isinstance(wrong, TransientError)


def test_one_squeue_gives_each_watched_job_or_array_its_status() -> None:
    records = parse_squeue((GOLDEN / "squeue.txt").read_text())
    statuses = statuses_from_squeue(records, ["118", "121", "999"], now=NOW)
    assert sorted(statuses) == ["118", "121"]  # 999 has no record: sacct is asked for it
    # The array: its finished task (record 120) and its held tasks' record, as one status.
    assert statuses["118"] == aggregate(
        "118", [status_from_squeue(r, now=NOW) for r in records if r["array_job_id"] == 118]
    )
    assert statuses["118"].state == "PENDING" and statuses["121"].exit_code == 3
    # A task watched by its own id while its array is not: its record alone.
    assert statuses_from_squeue(records, ["120"], now=NOW)["120"].state == "COMPLETED"


def test_the_jobs_of_one_name_and_the_one_to_adopt() -> None:
    assert JOBS_NAMED_SH.count('"$1"') == 2 and '"$2"' in JOBS_NAMED_SH  # the name is an argument, never formatted
    key = "gf-adopt"
    live, accounted = split_jobs_named((GOLDEN / "jobs_named.txt").read_text())
    assert accounted is not None
    found = {
        "live": live,
        "accounted": accounted,
        "adopt": job_for_key(key, live, accounted),
        "adopt_from_sacct": job_for_key(key, [], accounted),
    }
    check_golden("jobs_named", found)
    assert found["adopt"] == "1"  # the oldest of ours (1, 3, 4); 2 has our name and someone else's comment
    assert job_for_key(key, ["2|gf-adopt|someone else's"], []) is None
    assert found["adopt_from_sacct"] == "1"  # the controller forgot it: the accounting database has it
    # Where sacct stores no comment (no AccountingStoreFlags=job_comment) the name alone is the key.
    assert job_for_key(key, [], ["7|7|", "5_2|5_2|", "9|9|not ours"]) == "5"
    assert job_for_key(key, [f"8|{key}x|{KEY_COMMENT_PREFIX}{key}"], []) is None  # another name
    # squeue failed before sacct ran: no sacct part at all; nothing found: empty parts.
    assert split_jobs_named("") == ([], None)
    assert split_jobs_named("-- sacct --\n") == ([], [])


def test_sbatch_sinfo_and_scontrol_answers() -> None:
    assert sbatch_job_id("4\n") == "4" and sbatch_job_id("17;cluster\n") == "17"
    with pytest.raises(TransientError, match="instead of a job id"):
        sbatch_job_id("sbatch: error: Batch job submission failed\n")
    assert partitions_from_sinfo((GOLDEN / "sinfo_partitions.txt").read_text() + "debug\n\n") == ["debug", "joined"]
    # Recorded from scontrol release: an array that already finished is no problem, an unknown task is.
    assert release_problems("3_0-2: Job has already finished\n") == []
    assert release_problems("1_0: Invalid job id specified\n") == ["1_0: Invalid job id specified"]
