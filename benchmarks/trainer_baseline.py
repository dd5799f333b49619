"""The same LoRA run as llm_ddp_parallel_training.py --model qwen, through transformers' Trainer.

What a user would pick instead: Trainer with its own torchrun/accelerate DDP. Launched by
benchmark.py under torchrun with the same model folder, the same examples (built by the
script's own tokenizing function, so both train on identical token sequences), the same batch,
sequence length, steps, learning-rate schedule, clipping and weight decay. Prints one line on
rank 0, "result: {json}": real target tokens per second of the training steps after the
first sixth (as benchmark.py measures the script), and where the adapter went.

    torchrun --standalone --nproc_per_node=2 benchmarks/trainer_baseline.py --model DIR --out DIR ...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from rows import Stacked, stacked

import llm_ddp_parallel_training as script


class StepClock(TrainerCallback):
    """The wall-clock time at the end of every optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.times.append(time.perf_counter())


class Lines(torch.utils.data.Dataset):
    """Trainer's models shift labels themselves: give them [start] + tokens + [eos] whole (one
    position longer than the script's inputs), with the padding labelled -100."""

    def __init__(self, examples: Stacked, pad_id: int) -> None:
        self.labels = torch.cat([examples.inputs[:, :1], examples.targets], dim=1)
        self.ids = self.labels.masked_fill(self.labels == script.IGNORE_INDEX, pad_id)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--corpus", type=Path, default=script.DEFAULT_CORPUS)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--min-lr", type=float, required=True)
    p.add_argument("--warmup-steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args()
    torch.set_flush_denormal(True)  # as the script does: denormals would slow CPU training here too

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    lines = list(script.text_lines(args.corpus))
    data = Lines(
        stacked(
            script.encode_records_with_tokenizer([script.Record(text=x) for x in lines], tokenizer, args.seq_len)[0]
        ),
        tokenizer.pad_token_id,
    )

    training = TrainingArguments(
        output_dir=str(args.out / "trainer"),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": args.min_lr},
        warmup_steps=args.warmup_steps,
        weight_decay=0.01,
        max_grad_norm=1.0,
        optim="adamw_torch",
        seed=args.seed,
        save_strategy="no",
        eval_strategy="no",
        logging_steps=args.max_steps,
        report_to="none",
        disable_tqdm=True,
        dataloader_drop_last=True,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
    )
    seen: list[int] = []

    def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        seen.extend(int((r["labels"] != script.IGNORE_INDEX).sum()) - 1 for r in rows)
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    step_ends = StepClock()
    trainer = Trainer(model=model, args=training, train_dataset=data, data_collator=collate, callbacks=[step_ends])
    trainer.train()
    # Steady state, measured as benchmark.py measures the script: skip step 1 and the rest of the
    # first sixth of the steps (set-up, warm-up), then the wall time from the end of that step to
    # the end of the last, everything in between included. The collator also ran for batches the
    # loader prefetched and never trained on: count only the batches of the steps measured.
    skip = max(1, args.max_steps // 6)
    seconds = step_ends.times[-1] - step_ends.times[skip - 1]
    tokens = torch.tensor([sum(seen[skip * args.batch_size : args.max_steps * args.batch_size])], dtype=torch.float64)
    dist.all_reduce(tokens)
    if trainer.is_world_process_zero():
        model.save_pretrained(args.out / "adapter")
        print(
            "result: "
            + json.dumps(
                {
                    "tokens_per_sec": tokens.item() / seconds,
                    "seconds": seconds,
                    "adapter": str(args.out / "adapter"),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
    script.leave_finished()  # as the script does: Gloo's threads can abort the interpreter's shutdown
