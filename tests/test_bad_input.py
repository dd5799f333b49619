"""Bad input ends every rank quickly with one clear line and a non-zero exit, never a hang."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import TINY, launch

import llm_ddp_parallel_training as t

SCRIPT_FRAME = 'llm_ddp_parallel_training.py", line'  # a traceback frame from our own code


def assert_one_clear_error(run, expected: str, nproc: int | None) -> None:
    assert run.returncode != 0, run.output
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, f"expected one error line, got:\n{run.stderr}"
    assert expected in errors[0], errors[0]
    assert SCRIPT_FRAME not in run.output, f"a traceback from the script leaked:\n{run.output}"
    assert run.seconds < 30, f"took {run.seconds:.1f}s to fail"
    if nproc:
        assert "exitcode  : 2" in run.stderr, "the ranks exit with the usage-error code"


def write(path, data: bytes):
    path.write_bytes(data)
    return str(path)


def test_missing_corpus(tmp_path):
    run = launch([*TINY, "--corpus-file", str(tmp_path / "nope.txt")], nproc=2)
    assert_one_clear_error(run, "corpus file not found", 2)


def test_empty_corpus(tmp_path):
    run = launch([*TINY, "--corpus-file", write(tmp_path / "e.txt", b"\n  \n\n")], nproc=2)
    assert_one_clear_error(run, "no non-blank lines", 2)


def test_corpus_that_is_not_utf8(tmp_path):
    run = launch([*TINY, "--corpus-file", write(tmp_path / "l1.txt", "caf\xe9 latin-1\n".encode("latin-1"))], nproc=2)
    assert_one_clear_error(run, "not valid UTF-8", 2)


def test_corpus_too_small_for_one_batch_per_rank(tmp_path):
    run = launch(
        [*TINY, "--batch-size", "8", "--corpus-file", write(tmp_path / "s.txt", b"one\ntwo\nthree\n")], nproc=2
    )
    assert_one_clear_error(run, "corpus too small", 2)


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--batch-size", "0", "--batch-size: must be a positive integer, got 0"),
        ("--max-steps", "-3", "--max-steps: must be a positive integer, got -3"),
        ("--seq-len", "0", "--seq-len: must be a positive integer, got 0"),
        ("--lr", "-1", "--lr: must be a positive number"),
        ("--n-heads", "3", "not divisible by --n-heads 3"),
    ],
)
def test_impossible_sizes_are_refused_with_a_message_naming_the_flag(flag, value, expected):
    with pytest.raises(t.UsageError, match=re.escape(expected)):
        t.parse_args([*TINY, flag, value])


def test_an_impossible_size_ends_every_rank_with_one_line():
    assert_one_clear_error(launch([*TINY, "--batch-size", "0"], nproc=2), "--batch-size: must be a positive integer", 2)


def test_a_single_process_reports_bad_input_the_same_way():
    assert_one_clear_error(
        launch([*TINY, "--max-steps", "-3"]), "--max-steps: must be a positive integer, got -3", None
    )


def test_nccl_with_cpu_flag():
    assert_one_clear_error(launch([*TINY, "--backend", "nccl"], nproc=2), "--backend nccl needs GPUs but --cpu", 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_nccl_without_cuda():
    args = [a for a in TINY if a != "--cpu"]
    assert_one_clear_error(launch([*args, "--backend", "nccl"], nproc=2), "--backend nccl needs CUDA", 2)


def test_unwritable_output_dir_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a folder should be")
    run = launch([*TINY, "--max-steps", "1", "--output-dir", str(blocker / "out")], nproc=2)
    assert_one_clear_error(run, "could not write the outputs", 2)
    assert "step " not in run.stdout
