"""Qwen2 + LoRA under DDP, offline, on a tiny random model with the real Qwen2 architecture: two ranks
train the adapters (through torch's DDP and the from-scratch one alike, bit for bit; with gradient
checkpointing too), only their gradients travel, they save in PEFT's format and reload with the trained
logits, and a killed worker resumes bit-exactly; a model that cannot be loaded, LoRA targets the model
lacks and a failed adapter write each end every rank with one line.

The runs whose subject is not the launch share one launch per kind (2 ranks, one plain process); the
resume after a kill and the write that a file-size limit fails keep launches of their own."""

from __future__ import annotations

import importlib.util
import json
import resource
import subprocess

import pytest
import torch
from conftest import assert_ok, child_env, run_cmd, torchrun_cmd
from shared_launch import PROMPTLY_S, Shared, error_lines, share

import llm_ddp_parallel_training as t

# Without peft (or safetensors) there is no adapter to train: this module and test_chat_data.py skip. Imported
# where used, not here: importing peft takes seconds, and every pytest process collects this module.
NEEDS_PEFT = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None or importlib.util.find_spec("safetensors") is None,
    reason="needs peft and safetensors",
)
pytestmark = NEEDS_PEFT


def qwen_args(model_dir, out_dir, *extra: str) -> list[str]:
    return [
        "--model", "qwen", "--model-name-or-path", str(model_dir), "--cpu", "--output-dir", str(out_dir),
        "--batch-size", "4", "--seq-len", "32", "--sample-tokens", "8", "--lr", "1e-2", *extra,
    ]  # fmt: skip


RESUME_FLAGS = ["--max-steps", "6", "--save-every", "2", "--log-every", "1"]
HUB_TYPO = "Qwen/Qwen2.5-0.5B-Instructt"  # a name the Hub does not have (and the tests run offline)


def saved_adapter(out_dir) -> tuple[dict, dict[str, torch.Tensor]]:
    folder = out_dir / "qwen_lora"
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    return config, load_file(folder / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def two_ranks(tiny_qwen, tmp_path_factory) -> Shared:
    """This module's 2-rank runs, in one launch: the same LoRA run through torch's DDP and through the
    from-scratch one, one with gradient checkpointing, the uninterrupted run the resume test compares
    with, and a model name the Hub cannot provide."""
    root = tmp_path_factory.mktemp("qwen_two_ranks")

    def ddp(name: str) -> list[str]:
        flags = ["--max-steps", "4", "--log-every", "2", "--ddp", name, "--grad-accum-steps", "2", "--verify-sync", "1"]
        return qwen_args(tiny_qwen, root / name, *flags, "--optimizer", "sgd", "--lr", "0.5")

    jobs = {
        "torch": ddp("torch"),
        "manual": ddp("manual"),
        "checkpointing": qwen_args(tiny_qwen, root / "checkpointing", "--max-steps", "3", "--gradient-checkpointing"),
        "whole": qwen_args(tiny_qwen, root / "whole", *RESUME_FLAGS),
        "hub_typo": qwen_args(HUB_TYPO, root / "hub_typo"),
        **head_jobs(tiny_qwen, root),
        **{f"{policy} checkpointing": qwen_args(tiny_qwen, root / f"{policy} checkpointing", "--max-steps", "6",
                                                "--log-every", "1", "--optimizer", "sgd", "--gradient-checkpointing",
                                                "--checkpoint-policy", policy)
           for policy in ("full", "selective")},  # lora-fused's run, checkpointed
    }  # fmt: skip
    return share(root, jobs, nproc=2)


def head_jobs(tiny_qwen, root) -> dict[str, list[str]]:
    """Six fp32 steps of LoRA and of full fine-tuning through each head loss (--head-loss). SGD: AdamW divides each
    gradient by its own running size, which turns rounding in a gradient near zero into a step of the full lr."""
    return {f"{finetune}-{head}": qwen_args(tiny_qwen, root / f"{finetune}-{head}", "--finetune", finetune,
                                            "--head-loss", head, "--max-steps", "6", "--log-every", "1",
                                            "--optimizer", "sgd")
            for finetune in ("lora", "full") for head in ("fused", "full")}  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tiny_qwen, tmp_path_factory) -> Shared:
    """This module's plain-process runs, in one launch: a model folder that does not exist, and LoRA
    targets the model lacks."""
    root = tmp_path_factory.mktemp("qwen_one_process")
    jobs = {
        "no_such_model": qwen_args(root / "no_such_model" / "no_such_model", root / "no_such_model"),
        "lora_targets": qwen_args(tiny_qwen, root / "lora_targets", "--lora-targets", "q_proj,query_key_value"),
        **head_jobs(tiny_qwen, root),
    }
    return share(root, jobs, nproc=None)


def test_two_ranks_train_the_adapters_and_save_them_in_peft_format(two_ranks):
    run, out = two_ranks["torch"], two_ranks.out("torch")
    assert_ok(run)
    assert "trainable of" in run.stdout and "%)" in run.stdout
    config, weights = saved_adapter(out)
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["lora_dropout"] == 0.05
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert weights and all("lora_" in k and not k.startswith("module.") for k in weights)
    lora_b = {k: v for k, v in weights.items() if "lora_B" in k}
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b.values()), "every lora_B must move off zero"
    assert (out / "qwen_lora" / "tokenizer_config.json").exists()
    assert "[sample] What does an all-reduce do?" in run.stdout  # a pretrained model's default --prompt


def test_only_the_adapter_gradients_travel(two_ranks):
    run, out = two_ranks["torch"], two_ranks.out("torch")
    _, weights = saved_adapter(out)
    adapter_mb = sum(w.numel() * 4 for w in weights.values()) / 2**20  # fp32 gradients
    assert f"all-reduced 1 bucket(s), {adapter_mb:.2f} MiB" in run.stdout


def test_manual_ddp_trains_the_same_adapters_as_torch_ddp(two_ranks):
    assert_ok(two_ranks["manual"])
    torch_weights = saved_adapter(two_ranks.out("torch"))[1]
    manual_weights = saved_adapter(two_ranks.out("manual"))[1]
    assert all(torch.equal(torch_weights[k], manual_weights[k]) for k in torch_weights)


def test_gradient_checkpointing_under_ddp_still_trains_the_adapters(two_ranks):
    assert_ok(two_ranks["checkpointing"])
    _, weights = saved_adapter(two_ranks.out("checkpointing"))
    assert all(v.abs().sum() > 0 for k, v in weights.items() if "lora_B" in k)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_gradient_checkpointing_recomputes_exactly_what_it_did_not_keep(two_ranks, policy):
    # --checkpoint-policy selective keeps the matmuls' and attention's outputs and recomputes the rest; either way
    # backward sees the same numbers a run without checkpointing kept (the recompute is deterministic on a CPU).
    checkpointed, kept = two_ranks[f"{policy} checkpointing"], two_ranks["lora-fused"]
    assert_ok(checkpointed)
    assert len(checkpointed.losses()) == 6 and checkpointed.losses() == kept.losses()
    ours, theirs = (saved_adapter(two_ranks.out(name))[1] for name in (f"{policy} checkpointing", "lora-fused"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("finetune", ["lora", "full"])
@pytest.mark.parametrize("launch", ["one_process", "two_ranks"])
def test_the_fused_head_trains_what_full_logits_train_within_1e_5(request, launch, finetune):
    runs = request.getfixturevalue(launch)
    fused, full = runs[f"{finetune}-fused"], runs[f"{finetune}-full"]
    assert_ok(fused)
    assert_ok(full)
    assert "; head loss fused" in fused.stdout and "; head loss full" in full.stdout
    assert len(fused.losses()) == 6 and fused.losses() == pytest.approx(full.losses(), rel=1e-5, abs=0)
    from safetensors.torch import load_file

    name = "qwen_lora/adapter_model.safetensors" if finetune == "lora" else "qwen_full/model.safetensors"
    a, b = (load_file(runs.out(f"{finetune}-{head}") / name) for head in ("fused", "full"))
    worst = max((a[k] - b[k]).abs().max().item() for k in b)
    print(f"{launch}, {finetune}: fused vs full logits after 6 steps, largest weight difference {worst:.2g}")
    assert a.keys() == b.keys() and worst <= 1e-5


def test_saved_adapter_reloads_with_the_trained_logits_and_the_base_is_untouched(tiny_qwen, tmp_path, corpus_lines):
    import peft
    from transformers import AutoModelForCausalLM

    cfg = t.parse_args(qwen_args(tiny_qwen, tmp_path, "--max-steps", "4"))
    d = t.laid_out(t.setup_distributed(cfg), cfg)  # one plain process, laid out as main lays it
    kit = t.build_pretrained_kit(cfg, d, [t.Record(text=line) for line in corpus_lines], [])
    base_before = {k: v.clone() for k, v in kit.model.named_parameters() if not v.requires_grad}
    t.train(cfg, d, kit)  # the loop alone, no side work (Hooks' defaults)
    kit.save_final(kit.model, 4)

    assert all(torch.equal(base_before[k], v) for k, v in kit.model.named_parameters() if not v.requires_grad), (
        "frozen base weights changed"
    )
    batch = torch.stack([kit.train[i][0] for i in range(3)])
    kit.model.eval()
    with torch.no_grad():
        trained = kit.model(input_ids=batch).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_qwen)
        again = peft.PeftModel.from_pretrained(base, tmp_path / "qwen_lora").eval()(input_ids=batch).logits
    print(f"adapter round trip: max |logit difference| = {(trained - again).abs().max().item():.3g}")
    assert torch.equal(trained, again)


def test_an_adapter_trained_on_a_relative_model_folder_loads_with_its_base_from_any_folder(
    tiny_qwen, tmp_path, monkeypatch, corpus_lines
):
    # PEFT records the base as it was loaded: here "tiny_qwen0", which from elsewhere names no folder (and
    # AutoPeftModelForCausalLM would look for it on the Hub).
    import huggingface_hub
    import peft

    monkeypatch.chdir(tiny_qwen.parent)
    cfg = t.parse_args(qwen_args(tiny_qwen.name, tmp_path / "out"))
    d = t.laid_out(t.setup_distributed(cfg), cfg)  # one plain process, laid out as main lays it
    kit = t.build_pretrained_kit(cfg, d, [t.Record(text=line) for line in corpus_lines], [])
    kit.save_final(kit.model, 0)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # offline, like the launched runs
    adapter = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "out" / "qwen_lora")
    assert adapter.peft_config["default"].base_model_name_or_path == str(tiny_qwen.resolve())


@pytest.mark.parametrize("job, nproc", [("hub_typo", 2), ("no_such_model", None)])
def test_a_model_that_cannot_be_loaded_stops_every_rank_with_one_line(two_ranks, one_process, job, nproc):
    runs = two_ranks if nproc else one_process
    run, name = runs[job], HUB_TYPO if nproc else str(runs.out(job) / job)
    assert run.returncode != 0 and run.codes == (run.returncode,) * (nproc or 1), "every rank stops"
    errors = error_lines(run)
    assert len(errors) == 1 and "cannot load model" in errors[0] and name in errors[0], run.stderr
    assert 'llm_ddp_parallel_training.py", line' not in run.output
    assert runs.seconds(job) < PROMPTLY_S


def test_lora_targets_the_model_lacks_are_named_with_the_layers_it_has(one_process):
    run = one_process["lora_targets"]
    assert run.returncode == 2
    assert "--lora-targets query_key_value not found" in run.stderr
    # The output head is marked: pasting the list would adapt it too, which all-linear does not.
    assert "down_proj, gate_proj, k_proj, lm_head (the output head), o_proj, q_proj, up_proj, v_proj" in run.stderr


def test_lora_resume_after_a_killed_worker_is_bit_exact_with_dropout_on(tiny_qwen, two_ranks, tmp_path):
    # LoRA dropout 0.05 (the default) is on: the resumed run must draw the very masks the
    # uninterrupted one ("whole", in the shared launch) drew, on every rank.
    assert_ok(two_ranks["whole"])
    faulted = qwen_args(tiny_qwen, tmp_path / "faulted", *RESUME_FLAGS, "--inject-fault", "1:4")
    run = run_cmd(torchrun_cmd(2, faulted, ["--standalone", "--max-restarts=1"]), timeout=240)
    assert_ok(run)
    assert "continuing from" in run.stdout and "step_00000002 (step 2" in run.stdout
    whole, resumed = saved_adapter(two_ranks.out("whole"))[1], saved_adapter(tmp_path / "faulted")[1]
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
