"""tests/worker.py's jobs, with the probes of test_parallelism.py: jobs that use the
script's tensor and pipeline parallelism from Python, or look inside a rank after a run.

tests/worker.py's launch runs each job of a call from here through this module's run_job. A job
whose first argument is "probe:NAME" runs PROBES[NAME] on the same ranks, with the rest of its
command line; any other job is a command line, run as tests/worker.py runs it. Every rank of
a probe prints one line "MEASURED <json>" of what it found (the test reads every rank's).

From a test: run_jobs(jobs, nproc, timeout), which is conftest.run_jobs with this module's run_job.
"""

from __future__ import annotations

import copy
import json
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import worker

import llm_ddp_parallel_training as t

PROBE = "probe:"
command_line = worker.run_job  # one command line, as main() runs it
STEPS, LR = 3, 0.5  # the float64 scenarios: SGD steps, plain and exact


def measured(facts: dict) -> None:
    print("MEASURED " + json.dumps(facts), flush=True)


def float64_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """token_loss_sum in the logits' own dtype: the script's casts them to float32, which would cap
    a float64 comparison at float32's rounding."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=t.IGNORE_INDEX, reduction="sum"
    )


def tiny_float64(n_layers: int = 2) -> t.TinyTransformer:
    torch.manual_seed(0)
    config = t.TinyConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=n_layers, dropout=0.0)
    return t.TinyTransformer(config).double()


def batches(step: int, count: int = 2, rows: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same micro-batches on every rank (a split model's ranks all see one replica's data)."""
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randint(64, (rows, 16), generator=g), torch.randint(64, (rows, 16), generator=g))
            for _ in range(count)]  # fmt: skip


def sgd_step(model: nn.Module, micro: list[tuple]) -> None:
    """The micro-batches accumulated, the mean over every token, one SGD step (of one process, or of a
    tensor-parallel model, whose slices every rank updates alike)."""
    tokens = sum(int((y != t.IGNORE_INDEX).sum()) for _, y in micro)
    for x, y in micro:
        (float64_loss(model(x), y) / tokens).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
            p.grad = None


def max_gap(d: t.Dist, named: dict[str, torch.Tensor], reference: nn.Module) -> float:
    ref = dict(reference.named_parameters())
    return max(float((v.double() - ref[n].detach()).abs().max()) for n, v in named.items())


def tensor_parallel_float64(args: list[str], d: t.Dist) -> int:
    """TensorParallel (torch's and from scratch) on the tiny model in float64, and the from-scratch
    ColumnParallelLinear / RowParallelLinear on a plain MLP of one's own: STEPS SGD steps each, the
    whole weights against one process's."""
    cfg = t.parse_args(["--cpu", "--tp", str(d.world_size), "--n-heads", "4", "--d-model", "32"])
    split_d = t.laid_out(d, cfg)
    facts: dict[str, object] = {}
    for kind in ("manual", "torch"):
        reference, model = tiny_float64(), tiny_float64()
        split = t.TensorParallel(model, split_d, manual=kind == "manual")
        for step in range(STEPS):
            micro = batches(step)
            sgd_step(reference, micro)
            sgd_step(model, micro)  # the same step on the split model: each rank updates its slices
        whole = {n: split.whole(n, p) for n, p in model.named_parameters()}
        facts[f"tiny {kind}"] = max_gap(d, whole, reference)
        facts[f"tiny {kind} keys"] = sorted(whole) == sorted(n for n, _ in reference.named_parameters())
    for bias in (False, True):  # "usable on any nn.Module": an MLP of one's own, with and without biases
        torch.manual_seed(1)
        mlp = nn.Sequential(nn.Linear(8, 12, bias=bias), nn.GELU(), nn.Linear(12, 8, bias=bias)).double()
        mine = copy.deepcopy(mlp)
        group = split_d.group("tp")
        mine[0], mine[2] = t.ColumnParallelLinear(mine[0], group), t.RowParallelLinear(mine[2], group)
        x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        out_ref, out = mlp(x), mine(x)
        out_ref.square().sum().backward()
        out.square().sum().backward()
        gathered = [torch.empty_like(mine[0].weight.grad) for _ in range(split_d.tp)]
        dist.all_gather(gathered, mine[0].weight.grad.contiguous(), group=group)
        facts[f"mlp bias={bias} output"] = float((out - out_ref).detach().abs().max())
        facts[f"mlp bias={bias} first grad"] = float((torch.cat(gathered) - mlp[0].weight.grad).abs().max())
    measured(facts)
    return 0


def pipeline_float64(args: list[str], d: t.Dist) -> int:
    """The script's Pipeline (torch.distributed.pipelining, and the from-scratch GPipe and 1F1B) on
    the tiny model in float64: STEPS SGD steps of 2 micro-batches each, against one process.

    Pipeline has no constructor for a model of one's own: it takes the run's ModelKit, RunConfig,
    Dist and CommStats, and its forward_backward a MicroStep. Built here by hand, the way train()
    builds them; the script's float32 token_loss_sum is swapped for its float64 twin meanwhile."""
    facts: dict[str, object] = {}
    kept_loss, kept_dtype = t.token_loss_sum, torch.get_default_dtype()
    t.token_loss_sum = float64_loss
    torch.set_default_dtype(torch.float64)  # the stages receive activations into torch.empty(...)
    try:
        for ddp in ("manual", "torch"):
            for schedule in ("gpipe", "1f1b"):
                name = f"{ddp} {schedule}"
                try:
                    cfg = t.parse_args(["--cpu", "--pp", str(d.world_size), "--n-layers", "2", "--seq-len", "16",
                                        "--d-model", "32", "--n-heads", "4", "--grad-accum-steps", "2",
                                        "--ddp", ddp, "--pp-schedule", schedule])  # fmt: skip
                    split_d = t.laid_out(d, cfg)
                    reference, model = tiny_float64(), tiny_float64()
                    kit = t.ModelKit(model=model, train=None, val=None, loss=lambda m, x, y: float64_loss(m(x), y),
                                     sample=None, save_final=None, final_name="", final_label="",
                                     flops_per_token=0.0, describe="")  # fmt: skip
                    stats = t.CommStats()
                    pipe = t.Pipeline(kit, cfg, split_d, stats)
                    hooks = t.Hooks()  # no side work
                    micro = t.MicroStep(kit, split_d.device, hooks.autocast, hooks.loss, hooks.mark)
                    for step in range(STEPS):
                        micro_batches = batches(step)
                        sgd_step(reference, micro_batches)
                        tokens = sum(int((y != t.IGNORE_INDEX).sum()) for _, y in micro_batches)
                        pipe.forward_backward(micro_batches, [1.0 / tokens] * len(micro_batches), micro)
                        with torch.no_grad():
                            for p in model.parameters():
                                p -= LR * p.grad
                                p.grad = None
                    facts[name] = max_gap(d, dict(model.named_parameters()), reference)
                    facts[f"{name} params"] = sorted(n for n, _ in model.named_parameters())
                except Exception:  # one scenario's failure is its result; the others still run
                    facts[name] = traceback.format_exc()
    finally:
        t.token_loss_sum = kept_loss
        torch.set_default_dtype(kept_dtype)
    measured(facts)
    return 0


def dropout_rule(args: list[str], d: t.Dist) -> int:
    """Megatron's rule, as own_dropout_stream keeps it: inside, each rank of the group its own mask;
    outside, before and after, the same mask on every rank."""
    cfg = t.parse_args(["--cpu", "--tp", str(d.world_size)])
    split_d = t.laid_out(d, cfg)
    torch.manual_seed(1234)
    before = F.dropout(torch.ones(4096), 0.5)
    with t.own_dropout_stream(split_d.tp_rank):
        inside = F.dropout(torch.ones(4096), 0.5)
    after = F.dropout(torch.ones(4096), 0.5)
    masks = [torch.empty(3, 4096) for _ in range(d.world_size)]
    dist.all_gather(masks, torch.stack([before, inside, after]))
    measured({
        "before equal": all(torch.equal(m[0], masks[0][0]) for m in masks),
        "inside equal": all(torch.equal(m[1], masks[0][1]) for m in masks[1:]),
        "after equal": all(torch.equal(m[2], masks[0][2]) for m in masks),
    })  # fmt: skip
    return 0


def tp_replicas(args: list[str], d: t.Dist) -> int:
    """The command line runs as in a real run; after train(), every rank reports a digest of each
    parameter's local tensor: what no rank holds a slice of must be the same on every rank."""
    train = t.train

    def train_then_report(cfg, d_, kit, hooks):  # train()'s signature
        result = train(cfg, d_, kit, hooks)
        digests = {n: t.local_part(p).detach().double().sum().item() for n, p in kit.model.named_parameters()}
        exact = {n: t.local_part(p).detach().flatten()[:64].tolist() for n, p in kit.model.named_parameters()}
        measured({"rank": d_.rank, "sums": digests, "first": exact})
        return result

    t.train = train_then_report
    try:
        return command_line(args, d)
    finally:
        t.train = train


def ddp_on_a_sub_group(args: list[str], d: t.Dist) -> int:
    """TorchDDP built on a 2-rank sub-group of the 4 ranks, its buckets through the script's counting hook (plain
    and bf16): each rank's gradient must be its own pair's average. Reports the largest gap to that average, and
    to every rank's, per hook."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group, in the same order
    facts = {}
    for compress in (False, True):
        torch.manual_seed(0)
        model, alone = nn.Linear(8, 4), nn.Linear(8, 4)
        alone.load_state_dict(model.state_dict())
        ddp = t.TorchDDP(model, process_group=pairs[d.rank // 2])
        ddp.register_comm_hook((ddp.process_group, t.CommStats(compress)), t.allreduce_hook)
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(10 + d.rank))
        ddp(x).square().sum().backward()
        alone(x).square().sum().backward()
        local = [torch.empty_like(alone.weight.grad) for _ in range(d.world_size)]
        dist.all_gather(local, alone.weight.grad)
        mine = torch.stack(local[d.rank // 2 * 2 :][:2])
        gap, every = (model.weight.grad - mine.mean(0)).abs(), (model.weight.grad - torch.stack(local).mean(0)).abs()
        facts["bf16" if compress else "plain"] = {
            "to the pair's": gap.max().item(),
            "to every rank's": every.max().item(),
            "relative to the pair's sizes": (gap / mine.abs().sum(0)).max().item(),
        }
    measured(facts)
    return 0


PROBES: dict[str, Callable[[list[str], t.Dist], int]] = {
    "ddp sub-group": ddp_on_a_sub_group,
    "tp float64": tensor_parallel_float64,
    "pp float64": pipeline_float64,
    "dropout rule": dropout_rule,
    "tp replicas": tp_replicas,
}


def run_job(args: list[str], d: t.Dist) -> int:
    if args and args[0].startswith(PROBE):
        return PROBES[args[0].removeprefix(PROBE)](args[1:], d)
    return command_line(args, d)


def probe_facts(run) -> list[dict]:
    """Every rank's MEASURED line of a probe's Run, in rank order."""
    return [json.loads(line.split(" ", 1)[1]) for line in run.stdout.splitlines() if line.startswith("MEASURED ")]


def run_jobs(jobs: dict[str, list[str]], nproc: int | None = None, timeout: float = 240) -> dict:
    """conftest.run_jobs, through this module's run_job: a job may be ["probe:NAME", *args]. {name: Run}."""
    import conftest

    return conftest.run_jobs(jobs, nproc, timeout, worker=Path(__file__))
