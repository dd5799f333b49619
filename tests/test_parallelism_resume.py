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
from conftest import TINY, assert_bitwise_equal, assert_ok, checkpoint, run_cmd, run_jobs, torchrun_cmd, weights

RUN = [*TINY, "--n-layers", "2", "--batch-size", "2", "--grad-accum-steps", "2", "--dropout", "0.1",
       "--max-steps", "12", "--save-every", "4", "--keep-last", "3", "--log-every", "2"]  # fmt: skip
LAYOUTS = {"tp": ["--tp", "2"], "pp": ["--pp", "2"]}
# Into another layout from step 4, the same global batch: (flags, the checkpoint's layout). Under --tp 2 the two
# ranks are one replica and must share one dropout stream, which --verify-sync checks at every step.
ACROSS = {
    "ddp resumed by tp": (["--tp", "2", "--batch-size", "4", "--verify-sync", "1"], "ddp"),
    "pp resumed by tp": (["--tp", "2", "--verify-sync", "1"], "pp"),
    "tp resumed by ddp": (["--batch-size", "1", "--verify-sync", "1"], "tp"),
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("uninterrupted")
    jobs = {layout: [*RUN, *flags, "--output-dir", str(root / layout)] for layout, flags in LAYOUTS.items()}
    jobs["ddp"] = [*RUN, "--output-dir", str(root / "ddp")]
    for name, (flags, source) in {**ACROSS, "ddp resumed by ddp": ([], "ddp")}.items():
        jobs[name] = [*RUN, *flags, "--output-dir", str(root / name), "--resume", str(checkpoint(root / source, 4))]
    return {name: (run, root / name) for name, run in run_jobs(jobs, nproc=2, timeout=300).items()}


@pytest.mark.parametrize("name", ACROSS)
def test_a_resume_into_another_layout_seeds_its_streams_as_a_fresh_run_of_that_layout(uninterrupted, name):
    run, _ = uninterrupted[name]
    assert_ok(run)
    assert set(run.codes) == {0}, run.codes  # --verify-sync passed at every step, on every rank
    assert "every random stream (dropout) starts afresh, seeded as a fresh run of this layout seeds it" in run.stdout


def test_a_resume_into_the_same_layout_restores_each_ranks_own_stream(uninterrupted):
    run, out = uninterrupted["ddp resumed by ddp"]
    assert_ok(run)
    assert "starts afresh" not in run.stdout
    assert_bitwise_equal(weights(uninterrupted["ddp"][1]), weights(out))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_killed_rank_of_a_split_model_is_restarted_and_resumes_bit_exactly(uninterrupted, layout, tmp_path):
    args = [*RUN, *LAYOUTS[layout], "--output-dir", str(tmp_path), "--inject-fault", "1:10"]
    run = run_cmd(torchrun_cmd(2, args, ["--standalone", "--max-restarts=1"]), timeout=240)
    assert_ok(run)
    assert "injected 'kill' at step 10" in run.stderr
    assert "continuing from" in run.stdout and "step_00000008" in run.stdout
    assert_ok(uninterrupted[layout][0])
    assert_bitwise_equal(weights(uninterrupted[layout][1]), weights(tmp_path))
