"""benchmarks/memory.py --smoke runs its small plan and writes its table and figure: one table row
per (model, strategy, ranks, rank) it ran. The plan is four runs that reach every part of the
report: 1 and 2 ranks, each --sharding and each --ddp, the Qwen fixture, and a sharded strategy
against --sharding none at 2 ranks (the goal's line)."""

from __future__ import annotations

import importlib.util
import itertools
import signal
import subprocess
import sys

import pytest
from conftest import REPO, child_env

MEMORY = REPO / "benchmarks" / "memory.py"


def load_memory():
    spec = importlib.util.spec_from_file_location("memory", MEMORY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(240)
def test_smoke_run_writes_one_row_per_rank_and_the_figure(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, str(MEMORY), "--smoke", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        # Generous: 26-34 s alone on the 2-core VM, and over 60 s while a test beside it shares the cores.
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the benchmark ends its runs' ranks, then itself
        try:
            stdout, stderr = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        pytest.fail(f"memory.py --smoke still running after 180 s\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    assert proc.returncode == 0, f"--- stdout\n{stdout}\n--- stderr\n{stderr}"
    assert (out / "memory.png").read_bytes().startswith(b"\x89PNG")
    lines = (out / "memory_results.md").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("| model | strategy | ranks | rank |")))
    table = itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2 :])  # past the header
    rows = [line.split("|")[1:5] for line in table]
    memory = load_memory()
    expected = [
        (run.model, run.strategy, str(run.nproc), str(rank))
        for run in memory.plan(smoke=True)
        for rank in range(run.nproc)
    ]
    assert [tuple(cell.strip() for cell in row) for row in rows] == expected
    assert {run.nproc for run in memory.plan(smoke=True)} == {1, 2}


def test_the_smoke_plan_reaches_every_part_of_the_report():
    memory = load_memory()
    runs = memory.plan(smoke=True)
    assert {run.sharding for run in runs} == set(memory.SHARDINGS)
    assert {run.ddp for run in runs if run.nproc > 1} == {"torch", "manual"}
    assert {run.model for run in runs} == {"tiny", "qwen-full"}
    goal = [run for run in runs if memory.is_goal_run(run) and run.sharding != "none"]
    assert any(memory.Run("tiny", "none", run.ddp, 2) in runs for run in goal)
