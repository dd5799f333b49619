"""What a slow network costs DDP, measured: two hosts joined by a rate-shaped link, against the arithmetic.

    sudo python benchmarks/slow_link.py            # 3 links x 6 configurations: 9 minutes on an idle 2-core VM
    sudo python benchmarks/slow_link.py --smoke    # the same plan at toy sizes, 3 steps a run: checks the harness

Needs root and `ip` / `tc` (iproute2): the two hosts are Linux network namespaces joined by a veth pair
(tests/two_hosts.py), one torchrun in each, one rank per host (world size 2: on a 2-core machine a third
process would measure CPU contention, not the link). The link is each host's end of the pair, shaped with a
token bucket on both ends (`tc qdisc replace dev VETH root tbf rate RATE burst 256kb latency 100ms`, so both
directions carry RATE at most): unshaped, 1 Gbit/s, 100 Mbit/s. (netem, for latency and loss, does not exist
on every kernel; tbf does: ../shared/research/multi-host.md.) Each link's real rate is measured too, one TCP
stream from host B to host A.

Every run trains the benchmark model (benchmarks/benchmark.py's TINY_MODEL: d 512, 8 heads, 1 layer, sequence
128, batch 16 per rank, 3.47 M parameters, 13.9 MB of fp32 gradient) with fp32 AdamW, every step logged to
--metrics-file; a step's time is rank 0's, from its record (benchmarks/memory.py's step_seconds), and a run's
step time is the median of the steps after the first WARMUP (connections, allocator, the trace). The
configurations, each run on the three links back to back (its three rows ran side by side in time):

    default         torch DDP, 25 MiB buckets: this model's 13.3 MiB of gradient is one bucket
    bucket 1 MiB    --bucket-mb 1: 5 buckets here (a bucket holds whole tensors, and each MLP weight is 4 MiB),
                    the first ones all-reduced while backward computes the rest
    bucket 100 MiB  --bucket-mb 100: one big bucket, as the default is on this model; the two rows differ by
                    run-to-run noise alone, which is what they are here to show
    bf16            --grad-compression bf16: half the bytes on the wire
    accum 4         --grad-accum-steps 4: four micro-batches of 16 per step, one all-reduce per step
    fsdp            --sharding full: weights all-gathered in forward and again in backward, gradients
                    reduce-scattered

The prediction (docs/scaling.md): a ring all-reduce of G bytes over N hosts moves 2(N-1)/N x G through each
host's link, so at rate R it takes at least 2(N-1)/N x G / R; here N = 2 and G = parameters x 4 bytes (fp32
gradients). bf16 halves G; FSDP moves about 1.5x DDP's volume (ZeRO's count); accumulation keeps one
all-reduce per step, so per example it divides the cost by the micro-steps. On the shaped links R is the
nominal rate; unshaped, the TCP rate measured here. "Extra" is a shaped run's step time minus the unshaped
run's of the same configuration: what the link cost, to set beside the predicted transfer time. Beside the
ring's counts, what Gloo really sends: one all-reduce, reduce-scatter and all-gather of G between the hosts,
the bytes counted by the kernel on host A's end of the pair, and a second prediction from those bytes (it
differs for FSDP: Gloo's reduce-scatter sends the whole G, as an all-reduce does).

One run is traced (`--trace-steps 3 --plot`, bucket 1 MiB at 100 Mbit/s, the traced steps inside its warm-up):
its timeline.png shows the all-reduce stretching past backward; the full run copies it to
docs/timeline-slow-link.png.

Writes benchmarks/slow_link_results.md (--smoke: only into --out, or only prints, so that a check never
replaces the measured numbers). The runs write into a temp folder, removed at the end, also when a run fails
or the benchmark is stopped (the namespaces are removed in every case); --out DIR keeps them in DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))
from benchmark import SMOKE_MODEL, TINY_MODEL, in_output_folder, output_flags, publish, tiny_model  # noqa: E402
from memory import machine, step_seconds  # noqa: E402
from two_hosts import Host, TwoHosts, finish, missing  # noqa: E402

TABLE = REPO / "benchmarks" / "slow_link_results.md"
TIMELINE = REPO / "docs" / "timeline-slow-link.png"
TIMELINE_MAX_BYTES = 150_000  # a bigger picture stays out of the repository: the results say where it was

STEPS, WARMUP = 12, 3  # the first steps warm connections and the allocator, and hold the trace: not counted
SMOKE_STEPS, SMOKE_WARMUP = 3, 1
TRACED_STEPS = 3
# Every run: fp32 AdamW on the CPU, no held-out lines (no evaluation inside the timed loop), every step logged
# (the step times), a one-token sample, the corpus tokenized in memory (no cache shared between runs).
COMMON = ["--cpu", "--optimizer", "adamw", "--precision", "fp32", "--val-fraction", "0", "--log-every", "1",
          "--sample-tokens", "1", "--cache-dir", "none"]  # fmt: skip
HOSTS = 2  # one rank on each: the ring's N
RUN_TIMEOUT = 300  # seconds for one run, both hosts: a hung rendezvous ends the benchmark, not the machine
TCP_PORT = 29500  # the link's rate test, on host A's address (the rendezvous has 29400)
WIRE_PORT = 29600  # the bytes-on-the-wire check's process group


@dataclass(frozen=True)
class Link:
    name: str
    rate: str | None  # tc's rate; None: the veth pair as it is
    bytes_per_s: float | None  # nominal, for the arithmetic; None: the measured TCP rate stands in


LINKS = (
    Link("unshaped", None, None),
    Link("1 Gbit/s", "1gbit", 1e9 / 8),
    Link("100 Mbit/s", "100mbit", 1e8 / 8),
)


@dataclass(frozen=True)
class Config:
    name: str
    flags: tuple[str, ...]
    volume: float = 1.0  # bytes on the wire per step, as a multiple of DDP's fp32 all-reduce
    micro_steps: int = 1  # micro-batches of --batch-size per optimizer step


CONFIGS = (
    Config("default (25 MiB buckets)", ()),
    Config("--bucket-mb 1", ("--bucket-mb", "1")),
    Config("--bucket-mb 100 (one bucket)", ("--bucket-mb", "100")),
    Config("--grad-compression bf16", ("--grad-compression", "bf16"), volume=0.5),
    Config("--grad-accum-steps 4", ("--grad-accum-steps", "4"), micro_steps=4),
    Config("--sharding full (FSDP)", ("--sharding", "full"), volume=1.5),
)
TRACED = ("--bucket-mb 1", "100 Mbit/s")  # the run whose first steps make the timeline


def load() -> str:
    """The load average over 1, 5 and 15 minutes: on a shared machine, how much else was running."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def tc(host: Host, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", host.namespace, "tc", "qdisc", *args], capture_output=True,
                          text=True, timeout=30)  # fmt: skip


def shape(hosts: TwoHosts, link: Link) -> None:
    """Both ends of the pair at the link's rate (each end shapes what its host sends), or unshaped. A 256 KB
    bucket: with 64 KB one TCP stream got 115 MB/s through 1 Gbit/s here, with 256 KB 120 MB/s, the payload's
    share of the line rate (at 100 Mbit/s both gave 12 MB/s)."""
    for host in hosts.hosts:
        if link.rate is None:
            tc(host, "del", "dev", host.link, "root")  # fails when there is nothing to remove: fine
            continue
        done = tc(host, "replace", "dev", host.link, "root", "tbf", "rate", link.rate, "burst", "256kb", "latency",
                  "100ms")  # fmt: skip
        if done.returncode:
            raise SystemExit(f"tc could not shape {host.link} in {host.namespace}: {done.stderr.strip()}")


# The rate test's two ends, each started in its namespace as `python -c`: a few lines, not this module (whose
# imports, torch among them, take seconds). The receiver times from the first byte to the last, leaving out
# the connection's set-up, and prints bytes and seconds.
RECEIVER = """
import json, socket, sys, time
with socket.create_server(("0.0.0.0", int(sys.argv[1]))) as server:
    print("listening", flush=True)
    conn, _ = server.accept()
    buffer = bytearray(1 << 20)
    got = conn.recv_into(buffer)
    start = time.perf_counter()
    while n := conn.recv_into(buffer):
        got += n
    print(json.dumps({"bytes": got, "seconds": time.perf_counter() - start}), flush=True)
"""
SENDER = """
import socket, sys
chunk = bytes(1 << 20)
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60) as conn:
    for _ in range(int(sys.argv[3]) >> 20):
        conn.sendall(chunk)
"""


def tcp_rate(hosts: TwoHosts, link: Link) -> float:
    """Bytes per second of one TCP stream from host B to host A, about a second's worth of the link's rate."""
    a, b = hosts.hosts
    total = int(link.bytes_per_s) if link.bytes_per_s else 400 << 20
    receiver = subprocess.Popen(["ip", "netns", "exec", a.namespace, sys.executable, "-c", RECEIVER, str(TCP_PORT)],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert receiver.stdout is not None
        receiver.stdout.readline()  # "listening": the sender may connect now
        subprocess.run(["ip", "netns", "exec", b.namespace, sys.executable, "-c", SENDER, a.address, str(TCP_PORT),
                        str(total)], check=True, timeout=120)  # fmt: skip
        result = json.loads(receiver.communicate(timeout=60)[0])
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    return result["bytes"] / result["seconds"]


# What each collective the configurations use puts on the wire, counted by the kernel: the bytes host A's end of
# the pair sent (/sys/class/net/LINK/statistics/tx_bytes, headers included) during one collective of the
# gradient's size between the two hosts, one process each. The arithmetic assumes the ring's counts; this says
# what Gloo does.
WIRE = """
import json, sys, warnings, torch, torch.distributed as dist
warnings.filterwarnings("ignore")  # reduce_scatter_tensor's and all_gather_into_tensor's deprecation notices
rank, address, port, link, n = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=2)
sent = lambda: int(open(f"/sys/class/net/{link}/statistics/tx_bytes").read())
collectives = {
    "all-reduce, fp32": lambda: dist.all_reduce(torch.ones(n)),
    "all-reduce, bf16": lambda: dist.all_reduce(torch.ones(n, dtype=torch.bfloat16)),
    "reduce-scatter, fp32": lambda: dist.reduce_scatter_tensor(torch.empty(n // 2), torch.ones(n // 2 * 2)),
    "all-gather, fp32": lambda: dist.all_gather_into_tensor(torch.empty(n // 2 * 2), torch.ones(n // 2)),
}
counted = {}
for name, collective in collectives.items():
    dist.barrier()
    before = sent()
    collective()
    dist.barrier()  # its bytes are all out: the barrier's own few hundred are counted too
    counted[name] = sent() - before
if rank == 0:
    print(json.dumps(counted), flush=True)
dist.destroy_process_group()
"""
# The ring's count for each, per host, as a multiple of G: what docs/scaling.md's arithmetic assumes.
RING = {"all-reduce, fp32": 1.0, "all-reduce, bf16": 0.5, "reduce-scatter, fp32": 0.5, "all-gather, fp32": 0.5}


def wire_bytes(hosts: TwoHosts, parameters: int) -> dict[str, int]:
    """Bytes host A sent in each collective of `parameters` elements (the WIRE program, on the link as it is)."""
    procs = [subprocess.Popen(["ip", "netns", "exec", h.namespace, sys.executable, "-c", WIRE, str(rank),
                               hosts.hosts[0].address, str(WIRE_PORT), h.link, str(parameters)],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "GLOO_SOCKET_IFNAME": h.link,
                              "OMP_NUM_THREADS": "1"}) for rank, h in enumerate(hosts.hosts)]  # fmt: skip
    (code_a, out_a), (code_b, out_b) = finish(procs, 120)
    if code_a or code_b:
        raise SystemExit(f"the bytes-on-the-wire check failed ({code_a}, {code_b}):\n{out_a}\n{out_b}")
    return json.loads(out_a)


def wire_ms(config: Config, wire: dict[str, int], block_share: float, bytes_per_s: float) -> float:
    """The same from the bytes Gloo was seen to send: FSDP gathers each block's weights in forward and again in
    backward, the root unit's (embeddings, head: the rest) once, as fully_shard keeps the root gathered between
    forward and backward; then it reduce-scatters every gradient."""
    if "--sharding" in config.flags:
        gathered = 2 * block_share + (1 - block_share)
        sent = gathered * wire["all-gather, fp32"] + wire["reduce-scatter, fp32"]
    else:
        sent = wire["all-reduce, bf16" if "--grad-compression" in config.flags else "all-reduce, fp32"]
    return 1000 * sent / bytes_per_s


def predicted_ms(config: Config, gradient_bytes: int, bytes_per_s: float) -> float:
    """docs/scaling.md's bandwidth term: 2(N-1)/N x G per host, times the configuration's volume."""
    return 1000 * config.volume * 2 * (HOSTS - 1) / HOSTS * gradient_bytes / bytes_per_s


def command(config: Config, link: Link, folder: Path, smoke: bool) -> list[str]:
    args = [*COMMON, *(SMOKE_MODEL if smoke else TINY_MODEL), *config.flags, "--max-steps",
            str(SMOKE_STEPS if smoke else STEPS), "--output-dir", str(folder), "--metrics-file",
            str(folder / "metrics.jsonl")]  # fmt: skip
    if (config.name, link.name) == TRACED:
        args += ["--trace-steps", str(TRACED_STEPS), "--plot"]
    return args


def measure_run(hosts: TwoHosts, config: Config, link: Link, out: Path, smoke: bool) -> dict:
    folder = out / f"{CONFIGS.index(config)}-{LINKS.index(link)}"
    args = command(config, link, folder, smoke)
    load_before, start = load(), time.perf_counter()
    (code_a, out_a), (code_b, out_b) = finish([hosts.torchrun(node, 1, args) for node in range(HOSTS)], RUN_TIMEOUT)
    if code_a or code_b:
        raise SystemExit(f"benchmark run failed ({code_a}, {code_b}): {shlex.join(args)}\n{out_a}\n{out_b}")
    seconds = step_seconds(folder / "metrics.jsonl")
    warmup = SMOKE_WARMUP if smoke else WARMUP
    hidden = [line.strip() for line in out_a.splitlines() if "hidden behind backward" in line]
    collectives = [line.split("collectives", 1)[1].strip() for line in out_a.splitlines()
                   if line.startswith("  collectives ")]  # fmt: skip
    return {
        "config": config.name,
        "link": link.name,
        "args": args,
        "step_ms": 1000 * statistics.median(seconds[warmup:]),
        "steps_ms": [round(1000 * s, 1) for s in seconds],
        "warmup": warmup,
        "load_before": load_before,
        "wall_s": time.perf_counter() - start,
        "hidden": hidden[0] if hidden else None,
        "collectives": collectives[0] if collectives else None,
        "timeline": str(folder / "timeline.png") if (folder / "timeline.png").exists() else None,
    }


def measure(out: Path, smoke: bool) -> dict:
    """Every configuration on every link, one pair of namespaces throughout, the shaping changed between runs."""
    _, model = tiny_model(SMOKE_MODEL if smoke else TINY_MODEL)
    parameters = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for block in model.blocks for p in block.parameters())  # FSDP's inner units
    got: dict = {"parameters": parameters, "gradient_bytes": 4 * parameters, "load_start": load(), "runs": []}
    got["block_share"] = blocks / parameters
    got["started"] = time.strftime("%Y-%m-%d %H:%M:%S")
    with TwoHosts() as hosts:
        shape(hosts, LINKS[0])
        got["wire_bytes"] = wire_bytes(hosts, parameters)
        print(f"[wire] bytes host A sent per collective of G: {got['wire_bytes']}", flush=True)
        got["tcp_bytes_per_s"] = {}
        for link in LINKS:
            shape(hosts, link)
            got["tcp_bytes_per_s"][link.name] = tcp_rate(hosts, link)
            print(f"[link] {link.name}: one TCP stream B -> A, {got['tcp_bytes_per_s'][link.name] / 1e6:.1f} MB/s",
                  flush=True)  # fmt: skip
        for config in CONFIGS:
            for link in LINKS:
                shape(hosts, link)
                run = measure_run(hosts, config, link, out, smoke)
                got["runs"].append(run)
                print(f"[run] {config.name:30} {link.name:11} {run['step_ms']:8.0f} ms/step  (load before: "
                      f"{run['load_before']}, {run['wall_s']:.0f} s)", flush=True)  # fmt: skip
    got["load_end"] = load()
    (out / "results.json").write_text(json.dumps(got, indent=1))
    return got


def report(got: dict, smoke: bool) -> str:
    gradient = got["gradient_bytes"]
    runs = {(r["config"], r["link"]): r for r in got["runs"]}
    tcp = got["tcp_bytes_per_s"]
    model = SMOKE_MODEL if smoke else TINY_MODEL
    batch = HOSTS * int(model[model.index("--batch-size") + 1])  # one micro-step's examples, both hosts
    lines = [
        "# A slow link, measured: DDP's step time on a shaped link against the arithmetic",
        "",
        "What the numbers say, and what buys the time back: "
        "[docs/scaling.md](../docs/scaling.md#a-slow-link-measured).",
        "",
        "Written by `sudo python benchmarks/slow_link.py`"
        + (" --smoke (toy sizes: the numbers mean nothing)" if smoke else "")
        + f", started {got['started']}.",
        "",
        f"Machine: {machine()}. Two hosts on this one machine: two network namespaces joined by a veth pair, "
        "one torchrun in each, one rank per host (world size 2), one thread per rank, Gloo over the veth pair. "
        f"Load average (1, 5, 15 min) at the start: {got['load_start']}; at the end: {got['load_end']}; before "
        "each run: in the runs' list below.",
        "",
        f"The model: `{' '.join(SMOKE_MODEL if smoke else TINY_MODEL)}`, {got['parameters']:,} parameters: "
        f"G = {gradient / 1e6:.1f} MB of fp32 gradient. fp32 AdamW; `{' '.join(COMMON)}`.",
        "",
        "The links, both ends shaped by `tc ... tbf rate RATE burst 256kb latency 100ms`; the rate one TCP stream "
        "from host B to host A measured on each:",
        "",
        "| link | nominal | one TCP stream, measured |",
        "|---|--:|--:|",
    ]
    for link in LINKS:
        nominal = f"{link.bytes_per_s / 1e6:.1f} MB/s" if link.bytes_per_s else "-"
        lines.append(f"| {link.name} | {nominal} | {tcp[link.name] / 1e6:.1f} MB/s |")
    lines += [
        "",
        "What one collective of the gradient's size put on the wire between the two hosts (host A's end of the "
        "pair, the kernel's count, headers included), beside the ring's count that the arithmetic assumes:",
        "",
        "| collective of G | host A sent | the ring's count, 2 hosts |",
        "|---|--:|--:|",
    ]
    for name, sent in got["wire_bytes"].items():
        lines.append(f"| {name} | {sent / 1e6:.2f} MB | {RING[name] * gradient / 1e6:.2f} MB |")
    lines += [
        "",
        f"*measured*: rank 0's step time, the median of steps {got['runs'][0]['warmup'] + 1}-"
        f"{len(got['runs'][0]['steps_ms'])} of one run. *predicted comm*: the bandwidth term of docs/scaling.md, "
        "2(N-1)/N x G x volume / rate, N = 2 hosts, at the nominal rate (unshaped: the TCP rate measured above); "
        "volume 1 for DDP, 0.5 with bf16, 1.5 for FSDP. *extra*: measured minus the unshaped run of the same "
        "configuration, what the link cost; *extra / predicted*: against the predicted comm minus the unshaped "
        "prediction (1.0: the step grew by exactly the transfer time; below 1: part of it hid behind backward). "
        "*from the wire*: the same transfer time from the bytes Gloo sent above (FSDP: each block's weights "
        f"gathered twice, the root unit's once, {got['block_share']:.1%} of the weights in blocks). "
        f"*extra per {batch} examples*: the extra divided by the micro-steps (a step of `--grad-accum-steps 4` "
        f"trains 4 x {batch} examples, the others {batch}).",
        "",
        "| link | configuration | measured ms/step | predicted comm ms/step | from the wire, ms | unshaped ms/step "
        f"| extra ms/step | extra / predicted | extra per {batch} examples, ms |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for link in LINKS:
        for config in CONFIGS:
            run, base = runs[(config.name, link.name)], runs[(config.name, LINKS[0].name)]
            rate = link.bytes_per_s or tcp[link.name]
            predicted = predicted_ms(config, gradient, rate)
            wire = wire_ms(config, got["wire_bytes"], got["block_share"], rate)
            if link.bytes_per_s is None:
                lines.append(f"| {link.name} | {config.name} | {run['step_ms']:.0f} | {predicted:.1f} | {wire:.1f} | "
                             f"{base['step_ms']:.0f} | - | - | - |")  # fmt: skip
                continue
            extra = run["step_ms"] - base["step_ms"]
            over = extra / (predicted - predicted_ms(config, gradient, tcp[LINKS[0].name]))
            lines.append(
                f"| {link.name} | {config.name} | {run['step_ms']:.0f} | {predicted:.0f} | {wire:.0f} | "
                f"{base['step_ms']:.0f} | {extra:+.0f} | {over:.2f} | {extra / config.micro_steps:+.0f} |"
            )
    traced = next((r for r in got["runs"] if (r["config"], r["link"]) == TRACED), None)
    lines += ["", "## The traced run", ""]
    if traced:
        lines.append(f"`{TRACED[0]}` at {TRACED[1]}, its first {TRACED_STEPS} steps traced (inside the warm-up "
                     f"its step time leaves out). The script's summary: `{traced['hidden']}`.")  # fmt: skip
    lines += ["", "## The runs", "", "Each run: the step times of rank 0 in ms, every step (the first ones are the "
              "warm-up), the load average before it, the script's collectives row.", ""]  # fmt: skip
    for r in got["runs"]:
        lines.append(f"- {r['link']}, {r['config']}: {r['steps_ms']}; load {r['load_before']}; {r['collectives']}")
    lines += ["", "## Commands", "", "On each host, in its namespace, with `GLOO_SOCKET_IFNAME` its end of the pair "
              "(tests/two_hosts.py): `python -m torch.distributed.run --nnodes 2 --node-rank R --nproc-per-node=1 "
              "--rdzv-backend c10d --rdzv-endpoint HOST_A:29400 --rdzv-id two-hosts --local-addr THIS_HOST "
              "[--rdzv-conf is_host=1 on host A] llm_ddp_parallel_training.py ARGS`, ARGS:", "", "```"]  # fmt: skip
    lines += [shlex.join(r["args"]).replace(str(REPO) + "/", "") for r in got["runs"]]
    lines += ["```", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="the plan at toy sizes, 3 steps a run: checks the harness")
    output_flags(p, "; with --smoke the table goes here too")
    args = p.parse_args()
    if why := missing() or (None if shutil.which("tc") else "needs the `tc` command (iproute2)"):
        raise SystemExit(f"benchmarks/slow_link.py {why}")

    def work(out: Path, removed: bool) -> None:
        got = measure(out, args.smoke)
        publish(report(got, args.smoke), (out / TABLE.name if args.out else None) if args.smoke else TABLE)
        traced = next((r["timeline"] for r in got["runs"] if r["timeline"]), None)
        if traced and not args.smoke:
            if os.path.getsize(traced) <= TIMELINE_MAX_BYTES:
                shutil.copyfile(traced, TIMELINE)
                print(f"written: {TIMELINE}")
            else:
                print(f"the timeline is {os.path.getsize(traced):,} bytes: not copied to {TIMELINE}")

    in_output_folder(args.out, args.keep_outputs, "slow-link-benchmark-", work, lambda: None)


if __name__ == "__main__":
    main()
