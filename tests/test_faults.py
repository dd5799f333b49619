"""Faults, and what a resume decides after them: a crash mid-save, a damaged checkpoint, other
settings, a NaN, a rollback, pruning, a metrics file left by another run.

Every recovery is judged against one uninterrupted run: the final weights must be bitwise
identical (CPU, Gloo, dropout 0.1), which is only true if the resumed run continued on exactly
the examples it had not seen, with the same optimizer state and the same dropout masks.

What a resume decides (to refuse, to skip a damaged or partial checkpoint, to prune, to roll
back) does not depend on how its ranks were started: the uninterrupted run and those resumes
are jobs of a few shared launches (tests/worker.py runs each through the script's own
parse_args(), run() and report_failure(), and keeps every rank's exit code), made once for the
module by the fixtures `first` and `shared`; the crash mid-save, a kill, has a launch of its own.
Kills with torchrun's restarts: tests/test_recovery.py; stop requests: tests/test_stops.py; a
rank that fails, hangs or dies: tests/test_crashes.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import SCRIPT, TINY, assert_bitwise_equal, assert_ok, launch, run_jobs, weights
from fault_helpers import RUN


def damage(folder) -> None:
    state = folder / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])  # truncated, as by a full disk; the manifest stays


def checkpoint_names(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def files_of_each_checkpoint(out) -> dict[str, list[str]]:
    """Each step folder's files (beside them, a fault on purpose leaves the record that it fired)."""
    return {f.name: sorted(p.name for p in f.iterdir()) for f in (out / "checkpoints").iterdir() if f.is_dir()}


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> SimpleNamespace:
    """One two-rank launch: the uninterrupted run; its twin (the same job, into a folder of its own),
    then the twin's rollback to step 80; a NaN on one rank."""
    root = tmp_path_factory.mktemp("faults")
    uninterrupted, rollback = root / "uninterrupted", root / "rollback"
    step_80 = rollback / "checkpoints" / "step_00000080"
    jobs = {
        "uninterrupted": [*RUN, "--output-dir", str(uninterrupted)],
        "rollback's run": [*RUN, "--output-dir", str(rollback)],
        "rollback": [*RUN, "--output-dir", str(rollback), "--resume", str(step_80), "--max-steps", "100"],
        "nan": [*RUN, "--output-dir", str(root / "nan"), "--inject-fault", "1:2:nan"],
    }
    jobs["rollback"] += ["--save-every", "10"]
    runs = run_jobs(jobs, nproc=2, timeout=400)
    assert_ok(runs["uninterrupted"])
    assert_ok(runs["rollback's run"])
    # Noted now: the rolled-back run is continued by a later launch.
    return SimpleNamespace(root=root, uninterrupted=uninterrupted, rollback=rollback,
                           after_rollback=checkpoint_names(rollback), runs=runs)  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(first) -> Path:
    return first.uninterrupted


@pytest.fixture(scope="module")
def shared(first) -> SimpleNamespace:
    """The resumes, in three more launches.

    1. The crash mid-save (--nproc 2: a killed rank ends a launch, so it has a launch of its own).
    2. One process: resumes that must be refused, and a metrics file moved aside.
    3. Two ranks: the crashed run resumed; resumes of copies of the uninterrupted run, damaged or
       changed; the rolled-back run continued.
    Between the launches, the copies are made and damaged, and what a later job changes is noted
    first (the files the crash left).
    """
    root, uninterrupted, rollback, crash = first.root, first.uninterrupted, first.rollback, first.root / "crash"
    crashed = launch([*RUN, "--output-dir", str(crash), "--inject-fault", "0:80:save", "--nproc", "2"], timeout=280)
    assert (crash / "checkpoints").is_dir(), crashed.output  # no checkpoint at all: the launch says why
    after_crash = files_of_each_checkpoint(crash)

    def copy(name: str) -> Path:
        out = root / name
        shutil.copytree(uninterrupted, out)
        return out

    damaged = copy("damaged")
    damaged_120 = damaged / "checkpoints" / "step_00000120"
    damage(damaged_120)
    (damaged / "tiny_transformer.pt").unlink()
    newer = copy("damaged_newer")  # with a damaged folder from a longer earlier run
    shutil.copytree(newer / "checkpoints" / "step_00000120", newer / "checkpoints" / "step_00000999")
    damage(newer / "checkpoints" / "step_00000999")
    (newer / "tiny_transformer.pt").unlink()
    all_damaged = copy("all_damaged")
    for folder in (all_damaged / "checkpoints").iterdir():
        damage(folder)
    metrics = root / "metrics" / "m.jsonl"
    metrics.parent.mkdir()
    earlier_metrics = json.dumps({"step": 7, "loss": 1.0}) + "\n"
    metrics.write_text(earlier_metrics)

    one_process = {
        "damaged, named": [*RUN, "--output-dir", str(damaged), "--resume", str(damaged_120)],
        "one process": [*RUN, "--output-dir", str(copy("world_size")), "--max-steps", "200"],
        "metrics aside": [*TINY, "--max-steps", "2", "--log-every", "1", "--metrics-file", str(metrics)],
    }
    one_process["metrics aside"] += ["--output-dir", str(metrics.parent / "out")]
    runs = first.runs | run_jobs(one_process, nproc=None, timeout=400)

    changed = ["--precision", "bf16", "--grad-compression", "bf16", "--ddp", "manual", "--max-steps", "130"]
    two_ranks = {
        # The crash's own command (less --nproc): the fault fired once in that folder, and must not fire again.
        "crash resumed": [*RUN, "--output-dir", str(crash), "--inject-fault", "0:80:save"],
        "damaged": [*RUN, "--output-dir", str(damaged)],
        "damaged newer": [*RUN, "--output-dir", str(newer), "--max-steps", "200", "--keep-last", "1"],
        "rollback continued": [*RUN, "--output-dir", str(rollback), "--max-steps", "110", "--save-every", "10"],
        "all damaged": [*RUN, "--output-dir", str(all_damaged)],
        "lr": [*RUN, "--output-dir", str(copy("lr")), "--lr", "0.25", "--weight-decay", "0.1"],
        "precision": [*RUN, "--output-dir", str(copy("precision")), *changed],
    }
    runs |= run_jobs(two_ranks, nproc=2, timeout=400)
    return SimpleNamespace(
        uninterrupted=uninterrupted,
        after_rollback=first.after_rollback,
        crash=crash,
        crashed=crashed,
        after_crash=after_crash,
        damaged=damaged,
        newer=newer,
        metrics=metrics,
        earlier_metrics=earlier_metrics,
        runs=runs,
    )


def test_a_crash_during_a_checkpoint_write_never_leaves_a_loadable_partial(shared):
    assert shared.crashed.returncode != 0
    partial = shared.after_crash.get("step_00000080")  # the files of the crashed run's folder, before the resume
    assert partial is not None and "manifest.json" not in partial and "state.pt" not in partial

    resumed = shared.runs["crash resumed"]
    assert_ok(resumed)
    assert "skipping" in resumed.stdout and "step_00000080 is incomplete" in resumed.stdout
    assert "step_00000040 (step 40" in resumed.stdout
    assert "[fault]" in shared.crashed.stderr and "[fault]" not in resumed.output, "a fault fires once per folder"
    assert (shared.crash / "checkpoints" / "fault_0-80-save.fired").is_file()
    assert_bitwise_equal(weights(shared.uninterrupted), weights(shared.crash))


def test_a_damaged_checkpoint_is_refused_and_the_previous_one_is_used(shared):
    # A copy of the uninterrupted run, its step_00000120/state.pt truncated, its final model removed.
    named = shared.runs["damaged, named"]  # one process, --resume naming the damaged folder
    assert named.returncode == 2 and "step_00000120 is damaged" in named.stderr

    resumed = shared.runs["damaged"]  # then two ranks, --resume auto, in the same folder
    assert_ok(resumed)
    assert "step_00000120 is damaged" in resumed.stdout and "step_00000080 (step 80" in resumed.stdout
    assert_bitwise_equal(weights(shared.uninterrupted), weights(shared.damaged))


def test_checkpoints_are_plain_data_pruned_to_keep_last(uninterrupted):
    folders = sorted(p.name for p in (uninterrupted / "checkpoints").iterdir())
    assert folders == ["step_00000080", "step_00000120"]
    state = torch.load(uninterrupted / "checkpoints" / "step_00000120" / "state.pt", weights_only=True)
    assert state["progress"]["step"] == 120 and len(state["rng"]) == 2
    assert state["settings"]["world_size"] == 2 and "training_data_sha256" in state["settings"]
    assert set(state["trainable"]) == set(weights(uninterrupted))


def test_resuming_with_other_settings_is_refused(shared):
    run = shared.runs["one process"]  # a copy of the two-rank run, resumed by one process, --max-steps 200
    assert run.returncode == 2
    assert "cannot resume" in run.stderr and "world_size: 2 then, 1 now" in run.stderr


def test_a_non_finite_loss_on_one_rank_stops_every_rank_before_the_update(first):
    run = first.runs["nan"]
    assert run.returncode == 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, run.stderr
    assert "non-finite loss or gradient norm at step 2" in errors[0]
    assert "non-finite local loss on rank(s) [1]" in errors[0]
    assert SCRIPT.name + '", line' not in run.output


def test_a_damaged_newer_checkpoint_never_makes_pruning_delete_the_good_ones(shared):
    # A damaged folder from a longer earlier run sorts above everything this run writes. Were it
    # counted as complete, --keep-last 1 would delete each new checkpoint as soon as it was
    # written, leaving only the damaged one. (A copy of the uninterrupted run, with a damaged copy
    # of its step_00000120 as step_00000999, its final model removed; run on to 200 steps.)
    out = shared.newer
    run = shared.runs["damaged newer"]
    assert_ok(run)
    assert "step_00000999 is damaged" in run.stdout and "step_00000120 (step 120" in run.stdout
    assert checkpoint_names(out) == ["step_00000200"]
    assert [p.name for p in out.glob("checkpoints.abandoned-*/*")] == ["step_00000999"]


def test_pruning_keeps_the_newest_verified_checkpoint(uninterrupted, tmp_path):
    import llm_ddp_parallel_training as t

    out = tmp_path / "copy"
    shutil.copytree(uninterrupted, out)
    shutil.copytree(out / "checkpoints" / "step_00000120", out / "checkpoints" / "step_00000160")
    damage(out / "checkpoints" / "step_00000160")
    t.prune_checkpoints(t.parse_args([*RUN, "--output-dir", str(out), "--keep-last", "1"]))
    assert checkpoint_names(out) == ["step_00000120", "step_00000160"]  # the damaged one decides nothing


def test_a_rollback_sets_aside_the_checkpoints_it_abandons(shared):
    # The uninterrupted run's twin (the same job, into its own folder), resumed from its step 80
    # for a 100-step run saving every 10, then continued to 110 steps.
    back = shared.runs["rollback"]
    assert_ok(back)
    assert "1 checkpoint(s) after step 80 belong to the abandoned run" in back.stdout
    assert "--max-steps 100 (the checkpoint's run had 120): the schedule now spans 100 steps" in back.stdout
    assert shared.after_rollback == ["step_00000090", "step_00000100"]
    again = shared.runs["rollback continued"]
    assert_ok(again)
    assert "continuing from" in again.stdout and "step_00000100 (step 100" in again.stdout


def test_when_every_checkpoint_is_damaged_resume_auto_refuses_and_names_resume_none(shared):
    run = shared.runs["all damaged"]  # a copy of the uninterrupted run, every checkpoint damaged
    assert run.returncode != 0 and run.codes == (2, 2)  # every rank exits with the usage-error code
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "no usable checkpoint" in errors[0] and "--resume none" in errors[0], run.stderr
    assert "step " not in run.stdout


def test_resuming_with_another_learning_rate_is_refused(shared):
    run = shared.runs["lr"]  # a copy of the uninterrupted run, --lr 0.25 --weight-decay 0.1
    assert run.returncode != 0 and run.codes == (2, 2)
    assert "lr: 0.5 then, 0.25 now" in run.stderr and "weight_decay: 0.01 then, 0.1 now" in run.stderr


def test_resuming_with_another_precision_compression_or_ddp_is_refused_naming_each(shared):
    # A copy of the uninterrupted run: --precision bf16 --grad-compression bf16 --ddp manual --max-steps 130
    run = shared.runs["precision"]
    assert run.returncode != 0 and run.codes == (2, 2)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: cannot resume")]
    assert len(errors) == 1, run.stderr
    for named in ("precision: 'fp32' then, 'bf16' now", "grad_compression: 'none' then, 'bf16' now",
                  "ddp: 'torch' then, 'manual' now"):  # fmt: skip
        assert named in errors[0]
    assert "max_steps" not in errors[0], "a longer run is a free change"


@pytest.mark.parametrize("torn", [b'{"st', b'{"step": 4, "lo'])
def test_resume_tolerates_a_torn_last_metrics_line(tmp_path, torn):
    import llm_ddp_parallel_training as t

    metrics = tmp_path / "m.jsonl"
    metrics.write_bytes(b"".join(json.dumps({"step": s, "loss": 1.0}).encode() + b"\n" for s in (1, 2, 3)) + torn)
    t.prepare_metrics_file(t.parse_args([*TINY, "--metrics-file", str(metrics)]), start_step=2)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]


def test_a_fresh_run_moves_another_runs_metrics_file_aside(shared):
    metrics, earlier = shared.metrics, shared.earlier_metrics  # it held one record of another run
    run = shared.runs["metrics aside"]  # one process, 2 steps
    assert_ok(run)
    assert "held 1 record(s) of an earlier run: moved to" in run.stdout
    assert [p.read_text() for p in metrics.parent.glob("m.jsonl.before-*")] == [earlier]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]


def test_an_older_checkpoint_without_the_newer_settings_still_resumes(capsys):
    import llm_ddp_parallel_training as t

    now = {"lr": 0.5, "seed": 1337}
    t.check_same_run({"settings": {"seed": 1337}}, now, Path("step_00000040"))
    assert "does not record lr: taking this command's values" in capsys.readouterr().out
