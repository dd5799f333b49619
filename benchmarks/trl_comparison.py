"""Side by side with TRL's SFTTrainer: LoRA on chat data, 2 Gloo ranks, one epoch, CPU.

The same small Qwen2 (random weights, built offline, tokenizer with Qwen2.5's stock chat template,
which carries no {% generation %} markers), the same chat JSONL of varied conversations, LoRA r 8 /
alpha 16 / dropout 0.05 on q_proj,v_proj, the same conversations per optimizer step, lr, warmup
and cosine schedule. Each tool runs unpacked and packed. Reported per run: end-to-end wall time
(launch to exit, as a user waits for it), the train loop's time, target tokens per second of the
train loop, peak resident memory per rank, and the held-out assistant-token loss of the saved
adapter, computed for every run by one evaluator (this script's masks, one process).

DPO (--only dpo, or the default --only all): TRL's DPOTrainer (benchmarks/trl_dpo_baseline.py) beside
this script's --objective dpo on the same conversational preference pairs ({"prompt": [user turn],
"chosen": [assistant turn], "rejected": [assistant turn]}): the user says the start of a corpus line,
the chosen reply is the true rest of that line, the rejected one the same words in reverse order;
10 % held out. The same model, LoRA, beta 0.1, pairs per rank per step, lr, warmup and cosine
schedule, one epoch, fp32, no checkpointing, dropout off (DPOConfig's disable_dropout, the script's
default under DPO). TRL runs twice: its default reference, computed each step, and
precompute_ref_log_probs=True (found once before training, as the script always does). Ours runs with
a fresh --cache-dir: its tokens and reference log-probabilities are found in the run, as on a first
start (a second start would read both). Reported per run: end to end, train loop, optimizer
steps, peak resident memory per rank, and the held-out DPO loss and reward accuracy of the saved
adapter, computed for both by one evaluator (dpo_held_out, one process): policy = base + adapter,
reference = the base alone, a completion's log-prob = the sum of log p over its target tokens, loss =
-logsigmoid(beta * ((pc - rc) - (pr - rr))), accuracy = the fraction of pairs whose chosen reward
beats the rejected one (an untrained adapter: loss log 2, accuracy 0). Its masks are this script's:
each pair becomes the conversations prompt+chosen and prompt+rejected, tokenized by the script's
tokenize_record, whose targets are the assistant reply and its <|im_end|>: the tokens of
apply_chat_template(prompt + completion) after apply_chat_template(prompt, add_generation_prompt=True),
less the template's trailing newline (TRL trains on that newline too; it counts for neither tool here).

TRL is imported from the environment, or from a folder named by TRL_SITE, put first on the runs'
PYTHONPATH (e.g. pip install --target /opt/trl-site --no-deps trl==1.16.0, beside an environment that
has its dependencies):

    pip install -r benchmarks/requirements.txt
    python benchmarks/trl_comparison.py [--conversations 1200]
    TRL_SITE=/opt/trl-site python benchmarks/trl_comparison.py --only dpo [--pairs 800]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
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
DPO_SEQ_LEN, DPO_BATCH, DPO_LR, DPO_WARMUP, DPO_BETA = 256, 4, 5e-3, 10, 0.1  # DPO_BATCH: pairs per rank per step
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


def preference_records(lines: list[str], count: int, seed: int) -> list[dict]:
    """Preference pairs in TRL's conversational format: the user says the start of a corpus line; the
    chosen reply is the true rest of it, the rejected one the same words in reverse order. Word order is
    a signal a tiny model learns in one short epoch, and learns for held-out pairs too; the rest of
    another line instead (which rest belongs to which start) stayed at chance held out in a trial."""
    rng = random.Random(seed)
    usable = [line for line in lines if len(line.split()) >= 5]
    records = []
    while len(records) < count:
        words = rng.choice(usable).split()
        cut = rng.randint(1, len(words) - 3)  # a rest of at least 3 words, so its reversal differs
        chosen, rejected = " ".join(words[cut:]), " ".join(reversed(words[cut:]))
        if rejected != chosen:
            records.append({"prompt": [{"role": "user", "content": " ".join(words[:cut])}],
                            "chosen": [{"role": "assistant", "content": chosen}],
                            "rejected": [{"role": "assistant", "content": rejected}]})  # fmt: skip
    return records


def held_out_of(records: list[dict], training: Path) -> list[dict]:
    """The first tenth of the records, held out; the rest written to `training` as JSONL."""
    held_out = records[: len(records) // 10]
    training.write_text("".join(json.dumps(r) + "\n" for r in records[len(held_out) :]))
    return held_out


def run(cmd: list[str]) -> tuple[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    path = os.pathsep.join(p for p in (os.environ.get("TRL_SITE"), str(REPO)) if p)  # TRL_SITE: see the docstring
    env |= {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": path}
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


def summary_row(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^  (\w[\w/ ]*?)\s{2,}(.+)$", stdout.split("[summary]")[1], re.M))


def ours_dpo(model: Path, data: Path, out: Path) -> dict:
    stdout, wall = run(torchrun(str(REPO / "llm_ddp_parallel_training.py"), "--model", "qwen", "--cpu",
                                "--model-name-or-path", str(model), "--corpus-file", str(data),
                                "--objective", "dpo", "--dpo-beta", str(DPO_BETA), "--epochs", "1",
                                "--batch-size", str(DPO_BATCH), "--seq-len", str(DPO_SEQ_LEN), "--lr", str(DPO_LR),
                                "--warmup-steps", str(DPO_WARMUP), "--val-fraction", "0", "--log-every", "1000",
                                "--output-dir", str(out), "--no-pack", "--cache-dir", str(out / "cache")))  # fmt: skip
    row = summary_row(stdout)
    number = re.compile(r"[\d,]+(?:\.\d+)?")
    train = re.search(r"training steps ([\d.]+) s", row.get("wall time", ""))
    peaks = re.findall(r"([\d,.]+) MiB RSS", row.get("peak memory", ""))
    steps = number.match(row.get("steps", ""))
    seen = next((f"{row[k]} {k.split()[0]}" for k in ("pairs seen", "examples seen", "tokens seen") if k in row), "")
    return {"wall": wall, "train": float(train.group(1)) if train else float("nan"),
            "steps": int(steps.group().replace(",", "")) if steps else -1,
            "peak_mib": max(float(m.replace(",", "")) for m in peaks) if peaks else float("nan"),
            "seen": seen, "summary": row, "adapter": out / "qwen_lora"}  # fmt: skip


def trl_dpo(model: Path, data: Path, out: Path, precompute: bool = False) -> dict:
    args = ["--model", str(model), "--data", str(data), "--out", str(out), "--batch-size", str(DPO_BATCH),
            "--seq-len", str(DPO_SEQ_LEN), "--lr", str(DPO_LR), "--warmup-steps", str(DPO_WARMUP),
            "--beta", str(DPO_BETA)]  # fmt: skip
    args += ["--precompute"] if precompute else []
    stdout, wall = run(torchrun(str(REPO / "benchmarks" / "trl_dpo_baseline.py"), *args))
    r = json.loads(stdout.split("result: ")[1].splitlines()[0])
    return {"wall": wall, "train": r["train_seconds"], "steps": r["steps"], "peak_mib": r["peak_rss"] / 2**20,
            "seen": f"{r['pairs']:,} pairs", "train_loss": r["train_loss"], "adapter": Path(r["adapter"])}  # fmt: skip


@torch.no_grad()
def dpo_held_out(model_dir: Path, adapter: Path, records: list[dict], beta: float) -> tuple[float, float]:
    """Held-out DPO loss and reward accuracy of an adapter: policy = base + adapter, reference = the base
    (adapter disabled); a completion's log-prob sums log p over this script's targets (see the docstring)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter).eval()
    masking = script.chat_masking(tokenizer)
    sequences = []  # chosen, rejected, chosen, ...
    for r in records:
        for side in ("chosen", "rejected"):
            turns = tuple((m["role"], m["content"]) for m in r["prompt"] + r[side])
            seq = script.tokenize_record(script.Record(messages=turns), tokenizer, False, masking)
            if len(seq.ids) > DPO_SEQ_LEN:
                sys.exit(f"a held-out sequence has {len(seq.ids)} tokens, over the DPO seq-len {DPO_SEQ_LEN}")
            sequences.append(seq)

    def log_probs(batch: list) -> torch.Tensor:
        width = max(len(s.ids) for s in batch)
        ids = torch.tensor([s.ids + [0] * (width - len(s.ids)) for s in batch])
        mask = torch.tensor([[1] * len(s.ids) + [0] * (width - len(s.ids)) for s in batch])
        target = torch.tensor([s.is_target + [False] * (width - len(s.is_target)) for s in batch])[:, 1:]
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
        picked = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return (picked * target).sum(-1)

    policy, reference = [], []
    for i in range(0, len(sequences), 16):
        batch = sequences[i : i + 16]
        policy.append(log_probs(batch))
        with model.disable_adapter():
            reference.append(log_probs(batch))
    policy, reference = torch.cat(policy).double(), torch.cat(reference).double()
    margin = (policy[0::2] - reference[0::2]) - (policy[1::2] - reference[1::2])  # chosen minus rejected rewards / beta
    loss = -torch.nn.functional.logsigmoid(beta * margin).mean().item()
    return loss, (margin > 0).double().mean().item()


def dpo_comparison(lines: list[str], model: Path, root: Path, pairs: int) -> None:
    from transformers import AutoTokenizer

    records = preference_records(lines, pairs, seed=0)
    data, held_out = root / "pairs.jsonl", held_out_of(records, root / "pairs.jsonl")
    results = {}
    runs = {"ours --objective dpo": ours_dpo, "TRL DPOTrainer": trl_dpo,
            "TRL, precompute_ref_log_probs=True": functools.partial(trl_dpo, precompute=True)}  # fmt: skip
    for name, tool in runs.items():
        r = tool(model, data, root / re.sub(r"\W+", "_", name))
        r["loss"], r["accuracy"] = dpo_held_out(model, r["adapter"], held_out, DPO_BETA)
        results[name] = r
        print(f"{name}: {r['wall']:.1f} s end to end, {r['train']:.1f} s train loop, {r['steps']} steps "
              f"({r['seen']}), peak {r['peak_mib']:,.0f} MiB/rank, held-out DPO loss {r['loss']:.4f}, "
              f"accuracy {100 * r['accuracy']:.1f} %", flush=True)  # fmt: skip
    print(
        f"\n{len(records) - len(held_out)} training pairs, {len(held_out)} held out; "
        f"Qwen2 {MODEL_SHAPE}, vocab {len(AutoTokenizer.from_pretrained(model))}; seq {DPO_SEQ_LEN}, "
        f"{DPO_BATCH} pairs per rank per step, 2 Gloo ranks, beta {DPO_BETA:g}, lr {DPO_LR:g}, "
        f"{DPO_WARMUP} warmup steps, cosine to lr/10; untrained: loss {math.log(2):.4f}\n"
    )
    print("| run | end to end | train loop | steps | peak memory/rank | held-out DPO loss | held-out accuracy |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['wall']:.1f} s | {r['train']:.1f} s | {r['steps']} | {r['peak_mib']:,.0f} MiB | "
              f"{r['loss']:.4f} | {100 * r['accuracy']:.1f} % |")  # fmt: skip
    ours = results["ours --objective dpo"]
    for name, t in list(results.items())[1:]:
        wall, train = t["wall"] / ours["wall"], t["train"] / ours["train"]
        print(f"ours vs {name}: {wall:.2f}x end to end, {train:.2f}x train loop")


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


def sft_comparison(lines: list[str], model: Path, root: Path, conversations: int) -> None:
    from transformers import AutoTokenizer

    records = chat_records(lines, conversations, seed=0)
    data, held_out = root / "train.jsonl", held_out_of(records, root / "train.jsonl")
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", choices=("all", "sft", "dpo"), default="all", help="which comparison to run")
    p.add_argument("--conversations", type=int, default=1200, help="SFT: chat records, 10%% held out")
    p.add_argument("--pairs", type=int, default=800, help="DPO: preference pairs, 10%% held out")
    p.add_argument("--keep", action="store_true", help="keep the temp folder")
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="trl-comparison-"))
    try:
        lines = list(script.text_lines(script.DEFAULT_CORPUS))
        model = build_tiny_qwen(root / "model", lines, **MODEL_SHAPE)
        if a.only in ("all", "sft"):
            sft_comparison(lines, model, root, a.conversations)
        if a.only in ("all", "dpo"):
            dpo_comparison(lines, model, root, a.pairs)
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
