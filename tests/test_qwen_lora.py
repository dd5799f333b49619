"""Qwen2 + LoRA under DDP, offline, on a tiny random model with the real Qwen2 architecture."""

from __future__ import annotations

import json
import resource
import subprocess

import pytest
import torch
from conftest import assert_ok, child_env, launch, run_cmd, torchrun_cmd

import llm_ddp_parallel_training as t

peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")


def qwen_args(model_dir, out_dir, *extra: str) -> list[str]:
    return [
        "--model", "qwen", "--model-name-or-path", str(model_dir), "--cpu", "--output-dir", str(out_dir),
        "--batch-size", "4", "--seq-len", "32", "--sample-tokens", "8", "--lr", "1e-2", *extra,
    ]  # fmt: skip


def saved_adapter(out_dir) -> tuple[dict, dict[str, torch.Tensor]]:
    folder = out_dir / "qwen_lora"
    config = json.loads((folder / "adapter_config.json").read_text())
    return config, safetensors_torch.load_file(folder / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def two_rank_runs(tiny_qwen, tmp_path_factory) -> dict[str, tuple]:
    """The same 2-rank LoRA run through torch's DDP and through the from-scratch one."""
    runs = {}
    for ddp in ("torch", "manual"):
        out = tmp_path_factory.mktemp(f"qwen_{ddp}")
        flags = ["--max-steps", "4", "--log-every", "2", "--ddp", ddp, "--grad-accum-steps", "2", "--verify-sync", "1"]
        run = launch(qwen_args(tiny_qwen, out, *flags, "--optimizer", "sgd", "--lr", "0.5"), nproc=2)
        assert_ok(run)
        runs[ddp] = (run, out)
    return runs


def test_two_ranks_train_the_adapters_and_save_them_in_peft_format(two_rank_runs):
    run, out = two_rank_runs["torch"]
    assert "trainable of" in run.stdout and "%)" in run.stdout
    config, weights = saved_adapter(out)
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["lora_dropout"] == 0.05
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert weights and all("lora_" in k and not k.startswith("module.") for k in weights)
    lora_b = {k: v for k, v in weights.items() if "lora_B" in k}
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b.values()), "every lora_B must move off zero"
    assert (out / "qwen_lora" / "tokenizer_config.json").exists()
    assert "[sample] Each rank" in run.stdout


def test_only_the_adapter_gradients_travel(two_rank_runs):
    run, out = two_rank_runs["torch"]
    _, weights = saved_adapter(out)
    adapter_mb = sum(w.numel() * 4 for w in weights.values()) / 2**20  # fp32 gradients
    assert f"all-reduced 1 bucket(s), {adapter_mb:.2f} MiB" in run.stdout


def test_manual_ddp_trains_the_same_adapters_as_torch_ddp(two_rank_runs):
    torch_weights = saved_adapter(two_rank_runs["torch"][1])[1]
    manual_weights = saved_adapter(two_rank_runs["manual"][1])[1]
    assert all(torch.equal(torch_weights[k], manual_weights[k]) for k in torch_weights)


def test_gradient_checkpointing_under_ddp_still_trains_the_adapters(tiny_qwen, tmp_path):
    run = launch(qwen_args(tiny_qwen, tmp_path, "--max-steps", "3", "--gradient-checkpointing"), nproc=1)
    assert_ok(run)
    _, weights = saved_adapter(tmp_path)
    assert all(v.abs().sum() > 0 for k, v in weights.items() if "lora_B" in k)


def test_saved_adapter_reloads_with_the_trained_logits_and_the_base_is_untouched(tiny_qwen, tmp_path, corpus_lines):
    from transformers import AutoModelForCausalLM

    cfg = t.parse_args(qwen_args(tiny_qwen, tmp_path, "--max-steps", "4"))
    d = t.setup_distributed(cfg)  # one plain process
    kit = t.build_pretrained_kit(cfg, d, [t.Record(text=line) for line in corpus_lines], [])
    base_before = {k: v.clone() for k, v in kit.model.named_parameters() if not v.requires_grad}
    t.train(cfg, d, kit, resume=None, settings=t.run_settings(cfg, d, kit))
    kit.save_final(kit.model, 4)

    assert all(torch.equal(base_before[k], v) for k, v in kit.model.named_parameters() if not v.requires_grad), (
        "frozen base weights changed"
    )
    batch = kit.train.inputs[:3]
    kit.model.eval()
    with torch.no_grad():
        trained = kit.model(input_ids=batch).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_qwen)
        again = peft.PeftModel.from_pretrained(base, tmp_path / "qwen_lora").eval()(input_ids=batch).logits
    print(f"adapter round trip: max |logit difference| = {(trained - again).abs().max().item():.3g}")
    assert torch.equal(trained, again)


@pytest.mark.parametrize("name, nproc", [("Qwen/Qwen2.5-0.5B-Instructt", 2), ("{tmp}/no_such_model", None)])
def test_a_model_that_cannot_be_loaded_stops_every_rank_with_one_line(tmp_path, name, nproc):
    name = name.format(tmp=tmp_path)
    run = launch(qwen_args(name, tmp_path), nproc=nproc)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "cannot load model" in errors[0] and name in errors[0], run.stderr
    assert 'llm_ddp_parallel_training.py", line' not in run.output
    assert run.seconds < 60


def test_lora_targets_the_model_lacks_are_named_with_the_layers_it_has(tiny_qwen, tmp_path):
    run = launch(qwen_args(tiny_qwen, tmp_path, "--lora-targets", "q_proj,query_key_value"))
    assert run.returncode == 2
    assert "--lora-targets query_key_value not found" in run.stderr
    # The output head is marked: pasting the list would adapt it too, which all-linear does not.
    assert "down_proj, gate_proj, k_proj, lm_head (the output head), o_proj, q_proj, up_proj, v_proj" in run.stderr


def test_lora_resume_after_a_killed_worker_is_bit_exact_with_dropout_on(tiny_qwen, tmp_path):
    # LoRA dropout 0.05 (the default) is on: the resumed run must draw the very masks the
    # uninterrupted one drew, on every rank.
    flags = ["--max-steps", "6", "--save-every", "2", "--log-every", "1"]
    assert_ok(launch(qwen_args(tiny_qwen, tmp_path / "whole", *flags), nproc=2))
    faulted = qwen_args(tiny_qwen, tmp_path / "faulted", *flags, "--inject-fault", "1:4")
    run = run_cmd(torchrun_cmd(2, faulted, ["--standalone", "--max-restarts=1"]), timeout=240)
    assert_ok(run)
    assert "continuing from" in run.stdout and "step_00000002 (step 2" in run.stdout
    whole, resumed = saved_adapter(tmp_path / "whole")[1], saved_adapter(tmp_path / "faulted")[1]
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_a_failed_adapter_write_on_rank_0_ends_every_rank_with_one_line(tiny_qwen, tmp_path):
    # RLIMIT_FSIZE: no file may grow past 8 KiB. The model card fits, the adapter weights do
    # not, so safetensors fails with its own error type (SafetensorError, not an OSError).
    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))

    cmd = torchrun_cmd(2, qwen_args(tiny_qwen, tmp_path, "--max-steps", "2"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), preexec_fn=limit_file_size, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0
    assert len(errors) == 1 and "could not write LoRA adapters and tokenizer" in errors[0], proc.stderr
    assert 'llm_ddp_parallel_training.py", line' not in proc.stdout + proc.stderr
