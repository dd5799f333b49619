"""Side by side with TRL's SFTTrainer: LoRA on chat data, 2 Gloo ranks, one epoch, CPU.

The same small Qwen2 (random weights, built offline, tokenizer with Qwen2.5's stock chat template,
which carries no {% generation %} markers), the same chat JSONL of varied conversations, LoRA r 8 /
alpha 16 / dropout 0.05 on q_proj,v_proj, the same conversations per optimizer step, lr, warmup
and cosine schedule. Each tool runs unpacked and packed. Reported per run: end-to-end wall time
(launch to exit, as a user waits for it), the train loop's time, target tokens per second of the
train loop, peak resident memory per rank, and the held-out assistant-token loss of the saved
adapter, computed for every run by one evaluator (this script's masks, one process).

    pip install -r benchmarks/requirements.txt
    python benchmarks/trl_comparison.py [--conversations 1200]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from tiny_qwen import build_tiny_qwen  # noqa: E402

import llm_ddp_parallel_training as script  # noqa: E402

SEQ_LEN, BATCH, LR, WARMUP = 256, 4, 1e-3, 10
MODEL_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4}


def chat_records(lines: list[str], count: int, seed: int) -> list[dict]:
    """Conversations of 1 to 3 exchanges: the user says the start of a corpus line, the assistant
    the rest; an optional system prompt. Varied lengths, like real chat data."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        turns = [{"role": "system", "content": "Answer in one sentence."}] if rng.random() < 0.3 else []
        for line in rng.sample(lines, rng.randint(1, 3)):
            words = line.split()
            cut = rng.randint(1, max(1, len(words) - 1))
            turns += [{"role": "user", "content": " ".join(words[:cut])},
                      {"role": "assistant", "content": " ".join(words[cut:]) or "Yes."}]  # fmt: skip
        records.append({"messages": turns})
    return records


def run(cmd: list[str]) -> tuple[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    seconds = time.perf_counter() - started
    if out.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout, seconds


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]


def ours(model: Path, data: Path, out: Path, pack: bool) -> dict:
    stdout, wall = run(torchrun(str(REPO / "llm_ddp_parallel_training.py"), "--model", "qwen", "--cpu",
                                "--model-name-or-path", str(model), "--corpus-file", str(data), "--epochs", "1",
                                "--batch-size", str(BATCH), "--seq-len", str(SEQ_LEN), "--lr", str(LR),
                                "--warmup-steps", str(WARMUP), "--val-fraction", "0", "--log-every", "1000",
                                "--output-dir", str(out), "--pack" if pack else "--no-pack"))  # fmt: skip
    row = dict(re.findall(r"^  (\w[\w/ ]*?)\s{2,}(.+)$", stdout.split("[summary]")[1], re.M))
    train_seconds = float(re.search(r"training steps ([\d.]+) s", row["wall time"]).group(1))
    tokens = int(row["tokens seen"].split()[0].replace(",", ""))
    peak = max(float(m) for m in re.findall(r"([\d,.]+) MiB RSS", row["peak memory"]))
    steps = int(row["steps"].split()[0].replace(",", ""))
    return {"wall": wall, "train": train_seconds, "tokens": tokens, "peak_mib": peak, "steps": steps,
            "adapter": out / "qwen_lora"}  # fmt: skip


def trl(model: Path, data: Path, out: Path, pack: bool) -> dict:
    args = ["--model", str(model), "--data", str(data), "--out", str(out), "--batch-size", str(BATCH),
            "--seq-len", str(SEQ_LEN), "--lr", str(LR), "--warmup-steps", str(WARMUP)]  # fmt: skip
    stdout, wall = run(torchrun(str(REPO / "benchmarks" / "trl_baseline.py"), *args, *(["--pack"] if pack else [])))
    r = json.loads(stdout.split("result: ")[1].splitlines()[0])
    return {"wall": wall, "train": r["train_seconds"], "tokens": r["target_tokens"], "peak_mib": r["peak_rss"] / 2**20,
            "steps": r["steps"], "adapter": Path(r["adapter"])}  # fmt: skip


@torch.no_grad()
def held_out_loss(model_dir: Path, adapter: Path, records: list[dict]) -> float:
    """Mean loss per assistant target token (replies and their end-of-turn), this script's masks."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter).eval()
    samples = [script.Record(messages=tuple((m["role"], m["content"]) for m in r["messages"])) for r in records]
    examples, _ = script.encode_records_with_tokenizer(samples, tokenizer, SEQ_LEN)
    loss = tokens = 0.0
    for i in range(0, len(examples), 16):
        inputs, targets = script.trim_padding([examples[j] for j in range(i, min(i + 16, len(examples)))])
        loss += script.token_loss_sum(model(input_ids=inputs, use_cache=False).logits, targets).item()
        tokens += int((targets != script.IGNORE_INDEX).sum())
    return loss / tokens


def main() -> None:
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser()
    p.add_argument("--conversations", type=int, default=1200)
    p.add_argument("--keep", action="store_true", help="keep the temp folder")
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="trl-comparison-"))
    try:
        lines = list(script.text_lines(script.DEFAULT_CORPUS))
        model = build_tiny_qwen(root / "model", lines, **MODEL_SHAPE)
        records = chat_records(lines, a.conversations, seed=0)
        held_out = records[: len(records) // 10]
        data = root / "train.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records[len(held_out) :]))
        results = {}
        for name, tool, pack in (("ours", ours, False), ("TRL SFTTrainer", trl, False),
                                 ("ours --pack", ours, True), ("TRL packing=True", trl, True)):  # fmt: skip
            r = tool(model, data, root / name.replace(" ", "_"), pack)
            r["held_out"] = held_out_loss(model, r["adapter"], held_out)
            results[name] = r
            print(f"{name}: {r['wall']:.1f} s end to end, {r['train']:.1f} s train loop, {r['steps']} steps, "
                  f"{r['tokens'] / r['train']:,.0f} target tok/s, peak {r['peak_mib']:,.0f} MiB/rank, "
                  f"held-out loss {r['held_out']:.4f}", flush=True)  # fmt: skip
        print(
            f"\n{len(records) - len(held_out)} training conversations, {len(held_out)} held out; "
            f"Qwen2 {MODEL_SHAPE}, vocab {len(AutoTokenizer.from_pretrained(model))}; "
            f"seq {SEQ_LEN}, {BATCH} conversations per rank per step, 2 Gloo ranks, lr {LR:g}\n"
        )
        print("| run | end to end | train loop | target tokens/s | peak memory/rank | held-out loss |")
        print("|---|---|---|---|---|---|")
        for name, r in results.items():
            print(f"| {name} | {r['wall']:.1f} s | {r['train']:.1f} s | {r['tokens'] / r['train']:,.0f} | "
                  f"{r['peak_mib']:,.0f} MiB | {r['held_out']:.4f} |")  # fmt: skip
        for ours_name, trl_name in (("ours", "TRL SFTTrainer"), ("ours --pack", "TRL packing=True")):
            o, t = results[ours_name], results[trl_name]
            print(
                f"{ours_name} vs {trl_name}: {t['wall'] / o['wall']:.2f}x end to end, "
                f"held-out loss {100 * (o['held_out'] / t['held_out'] - 1):+.2f}%"
            )
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
