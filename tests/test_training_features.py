"""What users of a training script expect, each checked through the CLI: schedule, clipping,
validation, precision, progress display, metrics file, plot and summary.

None of these depends on how the run was started: the 2-rank runs share one launch and the
one-process runs another (conftest.run_jobs, each through the script's own parse_args() and
run()). That one process runs on a CPU capped at AVX2, which has no bf16 instructions, for the
test of the emulated-bf16 warning; no other one-process test depends on the instruction set.
A run without matplotlib and a run on a terminal are launched alone."""

from __future__ import annotations

import fcntl
import json
import math
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
import torch
from conftest import SCRIPT, TINY, assert_ok, child_env, launch, run_jobs, split_lines
from probe_worker import run_jobs_with_probes
from rows import byte_examples

import llm_ddp_parallel_training as t

LR, MIN_LR, WARMUP, STEPS = 0.004, 0.0004, 10, 30
VAL_FRACTION = 0.07  # 26 of 375 lines: 39 packed examples, an odd count


CLIP, CLIP_LR = 0.1, 0.5
COMPARED = ["--dropout", "0", "--max-steps", "4", "--log-every", "1", "--val-fraction", "0"]  # --compile or not
# Each block compiled, then wrapped or sharded (its hooks outside the compiled forward): under DDP, torch's FSDP
# (fully_shard) and the from-scratch FSDP, each against the eager DDP run.
COMPILED = {"compiled": [], "compiled, sharded": ["--sharding", "full"],
            "compiled, sharded from scratch": ["--sharding", "full", "--ddp", "manual"]}  # fmt: skip
SMALL_CORPUS = [f"line {i}: each rank averages the gradients it computed." for i in range(12)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every 2-rank run of this module, in one launch. Name -> (the run, its output folder)."""
    root = tmp_path_factory.mktemp("two_ranks")
    outs = {name: root / name for name in ("reported", "clipped", "bf16", "epochs", "capped", "small", *COMPILED,
                                           "eager")}  # fmt: skip
    for out in outs.values():
        out.mkdir()
    corpus = root / "small.txt"
    corpus.write_text("\n".join(SMALL_CORPUS) + "\n")
    jobs = {
        # validation, a metrics file and a plot
        "reported": [*TINY, "--max-steps", str(STEPS), "--warmup-steps", str(WARMUP), "--lr", str(LR),
                     "--min-lr", str(MIN_LR), "--log-every", "1", "--eval-every", "10", "--val-fraction",
                     str(VAL_FRACTION), "--metrics-file", str(outs["reported"] / "metrics.jsonl"), "--plot"],
        "clipped": [*TINY, "--optimizer", "sgd", "--lr", str(CLIP_LR), "--min-lr", str(CLIP_LR), "--warmup-steps",
                    "0", "--weight-decay", "0", "--grad-clip", str(CLIP), "--max-steps", "1",
                    "--metrics-file", str(outs["clipped"] / "m.jsonl")],
        "bf16": [*TINY, "--precision", "bf16", "--max-steps", "30", "--log-every", "10"],
        "epochs": [*TINY, "--epochs", "2", "--log-every", "1", "--warmup-steps", "5", "--lr", str(LR), "--min-lr",
                   str(MIN_LR), "--metrics-file", str(outs["epochs"] / "m.jsonl")],
        "capped": [*TINY, "--epochs", "2", "--max-steps", "3"],
        "small": [*TINY, "--corpus-file", str(corpus), "--batch-size", "1", "--max-steps", "2",
                  "--metrics-file", str(root / "small-metrics.jsonl")],
        **{name: [*TINY, "--compile", *layout, *COMPARED] for name, layout in COMPILED.items()},
        "eager": [*TINY, *COMPARED],
    }  # fmt: skip
    ran = run_jobs(
        {name: [*args, "--output-dir", str(outs[name])] for name, args in jobs.items()}, nproc=2, timeout=480
    )
    return {name: (ran[name], outs[name]) for name in jobs}


# This CPU may compute bf16 natively; capping oneDNN and ATen at AVX2 (no bf16 instructions)
# makes it emulate bf16, as an AVX2-only CPU does.
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Every one-process run of this module in one plain process (no process group), in one
    launch, on a CPU capped at AVX2 (AVX2_ONLY)."""
    root = tmp_path_factory.mktemp("one_process")
    outs = {name: root / name for name in ("fp16", "plot", "one", "short", "bf16")}
    for out in outs.values():
        out.mkdir()
    jobs = {
        "fp16": [*TINY, "--precision", "fp16"],
        "plot": [*TINY, "--max-steps", "12", "--log-every", "100", "--eval-every", "6", "--save-every", "12",
                 "--plot"],
        "one": [*TINY, "--max-steps", "1"],
        "short": [*TINY, "--max-steps", "6", "--log-every", "1", "--lr", "0.003", "--val-fraction", "0",
                  "--metrics-file", str(outs["short"] / "metrics.jsonl")],
        "bf16": [*TINY, "--precision", "bf16", "--max-steps", "1", "--val-fraction", "0"],
    }  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:  # conftest.child_env passes the test process's environment on
        for name, value in AVX2_ONLY.items():
            patch.setenv(name, value)
        ran = run_jobs({name: [*args, "--output-dir", str(outs[name])] for name, args in jobs.items()}, timeout=300)
    return {name: (ran[name], outs[name]) for name in jobs}


@pytest.fixture(scope="module")
def reported(two_ranks):
    """One two-rank run with validation, a metrics file and a plot."""
    run, out = two_ranks["reported"]
    assert_ok(run)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return run, out, records


def test_the_metrics_file_has_one_record_per_step_from_rank_0_only(reported):
    _, _, records = reported
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_sec"} <= r.keys()
        assert r["tokens_per_sec"] > 0 and math.isfinite(r["loss"]) and r["grad_norm"] > 0
    assert [r["step"] for r in records if "val_loss" in r] == [10, 20, 30]
    assert all({"val_ppl", "val_bpb"} <= r.keys() for r in records if "val_loss" in r)


def test_learning_rate_warms_up_linearly_then_decays_by_cosine(reported):
    lrs = {r["step"]: r["lr"] for r in reported[2]}
    for step in range(1, WARMUP + 1):
        assert lrs[step] == pytest.approx(LR * step / WARMUP)
    for step in range(WARMUP + 1, STEPS + 1):
        done = (step - WARMUP) / (STEPS - WARMUP)
        assert lrs[step] == pytest.approx(MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * done)))
    assert lrs[STEPS] == pytest.approx(MIN_LR)


def test_validation_loss_equals_a_direct_single_process_computation(reported, corpus_lines):
    _, out, records = reported
    model = t.load_tiny_checkpoint(out / "tiny_transformer.pt")
    _, val_lines = split_lines(corpus_lines, VAL_FRACTION, seed=1337)
    val = byte_examples(val_lines, seq_len=64, pack=True)
    assert len(val) % 2 == 1, "an odd count: two ranks cannot split it evenly"
    with torch.no_grad():
        loss_sum = t.token_loss_sum(model(val.inputs), val.targets).item()
        tokens = int((val.targets != t.IGNORE_INDEX).sum())
        # What a DistributedSampler's padding would do: repeat the first example.
        padded = loss_sum + t.token_loss_sum(model(val.inputs[:1]), val.targets[:1]).item()
    direct = loss_sum / tokens
    reported_loss = records[-1]["val_loss"]
    assert reported_loss == pytest.approx(direct, rel=1e-5)
    assert abs(padded / (tokens + int((val.targets[:1] != t.IGNORE_INDEX).sum())) - direct) > 1e-4
    assert records[-1]["val_ppl"] == pytest.approx(math.exp(direct), rel=1e-5)
    assert records[-1]["val_bpb"] == pytest.approx(loss_sum / math.log(2) / int(val.target_bytes.sum()), rel=1e-5)


def test_the_plot_is_a_png_of_train_and_validation_loss(reported):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    png = reported[1] / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(png).shape
    assert height > 100 and width > 100


def test_the_summary_reports_steps_tokens_time_losses_and_outputs(reported):
    run, out, records = reported
    summary = run.stdout.split("[summary]")[1]
    for row in ("steps", "tokens seen", "wall time", "tokens/s", "train loss", "val loss", "outputs"):
        assert f"  {row} " in summary
    assert f"{records[-1]['tokens_seen']:,}" in summary and str(out / "loss.png") in summary


def test_the_summary_names_every_file_and_folder_the_run_wrote(one_process):
    run, out = one_process["plot"]
    assert_ok(run)
    row = re.search(r"^  outputs\s+(.*)$", run.stdout, re.M).group(1).split(", ")
    assert row == [str(out / n) for n in ("tiny_transformer.pt", "loss.png", "memory.json", "config.yaml")] + [
        f"{out / 'checkpoints'}/"]  # fmt: skip


def test_an_evaluation_only_at_the_end_is_weighed_against_the_training_steps(one_process):
    run, _ = one_process["one"]  # --max-steps 1: no steps between two evaluations
    assert re.search(r"^\[eval\] every held-out example, at the end: about [0-9.]+% of the compute of the training "
                     r"steps \(", run.stdout, re.M), run.stdout  # fmt: skip


def test_a_missing_matplotlib_is_one_line_not_a_failure(tmp_path):
    blocker = tmp_path / "no_matplotlib" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is not installed here')\n")
    env = child_env({"PYTHONPATH": f"{blocker.parent}{os.pathsep}{child_env()['PYTHONPATH']}"})
    run = launch([*TINY, "--max-steps", "2", "--plot", "--output-dir", str(tmp_path)], env=env)
    assert_ok(run)
    assert "[plot] skipped: matplotlib is not installed" in run.stdout
    assert not (tmp_path / "loss.png").exists()


def test_gradient_clipping_caps_the_synchronised_global_norm(two_ranks):
    # One SGD step from the seeded initial weights: with the norm clipped to 0.1 the weights
    # move by exactly lr x 0.1. Clipping each rank's gradient before the all-reduce would not
    # give this: the average of two clipped vectors is shorter than either.
    clip, lr = CLIP, CLIP_LR
    run, out = two_ranks["clipped"]
    assert_ok(run)
    torch.manual_seed(1337)
    start = t.TinyTransformer(t.TinyConfig(seq_len=64, d_model=32, n_heads=2, n_layers=1)).state_dict()
    end = t.load_tiny_checkpoint(out / "tiny_transformer.pt").state_dict()
    moved = math.sqrt(sum((end[k] - start[k]).double().square().sum().item() for k in start))
    assert json.loads((out / "m.jsonl").read_text())["grad_norm"] > clip  # the norm before clipping
    assert moved == pytest.approx(lr * clip, rel=1e-4)


@pytest.mark.parametrize("layout", COMPILED)
def test_compile_trains_what_the_uncompiled_blocks_train(two_ranks, layout):
    (compiled, out), (eager, reference) = two_ranks[layout], two_ranks["eager"]
    assert_ok(compiled)
    assert_ok(eager)
    assert len(compiled.losses()) == 4 == len(eager.losses())  # rank 0 logs
    # Inductor fuses the block's operations and may sum in another order, as FSDP's reduce-scatter may: fp32
    # rounding, not other maths (1.2e-6 at most in the weights, measured at 4 AdamW steps).
    assert compiled.losses() == pytest.approx(eager.losses(), rel=1e-5)
    ours, theirs = (torch.load(o / t.TINY_FINAL, weights_only=True)["model"] for o in (out, reference))
    assert ours.keys() == theirs.keys(), "compiling in place keeps the checkpoint's keys"
    for name, value in ours.items():
        torch.testing.assert_close(value, theirs[name], rtol=0, atol=1e-5, msg=name)


def test_compile_is_refused_in_one_line_where_the_blocks_are_split():
    for layout in (["--tp", "2"], ["--pp", "2"], ["--cp", "2"]):
        with pytest.raises(t.UsageError, match=r"^--compile runs under DDP and --sharding; not yet with --tp, --pp"):
            t.parse_args(["--compile", *layout])


def test_compile_is_on_by_default_where_there_is_a_gpu_and_the_model_is_not_split():
    assert t.parse_args([]).compile is torch.cuda.is_available()
    assert t.parse_args(["--sharding", "full"]).compile is torch.cuda.is_available()
    assert t.parse_args(["--cpu"]).compile is False
    assert t.parse_args(["--tp", "2"]).compile is t.parse_args(["--pp", "2"]).compile is False  # not refused: off
    assert t.parse_args(["--compile", "--cpu"]).compile is True and t.parse_args(["--no-compile"]).compile is False


def test_bf16_autocast_runs_and_learns_on_cpu(two_ranks):
    run, _ = two_ranks["bf16"]
    assert_ok(run)
    assert "precision bf16" in run.stdout
    losses = run.losses()
    assert losses[-1] < losses[0] - 1.0, losses


def test_fp16_is_refused_on_cpu(one_process):
    run, _ = one_process["fp16"]
    assert run.returncode == 2 and "--precision fp16 needs a CUDA GPU" in run.stderr


def test_a_terminal_gets_a_progress_bar_and_a_pipe_gets_log_lines(tmp_path, reported):
    piped = reported[0]
    assert "step     1/30 | loss" in piped.stdout
    assert "step/s" not in piped.output and "s/step" not in piped.output
    # The same script on a terminal (a pseudo-terminal, 120 columns): a tqdm bar, no per-step lines.
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *TINY, "--max-steps", "5", "--output-dir", str(tmp_path)],
        stdin=child, stdout=child, stderr=child, env=child_env(), close_fds=True,
    )  # fmt: skip
    os.close(child)
    chunks, deadline = [], time.monotonic() + 60
    while True:
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("timed out on the terminal")
        if not select.select([main], [], [], 1)[0]:
            continue
        try:
            data = os.read(main, 4096)
        except OSError:  # the terminal closed: the process has exited
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=60) == 0
    screen = b"".join(chunks).decode(errors="replace")
    assert "5/5" in screen and ("step/s" in screen or "s/step" in screen), screen
    assert "step     1/5 | loss" not in screen
    assert "[summary]" in screen


@pytest.mark.parametrize(
    "name, peak",
    [("NVIDIA L4", 121e12), ("NVIDIA L40", None), ("NVIDIA L40S", 362e12), ("NVIDIA H100 PCIe", 756e12),
     ("NVIDIA H100 80GB HBM3", 989e12), ("Tesla T4", None)],
)  # fmt: skip
def test_mfu_peaks_match_the_gpu_name_exactly(name, peak):
    # By substring "L4" would match an L40, and "H100" would give the PCIe part the SXM's peak.
    assert t.gpu_peak_flops(name) == peak


def test_epochs_set_the_runs_length_and_the_schedule_spans_it(two_ranks):
    # 493 packed windows: 246 per rank, 61 steps of 4 per epoch on 2 ranks.
    run, out = two_ranks["epochs"]
    assert_ok(run)
    assert "--epochs 2 x 61 steps per epoch = 122 steps" in run.stdout
    records = [json.loads(line) for line in (out / "m.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 122 and records[-1]["epoch"] == 1
    assert records[-1]["lr"] == pytest.approx(MIN_LR)
    capped, _ = two_ranks["capped"]
    assert_ok(capped)
    assert "= 3 steps, capped by --max-steps 3" in capped.stdout


def test_the_loss_plot_follows_every_step_not_only_the_logged_ones(one_process):
    run, out = one_process["plot"]
    assert_ok(run)
    assert len(run.losses()) == 3  # logged: steps 1, 6 (an evaluation) and 12
    state = torch.load(out / "checkpoints" / "step_00000012" / "state.pt", weights_only=True)
    history = state["progress"]["history"]  # what write_loss_plot draws
    assert [h["step"] for h in history] == list(range(1, 13))
    assert [h["step"] for h in history if "val_loss" in h] == [6, 12]
    assert (out / "loss.png").exists()


def test_one_process_says_it_synchronises_nothing(one_process):
    run, _ = one_process["one"]
    assert_ok(run)
    assert "[run] gradient sync: none (one process" in run.stdout
    assert "MiB buckets" not in run.stdout


def test_without_warmup_step_1_trains_at_the_full_rate():
    cfg = t.parse_args([*TINY, "--lr", "0.5", "--warmup-steps", "0", "--max-steps", "10"])
    assert t.lr_at(cfg, 1) == 0.5
    assert t.lr_at(cfg, 2) < 0.5 and t.lr_at(cfg, 10) == pytest.approx(0.05)


def test_a_warmup_longer_than_half_the_run_becomes_a_tenth_of_it():
    cfg = t.parse_args([*TINY, "--lr", "0.003", "--max-steps", "15"])  # the default 20 warmup steps
    assert t.warmup_steps(cfg) == 1
    assert t.lr_at(cfg, 1) == 0.003 and t.lr_at(cfg, 15) == pytest.approx(0.0003)
    assert "more than half of this run's 15 steps: warming up for 1 step instead" in t.describe_warmup(cfg)
    kept = t.parse_args([*TINY, "--warmup-steps", "10", "--max-steps", "20"])  # half the run: as asked
    assert t.warmup_steps(kept) == 10 and t.describe_warmup(kept) is None


def test_a_short_run_says_its_warmup_was_capped_and_ends_decayed(one_process):
    run, out = one_process["short"]
    metrics = out / "metrics.jsonl"
    assert_ok(run)
    assert "[run] --warmup-steps 20 is more than half of this run's 6 steps: warming up for 1 step" in run.stdout
    lrs = [json.loads(line)["lr"] for line in metrics.read_text().splitlines()]
    assert lrs[0] == pytest.approx(0.003) and lrs[-1] == pytest.approx(0.0003)


def test_validation_with_fewer_held_out_examples_than_ranks_is_the_mean_over_those_that_exist(two_ranks):
    lines = SMALL_CORPUS
    run, out = two_ranks["small"]
    metrics = out.parent / "small-metrics.jsonl"
    assert_ok(run)
    _, val_lines = split_lines(lines, 0.1, seed=1337)
    val = byte_examples(val_lines, seq_len=64, pack=True)
    assert len(val) == 1, "one held-out example: rank 1 holds none"
    model = t.load_tiny_checkpoint(out / "tiny_transformer.pt")
    with torch.no_grad():
        direct = t.token_loss_sum(model(val.inputs), val.targets).item() / int((val.targets != t.IGNORE_INDEX).sum())
    assert json.loads(metrics.read_text().splitlines()[-1])["val_loss"] == pytest.approx(direct, rel=1e-5)


def test_the_defaults_are_the_good_short_run():
    # The run a learner gets with no flag is the quick start's: a 2-layer model that writes
    # readable text in about a minute, not a benchmark-sized one that ends in gibberish.
    cfg = t.parse_args([])
    assert (cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.batch_size, cfg.max_steps) == (128, 4, 2, 8, 600)


def test_emulated_bf16_on_a_cpu_is_said_at_start_up(one_process):
    run, _ = one_process["bf16"]  # on a CPU capped at AVX2 (AVX2_ONLY): no bf16 instructions
    assert_ok(run)
    warning = [line for line in run.stdout.splitlines() if "no bf16 instructions" in line]
    assert len(warning) == 1 and "x slower than fp32" in warning[0] and "--precision fp32" in warning[0]
    assert t.choose_precision(t.parse_args(["--cpu"]), t.setup_distributed(t.parse_args(["--cpu"]))) == "fp32"


def test_compile_wraps_each_sharded_blocks_own_forward_so_checkpointing_stays_on(tiny_qwen, tmp_path):
    # fully_shard makes each block an instance of a subclass, whose forward transformers wraps again and checkpoints
    # in only the outermost wrapper: a block compiled before sharding would run that subclass's inner forward,
    # silently without checkpointing. The blocks are compiled after (SideWork.start): each wraps its class's own.
    args = [
        "--model",
        "qwen",
        "--model-name-or-path",
        str(tiny_qwen),
        "--cpu",
        "--output-dir",
        str(tmp_path),
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--sharding",
        "full",
        "--gradient-checkpointing",
        "--compile",
    ]
    run = run_jobs_with_probes({"probe": ["probe:compiled_blocks", *args]}, nproc=2, timeout=180)["probe"]
    assert_ok(run)
    found = next(line.split()[1:] for line in run.stdout.splitlines() if line.startswith("COMPILED_AS_WRAPPED"))
    assert found[-1].startswith("FSDP") and set(found[:-1]) == {"True"}, found  # fmt: skip
