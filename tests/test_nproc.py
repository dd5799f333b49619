"""--nproc, the script's own launcher, end to end: a failing rank ends every rank promptly, Ctrl-C
stops every rank with a checkpoint, killing the launcher ends its ranks with one; and a process
that carries torchrun's rank variables refuses to launch ranks of its own.
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
from conftest import TINY, assert_ok, child_env, launch
from in_process import run_main

import llm_ddp_parallel_training as t


def test_a_failing_rank_under_nproc_ends_every_rank_promptly_with_a_clear_line(tmp_path):
    run = launch([*TINY, "--nproc", "2", "--inject-fault", "1:3:raise", "--output-dir", str(tmp_path)], timeout=280)
    # Promptly: a launch that fails at once takes 5-40 s on a loaded 2-core machine; rank 0, left to find
    # out by itself, would wait --timeout-s, 300 s by default, after its start. Generous, still short of it.
    assert run.returncode != 0 and run.seconds < 200
    assert "error: rank 1 failed first (exit code 1); every rank has stopped" in run.stderr
    assert "rank 0 lost contact with another rank" in run.stderr


def test_a_process_group_of_one_averages_nothing(tmp_path):
    # torchrun with one rank (here --nproc 1) makes a process group of one: no other rank to average with, so
    # no DDP and no all-reduce (an H200 run of a 1.5B full fine-tune had sent 2.9 GiB a step to itself).
    run = launch([*TINY, "--nproc", "1", "--max-steps", "3", "--log-every", "1", "--output-dir", str(tmp_path)])
    assert_ok(run)
    assert "gradient sync: none (one process: its gradient is already the whole batch's)" in run.stdout
    assert "all-reduced" not in run.stdout and "per step: nothing" in run.stdout


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_while_the_ranks_start_ends_them_quietly_and_leaves_nothing(tmp_path):
    # A terminal's Ctrl-C reaches the launcher and its ranks at once (one process group), here while the ranks import
    # torch (seconds; each has mapped torch's library): no rank's traceback, no "failed first", no folder; exit 130.
    # (In the milliseconds before Python has started, Python's own "Fatal Python error" would still show.)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(t.__file__), *TINY, "--nproc", "2", "--output-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                            start_new_session=True)  # fmt: skip

    def both_ranks_import_torch() -> bool:
        try:
            ranks = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            return len(ranks) == 2 and all("libtorch" in Path(f"/proc/{rank}/maps").read_text() for rank in ranks)
        except OSError:  # a process that has just ended
            return False

    try:
        started = time.monotonic()
        while not both_ranks_import_torch():
            assert proc.poll() is None and time.monotonic() < started + 120, "no rank started"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)
        stderr = proc.communicate(timeout=120)[1]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert (proc.returncode, stderr) == (130, "")
    assert not out.exists()


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
        assert len(ranks) == 2, f"the launcher's children: {ranks}"
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
