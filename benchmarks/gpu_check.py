"""The GPU check: one command, no network, one GPU, under 8 minutes; one table and one JSON.

    python benchmarks/gpu_check.py               # on a CUDA machine: the configurations below (CONFIGS)
    python benchmarks/gpu_check.py --smoke       # CPU, in this process, fp32, toy sizes: checks the harness (CI)

Each configuration trains through llm_ddp_parallel_training.py as a user starts it (torchrun, one rank,
NCCL, bf16, HF_HUB_OFFLINE=1) on a random-weight model built here from Qwen2.5-0.5B's or 1.5B's
configuration (weights do not change speed; nothing is downloaded) and the tests' small BPE tokenizer,
whose ids all fall inside Qwen's vocabulary. The data: examples of 1 to 16 corpus lines, so lengths vary
and packing has padding to remove. Reported per configuration: tokens/s (real tokens) and MFU, each the
median of the logged windows after the warm-up steps; the peak CUDA allocation beside the state the
script's memory table predicts (weights, gradients, AdamW moments; activations are not in it); wall
seconds of the launch. With `trl` importable, TRL's SFTTrainer runs the first configuration's data, batch
and steps, with checkpointing off and on, and again with `liger-kernel` (use_liger_kernel=True) where it is
importable. A configuration that fails gets an error row; the others still run.

Writes OUT/gpu_check.json (--out, default a temp folder) and OUT/logs/; the models and runs it built
are removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import random
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "llm_ddp_parallel_training.py"
sys.path[:0] = [str(REPO), str(REPO / "tests")]
import llm_ddp_parallel_training as script  # noqa: E402

# The shapes that set the speed, from Qwen/Qwen2.5-{0.5B,1.5B}-Instruct's config.json (both tie embeddings).
QWEN = {"vocab_size": 151936, "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1e6,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True}  # fmt: skip
SHAPES = {
    "0.5B": QWEN | {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14},
    "1.5B": QWEN | {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12},
}
# --smoke: toy stand-ins of the same family (the vocabulary is then the tokenizer's own).
TOY = {"num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": True}
TOY_SHAPES = {
    "0.5B": TOY | {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
    "1.5B": TOY | {"hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 3, "num_attention_heads": 6},
}


@dataclass(frozen=True)
class Config:
    name: str
    model: str  # a key of SHAPES
    finetune: str  # lora or full
    pack: bool
    compile: bool = True  # the script's default on CUDA; --smoke runs every row uncompiled (a CPU would spend it)
    head_loss: str = "fused"  # the script's --head-loss
    checkpointing: bool = False  # --gradient-checkpointing (TRL: gradient_checkpointing=True)
    policy: str = "full"  # --checkpoint-policy
    attention: str = "auto"  # --attn-implementation (auto: varlen for packed rows on CUDA)
    trainer: str = "script"  # or "trl", or "trl+liger" (SFTConfig(use_liger_kernel=True))
    objective: str = "sft"  # --objective (dpo: on preference pairs made from the same lines, write_pairs)


# The goal's questions first (issue 48: ours against TRL + Liger, checkpointing off and on; MFU at 0.5B and 1.5B
# full), then what each of the script's choices costs; a row that would start too late is skipped, the last first.
TRL = {"model": "0.5B", "finetune": "lora", "pack": False}  # TRL's rows: the first row's data, batch and steps
# Packed rows through torch's varlen kernel (the default on CUDA) and through SDPA with a block-diagonal mask: the
# same data, weights and seed, so their first step's loss must agree within bf16's rounding (compare_attention).
VARLEN, MASKED = "0.5B LoRA packed (varlen attention)", "0.5B LoRA packed, --attn-implementation sdpa (masked)"
# bf16 kernels summing in another order should move a mean loss by ~1e-3 (not measured: no GPU has run this). In a
# random-weight model, examples that see one another move it less than in a trained one, so DIFFER is decisive
# and "agree" rules out gross errors only; the exact check is CPU's (tests/test_chat_data.py, within 1e-5).
ATTENTION_TOLERANCE = 1e-2
CONFIGS = (
    Config("0.5B LoRA", "0.5B", "lora", pack=False),
    Config("TRL SFTTrainer + Liger, 0.5B LoRA's data and steps", **TRL, trainer="trl+liger"),
    Config("0.5B LoRA, --gradient-checkpointing", "0.5B", "lora", pack=False, checkpointing=True),
    Config(
        "0.5B LoRA, --gradient-checkpointing --checkpoint-policy selective",
        "0.5B",
        "lora",
        pack=False,
        checkpointing=True,
        policy="selective",
    ),
    Config("TRL SFTTrainer + Liger, gradient checkpointing", **TRL, checkpointing=True, trainer="trl+liger"),
    Config("0.5B full", "0.5B", "full", pack=False),
    Config("1.5B full packed", "1.5B", "full", pack=True),
    Config("0.5B LoRA DPO (pairs/s)", "0.5B", "lora", pack=False, objective="dpo"),
    Config("TRL SFTTrainer, 0.5B LoRA's data and steps", **TRL, trainer="trl"),
    Config("TRL SFTTrainer, gradient checkpointing", **TRL, checkpointing=True, trainer="trl"),
    Config(VARLEN, "0.5B", "lora", pack=True),
    Config(MASKED, "0.5B", "lora", pack=True, attention="sdpa"),
    Config("0.5B LoRA, --head-loss chunked", "0.5B", "lora", pack=False, head_loss="chunked"),
    Config("0.5B LoRA, --head-loss full", "0.5B", "lora", pack=False, head_loss="full"),
    Config("0.5B LoRA, --no-compile", "0.5B", "lora", pack=False, compile=False),
    Config("0.5B full, --head-loss chunked", "0.5B", "full", pack=False, head_loss="chunked"),
)


@dataclass(frozen=True)
class Sizes:
    batch_size: int
    seq_len: int
    steps: int
    log_every: int
    warmup: int  # steps left out of the medians: CUDA and compile warm-up, allocator growth
    examples: int
    timeout_s: float  # one launch
    budget_s: float  # all of them: a launch that would start past it is skipped (the 8 minutes, less margin)


GPU_SIZES = Sizes(  # 16 rows, the first 15 of 25-40 s each on an H200 (its launches of 2026-12-04, at 40 steps)
    batch_size=16, seq_len=512, steps=30, log_every=5, warmup=10, examples=2000, timeout_s=240, budget_s=440
)
MIN_LAUNCH_S = 60  # the H200's launches took 25-40 s (2026-12-04): with less left, a row would be cut off
SMOKE_SIZES = Sizes(batch_size=4, seq_len=64, steps=3, log_every=1, warmup=1, examples=200, timeout_s=120, budget_s=300)


def environment() -> dict:
    import transformers

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return {"device": device, "torch": torch.__version__, "transformers": transformers.__version__}


def write_corpus(path: Path, lines: list[str], count: int) -> Path:
    rng = random.Random(0)
    path.write_text("".join(" ".join(rng.sample(lines, rng.randint(1, 16))) + "\n" for _ in range(count)))
    return path


def write_pairs(path: Path, lines: list[str], count: int, most: int) -> Path:
    """Preference pairs for the DPO row: a user turn of up to `most` lines' start, the chosen reply their true rest,
    the rejected one those words backwards (a short system turn: the template's default one fills --smoke's rows)."""
    rng, records = random.Random(0), []
    for _ in range(count):
        words = " ".join(rng.sample(lines, rng.randint(1, most))).split()
        cut = max(1, len(words) // 3)
        records.append(
            {
                "prompt": [
                    {"role": "system", "content": "Answer."},
                    {"role": "user", "content": " ".join(words[:cut])},
                ],
                "chosen": [{"role": "assistant", "content": " ".join(words[cut:]) or "yes"}],
                "rejected": [{"role": "assistant", "content": " ".join(reversed(words[cut:])) + " no"}],
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def build_tokenizer(folder: Path, lines: list[str]) -> object:
    """tests/tiny_qwen.py's BPE tokenizer (trained on the corpus; its ids all fall inside Qwen's vocabulary)."""
    from tiny_qwen import build_tiny_qwen
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_qwen(folder, lines))


def build_model(folder: Path, shape: dict, tokenizer: object, smoke: bool) -> Path:
    """Random weights at `shape`, saved with the tokenizer; built on the GPU (seconds, where a CPU takes minutes)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer.save_pretrained(folder)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(**({"vocab_size": len(tokenizer)} | shape), bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    with torch.device("cpu" if smoke else "cuda"):
        model = Qwen2ForCausalLM(config).to(torch.float32 if smoke else torch.bfloat16)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def build_models(folder: Path, shapes: dict[str, dict], lines: list[str], smoke: bool) -> dict[str, Path | str]:
    """Each model's folder, or why it could not be built (its configurations then get an error row)."""
    tokenizer, models = build_tokenizer(folder / "tokenizer", lines), {}
    for name, shape in shapes.items():
        try:
            models[name] = build_model(folder / name, shape, tokenizer, smoke)
        except (RuntimeError, OSError) as e:  # out of memory is a RuntimeError too
            models[name] = f"could not build the {name} model: {e}"
    return models


def child_env(smoke: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return env | ({"OMP_NUM_THREADS": "1"} if smoke else {})  # a CI machine's cores are shared


def launch(args: list[str], log: Path, timeout: float, smoke: bool) -> tuple[int, str, float]:
    """torchrun, one rank, in its own process group (killed whole on timeout); exit code, output, seconds.
    --smoke runs the script in this process, as one plain process: start-up, not training, is what a toy
    configuration costs (10 s a launch on 2 cores), and the smoke checks the harness, not the launch."""
    started = time.perf_counter()
    if smoke and args[0] == str(SCRIPT):
        return (*in_process(args[1:], log), time.perf_counter() - started)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env(smoke), start_new_session=True)  # fmt: skip
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0] + f"\n[gpu_check] killed after {timeout:.0f} s"
    log.write_text(" ".join(cmd) + "\n\n" + output)
    return proc.returncode, output, time.perf_counter() - started


def in_process(args: list[str], log: Path) -> tuple[int, str]:
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        try:
            script.main(args)
            code = 0
        except SystemExit as e:  # the script's one-line failures end this way
            code = e.code if isinstance(e.code, int) else 1
    log.write_text(" ".join(["(in process)", str(SCRIPT), *args]) + "\n\n" + output.getvalue())
    return code, output.getvalue()


def script_args(c: Config, sizes: Sizes, model: Path, corpus: Path, run: Path, smoke: bool) -> list[str]:
    hardware = (["--cpu", "--backend", "gloo", "--precision", "fp32", "--dtype", "float32"] if smoke
                else ["--backend", "nccl", "--precision", "bf16", "--dtype", "bfloat16"])  # fmt: skip
    # DPO: its pairs beside the corpus; its head is always the chunked one (--head-loss is refused with it)
    objective = ["--objective", "dpo"] if c.objective == "dpo" else ["--head-loss", c.head_loss]
    corpus = corpus.with_name("pairs.jsonl") if c.objective == "dpo" else corpus
    return [str(SCRIPT), "--model", "qwen", "--model-name-or-path", str(model), "--corpus-file", str(corpus),
            "--finetune", c.finetune, "--pack" if c.pack else "--no-pack", "--seq-len", str(sizes.seq_len),
            "--batch-size", str(sizes.batch_size), "--max-steps", str(sizes.steps), "--log-every",
            str(sizes.log_every), "--val-fraction", "0", "--cache-dir", "none", "--sample-tokens", "1",
            "--progress", "plain", "--metrics-file", str(run / "metrics.jsonl"), "--output-dir", str(run),
            *objective, *hardware, "--compile" if c.compile and not smoke else "--no-compile",
            "--attn-implementation", c.attention,
            *(["--gradient-checkpointing", "--checkpoint-policy", c.policy] if c.checkpointing else [])]  # fmt: skip


def medians(records: list[dict], warmup: int) -> dict:
    """Medians of the windows after the warm-up steps (the last window alone when the run is that short)."""
    kept = [r for r in records if r["step"] > warmup] or records[-1:]
    speed = "tokens_per_sec" if "tokens_per_sec" in kept[0] else "pairs_per_sec"  # (DPO counts pairs)
    result = {speed: statistics.median(r[speed] for r in kept)}
    if all("mfu" in r for r in kept):
        result["mfu"] = statistics.median(r["mfu"] for r in kept)
    return result


def run_config(c: Config, sizes: Sizes, models: dict[str, Path | str], corpus: Path, out: Path, smoke: bool) -> dict:
    record: dict = {"status": "ok"}
    run = out / "runs" / re.sub(r"\W+", "_", c.name)
    run.mkdir(parents=True)
    log = out / "logs" / f"{run.name}.log"
    code, output, record["wall_s"] = launch(script_args(c, sizes, models[c.model], corpus, run, smoke), log,
                                            sizes.timeout_s, smoke)  # fmt: skip
    try:
        if code:
            raise RuntimeError(f"exit {code}: {last_line(output)} (log: {log})")
        logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        record |= medians(logged, sizes.warmup) | {"first_loss": logged[0]["loss"]}
        rank0 = json.loads((run / "memory.json").read_text())[0]
        record["peak_bytes"] = rank0["peak"]  # CUDA's peak allocation; on CPU the peak resident set
        record["predicted_state_bytes"] = sum(rank0["predicted"].values())
        record["state_bytes"] = sum(rank0[k] for k in rank0["predicted"])
    except (OSError, ValueError, KeyError, IndexError, RuntimeError) as e:
        record |= {"status": "error", "error": str(e)}
    shutil.rmtree(run, ignore_errors=True)  # a full fine-tune saves the whole model: gigabytes
    return record


def last_line(output: str) -> str:
    """What ended a run: the script's own `error:` line, else a traceback's last line, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("error: ")]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return (said or raised or lines or ["no output"])[-1][:300]


def run_trl(c: Config, sizes: Sizes, models: dict[str, Path | str], corpus: Path, out: Path, smoke: bool) -> dict:
    """TRL's SFTTrainer on config c's model, data, batch and steps (LoRA r 8 on q_proj,v_proj, as the script), with
    Liger's fused kernels where c asks (Triton: CUDA only). --smoke runs the plain row without checkpointing."""
    import importlib.util

    needed = ("trl", "liger_kernel") if c.trainer == "trl+liger" else ("trl",)
    missing = [lib for lib in needed if importlib.util.find_spec(lib) is None]
    if missing:
        return {"status": "skipped", "error": f"{missing[0].replace('_', '-')} not installed"}
    if smoke and (c.trainer != "trl" or c.checkpointing):
        return {"status": "skipped", "error": "timed on a GPU only (--smoke runs TRL's first row)"}
    run = out / "runs" / re.sub(r"\W+", "_", c.name)
    spec = {"model": str(models[c.model]), "corpus": str(corpus), "out": str(run), "pack": c.pack, "smoke": smoke,
            "liger": c.trainer == "trl+liger", "checkpointing": c.checkpointing, **asdict(sizes)}  # fmt: skip
    log = out / "logs" / f"{run.name}.log"  # each row's own
    code, output, wall = launch([str(Path(__file__).resolve()), "--trl-worker", json.dumps(spec)], log,
                                sizes.timeout_s, smoke)  # fmt: skip
    shutil.rmtree(run, ignore_errors=True)
    result = next((line.split("result: ", 1)[1] for line in output.splitlines() if line.startswith("result: ")), None)
    if code or result is None:
        return {"status": "error", "error": f"exit {code}: {last_line(output)} (log: {log})", "wall_s": wall}
    return {"status": "ok", "wall_s": wall, **json.loads(result)}


def trl_worker(spec: dict) -> None:
    """Under torchrun (one rank): train with SFTTrainer, time the steps after the warm-up, print one result line."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, *args: object, **kwargs: object) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the step's kernels done, as the script's timing waits for them
            self.ends.append(time.perf_counter())

    texts = [line for line in Path(spec["corpus"]).read_text().splitlines() if line.strip()]
    config = SFTConfig(output_dir=spec["out"], max_steps=spec["steps"], per_device_train_batch_size=spec["batch_size"],
                       max_length=spec["seq_len"], packing=spec["pack"], bf16=not spec["smoke"], use_cpu=spec["smoke"],
                       ddp_backend="gloo" if spec["smoke"] else "nccl", learning_rate=2e-4, save_strategy="no",
                       model_init_kwargs={"dtype": "float32" if spec["smoke"] else "bfloat16"},  # as the script's
                       report_to=[], logging_steps=spec["log_every"], dataloader_drop_last=True, seed=1337,
                       gradient_checkpointing=spec["checkpointing"],  # off: the script's default; TRL 1.x's is on
                       use_liger_kernel=spec["liger"])  # fmt: skip
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=spec["model"], args=config, train_dataset=Dataset.from_dict({"text": texts}),
                         peft_config=lora, callbacks=[clock := Clock()])  # fmt: skip
    trainer.train()
    ends, warmup = clock.ends, min(spec["warmup"], len(clock.ends) - 1)
    # Real tokens per step: the mean over as many of the dataloader's batches as the run took.
    batches = list(itertools.islice(trainer.get_train_dataloader(), spec["steps"]))
    mask = [b["attention_mask"].sum() if "attention_mask" in b else b["input_ids"].numel() for b in batches]
    speed = float(sum(mask)) / len(mask) * (len(ends) - 1 - warmup) / (ends[-1] - ends[warmup])
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024  # fmt: skip
    result = {"tokens_per_sec": speed, "peak_bytes": peak}
    cfg = trainer.model.config
    flops = script.training_flops_per_token(trainer.model, cfg.num_hidden_layers, script.attention_width(cfg),
                                            spec["seq_len"])  # fmt: skip
    if torch.cuda.is_available() and (peak_flops := script.gpu_peak_flops(torch.cuda.get_device_name())):
        result["mfu"] = speed * flops / peak_flops
    print("result: " + json.dumps(result), flush=True)
    script.leave_finished()  # as the script ends: the process group's threads can abort the interpreter's shutdown


def size(nbytes: float | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def print_table(records: list[dict], smoke: bool) -> None:
    peak = "peak RSS (CPU)" if smoke else "peak CUDA memory"
    print(f"\n| configuration | tokens/s | MFU | {peak} | memory table's predicted state | wall s |")
    print("|---|---|---|---|---|---|")
    for r in records:
        wall = f"{r['wall_s']:.0f}" if "wall_s" in r else "-"
        if r["status"] != "ok":
            print(f"| {r['name']} | {r['status']}: {r['error']} | | | | {wall} |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        speed = f"{r['tokens_per_sec']:,.0f}" if "tokens_per_sec" in r else f"{r['pairs_per_sec']:,.1f} pairs/s"
        print(f"| {r['name']} | {speed} | {mfu} | {size(r.get('peak_bytes'))} | "
              f"{size(r.get('predicted_state_bytes'))} | {wall} |")  # fmt: skip


def compare_attention(records: list[dict]) -> str:
    """Step 1's loss through varlen attention and through the masked path, the same batch and weights."""
    found = {r["name"]: r.get("first_loss") for r in records if r["name"] in (VARLEN, MASKED)}
    if None in found.values() or len(found) < 2:
        return "Varlen against masked attention: not compared (a row did not run)."
    varlen, masked = found[VARLEN], found[MASKED]
    off = abs(varlen - masked) / abs(masked)
    verdict = "agree" if off <= ATTENTION_TOLERANCE else "DIFFER: packed examples may see each other"
    return (f"Varlen against masked attention, step 1's loss on one batch: {varlen:.5f} against {masked:.5f} "
            f"(relative difference {off:.2e}: {verdict}).")  # fmt: skip


def closing_note(env: dict, sizes: Sizes, records: list[dict], smoke: bool) -> str:
    if smoke:
        return (f"Not run on a GPU: this was --smoke ({env['device']}, one plain process, fp32, toy model sizes, "
                f"{sizes.steps} steps); it checks the harness, its numbers say nothing about GPU speed. On a CUDA "
                "machine run "
                "`python benchmarks/gpu_check.py`.")  # fmt: skip
    return (f"Ran on {env['device']}, torch {env['torch']}, transformers {env['transformers']}: one rank, NCCL, "
            f"bf16, batch {sizes.batch_size} x {sizes.seq_len}, {sizes.steps} steps; tokens/s and MFU are medians "
            f"of the logged windows after step {sizes.warmup}. The predicted state is weights, gradients and AdamW "
            "moments; the peak adds activations and temporaries. "
            f"{sum(r['status'] == 'ok' for r in records)} of {len(records)} rows ran"
            + ("; MFU '-': no bf16 peak on file for this GPU (PEAK_FLOPS in the script)."
               if any(r["status"] == "ok" and "mfu" not in r for r in records) else "."))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, one plain process, fp32, toy sizes, 3 steps (CI)")
    p.add_argument("--out", type=Path, default=None, help="where gpu_check.json and logs/ go (default: a temp folder)")
    p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.trl_worker:
        return trl_worker(json.loads(a.trl_worker))
    if not a.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: `--smoke` runs this check on CPU at toy sizes")
    started, sizes, env = time.perf_counter(), SMOKE_SIZES if a.smoke else GPU_SIZES, environment()
    out = a.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    lines = list(script.text_lines(script.DEFAULT_CORPUS))
    corpus = write_corpus(out / "corpus.txt", lines, sizes.examples)
    write_pairs(out / "pairs.jsonl", lines, sizes.examples, most=1 if a.smoke else 8)
    models = build_models(out / "models", TOY_SHAPES if a.smoke else SHAPES, lines, a.smoke)
    records = []
    for c in CONFIGS:
        print(f"[gpu_check] {c.name} ...", flush=True)
        runner = run_config if c.trainer == "script" else run_trl
        left = started + sizes.budget_s - time.perf_counter()
        if isinstance(models[c.model], str):
            result = {"status": "error", "error": models[c.model]}
        elif left < MIN_LAUNCH_S:  # a launch started later would be killed mid-run: an error row, not an answer
            result = {"status": "skipped", "error": f"past the {sizes.budget_s:.0f} s budget"}
        else:
            result = runner(c, replace(sizes, timeout_s=min(sizes.timeout_s, left)), models, corpus, out, a.smoke)
        records.append({**asdict(c), **asdict(sizes), **env, **result})
    for built in ("models", "runs"):
        shutil.rmtree(out / built, ignore_errors=True)
    note = closing_note(env, sizes, records, a.smoke)
    summary = {"records": records, "gpu": not a.smoke, "note": note, "attention": compare_attention(records),
               "wall_s": time.perf_counter() - started, **env}  # fmt: skip
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    print_table(records, a.smoke)
    wall = time.perf_counter() - started
    print(f"\n{summary['attention']}\n{note}\nJSON: {out / 'gpu_check.json'} ({wall:.0f} s in all)")


if __name__ == "__main__":
    main()
