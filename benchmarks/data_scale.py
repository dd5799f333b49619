"""Start-up and memory at data scale, side by side with TRL's SFTTrainer, first and second start (issue 26, item 7).

    pip install -r benchmarks/requirements.txt
    python benchmarks/data_scale.py                    # everything: an hour or more on 2 CPU cores
    python benchmarks/data_scale.py --quick            # every kind of run once, small data: checks the harness
    python benchmarks/data_scale.py --sizes 100000 --seq-lens 128 --skip-bytes   # a subset

What a user waits for before training starts, and what it holds in memory, when the data is large
and the training short: every run is 2 optimizer steps, so start-up (reading, tokenizing and
caching the data, building the model) is nearly all of it. Linux only (it reads /proc).

The data, synthetic and written here (not timed), JSONL in the "messages" schema: short
conversations, one user/assistant pair (three in four) or two, a third of them with a system message
of their own (the rest get Qwen2.5's default one from the chat template), words drawn from
corpus.txt, about 50 tokens each, 30 to 90 (measured and printed with the table); --sizes conversations
(default 100,000 and 1,000,000). For the byte path, plain text lines of about 50 bytes of varied
words, --text-mb MB (10^6 bytes; default 100 and 1,000).

The model: tests/tiny_qwen.py's random Qwen2, MODEL_SHAPE as in benchmarks/trl_comparison.py, its
BPE tokenizer trained on corpus.txt's lines with a vocabulary of 2,000 (the fixture's default 400
cuts English into so many pieces that the template's default system prompt alone is 60 tokens;
Qwen2.5's real vocabulary keeps it near 20) and Qwen2.5's stock chat template.

Each side, 2 Gloo ranks on the CPU, LoRA r 8, alpha 16, dropout 0.05 on q_proj,v_proj, 4
conversations per rank per step, 2 steps, no packing, --seq-len / max_length 128 and 2,048:

    ours   python llm_ddp_parallel_training.py --cpu --nproc 2 --model hf --model-name-or-path MODEL
           --corpus-file DATA.jsonl --seq-len S --max-steps 2 --batch-size 4 --cache-dir CACHE
           --sample-tokens 1 --output-dir OUT ...   (its own evaluation at the end with the defaults a user
           gets: 10% held out, an evaluation reading at most --eval-examples 1,000 of them; a one-token sample)
    TRL    torchrun --standalone --nproc-per-node 2 data_scale.py --trl-worker ...: load_dataset("json"),
           SFTTrainer(model=MODEL, peft_config=LoRA, SFTConfig(assistant_only_loss=True, max_length=S,
           max_steps=2, per_device_train_batch_size=4, use_cpu=True, ddp_backend="gloo")), train, save
           the adapter on rank 0, as benchmarks/trl_baseline.py does; HF_HOME and HF_DATASETS_CACHE in
           a folder of the case's own
    bytes  python llm_ddp_parallel_training.py --cpu --max-steps 2 --corpus-file TEXT.txt --cache-dir CACHE
           --sample-tokens 1 --output-dir OUT   (the tiny byte-level model, one process, default evaluation)

First start: the case's cache folder empty (ours: --cache-dir; TRL: HF_DATASETS_CACHE). Second
start: the same command again, into a new --output-dir / output_dir (the script keeps one run per
folder), the cache as the first start left it. Each case has a cache folder of its own, so no
first start reuses what another case cached (TRL's at seq 2,048 not what it cached at seq 128; the
script's default cache under ~/.cache is never used). If the script's --help does not list
--cache-dir (an older script), it is left out and the report says so. The data file was just
written, so it is in the OS's page cache for both starts, and one untimed import of what either
side uses (torch, transformers' Trainer and Qwen2, peft, datasets, TRL's SFTTrainer) first puts
the libraries there too: "first start" means cold caches of the tools, not a cold disk.

Measured per run:
- wall: seconds from just before the launch (subprocess.Popen) to the launcher's exit, as a user
  waits for it: a thread blocks in os.waitpid on the launcher and takes the time when it returns.
- peak RSS per rank: every 50 ms the launcher's process tree is listed (psutil) and each process's
  VmHWM is read from /proc/PID/status: the kernel's own high-water mark of its resident set, so a
  spike between two polls is still caught; only growth in the last 50 ms before a process exits
  can be missed. The ranks are the launcher's children that carry RANK in their environment (both
  launchers start them so); the reported figure is the largest rank's. The launcher's own peak and
  the ranks' own reports (the script's summary; ru_maxrss in the TRL worker: they agree with VmHWM
  to a few MiB) are kept in results.json as checks. For the byte path the one process is the rank.
  Any other process in the tree (a rank's own children, such as a pool that tokenizes) is not a
  rank: the largest of their peaks is a column of its own. Each poll also reads RssAnon, the
  anonymous part of the resident set (what is not file pages, such as those of a memory-mapped
  cache, which the kernel can drop and every rank shares): its largest sample in any rank is shown
  beside the peak, "(N anon)", a lower bound of its own peak.
  (Not wait4's ru_maxrss of the launched process: Linux carries a process's maxrss across fork and
  exec, so it would count this benchmark's own memory, which holds torch and transformers, as
  the child's.)
- the cache folder's files and size after the run (is the cache there, did the second start add to it?).

Then a Markdown table of every run and the goals (issue text), each met or missed from the
measurements (GB = 10^9 bytes, the stricter reading for memory):
- 100,000 conversations (the smallest of --sizes), each seq len: first start <= 0.7x TRL's; second
  start <= 10 s and <= 0.6x TRL's;
- peak RSS per rank <= TRL's; and ours within 10% between seq 128 and seq 2,048;
- 1,000,000 conversations (the largest of --sizes): the 2-step run on 2 ranks completes, peak RSS
  per rank <= 1.5 GB;
- byte path, 1 GB of text (the largest of --text-mb): 2 steps in one process in <= 15 s (<= 5 s on
  a second start), peak RSS <= 0.6 GB.

A run that fails or times out (--timeout) is a row that says so (its log's tail is printed) and
the benchmark goes on, without the second start of that case (there is no warm cache to start
from). The runs write into a temp folder, removed at the end, also when a run fails or the
benchmark is stopped (Ctrl-C, SIGTERM: the runs still going are ended first); --keep-outputs keeps
it and prints its path, and --out DIR writes into DIR instead, which is never removed (the data
files and the model there are reused by a later run with the same --out; the caches are not).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "llm_ddp_parallel_training.py"
CORPUS = REPO / "corpus.txt"

# As benchmarks/trl_comparison.py: a 4-layer Qwen2, hidden 128. The vocabulary: see the docstring.
MODEL_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4}
VOCAB_SIZE = 2000
LORA = {"r": 8, "alpha": 16, "dropout": 0.05, "targets": "q_proj,v_proj"}
BATCH, STEPS, NPROC = 4, 2, 2
# The system prompt Qwen2.5's template adds to every conversation that has none of its own: the
# tokenizer is trained on it too, as Qwen2.5's own vocabulary covers it.
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
DATA_VERSION = 1  # in the data files' names: a changed generator never reuses old files under --out
POLL_S = 0.05
# What either side imports, imported once untimed before the runs (see the docstring).
WARM_UP = """
import datasets, peft, psutil, torch, torch.distributed.run
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer
from transformers.models.qwen2 import modeling_qwen2
try:
    from trl import SFTConfig, SFTTrainer
except ImportError:
    pass
"""
GB = 1e9
MIB = 2**20
QUICK = {"sizes": [2000], "text_mb": [1.0]}

# The goals (issue 26, item 7).
FIRST_VS_TRL = 0.7
SECOND_VS_TRL, SECOND_MAX_S = 0.6, 10.0
SEQ_RSS_SPREAD = 0.10
LARGE_RSS_GB = 1.5
BYTES_FIRST_S, BYTES_SECOND_S, BYTES_RSS_GB = 15.0, 5.0, 0.6


# ---- the TRL side: one rank, started by torchrun -------------------------------------------


def trl_worker(argv: list[str]) -> None:
    """One rank of the TRL run. Imports only what a TRL user's script would (not this repository's
    script), so that its start-up is TRL's own."""
    p = argparse.ArgumentParser(prog="data_scale.py --trl-worker")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--max-steps", type=int, required=True)
    a = p.parse_args(argv)

    import resource

    import torch
    import torch.distributed as dist
    from datasets import load_dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(
        output_dir=str(a.out),
        assistant_only_loss=True,
        max_length=a.seq_len,
        packing=False,
        per_device_train_batch_size=a.batch_size,
        max_steps=a.max_steps,
        learning_rate=2e-4,  # the script's default for --model hf
        use_cpu=True,
        ddp_backend="gloo",
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        dataloader_drop_last=True,
        seed=1337,
    )
    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules=LORA["targets"].split(","), task_type="CAUSAL_LM")  # fmt: skip
    trainer = SFTTrainer(model=a.model, args=config, train_dataset=load_dataset("json", data_files=a.data)["train"],
                         peft_config=lora)  # fmt: skip
    result = trainer.train()
    if dist.get_rank() == 0:
        trainer.model.save_pretrained(a.out / "adapter")  # the script saves its adapter too
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    peaks = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor([rss], dtype=torch.float64))
    if dist.get_rank() == 0:
        print("result: " + json.dumps({"steps": result.global_step, "train_seconds": result.metrics["train_runtime"],
                                       "peak_rss": [t.item() for t in peaks]}), flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()
    # As the script leaves (leave_finished): without the interpreter's shutdown, where Gloo's threads
    # can abort a finished run. It spares TRL that shutdown's time as it spares ours.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- the data ------------------------------------------------------------------------------


def corpus_words() -> list[str]:
    return sorted({w.lower() for w in re.findall(r"[A-Za-z]+", CORPUS.read_text(encoding="utf-8"))})


def json_phrases(rng: random.Random, words: list[str], count: int, lo: int, hi: int, end: str) -> list[str]:
    """`count` phrases of lo..hi words, capitalised and ended, each already a JSON string."""
    phrases = []
    for _ in range(count):
        text = " ".join(rng.choices(words, k=rng.randint(lo, hi)))
        phrases.append(json.dumps(text[0].upper() + text[1:] + end))
    return phrases


def write_chat(path: Path, count: int, seed: int) -> Path:
    """`count` conversations, one JSON record a line, written in chunks. Messages are drawn from
    pools of 65,536 user and 65,536 assistant phrases (and 256 system prompts), so the records
    are nearly all distinct while one costs a few random numbers and one string. Shapes: one
    pair (50%), a system message and one pair (25%), two pairs (15%), a system message and two
    pairs (10%)."""
    if path.exists():
        return path
    rng = random.Random(seed)
    words = [w for w in corpus_words() if len(w) <= 7]  # short words: short conversations
    system = json_phrases(rng, words, 256, 2, 4, ".")
    user = json_phrases(rng, words, 1 << 16, 1, 4, "?")
    reply = json_phrases(rng, words, 1 << 16, 2, 5, ".")
    bits = rng.getrandbits

    def pair() -> str:
        return (f'{{"role": "user", "content": {user[bits(16)]}}}, '
                f'{{"role": "assistant", "content": {reply[bits(16)]}}}')  # fmt: skip

    part = path.with_name(path.name + ".part")
    with part.open("w", encoding="utf-8") as f:
        for start in range(0, count, 10_000):
            lines = []
            for _ in range(min(10_000, count - start)):
                shape = rng.random()
                own_system = 0.5 <= shape < 0.75 or shape >= 0.9
                turns = [f'{{"role": "system", "content": {system[bits(8)]}}}'] if own_system else []
                turns += [pair(), pair()] if shape >= 0.75 else [pair()]
                lines.append('{"messages": [' + ", ".join(turns) + "]}\n")
            f.write("".join(lines))
    part.rename(path)  # whole or not there: a file of this name is complete
    return path


def write_text(path: Path, nbytes: int, seed: int) -> Path:
    """Text lines of 30-64 characters or a little more (about 50 bytes), words from corpus.txt,
    drawn from a pool of 131,072 distinct lines, until the file holds `nbytes` (a line more at most)."""
    if path.exists():
        return path
    rng = random.Random(seed)
    words = corpus_words()
    pool = []
    for _ in range(1 << 17):
        target, line = rng.randint(30, 64), rng.choice(words).capitalize()
        while len(line) < target:
            line += " " + rng.choice(words)
        pool.append((line + "\n").encode())
    mean = sum(map(len, pool)) / len(pool)
    part = path.with_name(path.name + ".part")
    written = 0
    with part.open("wb") as f:
        while written < nbytes:
            chunk = b"".join(rng.choices(pool, k=min(1 << 16, int((nbytes - written) / mean) + 1)))
            f.write(chunk)
            written += len(chunk)
    part.rename(path)
    return path


def token_stats(model: Path, data: Path, count: int = 2000) -> dict:
    """Tokens per conversation with the chat template, over the file's first `count` records."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    with data.open(encoding="utf-8") as f:
        records = [json.loads(line) for _, line in zip(range(count), f, strict=False)]
    lengths = [len(tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"])
               for r in records]  # fmt: skip
    return {"conversations": len(lengths), "mean": sum(lengths) / len(lengths), "min": min(lengths),
            "max": max(lengths)}  # fmt: skip


# ---- running one command and watching its memory ------------------------------------------

# Every child, each the leader of its own process group (its ranks are in it), so that a timeout
# or a stop ends a run's ranks with it before its folder is removed.
CHILDREN: list[Child] = []


class Child:
    """A command started in a session of its own, with its output in a log file. A thread blocks
    in os.waitpid on it: the exit is timed to the moment it happens."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.done = threading.Event()
        self.returncode: int | None = None
        with log.open("wb") as out:
            self.started = time.perf_counter()
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)  # fmt: skip
        self.ended = self.started
        CHILDREN.append(self)
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        _, status = os.waitpid(self.proc.pid, 0)
        self.ended = time.perf_counter()
        self.returncode = self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.done.set()

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # ended meanwhile
            os.killpg(self.proc.pid, sig)


def stop_children(grace: float = 10) -> None:
    """End every child still running, ranks included: SIGTERM to its process group first (the
    launchers pass it on and the ranks stop), SIGKILL for any still there after `grace` seconds."""
    alive = [child for child in CHILDREN if not child.done.is_set()]
    for child in alive:
        child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in alive:
        if not child.done.wait(max(0.0, deadline - time.monotonic())):
            child.signal_group(signal.SIGKILL)
            child.done.wait(10)


def memory_now(pid: int) -> tuple[int, int] | None:
    """(VmHWM, RssAnon) of /proc/PID/status in bytes: the process's peak resident set so far, and
    the anonymous part of its resident set now (None once it has exited: a zombie has no memory)."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith((b"VmHWM:", b"RssAnon:")):
                    fields[line.split(b":")[0]] = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return (fields[b"VmHWM"], fields.get(b"RssAnon", 0)) if b"VmHWM" in fields else None


def role(proc: object, root_pid: int) -> str | None:
    """The name "rank N" for a child of the launcher with RANK in its environment, else None (a process
    can be caught between fork and exec, still with its parent's environment: asked again later)."""
    import psutil

    try:
        if proc.ppid() != root_pid:
            return None
        rank = proc.environ().get("RANK")
    except (psutil.Error, OSError):
        return None
    return f"rank {rank}" if rank is not None else None


def watch(cmd: list[str], env: dict[str, str], log: Path, timeout: float, single: bool) -> dict:
    """Run `cmd` to its end (or `timeout`), polling its process tree's memory every POLL_S.
    `single`: the process itself is the one rank (the byte path)."""
    import psutil

    child = Child(cmd, env, log)
    root = psutil.Process(child.proc.pid)
    peaks: dict[int, int] = {}
    anon: dict[int, int] = {}  # the largest RssAnon seen: sampled, so a lower bound of its peak
    roles: dict[int, str] = {child.proc.pid: "rank 0" if single else "launcher"}
    timed_out = False
    while not child.done.wait(POLL_S):
        if time.perf_counter() - child.started > timeout:
            timed_out = True
            child.signal_group(signal.SIGTERM)
            if not child.done.wait(15):
                child.signal_group(signal.SIGKILL)
                child.done.wait(15)
            break
        with contextlib.suppress(psutil.Error):
            for proc in [root, *root.children(recursive=True)]:
                if proc.pid not in roles and (name := role(proc, root.pid)):
                    roles[proc.pid] = name
                if (now := memory_now(proc.pid)) is not None:
                    peaks[proc.pid] = max(peaks.get(proc.pid, 0), now[0])
                    anon[proc.pid] = max(anon.get(proc.pid, 0), now[1])
    ranks = {roles[pid]: peak for pid, peak in peaks.items() if roles.get(pid, "").startswith("rank")}
    others = [peak for pid, peak in peaks.items() if pid not in roles]
    return {
        "wall_s": child.ended - child.started,
        "returncode": child.returncode,
        "timed_out": timed_out,
        "rank_peaks_mib": {k: v / MIB for k, v in sorted(ranks.items())},
        "peak_rank_mib": max(ranks.values()) / MIB if ranks else None,
        # Of the resident set, the anonymous memory (not file pages, such as a memory-mapped cache's),
        # the largest sampled in any rank.
        "anon_rank_mib": max((anon[pid] for pid in peaks if roles.get(pid, "").startswith("rank")), default=0) / MIB,
        "launcher_peak_mib": None if single else peaks.get(child.proc.pid, 0) / MIB,
        "other_processes_peak_mib": max(others) / MIB if others else None,
    }


def child_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "HF_DATASETS_CACHE"}}
    # Offline (the model is a local folder), and everything Hugging Face caches in the case's folder.
    return env | {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                  "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(home / "hf-home"),
                  "HF_DATASETS_CACHE": str(home / "hf-datasets")}  # fmt: skip


def folder_size(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []
    return len(files), sum(p.stat().st_size for p in files)


def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# ---- the cases -----------------------------------------------------------------------------


@dataclass
class Case:
    kind: str  # "chat" (2 ranks) or "bytes" (one process)
    tool: str  # "ours" or "TRL"
    size: int  # conversations, or bytes of text
    seq_len: int | None
    data: Path = field(repr=False)
    folder: Path = field(repr=False)  # the case's cache and outputs: fresh for the first start

    @property
    def name(self) -> str:
        what = f"{self.size:,} conversations, seq {self.seq_len}" if self.kind == "chat" else f"{mb(self.size)} text"
        return f"{self.tool} {self.kind}, {what}"


def mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:,.0f} MB" if nbytes >= 1e7 else f"{nbytes / 1e6:,.1f} MB"


def command(case: Case, out: Path, model: Path | None, has_cache_dir: bool) -> list[str]:
    cache = ["--cache-dir", str(case.folder / "cache")] if has_cache_dir else []
    quiet = ["--sample-tokens", "1", "--log-every", "1", "--progress", "plain", "--output-dir", str(out)]
    if case.kind == "bytes":
        return [sys.executable, str(SCRIPT), "--cpu", "--max-steps", str(STEPS), "--corpus-file", str(case.data),
                *quiet, *cache]  # fmt: skip
    if case.tool == "ours":
        return [sys.executable, str(SCRIPT), "--cpu", "--nproc", str(NPROC), "--model", "hf", "--model-name-or-path",
                str(model), "--corpus-file", str(case.data), "--seq-len", str(case.seq_len), "--max-steps", str(STEPS),
                "--batch-size", str(BATCH), "--lora-r", str(LORA["r"]), "--lora-alpha", str(LORA["alpha"]),
                "--lora-dropout", str(LORA["dropout"]), "--lora-targets", LORA["targets"], "--no-pack",
                *quiet, *cache]  # fmt: skip
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
            str(Path(__file__).resolve()), "--trl-worker", "--model", str(model), "--data", str(case.data),
            "--out", str(out), "--seq-len", str(case.seq_len), "--batch-size", str(BATCH),
            "--max-steps", str(STEPS)]  # fmt: skip


def self_reported(case: Case, log: Path) -> tuple[list[float], int | None]:
    """The ranks' own peak RSS reports (MiB) and the optimizer steps done, from the log."""
    text = log.read_text(errors="replace")
    if case.tool == "TRL":
        found = re.search(r"^result: (.+)$", text, re.M)
        if not found:
            return [], None
        result = json.loads(found.group(1))
        return [b / MIB for b in result["peak_rss"]], result["steps"]
    peaks = [float(x.replace(",", "")) for x in re.findall(r"rank \d+: ([\d,.]+) MiB RSS", text)]
    steps = re.search(r"^  steps\s+([\d,]+) x", text, re.M)
    return peaks, int(steps.group(1).replace(",", "")) if steps else None


def run_case(case: Case, start: str, model: Path | None, has_cache_dir: bool, args: argparse.Namespace) -> dict:
    runs = sorted(case.folder.glob("out-*"))
    out = case.folder / f"out-{len(runs) + 1}"  # a new output folder each start; the cache stays
    log = case.folder / f"{start}.log"
    case.folder.mkdir(parents=True, exist_ok=True)
    cmd = command(case, out, model, has_cache_dir)
    measured = watch(cmd, child_env(case.folder), log, args.timeout, single=case.kind == "bytes")
    cache = case.folder / ("hf-datasets" if case.tool == "TRL" else "cache")
    files, size = folder_size(cache)
    reported, steps = self_reported(case, log)
    if measured["timed_out"]:
        status = f"timed out after {args.timeout:.0f} s"
    elif measured["returncode"]:
        status = f"failed (exit {measured['returncode']})"
    elif steps != STEPS:
        status = f"ran {steps} steps, not {STEPS}"
    elif measured["peak_rank_mib"] is None:
        status = "no rank processes seen"
    else:
        status = "ok"
    row = {**{k: v for k, v in asdict(case).items() if k not in ("data", "folder")}, "start": start,
           "status": status, **measured, "self_reported_peak_mib": reported, "steps": steps,
           "cache_files": files, "cache_bytes": size, "command": cmd, "log": str(log)}  # fmt: skip
    peak = f"{row['peak_rank_mib']:,.0f} MiB/rank" if row["peak_rank_mib"] else "no peak"
    print(f"{case.name}, {start} start: {row['wall_s']:.1f} s, {peak}, cache {files} files {mb(size)} [{status}]",
          flush=True)  # fmt: skip
    if status != "ok":
        print(f"  {shlex.join(cmd)}\n  log ({log}), last lines:\n{tail(log)}", flush=True)
    return row


# ---- the report ----------------------------------------------------------------------------


def ok(row: dict | None) -> bool:
    return row is not None and row["status"] == "ok"


def table(rows: list[dict]) -> list[str]:
    lines = ["| workload | data | seq | tool | start | wall | peak RSS per rank | wall vs TRL | RSS vs TRL "
             "| helpers' peak | cache after | status |",
             "|---|--:|--:|---|---|--:|--:|--:|--:|--:|--:|---|"]  # fmt: skip
    for r in rows:
        trl = None
        if r["tool"] == "ours" and r["kind"] == "chat":
            peer = select(rows, kind="chat", tool="TRL", size=r["size"], seq_len=r["seq_len"], start=r["start"])
            trl = peer[0] if peer else None
        both = ok(r) and ok(trl)
        workload = "chat, 2 ranks" if r["kind"] == "chat" else "bytes, 1 process"
        data = f"{r['size']:,} conv." if r["kind"] == "chat" else mb(r["size"])
        peak = f"{r['peak_rank_mib']:,.0f} MiB ({r['anon_rank_mib']:,.0f} anon)" if r["peak_rank_mib"] else "-"
        wall_ratio = f"{r['wall_s'] / trl['wall_s']:.2f}x" if both else "-"
        rss_ratio = f"{r['peak_rank_mib'] / trl['peak_rank_mib']:.2f}x" if both else "-"
        helpers = f"{r['other_processes_peak_mib']:,.0f} MiB" if r["other_processes_peak_mib"] else "-"
        lines.append(
            f"| {workload} | {data} | {r['seq_len'] or '-'} | {r['tool']} | {r['start']} | {r['wall_s']:.1f} s "
            f"| {peak} | {wall_ratio} | {rss_ratio} | {helpers} | {r['cache_files']} files, {mb(r['cache_bytes'])} "
            f"| {r['status']} |"
        )
    return lines


def select(rows: list[dict], **key: object) -> list[dict]:
    return [r for r in rows if all(r[k] == v for k, v in key.items())]


def unusable(ours: list[dict], peers: list[dict] | None = None) -> tuple[bool | None, str] | None:
    """Why a goal cannot be judged from these runs, as (met, numbers): our runs not there (not
    measured) or not ok (missed), TRL's not there or not ok (not measured: nothing to compare
    with). None when every run is there and ok."""
    if not ours:
        return None, "not run"
    if bad := [r for r in ours if not ok(r)]:
        return False, "; ".join(f"ours, {r['start']} start: {r['status']}" for r in bad)
    if peers is not None:
        if not peers:
            return None, "TRL not run"
        if bad := [r for r in peers if not ok(r)]:
            return None, "; ".join(f"TRL, {r['start']} start: {r['status']}" for r in bad)
    return None


def peak(rows: list[dict]) -> float:
    return max(r["peak_rank_mib"] for r in rows)


def goals(rows: list[dict], sizes: list[int], seq_lens: list[int], text_sizes: list[int]) -> list[dict]:
    """Each goal: its text, and met (True/False) or None (not measured), with the numbers."""
    results = []

    def goal(text: str, met: bool | None, numbers: str) -> None:
        results.append({"goal": text, "met": met, "numbers": numbers})

    chat = [r for r in rows if r["kind"] == "chat"]
    if chat:
        small, large = min(sizes), max(sizes)
        for seq in seq_lens:
            for start, limit in (("first", FIRST_VS_TRL), ("second", SECOND_VS_TRL)):
                ours = select(chat, tool="ours", size=small, seq_len=seq, start=start)
                trl = select(chat, tool="TRL", size=small, seq_len=seq, start=start)
                text = f"{start} start <= {limit}x TRL's" + (f" and <= {SECOND_MAX_S:g} s" if start == "second" else "")
                text += f", {small:,} conversations, seq {seq}"
                if why := unusable(ours, trl):
                    goal(text, *why)
                    continue
                a, b = ours[0]["wall_s"], trl[0]["wall_s"]
                met = a <= limit * b and (start == "first" or a <= SECOND_MAX_S)
                goal(text, met, f"{a:.1f} s vs {b:.1f} s ({a / b:.2f}x)")
        for size in sizes:
            for seq in seq_lens:
                ours = select(chat, tool="ours", size=size, seq_len=seq)
                trl = select(chat, tool="TRL", size=size, seq_len=seq)
                text = f"peak RSS per rank <= TRL's, {size:,} conversations, seq {seq} (the larger of both starts)"
                if why := unusable(ours, trl):
                    goal(text, *why)
                else:
                    a, b = peak(ours), peak(trl)
                    goal(text, a <= b, f"{a:,.0f} vs {b:,.0f} MiB ({a / b:.2f}x)")
            if len(seq_lens) > 1:
                short, long = min(seq_lens), max(seq_lens)
                at_short = select(chat, tool="ours", size=size, seq_len=short)
                at_long = select(chat, tool="ours", size=size, seq_len=long)
                text = f"ours: peak RSS per rank at seq {long} within {SEQ_RSS_SPREAD:.0%} of seq {short}'s"
                text += f", {size:,} conversations"
                if why := unusable(at_short) or unusable(at_long):
                    goal(text, *why)
                else:
                    a, b = peak(at_short), peak(at_long)
                    goal(text, abs(b - a) <= SEQ_RSS_SPREAD * min(a, b), f"{b:,.0f} vs {a:,.0f} MiB ({b / a - 1:+.1%})")
        for seq in seq_lens:
            found = select(chat, tool="ours", size=large, seq_len=seq)
            text = f"{large:,} conversations, seq {seq}: 2 steps on 2 ranks complete"
            text += f", peak RSS per rank <= {LARGE_RSS_GB} GB"
            if why := unusable(found):
                goal(text, *why)
            else:
                a = peak(found)
                goal(text, a * MIB <= LARGE_RSS_GB * GB, f"peak {a * MIB / GB:.2f} GB ({a:,.0f} MiB)")
    byte_rows = [r for r in rows if r["kind"] == "bytes"]
    if byte_rows:
        size = max(text_sizes)
        for start, limit in (("first", BYTES_FIRST_S), ("second", BYTES_SECOND_S)):
            found = select(byte_rows, size=size, start=start)
            text = f"byte path, {mb(size)} of text, {start} start: 2 steps in one process in <= {limit:g} s"
            if why := unusable(found):
                goal(text, *why)
            else:
                goal(text, found[0]["wall_s"] <= limit, f"{found[0]['wall_s']:.1f} s")
        found = select(byte_rows, size=size)
        text = f"byte path, {mb(size)} of text: peak RSS <= {BYTES_RSS_GB} GB (the larger of both starts)"
        if why := unusable(found):
            goal(text, *why)
        else:
            a = peak(found)
            goal(text, a * MIB <= BYTES_RSS_GB * GB, f"{a * MIB / GB:.2f} GB ({a:,.0f} MiB)")
    return results


def report(rows: list[dict], found: list[dict], context: dict) -> str:
    lines = [
        "# Start-up and memory at data scale: llm_ddp_parallel_training.py vs TRL's SFTTrainer",
        "",
        *(["**Quick run: sizes too small for these numbers to mean anything.**", ""] if context["quick"] else []),
        f"Machine: {context['machine']}. TRL {context['versions'].get('trl', '?')}, datasets "
        f"{context['versions'].get('datasets', '?')}, transformers {context['versions'].get('transformers', '?')}.",
        "",
    ]
    if "tokens" in context:
        t = context["tokens"]
        lines += [f"Chat data: {t['mean']:.1f} tokens per conversation with the chat template (min {t['min']}, "
                  f"max {t['max']}, over the first {t['conversations']:,}); {context['model']}.", ""]  # fmt: skip
    if not context["has_cache_dir"]:
        lines += ["The script's --help has no --cache-dir: its runs went without one (a second start then "
                  "finds no cache of its own to reuse).", ""]  # fmt: skip
    lines += [
        "*wall*: launch to exit. *peak RSS per rank*: the largest rank's VmHWM; in brackets the largest "
        "RssAnon sampled in a rank (the anonymous memory, not file pages such as a memory-mapped cache's). "
        "*vs TRL*: against TRL's run of the same data, seq len and start. *helpers' peak*: the largest peak of "
        "any other process in the tree (the ranks' own children, such as a pool that tokenizes), not counted "
        "as a rank. *cache after*: the case's cache folder after the run (ours: --cache-dir; TRL: "
        "HF_DATASETS_CACHE).",
        "",
        *table(rows),
        "",
        "## Goals",
        "",
    ]
    for g in found:
        mark = {True: "met", False: "MISSED", None: "not measured"}[g["met"]]
        lines.append(f"- **{mark}**: {g['goal']}: {g['numbers']}")
    return "\n".join([*lines, ""])


# ---- the benchmark -------------------------------------------------------------------------


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "peft", "trl", "datasets"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def measure(out: Path, args: argparse.Namespace) -> None:
    try:
        import psutil  # noqa: F401
    except ImportError:
        raise SystemExit("benchmarks/data_scale.py needs psutil: pip install -r benchmarks/requirements.txt") from None
    if not args.skip_trl and not args.skip_chat:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("no TRL: pip install -r benchmarks/requirements.txt, or --skip-trl") from None
    sys.path.insert(0, str(REPO / "benchmarks"))
    from memory import machine

    env = child_env(out / "untimed")
    helped = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, env=env,
                            timeout=300, check=True)  # fmt: skip
    has_cache_dir = "--cache-dir" in helped.stdout
    if not has_cache_dir:
        print("note: the script's --help has no --cache-dir: its runs go without one", flush=True)
    # Untimed: the libraries into the OS's page cache, so that no first start pays for a cold disk.
    subprocess.run([sys.executable, "-c", WARM_UP], env=env, timeout=300, check=True)
    context = {"quick": args.quick, "machine": machine(), "versions": versions(), "has_cache_dir": has_cache_dir}
    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    text_sizes = [round(x * 1e6) for x in args.text_mb]

    def save() -> None:
        results = {**context, "rows": rows, "goals": goals(rows, args.sizes, args.seq_lens, text_sizes)}
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))

    def both_starts(case: Case, model: Path | None) -> None:
        shutil.rmtree(case.folder, ignore_errors=True)  # a cold first start, also in an --out used before
        for start in ("first", "second"):
            rows.append(run_case(case, start, model, has_cache_dir, args))
            save()
            if not ok(rows[-1]):  # no warm cache to start from: a second start would be a first again
                print(f"{case.name}: no second start, the first was not ok", flush=True)
                break

    if not args.skip_chat:
        sys.path.insert(0, str(REPO / "tests"))
        from tiny_qwen import build_tiny_qwen, corpus_lines
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = out / "tiny-qwen"
        shape = MODEL_SHAPE | {"max_position_embeddings": max(2048, *args.seq_lens)}
        if not (model / "config.json").exists():
            build_tiny_qwen(model, [*corpus_lines(CORPUS), *[DEFAULT_SYSTEM] * 3], vocab_size=VOCAB_SIZE, **shape)
        context["model"] = f"tiny random Qwen2 {shape}, vocabulary {VOCAB_SIZE}"
        tools = ["ours"] + ([] if args.skip_trl else ["TRL"])
        for size in args.sizes:
            started = time.perf_counter()
            data = write_chat(data_dir / f"chat-{size}-v{DATA_VERSION}-seed{args.seed}.jsonl", size, args.seed)
            print(f"data: {data.name}, {mb(data.stat().st_size)} ({time.perf_counter() - started:.1f} s)", flush=True)
            if "tokens" not in context:
                context["tokens"] = token_stats(model, data)
            for seq in args.seq_lens:
                for tool in tools:
                    folder = out / f"{tool.lower()}-chat-{size}-seq{seq}"
                    both_starts(Case("chat", tool, size, seq, data, folder), model)
    if not args.skip_bytes:
        for size in text_sizes:
            started = time.perf_counter()
            data = write_text(data_dir / f"text-{size}-v{DATA_VERSION}-seed{args.seed}.txt", size, args.seed)
            print(f"data: {data.name}, {mb(data.stat().st_size)} ({time.perf_counter() - started:.1f} s)", flush=True)
            both_starts(Case("bytes", "ours", size, None, data, out / f"ours-bytes-{size}"), None)
    save()
    found = goals(rows, args.sizes, args.seq_lens, text_sizes)
    print("\n" + report(rows, found, context))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000], metavar="N",
                   help="conversations in the chat files (the goals: the smallest and the largest)")  # fmt: skip
    p.add_argument("--seq-lens", type=int, nargs="+", default=[128, 2048], metavar="S")
    p.add_argument("--text-mb", type=float, nargs="+", default=[100.0, 1000.0], metavar="MB",
                   help="MB (10^6 bytes) of text for the byte path (the goals: the largest)")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {QUICK['sizes'][0]:,} conversations and {QUICK['text_mb'][0]:g} MB of text "
                   "(unless --sizes / --text-mb are given)")  # fmt: skip
    p.add_argument("--skip-trl", action="store_true", help="only this script's runs")
    p.add_argument("--skip-chat", action="store_true", help="no chat runs (the byte path only)")
    p.add_argument("--skip-bytes", action="store_true", help="no byte-path runs")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take before it is stopped")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="write the data, the runs' outputs and results.json here, and keep them "
                   "(default: a temp folder)")  # fmt: skip
    p.add_argument("--keep-outputs", action="store_true",
                   help="keep the temp folder (removed by default, also on failure or Ctrl-C) "
                   "and print its path")  # fmt: skip
    args = p.parse_args()
    if args.quick:
        defaults = {a.dest: a.default for a in p._actions}
        for key, value in QUICK.items():
            if getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    if args.skip_chat and args.skip_bytes:
        p.error("--skip-chat and --skip-bytes leave nothing to run")
    sys.path.insert(0, str(REPO / "benchmarks"))
    from benchmark import in_output_folder  # the temp-folder lifecycle shared by the benchmarks

    work = lambda out, _removed: measure(out, args)  # noqa: E731
    in_output_folder(args.out, args.keep_outputs, "data-scale-", work, stop_children)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--trl-worker"]:
        trl_worker(sys.argv[2:])
    else:
        main()
