"""Peak memory of the loss's forward + backward: full logits vs the script's lean head.

A Qwen2 with Qwen2.5's 151,936-token vocabulary and a small body (hidden 64, one layer, random
weights, built offline), LoRA r 8 on q_proj,v_proj, a batch of 8 x 1,024 tokens, every position
a target. Each path runs in a fresh process; the number is the growth of its peak resident
memory (Linux VmHWM, reset through /proc/self/clear_refs) over the loss's forward + backward.

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


def measure(path: str) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import llm_ddp_parallel_training as script

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151_936, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(Qwen2ForCausalLM(config), lora)
    ids = torch.randint(config.vocab_size, (8, 1025))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    Path("/proc/self/clear_refs").write_text("5")  # restart the peak at the current size
    before = resident("VmRSS")
    if path == "full":
        loss = script.token_loss_sum(model(input_ids=inputs, use_cache=False).logits, targets)
    else:
        loss = script.LeanHeadLoss(model)(inputs, targets)
    loss.backward()
    return {"path": path, "peak_growth_bytes": resident("VmHWM") - before, "loss": loss.item()}


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(measure(sys.argv[1])))
        return
    results = {}
    for path in ("full", "lean"):
        out = subprocess.run([sys.executable, __file__, path], capture_output=True, text=True, check=True)
        results[path] = json.loads(out.stdout.strip().splitlines()[-1])
    full, lean = (results[p]["peak_growth_bytes"] for p in ("full", "lean"))
    for p in ("full", "lean"):
        r = results[p]
        print(f"{p:>4}: peak +{r['peak_growth_bytes'] / 2**30:.2f} GiB over the loss's forward + backward "
              f"(loss {r['loss']:.2f})")  # fmt: skip
    print(f"lean head: {full / lean:.1f}x less memory (goal: at least 4x)")


if __name__ == "__main__":
    main()
