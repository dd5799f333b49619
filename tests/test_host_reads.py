"""No step waits for the GPU outside the steps that report (issue 48, item 2).

On a GPU every read of a tensor's value (.item(), .tolist(), a nonzero, a boolean-mask index) makes the host
wait until the GPU has done all it was given, and the next kernels start only once the host has launched them
again. A step should queue its work and move on: the lean head's target rows come from the loader (found on
the CPU by lean_batch), and the loss and gradient norm are read at the steps that log, evaluate or save
(SideWork.read), which check the steps between them too.

These runs are real (2 Gloo ranks, tests/probe_worker.py's host_reads probe): every op of each step's device
work passes through a dispatch mode that counts those reads. With --max-steps 5 --log-every 4, steps 1, 4 and
5 log; steps 2 and 3 must read nothing (but transformers' own check, named below).
"""

from __future__ import annotations

import re

import pytest
from conftest import TINY, assert_ok
from probe_worker import run_jobs_with_probes

STEPS = ["--max-steps", "5", "--log-every", "4"]
QUIET, LOGGED = (2, 3), (1, 4, 5)


def qwen(model_dir, out, *extra: str) -> list[str]:
    return ["probe:host_reads", "--model", "qwen", "--model-name-or-path", str(model_dir), "--cpu",
            "--output-dir", str(out), "--batch-size", "4", "--seq-len", "32", *STEPS,
            *extra]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tiny_qwen, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("host_reads")
    jobs = {
        "tiny model": ["probe:host_reads", *TINY, "--output-dir", str(root / "tiny"), *STEPS],
        "LoRA, fused head": qwen(tiny_qwen, root / "lora"),
        "LoRA, chunked head": qwen(tiny_qwen, root / "chunked", "--head-loss", "chunked"),
        "full fine-tuning": qwen(tiny_qwen, root / "full", "--finetune", "full"),
        "non-finite at step 2": [*qwen(tiny_qwen, root / "nan"), "--inject-fault", "1:2:nan"],
    }
    return run_jobs_with_probes(jobs, nproc=2, timeout=300)


def reads_by_step(run) -> dict[int, list[str]]:
    found = re.findall(r"^HOST_READS step (\d+): (.*)$", run.stdout, flags=re.M)
    return {int(step): [op for op in ops.split(", ") if op] for step, ops in found}


# transformers' create_causal_mask checks, with one read per forward, whether position_ids restart within a row
# (packed examples) when no attention mask is given: transformers 5's own, skipped only under torch.compile.
TRANSFORMERS_MASK = "aten._local_scalar_dense in masking_utils.find_packed_sequence_indices"
JOBS = {"tiny model": [], "LoRA, fused head": [TRANSFORMERS_MASK], "LoRA, chunked head": [TRANSFORMERS_MASK],
        "full fine-tuning": [TRANSFORMERS_MASK]}  # fmt: skip


@pytest.mark.parametrize("job", JOBS)
def test_a_step_that_does_not_log_reads_nothing_from_the_device(runs, job):
    run = runs[job]
    assert_ok(run)
    reads = reads_by_step(run)
    assert sorted(reads) == [1, 2, 3, 4, 5], run.stdout
    assert all(reads[step] == JOBS[job] for step in QUIET), reads
    # The probe sees reads where there are some: a logging step reads the loss (the quiet steps' with it).
    assert all("Tensor.tolist in llm_ddp_parallel_training.read" in reads[step] for step in LOGGED), reads


def test_a_non_finite_step_between_logging_steps_stops_the_run_where_it_is_read(runs):
    run = runs["non-finite at step 2"]
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, run.stderr
    assert "non-finite loss or gradient norm at step 2" in errors[0], errors[0]
    assert "non-finite local loss on rank(s) [1]" in errors[0], errors[0]
    assert "every rank stopped at step 4, where it was read" in errors[0], errors[0]
    assert reads_by_step(run)[2] == [TRANSFORMERS_MASK], run.stdout  # the step itself waited for nothing of ours
