"""The measuring half of test_sharding_api.py: one job (run_job) of tests/worker.py's launch of 2 Gloo ranks.

Every rank trains small models with ShardedOptimizer (ZeRO stage 1) and ManualFSDP (ZeRO stage 3)
next to a plain reference: a copy of the same model, trained on this rank's batches with its
gradients all-reduced and divided by the world size, stepped by a plain torch optimizer. Each
scenario writes what it measured to OUT/rank<r>.json (the job's argument) as soon as it ends; the tests
assert on those facts. A scenario that raises records its traceback and the others still run;
if one rank is left waiting in a collective, both ranks stop after 20 s instead of hanging.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import llm_ddp_parallel_training as t

ZERO_LR, ZERO_LR_CHANGED, ZERO_DECAY = 1e-2, 3e-3, 0.1
FSDP_SGD_LR, FSDP_ADAMW_LR = 0.5, 1e-2
TIED_VOCAB = 16  # ShardedOptimizer's model
VOCAB, DIM, HIDDEN = 13, 9, 14  # ManualFSDP's model: odd sizes, so most shards end in padding


# ----------------------------------------------------------------------------------------------
# Models, data and the reference's gradient averaging
# ----------------------------------------------------------------------------------------------


class TiedNet(nn.Module):
    """Embedding -> frozen Linear (residual) -> Linear-Tanh-Linear -> head that IS the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(TIED_VOCAB, 8)
        self.frozen = nn.Linear(8, 8, bias=False).requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8))
        self.head = nn.Linear(8, TIED_VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.head(self.body(h + self.frozen(h)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, 2 residual blocks, final LayerNorm, head. No dropout: every result is deterministic."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        with torch.no_grad():  # LayerNorms start at 1 and 0 on every rank: make them random too
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.normal_(1.0, 0.2)
                    m.bias.normal_(0.0, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def batch(step: int, vocab: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's own batch: ranks, steps and micro-steps all see different tokens."""
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank())
    return torch.randint(vocab, (3, 5), generator=g), torch.randint(vocab, (3, 5), generator=g)


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def average_gradients(params: Iterable[nn.Parameter]) -> None:
    """What DDP does, by hand: sum every gradient over the ranks, divide by their number."""
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world())


# ----------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------


def digest(x: torch.Tensor) -> str:
    return hashlib.sha256(x.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def named(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


def comparison(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
    return {
        "max_abs_diff": max_abs_diff(mine, ref),
        "bitwise_equal": {k: torch.equal(mine[k], ref[k]) for k in ref},
        "digests": {k: digest(v) for k, v in mine.items()},
    }


def chunk_of(full: torch.Tensor, r: int) -> torch.Tensor:
    """Rank r's shard by the contract: flatten, zero-pad to a multiple of N, cut in N chunks."""
    flat = full.detach().reshape(-1)
    n = math.ceil(flat.numel() / world())
    return torch.cat([flat, flat.new_zeros(n * world() - flat.numel())])[r * n : (r + 1) * n]


def real_count(numel: int, r: int) -> int:
    """How many of rank r's shard elements are the parameter's; the rest is padding."""
    n = math.ceil(numel / world())
    return max(0, min(n, numel - r * n))


def optimizers_reachable_from(root: object) -> list[torch.optim.Optimizer]:
    """Every torch optimizer this object holds: itself, attributes, and inside dicts, lists, tuples."""
    found, seen, todo = [], set(), [(root, 0)]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen or depth > 4:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.optim.Optimizer):
            found.append(obj)
        if isinstance(obj, dict):
            children = list(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            children = list(obj)
        elif isinstance(obj, torch.optim.Optimizer) or type(obj).__module__ == t.__name__:
            children = list(vars(obj).values())
        else:
            continue
        todo.extend((c, depth + 1) for c in children if not isinstance(c, (torch.Tensor, nn.Module)))
    return found


def held_state(opt: object, model: nn.Module) -> dict:
    """The optimizer state this rank holds: for which parameters, and how many numbers."""
    names = {id(p): n for n, p in model.named_parameters()}
    params, tensors = set(), {}
    optimizers = optimizers_reachable_from(opt)
    for o in optimizers:
        for key, s in o.state.items():
            held = [v for v in s.values() if isinstance(v, torch.Tensor)]
            if held:
                params.add(names.get(id(key), f"<not a model parameter: {type(key).__name__}>"))
                tensors.update({id(v): v.numel() for v in held})
    return {"optimizers": len(optimizers), "params_with_state": sorted(params), "numel": sum(tensors.values())}


def state_dict_differences(mine: dict, ref: dict) -> list[str]:
    """Everything in which `mine` is not exactly the plain optimizer's state_dict `ref`."""
    problems = []
    if set(mine) != set(ref):
        problems.append(f"top-level keys {sorted(mine)} != {sorted(ref)}")
    state, ref_state = mine.get("state", {}), ref["state"]
    if set(state) != set(ref_state):
        problems.append(f"state keys {sorted(map(repr, state))} != {sorted(map(repr, ref_state))}")
    for i, entry in ref_state.items():
        got = state.get(i, {})
        if set(got) != set(entry):
            problems.append(f"state[{i}] keys {sorted(got)} != {sorted(entry)}")
        for k, v in entry.items():
            w = got.get(k)
            if isinstance(v, torch.Tensor):
                if not isinstance(w, torch.Tensor) or w.dtype != v.dtype or w.shape != v.shape:
                    problems.append(f"state[{i}][{k!r}]: {describe(w)} != {describe(v)}")
                elif not torch.equal(w, v):
                    problems.append(f"state[{i}][{k!r}] differs by {(w.double() - v.double()).abs().max().item():.3g}")
            elif w != v:
                problems.append(f"state[{i}][{k!r}]: {w!r} != {v!r}")
    groups, ref_groups = mine.get("param_groups", []), ref["param_groups"]
    if len(groups) != len(ref_groups):
        problems.append(f"{len(groups)} param_groups != {len(ref_groups)}")
    for j, (g, rg) in enumerate(zip(groups, ref_groups, strict=False)):
        for k in sorted(set(g) | set(rg)):
            if g.get(k, "<missing>") != rg.get(k, "<missing>"):
                problems.append(f"param_groups[{j}][{k!r}]: {g.get(k, '<missing>')!r} != {rg.get(k, '<missing>')!r}")
    return problems


def describe(x: object) -> str:
    return f"tensor {x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)


def grad_state(model: nn.Module) -> dict[str, str]:
    def state(p: nn.Parameter) -> str:
        return "None" if p.grad is None else "zero" if not p.grad.any() else "nonzero"

    return {n: state(p) for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------------------------
# Scenarios: each returns a dict of facts for this rank
# ----------------------------------------------------------------------------------------------


def dist_facts() -> dict:
    d = t.Dist.from_process_group()
    return {
        "rank": d.rank,
        "world_size": d.world_size,
        "device": str(d.device),
        "backend": d.backend,
        "distributed": d.distributed,
        "expected": {"rank": rank(), "world_size": world(), "backend": dist.get_backend()},
    }


def zero1_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    for p in model.parameters():
        p.grad = None  # by hand: zero_grad() has its own test
    x, y = batch(step, TIED_VOCAB)
    loss_of(model(x), y).backward()
    average_gradients(model.parameters())
    opt.step()


def sharded_optimizer() -> dict:
    facts = {}
    torch.manual_seed(0)  # the same seed everywhere: every rank starts with the same weights
    model = TiedNet()
    initial = named(model)
    ref = copy.deepcopy(model)  # deepcopy keeps the tie
    opt = t.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=ZERO_LR, weight_decay=ZERO_DECAY)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=ZERO_LR, weight_decay=ZERO_DECAY)
    facts["param_names"] = [n for n, _ in model.named_parameters()]
    facts["trainable"] = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = opt.param_groups
    facts["param_groups"] = {
        "count": len(groups),
        "params_are_the_models": [p for g in groups for p in g["params"]] == list(model.parameters()),
        "lr": [g["lr"] for g in groups],
        "weight_decay": [g["weight_decay"] for g in groups],
    }

    for step in range(3):
        zero1_step(model, opt, step)
        zero1_step(ref, ref_opt, step)
    facts["after_3_steps"] = comparison(named(model), named(ref))
    facts["held"] = held_state(opt, model)  # before state_dict(), which gathers the whole state
    facts["reference_held"] = held_state(ref_opt, ref)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    facts["state_dict_differences"] = state_dict_differences(sd, ref_sd)
    facts["state_dict_state_keys"] = sorted(map(repr, sd.get("state", {})))
    facts["reference_state_dict_state_keys"] = sorted(map(repr, ref_sd["state"]))

    # A new learning rate, set the way schedulers set it; the control steps with the old one.
    control, control_opt = copy.deepcopy((ref, ref_opt))
    opt.param_groups[0]["lr"] = ref_opt.param_groups[0]["lr"] = ZERO_LR_CHANGED
    zero1_step(model, opt, 3)
    zero1_step(ref, ref_opt, 3)
    zero1_step(control, control_opt, 3)
    facts["after_lr_change"] = comparison(named(model), named(ref))
    facts["old_lr_vs_new_lr"] = max_abs_diff(named(control), named(ref))
    facts["frozen_unchanged"] = torch.equal(model.frozen.weight, initial["frozen.weight"])
    facts["tied_same_object"] = model.head.weight is model.emb.weight
    facts["tied_changed_by"] = (model.emb.weight - initial["emb.weight"]).abs().max().item()
    facts["tied_equals_reference"] = torch.equal(model.emb.weight, ref.emb.weight)

    # Resume: a fresh ShardedOptimizer loads the plain optimizer's state_dict, then both step once.
    # The control starts from the same weights with fresh state, to show the loaded state matters.
    resumed = copy.deepcopy(ref)
    resumed_opt = t.ShardedOptimizer(resumed.parameters(), torch.optim.AdamW, lr=ZERO_LR, weight_decay=ZERO_DECAY)
    resumed_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    facts["lr_after_load"] = resumed_opt.param_groups[0]["lr"]
    fresh = copy.deepcopy(ref)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=ZERO_LR_CHANGED, weight_decay=ZERO_DECAY)
    zero1_step(resumed, resumed_opt, 4)
    zero1_step(ref, ref_opt, 4)
    zero1_step(fresh, fresh_opt, 4)
    facts["after_load"] = comparison(named(resumed), named(ref))
    facts["fresh_state_vs_loaded"] = max_abs_diff(named(fresh), named(ref))

    # zero_grad(): the gradients step 4 left, then new ones for set_to_none=False.
    facts["grads_before_zero_grad"] = grad_state(resumed)
    resumed_opt.zero_grad()
    facts["grads_after_zero_grad"] = grad_state(resumed)
    x, y = batch(5, TIED_VOCAB)
    loss_of(resumed(x), y).backward()
    resumed_opt.zero_grad(set_to_none=False)
    facts["grads_after_zero_grad_set_to_none_false"] = grad_state(resumed)
    return facts


def unit_lists() -> dict[str, Callable[[TinyLM], list[nn.Module]]]:
    return {"blocks and root": lambda m: [*m.blocks, m], "blocks only": lambda m: [*m.blocks]}


def fsdp_run(units: str, optimizer: str, steps: int, param_dtype: torch.dtype | None = None, micro: int = 1) -> dict:
    """Train TinyLM under ManualFSDP and its plain reference side by side, measuring as we go."""
    facts = {}
    torch.manual_seed(1 + rank())  # every rank draws its own weights: the wrapper must broadcast rank 0's
    module = TinyLM()
    ref = copy.deepcopy(module)
    for p in ref.parameters():
        dist.broadcast(p.data, src=0)  # the reference starts from rank 0's weights too
    unit_modules = unit_lists()[units](module)
    in_unit = {id(p) for u in unit_modules for p in u.parameters()}
    names = [n for n, _ in module.named_parameters()]
    sharded = {n for n, p in module.named_parameters() if id(p) in in_unit}
    full_shape = {n: list(p.shape) for n, p in module.named_parameters()}
    facts.update(names=names, sharded=sorted(sharded), full_shapes=full_shape)

    model = t.ManualFSDP(module, t.Dist.from_process_group(), unit_modules, param_dtype=param_dtype)
    facts["module_is_module"] = model.module is module
    facts["after_construction"] = {
        n: shard_facts(p.data, ref.get_parameter(n), n in sharded) for n, p in module.named_parameters()
    }

    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=FSDP_SGD_LR),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=FSDP_ADAMW_LR),
    }[optimizer]
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    for step in range(steps):
        batches = [batch(step, VOCAB, i) for i in range(micro)]
        ref_opt.zero_grad()
        local_after_first = None
        for x, y in batches:
            loss_of(ref(x), y).backward()
            if local_after_first is None:
                local_after_first = {n: p.grad.clone() for n, p in ref.named_parameters()}
        average_gradients(ref.parameters())
        ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}

        opt.zero_grad()
        for i, (x, y) in enumerate(batches):
            accumulating = i < len(batches) - 1
            with model.no_sync() if accumulating else contextlib.nullcontext():
                logits = model(x)
                loss_of(logits, y).backward()
            if step == 0 and i == 0:
                facts["logits_dtype"] = str(logits.dtype)
            if step == 0 and accumulating and i == 0:
                facts["replicated_grads_inside_no_sync"] = {
                    n: local_grad_facts(p.grad, local_after_first[n])
                    for n, p in module.named_parameters()
                    if n not in sharded
                }
        model.finish_gradient_sync()  # ManualFSDP waits for its reduce-scatters here
        if step == 0:
            facts["gradients"] = {n: grad_facts(p, ref_grads[n], n in sharded) for n, p in module.named_parameters()}
        opt.step()
        ref_opt.step()

    facts["data_dtypes_after_training"] = {n: str(p.data.dtype) for n, p in module.named_parameters()}
    full = {n: model.whole(p) for n, p in model.module.named_parameters()}  # a collective: every rank gathers
    facts["gathered_keys"] = list(full)
    facts["gathered_shapes"] = {n: list(v.shape) for n, v in full.items()}
    facts["gathered_dtypes"] = {n: str(v.dtype) for n, v in full.items()}
    reference = named(ref)
    if set(full) == set(reference):
        facts["trained"] = comparison({n: v.float() for n, v in full.items()}, reference)
        diff = torch.cat([(full[n].double() - reference[n].double()).flatten() for n in reference])
        whole = torch.cat([reference[n].double().flatten() for n in reference])
        facts["trained"]["relative_norm_diff"] = (diff.norm() / whole.norm()).item()
        facts["shards_after_training"] = {
            n: shard_facts(p.data, full[n], n in sharded) for n, p in module.named_parameters()
        }
    return facts


def shard_facts(data: torch.Tensor, full: torch.Tensor, sharded: bool) -> dict:
    """What a parameter holds between steps, against what it should: its chunk of `full`, or all of it."""
    expected = chunk_of(full, rank()) if sharded else full.detach()
    facts = {"shape": list(data.shape), "dtype": str(data.dtype), "expected_shape": list(expected.shape)}
    if data.shape == expected.shape:
        real = real_count(full.numel(), rank()) if sharded else data.numel()
        mine, theirs = data.reshape(-1).double(), expected.reshape(-1).double()
        facts["max_abs_diff"] = (mine[:real] - theirs[:real]).abs().max().item() if real else 0.0
        if sharded:  # the padding that completes the last chunk: zeros by the contract
            facts["padding"] = data.numel() - real
            facts["padding_max_abs"] = mine[real:].abs().max().item() if data.numel() > real else 0.0
    return facts


def grad_facts(p: nn.Parameter, ref_grad: torch.Tensor, sharded: bool) -> dict:
    """A parameter's .grad after finish_gradient_sync, against the reference's averaged gradient."""
    g = p.grad
    facts = {"data_shape": list(p.data.shape), "data_dtype": str(p.data.dtype)}
    if g is None:
        return {**facts, "grad": None}
    facts.update(grad="present", shape=list(g.shape), dtype=str(g.dtype))
    facts.update({f"vs_{k}": v for k, v in shard_facts(g, ref_grad, sharded).items()})
    if "vs_max_abs_diff" in facts:
        expected = chunk_of(ref_grad, rank()) if sharded else ref_grad
        real = real_count(ref_grad.numel(), rank()) if sharded else ref_grad.numel()
        facts["bitwise_equal"] = torch.equal(g.reshape(-1)[:real], expected.reshape(-1)[:real])
        facts["reference_max_abs"] = ref_grad.abs().max().item()
    return facts


def local_grad_facts(g: torch.Tensor | None, local: torch.Tensor) -> dict:
    if g is None or g.shape != local.shape:
        return {"grad": None if g is None else list(g.shape)}
    return {"max_abs_diff_from_local": (g - local).abs().max().item(), "local_max_abs": local.abs().max().item()}


SCENARIOS: dict[str, Callable[[], dict]] = {
    "dist": dist_facts,
    "sharded optimizer": sharded_optimizer,
    "fsdp sgd, blocks and root": lambda: fsdp_run("blocks and root", "sgd", 3),
    "fsdp sgd, blocks only": lambda: fsdp_run("blocks only", "sgd", 3),
    "fsdp adamw, blocks and root": lambda: fsdp_run("blocks and root", "adamw", 3),
    "fsdp no_sync, blocks and root": lambda: fsdp_run("blocks and root", "sgd", 2, micro=2),
    "fsdp no_sync, blocks only": lambda: fsdp_run("blocks only", "sgd", 2, micro=2),
    "fsdp bfloat16": lambda: fsdp_run("blocks and root", "sgd", 3, param_dtype=torch.bfloat16),
    "fsdp float16": lambda: fsdp_run("blocks and root", "sgd", 3, param_dtype=torch.float16),
}


def both_ranks_finished(store: dist.Store, name: str) -> bool:
    """False when another rank has not finished `name` in 20 s: it is stuck in a collective."""
    store.set(f"{name}/{rank()}", "done")
    try:
        store.wait([f"{name}/{r}" for r in range(world())], timedelta(seconds=20))
    except RuntimeError:  # DistStoreError, a RuntimeError, on the timeout
        return False
    return True


def run_job(args: list[str], d: t.Dist) -> int:
    """Every scenario, one after another, on the ranks of tests/worker.py's launch (their default
    process group): each writes what it measured to OUT/rank<r>.json (args[0]) as soon as it ends."""
    out = Path(args[0])
    facts: dict[str, dict] = {}
    for name, scenario in SCENARIOS.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                facts[name] = scenario()
            except Exception:
                facts[name] = {"error": traceback.format_exc()}
        facts[name]["warnings"] = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]
        path = out / f"rank{rank()}.json"
        path.with_suffix(".tmp").write_text(json.dumps(facts, indent=1, default=str))
        path.with_suffix(".tmp").replace(path)
        if not both_ranks_finished(d.store, name):  # the job's own store, under a prefix of its own
            print(f"rank {rank()}: another rank never finished {name!r}; stopping", file=sys.stderr, flush=True)
            os._exit(1)
    return 0
