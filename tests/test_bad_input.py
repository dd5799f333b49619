"""Bad input ends every rank quickly with one clear line and a non-zero exit, never a hang."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch
from conftest import TINY, child_env, free_port, launch, run_cmd, torchrun_cmd

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


def test_a_prompt_that_cannot_be_encoded_is_refused_before_training(tmp_path):
    # A lone surrogate: what Python makes of an argument's bytes that are not UTF-8.
    run = launch([*TINY, "--prompt", "caf\udce9", "--output-dir", str(tmp_path)])
    assert_one_clear_error(run, "--prompt cannot be encoded as UTF-8", None)
    assert run.returncode == 2 and "step " not in run.stdout


@pytest.mark.parametrize(
    "flag, value",
    [("--seed", str(2**64)), ("--seed", "-1"), ("--timeout-s", "1e300"), ("--timeout-s", "1e-9"),
     ("--bucket-mb", "1e300"), ("--bucket-mb", "nan")],
)  # fmt: skip
def test_values_that_would_break_later_are_refused_at_parse_time(flag, value):
    with pytest.raises(t.UsageError, match=re.escape(f"{flag}: must be from")):
        t.parse_args([*TINY, flag, value])


@pytest.mark.parametrize("flag", ["--d-model", "--n-layers"])
def test_a_model_too_large_for_memory_is_refused_before_allocating(flag, tmp_path):
    run = launch([*TINY, flag, str(2**40), "--output-dir", str(tmp_path)])
    assert_one_clear_error(run, "lower --d-model or --n-layers", None)
    assert run.returncode == 2


def test_the_memory_check_counts_the_tiny_models_parameters_exactly():
    config = t.TinyConfig(seq_len=64, d_model=48, n_heads=4, n_layers=3)
    assert t.tiny_parameter_count(config) == sum(p.numel() for p in t.TinyTransformer(config).parameters())


@pytest.mark.parametrize("kind", ["folder", "not json", "json without a newline"])
def test_a_metrics_file_that_is_not_one_is_refused(kind, tmp_path):
    path = tmp_path / "metrics"
    if kind == "folder":
        path.mkdir()
    else:  # another program's file; a last line without its newline is not a torn record either
        path.write_text("name,loss\nrun1,0.5\n" if kind == "not json" else '{"model": "tiny", "seed": 1}')
    run = launch([*TINY, "--max-steps", "1", "--metrics-file", str(path), "--output-dir", str(tmp_path / "out")])
    assert_one_clear_error(run, f"--metrics-file {path} is not a", None)
    assert run.returncode == 2


@pytest.mark.parametrize(
    "env, expected",
    [({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}, "inconsistent"),
     ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR or MASTER_PORT is not"),
     ({"RANK": "0"}, "incomplete or not integers"),
     ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
      "inconsistent")],
)  # fmt: skip
def test_rank_variables_set_wrongly_without_torchrun_are_refused(env, expected):
    run = launch([*TINY, "--max-steps", "1"], env=child_env(env))
    assert_one_clear_error(run, expected, None)
    assert run.returncode == 2


def test_rank_variables_without_torchrun_and_no_peer_end_with_one_line_after_the_timeout(tmp_path):
    env = child_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    run = launch([*TINY, "--max-steps", "1", "--timeout-s", "2", "--output-dir", str(tmp_path)], env=env)
    assert_one_clear_error(run, "rank 0 of 2 could not join the process group", None)
    assert "waiting up to 2 s for 2 ranks" in run.stdout


def make_checkpoint_folder(root, manifest: bytes, state: bytes):
    folder = root / "checkpoints" / "step_00000001"
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(state)
    (folder / "manifest.json").write_bytes(manifest)
    return folder


@pytest.mark.parametrize(
    "manifest, state, expected",
    [(b"[1, 2]", b"x", "is damaged: its manifest.json is not a checkpoint manifest"),
     (None, b"not a pickle at all", "matches its manifest but is not a training state this script wrote")],
)  # fmt: skip
def test_a_checkpoint_that_is_valid_on_the_surface_is_refused_with_one_line(tmp_path, manifest, state, expected):
    if manifest is None:  # the digest matches: only loading can tell
        manifest = json.dumps({"sha256": {"state.pt": hashlib.sha256(state).hexdigest()}}).encode()
    folder = make_checkpoint_folder(tmp_path, manifest, state)
    run = launch([*TINY, "--max-steps", "1", "--output-dir", str(tmp_path), "--resume", str(folder)])
    assert_one_clear_error(run, expected, None)
    assert "weights_only" not in run.output


@pytest.mark.parametrize(
    "resume, expected",
    [("autp", "autp does not exist (--resume takes auto, none, or a checkpoints/step_* folder)"),
     ("{tmp}", "is not a checkpoint folder (no manifest.json, and not named step_*)"),
     ("{tmp}/out", "holds checkpoints but is not one: name one of its step_* folders")],
)  # fmt: skip
def test_a_resume_value_that_is_no_checkpoint_says_what_it_is(tmp_path, resume, expected):
    (tmp_path / "out" / "checkpoints").mkdir(parents=True)
    run = launch([*TINY, "--max-steps", "1", "--output-dir", str(tmp_path / "out"), "--resume",
                  resume.format(tmp=tmp_path)])  # fmt: skip
    assert_one_clear_error(run, expected, None)
    assert "interrupted" not in run.output


def test_a_byte_order_mark_is_not_trained_on(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffFirst line\nSecond line\n".encode())
    assert t.read_corpus_lines(path) == ["First line", "Second line"]


def test_a_misspelt_flag_is_refused_even_when_it_is_a_prefix_of_a_real_one():
    # argparse's prefix matching would take --max-step for --max-steps and train on silently.
    for typo in ("--max-step", "--max-stpes"):
        run = launch([*TINY, typo, "3"])
        assert_one_clear_error(run, f"unrecognized arguments: {typo} 3", None)


def test_under_torchrun_the_root_cause_torchrun_reports_is_the_clear_line(tmp_path):
    run = launch([*TINY, "--corpus-file", str(tmp_path / "nope.txt")], nproc=2)
    assert_one_clear_error(run, "corpus file not found", 2)
    root_cause = run.stderr.split("Root Cause (first observed failure):")[1]
    assert f"traceback : error: corpus file not found: {tmp_path / 'nope.txt'}" in root_cause, run.stderr
    assert run.returncode == 1  # torchrun's own code for "a rank failed"; the rank's 2 is in its report


def test_under_torchrun_the_root_cause_is_the_rank_that_failed_not_one_that_lost_it():
    # torchrun looks every 3 s: by then both ranks have exited, and it must choose between their reports.
    cmd = torchrun_cmd(
        2, [*TINY, "--max-steps", "20", "--inject-fault", "1:3:raise"], ["--standalone", "--monitor-interval=3"]
    )
    run = run_cmd(cmd, 120)
    assert run.returncode == 1
    root_cause = run.stderr.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root_cause, run.stderr
    assert "injected failure on rank 1 at step 3" in root_cause


def test_bad_input_under_nproc_is_one_line_not_one_per_rank_and_the_launcher(tmp_path):
    run = launch([*TINY, "--nproc", "2", "--corpus-file", str(tmp_path / "nope.txt")], timeout=60)
    assert run.returncode == 2
    assert_one_clear_error(run, "corpus file not found", None)
