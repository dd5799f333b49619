"""Past one machine, for real: two hosts made of network namespaces joined by a veth pair (tests/two_hosts.py),
torchrun on each meeting through c10d rendezvous at host A's private address. Two hosts of two ranks train the
weights four ranks train on one host, bit for bit, and the run header says which ranks are on which node and
which interface and address their sockets use; a rank that cannot reach the address it was told to meet at says
so in one line within seconds, not after --timeout-s; a wrong interface name is refused before the rendezvous.
A host lost (every process killed, or its link down) is named by the other host's ranks, which end; the same
commands started again resume bitwise, and under torchrun's --max-restarts a host started again rejoins."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import pytest
from conftest import TINY, assert_bitwise_equal, run_jobs, weights
from two_hosts import TwoHosts, finish, ip, missing

import llm_ddp_parallel_training as t

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

FLAGS = [*TINY, "--max-steps", "40", "--save-every", "10", "--dropout", "0.1", "--cache-dir", "none"]
TIMEOUT_S = 20  # the unreachable run's --timeout-s: longer than host B's 10 s of trying, as 300 s by default is


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The two-host scenarios at once, each on its own pair of namespaces, beside the same runs on one host; one
    rank per host where the scenario is a failure that one rank shows as well as two (every process started
    costs seconds of CPU, on a machine the rest of the suite shares): those that resume end bitwise equal to two
    ranks on one host, as two hosts of two ranks do to four ranks on one."""
    root = tmp_path_factory.mktemp("hosts")
    with TwoHosts() as good, TwoHosts() as lost, TwoHosts() as killed, TwoHosts() as severed, TwoHosts() as back:
        started, results = time.monotonic(), {}
        again = [*FLAGS, "--output-dir", str(root / "host-lost")]
        cut = [killed.torchrun(node, 1, again) for node in (0, 1)]
        rejoin = [*FLAGS, "--output-dir", str(root / "rejoined")]
        own = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # else host B's new agent waits (the [nodes] warning)
        elastic = [back.torchrun(node, 1, rejoin, own, max_restarts=1) for node in (0, 1)]
        unplugged_args = [*FLAGS, "--timeout-s", str(TIMEOUT_S), "--output-dir", str(root / "link-down")]
        unplugged = [severed.torchrun(node, 1, unplugged_args) for node in (0, 1)]
        trained = [good.torchrun(node, 2, [*FLAGS, "--output-dir", str(root / "two-hosts")]) for node in (0, 1)]
        # Host A is the rendezvous host but no host passes --local-addr: torchrun tells the ranks to meet at
        # A's name, which each host resolves to its own loopback address (multi-host.md).
        stuck_args = [*FLAGS, "--timeout-s", str(TIMEOUT_S), "--output-dir", str(root / "stuck")]
        stuck = [lost.torchrun(0, 1, stuck_args, launcher=["--rdzv-conf", "is_host=1"]),
                 lost.torchrun(1, 1, stuck_args, launcher=[])]  # fmt: skip
        deadline = time.monotonic() + 200  # they end on their own by then: --timeout-s plus start-up, however busy

        # Once step 10's checkpoint is written, every process of one run's host B is killed, and the other run's
        # host B loses its link (no socket closes: host A's ranks notice it at --timeout-s). Host A's ranks must
        # end on their own. (The unplugged host B's torchrun, cut off from the store on host A, waits on: it is
        # killed at the end.)
        # A third run's host B is killed the same way and started again at once with the same command: under
        # --max-restarts, host A's agent restarts its ranks and they meet host B's new ones in a new round.
        def come_back() -> None:
            back.kill(1)
            elastic.append(back.torchrun(1, 1, rejoin, own, max_restarts=1))

        watched = {"host-lost": (lambda: killed.kill(1), cut), "link-down": (lambda: ip(
            "-n", severed.hosts[1].namespace, "link", "set", severed.hosts[1].link, "down"), unplugged),
            "rejoined": (come_back, elastic)}  # fmt: skip
        when = {}
        while len(when) < len(watched) and time.monotonic() < started + 200:
            for name, (act, procs) in watched.items():
                done = (root / name / "checkpoints" / "step_00000010").exists() or procs[0].poll() is not None
                if name not in when and done:
                    act()
                    when[name] = time.monotonic()
            time.sleep(0.02)
        results["host lost"] = finish(cut, 120)
        results["host lost after s"], results["lost address"] = (
            time.monotonic() - when["host-lost"],
            killed.hosts[1].address,
        )
        results["link down"] = finish(unplugged[:1], TIMEOUT_S + 60)[0]
        results["link down after s"], results["cut address"] = (
            time.monotonic() - when["link-down"],
            severed.hosts[1].address,
        )
        restarted = [killed.torchrun(node, 1, again) for node in (0, 1)]  # both hosts again, the same commands
        # What host A left, read before the same commands run again (they keep only the newest checkpoints).
        results["link-down checkpoint"] = t.read_checkpoint(root / "link-down" / "checkpoints" / "step_00000010")
        severed.kill(1)  # host B's agent, cut off from the store, waits on; with its link back, both start again
        ip("-n", severed.hosts[1].namespace, "link", "set", severed.hosts[1].link, "up")
        one_host = run_jobs({name: [*FLAGS, *extra, "--output-dir", str(root / name)] for name, extra in
                             (("one-host", []), ("one-host-tp", ["--tp", "2"]))}, nproc=4)  # fmt: skip
        one_host |= run_jobs({"one-host-2": [*FLAGS, "--output-dir", str(root / "one-host-2")]}, nproc=2)
        # After the one-host jobs, not beside them: its --timeout-s 20 bounds each collective, on 2 shared cores.
        relinked = [severed.torchrun(node, 1, unplugged_args) for node in (0, 1)]
        results |= {"restarted": finish(restarted, 240), "relinked": finish(relinked, 240)}
        results["two hosts"] = finish(trained, 240)
        # Tensor parallelism inside each host (a tensor-parallel pair is two neighbouring ranks), data parallelism
        # across them: the layout as it is run in practice.
        split = [good.torchrun(node, 2, [*FLAGS, "--tp", "2", "--output-dir", str(root / "tp")], max_restarts=1)
                 for node in (0, 1)]  # fmt: skip
        for proc in stuck:  # one still running at the deadline is killed: code -9, and its test fails
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))  # (their output is small: the pipe holds it)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        results |= {"tp": finish(split, 240), "stuck": finish(stuck, 240), "rejoined": finish(elastic, 240)}
    return results, one_host, root


def test_two_hosts_of_two_ranks_train_the_weights_of_four_ranks_on_one_host(runs):
    results, one_host, root = runs
    assert one_host["one-host"].returncode == 0, one_host["one-host"].output
    for code, output in results["two hosts"]:
        assert code == 0, output
    assert_bitwise_equal(weights(root / "two-hosts"), weights(root / "one-host"), "2 hosts x 2 ranks against 4 ranks")


def test_tensor_parallel_inside_each_host_and_data_parallel_across_them_is_exact_and_said(runs):
    results, one_host, root = runs
    assert one_host["one-host-tp"].returncode == 0, one_host["one-host-tp"].output
    for code, output in results["tp"]:
        assert code == 0, output
    assert_bitwise_equal(weights(root / "tp"), weights(root / "one-host-tp"), "--tp 2 on 2 hosts against one host")
    summary = next(out for out in (o for _, o in results["tp"]) if "[summary]" in out)
    assert "across nodes: the data-parallel ones alone (each replica's 2 ranks share a node)" in summary
    # Started under --max-restarts with torch's shared store, the run warns that a host could not come back.
    assert "[nodes] warning: under --max-restarts a host started again would wait for the store's address" in summary
    assert all("[resume]" not in output for _, output in results["tp"]), "it ran through, with no restart"


def test_the_header_says_which_ranks_are_on_which_node_and_their_interface_and_address(runs):
    results, _, _ = runs
    output = "".join(out for _, out in results["two hosts"])
    (line,) = [line for line in output.splitlines() if line.startswith("[nodes] ")]
    assert line.startswith("[nodes] 2 nodes: node 0 (") and ": ranks 0,1, Gloo on v" in line, line
    assert ": ranks 2,3, Gloo on v" in line and line.count("(GLOO_SOCKET_IFNAME)") == 2, line
    assert "10." in line and " ? " not in line, "each interface's own address"


def test_ranks_that_cannot_reach_the_meeting_address_say_so_in_one_line_and_every_host_ends(runs):
    results, _, _ = runs
    (code_a, out_a), (code_b, out_b) = results["stuck"]
    assert code_a not in (0, -9) and code_b not in (0, -9), (out_a, out_b)
    # The ranks on the host that does not hold the store: one line each, the cause and the fix.
    said = [line for line in out_b.splitlines() if "cannot reach the rendezvous store at " in line]
    assert said and "resolves to 127." in said[0] and "--local-addr" in said[0] and "GLOO_SOCKET_IFNAME" in said[0]
    # Host A's ranks reach their own store; they wait there for host B's for --timeout-s, then end too.
    assert "could not join the process group" in out_a, out_a


def test_a_host_lost_mid_run_is_named_the_checkpoint_survives_and_the_same_commands_resume_bitwise(runs):
    results, one_host, root = runs
    (code_a, out_a), (code_b, _) = results["host lost"]
    assert code_b == -9 and code_a == 1, out_a
    lost = [line for line in out_a.splitlines() if line.startswith("error: rank ")]
    named = (
        f", {results['lost address']}), which probably failed first"  # "lost contact with node 1 (HOSTNAME, ADDRESS)"
    )
    assert lost and all("lost contact with node 1 (" in line and named in line for line in lost), out_a[-4000:]
    # A dead peer's sockets close at once: host A's ranks end in seconds (its agent's shutdown included).
    assert results["host lost after s"] < 60
    for code, output in results["restarted"]:
        assert code == 0, output
    restarted = "".join(out for _, out in results["restarted"])
    assert "[resume] continuing from" in restarted and "step_00000010 (step 10" in restarted, restarted
    assert one_host["one-host-2"].returncode == 0, one_host["one-host-2"].output
    assert_bitwise_equal(weights(root / "host-lost"), weights(root / "one-host-2"), "resumed after host B was lost")


def test_under_max_restarts_a_host_that_comes_back_rejoins_and_the_job_goes_on_from_the_last_checkpoint(runs):
    results, _, root = runs
    (code_a, out_a), (code_b, _), (code_back, out_back) = results["rejoined"]
    assert code_b == -9 and code_a == 0 and code_back == 0, (out_a, out_back)
    assert "lost contact with node 1 (" in out_a, out_a  # the ranks host A's agent restarted said why
    assert "[nodes] warning" not in out_a, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is set"
    assert out_a.count("[resume] continuing from") == 1, out_a  # rank 0, on host A, restarted once
    assert_bitwise_equal(weights(root / "rejoined"), weights(root / "one-host-2"), "host B came back, same command")


def test_a_link_taken_down_is_noticed_at_timeout_s_and_named_and_the_last_checkpoint_stays(runs):
    results, _, _ = runs
    code, output = results["link down"]
    assert code == 1, output
    said = [line for line in output.splitlines() if line.startswith("error: rank ")]
    named = f", {results['cut address']}) does not answer at all: its host or link is down"  # "node 1 (HOSTNAME, ..."
    found = f"host A's error lines {said}, its output's end:\n{output[-4000:]}"  # what was found, not just len([])
    assert len(said) == 1 and all(f"did not answer within --timeout-s {TIMEOUT_S}" in line for line in said), found
    assert all("node 1 (" in line and named in line for line in said), found
    assert results["link down after s"] < TIMEOUT_S + 30, "the bound: --timeout-s plus at most 30 s"
    assert results["link-down checkpoint"]["progress"]["step"] == 10


def test_with_the_link_back_the_same_commands_resume_bitwise(runs):
    results, _, root = runs
    for code, output in results["relinked"]:
        assert code == 0, output
    resumed = "".join(out for _, out in results["relinked"])
    assert "[resume] continuing from" in resumed and "step_00000010 (step 10" in resumed, resumed
    assert_bitwise_equal(weights(root / "link-down"), weights(root / "one-host-2"), "resumed after the link was down")


def test_a_socket_interface_this_host_does_not_have_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9z")
    with pytest.raises(t.UsageError, match=r"^GLOO_SOCKET_IFNAME=eth9z: this host has no interface eth9z \(it has lo"):
        t.check_socket_interfaces()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "l")  # NCCL's names are prefixes: "l" matches lo
    t.check_socket_interfaces()
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=l")  # ... unless the list starts with "="
    with pytest.raises(t.UsageError, match=r"^NCCL_SOCKET_IFNAME==l: this host has no interface l "):
        t.check_socket_interfaces()
