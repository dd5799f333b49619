"""One-GPU LoRA training speed at Qwen2.5-0.5B's exact size, with no network: tokens/s, MFU, memory.

    python benchmarks/gpu_qwen_lora.py                 # about 2-4 minutes on an H100/H200
    python benchmarks/gpu_qwen_lora.py --steps 40 --batch-size 16

Weights do not change speed, so the model is Qwen2.5-0.5B's configuration (24 layers, hidden 896,
14 query and 2 key-value heads, MLP 4864, vocabulary 151,936, tied embeddings) with random
weights, built locally; the tokenizer is the tests' small BPE (its ids all fall inside the
vocabulary). The corpus lines are joined into long lines so that every example fills --seq-len
real tokens. The script itself does the training (torchrun, one rank, NCCL, bf16, LoRA on q_proj
and v_proj) and reports tokens/s and MFU (LoRA-aware FLOPs against the GPU's dense bf16 peak,
989 TFLOP/s for H100/H200) per logged window, and peak CUDA memory at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

QWEN25_05B = {  # Qwen/Qwen2.5-0.5B-Instruct's config.json, the sizes that set the speed
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    from tiny_qwen import build_tiny_qwen

    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-qwen-"))
    lines = [line for line in (REPO / "corpus.txt").read_text().splitlines() if line.strip()]
    model_dir = build_tiny_qwen(out / "qwen2.5-0.5b-random", lines, **QWEN25_05B)
    # Long lines: ~40 corpus lines each, so a 512-token example is full of real tokens.
    long_lines = [" ".join(lines[i : i + 40]) for i in range(0, len(lines), 10)]
    corpus = out / "long_lines.txt"
    corpus.write_text("\n".join(long_lines) + "\n")

    metrics = out / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(REPO / "llm_ddp_parallel_training.py"), "--model", "qwen", "--model-name-or-path", str(model_dir),
           "--corpus-file", str(corpus), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
           "--max-steps", str(args.steps), "--log-every", "5", "--val-fraction", "0", "--precision", "bf16",
           "--metrics-file", str(metrics), "--output-dir", str(out / "run")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    print(done.stdout[-4000:])
    if done.returncode:
        raise SystemExit(f"training failed:\n{done.stderr[-4000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()][2:]  # skip warm-up windows
    memory = next(line for line in done.stdout.splitlines() if "peak memory" in line).split("peak memory", 1)[1]
    print(f"\n| {torch.cuda.get_device_name()} | Qwen2.5-0.5B shape, LoRA r=8 q/v, bf16, "
          f"batch {args.batch_size} x {args.seq_len} |\n|---|---|")  # fmt: skip
    print(f"| tokens/s (median of logged windows) | {statistics.median(r['tokens_per_sec'] for r in records):,.0f} |")
    if "mfu" in records[0]:
        print(
            f"| MFU (LoRA-aware FLOPs / dense bf16 peak) | {100 * statistics.median(r['mfu'] for r in records):.1f}% |"
        )
    print(f"| peak memory | {memory.strip()} |")


if __name__ == "__main__":
    main()
