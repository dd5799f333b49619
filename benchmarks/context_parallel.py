"""Measure what context parallelism (--cp) costs in step time against DDP at long sequences, and what it
saves: each rank's activation memory, 1/N of one process's.

    python benchmarks/context_parallel.py                # 3 rounds and the sweep: 9-12 minutes on 2 CPU cores
    python benchmarks/context_parallel.py --smoke        # one round at small sizes, both parts: checks the harness
    python benchmarks/context_parallel.py --only time    # or --only memory: one part
    python benchmarks/context_parallel.py --ddp torch --ddp manual   # the step times with both --ddp

Every run trains a tiny model (MODEL: d 128, 4 heads, 2 blocks, 0.98 M parameters at 4,096 positions)
through llm_ddp_parallel_training.py as a user starts it (`--cpu --nproc N`, a plain process for one),
Gloo, one thread per rank, fp32 AdamW, in a folder of its own.

Step time, at --seq-len 1,024, 2,048 and 4,096 (the issue's long sequences), each on the same global
batch of 2 * B examples: `--cp 2` on 2 ranks (one replica whose 2 ranks share its batch: `--batch-size
2B`, each rank holding chunks i and 3 - i of every example), 2-rank DDP (`--batch-size B` on each of its
2 replicas) and one process (`--batch-size 2B`, the reference row). The script's `[run]` line names the
global batch; the benchmark checks it is the same for the three. Each run logs every step (--log-every
1) to --metrics-file; a record's real tokens over its tokens/s is the wall-clock time rank 0 spent in
that step, and the median of the steps after the first WARMUP is a run's step time. The runs go in
--repeats rounds, every run once a round, one after the other; each ratio to DDP is taken within its
round (the runs that ran side by side in time) and the rounds' median reported: a shared machine
drifts, and rounds keep that out. --ddp torch by default (torch's DDP averaging the gradient, the ring
inside; `--ddp manual` is bitwise equal to it and adds a round's worth of runs per --ddp named).

Activation memory, at --seq-len 256 to 4,096: one process, `--cp 2` on 2 ranks and `--cp 4` on 4
ranks, each on the same per-replica batch (2B examples), each rank's `activations` read from the
OUTPUT_DIR/memory.json the script writes: the bytes autograd kept for backward from the first
micro-batch (counted with saved_tensors_hooks, each storage once, no weights). Predicted: one
process's bytes / N. One step suffices (it is the first micro-batch's); where the step-time runs
trained that same layout, length and batch (one process and `--cp 2` at 1,024-4,096), their round 1
memory.json is read rather than running again.

Writes benchmarks/context_parallel_results.md (--smoke or --only: only into --out, or only prints, so
that a partial run never replaces the measured numbers). The runs write into a temp folder, removed at
the end, also when a run fails or the benchmark is stopped; --out DIR keeps them in DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # also when it is loaded as a module, as a test does
from benchmark import in_output_folder, output_flags, publish  # noqa: E402  (what the benchmarks share)
from memory import MIB, machine, run_child, step_seconds, stop_children  # noqa: E402  (children killed by group)
from parallelism import COMMON, RUN_TIMEOUT, relative, summary_row  # noqa: E402  (fp32 AdamW, every step logged)

SCRIPT = REPO / "llm_ddp_parallel_training.py"
TABLE = REPO / "benchmarks" / "context_parallel_results.md"

# The model, named in full on every command line so that the numbers keep describing the same model when
# the script's defaults change; --seq-len is each run's own.
MODEL = ["--d-model", "128", "--n-heads", "4", "--n-layers", "2"]
SMOKE_MODEL = ["--d-model", "64", "--n-heads", "2", "--n-layers", "1"]
B = 1  # examples per DDP rank: a global batch of 2B, the per-replica batch of one process and of --cp
TIME_SEQS = (1024, 2048, 4096)
SMOKE_TIME_SEQS = (64,)
MEMORY_SEQS = (256, 512, 1024, 2048, 4096)
SMOKE_MEMORY_SEQS = (64,)
STEPS, WARMUP = 4, 1  # the first step warms caches and connections: not counted (4,096 positions: ~10 s a step)
SMOKE_STEPS, SMOKE_WARMUP = 2, 1
RANKS = 2  # the step-time runs'
MEMORY_CPS = (2, 4)  # the sweep's --cp N, on N ranks
DDPS = ("torch", "manual")
PARTS = ("time", "memory")


@dataclass(frozen=True)
class Run:
    layout: str  # "one" (one process), "ddp" (2 ranks) or "cp" (--cp ranks on as many ranks)
    seq: int
    ddp: str = "-"  # one process has no DDP
    ranks: int = 1
    steps: int = STEPS

    @property
    def name(self) -> str:
        layout = f"cp{self.ranks}" if self.layout == "cp" else self.layout
        return "-".join([layout, *([self.ddp] if self.ddp != "-" else []), f"t{self.seq}"])

    @property
    def label(self) -> str:
        return {"one": "one process", "ddp": f"DDP, {self.ranks} ranks", "cp": f"`--cp {self.ranks}`"}[self.layout]


def time_plan(seqs: Collection[int], ddps: Collection[str], steps: int) -> list[Run]:
    """One round's step-time runs, in the order they run: per length, one process, then each --ddp's DDP and CP."""
    runs = []
    for seq in seqs:
        runs.append(Run("one", seq, steps=steps))
        for ddp in ddps:
            runs += [Run("ddp", seq, ddp, RANKS, steps), Run("cp", seq, ddp, RANKS, steps)]
    return runs


def memory_plan(seqs: Collection[int]) -> list[Run]:
    """The sweep's runs: one step each, --ddp torch (the ring and the activations are the same under either)."""
    runs = []
    for seq in seqs:
        runs.append(Run("one", seq, steps=1))
        runs += [Run("cp", seq, "torch", n, steps=1) for n in MEMORY_CPS]
    return runs


def command(run: Run, folder: Path, smoke: bool) -> list[str]:
    # --batch-size is per data-parallel replica: DDP has two, one process and --cp one.
    batch = B if run.layout == "ddp" else RANKS * B
    args = [*COMMON, *(SMOKE_MODEL if smoke else MODEL), "--seq-len", str(run.seq), "--batch-size", str(batch),
            "--max-steps", str(run.steps), "--output-dir", str(folder),
            "--metrics-file", str(folder / "metrics.jsonl")]  # fmt: skip
    if run.layout == "cp":
        args += ["--cp", str(run.ranks)]
    if run.ddp != "-":
        args += ["--ddp", run.ddp]
    if run.ranks > 1:
        args += ["--nproc", str(run.ranks)]
    return [sys.executable, str(SCRIPT), *args]


def host() -> str:
    """memory.py's machine(), and whether it is a virtual machine (the CPU's hypervisor flag)."""
    try:
        virtual = " hypervisor " in f" {Path('/proc/cpuinfo').read_text().replace(chr(10), ' ')} "
    except OSError:
        virtual = False
    return machine() + ("; a virtual machine" if virtual else "")


def global_batch(stdout: str) -> int | None:
    """The global batch the script's `[run]` line names, e.g. "1 replica(s) of 2 rank(s) x 2 examples x 1
    micro-step(s) = global batch 2"."""
    found = re.search(r"^\[run\] .*= global batch (\d+)$", stdout, re.MULTILINE)
    return int(found.group(1)) if found else None


def measure_run(run: Run, out: Path, smoke: bool, round_number: int, prefix: str = "") -> dict:
    folder = out / f"{prefix}{run.name}-r{round_number}"
    cmd = command(run, folder, smoke)
    load = os.getloadavg()[0]
    start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = run_child(cmd, timeout=RUN_TIMEOUT)
    used = resource.getrusage(resource.RUSAGE_CHILDREN)  # the run's processes, every rank and the launcher
    if done.returncode:
        raise SystemExit(f"benchmark run failed: {shlex.join(cmd)}\n{done.stdout}\n{done.stderr}")
    ranks = sorted(json.loads((folder / "memory.json").read_text()), key=lambda r: r["rank"])
    if [r["rank"] for r in ranks] != list(range(run.ranks)):
        raise SystemExit(f"{folder / 'memory.json'} has ranks {[r['rank'] for r in ranks]}, not 0-{run.ranks - 1}")
    warmup = SMOKE_WARMUP if smoke else WARMUP
    seconds = step_seconds(folder / "metrics.jsonl")
    return {
        "run": run.__dict__,
        "round": round_number,
        "command": cmd,
        "global_batch": global_batch(done.stdout),
        "step_ms": 1000 * statistics.median(seconds[warmup:] or seconds),
        "steps_ms": [1000 * s for s in seconds],
        "sent_per_step": summary_row(done.stdout, "collectives"),
        "activations": [r["activations"] for r in ranks],
        "load_before": load,
        "wall_s": time.perf_counter() - start,
        "cpu_user_s": used.ru_utime - cpu.ru_utime,
        "cpu_sys_s": used.ru_stime - cpu.ru_stime,
    }


# ---- the report ------------------------------------------------------------------------------


def check_global_batches(results: list[dict]) -> None:
    """Every step-time run of a length trains the same global batch, as the script's [run] line says."""
    for seq in sorted({r["run"]["seq"] for r in results}):
        named = {Run(**r["run"]).name: r["global_batch"] for r in results if r["run"]["seq"] == seq}
        if len(set(named.values())) != 1 or None in named.values():
            raise SystemExit(f"--seq-len {seq}: the runs' [run] lines name different global batches: {named}")


def round_ratios(rounds: list[dict], reference: list[dict]) -> list[float]:
    """Step time against the reference's (DDP of the same --ddp and length), within each round."""
    base = {r["round"]: r["step_ms"] for r in reference}
    return [r["step_ms"] / base[r["round"]] for r in rounds if r["round"] in base]


def summarise(results: list[dict], ddps: Collection[str]) -> list[dict]:
    """Per run, in plan order: median step time over the rounds and, against each --ddp's DDP of the same length
    (one process: against every --ddp's), the median of the round ratios."""
    grouped: dict[Run, list[dict]] = {}
    for r in results:
        grouped.setdefault(Run(**r["run"]), []).append(r)
    rows = []
    for run, rounds in grouped.items():
        against = [run.ddp] if run.ddp != "-" else list(ddps)
        for ddp in against:
            ratios = round_ratios(rounds, grouped.get(Run("ddp", run.seq, ddp, RANKS, run.steps), []))
            rows.append({
                "run": run,
                "against": ddp,
                "step_ms": statistics.median(r["step_ms"] for r in rounds),
                "tokens_per_step": RANKS * B * run.seq,
                "ratios": ratios,
                "ratio": statistics.median(ratios) if ratios else None,
                "sent_per_step": rounds[0]["sent_per_step"],
                "global_batch": rounds[0]["global_batch"],
                **{k: statistics.median(r[k] for r in rounds) if k in rounds[0] else None  # (not in older results)
                   for k in ("cpu_user_s", "cpu_sys_s")},
            })  # fmt: skip
    return rows


def time_table(rows: list[dict]) -> list[str]:
    lines = ["| --seq-len | layout | --ddp | global batch | step ms (median of rounds) | vs DDP, median of round "
             "ratios | per round | CPU s, user / sys | collectives per step (rank 0, the script's summary) |",
             "|--:|---|---|--:|--:|--:|---|--:|---|"]  # fmt: skip
    for s in rows:
        run = s["run"]
        ddp = run.ddp if run.ddp != "-" else f"- (vs {s['against']}'s DDP)"
        ratio = f"**{s['ratio']:.2f}x**" if s["ratio"] is not None and run.layout == "cp" else (
            f"{s['ratio']:.2f}x" if s["ratio"] is not None else "-")  # fmt: skip
        per_round = ", ".join(f"{x:.2f}x" for x in s["ratios"])
        cpu = f"{s['cpu_user_s']:.0f} / {s['cpu_sys_s']:.0f}" if s["cpu_user_s"] is not None else "-"
        sent = (s["sent_per_step"] or "-").removeprefix("rank 0, per step: ")
        lines.append(f"| {run.seq:,} | {run.label} | {ddp} | {s['global_batch']} | {s['step_ms']:,.0f} | {ratio} | "
                     f"{per_round} | {cpu} | {sent} |")  # fmt: skip
    return lines


def sweep(results: list[dict], cached: list[dict]) -> list[dict]:
    """Per length: one process's activation bytes and, per --cp N, each rank's, beside one process's / N.
    `cached`: the step-time runs of round 1 (the same layout, length and per-replica batch: read, not rerun)."""
    found = {(r["run"]["layout"], r["run"]["ranks"], r["run"]["seq"]): r for r in cached if r["round"] == 1}
    found |= {(r["run"]["layout"], r["run"]["ranks"], r["run"]["seq"]): r for r in results}
    rows = []
    for seq in sorted({seq for _, _, seq in found}):
        one = found.get(("one", 1, seq))
        if one is None:
            continue
        row = {"seq": seq, "one": one["activations"][0], "cp": {}}
        for n in MEMORY_CPS:
            if (r := found.get(("cp", n, seq))) is not None:
                ranks = r["activations"]
                predicted = row["one"] / n
                row["cp"][n] = {"ranks": ranks, "predicted": predicted, "ratio": max(ranks) / predicted,
                                "share": max(ranks) / row["one"], "from": Run(**r["run"]).name}  # fmt: skip
        rows.append(row)
    return rows


def memory_table(rows: list[dict]) -> list[str]:
    head = "| --seq-len | one process, MiB |"
    rule = "|--:|--:|"
    for n in MEMORY_CPS:
        head += f" `--cp {n}`, per rank, MiB | predicted (one / {n}) | measured / predicted |"
        rule += "--:|--:|--:|"
    lines = [head, rule]
    for row in rows:
        cells = [f"{row['seq']:,}", f"{row['one'] / MIB:,.2f}"]
        for n in MEMORY_CPS:
            c = row["cp"].get(n)
            if c is None:
                cells += ["-", "-", "-"]
                continue
            low, high = min(c["ranks"]) / MIB, max(c["ranks"]) / MIB
            measured = f"{high:,.2f}" if f"{low:,.2f}" == f"{high:,.2f}" else f"{low:,.2f}-{high:,.2f}"
            cells += [measured, f"{c['predicted'] / MIB:,.2f}", f"{c['ratio']:.4f}"]
        lines.append(f"| {' | '.join(cells)} |")
    return lines


def memory_lines(rows: list[dict]) -> list[str]:
    lines = []
    for n in MEMORY_CPS:
        shares = [row["cp"][n] for row in rows if n in row["cp"]]
        if shares:
            ratios = [c["ratio"] for c in shares]
            lines.append(f"- `--cp {n}`: each rank keeps {min(c['share'] for c in shares):.6f}-"
                         f"{max(c['share'] for c in shares):.6f} of one process's activations (1/{n} = {1 / n:.6f}); "
                         f"measured / predicted {min(ratios):.4f}-{max(ratios):.4f} over {len(shares)} lengths "
                         "(the largest rank's)")  # fmt: skip
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        growth = last["one"] / first["one"]
        lines.append(f"- one process's activations grow {growth:.1f}x from --seq-len {first['seq']:,} to "
                     f"{last['seq']:,} ({last['seq'] / first['seq']:.0f}x the tokens): linear in the sequence, "
                     "no T x T attention matrix kept (the fused attention saves its output and log-sum-exp; the "
                     "ring the same, per block)")  # fmt: skip
    return lines


def report(time_results: list[dict], rows: list[dict], memory_results: list[dict], swept: list[dict], smoke: bool,
           loads: dict[str, list[tuple[float, float]]]) -> str:  # fmt: skip
    model = SMOKE_MODEL if smoke else MODEL
    steps, warmup = (SMOKE_STEPS, SMOKE_WARMUP) if smoke else (STEPS, WARMUP)
    rounds = max((r["round"] for r in time_results), default=0)
    load_text = "; ".join(f"{part} {i}: {a:.2f} -> {b:.2f}" for part, spans in loads.items()
                          for i, (a, b) in enumerate(spans, 1))  # fmt: skip
    lines = [
        "# Context parallelism against DDP: step time at long sequences, and activation memory per rank",
        "",
        "Written by `python benchmarks/context_parallel.py`"
        + (" --smoke (sizes too small to mean anything)" if smoke else "")
        + f" on {time.strftime('%Y-%m-%d')}.",
        "",
        f"Machine: {host()}. Gloo, one thread per rank (`OMP_NUM_THREADS=1`); fp32 AdamW; the model "
        f"`{' '.join(model)}`. Load average (1 min) at the start and end of each round (time) and of the sweep "
        f"(memory): {load_text}. The machine was shared: read the ratios (taken within a round), not the absolute "
        "milliseconds.",
        "",
    ]
    if time_results:
        ddps = sorted({r["run"]["ddp"] for r in time_results} - {"-"})
        lines += [
            f"## Step time: `--cp {RANKS}` against {RANKS}-rank DDP on the same global batch",
            "",
            f"Every run trains a global batch of {RANKS * B} examples of --seq-len tokens: DDP `--batch-size {B}` on "
            f"each of its {RANKS} replicas, `--cp {RANKS}` `--batch-size {RANKS * B}` on its one replica (its "
            f"{RANKS} ranks each hold 2 of the {2 * RANKS} chunks of every example), one process `--batch-size "
            f"{RANKS * B}` (the *global batch* column is the script's `[run]` line's). --ddp: {', '.join(ddps)}. "
            f"*step ms*: rank 0's wall-clock time per step, the median of the {steps - warmup} step(s) after the "
            f"first {warmup} of {steps}, then the median over {rounds} round(s). *vs DDP*: against DDP with the same "
            "--ddp and --seq-len, taken within each round, the rounds' median. *CPU s*: the whole run's (start-up "
            "included), every process's, user and kernel (sys) time, the median over the rounds.",
            "",
            *time_table(rows),
            "",
        ]
    if swept:
        lines += [
            "## Activation memory per rank, by --seq-len: falling as 1/N with `--cp N`",
            "",
            f"`activations` from each rank's OUTPUT_DIR/memory.json: the bytes autograd kept for backward from the "
            f"first micro-batch, {RANKS * B} examples of --seq-len tokens on every layout (`--batch-size "
            f"{RANKS * B}`: one process, and one replica of N ranks). *predicted*: one process's bytes / N. "
            "*measured / predicted*: the largest rank's against it (where ranks differ the cell gives their range). "
            "One step each (`--max-steps 1`); the one-process and `--cp 2` cells at the step-time lengths are "
            "read from the step-time runs' round 1 (the same layout, length and batch).",
            "",
            *memory_table(swept),
            "",
            *memory_lines(swept),
            "",
        ]
    lines += [
        "## Commands",
        "",
        "`$OUT` is the benchmark's folder for the runs. Each round ran the same step-time commands into new "
        "folders (`-r1`, `-r2`, ...).",
        "",
        "```",
        *(f"OMP_NUM_THREADS=1 {shlex.join(r['command'])}" for r in time_results if r["round"] == 1),
        *(f"OMP_NUM_THREADS=1 {shlex.join(r['command'])}" for r in memory_results),
        "```",
        "",
    ]
    return "\n".join(lines)


def measure(out: Path, smoke: bool, repeats: int, parts: Collection[str], ddps: Collection[str],
            table: Path | None) -> dict:  # fmt: skip
    time_results, memory_results, loads = [], [], {"time, round": [], "memory sweep": []}
    if "time" in parts:
        runs = time_plan(SMOKE_TIME_SEQS if smoke else TIME_SEQS, ddps, SMOKE_STEPS if smoke else STEPS)
        for round_number in range(1, repeats + 1):
            before = os.getloadavg()[0]
            for run in runs:
                result = measure_run(run, out, smoke, round_number)
                time_results.append(result)
                print(f"[round {round_number}/{repeats}] {run.name}: {result['step_ms']:,.0f} ms/step "
                      f"({result['wall_s']:.0f} s, load {result['load_before']:.2f})", flush=True)  # fmt: skip
            loads["time, round"].append((before, os.getloadavg()[0]))
        check_global_batches(time_results)
    if "memory" in parts:
        before = os.getloadavg()[0]
        done = {(r["run"]["layout"], r["run"]["ranks"], r["run"]["seq"]) for r in time_results}
        todo = [run for run in memory_plan(SMOKE_MEMORY_SEQS if smoke else MEMORY_SEQS)
                if (run.layout, run.ranks, run.seq) not in done]  # fmt: skip
        for i, run in enumerate(todo, 1):
            result = measure_run(run, out, smoke, 1, prefix="memory-")
            memory_results.append(result)
            mib = ", ".join(f"{a / MIB:.2f}" for a in result["activations"])
            print(f"[memory {i}/{len(todo)}] {run.name}: activations {mib} MiB ({result['wall_s']:.0f} s)", flush=True)
        loads["memory sweep"].append((before, os.getloadavg()[0]))
    rows = summarise(time_results, ddps)
    swept = sweep(memory_results, time_results) if "memory" in parts else []
    got = {"machine": host(), "loads": loads, "time": [r | {"run": r["run"].__dict__} for r in rows],
           "memory": swept, "results": time_results + memory_results}  # fmt: skip
    (out / "results.json").write_text(json.dumps(got, indent=1))
    publish(relative(report(time_results, rows, memory_results, swept, smoke, loads), out), table)
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="one round at small sizes, both parts: checks the harness (its numbers mean nothing)",
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds of the step-time runs; each round runs each once")
    p.add_argument("--only", choices=PARTS, default=None, help="measure one part only: the step times or the sweep")
    p.add_argument(
        "--ddp",
        action="append",
        choices=DDPS,
        help="the step-time runs' --ddp, repeatable (default: torch; `--ddp manual` is bitwise equal to it)",
    )
    output_flags(p, "; with --smoke or --only the table goes here too")
    args = p.parse_args()
    parts = (args.only,) if args.only else PARTS
    ddps = tuple(d for d in DDPS if d in (args.ddp or ["torch"]))

    def work(out: Path, removed: bool) -> None:
        # The smoke's numbers mean nothing, and --only's are half the table: never over the measured ones.
        partial = args.smoke or args.only is not None
        table = (out / TABLE.name if args.out else None) if partial else TABLE
        measure(out, args.smoke, 1 if args.smoke else args.repeats, parts, ddps, table)

    in_output_folder(args.out, args.keep_outputs, "context-parallel-benchmark-", work, stop_children)


if __name__ == "__main__":
    main()
