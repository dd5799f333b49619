"""One run per output folder: a second run into a held folder stops at once and names the holder."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import SCRIPT, TINY, assert_ok, child_env, launch

import llm_ddp_parallel_training as t


def start_long_run(out):
    cmd = [sys.executable, str(SCRIPT), *TINY, "--max-steps", "100000", "--output-dir", str(out)]
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while f"pid {proc.pid}" not in ((out / "run.lock").read_text() if (out / "run.lock").exists() else ""):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the first run never took the folder")
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGSTOP)  # paused, it keeps the lock and leaves the cores to the second run
    return proc


def test_a_second_run_into_a_held_folder_stops_at_once_naming_the_holder(tmp_path):
    first = start_long_run(tmp_path)
    try:
        second = launch([*TINY, "--max-steps", "2", "--output-dir", str(tmp_path)], nproc=2, timeout=60)
    finally:
        first.kill()
        first.wait()
    errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, second.stderr
    assert f"host {socket.gethostname()}, pid {first.pid}" in errors[0]
    assert "--output-dir" in errors[0]
    assert "exitcode  : 2" in second.stderr and second.seconds < 30
    assert not (tmp_path / "tiny_transformer.pt").exists()


def test_a_killed_run_leaves_no_lock_behind(tmp_path):
    first = start_long_run(tmp_path)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert (tmp_path / "run.lock").exists()  # the file stays; the operating system's lock went with the process
    assert_ok(launch([*TINY, "--max-steps", "2", "--output-dir", str(tmp_path)]))
    # A finished run holds nothing (its model is replaced only on request).
    assert_ok(launch([*TINY, "--max-steps", "2", "--overwrite", "--output-dir", str(tmp_path)]))


def test_a_new_run_into_a_folder_holding_a_finished_model_is_refused_unless_it_resumes_or_overwrites(tmp_path):
    assert_ok(launch([*TINY, "--max-steps", "2", "--output-dir", str(tmp_path)]))
    finished = (tmp_path / "tiny_transformer.pt").read_bytes()
    run = launch([*TINY, "--max-steps", "3", "--output-dir", str(tmp_path)], nproc=2)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode != 0 and len(errors) == 1, run.stderr
    assert f"{tmp_path} already holds a finished run's model" in errors[0] and "--overwrite" in errors[0]
    assert (tmp_path / "tiny_transformer.pt").read_bytes() == finished
    resumable = tmp_path / "resumable"  # a run with checkpoints continues: its model is its own
    assert_ok(launch([*TINY, "--max-steps", "2", "--save-every", "2", "--output-dir", str(resumable)]))
    assert_ok(launch([*TINY, "--max-steps", "3", "--save-every", "2", "--output-dir", str(resumable)]))
    assert_ok(launch([*TINY, "--max-steps", "3", "--overwrite", "--output-dir", str(tmp_path)]))
    assert (tmp_path / "tiny_transformer.pt").read_bytes() != finished


def test_a_filesystem_without_locks_gets_a_warning_not_a_refusal(tmp_path, monkeypatch, capsys):
    def no_locks_here(f):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(t, "lock_file", no_locks_here)
    t.OutputLock().hold(tmp_path)
    assert "warning: cannot lock" in capsys.readouterr().out
