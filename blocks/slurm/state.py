"""What Slurm's commands answer, read: pure functions from squeue / sacct text to our job states and usage.

Nothing here talks to a cluster: the block (``blocks/slurm/cluster.py`` and its mixins) runs the commands (the argv
lists are built here, so the fields asked for and the fields read are written once) and hands their output
over. The readers are tested against recorded outputs (``tests/golden/slurm/``).

* ``squeue``: ``SQUEUE_FIELDS`` as ``-O`` fields separated by ``|``, times as epoch seconds
  (``SLURM_TIME_FORMAT=%s``); ``parse_squeue`` turns its lines into records named as ``squeue --json``
  names them, ``status_from_squeue`` a record into a ``JobStatus``.
* ``sacct``: ``statuses_from_sacct`` (``SACCT_STATUS_FORMAT``, a job that left the controller's memory),
  ``usage`` (``SACCT_USAGE_FORMAT``: GPU-hours, CPU-hours, wall seconds and requeues over every attempt),
  ``array_task_rows`` / ``task_status`` (``SACCT_TASK_FORMAT``: the final state of each array task).
* ``aggregate``: one status for an array from the statuses of its tasks; ``statuses_from_squeue`` one status
  per watched job (or array) from ONE squeue's records.
* Adopting a job by its key: ``JOBS_NAMED_SH`` asks squeue and then sacct for the jobs of one name in one
  command; ``split_jobs_named`` and ``job_for_key`` read its answer. ``sbatch_job_id`` reads
  ``sbatch --parsable``, ``partitions_from_sinfo`` ``sinfo -h -o %R``, ``release_problems`` ``scontrol release``.
* ``command_error``: a failed Slurm command's message as a transient or a configuration error.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

from blocks.errors import ConfigurationError, GpuferryError, TransientError, explain_exit_code
from blocks.records import TERMINAL_STATES, JobStatus

# Slurm job states -> ours. PREEMPTED / NODE_FAIL depend on whether the job will be requeued.
_PENDING = {"PENDING", "CONFIGURING", "SUSPENDED", "RESV_DEL_HOLD", "RESIZING", "POWER_UP_NODE", "STOPPED"}
_RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "UPDATE_DB"}
_REQUEUED = {"REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD"}
_FAILED = {"FAILED", "BOOT_FAIL", "SPECIAL_EXIT", "DEADLINE", "LAUNCH_FAILED", "REVOKED"}
# The Slurm states an attempt ends in (sacct's record of it is final).
TERMINAL_SLURM = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "NODE_FAIL",
        "PREEMPTED",
        "SPECIAL_EXIT",
    }
)


def map_state(slurm_state: str, *, requeue: bool, exit_code: int | None, reason: str = "") -> tuple[str, str]:
    """(our state, reason) for a Slurm state; PREEMPTED/REQUEUED/NODE_FAIL-with-requeue are not terminal."""
    state = slurm_state.split()[0].upper() if slurm_state else "PENDING"  # sacct: "CANCELLED by 0"
    if state in _PENDING:
        return "PENDING", reason
    if state in _RUNNING:
        return "RUNNING", reason
    if state in _REQUEUED:
        return "REQUEUED", reason or "requeued; it resumes from its last checkpoint"
    if state == "PREEMPTED":
        if requeue:
            return "PREEMPTED", "preempted by a higher-priority job; Slurm requeues it"
        return "FAILED", "preempted and not requeueable (submit with requeue=True to resume instead)"
    if state == "NODE_FAIL":
        if requeue:
            return "REQUEUED", "its node failed; Slurm requeues it"
        return "FAILED", "its node failed and the job is not requeueable"
    if state == "COMPLETED":
        return "COMPLETED", ""
    if state == "CANCELLED":
        return "CANCELLED", f"cancelled ({slurm_state})"
    if state == "TIMEOUT":
        return "TIMEOUT", "it ran past its time limit: raise resources.time_limit_minutes or checkpoint more often"
    if state == "OUT_OF_MEMORY":
        return "OUT_OF_MEMORY", "killed for exceeding its memory limit: raise resources.mem_gb"
    if state in _FAILED:
        return "FAILED", explain_exit_code(exit_code) if state == "FAILED" else f"Slurm state {state}"
    return "FAILED", f"unexpected Slurm state {slurm_state!r}"


def wait_status_to_exit(raw: int | None) -> int | None:
    """squeue gives the wait status (code << 8 | signal); a signal becomes 128 + signal."""
    if raw is None:
        return None
    signal = raw & 0x7F
    return 128 + signal if signal else (raw >> 8) & 0xFF


def sacct_exit(text: str) -> int | None:
    """sacct's "code:signal"."""
    try:
        code, signal = (int(x) for x in text.split(":"))
    except ValueError:
        return None
    return 128 + signal if signal else code


def _reason(text: str | None) -> str:
    return "" if text in (None, "", "None") else f"Slurm reason: {text}"


def command_name(argv: Sequence[str]) -> str:
    """The program an ``env NAME=VALUE ... program`` command line runs."""
    return next((a for a in argv if a != "env" and not re.match(r"^[A-Z_]+=", a)), argv[0])


# What a Slurm command says when the controller or the database is busy or restarting: worth a retry.
_TRANSIENT_MARKS = (
    "Unable to contact slurm controller",
    "Socket timed out",
    "Connection refused",
    "Zero Bytes were transmitted",
    "slurm_persist_conn_open",
    "Connection timed out",
    "temporarily unavailable",
    "try again",
    "Resource temporarily unavailable",
)


def command_error(argv: Sequence[str], rc: int, message: str) -> GpuferryError:
    """The error a failed Slurm command raises: transient when the controller is unreachable or busy."""
    text = message.strip()
    name = command_name(argv)
    if any(mark.lower() in text.lower() for mark in _TRANSIENT_MARKS):
        return TransientError(f"{name} failed (exit {rc}): {text}")
    return ConfigurationError(f"{name} failed (exit {rc}): {text}")


def index_ranges(indexes: Iterable[int]) -> str:
    """Array task indexes as Slurm writes them: 0-4,7,9-12."""
    parts: list[str] = []
    run: list[int] = []
    for index in sorted(set(indexes)):
        if run and index != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(index)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


# ---- squeue ------------------------------------------------------------------------------------------

# One squeue record: ``squeue -O`` field, and the name the record gets (``squeue --json``'s).
SQUEUE_FIELDS: tuple[tuple[str, str], ...] = (
    ("JobID", "job_id"),
    ("ArrayJobID", "array_job_id"),
    ("ArrayTaskID", "array_task_id"),
    ("State", "job_state"),
    ("exit_code", "exit_code"),
    ("Reason", "state_reason"),
    ("Requeue", "requeue"),
    ("RestartCnt", "restart_cnt"),
    ("StartTime", "start_time"),
    ("EndTime", "end_time"),
    ("NumCPUs", "cpus"),
    ("tres-alloc", "tres_alloc_str"),
    ("NodeList", "nodes"),
)
_SQUEUE_INTS = ("job_id", "array_job_id", "exit_code", "restart_cnt", "start_time", "end_time", "cpus")


def squeue_argv(job_ids: Iterable[str] = ()) -> list[str]:
    """ONE ``squeue`` of ``job_ids`` (every job the controller holds when none are given), in text form.

    Two RPCs (the jobs, the partitions) whether it asks for one job or for a thousand (``--local``: no
    federation lookup, which squeue adds for a single id). squeue filters by ``-j`` itself, whereas
    ``squeue --json`` in 22.05 ignores ``-j`` and serialises every job in the controller's memory (~10 MB
    and up to a second at 2,000 records).
    """
    ids = sorted({str(j) for j in job_ids}, key=int)
    argv = [
        "env",
        "SLURM_TIME_FORMAT=%s",
        "squeue",
        "--local",
        "-h",
        "-t",
        "all",
        "-O",
        ",".join(f"{field}:|" for field, _ in SQUEUE_FIELDS),
    ]
    if ids:
        argv += ["-j", ",".join(ids)]
    return argv


def parse_squeue(out: str) -> list[dict[str, Any]]:
    """squeue's lines as records; pending array tasks come as one record whose ``array_task_id`` is None."""
    jobs = []
    for line in out.splitlines():
        values = line.split("|")
        if len(values) < len(SQUEUE_FIELDS) or not values[0].strip().isdigit():
            continue
        record: dict[str, Any] = {
            name: value.strip() for (_, name), value in zip(SQUEUE_FIELDS, values, strict=False)
        }  # extra trailing fields are ignored
        for name in _SQUEUE_INTS:
            record[name] = int(record[name]) if record[name].isdigit() else 0
        task = record["array_task_id"]
        record["array_task_id"] = int(task) if task.isdigit() else None
        record["requeue"] = record["requeue"] == "1"
        jobs.append(record)
    return jobs


def status_from_squeue(record: dict[str, Any], now: float | None = None) -> JobStatus:
    """The status of one squeue record (a job, an array task, or an array's pending tasks)."""
    exit_code = wait_status_to_exit(record.get("exit_code"))
    slurm_state = str(record.get("job_state", "PENDING"))
    state, reason = map_state(
        slurm_state,
        requeue=bool(record.get("requeue")),
        exit_code=exit_code,
        reason=_reason(record.get("state_reason")),
    )
    if state in ("RUNNING", "PENDING") and record.get("restart_cnt"):
        reason = f"attempt {int(record['restart_cnt']) + 1} (requeued {record['restart_cnt']}x). {reason}".strip()
    start, end = record.get("start_time") or 0, record.get("end_time") or 0
    now = time.time() if now is None else now
    elapsed = max(0.0, (end if state not in ("PENDING", "RUNNING") and end else now) - start) if start else 0.0
    task = record.get("array_task_id")
    job_id = str(record["job_id"]) if task is None else f"{record.get('array_job_id')}_{task}"
    return JobStatus(
        job_id=job_id,
        state=state,
        exit_code=exit_code if state != "RUNNING" else None,
        reason=reason,
        elapsed_seconds=elapsed if state != "PENDING" else 0.0,
        nodes=str(record.get("nodes") or "") if state == "RUNNING" else "",
    )


def usage_row_from_squeue(record: dict[str, Any], status: JobStatus) -> list[str]:
    """A finished task's squeue record as the row ``usage`` reads (what sacct would give for one attempt)."""
    elapsed = max(0, int(record.get("end_time") or 0) - int(record.get("start_time") or 0))
    return [
        status.job_id,
        status.job_id,
        str(record.get("job_state")),
        str(elapsed),
        str(record.get("tres_alloc_str") or ""),
        str(record.get("cpus") or 0),
    ]


def statuses_from_squeue(
    records: Iterable[dict[str, Any]], job_ids: Iterable[str], now: float | None = None
) -> dict[str, JobStatus]:
    """The status of each of ``job_ids`` that ONE squeue's ``records`` hold: a job's from its record, an
    array's from those of its tasks (an array task's record counts for its array when the array is watched).
    A watched job without a record is left out (sacct has it, or nobody)."""
    wanted = {str(j) for j in job_ids}
    per_job: dict[str, list[JobStatus]] = {}
    for record in records:
        parent = str(record.get("array_job_id") or 0)
        own = str(record.get("job_id"))
        if parent in wanted and parent != "0":
            per_job.setdefault(parent, []).append(status_from_squeue(record, now))
        elif own in wanted:
            per_job.setdefault(own, []).append(status_from_squeue(record, now))
    return {job_id: aggregate(job_id, items) for job_id, items in per_job.items()}


def partitions_from_sinfo(out: str) -> list[str]:
    """``sinfo -h -o %R``'s partitions, each once, sorted."""
    return sorted({line.strip() for line in out.splitlines() if line.strip()})


# ---- submit and adopt: a job's key is its name, and in its comment -----------------------------------

KEY_COMMENT_PREFIX = "gpuferry-key:"
_SACCT_SEPARATOR = "-- sacct --"

# squeue's and then sacct's jobs of one name ("$1"), since "$2"; a fixed script, the name an argument.
JOBS_NAMED_SH = (
    f'squeue -h -t all --name="$1" -o "%F|%j|%k" || exit; echo "{_SACCT_SEPARATOR}"; '
    'exec sacct -X -n -P --name="$1" --starttime="$2" --format=JobIDRaw,JobID,Comment'
)


def split_jobs_named(out: str) -> tuple[list[str], list[str] | None]:
    """``JOBS_NAMED_SH``'s answer as squeue's ``array job id|name|comment`` lines and sacct's
    ``JobIDRaw|JobID|Comment`` lines (None: the command stopped before sacct). squeue's lines start with a
    job id: the separator line cannot be one of them."""
    live, separated, accounted = ("\n" + out).partition(f"\n{_SACCT_SEPARATOR}\n")
    return [line for line in live.splitlines() if line], accounted.splitlines() if separated else None


def job_for_key(key: str, live: Iterable[str], accounted: Iterable[str]) -> str | None:
    """The id of the job carrying ``key`` among ``split_jobs_named``'s lines: the oldest live one, else the
    oldest accounted one. A live job carries the key as its name and its comment; sacct has the comment only
    where AccountingStoreFlags=job_comment, so there an empty comment with the name is the key too."""
    comment = KEY_COMMENT_PREFIX + key
    found = []
    for line in live:
        job_id, name, job_comment = (line.split("|", 2) + ["", ""])[:3]
        if name == key and job_comment == comment and job_id.isdigit():
            found.append(job_id)
    if not found:
        found = [
            line.split("|")[1].split("_")[0]
            for line in accounted
            if line.count("|") >= 2 and line.split("|", 2)[2] in (comment, "")
        ]
    return min(found, key=int) if found else None


def sbatch_job_id(out: str) -> str:
    """The job id ``sbatch --parsable`` printed ("<id>" or "<id>;<cluster>")."""
    job_id = out.strip().split(";")[0]
    if not job_id.isdigit():
        raise TransientError(f"sbatch answered {out!r} instead of a job id")
    return job_id


def release_problems(out: str) -> list[str]:
    """What ``scontrol release`` said that is an error: releasing a task that already ran is none."""
    return [
        line
        for line in out.splitlines()
        if line.strip() and not line.rstrip().endswith(("Job has already finished", "No error"))
    ]


# ---- sacct -------------------------------------------------------------------------------------------

SACCT_STATUS_FORMAT = "JobIDRaw,JobID,State,ExitCode,ElapsedRaw,Reason"
SACCT_USAGE_FORMAT = "JobIDRaw,JobID,State,ElapsedRaw,AllocTRES,NCPUS"
SACCT_TASK_FORMAT = SACCT_USAGE_FORMAT + ",ExitCode,Reason"
NOT_VISIBLE = "not visible in squeue or sacct (sacct lags the controller; lost after lost_job_grace_seconds)"


def statuses_from_sacct(out: str, job_ids: Iterable[str]) -> dict[str, JobStatus]:
    """The status of each of ``job_ids`` from sacct's ``SACCT_STATUS_FORMAT`` lines (an array's from its
    tasks'); a job sacct does not have (yet) is PENDING and not ``visible``."""
    per_job: dict[str, list[JobStatus]] = {j: [] for j in job_ids}
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) < 6:
            continue
        _raw, jid, slurm_state, exit_text, elapsed, reason = parts[:6]
        base = jid.split("_")[0]
        if base not in per_job:
            continue
        exit_code = sacct_exit(exit_text)
        # A job sacct reports PREEMPTED/NODE_FAIL that the controller no longer has was not requeued.
        state, why = map_state(slurm_state, requeue=False, exit_code=exit_code, reason=_reason(reason))
        per_job[base].append(
            JobStatus(
                job_id=jid,
                state=state,
                exit_code=exit_code,
                reason=why,
                elapsed_seconds=float(elapsed or 0),
            )
        )
    unseen = {"state": "PENDING", "reason": NOT_VISIBLE, "visible": False}
    return {
        job_id: aggregate(job_id, items) if items else JobStatus(job_id=job_id, **unseen)
        for job_id, items in per_job.items()
    }


def aggregate(job_id: str, items: list[JobStatus]) -> JobStatus:
    """One status for a job (one item) or an array (one item per task or pending group)."""
    if len(items) == 1:
        return items[0].model_copy(update={"job_id": job_id})
    elapsed = max(i.elapsed_seconds for i in items)
    live = [i for i in items if not i.terminal]
    if live:
        order = ("PREEMPTED", "REQUEUED", "RUNNING", "PENDING")
        state = next(s for s in order if any(i.state == s for i in live))
        done = sum(1 for i in items if i.terminal)
        return JobStatus(
            job_id=job_id,
            state=state,
            elapsed_seconds=elapsed,
            reason=f"array: {done} tasks finished, {len(live)} records still queued or running",
            nodes=",".join(sorted({i.nodes for i in live if i.nodes})),
        )
    failed = [i for i in items if i.state != "COMPLETED"]
    if not failed:
        return JobStatus(
            job_id=job_id,
            state="COMPLETED",
            exit_code=0,
            elapsed_seconds=elapsed,
            reason=f"array: all {len(items)} tasks completed",
        )
    first = sorted(failed, key=lambda i: i.job_id)[0]
    return JobStatus(
        job_id=job_id,
        state=first.state,
        exit_code=first.exit_code,
        elapsed_seconds=elapsed,
        reason=f"array: {len(failed)} of {len(items)} tasks did not complete; task {first.job_id}: {first.reason}",
    )


def usage_rows(out: str) -> list[list[str]]:
    """sacct's ``SACCT_USAGE_FORMAT`` lines as rows."""
    return [line.split("|") for line in out.splitlines() if line.count("|") >= 5]


def accounting_settled(rows: list[list[str]]) -> bool:
    """Whether sacct has the final record of every attempt (it lags the controller by a few seconds)."""
    return bool(rows) and all(r[2].split()[0] in TERMINAL_SLURM or r[2].startswith("REQUEUED") for r in rows)


def usage(rows: list[list[str]]) -> dict[str, float]:
    """GPU-hours (allocated ``gres/gpu`` × elapsed), CPU-hours, wall seconds and requeues of every attempt."""
    gpu_s = cpu_s = wall = 0.0
    requeues = 0
    for _raw, _jid, state, elapsed_text, tres, ncpus in (r[:6] for r in rows):
        elapsed = float(elapsed_text or 0)
        gpus = 0
        for item in tres.split(","):
            name, _, value = item.partition("=")
            if name == "gres/gpu" and value.isdigit():
                gpus = int(value)
        gpu_s += gpus * elapsed
        cpu_s += int(ncpus or 0) * elapsed
        wall = max(wall, elapsed)
        if state.split()[0] in ("PREEMPTED", "REQUEUED", "NODE_FAIL"):
            requeues += 1
    return {"gpu_hours": gpu_s / 3600, "cpu_hours": cpu_s / 3600, "wall_seconds": wall, "requeues": requeues}


def array_task_rows(out: str) -> dict[int, list[list[str]]]:
    """sacct's ``SACCT_TASK_FORMAT`` lines of an array, per task index, attempts in order."""
    per_task: dict[int, list[list[str]]] = {}
    for line in out.splitlines():
        row = line.split("|")
        if len(row) >= 8 and "_" in row[1] and row[1].split("_", 1)[1].isdigit():
            per_task.setdefault(int(row[1].split("_", 1)[1]), []).append(row)
    return per_task


def task_status(rows: list[list[str]]) -> JobStatus | None:
    """The final status of an array task from its sacct rows (its last attempt), None while it has none."""
    if not rows:
        return None
    last = rows[-1]
    exit_code = sacct_exit(last[6])
    state, why = map_state(last[2], requeue=False, exit_code=exit_code, reason=_reason(last[7]))
    if state not in TERMINAL_STATES:
        return None
    return JobStatus(
        job_id=last[1],
        state=state,
        exit_code=exit_code,
        reason=why,
        elapsed_seconds=float(last[3] or 0),
    )
