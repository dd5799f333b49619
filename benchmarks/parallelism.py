"""Measure what splitting the model costs in step time against DDP, and the pipeline's bubble.

    python benchmarks/parallelism.py            # 3 rounds of 8 runs: 4-6 minutes on 2 CPU cores
    python benchmarks/parallelism.py --smoke    # one round at small sizes, 3 steps: checks the harness
    python benchmarks/parallelism.py --only tp --only 1f1b   # DDP and the named layouts only

Every run trains the tiny model through llm_ddp_parallel_training.py as a user starts it (`--cpu
--nproc 2`), 2 Gloo ranks, one thread each, fp32 AdamW, on the same global batch: MICRO examples
per micro-batch, ACCUM micro-batches per step. DDP (`--sharding none`) holds a whole copy per rank
and gives each rank half of every micro-batch (`--batch-size MICRO/2`); `--tp 2` and `--pp 2`
leave one data-parallel replica, so `--batch-size MICRO` (it is per replica). The step's ACCUM
micro-batches are what the pipeline fills itself with: its ideal bubble is (S - 1) / (M + S - 1).

The layouts, each with the from-scratch classes (`--ddp manual`) and with torch's (`--ddp torch`),
each against DDP of its own --ddp:

    ddp     --sharding none (the reference: 1.00x)
    tp      --tp 2: Megatron's column / row split of every block, two all-reduces per block in
            forward and two in backward, per micro-batch
    1f1b    --pp 2 --pp-schedule 1f1b: two stages of two blocks, one forward one backward
    gpipe   --pp 2 --pp-schedule gpipe: every forward, then every backward
    zero1   --sharding optimizer, and fsdp  --sharding full: not in the default plan (their costs are
            benchmarks/memory.py's); `--only zero1 --only fsdp` sets them beside DDP on this model, for
            docs/parallelism.md's side-by-side table

Step time: each run logs every step (--log-every 1) to --metrics-file; a record's real tokens over
its tokens/s is the wall-clock time rank 0 spent in that step. The median of the steps after the
first WARMUP is a run's step time. The runs go in --repeats rounds, each round every run once, one
after the other; each ratio to DDP is taken within its round (the runs that ran side by side in
time) and the rounds' median reported: a shared machine drifts, and rounds keep that out.

Where the time goes: the from-scratch runs are traced (`--trace-steps`, every step; torch's split
runs cannot be: the script refuses, as their collectives run out of its sight), and the trace's
counted steps give, on each rank, the time in tensor-parallel all-reduces, the bubble (the time a
stage sat in a receive, waiting for its neighbour) and the time in sends and receives. The 1F1B
bubble goal is judged on the first stage: in this script's schedules it waits in its receives
through both the fill and the drain, while the last stage waits out the drain in the gradient
norm's all-reduce (its "sync"), which the trace does not call bubble.

Goals (issue 28): each split layout's step time <= GOAL x DDP's; the 1F1B bubble within 10% of
(S - 1) / (M + S - 1).

Writes benchmarks/parallelism_results.md (--smoke or --only: only into --out, or only prints, so that
a partial run never replaces the measured numbers). The runs write into a temp folder, removed at the end,
also when a run fails or the benchmark is stopped; --out DIR keeps them in DIR.
"""

from __future__ import annotations

import argparse
import json
import os
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
from memory import machine, run_child, step_seconds, stop_children  # noqa: E402  (children killed by group)

SCRIPT = REPO / "llm_ddp_parallel_training.py"
TABLE = REPO / "benchmarks" / "parallelism_results.md"

# The tiny model, named in full on every command line so that the numbers keep describing the same
# model when the script's defaults change: d 256, 4 heads, 4 blocks (two per stage), sequence 128:
# 3.31 M parameters. Global batch: 4 micro-batches of 8 examples.
TINY_MODEL = ["--d-model", "256", "--n-heads", "4", "--n-layers", "4", "--seq-len", "128"]
SMOKE_MODEL = ["--d-model", "64", "--n-heads", "2", "--n-layers", "2", "--seq-len", "32"]
MICRO, ACCUM = 8, 4
SMOKE_MICRO, SMOKE_ACCUM = 4, 2
STEPS, WARMUP = 10, 3  # the first steps warm caches and connections: not counted
SMOKE_STEPS, SMOKE_WARMUP = 3, 1
# Every run: fp32 AdamW on the CPU, no held-out lines (no evaluation inside the timed loop), every
# step logged (the step times), a one-token sample (the sample is not what is measured).
COMMON = ["--cpu", "--optimizer", "adamw", "--precision", "fp32", "--val-fraction", "0", "--log-every", "1",
          "--sample-tokens", "1"]  # fmt: skip
RANKS, STAGES = 2, 2
LAYOUTS = {
    "ddp": ["--sharding", "none"],
    "tp": ["--tp", "2"],
    "1f1b": ["--pp", "2", "--pp-schedule", "1f1b"],
    "gpipe": ["--pp", "2", "--pp-schedule", "gpipe"],
    "zero1": ["--sharding", "optimizer"],
    "fsdp": ["--sharding", "full"],
}
SPLITS = ("tp", "1f1b", "gpipe")  # the default plan, each against DDP, the reference, which always runs
SHARDINGS = ("zero1", "fsdp")  # only when --only names them: docs/parallelism.md's side-by-side step times
DATA_PARALLEL = ("ddp", *SHARDINGS)  # two replicas of the model: half of every micro-batch each
DDPS = ("manual", "torch")
GOAL = 2.0  # a split layout's step time against DDP's of the same --ddp
BUBBLE_TOLERANCE = 0.10  # relative, against (S - 1) / (M + S - 1)
RUN_TIMEOUT = 300  # seconds: pipelining on Gloo has hung before; a hung run ends the benchmark


@dataclass(frozen=True)
class Run:
    layout: str
    ddp: str

    @property
    def name(self) -> str:
        return f"{self.layout}-{self.ddp}"

    @property
    def traced(self) -> bool:
        return self.ddp == "manual"  # torch's split runs refuse --trace-steps (collectives out of sight)


def plan(only: Collection[str]) -> list[Run]:
    """One round's runs, in the order they run: each --ddp's DDP first, then its split layouts."""
    return [Run(layout, ddp) for ddp in DDPS for layout in ("ddp", *(s for s in (*SPLITS, *SHARDINGS) if s in only))]


def command(run: Run, folder: Path, smoke: bool) -> list[str]:
    micro, accum = (SMOKE_MICRO, SMOKE_ACCUM) if smoke else (MICRO, ACCUM)
    steps = SMOKE_STEPS if smoke else STEPS
    # --batch-size is per data-parallel replica: DDP has two, a split layout one. A pipeline cuts each micro-step
    # into a micro-batch per stage: half the micro-steps of twice the examples are the same micro-batches.
    batch = micro // RANKS if run.layout in DATA_PARALLEL else micro
    cut = STAGES if "--pp" in LAYOUTS[run.layout] else 1
    args = [*COMMON, *(SMOKE_MODEL if smoke else TINY_MODEL), *LAYOUTS[run.layout], "--ddp", run.ddp,
            "--batch-size", str(batch * cut), "--grad-accum-steps", str(accum // cut), "--max-steps", str(steps),
            "--output-dir", str(folder), "--metrics-file", str(folder / "metrics.jsonl"),
            "--nproc", str(RANKS)]  # fmt: skip
    if run.traced:
        args += ["--trace-steps", str(steps)]
    return [sys.executable, str(SCRIPT), *args]


def summary_row(stdout: str, row: str) -> str | None:
    """A row of the script's [summary], e.g. "collectives", without its name."""
    return next((line.split(row, 1)[1].strip() for line in stdout.splitlines() if line.startswith(f"  {row} ")), None)


def trace_shares(trace: Path, warmup: int) -> list[dict[str, float]]:
    """Per rank, over the traced steps after `warmup`: ms per step in all, in the bubble, in each kind
    of communication span (wall time while one was in flight), and how many of each per step."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    ranks = []
    for pid in sorted({e["pid"] for e in events}):
        mine = [e for e in events if e["pid"] == pid]
        steps = [e for e in mine if e["name"].startswith("step ") and int(e["name"].split()[1]) > warmup]

        def inside(e: dict, steps: list[dict] = steps) -> bool:
            return any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps)

        counted = [e for e in mine if inside(e)]
        per = {"step_ms": sum(s["dur"] for s in steps) / 1000 / len(steps)}
        work = [(e["ts"], e["ts"] + e["dur"]) for e in counted if e["name"] in ("forward", "backward")]
        per["compute_ms"] = union_length(work) / 1000 / len(steps)  # forward and backward, this rank's own
        for name in ("bubble", "all-reduce", "send", "recv"):
            spans = [(e["ts"], e["ts"] + e["dur"]) for e in counted if e["name"] == name]
            per[f"{name}_ms"] = union_length(spans) / 1000 / len(steps)
            per[f"{name}_count"] = len(spans) / len(steps)
        ranks.append(per)
    return ranks


def union_length(spans: list[tuple[float, float]]) -> float:
    """The time covered by spans that may overlap (sends in flight at once count once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def measure_run(run: Run, out: Path, smoke: bool, round_number: int) -> dict:
    folder = out / f"{run.name}-r{round_number}"
    cmd = command(run, folder, smoke)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = run_child(cmd, timeout=RUN_TIMEOUT)
    if done.returncode:
        raise SystemExit(f"benchmark run failed: {shlex.join(cmd)}\n{done.stdout}\n{done.stderr}")
    warmup = SMOKE_WARMUP if smoke else WARMUP
    seconds = step_seconds(folder / "metrics.jsonl")
    result = {
        "run": run.__dict__,
        "round": round_number,
        "command": cmd,
        "step_ms": 1000 * statistics.median(seconds[warmup:]),
        "steps_ms": [1000 * s for s in seconds],
        "sent_per_step": summary_row(done.stdout, "collectives"),
        "bubble_row": summary_row(done.stdout, "pipeline bubble"),
        "load_before": load,
        "wall_s": time.perf_counter() - start,
    }
    if run.traced:
        result["trace"] = trace_shares(folder / "trace.json", warmup)
    return result


# ---- the report ------------------------------------------------------------------------------


def ideal_bubble(smoke: bool) -> float:
    m = SMOKE_ACCUM if smoke else ACCUM
    return (STAGES - 1) / (m + STAGES - 1)


def by_run(results: list[dict]) -> dict[Run, list[dict]]:
    """Each run's rounds, in round order."""
    grouped: dict[Run, list[dict]] = {}
    for r in results:
        grouped.setdefault(Run(**r["run"]), []).append(r)
    return grouped


def round_ratios(rounds: list[dict], reference: list[dict]) -> list[float]:
    """Step time against DDP's of the same --ddp, within each round."""
    base = {r["round"]: r["step_ms"] for r in reference}
    return [r["step_ms"] / base[r["round"]] for r in rounds if r["round"] in base]


def summarise(results: list[dict], smoke: bool) -> dict[str, dict]:
    """Per run: median step time over the rounds, the median of the round ratios to DDP, and (traced
    runs) each rank's medians over the rounds of the trace's per-step figures."""
    grouped = by_run(results)
    out = {}
    for run, rounds in grouped.items():
        ratios = round_ratios(rounds, grouped.get(Run("ddp", run.ddp), []))
        entry = {
            "step_ms": statistics.median(r["step_ms"] for r in rounds),
            "ratios": ratios,
            "ratio": statistics.median(ratios) if ratios else None,
            "sent_per_step": rounds[0]["sent_per_step"],
            "bubble_row": [r["bubble_row"] for r in rounds],
        }
        if run.traced:
            ranks = len(rounds[0]["trace"])
            entry["trace"] = [
                {k: statistics.median(r["trace"][rank][k] for r in rounds) for k in rounds[0]["trace"][rank]}
                for rank in range(ranks)
            ]
        out[run.name] = entry
    if "1f1b-manual" in out:
        first = [r["trace"][0]["bubble_ms"] / r["trace"][0]["step_ms"] for r in grouped[Run("1f1b", "manual")]]
        out["1f1b-manual"]["first_stage_bubble"] = statistics.median(first)
        out["1f1b-manual"]["ideal_bubble"] = ideal_bubble(smoke)
    return out


def steps_table(summary: dict[str, dict]) -> list[str]:
    lines = ["| layout | --ddp | step ms (median of rounds) | vs DDP, median of round ratios | per round | "
             "collectives per step (rank 0, the script's summary) |", "|---|---|--:|--:|---|---|"]  # fmt: skip
    for name, s in summary.items():
        layout, ddp = name.rsplit("-", 1)
        flags = " ".join(LAYOUTS[layout])
        ratio = f"{s['ratio']:.2f}x" if s["ratio"] is not None else "-"
        per_round = ", ".join(f"{x:.2f}x" for x in s["ratios"])
        lines.append(f"| `{flags}` | {ddp} | {s['step_ms']:,.0f} | {ratio} | {per_round} | {s['sent_per_step']} |")
    return lines


def goal_lines(summary: dict[str, dict]) -> list[str]:
    lines = []
    for name, s in summary.items():
        layout, ddp = name.rsplit("-", 1)
        if layout in SPLITS and s["ratio"] is not None:
            verdict = "met" if s["ratio"] <= GOAL else "missed"
            lines.append(f"- `{' '.join(LAYOUTS[layout])} --ddp {ddp}` against `--sharding none --ddp {ddp}`: "
                         f"**{s['ratio']:.2f}x**, goal <= {GOAL}x: **{verdict}**")  # fmt: skip
    if "1f1b-manual" in summary:
        s = summary["1f1b-manual"]
        measured, ideal = s["first_stage_bubble"], s["ideal_bubble"]
        off = (measured - ideal) / ideal
        verdict = "met" if abs(off) <= BUBBLE_TOLERANCE else "missed"
        lines.append(f"- 1F1B bubble, first stage (`--ddp manual`, from the trace): **{100 * measured:.1f}%** "
                     f"against the ideal {100 * ideal:.1f}% ({100 * off:+.0f}%), goal within "
                     f"{100 * BUBBLE_TOLERANCE:.0f}%: **{verdict}**")  # fmt: skip
    return lines


def trace_table(summary: dict[str, dict]) -> list[str]:
    lines = ["| layout (--ddp manual, traced) | rank | step ms | forward + backward, ms | "
             "in all-reduces, ms (count) | bubble, ms (share of step) | send / recv in flight, ms (count) |",
             "|---|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
    for name, s in summary.items():
        for rank, t in enumerate(s.get("trace", [])):
            layout = name.rsplit("-", 1)[0]
            reduce = f"{t['all-reduce_ms']:.1f} ({t['all-reduce_count']:g})" if t["all-reduce_count"] else "-"
            bubble = f"{t['bubble_ms']:.1f} ({100 * t['bubble_ms'] / t['step_ms']:.1f}%)" if t["bubble_count"] else "-"
            p2p = (f"{t['send_ms']:.1f} / {t['recv_ms']:.1f} ({t['send_count']:g} / {t['recv_count']:g})"
                   if t["send_count"] + t["recv_count"] else "-")  # fmt: skip
            flags = " ".join(LAYOUTS[layout])
            cells = [f"`{flags}`", str(rank), f"{t['step_ms']:,.0f}", f"{t['compute_ms']:,.0f}", reduce, bubble, p2p]
            lines.append(f"| {' | '.join(cells)} |")
    return lines


def reading(summary: dict[str, dict], smoke: bool) -> list[str]:
    """Where the time beyond DDP's goes, in words, with the traced runs' numbers (rank 0's)."""
    micro, accum = (SMOKE_MICRO, SMOKE_ACCUM) if smoke else (MICRO, ACCUM)
    model = SMOKE_MODEL if smoke else TINY_MODEL
    d, layers = int(model[model.index("--d-model") + 1]), int(model[model.index("--n-layers") + 1])
    t = int(model[model.index("--seq-len") + 1])
    activation = micro * t * d * 4 / 2**20  # one micro-batch's activations, fp32, MiB
    lines = []
    if (ddp := summary.get("ddp-manual", {}).get("trace")) is not None:
        r = ddp[0]
        lines.append(
            f"- **DDP** sends the gradient once a step (one all-reduce, whatever the batch): in flight "
            f"{r['all-reduce_ms']:.0f} ms of rank 0's {r['step_ms']:,.0f} ms. With --grad-accum-steps "
            f"{accum} and one bucket it starts after the last backward, so little of it hides."
        )
    if (tp := summary.get("tp-manual", {}).get("trace")) is not None:
        r = tp[0]
        excess = r["step_ms"] - ddp[0]["step_ms"] if ddp else 0.0
        alone = r["compute_ms"] - r["all-reduce_ms"]  # the all-reduces sit inside forward and backward
        lines.append(
            f"- **--tp 2** sends activations instead, {r['all-reduce_count']:g} all-reduces a step ({accum} "
            f"micro-batches x {layers} blocks x 2 in forward and 2 in backward), each {activation:g} MiB "
            f"({micro} x {t} tokens x d {d} x 4 bytes): {r['all-reduce_ms']:.0f} ms of rank 0's "
            f"{r['step_ms']:,.0f} ms in flight ({100 * r['all-reduce_ms'] / r['step_ms']:.0f}%), and none of it "
            "hides: the next layer needs the sum. Each call pays Gloo's fixed cost (a round trip between the "
            "processes, a wake-up of its thread) whatever its size: the latency of many small collectives. "
            + (
                f"TP's traced step was {excess:.0f} ms longer than DDP's: {r['all-reduce_ms']:.0f} ms in its "
                f"all-reduces, and its forward and backward without them took {alone:.0f} ms against DDP's "
                f"{ddp[0]['compute_ms']:.0f}"
                if excess > 0
                else "This time TP's traced step was no longer than DDP's: the machine's load moved more than TP costs"
            )
            + " (beside the wire, every rank repeats what TP does not split, the embeddings, norms, the head and "
            "the loss over the whole micro-batch, and each matmul is half as wide)."
        )
    if "first_stage_bubble" in summary.get("1f1b-manual", {}):
        first, ideal = summary["1f1b-manual"]["first_stage_bubble"], summary["1f1b-manual"]["ideal_bubble"]
        stages = summary["1f1b-manual"]["trace"]
        lines.append(
            f"- **--pp 2** sends little ({accum} activations of {activation:g} MiB forward and {accum} gradients "
            f"back per step); its cost is the bubble: a stage idle while the pipeline fills and drains, ideally "
            f"(S - 1) / (M + S - 1) = {100 * ideal:.0f}% of the step at M = {accum}, measured "
            f"{100 * first:.1f}% on the first stage. The formula counts compute alone, on equal stages: here "
            f"the stages computed {stages[0]['compute_ms']:.0f} and {stages[-1]['compute_ms']:.0f} ms a step "
            "(forward and backward; the last stage holds the head and the loss), and on a shared CPU each "
            "micro-step's time varies: the first stage waits for the last's slow ones and gains nothing from its "
            "fast ones. The last stage waits out the drain in the step's closing "
            'all-reduces (its "sync" on the timeline), not in a receive. More micro-batches shrink the bubble '
            f"(M = {2 * accum}: {100 / (2 * accum + 1):.0f}%), at the price of smaller matmuls."
        )
    return lines


def report(results: list[dict], summary: dict[str, dict], smoke: bool, loads: list[tuple[float, float]]) -> str:
    micro, accum = (SMOKE_MICRO, SMOKE_ACCUM) if smoke else (MICRO, ACCUM)
    model = SMOKE_MODEL if smoke else TINY_MODEL
    rounds = max(r["round"] for r in results)
    load_text = "; ".join(f"round {i}: {a:.2f} -> {b:.2f}" for i, (a, b) in enumerate(loads, 1))
    lines = [
        "# Splitting the model against DDP: step time and the pipeline's bubble",
        "",
        "Written by `python benchmarks/parallelism.py`"
        + (" --smoke (sizes too small to mean anything)" if smoke else "")
        + f" on {time.strftime('%Y-%m-%d')}.",
        "",
        f"Machine: {machine()}. {RANKS} Gloo ranks (`--nproc {RANKS}`), one thread each (`OMP_NUM_THREADS=1`); "
        f"fp32 AdamW. Load average (1 min) before and after each round: {load_text}. The machine was shared: "
        "read the ratios (taken within a round), not the absolute milliseconds.",
        "",
        f"The model: `{' '.join(model)}`; every layout trains the same global batch, {accum} micro-batches of "
        f"{micro} examples (DDP, and ZeRO-1 and FSDP where they ran: `--batch-size {micro // RANKS}` on each of "
        f"their {RANKS} replicas; `--tp 2`: `--batch-size {micro}` on its one replica), `--grad-accum-steps {accum}`; "
        f"`--pp 2`: `--batch-size {micro * STAGES} --grad-accum-steps {accum // STAGES}`, each micro-step cut into "
        f"{STAGES} micro-batches. *step ms*: rank 0's "
        f"wall-clock time per step, the median of the steps after the first {SMOKE_WARMUP if smoke else WARMUP}, "
        f"then the median over {rounds} round(s). *vs DDP*: against `--sharding none` with the same `--ddp`, "
        "taken within each round, the rounds' median. The `--ddp manual` runs are traced (`--trace-steps`); "
        "torch's split runs cannot be (the script refuses: their collectives run out of its sight).",
        "",
        *steps_table(summary),
        "",
        f"## Goals: each split layout <= {GOAL}x DDP's step time; the 1F1B bubble within "
        f"{100 * BUBBLE_TOLERANCE:.0f}% of (S - 1) / (M + S - 1)",
        "",
        *(goal_lines(summary) or ["- nothing to compare"]),
        "",
        "## Where the time goes (the from-scratch runs' traces, counted steps, medians over the rounds)",
        "",
        "Time in all-reduces and sends / receives is wall time while one was in flight on that rank. A "
        "tensor-parallel all-reduce sits inside forward or backward, which wait for it: none of it hides. The "
        "bubble is the time a stage sat in a receive, its neighbour still computing.",
        "",
        *trace_table(summary),
        "",
        *reading(summary, smoke),
        "",
        "The script's own summary row for the traced 1F1B runs, per round: "
        + "; ".join(row or "-" for row in summary.get("1f1b-manual", {}).get("bubble_row", [])),
        "",
        "## Commands",
        "",
        "`$OUT` is the benchmark's folder for the runs. Each round ran the same commands into new folders "
        "(`-r1`, `-r2`, ...).",
        "",
        "```",
        *(f"OMP_NUM_THREADS=1 {shlex.join(r['command'])}" for r in results if r["round"] == 1),
        "```",
        "",
    ]
    return "\n".join(lines)


def relative(text: str, out: Path) -> str:
    return text.replace(str(out), "$OUT").replace(str(REPO) + "/", "")


def measure(out: Path, smoke: bool, repeats: int, only: Collection[str], table: Path | None) -> dict:
    runs = plan(only)
    results, loads = [], []
    for round_number in range(1, repeats + 1):
        before = os.getloadavg()[0]
        for run in runs:
            result = measure_run(run, out, smoke, round_number)
            results.append(result)
            print(f"[round {round_number}/{repeats}] {run.name}: {result['step_ms']:,.0f} ms/step "
                  f"({result['wall_s']:.0f} s, load {result['load_before']:.2f})", flush=True)  # fmt: skip
        loads.append((before, os.getloadavg()[0]))
    summary = summarise(results, smoke)
    got = {"machine": machine(), "loads": loads, "summary": summary, "results": results}
    (out / "results.json").write_text(json.dumps(got, indent=1))
    publish(relative(report(results, summary, smoke, loads), out), table)
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="one round at small sizes, 3 steps a run: checks the harness (its numbers mean nothing)",
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds; each round runs every layout once")
    p.add_argument(
        "--only",
        action="append",
        choices=(*SPLITS, *SHARDINGS),
        metavar="NAME",
        help=f"measure only this layout (and DDP, the reference); repeatable (default: {', '.join(SPLITS)}; "
        f"{' and '.join(SHARDINGS)} only when named)",
    )
    output_flags(p, "; with --smoke or --only the table goes here too")
    args = p.parse_args()
    only = set(args.only or SPLITS)

    def work(out: Path, removed: bool) -> None:
        # The smoke's numbers mean nothing, and --only's are part of the table: never over the measured ones.
        partial = args.smoke or only != set(SPLITS)
        table = (out / TABLE.name if args.out else None) if partial else TABLE
        measure(out, args.smoke, 1 if args.smoke else args.repeats, only, table)

    in_output_folder(args.out, args.keep_outputs, "parallelism-benchmark-", work, stop_children)


if __name__ == "__main__":
    main()
