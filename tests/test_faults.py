"""Faults: a killed worker, a stop request, a crash mid-save, a raising rank, a NaN, a bad file.

Every recovery is judged against one uninterrupted run: the final weights must be bitwise
identical (CPU, Gloo, dropout 0.1), which is only true if the resumed run continued on exactly
the examples it had not seen, with the same optimizer state and the same dropout masks.

Kills, hangs, signals and torchrun's restarts each have a launch of their own. What a resume
decides (to refuse, to skip a damaged or partial checkpoint, to prune, to roll back) does not
depend on how its ranks were started: those resumes, the uninterrupted run and the other runs
that end in an error on every rank are jobs of a few shared launches (tests/worker.py runs each
through the script's own parse_args(), run() and report_failure(), and keeps every rank's exit
code), made once for the module by the fixtures `first` and `shared`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import SCRIPT, TINY, Run, assert_ok, child_env, launch, run_cmd, run_jobs, torchrun_cmd

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

# "Promptly", for a job whose failed rank takes the others down with it: a launch that fails at
# once takes 5-40 s on a loaded 2-core machine. Were the others left to find out by themselves,
# they would wait --timeout-s, 300 s by default, after their start: generous, and still short of it.
PROMPT_S = 200


def weights(out) -> dict[str, torch.Tensor]:
    return torch.load(out / "tiny_transformer.pt", weights_only=True)["model"]


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"weights differ from the uninterrupted run: {differ}"


def damage(folder) -> None:
    state = folder / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])  # truncated, as by a full disk; the manifest stays


def checkpoint_names(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def files_of_each_checkpoint(out) -> dict[str, list[str]]:
    return {folder.name: sorted(p.name for p in folder.iterdir()) for folder in (out / "checkpoints").iterdir()}


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> SimpleNamespace:
    """One two-rank launch: the uninterrupted run; its twin (the same job, into a folder of its own),
    then the twin's rollback to step 80; a NaN on one rank."""
    root = tmp_path_factory.mktemp("faults")
    uninterrupted, rollback = root / "uninterrupted", root / "rollback"
    step_80 = rollback / "checkpoints" / "step_00000080"
    jobs = {
        "uninterrupted": [*RUN, "--output-dir", str(uninterrupted)],
        "rollback's run": [*RUN, "--output-dir", str(rollback)],
        "rollback": [*RUN, "--output-dir", str(rollback), "--resume", str(step_80), "--max-steps", "100"],
        "nan": [*RUN, "--output-dir", str(root / "nan"), "--inject-fault", "1:2:nan"],
    }
    jobs["rollback"] += ["--save-every", "10"]
    runs = run_jobs(jobs, nproc=2, timeout=400)
    assert_ok(runs["uninterrupted"])
    assert_ok(runs["rollback's run"])
    # Noted now: the rolled-back run is continued by a later launch.
    return SimpleNamespace(root=root, uninterrupted=uninterrupted, rollback=rollback,
                           after_rollback=checkpoint_names(rollback), runs=runs)  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(first) -> Path:
    return first.uninterrupted


@pytest.fixture(scope="module")
def shared(first) -> SimpleNamespace:
    """The resumes, in three more launches.

    1. The crash mid-save (--nproc 2: a killed rank ends a launch, so it has a launch of its own).
    2. One process: resumes that must be refused, and a metrics file moved aside.
    3. Two ranks: the crashed run resumed; resumes of copies of the uninterrupted run, damaged or
       changed; the rolled-back run continued.
    Between the launches, the copies are made and damaged, and what a later job changes is noted
    first (the files the crash left).
    """
    root, uninterrupted, rollback, crash = first.root, first.uninterrupted, first.rollback, first.root / "crash"
    crashed = launch([*RUN, "--output-dir", str(crash), "--inject-fault", "0:80:save", "--nproc", "2"], timeout=280)
    after_crash = files_of_each_checkpoint(crash)

    def copy(name: str) -> Path:
        out = root / name
        shutil.copytree(uninterrupted, out)
        return out

    damaged = copy("damaged")
    damaged_120 = damaged / "checkpoints" / "step_00000120"
    damage(damaged_120)
    (damaged / "tiny_transformer.pt").unlink()
    newer = copy("damaged_newer")  # with a damaged folder from a longer earlier run
    shutil.copytree(newer / "checkpoints" / "step_00000120", newer / "checkpoints" / "step_00000999")
    damage(newer / "checkpoints" / "step_00000999")
    (newer / "tiny_transformer.pt").unlink()
    all_damaged = copy("all_damaged")
    for folder in (all_damaged / "checkpoints").iterdir():
        damage(folder)
    metrics = root / "metrics" / "m.jsonl"
    metrics.parent.mkdir()
    earlier_metrics = json.dumps({"step": 7, "loss": 1.0}) + "\n"
    metrics.write_text(earlier_metrics)

    one_process = {
        "damaged, named": [*RUN, "--output-dir", str(damaged), "--resume", str(damaged_120)],
        "one process": [*RUN, "--output-dir", str(copy("world_size")), "--max-steps", "200"],
        "metrics aside": [*TINY, "--max-steps", "2", "--log-every", "1", "--metrics-file", str(metrics)],
    }
    one_process["metrics aside"] += ["--output-dir", str(metrics.parent / "out")]
    runs = first.runs | run_jobs(one_process, nproc=None, timeout=400)

    changed = ["--precision", "bf16", "--grad-compression", "bf16", "--ddp", "manual", "--max-steps", "130"]
    two_ranks = {
        "crash resumed": [*RUN, "--output-dir", str(crash)],
        "damaged": [*RUN, "--output-dir", str(damaged)],
        "damaged newer": [*RUN, "--output-dir", str(newer), "--max-steps", "200", "--keep-last", "1"],
        "rollback continued": [*RUN, "--output-dir", str(rollback), "--max-steps", "110", "--save-every", "10"],
        "all damaged": [*RUN, "--output-dir", str(all_damaged)],
        "lr": [*RUN, "--output-dir", str(copy("lr")), "--lr", "0.25", "--weight-decay", "0.1"],
        "precision": [*RUN, "--output-dir", str(copy("precision")), *changed],
    }
    runs |= run_jobs(two_ranks, nproc=2, timeout=400)
    return SimpleNamespace(
        uninterrupted=uninterrupted,
        after_rollback=first.after_rollback,
        crash=crash,
        crashed=crashed,
        after_crash=after_crash,
        damaged=damaged,
        newer=newer,
        metrics=metrics,
        earlier_metrics=earlier_metrics,
        runs=runs,
    )


def test_a_killed_worker_is_restarted_by_torchrun_and_resumes_bit_exactly(uninterrupted, tmp_path):
    cmd = torchrun_cmd(
        2, [*RUN, "--output-dir", str(tmp_path), "--inject-fault", "1:60"], ["--standalone", "--max-restarts=1"]
    )
    run = run_cmd(cmd, timeout=300)
    assert_ok(run)
    assert "injected 'kill' at step 60" in run.stderr
    assert "continuing from" in run.stdout and "step_00000040" in run.stdout
    assert_bitwise_equal(weights(uninterrupted), weights(tmp_path))


def signal_at_step(cmd: list[str], step: int, send: Callable[[int], None]) -> tuple[int, str, float]:
    """Start torchrun, wait until it logs `step`, call send(torchrun's pid), then collect the rest.

    Returns the exit code, everything printed, and the seconds from the signal to the exit.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                            start_new_session=True)  # fmt: skip
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(f"step {step:>5}/"):
                break
        sent = time.perf_counter()
        send(proc.pid)
        output = "".join(seen) + proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, output, time.perf_counter() - sent


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

    resumed = launch([*RUN, "--output-dir", str(tmp_path), "--log-every", "1", "--metrics-file", str(metrics)], nproc=2)
    assert_ok(resumed)
    # Promptly: within 20 s, or on a machine so busy that starting the same run again took longer, within that.
    assert stop_seconds < max(20, resumed.seconds), (stop_seconds, resumed.seconds)
    assert f"(step {stopped_at}" in resumed.stdout
    assert_bitwise_equal(weights(uninterrupted), weights(tmp_path))
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 121)), "the metrics file holds every step exactly once"


def test_a_crash_during_a_checkpoint_write_never_leaves_a_loadable_partial(shared):
    assert shared.crashed.returncode != 0
    partial = shared.after_crash.get("step_00000080")  # the files of the crashed run's folder, before the resume
    assert partial is not None and "manifest.json" not in partial and "state.pt" not in partial

    resumed = shared.runs["crash resumed"]
    assert_ok(resumed)
    assert "skipping" in resumed.stdout and "step_00000080 is incomplete" in resumed.stdout
    assert "step_00000040 (step 40" in resumed.stdout
    assert_bitwise_equal(weights(shared.uninterrupted), weights(shared.crash))


def test_a_damaged_checkpoint_is_refused_and_the_previous_one_is_used(shared):
    # A copy of the uninterrupted run, its step_00000120/state.pt truncated, its final model removed.
    named = shared.runs["damaged, named"]  # one process, --resume naming the damaged folder
    assert named.returncode == 2 and "step_00000120 is damaged" in named.stderr

    resumed = shared.runs["damaged"]  # then two ranks, --resume auto, in the same folder
    assert_ok(resumed)
    assert "step_00000120 is damaged" in resumed.stdout and "step_00000080 (step 80" in resumed.stdout
    assert_bitwise_equal(weights(shared.uninterrupted), weights(shared.damaged))


def test_checkpoints_are_plain_data_pruned_to_keep_last(uninterrupted):
    folders = sorted(p.name for p in (uninterrupted / "checkpoints").iterdir())
    assert folders == ["step_00000080", "step_00000120"]
    state = torch.load(uninterrupted / "checkpoints" / "step_00000120" / "state.pt", weights_only=True)
    assert state["progress"]["step"] == 120 and len(state["rng"]) == 2
    assert state["settings"]["world_size"] == 2 and "training_data_sha256" in state["settings"]
    assert set(state["trainable"]) == set(weights(uninterrupted))


def test_resuming_with_other_settings_is_refused(shared):
    run = shared.runs["one process"]  # a copy of the two-rank run, resumed by one process, --max-steps 200
    assert run.returncode == 2
    assert "cannot resume" in run.stderr and "world_size: 2 then, 1 now" in run.stderr


def test_a_rank_that_raises_ends_the_whole_job_promptly_and_torchrun_names_it_the_root_cause(tmp_path):
    # torchrun looks every 3 s here: by then both ranks have exited, and it must choose between their
    # reports. The root cause is the rank that failed, not the one that lost it.
    args = [*RUN, "--output-dir", str(tmp_path), "--inject-fault", "1:3:raise"]
    run = run_cmd(torchrun_cmd(2, args, ["--standalone", "--monitor-interval=3"]), 280)
    assert run.returncode != 0
    assert run.seconds < PROMPT_S
    assert "RuntimeError: injected failure on rank 1 at step 3" in run.output  # that rank's own error
    assert "rank 0 lost contact with another rank" in run.stderr
    assert run.returncode == 1
    root_cause = run.stderr.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root_cause, run.stderr
    assert "injected failure on rank 1 at step 3" in root_cause


def test_a_non_finite_loss_on_one_rank_stops_every_rank_before_the_update(first):
    run = first.runs["nan"]
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


def test_a_damaged_newer_checkpoint_never_makes_pruning_delete_the_good_ones(shared):
    # A damaged folder from a longer earlier run sorts above everything this run writes. Were it
    # counted as complete, --keep-last 1 would delete each new checkpoint as soon as it was
    # written, leaving only the damaged one. (A copy of the uninterrupted run, with a damaged copy
    # of its step_00000120 as step_00000999, its final model removed; run on to 200 steps.)
    out = shared.newer
    run = shared.runs["damaged newer"]
    assert_ok(run)
    assert "step_00000999 is damaged" in run.stdout and "step_00000120 (step 120" in run.stdout
    assert checkpoint_names(out) == ["step_00000200"]
    assert [p.name for p in out.glob("checkpoints.abandoned-*/*")] == ["step_00000999"]


def test_pruning_keeps_the_newest_verified_checkpoint(uninterrupted, tmp_path):
    import llm_ddp_parallel_training as t

    out = tmp_path / "copy"
    shutil.copytree(uninterrupted, out)
    shutil.copytree(out / "checkpoints" / "step_00000120", out / "checkpoints" / "step_00000160")
    damage(out / "checkpoints" / "step_00000160")
    t.prune_checkpoints(t.parse_args([*RUN, "--output-dir", str(out), "--keep-last", "1"]))
    assert checkpoint_names(out) == ["step_00000120", "step_00000160"]  # the damaged one decides nothing


def test_a_rollback_sets_aside_the_checkpoints_it_abandons(shared):
    # The uninterrupted run's twin (the same job, into its own folder), resumed from its step 80
    # for a 100-step run saving every 10, then continued to 110 steps.
    back = shared.runs["rollback"]
    assert_ok(back)
    assert "1 checkpoint(s) after step 80 belong to the abandoned run" in back.stdout
    assert "--max-steps 100 (the checkpoint's run had 120): the schedule now spans 100 steps" in back.stdout
    assert shared.after_rollback == ["step_00000090", "step_00000100"]
    again = shared.runs["rollback continued"]
    assert_ok(again)
    assert "continuing from" in again.stdout and "step_00000100 (step 100" in again.stdout


def test_when_every_checkpoint_is_damaged_resume_auto_refuses_and_names_resume_none(shared):
    run = shared.runs["all damaged"]  # a copy of the uninterrupted run, every checkpoint damaged
    assert run.returncode != 0 and run.codes == (2, 2)  # every rank exits with the usage-error code
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "no usable checkpoint" in errors[0] and "--resume none" in errors[0], run.stderr
    assert "step " not in run.stdout


def test_resuming_with_another_learning_rate_is_refused(shared):
    run = shared.runs["lr"]  # a copy of the uninterrupted run, --lr 0.25 --weight-decay 0.1
    assert run.returncode != 0 and run.codes == (2, 2)
    assert "lr: 0.5 then, 0.25 now" in run.stderr and "weight_decay: 0.01 then, 0.1 now" in run.stderr


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


def test_a_full_disk_under_the_metrics_file_ends_every_rank_with_one_line(tmp_path):
    # RLIMIT_FSIZE makes a write past 8 KiB fail with EFBIG, as a full disk fails with ENOSPC.
    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))

    args = [*TINY, "--max-steps", "300", "--log-every", "1", "--metrics-file", str(tmp_path / "m.jsonl"),
            "--output-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(torchrun_cmd(2, args), capture_output=True, text=True, env=child_env(),
                          preexec_fn=limit_file_size, timeout=240)  # fmt: skip
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0
    assert len(errors) == 1 and "could not write the metrics file" in errors[0] and "File too large" in errors[0]
    assert SCRIPT.name + '", line' not in proc.stdout + proc.stderr
    assert not (tmp_path / "tiny_transformer.pt").exists()


@pytest.mark.parametrize("torn", [b'{"st', b'{"step": 4, "lo'])
def test_resume_tolerates_a_torn_last_metrics_line(tmp_path, torn):
    import llm_ddp_parallel_training as t

    metrics = tmp_path / "m.jsonl"
    metrics.write_bytes(b"".join(json.dumps({"step": s, "loss": 1.0}).encode() + b"\n" for s in (1, 2, 3)) + torn)
    t.prepare_metrics_file(t.parse_args([*TINY, "--metrics-file", str(metrics)]), start_step=2)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]


def test_a_fresh_run_moves_another_runs_metrics_file_aside(shared):
    metrics, earlier = shared.metrics, shared.earlier_metrics  # it held one record of another run
    run = shared.runs["metrics aside"]  # one process, 2 steps
    assert_ok(run)
    assert "held 1 record(s) of an earlier run: moved to" in run.stdout
    assert [p.read_text() for p in metrics.parent.glob("m.jsonl.before-*")] == [earlier]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]


def run_noting_a_line(cmd: list[str], mark: str, timeout: float) -> tuple[Run, float | None]:
    """run_cmd, that also notes when the first line holding `mark` came: seconds from the start, or None."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                            start_new_session=True)  # fmt: skip
    watchdog = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    watchdog.start()
    marked, out, err = [], [], []

    def read(stream, lines: list[str]) -> None:
        for line in stream:
            if mark in line and not marked:
                marked.append(time.perf_counter() - started)
            lines.append(line)

    readers = [
        threading.Thread(target=read, args=(proc.stdout, out)),
        threading.Thread(target=read, args=(proc.stderr, err)),
    ]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    proc.wait()
    watchdog.cancel()
    run = Run(proc.returncode, "".join(out), "".join(err), time.perf_counter() - started)
    if run.seconds >= timeout:
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n--- stdout\n{run.stdout}\n--- stderr\n{run.stderr}")
    return run, marked[0] if marked else None


def test_a_rank_that_hangs_ends_the_job_after_the_timeout_with_one_line(tmp_path):
    args = [*RUN, "--output-dir", str(tmp_path), "--timeout-s", "3", "--inject-fault", "1:5:hang"]
    run, hung_at = run_noting_a_line(torchrun_cmd(2, args), "injected 'hang' at step 5", timeout=240)
    assert run.returncode != 0 and hung_at is not None, run.output
    # Promptly, on any machine: after the hang the job ends within the --timeout-s 3 plus twice the time it
    # took to get there (start-up and 5 steps). A hung rank that ignored torchrun's request to stop would
    # be killed only after torchrun's 30 s grace.
    assert run.seconds - hung_at < 3 + 2 * hung_at, (hung_at, run.seconds)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, run.stderr
    assert "rank 0: another rank did not answer within --timeout-s 3" in errors[0]
    assert SCRIPT.name + '", line' not in run.output


def test_when_rank_0_dies_the_other_ranks_say_so_too(tmp_path):
    run = launch([*RUN, "--output-dir", str(tmp_path), "--inject-fault", "0:5"], nproc=2, timeout=280)
    assert run.returncode != 0 and run.seconds < PROMPT_S
    assert "error: rank 1 lost contact with another rank" in run.stderr, run.stderr


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


def test_resuming_with_another_precision_compression_or_ddp_is_refused_naming_each(shared):
    # A copy of the uninterrupted run: --precision bf16 --grad-compression bf16 --ddp manual --max-steps 130
    run = shared.runs["precision"]
    assert run.returncode != 0 and run.codes == (2, 2)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: cannot resume")]
    assert len(errors) == 1, run.stderr
    for named in ("precision: 'fp32' then, 'bf16' now", "grad_compression: 'none' then, 'bf16' now",
                  "ddp: 'torch' then, 'manual' now"):  # fmt: skip
        assert named in errors[0]
    assert "max_steps" not in errors[0], "a longer run is a free change"


def test_an_older_checkpoint_without_the_newer_settings_still_resumes(capsys):
    import llm_ddp_parallel_training as t

    now = {"lr": 0.5, "seed": 1337}
    t.check_same_run({"settings": {"seed": 1337}}, now, Path("step_00000040"))
    assert "does not record lr: taking this command's values" in capsys.readouterr().out
