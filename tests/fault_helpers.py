"""What the fault tests share: one training run's command line, its weights compared bit for bit,
and a signal sent to a running job at a chosen step."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from conftest import TINY, child_env

RUN = [
    *TINY,
    "--dropout",
    "0.1",
    "--optimizer",
    "sgd",
    "--lr",
    "0.5",
    "--max-steps",
    "120",
    "--save-every",
    "40",
    "--log-every",
    "10",
]


def signal_at_step(cmd: list[str], step: int, send: Callable[[int], None]) -> tuple[int, str, float]:
    """Start torchrun, wait until it logs `step`, call send(torchrun's pid), then collect the rest.

    Returns the exit code, everything printed, and the seconds from the signal to the exit.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                            start_new_session=True)  # fmt: skip
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(f"step {step:>5}/"):
                break
        sent = time.perf_counter()
        send(proc.pid)
        output = "".join(seen) + proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, output, time.perf_counter() - sent


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's workers), from /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
    return children
