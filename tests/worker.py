"""Many runs of the script in launches that stay up, for tests whose subject is not the launch itself.

Started by torchrun (or as one plain process), the ranks join one process group, then run each
job's command line through the script's own parse_args() and run(), and report a failure through
its report_failure(), exactly as main() does for one command line. Starting Python, importing
torch and meeting costs about 5 s a launch on a 2-core machine; a tiny run costs well under one.
So the ranks stay up: they serve one batch of jobs after another (a "call"), for every test file
that a pytest process runs (conftest.run_jobs keeps one such launch per number of ranks).

    torchrun --standalone --nproc-per-node=2 tests/worker.py FOLDER PARENT_PID

FOLDER/call<N>.json, written by the test process, is {"cwd": ..., "jobs": [{"name", "args",
"runner"}]}; the ranks take the calls in order N = 0, 1, ..., and each writes
FOLDER/call<N>.rank<R>.json: {name: {"returncode", "stdout", "stderr", "seconds"}}, the job's own
output only, and its time. (Only what a process prints through sys.stdout and sys.stderr is
captured; the stop machinery's raw writes are not, and tests of signals launch their own runs.) A
job's "runner" names the module whose run_job runs it: this one, or one that adds probes
(tests/probe_worker.py, tests/parallelism_worker.py, tests/sharding_api_worker.py). FOLDER/stop
(or the test process, PARENT_PID, gone) ends the launch. An idle rank waits on its FIFO,
FOLDER/wake.rank<R>, into which the test process writes a byte after each call file and the stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import io
import json
import os
import select
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import llm_ddp_parallel_training as t

# An idle rank sleeps in select() on its FIFO (FOLDER/wake.rank<R>), which the test process writes a byte
# into after each call it writes and when it asks the launch to end (conftest.Ranks.wake): woken at once, and
# otherwise up only once a LOOK_S to see whether the test process has gone. (It used to look for the next call
# every 50 ms: 0.3 % of a core per idle rank, with a dozen ranks idle for most of a test session.)
LOOK_S = 1.0


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


def runner(name: str):
    """The run_job of module `name`: this module's own, or that of a worker with probes."""
    return run_job if name == "worker" else importlib.import_module(name).run_job


def serve_call(call: dict, number: int, d: t.Dist) -> dict:
    """Each job of one call, in order: {name: its exit code and its output on this rank}."""
    os.chdir(call["cwd"])  # the test's folder: a relative path in a job names a file there
    results = {}
    for i, job in enumerate(call["jobs"]):
        # Each job meets in a store of its own: the script's meetings count arrivals under fixed keys.
        own = dataclasses.replace(d, store=dist.PrefixStore(f"call{number}_job{i}", d.store)) if d.distributed else d
        out, err, started = io.StringIO(), io.StringIO(), time.perf_counter()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = runner(job["runner"])(job["args"], own)
        results[job["name"]] = {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                                "seconds": time.perf_counter() - started}  # fmt: skip
        # The job's DDP reducer and hooks are cyclic garbage: collected now, while no collective is in
        # flight, not at a random point of a later job, where a rank once aborted ("terminate called
        # without an active exception": the hazard teardown_distributed guards against at exit).
        gc.collect()
        # What survived is kept for good (torch, the lazily imported modules, the script's own state): frozen,
        # the next job's collection looks at that job's objects alone. Unfrozen, each collection walked every
        # object of every import again, 0.1-0.3 s a job on each rank (a third of a tiny job's time).
        gc.freeze()
        if d.distributed:
            dist.barrier()
    return results


def next_call(folder: Path, number: int, parent: int, wake: int) -> dict | None:
    """Wait for call <number>; None once the test process asks the launch to end, or has gone. `wake`: this
    rank's FIFO, open for reading and writing (so that it never reads as closed, and select() blocks on it)."""
    path = folder / f"call{number}.json"
    while not path.exists():
        if (folder / "stop").exists():
            return None
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            return None
        if select.select([wake], [], [], LOOK_S)[0]:
            with contextlib.suppress(BlockingIOError):
                os.read(wake, 4096)  # the bytes only wake; the files say what to do
    return json.loads(path.read_text())


def write_atomically(path: Path, text: str) -> None:
    """Written whole under another name, then renamed: a reader never sees half a file."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)


def main(folder: str, parent: str) -> None:
    torch.set_flush_denormal(True)  # as main() does
    os.environ.pop("TORCHELASTIC_ERROR_FILE", None)  # a job's error is its result, not the worker's
    folder = Path(folder)
    d = t.setup_distributed(t.parse_args(["--cpu", "--timeout-s", "120"]))
    gc.freeze()  # the imports: no job's collection need look at them (serve_call)
    fifo = folder / f"wake.rank{d.rank}"
    os.mkfifo(fifo)
    wake = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    write_atomically(folder / f"ready.rank{d.rank}", "")
    number = 0
    while (call := next_call(folder, number, int(parent), wake)) is not None:
        write_atomically(folder / f"call{number}.rank{d.rank}.json", json.dumps(serve_call(call, number, d)))
        number += 1
    t.teardown_distributed()


if __name__ == "__main__":
    sys.modules.setdefault("worker", sys.modules["__main__"])  # the probe workers' `import worker`: this one
    main(*sys.argv[1:])
