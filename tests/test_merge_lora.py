"""--merge-lora: a LoRA run's adapters folded into their base model as OUTPUT_DIR/merged, a plain transformers
folder that loads with no PEFT installed and computes what the base with its adapters computes; an adapter
folder merged alone, without training; and what cannot be merged, refused in one line before anything runs."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import assert_ok, child_env, run_jobs
from in_process import run_main

import llm_ddp_parallel_training as t

pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")


@pytest.fixture(scope="module")
def trained(tiny_qwen, tmp_path_factory):
    """A 2-rank LoRA run (torch's DDP) that merges its adapters at the end: a job of the shared 2-rank launch
    (conftest.run_jobs), its subject being what the run writes, not how its ranks were started."""
    out = tmp_path_factory.mktemp("merge") / "run"
    args = ["--model", "hf", "--model-name-or-path", str(tiny_qwen), "--cpu", "--output-dir", str(out),
            "--batch-size", "4", "--seq-len", "32", "--sample-tokens", "8", "--lr", "1e-2", "--max-steps", "3",
            "--merge-lora"]  # fmt: skip
    return run_jobs({"merge": args}, nproc=2, timeout=300)["merge"], out


def test_a_lora_run_with_merge_lora_writes_a_plain_transformers_folder(trained):
    run, out = trained
    assert_ok(run)
    assert f"[save] the merged model: {out / 'merged'}" in run.stdout
    files = {p.name for p in (out / "merged").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files, files
    assert "chat_template.jinja" in files, "the chat template travels with the tokenizer"
    assert not {"adapter_config.json", "adapter_model.safetensors"} & files, "merged: no adapter left"


def test_the_merged_model_computes_what_the_base_with_its_adapters_computes(trained, tiny_qwen):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, out = trained
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_qwen), out / "qwen_lora").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    # W + (alpha/r) B A folded into one fp32 weight rounds once where the adapter path adds two products:
    # the logits (|x| ~ 1) differ in their last bits only (3e-7 measured), far below what training moves.
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen).eval()
    with torch.no_grad():
        assert not torch.allclose(base(input_ids=ids).logits, got, atol=1e-5), "the adapters were merged in"


def test_the_merged_folder_loads_with_no_peft_installed(trained):
    _, out = trained
    code = ("import sys; sys.modules['peft'] = None\n"  # any import of peft now fails
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(out / 'merged')!r})\n"
            f"tok = AutoTokenizer.from_pretrained({str(out / 'merged')!r})\n"
            "print(type(m).__name__, bool(tok.chat_template))")  # fmt: skip
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=child_env())
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["Qwen2ForCausalLM", "True"]


def test_an_adapter_folder_merges_alone_without_training(trained, tmp_path, monkeypatch, capsys):
    # main() in this process (run_main): the merge is one process's work, and a launch of its own costs seconds.
    _, out = trained
    alone = run_main(["--merge-lora", str(out / "qwen_lora"), "--output-dir", str(tmp_path / "alone")], monkeypatch,
                     capsys)  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.strip() == f"[save] the merged model: {tmp_path / 'alone' / 'merged'}"
    saved = (tmp_path / "alone" / "merged" / "model.safetensors").read_bytes()
    assert saved == (out / "merged" / "model.safetensors").read_bytes(), "the same merge as at the run's end"


def test_merging_into_a_folder_that_holds_a_merge_replaces_it_and_says_so(trained, tmp_path, monkeypatch, capsys):
    _, out = trained
    stale = tmp_path / "merged" / "model.safetensors"
    stale.parent.mkdir()
    stale.write_text("an earlier merge")
    run = run_main(["--merge-lora", str(out / "qwen_lora"), "--output-dir", str(tmp_path)], monkeypatch, capsys)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"[save] the merged model (the one there replaced): {tmp_path / 'merged'}"
    assert stale.read_bytes() == (out / "merged" / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (["--merge-lora"], "--merge-lora merges the LoRA adapters this run trains: it needs --model hf and "
         "--finetune lora, or an adapter folder to merge (--merge-lora ADAPTER_DIR)"),
        (["--model", "hf", "--finetune", "full", "--merge-lora"], "--merge-lora merges the LoRA adapters this run "
         "trains: it needs --model hf and --finetune lora, or an adapter folder to merge (--merge-lora ADAPTER_DIR)"),
        (["--merge-lora", "no_such_folder"], "--merge-lora no_such_folder: no adapter_config.json there; name the "
         "folder a LoRA run wrote"),
    ],
)  # fmt: skip
def test_what_cannot_be_merged_is_refused_in_one_line(args, refusal):
    with pytest.raises(t.UsageError) as refused:
        t.parse_args(args)
    assert str(refused.value) == refusal


def test_an_adapter_folder_is_merged_by_one_process_only(trained):
    _, out = trained
    with pytest.raises(t.UsageError) as refused:
        t.parse_args(["--merge-lora", str(out / "qwen_lora"), "--nproc", "2"])
    assert str(refused.value) == "--merge-lora ADAPTER_DIR runs as one process: leave out --nproc and torchrun"


def test_an_adapter_whose_base_is_gone_fails_in_one_line_and_leaves_nothing(trained, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no hub to ask, as in a launched run
    _, out = trained
    adapter = tmp_path / "adapter"
    shutil.copytree(out / "qwen_lora", adapter)
    config = json.loads((adapter / "adapter_config.json").read_text()) | {"base_model_name_or_path": "gone/base"}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    failed = run_main(["--merge-lora", str(adapter), "--output-dir", str(tmp_path / "nothing")], monkeypatch, capsys)
    assert failed.returncode == 1
    assert failed.stderr.strip().startswith(f"error: could not merge {adapter}: ") and "\n" not in failed.stderr.strip()
    assert not (tmp_path / "nothing").exists(), "a failed merge leaves no folder behind"
