"""benchmarks/benchmark.py cleans up after itself: its temp folder and its child processes; it
names the model it measures in full; and it reports 2 ranks against two independent 1-rank runs.

The end-to-end runs are `--smoke` runs: the smoke run that finishes measures scaling only (`--only
scaling`: the 1-rank, 2-rank and paired runs whose rows are checked; the all-reduce, start-up and
Trainer launches would triple its time and check nothing here), and every row of the full table is
checked in-process, with the measurements stubbed. The stopped runs are stopped in the first
training run, which every measurement set starts with."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, child_env

BENCHMARK = REPO / "benchmarks" / "benchmark.py"


def start_benchmark(tmp: Path, *flags: str) -> subprocess.Popen:
    # TMPDIR: the benchmark's temp folder (and torchrun's) lands in tmp, where the test can list it.
    return subprocess.Popen(
        [sys.executable, str(BENCHMARK), "--smoke", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env({"TMPDIR": str(tmp)}),
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"benchmark still running after {timeout}s\n--- stdout\n{out}\n--- stderr\n{err}")


def benchmark_folders(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("ddp-benchmark-*"))


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that name `text` (a run's output folder)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended while we looked
            continue
        if text in args:
            found.append(args)
    return found


@pytest.mark.timeout(300)
def test_smoke_run_removes_its_temp_folder(tmp_path):
    proc = start_benchmark(tmp_path, "--only", "scaling")
    out, err = finish(proc, timeout=240)
    assert proc.returncode == 0, f"--- stdout\n{out}\n--- stderr\n{err}"
    assert "| scaling, 2 ranks vs 1" in out
    assert "| 2 ranks vs the 1-rank run twice at once, same rounds (goal >= 0.97) | " in out
    assert "now removed (--keep-outputs or --out DIR keeps them)" in out
    assert benchmark_folders(tmp_path) == []


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="lists processes through /proc")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("keep", [False, True], ids=["default", "keep-outputs"])
def test_a_stopped_benchmark_ends_its_runs_and_removes_its_folder_unless_kept(tmp_path, keep):
    proc = start_benchmark(tmp_path, *(["--keep-outputs"] if keep else []))
    # Stop it while the first training run writes into the folder.
    deadline = time.monotonic() + 90
    while not any((folder / "tiny").exists() for folder in benchmark_folders(tmp_path)):
        assert proc.poll() is None, finish(proc, timeout=10)
        assert time.monotonic() < deadline, "the benchmark never started its first training run"
        time.sleep(0.2)
    (folder,) = benchmark_folders(tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc, timeout=90)
    assert proc.returncode == 128 + signal.SIGTERM, f"--- stdout\n{out}\n--- stderr\n{err}"
    assert processes_mentioning(str(folder)) == []  # its training runs ended with it
    if keep:
        assert folder.is_dir() and f"outputs so far kept in {folder}" in err
    else:
        assert benchmark_folders(tmp_path) == []


def load_benchmark():
    spec = importlib.util.spec_from_file_location("benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_pins_the_model_it_measures():
    """The README's numbers are for d 512, 8 heads, 1 layer, sequence 128, batch 16: the benchmark
    says so on every command line rather than trusting the script's defaults, which move."""
    benchmark = load_benchmark()
    cfg = benchmark.script.parse_args(["--cpu", *benchmark.TINY_MODEL])
    assert (cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.seq_len, cfg.batch_size) == (512, 8, 1, 128, 16)
    flags = {flag for flag in benchmark.TINY_MODEL if flag.startswith("--")}
    assert flags == {flag for flag in benchmark.SMOKE_MODEL if flag.startswith("--")}


def test_two_ranks_are_compared_with_the_pair_of_their_own_round():
    benchmark = load_benchmark()
    one = [{"tokens_per_sec": 100.0, "ms_forward": 1.0}, {"tokens_per_sec": 50.0, "ms_forward": 2.0}]
    two = [{"tokens_per_sec": 190.0, "ms_forward": 1.0}, {"tokens_per_sec": 90.0, "ms_forward": 3.0}]
    pair = [200.0, 90.0]  # round 2 was slow for everyone alike: its ratio is 1.0, not 90/200
    result = benchmark.scaling_summary(one, two, pair)
    assert result["rounds"]["two_vs_pair"] == [0.95, 1.0]
    assert result["two_vs_pair"] == pytest.approx(0.975)
    assert result["ratio"] == pytest.approx((1.9 + 1.8) / 2)
    assert result["pair_ratio"] == pytest.approx((2.0 + 1.8) / 2)
    assert result["pair_tokens_per_sec"] == 145.0
    assert result["two_ranks"] == {"tokens_per_sec": 140.0, "ms_forward": 2.0}


# The full run's table, row by row (at the smoke's model size, which only the gradient's MB shows).
FULL_TABLE = [
    "scaling, 2 ranks vs 1, both under torchrun and DDP (goal >= 1.8x)",
    "per step, ms, 1 rank -> 2 ranks",
    "the 1-rank run twice at once, not communicating, vs once",
    "2 ranks vs the 1-rank run twice at once, same rounds (goal >= 0.97)",
    "one all-reduce of the 0.4 MB gradient, 2 Gloo ranks alone",
    "scaling if those two were the only losses (no overlap)",
    "matmul peak, 1 thread",
    "efficiency, 1 rank (goal >= 70%)",
    "efficiency, per rank of 2",
    "start-up to first step, 1 process (goal <= 3 s)",
    "start-up to first step, 2 ranks (torchrun)",
    "LoRA vs Trainer, 2 ranks (goal >= 1.2x)",
    "loss on the same 64 training lines after training, ours vs Trainer",
    "peak memory, tiny model",
    "peak memory, Qwen2 + LoRA (tiny fixture)",
]
FULL_RESULTS = ["scaling", "allreduce_ms", "ceiling", "gemm_peak", "flops_per_token", "startup_one", "startup_two",
                "trainer", "tiny_memory"]  # fmt: skip


@pytest.fixture
def stubbed_measure(monkeypatch, tmp_path, capsys):
    """measure(only=...) with every measurement replaced by fixed numbers: the names of its table's
    rows, and results.json's keys."""
    benchmark = load_benchmark()
    speed = {"tokens_per_sec": 1000.0, "ms_forward": 1.0}
    scaling = {"one_rank": speed, "two_ranks": speed, "ratio": 1.0, "pair_ratio": 2.0, "pair_tokens_per_sec": 2000.0,
               "two_vs_pair": 0.5, "rounds": {"two_vs_pair": [0.5]}}  # fmt: skip
    trainer = {"ratio": 1.0, "ours_tokens_per_sec": 1.0, "trainer_tokens_per_sec": 1.0, "ours_loss": 1.0,
               "trainer_loss": 1.0, "base_loss": 2.0, "memory": "rank 0: 1 MiB RSS"}  # fmt: skip
    monkeypatch.setattr(benchmark, "gemm_peak", lambda *a: 1e9)
    monkeypatch.setattr(benchmark, "measure_scaling", lambda *a: scaling)
    monkeypatch.setattr(benchmark, "allreduce_ms", lambda numel: {"fp32": 1.0, "bf16": 1.0})
    monkeypatch.setattr(benchmark, "seconds_to_first_step", lambda *a: 1.0)
    monkeypatch.setattr(benchmark, "launch", lambda *a: "  peak memory rank 0: 1 MiB RSS\n")
    monkeypatch.setattr(benchmark, "compare_with_trainer", lambda *a: trainer)

    def measure(*only: str) -> tuple[list[str], list[str]]:
        capsys.readouterr()
        benchmark.measure(tmp_path, True, 1, only or benchmark.MEASUREMENTS)
        table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
        rows = [line[2:].split(" | ")[0] for line in table[1:]]  # past the header
        return rows, list(json.loads((tmp_path / "results.json").read_text()))

    return measure


def test_the_full_table_has_every_row_and_result(stubbed_measure):
    assert stubbed_measure() == (FULL_TABLE, FULL_RESULTS)


def test_only_prints_the_rows_of_the_measurements_it_names(stubbed_measure):
    rows, results = stubbed_measure("scaling")
    assert rows == [*FULL_TABLE[:4], *FULL_TABLE[6:9]]  # the scaling rows, the matmul peak and efficiency
    assert results == ["scaling", "gemm_peak", "flops_per_token"]
    # A row of two measurements needs both: without scaling, no ceiling and no 1-rank step.
    rows, results = stubbed_measure("all-reduce", "trainer")
    assert rows == [FULL_TABLE[4], *FULL_TABLE[11:13], FULL_TABLE[14]]
    assert results == ["allreduce_ms", "trainer"]
