"""--cp (issue 37): context parallelism from scratch, ring attention over Gloo, alone and beside DDP.

Each example's sequence is cut into 2N chunks over N ranks (rank i holds chunks i and 2N-1-i); keys and
values travel round the ring, blocks merge by their log-sum-exp. Judged as the other splits are
(tests/test_parallelism.py), on the tiny model, fp32, SGD, dropout 0, 12 steps:
  - --cp 2 on 2 ranks lands within 1e-6 of one process, and dp 2 x cp 2 on 4 ranks (DDP, ZeRO-1 and FSDP,
    torch's and from scratch) within 1e-6 of 2-rank DDP,
    both on the same global batch; the held-out loss, evaluated under CP, is one process's;
  - --ddp manual (ManualDDP) lands bitwise on --ddp torch (torch's DDP): the two differ in the gradient
    average alone. torch's own context_parallel registers ring attention for the flash, efficient and cuDNN
    SDPA kernels only, none of which runs on a CPU: there is no torch ring to compare with here;
  - through the Python API in float64, RingAttention over 1, 2, 3 and 4 ranks is one process's causal
    attention, forward and dQ, dK, dV, within 1e-12; with attention dropout its gradient is the slope of
    what its forward computed;
  - with dropout, --verify-sync passes; a checkpoint is today's whole state, resumed in either direction.
Launches: jobs of the shared 2-rank, 4-rank and one-process launches (conftest.run_jobs), hard timeouts.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, Run, assert_bitwise_equal, assert_ok, checkpoint, max_difference, weights
from context_parallel_worker import run_jobs
from in_process import run_main
from parallelism_worker import probe_facts

import llm_ddp_parallel_training as t

SGD = [*TINY, "--n-layers", "2", "--batch-size", "2", "--grad-accum-steps", "2", "--optimizer", "sgd", "--lr", "0.5",
       "--grad-clip", "0", "--dropout", "0", "--max-steps", "12", "--save-every", "6", "--keep-last", "2",
       "--log-every", "6"]  # fmt: skip
EXACT, FLOAT64 = 1e-6, 1e-12
# Padded rows of different lengths: each micro-batch's mean weighs its tokens differently from the global mean.
MEAN_OF_MEANS = ["--no-pack", "--loss-normalization", "mean-of-means"]


def jobs_in(root: Path, jobs: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each job with an output folder of its own, root / its name, holding its metrics (probes take none)."""
    own = {name: ["--output-dir", str(root / name), "--metrics-file", str(root / name / "metrics.jsonl")]
           for name in jobs}  # fmt: skip
    return {name: args if args[0].startswith("probe:") else [*args, *own[name]] for name, args in jobs.items()}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cp")


@pytest.fixture(scope="module")
def two_ranks(root) -> dict[str, Run]:
    ddp_checkpoint = checkpoint(root / "ddp", 6)
    return run_jobs(jobs_in(root, {
        "cp torch": [*SGD, "--cp", "2"],
        "cp manual": [*SGD, "--cp", "2", "--ddp", "manual"],
        "ddp": SGD,  # 2 replicas, global batch 8: the yardstick of dp 2 x cp 2
        "ddp resumed by cp": [*SGD, "--cp", "2", "--batch-size", "4", "--resume", str(ddp_checkpoint)],
        "dropout": [*SGD, "--cp", "2", "--dropout", "0.2", "--verify-sync", "1", "--max-steps", "4", "--no-pack",
                    "--inspect", "--trace-steps", "1"],
        "cp 3 on 2 ranks": [*TINY, "--cp", "3", "--seq-len", "60"],
        "cp mean-of-means": [*SGD, *MEAN_OF_MEANS, "--cp", "2"],
        "ddp mean-of-means": [*SGD, *MEAN_OF_MEANS],
        "ring": ["probe:ring float64"],
    }), 2, timeout=400)  # fmt: skip


@pytest.fixture(scope="module")
def four_ranks(root) -> dict[str, Run]:
    return run_jobs(jobs_in(root, {
        "dp x cp torch": [*SGD, "--cp", "2"],
        "dp x cp manual": [*SGD, "--cp", "2", "--ddp", "manual"],
        "dp x cp zero-1": [*SGD, "--cp", "2", "--ddp", "manual", "--sharding", "optimizer"],
        "dp x cp fsdp": [*SGD, "--cp", "2", "--sharding", "full"],  # torch's fully_shard over the dp x cp ranks
        "dp x cp manual fsdp": [*SGD, "--cp", "2", "--sharding", "full", "--ddp", "manual"],
        "dp x cp mean-of-means": [*SGD, *MEAN_OF_MEANS, "--cp", "2"],
        "tp x cp torch": [*SGD, "--cp", "2", "--tp", "2"],  # each slice's 2 ranks ring its own head
        "tp x cp manual": [*SGD, "--cp", "2", "--tp", "2", "--ddp", "manual"],
        "ring": ["probe:ring float64"],
    }), 4, timeout=400)  # fmt: skip


@pytest.fixture(scope="module")
def one_process(root, two_ranks) -> dict[str, Run]:
    return run_jobs(jobs_in(root, {
        "plain": SGD,
        "plain mean-of-means": [*SGD, *MEAN_OF_MEANS],
        "cp resumed by one process": [*SGD, "--resume", str(checkpoint(root / "cp torch", 6))],
    }), None, timeout=300)  # fmt: skip


def finished(runs: dict[str, Run], name: str, root: Path) -> Path:
    assert_ok(runs[name])
    assert set(runs[name].codes) <= {0}, runs[name].codes
    return root / name


def held_out(folder: Path) -> tuple[float, float]:
    """The last held-out loss and bits per byte the run wrote, in full (the log prints 4 decimals, too few)."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return next((r["val_loss"], r["val_bpb"]) for r in reversed(records) if "val_loss" in r)


# ----- exactness: fp32 SGD, 12 steps -----


@pytest.mark.parametrize("which", ["torch", "manual"])
def test_cp_over_two_ranks_trains_the_weights_and_losses_of_one_process(two_ranks, one_process, root, which):
    split, plain = finished(two_ranks, f"cp {which}", root), finished(one_process, "plain", root)
    diff = max_difference(weights(plain), weights(split))
    print(f"--cp 2/{which} vs one process, 12 SGD steps: max |dweight| = {diff:.3g}")
    assert diff < EXACT
    assert two_ranks[f"cp {which}"].losses()[:3] == one_process["plain"].losses()[:3]  # 4 decimals
    assert max(map(abs, np.subtract(held_out(split), held_out(plain)))) < EXACT  # under CP: each rank its tokens


@pytest.mark.parametrize(("split", "reference"), [("cp", "plain"), ("dp x cp", "ddp")])
def test_under_cp_mean_of_means_averages_each_replicas_mean_not_each_ranks_chunk(two_ranks, four_ranks, one_process,
                                                                                 root, split, reference):  # fmt: skip
    runs = {**two_ranks, **four_ranks, **one_process}
    mine, theirs = (finished(runs, f"{name} mean-of-means", root) for name in (split, reference))
    diff = max_difference(weights(theirs), weights(mine))
    print(f"{split} vs {reference}, --no-pack, mean-of-means, 12 SGD steps: max |dweight| = {diff:.3g}")
    assert diff < EXACT


@pytest.mark.parametrize("which", ["torch", "manual", "zero-1", "fsdp", "manual fsdp"])
def test_dp_x_cp_over_four_ranks_trains_the_weights_of_two_rank_ddp(four_ranks, two_ranks, root, which):
    split, ddp = finished(four_ranks, f"dp x cp {which}", root), finished(two_ranks, "ddp", root)
    diff = max_difference(weights(ddp), weights(split))
    print(f"dp 2 x cp 2/{which} vs 2-rank DDP: max |dweight| = {diff:.3g}")
    assert diff < EXACT
    assert max(map(abs, np.subtract(held_out(split), held_out(ddp)))) < EXACT


@pytest.mark.parametrize("which", ["torch", "manual"])
def test_tp_x_cp_over_four_ranks_trains_the_weights_of_one_process(four_ranks, one_process, root, which):
    split, plain = finished(four_ranks, f"tp x cp {which}", root), finished(one_process, "plain", root)
    diff = max_difference(weights(plain), weights(split))
    print(f"tp 2 x cp 2/{which} vs one process: max |dweight| = {diff:.3g}")
    assert diff < EXACT
    assert max(map(abs, np.subtract(held_out(split), held_out(plain)))) < EXACT


def test_manual_ddp_under_cp_is_bitwise_torchs_ddp(two_ranks, four_ranks, root):
    # torch's side is its DDP (the gradient average); its context_parallel cannot run on a CPU.
    assert_bitwise_equal(weights(root / "cp torch"), weights(finished(two_ranks, "cp manual", root)), "--cp 2")
    torchs, mine = (finished(four_ranks, f"dp x cp {w}", root) for w in ("torch", "manual"))
    assert_bitwise_equal(weights(torchs), weights(mine), "dp 2 x cp 2")


def test_the_run_says_how_cp_splits_the_batch(two_ranks):
    out = two_ranks["cp torch"].stdout
    assert "[run] 1 replica(s) x 2 examples x 2 micro-step(s) = global batch 4" in out
    assert "[run] --cp 2: each replica's 2 ranks see the same batch, each two of its 4 chunks" in out
    assert "[run] gradient sync: torch DDP" in out
    assert re.search(r"collectives  rank 0, per step: ring send \d+ call", out)


# ----- float64 through the Python API -----


@pytest.mark.parametrize("launch", ["two_ranks", "four_ranks"])
def test_in_float64_ring_attention_is_one_process_causal_attention(launch, request):
    run = request.getfixturevalue(launch)["ring"]
    assert_ok(run)
    ranks = probe_facts(run)
    sizes = {"two_ranks": [1, 2], "four_ranks": [3, 4]}[launch]
    for rank, found in enumerate(ranks):
        for n in sizes:
            if f"ring {n}" not in found:
                assert rank >= n, found  # only the ranks beyond a ring of 3 idle
                continue
            gaps = found[f"ring {n}"]
            print(f"ring of {n}, rank {rank}: {gaps}")
            assert gaps.pop("chunks") == [rank % n, 2 * n - 1 - rank % n]
            assert max(gaps.values()) < FLOAT64, gaps


@pytest.mark.parametrize("launch", ["two_ranks", "four_ranks"])
def test_with_attention_dropout_the_rings_gradient_is_the_slope_of_its_forward(launch, request):
    found = probe_facts(request.getfixturevalue(launch)["ring"])[0]["dropout"]
    print(found)
    assert abs(found["slope"] - found["difference"]) < 1e-7 * max(1.0, abs(found["slope"]))
    assert abs(found["with dropout"] - found["without dropout"]) > 1e-3  # the dropout did drop


# ----- dropout, checkpoints, refusals -----


def test_with_dropout_and_verify_sync_a_cp_run_passes(two_ranks):
    run = two_ranks["dropout"]
    assert_ok(run)
    assert run.codes == (0, 0) and "diverged" not in run.output
    # --no-pack cuts each batch after its last target: under --cp padded to a multiple of 4 again
    assert re.search(r"rank 1: step 1: local loss [0-9.]+ over \d+ tokens", run.stdout)


def test_inspect_says_each_ranks_place_in_the_mesh_and_the_positions_it_holds(two_ranks):
    out = two_ranks["dropout"].stdout  # --inspect, --seq-len 64: four chunks of 16
    for rank, held in ((0, "positions 0-15 and 48-63 of every example (chunks 0 and 3 of 4)"),
                       (1, "positions 16-31 and 32-47 of every example (chunks 1 and 2 of 4)")):  # fmt: skip
        assert f"[inspect] rank {rank}: dp 0 of 1, pp 0 of 1, tp 0 of 1, cp {rank} of 2\n" in out
        assert f"[inspect] rank {rank}: {held}\n[inspect] rank {rank}: every weight whole\n" in out


def test_the_timeline_draws_each_ring_pass_beside_the_blocks_it_overlaps(two_ranks, root):
    assert_ok(two_ranks["dropout"])
    events = json.loads((root / "dropout" / "trace.json").read_text())["traceEvents"]
    for rank in (0, 1):
        mine = [e for e in events if e.get("pid") == rank and e.get("ph") == "X"]
        passes = [e for e in mine if "ring pass" in e.get("args", {})]
        computing = [e for e in mine if e["name"] in ("forward", "backward")]
        assert len(passes) == 8, passes  # 2 micro-batches x 2 blocks x (a pass in forward, one in backward)
        for e in passes:  # each pass starts inside the forward or the backward that computes beside it
            assert any(c["ts"] <= e["ts"] <= c["ts"] + c["dur"] for c in computing), (e, computing)


def test_each_cp_rank_keeps_half_the_activations_of_one_process(two_ranks, one_process, root):
    # The same micro-batches; a rank of the ring computes half of every example's tokens, and keeps for backward
    # its own queries, keys, values, output and log-sum-exp (never a whole row of scores): half of one process's.
    plain, split = (json.loads((finished(runs, name, root) / "memory.json").read_text())
                    for runs, name in ((one_process, "plain"), (two_ranks, "cp torch")))  # fmt: skip
    ratios = [rank["activations"] / plain[0]["activations"] for rank in split]
    print(f"--cp 2: each rank's activations over one process's: {ratios}")
    assert all(abs(ratio - 0.5) < 1e-3 for ratio in ratios), ratios  # 0.500003: its positions are all it adds


def test_a_cp_runs_model_is_todays_format_and_its_checkpoint_resumes_as_one_process(one_process, root):
    model = t.load_tiny_checkpoint(root / "cp torch" / t.TINY_FINAL)  # the whole model, as a plain run writes it
    assert sorted(model.state_dict()) == sorted(weights(root / "plain"))
    out = finished(one_process, "cp resumed by one process", root)
    assert "step_00000006 (step 6" in one_process["cp resumed by one process"].stdout
    diff = max_difference(weights(root / "plain"), weights(out))
    print(f"--cp 2 for 6 steps, then one process for 6, vs one process: max |dweight| = {diff:.3g}")
    assert diff < EXACT


def test_a_ddp_checkpoint_resumes_under_cp(two_ranks, root):
    out = finished(two_ranks, "ddp resumed by cp", root)
    assert "step_00000006 (step 6" in two_ranks["ddp resumed by cp"].stdout
    diff = max_difference(weights(root / "ddp"), weights(out))
    print(f"2-rank DDP for 6 steps, then --cp 2 for 6, vs 2-rank DDP: max |dweight| = {diff:.3g}")
    assert diff < EXACT


def test_a_context_parallel_split_answers_for_its_inner_split_and_copies_without_recursing():
    bare = t.ContextParallel.__new__(t.ContextParallel)  # as copy and pickle make one, before its state
    assert not hasattr(bare, "sliced")
    bare.inner = t.ModelSplit()
    assert copy.deepcopy(bare).holds_all and bare.loss_share == 1.0 and not bare.sliced("blocks.0.attn.qkv.weight")


REFUSED = {
    "seq-len not in 2N chunks": (["--cp", "3", "--seq-len", "64"], "--seq-len 64 does not cut into 2 x --cp 3 = 6"),
    "cp with pp": (["--cp", "2", "--pp", "2", "--n-layers", "2"], "--cp with --pp: the two do not compose yet"),
    "cp with hf": (["--cp", "2", "--model", "hf"], "--cp runs the tiny model; not yet with --model hf"),
    "cp with sample-every": (["--cp", "2", "--sample-every", "5"], "--sample-every samples rank 0's whole model"),
    "cp with compile": (["--cp", "2", "--compile"], "not yet with --tp, --pp or --cp"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_cp_cannot_do_yet_is_refused_in_one_line(case, tmp_path, monkeypatch, capsys):
    flags, expected = REFUSED[case]
    model = ["--cpu"] if "hf" in flags else TINY  # --model hf refuses the tiny model's flags, before --cp
    run = run_main([*model, "--output-dir", str(tmp_path), *flags], monkeypatch, capsys)
    assert run.returncode != 0, run.output
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], run.stderr


def test_cp_that_does_not_divide_the_ranks_is_refused_by_every_rank(two_ranks):
    run = two_ranks["cp 3 on 2 ranks"]
    assert run.returncode != 0 and run.codes == (2, 2), run.output
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "--tp 1 x --pp 1 x --cp 3 does not divide the 2 ranks into replicas" in errors[0]
