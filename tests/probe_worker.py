"""tests/worker.py's jobs, with probes: jobs that look inside a rank where a command line cannot.

The launch, its calls and its results are tests/worker.py's, run by its own loop, which runs each
job of a call from here through this module's run_job: a job whose first argument is "probe:NAME"
runs PROBES[NAME] on the same ranks instead, with the rest of its command line. A probe prints what
it found (rank 0) and returns an exit code, as a job does. A probe costs a few milliseconds; a
launch of its own cost 5 s.

From a test: run_jobs_with_probes(jobs, nproc), which is conftest.run_jobs with this module's run_job.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import worker

import llm_ddp_parallel_training as t

PROBE = "probe:"
command_line = worker.run_job  # one command line, as main() runs it


def dropout_probe(args: list[str], d: t.Dist) -> int:
    """The command line runs as in a real run up to train(); in train()'s place, rank 0 prints
    whether the ranks hold equal weights and whether they drew equal dropout masks."""

    def probe(cfg, d, kit, hooks):  # train()'s signature
        weights = torch.cat([p.detach().flatten() for p in kit.model.parameters()])
        dropped = torch.nn.functional.dropout(torch.ones(4096), p=cfg.dropout, training=True)
        first, second = t.all_gather_tensor(d, torch.stack([weights[:4096], dropped]))
        if d.is_main:
            print("WEIGHTS_EQUAL", torch.equal(first[0], second[0]), "MASKS_EQUAL", torch.equal(first[1], second[1]))
        raise SystemExit(0)

    train, t.train = t.train, probe
    try:
        return command_line(args, d)
    finally:
        t.train = train


def clock_probe(args: list[str], d: t.Dist) -> int:
    """clock_offsets on one machine's clocks, then with rank r's clock set r x 1000 s ahead: rank 0
    prints both (every rank gets every offset; rank 0 alone prints, so lines never interleave)."""
    same = t.clock_offsets(d)
    perf_counter = time.perf_counter
    time.perf_counter = lambda: perf_counter() + 1000.0 * d.rank
    try:
        skewed = t.clock_offsets(d)
    finally:
        time.perf_counter = perf_counter
    if d.is_main:
        print("SAME_MACHINE", *same)
        print("SKEWED", *skewed)
    return 0


def script_probe(args: list[str], d: t.Dist) -> int:
    """The Python file args[0], run on every rank in a namespace of its own, the ranks' default process
    group already joined: what it prints is the job's output, an exception its failure (exit code 1)."""
    try:
        exec(compile(Path(args[0]).read_text(), args[0], "exec"), {"__name__": "__probe__"})
    except Exception:
        traceback.print_exc()
        return 1
    return 0


PROBES: dict[str, Callable[[list[str], t.Dist], int]] = {
    "dropout": dropout_probe,
    "clock": clock_probe,
    "script": script_probe,
}


def run_job(args: list[str], d: t.Dist) -> int:
    if args and args[0].startswith(PROBE):
        return PROBES[args[0].removeprefix(PROBE)](args[1:], d)
    return command_line(args, d)


def run_jobs_with_probes(jobs: dict[str, list[str]], nproc: int | None = None, timeout: float = 240) -> dict:
    """conftest.run_jobs, through this module's run_job: a job may be ["probe:NAME", *args]. {name: Run}."""
    from conftest import run_jobs

    return run_jobs(jobs, nproc, timeout, worker=Path(__file__))
