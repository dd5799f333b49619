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
from torch.utils._python_dispatch import TorchDispatchMode

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

    return run_replaced("train", probe, args, d)


def run_replaced(name: str, value: object, args: list[str], d: t.Dist) -> int:
    """The command line as a real run, the script's `name` replaced by `value` while it runs."""
    kept = getattr(t, name)
    setattr(t, name, value)
    try:
        return command_line(args, d)
    finally:
        setattr(t, name, kept)


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


class HostReads(TorchDispatchMode):
    """Counts, in the ops it sees, what makes a host wait for a GPU: a tensor's value read (.item(), float(),
    bool(): aten._local_scalar_dense), a nonzero, or an index by a boolean mask (a nonzero inside). On this
    CPU .tolist() reaches no dispatcher: Tensor.tolist is wrapped to count it too. Not counted: torch DDP's
    reducer reading its int32 map of used parameters (find_unused_parameters), which it keeps in host memory
    under CUDA too (reducer.cpp, finalize_bucket_dense): a read of the host's own memory."""

    SYNCS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select")

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        masked = name == "aten.index" and any(i is not None and i.dtype == torch.bool for i in args[1])
        used_map = name == "aten._local_scalar_dense" and args[0].dtype == torch.int32
        if (name in self.SYNCS or masked) and not used_map:
            self.found.append(f"{name} in {reader()}")
        return func(*args, **(kwargs or {}))


def reader() -> str:
    """Who read: the innermost caller outside torch and this file, as module.function."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        module = Path(frame.filename).stem
        if "/torch/" not in frame.filename and module != "probe_worker":
            return f"{module}.{frame.name}"
    return "torch"


def host_reads_probe(args: list[str], d: t.Dist) -> int:
    """The command line as a real run, each step's device work watched by HostReads: from the step's first
    "sync" mark (after the batch is on the device and the Gloo vote is counted) to step_done. Rank 0 prints
    a line `HOST_READS step N: op, op, ...` for each step."""
    side, tolist, watching = t.SideWork, torch.Tensor.tolist, []

    def counted_tolist(tensor: torch.Tensor) -> object:
        for mode in watching:
            mode.found.append(f"Tensor.tolist in {reader()}")
        return tolist(tensor)

    class Watched(side):
        def mark(self, phase: str) -> None:
            super().mark(phase)
            if phase == "sync" and not watching:
                watching.append(HostReads())
                watching[0].__enter__()

        def step_done(self, metrics: dict, *rest: object) -> None:
            mode = watching.pop()
            mode.__exit__(None, None, None)
            if d.is_main:
                print(f"HOST_READS step {metrics['step']}: {', '.join(mode.found)}", flush=True)
            super().step_done(metrics, *rest)

    t.SideWork, torch.Tensor.tolist = Watched, counted_tolist
    try:
        return command_line(args, d)
    finally:  # a run that failed mid-step (a non-finite loss, read late) leaves its mode entered: the next job's not
        for mode in reversed(watching):
            mode.__exit__(None, None, None)
        t.SideWork, torch.Tensor.tolist = side, tolist


def compiled_blocks_probe(args: list[str], d: t.Dist) -> int:
    """The command line as a real run up to its first step: then rank 0 prints, for each block, whether the forward
    --compile compiled is the one its class has now (after fully_shard made it a subclass, whose forward is the one
    transformers' checkpointing wraps outermost), and stops."""

    class Started(t.SideWork):
        def start(self, *args: object) -> t.Progress:
            super().start(*args)
            wrapped = [
                block.forward._torchdynamo_orig_callable.__func__ is type(block).forward for block in self.kit.blocks
            ]
            if d.is_main:
                print("COMPILED_AS_WRAPPED", *wrapped, type(self.kit.blocks[0]).__name__, flush=True)
            raise SystemExit(0)

    return run_replaced("SideWork", Started, args, d)


PROBES: dict[str, Callable[[list[str], t.Dist], int]] = {
    "host_reads": host_reads_probe,
    "compiled_blocks": compiled_blocks_probe,
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
