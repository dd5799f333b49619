"""ShardedOptimizer (ZeRO stage 1) and ManualFSDP (ZeRO stage 3), held to their contract.

One job on 2 real Gloo ranks (conftest.run_jobs) runs tests/sharding_api_worker.py. Each rank trains
small models with the sharded classes next to a plain reference: a copy of the same model fed
the same batches, its gradients all-reduced and divided by the world size, stepped by a plain
torch optimizer. The worker writes what it measured per rank to JSON; the tests below read it.

ShardedOptimizer only moves each owned parameter's update to one rank and sends the result on,
so it must agree with plain AdamW bit for bit. ManualFSDP computes with the same weights and
sums the same two gradients per element (then halves them, which is exact): in fp32 we measured
it bitwise equal to the reference (max |diff| 0 for gradients and for weights after SGD, AdamW
and no_sync accumulation) and allow 1e-6. With param_dtype the weights are cast for the compute:
after 3 SGD steps bf16 moved them by 6.8e-4 at most (3.0e-4 of their norm), fp16 by 1.4e-4
(5.0e-5); we require under 1% of the norm, and more than the fp32 tolerance (the cast happened).
The whole file takes a few seconds: one job, every scenario.
"""

from __future__ import annotations

import inspect
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import sharding_api_worker as worker
from conftest import Run, assert_ok, run_jobs

import llm_ddp_parallel_training as t

WORKER = Path(__file__).with_name("sharding_api_worker.py")
RANKS = 2
TOLERANCE = 1e-6
LOW_PRECISION_TOLERANCE = 1e-2  # relative to the norm of the fp32 reference's weights

FSDP_FP32 = [
    "fsdp sgd, blocks and root",
    "fsdp sgd, blocks only",
    "fsdp adamw, blocks and root",
    "fsdp no_sync, blocks and root",
    "fsdp no_sync, blocks only",
]
FSDP_LOW_PRECISION = ["fsdp bfloat16", "fsdp float16"]
# The parameters that TinyLM keeps outside both blocks: replicated when only the blocks are units.
OUTSIDE_THE_BLOCKS = {"emb.weight", "norm.weight", "norm.bias", "head.weight", "head.bias"}


@dataclass
class Measured:
    run: Run
    ranks: list[dict]  # per rank: scenario name -> facts

    def __call__(self, scenario: str) -> list[dict]:
        """The facts of one scenario, rank by rank; a clear failure if a rank raised or never got there."""
        per_rank = [facts.get(scenario) for facts in self.ranks]
        problems = [
            f"rank {r} never finished {scenario!r}" if got is None else f"rank {r}: {scenario!r} raised\n{got['error']}"
            for r, got in enumerate(per_rank)
            if got is None or "error" in got
        ]
        if problems:
            stderr = self.run.stderr[-6000:]
            pytest.fail("\n".join([*problems, f"--- worker exit {self.run.returncode}, stderr\n{stderr}"]))
        return per_rank


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> Measured:
    """The one job: 2 ranks run every scenario of the worker and write rank<r>.json."""
    out = tmp_path_factory.mktemp("sharding_api")
    run = run_jobs({"scenarios": [str(out)]}, nproc=RANKS, timeout=150, worker=WORKER)["scenarios"]
    paths = [out / f"rank{r}.json" for r in range(RANKS)]
    return Measured(run, [json.loads(p.read_text()) if p.exists() else {} for p in paths])


@pytest.fixture(scope="module")
def zero1(measured) -> list[dict]:
    return measured("sharded optimizer")


def test_the_worker_finishes_every_scenario_on_both_ranks(measured):
    for scenario in worker.SCENARIOS:
        measured(scenario)
    assert_ok(measured.run)


def test_dist_from_process_group_describes_this_rank_of_the_default_group(measured):
    for facts in measured("dist"):
        expected = facts["expected"]
        assert (facts["rank"], facts["world_size"]) == (expected["rank"], expected["world_size"])
        assert facts["backend"] == expected["backend"] == "gloo"
        assert facts["device"] == "cpu"
        assert facts["distributed"] is True


def test_neither_class_emits_a_warning(measured):
    caught = {
        (r, scenario): facts[scenario]["warnings"]
        for r, facts in enumerate(measured.ranks)
        for scenario in facts
        if facts[scenario]["warnings"]
    }
    assert caught == {}


# ----------------------------------------------------------------------------------------------
# ShardedOptimizer: AdamW over a model with a tied embedding/head and a frozen Linear
# ----------------------------------------------------------------------------------------------


def test_sharded_optimizer_takes_the_arguments_of_zero_redundancy_optimizer():
    with warnings.catch_warnings():  # importing it warns that torch.jit.script is deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer
    ours = inspect.signature(t.ShardedOptimizer).parameters
    theirs = inspect.signature(ZeroRedundancyOptimizer).parameters
    assert list(ours)[:2] == ["params", "optimizer_class"]
    assert [p.name for p in ours.values() if p.kind is inspect.Parameter.VAR_KEYWORD] == ["defaults"]
    for name, p in ours.items():  # nothing of its own: every argument is one ZeroRedundancyOptimizer takes
        assert name in theirs and theirs[name].kind is p.kind, name
        assert p.default is theirs[name].default or p.default == theirs[name].default, name


def test_after_adamw_steps_every_rank_holds_the_same_full_parameters(zero1):
    for when in ("after_3_steps", "after_lr_change"):
        assert zero1[0][when]["digests"] == zero1[1][when]["digests"], when


def test_sharded_adamw_updates_the_parameters_bitwise_like_plain_adamw(zero1):
    for r, facts in enumerate(zero1):
        compared = facts["after_3_steps"]
        print(f"rank {r}: max |param - plain AdamW's| after 3 steps = {compared['max_abs_diff']:.3g}")
        assert [name for name, same in compared["bitwise_equal"].items() if not same] == []


def test_param_groups_hold_every_parameter_with_the_given_hyperparameters(zero1):
    for facts in zero1:
        groups = facts["param_groups"]
        assert groups["params_are_the_models"]
        assert groups["lr"] == [worker.ZERO_LR] * groups["count"]
        assert groups["weight_decay"] == [worker.ZERO_DECAY] * groups["count"]


def test_each_rank_keeps_optimizer_state_only_for_the_whole_parameters_it_owns(zero1):
    trainable = set(zero1[0]["trainable"])
    held = [set(facts["held"]["params_with_state"]) for facts in zero1]
    for r, names in enumerate(held):
        print(f"rank {r} holds state for {sorted(names)}")
        assert names and names < trainable, f"rank {r}"
    assert not held[0] & held[1]
    assert held[0] | held[1] == trainable


def test_the_ranks_hold_the_optimizer_state_once_between_them(zero1):
    # AdamW keeps exp_avg, exp_avg_sq and a step count per parameter: 2 x numel + 1 numbers.
    whole = zero1[0]["reference_held"]["numel"]
    per_rank = [facts["held"]["numel"] for facts in zero1]
    print(f"optimizer state numbers per rank {per_rank}, plain AdamW {whole}")
    assert all(0 < n < whole for n in per_rank)
    assert sum(per_rank) == whole


def test_state_dict_is_the_plain_optimizers_state_dict_on_every_rank(zero1):
    for r, facts in enumerate(zero1):
        assert facts["state_dict_differences"] == [], f"rank {r}"
        assert facts["state_dict_state_keys"] == facts["reference_state_dict_state_keys"] == ["0", "2", "3", "4", "5"]


def test_loading_a_plain_optimizers_state_dict_resumes_exactly(zero1):
    for r, facts in enumerate(zero1):
        assert facts["lr_after_load"] == worker.ZERO_LR_CHANGED  # the loaded group's, not the constructor's
        assert [name for name, same in facts["after_load"]["bitwise_equal"].items() if not same] == [], f"rank {r}"
        # The loaded moments mattered: fresh ones would have stepped elsewhere.
        assert facts["fresh_state_vs_loaded"] > 1e-4


def test_a_learning_rate_set_in_param_groups_takes_effect_at_the_next_step(zero1):
    for r, facts in enumerate(zero1):
        assert [name for name, same in facts["after_lr_change"]["bitwise_equal"].items() if not same] == [], f"rank {r}"
        # ... and the old rate would have given other weights.
        assert facts["old_lr_vs_new_lr"] > 1e-4


def test_zero_grad_sets_gradients_to_none_or_to_zero_like_a_torch_optimizer(zero1):
    trainable = set(zero1[0]["trainable"])
    for facts in zero1:
        assert {n for n, s in facts["grads_before_zero_grad"].items() if s == "nonzero"} == trainable
        assert set(facts["grads_after_zero_grad"].values()) == {"None"}  # set_to_none=True, torch's default
        after = facts["grads_after_zero_grad_set_to_none_false"]
        assert {n: s for n, s in after.items() if n in trainable} == dict.fromkeys(trainable, "zero")
        assert after["frozen.weight"] == "None"


def test_a_frozen_parameter_is_never_updated_and_holds_no_state(zero1):
    for facts in zero1:
        assert facts["frozen_unchanged"]
        assert "frozen.weight" not in facts["held"]["params_with_state"]


def test_a_tied_parameter_stays_tied_and_is_updated_once(zero1):
    for facts in zero1:
        assert facts["tied_same_object"]  # head.weight is emb.weight
        assert facts["tied_changed_by"] > 1e-3
        assert facts["tied_equals_reference"]  # plain AdamW sees the shared tensor once


# ----------------------------------------------------------------------------------------------
# ManualFSDP: an Embedding, 2 residual blocks, a LayerNorm and a head, each rank drawing its own
# initial weights; units are [*blocks, model] or the blocks only
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["fsdp sgd, blocks and root", "fsdp sgd, blocks only"])
def test_fsdp_module_is_the_wrapped_module(measured, scenario):
    assert all(facts["module_is_module"] for facts in measured(scenario))


@pytest.mark.parametrize("scenario", ["fsdp sgd, blocks and root", "fsdp sgd, blocks only"])
def test_fsdp_a_unit_parameter_holds_its_chunk_of_rank_0s_weights(measured, scenario):
    for r, facts in enumerate(measured(scenario)):
        for name in facts["sharded"]:
            held = facts["after_construction"][name]
            shard = math.ceil(math.prod(facts["full_shapes"][name]) / RANKS)
            assert held["shape"] == [shard], f"rank {r}: {name}"
            assert held["max_abs_diff"] == 0.0, f"rank {r}: {name}"  # a broadcast copies exactly


def test_fsdp_a_parameter_outside_every_unit_keeps_rank_0s_full_weights(measured):
    for r, facts in enumerate(measured("fsdp sgd, blocks only")):
        assert set(facts["names"]) - set(facts["sharded"]) == OUTSIDE_THE_BLOCKS
        for name in OUTSIDE_THE_BLOCKS:
            held = facts["after_construction"][name]
            assert held["shape"] == facts["full_shapes"][name], f"rank {r}: {name}"
            assert held["max_abs_diff"] == 0.0, f"rank {r}: {name}"


@pytest.mark.parametrize("scenario", ["fsdp sgd, blocks and root", "fsdp sgd, blocks only"])
def test_fsdp_each_grad_is_its_share_of_the_averaged_full_gradient(measured, scenario):
    # A unit parameter's .grad: its chunk of the reference's averaged gradient, shaped like .data.
    # A replicated one's: the whole averaged gradient, as DDP leaves it.
    worst, bitwise, count = 0.0, 0, 0
    for r, facts in enumerate(measured(scenario)):
        for name, grad in facts["gradients"].items():
            where = f"rank {r}: {name}"
            assert grad["grad"] == "present", where
            assert grad["shape"] == grad["data_shape"] == grad["vs_expected_shape"], where
            assert grad["dtype"] == grad["data_dtype"] == "torch.float32", where
            worst = max(worst, grad["vs_max_abs_diff"])
            bitwise, count = bitwise + grad["bitwise_equal"], count + 1
            assert grad["vs_max_abs_diff"] <= TOLERANCE, where
    print(f"{scenario}: max |grad - reference| = {worst:.3g}; bitwise equal on {bitwise}/{count}")


def test_fsdp_the_padding_of_a_shard_is_zero_in_weights_and_gradients(measured):
    padded = 0
    for scenario in FSDP_FP32:
        for r, facts in enumerate(measured(scenario)):
            for when in ("after_construction", "shards_after_training"):
                for name in facts["sharded"]:
                    held = facts[when][name]
                    padded += held["padding"]
                    assert held["padding_max_abs"] == 0.0, f"{scenario}, rank {r}, {when}: {name}"
            for name in facts["sharded"]:
                assert facts["gradients"][name]["vs_padding_max_abs"] == 0.0, f"{scenario}, rank {r}, grad: {name}"
    assert padded > 0  # odd sizes: rank 1's chunks of them end in padding


@pytest.mark.parametrize(
    "scenario", ["fsdp sgd, blocks and root", "fsdp adamw, blocks and root", "fsdp sgd, blocks only"]
)
def test_fsdp_training_matches_the_reference_trained_on_averaged_gradients(measured, scenario):
    for r, facts in enumerate(measured(scenario)):
        trained = facts["trained"]
        same = sum(trained["bitwise_equal"].values())
        count = len(trained["bitwise_equal"])
        print(f"{scenario}, rank {r}: max |dparam| = {trained['max_abs_diff']:.3g}, bitwise equal {same}/{count}")
        assert trained["max_abs_diff"] <= TOLERANCE


@pytest.mark.parametrize("scenario", FSDP_FP32)
def test_fsdp_between_steps_each_shard_is_its_chunk_of_the_gathered_weights(measured, scenario):
    for r, facts in enumerate(measured(scenario)):
        for name, held in facts["shards_after_training"].items():
            assert held["shape"] == held["expected_shape"], f"rank {r}: {name}"
            assert held["max_abs_diff"] == 0.0, f"rank {r}: {name}"


@pytest.mark.parametrize("scenario", FSDP_FP32 + FSDP_LOW_PRECISION)
def test_fsdp_whole_parameters_are_keyed_and_shaped_like_the_module(measured, scenario):
    # ManualFSDP.whole(p) of every parameter of the wrapped module: what a checkpoint gathers.
    for facts in measured(scenario):
        assert sorted(facts["gathered_keys"]) == sorted(facts["names"])
        assert facts["gathered_shapes"] == facts["full_shapes"]


@pytest.mark.parametrize("scenario", FSDP_FP32 + FSDP_LOW_PRECISION)
def test_fsdp_every_rank_gathers_the_same_weights(measured, scenario):
    first, second = measured(scenario)
    assert first["trained"]["digests"] == second["trained"]["digests"]


@pytest.mark.parametrize("scenario", ["fsdp no_sync, blocks and root", "fsdp no_sync, blocks only"])
def test_fsdp_no_sync_accumulation_matches_the_reference_accumulating_the_same_micro_batches(measured, scenario):
    for r, facts in enumerate(measured(scenario)):
        diff = facts["trained"]["max_abs_diff"]
        print(f"{scenario}, rank {r}: 2 steps x 2 micro-batches, max |dparam| = {diff:.3g}")
        assert diff <= TOLERANCE


def test_fsdp_no_sync_leaves_replicated_gradients_local_until_the_synced_micro_step(measured):
    # Inside no_sync() nothing is sent: a replicated parameter's .grad is this rank's own gradient.
    for r, facts in enumerate(measured("fsdp no_sync, blocks only")):
        inside = facts["replicated_grads_inside_no_sync"]
        assert set(inside) == OUTSIDE_THE_BLOCKS
        for name, grad in inside.items():
            assert "max_abs_diff_from_local" in grad, f"rank {r}: {name}: {grad}"
            assert grad["max_abs_diff_from_local"] <= TOLERANCE, f"rank {r}: {name}"


@pytest.mark.parametrize("scenario", FSDP_LOW_PRECISION)
def test_fsdp_param_dtype_keeps_fp32_shards_and_gradients(measured, scenario):
    for r, facts in enumerate(measured(scenario)):
        assert set(facts["data_dtypes_after_training"].values()) == {"torch.float32"}, f"rank {r}"
        for name, grad in facts["gradients"].items():
            assert (grad["dtype"], grad["data_dtype"]) == ("torch.float32", "torch.float32"), f"rank {r}: {name}"
            assert grad["shape"] == grad["data_shape"], f"rank {r}: {name}"


@pytest.mark.parametrize("scenario", FSDP_LOW_PRECISION)
def test_fsdp_param_dtype_trains_within_one_percent_of_fp32_but_not_as_fp32(measured, scenario):
    for r, facts in enumerate(measured(scenario)):
        trained = facts["trained"]
        print(
            f"{scenario}, rank {r}: logits {facts['logits_dtype']}, max |dparam| vs fp32 = "
            f"{trained['max_abs_diff']:.3g}, relative (norms) = {trained['relative_norm_diff']:.3g}"
        )
        assert trained["relative_norm_diff"] < LOW_PRECISION_TOLERANCE
        assert trained["max_abs_diff"] > TOLERANCE  # the weights really were cast for the compute
