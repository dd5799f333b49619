"""Shared helpers: launch the real script as real processes, with hard timeouts."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "llm_ddp_parallel_training.py"
sys.path.insert(0, str(REPO))

# Small and fast: the behaviour under test does not depend on model size.
TINY = ["--cpu", "--d-model", "32", "--n-heads", "2", "--n-layers", "1", "--seq-len", "64", "--batch-size", "4"]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    codes: tuple[int, ...] = ()  # every rank's exit code, for a job of a shared launch (run_jobs)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def losses(self) -> list[float]:
        return [float(x) for x in re.findall(r"^step\s+\d+/\d+ \| loss ([0-9.]+)", self.stdout, re.M)]


# The launched runs keep their token caches (the script's --cache-dir default) here, not in the
# user's ~/.cache: a test session starts with none, and leaves none behind.
CACHE_HOME = tempfile.mkdtemp(prefix="llm-ddp-test-cache-")
atexit.register(shutil.rmtree, CACHE_HOME, ignore_errors=True)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    }
    env.update(
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        XDG_CACHE_HOME=CACHE_HOME,
    )
    env.update(extra or {})
    return env


def run_cmd(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> Run:
    """Run a command in its own process group; on timeout kill the whole group and fail."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or child_env(), start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}")
    return Run(proc.returncode, out, err, time.perf_counter() - start)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, args: list[str], launcher: list[str] | None = None, script: Path = SCRIPT) -> list[str]:
    # --standalone runs a private rendezvous on a free port, so tests never collide on ports.
    launcher = launcher if launcher is not None else ["--standalone"]
    return [sys.executable, "-m", "torch.distributed.run", *launcher, f"--nproc-per-node={nproc}", str(script), *args]


def launch(args: list[str], nproc: int | None = None, timeout: float = 120, env: dict[str, str] | None = None) -> Run:
    """The script as a user runs it: a plain process (nproc=None) or torchrun with nproc ranks."""
    cmd = [sys.executable, str(SCRIPT), *args] if nproc is None else torchrun_cmd(nproc, args)
    return run_cmd(cmd, timeout, env)


class Ranks:
    """A launch of tests/worker.py that stays up (nproc ranks under torchrun, or one plain process)
    and runs one call of jobs after another: the start-up, about 5 s a launch on 2 cores, is paid
    once per pytest process instead of once per call. Its processes get the environment `env`. A
    call that fails to come back in time, or finds the launch gone, ends the launch; the next call
    starts a new one."""

    def __init__(self, nproc: int | None, env: dict[str, str]) -> None:
        self.nproc, self.env, self.proc, self.calls = nproc, env, None, 0

    def start(self, deadline: float) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="ranks-"))
        argv = [str(self.folder), str(os.getpid())]
        script = REPO / "tests" / "worker.py"
        cmd = torchrun_cmd(self.nproc, argv, script=script) if self.nproc else [sys.executable, str(script), *argv]
        self.log = open(self.folder / "log.txt", "w+")  # noqa: SIM115 (kept open while the launch lives)
        started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)  # fmt: skip
        self.calls = 0
        self.wait_for([self.folder / f"ready.rank{r}" for r in range(self.nproc or 1)], deadline, "start")
        self.start_seconds = time.perf_counter() - started

    def wait_for(self, paths: list[Path], deadline: float, what: str) -> None:
        while not all(p.exists() for p in paths):
            if self.proc.poll() is not None:
                self.fail(f"the launch ended (exit {self.proc.returncode}) during {what}")
            if time.perf_counter() > deadline:
                self.fail(f"timed out during {what}")
            time.sleep(0.02)

    def fail(self, why: str) -> None:
        self.stop()
        self.log.seek(0)
        pytest.fail(f"{self.nproc or 1} rank(s) of tests/worker.py: {why}\n--- output\n{self.log.read()}")

    def call(self, jobs: list[dict], timeout: float) -> tuple[list[dict], float]:
        """Every rank's results of one call, and how long a launch of its own would have taken (start-up
        included)."""
        started = time.perf_counter()
        if self.proc is None or self.proc.poll() is not None:
            self.start(started + timeout)
        number, self.calls = self.calls, self.calls + 1
        request = self.folder / f"call{number}.json"
        temporary = request.with_name(request.name + ".tmp")  # written whole, then renamed: never read in half
        temporary.write_text(json.dumps({"cwd": os.getcwd(), "jobs": jobs}))
        temporary.replace(request)
        self.wake()
        results = [self.folder / f"call{number}.rank{r}.json" for r in range(self.nproc or 1)]
        self.wait_for(results, started + timeout, f"call {number}")
        ranks = [json.loads(path.read_text()) for path in results]
        return ranks, self.start_seconds + time.perf_counter() - started

    def wake(self) -> None:
        """A byte into each rank's FIFO: an idle rank waits in select() on it (tests/worker.py's next_call)."""
        for r in range(self.nproc or 1):
            try:
                fd = os.open(self.folder / f"wake.rank{r}", os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # that rank has gone (ENXIO: nothing holds its FIFO open), or never came
                continue
            with contextlib.suppress(OSError):  # a full pipe holds enough bytes to wake it already
                os.write(fd, b"!")
            os.close(fd)

    def stop(self) -> None:
        if self.proc is not None:
            (self.folder / "stop").touch()
            self.wake()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None
            shutil.rmtree(self.folder, ignore_errors=True)


# This pytest process's launches that stay up, by number of ranks and environment (a test that sets a
# variable for its runs, such as a CPU capability, gets a launch of its own with it).
RANKS: dict[tuple, Ranks] = {}


@atexit.register
def stop_every_launch() -> None:
    for ranks in RANKS.values():
        ranks.stop()


def run_jobs(
    jobs: dict[str, list[str]],
    nproc: int | None = None,
    timeout: float = 240,
    worker: Path | None = None,
    fresh: bool = False,
) -> dict[str, Run]:
    """Run many command lines in one call of a launch that stays up (tests/worker.py): nproc ranks
    under torchrun, or one plain process, with the environment child_env() gives now. For tests whose
    subject is what a run does, not how it was started: each job goes through the script's own
    parse_args(), run() and error report, as under main(), or through `worker`'s run_job (a worker with
    probes built on it). fresh: a launch of these jobs alone, ended after them, for jobs that read what
    their process has held (its peak memory). Returns each job's Run: rank 0's exit code, every rank's
    in `codes`, every rank's output in rank order, and as its seconds what a launch of these jobs alone
    would have taken, start-up included."""
    runner, env = worker.stem if worker else "worker", child_env()
    key = (nproc, *sorted((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST"))  # pytest's, per test
    up = Ranks(nproc, env) if fresh else RANKS.setdefault(key, Ranks(nproc, env))
    try:
        ranks, seconds = up.call([{"name": n, "args": a, "runner": runner} for n, a in jobs.items()], timeout)
    finally:
        if fresh:
            up.stop()
    return {
        name: Run(
            ranks[0][name]["returncode"],
            "".join(rank[name]["stdout"] for rank in ranks),
            "".join(rank[name]["stderr"] for rank in ranks),
            seconds,
            tuple(rank[name]["returncode"] for rank in ranks),
        )
        for name in jobs
    }


def assert_ok(run: Run) -> None:
    assert run.returncode == 0, f"exit {run.returncode}\n--- stdout\n{run.stdout}\n--- stderr\n{run.stderr}"


# The order in which pytest -n hands out the files (pyproject.toml: --dist loadfile, each file whole to one
# pytest process for its shared launches, and --no-loadscope-reorder): the longest first, as measured on 2
# cores, so that the last file either process starts is a short one and neither waits long for the other at
# the end. (xdist's own order, the most tests first, left the few long end-to-end tests of the benchmarks and
# the notebook for last.) Files not named here follow, in their usual order.
LONGEST_FIRST = [
    "test_token_cache_runs.py",
    "test_sharding.py",
    "test_token_cache.py",
    "test_launch.py",
    "test_benchmark_harness.py",
    "test_parallelism.py",
    "test_stops.py",
    "test_chat_data.py",
    "test_more_ranks.py",
    "test_nproc.py",
    "test_recovery.py",
    "test_core_program.py",
    "test_new_user.py",
    "test_readme.py",
    "test_parallelism_resume.py",
    "test_bad_input.py",
    "test_crashes.py",
    "test_notebook.py",
    "test_qwen_lora.py",
    "test_gpu_check.py",
    "test_around_the_loop.py",
    "test_two_hosts.py",
    "test_memory_benchmark.py",
    "test_head_loss_memory.py",
    "test_faults.py",
    "test_training_features.py",
    "test_model_families.py",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    place = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))  # stable: a file's tests keep their order


@pytest.fixture(autouse=True)
def run_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """Every test, and every process it starts, works in its own temp folder: a run with the default
    --output-dir (outputs/) writes there, never into the repo, nor into another test's run when the
    tests run side by side (pytest -n 2)."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def corpus_lines() -> list[str]:
    return [line for line in (REPO / "corpus.txt").read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory, corpus_lines) -> Path:
    """A tiny random Qwen2 + BPE tokenizer on disk, built once per test session."""
    from tiny_qwen import build_tiny_qwen

    return build_tiny_qwen(tmp_path_factory.mktemp("tiny_qwen"), corpus_lines)


def split_lines(lines: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """The script's held_out split applied to a list of lines or records: (training, held out), as a run splits them."""
    import llm_ddp_parallel_training as t

    val = t.held_out(len(lines), val_fraction, seed)
    return [x for x, v in zip(lines, val, strict=True) if not v], [x for x, v in zip(lines, val, strict=True) if v]


# The tiny model's final weights, compared between runs.
Weights = dict[str, torch.Tensor]


def weights(out: Path) -> Weights:
    return torch.load(out / "tiny_transformer.pt", weights_only=True)["model"]


def checkpoint(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:08d}"


def max_difference(a: Weights, b: Weights) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_bitwise_equal(a: Weights, b: Weights, what: str = "against the uninterrupted run") -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{what}: {differ} differ, max |dweight| = {max_difference(a, b):.3g}"
