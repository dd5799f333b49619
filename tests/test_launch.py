"""The ways to launch, end to end: one process, torchrun on one machine, two nodes, and --nproc.

torchrun and --nproc each start one same run (dropout included) for the module: the loss falls
under torchrun, and the two write the same bytes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY, assert_ok, child_env, free_port, launch, run_cmd, torchrun_cmd
from in_process import run_main

import llm_ddp_parallel_training as t


def test_single_process_run_writes_a_checkpoint_that_reloads(tmp_path):
    run = launch([*TINY, "--max-steps", "3", "--output-dir", str(tmp_path)])
    assert_ok(run)
    assert "no process group" in run.stdout
    ckpt = torch.load(tmp_path / "tiny_transformer.pt", weights_only=True)
    assert ckpt["step"] == 3 and ckpt["config"]["d_model"] == 32
    assert not any(k.startswith("module.") for k in ckpt["model"])
    model = t.load_tiny_checkpoint(tmp_path / "tiny_transformer.pt")
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 256)


@pytest.fixture(scope="module")
def torchrun_and_nproc(tmp_path_factory) -> dict[str, tuple]:
    """The same run, started by torchrun and by --nproc 2: {launcher: (run, output folder)}."""
    root = tmp_path_factory.mktemp("launchers")
    args = [*TINY, "--max-steps", "40", "--log-every", "10", "--dropout", "0.1"]
    torchrun = launch([*args, "--output-dir", str(root / "torchrun")], nproc=2)
    nproc = launch([*args, "--nproc", "2", "--output-dir", str(root / "nproc")])
    return {"torchrun": (torchrun, root / "torchrun"), "nproc": (nproc, root / "nproc")}


def test_two_gloo_ranks_train_and_the_loss_falls(torchrun_and_nproc):
    run, out = torchrun_and_nproc["torchrun"]
    assert_ok(run)
    assert "2 rank(s) x 4 examples x 1 micro-step(s) = global batch 8" in run.stdout
    losses = run.losses()
    assert len(losses) >= 4 and losses[-1] < losses[0] - 1.0, losses
    assert (out / "tiny_transformer.pt").exists()
    assert "[sample] Each rank" in run.stdout


def test_two_nodes_meet_through_c10d_rendezvous(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    args = [*TINY, "--max-steps", "3", "--output-dir", str(tmp_path)]
    launcher = f"--nnodes 2 --rdzv-backend c10d --rdzv-endpoint {endpoint} --rdzv-id two-node-test".split()
    cmds = [torchrun_cmd(1, args, [*launcher, "--node-rank", str(k)]) for k in (0, 1)]
    # The second "node" runs in the background; both must finish.
    other = subprocess.Popen(
        cmds[1], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(), start_new_session=True
    )
    try:
        run = run_cmd(cmds[0], timeout=240)
        other_out, _ = other.communicate(timeout=120)
    finally:
        other.kill()
    assert_ok(run)
    assert other.returncode == 0, other_out
    assert "2 process(es)" in run.stdout + other_out
    assert (tmp_path / "tiny_transformer.pt").exists()


def test_same_seed_same_world_size_gives_bitwise_identical_checkpoints(torchrun_and_nproc):
    # Two launches of one run (seed 1337, 2 ranks, dropout 0.1): one by torchrun, one by --nproc 2.
    paths = []
    for name in ("torchrun", "nproc"):
        run, out = torchrun_and_nproc[name]
        assert_ok(run)
        paths.append(out / "tiny_transformer.pt")
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_the_tiny_path_never_imports_transformers_or_peft(tmp_path):
    args = [*TINY, "--max-steps", "1", "--output-dir", str(tmp_path)]
    code = (
        "import sys, llm_ddp_parallel_training as t\n"
        f"t.main({args!r})\n"
        "print('IMPORTED', [m for m in ('transformers', 'peft') if m in sys.modules])"
    )
    run = run_cmd([sys.executable, "-c", code], timeout=120)
    assert_ok(run)
    assert "IMPORTED []" in run.stdout


MEETING_PROBE = """
import sys, time
import llm_ddp_parallel_training as t

cfg = t.parse_args(sys.argv[1:])
d = t.setup_distributed(cfg)
time.sleep(4 if d.rank == 1 else 0)  # rank 1's "download" outlasts --timeout-s 1
problem = t.meet_without_deadline(d, "probe", "")
print(f"rank {d.rank} met, problem {problem!r}", flush=True)
t.teardown_distributed()
"""


def test_waiting_for_a_download_has_no_collective_deadline(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(MEETING_PROBE)
    run = run_cmd(torchrun_cmd(2, [*TINY, "--timeout-s", "1"], script=probe), timeout=180)
    assert_ok(run)
    assert "rank 0 met, problem ''" in run.stdout and "rank 1 met, problem ''" in run.stdout


def test_nproc_runs_the_ranks_itself_and_writes_what_torchrun_writes_bit_for_bit(torchrun_and_nproc):
    assert_ok(torchrun_and_nproc["torchrun"][0])
    run = torchrun_and_nproc["nproc"][0]
    assert_ok(run)
    assert "2 process(es)" in run.stdout
    checkpoints = [(out / "tiny_transformer.pt").read_bytes() for _, out in torchrun_and_nproc.values()]
    assert checkpoints[0] == checkpoints[1]


def test_a_failing_rank_under_nproc_ends_every_rank_promptly_with_a_clear_line(tmp_path):
    run = launch([*TINY, "--nproc", "2", "--inject-fault", "1:3:raise", "--output-dir", str(tmp_path)], timeout=280)
    # Promptly: a launch that fails at once takes 5-40 s on a loaded 2-core machine; rank 0, left to find
    # out by itself, would wait --timeout-s, 300 s by default, after its start. Generous, still short of it.
    assert run.returncode != 0 and run.seconds < 200
    assert "error: rank 1 failed first (exit code 1); every rank has stopped" in run.stderr
    assert "rank 0 lost contact with another rank" in run.stderr


def test_nproc_inside_a_launched_rank_is_refused(monkeypatch, capsys):
    # (torchrun itself rejects "--nproc" after the script as an ambiguous abbreviation of its own
    # --nproc-per-node; a rank launched any other way carries torchrun's variables.) main() runs in
    # this process: the refusal comes before any rank or process group.
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    run = run_main([*TINY, "--nproc", "2"], monkeypatch, capsys, env)
    assert run.returncode == 2
    assert "error: --nproc starts its own ranks: under torchrun, leave it out" in run.stderr


def test_ctrl_c_to_the_nproc_launcher_stops_every_rank_with_a_checkpoint(tmp_path):
    # A notebook's interrupt reaches the launcher alone; it forwards the signal to every rank.
    cmd = [sys.executable, str(t.__file__), *TINY, "--max-steps", "2000", "--log-every", "1", "--save-every", "1000",
           "--nproc", "2", "--output-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                            start_new_session=True)  # fmt: skip
    try:
        for line in proc.stdout:
            if line.startswith("step    20/"):
                break
        os.kill(proc.pid, signal.SIGINT)
        output = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == t.EXIT_STOPPED, output
    stopped_at = int(output.split("stopped after step ")[1].split(";")[0])
    assert (tmp_path / "checkpoints" / f"step_{stopped_at:08d}" / "manifest.json").exists()


def process_alive(pid: int) -> bool:
    """Running or sleeping, not gone and not a zombie left for a parent that no longer reaps it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_end_with_a_checkpoint_when_their_nproc_launcher_is_killed(tmp_path):
    # A killed notebook kernel or an OOM kill: SIGKILL, which the launcher cannot pass on.
    out, log = tmp_path / "out", tmp_path / "log.txt"
    args = [*TINY, "--log-every", "1", "--save-every", "100000", "--output-dir", str(out)]
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, str(t.__file__), *args, "--max-steps", "100000", "--nproc", "2"],
                                stdout=sink,
                                stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)  # fmt: skip
    try:
        started = time.monotonic()
        while "step     5/" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < started + 240, log.read_text()
            time.sleep(0.2)
        ranks = [int(pid) for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        assert len(ranks) == 2
        proc.kill()
        proc.wait()
        # Within 30 s, or on a machine so busy that the start took longer, within that.
        deadline = time.monotonic() + max(30, time.monotonic() - started)
        while any(map(process_alive, ranks)):
            assert time.monotonic() < deadline, f"ranks outlived their launcher:\n{log.read_text()}"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert "[stop] the --nproc launcher has gone: every rank stops after this step" in output
    stopped_at = int(output.split("stopped after step ")[1].split(";")[0])
    assert (out / "checkpoints" / f"step_{stopped_at:08d}" / "manifest.json").exists()
    # The folder is free again (run.lock went with the ranks), and the same run resumes there.
    resumed = launch([*args, "--max-steps", str(stopped_at + 1), "--nproc", "2"])
    assert_ok(resumed)
    assert f"(step {stopped_at}" in resumed.stdout
