"""Many runs of the script in one launch, for tests whose subject is not the launch itself.

Started by torchrun (or as one plain process), the ranks join one process group, then run each
job's command line through the script's own parse_args() and run(), and report a failure through
its report_failure(), exactly as main() does for one command line. Starting Python, importing
torch and meeting costs about 5 s a launch on a 2-core machine; a tiny run costs well under one.

    torchrun --standalone --nproc-per-node=2 tests/worker.py JOBS.json RESULTS_DIR

JOBS.json is a list of {"name": ..., "args": [...]}; each rank writes RESULTS_DIR/rank<R>.json:
{name: {"returncode", "stdout", "stderr"}} with the job's own output only. (Only what a process
prints through sys.stdout and sys.stderr is captured; the stop machinery's raw writes are not,
and tests of signals launch their own runs.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import llm_ddp_parallel_training as t


def run_job(args: list[str], d: t.Dist) -> int:
    """One command line, as main() runs it once the ranks have met: its exit code."""
    cfg = None
    try:
        cfg = t.parse_args(args)
        t.run(cfg, t.laid_out(d, cfg), time.perf_counter())  # a split model lays the ranks out its own way
        return 0
    except SystemExit as e:  # a clean stop, or a restart that stays stopped
        return e.code if isinstance(e.code, int) else 1
    except (t.UsageError, t.TrainingError, RuntimeError) as e:
        return t.report_failure(e, cfg, d)
    finally:
        t.OUTPUT_LOCK.release()  # as main() does; the next job writes into another folder


def main(jobs_file: str, results_dir: str) -> None:
    torch.set_flush_denormal(True)  # as main() does
    os.environ.pop("TORCHELASTIC_ERROR_FILE", None)  # a job's error is its result, not the worker's
    jobs = json.loads(Path(jobs_file).read_text())
    d = t.setup_distributed(t.parse_args(["--cpu", "--timeout-s", "120"]))
    results = {}
    for i, job in enumerate(jobs):
        # Each job meets in a store of its own: the script's meetings count arrivals under fixed keys.
        own = dataclasses.replace(d, store=dist.PrefixStore(f"job_{i}", d.store)) if d.distributed else d
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run_job(job["args"], own)
        results[job["name"]] = {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
        # The job's DDP reducer and hooks are cyclic garbage: collected now, while no collective is in
        # flight, not at a random point of a later job, where a rank once aborted ("terminate called
        # without an active exception": the hazard teardown_distributed guards against at exit).
        gc.collect()
        if d.distributed:
            dist.barrier()
    Path(results_dir, f"rank{d.rank}.json").write_text(json.dumps(results))
    t.teardown_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
