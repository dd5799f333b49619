"""The same LoRA DPO run as llm_ddp_parallel_training.py --objective dpo, through TRL's DPOTrainer.

What a practitioner would otherwise pick: DPOTrainer with a peft_config (the reference is the same
model with the adapter disabled, computed each step: precompute_ref_log_probs=False, TRL's default; with
--precompute, once before training, as the script does), sigmoid loss,
beta as given, under torchrun's DDP on CPU with Gloo (use_cpu, ddp_backend="gloo", as trl_baseline.py).
Launched by trl_comparison.py --only dpo with the same model folder, the same conversational
preference JSONL ({"prompt": [user turn], "chosen": [assistant turn], "rejected": [assistant turn]}),
LoRA r 8 / alpha 16 on q_proj,v_proj, the same pairs per rank per optimizer step, lr,
warmup, cosine decay to lr/10, weight decay and clipping, one epoch.

Settings that differ from DPOConfig's defaults, set to match the script's CPU run: fp32 (DPOConfig
defaults to bf16 autocast, on CPU too) and no gradient checkpointing (DPOConfig defaults to it on).
Dropout is DPOConfig's default, off (disable_dropout, as the script under --objective dpo). max_length is
--seq-len per sequence (prompt + completion). Prints one line on rank 0, "result: {json}": the train
loop's seconds, the pairs it trained on, the optimizer steps, peak memory and the adapter's folder.

    PYTHONPATH=$TRL_SITE:. torchrun --standalone --nproc_per_node=2 benchmarks/trl_dpo_baseline.py \\
        --model DIR --data FILE --out DIR --batch-size 4 --seq-len 128 --lr 1e-3 --warmup-steps 10 --beta 0.1
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
from trl import DPOConfig, DPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import llm_ddp_parallel_training as script


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--batch-size", type=int, required=True, help="preference pairs per rank per step")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--warmup-steps", type=int, required=True)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1337, help="the script's default --seed")
    p.add_argument("--precompute", action="store_true", help="precompute_ref_log_probs=True")
    a = p.parse_args()

    config = DPOConfig(
        output_dir=str(a.out),
        beta=a.beta,
        loss_type=["sigmoid"],
        precompute_ref_log_probs=a.precompute,
        max_length=a.seq_len,
        per_device_train_batch_size=a.batch_size,
        num_train_epochs=1,
        learning_rate=a.lr,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": a.lr / 10},
        warmup_steps=a.warmup_steps,
        weight_decay=0.01,
        max_grad_norm=1.0,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        ddp_backend="gloo",
        save_strategy="no",
        report_to=[],
        logging_steps=10,
        dataloader_drop_last=True,
        seed=a.seed,
    )
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")  # fmt: skip
    trainer = DPOTrainer(model=a.model, args=config, train_dataset=load_dataset("json", data_files=a.data)["train"],
                         peft_config=lora)  # fmt: skip
    result = trainer.train()
    pairs = torch.tensor([result.global_step * a.batch_size * dist.get_world_size()], dtype=torch.float64)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        trainer.model.save_pretrained(a.out / "adapter")
        out = {"train_seconds": result.metrics["train_runtime"], "pairs": int(pairs.item()),
               "peak_rss": peak.item(), "steps": result.global_step, "train_loss": result.training_loss,
               "adapter": str(a.out / "adapter")}  # fmt: skip
        print("result: " + json.dumps(out))
    dist.barrier()


if __name__ == "__main__":
    main()
    script.leave_finished()  # as the script does: Gloo's threads can abort the interpreter's shutdown
