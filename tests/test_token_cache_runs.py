"""The token cache across runs and processes: a second run reuses it and trains identically; a
damaged file is rebuilt, never trained on; a build killed or stopped midway leaves nothing a later run
loads, and the next build on its machine removes a killed build's folder; two runs building the same cache
at once both succeed, also when they race for a damaged cache's place; a machine that cannot see rank 0's cache
builds its own; memory per rank does not grow with --seq-len; a disk that fills mid-build is one line
and leaves nothing; the tiny path never imports datasets.

What runs on the cache shares two plain-process launches (one_process); the kills, the concurrent
builds, the two machines, the full disk and the tiny path's imports are processes of their own; the
leftover folders and the race are build_cache called here.
What the cache holds, its key, and its refusals on two ranks: tests/test_token_cache.py."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import SCRIPT, TINY, assert_ok, child_env, free_port, run_cmd, torchrun_cmd
from shared_launch import Shared, share
from test_token_cache import cache_line, caches, hf, same_weights, varied_conversations, write_jsonl

import llm_ddp_parallel_training as t


@pytest.fixture(scope="module")
def conversations(corpus_lines) -> list[dict]:
    return varied_conversations(corpus_lines)


DAMAGES = {
    "cut_short": (lambda data: data[:-5], "holds 35194 bytes where 35199 were written"),
    "one_bit_flipped": (lambda data: data[:100] + bytes([data[100] ^ 1]) + data[101:], "fails its CRC-32 check"),
}


@dataclass(frozen=True)
class KilledBuild:
    returncode: int
    stderr: str
    left: list[str]  # what the cache folder holds once the process is gone
    args: list[str]  # its command line: a later run's


def kill_while_writing(args: list[str], cache: Path, how: signal.Signals) -> KilledBuild:
    """Start a run, and send its process group `how` once its build writes token ids."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=child_env(), start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not any((p / "ids.bin").exists() for p in cache.glob(".tokens-*.tmp-*")):
            assert time.monotonic() < deadline and proc.poll() is None, "the build never started writing"
            time.sleep(0.05)
        os.killpg(proc.pid, how)  # Ctrl-C reaches the whole process group: the pool's processes too
        _, err = proc.communicate(timeout=60)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return KilledBuild(proc.returncode, err, caches(cache), args)


@pytest.fixture(scope="module")
def killed_builds(tiny_qwen, conversations, tmp_path_factory) -> dict[signal.Signals, KilledBuild]:
    """A build killed (SIGKILL) and one stopped as Ctrl-C stops it (SIGINT) midway, each a process of
    its own; a later run on each one's cache is a job of one_process's second launch."""
    root = tmp_path_factory.mktemp("killed_builds")
    data = write_jsonl(root / "chat.jsonl", conversations * 2)  # 6,000: three chunks, two in the pool
    killed = {}
    for how in (signal.SIGKILL, signal.SIGINT):
        cache = root / f"cache_{how.name}"
        args = [*hf(tiny_qwen, "--corpus-file", str(data), "--max-steps", "1"), "--cache-dir", str(cache)]
        killed[how] = kill_while_writing(args, cache, how)
    return killed


@pytest.fixture(scope="module")
def one_process(killed_builds, tmp_path_factory) -> Shared:
    """This module's plain-process runs, in two launches of their own. Between them, each of two caches
    the first launch built is damaged (DAMAGES), and two builds are killed midway (killed_builds); the second
    launch runs on the damaged caches again, on the killed builds' caches, and a second time on the
    cache of the reuse test. Each launch starts with a run on 100,000 lines (--seq-len 128, then
    2,048): a process's peak memory is the most it ever held, so only a first run's is its own."""
    root = tmp_path_factory.mktemp("cache_one_process")
    lines = root / "lines.txt"
    lines.write_text("".join(f"line {i} of a corpus that is long enough\n" for i in range(100_000)))

    def memory_run(seq_len: int) -> list[str]:
        args = [*TINY, "--no-pack", "--seq-len", str(seq_len), "--max-steps", "1", "--val-fraction", "0"]
        return [*args, "--corpus-file", lines, "--output-dir", root / f"memory_{seq_len}", "--cache-dir", root / "c"]

    def damaged_run(damage: str, name: str) -> list[str]:
        return [*TINY, "--max-steps", "2", "--cache-dir", root / f"{damage}_cache", "--output-dir", root / name]

    def reuse_run(name: str) -> list[str]:
        return [*TINY, "--max-steps", "3", "--output-dir", root / name, "--cache-dir", root / "reuse_cache"]

    first_jobs = {"memory_128": memory_run(128), "reuse_1": reuse_run("reuse_1")}
    first_jobs |= {f"first_{d}": damaged_run(d, f"first_{d}") for d in DAMAGES}
    first = share(root, first_jobs, nproc=None, fresh=True)  # fresh: the memory run's peak is its own
    for damage, (how, _) in DAMAGES.items():
        (folder,) = (root / f"{damage}_cache").iterdir()
        stream = folder / "stream.bin"
        stream.write_bytes(how(stream.read_bytes()))
    again = {f"again_{damage}": [*damaged_run(damage, f"again_{damage}"), "--overwrite"] for damage in DAMAGES}
    second_jobs = {"memory_2048": memory_run(2048), "reuse_2": reuse_run("reuse_2"), **again}
    for how, killed in killed_builds.items():
        later = ["--max-steps", "1", "--val-fraction", "0.001", "--output-dir", root / how.name]
        second_jobs[f"later_{how.name}"] = [*killed.args, *later]
    second = share(root, second_jobs, nproc=None, timeout=480, fresh=True)
    return Shared(first.runs | second.runs, root)


# ----- built once and reused; rebuilt when damaged or left half-written -----


def test_a_second_run_reuses_the_cache_and_trains_identically(one_process):
    runs, cache = [one_process["reuse_1"], one_process["reuse_2"]], one_process.root / "reuse_cache"
    for run in runs:
        assert_ok(run)
    assert re.match(r"\[cache\] built .*bytes-\w+: 375 lines, [\d,]+ tokens in [\d.]+ s", cache_line(runs[0]))
    assert "[cache] reused" in cache_line(runs[1]) and str(cache) in cache_line(runs[1])
    assert runs[0].losses() == runs[1].losses()
    assert same_weights(
        one_process.out("reuse_1") / "tiny_transformer.pt", one_process.out("reuse_2") / "tiny_transformer.pt"
    )
    assert len(caches(cache)) == 1, caches(cache)


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_cache_file_is_rebuilt_never_trained_on(one_process, damage):
    run, said = one_process[f"again_{damage}"], DAMAGES[damage][1]
    assert_ok(one_process[f"first_{damage}"])
    assert_ok(run)
    assert f"stream.bin {said}: building it again" in run.stdout and "[cache] built" in run.stdout
    first, again = (one_process.out(f"{when}_{damage}") / "tiny_transformer.pt" for when in ("first", "again"))
    assert same_weights(first, again)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT])
def test_a_build_killed_or_stopped_midway_leaves_no_cache_that_a_later_run_loads(killed_builds, one_process, how):
    killed = killed_builds[how]
    if how == signal.SIGINT:
        assert killed.returncode == 1 and killed.stderr.count("error: ") == 1, killed.stderr
        assert "stopped by SIGINT while building the token cache, before training: nothing was written" in killed.stderr
        assert killed.left == [], "a stopped build removes its folder"
    assert not [p for p in killed.left if p.startswith("tokens-")], "nothing a later run would load"
    run = one_process[f"later_{how.name}"]
    assert_ok(run)
    assert "[cache] built" in run.stdout


# ----- processes that build at once, and machines that cannot see each other's cache -----


def test_two_runs_building_the_same_cache_at_once_both_succeed(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("".join(f"line {i}: the same words again and again, to make a corpus\n" for i in range(300_000)))
    cmds = [[sys.executable, str(SCRIPT), *TINY, "--max-steps", "2", "--corpus-file", str(path), "--val-fraction",
             "0.001", "--output-dir", str(tmp_path / f"out{k}"), "--cache-dir", str(tmp_path / "cache")]
            for k in (0, 1)]  # fmt: skip
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                              start_new_session=True) for c in cmds]  # fmt: skip
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert all("[cache] built" in out or "[cache] reused" in out for out in outputs)
    assert caches(tmp_path / "cache") == [next(iter(caches(tmp_path / "cache")))], "one cache, no leftovers"
    assert same_weights(tmp_path / "out0/tiny_transformer.pt", tmp_path / "out1/tiny_transformer.pt")


def a_small_build(sink: t.ArraySink) -> dict:
    sink.append("stream", np.frombuffer(b"\nsome text\n", dtype=np.uint8))
    return {"records": 1}


def test_the_next_build_on_a_machine_removes_the_folders_of_builds_killed_there(tmp_path):
    # A build killed outright (SIGKILL) runs no cleanup: its folder is named for its machine and process.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    host = socket.gethostname()
    left = {
        "killed here": f".tokens-0a1b.tmp-{host}-{int(gone.stdout)}",
        "alive here": f".tokens-0a1b.tmp-{host}-{os.getppid()}",  # pytest's parent lives
        "another machine's": f".tokens-0a1b.tmp-{host}-2-{int(gone.stdout)}",  # host "{host}-2"
    }
    for name in left.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "ids.bin").write_bytes(b"half a build")
    t.build_cache(t.parse_args(["--cache-dir", str(tmp_path)]), tmp_path / "bytes-0a1b", "key", a_small_build)
    assert caches(tmp_path) == sorted([left["alive here"], left["another machine's"], "bytes-0a1b"])


def test_a_leftover_named_for_this_very_process_is_removed_not_a_reason_to_fail(tmp_path):
    # In a container a restarted build often gets the PID its killed predecessor had.
    left = tmp_path / f".bytes-0a1b.tmp-{socket.gethostname()}-{os.getpid()}"
    left.mkdir()
    (left / "ids.bin").write_bytes(b"half a build")
    t.build_cache(t.parse_args(["--cache-dir", str(tmp_path)]), tmp_path / "bytes-0a1b", "key", a_small_build)
    assert caches(tmp_path) == ["bytes-0a1b"]
    assert t.cache_problem(tmp_path / "bytes-0a1b", "key") is None


def test_a_build_that_loses_the_race_for_a_damaged_caches_place_uses_the_cache_that_won(tmp_path, monkeypatch):
    cfg, cache = t.parse_args(["--cache-dir", str(tmp_path / "cache")]), tmp_path / "cache" / "bytes-0a1b"
    t.build_cache(cfg, tmp_path / "winner", "key", a_small_build)
    cache.mkdir(parents=True)
    (cache / "meta.json").write_text("damaged")
    rename = os.rename

    def another_build_finishes_between(src, dst) -> None:
        rename(src, dst)
        if Path(src) == cache:  # this build took the damaged cache aside; the other renames its cache in first
            shutil.copytree(tmp_path / "winner", cache)

    monkeypatch.setattr(t.os, "rename", another_build_finishes_between)
    t.build_cache(cfg, cache, "key", a_small_build)
    assert t.cache_problem(cache, "key") is None
    assert caches(cache.parent) == ["bytes-0a1b"], "no leftovers"


def test_a_machine_that_cannot_see_rank_0s_cache_builds_its_own(tmp_path):
    """Two "machines" (torchrun agents) whose --cache-dir default is node-local: each builds once."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = [*TINY, "--max-steps", "2", "--output-dir", str(tmp_path / "out")]
    launcher = f"--nnodes 2 --rdzv-backend c10d --rdzv-endpoint {endpoint} --rdzv-id node-local-cache".split()
    cmds = [torchrun_cmd(1, args, [*launcher, "--node-rank", str(k)]) for k in (0, 1)]
    envs = [child_env({"XDG_CACHE_HOME": str(tmp_path / f"node{k}")}) for k in (0, 1)]
    other = subprocess.Popen(cmds[1], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=envs[1],
                             start_new_session=True)  # fmt: skip
    try:
        run = run_cmd(cmds[0], timeout=120, env=envs[0])
        other_out, _ = other.communicate(timeout=60)
    finally:
        other.kill()
    assert_ok(run)
    assert other.returncode == 0, other_out
    assert (run.stdout + other_out).count("[cache] built") == 2
    for k in (0, 1):
        found = caches(tmp_path / f"node{k}" / "llm_ddp_parallel_training")
        assert len(found) == 1, found


# ----- memory per rank, a full disk, the tiny path's imports -----


def test_memory_per_rank_does_not_grow_with_seq_len(one_process):
    """100,000 lines at seq 2,048 held padded would take 3.3 GB (inputs and targets, int64)."""
    peaks = {}
    for seq_len in (128, 2048):
        assert_ok(one_process[f"memory_{seq_len}"])
        memory = json.loads((one_process.out(f"memory_{seq_len}") / "memory.json").read_text())
        peaks[seq_len] = max(rank["peak"] for rank in memory)
    assert peaks[2048] < 1.1 * peaks[128], peaks
    assert peaks[2048] < 1 << 30, peaks


def limit_file_size() -> None:  # in the child: files stop growing at 1 MB, as on a full disk
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def test_a_disk_that_fills_mid_build_is_one_line_and_leaves_nothing(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("".join(f"line {i} of a corpus bigger than the disk has room for\n" for i in range(100_000)))
    cache = tmp_path / "cache"
    cmd = [sys.executable, str(SCRIPT), *TINY, "--corpus-file", str(path), "--cache-dir", str(cache)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=60, preexec_fn=limit_file_size)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert "cannot write the token cache" in errors[0] and "File too large" in errors[0]
    assert time.perf_counter() - start < 30
    assert caches(cache) == []


def test_the_tiny_path_never_imports_datasets(tmp_path):
    args = [*TINY, "--max-steps", "1", "--output-dir", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]
    code = f"import sys, llm_ddp_parallel_training as t\nt.main({args!r})\nprint('IMPORTED', 'datasets' in sys.modules)"
    run = run_cmd([sys.executable, "-c", code], timeout=60)
    assert_ok(run)
    assert "IMPORTED False" in run.stdout
