"""Where sharded training keeps its state, and in which dtype.

ManualFSDP with param_dtype computes in bfloat16 and keeps everything else in float32, as torch's
fully_shard with a MixedPrecisionPolicy does: the shards, the gradients and their sums across
accumulation micro-steps; and a module whose parameters lie partly outside every unit runs whole in
the compute dtype (the unit's inputs are cast, and so are the replicated parameters while they compute).

The reference is the same model cast to bfloat16, run one micro-batch at a time, its gradients summed
in float32: every rank feeds the same micro-batches, so the averaged gradient is that sum exactly.

A ZeroRedundancyOptimizer loaded from a whole state (a resume) keeps every state tensor where a
stepping optimizer keeps it: torch's own load moves Adam's 0-d step to the CPU, where the fused and
capturable CUDA kernels refuse it (pytorch#124133). On a CPU the devices agree either way; the GPU
check is `--sharding optimizer --save-every 2 --max-steps 4`, then the same with `--max-steps 6`.
"""

from __future__ import annotations

import json

import pytest
from conftest import assert_ok
from probe_worker import run_jobs_with_probes

PROBE = r'''
import contextlib, copy, json, sys
import torch, torch.distributed as dist
import llm_ddp_parallel_training as t

d = t.Dist.from_process_group()  # the default group, which the ranks joined before running this
torch.manual_seed(0)
base = t.TinyTransformer(t.TinyConfig(seq_len=16, d_model=32, n_heads=2, n_layers=2))
batches = torch.randint(0, 256, (8, 2, 17), generator=torch.Generator().manual_seed(1))  # the same on every rank

def reference(micro_batches):
    """The bf16 model, a micro-batch at a time; its gradients summed in float32, and its last loss."""
    model, summed = copy.deepcopy(base).to(torch.bfloat16), {}
    for ids in micro_batches:
        model.zero_grad()
        loss = t.token_loss_sum(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        for n, p in model.named_parameters():
            summed[n] = summed.get(n, 0) + p.grad.float()
    return summed, loss.item()

def trained(units_of, micro_batches):
    module = copy.deepcopy(base)
    fsdp = t.ManualFSDP(module, d, units_of(module), param_dtype=torch.bfloat16)
    for i, ids in enumerate(micro_batches):
        with fsdp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            loss = t.token_loss_sum(fsdp(ids[:, :-1]), ids[:, 1:])
            loss.backward()
    fsdp.finish_gradient_sync()
    grads = {n: fsdp.whole(p, p.grad) for n, p in module.named_parameters()}
    kept = {n: [str(p.dtype), str(p.grad.dtype)] for n, p in module.named_parameters()}
    return grads, loss.item(), kept

def worst(grads, summed):
    return max(((grads[n] - summed[n]).norm() / summed[n].norm()).item() for n in summed)

facts = {}
summed, _ = reference(batches)
grads, _, kept = trained(lambda m: [*m.blocks, m], batches)
facts["accumulated"] = {"relative_error": worst(grads, summed), "dtypes": kept}
try:
    summed, ref_loss = reference(batches[:1])
    grads, loss, kept = trained(lambda m: [*m.blocks], batches[:1])
    facts["blocks only"] = {"relative_error": worst(grads, summed), "loss": loss, "reference_loss": ref_loss,
                            "dtypes": kept}
except RuntimeError as e:
    facts["blocks only"] = {"error": str(e).splitlines()[0]}
from torch.distributed.optim import ZeroRedundancyOptimizer

def zero_model():
    torch.manual_seed(0)
    model = t.TinyTransformer(t.TinyConfig(seq_len=16, d_model=32, n_heads=2, n_layers=2))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2, fused=True)
    return model, list(model.named_parameters()), opt

def zero_step(model, opt, ids):
    t.token_loss_sum(model(ids[:, :-1]), ids[:, 1:]).backward()
    opt.step()
    opt.zero_grad()

stepped, named, opt = zero_model()
zero_step(stepped, opt, batches[0])
weights, state = t.rank0_state(t.Wrapper(stepped), d, named, opt)
box = [copy.deepcopy((weights, state))]  # as a checkpoint holds them: rank 0's are its live tensors
dist.broadcast_object_list(box, src=0)
resumed, named2, opt2 = zero_model()
t.load_state(t.Wrapper(resumed), named2, *box[0][:1], opt2, box[0][1])
where = lambda o: sorted((n, k, str(v.device), str(v.dtype)) for n, p in (named if o is opt else named2)
                         for k, v in o.optim.state.get(p, {}).items())
facts["zero"] = {"stepped": where(opt), "resumed": where(opt2)}
zero_step(stepped, opt, batches[1])
zero_step(resumed, opt2, batches[1])
facts["zero"]["continues_bitwise"] = all(torch.equal(a, b) for a, b in zip(stepped.parameters(), resumed.parameters()))
if d.rank == 0:
    print("FACTS " + json.dumps(facts))
'''


@pytest.fixture(scope="module")
def facts(tmp_path_factory) -> dict:
    """PROBE on 2 ranks, a job of a shared launch (tests/probe_worker.py's script probe); rank 0's facts."""
    script = tmp_path_factory.mktemp("probe") / "probe.py"
    script.write_text(PROBE)
    run = run_jobs_with_probes({"probe": ["probe:script", str(script)]}, nproc=2, timeout=120)["probe"]
    assert_ok(run)
    return json.loads(run.stdout.split("FACTS ", 1)[1])


def test_manual_fsdp_param_dtype_accumulates_and_keeps_gradients_in_float32(facts):
    accumulated = facts["accumulated"]
    # 8 micro-steps under no_sync(): summed in bfloat16 they were 4.7e-3 off (relative) before the fix.
    assert accumulated["relative_error"] < 1e-6, accumulated
    assert all(dtypes == ["torch.float32", "torch.float32"] for dtypes in accumulated["dtypes"].values())
    blocks_only = facts["blocks only"]
    # Before the fix: "mixed dtype (CPU): expect parameter to have scalar type of Float", from a float32
    # LayerNorm on the bfloat16 activations of the blocks.
    assert "error" not in blocks_only, blocks_only
    assert blocks_only["loss"] == blocks_only["reference_loss"]
    assert blocks_only["relative_error"] < 1e-6, blocks_only
    assert all(dtypes == ["torch.float32", "torch.float32"] for dtypes in blocks_only["dtypes"].values())


def test_a_resumed_zero_optimizer_keeps_its_state_where_a_stepping_one_does_and_continues_bitwise(facts):
    zero = facts["zero"]
    assert zero["resumed"] == zero["stepped"] and any(k == "step" for _, k, *_ in zero["stepped"])
    assert zero["continues_bitwise"]
