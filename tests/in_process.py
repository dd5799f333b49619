"""The script's main() inside the test process, for a refusal that comes before any training.

Parsing the command line and reading the rank variables need no process group and no other rank:
main() refuses there in one line and exits, and here that costs no start-up (about 3 s a
process). What it returns is what a launched process gives: the exit code and what it printed.
The end-to-end tests (tests/test_bad_input.py) show the same report crossing a process boundary.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import Run

import llm_ddp_parallel_training as t

# What torchrun or --nproc exports to a rank; none of it may leak in from the test's own environment.
LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_ERROR_FILE",
    t.LAUNCHER_PIPE,
)


def went_past_the_refusal(*args: object) -> None:
    raise AssertionError("main() went on to train: the command line was not refused")


def run_main(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, env=None) -> Run:
    """main(args) with exactly the launch variables in `env`: its exit code and its output.

    Training never starts in the test process: should main() get past the refusal, the test fails
    there, before any signal handler is installed."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(t.STOP, "install", went_past_the_refusal)
    monkeypatch.setattr(t, "run", went_past_the_refusal)
    capsys.readouterr()
    main = getattr(t.main, "__wrapped__", t.main)  # without torchrun's @record, which takes over faulthandler
    started = time.perf_counter()
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        torch.set_flush_denormal(False)  # main() sets it for the process; this process is pytest's
    seconds = time.perf_counter() - started
    out = capsys.readouterr()
    return Run(code, out.out, out.err, seconds)
