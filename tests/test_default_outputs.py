"""The seed page's two commands, one after the other, as a newcomer types them: both write into the
default outputs/, and the second keeps the first's finished model beside its own instead of refusing.
A folder the user names is still refused (tests/test_output_lock.py): there a finished model is theirs."""

from __future__ import annotations

import sys

import torch
from conftest import SCRIPT, assert_ok, run_cmd, torchrun_cmd


def test_the_seed_commands_run_one_after_the_other_into_the_default_outputs(tmp_path):
    first = run_cmd(torchrun_cmd(2, ["--model", "tiny", "--cpu", "--batch-size", "2", "--max-steps", "2"]), 120)
    assert_ok(first)
    second = run_cmd([sys.executable, str(SCRIPT), "--model", "tiny", "--cpu", "--max-steps", "2"], 120)
    assert_ok(second)
    kept = list((tmp_path / "outputs").glob("tiny_transformer.before-*.pt"))
    assert len(kept) == 1 and f"moved to {kept[0].relative_to(tmp_path)}" in second.stdout
    assert torch.load(kept[0], weights_only=True)["step"] == 2  # the first run's model, whole
    assert torch.load(tmp_path / "outputs" / "tiny_transformer.pt", weights_only=True)["step"] == 2
