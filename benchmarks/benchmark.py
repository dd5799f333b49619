"""Measure llm_ddp_parallel_training.py on this machine, in one run, and print the table the README quotes.

    python benchmarks/benchmark.py            # the full measurement: a few minutes on 2 CPU cores
    python benchmarks/benchmark.py --smoke    # every measurement once, small and short: checks the harness
    python benchmarks/benchmark.py --only scaling --only trainer   # some measurements, with their rows

The runs write into a temp folder, removed at the end, also when a run fails or the benchmark is
stopped (Ctrl-C, SIGTERM); --keep-outputs keeps it and prints its path, and --out DIR writes into
DIR instead, which is never removed.

What it measures (ratios as well as absolute numbers: shared machines are noisy, so every timing
is the median of --repeats runs, and the runs being compared alternate):

1. scaling     tokens/s of 2 Gloo ranks against 1 rank, one thread per rank (what torchrun sets),
               the tiny model at TINY_MODEL's sizes, with the per-step breakdown from
               --time-breakdown; and what limits it, measured apart: the 1-rank run twice at
               once, not communicating (the ranks share one machine: this is the most 2 ranks
               could make here), with 2 ranks against it in the same round (goal >= 0.97), and
               one all-reduce of the model's gradient bytes between two Gloo ranks, alone
2. efficiency  model FLOP/s of one rank against this machine's single-thread matmul peak, which
               is measured here too
3. start-up    seconds from launch to the end of the first optimizer step (imports included)
4. Trainer     the same LoRA run on a tiny random Qwen2, two ranks, through this script and through
               transformers' Trainer; tokens/s, and the final loss of both on the same 64 lines
5. memory      peak resident memory per rank, both models (the Qwen2 one in 4, the tiny model's
               in a 3-step run of its own)

--only NAME runs only the named measurements and prints only their rows; it can be given again
for more (default: all of them). The names: scaling (1 without the all-reduce, and 2), all-reduce
(the rest of 1), start-up (3), trainer (4, and the Qwen2 half of 5), memory (the tiny model's half
of 5). The row of the scaling that the two limits measured apart would allow needs both scaling
and all-reduce. The tests run `--smoke --only scaling`; `--smoke` alone checks every measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "llm_ddp_parallel_training.py"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from rows import stacked  # noqa: E402

import llm_ddp_parallel_training as script  # noqa: E402

# The tiny model every measurement here trains, named in full on every command line, so that
# the numbers keep describing the same model when the script's defaults change: d 512, 8 heads,
# 1 layer, sequence 128, batch 16 per rank (3.47 M parameters, 20.4 MFLOP per token), the
# model the README's performance numbers are for. --smoke shrinks width, heads and batch.
TINY_MODEL = ["--d-model", "512", "--n-heads", "8", "--n-layers", "1", "--seq-len", "128", "--batch-size", "16"]
SMOKE_MODEL = ["--d-model", "64", "--n-heads", "2", "--n-layers", "1", "--seq-len", "128", "--batch-size", "4"]
# 2 ranks against the 1-rank run twice at once (the machine's own two-process limit): what is
# lost to talking and to waiting for the slower rank.
PAIR_GOAL = 0.97
# What --only can name, in the order they run (1: scaling, matmul peak and efficiency; 3-5).
MEASUREMENTS = ("scaling", "all-reduce", "start-up", "memory", "trainer")


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK"}}
    # One thread per rank for every run, as torchrun sets it when it starts several ranks.
    return env | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def command(args: list[str], nproc: int | None) -> list[str]:
    if nproc:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                str(SCRIPT), *args]  # fmt: skip
    return [sys.executable, str(SCRIPT), *args]


# Every child process, so that a failure or a stop can end the ones still running before their
# output folder is removed (a torchrun killed outright would leave its ranks running, writing).
CHILDREN: list[subprocess.Popen] = []


def spawn(cmd: list[str], **popen: object) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=child_env(), **popen)
    CHILDREN.append(proc)
    return proc


def run_child(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True), with the child recorded in CHILDREN."""
    proc = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"benchmark run timed out after {timeout:.0f} s: {' '.join(cmd)}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop_children(grace: float = 30) -> None:
    """End every child still running: SIGTERM first (torchrun passes it on to its ranks and waits
    for them; the script stops cleanly), SIGKILL for any still there after `grace` seconds."""
    alive = [proc for proc in CHILDREN if proc.poll() is None]
    for proc in alive:
        proc.terminate()
    deadline = time.monotonic() + grace
    for proc in alive:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


RUN_NUMBERS = itertools.count(1)


def run_dir(parent: Path, name: str) -> Path:
    """A folder of its own for one run: the script keeps one run per folder (it refuses to
    replace a finished run's model), and a fresh folder means nothing is left from the last."""
    return parent / f"{name}-{next(RUN_NUMBERS)}"


def launch(args: list[str], nproc: int | None, timeout: float = 900) -> str:
    cmd = command(args, nproc)
    done = run_child(cmd, timeout)
    if done.returncode:
        raise SystemExit(f"benchmark run failed: {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    return done.stdout


def summary_row(stdout: str, row: str) -> str:
    return next(line.split(row, 1)[1].strip() for line in stdout.splitlines() if line.startswith(f"  {row} "))


# ---- 1-2. scaling and arithmetic efficiency ------------------------------------------------


def gemm_peak(sizes: tuple[int, ...], repeats: int) -> float:
    """Single-thread fp32 matmul FLOP/s: the fastest of many multiplies, over a few sizes.

    A peak is what the machine *can* do, so the fastest run is the right statistic (noise only
    ever slows a run down); it makes the efficiency figure below conservative.
    """
    torch.set_num_threads(1)
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm up
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def speed_args(steps: int, extra: list[str], out: Path, metrics: Path) -> list[str]:
    metrics.unlink(missing_ok=True)
    return ["--cpu", "--max-steps", str(steps), "--log-every", str(max(1, steps // 6)), "--val-fraction", "0",
            "--time-breakdown", "--metrics-file", str(metrics), "--output-dir", str(out), *extra]  # fmt: skip


def read_speed(metrics: Path) -> dict[str, float]:
    """Tokens/s of the steps after the first logging window (start-up and warm-up excluded):
    all their tokens over all their time, and the mean milliseconds per step in each phase."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    measured = records[2:]  # records[0] is step 1 alone, records[1] the rest of the first window
    tokens = [r["tokens_seen"] - prev["tokens_seen"] for prev, r in zip(records[1:-1], measured, strict=True)]
    seconds = sum(n / r["tokens_per_sec"] for n, r in zip(tokens, measured, strict=True))
    phases = {k: statistics.mean(r[k] for r in measured) for k in measured[0] if k.startswith("ms_")}
    return {"tokens_per_sec": sum(tokens) / seconds, **phases}


def training_speed(nproc: int, steps: int, extra: list[str], out: Path) -> dict[str, float]:
    run = run_dir(out, f"ranks{nproc}")
    launch(speed_args(steps, extra, run, run / "metrics.jsonl"), nproc)
    return read_speed(run / "metrics.jsonl")


def independent_pair_speed(steps: int, extra: list[str], out: Path) -> float:
    """The 1-rank run twice, started together, with no process group between them: summed tokens/s.

    What 2 ranks could reach if they never communicated: the machine's share for each when both
    cores are busy (shared caches and memory, a VM's neighbours).
    """
    folders = [run_dir(out, f"pair{i}") for i in "ab"]
    runs = [(speed_args(steps, extra, run, run / "metrics.jsonl"), run / "metrics.jsonl") for run in folders]
    procs = [spawn(command(args, 1), stdout=subprocess.DEVNULL) for args, _ in runs]
    if any(proc.wait(timeout=900) for proc in procs):
        raise SystemExit("benchmark run failed: two independent 1-process runs")
    return sum(read_speed(metrics)["tokens_per_sec"] for _, metrics in runs)


def measure_scaling(steps: int, repeats: int, extra: list[str], out: Path) -> dict:
    one, two, pair = [], [], []
    for _ in range(repeats):  # alternate, so drift in the machine's load hits all alike
        one.append(training_speed(1, steps, extra, out))
        two.append(training_speed(2, steps, extra, out))
        pair.append(independent_pair_speed(steps, extra, out))
    return scaling_summary(one, two, pair)


def scaling_summary(one: list[dict[str, float]], two: list[dict[str, float]], pair: list[float]) -> dict:
    """Medians of the rounds; each ratio is taken within its round (the runs that ran side by
    side in time), and the ratios' median reported."""
    med = {n: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for n, runs in ((1, one), (2, two))}
    ratios = [b["tokens_per_sec"] / a["tokens_per_sec"] for a, b in zip(one, two, strict=True)]
    pair_ratios = [b / a["tokens_per_sec"] for a, b in zip(one, pair, strict=True)]
    two_vs_pair = [a["tokens_per_sec"] / b for a, b in zip(two, pair, strict=True)]
    return {"one_rank": med[1], "two_ranks": med[2], "ratio": statistics.median(ratios),
            "pair_ratio": statistics.median(pair_ratios), "pair_tokens_per_sec": statistics.median(pair),
            "two_vs_pair": statistics.median(two_vs_pair),
            "rounds": {"one_rank": [r["tokens_per_sec"] for r in one], "two_ranks": [r["tokens_per_sec"] for r in two],
                       "pair": pair, "two_vs_pair": two_vs_pair}}  # fmt: skip


def allreduce_ms(numel: int) -> dict[str, float]:
    """One all-reduce of `numel` gradients between 2 Gloo ranks, alone: the median of 20, in ms."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--allreduce-worker", str(numel)]  # fmt: skip
    done = run_child(cmd, timeout=300)
    if done.returncode:
        raise SystemExit(f"all-reduce run failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))


def allreduce_worker(numel: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    times = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x = torch.randn(numel).to(dtype)
        seconds = []
        for i in range(23):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            if i >= 3:  # the first calls set up connections and buffers
                seconds.append(time.perf_counter() - start)
        times[name] = 1000 * statistics.median(seconds)
    if dist.get_rank() == 0:
        print(json.dumps(times))
    dist.destroy_process_group()


def tiny_model(extra: list[str]) -> tuple[script.RunConfig, torch.nn.Module]:
    cfg = script.parse_args(["--cpu", *extra])
    config = script.TinyConfig(seq_len=cfg.seq_len, d_model=cfg.d_model, n_heads=cfg.n_heads, n_layers=cfg.n_layers)
    return cfg, script.TinyTransformer(config)


def tiny_flops_per_token(extra: list[str]) -> float:
    cfg, model = tiny_model(extra)
    return script.training_flops_per_token(model, cfg.n_layers, cfg.d_model, cfg.seq_len)


# ---- 3. start-up ------------------------------------------------------------------------------


def seconds_to_first_step(nproc: int | None, extra: list[str], out: Path) -> float:
    """From launch (a fresh interpreter, imports included) to the first step's log line."""
    folder = run_dir(out, "startup")
    cmd = command(["--cpu", "--max-steps", "2", "--val-fraction", "0", "--output-dir", str(folder), *extra], nproc)
    start = time.perf_counter()
    proc = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seconds = None
    for line in proc.stdout:
        if seconds is None and line.startswith("step     1/"):
            seconds = time.perf_counter() - start
    if proc.wait(timeout=300) != 0 or seconds is None:
        raise SystemExit(f"start-up run failed or never logged step 1: {' '.join(cmd)}")
    return seconds


# ---- 4. against transformers' Trainer ---------------------------------------------------------


def loss_on_lines(model_dir: Path, adapter: Path | None, lines: list[str], seq_len: int) -> float:
    """Token-weighted loss of the base model (plus an adapter) on the given lines, one way for all."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model = (PeftModel.from_pretrained(model, adapter) if adapter else model).eval()
    val = stacked(
        script.encode_records_with_tokenizer([script.Record(text=line) for line in lines], tokenizer, seq_len)[0]
    )
    with torch.no_grad():
        loss = script.token_loss_sum(model(input_ids=val.inputs).logits, val.targets).item()
    return loss / int((val.targets != script.IGNORE_INDEX).sum())


def compare_with_trainer(steps: int, repeats: int, batch: int, seq_len: int, out: Path) -> dict:
    from tiny_qwen import build_tiny_qwen

    lines = list(script.text_lines(script.DEFAULT_CORPUS))
    model_dir = build_tiny_qwen(out / "tiny_qwen", lines)
    same = {"--batch-size": batch, "--seq-len": seq_len, "--max-steps": steps, "--lr": 2e-3, "--min-lr": 2e-4,
            "--warmup-steps": max(1, steps // 10)}  # fmt: skip
    flags = [str(x) for kv in same.items() for x in kv]
    ours, theirs = [], []
    for _ in range(repeats):
        ours_dir, trainer_dir = run_dir(out, "ours"), run_dir(out, "trainer")
        run = launch(speed_args(steps, ["--model", "qwen", "--model-name-or-path", str(model_dir), *flags],
                                ours_dir, ours_dir / "metrics.jsonl"), nproc=2)  # fmt: skip
        ours.append(read_speed(ours_dir / "metrics.jsonl")["tokens_per_sec"])
        memory = summary_row(run, "peak memory")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(REPO / "benchmarks" / "trainer_baseline.py"), "--model", str(model_dir),
               "--out", str(trainer_dir), *flags]  # fmt: skip
        done = run_child(cmd, timeout=900)
        if done.returncode:
            raise SystemExit(f"Trainer run failed:\n{done.stdout}\n{done.stderr}")
        report = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("result: "))[8:])
        theirs.append(report["tokens_per_sec"])
    # Both trained on every line (no hold-out, so both see the same data); the losses are taken
    # on the first 64 lines, the same way, with the untrained base for scale.
    return {
        "ours_tokens_per_sec": statistics.median(ours),
        "trainer_tokens_per_sec": statistics.median(theirs),
        "ratio": statistics.median(a / b for a, b in zip(ours, theirs, strict=True)),
        "runs": {"ours": ours, "trainer": theirs},
        "base_loss": loss_on_lines(model_dir, None, lines[:64], seq_len),
        "ours_loss": loss_on_lines(model_dir, ours_dir / script.QWEN_FINAL, lines[:64], seq_len),
        "trainer_loss": loss_on_lines(model_dir, Path(report["adapter"]), lines[:64], seq_len),
        "memory": memory,
    }


# ---- the report -----------------------------------------------------------------------------


def stop_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C does, so the clean-up below runs


def in_output_folder(
    out: Path | None, keep: bool, prefix: str, work: Callable[[Path, bool], None], stop: Callable[[], None]
) -> None:
    """work(folder, removed) in --out DIR, or in a temp folder that is removed at the end (unless
    --keep-outputs), also when a run fails or the benchmark is stopped (Ctrl-C, SIGTERM): `stop`
    ends the children still running first. benchmarks/memory.py uses it too."""
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    folder = out or Path(tempfile.mkdtemp(prefix=prefix))
    remove = out is None and not keep  # a folder the user named is never removed
    done = False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        work(folder, remove)
        done = True
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a repeated SIGTERM must not cut the clean-up short
        stop()
        if remove:
            shutil.rmtree(folder, ignore_errors=True)
            if done:
                print("\nthe runs' outputs and results.json were in a temp folder, now removed "
                      "(--keep-outputs or --out DIR keeps them)")  # fmt: skip
        elif done:
            print(f"\nraw results: {folder / 'results.json'}\noutputs kept in {folder}")
        else:
            print(f"outputs so far kept in {folder}", file=sys.stderr)


def output_flags(p: argparse.ArgumentParser, also: str = "") -> None:
    """--out DIR and --keep-outputs, which every benchmark takes and in_output_folder acts on."""
    p.add_argument("--out", type=Path, default=None, metavar="DIR", help="write the runs' outputs and results.json "
                   f"here, and keep them (default: a temp folder){also}")  # fmt: skip
    p.add_argument(
        "--keep-outputs",
        action="store_true",
        help="keep the temp folder (removed by default, also on failure or Ctrl-C) and print its path",
    )


def publish(text: str, table: Path | None, also: str = "") -> None:
    """A benchmark's report: printed, and written to `table` where one is named."""
    print("\n" + text)
    if table:
        table.parent.mkdir(parents=True, exist_ok=True)
        table.write_text(text)
        print(f"table: {table}{also}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="every measurement (or --only's) once, at small sizes and few steps: checks the harness; "
        "its numbers mean nothing",
    )
    p.add_argument("--repeats", type=int, default=3)
    output_flags(p)
    p.add_argument(
        "--only",
        action="append",
        choices=MEASUREMENTS,
        metavar="NAME",
        help=f"run only this measurement and print only its rows; repeatable (default: all: {', '.join(MEASUREMENTS)})",
    )
    p.add_argument("--allreduce-worker", type=int, default=0, help=argparse.SUPPRESS)  # a rank of allreduce_ms
    args = p.parse_args()
    if args.allreduce_worker:
        return allreduce_worker(args.allreduce_worker)
    only = set(args.only or MEASUREMENTS)
    in_output_folder(
        args.out,
        args.keep_outputs,
        "ddp-benchmark-",
        lambda out, _removed: measure(out, args.smoke, 1 if args.smoke else args.repeats, only),
        stop_children,
    )


def measure(out: Path, smoke: bool, repeats: int, only: Collection[str] = MEASUREMENTS) -> None:
    """The measurements in `only`, in the order of MEASUREMENTS; the table's rows of those, in
    its order; results.json with their results."""
    tiny = SMOKE_MODEL if smoke else TINY_MODEL
    steps = 12 if smoke else 60
    sizes, reps = ((256,), 3) if smoke else ((512, 1024, 2048), 20)
    cfg, model = tiny_model(tiny)
    numel = sum(p.numel() for p in model.parameters())
    got: dict = {}  # results.json: what was measured, in the full run's order of keys
    rows: list[tuple[str, str]] = []
    if "scaling" in only:
        peak = gemm_peak(sizes, reps)
        got["scaling"] = scaling = measure_scaling(steps, repeats, tiny, out / "tiny")
        peak = max(peak, gemm_peak(sizes, reps))  # measured before and after: the machine's load drifts
        fpt = tiny_flops_per_token(tiny)
        step_ms = 1000 * cfg.batch_size * cfg.seq_len / scaling["one_rank"]["tokens_per_sec"]
        one_rank_flops = scaling["one_rank"]["tokens_per_sec"] * fpt
        two_rank_flops = scaling["two_ranks"]["tokens_per_sec"] * fpt / 2
        breakdown = " / ".join(
            f"{k[3:]} {scaling['one_rank'][k]:.1f} -> {scaling['two_ranks'][k]:.1f}"
            for k in scaling["one_rank"]
            if k.startswith("ms_")
        )
        rows += [
            ("scaling, 2 ranks vs 1, both under torchrun and DDP (goal >= 1.8x)",
             f"{scaling['ratio']:.2f}x: {scaling['two_ranks']['tokens_per_sec']:,.0f} vs "
             f"{scaling['one_rank']['tokens_per_sec']:,.0f} tokens/s"),
            ("per step, ms, 1 rank -> 2 ranks", breakdown),
            ("the 1-rank run twice at once, not communicating, vs once", f"{scaling['pair_ratio']:.2f}x the tokens/s"),
            (f"2 ranks vs the 1-rank run twice at once, same rounds (goal >= {PAIR_GOAL})",
             f"{scaling['two_vs_pair']:.3f}: {scaling['two_ranks']['tokens_per_sec']:,.0f} vs "
             f"{scaling['pair_tokens_per_sec']:,.0f} tokens/s (per round: "
             f"{', '.join(f'{r:.3f}' for r in scaling['rounds']['two_vs_pair'])})"),
        ]  # fmt: skip
    if "all-reduce" in only:
        got["allreduce_ms"] = allreduce = allreduce_ms(numel)
        per_step = f"; a 1-rank step takes {step_ms:.0f} ms" if "scaling" in only else ""
        rows.append((f"one all-reduce of the {4 * numel / 1e6:.1f} MB gradient, 2 Gloo ranks alone",
                     f"{allreduce['fp32']:.1f} ms (bf16: {allreduce['bf16']:.1f} ms){per_step}"))  # fmt: skip
        if "scaling" in only:
            # What 2 ranks could reach if the only losses were the two measured apart: sharing the
            # machine, and one step's all-reduce with nothing hidden behind backward. The rest of the
            # gap is waiting: each step runs at the pace of the slower rank.
            got["ceiling"] = ceiling = scaling["pair_ratio"] * step_ms / (step_ms + allreduce["fp32"])
            rows.append(("scaling if those two were the only losses (no overlap)", f"{ceiling:.2f}x"))
    if "scaling" in only:
        got |= {"gemm_peak": peak, "flops_per_token": fpt}
        rows += [
            ("matmul peak, 1 thread", f"{peak / 1e9:.1f} GFLOP/s"),
            ("efficiency, 1 rank (goal >= 70%)",
             f"{100 * one_rank_flops / peak:.0f}% ({one_rank_flops / 1e9:.1f} GFLOP/s at {fpt / 1e6:.2f} MFLOP/token)"),
            ("efficiency, per rank of 2", f"{100 * two_rank_flops / peak:.0f}%"),
        ]  # fmt: skip
    if "start-up" in only:
        startup_one = statistics.median(seconds_to_first_step(None, tiny, out / "startup") for _ in range(repeats))
        startup_two = statistics.median(seconds_to_first_step(2, tiny, out / "startup") for _ in range(repeats))
        got |= {"startup_one": startup_one, "startup_two": startup_two}
        rows += [
            ("start-up to first step, 1 process (goal <= 3 s)", f"{startup_one:.2f} s"),
            ("start-up to first step, 2 ranks (torchrun)", f"{startup_two:.2f} s"),
        ]
    if "memory" in only:
        tiny_memory = summary_row(launch(["--cpu", "--max-steps", "3", "--output-dir", str(run_dir(out, "mem")),
                                          *tiny], 2), "peak memory")  # fmt: skip
    if "trainer" in only:
        got["trainer"] = trainer = compare_with_trainer(10 if smoke else 300, repeats, 8, 64, out / "qwen")
        rows += [
            ("LoRA vs Trainer, 2 ranks (goal >= 1.2x)",
             f"{trainer['ratio']:.2f}x: {trainer['ours_tokens_per_sec']:,.0f} vs "
             f"{trainer['trainer_tokens_per_sec']:,.0f} tokens/s"),
            ("loss on the same 64 training lines after training, ours vs Trainer",
             f"{trainer['ours_loss']:.4f} vs {trainer['trainer_loss']:.4f} (untrained: {trainer['base_loss']:.4f})"),
        ]  # fmt: skip
    if "memory" in only:
        got["tiny_memory"] = tiny_memory
        rows.append(("peak memory, tiny model", tiny_memory))
    if "trainer" in only:
        rows.append(("peak memory, Qwen2 + LoRA (tiny fixture)", trainer["memory"]))

    print(f"\n{'smoke run: sizes and step counts are too small for these numbers to mean anything' if smoke else ''}")
    print("| measurement | result |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    (out / "results.json").write_text(json.dumps(got, indent=1))


if __name__ == "__main__":
    main()
