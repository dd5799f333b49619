"""Peak memory of the loss's forward + backward through each --head-loss: full logits, chunked, fused.

A Qwen2 with Qwen2.5's 151,936-token vocabulary and a small body (hidden 64, one layer, random
weights, built offline, the head tied to the embedding), LoRA r 8 on q_proj,v_proj, then full
fine-tuning (every weight, the head's too), a batch of 2 x 1,024 tokens, every position a target
(2,048 targets). Each path runs in a fresh process; the number is the growth of its peak
resident memory (Linux VmHWM, reset through /proc/self/clear_refs) over the loss's forward + backward.
Goal (issue 48): fused at most 0.6x chunked's and 0.35x full logits'.

    python benchmarks/lm_head_memory.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def resident(field: str) -> int:
    """VmRSS or VmHWM of this process, in bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
    return int(line.split()[1]) * 1024


def measure(path: str, finetune: str = "lora") -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import llm_ddp_parallel_training as script

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151_936, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(Qwen2ForCausalLM(config), lora) if finetune == "lora" else Qwen2ForCausalLM(config)
    ids = torch.randint(config.vocab_size, (2, 1025))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    Path("/proc/self/clear_refs").write_text("5")  # restart the peak at the current size
    before = resident("VmRSS")
    if path == "full":
        loss = script.token_loss_sum(model(input_ids=inputs, use_cache=False).logits, targets)
    else:
        loss = script.LeanHeadLoss(model, fused=path == "fused")(inputs, targets)
    loss.backward()
    return {"path": path, "peak_growth_bytes": resident("VmHWM") - before, "loss": loss.item()}


PATHS = ("full", "chunked", "fused")


def measure_all(finetune: str = "lora", paths: tuple[str, ...] = PATHS) -> dict[str, dict]:
    """Each path's result, each measured in a process of its own."""
    results = {}
    for path in paths:
        out = subprocess.run([sys.executable, __file__, path, finetune], capture_output=True, text=True, check=True)
        results[path] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(measure(*sys.argv[1:])))
        return
    for finetune in ("lora", "full"):
        results = measure_all(finetune)
        peak = {path: r["peak_growth_bytes"] for path, r in results.items()}
        for path, r in results.items():
            print(f"{finetune} {path:>7}: peak +{peak[path] / 2**30:.2f} GiB in the loss's forward + backward "
                  f"(loss {r['loss']:.4f})")  # fmt: skip
        print(f"{finetune}: fused {peak['fused'] / peak['chunked']:.2f}x chunked's peak, "
              f"{peak['fused'] / peak['full']:.2f}x full logits' (goal, LoRA: at most 0.6x and 0.35x)")  # fmt: skip


if __name__ == "__main__":
    main()
