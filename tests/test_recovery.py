"""A killed worker, restarted by torchrun, and a job stopped by SIGTERM, run again, each continue
bit for bit: the final weights are identical to those of one uninterrupted run (CPU, Gloo,
dropout 0.1), which is only true if the run continued on exactly the examples it had not seen,
with the same optimizer state and the same dropout masks. Each kill, restart and signal is a
launch of its own; the uninterrupted run and the run that finishes after the SIGTERM, whose subject
is not their launch, are jobs of a shared one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
from conftest import assert_bitwise_equal, assert_ok, run_cmd, run_jobs, torchrun_cmd, weights
from fault_helpers import RUN, signal_at_step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run each recovery must land on, bit for bit: a job of a shared launch of 2 ranks."""
    out = tmp_path_factory.mktemp("uninterrupted")
    assert_ok(run_jobs({"uninterrupted": [*RUN, "--output-dir", str(out)]}, nproc=2)["uninterrupted"])
    return out


def test_a_killed_worker_is_restarted_by_torchrun_and_resumes_bit_exactly(uninterrupted, tmp_path):
    cmd = torchrun_cmd(
        2, [*RUN, "--output-dir", str(tmp_path), "--inject-fault", "1:60"], ["--standalone", "--max-restarts=1"]
    )
    run = run_cmd(cmd, timeout=300)
    assert_ok(run)
    assert "injected 'kill' at step 60" in run.stderr
    assert "continuing from" in run.stdout and "step_00000040" in run.stdout
    assert_bitwise_equal(weights(uninterrupted), weights(tmp_path))


def test_a_restart_continues_from_the_newest_checkpoint_even_after_resume_path(uninterrupted, tmp_path):
    # --resume PATH chose the first attempt's start. Going back there after a crash would throw
    # away everything trained since (and set those checkpoints aside as abandoned).
    out = tmp_path / "copy"
    shutil.copytree(uninterrupted, out)
    (out / "tiny_transformer.pt").unlink()
    args = [*RUN, "--output-dir", str(out), "--resume", str(out / "checkpoints" / "step_00000080"),
            "--save-every", "10", "--inject-fault", "1:105"]  # fmt: skip
    run = run_cmd(torchrun_cmd(2, args, ["--standalone", "--max-restarts=1"]), timeout=300)
    assert_ok(run)
    assert "torchrun restarted the job: --resume" in run.stdout and "step_00000100 (step 100" in run.stdout
    assert_bitwise_equal(weights(uninterrupted), weights(out))


def test_sigterm_stops_every_rank_with_a_checkpoint_and_the_same_command_finishes(uninterrupted, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    args = [*RUN, "--output-dir", str(tmp_path), "--log-every", "1", "--metrics-file", str(metrics)]
    returncode, output, stop_seconds = signal_at_step(
        torchrun_cmd(2, args), 20, lambda pid: os.kill(pid, signal.SIGTERM)
    )
    assert returncode != 0
    assert "[stop] SIGTERM: every rank stopped after step" in output, output
    stopped_at = int(output.split("stopped after step ")[1].split(";")[0])
    assert 20 <= stopped_at < 120
    assert (tmp_path / "checkpoints" / f"step_{stopped_at:08d}" / "manifest.json").exists()
    assert not (tmp_path / "tiny_transformer.pt").exists()
    print(f"SIGTERM to exit: {stop_seconds:.1f} s, stopped after step {stopped_at}")

    # The same command again, as a job of the shared launch (what the resume decides does not depend on how
    # the ranks were started); its seconds are a launch's of its own, start-up included (conftest.run_jobs).
    again = [*RUN, "--output-dir", str(tmp_path), "--log-every", "1", "--metrics-file", str(metrics)]
    resumed = run_jobs({"resumed": again}, nproc=2)["resumed"]
    assert_ok(resumed)
    # Promptly: within 20 s, or on a machine so busy that starting the same run again took longer, within that.
    assert stop_seconds < max(20, resumed.seconds), (stop_seconds, resumed.seconds)
    assert f"(step {stopped_at}" in resumed.stdout
    assert_bitwise_equal(weights(uninterrupted), weights(tmp_path))
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 121)), "the metrics file holds every step exactly once"


def test_the_same_command_after_the_run_has_finished_has_nothing_to_do_and_leaves_its_outputs(uninterrupted, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(uninterrupted, out)
    outputs = [out / "memory.json", out / "tiny_transformer.pt"]
    before = [path.read_bytes() for path in outputs]
    again = run_jobs({"again": [*RUN, "--output-dir", str(out)]}, nproc=2)["again"]
    assert_ok(again)
    assert "is this run's last step and its model is saved: nothing to do" in again.stdout, again.stdout
    assert not [line for line in again.stdout.splitlines() if line.startswith("step ")], "no step trained"
    assert [path.read_bytes() for path in outputs] == before
