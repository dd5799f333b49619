"""--trace-steps: every rank's steps as a Chrome trace, on one clock, and the overlap it proves.

What a trace holds does not depend on how the ranks were started: the 2-rank runs share one
launch (conftest.run_jobs, each through the script's own parse_args() and run()), and the clock
probe runs in it too (tests/probe_worker.py); the one-process run has its own.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import REPO, TINY, assert_ok, run_jobs
from probe_worker import run_jobs_with_probes

import llm_ddp_parallel_training as t

SMALL_BUCKETS = [*TINY, "--n-layers", "2", "--bucket-mb", "0.01", "--max-steps", "4", "--log-every", "1"]
PHASES = {"data", "forward", "backward", "optimizer"}


def spans_by_rank(trace: dict) -> dict[int, list[dict]]:
    ranks: dict[int, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            ranks.setdefault(e["pid"], []).append(e)
    return ranks


def steps_of(spans: list[dict]) -> dict[int, list[dict]]:
    """Each step's spans: those that start inside its "step K" span."""
    out = {}
    for s in spans:
        if s["name"].startswith("step "):
            end = s["ts"] + s["dur"]
            out[int(s["name"].split()[1])] = [x for x in spans if s["ts"] <= x["ts"] <= end and x is not s]
    return out


def backward_end(step_spans: list[dict]) -> float:
    return max(s["ts"] + s["dur"] for s in step_spans if s["name"] == "backward")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every 2-rank run of this module, and the clock probe, in one launch, in order (the resumed run
    follows the run it resumes, in the same folder). Name -> (the run, its output folder)."""
    root = tmp_path_factory.mktemp("trace")
    outs = {name: root / name.replace(" ", "_") for name in ("torch DDP", "manual DDP", "resumed")}
    for out in outs.values():
        out.mkdir()
    first = [*TINY, "--save-every", "2", "--output-dir", str(outs["resumed"])]
    jobs = {
        "torch DDP": [*SMALL_BUCKETS, "--trace-steps", "3", "--plot", "--metrics-file",
                      str(outs["torch DDP"] / "metrics.jsonl"), "--output-dir", str(outs["torch DDP"])],
        "manual DDP": [*SMALL_BUCKETS, "--ddp", "manual", "--trace-steps", "2",
                       "--output-dir", str(outs["manual DDP"])],
        "4 steps, checkpointed": [*first, "--max-steps", "4"],
        "resumed": [*first, "--max-steps", "6", "--trace-steps", "2", "--plot"],
        "clock probe": ["probe:clock"],  # no run: no folder of its own
    }  # fmt: skip
    outs["4 steps, checkpointed"], outs["clock probe"] = outs["resumed"], root
    ran = run_jobs_with_probes(jobs, nproc=2, timeout=400)
    return {name: (ran[name], outs[name]) for name in jobs}


@pytest.fixture(scope="module")
def torch_ddp(two_ranks):
    run, out = two_ranks["torch DDP"]
    assert_ok(run)
    trace = json.loads((out / "trace.json").read_text())
    return run, trace, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], out


def test_the_trace_names_one_process_per_rank(torch_ddp):
    _, trace, _, _ = torch_ddp
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}


def test_every_traced_step_holds_each_phase_and_only_the_traced_steps_appear(torch_ddp):
    _, trace, _, _ = torch_ddp
    for rank, spans in spans_by_rank(trace).items():
        steps = steps_of(spans)
        assert sorted(steps) == [1, 2, 3], rank  # --trace-steps 3 of --max-steps 4
        for k, inside in steps.items():
            assert {s["name"] for s in inside} >= PHASES, (rank, k)
            assert all(s["ph"] == "X" and s["dur"] >= 0 for s in inside)


def test_each_bucket_all_reduce_is_a_span_with_its_index_bytes_and_dtype(torch_ddp):
    _, trace, metrics, _ = torch_ddp
    for rank, spans in spans_by_rank(trace).items():
        for k, inside in steps_of(spans).items():
            buckets = [s["args"] for s in inside if s["name"] == "all-reduce"]
            assert all(set(b) == {"bucket", "bytes", "dtype"} and b["dtype"] == "float32" for b in buckets)
            sent = next(m for m in metrics if m["step"] == k)  # what the comm hook counted, logged each step
            assert len(buckets) == sent["allreduce_calls"], (rank, k)
            assert sum(b["bytes"] for b in buckets) == sent["allreduce_bytes"], (rank, k)
            assert sorted(b["bucket"] for b in buckets) == list(range(len(buckets)))
        assert max(len([s for s in inside if s["name"] == "all-reduce"]) for inside in steps_of(spans).values()) > 2


def test_with_several_buckets_an_all_reduce_starts_before_backward_ends_on_every_rank(torch_ddp):
    """The overlap DDP exists for: buckets go on the wire while backward still computes."""
    _, trace, _, _ = torch_ddp
    for rank, spans in spans_by_rank(trace).items():
        for k, inside in steps_of(spans).items():  # step 1 too: torch's DDP keeps one bucket layout (TorchDDP)
            starts = [s["ts"] for s in inside if s["name"] == "all-reduce"]
            assert min(starts) < backward_end(inside), (rank, k)


def test_step_1_sends_the_buckets_of_every_later_step_as_the_notebook_and_the_chapter_say(torch_ddp):
    _, trace, _, _ = torch_ddp
    for rank, spans in spans_by_rank(trace).items():
        sent = {k: [s for s in inside if s["name"] == "all-reduce"] for k, inside in steps_of(spans).items()}
        assert len(sent[1]) == len(sent[2]) > 1, (rank, {k: len(v) for k, v in sent.items()})
    notebook = "".join("".join(c["source"]) for c in json.loads((REPO / "ddp_walkthrough.ipynb").read_text())["cells"])
    assert "Step 1 looks like every other step" in notebook
    assert "(step 1 included: in one layout for the whole run" in (REPO / "docs" / "gradients.md").read_text()


def test_ranks_share_one_clock_so_their_steps_overlap(torch_ddp):
    # Every step opens with an all-reduce of the token counts: no rank can finish step k before
    # the others have started it, so on one clock the "step k" spans of all ranks intersect.
    _, trace, _, _ = torch_ddp
    by_rank = spans_by_rank(trace)
    for k in (1, 2, 3):
        spans = [next(s for s in by_rank[r] if s["name"] == f"step {k}") for r in (0, 1)]
        assert max(s["ts"] for s in spans) < min(s["ts"] + s["dur"] for s in spans), k


def test_the_first_traced_step_opens_with_the_ranks_start_up_not_a_sync(torch_ddp):
    _, trace, _, _ = torch_ddp
    for rank, spans in spans_by_rank(trace).items():
        steps = steps_of(spans)
        first = sorted(steps[1], key=lambda s: s["ts"])
        assert [s["name"] for s in first if s["name"] in ("data", "start-up", "sync", "forward")][:3] == [
            "data", "start-up", "forward"], rank  # fmt: skip
        assert all(s["name"] != "start-up" for k in (2, 3) for s in steps[k]), rank


def test_with_the_gradient_in_one_bucket_the_summary_says_why_nothing_hides_and_what_splits_it(two_ranks):
    run, _ = two_ranks["resumed"]
    assert_ok(run)
    hint = re.search(
        r"the gradient is one bucket, sent when backward ends: --bucket-mb ([0-9.e-]+) splits it", run.stdout
    )
    assert hint and float(hint[1]) < 30_816 * 4 / 2**20, run.stdout  # below TINY's whole gradient: it splits
    assert "one bucket" not in two_ranks["torch DDP"][0].stdout


def test_the_summary_reports_the_hidden_fraction_and_plot_draws_the_timeline(torch_ddp):
    run, _, _, out = torch_ddp
    assert "all-reduce   hidden behind backward: rank 0 " in run.stdout, run.stdout
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_manual_ddp_traces_every_bucket_it_launches(two_ranks):
    run, out = two_ranks["manual DDP"]
    assert_ok(run)
    for rank, spans in spans_by_rank(json.loads((out / "trace.json").read_text())).items():
        for k, inside in steps_of(spans).items():
            launched = sorted(s["args"]["bucket"] for s in inside if s["name"] == "all-reduce")
            assert len(launched) > 2 and launched == list(range(len(launched))), (rank, k)
            # Two or more: the last bucket always starts at the last gradient; the others overlap.
            early = [s for s in inside if s["name"] == "all-reduce" and s["ts"] < backward_end(inside)]
            assert len(early) >= 2, (rank, k)


def test_one_process_traces_its_steps_with_no_all_reduce(tmp_path):
    args = [*TINY, "--max-steps", "3", "--trace-steps", "2", "--output-dir", str(tmp_path)]
    run = run_jobs({"one process": args})["one process"]  # a job of a shared launch of one plain process
    assert_ok(run)
    spans = spans_by_rank(json.loads((tmp_path / "trace.json").read_text()))
    assert list(spans) == [0]
    assert sorted(steps_of(spans[0])) == [1, 2]
    assert not [s for s in spans[0] if s["name"] == "all-reduce"]
    assert "none (one process: nothing to synchronise)" in run.stdout


def test_clock_alignment_recovers_a_skew_between_ranks(two_ranks):
    # tests/probe_worker.py's clock probe: the offsets of the ranks' clocks on one machine, then
    # with rank r's clock set r x 1000 s ahead.
    run, _ = two_ranks["clock probe"]
    assert_ok(run)
    found = {kind: [float(v) for v in values] for kind, *values in (line.split() for line in run.stdout.splitlines())}
    assert found["SKEWED"][0] == 0.0
    assert found["SKEWED"][1] == pytest.approx(-1000.0, abs=0.005)  # within 5 ms
    assert abs(found["SAME_MACHINE"][1]) < 0.005  # one machine, one monotonic clock: about 0


def test_hidden_fraction_counts_in_flight_time_under_backward_once():
    spans = [
        ("backward", 0.0, 10.0, {}),
        ("all-reduce", 4.0, 8.0, {}),  # hidden
        ("all-reduce", 6.0, 12.0, {}),  # overlaps the first: 8..10 hidden, 10..12 waited for
        ("backward", 20.0, 30.0, {}),
    ]
    assert t.hidden_fraction(spans) == pytest.approx(6 / 8)
    assert t.hidden_fraction([("backward", 0.0, 1.0, {})]) is None


def test_a_resumed_run_traces_its_own_first_steps(two_ranks):
    assert_ok(two_ranks["4 steps, checkpointed"][0])
    run, out = two_ranks["resumed"]
    assert_ok(run)
    for spans in spans_by_rank(json.loads((out / "trace.json").read_text())).values():
        assert sorted(steps_of(spans)) == [5, 6]
    assert (out / "timeline.png").exists()


def test_collected_spans_move_onto_rank_0s_clock():
    d = t.Dist(0, 0, 1, 1, torch.device("cpu"), None, "one process")
    timeline = t.Timeline(1, d.device)
    timeline.spans = [("forward", 1.0, 2.0, {})]
    assert t.collect_trace(d, timeline, [5.0]) == [[("forward", 6.0, 7.0, {})]]


def test_the_timeline_picture_labels_every_step_and_titles_each_ranks_hidden_share():
    plt = t.import_pyplot()
    steps = [("step 1", 0.0, 1.0, {}), ("backward", 0.2, 0.8, {}), ("step 2", 1.0, 2.0, {}), ("backward", 1.2, 1.8, {})]
    ranks = [
        [*steps, ("all-reduce", 0.6, 0.8, {}), ("all-reduce", 1.7, 1.9, {})],  # rank 0: 3 of 4 tenths hidden
        [*steps, ("all-reduce", 0.8, 1.0, {}), ("all-reduce", 1.8, 2.0, {})],  # rank 1: none hidden
    ]
    cfg = t.parse_args(["--cpu"])
    fig = t.timeline_figure(plt, cfg, ranks)
    ax = fig.axes[0]
    assert [text.get_text().strip() for text in ax.texts] == ["step 1", "step 2"]
    assert "hidden behind backward: rank 0 75%, rank 1 0%" in ax.get_title()
    assert t.hidden_shares(ranks) in t.describe_overlap(ranks), "the title and the summary give the same shares"
    plt.close(fig)
