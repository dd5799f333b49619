"""--tp and --pp (issue 28): tensor and pipeline parallelism, torch's and from scratch, on Gloo.

Splitting the model moves where each multiply-add runs; it must not move the numbers beyond the
rounding of a different order of additions. Judged on the tiny model (TINY, 2 blocks so that there
are two stages to cut), fp32, SGD, dropout 0, 12 steps:
  - every layout lands within 1e-6 max |dweight| of a plain run on the same global batch: one
    process when the model is split over every rank, 2-rank DDP when 4 ranks hold 2 replicas;
  - each from-scratch layout (--ddp manual) lands bitwise on torch's (--ddp torch) for the same layout;
  - in float64 through the Python API, TP and PP land within 1e-10 of one process.
A checkpoint holds the whole state whatever the layout, so any layout resumes any other.

Launches, all with hard timeouts (pipelining on Gloo has hung before): one of 4 ranks, one of 2
ranks (every 2-rank run and probe, tests/parallelism_worker.py), one plain process; each runs its
jobs through the script's own parse_args() and run() (conftest.run_jobs). The order is the order
of what resumes what: 4 ranks write a checkpoint that 2 ranks resume, 2 ranks one that the one
process resumes. Kill and restart, which need launches of their own, are in
test_parallelism_resume.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import TINY, Run, assert_bitwise_equal, assert_ok, checkpoint, max_difference, weights
from in_process import run_main
from parallelism_worker import probe_facts, run_jobs

import llm_ddp_parallel_training as t

# Two blocks: a pipeline of 2 stages needs one block each. Two micro-steps of 2 examples: under --pp 2 each is cut
# into 2 micro-batches of one example, 4 a step.
SPLIT = [*TINY, "--n-layers", "2", "--batch-size", "2", "--grad-accum-steps", "2"]
# SGD moves each weight by exactly lr x gradient: a gradient off by any factor shows in the weights.
SGD = [*SPLIT, "--optimizer", "sgd", "--lr", "0.5", "--grad-clip", "0", "--dropout", "0", "--max-steps", "12",
       "--save-every", "6", "--keep-last", "2", "--log-every", "6"]  # fmt: skip
# AdamW (the default), clipping that acts at every step, 4 micro-batches of one example each.
CLIP = 0.5
ADAMW = [*SPLIT, "--batch-size", "1", "--grad-accum-steps", "4", "--grad-clip", str(CLIP), "--dropout", "0",
         "--max-steps", "12", "--log-every", "1"]  # fmt: skip
DROPOUT = [*SPLIT, "--dropout", "0.1", "--verify-sync", "1", "--max-steps", "4", "--log-every", "1"]
PLAIN = [*TINY, "--n-layers", "2", "--max-steps", "2"]  # AdamW, clipping: the defaults
SHOW = [*SPLIT, "--max-steps", "3", "--log-every", "1", "--trace-steps", "2", "--inspect", "--ddp", "manual"]

EXACT = 1e-6  # the bound for fp32 SGD against the plain run
FLOAT64 = 1e-10  # ... and for float64 through the Python API

TWO_RANK_LAYOUTS = {
    "tp": ["--tp", "2"],
    "pp gpipe": ["--pp", "2", "--pp-schedule", "gpipe"],
    "pp 1f1b": ["--pp", "2", "--pp-schedule", "1f1b"],
}
# 4 ranks, 2 replicas of a model split in 2. (--tp 2 --sharding full has no from-scratch twin: refused.)
FOUR_RANK_LAYOUTS = {"pp x ddp": ["--pp", "2"], "tp x ddp": ["--tp", "2"]}
TP_X_PP = ["--tp", "2", "--pp", "2"]  # tensor parallelism inside pipeline stages: from scratch, chosen as no --ddp is
HAS_PEFT = importlib.util.find_spec("peft") is not None


def ddp(which: str) -> list[str]:
    return ["--ddp", which]


def qwen_args(model_dir: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["--model", "qwen", "--model-name-or-path", str(model_dir), "--cpu", "--output-dir", str(out_dir),
            "--batch-size", "4", "--seq-len", "32", "--sample-tokens", "8", "--lr", "1e-2", "--max-steps", "4",
            "--log-every", "1", "--optimizer", "sgd", *extra]  # fmt: skip


class Jobs:
    """Named command lines for one launch, each with an output folder of its own under root."""

    def __init__(self, root: Path) -> None:
        self.root, self.jobs, self.outs = root, {}, {}

    def add(self, name: str, args: list[str]) -> None:
        self.outs[name] = self.root / f"job{len(self.jobs)}"
        self.jobs[name] = [*args, "--output-dir", str(self.outs[name])]

    def probe(self, name: str, probe: str, args: list[str] = ()) -> None:
        self.outs[name] = self.root / f"job{len(self.jobs)}"
        self.jobs[name] = [f"probe:{probe}", *args, *(["--output-dir", str(self.outs[name])] if args else [])]

    def run(self, nproc: int | None, timeout: float) -> dict[str, tuple[Run, Path]]:
        ran = run_jobs(self.jobs, nproc, timeout)
        return {name: (ran[name], self.outs[name]) for name in self.jobs}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, tiny_qwen) -> dict[str, tuple[Run, Path]]:
    """The 4-rank runs, in one launch: 2 replicas of a model split in 2."""
    jobs = Jobs(tmp_path_factory.mktemp("four_ranks"))
    jobs.add("sgd tp x full/torch", [*SGD, "--tp", "2", "--sharding", "full", "--inspect"])
    jobs.add("sgd tp x pp", [*SGD, *TP_X_PP])  # one replica: 2 stages, each sliced in 2
    for layout, flags in FOUR_RANK_LAYOUTS.items():
        for which in ("torch", "manual"):
            jobs.add(f"sgd {layout}/{which}", [*SGD, *flags, *ddp(which)])
    jobs.probe("ddp sub-group", "ddp sub-group")
    jobs.add("refused: --tp 3 on 4 ranks", [*TINY, "--n-heads", "3", "--d-model", "33", "--tp", "3"])
    jobs.jobs["refused: qwen --tp 2 on 4 ranks"] = qwen_args(tiny_qwen, jobs.root / "qwen", "--finetune", "full",
                                                             "--tp", "2")  # fmt: skip
    jobs.outs["refused: qwen --tp 2 on 4 ranks"] = jobs.root / "qwen"
    return jobs.run(4, timeout=420)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_qwen, four_ranks) -> dict[str, tuple[Run, Path]]:
    """Every 2-rank run and probe, in one launch, in this order: what a resume reads is written before it."""
    jobs = Jobs(tmp_path_factory.mktemp("two_ranks"))
    for layout, flags in TWO_RANK_LAYOUTS.items():
        for which in ("torch", "manual"):
            jobs.add(f"sgd {layout}/{which}", [*SGD, *flags, *ddp(which)])
    # The references for 4 ranks, 2 replicas: DDP over 2 ranks, the same global batch of 8.
    jobs.add("sgd ddp", SGD)
    # A --sharding none checkpoint of global batch 4 (2 ranks x 1 example x 2 micro-steps), resumed by --pp 2.
    jobs.add("sgd ddp, batch 1", [*SGD, "--batch-size", "1"])
    none_checkpoint = checkpoint(jobs.outs["sgd ddp, batch 1"], 6)
    jobs.add("sgd none resumed by pp", [*SGD, "--pp", "2", "--resume", str(none_checkpoint)])
    # --tp 2 --sharding full over 4 ranks, resumed by --tp 2 over 2: one replica, twice the batch.
    tp_full = four_ranks["sgd tp x full/torch"][1]
    jobs.add("sgd tp x full resumed by tp",
             [*SGD, "--tp", "2", "--batch-size", "4", "--resume", str(checkpoint(tp_full, 6))])  # fmt: skip
    for layout in ("tp", "pp 1f1b"):
        for which in ("torch", "manual"):
            # The pipeline's 4 micro-batches of one example: 2 micro-steps of 2, each cut in 2
            pipelined = ["--batch-size", "2", "--grad-accum-steps", "2"] if layout.startswith("pp") else []
            jobs.add(f"adamw {layout}/{which}", [*ADAMW, *TWO_RANK_LAYOUTS[layout], *pipelined, *ddp(which)])
    # The yardstick: DDP, the same global batch of 4 (2 ranks x 1 example x 2 micro-steps).
    jobs.add("adamw ddp", [*ADAMW, "--grad-accum-steps", "2"])
    for which in ("torch", "manual"):
        jobs.probe(f"dropout tp/{which}", "tp replicas", [*DROPOUT, "--tp", "2", *ddp(which)])
    for which in ("torch", "manual"):
        for schedule in ("1f1b", "gpipe"):  # as a learner types it: no --grad-accum-steps
            jobs.add(f"plain pp/{which} {schedule}", [*PLAIN, "--pp", "2", *ddp(which), "--pp-schedule", schedule])
    jobs.add("show tp", [*SHOW, "--tp", "2"])
    jobs.add("show pp", [*SHOW, "--pp", "2"])
    jobs.probe("tp float64", "tp float64")
    jobs.probe("pp float64", "pp float64")
    jobs.probe("dropout rule", "dropout rule")
    for finetune in ("full", "lora") if HAS_PEFT else ("full",):
        jobs.jobs[f"qwen {finetune}"] = qwen_args(tiny_qwen, jobs.root / f"qwen_{finetune}", "--finetune", finetune,
                                                  "--tp", "2")  # fmt: skip
        jobs.outs[f"qwen {finetune}"] = jobs.root / f"qwen_{finetune}"
    if HAS_PEFT:
        jobs.jobs["refused: lora o_proj"] = qwen_args(tiny_qwen, jobs.root / "qwen_o", "--finetune", "lora",
                                                      "--tp", "2", "--lora-targets", "o_proj")  # fmt: skip
        jobs.outs["refused: lora o_proj"] = jobs.root / "qwen_o"
    return jobs.run(2, timeout=540)


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory) -> dict[str, tuple[Run, Path]]:
    """The 3-D layout: 2 replicas x 2 stages x 2 slices."""
    jobs = Jobs(tmp_path_factory.mktemp("eight_ranks"))
    jobs.add("sgd dp x tp x pp", [*SGD, *TP_X_PP])
    return jobs.run(8, timeout=420)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_qwen, two_ranks, four_ranks, eight_ranks) -> dict[str, tuple[Run, Path]]:
    """The plain runs every split is judged against, and --tp 2, --tp 2 --pp 2 and 3-D checkpoints resumed by one
    process."""
    jobs = Jobs(tmp_path_factory.mktemp("one_process"))
    jobs.add("sgd", SGD)
    jobs.add("sgd tp resumed by none", [*SGD, "--resume", str(checkpoint(two_ranks["sgd tp/torch"][1], 6))])
    tp_x_pp = checkpoint(four_ranks["sgd tp x pp"][1], 6)  # (--ddp is a setting a resume keeps)
    jobs.add("sgd tp x pp resumed by none", [*SGD, "--ddp", "manual", "--resume", str(tp_x_pp)])
    three_d = checkpoint(eight_ranks["sgd dp x tp x pp"][1], 6)  # global batch 8: one process takes 4 x 2
    jobs.add("sgd 3-d resumed by none", [*SGD, "--batch-size", "4", "--ddp", "manual", "--resume", str(three_d)])
    jobs.add("adamw", ADAMW)
    jobs.add("plain", PLAIN)  # as a learner types it: the yardstick of the same command plus --pp 2
    jobs.add("nothing to split", [*TINY, "--max-steps", "1", "--tp", "2"])
    for finetune in ("full", "lora") if HAS_PEFT else ("full",):
        jobs.jobs[f"qwen {finetune}"] = qwen_args(tiny_qwen, jobs.root / f"qwen_{finetune}", "--finetune", finetune)
        jobs.outs[f"qwen {finetune}"] = jobs.root / f"qwen_{finetune}"
    return jobs.run(None, timeout=300)


def finished(runs: dict[str, tuple[Run, Path]], name: str) -> Path:
    """The output folder of a run that succeeded on every rank."""
    run, out = runs[name]
    assert_ok(run)
    assert set(run.codes) <= {0}, run.codes
    return out


def shown(runs: dict[str, tuple[Run, Path]], name: str) -> Run:
    """A run that succeeded on every rank."""
    finished(runs, name)
    return runs[name][0]


# ----------------------------------------------------------------------------------------------
# Exactness: fp32 SGD, 12 steps, dropout 0
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", TWO_RANK_LAYOUTS)
@pytest.mark.parametrize("which", ["torch", "manual"])
def test_a_model_split_over_two_ranks_trains_the_weights_of_one_process(two_ranks, one_process, layout, which):
    # --tp 2 / --pp 2 over 2 ranks: one replica of global batch 4, as one process with the same flags.
    reference, split = finished(one_process, "sgd"), finished(two_ranks, f"sgd {layout}/{which}")
    diff = max_difference(weights(reference), weights(split))
    print(f"{layout}/{which} vs one process, 12 SGD steps: max |dweight| = {diff:.3g}")
    assert diff < EXACT


def test_torch_ddp_on_a_sub_group_averages_over_its_group_alone_with_either_hook(four_ranks):
    run, _ = four_ranks["ddp sub-group"]
    assert_ok(run)
    for rank, found in enumerate(probe_facts(run)):
        print(rank, found)
        plain, bf16 = found["plain"], found["bf16"]
        assert plain["to the pair's"] == 0 and plain["to every rank's"] > 0.1  # a sum of two is order-free
        # bf16 keeps 8 significant bits: each half rounded by up to 2^-8 of itself, and their sum once more
        assert bf16["relative to the pair's sizes"] <= 2**-8 and bf16["to every rank's"] > 0.1


@pytest.mark.parametrize("layout", TWO_RANK_LAYOUTS)
def test_each_from_scratch_split_is_bitwise_torchs(two_ranks, layout):
    mine, torchs = finished(two_ranks, f"sgd {layout}/manual"), finished(two_ranks, f"sgd {layout}/torch")
    assert_bitwise_equal(weights(torchs), weights(mine), layout)


def test_tp_with_fsdp_over_four_ranks_trains_the_weights_of_ddp(four_ranks, two_ranks):
    # --tp 2 --sharding full on 4 ranks: 2 replicas, each split in 2 and fully sharded over the replicas.
    reference, split = finished(two_ranks, "sgd ddp"), finished(four_ranks, "sgd tp x full/torch")
    diff = max_difference(weights(reference), weights(split))
    print(f"tp 2 x fsdp 2 vs 2-rank DDP: max |dweight| = {diff:.3g}")
    assert diff < EXACT


def test_inspect_says_what_each_rank_holds_under_tp_with_torchs_fsdp(four_ranks):
    out = four_ranks["sgd tp x full/torch"][0].stdout  # a 2-D mesh: its rows once failed --inspect (mesh_dim)
    for r in range(4):
        assert f"[inspect] rank {r}: blocks.0.attn.qkv.weight: slice {r % 2} of 2 of its rows" in out
        assert f"[inspect] rank {r}: ... each held in rows along the replicas (fully_shard)" in out


def test_tp_inside_pipeline_stages_over_four_ranks_trains_the_weights_of_one_process(four_ranks, one_process):
    reference, split = finished(one_process, "sgd"), finished(four_ranks, "sgd tp x pp")
    diff = max_difference(weights(reference), weights(split))
    print(f"tp 2 x pp 2 vs one process: max |dweight| = {diff:.3g}")
    assert diff < EXACT
    # Typed without --ddp, the layout only the from-scratch classes compose: they are chosen, and the header says so
    assert (
        "[run] --ddp manual: only the from-scratch classes run this (--tp with --pp --ddp torch: torch's pipeline "
        "takes no sliced stages here; --ddp manual composes them)"
    ) in four_ranks["sgd tp x pp"][0].stdout


def test_the_3d_layout_dp_x_tp_x_pp_over_eight_ranks_trains_the_weights_of_ddp(eight_ranks, two_ranks):
    reference, split = finished(two_ranks, "sgd ddp"), finished(eight_ranks, "sgd dp x tp x pp")
    diff = max_difference(weights(reference), weights(split))
    print(f"dp 2 x tp 2 x pp 2 vs 2-rank DDP: max |dweight| = {diff:.3g}")
    assert diff < EXACT
    assert "[run] 2 replica(s) x 2 examples x 2 micro-step(s) = global batch 8" in eight_ranks[
        "sgd dp x tp x pp"][0].stdout  # fmt: skip


@pytest.mark.parametrize("layout", FOUR_RANK_LAYOUTS)
@pytest.mark.parametrize("which", ["torch", "manual"])
def test_a_split_model_beside_ddp_over_four_ranks_trains_the_weights_of_ddp(four_ranks, two_ranks, layout, which):
    reference, split = finished(two_ranks, "sgd ddp"), finished(four_ranks, f"sgd {layout}/{which}")
    diff = max_difference(weights(reference), weights(split))
    print(f"{layout}/{which} over 4 ranks vs 2-rank DDP: max |dweight| = {diff:.3g}")
    assert diff < EXACT


@pytest.mark.parametrize("layout", FOUR_RANK_LAYOUTS)
def test_each_from_scratch_split_beside_ddp_is_bitwise_torchs(four_ranks, layout):
    mine, torchs = finished(four_ranks, f"sgd {layout}/manual"), finished(four_ranks, f"sgd {layout}/torch")
    assert_bitwise_equal(weights(torchs), weights(mine), f"{layout} over 4 ranks")


# ----------------------------------------------------------------------------------------------
# AdamW, clipping, 4 micro-batches: a stated bound
# ----------------------------------------------------------------------------------------------


def grad_norms(run: Run) -> list[float]:
    return [float(x) for x in re.findall(r"^step\s+\d+/\d+ \|.*\| grad norm ([0-9.]+)", run.stdout, re.M)]


def test_clipping_acts_at_every_step_of_the_adamw_runs(one_process):
    norms = grad_norms(one_process["adamw"][0])
    assert len(norms) == 12 and min(norms) > CLIP, norms


EPS = torch.finfo(torch.float32).eps
# What 12 steps of rounding can do to a weight of the tiny model (|w| < 0.1 but for the norms' ones,
# which stay bitwise or within 6e-8 here): one fp32 rounding of |w| a step, 12 times.
BULK = 12 * EPS * 0.1  # 1.4e-7
ADAMW_BOUND = 1e-5


def adamw_differences(two_ranks, one_process, name: str) -> torch.Tensor:
    reference, split = weights(finished(one_process, "adamw")), weights(finished(two_ranks, name))
    assert reference.keys() == split.keys()
    return torch.cat([(split[k] - reference[k]).abs().flatten() for k in reference])


@pytest.mark.parametrize("layout", ["tp", "pp 1f1b"])
@pytest.mark.parametrize("which", ["torch", "manual"])
def test_with_adamw_clipping_and_accumulation_a_split_model_stays_within_the_stated_bound(
    two_ranks, one_process, layout, which
):
    """The bound, 1e-5 max |dweight| after 12 steps, and why.

    Measured against one process on the same global batch: TP 2.5e-6 (torch's and the from-scratch
    alike: one element of 43,168; the next 16 under 6e-7), PP 6.0e-8, DDP (the yardstick, two tests
    down) 2.0e-7. A split adds the same numbers in another order, so every gradient element carries
    a rounding error of a few fp32 eps (1.2e-7) relative to the terms it was summed from; under TP
    the update rounds differently too (make_optimizer steps AdamW tensor by tensor there, one
    process with the fused kernel), which is why TP sits above PP and DDP.
    AdamW then moves each weight by lr x m / (sqrt(v) + eps), about lr = 3e-3 whatever the gradient's
    size: for an ordinary element the rounding shifts that step by ~lr x 1e-7, and the weight's own
    fp32 rounding (eps x |w| < 1.2e-8 a step) dominates; over 12 steps, BULK = 1.4e-7 (the next test
    holds all but 0.1 % of elements to it). An element whose gradient nearly cancels (|g| ~ 1e-3 of its
    terms) has its rounding error divided by sqrt(v) ~ |g|: amplified ~1e3, so ~lr x 1e-4 a step,
    ~4e-6 over 12 steps; 1e-5 leaves a factor 2.5 for that. What a wrong split does is larger by
    orders of magnitude: a gradient missing a rank's part, or one slice's, changes m / sqrt(v) by
    O(1) on most elements, ~lr = 3e-3 a step. (Clipping rescales every gradient by one factor,
    which AdamW divides back out: a wrong clip shows in the SGD tests, not here.)"""
    diff = float(adamw_differences(two_ranks, one_process, f"adamw {layout}/{which}").max())
    print(f"adamw {layout}/{which} vs one process: max |dweight| = {diff:.3g}")
    assert diff < ADAMW_BOUND


@pytest.mark.parametrize("layout", ["tp", "pp 1f1b"])
@pytest.mark.parametrize("which", ["torch", "manual"])
def test_with_adamw_all_but_a_few_elements_stay_within_fp32_rounding_of_one_process(
    two_ranks, one_process, layout, which
):
    # Measured: TP 17 of 43,168 elements above BULK, PP none. A wrong gradient moves most of them by ~lr.
    differences = adamw_differences(two_ranks, one_process, f"adamw {layout}/{which}")
    outliers = int((differences > BULK).sum())
    print(f"adamw {layout}/{which}: {outliers} of {differences.numel()} elements differ by more than {BULK:.2g}")
    assert outliers < 1e-3 * differences.numel()


def test_with_adamw_ddp_itself_stays_within_the_stated_bound(two_ranks, one_process):
    # The yardstick: DDP, which the other suites prove, adds the same numbers in another order too.
    differences = adamw_differences(two_ranks, one_process, "adamw ddp")
    print(f"adamw ddp vs one process: max |dweight| = {float(differences.max()):.3g}, "
          f"{int((differences > BULK).sum())} elements above {BULK:.2g}")  # fmt: skip
    assert float(differences.max()) < ADAMW_BOUND


# ----------------------------------------------------------------------------------------------
# Float64 through the Python API
# ----------------------------------------------------------------------------------------------


def facts(runs: dict[str, tuple[Run, Path]], name: str) -> list[dict]:
    run = shown(runs, name)
    found = probe_facts(run)
    assert len(found) == 2, run.output
    return found


@pytest.mark.parametrize("which", ["manual", "torch"])
def test_in_float64_tensor_parallel_tiny_model_matches_one_process(two_ranks, which):
    # TensorParallel(model, d, manual) on the tiny model, 3 SGD steps of 2 micro-batches, weights
    # gathered whole with its whole(): measured 2.2e-16 for both, one unit in the last place.
    for rank in facts(two_ranks, "tp float64"):
        assert rank[f"tiny {which} keys"]
        assert rank[f"tiny {which}"] < FLOAT64, rank


def test_in_float64_column_and_row_parallel_linears_on_a_model_of_ones_own_match_one_process(two_ranks):
    for rank in facts(two_ranks, "tp float64"):
        assert rank["mlp bias=False output"] < FLOAT64 and rank["mlp bias=False first grad"] < FLOAT64, rank


def test_column_and_row_parallel_linears_keep_a_linears_bias(two_ranks):
    # "usable on any nn.Module": nn.Linear has a bias by default. A split that drops it silently
    # computes another function (measured: output off by 0.24, first gradient by 1.3).
    for rank in facts(two_ranks, "tp float64"):
        output, grad = rank["mlp bias=True output"], rank["mlp bias=True first grad"]
        assert output < FLOAT64 and grad < FLOAT64, (
            f"Linear(bias=True) split by ColumnParallelLinear and RowParallelLinear: the output is off by "
            f"{output:.3g}, the first weight's gradient by {grad:.3g}"
        )


@pytest.mark.parametrize("schedule", ["manual gpipe", "manual 1f1b", "torch gpipe", "torch 1f1b"])
def test_in_float64_a_pipeline_matches_one_process(two_ranks, schedule):
    # Pipeline(kit, cfg, d, stats).forward_backward, 3 SGD steps of 2 micro-batches: measured 0.0,
    # bitwise one process accumulating the same micro-batches.
    ranks = facts(two_ranks, "pp float64")
    for rank in ranks:
        assert isinstance(rank[schedule], float), rank[schedule]  # else: the scenario's traceback
        assert rank[schedule] < FLOAT64
    stage0, stage1 = (set(rank[f"{schedule} params"]) for rank in ranks)
    assert {"tok_emb.weight", "blocks.0.attn.qkv.weight"} <= stage0 and not stage0 & stage1
    assert {"head.weight", "blocks.1.attn.qkv.weight"} <= stage1


# ----------------------------------------------------------------------------------------------
# Dropout under TP: Megatron's rule
# ----------------------------------------------------------------------------------------------


def test_own_dropout_stream_gives_each_tp_rank_its_own_mask_inside_and_the_same_outside(two_ranks):
    for rank in facts(two_ranks, "dropout rule"):
        assert rank == {"before equal": True, "inside equal": False, "after equal": True}


@pytest.mark.parametrize("which", ["torch", "manual"])
def test_with_dropout_and_verify_sync_a_tp_run_passes(two_ranks, which):
    # Before 478db7a: "replicas diverged ... grad of tok_emb.weight" at the first check.
    run = two_ranks[f"dropout tp/{which}"][0]
    assert_ok(run)
    assert run.codes == (0, 0), run.output
    assert "diverged" not in run.output


@pytest.mark.parametrize("which", ["torch", "manual"])
def test_with_dropout_the_tp_ranks_hold_their_replicated_weights_bitwise_alike(two_ranks, which):
    rank0, rank1 = facts(two_ranks, f"dropout tp/{which}")
    sliced = {n for n in rank0["sums"] if any(f".{part}.weight" in n for part in ("qkv", "proj", "mlp.0", "mlp.2"))}
    alike = set(rank0["sums"]) - sliced
    assert {"tok_emb.weight", "head.weight", "blocks.0.ln1.weight"} <= alike and len(sliced) == 8
    differ = [n for n in alike if (rank0["sums"][n], rank0["first"][n]) != (rank1["sums"][n], rank1["first"][n])]
    assert not differ, f"replicated tensors differ between the TP ranks: {differ}"
    # ... while each rank's slices are its own (the check above is not comparing one tensor with itself).
    assert all(rank0["first"][n] != rank1["first"][n] for n in sliced)


# ----------------------------------------------------------------------------------------------
# Checkpoints: any layout resumes any other
# ----------------------------------------------------------------------------------------------


def resumed(runs: dict[str, tuple[Run, Path]], name: str, step: int = 6) -> Path:
    run, out = runs[name]
    assert_ok(run)
    assert f"step_{step:08d} (step {step}" in run.stdout, run.stdout[-3000:]
    return out


def test_a_tp_checkpoint_resumed_by_one_process_lands_on_the_uninterrupted_run(one_process):
    out = resumed(one_process, "sgd tp resumed by none")
    diff = max_difference(weights(finished(one_process, "sgd")), weights(out))
    print(f"--tp 2 for 6 steps, then one process for 6, vs one process: max |dweight| = {diff:.3g}")
    assert diff < EXACT


def test_a_tp_x_pp_checkpoint_resumed_by_one_process_lands_on_the_uninterrupted_run(one_process):
    out = resumed(one_process, "sgd tp x pp resumed by none")
    diff = max_difference(weights(finished(one_process, "sgd")), weights(out))
    print(f"--tp 2 --pp 2 for 6 steps, then one process for 6, vs one process: max |dweight| = {diff:.3g}")
    assert diff < EXACT


def test_a_3d_checkpoint_of_eight_ranks_resumed_by_one_process_lands_on_2_rank_ddp(one_process, two_ranks):
    out = resumed(one_process, "sgd 3-d resumed by none")
    diff = max_difference(weights(finished(two_ranks, "sgd ddp")), weights(out))
    print(f"dp 2 x tp 2 x pp 2 for 6 steps, then one process for 6, vs 2-rank DDP: max |dweight| = {diff:.3g}")
    assert diff < EXACT


def test_a_none_checkpoint_resumed_by_a_pipeline_lands_on_the_uninterrupted_run(two_ranks, one_process):
    out = resumed(two_ranks, "sgd none resumed by pp")
    diff = max_difference(weights(finished(one_process, "sgd")), weights(out))
    print(f"2-rank DDP for 6 steps, then --pp 2 for 6, vs one process: max |dweight| = {diff:.3g}")
    assert diff < EXACT


def test_a_tp_fsdp_checkpoint_of_four_ranks_resumed_by_tp_on_two_lands_on_the_uninterrupted_run(four_ranks, two_ranks):
    out = resumed(two_ranks, "sgd tp x full resumed by tp")
    references = {"uninterrupted on 4 ranks": finished(four_ranks, "sgd tp x full/torch"),
                  "2-rank DDP": finished(two_ranks, "sgd ddp")}  # fmt: skip
    for what, reference in references.items():
        diff = max_difference(weights(reference), weights(out))
        print(f"--tp 2 --sharding full on 4 ranks, then --tp 2 on 2, vs {what}: max |dweight| = {diff:.3g}")
        assert diff < EXACT


@pytest.mark.parametrize("layout", ["sgd tp/torch", "sgd pp 1f1b/manual", "sgd tp x full/torch"])
def test_a_split_runs_checkpoint_is_one_whole_state_in_todays_format(one_process, two_ranks, four_ranks, layout):
    runs = {**two_ranks, **four_ranks}
    whole = torch.load(checkpoint(finished(one_process, "sgd"), 6) / "state.pt", weights_only=False)
    state = torch.load(checkpoint(finished(runs, layout), 6) / "state.pt", weights_only=False)
    assert {k: v.shape for k, v in state["trainable"].items()} == {k: v.shape for k, v in whole["trainable"].items()}
    assert set(state) == set(whole)


# ----------------------------------------------------------------------------------------------
# Showing it: --inspect, the memory table, the summary, the trace
# ----------------------------------------------------------------------------------------------


def test_inspect_says_which_slice_each_tp_rank_owns(two_ranks):
    out = shown(two_ranks, "show tp").stdout
    for r in (0, 1):
        assert f"[inspect] rank {r}: blocks.0.attn.qkv.weight: slice {r} of 2 of its rows of each of q, k and v" in out
        assert f"[inspect] rank {r}: blocks.0.attn.proj.weight: slice {r} of 2 of its columns" in out


def test_inspect_says_which_blocks_each_pp_stage_owns(two_ranks):
    out = shown(two_ranks, "show pp").stdout
    assert "[inspect] rank 0: stage 0: the embeddings, blocks 0-0" in out
    assert "[inspect] rank 1: stage 1: blocks 1-1, the final norm and head" in out


def memory(out: Path) -> list[dict]:
    return json.loads((out / "memory.json").read_text())


WHOLE_MODEL = 43_168  # parameters of TINY with 2 blocks (the log's [model] line)
SLICED = 2 * 12 * 32**2  # per block q, k, v (3d^2), the projection (d^2) and the MLP (8d^2), d = 32


def test_the_memory_table_says_what_each_tp_rank_holds(two_ranks):
    run, out = two_ranks["show tp"]
    assert_ok(run)
    for r in (0, 1):
        holds = f"rank {r} holds slice {r} of 2 of each block's q, k, v and MLP rows and projection columns"
        assert holds in run.stdout
    # Each rank holds half of every sliced matrix, and the rest whole.
    assert [m["parameters"] for m in memory(out)] == [4 * (WHOLE_MODEL - SLICED // 2)] * 2


def test_the_memory_table_says_which_blocks_each_pp_stage_holds(two_ranks):
    run, out = two_ranks["show pp"]
    assert_ok(run)
    assert "rank 0 holds stage 0: the embeddings, blocks 0-0" in run.stdout
    assert "rank 1 holds stage 1: blocks 1-1, the final norm and head" in run.stdout
    assert sum(m["parameters"] for m in memory(out)) == 4 * WHOLE_MODEL  # the stages hold the model once


def sent_per_step(run: Run) -> str:
    return re.search(r"^  collectives\s+(.*)$", run.stdout, re.M).group(1)


def test_the_summary_counts_one_steps_tensor_parallel_all_reduces_with_their_bytes(two_ranks):
    # "Per step" is a training step's traffic: the held-out evaluation at the last step runs forwards
    # through the split model too (their all-reduces), but is no part of a step.
    # Per micro-batch and block: 2 all-reduces in forward (after proj and the MLP's second Linear),
    # 2 in backward (the inputs of qkv and the MLP's first Linear), each of (2, 64, 32) fp32 = 16 KiB.
    # 2 blocks x 2 micro-batches x 4 = 16 a training step, 0.25 MiB.
    row = sent_per_step(shown(two_ranks, "show tp"))
    assert row == "rank 0, per step: tensor-parallel all-reduce 16 call(s), 0.25 MiB", row


def test_the_summary_counts_one_steps_pipeline_sends_with_their_bytes(two_ranks):
    # Stage 0 (rank 0) sends each micro-batch's activations on: 2 micro-steps of 2 examples cut in 2 for the 2
    # stages, 4 of (1, 64, 32) fp32 = 32 KiB.
    row = sent_per_step(shown(two_ranks, "show pp"))
    assert row == "rank 0, per step: pipeline send 4 call(s), 0.03 MiB", row


def trace(out: Path) -> list[dict]:
    events = json.loads((out / "trace.json").read_text())
    return [e for e in (events["traceEvents"] if isinstance(events, dict) else events) if e.get("ph") == "X"]


def test_the_tp_trace_shows_each_all_reduce_inside_forward_or_backward(two_ranks):
    events = trace(finished(two_ranks, "show tp"))
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank]
        phases = {p: [(e["ts"], e["ts"] + e["dur"]) for e in mine if e["name"] == p] for p in ("forward", "backward")}
        reduces = [e for e in mine if e["name"] == "all-reduce" and "tensor parallel" in e["args"]]
        assert len(reduces) == 2 * 16, len(reduces)  # 2 traced steps

        where = [next((p for p, spans in phases.items() for a, b in spans if a <= e["ts"] <= b), None) for e in reduces]
        assert where.count("forward") == where.count("backward") == 16, where


def test_the_pp_trace_shows_sends_receives_and_each_stages_bubble(two_ranks):
    events = trace(finished(two_ranks, "show pp"))
    for rank, other in ((0, 1), (1, 0)):
        mine = [e for e in events if e["pid"] == rank]
        assert [e["args"]["to stage"] for e in mine if e["name"] == "send"].count(other) == 8  # 2 steps x 4
        assert [e["args"]["from stage"] for e in mine if e["name"] == "recv"].count(other) == 8
        assert any(e["name"] == "bubble" for e in mine)
    # The last stage waits at the step's end for the first to finish its backward: drawn as the drain it is.
    # The first stage finishes last: it never drains.
    assert any(e["name"] == "drain" for e in events if e["pid"] == 1)
    assert not any(e["name"] == "drain" for e in events if e["pid"] == 0)


def test_the_summary_gives_each_stages_bubble_beside_the_ideal(two_ranks):
    run = shown(two_ranks, "show pp")
    row = re.search(r"^  pipeline bubble\s+(.*)$", run.stdout, re.M).group(1)
    # (S - 1) / (M + S - 1) = 1/5 for 2 stages and 4 micro-batches (2 micro-steps, each cut in 2)
    assert re.fullmatch(
        r"idle, waiting for a neighbour: rank 0 \d+%, rank 1 \d+% \(ideal 20% for 2 stages and 4 micro-batches, for the"
        r" first\)",
        row,
    ), row


# ----------------------------------------------------------------------------------------------
# Refusals: one line, naming the flags, before any rank trains
# ----------------------------------------------------------------------------------------------


REFUSED = {
    "torch's tp with pp": (["--n-layers", "2", "--tp", "2", "--pp", "2", "--ddp", "torch"],
                           "--tp with --pp --ddp torch: torch's"),
    "tp with sharding optimizer": (["--tp", "2", "--sharding", "optimizer"], "--tp 2 with --sharding optimizer"),
    "pp with sharding full": (["--n-layers", "2", "--pp", "2", "--sharding", "full"], "--pp 2 with --sharding full"),
    "tp with from-scratch fsdp": (["--tp", "2", "--sharding", "full", "--ddp", "manual"],
                                  "--tp with --sharding full --ddp manual"),
    "tp not dividing the heads": (["--tp", "3"], "--tp 3 must divide --n-heads 2"),
    "pp more than the blocks": (["--pp", "2"], "--pp 2 is more stages than --n-layers 1"),
    "tp with fp16": (["--tp", "2", "--precision", "fp16"], "--tp 2 with --precision fp16"),
    "pp with fp16": (["--n-layers", "2", "--pp", "2", "--precision", "fp16"], "--pp 2 with --precision fp16"),
    "pp with desync": (["--n-layers", "2", "--pp", "2", "--inject-fault", "1:2:desync"],
                       "--inject-fault desync with --pp"),
    "torch's tp traced": (["--tp", "2", "--trace-steps", "2", "--ddp", "torch"],
                          "--trace-steps with --tp 2 --ddp torch"),
    "torch's pp compressed": (["--n-layers", "2", "--pp", "2", "--grad-compression", "bf16", "--ddp", "torch"],
                              "--grad-compression with --pp 2 --ddp torch"),
    "pp not dividing the batch": (["--n-layers", "2", "--pp", "2", "--batch-size", "3"],
                                  "--pp 2 cuts each micro-step's batch into 2 micro-batches: --batch-size 3 does not "
                                  "divide; give a multiple of 2"),
}  # fmt: skip


@pytest.mark.parametrize("which", ["torch", "manual"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_same_command_plus_pp_trains_what_one_process_trains(two_ranks, one_process, which, schedule):
    # AdamW, clipping, 2 steps, no --grad-accum-steps: each step's batch of 4 cut into 2 micro-batches of 2
    run = shown(two_ranks, f"plain pp/{which} {schedule}")
    assert "[run] 1 replica(s) x 4 examples x 1 micro-step(s) = global batch 4" in run.stdout
    assert ("[run] --pp 2: each replica's 2 ranks hold a stage of blocks each; each micro-step's 4 examples flow "
            "through them as 2 micro-batches of 2, 2 a step") in run.stdout  # fmt: skip
    assert "examples per replica per epoch" in run.stdout
    diff = max_difference(
        weights(finished(one_process, "plain")), weights(finished(two_ranks, f"plain pp/{which} {schedule}"))
    )
    print(f"the same command plus --pp 2 ({which}, {schedule}) vs one process: max |dweight| = {diff:.3g}")
    assert diff < EXACT


def test_the_run_header_under_tp_counts_replicas_and_says_how_the_model_is_split(two_ranks):
    run = shown(two_ranks, "show tp")
    assert "[run] 1 replica(s) x 2 examples x 2 micro-step(s) = global batch 4" in run.stdout
    assert "[run] --tp 2: each replica's 2 ranks hold a slice of every weight and see the same batch" in run.stdout


def assert_one_clear_error(run: Run, expected: str) -> None:
    assert run.returncode != 0, run.output
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, f"expected one error line, got:\n{run.stderr}"
    assert expected in errors[0], errors[0]
    assert 'llm_ddp_parallel_training.py", line' not in run.output, run.output


@pytest.mark.parametrize("case", REFUSED)
def test_a_split_that_cannot_work_is_refused_in_one_line(case, tmp_path, monkeypatch, capsys):
    flags, expected = REFUSED[case]
    assert_one_clear_error(run_main([*TINY, "--output-dir", str(tmp_path), *flags], monkeypatch, capsys), expected)


def test_a_trace_of_torchs_split_is_refused_saying_that_manual_ddp_traces_its_own():
    # Not "shows and compresses", the words of the compression refusal: the trace has nothing to compress.
    with pytest.raises(t.UsageError) as refused:
        t.parse_args([*TINY, "--tp", "2", "--trace-steps", "2", "--ddp", "torch"])
    assert str(refused.value) == (
        "--trace-steps with --tp 2 --ddp torch: torch's split runs its collectives out of this script's sight; "
        "--ddp manual traces its own"
    )


def test_pp_with_a_pretrained_model_is_refused_in_one_line(tiny_qwen, tmp_path, monkeypatch, capsys):
    run = run_main(qwen_args(tiny_qwen, tmp_path, "--finetune", "full", "--pp", "2"), monkeypatch, capsys)
    assert_one_clear_error(run, "--pp with --model hf")


def test_tp_that_does_not_divide_the_ranks_is_refused_by_every_rank(four_ranks):
    run = four_ranks["refused: --tp 3 on 4 ranks"][0]
    assert_one_clear_error(run, "--tp 3 x --pp 1 does not divide the 4 ranks into replicas")
    assert run.codes == (2,) * 4


def test_tp_beside_data_parallelism_on_a_pretrained_model_is_refused(four_ranks):
    run = four_ranks["refused: qwen --tp 2 on 4 ranks"][0]
    assert_one_clear_error(run, "--tp 2 on 4 ranks with --model hf")
    assert run.codes == (2,) * 4


@pytest.mark.skipif(not HAS_PEFT, reason="needs peft")
def test_lora_on_a_row_parallel_layer_under_tp_is_refused_by_name(two_ranks):
    run = two_ranks["refused: lora o_proj"][0]
    assert_one_clear_error(run, "--lora-targets o_proj under --tp")
    assert run.codes == (2, 2)


def test_one_process_says_there_is_nothing_to_split(one_process):
    run = one_process["nothing to split"][0]
    assert_ok(run)
    assert "[run] --tp 2 --pp 1: one process computes the whole model, there is nothing to split" in run.stdout


# ----------------------------------------------------------------------------------------------
# The pretrained path: transformers' own tensor-parallel plan
# ----------------------------------------------------------------------------------------------

# Measured after 4 SGD steps at lr 1e-2 on the tiny Qwen2: full 3.7e-9, LoRA 1.6e-10. SGD moves a
# weight by lr x gradient, the gradient clipped to norm 1 (the default --grad-clip), so each step
# moves an element by at most 1e-2; the split computes each gradient with other sums (the plan's
# all-reduces, the gathered head), ~1e-6 relative at worst for fp32 sums of this size, so 4 steps
# differ by at most ~4 x 1e-2 x 1e-6 = 4e-8. A plan that loses a rank's part (a missing all-reduce)
# moves a gradient by O(1) relative: ~1e-3 after one step.
PRETRAINED_BOUND = 1e-7


NEEDS_PEFT = pytest.mark.skipif(not HAS_PEFT, reason="needs peft")


@pytest.mark.parametrize("finetune", ["full", pytest.param("lora", marks=NEEDS_PEFT)])
def test_a_pretrained_model_under_transformers_tp_plan_trains_the_weights_of_one_process(
    two_ranks, one_process, finetune
):
    from safetensors.torch import load_file

    name = "qwen_full/model.safetensors" if finetune == "full" else "qwen_lora/adapter_model.safetensors"
    mine, reference = (load_file(finished(runs, f"qwen {finetune}") / name) for runs in (two_ranks, one_process))
    assert mine.keys() == reference.keys(), sorted(set(mine) ^ set(reference))
    assert all(mine[k].shape == reference[k].shape for k in mine)
    diff = max(float((mine[k] - reference[k]).abs().max()) for k in mine)
    print(f"qwen {finetune} --tp 2 vs one process, 4 SGD steps: max |dweight| = {diff:.3g}")
    assert diff < PRETRAINED_BOUND
