"""Faults: a killed worker, a stop request, a crash mid-save, a raising rank, a NaN, a bad file.

Every recovery is judged against one uninterrupted run: the final weights must be bitwise
identical (CPU, Gloo, dropout 0.1), which is only true if the resumed run continued on exactly
the examples it had not seen, with the same optimizer state and the same dropout masks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import SCRIPT, TINY, assert_ok, child_env, launch, run_cmd, torchrun_cmd

RUN = [
    *TINY,
    "--dropout",
    "0.1",
    "--optimizer",
    "sgd",
    "--lr",
    "0.5",
    "--max-steps",
    "120",
    "--save-every",
    "40",
    "--log-every",
    "10",
]


def weights(out) -> dict[str, torch.Tensor]:
    return torch.load(out / "tiny_transformer.pt", weights_only=True)["model"]


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"weights differ from the uninterrupted run: {differ}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    assert_ok(launch([*RUN, "--output-dir", str(out)], nproc=2))
    return out


def test_a_killed_worker_is_restarted_by_torchrun_and_resumes_bit_exactly(uninterrupted, tmp_path):
    cmd = torchrun_cmd(
        2, [*RUN, "--output-dir", str(tmp_path), "--inject-fault", "1:60"], ["--standalone", "--max-restarts=1"]
    )
    run = run_cmd(cmd, timeout=180)
    assert_ok(run)
    assert "injected 'kill' at step 60" in run.stderr
    assert "continuing from" in run.stdout and "step_00000040" in run.stdout
    assert_bitwise_equal(weights(uninterrupted), weights(tmp_path))


def test_sigterm_stops_every_rank_with_a_checkpoint_and_the_same_command_finishes(uninterrupted, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    args = [*RUN, "--output-dir", str(tmp_path), "--log-every", "1", "--metrics-file", str(metrics)]
    proc = subprocess.Popen(torchrun_cmd(2, args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env(), start_new_session=True)  # fmt: skip
    try:
        for line in proc.stdout:  # wait until training is under way, then ask torchrun to stop
            if line.startswith("step    20/"):
                break
        sent = time.perf_counter()
        os.kill(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        stop_seconds = time.perf_counter() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "[stop] SIGTERM: every rank stopped after step" in output, output
    stopped_at = int(output.split("stopped after step ")[1].split(";")[0])
    assert 20 <= stopped_at < 120
    assert (tmp_path / "checkpoints" / f"step_{stopped_at:08d}" / "manifest.json").exists()
    assert not (tmp_path / "tiny_transformer.pt").exists()
    print(f"SIGTERM to exit: {stop_seconds:.1f} s, stopped after step {stopped_at}")
    assert stop_seconds < 20

    resumed = launch([*RUN, "--output-dir", str(tmp_path), "--log-every", "1", "--metrics-file", str(metrics)], nproc=2)
    assert_ok(resumed)
    assert f"(step {stopped_at}" in resumed.stdout
    assert_bitwise_equal(weights(uninterrupted), weights(tmp_path))
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 121)), "the metrics file holds every step exactly once"


def test_a_crash_during_a_checkpoint_write_never_leaves_a_loadable_partial(uninterrupted, tmp_path):
    crashed = launch([*RUN, "--output-dir", str(tmp_path), "--inject-fault", "0:80:save"], nproc=2)
    assert crashed.returncode != 0
    partial = tmp_path / "checkpoints" / "step_00000080"
    assert partial.exists() and not (partial / "manifest.json").exists() and not (partial / "state.pt").exists()

    resumed = launch([*RUN, "--output-dir", str(tmp_path)], nproc=2)
    assert_ok(resumed)
    assert "skipping" in resumed.stdout and "step_00000080 is incomplete" in resumed.stdout
    assert "step_00000040 (step 40" in resumed.stdout
    assert_bitwise_equal(weights(uninterrupted), weights(tmp_path))


def test_a_damaged_checkpoint_is_refused_and_the_previous_one_is_used(uninterrupted, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(uninterrupted, out)
    state = out / "checkpoints" / "step_00000120" / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])  # truncated, as by a full disk
    (out / "tiny_transformer.pt").unlink()

    named = launch([*RUN, "--output-dir", str(out), "--resume", str(state.parent)])
    assert named.returncode == 2 and "step_00000120 is damaged" in named.stderr

    resumed = launch([*RUN, "--output-dir", str(out)], nproc=2)
    assert_ok(resumed)
    assert "step_00000120 is damaged" in resumed.stdout and "step_00000080 (step 80" in resumed.stdout
    assert_bitwise_equal(weights(uninterrupted), weights(out))


def test_checkpoints_are_plain_data_pruned_to_keep_last(uninterrupted):
    folders = sorted(p.name for p in (uninterrupted / "checkpoints").iterdir())
    assert folders == ["step_00000080", "step_00000120"]
    state = torch.load(uninterrupted / "checkpoints" / "step_00000120" / "state.pt", weights_only=True)
    assert state["progress"]["step"] == 120 and len(state["rng"]) == 2
    assert state["settings"]["world_size"] == 2 and "training_data_sha256" in state["settings"]
    assert set(state["trainable"]) == set(weights(uninterrupted))


def test_resuming_with_other_settings_is_refused(uninterrupted, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(uninterrupted, out)
    run = launch([*RUN, "--output-dir", str(out), "--max-steps", "200"])  # one process instead of two
    assert run.returncode == 2
    assert "cannot resume" in run.stderr and "world_size: 2 then, 1 now" in run.stderr


def test_a_rank_that_raises_ends_the_whole_job_promptly(tmp_path):
    run = launch([*RUN, "--output-dir", str(tmp_path), "--inject-fault", "1:3:raise"], nproc=2, timeout=60)
    assert run.returncode != 0
    assert run.seconds < 30
    assert "RuntimeError: injected failure on rank 1 at step 3" in run.output  # that rank's own error
    assert "rank 0 lost contact with another rank" in run.stderr


def test_a_non_finite_loss_on_one_rank_stops_every_rank_before_the_update(tmp_path):
    run = launch([*RUN, "--output-dir", str(tmp_path), "--inject-fault", "1:2:nan"], nproc=2)
    assert run.returncode == 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, run.stderr
    assert "non-finite loss or gradient norm at step 2" in errors[0]
    assert "non-finite local loss on rank(s) [1]" in errors[0]
    assert SCRIPT.name + '", line' not in run.output


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's workers), from /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
    return children


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_one_signal_to_the_whole_job_still_stops_cleanly_with_a_checkpoint(tmp_path, sig):
    # Ctrl-C in a terminal, or Slurm's scancel, signals torchrun and every worker at once; the
    # agent then forwards its copy to each worker, so each worker gets the signal twice, its own
    # copy first. Here the forwarded copy comes 0.1 s after the direct one (the agent is quick
    # when idle, slower on a loaded machine), while the workers are still in the step (the default
    # d 512 model: about 0.25 s a step). It must not count as a second, "stop at once" request.
    args = [*RUN, "--d-model", "512", "--batch-size", "16", "--output-dir", str(tmp_path), "--log-every", "1"]
    proc = subprocess.Popen(torchrun_cmd(2, args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env(), start_new_session=True)  # fmt: skip
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("step     2/"):
                break
        for pid in child_pids(proc.pid):
            os.kill(pid, sig)
        time.sleep(0.1)
        os.kill(proc.pid, sig)
        output = "".join(seen) + proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert f"[stop] {sig.name}: every rank stopped after step" in output, output
    assert "stopping at once" not in output and "KeyboardInterrupt" not in output, output
    stopped_at = int(output.split("stopped after step ")[1].split(";")[0])
    assert (tmp_path / "checkpoints" / f"step_{stopped_at:08d}" / "manifest.json").exists()
