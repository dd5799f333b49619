"""Many runs in one launch (conftest.run_jobs), and what a test reads from one of them: its output,
its folder, each rank's exit code, and how long it could have taken at most.

A launch costs seconds of start-up (Python, torch, the ranks meeting) and a tiny run well under one,
so a test module runs every configuration whose subject is not the launch itself as one job of a
shared launch, and its test functions each check one behaviour on the results.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from conftest import Run, run_jobs

SCRIPT_FRAME = 'llm_ddp_parallel_training.py", line'  # a traceback frame from the script's own code

# How soon a bad input must end a run: well below --timeout-s (300 s by default), which ranks left
# waiting for a peer that never answers would sit out, and about 4x a single launch's time to fail
# on a loaded 2-core machine (20-30 s; 80 s seen for a 3,000-record build at a load average of 16).
PROMPTLY_S = 120.0


@dataclass(frozen=True)
class Shared:
    """One launch's jobs: each job NAME wrote into root / NAME (its --output-dir, by convention)."""

    runs: dict[str, Run]
    root: Path

    def __getitem__(self, name: str) -> Run:
        return self.runs[name]

    def out(self, name: str) -> Path:
        return self.root / name

    def seconds(self, name: str) -> float:
        """At most what a launch of this job alone took: the shared launch's time, start-up included,
        less the wall time each other job printed in its summary (the jobs run one after another)."""
        others = sum(wall_seconds(run) for job, run in self.runs.items() if job != name)
        return self.runs[name].seconds - others


def share(
    root: Path, jobs: dict[str, list[str]], nproc: int | None, timeout: float = 300, fresh: bool = False
) -> Shared:
    """Run the jobs (command lines) in one call of a shared launch: nproc ranks under torchrun, or one
    plain process; fresh: in a launch of their own (conftest.run_jobs)."""
    jobs = {name: [str(a) for a in args] for name, args in jobs.items()}
    return Shared(run_jobs(jobs, nproc, timeout, fresh=fresh), root)


def wall_seconds(run: Run) -> float:
    """The wall time a finished run printed in its summary (0 for a run that printed none), rounded down."""
    printed = [float(s) for s in re.findall(r"^  wall time\s+([\d.]+) s", run.stdout, re.M)]
    return max(max(printed) - 0.05, 0.0) if printed else 0.0  # printed to 0.1 s


def error_lines(run: Run) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.startswith("error: ")]


def assert_one_clear_error(run: Run, expected: str, seconds: float, ranks: int | None) -> None:
    """The run failed with one error line that says `expected`, no traceback from the script, within
    PROMPTLY_S (`seconds`: its own time, start-up included); on `ranks` ranks, each exited with the
    usage-error code (2)."""
    assert run.returncode != 0, run.output
    errors = error_lines(run)
    assert len(errors) == 1, f"expected one error line, got:\n{run.stderr}"
    assert expected in errors[0], errors[0]
    assert SCRIPT_FRAME not in run.output, f"a traceback from the script leaked:\n{run.output}"
    assert seconds < PROMPTLY_S, f"took {seconds:.1f}s to fail"
    if ranks and run.codes:  # a job of a shared launch: every rank's own exit code
        assert run.codes == (2,) * ranks, f"the ranks exit with the usage-error code: {run.codes}"
    elif ranks:  # a launch of its own: torchrun's summary
        assert "exitcode  : 2" in run.stderr, "the ranks exit with the usage-error code"
