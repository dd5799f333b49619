"""The same LoRA fine-tune on chat data as llm_ddp_parallel_training.py, through TRL's SFTTrainer.

What a practitioner would otherwise pick: SFTTrainer with assistant-only loss (TRL swaps in its
training version of Qwen2.5's template, which carries {% generation %} markers), under torchrun's
DDP. Launched by trl_comparison.py with the same model folder, the same chat JSONL, LoRA r 8 /
alpha 16 / dropout 0.05 on q_proj,v_proj, the same conversations per optimizer step, lr, warmup,
cosine decay to lr/10, weight decay and clipping, one epoch. Prints one line on rank 0,
"result: {json}": the train loop's seconds, the target tokens it trained on, and peak memory.

    torchrun --standalone --nproc_per_node=2 benchmarks/trl_baseline.py --model DIR --data FILE --out DIR ...
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import load_dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import llm_ddp_parallel_training as script


def shared_flags() -> argparse.ArgumentParser:
    """The flags trl_comparison.py gives this baseline and trl_dpo_baseline.py alike."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--batch-size", type=int, required=True, help="examples (DPO: pairs) per rank per step")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--warmup-steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=1337, help="the script's default --seed")
    return p


def shared_config(a: argparse.Namespace) -> dict:
    """The training arguments both baselines set as the script runs: one epoch on CPU through Gloo, its schedule, weight
    decay and clipping, no saving or tracking on the way."""
    return {"output_dir": str(a.out), "max_length": a.seq_len, "per_device_train_batch_size": a.batch_size,
            "num_train_epochs": 1, "learning_rate": a.lr, "lr_scheduler_type": "cosine_with_min_lr",
            "lr_scheduler_kwargs": {"min_lr": a.lr / 10}, "warmup_steps": a.warmup_steps, "weight_decay": 0.01,
            "max_grad_norm": 1.0, "use_cpu": True, "ddp_backend": "gloo", "save_strategy": "no", "report_to": [],
            "logging_steps": 10, "dataloader_drop_last": True, "seed": a.seed}  # fmt: skip


def trained(trainer_class: type, config: object, a: argparse.Namespace) -> tuple[object, object]:
    """The trainer, on the JSONL file, with the script's LoRA (r 8, alpha 16, dropout 0.05 on q_proj and v_proj; a
    DPOConfig's disable_dropout zeroes it), and its train() result."""
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")  # fmt: skip
    dataset = load_dataset("json", data_files=a.data)["train"]
    trainer = trainer_class(model=a.model, args=config, train_dataset=dataset, peft_config=lora)
    return trainer, trainer.train()


def report(trainer: object, result: object, a: argparse.Namespace, **counts: float) -> None:
    """Rank 0 saves the adapter and prints "result: {json}": the train loop's seconds, `counts`, the peak resident
    memory of the ranks (a collective) and the steps."""
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        trainer.model.save_pretrained(a.out / "adapter")
        print("result: " + json.dumps({"train_seconds": result.metrics["train_runtime"], **counts,
                                       "peak_rss": peak.item(), "steps": result.global_step,
                                       "adapter": str(a.out / "adapter")}))  # fmt: skip
    dist.barrier()


def main() -> None:
    p = shared_flags()
    p.add_argument("--pack", action="store_true")
    a = p.parse_args()
    config = SFTConfig(assistant_only_loss=True, packing=a.pack, **shared_config(a))
    trainer, result = trained(SFTTrainer, config, a)
    # Target tokens seen: the labels that count, over every batch of the epoch, summed over ranks.
    targets = torch.zeros(1, dtype=torch.float64)
    for batch in trainer.get_train_dataloader():
        targets += int((batch["labels"][:, 1:] != -100).sum())
    dist.all_reduce(targets)
    report(trainer, result, a, target_tokens=int(targets.item()))


if __name__ == "__main__":
    main()
    script.leave_finished()  # as the script does: Gloo's threads can abort the interpreter's shutdown
