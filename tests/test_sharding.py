"""--sharding {none,optimizer,full} and --finetune full, through the CLI on 2 Gloo ranks.

Sharding moves where weights, gradients and optimizer state live; it must not move the numbers.
Each strategy (torch's ZeroRedundancyOptimizer and fully_shard, or the from-scratch
ShardedOptimizer and ManualFSDP, chosen by --ddp) is judged against the `--sharding none --ddp
torch` run of the same flags: fp32 on CPU, the final weights must be bitwise equal. The averaged
gradient is the same sum of the same two per-rank numbers, halved (exact), whether it arrives by
all-reduce or by reduce-scatter. One exception is expected and measured: when clipping acts,
full sharding adds up the squared gradient norm shard by shard, in another order, so the clip
coefficient may differ in its last bit.

Every checkpoint holds the whole gathered state in one format, so a checkpoint from any sharding
resumes under any other, and under another world size when the global batch stays the same.

Where the numbers land does not depend on how the ranks were started: every 2-rank run whose
subject is not the launch shares one launch of 2 Gloo ranks, and the one-process runs another
(conftest.run_jobs, each through the script's own parse_args() and run(); their weights are bitwise
those of a separate launch). A killed worker that torchrun restarts, a SIGTERM, a group of one that
--nproc 1 starts, and the ranks' own refusal under torchrun keep launches of their own; the run that
finishes after the SIGTERM is a job of the shared launch.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
from pathlib import Path

import pytest
import torch
from conftest import (
    TINY,
    Run,
    assert_bitwise_equal,
    assert_ok,
    checkpoint,
    launch,
    max_difference,
    run_cmd,
    run_jobs,
    torchrun_cmd,
    weights,
)
from fault_helpers import signal_at_step

import llm_ddp_parallel_training as t

REFERENCE = ("none", "torch")
SHARDED = [("optimizer", "torch"), ("optimizer", "manual"), ("full", "torch"), ("full", "manual")]
STRATEGIES = [("none", "manual"), *SHARDED]  # manual DDP beside them: it too must not move a bit

# SGD moves each weight by exactly lr x gradient: a gradient off by any factor shows in the weights.
# --no-pack: one padded line per example, so the ranks hold different token counts.
SGD = [*TINY, "--no-pack", "--optimizer", "sgd", "--lr", "0.5", "--grad-clip", "0", "--max-steps", "5",
       "--log-every", "1"]  # fmt: skip
# AdamW with dropout on every rank and accumulation; long enough to checkpoint, kill, stop and resume in.
ADAMW = [*TINY, "--dropout", "0.1", "--batch-size", "2", "--grad-accum-steps", "2", "--grad-clip", "0",
         "--max-steps", "20", "--save-every", "5", "--keep-last", "4", "--log-every", "1"]  # fmt: skip
CLIP = 0.5
CLIPPED = [*TINY, "--grad-clip", str(CLIP), "--max-steps", "5", "--log-every", "1"]


def sharded(sharding: str, ddp: str) -> list[str]:
    return ["--sharding", sharding, "--ddp", ddp]


def grad_norms(run: Run) -> list[float]:
    return [float(x) for x in re.findall(r"^step\s+\d+/\d+ \|.*\| grad norm ([0-9.]+)", run.stdout, re.M)]


CLIPPED_STRATEGIES = [REFERENCE, ("optimizer", "manual"), ("full", "torch"), ("full", "manual")]
REFUSALS = {
    "fp16": (["--sharding", "full", "--precision", "fp16"], "--precision fp16"),
    "grad-compression": (["--sharding", "full", "--grad-compression", "bf16"], "--grad-compression"),
    # --ddp manual traces its own buckets; torch's fully_shard cannot be traced
    "trace-steps": (["--sharding", "full", "--trace-steps", "2", "--ddp", "torch"], "--trace-steps"),
    "gradient-checkpointing": (["--sharding", "full", "--gradient-checkpointing", "--ddp", "manual"],
                               "--gradient-checkpointing"),
    "finetune full without qwen": (["--finetune", "full"], "--finetune full"),
}  # fmt: skip
HAS_PEFT = importlib.util.find_spec("peft") is not None


def qwen_args(model_dir: Path, out_dir: Path, *extra: str) -> list[str]:
    return [
        "--model", "qwen", "--model-name-or-path", str(model_dir), "--cpu", "--output-dir", str(out_dir),
        "--batch-size", "4", "--seq-len", "32", "--sample-tokens", "8", "--lr", "1e-2", "--max-steps", "3",
        "--log-every", "1", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks_runs(tmp_path_factory, tiny_qwen) -> dict[str, tuple[Run, Path]]:
    """Every 2-rank run of this module whose subject is not the launch, in one launch of 2 Gloo
    ranks (conftest.run_jobs), in this order: what a resume reads is written by a run before it.
    Name -> (the run, its output folder)."""
    root, jobs, outs = tmp_path_factory.mktemp("two_ranks"), {}, {}

    def job(name: str, args: list[str]) -> None:
        outs[name] = root / f"job{len(jobs)}"
        jobs[name] = [*args, "--output-dir", str(outs[name])]

    for sharding, ddp in [REFERENCE, *SHARDED]:
        job(f"sgd {sharding}/{ddp}", [*SGD, *sharded(sharding, ddp)])
    job("sgd, gradient doubled", [*SGD, "--lr", "1.0", *sharded(*REFERENCE)])
    for sharding, ddp in [REFERENCE, *STRATEGIES]:
        job(f"adamw {sharding}/{ddp}", [*ADAMW, *sharded(sharding, ddp)])
    for sharding, ddp in CLIPPED_STRATEGIES:
        job(f"clipped {sharding}/{ddp}", [*CLIPPED, *sharded(sharding, ddp)])
    job("none checkpoint resumed under full", [*ADAMW, *sharded("full", "torch"),
        "--resume", str(checkpoint(outs["adamw none/torch"], 10))])  # fmt: skip
    for refusal, (flags, _) in REFUSALS.items():
        job(f"refused: {refusal}", [*TINY, "--max-steps", "2", *flags])
    outs["qwen full"] = root / "qwen_full_run"
    jobs["qwen full"] = qwen_args(tiny_qwen, outs["qwen full"], "--finetune", "full", *sharded("full", "torch"))
    if HAS_PEFT:  # without peft a LoRA run cannot start; its test skips
        outs["qwen lora"] = root / "qwen_lora_run"
        jobs["qwen lora"] = qwen_args(tiny_qwen, outs["qwen lora"], *sharded("full", "manual"))
    ran = run_jobs(jobs, nproc=2, timeout=540)  # 266 s at load 17 on 2 cores; pytest's own is 600
    return {name: (ran[name], outs[name]) for name in jobs}


def finished(runs: dict[str, tuple[Run, Path]], kind: str, strategies: list[tuple[str, str]]) -> dict:
    """The output folders of the `kind` runs, by (sharding, ddp), each run having succeeded."""
    for sharding, ddp in strategies:
        assert_ok(runs[f"{kind} {sharding}/{ddp}"][0])
    return {(sharding, ddp): runs[f"{kind} {sharding}/{ddp}"][1] for sharding, ddp in strategies}


@pytest.fixture(scope="module")
def sgd_runs(two_ranks_runs) -> dict[tuple[str, str], Path]:
    return finished(two_ranks_runs, "sgd", [REFERENCE, *SHARDED])


@pytest.fixture(scope="module")
def adamw_runs(two_ranks_runs) -> dict[tuple[str, str], Path]:
    return finished(two_ranks_runs, "adamw", [REFERENCE, *STRATEGIES])


@pytest.fixture(scope="module")
def clipped_runs(two_ranks_runs) -> dict[tuple[str, str], tuple[Run, Path]]:
    finished(two_ranks_runs, "clipped", CLIPPED_STRATEGIES)
    return {(sharding, ddp): two_ranks_runs[f"clipped {sharding}/{ddp}"] for sharding, ddp in CLIPPED_STRATEGIES}


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory, two_ranks_runs) -> dict[str, tuple[Run, Path]]:
    """The runs of one plain process (no process group), in one launch: a 2-rank fully sharded
    checkpoint resumed, and a sharded run with nothing to shard."""
    root = tmp_path_factory.mktemp("one_process")
    outs = {"resumed": root / "resumed", "nothing to shard": root / "nothing_to_shard"}
    jobs = {
        "resumed": [*ADAMW, "--batch-size", "4", "--sharding", "none", "--output-dir", str(outs["resumed"]),
                    "--resume", str(checkpoint(two_ranks_runs["adamw full/torch"][1], 10))],
        "nothing to shard": [*TINY, "--max-steps", "1", "--sharding", "full",
                             "--output-dir", str(outs["nothing to shard"])],
    }  # fmt: skip
    ran = run_jobs(jobs, timeout=300)
    return {name: (ran[name], outs[name]) for name in jobs}


# ----------------------------------------------------------------------------------------------
# The same numbers under every sharding
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sharding, ddp", SHARDED)
def test_sgd_trains_the_same_weights_bitwise_under_every_sharding(sgd_runs, sharding, ddp):
    assert_bitwise_equal(weights(sgd_runs[REFERENCE]), weights(sgd_runs[sharding, ddp]), f"{sharding}/{ddp}")


@pytest.mark.parametrize("sharding, ddp", STRATEGIES)
def test_adamw_with_dropout_and_accumulation_trains_the_same_weights_bitwise_under_every_sharding(
    adamw_runs, sharding, ddp
):
    # Dropout 0.1: each rank draws its own masks, and must draw the same ones whatever holds its weights.
    assert_bitwise_equal(weights(adamw_runs[REFERENCE]), weights(adamw_runs[sharding, ddp]), f"{sharding}/{ddp}")


def test_clipping_acts_at_every_step_of_the_clipped_runs(clipped_runs):
    norms = grad_norms(clipped_runs[REFERENCE][0])
    assert len(norms) == 5 and min(norms) > CLIP, norms


def test_with_clipping_acting_optimizer_sharding_stays_bitwise(clipped_runs):
    # ZeRO-1 clips the whole all-reduced gradient, as DDP does: the same norm, the same coefficient.
    reference, sharded_out = clipped_runs[REFERENCE][1], clipped_runs["optimizer", "manual"][1]
    assert_bitwise_equal(weights(reference), weights(sharded_out), "optimizer/manual, clipped")


@pytest.mark.parametrize("ddp", ["torch", "manual"])
def test_with_clipping_acting_full_sharding_agrees_to_float32_rounding(clipped_runs, ddp):
    # Full sharding sums each rank's squared shard norms, then the ranks' sums: the same squares in
    # another order, so the norm and hence the clip coefficient may differ in its last bit. After
    # 5 clipped AdamW steps we measured max |dparam| = 7.5e-9 (torch's fully_shard and ManualFSDP
    # alike). A wrong norm (one shard's only, or a sum where a mean belongs) changes the coefficient
    # itself, by a factor, and the weights by orders of magnitude more than 1e-6.
    diff = max_difference(weights(clipped_runs[REFERENCE][1]), weights(clipped_runs["full", ddp][1]))
    print(f"full/{ddp} vs none/torch, clipping at {CLIP}: max |dparam| = {diff:.3g}")
    assert diff < 1e-6


@pytest.fixture(scope="module")
def doubled_gradient(two_ranks_runs) -> Path:
    """The reference SGD run with lr doubled: what a summed (not averaged) gradient looks like under SGD."""
    run, out = two_ranks_runs["sgd, gradient doubled"]
    assert_ok(run)
    return out


@pytest.mark.parametrize("ddp", ["torch", "manual"])
def test_full_sharding_averages_gradients_over_ranks_it_does_not_sum_them(sgd_runs, doubled_gradient, ddp):
    # fully_shard's reduce-scatter on Gloo, and ManualFSDP's, must end in the mean: SGD at lr 0.5
    # then lands exactly on DDP's weights, and far from where a gradient twice as large lands.
    fsdp, ddp_weights = weights(sgd_runs["full", ddp]), weights(sgd_runs[REFERENCE])
    assert_bitwise_equal(ddp_weights, fsdp, f"full/{ddp}")
    doubled = max_difference(fsdp, weights(doubled_gradient))
    print(f"full/{ddp} vs the gradient doubled: max |dparam| = {doubled:.3g}")
    assert doubled > 1e-3


# ----------------------------------------------------------------------------------------------
# Checkpoints: one whole format, so any sharding resumes any other
# ----------------------------------------------------------------------------------------------


def saved_state(out: Path, step: int = 10) -> dict:
    return torch.load(checkpoint(out, step) / "state.pt", weights_only=False)


@pytest.mark.parametrize("sharding, ddp", STRATEGIES)
def test_a_checkpoint_holds_the_whole_state_in_the_same_format_under_every_sharding(adamw_runs, sharding, ddp):
    whole, state = saved_state(adamw_runs[REFERENCE]), saved_state(adamw_runs[sharding, ddp])
    trainable = state["trainable"]
    assert {k: v.shape for k, v in trainable.items()} == {k: v.shape for k, v in whole["trainable"].items()}
    # A plain torch optimizer's state_dict over the trainable weights in order, every moment full-shaped.
    shapes = [v.shape for v in trainable.values()]
    assert sorted(state["optimizer"]["state"]) == list(range(len(shapes)))
    assert [g["params"] for g in state["optimizer"]["param_groups"]] == [
        g["params"] for g in whole["optimizer"]["param_groups"]
    ]
    for i, moments in state["optimizer"]["state"].items():
        assert moments["exp_avg"].shape == moments["exp_avg_sq"].shape == shapes[i], i
    # The runs agree bitwise, so their step-10 states do too: the gathered shards are put back in place.
    assert_bitwise_equal(whole["trainable"], trainable, f"{sharding}/{ddp} checkpoint weights")
    for i, moments in whole["optimizer"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[k], state["optimizer"]["state"][i][k]), f"{sharding}/{ddp}: {k} of {i}"


def test_a_checkpoint_without_sharding_resumes_under_full_sharding(two_ranks_runs, adamw_runs):
    run, out = two_ranks_runs["none checkpoint resumed under full"]
    assert_ok(run)
    assert "continuing from" in run.stdout and "step_00000010 (step 10" in run.stdout, run.stdout
    diff = max_difference(weights(adamw_runs[REFERENCE]), weights(out))
    print(f"none checkpoint resumed under full vs uninterrupted none: max |dparam| = {diff:.3g}")
    assert diff < 1e-5


@pytest.mark.parametrize("launcher", ["plain process", "--nproc 1"])
def test_a_fully_sharded_checkpoint_of_2_ranks_resumes_in_one_process_with_the_same_global_batch(
    adamw_runs, one_process_runs, tmp_path, launcher
):
    # 2 ranks x 2 examples x 2 micro-steps continue as 1 process x 4 x 2: the same 8 examples per step,
    # whether that one process is a plain `python script.py` (no process group) or a group of one
    # (the script's own launcher starts it: a launch of its own).
    if launcher == "plain process":
        run, out = one_process_runs["resumed"]
    else:
        out = tmp_path
        one = [*ADAMW, "--batch-size", "4", "--sharding", "none", "--output-dir", str(out), "--nproc", "1"]
        run = launch([*one, "--resume", str(checkpoint(adamw_runs["full", "torch"], 10))])
    assert_ok(run)
    assert "continuing from" in run.stdout and "step_00000010 (step 10" in run.stdout, run.stdout
    assert "saved by 2 rank(s), resumed by 1" in run.output
    assert "step    20/20" in run.stdout and (out / "tiny_transformer.pt").exists()


def test_full_sharding_resumes_bit_exactly_after_a_killed_worker(adamw_runs, tmp_path):
    args = [*ADAMW, *sharded("full", "manual"), "--output-dir", str(tmp_path), "--inject-fault", "1:13:kill"]
    run = run_cmd(torchrun_cmd(2, args, ["--standalone", "--max-restarts=1"]), timeout=180)
    assert_ok(run)
    assert "injected 'kill' at step 13" in run.stderr
    assert "continuing from" in run.stdout and "step_00000010 (step 10" in run.stdout
    assert_bitwise_equal(weights(adamw_runs["full", "manual"]), weights(tmp_path), "killed at 13, resumed from 10")


def test_optimizer_sharding_stops_on_sigterm_with_a_checkpoint_and_the_same_command_finishes_bit_exactly(
    adamw_runs, tmp_path
):
    args = [*ADAMW, *sharded("optimizer", "manual"), "--output-dir", str(tmp_path)]
    returncode, output, _ = signal_at_step(torchrun_cmd(2, args), 3, lambda pid: os.kill(pid, signal.SIGTERM))
    assert returncode != 0
    assert "[stop] SIGTERM: every rank stopped after step" in output, output
    stopped_at = int(output.split("stopped after step ")[1].split(";")[0])
    assert 3 <= stopped_at < 20 and (checkpoint(tmp_path, stopped_at) / "manifest.json").exists()
    assert_ok(run_jobs({"the same command": args}, nproc=2)["the same command"])  # a job: where the numbers land
    assert_bitwise_equal(weights(adamw_runs["optimizer", "manual"]), weights(tmp_path), f"stopped at {stopped_at}")


# ----------------------------------------------------------------------------------------------
# One process, and what full sharding refuses
# ----------------------------------------------------------------------------------------------


def test_the_collectives_row_says_first_that_torchs_fully_shard_is_not_counted():
    # Last, after "nothing", the note read as if fully_shard sent nothing.
    one = t.MeshDist(0, 0, 1, 1, torch.device("cpu"), None, "one process")  # (laid out: main's)
    row = t.describe_traffic(t.parse_args(["--sharding", "full"]), one, {})
    assert row == (
        "rank 0, per step: collectives of torch's fully_shard: not counted (out of this script's sight); the rest: "
        "nothing"
    )


def test_one_process_with_sharding_says_there_is_nothing_to_shard_and_trains(one_process_runs):
    run, out = one_process_runs["nothing to shard"]
    assert_ok(run)
    assert "nothing to shard" in run.stdout
    assert (out / "tiny_transformer.pt").exists()


@pytest.mark.parametrize("refusal", REFUSALS)
def test_a_combination_that_cannot_be_honoured_is_refused_with_one_line_naming_the_flag(two_ranks_runs, refusal):
    run, out = two_ranks_runs[f"refused: {refusal}"]
    named = REFUSALS[refusal][1]
    assert run.returncode == 2, run.output
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], run.stderr
    assert "step " not in run.stdout and not (out / "tiny_transformer.pt").exists()


def test_under_torchrun_the_ranks_refuse_full_sharding_with_fp16_before_training(tmp_path):
    # Under torchrun no launcher of ours parses first: each rank parses and refuses on its own, at
    # once, and none is left waiting for a peer (that would take --timeout-s, 300 s by default).
    # At once: 5 s on an idle 2-core machine, 33 s while other test suites loaded it (load 12).
    run = launch([*TINY, "--max-steps", "2", "--sharding", "full", "--precision", "fp16",
                  "--output-dir", str(tmp_path)], nproc=2, timeout=240)  # fmt: skip
    assert run.returncode != 0 and "exitcode  : 2" in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "--precision fp16 with --sharding full" in errors[0], run.stderr
    assert "step " not in run.stdout and run.seconds < 150


# ----------------------------------------------------------------------------------------------
# Qwen: every weight fine-tuned, or LoRA, with the weights sharded
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_full(two_ranks_runs) -> tuple[Run, Path]:
    run, out = two_ranks_runs["qwen full"]
    assert_ok(run)
    return run, out


def test_full_finetuning_under_full_sharding_saves_a_whole_model_that_transformers_loads(tiny_qwen, qwen_full):
    from transformers import AutoModelForCausalLM

    _, out = qwen_full
    assert (out / "qwen_full" / "tokenizer_config.json").exists() and not (out / "qwen_lora").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen).state_dict()
    tuned = AutoModelForCausalLM.from_pretrained(out / "qwen_full").state_dict()
    assert tuned.keys() == base.keys()
    assert all(tuned[k].shape == base[k].shape for k in base)
    unchanged = [k for k in base if torch.equal(tuned[k], base[k])]
    print(f"full fine-tuning: {len(base) - len(unchanged)} of {len(base)} tensors moved")
    assert not unchanged, f"every weight trains, yet these did not move: {unchanged}"


def test_under_full_sharding_rank_0_samples_from_the_model_it_saved_read_back(qwen_full):
    # Sampling is rank 0's alone, and under full sharding rank 0 holds only its shards of the model.
    run, out = qwen_full
    samples = [line for line in run.stdout.splitlines() if line.startswith("[sample]")]
    assert len(samples) == 1 and samples[0].startswith(f"[sample] (from {out / 'qwen_full'}, read back) "), samples


def test_lora_under_full_sharding_saves_adapters_that_peft_loads(tiny_qwen, two_ranks_runs):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    run, out = two_ranks_runs["qwen lora"]
    assert_ok(run)
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_qwen), out / "qwen_lora")
    lora_b = {k: v for k, v in model.state_dict().items() if "lora_B" in k}
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b.values()), "every lora_B must move off zero"
