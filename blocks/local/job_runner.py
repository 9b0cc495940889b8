"""Supervisor of one local training job: ``python -m blocks.local.job_runner WORKDIR -- ARGV...``.

It runs ARGV with its output in ``WORKDIR/job.log``, forwards SIGTERM/SIGUSR1/SIGINT to it (the
job then checkpoints and exits), and records the exit code in ``WORKDIR/exit.json`` atomically. The
job thus outlives the process that submitted it and its outcome is never lost, as on a cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    workdir = Path(argv[0])
    command = argv[argv.index("--") + 1 :]
    started = time.time()
    with open(workdir / "job.log", "ab", buffering=0) as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def forward(signum: int, _frame: object) -> None:
            if child.poll() is None:
                child.send_signal(signum)

        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, forward)
        code = child.wait()
    record = {"exit_code": code, "started": started, "ended": time.time()}
    tmp = workdir / "exit.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, workdir / "exit.json")
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
