"""A stop request (SIGINT, SIGTERM) stops every rank after the same step, with a checkpoint; the
launcher's forwarded copy of a signal is not a second request, a later one stops at once; and a
stop stays a stop when torchrun restarts the job. Each signal goes to a launch of its own.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time

import pytest
import torch
from conftest import SCRIPT, TINY, run_cmd, torchrun_cmd
from fault_helpers import RUN, child_pids, signal_at_step


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_one_signal_to_the_whole_job_still_stops_cleanly_with_a_checkpoint(tmp_path, sig):
    # Ctrl-C in a terminal, or Slurm's scancel, signals torchrun and every worker at once; the
    # agent then forwards its copy to each worker, so each worker gets the signal twice, its own
    # copy first. Here the forwarded copy comes 0.1 s after the direct one (the agent is quick
    # when idle, slower on a loaded machine), while the workers are still in the step (the default
    # d 512 model: about 0.25 s a step). It must not count as a second, "stop at once" request.
    args = [*RUN, "--d-model", "512", "--batch-size", "16", "--output-dir", str(tmp_path), "--log-every", "1"]

    def workers_then_launcher(launcher: int) -> None:
        for pid in child_pids(launcher):
            os.kill(pid, sig)
        time.sleep(0.1)
        os.kill(launcher, sig)

    _, output, _ = signal_at_step(torchrun_cmd(2, args), 2, workers_then_launcher)
    assert f"[stop] {sig.name}: every rank stopped after step" in output, output
    assert "stopping at once" not in output and "KeyboardInterrupt" not in output, output
    stopped_at = int(output.split("stopped after step ")[1].split(";")[0])
    assert (tmp_path / "checkpoints" / f"step_{stopped_at:08d}" / "manifest.json").exists()


def test_a_requested_stop_stays_stopped_under_max_restarts(tmp_path):
    # SIGTERM to one worker: every rank stops with a checkpoint and exit code 3, which torchrun
    # counts as a failure and restarts. The restarted attempt must not resume and finish.
    args = [*RUN, "--output-dir", str(tmp_path), "--log-every", "1", "--max-steps", "400"]
    cmd = torchrun_cmd(2, args, ["--standalone", "--max-restarts=1"])
    returncode, output, _ = signal_at_step(cmd, 20, lambda launcher: os.kill(child_pids(launcher)[0], signal.SIGTERM))
    assert "every rank stopped after step" in output, output
    assert "torchrun restarted the job after a requested stop: it stays stopped" in output, output
    assert "continuing from" not in output and not (tmp_path / "tiny_transformer.pt").exists()
    assert returncode != 0


def test_a_requested_stop_stays_stopped_with_a_process_between_torchrun_and_python(tmp_path):
    # Every restart starts a new bash, so the ranks' parent changes; the launch does not.
    args = [*RUN, "--output-dir", str(tmp_path), "--log-every", "1", "--max-steps", "400"]
    wrapped = f"{sys.executable} {SCRIPT} {' '.join(args)}; exit $?"  # a compound command: bash stays
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           "--no-python", "bash", "-c", wrapped]  # fmt: skip

    def stop_one_rank(launcher: int) -> None:
        ranks = [pid for shell in child_pids(launcher) for pid in child_pids(shell)]
        os.kill(ranks[0], signal.SIGTERM)

    returncode, output, _ = signal_at_step(cmd, 20, stop_one_rank)
    assert "every rank stopped after step" in output, output
    assert "torchrun restarted the job after a requested stop: it stays stopped" in output, output
    assert "continuing from" not in output and not (tmp_path / "tiny_transformer.pt").exists()
    assert returncode != 0


def test_the_stop_marker_holds_only_for_restarts_of_the_same_launch(tmp_path, monkeypatch):
    import llm_ddp_parallel_training as t

    cfg = t.parse_args([*TINY, "--output-dir", str(tmp_path)])
    stopped = t.Dist(0, 0, 2, 2, torch.device("cpu"), "gloo", "", launch="3f2a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    t.write_stop_marker(cfg, stopped, 20, "SIGTERM")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert t.stopped_in_an_earlier_attempt(cfg, stopped), "a restart of the stopped launch stays stopped"
    another = dataclasses.replace(stopped, launch="9c41")
    assert not t.stopped_in_an_earlier_attempt(cfg, another), "another launch resumes"
    assert not (tmp_path / t.STOP_MARKER).exists(), "a new launch clears the marker"


def test_a_second_signal_after_the_first_was_acknowledged_stops_at_once():
    # The deliberate way out stays: a repeat within REPEAT_S (here 0.5 s) is the launcher's
    # forwarded copy and changes nothing; one after it exits at once, without a checkpoint.
    code = (
        "import os, signal, sys, time\n"
        "import llm_ddp_parallel_training as t\n"
        "t.STOP.install()\n"
        "t.STOP.REPEAT_S = 0.5\n"
        "for pause in (0.1, 0.1):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(pause)\n"
        "print('still running after the copy', flush=True)\n"
        "time.sleep(0.6)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(10)\n"
        "print('never printed')\n"
    )
    run = run_cmd([sys.executable, "-c", code], timeout=120)
    assert run.returncode == 128 + signal.SIGINT
    assert "still running after the copy" in run.stdout and "never printed" not in run.stdout
    assert "[stop] SIGINT: every rank stops after this step" in run.stderr
    assert "[stop] second SIGINT: stopping at once, without a checkpoint" in run.stderr


def test_the_launchers_copy_is_recognised_even_while_a_long_computation_runs():
    # Python runs signal handlers only between bytecodes. Here the forwarded copy arrives 0.2 s
    # after the first signal but while the main thread is inside one long C call (a few
    # seconds of matmuls, as in a big backward pass): it must still count as the same request.
    code = (
        "import os, signal, threading, time, torch\n"
        "import llm_ddp_parallel_training as t\n"
        "torch.set_num_threads(1)\n"
        "t.STOP.install()\n"
        "t.STOP.REPEAT_S = 0.5\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(0.1)\n"
        "threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
        "started = time.monotonic()\n"
        "torch.linalg.matrix_power(torch.randn(1200, 1200, dtype=torch.float64), 63)\n"
        "print(f'computed for {time.monotonic() - started:.1f} s; still running', flush=True)\n"
    )
    run = run_cmd([sys.executable, "-c", code], timeout=120)
    assert run.returncode == 0, run.output
    assert "still running" in run.stdout and "stopping at once" not in run.stderr
