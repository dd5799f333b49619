"""benchmarks/gpu_check.py --smoke runs the GPU check's whole harness on CPU at toy sizes: every
configuration of the script trains through it (in the check's own process: on a GPU each is a torchrun launch)
and lands in the table and the JSON, TRL's rows are listed (the first one trained where trl is installed), and the
closing note says that no GPU ran it."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO, child_env, run_cmd

GPU_CHECK = REPO / "benchmarks" / "gpu_check.py"


@pytest.mark.timeout(240)
def test_smoke_run_prints_the_table_and_writes_a_record_per_configuration(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu_check

    # About 30 s on a quiet 2-core machine (ten toy runs of 2-3 s, the models built); room for a busy one.
    run = run_cmd([sys.executable, str(GPU_CHECK), "--smoke", "--out", str(tmp_path)], timeout=200, env=child_env())
    assert run.returncode == 0, run.output
    assert "| configuration | tokens/s | MFU |" in run.stdout
    assert "Not run on a GPU" in run.stdout
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["gpu"] is False
    records = {r["name"]: r for r in summary["records"]}
    assert list(records) == [c.name for c in gpu_check.CONFIGS]
    for c in gpu_check.CONFIGS:
        r = records[c.name]
        assert f"| {c.name} |" in run.stdout
        if c.trainer != "script":  # TRL's first row trains where trl is installed; the rest are timed on a GPU
            first = c == next(c for c in gpu_check.CONFIGS if c.trainer == "trl")
            reasons = ("trl not installed", "liger-kernel not installed", "timed on a GPU only (--smoke runs TRL's "
                       "first row)")  # fmt: skip
            assert (r["status"] == "ok" and first) or (r["status"] == "skipped" and r["error"] in reasons), r
        else:
            assert r["status"] == "ok", r
            speed = r["tokens_per_sec"] if c.objective == "sft" else r["pairs_per_sec"]
            assert speed > 0 and r["peak_bytes"] > 0 and r["predicted_state_bytes"] > 0
            assert r["torch"] and r["transformers"] and r["device"] == "CPU"
    heads = {(c.finetune, c.head_loss) for c in gpu_check.CONFIGS if c.trainer == "script"}
    assert {"fused", "chunked", "full"} <= {head for _, head in heads} and ("full", "chunked") in heads
    assert {c.checkpointing for c in gpu_check.CONFIGS if c.trainer != "script"} == {False, True}
    assert {c.policy for c in gpu_check.CONFIGS if c.checkpointing and c.trainer == "script"} == {"full", "selective"}
    assert "pairs/s |" in run.stdout  # the DPO row, on preference pairs
    # On a CPU --attn-implementation auto is sdpa: the varlen row runs the masked row's path, and its loss is equal.
    assert "Varlen against masked attention, step 1's loss on one batch" in summary["attention"]
    assert summary["attention"].endswith(": agree).")
    assert records[gpu_check.VARLEN]["first_loss"] == records[gpu_check.MASKED]["first_loss"]
    assert not (tmp_path / "models").exists() and not (tmp_path / "runs").exists()  # the weights are removed
