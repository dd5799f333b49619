"""An evaluation's cost stays bounded however large the corpus: --eval-examples (1,000 by default)
held-out examples, spread evenly over the held-out set and the same ones every time; 0 reads every
one, exactly. (A 200 MB corpus held out 440,000 lines, and one evaluation took more than 10 minutes.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY, assert_ok, run_jobs

import llm_ddp_parallel_training as t


def test_a_large_held_out_set_is_read_as_a_bounded_evenly_spread_sample():
    read = t.evaluated_examples(t.parse_args([]), 440_000)
    assert len(read) == 1000 and read[0] == 0 and read[-1] < 440_000
    gaps = read.diff()
    assert (gaps == 440).all(), "spread evenly: every part of the held-out set is read"


@pytest.mark.parametrize("cap", ["0", "5000"])
def test_zero_or_a_cap_above_the_held_out_set_reads_every_example(cap):
    assert torch.equal(t.evaluated_examples(t.parse_args(["--eval-examples", cap]), 1234), torch.arange(1234))


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory) -> dict[str, tuple[str, list[dict]]]:
    root = tmp_path_factory.mktemp("evaluation")
    caps = {"bounded": "4", "all": "0", "all, by a cap above the set": "100000"}
    flags = [*TINY, "--max-steps", "2", "--eval-every", "1"]
    jobs = {name: [*flags, "--eval-examples", cap, "--output-dir", str(root / name),
                   "--metrics-file", str(root / f"{name}.jsonl")] for name, cap in caps.items()}  # fmt: skip
    results = {}
    for name, run in run_jobs(jobs, nproc=2, timeout=240).items():
        assert_ok(run)
        metrics = [json.loads(line) for line in Path(root / f"{name}.jsonl").read_text().splitlines()]
        results[name] = (run.stdout, [m for m in metrics if "val_loss" in m])
    return results


def test_the_run_header_says_what_an_evaluation_reads_and_what_it_costs(evaluated):
    stdout, _ = evaluated["bounded"]
    assert "[eval] 4 of " in stdout and "held-out examples, spread evenly, every 1 steps and at the end" in stdout
    assert "% of the compute of the steps between (--eval-examples; 0 reads all)" in stdout
    assert "[eval] every held-out example" in evaluated["all"][0]


def test_the_exact_full_evaluation_is_one_flag_away(evaluated):
    names = ["bounded", "all", "all, by a cap above the set"]
    (_, bounded), (_, full), (_, capped_above) = (evaluated[name] for name in names)
    assert full[-1]["val_loss"] == capped_above[-1]["val_loss"]
    assert bounded[-1]["val_loss"] != full[-1]["val_loss"], "4 examples estimate the loss; all of them give it"
