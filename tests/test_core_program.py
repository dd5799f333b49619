"""Two programs inside the script, each the text above a line of it, saved alone beside corpus.txt: the DDP
program (sections 1-6, above section 7's heading) and the teaching core (sections 1-8, above the banner). Each
trains under torchrun (or as one plain process) and writes the weights the full script writes; the DDP program
refuses, naming the section, the sharding and model splits that it ends before.

The core's runs are launches of their own (a program started as a user starts it is the subject); the
full script's reference runs are jobs of a shared launch (conftest.run_jobs: the weights of a launch of
their own, bit for bit)."""

from __future__ import annotations

import runpy
import shutil
import signal
import sys

import pytest
import torch
from conftest import REPO, SCRIPT, TINY, assert_ok, run_cmd, run_jobs, torchrun_cmd

import llm_ddp_parallel_training as t


def saved_alone(folder, name: str, end: str):
    """The script's text above the first line that starts with `end` (and the rule line before a heading), as
    `name` beside a copy of the shipped corpus."""
    lines = SCRIPT.read_text(encoding="utf-8").splitlines(keepends=True)
    stop = next(i for i, line in enumerate(lines) if line.startswith(end))
    stop -= lines[stop - 1].startswith("# ---")
    (folder / name).write_text("".join(lines[:stop]), encoding="utf-8")
    shutil.copy(REPO / "corpus.txt", folder / "corpus.txt")
    return folder / name


@pytest.fixture
def core(tmp_path):
    """The script's text down to the banner, as core.py."""
    return saved_alone(tmp_path, "core.py", "# =====")


@pytest.fixture
def ddp_program(tmp_path):
    """The script's text above section 7's heading, as ddp.py."""
    return saved_alone(tmp_path, "ddp.py", "# 7. Sharding:")


def weights(path):
    return torch.load(path, weights_only=True)["model"]


@pytest.mark.parametrize(
    "flags",
    [["--max-steps", "30"], [*TINY[1:], "--ddp", "manual", "--sharding", "full", "--max-steps", "12"]],
    ids=["the issue's command", "manual fsdp"],
)
def test_the_core_alone_under_torchrun_writes_the_full_scripts_weights_bit_for_bit(core, tmp_path, flags):
    alone = run_cmd(torchrun_cmd(2, ["--cpu", *flags, "--output-dir", str(tmp_path / "core")], script=core), 240)
    assert_ok(alone)
    # The full script's weights: a job of a shared launch of 2 ranks (conftest.run_jobs), its subject being
    # where the numbers land, not how the ranks were started (as test_recovery's uninterrupted run).
    full_args = ["--cpu", *flags, "--output-dir", str(tmp_path / "full"), "--val-fraction", "0"]
    assert_ok(run_jobs({"full": full_args}, nproc=2, timeout=240)["full"])
    steps = [int(line.split()[1]) for line in alone.stdout.splitlines() if line.startswith("step")]
    assert steps == list(range(1, int(flags[-1]) + 1)), "rank 0 prints every step's loss"
    mine, theirs = weights(tmp_path / "core" / t.TINY_FINAL), weights(tmp_path / "full" / t.TINY_FINAL)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert "[sample]" not in alone.stdout, "the core samples nothing: that is the full script's"


def test_the_core_alone_runs_as_one_process_and_names_what_it_leaves_to_the_full_script(core, tmp_path):
    args = [*TINY, "--max-steps", "4", "--epochs", "1", "--plot", "--output-dir", str(tmp_path / "o")]
    run = run_cmd([sys.executable, str(core), *args], timeout=120)
    assert_ok(run)
    assert run.stdout.count("| loss ") == 4, "--max-steps decides: an ignored --epochs changes nothing"
    assert "[core] ignored: --epochs, --plot; the full script, llm_ddp_parallel_training.py, does that" in run.stdout
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [t.TINY_FINAL], "no loss.png: --plot was ignored"
    model = t.load_tiny_checkpoint(tmp_path / "o" / t.TINY_FINAL)
    assert model.config.d_model == 32


DDP_FLAGS = [*TINY, "--max-steps", "6", "--dropout", "0.1"]  # dropout: each rank's own stream, as the full script's


@pytest.mark.parametrize("launch", ["one process", "torch", "manual"])
def test_the_ddp_program_alone_writes_the_full_scripts_weights_bit_for_bit(ddp_program, tmp_path, launch):
    flags = [*DDP_FLAGS, *(["--ddp", launch] if launch != "one process" else [])]
    nproc = None if launch == "one process" else 2
    args = [*flags, "--output-dir", str(tmp_path / "alone")]
    cmd = [sys.executable, str(ddp_program), *args] if nproc is None else torchrun_cmd(2, args, script=ddp_program)
    assert_ok(run_cmd(cmd, 240))
    full = [*flags, "--output-dir", str(tmp_path / "full"), "--val-fraction", "0"]
    assert_ok(run_jobs({"full": full}, nproc=nproc, timeout=240)["full"])
    mine, theirs = weights(tmp_path / "alone" / t.TINY_FINAL), weights(tmp_path / "full" / t.TINY_FINAL)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize(
    ("flags", "section"),
    [(["--sharding", "optimizer"], "7 (Sharding)"), (["--tp", "2"], "8 (Model splitting)"),
     (["--pp", "2"], "8 (Model splitting)"), (["--cp", "2"], "8 (Model splitting)")],
)  # fmt: skip
def test_the_ddp_program_refuses_a_sharding_or_split_in_one_line_naming_the_section_that_adds_it(
    ddp_program, tmp_path, flags, section, monkeypatch, capsys
):
    # In this process (runpy, as `python ddp.py` runs it): the refusal comes before any process group.
    monkeypatch.setattr(sys, "argv", [str(ddp_program), *TINY, *flags, "--output-dir", str(tmp_path / "o")])
    ctrl_c = signal.getsignal(signal.SIGINT)  # the program sets its quiet Ctrl-C as it starts: pytest's back after
    with pytest.raises(SystemExit) as refused:
        try:
            runpy.run_path(str(ddp_program), run_name="__main__")
        finally:
            signal.signal(signal.SIGINT, ctrl_c)
    assert refused.value.code == (f"error: {' '.join(flags)}: section {section} adds it, and this program ends "
                                  "before it; run llm_ddp_parallel_training.py")  # fmt: skip
    assert capsys.readouterr().out == "" and not (tmp_path / "o").exists(), "a refused run writes nothing"
