"""Measure what each --sharding strategy keeps in every rank's memory, and what it costs in step time.

    python benchmarks/memory.py            # the full measurement: 12-15 minutes on 2 CPU cores (two runs)
    python benchmarks/memory.py --smoke    # 3 small runs of 2 steps: checks the harness

Each run trains through llm_ddp_parallel_training.py as a user would start it (`--cpu --nproc N`,
a plain process for 1 rank), Gloo, fp32, AdamW, in a folder of its own, and reads back the
OUTPUT_DIR/memory.json the script writes: every rank's parameters, gradients and optimizer state
in bytes, counted from the live tensors, beside what the ZeRO arithmetic predicts, the largest
FSDP unit when gathered, and the peak resident set (RSS) of the rank's process.

The runs:

    tiny model     TINY_MODEL (d 512, 4 layers: 12.9 M parameters, 197 MiB of training state per
                   whole copy), --sharding none / optimizer / full at 1, 2 and 4 ranks, with torch's
                   DDP / ZeroRedundancyOptimizer / fully_shard and with the from-scratch ManualDDP /
                   ShardedOptimizer / ManualFSDP (--ddp torch / manual)
    Qwen fixture   tests/tiny_qwen.py's model as its CLI builds it, --finetune full and --finetune
                   lora, the same strategies and rank counts, --ddp torch

Step time: the script logs every step (--log-every 1) to --metrics-file; each record's real tokens
over its tokens/s is the wall-clock time rank 0 spent in that step (data, forward, backward, every
collective, optimizer; not evaluation, checkpoints or start-up). The median of the steps after the
first WARMUP is reported. The goal's runs (tiny model, 2 ranks) run in --repeats rounds, each
round's runs side by side in time; each ratio to none is taken within a round, and the rounds'
median reported (a shared machine drifts: rounds keep that out of the ratio). Every rank runs one
thread (OMP_NUM_THREADS=1, what torchrun sets): on a 2-core machine 4 ranks share 2 cores, and
their step times say more about that than about sharding.

Goal (issue text): at 2 ranks each sharded strategy's step time is at most GOAL x --sharding
none's on the tiny model, from-scratch and torch's alike (each against none of its own --ddp).

Writes benchmarks/memory_results.md and docs/memory.png (--smoke: into --out, or only prints, so
that a smoke run never replaces the measured numbers). The runs write into a temp folder, removed
at the end, also when a run fails or the benchmark is stopped; --out DIR keeps them in DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # also when it is loaded as a module, as a test does
from benchmark import in_output_folder, output_flags, publish  # noqa: E402  (what the benchmarks share)

SCRIPT = REPO / "llm_ddp_parallel_training.py"
TINY_QWEN = REPO / "tests" / "tiny_qwen.py"
TABLE = REPO / "benchmarks" / "memory_results.md"
FIGURE = REPO / "docs" / "memory.png"

# The tiny model every tiny run trains, named in full on every command line, so that the numbers
# keep describing the same model when the script's defaults change: d 512, 8 heads, 4 layers,
# sequence 128, batch 8 per rank: 12.9 M parameters, 49 MiB of fp32 weights, as much again of
# gradients and twice that of AdamW moments, against a process of some 550 MiB before training.
TINY_MODEL = ["--d-model", "512", "--n-heads", "8", "--n-layers", "4", "--seq-len", "128", "--batch-size", "8"]
SMOKE_MODEL = ["--d-model", "64", "--n-heads", "2", "--n-layers", "2", "--seq-len", "32", "--batch-size", "2"]
QWEN_RUN = ["--seq-len", "64", "--batch-size", "8", "--dtype", "float32"]
SMOKE_QWEN_RUN = ["--seq-len", "32", "--batch-size", "2", "--dtype", "float32"]
# Every run: fp32 AdamW on the CPU, no held-out lines (no evaluation inside the timed loop), every
# step logged (the step times), a one-token sample (the sample is not what is measured).
COMMON = ["--cpu", "--optimizer", "adamw", "--precision", "fp32", "--val-fraction", "0", "--log-every", "1",
          "--sample-tokens", "1"]  # fmt: skip
SHARDINGS = ("none", "optimizer", "full")
GOAL = 1.25  # at 2 ranks, a sharded strategy's step time against --sharding none's, tiny model
MIB = 2**20
STATE = ("parameters", "gradients", "optimizer_state")
OFF_LIMIT = 0.02  # measured state more than 2% off the prediction is reported


@dataclass(frozen=True)
class Run:
    model: str  # "tiny", "qwen-full" or "qwen-lora"
    sharding: str
    ddp: str
    nproc: int

    @property
    def name(self) -> str:
        return f"{self.model}-{self.sharding}-{self.ddp}-n{self.nproc}"

    @property
    def strategy(self) -> str:
        return self.sharding if self.nproc == 1 else f"{self.sharding} ({self.ddp})"


def plan(smoke: bool) -> list[Run]:
    """Every run, in the order they run. At 1 rank --ddp does nothing (there is no DDP) and the
    script trains every --sharding the same, saying so: those rows check the N=1 arithmetic."""
    if smoke:  # 1 and 2 ranks, each strategy, each --ddp and the Qwen path, in three runs (a goal line
        # would take a fourth, --sharding none at 2 ranks: tests/test_memory_benchmark.py checks it in-process)
        return [Run("tiny", "none", "torch", 1), Run("tiny", "optimizer", "manual", 2),
                Run("qwen-full", "full", "torch", 2)]  # fmt: skip
    runs = []
    for nproc in (1, 2, 4):
        ddps = ("torch",) if nproc == 1 else ("torch", "manual")
        runs += [Run("tiny", s, ddp, nproc) for s in SHARDINGS for ddp in ddps]
    for model, nproc in itertools.product(("qwen-full", "qwen-lora"), (1, 2, 4)):
        runs += [Run(model, s, "torch", nproc) for s in SHARDINGS]
    return runs


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK"}}
    # One thread per rank for every run, as torchrun sets it when it starts several ranks (--nproc
    # sets it too; the 1-rank run is given the same, so that 1 rank compares with N).
    return env | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


# Every child, each the leader of its own process group (--nproc's ranks are in it), so that a
# timeout or a stop ends a run's ranks with it before its folder is removed.
CHILDREN: list[subprocess.Popen] = []


def run_child(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    CHILDREN.append(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_children(grace=10)
        raise SystemExit(f"benchmark run timed out after {timeout:.0f} s: {shlex.join(cmd)}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop_children(grace: float = 30) -> None:
    """End every child still running, ranks included: SIGTERM to its process group first (the
    script stops cleanly), SIGKILL for any still there after `grace` seconds."""
    alive = [proc for proc in CHILDREN if proc.poll() is None]
    for proc in alive:
        signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in alive:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            proc.wait()


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # ended meanwhile
        os.killpg(proc.pid, sig)


RUN_NUMBERS = itertools.count(1)


def run_dir(parent: Path, name: str) -> Path:
    """A folder of its own for one run: the script keeps one run per folder, and a fresh folder
    means nothing is left from the last."""
    return parent / f"{name}-{next(RUN_NUMBERS)}"


def command(run: Run, folder: Path, steps: int, smoke: bool, qwen_dir: Path | None) -> list[str]:
    if run.model == "tiny":
        model = SMOKE_MODEL if smoke else TINY_MODEL
    else:
        finetune = run.model.removeprefix("qwen-")
        model = ["--model", "qwen", "--model-name-or-path", str(qwen_dir), "--finetune", finetune,
                 *(SMOKE_QWEN_RUN if smoke else QWEN_RUN)]  # fmt: skip
    args = [*COMMON, *model, "--sharding", run.sharding, "--ddp", run.ddp, "--max-steps", str(steps),
            "--output-dir", str(folder), "--metrics-file", str(folder / "metrics.jsonl")]  # fmt: skip
    return [sys.executable, str(SCRIPT), *args, *(["--nproc", str(run.nproc)] if run.nproc > 1 else [])]


def step_seconds(metrics: Path) -> list[float]:
    """Every step's seconds on rank 0's clock: with --log-every 1 each record is one step, and its
    real tokens (the growth of tokens_seen) over its tokens/s is the time the script measured."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    seen = [0] + [r["tokens_seen"] for r in records]
    return [(seen[i + 1] - seen[i]) / r["tokens_per_sec"] for i, r in enumerate(records)]


def measure_run(run: Run, out: Path, steps: int, warmup: int, smoke: bool, qwen_dir: Path | None) -> dict:
    folder = run_dir(out, run.name)
    cmd = command(run, folder, steps, smoke, qwen_dir)
    start = time.perf_counter()
    done = run_child(cmd, timeout=300)  # the smoke's runs too: 60 s was once too short on a busy machine
    if done.returncode:
        raise SystemExit(f"benchmark run failed: {shlex.join(cmd)}\n{done.stdout}\n{done.stderr}")
    seconds = step_seconds(folder / "metrics.jsonl")
    ranks = json.loads((folder / "memory.json").read_text())
    if sorted(r["rank"] for r in ranks) != list(range(run.nproc)):
        raise SystemExit(f"{folder / 'memory.json'} has ranks {[r['rank'] for r in ranks]}, not 0-{run.nproc - 1}")
    step_ms = 1000 * statistics.median(seconds[warmup:])
    return {
        "run": run.__dict__,
        "command": cmd,
        "step_ms": step_ms,  # the median over rounds, once there are several
        "rounds": [{"step_ms": step_ms, "steps_ms": [1000 * s for s in seconds], "warmup": warmup}],
        "wall_s": time.perf_counter() - start,
        "ranks": sorted(ranks, key=lambda r: r["rank"]),
    }


def is_goal_run(run: Run) -> bool:
    return run.model == "tiny" and run.nproc == 2


def start_qwen_build(out: Path) -> tuple[Path, list[str], subprocess.Popen]:
    """The Qwen fixture as its CLI builds it (the CLI takes no sizes), started in the background."""
    folder = out / "tiny-qwen"
    cmd = [sys.executable, str(TINY_QWEN), str(folder)]
    proc = subprocess.Popen(
        cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    CHILDREN.append(proc)
    return folder, cmd, proc


def finish_qwen_build(cmd: list[str], proc: subprocess.Popen) -> None:
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"building the Qwen fixture timed out: {shlex.join(cmd)}") from None
    if proc.returncode:
        raise SystemExit(f"building the Qwen fixture failed: {shlex.join(cmd)}\n{output}")


# ---- the tables ----------------------------------------------------------------------------


def mib(nbytes: float) -> str:
    return f"{nbytes / MIB:,.2f}"


def off(measured: int, predicted: int) -> float | None:
    return (measured - predicted) / predicted if predicted else None


def state_off(rank: dict) -> float | None:
    return off(sum(rank[k] for k in STATE), sum(rank["predicted"][k] for k in STATE))


def baselines(results: list[dict]) -> dict[tuple, dict]:
    """--sharding none's result for each (model, --ddp, ranks); at 1 rank, for every --ddp."""
    base = {}
    for r in results:
        run = Run(**r["run"])
        if run.sharding == "none":
            ddps = ("torch", "manual") if run.nproc == 1 else (run.ddp,)
            base |= {(run.model, ddp, run.nproc): r for ddp in ddps}
    return base


def round_ratios(result: dict, base: dict[tuple, dict]) -> list[float]:
    """Step time against --sharding none's of the same --ddp and ranks, within each round."""
    run = Run(**result["run"])
    none = base.get((run.model, run.ddp, run.nproc))
    if none is None:
        return []
    pairs = zip(result["rounds"], none["rounds"], strict=False)  # a 1-rank none ran once: round 1 only
    return [a["step_ms"] / b["step_ms"] for a, b in pairs]


def ratio_to_none(result: dict, base: dict[tuple, dict]) -> float | None:
    """The median of the rounds' ratios: each taken between runs that ran side by side in time."""
    ratios = round_ratios(result, base)
    return statistics.median(ratios) if ratios else None


def memory_table(results: list[dict]) -> list[str]:
    """One row per (model, strategy, ranks, rank): measured MiB with the prediction in brackets."""
    base = baselines(results)
    lines = [
        "| model | strategy | ranks | rank | parameters | gradients | optimizer state | state vs predicted "
        "| largest unit | peak RSS | step ms | vs none |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        run = Run(**r["run"])
        ratio = ratio_to_none(r, base)
        for rank in r["ranks"]:
            cells = [f"{mib(rank[k])} ({mib(rank['predicted'][k])})" for k in STATE]
            gap = state_off(rank)
            first = rank["rank"] == 0
            step = f"{r['step_ms']:,.0f}" if first else ""
            versus = f"{ratio:.2f}x" if first and ratio is not None else ""
            unit = mib(rank["largest_unit"]) if rank["largest_unit"] else "-"
            lines.append(
                f"| {run.model} | {run.strategy} | {run.nproc} | {rank['rank']} | {' | '.join(cells)} | "
                f"{'-' if gap is None else f'{100 * gap:+.1f}%'} | {unit} | {mib(rank['peak'])} | {step} | {versus} |"
            )
    return lines


def step_table(results: list[dict]) -> list[str]:
    """Step time, ms, by (model, strategy) and ranks, with the ratio to none of the same --ddp and ranks."""
    base = baselines(results)
    counts = sorted({r["run"]["nproc"] for r in results})
    cells: dict[tuple[str, str, str], dict[int, str]] = {}
    for r in results:
        run = Run(**r["run"])
        ratio = ratio_to_none(r, base)
        ddp = run.ddp if run.nproc > 1 else "-"
        row = cells.setdefault((run.model, run.sharding, ddp), {})
        row[run.nproc] = f"{r['step_ms']:,.0f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")
    # 1 rank has no --ddp: its cell stands in both rows of its model and --sharding.
    for (model, sharding, ddp), row in cells.items():
        if ddp != "-" and 1 not in row and (one := cells.get((model, sharding, "-"), {}).get(1)):
            row[1] = one
    lines = [
        "| model | --sharding | --ddp | " + " | ".join(f"{n} rank{'s' * (n > 1)}" for n in counts) + " |",
        "|---|---|---|" + "--:|" * len(counts),
    ]
    for (model, sharding, ddp), row in cells.items():
        if ddp == "-" and any(k[:2] == (model, sharding) and k[2] != "-" for k in cells):
            continue  # shown in the rows with a --ddp
        lines.append(f"| {model} | {sharding} | {ddp} | " + " | ".join(row.get(n, "") for n in counts) + " |")
    return lines


def spread(result: dict) -> str:
    """The counted steps' range over every round, fastest to slowest, in ms."""
    counted = [ms for x in result["rounds"] for ms in x["steps_ms"][x["warmup"] :]]
    return f"{min(counted):,.0f}-{max(counted):,.0f}"


def goal_lines(results: list[dict]) -> list[str]:
    """The issue's goal: at 2 ranks, tiny model, each sharded strategy against none of its --ddp."""
    base = baselines(results)
    lines = []
    for r in results:
        run = Run(**r["run"])
        if run.model == "tiny" and run.nproc == 2 and run.sharding != "none":
            ratio = ratio_to_none(r, base)
            if ratio is None:
                continue
            none = base[(run.model, run.ddp, run.nproc)]
            verdict = "met" if ratio <= GOAL else "missed"
            rounds = ", ".join(f"{x:.2f}x" for x in round_ratios(r, base))
            lines.append(
                f"- `--sharding {run.sharding} --ddp {run.ddp}` against `--sharding none --ddp {run.ddp}`: "
                f"**{ratio:.2f}x**, goal <= {GOAL}x: **{verdict}**. The median of the rounds' ratios ({rounds}); "
                f"median step time {r['step_ms']:,.0f} ms vs {none['step_ms']:,.0f} ms, single steps "
                f"{spread(r)} ms vs {spread(none)} ms"
            )
    return lines


def discrepancies(results: list[dict]) -> list[str]:
    """Every measured state figure more than OFF_LIMIT off its prediction, and a 1-rank run of a
    sharding strategy whose state differs from the 1-rank --sharding none run of the same model."""
    lines = []
    for r in results:
        run = Run(**r["run"])
        for rank in r["ranks"]:
            for k in STATE:
                gap = off(rank[k], rank["predicted"][k])
                if gap is not None and abs(gap) > OFF_LIMIT:
                    lines.append(
                        f"- {run.model}, {run.strategy}, {run.nproc} ranks, rank {rank['rank']}: {k} "
                        f"{rank[k]:,} bytes measured vs {rank['predicted'][k]:,} predicted ({100 * gap:+.1f}%)"
                    )
    alone = {
        r["run"]["model"]: r["ranks"][0] for r in results if r["run"]["nproc"] == 1 and r["run"]["sharding"] == "none"
    }
    for r in results:
        run, none = Run(**r["run"]), alone.get(r["run"]["model"])
        if run.nproc == 1 and run.sharding != "none" and none:
            differ = [k for k in STATE if r["ranks"][0][k] != none[k]]
            if differ:
                lines.append(
                    f"- {run.model}, --sharding {run.sharding} in one process holds other state than "
                    f"--sharding none: "
                    + ", ".join(f"{k} {mib(r['ranks'][0][k])} vs {mib(none[k])} MiB" for k in differ)
                )
    return lines


def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.SubprocessError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return (
        f"{model}, {os.cpu_count()} logical CPUs; Python {platform.python_version()}, torch {torch.__version__}, "
        f"{platform.system()} {platform.release()}"
    )


def report(
    results: list[dict], commands: list[list[str]], out: Path, kept: bool, smoke: bool, figure: Path | None
) -> str:
    lines = [
        "# Memory per rank and step time, by --sharding",
        "",
        "Written by `python benchmarks/memory.py`"
        + (" --smoke (sizes too small to mean anything)" if smoke else "")
        + f" on {time.strftime('%Y-%m-%d')}.",
        "",
        f"Machine: {machine()}. Every rank runs one thread (`OMP_NUM_THREADS=1`); Gloo; fp32; AdamW. "
        f"With 4 ranks on {os.cpu_count()} cores the ranks share cores "
        + ("(oversubscribed): 4-rank step times measure that more than sharding." if os.cpu_count() < 4 else "."),
        "",
        "Each cell is MiB measured on that rank, from the script's `OUTPUT_DIR/memory.json` (every live "
        "tensor's storage counted once), with what the ZeRO arithmetic predicts in brackets. *state vs predicted* "
        "is parameters + gradients + optimizer state against the prediction's sum. *largest unit*: the largest "
        "FSDP unit when gathered. *peak RSS*: the rank's peak resident set, the whole process (Python, torch, "
        "data, activations). *step ms*: rank 0's wall-clock time per training step, the median of the steps "
        f"after the first {WARMUP if not smoke else SMOKE_WARMUP} (each step's real tokens over its tokens/s, "
        "as the script logs it with `--log-every 1` in `--metrics-file`). *vs none*: that step time against "
        "`--sharding none` with the same `--ddp` and ranks. The goal's runs (tiny model, 2 ranks) ran in "
        f"{max(len(r['rounds']) for r in results)} rounds, each round's runs side by side in time: their step "
        "time is the median over the rounds, and *vs none* the median of the rounds' ratios.",
        "",
        *memory_table(results),
        "",
        "## Step time, ms (against `--sharding none` with the same `--ddp` and ranks)",
        "",
        "What sharding costs in communication: ZeRO-1 keeps DDP's all-reduce and adds, after each update, a "
        "broadcast of every parameter from the rank that updated it; FSDP replaces the all-reduce by an "
        "all-gather of each unit's weights before its forward and again before its backward, and a "
        "reduce-scatter of its gradients: 1.5x the bytes of an all-reduce, in more, smaller messages.",
        "",
        *step_table(results),
        "",
        "## Goal: at 2 ranks, each sharded strategy's step time <= 1.25x `--sharding none`'s (tiny model)",
        "",
        *(goal_lines(results) or ["- no 2-rank tiny runs to compare"]),
        "",
        f"## Measured state more than {100 * OFF_LIMIT:.0f}% off the prediction",
        "",
        "The prediction is an exact 1/N split. ZeRO-1 (torch's and ours) deals whole parameters to ranks, "
        "largest first, so one rank's share of the optimizer state can be off by up to a parameter's moments, "
        "while the ranks' total is exact; FSDP splits every parameter, so it matches to the byte.",
        "",
        *(discrepancies(results) or ["- none"]),
        "",
    ]
    if figure:
        lines += [f"Figure: `{figure.relative_to(REPO) if figure.is_relative_to(REPO) else figure}`.", ""]
    lines += [
        "## Commands",
        "",
        f"`$OUT` is the benchmark's folder for the runs ({f'kept: {out}' if kept else 'a temp folder, removed'}). "
        "The goal's runs ran again in each further round, the same commands into new folders.",
        "",
        "```",
        *(f"OMP_NUM_THREADS=1 {shlex.join(cmd)}".replace(str(out), "$OUT") for cmd in commands),
        "```",
        "",
    ]
    return "\n".join(lines)


# ---- the figure ----------------------------------------------------------------------------

COLOURS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868"}


def draw(results: list[dict], path: Path) -> None:
    """Per rank, training state as stacked bars (top row) and peak RSS with the state inside it
    (bottom row), one column per (model, ranks); each strategy's step time above its bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(model, n) for model, n in (("tiny", 2), ("tiny", 4), ("qwen-full", 2))
              if any(r["run"]["model"] == model and r["run"]["nproc"] == n for r in results)]  # fmt: skip
    fig, axes = plt.subplots(2, len(panels), figsize=(6.2 * len(panels), 8.5), squeeze=False, layout="constrained")
    base = baselines(results)
    for col, (model, nproc) in enumerate(panels):
        group = [r for r in results if r["run"]["model"] == model and r["run"]["nproc"] == nproc]
        alone = next((r["ranks"][0] for r in results if r["run"] == Run(model, "none", "torch", 1).__dict__), None)
        ticks, labels, x = [], [], 0.0
        for r in group:
            run = Run(**r["run"])
            xs = [x + i for i in range(nproc)]
            for row, ax in enumerate(axes[:, col]):
                bottom = [0.0] * nproc
                if row == 1:
                    peaks = [rank["peak"] / MIB for rank in r["ranks"]]
                    ax.bar(xs, peaks, color="#c8c8c8", edgecolor="#555555", linewidth=0.6, label="peak RSS")
                for k in STATE:
                    heights = [rank[k] / MIB for rank in r["ranks"]]
                    ax.bar(xs, heights, bottom=bottom, color=COLOURS[k], label=k.replace("_", " "))
                    bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
                if row == 0:
                    ratio = ratio_to_none(r, base)
                    note = f"{r['step_ms']:,.0f} ms" + (f"\n{ratio:.2f}x" if ratio and run.sharding != "none" else "")
                    ax.text(sum(xs) / nproc, max(bottom) * 1.02, note, ha="center", va="bottom", fontsize=8)
            ticks.append(sum(xs) / nproc)
            labels.append(f"{run.sharding}\n{run.ddp}")
            x += nproc + 1
        whole = [r["ranks"][0]["parameters"] for r in group if r["run"]["sharding"] == "none"]
        title = {"tiny": "tiny model", "qwen-full": "Qwen fixture, --finetune full"}[model]
        title += f" ({mib(whole[0])} MiB of weights)" if whole else ""
        top, bottom_ax = axes[0, col], axes[1, col]
        top.set_title(f"{title}, {nproc} ranks\ntraining state per rank (bars: ranks 0..{nproc - 1})", fontsize=10)
        bottom_ax.set_title("peak RSS per rank (whole process), state inside", fontsize=10)
        if alone:
            line = {"color": "black", "linestyle": "--", "linewidth": 0.8, "label": "1 process, --sharding none"}
            top.axhline(sum(alone[k] for k in STATE) / MIB, **line)
            bottom_ax.axhline(alone["peak"] / MIB, **line)
        for ax in (top, bottom_ax):
            ax.set_xticks(ticks, labels, fontsize=8)
            ax.set_xlim(-0.8, max(x, 3 * (nproc + 1)) - 1.2)  # bars of one width in every panel
            ax.set_ylabel("MiB")
            ax.margins(y=0.15)
            ax.grid(axis="y", alpha=0.3)
    handles, names = axes[1, 0].get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    fig.legend(unique.values(), unique.keys(), loc="outside lower center", ncol=len(unique), frameon=False)
    fig.suptitle("Memory per rank by --sharding (Gloo, CPU, fp32 AdamW); step time and its ratio to none above")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the benchmark -------------------------------------------------------------------------

STEPS, WARMUP = 12, 4  # the first steps touch fresh memory and warm caches: not counted
SMOKE_STEPS, SMOKE_WARMUP = 2, 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="3 runs at small sizes, 2 steps each: 1 and 2 ranks, each --sharding and --ddp, the Qwen fixture once; "
        "checks the harness (its numbers mean nothing)",
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds of the goal's runs (tiny model, 2 ranks)")
    output_flags(p, "; with --smoke the table and figure go here too")
    args = p.parse_args()

    def work(out: Path, removed: bool) -> None:
        if args.smoke:  # the smoke's numbers mean nothing: never over the measured ones
            table, figure = (out / TABLE.name, out / FIGURE.name) if args.out else (None, None)
        else:
            table, figure = TABLE, FIGURE
        measure(out, args.smoke, 1 if args.smoke else args.repeats, table, figure, kept=not removed)

    in_output_folder(args.out, args.keep_outputs, "memory-benchmark-", work, stop_children)


def measure(out: Path, smoke: bool, repeats: int, table: Path | None, figure: Path | None, kept: bool) -> None:
    runs = plan(smoke)
    steps, warmup = (SMOKE_STEPS, SMOKE_WARMUP) if smoke else (STEPS, WARMUP)
    qwen_dir, commands, build = None, [], None
    if any(run.model != "tiny" for run in runs):
        qwen_dir, built, build = start_qwen_build(out)
        commands.append(built)
        if not smoke:  # it would slow the timed runs down; the smoke's timings mean nothing
            finish_qwen_build(built, build)
    results = []
    for i, run in enumerate(runs, 1):
        if run.model != "tiny" and build.returncode is None:
            finish_qwen_build(built, build)
        result = measure_run(run, out, steps, warmup, smoke, qwen_dir)
        print(f"[{i}/{len(runs)}] {run.name}: {result['step_ms']:,.0f} ms/step, {result['wall_s']:.0f} s", flush=True)
        results.append(result)
        commands.append(result["command"])
    # The goal's runs again, in the same order, so that each round's runs ran side by side in time.
    goal = [r for r in results if is_goal_run(Run(**r["run"]))]
    for round_number in range(2, repeats + 1):
        for r in goal:
            run = Run(**r["run"])
            again = measure_run(run, out, steps, warmup, smoke, qwen_dir)
            r["rounds"].append(again["rounds"][0])
            r["step_ms"] = statistics.median(x["step_ms"] for x in r["rounds"])
            print(f"[round {round_number}/{repeats}] {run.name}: {again['step_ms']:,.0f} ms/step", flush=True)
    (out / "results.json").write_text(json.dumps({"machine": machine(), "results": results}, indent=1))
    if figure:
        draw(results, figure)
    publish(report(results, commands, out, kept, smoke, figure), table, f"\nfigure: {figure}" if figure else "")


if __name__ == "__main__":
    main()
