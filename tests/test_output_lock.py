"""One run per output folder: a second run into a held folder stops at once and names the holder.

The holders are real processes: one paused while it holds its folder, one killed. The runs that
meet their folders, and the runs into a folder holding a finished model, are jobs of shared
launches (tests/worker.py: each job goes through the script's own parse_args(), run() and
report_failure(), and takes and lets go of its folder's lock as a process of its own would).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from conftest import SCRIPT, TINY, assert_ok, child_env, run_jobs

import llm_ddp_parallel_training as t

# "At once": a launch that stops at once takes 5-30 s on a loaded 2-core machine, a shared launch of
# its jobs about as long. A run that waited for the folder would wait for as long as the holder held it.
AT_ONCE_S = 120


def start_long_run(out):
    cmd = [sys.executable, str(SCRIPT), *TINY, "--max-steps", "100000", "--output-dir", str(out)]
    return subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def hold_the_folder(proc, out) -> None:
    """Wait until the long run `proc` holds `out`, then pause it: it keeps the lock and leaves the cores."""
    deadline = time.monotonic() + 240  # a process's start: seconds, or a minute on a busy machine
    while f"pid {proc.pid}" not in ((out / "run.lock").read_text() if (out / "run.lock").exists() else ""):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the first run never took the folder")
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGSTOP)


@pytest.fixture(scope="module")
def lock(tmp_path_factory) -> SimpleNamespace:
    """Two long runs take a folder each (started together): one is killed, then two runs follow it
    there; the other stays paused while a second run (two ranks) tries its folder. Into another
    folder: a run that finishes, a new run (two ranks: refused), and one with --overwrite; and in a
    folder of that folder, a run with checkpoints and its continuation."""
    root = tmp_path_factory.mktemp("lock")
    held, killed, finished = root / "held", root / "killed", root / "finished"
    resumable = finished / "resumable"  # a run with checkpoints, in a folder of the finished run's folder
    holder, victim = start_long_run(held), start_long_run(killed)
    try:
        hold_the_folder(holder, held)
        hold_the_folder(victim, killed)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        lock_file_stays = (killed / "run.lock").exists()
        one = {
            "after the kill": [*TINY, "--max-steps", "2", "--output-dir", str(killed)],
            "again, overwriting": [*TINY, "--max-steps", "2", "--overwrite", "--output-dir", str(killed)],
            "finished": [*TINY, "--max-steps", "2", "--output-dir", str(finished)],
            "with checkpoints": [*TINY, "--max-steps", "2", "--save-every", "2", "--output-dir", str(resumable)],
            "continued": [*TINY, "--max-steps", "3", "--save-every", "2", "--output-dir", str(resumable)],
        }
        runs = run_jobs(one, nproc=None)
        finished_model = (finished / "tiny_transformer.pt").read_bytes()
        two = {
            "into the held folder": [*TINY, "--max-steps", "2", "--output-dir", str(held)],
            "into the finished folder": [*TINY, "--max-steps", "3", "--output-dir", str(finished)],
        }
        runs |= run_jobs(two, nproc=2)
    finally:
        for proc in (holder, victim):
            proc.kill()
            proc.wait()
    model_after_refusal = (finished / "tiny_transformer.pt").read_bytes()
    runs |= run_jobs({"overwrite": [*TINY, "--max-steps", "3", "--overwrite", "--output-dir", str(finished)]})
    return SimpleNamespace(
        held=held,
        finished=finished,
        holder_pid=holder.pid,
        lock_file_stays=lock_file_stays,
        finished_model=finished_model,
        model_after_refusal=model_after_refusal,
        runs=runs,
    )


def test_a_second_run_into_a_held_folder_stops_at_once_naming_the_holder(lock):
    second = lock.runs["into the held folder"]  # two ranks, while the paused first run holds the folder
    errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, second.stderr
    assert f"host {socket.gethostname()}, pid {lock.holder_pid}" in errors[0]
    assert "--output-dir" in errors[0]
    assert second.codes == (2, 2) and second.seconds < AT_ONCE_S  # every rank exits with the usage-error code
    assert not (lock.held / "tiny_transformer.pt").exists()


def test_a_killed_run_leaves_no_lock_behind(lock):
    assert lock.lock_file_stays  # the file stays; the operating system's lock went with the process
    assert_ok(lock.runs["after the kill"])
    # A finished run holds nothing (its model is replaced only on request).
    assert_ok(lock.runs["again, overwriting"])


def test_a_new_run_into_a_folder_holding_a_finished_model_is_refused_unless_it_resumes_or_overwrites(lock):
    assert_ok(lock.runs["finished"])
    run = lock.runs["into the finished folder"]  # two ranks
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode != 0 and len(errors) == 1, run.stderr
    assert f"{lock.finished} already holds a finished run's model" in errors[0] and "--overwrite" in errors[0]
    assert lock.model_after_refusal == lock.finished_model
    # A run with checkpoints continues: its model is its own.
    assert_ok(lock.runs["with checkpoints"])
    assert_ok(lock.runs["continued"])
    assert_ok(lock.runs["overwrite"])
    assert (lock.finished / "tiny_transformer.pt").read_bytes() != lock.finished_model


def test_a_filesystem_without_locks_gets_a_warning_not_a_refusal(tmp_path, monkeypatch, capsys):
    def no_locks_here(f):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(t, "lock_file", no_locks_here)
    t.OutputLock().hold(tmp_path)
    assert "warning: cannot lock" in capsys.readouterr().out


def test_a_run_that_wrote_nothing_leaves_neither_its_lock_nor_the_folders_it_made(tmp_path):
    lock = t.OutputLock()
    lock.hold(tmp_path / "runs" / "x")
    lock.release()
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_existed_before_or_holds_anything_else_stays(tmp_path):
    existed, written = tmp_path / "existed", tmp_path / "written"
    existed.mkdir()
    for folder in (existed, written):
        lock = t.OutputLock()
        lock.hold(folder)
        if folder == written:
            (written / "metrics.jsonl").write_text("{}\n")
        lock.release()
    assert list(existed.iterdir()) == [] and sorted(p.name for p in written.iterdir()) == ["metrics.jsonl", "run.lock"]


def test_a_lock_taken_on_a_run_lock_that_a_releasing_run_just_removed_is_taken_again_on_the_new_one(
    tmp_path, monkeypatch
):
    lock, taken, real = t.OutputLock(), [], t.lock_file

    def released_meanwhile(f) -> None:
        if not taken:  # between this run's open and its lock, a run that wrote nothing removed run.lock
            (tmp_path / "run.lock").unlink()
        taken.append(f)
        real(f)

    monkeypatch.setattr(t, "lock_file", released_meanwhile)
    lock.hold(tmp_path)
    try:
        assert len(taken) == 2, f"lock attempts: {taken}"
        assert os.path.samestat(os.fstat(lock.file.fileno()), os.stat(tmp_path / "run.lock"))
    finally:
        lock.file.close()
