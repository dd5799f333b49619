"""Two hosts on this one machine: two Linux network namespaces joined by a veth pair, each end with a private
address that exists only inside them (../shared/research/multi-host.md, measured there). A torchrun started in
each, as on two machines: `--nnodes 2 --node-rank R --rdzv-backend c10d --rdzv-endpoint HOST_A:PORT`, with
`--local-addr` on each and `--rdzv-conf is_host=1` on host A, because inside a namespace the hostname resolves to
127.0.0.1, an address on no interface the hosts share. Needs root and `ip`: `missing()` says which is absent, for
a test to skip with the reason. Every process started is killed and both namespaces are removed at the end,
also on failure."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from conftest import SCRIPT, child_env

COUNTER = itertools.count()
PORT = 29400  # the rendezvous port on host A's address: that address exists in these namespaces alone


def missing() -> str | None:
    """Why two hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2)"
    return None


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass(frozen=True)
class Host:
    namespace: str
    link: str  # its end of the veth pair: the interface its ranks talk through
    address: str


class TwoHosts:
    """Host A (node 0, the rendezvous) and host B, on a fresh /24 each time; names unique to this process."""

    def __init__(self) -> None:
        n = next(COUNTER)
        tag = f"{os.getpid() % 100000}x{n}"
        subnet = f"10.{os.getpid() % 200 + 20}.{n % 250}"
        self.hosts = [Host(f"ddp{tag}{s}", f"v{tag}{s}", f"{subnet}.{i + 1}") for i, s in enumerate("ab")]
        self.started: list[subprocess.Popen] = []

    def __enter__(self) -> TwoHosts:
        a, b = self.hosts
        try:
            for h in self.hosts:
                ip("netns", "add", h.namespace)
                ip("-n", h.namespace, "link", "set", "lo", "up")
            ip("link", "add", a.link, "type", "veth", "peer", "name", b.link)
            for h in self.hosts:
                ip("link", "set", h.link, "netns", h.namespace)
                ip("-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", h.link)
                ip("-n", h.namespace, "link", "set", h.link, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)  # (its output is finish()'s to read)
        for node, h in enumerate(self.hosts):
            self.kill(node)  # anything a test left there
            subprocess.run(["ip", "netns", "del", h.namespace], capture_output=True)  # its end of the pair with it

    def kill(self, node: int) -> None:
        """Every process on host `node`: the host lost, as a machine that dies takes its ranks and its agent."""
        for pid in subprocess.run(["ip", "netns", "pids", self.hosts[node].namespace], capture_output=True,
                                  text=True).stdout.split():  # fmt: skip
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)

    def torchrun(self, node: int, nproc: int, args: list[str], env: dict[str, str] | None = None,
                 launcher: list[str] | None = None, max_restarts: int = 0) -> subprocess.Popen:  # fmt: skip
        """Start torchrun on host `node` (0: A, the rendezvous) with nproc ranks of the script; its output piped."""
        host, rdzv = self.hosts[node], self.hosts[0]
        if launcher is None:
            launcher = ["--local-addr", host.address, *(["--rdzv-conf", "is_host=1"] if node == 0 else [])]
        launcher = [*launcher, "--max-restarts", str(max_restarts)]
        cmd = ["ip", "netns", "exec", host.namespace, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--node-rank", str(node), f"--nproc-per-node={nproc}", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"{rdzv.address}:{PORT}", "--rdzv-id", "two-hosts", *launcher, str(SCRIPT), *args]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=child_env({"GLOO_SOCKET_IFNAME": host.link, **(env or {})}),
                                start_new_session=True)  # fmt: skip
        self.started.append(proc)
        return proc


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Each process's exit code and output, all of them waited for within `timeout` seconds in all; one still
    running then is killed with its process group (its code: -9)."""
    deadline, results = time.monotonic() + timeout, []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        results.append((proc.returncode, out))
    return results
