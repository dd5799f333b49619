"""A killed rank of a split model, restarted by torchrun, continues bit for bit (issue 28, item 6).

Under --tp 2 and under --pp 2 (AdamW, dropout 0.1, 2 micro-batches a step), rank 1 is killed at
step 10 (--inject-fault 1:10, SIGKILL: no cleanup); torchrun restarts both ranks, which resume from
the step-8 checkpoint. The final weights must equal those of one uninterrupted run of the same
flags bitwise: only true if every rank took back its slice or its stage of the weights and of
AdamW's moments, the data position, and the random state dropout draws from (under --tp, the
shared stream each rank's own heads' stream is seeded from).

The uninterrupted runs share one launch (conftest.run_jobs: the same weights as launches of their
own); each kill and restart is a launch of its own, with a hard timeout.
"""

from __future__ import annotations

import pytest
from conftest import TINY, assert_bitwise_equal, assert_ok, run_cmd, run_jobs, torchrun_cmd, weights

RUN = [*TINY, "--n-layers", "2", "--batch-size", "2", "--grad-accum-steps", "2", "--dropout", "0.1",
       "--max-steps", "12", "--save-every", "4", "--log-every", "2"]  # fmt: skip
LAYOUTS = {"tp": ["--tp", "2"], "pp": ["--pp", "2"]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("uninterrupted")
    jobs = {layout: [*RUN, *flags, "--output-dir", str(root / layout)] for layout, flags in LAYOUTS.items()}
    ran = run_jobs(jobs, nproc=2, timeout=240)
    for run in ran.values():
        assert_ok(run)
    return {layout: root / layout for layout in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_killed_rank_of_a_split_model_is_restarted_and_resumes_bit_exactly(uninterrupted, layout, tmp_path):
    args = [*RUN, *LAYOUTS[layout], "--output-dir", str(tmp_path), "--inject-fault", "1:10"]
    run = run_cmd(torchrun_cmd(2, args, ["--standalone", "--max-restarts=1"]), timeout=240)
    assert_ok(run)
    assert "injected 'kill' at step 10" in run.stderr
    assert "continuing from" in run.stdout and "step_00000008" in run.stdout
    assert_bitwise_equal(weights(uninterrupted[layout]), weights(tmp_path))
