"""tests/worker.py's jobs, with the probes of test_context_parallel.py: ring attention through the
script's Python API (ContextParallel, RingAttention) on ranks of a shared launch. Every rank of a probe
prints one line "MEASURED <json>" (parallelism_worker.probe_facts reads them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import parallelism_worker
import torch
import torch.distributed as dist
import torch.nn.functional as F

import llm_ddp_parallel_training as t

C = 3  # positions a chunk: each rank holds 2 chunks, the sequence 2N of them


def qkv(n: int, seed: int = 1) -> list[torch.Tensor]:
    """q, k, v and an output gradient, (batch 2, heads 2, 2N chunks, head dim 4), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, 2 * n * C, 4, generator=g, dtype=torch.float64) for _ in range(4)]


def rings(world: int, sizes: list[int]) -> list[tuple[int, t.ContextParallel | None]]:
    """A ring of each size over the first ranks (ranks beyond it idle: a group of 3 on 4 ranks). Each
    ring's group is made by every rank, as dist.new_group asks."""
    made = []
    for n in sizes:
        groups = [dist.new_group(list(range(i, i + n))) for i in range(0, world - n + 1, n)]
        mine = dist.get_rank() // n
        made.append((n, t.ContextParallel(groups[mine]) if mine < len(groups) else None))
    return made


def ring_gaps(n: int, ring: t.ContextParallel) -> dict[str, float]:
    """This rank's chunks of causal attention and of dQ, dK, dV against one process's, max |difference|."""
    q, k, v, dout = qkv(n)
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=True)
    expected.backward(dout)
    at = ring.own_part((torch.zeros(1, 2 * n * C), torch.zeros(1, 2 * n * C)))[2][0]
    mine = [x[..., at, :].clone().requires_grad_() for x in (q, k, v)]
    out = t.RingAttention.apply(*mine, 0.0, ring)
    out.backward(dout[..., at, :])
    gaps = {"output": (out - expected[..., at, :]).abs().max()}
    gaps |= {
        f"d{name}": (a.grad - b.grad[..., at, :]).abs().max() for name, a, b in zip("qkv", mine, whole, strict=True)
    }
    return {name: float(gap) for name, gap in gaps.items()} | {"chunks": list(ring.chunks(ring.rank))}


def dropout_slope(n: int, ring: t.ContextParallel, p: float = 0.3, eps: float = 1e-6) -> dict[str, float]:
    """With attention dropout, backward must differentiate what forward computed (the same masks drawn
    again): the gradient's slope along a random direction against a central difference of the loss
    sum(out * w) over every rank, each forward drawing its masks from the same seed."""
    q, k, v, w = (x[..., : 2 * C, :] for x in qkv(n, seed=2 + ring.rank))  # this rank's own tokens
    g = torch.Generator().manual_seed(7 + ring.rank)
    direction = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in (q, k, v)]

    def loss(x: list[torch.Tensor]) -> torch.Tensor:
        torch.manual_seed(11)
        return (t.RingAttention.apply(*x, p, ring) * w).sum()

    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    loss(inputs).backward()
    slope = torch.stack([sum((x.grad * u).sum() for x, u in zip(inputs, direction, strict=True)).detach()])
    ends = torch.stack([loss([x + s * eps * u for x, u in zip((q, k, v), direction, strict=True)]) for s in (1, -1)])
    with torch.no_grad():
        no_drop = (t.RingAttention.apply(q, k, v, 0.0, ring) * w).sum()
    sums = torch.cat([slope, ends.detach(), no_drop.reshape(1)])
    dist.all_reduce(sums, group=ring.group)
    difference = (sums[1] - sums[2]) / (2 * eps)
    return {"slope": float(sums[0]), "difference": float(difference), "without dropout": float(sums[3]),
            "with dropout": float(sums[1] + sums[2]) / 2}  # fmt: skip


def ring_float64(args: list[str], d: t.Dist) -> int:
    """Ring attention over rings of 1 .. world ranks (2 ranks: 1, 2; 4 ranks: 3, 4) against one process, and
    the dropout slope over the whole world."""
    sizes = [1, 2] if d.world_size == 2 else [3, 4]
    facts: dict[str, object] = {}
    for n, ring in rings(d.world_size, sizes):
        if ring is not None:
            facts[f"ring {n}"] = ring_gaps(n, ring)
    ring = rings(d.world_size, [d.world_size])[0][1]
    facts["dropout"] = dropout_slope(d.world_size, ring)
    parallelism_worker.measured(facts)
    return 0


PROBES: dict[str, Callable[[list[str], t.Dist], int]] = {"ring float64": ring_float64}


def run_job(args: list[str], d: t.Dist) -> int:
    if args and args[0].startswith(parallelism_worker.PROBE):
        return PROBES[args[0].removeprefix(parallelism_worker.PROBE)](args[1:], d)
    return parallelism_worker.command_line(args, d)


def run_jobs(jobs: dict[str, list[str]], nproc: int | None = None, timeout: float = 240) -> dict:
    import conftest

    return conftest.run_jobs(jobs, nproc, timeout, worker=Path(__file__))
