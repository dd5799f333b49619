"""What DDP does to every gradient, proven through the CLI and the saved checkpoints.

The equivalences use plain SGD without gradient clipping, dropout 0, fp32 on CPU. SGD moves
each weight by exactly lr x gradient, so a gradient that is off by any factor shows up directly
in the weights (Adam divides such a factor back out, and clipping caps it). Runs that split the
same global batch differently add the same token losses in a different order, so they agree to
float32 rounding, not bitwise: we measured max |dparam| = 1.2e-7 here after 5 steps. We assert
1e-5: two orders above rounding, and far below what a real bug costs: doubling the gradient (a
sum where a mean belongs) moves the weights by 0.29 in this setup, and averaging per-rank means
instead of counting tokens globally by 7.5e-3 (see the tests below).

What a run does to its gradients does not depend on how it was started: every run here shares one
2-rank launch, or one plain process for the single-process runs (conftest.run_jobs), each through
the script's own parse_args() and run(); the dropout probe, which stands in for train(), runs in the
2-rank launch too (tests/probe_worker.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY, Run, assert_ok, max_difference, run_jobs
from probe_worker import run_jobs_with_probes

import llm_ddp_parallel_training as t

TOLERANCE = 1e-5
# --no-pack: one padded line per example, so ranks and micro-steps hold different token counts.
SGD = [
    *TINY,
    "--no-pack",
    "--optimizer",
    "sgd",
    "--lr",
    "0.5",
    "--grad-clip",
    "0",
    "--max-steps",
    "5",
    "--log-every",
    "1",
]

# name: (ranks (None = one plain process), extra flags)
RUNS = {
    "2 ranks x 4": (2, ["--batch-size", "4"]),
    "1 rank x 8": (None, ["--batch-size", "8"]),
    "1 rank x 4 x accumulation 2": (None, ["--batch-size", "4", "--grad-accum-steps", "2"]),
    "2 ranks x 2 x accumulation 2": (2, ["--batch-size", "2", "--grad-accum-steps", "2"]),
    "manual DDP, 2 ranks x 4": (
        2,
        ["--batch-size", "4", "--ddp", "manual", "--bucket-mb", "0.01", "--verify-sync", "1"],
    ),
    "manual DDP, 2 ranks x 2 x accumulation 2": (
        2,
        [
            "--batch-size",
            "2",
            "--grad-accum-steps",
            "2",
            "--ddp",
            "manual",
            "--bucket-mb",
            "0.01",
            "--verify-sync",
            "1",
        ],
    ),
    "mean-of-means, 2 ranks x 4": (2, ["--batch-size", "4", "--loss-normalization", "mean-of-means"]),
    "bf16 gradient all-reduce, 2 ranks x 4": (2, ["--batch-size", "4", "--grad-compression", "bf16"]),
    "manual DDP, bf16 gradient all-reduce, 2 ranks x 4": (
        2,
        ["--batch-size", "4", "--ddp", "manual", "--bucket-mb", "0.01", "--grad-compression", "bf16"],
    ),
    "1 rank x 8, gradient doubled": (None, ["--batch-size", "8", "--lr", "1.0"]),
}


DESYNC = "verify-sync, rank 1 desynchronised at step 2"
INSPECT = "inspect, 3 steps"
INSPECT_CLIPPED = "inspect, 2 steps, every step clipped"
DROPOUT_PROBE = "dropout 0.5, probed where train() starts"


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, tuple[Run, Path]]:
    """Every run of this module, in two launches: one of 2 ranks, one plain process (run_jobs).

    Each configuration of RUNS keeps its own kind of process: the 2-rank ones run on 2 Gloo ranks,
    the others in one plain process with no process group. Returns each run and its output folder."""
    root = tmp_path_factory.mktemp("gradients")
    jobs: dict[int | None, dict[str, list[str]]] = {2: {}, None: {}}
    outs = {}
    for i, (name, (nproc, flags)) in enumerate(RUNS.items()):
        outs[name] = root / str(i)
        jobs[nproc][name] = [*SGD, *flags, "--output-dir", str(outs[name])]
    extra = {
        DESYNC: [*SGD, "--verify-sync", "1", "--inject-fault", "1:2:desync"],
        INSPECT: [*TINY, "--max-steps", "3", "--inspect"],
        INSPECT_CLIPPED: [*TINY, "--max-steps", "2", "--log-every", "1", "--grad-clip", "0.01", "--inspect"],
        DROPOUT_PROBE: ["probe:dropout", *TINY, "--dropout", "0.5"],
    }
    for name, args in extra.items():
        outs[name] = root / f"extra{len(outs)}"
        jobs[2][name] = [*args, "--output-dir", str(outs[name])]
    ran = {**run_jobs_with_probes(jobs[2], nproc=2, timeout=480), **run_jobs(jobs[None], timeout=300)}
    return {name: (ran[name], outs[name]) for name in outs}


@pytest.fixture(scope="module")
def runs(launched) -> dict[str, tuple[Run, dict[str, torch.Tensor]]]:
    """Every configuration of RUNS: its output and final weights."""
    results = {}
    for name in RUNS:
        run, out = launched[name]
        assert_ok(run)
        results[name] = (run, torch.load(out / "tiny_transformer.pt", weights_only=True)["model"])
    return results


@pytest.fixture(scope="module")
def trained(runs) -> dict[str, dict[str, torch.Tensor]]:
    return {name: weights for name, (_, weights) in runs.items()}


@pytest.mark.parametrize("other", ["1 rank x 8", "1 rank x 4 x accumulation 2", "2 ranks x 2 x accumulation 2"])
def test_the_same_global_batch_gives_the_same_weights_however_it_is_split(trained, other):
    diff = max_difference(trained["2 ranks x 4"], trained[other])
    print(f"2 ranks x 4 vs {other}: max |dparam| = {diff:.3g}")
    assert diff < TOLERANCE


@pytest.mark.parametrize("manual, torch_ref", [
    ("manual DDP, 2 ranks x 4", "2 ranks x 4"),
    ("manual DDP, 2 ranks x 2 x accumulation 2", "2 ranks x 2 x accumulation 2"),
])  # fmt: skip
def test_manual_ddp_matches_torch_ddp_bitwise(trained, manual, torch_ref):
    # Both sum the same two numbers per element (and divide by 2, which is exact), so the
    # from-scratch all-reduce reproduces torch's bit for bit, whatever the bucket layout.
    a, b = trained[manual], trained[torch_ref]
    assert all(torch.equal(a[k], b[k]) for k in a), f"max |dparam| = {max_difference(a, b):.3g}"


def test_mean_of_per_rank_means_is_not_the_global_mean(trained):
    # Lines differ in length, so ranks hold different token counts; averaging their means
    # weighs tokens unequally, and the weights drift from the exact global-batch result.
    diff = max_difference(trained["2 ranks x 4"], trained["mean-of-means, 2 ranks x 4"])
    print(f"mean-of-means vs global-tokens: max |dparam| = {diff:.3g}")
    assert diff > 100 * TOLERANCE


@pytest.mark.parametrize("ddp", ["torch", "manual"])
def test_bf16_gradient_compression_halves_the_bytes_and_barely_moves_the_weights(runs, trained, ddp):
    # bf16 keeps 8 significant bits: each rank's gradient is rounded by up to 2^-8 of itself before
    # the sum. After 5 SGD steps at lr 0.5 that moved the weights by 5.6e-4 here (torch's hook
    # and the manual DDP alike); we allow 5e-3, and require more than float32 rounding.
    fp32, bf16 = {
        "torch": ("2 ranks x 4", "bf16 gradient all-reduce, 2 ranks x 4"),
        "manual": ("manual DDP, 2 ranks x 4", "manual DDP, bf16 gradient all-reduce, 2 ranks x 4"),
    }[ddp]
    diff = max_difference(trained[fp32], trained[bf16])
    print(f"bf16 all-reduce ({ddp} DDP) vs fp32: max |dparam| = {diff:.3g}")
    assert TOLERANCE < diff < 5e-3
    # The same buckets, half the bytes (the log prints MiB to two decimals).
    (buckets, full), (buckets_bf16, half) = (sent_per_step(runs[r][0])[0].split(" bucket(s), ") for r in (fp32, bf16))
    assert buckets == buckets_bf16
    assert float(half.split()[0]) == pytest.approx(float(full.split()[0]) / 2, abs=0.006)


def test_the_tolerance_would_catch_a_factor_of_two(trained):
    diff = max_difference(trained["1 rank x 8"], trained["1 rank x 8, gradient doubled"])
    print(f"gradient x2: max |dparam| = {diff:.3g}")
    assert diff > 100 * TOLERANCE


def sent_per_step(run: Run) -> list[str]:
    return [
        line.split("| all-reduced ")[1].split(" | ")[0] for line in run.stdout.splitlines() if "| all-reduced" in line
    ]


@pytest.mark.parametrize("ddp", ["", "manual DDP, "])
def test_accumulation_all_reduces_once_per_optimizer_step(runs, ddp):
    # Two micro-steps per optimizer step, yet the same single bucket goes out once per step:
    # the first micro-step ran inside no_sync() and sent nothing.
    one = sent_per_step(runs[f"{ddp}2 ranks x 4"][0])
    two = sent_per_step(runs[f"{ddp}2 ranks x 2 x accumulation 2"][0])
    assert len(one) == len(two) == 5, (one, two)
    assert len(set(one + two)) == 1, (one, two)
    if not ddp:
        assert one[0] == "1 bucket(s), 0.12 MiB"


def test_verify_sync_stops_every_rank_when_one_rank_diverges(launched):
    run, out = launched[DESYNC]
    assert run.returncode == 1
    assert run.codes == (1, 1), run.codes  # every rank stopped with the error, none trained on
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, run.stderr
    assert "replicas diverged at step 2 (after the gradient all-reduce)" in errors[0]
    assert "first differing tensor grad of tok_emb.weight; rank(s) [1] differ from rank 0" in errors[0]
    assert not (out / "tiny_transformer.pt").exists()


def test_inspect_reports_shards_buckets_and_gradients_rank_by_rank(launched):
    run, _ = launched[INSPECT]
    assert_ok(run)
    lines = [line for line in run.stdout.splitlines() if line.startswith("[inspect]")]
    shard_lines = [line for line in lines if "shard:" in line]
    assert [line.split(":")[0] for line in shard_lines] == ["[inspect] rank 0"] * 2 + ["[inspect] rank 1"] * 2
    assert "epoch 0 shard" in shard_lines[0] and "epoch 1 shard" in shard_lines[1]
    assert any(line.startswith("[inspect]   bucket 0:") for line in lines)
    for step in (1, 2, 3):
        for rank in (0, 1):
            assert any(f"rank {rank}: step {step}: local grad norm" in line and "cosine" in line for line in lines)
        assert any(
            f"step {step}: global-token mean loss" in line and "mean of per-rank means" in line for line in lines
        )


def test_inspect_shows_the_averaged_gradient_identical_on_every_rank_and_before_clipping(launched):
    # After the all-reduce every rank holds the same gradient: its norm is the one the step logs
    # (the norm before clipping: with --grad-clip 0.01 every step clips, and a report taken after
    # clipping would read 0.0100).
    run, _ = launched[INSPECT_CLIPPED]
    assert_ok(run)
    for step in (1, 2):
        averaged = {
            line.split("averaged ")[1].split()[0]
            for line in run.stdout.splitlines()
            if f": step {step}: local grad norm" in line
        }
        logged = next(line for line in run.stdout.splitlines() if line.startswith(f"step {step:>5}/"))
        assert len(averaged) == 1, averaged
        assert float(averaged.pop()) == pytest.approx(float(logged.split("grad norm ")[1].split()[0]), abs=2e-3)


def test_verify_sync_compares_bit_patterns_so_an_fp16_overflow_step_is_no_divergence():
    # fp16 with a GradScaler: an overflowing step is routine. Every rank holds the same inf and
    # NaN gradients and the scaler skips the step; their NaN fingerprints never compare equal as
    # numbers, only as bits. (Function level: the fp16 path needs CUDA to run whole.)
    d = t.Dist(0, 0, 1, 1, torch.device("cpu"), None, "one process")
    overflowed = [("grad of w", torch.tensor([float("inf"), -float("inf"), 1.0], dtype=torch.float16))]
    t.verify_replicas_agree(d, 7, "after the gradient all-reduce", overflowed)


def test_ranks_start_with_equal_weights_but_draw_their_own_dropout_masks(launched):
    # tests/probe_worker.py's dropout probe: everything before train() runs as in a real run, then
    # rank 0 compares the ranks' first 4096 weights and a dropout mask each rank draws.
    run, _ = launched[DROPOUT_PROBE]
    assert_ok(run)
    assert "WEIGHTS_EQUAL True MASKS_EQUAL False" in run.stdout, run.output
