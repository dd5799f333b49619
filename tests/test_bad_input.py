"""Bad input ends every rank quickly with one clear line and a non-zero exit, never a hang.

End to end, once per boundary the report crosses: a plain process, two ranks under torchrun (and
the line torchrun shows as the root cause), the ranks of --nproc, and a process that waits for
ranks that never come. The other refusals are the same report with other words: those found at
run time are jobs of two shared launches (tests/worker.py: each job goes through the script's own
parse_args(), run() and report_failure(), and every rank's exit code is kept), one with two ranks
and one plain process; those found before any rank starts (the command line, the rank variables)
run main() in this process (tests/in_process.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys

import pytest
import torch
from conftest import TINY, child_env, free_port, launch, run_jobs
from in_process import run_main

import llm_ddp_parallel_training as t

SCRIPT_FRAME = 'llm_ddp_parallel_training.py", line'  # a traceback frame from our own code

# "Quickly", never a hang: a launch that fails at once takes 5-40 s on a loaded 2-core machine, a
# shared launch of all its jobs about as long. A rank left waiting for another would wait --timeout-s
# after its start: 300 s by default in a launch of its own, 120 s in a shared one (tests/worker.py).
# Generous bounds, and still short of those waits.
QUICK_S, QUICK_SHARED_S = 200, 110


def assert_one_clear_error(run, expected: str, nproc: int | None) -> None:
    assert run.returncode != 0, run.output
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, f"expected one error line, got:\n{run.stderr}"
    assert expected in errors[0], errors[0]
    assert SCRIPT_FRAME not in run.output, f"a traceback from the script leaked:\n{run.output}"
    assert run.seconds < (QUICK_SHARED_S if run.codes else QUICK_S), f"took {run.seconds:.1f}s to fail"
    if nproc:  # the ranks exit with the usage-error code: each rank's own, or torchrun's report of them
        if run.codes:
            assert run.codes == (2,) * nproc, run.codes
        else:
            assert "exitcode  : 2" in run.stderr, "the ranks exit with the usage-error code"


def write(path, data: bytes):
    path.write_bytes(data)
    return str(path)


def make_checkpoint_folder(root, manifest: bytes, state: bytes):
    folder = root / "checkpoints" / "step_00000001"
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(state)
    (folder / "manifest.json").write_bytes(manifest)
    return folder


def jobs_in(root, jobs: dict[str, list[str]], nproc: int | None):
    """run_jobs from `root`, the folder a relative path names (the tests' own folder is not set yet)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        return run_jobs(jobs, nproc, timeout=240)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Each refusal found at run time on two ranks, as jobs of one two-rank launch."""
    root = tmp_path_factory.mktemp("two_ranks")
    blocker = root / "file"
    blocker.write_text("a file where a folder should be")
    jobs = {
        "empty": [*TINY, "--corpus-file", write(root / "e.txt", b"\n  \n\n")],
        "latin-1": [*TINY, "--corpus-file", write(root / "l1.txt", "caf\xe9 latin-1\n".encode("latin-1"))],
        "too small": [*TINY, "--batch-size", "8", "--corpus-file", write(root / "s.txt", b"one\ntwo\nthree\n")],
        "seq-len beyond the corpus": [*TINY, "--seq-len", "100000", "--val-fraction", "0"],
        "batch size 0": [*TINY, "--batch-size", "0"],
        "unwritable": [*TINY, "--max-steps", "1", "--output-dir", str(blocker / "out")],
    }
    for name, args in jobs.items():
        if "--output-dir" not in args:
            args += ["--output-dir", str(root / name.replace(" ", "_"))]
    return jobs_in(root, jobs, nproc=2)


def metrics_file_that_is_not_one(path, kind: str) -> str:
    if kind == "folder":
        path.mkdir()
    else:  # another program's file; a last line without its newline is not a torn record either
        path.write_text("name,loss\nrun1,0.5\n" if kind == "not json" else '{"model": "tiny", "seed": 1}')
    return str(path)


NOT_METRICS = ["folder", "not json", "json without a newline"]

SURFACE_VALID = [
    (b"[1, 2]", b"x", "is damaged: its manifest.json is not a checkpoint manifest"),
    (None, b"not a pickle at all", "matches its manifest but is not a training state this script wrote"),
]

NO_CHECKPOINT = [
    ("autp", "autp does not exist (--resume takes auto, none, or a checkpoints/step_* folder)"),
    ("{tmp}", "is not a checkpoint folder (no manifest.json, and not named step_*)"),
    ("{tmp}/out", "holds checkpoints but is not one: name one of its step_* folders"),
]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Each refusal found at run time in one process, as jobs of one plain-process launch."""
    root = tmp_path_factory.mktemp("one_process")
    jobs = {}
    for flag in ("--d-model", "--n-layers"):
        jobs[f"too large {flag}"] = [*TINY, flag, str(2**40), "--output-dir", str(root / flag.lstrip("-"))]
    for kind in NOT_METRICS:
        folder = root / kind.replace(" ", "_")
        folder.mkdir()
        metrics = metrics_file_that_is_not_one(folder / "metrics", kind)
        jobs[kind] = [*TINY, "--max-steps", "1", "--metrics-file", metrics, "--output-dir", str(folder / "out")]
    for i, (manifest, state, _) in enumerate(SURFACE_VALID):
        folder = root / f"surface{i}"
        if manifest is None:  # the digest matches: only loading can tell
            manifest = json.dumps({"sha256": {"state.pt": hashlib.sha256(state).hexdigest()}}).encode()
        checkpoint = make_checkpoint_folder(folder, manifest, state)
        jobs[f"surface {i}"] = [*TINY, "--max-steps", "1", "--output-dir", str(folder), "--resume", str(checkpoint)]
    for i, (resume, _) in enumerate(NO_CHECKPOINT):
        folder = root / f"resume{i}"
        (folder / "out" / "checkpoints").mkdir(parents=True)
        jobs[f"resume {i}"] = [*TINY, "--max-steps", "1", "--output-dir", str(folder / "out"), "--resume",
                               resume.format(tmp=folder)]  # fmt: skip
    return root, jobs_in(root, jobs, nproc=None)


# End to end: one per boundary.


def test_a_single_process_reports_bad_input_the_same_way():
    run = launch([*TINY, "--max-steps", "-3"], timeout=280)
    assert_one_clear_error(run, "--max-steps: must be a positive integer, got -3", None)


def test_under_torchrun_the_root_cause_torchrun_reports_is_the_clear_line(tmp_path):
    run = launch([*TINY, "--corpus-file", str(tmp_path / "nope.txt")], nproc=2, timeout=280)
    assert_one_clear_error(run, "corpus file not found", 2)
    root_cause = run.stderr.split("Root Cause (first observed failure):")[1]
    assert f"traceback : error: corpus file not found: {tmp_path / 'nope.txt'}" in root_cause, run.stderr
    assert run.returncode == 1  # torchrun's own code for "a rank failed"; the rank's 2 is in its report


def test_bad_input_under_nproc_is_one_line_not_one_per_rank_and_the_launcher(tmp_path):
    run = launch([*TINY, "--nproc", "2", "--corpus-file", str(tmp_path / "nope.txt")], timeout=280)
    assert run.returncode == 2
    assert_one_clear_error(run, "corpus file not found", None)


def test_a_run_refused_after_taking_its_output_folder_leaves_no_folder(tmp_path):
    # An empty corpus is found once rank 0 holds the folder (run.lock): a run that wrote nothing leaves nothing.
    empty, out = write(tmp_path / "e.txt", b"\n  \n"), tmp_path / "runs" / "refused"
    run = launch([*TINY, "--nproc", "2", "--corpus-file", empty, "--output-dir", str(out)], timeout=280)
    assert_one_clear_error(run, "no non-blank lines", None)
    assert not (tmp_path / "runs").exists()


def test_rank_variables_without_torchrun_and_no_peer_end_with_one_line_after_the_timeout(tmp_path):
    env = child_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    run = launch([*TINY, "--max-steps", "1", "--timeout-s", "2", "--output-dir", str(tmp_path)], env=env, timeout=280)
    assert_one_clear_error(run, "rank 0 of 2 could not join the process group", None)
    assert "waiting up to 2 s for 2 ranks" in run.stdout


# Found at run time, on two ranks (one shared launch).


def test_empty_corpus(two_ranks):
    assert_one_clear_error(two_ranks["empty"], "no non-blank lines", 2)


def test_corpus_that_is_not_utf8(two_ranks):
    assert_one_clear_error(two_ranks["latin-1"], "not valid UTF-8", 2)


def test_corpus_too_small_for_one_batch_per_rank(two_ranks):
    assert_one_clear_error(two_ranks["too small"], "corpus too small", 2)


def test_a_seq_len_no_example_fits_is_named_as_the_cause(two_ranks):
    expected = "corpus too small: not one example of --seq-len 100000 fits in it; give a shorter --seq-len"
    assert_one_clear_error(two_ranks["seq-len beyond the corpus"], expected, 2)


def test_an_impossible_size_ends_every_rank_with_one_line(two_ranks):
    assert_one_clear_error(two_ranks["batch size 0"], "--batch-size: must be a positive integer", 2)


def test_unwritable_output_dir_fails_before_training(two_ranks):
    run = two_ranks["unwritable"]
    assert_one_clear_error(run, "could not write the outputs", 2)
    assert "step " not in run.stdout


# Found at run time, in one process (one shared launch).


@pytest.mark.parametrize("flag", ["--d-model", "--n-layers"])
def test_a_model_too_large_for_memory_is_refused_before_allocating(flag, one_process):
    run = one_process[1][f"too large {flag}"]
    assert_one_clear_error(run, "lower --d-model or --n-layers", None)
    assert run.returncode == 2


@pytest.mark.parametrize("kind", NOT_METRICS)
def test_a_metrics_file_that_is_not_one_is_refused(kind, one_process):
    root, runs = one_process
    run = runs[kind]
    assert_one_clear_error(run, f"--metrics-file {root / kind.replace(' ', '_') / 'metrics'} is not a", None)
    assert run.returncode == 2


@pytest.mark.parametrize("i, expected", [(i, expected) for i, (_, _, expected) in enumerate(SURFACE_VALID)])
def test_a_checkpoint_that_is_valid_on_the_surface_is_refused_with_one_line(one_process, i, expected):
    run = one_process[1][f"surface {i}"]
    assert_one_clear_error(run, expected, None)
    assert "weights_only" not in run.output


@pytest.mark.parametrize("i, expected", [(i, expected) for i, (_, expected) in enumerate(NO_CHECKPOINT)])
def test_a_resume_value_that_is_no_checkpoint_says_what_it_is(one_process, i, expected):
    run = one_process[1][f"resume {i}"]
    assert_one_clear_error(run, expected, None)
    assert "interrupted" not in run.output


# Found before any rank starts: main() in this process.


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


@pytest.mark.parametrize(
    "flag, value",
    [("--seed", str(2**64)), ("--seed", "-1"), ("--timeout-s", "1e300"), ("--timeout-s", "1e-9"),
     ("--bucket-mb", "1e300"), ("--bucket-mb", "nan")],
)  # fmt: skip
def test_values_that_would_break_later_are_refused_at_parse_time(flag, value):
    with pytest.raises(t.UsageError, match=re.escape(f"{flag}: must be from")):
        t.parse_args([*TINY, flag, value])


def test_a_misspelt_flag_is_refused_even_when_it_is_a_prefix_of_a_real_one(monkeypatch, capsys):
    # argparse's prefix matching would take --max-step for --max-steps and train on silently.
    for typo in ("--max-step", "--max-stpes"):
        run = run_main([*TINY, typo, "3"], monkeypatch, capsys)
        assert_one_clear_error(run, f"unrecognized arguments: {typo} 3", None)


def test_a_prompt_that_cannot_be_encoded_is_refused_before_training(tmp_path, monkeypatch, capsys):
    # A lone surrogate: what Python makes of an argument's bytes that are not UTF-8.
    run = run_main([*TINY, "--prompt", "caf\udce9", "--output-dir", str(tmp_path)], monkeypatch, capsys)
    assert_one_clear_error(run, "--prompt cannot be encoded as UTF-8", None)
    assert run.returncode == 2 and "step " not in run.stdout


# As torchrun exports them to rank 0 of two.
TORCHRUN_RANK_0 = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "TORCHELASTIC_RUN_ID": "test",
                   "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip


def test_nccl_with_cpu_flag(monkeypatch, capsys):
    run = run_main([*TINY, "--backend", "nccl"], monkeypatch, capsys, TORCHRUN_RANK_0)
    assert_one_clear_error(run, "--backend nccl needs GPUs but --cpu", None)
    assert run.returncode == 2, "the ranks exit with the usage-error code"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_nccl_without_cuda(monkeypatch, capsys):
    args = [a for a in TINY if a != "--cpu"]
    run = run_main([*args, "--backend", "nccl"], monkeypatch, capsys, TORCHRUN_RANK_0)
    assert_one_clear_error(run, "--backend nccl needs CUDA", None)
    assert run.returncode == 2, "the ranks exit with the usage-error code"


@pytest.mark.parametrize(
    "env, expected",
    [({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}, "inconsistent"),
     ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR or MASTER_PORT is not"),
     ({"RANK": "0"}, "incomplete or not integers"),
     ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
      "inconsistent")],
)  # fmt: skip
def test_rank_variables_set_wrongly_without_torchrun_are_refused(env, expected, monkeypatch, capsys):
    run = run_main([*TINY, "--max-steps", "1"], monkeypatch, capsys, env)
    assert_one_clear_error(run, expected, None)
    assert run.returncode == 2


MISSING_INPUTS = {
    "corpus file": (["--corpus-file", "{tmp}/nope.txt"], "corpus file not found: {tmp}/nope.txt"),
    "model folder": (["--model", "hf", "--model-name-or-path", "{tmp}/no_model"], "cannot load model: no folder"),
    "datasets library": (["--model", "hf", "--dataset", "someone/chats"], "not installed here: pip install datasets"),
}


@pytest.mark.parametrize("missing", MISSING_INPUTS)
def test_a_missing_input_is_refused_before_the_process_group_is_joined(missing, tmp_path, monkeypatch, capsys):
    # Rank 0 of two whose peer never comes: joining would wait --timeout-s and fail to connect instead.
    monkeypatch.setitem(sys.modules, "datasets", None)  # an import of it fails, as where it is not installed
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    flags, expected = MISSING_INPUTS[missing]
    args = ["--cpu", "--timeout-s", "2", "--output-dir", str(tmp_path / "out"), *flags]
    run = run_main([a.format(tmp=tmp_path) for a in args], monkeypatch, capsys, env)
    assert_one_clear_error(run, expected.format(tmp=tmp_path), None)
    assert run.returncode == 2 and "[connect]" not in run.output


# No process at all.


def test_the_memory_check_counts_the_tiny_models_parameters_exactly():
    config = t.TinyConfig(seq_len=64, d_model=48, n_heads=4, n_layers=3)
    assert t.tiny_parameter_count(config) == sum(p.numel() for p in t.TinyTransformer(config).parameters())


def test_a_byte_order_mark_is_not_trained_on(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffFirst line\nSecond line\n".encode())
    assert list(t.text_lines(path)) == ["First line", "Second line"]


def test_a_seq_len_beyond_the_models_context_is_refused_before_the_data_is_read(tiny_qwen):
    cfg = t.parse_args(["--model", "hf", "--model-name-or-path", str(tiny_qwen), "--seq-len", "100000"])
    one = t.Dist(0, 0, 1, 1, torch.device("cpu"), None, "one process")
    with pytest.raises(
        t.UsageError, match=r"^--seq-len 100000 is beyond \S+'s context of 512 tokens: give at most 512$"
    ):
        t.resolve_model_files(cfg, one)  # each rank's first look at the model, before the token cache is built
    assert t.resolve_model_files(t.replace(cfg, seq_len=512), one) == tiny_qwen
