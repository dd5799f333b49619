"""Train a causal language model across processes with PyTorch DistributedDataParallel.

One file, two reading depths. Sections 1-8 are the teaching core, the DDP a learner came to read,
in the order the data flows, and a program of its own (run_core: cut at the banner, it trains); after
the banner, sections 9-18 make it production-grade, reaching the loop only through its Hooks:

    1. Settings             everything a run is told, in one frozen RunConfig
    2. Ranks                torchrun's environment says who this process is; then the process group
                            (NCCL on Linux GPUs, Gloo on CPU)
    3. Data                 text becomes fixed-length byte examples; a DistributedSampler hands
                            every rank a disjoint slice of each epoch
    4. Model                a byte-level causal Transformer trained from scratch
    5. Sync                 the gradient all-reduce during backward, by torch's DDP and by a
                            from-scratch DDP beside it
    6. Train                one loop for every model: forward, backward, sync, clip, step
    7. Sharding             ZeRO-1 and FSDP from scratch, beside torch's ZeroRedundancyOptimizer
                            and fully_shard
    8. Model splitting      tensor, pipeline and context parallelism from scratch, beside torch's
    -------------------     a reader who came for DDP may stop here
    9. Command line         argparse fills the RunConfig, and refuses what cannot run
   10. Launcher             ranks started without torchrun (--nproc), and meetings with no deadline
   11. Records              .jsonl schemas, chat templates and assistant-only targets, packing,
                            the token cache
   12. Pretrained models    Qwen2.5, Llama, Gemma, Mistral, Phi-3, ... with LoRA; the tiny model's
                            size check
   13. Reports and checks   how gradients travel, the whole state from shards, --inspect,
                            --verify-sync
   14. Timeline             every rank's first --trace-steps steps on one clock, as a trace file
                            and a picture
   15. Step side work       warmup, precision, faults on purpose, the step's side work, stop requests
   16. Evaluate and report  held-out loss, progress, metrics, MFU, the loss plot, the memory table,
                            summary
   17. Save                 rank 0 writes while the others wait for it; locks, checkpoints and
                            resume, stop markers
   18. Main                 launch -> connect -> shard -> train -> sync -> save -> sample, and one
                            clear exit on every path

Run it as one plain process, under torchrun on one or many machines, or let it start its own ranks:

    python llm_ddp_parallel_training.py --cpu --max-steps 20
    torchrun --standalone --nproc_per_node=2 llm_ddp_parallel_training.py --cpu
    python llm_ddp_parallel_training.py --cpu --nproc 2
"""

from __future__ import annotations

import argparse
import codecs
import collections
import contextlib
import errno
import functools
import gc
import hashlib
import importlib.util
import inspect
import io
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import timedelta
from difflib import get_close_matches
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __name__ == "__main__":  # Ctrl-C in the seconds the imports below take, or before training: nothing to save yet,
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))  # so a shell's 130, no traceback (StopRequest)

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm

if TYPE_CHECKING:  # type hints only: the tiny path never imports transformers
    from transformers import PreTrainedTokenizerBase

DEFAULT_CORPUS = Path(__file__).resolve().parent / "corpus.txt"
DEFAULT_OUTPUT_DIR = Path("outputs")  # every run that names no --output-dir shares it
TINY_FINAL = "tiny_transformer.pt"  # the trained tiny model, in OUTPUT_DIR
IGNORE_INDEX = -100  # target id that cross-entropy skips: padding never counts in the loss
NEWLINE = 10  # the byte that opens and closes every line for the byte-level model


class UsageError(Exception):
    """Bad input (flags, files, hardware): the same on every rank, reported as one line."""


class TrainingError(Exception):
    """A run-time failure that every rank agreed on (through a collective), reported as one line."""


def first_line(error: BaseException) -> str:
    text = str(error).strip().removeprefix(CALLBACK_WRAPPER)
    # Gloo appends advice ("This is typically caused by...") that buries the fact itself.
    return text.splitlines()[0].split(" This is typically")[0] if text else type(error).__name__


# How torch words an error that reaches a future through a .then() callback (--trace-steps adds one).
CALLBACK_WRAPPER = "Got the following error when running the callback: RuntimeError: "


# ----------------------------------------------------------------------------------------------
# 1. Settings: everything a run is told, in one frozen RunConfig; each field is also its flag
# ----------------------------------------------------------------------------------------------


def flag(default: object, help: str, group: str | None = None, **reading: object) -> Any:
    """A setting and its flag, declared once: default, --help line, the --help group it opens, and how argparse
    reads it (type, choices, metavar, action; `within`, a range; a type named in words, as "layer names")."""
    return field(default=default, metadata={"help": help, "group": group, **reading})


# The ranges numeric flags accept, as data: Within, with the command line, checks them as argparse reads.
POSITIVE, COUNT = {"kind": int, "low": 1}, {"kind": int, "low": 0}  # 1, 2, ...; and 0 (off), 1, 2, ...
AMOUNT, RATE = {"kind": float, "low": 0}, {"kind": float, "low": 0, "low_open": True}  # >= 0; > 0
PROBABILITY = {"kind": float, "low": 0, "high": 1, "high_open": True}


PRETRAINED_GROUP = "pretrained model (--model hf)"
TINY_GROUP = "tiny model"


@dataclass(frozen=True)
class RunConfig:
    """Every setting of one run, the same on every rank; each field is a flag (--seq-len for seq_len).
    A default of None is decided once the rest is known (settle_defaults), as its help says."""

    model: str = flag("tiny", "tiny: a byte-level Transformer from scratch; hf: a pretrained causal LM from the "
                      "Hugging Face Hub or a local folder (--model-name-or-path), LoRA or full fine-tuning; qwen: the "
                      "same as hf", "run", choices=["tiny", "hf", "qwen"])  # fmt: skip
    corpus_file: Path = flag(DEFAULT_CORPUS, "UTF-8 text, one training sample per line (blank lines skipped), "
                             "or .jsonl records", type=Path)  # fmt: skip
    output_dir: Path = flag(DEFAULT_OUTPUT_DIR, "where rank 0 writes", type=Path)
    seed: int = flag(
        1337, "init, shuffle and split; dropout adds the rank", within={"kind": int, "low": 0, "high": 2**63 - 1}
    )
    seq_len: int = flag(128, "tokens per example (bytes for tiny)", within=POSITIVE)
    pack: bool | None = flag(None, "pack examples into full rows (default: on for tiny, off for hf); --no-pack: one "
                             "padded example per row", action=argparse.BooleanOptionalAction)  # fmt: skip
    data_format: str = flag(
        "auto",
        "for a .jsonl corpus: the records' schema (auto: decided from the records)",
        choices=["auto", "text", "messages", "prompt-completion", "sharegpt", "alpaca", "preference"],
    )
    train_on_prompt: bool = flag(False, "chat and prompt-completion data: train on every token, not only the replies",
                                 action="store_true")  # fmt: skip
    show_examples: int = flag(0, "print the first N records as the model sees them, targets in [[ ]], and exit",
                              within=COUNT, metavar="N")  # fmt: skip
    cache_dir: Path | None = flag(None, "where the corpus is kept tokenized: built once, then read by every rank as "
                                  "batches ask (default: $XDG_CACHE_HOME or ~/.cache, then llm_ddp_parallel_training); "
                                  "none: tokenize in memory, for this run only", metavar="DIR")  # fmt: skip

    d_model: int = flag(128, "embedding width", TINY_GROUP, within=POSITIVE)
    n_heads: int = flag(4, "attention heads", within=POSITIVE)
    n_layers: int = flag(2, "Transformer blocks", within=POSITIVE)
    dropout: float = flag(0.0, "dropout probability", within=PROBABILITY)

    dataset: str | None = flag(None, "read the records with Hugging Face datasets instead of --corpus-file: a Hub "
                               "name, a local parquet, JSONL or CSV file, or a folder save_to_disk wrote",
                               PRETRAINED_GROUP, metavar="NAME_OR_PATH")  # fmt: skip
    dataset_split: str = flag("train", "the split of --dataset to train on")
    dataset_config: str | None = flag(None, "the configuration of a Hub --dataset that has several", metavar="NAME")
    model_name_or_path: str = flag("Qwen/Qwen2.5-0.5B-Instruct", "pretrained causal LM: hub name or local folder "
                                   "(Qwen2, Llama, Gemma, Mistral, Phi-3, ...)")  # fmt: skip
    lora_r: int = flag(8, "rank of the low-rank update B @ A", within=POSITIVE)
    lora_alpha: float = flag(16.0, "update scale is alpha / r", within=RATE)
    lora_dropout: float = flag(0.05, "dropout on the adapter input", within=PROBABILITY)
    lora_targets: tuple[str, ...] = flag(("q_proj", "v_proj"), "linear layers to adapt, comma-separated; all-linear: "
                                         "every linear layer but the output head", type="layer names")  # fmt: skip
    dtype: str = flag("auto", "weights dtype; auto: bfloat16 on GPUs that support it, else float32",
                      choices=["auto", "float32", "bfloat16", "float16"])  # fmt: skip
    attn_implementation: str = flag("auto", "attention kernel; auto: varlen for packed rows on a GPU computing bf16, "
                                    "else sdpa; varlen: each packed example attends to itself alone, no mask (torch's "
                                    "variable-length flash kernel; on CPU, SDPA example by example); flash_attention_2 "
                                    "needs CUDA and the flash-attn package",
                                    choices=["auto", "sdpa", "varlen", "flash_attention_2", "eager"])  # fmt: skip
    trust_remote_code: bool = flag(False, "allow model code from the hub (the families transformers knows need none)",
                                   action="store_true")  # fmt: skip
    gradient_checkpointing: bool = flag(False, "recompute activations in backward to save memory", action="store_true")
    checkpoint_policy: str = flag("full", "what --gradient-checkpointing recomputes: full, each block's every "
                                  "activation; selective, all but its matmuls' and attention's outputs (less "
                                  "recompute, more memory)", choices=["full", "selective"])  # fmt: skip
    finetune: str = flag("lora", "lora: train adapters only; full: train every weight (needs --sharding full to fit "
                         "where DDP does not)", choices=["lora", "full"])  # fmt: skip
    head_loss: str = flag("fused", "the head's loss, chunk by chunk: fused finds its gradients in forward, chunked "
                          "recomputes in backward; full: all logits", choices=["fused", "chunked", "full"])  # fmt: skip
    objective: str = flag("sft", "sft: learn the replies; dpo: prefer each pair's chosen reply to its rejected one "
                          "(Direct Preference Optimization, preference records)", choices=["sft", "dpo"])  # fmt: skip
    dpo_beta: float = flag(0.1, "DPO's beta: how far preferences may pull the model from its reference", within=RATE)

    batch_size: int = flag(8, "examples per rank per step", "optimisation", within=POSITIVE)
    max_steps: int = flag(None, "optimizer steps, across epochs (default: 600, or no cap when --epochs is given)",
                          within=POSITIVE)  # fmt: skip
    epochs: int = flag(0, "passes over the training data; --max-steps still caps (0: --max-steps alone decides)",
                       within=COUNT)  # fmt: skip
    lr: float = flag(None, "peak learning rate (default: 3e-3 tiny, 2e-4 hf)", within=RATE)
    min_lr: float = flag(None, "end of the cosine decay (default: lr/10)", within=AMOUNT)
    warmup_steps: int = flag(20, "linear warmup from 0 to --lr", within=COUNT)
    weight_decay: float = flag(0.01, "weight decay", within=AMOUNT)
    grad_clip: float = flag(1.0, "clip the global gradient norm to this (0: off)", within=AMOUNT)
    precision: str = flag("auto", "autocast: auto is bf16 on GPUs that support it, else fp32; fp16 (GPU only) uses a "
                          "GradScaler", choices=["auto", "fp32", "bf16", "fp16"])  # fmt: skip
    tf32: bool = flag(True, "TF32 for fp32 matmuls on CUDA GPUs", action=argparse.BooleanOptionalAction)
    compile: bool | None = flag(None, "torch.compile each Transformer block and the fused head's softmax: faster "
                                "steps once the first ones have compiled (minutes for a large model); default on "
                                "with CUDA GPUs, off on CPU", action=argparse.BooleanOptionalAction)  # fmt: skip

    val_fraction: float = flag(0.1, "share of lines held out for validation", "validation and reporting",
                               within=PROBABILITY)  # fmt: skip
    eval_every: int = flag(100, "steps between evaluations (0: at the end)", within=COUNT)
    eval_examples: int = flag(1000, "held-out examples an evaluation reads, spread evenly over the held-out set, "
                              "the same ones each time (0: every one, exact however large)", within=COUNT)  # fmt: skip
    eval_file: Path | None = flag(None, "held-out data from a file of its own, in any format the training data takes "
                                  "(then nothing is held out of the training data)", type=Path)  # fmt: skip
    progress: str = flag("auto", "auto: a bar on a terminal, else log lines", choices=["auto", "bar", "plain"])
    log_every: int = flag(25, "steps between log lines", within=POSITIVE)
    metrics_file: Path | None = flag(None, "append one JSON object per logged step", type=Path)
    report_to: tuple[str, ...] = flag(("none",), "trackers that get the metrics, the settings and the summary, comma-"
                                      "separated: tensorboard, wandb, trackio (their files under OUTPUT_DIR)",
                                      type="tracker names")  # fmt: skip
    plot: bool = flag(False, "write OUTPUT_DIR/loss.png at the end (needs matplotlib)", action="store_true")
    time_breakdown: bool = flag(False, "time data/forward/backward/sync/optimizer in every step", action="store_true")
    trace_steps: int = flag(0, "record every rank's first N steps to OUTPUT_DIR/trace.json (Perfetto); with --plot, "
                            "timeline.png", within=COUNT, metavar="N")  # fmt: skip

    ddp: str = flag("torch", "torch's DDP (and ZeroRedundancyOptimizer, fully_shard), or the from-scratch ones",
                    "gradients", choices=["torch", "manual"])  # fmt: skip
    sharding: str = flag("none", "none: DDP, a whole copy per rank; optimizer: ZeRO-1, optimizer state split across "
                         "ranks; full: FSDP (ZeRO-3), weights, gradients and optimizer state split",
                         choices=["none", "optimizer", "full"])  # fmt: skip
    bucket_mb: float = flag(25.0, "gradient bucket size for the all-reduce, in MiB (torch's bucket_cap_mb)",
                            within={"kind": float, "low": 1e-3, "high": 65536, "unit": " MiB"})  # fmt: skip
    grad_accum_steps: int = flag(1, "micro-steps per optimizer step (k-1 without sync)", within=POSITIVE)
    loss_normalization: str = flag("global-tokens", "exact mean over every token of the global batch, or the biased "
                                   "mean of per-rank means", choices=["global-tokens", "mean-of-means"])  # fmt: skip
    optimizer: str = flag("adamw", "sgd: plain, no momentum", choices=["adamw", "sgd"])
    grad_compression: str = flag("none", "bf16: all-reduce gradients as bfloat16, half the bytes (for slow links; "
                                 "rounds each gradient)", choices=["none", "bf16"])  # fmt: skip
    verify_sync: int = flag(0, "every N steps check that all ranks hold identical gradients, weights and optimizer "
                            "state", within=COUNT, metavar="N")  # fmt: skip
    inspect: bool = flag(False, "report shards, buckets and per-rank gradients", action="store_true")
    inject_fault: str | None = flag(None, "teaching/testing aid: make RANK fail at STEP once; KIND kill "
                                          "(default), raise, nan, desync, save or hang", type="fault plan",
                                          metavar="RANK:STEP[:KIND]")  # fmt: skip

    tp: int = flag(1, "tensor parallelism: every block's matrices split across groups of N ranks (Megatron's "
                   "layout); the data-parallel degree is the world size / (tp x pp)", "model splitting",
                   within=POSITIVE, metavar="N")  # fmt: skip
    pp: int = flag(1, "pipeline parallelism: the model cut into N stages of whole blocks, each micro-step's batch "
                   "cut into N micro-batches flowing through them", within=POSITIVE, metavar="N")  # fmt: skip
    pp_schedule: str = flag("1f1b", "gpipe: every micro-batch forward, then every backward; 1f1b: one forward, one "
                            "backward, as soon as they can (less activation memory)",
                            choices=["gpipe", "1f1b"])  # fmt: skip
    cp: int = flag(1, "context parallelism: each example's sequence split across N ranks, ring attention passing "
                   "keys and values around them; the data-parallel degree is the world size / (tp x pp x cp)",
                   within=POSITIVE, metavar="N")  # fmt: skip

    save_every: int = flag(0, "full training state every N steps and at the end (0: off)", "checkpoints and resume",
                           within=COUNT, metavar="N")  # fmt: skip
    keep_last: int = flag(2, "how many checkpoints to keep", within=POSITIVE, metavar="K")
    overwrite: bool = flag(False, "replace a finished run's model in OUTPUT_DIR (else: refused)", action="store_true")
    resume: str = flag("auto", "auto: continue from the newest complete checkpoint in OUTPUT_DIR/checkpoints, if any",
                       metavar="auto|none|PATH")  # fmt: skip

    backend: str = flag("auto", "auto: NCCL on Linux with CUDA, else Gloo", "hardware and process group",
                        choices=["auto", "gloo", "nccl"])  # fmt: skip
    cpu: bool = flag(False, "train on CPU even if CUDA is available", action="store_true")
    nproc: int = flag(0, "start N ranks on this machine without torchrun (Windows, macOS, notebooks); 0: off",
                      within=COUNT, metavar="N")  # fmt: skip
    timeout_s: float = flag(300.0, "how long a collective may wait for the other ranks",
                            within={"kind": float, "low": 1, "high": 7 * 86400, "unit": " seconds"})  # fmt: skip

    prompt: str = flag(None, "text the trained model continues (default: \"Each rank\" for a tiny model, a question "
                       "for a pretrained one)", "sample")  # fmt: skip
    sample_tokens: int = flag(120, "length of the sample", within=POSITIVE)
    sample_every: int = flag(0, "every N steps, samples for --prompt and, on chat data, three held-out user turns",
                             within=COUNT, metavar="N")  # fmt: skip
    temperature: float = flag(None, "0: greedy (default: 0.8 for a tiny model, 0 for a pretrained one)", within=AMOUNT)
    top_p: float = flag(1.0, "sample from the likeliest tokens that add up to this probability (0: the likeliest one)",
                        within={"kind": float, "low": 0, "high": 1}, metavar="P")  # fmt: skip
    chat: Path | None = flag(None, "talk to a trained output (tiny checkpoint, adapters, merged or full model): answer "
                             "--prompt and exit, or on a terminal without --prompt, turn by turn", type=Path,
                             metavar="PATH")  # fmt: skip
    merge_lora: str | None = flag(None, "write OUTPUT_DIR/merged, LoRA adapters merged into their base model: "
                                  "after training, or from ADAPTER_DIR alone", nargs="?", const="",
                                  metavar="ADAPTER_DIR")  # fmt: skip


def settle_defaults(args: argparse.Namespace, typed: set[str]) -> None:
    """The defaults of None, decided once the rest is known, as each flag's help says; `typed`: the
    flags the command line spelt out."""
    if args.max_steps is None:  # 0: no cap, for --epochs to decide (see steps_for_epochs)
        args.max_steps = 0 if args.epochs else 600
    if args.pack is None:  # byte windows cut anywhere; a pretrained model packs whole examples, kept apart, when asked
        args.pack = args.model == "tiny"
    if args.lr is None:  # a pretrained model wants a far gentler step than one from scratch; all its weights gentler
        args.lr = (2e-5 if args.finetune == "full" else 2e-4) if args.model == "hf" else 3e-3
    if args.min_lr is None:
        args.min_lr = args.lr / 10
    if args.prompt is None:  # the tiny corpus's opening words; a pretrained model is asked what it may know
        args.prompt = "Each rank" if args.model == "tiny" else "What does an all-reduce do?"
    if args.compile is None:  # where it pays: on GPUs, the model whole or sharded (not yet cut by --tp, --pp, --cp)
        args.compile = torch.cuda.is_available() and not args.cpu and args.tp * args.pp * args.cp == 1
    if args.temperature is None and not args.chat:  # tiny samples drew at 0.8, pretrained ones greedily; --chat:
        args.temperature = 0.8 if args.model == "tiny" else 0.0  # as what it loads (replier)


# ----------------------------------------------------------------------------------------------
# 2. Ranks: torchrun's environment says who this process is; then the process group
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    """Everything this process knows about its place in the job."""

    rank: int  # 0 .. world_size-1, unique across all machines
    local_rank: int  # 0 .. local_world_size-1 on this machine: picks the GPU
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None: a plain single process, no process group
    why: str  # the reason for the backend/device choice, printed at start
    control: dist.ProcessGroup | None = None  # Gloo group for host numbers under NCCL (None: the default group)
    store: dist.Store | None = None  # the rendezvous key-value store the ranks met in
    launch: str | None = None  # this torchrun launch, the same in all its restarts (launch_token)

    @classmethod
    def from_process_group(cls) -> Dist:
        """This process's place in a process group already started: for using ManualDDP,
        ShardedOptimizer or ManualFSDP in a script of your own."""
        backend = dist.get_backend()
        return cls(
            rank=dist.get_rank(),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=dist.get_world_size(),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
            device=torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu"),
            backend=backend,
            why="a process group started by the caller",
        )

    @property
    def is_main(self) -> bool:
        # Decisions "only one process does this" use the global rank: LOCAL_RANK 0 exists
        # once per machine, so testing it would make every machine write the checkpoint.
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    # Under DDP every rank is a replica: it reads its own share of the data (dp of them, this one dp_rank),
    # averages its gradients with every other rank (replicas, in data_group: the default group, None) and
    # draws its own dropout (seed_offset).
    dp = replicas = property(lambda self: self.world_size)
    dp_rank = seed_offset = property(lambda self: self.rank)
    data_group = None


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ or "WORLD_SIZE" in os.environ


def choose_backend_and_device(cfg: RunConfig, local_rank: int, local_world: int) -> tuple[str, torch.device, str]:
    cuda = torch.cuda.is_available()
    if cfg.backend == "nccl":
        if cfg.cpu:
            raise UsageError("--backend nccl needs GPUs but --cpu was given; use --backend gloo")
        if not cuda:
            raise UsageError("--backend nccl needs CUDA, and torch sees no CUDA device; use --backend gloo")
        if not dist.is_nccl_available():
            raise UsageError("--backend nccl: this torch build has no NCCL (it ships on Linux only)")
    use_cuda = cuda and not cfg.cpu
    if use_cuda and local_world > torch.cuda.device_count():
        raise UsageError(
            f"{local_world} ranks on this machine but only {torch.cuda.device_count()} GPU(s); "
            "lower --nproc_per_node or add --cpu"
        )
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if cfg.backend != "auto":
        return cfg.backend, device, f"--backend {cfg.backend} was asked for"
    if use_cuda and sys.platform.startswith("linux"):
        return "nccl", device, "CUDA is available on Linux: NCCL is the fast GPU collective library"
    if use_cuda:
        return "gloo", device, f"NCCL is Linux-only and this is {sys.platform}: Gloo (it reduces CUDA tensors too)"
    why = "--cpu was given" if cfg.cpu else "no CUDA device"
    return "gloo", device, f"{why}: Gloo runs the collectives on CPU"


def setup_distributed(cfg: RunConfig, meet: Callable[[timedelta], tuple] = lambda timeout: (None, None)) -> Dist:
    """Read the rank facts torchrun exported and join the process group (or stay single). `meet` gives
    the store the ranks meet in and their launch; (None, None): one built from MASTER_ADDR/PORT."""
    if not launched_by_torchrun():
        use_cuda = torch.cuda.is_available() and not cfg.cpu
        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        return Dist(0, 0, 1, 1, device, None, "not launched by torchrun: one process, no process group")
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank, local_world = int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", world))
    backend, device, why = choose_backend_and_device(cfg, local_rank, local_world)
    if "TORCHELASTIC_RUN_ID" not in os.environ and local_rank == 0:  # a hand-made launch: say what it waits for
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        print(f"[connect] not started by torchrun: waiting up to {cfg.timeout_s:g} s for {world} ranks at {where}")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, so rank r never touches GPU 0
    timeout = timedelta(seconds=cfg.timeout_s)  # bounds every collective: a silent rank fails the job, not hangs it
    try:
        agent_store, launch = meet(timeout)
        dist.init_process_group(
            backend=backend,
            store=agent_store,
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    except (RuntimeError, ValueError) as e:  # DistStoreError and friends are RuntimeErrors
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise TrainingError(
            f"rank {rank} of {world} could not join the process group at {where}: {first_line(e)}"
        ) from None
    # Under NCCL a second, Gloo group carries the step's host numbers (token counts, stop votes).
    control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    # Without torchrun's agent store, torch built one from MASTER_ADDR/PORT: take that one.
    store = agent_store or dist.distributed_c10d._get_default_store()
    return Dist(rank, local_rank, world, local_world, device, backend, why, control, store, launch)


def teardown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        # DDP's reducer and the gradient hooks hold the process group in reference cycles;
        # collect them while the interpreter is fully alive. Left to interpreter shutdown,
        # Gloo's threads can still own tensors then, and the process aborts (pytorch#179291).
        gc.collect()
        dist.destroy_process_group()


def all_reduce_sum(d: Dist, values: list[float]) -> list[float]:
    """Sum a few host numbers over all ranks, on the CPU through Gloo (d.control): under NCCL a read
    back from the GPU would wait for all the GPU work queued before it."""
    if not d.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=d.control)
    return t.tolist()


# ----------------------------------------------------------------------------------------------
# 3. Data: text -> fixed-length byte examples -> a DistributedSampler slice per rank
# ----------------------------------------------------------------------------------------------


def held_out(n: int, val_fraction: float, seed: int) -> np.ndarray:
    """Which of n lines (or records) are held out for validation (bool each). Seeded by --seed alone, not
    the rank: every rank agrees without talking, and no held-out line leaks into another rank's training."""
    n_val = max(1, round(n * val_fraction)) if val_fraction else 0
    if n_val >= n:
        raise UsageError(
            f"corpus too small: {n} line(s) cannot be split into training and validation lines "
            f"(--val-fraction {val_fraction}); add lines or pass --val-fraction 0"
        )
    chosen = np.zeros(n, dtype=bool)
    if n_val:  # int32: the same permutation as int64's, in half the memory (a million lines: 4 MB)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
        chosen[order[:n_val].numpy()] = True
    return chosen


def trim_padding(batch: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Stack a batch (inputs, targets[, positions]) and cut the columns after its last target: padding
    sits on the right, where causal attention never looks, so the cut only saves compute."""
    columns = [torch.stack(column) for column in zip(*batch, strict=True)]
    used = (columns[1] != IGNORE_INDEX).any(dim=0).nonzero()
    width = int(used.max()) + 1 if len(used) else columns[1].shape[1]
    return tuple(c[:, :width].contiguous() for c in columns)


@dataclass(frozen=True)
class Lines:
    """Lines as one byte stream (packed_stream), the bytes the tokens: line i is stream[edges[i] + 1 : edges[i + 1]]."""

    stream: np.ndarray  # uint8: in memory, or a view of the token cache's file (FileArray)
    edges: np.ndarray  # (N + 1,) the framing newlines' positions
    key: str  # what the bytes are: the token cache's key, part of the training data's digest
    chosen: np.ndarray | None = None  # bool, one per line; None: every line

    @classmethod
    def from_texts(cls, texts: list[str]) -> Lines:
        """Lines given as texts, none holding a newline: the stream's newlines are their edges."""
        stream = np.frombuffer(packed_stream(texts), dtype=np.uint8)
        return cls(stream, np.flatnonzero(stream == NEWLINE), hashlib.sha256(stream.tobytes()).hexdigest())

    def __len__(self) -> int:
        return len(self.edges) - 1 if self.chosen is None else int(self.chosen.sum())

    fmt, chat = "text", False  # lines, as describe_records says it; never conversations

    def subset(self, chosen: np.ndarray) -> Lines:
        return replace(self, chosen=chosen)

    def lines(self) -> np.ndarray:
        return np.arange(len(self.edges) - 1) if self.chosen is None else np.flatnonzero(self.chosen)

    def digest(self, what: str) -> str:
        chosen = b"" if self.chosen is None else np.packbits(self.chosen).tobytes()
        return hashlib.sha256(f"{self.key}:{what}:".encode() + chosen).hexdigest()


def packed_stream(lines: list[str]) -> bytes:
    """The lines as one byte stream, each framed by newlines (b"\n" + line + b"\n", sharing them)."""
    return b"\n" + b"".join(line.encode("utf-8") + b"\n" for line in lines)  # (no lines: one newline, no line)


class Pieces:
    """The chosen lines read as packed_stream(those lines) would lay them out, without copying
    them: each run of consecutive chosen lines is one piece of the corpus's stream."""

    def __init__(self, corpus: Lines) -> None:
        edges, n = corpus.edges, len(corpus.edges) - 1
        chosen = np.ones(n, dtype=bool) if corpus.chosen is None else corpus.chosen
        step = np.diff(np.concatenate([[False], chosen, [False]]).view(np.int8))  # +1 where a run opens, -1 after it
        first, last = np.flatnonzero(step == 1), np.flatnonzero(step == -1) - 1
        # A run is its lines, each with its closing newline; the first run also takes the newline before it.
        self.starts = edges[first] + 1
        self.starts[0] -= 1
        self.cum = np.concatenate([[0], np.cumsum(edges[last + 1] + 1 - self.starts)])
        self.stream = corpus.stream

    def __len__(self) -> int:
        return int(self.cum[-1])

    def read(self, at: int, n: int) -> torch.Tensor:
        """Bytes [at, at + n) of the laid-out stream (fewer at its end), as int64 token ids."""
        end, piece, parts = min(at + n, len(self)), int(np.searchsorted(self.cum, at, side="right")) - 1, []
        while at < end:  # a window crosses a piece's end where a held-out line was left out
            take, start = min(end, int(self.cum[piece + 1])) - at, int(self.starts[piece]) + at - int(self.cum[piece])
            parts.append(self.stream[start : start + take])
            at, piece = at + take, piece + 1
        return torch.from_numpy(np.concatenate(parts).astype(np.int64))


class Rows(Dataset):
    """Examples made a row at a time, as a batch asks, from flat token arrays: nothing is held padded. Row i is
    (inputs, targets[, positions]) of seq_len tokens (ShiftingWindows, ByteWindows, TokenRows); key, what they are."""

    def set_epoch(self, epoch: int) -> None:
        """Fixed rows: only the sampler's order changes between epochs."""

    def digest(self) -> str:
        return self.key  # a checkpoint records it: a resume on other rows is refused


class ShiftingWindows(Rows):
    """Packed training data: one byte stream cut into full seq_len windows, at an offset drawn from --seed
    and the epoch. A cut that never moved lets a small model memorize "this byte at that position"."""

    def __init__(self, corpus: Lines, seq_len: int, seed: int) -> None:
        self.stream, self.seq_len, self.seed, self.offset = Pieces(corpus), seq_len, seed, 0
        self.key = corpus.digest(f"windows:{seq_len}")

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.seq_len - 1)  # windows that fit at any offset

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.stream.read(self.offset + i * self.seq_len, self.seq_len + 1)
        return window[:-1], window[1:]

    def set_epoch(self, epoch: int) -> None:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        self.offset = int(torch.randint(self.seq_len, (), generator=generator))

    @property
    def target_bytes(self) -> torch.Tensor:
        return torch.full((len(self),), self.seq_len, dtype=torch.long)  # every window is full


class ByteWindows(Rows):
    """Fixed byte examples: each span (a line, or all chosen lines end to end when packed) cut into windows
    of seq_len targets overlapping by one byte, so every byte is a target once; a span's last is padded."""

    def __init__(self, corpus: Lines, seq_len: int, pack: bool) -> None:
        self.stream, self.seq_len = Pieces(corpus), seq_len
        if pack:
            self.starts, self.lengths = np.array([0]), np.array([len(self.stream)])
        else:  # line i spans edges[i] .. edges[i + 1], in the laid-out stream
            self.stream = Pieces(Lines(corpus.stream, corpus.edges, corpus.key))
            lines = corpus.lines()
            self.starts, self.lengths = corpus.edges[lines], corpus.edges[lines + 1] + 1 - corpus.edges[lines]
        self.cum = np.concatenate([[0], np.cumsum((self.lengths - 2) // seq_len + 1)])
        self.key = corpus.digest(f"{'packed' if pack else 'lines'}:{seq_len}")

    def __len__(self) -> int:
        return int(self.cum[-1])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        span = int(np.searchsorted(self.cum, i, side="right")) - 1
        cut = (i - int(self.cum[span])) * self.seq_len
        ids = self.stream.read(int(self.starts[span]) + cut, min(self.seq_len + 1, int(self.lengths[span]) - cut))
        inputs = torch.zeros(self.seq_len, dtype=torch.long)
        targets = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        inputs[: len(ids) - 1], targets[: len(ids) - 1] = ids[:-1], ids[1:]
        return inputs, targets

    @functools.cached_property
    def target_bytes(self) -> torch.Tensor:
        """Each row's targets: its window's bytes but the first."""
        span = np.repeat(np.arange(len(self.lengths)), np.diff(self.cum))
        cut = (np.arange(len(self)) - self.cum[span]) * self.seq_len
        return torch.from_numpy(np.minimum(self.seq_len + 1, self.lengths[span] - cut) - 1)


class LeanDistributedSampler(DistributedSampler):
    """DistributedSampler's order exactly, handed out from a tensor instead of a Python list of every
    index: the 7.8 M windows of a 1 GB corpus made that list 320 MB on every rank."""

    def __iter__(self) -> Iterator[int]:
        n, seeded = len(self.dataset), torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(n, generator=seeded) if self.shuffle else torch.arange(n)
        if self.total_size > n:  # without drop_last torch pads to a multiple of the ranks, repeating from the start
            order = order.repeat(-(-self.total_size // n))
        for part in order[: self.total_size][self.rank :: self.num_replicas].split(1 << 16):
            yield from part.tolist()


def make_train_loader(
    dataset: Dataset, cfg: RunConfig, d: Dist, collate: Callable[[list], tuple] = trim_padding
) -> tuple[DataLoader, DistributedSampler]:
    # Every rank builds the same permutation (seed, epoch) and keeps every dp-th index from its own:
    # disjoint shards covering the data; drop_last trims instead of repeating examples.
    sampler = LeanDistributedSampler(dataset, num_replicas=d.dp, rank=d.dp_rank, shuffle=True, seed=cfg.seed,
                                     drop_last=True)  # fmt: skip
    per_step = cfg.batch_size * cfg.grad_accum_steps
    if not len(dataset):
        raise UsageError(f"corpus too small: not one example of --seq-len {cfg.seq_len} fits in it; give a shorter "
                         "--seq-len or a larger corpus")  # fmt: skip
    if len(sampler) < per_step:
        raise UsageError(
            f"corpus too small: {len(dataset)} examples give each of {d.dp} data-parallel rank(s) "
            f"{len(sampler)} per epoch, fewer than one step's {per_step} (--batch-size x --grad-accum-steps); "
            "use a larger corpus, smaller batches or fewer ranks"
        )
    loader = DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        drop_last=True,  # equal batch counts on every rank, so no rank waits in an all-reduce alone
        collate_fn=collate,
        pin_memory=d.device.type == "cuda",
        # Each iter(loader) draws a worker seed: from the global RNG it would shift the dropout stream,
        # and a resumed run (a new iterator mid-epoch) would drop different units.
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    return loader, sampler


def steps_from(loader: DataLoader, sampler: DistributedSampler, k: int, start_step: int) -> Iterator[list]:
    """Yield each optimizer step's k micro-batches, across epochs, from `start_step`: an epoch is
    len(loader) // k steps, so a step number alone says where a resumed run starts."""
    steps_per_epoch = len(loader) // k
    epoch, skip = divmod(start_step, steps_per_epoch)
    while True:
        sampler.set_epoch(epoch)  # else every epoch replays epoch 0's order
        loader.dataset.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(skip * k):
            next(batches)
        for _ in range(steps_per_epoch - skip):
            yield [next(batches) for _ in range(k)]
        epoch, skip = epoch + 1, 0


# ----------------------------------------------------------------------------------------------
# 4. Model: a byte-level causal Transformer trained from scratch
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 256  # one id per byte
    seq_len: int = 128
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 1
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.head_dim, self.dropout = c.d_model // c.n_heads, c.dropout
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model, bias=False)
        self.proj = nn.Linear(c.d_model, c.d_model, bias=False)
        self.own_dropout = contextlib.nullcontext  # (where a rank computes some heads only: its own mask for them)
        # is_causal masks every j > i: a token never sees the bytes it must predict
        self.attend = functools.partial(F.scaled_dot_product_attention, is_causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # q, k and v as (B, heads, T, head_dim), the heads counted from qkv's output (-1)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=2))
        with self.own_dropout():
            y = self.attend(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d_model, bias=False)
        self.attn = CausalSelfAttention(c)
        self.ln2 = nn.LayerNorm(c.d_model, bias=False)
        self.mlp = nn.Sequential(
            nn.Linear(c.d_model, 4 * c.d_model, bias=False), nn.GELU(), nn.Linear(4 * c.d_model, c.d_model, bias=False)
        )
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyTransformer(nn.Module):
    """Token + position embeddings, causal blocks, final norm, LM head: (B, T) ids -> (B, T, V)."""

    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.config = c
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = nn.Embedding(c.seq_len, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model, bias=False)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # `positions`: each token's place in its example, where a rank holds pieces of one (else 0 .. T-1)
        at = torch.arange(x.shape[1], device=x.device) if positions is None else positions
        x = self.drop(self.tok_emb(x) + self.pos_emb(at))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over the real (non-padding) targets."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


@dataclass
class ModelKit:
    """What the shared training loop needs from a model path; the rest stays in its builder."""

    model: nn.Module  # the plain model; DDP wraps it later
    train: Rows
    val: Rows | None  # held-out lines (--val-fraction), fixed windows; None when there are none
    # (module, inputs, targets[, positions]) -> the sum of the target tokens' losses
    loss: Callable[..., torch.Tensor]
    # (unwrapped model, step, its whole state dict or None: the model's own) -> path written
    save_final: Callable[[nn.Module, int, dict | None], Path]
    final_name: str  # what save_final writes inside OUTPUT_DIR
    final_label: str  # ... and what that is, for the log
    describe: str
    collate: Callable[[list], tuple] = trim_padding  # how a micro-batch's rows are stacked
    count: Callable[[tuple], int] = lambda batch: int((batch[1] != IGNORE_INDEX).sum())  # what the loss averages over
    data_report: str = ""  # what became of the records on the way to examples
    loss_module: nn.Module | None = None  # what DDP wraps and `loss` runs, if not the model (LeanHeadLoss)
    blocks: list[nn.Module] = field(default_factory=list)  # the Transformer blocks (a sharded layout's units)
    split: object | None = None  # how a later section cuts the model over a replica's ranks (or its loader did)
    # What the full script adds (tiny_kit, build_pretrained_kit):
    sample: Callable[[nn.Module, str], str] | None = None  # (unwrapped model, prompt) -> text
    flops_per_token: float = 0.0  # training FLOPs per token, for MFU
    reload: Callable[[Path], nn.Module] | None = None  # save_final's output read back, as a plain model
    tally: object | None = None  # what the loss counts beside itself, reported with it (DPO's rewards: RewardTally)

    @property
    def trained(self) -> nn.Module:
        return self.loss_module or self.model


def tiny_config(cfg: RunConfig) -> TinyConfig:
    return TinyConfig(seq_len=cfg.seq_len, d_model=cfg.d_model, n_heads=cfg.n_heads, n_layers=cfg.n_layers,
                      dropout=cfg.dropout)  # fmt: skip


def build_tiny_kit(cfg: RunConfig, d: Dist, lines: Lines, val_lines: Lines | None = None) -> ModelKit:
    config = tiny_config(cfg)
    # Same seed on every rank: the replicas start identical. (DDP would also broadcast rank
    # 0's weights when it wraps the model, but equal seeds make single-process runs match.)
    torch.manual_seed(cfg.seed)
    model = TinyTransformer(config).to(d.device)
    n_params = sum(p.numel() for p in model.parameters())

    def save_final(raw: nn.Module, step: int, whole: dict | None = None) -> Path:
        path = cfg.output_dir / TINY_FINAL
        buffer = io.BytesIO()
        torch.save({"model": whole or raw.state_dict(), "config": asdict(config), "step": step}, buffer)
        atomic_write(path, buffer.getvalue())
        return path

    return ModelKit(
        model=model,
        train=ShiftingWindows(lines, cfg.seq_len, cfg.seed) if cfg.pack else ByteWindows(lines, cfg.seq_len, False),
        val=ByteWindows(val_lines, cfg.seq_len, cfg.pack) if val_lines is not None and len(val_lines) else None,
        loss=lambda m, ids, targets, *positions: token_loss_sum(m(ids, *positions), targets),
        save_final=save_final,
        final_name=TINY_FINAL,
        final_label="model checkpoint",
        describe=f"tiny Transformer: {cfg.n_layers} layer(s), d_model {cfg.d_model}, "
        f"{cfg.n_heads} heads, {n_params:,} parameters",
        blocks=list(model.blocks),
    )


def atomic_write(path: Path, data: bytes) -> None:
    """Write a temp file beside it, fsync, rename over: readers see the old file or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------
# 5. Sync: the gradient all-reduce, by torch's DDP and by a from-scratch DDP beside it
# ----------------------------------------------------------------------------------------------


DDP_TAKES = inspect.signature(DDP.__init__).parameters


def wrap_data_parallel(model: nn.Module, cfg: RunConfig, d: Dist, stats: CommStats) -> Wrapper | TorchDDP:
    if not d.distributed or d.replicas == 1:
        return Wrapper(model)  # one process (a group of one too): nothing to average
    if cfg.ddp == "manual":
        return ManualDDP(model, d, cfg.bucket_mb, stats)
    return TorchDDP.wrap(model, cfg, d, stats)


class CommStats:
    """Where the wrappers say what they send, as they send it: record, a gradient bucket about to be all-reduced
    (nbytes on the wire; grads, this rank's own); count, a collective of another kind (an all-gather of weights, a
    send to another rank); traced, a collective's future as its caller waits for it; span, point-to-point work from
    mark() to now; end_step, the step's bucket all-reduces as (calls, bytes). Here they go nowhere: it carries only
    --grad-compression (bf16 buckets: half the bytes). The full script's Traffic counts them and draws them."""

    def __init__(self, compress: bool = False) -> None:
        self.compress = compress

    def record(self, index: int, nbytes: int, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None: ...

    def count(self, kind: str, nbytes: int) -> None: ...

    def traced(self, future: torch.futures.Future, name: str, args: dict) -> torch.futures.Future:
        return future

    def mark(self) -> object: ...

    def span(self, name: str, start: object, args: dict) -> None: ...

    def end_step(self) -> tuple[int, int]:
        return 0, 0


@dataclass
class MicroStep:
    """One micro-batch's forward and backward, as every layout runs them: the kit's loss under `autocast`
    (its value through `spoil`, which a fault on purpose may spoil), backward through fp16's GradScaler
    when there is one; `mark` notes where the step has got to."""

    kit: ModelKit
    device: torch.device
    autocast: Callable[[], contextlib.AbstractContextManager]
    spoil: Callable[[torch.Tensor], torch.Tensor]
    mark: Callable[[str], None]
    scaler: torch.amp.GradScaler | None = None

    def forward(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        with self.autocast():
            loss = self.spoil(self.kit.loss(model, *batch))
        self.mark("forward")
        return loss

    def backward(self, scaled: torch.Tensor) -> None:
        (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        self.mark("backward")


class Layout:
    """How the model sits on the ranks, as the loop and the save ask it: here DDP's answers (every rank holds
    the whole model and computes every example of its share); the layouts of sharding (section 7) and model
    splitting (section 8) answer otherwise."""

    loss_share = example_share = 1.0  # how much of this rank's loss (and examples) the global sums count: all
    fused_optimizer = True  # AdamW's one kernel over every tensor (False: a layout of tensors it cannot mix)
    rank0_holds_all = True  # rank 0's own model is whole: saving it gathers nothing
    all_reduces_buckets = True  # its gradients travel in DDP's buckets
    gathers_in_forward = False  # a forward is a collective every rank must join (not under DDP)

    def local_batch(self, batch: tuple) -> tuple:
        """What of a micro-batch this rank computes: all of it."""
        return batch

    def forward_backward(self, micro_batches: list[tuple], scales: list[float], micro: MicroStep) -> torch.Tensor:
        """The step's micro-batches through forward and backward, the first k-1 inside no_sync() (no
        communication); the last one's backward all-reduces the sum, bucket by bucket. Returns the loss sum."""
        loss_sum = torch.zeros((), device=micro.device)
        for i, batch in enumerate(micro_batches):
            with self.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                micro_loss = micro.forward(self, batch)
                micro.backward(micro_loss * scales[i])
            loss_sum += micro_loss.detach()
        return loss_sum * self.loss_share

    def finish_gradient_sync(self) -> None:
        """Wait for the gradient sync: torch's DDP already did, inside backward()."""

    def eval_loss(self, kit: ModelKit, batch: tuple) -> torch.Tensor:
        """A held-out batch's loss sum, through the unwrapped model: no DDP hooks, no collective of DDP's."""
        return kit.loss(kit.trained, *batch)

    def after_evaluation(self) -> None:
        """A forward without backward has run (the held-out loss)."""

    def local_grads(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """The gradients as this rank holds them: every one whole."""
        return [p.grad for p in params if p.grad is not None]

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The whole gradient's 2-norm: every rank holds all of it, averaged, so each finds the same norm."""
        squares = (torch.linalg.vector_norm(g, dtype=torch.float32).square() for g in self.local_grads(params))
        return sum(squares, torch.zeros((), device=params[0].device)).sqrt()

    def clip_gradients(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """The whole gradient's norm, identical on every rank, so all clip alike to max_norm (when set)."""
        norm = self.grad_norm(params)
        if max_norm:  # on the device, no wait for it; each rank scales what it holds
            torch._foreach_mul_(self.local_grads(params), (max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    # What saving asks of every layout, to write the whole model's state whatever the layout (whole_state_dict
    # here; the checkpoints below the banner): under DDP rank 0 holds every tensor whole, and sends it alone.
    def whole_tensor(self, name: str, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The whole of t (p, or its Adam moment), cut as parameter `name` is: a collective where it is cut."""
        return t

    def tensor_part(self, name: str, p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole tensor cut as parameter `name` (p) is cut: whole_tensor undone."""
        return whole

    def sends_to_rank0(self, d: Dist) -> bool:
        """Whether what this rank gathers goes to rank 0 (gather_to_rank0)."""
        return d.is_main

    def gather_to_rank0(self, d: Dist, mine: object) -> list | None:
        """Every part of the model's `mine` that rank 0 joins into the whole (None elsewhere): here its own."""
        return [mine] if d.is_main else None


class Wrapper(Layout, nn.Module):
    """The wrapped module and no_sync() for accumulation: the from-scratch wrappers' base, and on
    its own one plain process's, which has nothing to synchronise."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.require_sync = True  # False inside no_sync(): gradients accumulate, nothing travels

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.module(*args, **kwargs)


class TorchDDP(DDP, Layout):
    """torch's DistributedDataParallel. find_unused_parameters=True keeps one bucket layout for the whole run: left
    alone, the reducer rebuilds its buckets after step 1, and at 3+ ranks Gloo's ring then adds in another order
    (a resumed run in yet another); searching for unused parameters, it never rebuilds, and buckets as ManualDDP."""

    @classmethod
    def wrap(cls, model: nn.Module, cfg: RunConfig, d: Dist, stats: CommStats) -> TorchDDP:
        # torch's DDP broadcasts rank 0's parameters to all ranks now, then hooks every parameter:
        # during backward, finished gradients fill buckets that are all-reduced (averaged) while the
        # rest of backward still runs, so every rank ends the step with the same gradient.
        ddp = cls(
            model,
            process_group=d.data_group,
            device_ids=[d.device.index] if d.device.type == "cuda" else None,
            bucket_cap_mb=cfg.bucket_mb,
            find_unused_parameters=True,  # one bucket layout for the whole run (above)
            # .grad is a view into its bucket: no copy back out (while the loop zeroes .grad, never sets None)
            gradient_as_bucket_view=True,
            # Buffers never change here (rotary frequencies are fixed): nothing to re-send (renamed in torch 2.13)
            **{"forward_sync_buffers" if "forward_sync_buffers" in DDP_TAKES else "broadcast_buffers": False},
        )
        ddp.register_comm_hook((ddp.process_group, stats), allreduce_hook)
        return ddp


def allreduce_hook(state, bucket):  # no annotations: DDP checks them, and rejects strings
    """torch DDP's own all-reduce over DDP's group (state: that group, and the run's CommStats), or with
    --grad-compression torch's bf16 one (each gradient rounded by up to 2^-8 of itself before the sum:
    docs/gradients.md). Given None for the group, torch's hooks would reduce over every rank."""
    group, stats = state
    buffer = bucket.buffer()
    nbytes = buffer.numel() * (2 if stats.compress else buffer.element_size())
    stats.record(bucket.index(), nbytes, bucket.parameters(), bucket.gradients())
    future = (default_hooks.bf16_compress_hook if stats.compress else default_hooks.allreduce_hook)(group, bucket)
    dtype = "bfloat16" if stats.compress else str(buffer.dtype).removeprefix("torch.")
    return stats.traced(future, "all-reduce", {"bucket": bucket.index(), "bytes": nbytes, "dtype": dtype})


@dataclass(eq=False)
class Bucket:
    index: int
    params: list[nn.Parameter]
    flat: torch.Tensor  # one contiguous buffer for all their gradients: one all-reduce per bucket
    offsets: list[int]
    ready: int = 0
    arrival: torch.futures.Future | None = None  # the all-reduce in flight; wait() returns once the sum is here
    wire: torch.Tensor | None = None  # what travels: flat itself, or its bf16 copy

    def views(self) -> list[torch.Tensor]:
        """Each parameter's gradient, as it lies in flat."""
        return [self.flat[o : o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets, strict=True)]


def start_equal(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """The group's first rank's parameters and buffers, broadcast to the others, as DDP does when it wraps."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t, src=dist.get_global_rank(group, 0) if group else 0, group=group)


class ManualDDP(Wrapper):
    """Data parallelism from scratch: what torch's DDP does for us, in plain Python.

    1. Start equal: broadcast rank 0's parameters and buffers to every rank.
    2. Plan buckets as torch's DDP does (TorchDDP): parameters in registration order, a bucket
       closed at bucket_mb, the last bucket first (backward starts from the last layer).
    3. During backward, a hook on each parameter copies its finished gradient into its bucket;
       when a bucket's last gradient arrives, it is divided by the world size (a sum of averages
       cannot overflow) and its all-reduce starts asynchronously, overlapping the rest of backward.
    4. finish_gradient_sync(): wait for every bucket, copy the averages back into .grad.
    """

    def __init__(self, module: nn.Module, d: Dist, bucket_mb: float, stats: CommStats) -> None:
        super().__init__(module)
        self.world_size, self.stats, self.group = d.replicas, stats, d.data_group
        start_equal(module, self.group)
        self.buckets: list[Bucket] = []
        self.place: dict[nn.Parameter, tuple[Bucket, int]] = {}
        groups: list[list[nn.Parameter]] = [[]]
        for p in (p for p in module.parameters() if p.requires_grad):
            if sum(q.numel() * q.element_size() for q in groups[-1]) >= int(bucket_mb * 2**20):
                groups.append([])
            groups[-1].append(p)
        for params in reversed(groups):
            self._add_bucket(params)
        for p in self.place:
            # A post-accumulate hook runs once the gradient is fully summed into p.grad for this
            # backward. It receives the *parameter*, not the gradient: reading p.grad is right,
            # all-reducing p itself would average the weights (picotron#39).
            p.register_post_accumulate_grad_hook(self.gradient_ready)

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        offsets = [0, *itertools.accumulate(p.numel() for p in params)]  # where each one starts, and where they end
        flat = torch.zeros(offsets[-1], dtype=params[0].dtype, device=params[0].device)
        bucket = Bucket(len(self.buckets), params, flat, offsets[:-1])
        self.buckets.append(bucket)
        for p, offset in zip(params, offsets[:-1], strict=True):
            self.place[p] = (bucket, offset)

    def gradient_ready(self, p: nn.Parameter) -> None:
        if not self.require_sync:
            return  # inside no_sync(): the gradient stays in p.grad and keeps accumulating there
        bucket, offset = self.place[p]
        # p.grad holds the sum over every micro-step since the last sync, so accumulated
        # gradients count too (a hook on the incoming gradient would see only the last one).
        bucket.flat[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            bucket.wire = bucket.flat.to(torch.bfloat16) if self.stats.compress else bucket.flat
            bucket.wire.div_(self.world_size)  # all_reduce sums; DDP's contract is the average
            self.stats.record(bucket.index, bucket.wire.nbytes, bucket.params, bucket.views())
            work = dist.all_reduce(bucket.wire, async_op=True, group=self.group)
            label = {"bucket": bucket.index, "bytes": bucket.wire.nbytes, "dtype": str(bucket.wire.dtype)[6:]}
            bucket.arrival = self.stats.traced(work.get_future(), "all-reduce", label)

    def finish_gradient_sync(self) -> None:
        for bucket in self.buckets:
            if bucket.arrival is None:
                names = {p: name for name, p in self.module.named_parameters()}
                missing = [names[p] for p in bucket.params if p.grad is None]
                raise TrainingError(f"a gradient bucket never filled: no gradient for {', '.join(missing) or '?'}")
            bucket.arrival.wait()
            if bucket.wire is not bucket.flat:
                bucket.flat.copy_(bucket.wire)
            for p, view in zip(bucket.params, bucket.views(), strict=True):
                p.grad.copy_(view)
            bucket.ready, bucket.arrival, bucket.wire = 0, None, None


def kept(t: torch.Tensor, keep: bool) -> torch.Tensor | None:
    return t.cpu() if keep else None  # gathered whole: to rank 0's CPU, dropped on the ranks that send nothing


def whole_state_dict(model: Layout, d: Dist, raw: nn.Module) -> dict | None:
    """raw.state_dict() whole on rank 0, on its CPU, for the final save, from any layout (a collective);
    None where rank 0's own model is whole. Each tensor is gathered, and dropped where it is not sent."""
    if model.rank0_holds_all:
        return None
    keep, whole = model.sends_to_rank0(d), {}
    named = raw.state_dict(keep_vars=True)
    for name, t in named.items():
        if id(t) not in whole:  # tied weights are one tensor: gathered once, saved as one
            whole[id(t)] = kept(model.whole_tensor(name, t, t.detach()), keep)
    parts = model.gather_to_rank0(d, {name: whole[id(t)] for name, t in named.items()})
    return {name: t for part in parts for name, t in part.items()} if d.is_main else None


# ----------------------------------------------------------------------------------------------
# 6. Train: one loop for every model: forward, backward, sync, clip, step
# ----------------------------------------------------------------------------------------------


def loss_scale(cfg: RunConfig, d: Dist, micro_tokens: int, global_tokens: float) -> float:
    """What each micro-step's token-loss *sum* is multiplied by before backward.

    global-tokens: replicas / global_tokens. DDP averages over the replicas (divides by their number),
      so the gradient is exactly that of sum(every token loss) / global_tokens: the mean over every
      target token of the global batch, whatever the split across ranks and micro-steps.
    mean-of-means: 1 / (micro_tokens * k). Each micro-batch's own mean, averaged over micro-steps
      and then over ranks: a token in a short micro-batch weighs more than one in a long one.
      (replicas / dp is 1 under DDP; where a replica's loss is computed in parts by several of its
      ranks, each adds its part to the replica's mean.)
    """
    if cfg.loss_normalization == "global-tokens":
        return d.replicas / global_tokens
    return d.replicas / d.dp / (micro_tokens * cfg.grad_accum_steps)


class Hooks:
    """What train() does besides the DDP steps, at fixed points of every step. This default does nothing;
    the full script's SideWork fills it (resume, progress, evaluation, checkpoints, faults, stops, checks)."""

    scaler: torch.amp.GradScaler | None = None  # fp16's loss scaling: small gradients would underflow

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # forward in fp32

    def comm_stats(self, compress: bool) -> CommStats:
        """Where the wrappers say what they send (here, nowhere)."""
        return CommStats(compress)

    def before_wrap(self, kit: ModelKit, stats: CommStats) -> None:
        """The model is about to be wrapped: gradient hooks registered now run before the wrapper's."""

    def start(self, model: Layout, named_params: list, optimizer: torch.optim.Optimizer,
              sampler: DistributedSampler, steps_per_epoch: int) -> Progress:  # fmt: skip
        """Before the first step: where the run starts (step 0 here; a checkpoint's step on resume)."""
        return Progress()

    def begin_step(self, step: int) -> None:
        """A step starts (before its batch is read)."""

    def mark(self, phase: str) -> None:
        """The step has reached the end of a phase: data, forward, backward, sync, optimizer."""

    def loss(self, micro_loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss on its way to backward (a fault on purpose may spoil it)."""
        return micro_loss

    def shared_votes(self) -> list[float]:
        """Facts every rank must hear before backward: they ride in the step's one small all-reduce."""
        return []

    def should_stop(self, votes: list[float]) -> bool:
        """Given those votes summed over the ranks: whether every rank stops now, before this step."""
        return False

    def gradients_synced(self, step: int, model: Layout, named_params: list, sent: tuple[int, int],
                         local_loss_sum: torch.Tensor, micro_tokens: list[int]) -> None:  # fmt: skip
        """Every gradient is averaged, not yet clipped; `sent`: the step's bucket all-reduces (calls, bytes)."""

    def read(self, step: int, numbers: torch.Tensor) -> list[float] | None:
        """The step's loss, gradient norm and this rank's loss sum, read from the device (on a GPU, the host waits for
        it) for the guard before the update and the metrics. Here every step; None: later (SideWork.read)."""
        return numbers.tolist()

    def non_finite(self, step: int, loss: float, grad_norm: float, local_loss_sum: float) -> None:
        """The loss or the gradient norm is not finite: stop before the update."""
        raise TrainingError(f"non-finite loss or gradient norm at step {step} (loss {loss}, grad norm {grad_norm})")

    def before_update(self, step: int, model: Layout, named_params: list) -> None:
        """The gradients are clipped; the optimizer steps next."""

    def after_update(self, step: int, model: Layout, named_params: list, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer has stepped."""

    def step_done(self, metrics: dict[str, float], tokens: int, seconds: float, model: Layout,
                  named_params: list, optimizer: torch.optim.Optimizer, progress: Progress) -> None:  # fmt: skip
        """The step is done: its metrics, real target tokens and seconds; `progress` already counts it."""

    def finish(self, model: Layout, named_params: list, optimizer: torch.optim.Optimizer, progress: Progress) -> None:
        """The loop has ended: finished, or stopped when should_stop() said so."""


def lr_at(cfg: RunConfig, step: int) -> float:
    """Linear warmup from 0 to --lr, then cosine decay to --min-lr at the last step: a pure function of
    the step, identical on every rank, so it needs no saved state."""
    warmup = warmup_steps(cfg)
    if step <= warmup:
        return cfg.lr * step / warmup
    peak = max(warmup, 1)  # the step that trains at the full rate, where the decay starts
    done = (step - peak) / max(1, cfg.max_steps - peak)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(done, 1.0)))


WARMUP_SHARE = 0.1  # of the run, when --warmup-steps would take more than half of it


def warmup_steps(cfg: RunConfig) -> int:
    """--warmup-steps, or a tenth of the run (at least one step) where that is more than half of it: a
    run that is nearly all warmup would end at the peak rate, never decaying."""
    if cfg.warmup_steps * 2 <= cfg.max_steps:
        return cfg.warmup_steps
    return max(1, int(cfg.max_steps * WARMUP_SHARE))


def make_optimizer(cfg: RunConfig, d: Dist, model: Layout, params: list[nn.Parameter],
                   stats: CommStats) -> torch.optim.Optimizer:  # fmt: skip
    if cfg.optimizer == "sgd":
        # Plain SGD moves weights by exactly lr x gradient: a gradient off by a factor shows at once.
        kind, options = torch.optim.SGD, {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    else:  # fused: one kernel for every tensor (5x faster on CPU), where the layout's tensors allow it
        kind, options = torch.optim.AdamW, {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
        options |= {"fused": True} if model.fused_optimizer else {"fused": False, "foreach": False}
    shared = (make(cfg, d, kind, options, params, stats) for maker in LAYOUT_MAKERS if (make := maker.optimizer))
    return next(filter(None, shared), None) or kind(params, **options)  # (sharding's optimizer, section 7)


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
    """The update, the same on every rank; fp16's scaler skips a step whose gradient overflowed."""
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # in place: .grad stays a view into DDP's bucket


@dataclass
class Progress:
    """Where the run stands. Saved in every checkpoint, so a resumed run picks up exactly here."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0  # real (non-padding) target tokens trained on, all ranks
    history: list[dict[str, float]] = field(default_factory=list)  # every step's loss (and val loss)


def train(cfg: RunConfig, d: Dist, kit: ModelKit, hooks: Hooks | None = None) -> tuple[Layout, Progress]:
    """The loop for every model and layout; side work at fixed points, through `hooks`. Returns the model
    as trained (wrapped, sharded or split) and where it got."""
    hooks = hooks or Hooks()
    loader, sampler = make_train_loader(kit.train, cfg, d, kit.collate)
    stats = hooks.comm_stats(cfg.grad_compression == "bf16")
    model = lay_out(kit, cfg, d, stats, hooks)  # DDP, or a later section's layout
    named_params = trainable_parameters(kit.model)  # again: a sharded layout may replace every parameter
    params = [p for _, p in named_params]
    optimizer = make_optimizer(cfg, d, model, params, stats)
    micro = MicroStep(kit, d.device, hooks.autocast, hooks.loss, hooks.mark, hooks.scaler)
    steps_per_epoch = len(loader) // cfg.grad_accum_steps
    progress = hooks.start(model, named_params, optimizer, sampler, steps_per_epoch)
    model.train()
    stream = steps_from(loader, sampler, cfg.grad_accum_steps, progress.step)
    while progress.step < cfg.max_steps:
        step, started = progress.step + 1, time.perf_counter()
        hooks.begin_step(step)
        batches = next(stream)  # this rank's micro-batches (its replica's, where ranks share one)
        cpu_batches = [model.local_batch(batch) for batch in batches]  # what of them this rank computes: all
        # Count target tokens (kit.count: what the loss averages over) while the batch is on the CPU: on a GPU, a sync.
        micro_tokens = [kit.count(batch) for batch in cpu_batches]
        replica_tokens = [kit.count(batch) for batch in batches]  # (mean-of-means divides by)
        micro_batches = [tuple(t.to(d.device, non_blocking=True) for t in batch) for batch in cpu_batches]
        hooks.mark("data")
        # One small all-reduce before any backward carries the facts every rank must share: the global
        # token count the loss divides by, and the hooks' votes (a stop request, a failed write).
        global_tokens, *votes = all_reduce_sum(d, [sum(micro_tokens) * model.loss_share, *hooks.shared_votes()])
        if hooks.should_stop(votes):
            break
        hooks.mark("sync")
        lr = lr_at(cfg, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # Forward and backward for each micro-batch (Layout.forward_backward: k-1 inside no_sync(), the
        # last one's backward all-reducing the sum).
        scales = [loss_scale(cfg, d, tokens, global_tokens) for tokens in replica_tokens]
        loss_sum = model.forward_backward(micro_batches, scales, micro)
        model.finish_gradient_sync()
        hooks.mark("sync")
        sent = stats.end_step()
        # Each rank's loss covers its own shard; the sum over ranks, divided by the global
        # token count, is the loss of the global batch: the number the update follows.
        local_loss_sum = loss_sum.clone()
        if d.distributed:
            dist.all_reduce(loss_sum)  # on the device: nothing is read back yet
        if hooks.scaler:
            hooks.scaler.unscale_(optimizer)  # clip and report the true gradient, not the scaled one
        hooks.gradients_synced(step, model, named_params, sent, local_loss_sum, micro_tokens)
        norm = model.clip_gradients(params, cfg.grad_clip)
        numbers = torch.stack([loss_sum.double() / global_tokens, norm.double(), local_loss_sum.double()])
        read = hooks.read(step, numbers)  # as floats; None where the hooks read them later
        hooks.mark("sync")
        # With fp16 an overflowing gradient is routine: the scaler skips that step and lowers
        # its scale, identically on every rank. Anything else non-finite stops the run.
        if read and (not math.isfinite(read[0]) or (not math.isfinite(read[1]) and hooks.scaler is None)):
            hooks.non_finite(step, *read)
        hooks.before_update(step, model, named_params)
        optimizer_step(optimizer, hooks.scaler)
        hooks.after_update(step, model, named_params, optimizer)
        progress.step, progress.tokens_seen = step, progress.tokens_seen + int(global_tokens)
        metrics = {"step": step, "lr": lr, **({"loss": read[0], "grad_norm": read[1]} if read else {})}
        hooks.step_done(metrics, int(global_tokens), time.perf_counter() - started, model, named_params, optimizer,
                        progress)  # fmt: skip
    hooks.finish(model, named_params, optimizer, progress)
    return model, progress


def lay_out(kit: ModelKit, cfg: RunConfig, d: Dist, stats: CommStats, hooks: Hooks) -> Layout:
    """The model wrapped as every rank trains it: DDP (section 5), unless a later section's layout takes the run;
    that one may first cut the model (new parameters: before any hook sees them)."""
    for maker in LAYOUT_MAKERS:
        maker.cut(kit, cfg, d, stats)
    hooks.before_wrap(kit, stats)
    wrapped = (layout for maker in reversed(LAYOUT_MAKERS) if (layout := maker.wrap(kit, cfg, d, stats)))
    return next(wrapped, None) or wrap_data_parallel(kit.trained, cfg, d, stats)


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


@dataclass(frozen=True)
class LayoutMaker:
    """What a later section adds to the loop for the settings it reads (sharding, section 7; model splitting,
    section 8): the ranks laid out for it, the model cut for this rank (before any hook sees its parameters),
    wrapped in its layout and given its optimizer, each None where the run is not that section's."""

    settings: tuple[str, ...]  # what asks for it: the DDP program alone refuses them (run_core)
    ranks: Callable[[Dist, RunConfig], Dist] = lambda d, cfg: d
    cut: Callable[[ModelKit, RunConfig, Dist, CommStats], None] = lambda kit, cfg, d, stats: None
    wrap: Callable[[ModelKit, RunConfig, Dist, CommStats], Layout | None] = lambda kit, cfg, d, stats: None
    optimizer: Callable[..., torch.optim.Optimizer | None] | None = None  # (cfg, d, kind, options, params, stats)


LAYOUT_MAKERS: list[LayoutMaker] = []  # in section order; the DDP program alone has none


# ----- A program on its own: the text above section 7, or above the banner, saved alone beside corpus.txt -----


# What the program acts on when it runs alone (run_core); the full script acts on every setting.
CORE_SETTINGS = ("corpus_file", "output_dir", "seed", "seq_len", "pack", "d_model", "n_heads", "n_layers", "dropout",
                 "batch_size", "max_steps", "lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip", "ddp",
                 "sharding", "bucket_mb", "grad_accum_steps", "loss_normalization", "optimizer", "grad_compression",
                 "tp", "pp", "pp_schedule", "cp", "backend", "cpu", "timeout_s")  # fmt: skip

# The settings a later section gives meaning to, and that section: a program that ends before it refuses them.
ADDED_LATER = {"sharding": "7 (Sharding)", **dict.fromkeys(("tp", "pp", "cp"), "8 (Model splitting)")}


def add_flags(parser: argparse.ArgumentParser, read: Callable[[dict], dict]) -> argparse.ArgumentParser:
    """A flag for each RunConfig field, in its --help group; `read` turns the field's metadata into
    argparse's arguments (the full script checks ranges as it reads them: checked_reading)."""
    group = parser
    for setting in fields(RunConfig):
        reading = read(dict(setting.metadata))
        help_line, title = reading.pop("help"), reading.pop("group")
        group = parser.add_argument_group(title) if title else group
        default = ",".join(setting.default) if isinstance(setting.default, tuple) else setting.default
        group.add_argument("--" + setting.name.replace("_", "-"), default=default, help=help_line, **reading)
    return parser


def plain_reading(metadata: dict) -> dict:
    """A flag as the core alone reads it: a range as its kind of number, unchecked; a type named in words as text."""
    within = metadata.pop("within", None)
    if within or isinstance(metadata.get("type"), str):
        metadata["type"] = within["kind"] if within else str
    return metadata


def core_settings(argv: list[str] | None = None) -> RunConfig:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description="The teaching core alone: the tiny model on the corpus, across the "
                                     "ranks torchrun starts. It acts on " + ", ".join("--" + name.replace("_", "-") for
                                     name in CORE_SETTINGS) + "; any other flag is named and ignored",
                                     allow_abbrev=False)  # fmt: skip
    parser = add_flags(parser, plain_reading)
    args, typed = parser.parse_args(argv), {word.split("=", 1)[0] for word in argv if word.startswith("--")}
    ignored = [s for s in fields(RunConfig) if s.name not in CORE_SETTINGS]
    if given := [flag for s in ignored if (flag := "--" + s.name.replace("_", "-")) in typed]:
        print(f"[core] ignored: {', '.join(given)}; the full script, llm_ddp_parallel_training.py, does that")
    for setting in ignored:  # as if not given: --epochs, say, would otherwise leave --max-steps at 0
        setattr(args, setting.name, setting.default)
    settle_defaults(args, typed)
    cfg, added = RunConfig(**vars(args)), {setting for maker in LAYOUT_MAKERS for setting in maker.settings}
    for setting, section in ADDED_LATER.items():  # a sharding or split the sections present do not add: refused
        if setting not in added and (value := getattr(cfg, setting)) != RunConfig.__dataclass_fields__[setting].default:
            raise SystemExit(f"error: --{setting} {value}: section {section} adds it, and this program ends before it; "
                             "run llm_ddp_parallel_training.py")  # fmt: skip
    return cfg


class PrintLoss(Hooks):
    """The core's one piece of side work: rank 0 prints each step's loss."""

    def __init__(self, d: Dist) -> None:
        self.d = d

    def step_done(self, metrics: dict[str, float], *_: object) -> None:
        if self.d.is_main:
            print(f"step {int(metrics['step']):>5} | loss {metrics['loss']:.4f}", flush=True)


def run_core(argv: list[str] | None = None) -> None:
    """launch -> connect -> shard -> train -> sync -> save, the seed's six stages, with nothing else: torchrun
    launched this process, setup_distributed connects it, and train() shards the data (DistributedSampler),
    trains, and syncs the gradients every step; rank 0 saves the model (gathered whole where a later section's
    layout cuts it)."""
    cfg = core_settings(argv)
    if not cfg.corpus_file.is_file():
        raise SystemExit(f"error: corpus file not found: {cfg.corpus_file} (core.py reads corpus.txt beside it)")
    torch.set_flush_denormal(True)  # denormal gradients (after ~100 steps) run in slow microcode on x86 CPUs
    d = setup_distributed(cfg)  # torchrun launched this process; it joins the others
    for maker in LAYOUT_MAKERS:  # ... and, where a later section splits the model, lays out the ranks for it
        d = maker.ranks(d, cfg)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # training: Ctrl-C as Python has it, cleaned up after
    try:
        if d.is_main:
            print(f"[core] {d.world_size} process(es), backend {d.backend or 'none'} on {d.device}: {d.why}")
        text = cfg.corpus_file.read_text(encoding="utf-8")
        kit = build_tiny_kit(cfg, d, Lines.from_texts([line.strip() for line in text.split("\n") if line.strip()]))
        # Dropout: each replica its own stream (W ranks dropping the same units of different examples would not
        # be one process with a W-times batch; seed_offset: where ranks compute one replica together, one stream).
        torch.manual_seed(cfg.seed + d.seed_offset)
        model, progress = train(cfg, d, kit, PrintLoss(d))  # shard, train, sync: step after step
        whole = whole_state_dict(model, d, kit.model)  # a collective where no rank holds the whole model
        if d.is_main:
            print(f"[save] {kit.save_final(kit.model, progress.step, whole)}")
    finally:
        teardown_distributed()


if __name__ == "__main__" and "\n# 7. Sharding:" not in Path(__file__).read_text(encoding="utf-8"):
    run_core()  # the DDP program saved alone (sections 1-6); with the sections after it, they run it


# ----------------------------------------------------------------------------------------------
# 7. Sharding: ZeRO-1 and FSDP from scratch, beside torch's ZeroRedundancyOptimizer and fully_shard
# ----------------------------------------------------------------------------------------------


# Sharding. DDP keeps a whole copy of the training state on every rank: for mixed-precision
# Adam, 16 bytes a parameter (bf16 weight and gradient, fp32 master weight and two moments),
# so two 8 GB GPUs hold no more than one. ZeRO (Rajbhandari et al., 2019) removes the copies:
# stage 1 shards the optimizer state, stage 3 (FSDP) the weights and gradients as well.
# torch ships both (ZeroRedundancyOptimizer, fully_shard); here is each from scratch.

# torch 2.13 renamed the two collectives of sharding (the old names now warn); older torch has only those.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The slice of a tensor this rank holds: a DTensor's local shard (fully_shard), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def global_grad_norm(own: list[torch.Tensor], alike: list[torch.Tensor], group: object) -> torch.Tensor:
    """The whole gradient's 2-norm, the same on every rank, for every layout: the squares of this rank's own
    parts (slices, shards, stages) summed over the group, plus those every rank holds alike (norm_parts)."""
    device = next((g.device for g in [*own, *alike]), torch.device("cpu"))
    squares = [sum((torch.linalg.vector_norm(g, dtype=torch.float32).square() for g in part),
                   torch.zeros((), device=device)) for part in (own, alike)]  # fmt: skip
    if own:
        dist.all_reduce(squares[0], group=group)
    return (squares[0] + squares[1]).sqrt()


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 from scratch: each rank keeps the optimizer state of its own parameters only.

    Adam keeps two numbers for every weight: twice the weights themselves, on every rank under
    DDP. Here, with the signature of torch's ZeroRedundancyOptimizer:
    1. Whole parameters are dealt out to ranks, largest first, each to the rank holding the
       fewest numbers so far. An inner optimizer on each rank sees only that rank's share, so
       it allocates state for about 1/N of the model.
    2. step(): the gradients are already averaged (DDP's all-reduce ran as usual), so each
       rank updates its own parameters exactly as an unsharded optimizer would.
    3. Each parameter is broadcast from its owner: every rank again holds the same weights.
    """

    stats: CommStats | None = None  # the run's count of collectives (set by the script; None in one of your own)

    def __init__(self, params: Iterator[nn.Parameter], optimizer_class: type, **defaults: object) -> None:
        super().__init__(params, defaults)
        self.rank, world = dist.get_rank(), dist.get_world_size()
        trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        load = [0] * world
        self.owner: dict[nn.Parameter, int] = {}
        for p in sorted(trainable, key=lambda p: -p.numel()):  # a stable sort: every rank deals the same hand
            self.owner[p] = load.index(min(load))
            load[self.owner[p]] += p.numel()
        mine = [
            {**_options(group), "params": [p for p in group["params"] if self.owner.get(p) == self.rank]}
            for group in self.param_groups
        ]
        self.optim = optimizer_class(mine, **defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:  # as a torch optimizer: recompute the loss (and its gradients) first
            with torch.enable_grad():
                loss = closure()
        for outer, inner in zip(self.param_groups, self.optim.param_groups, strict=True):
            inner.update(_options(outer))  # a changed lr (the schedule) reaches the inner optimizer
        self.optim.step()
        for work in [dist.broadcast(p.data, src=owner, async_op=True) for p, owner in self.owner.items()]:
            work.wait()
        for p in self.owner if self.stats is not None else ():
            self.stats.count("broadcast of updated weights", p.nbytes)
        return loss

    def state_dict(self, to: int | None = None, group: dist.ProcessGroup | None = None) -> dict:
        """The full state, as an unsharded optimizer_class would return it: a collective, every rank receiving
        it, or with `to` that rank alone (the others get {}). `group`: a Gloo group keeps it off the GPUs."""
        index, inner = self._global_index(), self.optim.state_dict()
        mine = [p for group in self.optim.param_groups for p in group["params"]]
        local = {
            index[p]: {k: v.cpu() if torch.is_tensor(v) else v for k, v in inner["state"][i].items()}
            for i, p in enumerate(mine)
            if i in inner["state"]
        }
        shares: list[dict] = [{} for _ in range(dist.get_world_size())]
        if to is None:
            dist.all_gather_object(shares, local, group=group)
        else:
            dist.gather_object(local, shares if self.rank == to else None, dst=to, group=group)
            if self.rank != to:
                return {}
        groups = [
            {**_options(ig), "params": [index[p] for p in og["params"]]}
            for og, ig in zip(self.param_groups, inner["param_groups"], strict=True)
        ]
        return {"state": dict(sorted((i, s) for share in shares for i, s in share.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take a full state (this class's, or an unsharded optimizer's): each rank keeps its share."""
        index, groups, state, i = self._global_index(), [], {}, 0
        for outer, saved, inner in zip(
            self.param_groups, state_dict["param_groups"], self.optim.param_groups, strict=True
        ):
            outer.update({k: v for k, v in _options(saved).items() if k in outer})
            ids = list(range(i, i + len(inner["params"])))
            i += len(ids)
            state |= {
                j: state_dict["state"][index[p]]
                for j, p in zip(ids, inner["params"], strict=True)
                if index[p] in state_dict["state"]
            }
            groups.append({**_options(saved), "params": ids})
        self.optim.load_state_dict({"state": state, "param_groups": groups})

    def _global_index(self) -> dict[nn.Parameter, int]:
        return {p: i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}


def _options(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


@dataclass(eq=False)
class Unit:
    """A module whose own parameters are gathered together before it runs, and freed after."""

    module: nn.Module
    params: list[nn.Parameter]
    trainable: list[nn.Parameter]
    gathering: list[tuple[dist.Work, torch.Tensor]] | None = None  # an all-gather in flight
    full: bool = False  # the parameters hold their whole weights now
    arrived: set[nn.Parameter] = field(default_factory=set)  # gradients ready in this backward
    scattering: list[tuple[nn.Parameter, dist.Work, torch.Tensor]] = field(default_factory=list)
    settled: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)  # averaged shard gradients


class ManualFSDP(Wrapper):
    """FSDP (ZeRO stage 3) from scratch: each rank stores 1/N of every weight, gradient and moment.

    A *unit* is a module whose parameters are made whole together. For each parameter p of a unit:
    1. Between steps p.data is this rank's shard: p flattened, zero-padded, cut in N pieces; rank r
       keeps piece r. The optimizer sees only shards, so its state is 1/N of the model too.
    2. Before the unit's forward: all-gather the whole weight (p.data = whole), the next unit's
       all-gather already in flight (prefetch).
    3. After its forward: p.data = the shard again. Autograd saved p, not a copy: backward uses
       whatever p.data holds by then.
    4. Before its backward (a hook on its output's gradient): gather again, and prefetch.
    5. As its last gradient arrives: reduce-scatter; each rank receives its piece of the sum.
    6. finish_gradient_sync(): wait, divide by N: p.grad is the averaged gradient of p's shard.
    Parameters outside every unit stay whole, averaged as DDP does. With param_dtype the weights and
    each unit's inputs compute in it (fully_shard's MixedPrecisionPolicy); shards and gradients do not.
    """

    gathers_in_forward, all_reduces_buckets, rank0_holds_all = True, False, False

    def __init__(self, module: nn.Module, d: Dist, units: list[nn.Module], param_dtype: torch.dtype | None = None,
                 stats: CommStats | None = None) -> None:  # fmt: skip
        super().__init__(module)
        self.world, self.rank, self.param_dtype = d.world_size, d.rank, param_dtype
        start_equal(module)
        owner = innermost_units(module, units)
        mine = {u: [p for p in u.parameters() if owner[p] is u] for u in units}
        self.units = [Unit(u, mine[u], [p for p in mine[u] if p.requires_grad]) for u in units]
        self.whole_params = [p for p in module.parameters() if p not in owner and p.requires_grad]
        self.shape = {p: p.shape for p in owner}
        self.shard = {p: self._cut(p) for p in owner}  # the master weights: p.data points here between steps
        self.held: dict[nn.Parameter, torch.Tensor] = {}  # whole gradients accumulated under no_sync()
        self.shard_grads: dict[nn.Parameter, torch.Tensor] = {}  # p.grad, set aside while p is whole
        self.forward_order: list[Unit] = []  # learned in the first step; prefetch follows it
        self.finish_order: list[Unit] = []  # units in the order their forwards end: backward runs it in reverse
        self.order_known = False
        self.gloo, self.stats = dist.get_backend() == "gloo", stats  # stats: counts and traces each collective
        self.master: dict[nn.Parameter, torch.Tensor] = {}  # a replicated weight's own, while it computes cast
        if param_dtype is not None and self.whole_params:
            module.register_forward_pre_hook(self._cast_replicated)
            module.register_forward_hook(self._after_root_forward)
            for p in self.whole_params:
                p.register_post_accumulate_grad_hook(self._uncast_replicated)
        for unit in self.units:
            for p in unit.params:
                p.data = self.shard[p]
            unit.module.register_forward_pre_hook(functools.partial(self._before_forward, unit))
            unit.module.register_forward_hook(functools.partial(self._after_forward, unit))
            for p in unit.trainable:
                p.register_post_accumulate_grad_hook(functools.partial(self._gradient_ready, unit))

    def _cut(self, t: torch.Tensor) -> torch.Tensor:
        size = math.ceil(t.numel() / self.world)
        padded = torch.zeros(size * self.world, dtype=t.dtype, device=t.device)
        padded[: t.numel()] = t.detach().reshape(-1)
        return padded[self.rank * size : (self.rank + 1) * size].clone()

    def _start_gather(self, unit: Unit) -> None:
        if unit.full or unit.gathering is not None:
            return
        unit.gathering = []
        for p in unit.params:
            piece = self.shard[p].to(self.param_dtype or p.dtype)
            whole = torch.empty(piece.numel() * self.world, dtype=piece.dtype, device=piece.device)
            unit.gathering.append((all_gather_single(whole, piece, async_op=True), whole))
        self._trace("all-gather", [work for work, _ in unit.gathering], unit, sum(w.nbytes for _, w in unit.gathering))

    def _gather(self, unit: Unit) -> None:
        self._start_gather(unit)
        if unit.full:
            return
        for p, (work, whole) in zip(unit.params, unit.gathering, strict=True):
            work.wait()
            if p.grad is not None:  # a shard's gradient does not fit the whole weight: set it aside
                self.shard_grads[p] = p.grad
                p.grad = None
            p.data = whole[: math.prod(self.shape[p])].view(self.shape[p])
        unit.gathering, unit.full = None, True

    def _reshard(self, unit: Unit) -> None:
        if not unit.full:
            return
        for p in unit.params:
            p.data = self.shard[p]
            if p in self.shard_grads:
                p.grad = self.shard_grads.pop(p)
        unit.full = False

    def _prefetch(self, order: list[Unit], unit: Unit, ahead: int) -> None:
        if self.order_known and unit in order and 0 <= (i := order.index(unit) + ahead) < len(order):
            self._start_gather(order[i])

    def _before_forward(self, unit: Unit, module: nn.Module, args: tuple) -> tuple:
        if not self.order_known and unit not in self.forward_order:
            self.forward_order.append(unit)
        self._gather(unit)
        self._prefetch(self.forward_order, unit, +1)
        if self.param_dtype is not None:  # a unit computes in param_dtype whatever dtype reaches it
            args = tuple(a.to(self.param_dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
        if not torch.is_grad_enabled() or not any(torch.is_tensor(a) and a.requires_grad for a in args):
            return args  # no backward will pass here (the root's inputs are token ids): reshard at the end
        # The gradient reaches the unit's inputs last of all its backward: then it can be freed.
        return _AfterBackward.apply(functools.partial(self._reshard, unit), *args)

    def _after_forward(self, unit: Unit, module: nn.Module, args: tuple, output: object) -> None:
        if not self.order_known and unit not in self.finish_order:
            self.finish_order.append(unit)
        needs_grad = [t for t in tensors_in(output) if t.requires_grad]
        if needs_grad:
            hook = functools.partial(self._before_backward, unit)
            torch.autograd.graph.register_multi_grad_hook(needs_grad, hook, mode="any")
        self._reshard(unit)

    def _before_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        self._gather(unit)
        self._prefetch(self.finish_order, unit, -1)

    def _cast_replicated(self, module: nn.Module, args: tuple) -> None:
        for p in self.whole_params:
            if p not in self.master:
                self.master[p], p.data = p.data, p.data.to(self.param_dtype)

    def _after_root_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        if not torch.is_grad_enabled():  # no backward will come for the cast weights (evaluation)
            self._uncast_replicated()

    @torch.no_grad()
    def _uncast_replicated(self, p: nn.Parameter | None = None) -> None:
        """p's gradient has arrived: its weight and gradient back in its own dtype (None: every weight cast)."""
        for q in [p] if p is not None else list(self.master):
            q.data = self.master.pop(q)
            if q.grad is not None:
                q.grad = q.grad.to(q.dtype)

    @torch.no_grad()
    def _gradient_ready(self, unit: Unit, p: nn.Parameter) -> None:
        grad = p.grad.to(self.shard[p].dtype)  # summed in the master dtype (fp32), not param_dtype
        grad = self.held.pop(p).add_(grad) if p in self.held else grad
        p.grad = None  # the whole gradient leaves .grad: only the shard's will come back there
        if not self.require_sync:  # inside no_sync(): keep the whole gradient until the last micro-step
            self.held[p] = grad
            return
        unit.arrived.add(p)
        shard = self.shard[p]
        padded = grad.reshape(-1)
        if padded.numel() < shard.numel() * self.world:
            padded = F.pad(padded, (0, shard.numel() * self.world - padded.numel()))
        if self.gloo:  # Gloo has no reduce-scatter of its own: torch runs this all-reduce and keeps
            # this rank's piece (pytorch#118911); done here openly, the timeline can time it too.
            work, mine = dist.all_reduce(padded, async_op=True), padded.view(self.world, -1)[self.rank]
        else:
            mine = torch.empty_like(shard)
            work = reduce_scatter_single(mine, padded, async_op=True)
        unit.scattering.append((p, work, mine))
        self._trace("reduce-scatter", [work], unit, padded.nbytes)
        if len(unit.arrived) == len(unit.trainable):
            # This unit's gradients are all on the wire: settle the units before it. Each
            # reduce-scatter holds a whole, padded gradient until it ends; settling them as we
            # go keeps about one unit's in flight, not the whole model's, as FSDP does.
            for other in self.units:
                if other is not unit:
                    self._settle(other)

    def _settle(self, unit: Unit) -> None:
        for p, work, summed in unit.scattering:
            work.wait()
            unit.settled.append((p, summed / self.world))  # reduce-scatter summed; the contract is the average
        unit.scattering = []  # the whole, padded gradients are freed

    def _trace(self, name: str, works: list[dist.Work], unit: Unit, nbytes: int) -> None:
        if self.stats is not None:
            self.stats.count(name, nbytes)
            arrivals = torch.futures.collect_all([work.get_future() for work in works])
            self.stats.traced(arrivals, name, {"unit": self.units.index(unit), "tensors": len(works), "bytes": nbytes})

    def finish_gradient_sync(self) -> None:
        self.order_known = True
        self._uncast_replicated()  # a weight that got no gradient
        averaging = [dist.all_reduce(p.grad, async_op=True) for p in self.whole_params if p.grad is not None]
        for unit in self.units:
            if len(unit.arrived) < len(unit.trainable):
                names = {q: n for n, q in self.module.named_parameters()}
                missing = [names[q] for q in unit.trainable if q not in unit.arrived]
                raise TrainingError(f"a sharded unit's gradient never arrived: no gradient for {', '.join(missing)}")
            self._settle(unit)
            self._reshard(unit)
            for p, mine in unit.settled:
                p.grad = mine if p.grad is None else p.grad.add_(mine)
            unit.settled, unit.arrived = [], set()
        for work in averaging:
            work.wait()
        if grads := [p.grad for p in self.whole_params if p.grad is not None]:
            torch._foreach_div_(grads, self.world)

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        shards = [p.grad for unit in self.units for p in unit.trainable if p.grad is not None]  # the padding is 0
        return global_grad_norm(shards, [p.grad for p in self.whole_params if p.grad is not None], None)

    def whole(self, p: nn.Parameter, shard: torch.Tensor | None = None) -> torch.Tensor:
        """The whole of p (or of a tensor cut like p, such as its Adam moment): a collective when p is sharded."""
        if p not in self.shard:
            return p.detach() if shard is None else shard
        shard = self.shard[p] if shard is None else shard
        whole = torch.empty(shard.numel() * self.world, dtype=shard.dtype, device=shard.device)
        all_gather_single(whole, shard.contiguous())
        return whole[: math.prod(self.shape[p])].view(self.shape[p])

    def whole_tensor(self, name: str, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.whole(p, t) if t.dim() else t  # a 0-d one (Adam's step count) is never cut

    def tensor_part(self, name: str, p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        return self._cut(whole.to(self.shard[p].device)) if p in self.shard and whole.dim() else whole


class _AfterBackward(torch.autograd.Function):
    """The identity on a unit's inputs, whose backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx: object, done: Callable[[], None], *inputs: object) -> tuple:
        ctx.done = done
        return inputs

    @staticmethod
    def backward(ctx: object, *grads: torch.Tensor) -> tuple:
        ctx.done()
        return (None, *grads)


def tensors_in(output: object) -> list[torch.Tensor]:
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    return [t for item in output for t in tensors_in(item)] if isinstance(output, (tuple, list)) else []


def innermost_units(module: nn.Module, units: list[nn.Module]) -> dict[nn.Parameter, nn.Module]:
    """Each parameter belongs to the innermost unit that contains it."""
    owner: dict[nn.Parameter, nn.Module] = {}
    for unit in sorted(units, key=lambda u: -sum(1 for _ in u.modules())):  # outermost first, inner ones overwrite
        for p in unit.parameters():
            if p in owner and not any(m is unit for m in owner[p].modules()):
                raise ValueError("a parameter is shared by two units, neither inside the other: put them in one unit")
            owner[p] = unit
    return owner


class TorchFSDP(Wrapper):
    """torch's fully_shard (FSDP2) on the same units. Its parameters are DTensors, each rank holding
    a block of rows, which DTensor's own full_tensor gathers whole."""

    gathers_in_forward, all_reduces_buckets, rank0_holds_all = True, False, False

    @classmethod
    def shard(cls, kit: ModelKit, mesh: object) -> TorchFSDP:
        """fully_shard each unit over the ranks of `mesh` (a DeviceMesh)."""
        from torch.distributed.fsdp import fully_shard

        for unit in [*kit.blocks, kit.trained]:  # inner units first: each takes its own parameters, the root the rest
            fully_shard(unit, mesh=mesh)
        # FSDP2 warns that a unit returned a view, which an in-place op could detach from its
        # all-gather; this script never modifies a model's output in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        return cls(kit.trained)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        # FSDP2 then keeps whole (unsharded) gradients until the micro-step that syncs: memory for silence.
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def local_grads(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        return [local_part(p.grad) for p in params if p.grad is not None]  # this rank's rows of each

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        return global_grad_norm(self.local_grads(params), [], None)  # every row is some rank's own

    def whole_tensor(self, name: str, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def tensor_part(self, name: str, p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """This rank's block of a whole tensor, as a DTensor laid out as p is, cut locally (no collective)."""
        if not (whole.dim() and hasattr(p, "device_mesh")):
            return whole
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(whole.to(p.device), p.device_mesh, p.placements, src_data_rank=None)

    def after_evaluation(self) -> None:
        for unit in self.module.modules():  # fully_shard leaves the root unit whole after a forward
            if hasattr(unit, "reshard"):  # with no backward to follow: back to shards
                unit.reshard()


def shard_fully(kit: ModelKit, cfg: RunConfig, d: Dist, stats: CommStats) -> ManualFSDP | TorchFSDP:
    """FSDP units: each block, then the rest as the root unit (tied embedding and head weights must share one)."""
    if cfg.ddp == "manual":
        return ManualFSDP(kit.trained, d, [*kit.blocks, kit.trained], stats=stats)
    from torch.distributed.device_mesh import init_device_mesh

    # A device mesh says which ranks share the shards: here all of them, on this device type
    # (given explicitly: on a CPU, fully_shard would otherwise look for a GPU).
    return TorchFSDP.shard(kit, init_device_mesh(d.device.type, (d.world_size,)))


def sharded_optimizer(cfg: RunConfig, d: Dist, kind: type, options: dict, params: list[nn.Parameter],
                      stats: CommStats) -> torch.optim.Optimizer | None:  # fmt: skip
    """ZeRO-1 (--sharding optimizer): each rank keeps the optimizer state of its own share of the weights.
    (Under --sharding full the parameters are shards already: a plain optimizer keeps 1/N state.)"""
    if cfg.sharding != "optimizer" or not d.distributed:
        return None
    if cfg.ddp == "manual":
        optimizer = ShardedOptimizer(params, kind, **options)
        optimizer.stats = stats  # its broadcasts of updated weights count among the run's collectives
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=kind, **options)


LAYOUT_MAKERS.append(LayoutMaker(("sharding",), optimizer=sharded_optimizer, wrap=lambda kit, cfg, d, stats: (
    shard_fully(kit, cfg, d, stats) if cfg.sharding == "full" and d.distributed else None)))  # fmt: skip


# ----------------------------------------------------------------------------------------------
# 8. Model splitting: tensor, pipeline and context parallelism from scratch, beside torch's
# ----------------------------------------------------------------------------------------------


# Sharding (ManualFSDP) still computes every layer whole on every rank: it only stores less. Model
# splitting computes less on each rank. Tensor parallelism (Shoeybi et al. 2019, Megatron-LM) cuts
# each block's matrices across a group of ranks, so every rank computes a slice of every block;
# pipeline parallelism (Huang et al. 2019, GPipe; Narayanan et al. 2019, 1F1B) gives each rank a run
# of whole blocks, and the micro-batches flow from stage to stage. torch ships both
# (parallelize_module, torch.distributed.pipelining); here is each from scratch, beside them.


@dataclass(frozen=True)
class MeshDist(Dist):
    """This process's place when the ranks are laid out as a grid (laid_out): dp replicas x pp stages x tp slices
    x cp sequence parts, rank = ((dp_rank x pp + pp_rank) x tp + tp_rank) x cp + cp_rank, so that a group is
    neighbours. A replica's ranks hold one model between them and read one share of the data."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    mesh: object | None = None  # the grid as torch's DeviceMesh, whose groups every split uses; None: no split

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.pp * self.cp)

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.cp) % self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank // self.cp % self.tp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights, which average their gradients: the replicas and, within each,
        its context-parallel ranks (the same example, other tokens)."""
        return self.dp * self.cp

    @property
    def seed_offset(self) -> int:
        """Dropout's stream: one per tensor-parallel group, whose slices compute one replica's activations."""
        return self.rank // (self.tp * self.cp) * self.cp + self.cp_rank

    @property
    def replica_dim(self) -> str:
        """The mesh's dimension of the ranks that average their gradients (replicas): "dp", with --cp "dp_cp"."""
        return "dp_cp" if self.cp > 1 else "dp"

    @property
    def data_group(self) -> dist.ProcessGroup | None:
        return self.group(self.replica_dim)

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The ranks that share this rank's place along one dimension of the grid ("dp", "pp", "tp", "cp", or
        replica_dim)."""
        return self.mesh.get_group(dim) if self.mesh is not None else None


def laid_out(d: Dist, cfg: RunConfig) -> MeshDist:
    """The ranks as a grid of dp replicas x pp stages x tp slices x cp parts; all replicas where the model is whole."""
    place = {f.name: getattr(d, f.name) for f in fields(Dist)}
    if cfg.tp * cfg.pp * cfg.cp == 1 or not d.distributed:
        return MeshDist(**place)
    if d.world_size % (cfg.tp * cfg.pp * cfg.cp):
        split = f"--tp {cfg.tp} x --pp {cfg.pp}" + (f" x --cp {cfg.cp}" if cfg.cp > 1 else "")
        raise UsageError(f"{split} does not divide the {d.world_size} ranks into replicas")
    from torch.distributed.device_mesh import init_device_mesh

    shape = (d.world_size // (cfg.tp * cfg.pp * cfg.cp), cfg.pp, cfg.tp, cfg.cp)
    mesh = init_device_mesh(d.device.type, shape, mesh_dim_names=("dp", "pp", "tp", "cp"))
    if cfg.cp > 1:  # the replicas and their cp ranks hold the same weights: one group averages their gradients
        mesh["dp", "cp"]._flatten("dp_cp")
    if cfg.tp > 1 and cfg.pp > 1:  # a replica's stages and slices: one group adds up its gradient norm
        mesh["pp", "tp"]._flatten("pp_tp")
    return MeshDist(**place, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, mesh=mesh)


class ModelSplit:
    """How one replica's model is split across its ranks; this base splits nothing, whole on each rank.
    The wrappers (ManualDDP, TorchDDP, the FSDPs) ask their split what to gather, cut, count and add up."""

    loss_share = 1.0  # how much of this rank's loss counts in the global sum

    @property
    def example_share(self) -> float:
        """How much of this rank's examples counts (their bytes, for bits per byte): its loss's share, except where
        ranks compute parts of the same examples (ContextParallel)."""
        return self.loss_share

    holds_all = True  # every rank holds every weight of the model
    fused_optimizer = True  # AdamW's one kernel can take every tensor (TensorParallel: not beside DTensor slices)

    def sliced(self, name: str) -> bool:
        return False  # whether this rank holds only a slice of parameter `name`

    def whole(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Parameter `name` (or its Adam moment) whole, from this rank's piece: a collective when sliced."""
        return t.detach()

    def part(self, name: str, value: object, like: torch.Tensor | None = None) -> object:
        """This rank's piece of a whole value of parameter `name` (shaped as `like`, when given)."""
        return value

    def to_model_order(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        return whole  # gathered from slices, a fused weight comes in rank order (TensorParallel)

    def to_rank_order(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        return whole  # ... and slices are cut from that order

    def norm_parts(self, params: list[nn.Parameter], dp_sharded: bool = False) -> tuple[list, list, None]:
        """(own, alike, group) for global_grad_norm: every gradient whole on every rank, or under fully_shard
        (dp_sharded) each rank's rows, its own, added up over every rank."""
        grads = [local_part(p.grad) for p in params if p.grad is not None]
        return (grads, [], None) if dp_sharded else ([], grads, None)

    def own_part(self, batch: tuple) -> tuple:
        """What of a micro-batch this rank computes: here all of it."""
        return batch


class SplitLayout(Layout):
    """A layout whose model is split across each replica's ranks (self.split): it computes, counts, clips and saves
    as its split says. Mixed in before the layout it splits (SplitManualDDP, ...), or after one that answers for
    itself first (SplitManualFSDP)."""

    split: ModelSplit

    @property
    def loss_share(self) -> float:
        return self.split.loss_share

    @property
    def example_share(self) -> float:
        return self.split.example_share

    @property
    def rank0_holds_all(self) -> bool:
        return self.split.holds_all

    @property
    def fused_optimizer(self) -> bool:
        return self.split.fused_optimizer

    def local_batch(self, batch: tuple) -> tuple:
        return self.split.own_part(batch)

    def local_grads(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        return [local_part(p.grad) for p in params if p.grad is not None]

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        return global_grad_norm(*self.split.norm_parts(params))

    def whole_tensor(self, name: str, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.split.whole(name, t) if t.dim() else t

    def tensor_part(self, name: str, p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        return self.split.part(name, whole, p) if whole.dim() else whole


class SplitWrapper(SplitLayout, Wrapper):
    """One replica, split over every rank: no replica to average with."""

    @property
    def all_reduces_buckets(self) -> bool:
        return self.split.holds_all  # a model split over every rank has no bucket to all-reduce


class SplitManualDDP(SplitLayout, ManualDDP):
    """Each split rank's replicas (the same slice, stage or chunks) averaged from scratch."""


class SplitTorchDDP(SplitLayout, TorchDDP):
    """Each split rank's replicas averaged by torch's DDP."""


class SplitManualFSDP(ManualFSDP, SplitLayout):
    """ManualFSDP over the replicas and their cp ranks, each rank computing its own tokens (ContextParallel)."""


class SplitTorchFSDP(SplitLayout, TorchFSDP):
    """fully_shard over the replicas of a split model (torch's 2-D recipe under --tp): DTensors whole in rank order,
    put back in the model's (q, k, v)."""

    rank0_holds_all = False

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        return global_grad_norm(*self.split.norm_parts(params, dp_sharded=self.gathers_in_forward))

    def whole_tensor(self, name: str, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.split.to_model_order(name, t.full_tensor()) if hasattr(t, "full_tensor") else t

    def tensor_part(self, name: str, p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        rank_order = self.split.to_rank_order(name, whole) if whole.dim() else whole
        return TorchFSDP.tensor_part(self, name, p, rank_order)


class TorchReplicated(SplitTorchFSDP):
    """torch's data parallelism for a tensor-parallel model: replicate (FSDP's machinery, weights whole along the
    replicas) takes DTensor parameters, which its DDP does not. No forward gathers anything."""

    gathers_in_forward = False


def tensor_parallel_sum(t: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None) -> torch.Tensor:
    """The all-reduce of tensor parallelism, in place; counted and traced when a run's stats watch."""
    work = dist.all_reduce(t, group=group, async_op=True)
    if stats is not None:
        stats.count("tensor-parallel all-reduce", t.nbytes)
        stats.traced(work.get_future(), "all-reduce", {"tensor parallel": tuple(t.shape), "bytes": t.nbytes}).wait()
    work.wait()
    return t


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: the identity in forward (every rank holds the same input), an all-reduce in backward: each
    rank's slice sends back its own part of the input's gradient, and the input needs their sum."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None) -> torch.Tensor:
        ctx.group, ctx.stats = group, stats
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple:
        return tensor_parallel_sum(grad.contiguous().clone(), ctx.group, ctx.stats), None, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: an all-reduce in forward (each rank computed a partial sum of the output), the
    identity in backward (every partial sum's gradient is the whole output's)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None) -> torch.Tensor:
        return tensor_parallel_sum(x.clone(), group, stats)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple:
        return grad, None, None


class ColumnParallelLinear(nn.Module):
    """y = x W^T, W's rows (y's columns) cut across the group: rank r computes its slice of y with no
    communication in forward. `parts`: a fused Linear (q, k and v in one weight) is cut as that many
    blocks, each rank taking its slice of each; cut naively, rank 0 would get q and half of k."""

    def __init__(
        self, linear: nn.Linear, group: dist.ProcessGroup, parts: int = 1, stats: CommStats | None = None
    ) -> None:
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.stats = group, stats
        self.weight = nn.Parameter(rank_order(linear.weight.detach(), parts, n).chunk(n)[r].clone())
        # A bias belongs to the outputs: cut with the rows, as the weight is.
        b = linear.bias
        self.bias = None if b is None else nn.Parameter(rank_order(b.detach(), parts, n).chunk(n)[r].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(CopyToTensorParallel.apply(x, self.group, self.stats), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T, W's columns (x's features) cut across the group: rank r multiplies the slice of x
    the column-parallel layer before it made, and the partial products are summed."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup, stats: CommStats | None = None) -> None:
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.stats = group, stats
        self.weight = nn.Parameter(linear.weight.detach().chunk(n, dim=1)[r].clone())
        # The bias whole on every rank, added once, after the sum: inside it, it would count n times.
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ReduceFromTensorParallel.apply(F.linear(x, self.weight), self.group, self.stats)
        return y if self.bias is None else y + self.bias


def rank_order(weight: torch.Tensor, parts: int, n: int) -> torch.Tensor:
    """A fused weight's rows rank by rank, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: an even cut in n then
    gives each rank its slice of every part (for parts=1, the weight as it is)."""
    return weight.reshape(parts, n, -1, *weight.shape[1:]).transpose(0, 1).reshape(weight.shape)


def model_order(weight: torch.Tensor, parts: int, n: int) -> torch.Tensor:
    """rank_order undone: the weight as the model, and every checkpoint, lays it out."""
    return weight.reshape(n, parts, -1, *weight.shape[1:]).transpose(0, 1).reshape(weight.shape)


@contextlib.contextmanager
def own_dropout_stream(tp_rank: int) -> Iterator[None]:
    """Megatron's rule for dropout under tensor parallelism: an activation the group holds alike draws the same
    mask on each rank; a sliced one (this rank's own heads) its own, seeded from the shared stream, so the ranks
    stay in step and a checkpoint's random state resumes it."""
    seed = int(torch.randint(2**62, ()))  # the same on every rank of the group
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        torch.manual_seed(seed + tp_rank)
        yield


def tensor_parallel_cuts(i: int) -> dict[str, tuple[int, int]]:
    """Block i's parameters that tensor parallelism slices: (the dimension cut, the fused parts in it)."""
    return {f"blocks.{i}.attn.qkv.weight": (0, 3), f"blocks.{i}.attn.proj.weight": (1, 1),
            f"blocks.{i}.mlp.0.weight": (0, 1), f"blocks.{i}.mlp.2.weight": (1, 1)}  # fmt: skip


class TensorParallel(ModelSplit):
    """Megatron's layout over the tensor-parallel group: in every block q, k, v and the MLP's first
    Linear cut by output rows (column-parallel), the attention's output projection and the MLP's
    second Linear by input columns (row-parallel): one all-reduce after each row-parallel Linear in
    forward, one for each column-parallel input in backward; attention runs this rank's own heads.
    The embeddings, norms and head stay whole on every rank. --ddp manual swaps in the modules above;
    --ddp torch gives the same cuts to parallelize_module as ColwiseParallel and RowwiseParallel."""

    holds_all = fused_optimizer = False  # each rank holds a slice of every block's matrices

    def __init__(self, model: nn.Module, d: Dist, manual: bool, stats: CommStats | None = None,
                 blocks: range | None = None) -> None:  # fmt: skip
        self.group, self.n, self.rank = d.group("tp"), d.tp, d.tp_rank
        self.loss_share = float(d.tp_rank == 0)  # every slice computed the same loss: one counts it
        self.cuts: dict[str, tuple[int, int]] = {}  # parameter -> (the dimension cut, fused parts)
        for i, block in enumerate(model.blocks):
            if blocks is not None and i not in blocks:  # a pipeline stage's: its own blocks only (TensorParallelStage)
                continue
            self.cuts |= tensor_parallel_cuts(i)
            block.attn.own_dropout = functools.partial(own_dropout_stream, d.tp_rank)
            if manual:
                block.attn.qkv = ColumnParallelLinear(block.attn.qkv, self.group, 3, stats)
                block.attn.proj = RowParallelLinear(block.attn.proj, self.group, stats)
                block.mlp[0] = ColumnParallelLinear(block.mlp[0], self.group, 1, stats)
                block.mlp[2] = RowParallelLinear(block.mlp[2], self.group, stats)
                continue
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            with torch.no_grad():  # q, k, v rank by rank, so that torch's even row cut takes three blocks
                block.attn.qkv.weight.copy_(rank_order(block.attn.qkv.weight, 3, self.n))
            plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(), "mlp.0": ColwiseParallel(),
                    "mlp.2": RowwiseParallel()}  # fmt: skip
            parallelize_module(block, d.mesh["tp"], plan)
        self.model = model

    def sliced(self, name: str) -> bool:
        return name in self.cuts

    def to_model_order(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        return model_order(whole, self.cuts[name][1], self.n) if self.sliced(name) else whole

    def to_rank_order(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        return rank_order(whole, self.cuts[name][1], self.n) if self.sliced(name) else whole

    def whole(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if not self.sliced(name):
            return t.detach()
        local = local_part(t).detach().contiguous()
        pieces = [torch.empty_like(local) for _ in range(self.n)]
        dist.all_gather(pieces, local, group=self.group)
        return self.to_model_order(name, torch.cat(pieces, dim=self.cuts[name][0]))

    def part(self, name: str, value: object, like: torch.Tensor | None = None) -> object:
        if not (self.sliced(name) and torch.is_tensor(value) and value.dim()):
            return value  # whole on every rank, or a 0-d step count
        dim, parts = self.cuts[name]
        piece = rank_order(value, parts, self.n).chunk(self.n, dim=dim)[self.rank].clone()
        if hasattr(like, "device_mesh"):  # torch's: a DTensor cut as the parameter is
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(piece.to(like.device), like.device_mesh, like.placements)
        return piece

    def norm_parts(self, params: list[nn.Parameter], dp_sharded: bool = False) -> tuple[list, list, object]:
        """Each rank's slices its own, summed over the group; what every rank of it holds whole counted once. The
        same for both kinds of tensor parallelism, so that they clip alike to the bit. Under FSDP's rows
        (dp_sharded) every part is this rank's own, the whole ones counted on the group's first rank."""
        sliced = {id(p) for n, p in self.model.named_parameters() if n in self.cuts}  # (data parallelism re-makes them)
        own = [local_part(p.grad) for p in params if p.grad is not None and id(p) in sliced]
        alike = [local_part(p.grad) for p in params if p.grad is not None and id(p) not in sliced]
        return (own + alike * (self.rank == 0), [], None) if dp_sharded else (own, alike, self.group)


def stage_blocks(stage: int, n_layers: int, stages: int) -> range:
    """The blocks of a stage: a contiguous run, the stages as even as the blocks allow."""
    return range(stage * n_layers // stages, (stage + 1) * n_layers // stages)


class StageSplit(ModelSplit):
    """A pipeline stage's part of the model: its own parameters whole, the others' none."""

    holds_all = False  # each stage holds its own blocks

    def __init__(self, d: Dist, last: bool, first: bool, owned: range) -> None:
        self.group, self.loss_share = d.group("pp"), float(last)  # only the last stage computes the loss
        self.first, self.last, self.owned, self.stage = first, last, owned, d.pp_rank

    def norm_parts(self, params: list[nn.Parameter]) -> tuple[list, list, dist.ProcessGroup]:
        return [p.grad for p in params if p.grad is not None], [], self.group  # each stage's own, over the stages


class TensorParallelStage(TensorParallel):
    """A pipeline stage whose blocks tensor parallelism slices (--tp with --pp, from scratch): the 3-D layout's
    ranks, dp replicas x pp stages x tp slices. Activations between stages are whole, as the row-parallel
    all-reduce leaves them: a stage sends to the next stage's rank of the same slice (its pp group)."""

    def __init__(self, model: nn.Module, d: Dist, stats: CommStats, stage: StageSplit) -> None:
        super().__init__(model, d, True, stats, blocks=stage.owned)
        self.stage, self.replica = stage, d.group("pp_tp")
        self.loss_share = stage.loss_share * self.loss_share  # the last stage's first slice counts the loss

    def norm_parts(self, params: list[nn.Parameter], dp_sharded: bool = False) -> tuple[list, list, object]:
        own, alike, _ = super().norm_parts(params)  # the slices, and the stage's whole ones counted on one slice
        return own + alike * (self.rank == 0), [], self.replica


class Stage(nn.Module):
    """A pipeline stage's forward through the parts of the tiny model it holds: the first stage embeds token ids,
    the last ends in the head; the others take hidden states and pass them on."""

    def __init__(self, model: TinyTransformer, first: bool, last: bool) -> None:
        super().__init__()
        self.model, self.first, self.last = model, first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        if self.first:
            x = m.drop(m.tok_emb(x) + m.pos_emb(torch.arange(x.shape[1], device=x.device)))
        for block in m.blocks:
            x = block(x)
        return m.head(m.ln_f(x)) if self.last else x


class Pipeline(SplitLayout, Wrapper):
    """Pipeline parallelism over the pipeline group: this rank holds one stage, a run of whole
    blocks (the first stage the embeddings too, the last the final norm and head), and the step's
    --grad-accum-steps micro-batches flow through the stages, activations forward and their
    gradients back, so that a pipelined step is exactly the accumulated one. GPipe runs every
    micro-batch's forward, then every backward; 1F1B, once the pipeline is full, alternates one
    forward with one backward, so a stage holds at most (stages - its index) micro-batches'
    activations. The idle time while it fills and drains is the bubble: (S - 1) / (M + S - 1) of
    the step for S stages and M micro-batches. --ddp manual schedules over isend/irecv; --ddp torch
    with torch.distributed.pipelining. Under data parallelism the stage's replicas then average
    their gradients, bucket by bucket, as DDP would."""

    def __init__(self, kit: ModelKit, cfg: RunConfig, d: Dist, stats: CommStats) -> None:
        model, n = kit.model, len(kit.model.blocks)
        self.first, self.last = d.pp_rank == 0, d.pp_rank == d.pp - 1
        self.owned = stage_blocks(d.pp_rank, n, d.pp)
        for i in range(n):  # the other stages' parts are taken out: this rank holds only its own
            if i not in self.owned:
                model.blocks[i] = nn.Identity()
        if not self.first:
            model.tok_emb = model.pos_emb = None
        if not self.last:
            model.ln_f = model.head = None
        stage = StageSplit(d, self.last, self.first, self.owned)
        super().__init__(Stage(model, self.first, self.last))
        self.split = TensorParallelStage(model, d, stats, stage) if d.tp > 1 else stage
        self.d, self.cfg, self.stats = d, cfg, stats
        self.group, self.ranks = d.group("pp"), dist.get_process_group_ranks(d.group("pp"))
        self.sync = ManualDDP(model, d, cfg.bucket_mb, stats) if d.dp > 1 else None
        self.in_flight: list[tuple[dist.Work, object, dict]] = []  # sends not yet seen done

    @property
    def all_reduces_buckets(self) -> bool:
        return self.sync is not None  # the stage's replicas average its gradients in DDP's buckets

    def sends_to_rank0(self, d: MeshDist) -> bool:
        return d.dp_rank == 0 and d.tp_rank == 0  # the first replica's stages (their first slices)

    def gather_to_rank0(self, d: MeshDist, mine: object) -> list | None:
        """Every stage's `mine`, in stage order, on rank 0 (a collective of the first replica's stages)."""
        if not self.sends_to_rank0(d):
            return None
        stages = [None] * d.pp if d.is_main else None
        dist.gather_object(mine, stages, dst=0, group=self.group)
        return stages

    def padded(self, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Every micro-batch at --seq-len: the stages exchange activations of one shape."""
        inputs, targets = batch[:2]
        pad = self.cfg.seq_len - inputs.shape[1]
        return F.pad(inputs, (0, pad)), F.pad(targets, (0, pad), value=IGNORE_INDEX)

    def forward_backward(self, micro_batches: list[tuple], scales: list[float], micro: MicroStep) -> torch.Tensor:
        # Each micro-step's batch cut into --pp micro-batches (its scale each): the stages fill, and the step
        # trains what one process trains on that batch.
        cut = [(part, scale) for batch, scale in zip(micro_batches, scales, strict=True)
               for part in zip(*(t.chunk(self.d.pp) for t in self.padded(batch)), strict=True)]  # fmt: skip
        batches, scales = [part for part, _ in cut], [scale for _, scale in cut]
        with self.sync.no_sync() if self.sync else contextlib.nullcontext():
            losses = self.schedule_step(batches, scales, micro)
        loss = torch.stack(losses).sum() if losses else torch.zeros((), device=self.d.device)
        return loss * self.loss_share  # (--tp: each slice of the last stage computed it, one counts it)

    def send(self, t: torch.Tensor, to: int) -> None:
        """t to the stage `to` steps away (+1: the next, -1: the one before), counted; traced once seen done."""
        self.stats.count("pipeline send", t.nbytes)
        work = dist.isend(t.detach(), self.ranks[self.d.pp_rank + to], group=self.group)
        self.in_flight.append((work, self.stats.mark(), {"to stage": self.d.pp_rank + to, "bytes": t.nbytes}))

    def settle(self, wait: bool = False) -> None:
        """The sends seen done (all, with wait) leave the flight list, each a span on the timeline."""
        for flight in list(self.in_flight):
            work, start, args = flight
            if wait:
                work.wait()
            if wait or work.is_completed():
                self.in_flight.remove(flight)
                self.stats.span("send", start, args)

    def receive(self, shape: tuple, frm: int, micro: MicroStep) -> torch.Tensor:
        """A tensor from the stage `frm` steps away; the wait for it, this stage idle, is its bubble."""
        self.settle()
        t, start = torch.empty(shape, device=self.d.device), self.stats.mark()
        dist.irecv(t, self.ranks[self.d.pp_rank + frm], group=self.group).wait()
        self.stats.span("recv", start, {"from stage": self.d.pp_rank + frm, "bytes": t.nbytes})
        micro.mark("bubble")  # this stage idle, waiting for its neighbour
        return t

    def schedule_step(self, batches: list[tuple], scales: list[float], micro: MicroStep) -> list[torch.Tensor]:
        """GPipe or 1F1B from scratch: a stage receives its input from the one before (the first reads
        the ids), computes, and sends its output on; backward runs the other way."""
        inputs, outputs, losses = {}, {}, []
        shape = (*batches[0][0].shape, self.cfg.d_model)

        def forward(m: int) -> None:
            x = batches[m][0] if self.first else self.receive(shape, -1, micro).requires_grad_()
            if self.last:  # the loss, scaled as loss_scale says
                loss = micro.forward(self.module, (x, batches[m][1]))
                losses.append(loss.detach())
                outputs[m] = loss * scales[m]
            else:
                with micro.autocast():
                    outputs[m] = self.module(x)
                micro.mark("forward")
                self.send(outputs[m], +1)
            inputs[m] = x

        def backward(m: int) -> None:
            y, x = outputs.pop(m), inputs.pop(m)
            if self.last:
                micro.backward(y)
            else:
                y.backward(self.receive(y.shape, +1, micro))
                micro.mark("backward")
            if not self.first:
                self.send(x.grad, -1)

        # GPipe: every forward first. 1F1B: as many as the stages after this one need to start (the
        # last stage none), then one forward and one backward, then the backwards left over.
        count = len(batches)
        warmup = min(count, count if self.cfg.pp_schedule == "gpipe" else self.d.pp - self.d.pp_rank - 1)
        for m in range(warmup):
            forward(m)
        for m in range(warmup, count):
            forward(m)
            backward(m - warmup)
        for m in range(count - warmup, count):
            backward(m)
        self.settle(wait=True)
        return losses

    def finish_gradient_sync(self) -> None:
        if self.sync:  # the replicas of this stage average its gradients: no_sync kept them local till now
            for p in self.sync.place:
                if p.grad is not None:
                    self.sync.gradient_ready(p)
            self.sync.finish_gradient_sync()

    def eval_loss(self, kit: ModelKit, batch: tuple) -> torch.Tensor:
        """Forward only, through the stages; the loss on the last (0 elsewhere: its share is 0)."""
        x, targets = self.padded(batch)
        if not self.first:
            received = torch.empty((*x.shape, self.cfg.d_model), device=self.d.device)
            dist.recv(received, self.ranks[self.d.pp_rank - 1], group=self.group)
            x = received
        if self.last:
            return token_loss_sum(self.module(x), targets)
        dist.send(self.module(x), self.ranks[self.d.pp_rank + 1], group=self.group)
        return torch.zeros((), device=self.d.device)


class TorchPipeline(Pipeline):
    """The same stages under torch.distributed.pipelining: PipelineStage and its GPipe or 1F1B schedule."""

    schedule = None  # made at the first step, for that many micro-batches

    def schedule_step(self, batches: list[tuple], scales: list[float], micro: MicroStep) -> list[torch.Tensor]:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        losses: list[torch.Tensor] = []

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = micro.spoil(token_loss_sum(logits, targets))
            losses.append(loss.detach())
            # Which micro-batch: torch hands each as a view of the step's targets, equal in size (and on its first
            # step the first once more, to check the stage's output: that call's loss is not kept below).
            return loss * scales[targets.storage_offset() // targets.numel()]

        if self.schedule is None:
            stage = PipelineStage(self.module, self.d.pp_rank, self.d.pp, self.d.device, group=self.group)
            kind = ScheduleGPipe if self.cfg.pp_schedule == "gpipe" else Schedule1F1B
            # scale_grads=False: each loss is already divided as loss_scale says, not by the micro-batches
            self.schedule = kind(stage, len(batches), loss_fn=lambda y, t: self.loss_fn(y, t), scale_grads=False)
        self.loss_fn = loss_fn
        ids, targets = (torch.cat(column) for column in zip(*batches, strict=True))
        with micro.autocast():
            if self.first:
                self.schedule.step(ids)
            else:
                self.schedule.step(target=targets if self.last else None, losses=[] if self.last else None)
        return losses[-len(batches) :]  # the micro-batches' own, without that first check


# Context parallelism (Liu et al. 2023, ring attention; Brandon et al. 2023, the causal load balance) splits
# each example's sequence across a group of ranks. Only attention mixes tokens, so everything else runs on
# this rank's tokens alone; attention needs every earlier token's key and value, which travel round the ring.
# torch's context_parallel registers its ring for the flash, efficient and cuDNN SDPA kernels only, none of
# which runs on a CPU: on Gloo, this from-scratch ring is the only one. --ddp torch and manual differ in
# the gradient average alone (torch's DDP or ManualDDP, over the replicas and their cp ranks).


class ContextParallel:
    """Each example's sequence cut into 2N equal chunks over the N ranks of the cp group: rank i holds chunks
    i and 2N-1-i (early ones cost little under a causal mask, late ones much: a pair balances the work),
    with their global positions; each rank's targets are its own. The weights are as `inner` splits them:
    whole (ModelSplit), or under --tp sliced (TensorParallel: each slice's ranks ring their own heads)."""

    KV, DKV = 1, 2  # the ring's message kinds, as tags: keys and values, and their gradients on the way home

    def __init__(self, group: dist.ProcessGroup, model: nn.Module | None = None, stats: CommStats | None = None,
                 inner: ModelSplit | None = None) -> None:  # fmt: skip
        self.inner = inner or ModelSplit()  # first: __getattr__ reads it
        self.group, self.n, self.rank, self.stats = group, dist.get_world_size(group), dist.get_rank(group), stats
        self.peers = [dist.get_global_rank(group, i) for i in range(self.n)]  # isend/irecv take global ranks
        self.seq_len = model.config.seq_len if model is not None else None  # (--inspect's positions)
        for block in model.blocks if model is not None else []:  # the model's attention made the ring's
            block.attn.attend = functools.partial(RingAttention.apply, ring=self)

    def __getattr__(self, name: str) -> object:  # what the ring does not change: the weights' split, the loss share
        if name == "inner":  # not set yet (copy makes the object first): no answer, rather than endless recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def example_share(self) -> float:  # every rank of the ring computes a part of the same examples: one counts them
        return float(self.rank == 0) * self.inner.example_share

    def chunks(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.n - 1 - rank

    def own_part(self, batch: tuple) -> tuple:
        """This rank's two chunks of every row (inputs, targets), and their positions. A row cut short
        (trim_padding, under --no-pack) is padded to a multiple of 2N: padding targets nothing."""
        inputs, targets = batch[:2]
        pad = -inputs.shape[1] % (2 * self.n)
        inputs, targets = F.pad(inputs, (0, pad)), F.pad(targets, (0, pad), value=IGNORE_INDEX)
        c = inputs.shape[1] // (2 * self.n)
        at = torch.cat([torch.arange(i * c, (i + 1) * c) for i in self.chunks(self.rank)])
        return inputs[:, at], targets[:, at], at.expand(len(inputs), -1)

    def pairs(self, source: int, c: int) -> Iterator[tuple[slice, slice, bool]]:
        """(query rows, key rows, causal) for each pair of this rank's chunks and `source`'s that attends at all:
        a later chunk sees an earlier one whole (no mask), a chunk sees itself causally, never a later one."""
        for i, mine in enumerate(self.chunks(self.rank)):
            for j, theirs in enumerate(self.chunks(source)):
                if mine >= theirs:
                    yield slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c), mine == theirs

    def send(self, t: torch.Tensor, tag: int) -> dist.Work:
        if self.stats is not None:
            self.stats.count("ring send", t.nbytes)
        return dist.isend(t, self.peers[(self.rank + 1) % self.n], group=self.group, tag=tag)

    def receive(self, like: torch.Tensor, tag: int) -> tuple[torch.Tensor, dist.Work]:
        t = torch.empty_like(like)
        return t, dist.irecv(t, self.peers[(self.rank - 1) % self.n], group=self.group, tag=tag)

    def around(self, kv: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(source rank, its keys and values) for each rank of the ring, this one first: while the caller
        computes with one block, the next is already on its way (one process: no send to itself)."""
        for step in range(self.n):
            last, start = step == self.n - 1, self.stats.mark() if self.stats is not None else None
            works = [] if last else [self.send(kv, self.KV), *(incoming := self.receive(kv, self.KV))[1:]]
            yield (self.rank - step) % self.n, kv
            for work in works:
                work.wait()
            if works and start is not None:  # on the timeline: the pass, until seen arrived, beside the block
                self.stats.span("send", start, {"ring pass": step + 1, "keys and values": tuple(kv.shape)})
            kv = kv if last else incoming[0]


def attention_block(q: torch.Tensor, k: torch.Tensor, causal: bool, lse: torch.Tensor | None = None) -> tuple:
    """One (query chunk, key chunk) pair's scores' exponentials, normalised by their own log-sum-exp (returned),
    or by a given one (the whole row's, in backward)."""
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:  # the diagonal pair: key j is visible to query i when j <= i
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse = s.logsumexp(-1, keepdim=True) if lse is None else lse
    return (s - lse).exp(), lse


def kept_units(p: torch.Tensor, dropout_p: float, seed: int, block: int) -> torch.Tensor:
    """Attention dropout on one block's probabilities: a mask drawn from its own seed, so that backward
    draws the very same mask again instead of storing it."""
    if not dropout_p:
        return p
    generator = torch.Generator(p.device).manual_seed(seed + block)
    return p * (torch.rand(p.shape, generator=generator, device=p.device) >= dropout_p) / (1 - dropout_p)


class RingAttention(torch.autograd.Function):
    """Causal attention over the sequence split across the cp group (ContextParallel), from scratch.

    Forward: each rank's keys and values travel round the ring, one block a step, the next in flight while
    this one computes. Each pair of chunks gives an output and the log-sum-exp of its scores; they merge as
    online softmax does: o = o * exp(lse - new) + o_b * exp(lse_b - new), new = log(exp(lse) + exp(lse_b)).
    Backward recomputes each block (flash attention's way: no N x N probabilities kept), from the saved
    output and log-sum-exp; the keys' and values' gradients ride the ring with them and take one hop more,
    home to the rank that owns them."""

    @staticmethod
    def forward(ctx: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                ring: ContextParallel) -> torch.Tensor:  # fmt: skip
        c, seed = q.shape[-2] // 2, int(torch.randint(2**62, ())) if dropout_p else 0
        out, lse = torch.zeros_like(q), torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype, device=q.device)
        for source, kv in ring.around(torch.stack([k, v])):
            for block, (rows, cols, causal) in enumerate(ring.pairs(source, c)):
                p, lse_b = attention_block(q[..., rows, :], kv[0, ..., cols, :], causal)
                o_b = kept_units(p, dropout_p, seed, 4 * source + block) @ kv[1, ..., cols, :]
                o, m = out[..., rows, :], lse[..., rows, :]  # views: merged in place
                merged = torch.logaddexp(m, lse_b)  # finite: this rank's own chunks, the diagonal, come first
                o.mul_((m - merged).exp()).add_(o_b * (lse_b - merged).exp())
                m.copy_(merged)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.dropout_p, ctx.seed = ring, dropout_p, seed
        return out

    @staticmethod
    def backward(ctx: object, dout: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        ring, c, dq, sends = ctx.ring, q.shape[-2] // 2, torch.zeros_like(q), []
        delta = (dout * out).sum(-1, keepdim=True)  # sum_j p_ij dp_ij, the softmax's backward term
        for step, (source, kv) in enumerate(ring.around(torch.stack([k, v]))):
            travelled = ring.receive(kv, ring.DKV) if step else None  # the gradients of kv the ranks before added
            dkv = torch.zeros_like(kv)
            for block, (rows, cols, causal) in enumerate(ring.pairs(source, c)):
                kb, vb, do = kv[0, ..., cols, :], kv[1, ..., cols, :], dout[..., rows, :]
                p, _ = attention_block(q[..., rows, :], kb, causal, lse[..., rows, :])
                drop = functools.partial(kept_units, dropout_p=ctx.dropout_p, seed=ctx.seed, block=4 * source + block)
                dkv[1, ..., cols, :] += drop(p).transpose(-2, -1) @ do
                ds = p * (drop(do @ vb.transpose(-2, -1)) - delta[..., rows, :]) * q.shape[-1] ** -0.5
                dq[..., rows, :] += ds @ kb
                dkv[0, ..., cols, :] += ds.transpose(-2, -1) @ q[..., rows, :]
            if travelled:
                travelled[1].wait()
                dkv += travelled[0]
            if ring.n > 1:  # on to the next rank; after the last step that is home
                sends.append(ring.send(dkv, ring.DKV))
        if ring.n > 1:
            dkv, work = ring.receive(dkv, ring.DKV)
            work.wait()
        for work in sends:
            work.wait()
        return dq, dkv[0], dkv[1], None, None


def split_model(kit: ModelKit, cfg: RunConfig, d: MeshDist, stats: CommStats) -> None:
    """Tensor and context parallelism applied to the model in place (kit.split), before any hook sees its
    parameters. Under --pp each stage slices its own blocks (TensorParallelStage), once the pipeline cuts them."""
    if cfg.tp * cfg.pp * cfg.cp > 1 and kit.split is None and d.pp == 1 and d.tp * d.cp > 1:
        tp = TensorParallel(kit.model, d, cfg.ddp == "manual", stats) if d.tp > 1 else None
        kit.split = ContextParallel(d.group("cp"), kit.model, stats, tp) if d.cp > 1 else tp


def split_layout(kit: ModelKit, cfg: RunConfig, d: MeshDist, stats: CommStats) -> Layout | None:
    """The split model as every rank trains it: a pipeline's stage, or slices (and chunks) averaged by DDP over
    their replicas, sharded by FSDP, or alone where one replica spans every rank."""
    if cfg.tp * cfg.pp * cfg.cp == 1 or d.tp * d.pp * d.cp == 1:  # (one process: nothing to split)
        return None
    if d.pp > 1:
        return (TorchPipeline if cfg.ddp == "torch" else Pipeline)(kit, cfg, d, stats)
    if d.distributed and cfg.sharding == "full":
        layout = (SplitManualFSDP(kit.trained, d, [*kit.blocks, kit.trained], stats=stats) if cfg.ddp == "manual"
                  else SplitTorchFSDP.shard(kit, d.mesh[d.replica_dim]))  # fmt: skip
    elif d.replicas == 1:
        layout = SplitWrapper(kit.trained)
    elif cfg.ddp == "manual":
        layout = SplitManualDDP(kit.trained, d, cfg.bucket_mb, stats)
    elif kit.split.holds_all:
        layout = SplitTorchDDP.wrap(kit.trained, cfg, d, stats)
    else:  # torch's DDP takes no DTensor slices; replicate, FSDP's machinery with the weights whole, does
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for unit in [*kit.blocks, kit.trained]:  # inner units first, as fully_shard takes them
            replicate(unit, mesh=d.mesh[d.replica_dim])
        layout = TorchReplicated(kit.trained)
    layout.split = kit.split
    return layout


LAYOUT_MAKERS.append(LayoutMaker(("tp", "pp", "cp"), cut=split_model, wrap=split_layout, ranks=lambda d, cfg: (
    laid_out(d, cfg) if cfg.tp * cfg.pp * cfg.cp > 1 else d)))  # fmt: skip


if __name__ == "__main__" and "\n# =====" not in Path(__file__).read_text(encoding="utf-8"):
    run_core()  # the core saved alone (sections 1-8); in the whole script, main() runs


# ==============================================================================================
# Everything above is the DDP you came to read: settings, ranks, data, model, gradient sync, the
# training loop, sharding. A reader who came for DDP may stop here.
#
# Everything below makes the script production-grade: the command line, the launcher for machines
# without torchrun, chat data and pretrained models (tokenizers, chat templates, LoRA), the checks a
# learner turns on (--verify-sync, --inspect, the timeline), precision, faults and stop requests,
# evaluation, metrics, plots, the trace, the memory table, checkpoints and resume, locks, and main().
# ==============================================================================================


# ----------------------------------------------------------------------------------------------
# 9. Command line: argparse fills the RunConfig, and refuses what cannot run
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Within:
    """A number a flag accepts, checked as argparse reads it: past a sign check a value can still break far
    later (a timedelta overflow, a bucket too large to allocate), so each has its range."""

    kind: type  # int or float
    low: float
    high: float = math.inf
    low_open: bool = False  # the low end itself is refused: "a positive number"
    high_open: bool = False
    unit: str = ""

    def __call__(self, text: str) -> int | float:
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {self}, got {text}") from None
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        if not (above and below and math.isfinite(value)):  # also refuses NaN
            raise argparse.ArgumentTypeError(f"must be {self}, got {value if self.kind is int else text}")
        return value

    def __str__(self) -> str:
        if self.high_open:
            return f"in [{self.low:g}, {self.high:g})"
        if self.high < math.inf:
            return f"from {self.low:g} to {self.high:g}{self.unit}"
        noun = "integer" if self.kind is int else "number"
        return f"a positive {noun}" if self.low_open or self.low > 0 else f"zero or a positive {noun}"


# --inject-fault's kinds: kill: SIGKILL itself; raise: an exception; nan: a NaN loss; desync: a wrong gradient;
# save: SIGKILL itself halfway through writing the step's checkpoint; hang: stop answering.
FAULT_KINDS = ("kill", "raise", "nan", "desync", "save", "hang")


def fault_plan(text: str) -> str:
    """--inject-fault RANK:STEP[:KIND], read and spelled in full (a teaching and testing aid, never for real runs)."""
    parts = text.split(":")
    try:
        rank, step = int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"expected RANK:STEP[:KIND], got {text!r}") from None
    kind = parts[2] if len(parts) > 2 else "kill"
    if len(parts) > 3 or kind not in FAULT_KINDS or rank < 0 or step < 1:
        raise argparse.ArgumentTypeError(f"expected RANK:STEP[:KIND] with KIND one of {', '.join(FAULT_KINDS)}")
    return f"{rank}:{step}:{kind}"


def layer_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("must name at least one layer, e.g. q_proj,v_proj")
    return names


def tracker_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip() and n.strip() != "none")
    if unknown := [n for n in names if n not in TRACKERS]:
        raise argparse.ArgumentTypeError(f"unknown tracker {unknown[0]!r}: choose from none, {', '.join(TRACKERS)}")
    return names or ("none",)


READERS = {"layer names": layer_names, "fault plan": fault_plan, "tracker names": tracker_names}  # RunConfig's words


class _Parser(argparse.ArgumentParser):
    def __init__(self, **kwargs: object) -> None:
        # Flag names are an interface: with prefix matching, a typo like --max-step would quietly
        # mean --max-steps while --max-stpes is refused. Every misspelling is refused alike.
        super().__init__(allow_abbrev=False, **kwargs)

    # argparse prints a usage wall and exits; every rank would do it. Raise instead, report once,
    # with the flag a typo most likely meant.
    def error(self, message: str) -> None:  # type: ignore[override]
        known = [name for action in self._actions for name in action.option_strings]
        typos = [word.split("=")[0] for word in message.partition("unrecognized arguments: ")[2].split()]
        meant = [close[0] for typo in typos if typo.startswith("--") and (close := get_close_matches(typo, known, 1))]
        raise UsageError(message + (f"; did you mean {' or '.join(meant)}?" if meant else ""))


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    # A default of None is decided later (its help says how); False is an unset switch.
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


ALL_LINEAR = "all-linear"  # --lora-targets in PEFT's own spelling: every linear layer but the output head


# --model qwen, the first name of the pretrained path, stays a working spelling of --model hf.
MODEL_ALIASES = {"qwen": "hf"}


def build_arg_parser() -> argparse.ArgumentParser:
    """The command line, made from RunConfig's fields: a flag each, in their groups."""
    parser = _Parser(
        description="Train a causal language model across processes with DistributedDataParallel: a byte-level "
        "Transformer from scratch (learn DDP on a CPU with --nproc 2), or LoRA adapters on Qwen2.5 or another "
        "pretrained model (--model hf; --model qwen is the same) on your text or chat data, on 1-8 GPUs per machine "
        "and many machines.",
        formatter_class=_HelpFormatter,
    )
    add_flags(parser, checked_reading)
    run_group = next(g for g in parser._action_groups if g.title == "run")
    run_group.add_argument("--config", type=Path, metavar="FILE", help="YAML settings, keys named as the flags "
                           "(max_steps or max-steps); the command line overrides them. Each run writes its own, "
                           "resolved, as OUTPUT_DIR/config.yaml: --config with it repeats the run")  # fmt: skip
    return parser


def checked_reading(metadata: dict) -> dict:
    """A flag as the full script reads it: a range checked as argparse reads it (Within), a type named
    in words read by its reader (READERS)."""
    if "within" in metadata:
        metadata["type"] = Within(**metadata.pop("within"))
    if metadata.get("type") in READERS:
        metadata["type"] = READERS[metadata["type"]]
    return metadata


def config_words(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The settings of --config FILE as command-line words, to stand before the command line's own."""
    pre = _Parser(add_help=False)
    pre.add_argument("--config", type=Path)
    pre.add_argument("--output-dir", type=Path)
    typed = pre.parse_known_args(argv)[0]
    if (path := typed.config) is None:
        return []
    try:
        import yaml
    except ImportError:
        raise UsageError("--config reads YAML: pip install pyyaml") from None
    try:
        settings = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as e:
        raise UsageError(f"--config {path}: {e.strerror}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise UsageError(f"--config {path}: not YAML ({' '.join(str(e).split())})") from None
    if not isinstance(settings, dict):
        raise UsageError(f"--config {path}: expected one `name: value` line per setting")
    actions = {a.dest.replace("_", "-"): a for a in parser._actions if a.dest not in ("help", "config")}
    if unknown := [str(key) for key in settings if str(key).replace("_", "-") not in actions]:
        named = ", ".join(nearest_setting(list(actions), key) for key in unknown)
        raise UsageError(f"--config {path}: unknown setting{'s' * (len(unknown) > 1)} {named}")
    # A repeat into another folder (--config OLD/config.yaml --output-dir NEW) writes there all it wrote in OLD.
    moved = typed.output_dir and settings.get("output_dir", settings.get("output-dir"))
    words = []
    for key, value in settings.items():
        action = actions[str(key).replace("_", "-")]
        if moved and action.type is Path and value and Path(value).resolve().is_relative_to(Path(moved).resolve()):
            value = typed.output_dir / Path(value).resolve().relative_to(Path(moved).resolve())
        flag = action.option_strings[0]
        switch = action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction)
        if switch and value is not None and not isinstance(value, bool):  # "no" would read as on
            raise UsageError(f"--config {path}: {key} is on or off: true or false, not {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            words += [flag if value else "--no-" + flag[2:]] if value is not None else []
        elif action.nargs == 0 or (action.nargs == "?" and isinstance(value, bool)):  # merge_lora: true
            words += [flag] if value else []
        elif value is not None:
            words += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    try:  # each value read alone first, so that a bad one is blamed on the file, not on the command line
        check_model_flags(parser, words, parser.parse_args(words))
    except UsageError as e:
        raise UsageError(f"--config {path}: {str(e).removeprefix('argument ')}") from None
    return words


# What other trainers call a setting (transformers' TrainingArguments, TRL): a file written for one is told our name.
SETTING_ALIASES = {"learning_rate": "lr", "per_device_train_batch_size": "batch_size", "num_train_epochs": "epochs",
                   "gradient_accumulation_steps": "grad_accum_steps", "max_grad_norm": "grad_clip",
                   "max_seq_length": "seq_len", "lora_target_modules": "lora_targets"}  # fmt: skip


def nearest_setting(known: list[str], key: str) -> str:
    """An unknown key, with the setting it most likely meant spelled as the key was (max_steps or max-steps)."""
    meant = SETTING_ALIASES.get(key.replace("-", "_"), "").replace("_", "-") or next(
        iter(get_close_matches(key.replace("_", "-"), known, 1)), None)  # fmt: skip
    return f"{key} (did you mean {meant.replace('-', '_') if '_' in key else meant}?)" if meant else key


def write_settings(cfg: RunConfig) -> Path | None:
    """OUTPUT_DIR/config.yaml: every setting as this run resolved it, for --config."""
    try:
        import yaml
    except ImportError:
        return say("[settings] OUTPUT_DIR/config.yaml not written: pip install pyyaml")
    path = cfg.output_dir / "config.yaml"
    atomic_write(path, yaml.safe_dump(resolved_settings(cfg), sort_keys=False, allow_unicode=True).encode())
    return path


def derived_settings(cfg: RunConfig) -> set[str]:
    """The settings that hold what settle_defaults derives from the others (--min-lr from --lr, --lr from --model
    and --finetune, ...): left out of config.yaml, they are derived anew when the command line changes those."""
    derived = set()
    for name in ("lr", "min_lr", "pack", "temperature", "prompt"):
        args = argparse.Namespace(**{f.name: getattr(cfg, f.name) for f in fields(cfg)} | {name: None})
        settle_defaults(args, set())
        derived |= {name} if getattr(args, name) == getattr(cfg, name) else set()
    return derived


def resolved_settings(cfg: RunConfig) -> dict:
    """Every setting as this run resolved it, spelt as its flag takes it (paths absolute: the file repeats the run
    from any folder), the other model's and the derived ones left out."""
    title = TINY_GROUP if cfg.model == "hf" else PRETRAINED_GROUP
    other = {a.dest for g in build_arg_parser()._action_groups if g.title == title for a in g._group_actions}
    settings = {}
    skip = other | derived_settings(cfg) | {"nproc"} | ({"max_steps"} if cfg.max_steps == 0 else set())
    skip |= {"val_fraction"} if cfg.eval_file else set()  # (--eval-file: nothing held out, and the two are refused)
    skip |= {"head_loss"} if cfg.objective == "dpo" else {"dpo_beta"}  # (each refused with the other objective)
    for name, value in ((f.name, getattr(cfg, f.name)) for f in fields(cfg) if f.name not in skip):
        if name == "model_name_or_path" and Path(value).expanduser().exists():  # a local folder, not a hub name
            value = Path(value).expanduser()
        if name == "merge_lora" and value == "":  # --merge-lora with no folder: merge after training
            value = True
        if value is not None or name == "cache_dir":  # no cache: "none", as the flag spells it
            settings[name] = "none" if value is None else str(value.resolve()) if isinstance(value, Path) else (
                ",".join(value) if isinstance(value, tuple) else value)  # fmt: skip
    return settings


def parse_args(argv: list[str] | None = None) -> RunConfig:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_arg_parser()
    argv = [*config_words(parser, argv), *argv]  # the file's settings first: the command line overrides them
    args = parser.parse_args(argv)
    del args.config
    check_model_flags(parser, argv, args)
    typed = {word.split("=", 1)[0] for word in argv}
    if args.eval_file and args.val_fraction and "--val-fraction" in typed:  # (0 says what --eval-file does)
        raise UsageError("--eval-file holds the held-out data, and nothing is held out of the training data: leave "
                         "out --val-fraction")  # fmt: skip
    if args.chat and args.merge_lora is not None:
        raise UsageError("--chat trains and merges nothing: merge first, then --chat OUTPUT_DIR/merged")
    settle_defaults(args, typed)
    if args.objective == "dpo" and "--lora-dropout" not in typed:  # TRL's disable_dropout: the policy's log-
        args.lora_dropout = 0.0  # probabilities as free of noise as its reference's
    if args.cache_dir is None:  # where datasets and transformers keep theirs: $XDG_CACHE_HOME, else ~/.cache
        args.cache_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llm_ddp_parallel_training"
    else:
        args.cache_dir = None if args.cache_dir.lower() == "none" else Path(args.cache_dir).expanduser()
    if args.min_lr > args.lr:
        raise UsageError(f"--min-lr {args.min_lr:g} is above --lr {args.lr:g}")
    cfg = RunConfig(**vars(args))
    if ALL_LINEAR in cfg.lora_targets and len(cfg.lora_targets) > 1:
        raise UsageError(f"--lora-targets {ALL_LINEAR} already names every linear layer: give it alone")
    if cfg.d_model % cfg.n_heads:
        raise UsageError(f"--d-model {cfg.d_model} is not divisible by --n-heads {cfg.n_heads}")
    if "--ddp" not in typed and layout_refusal(cfg) and not layout_refusal(manual := replace(cfg, ddp="manual")):
        cfg = manual  # only the from-scratch classes run this layout: the header says so (announce_run)
    if why := layout_refusal(cfg):
        raise UsageError(why)
    if cfg.merge_lora is not None and (why := cannot_merge(cfg)):
        raise UsageError(why)
    if cfg.objective == "dpo" and (why := cannot_prefer(cfg, typed)):
        raise UsageError(why)
    if cfg.objective != "dpo" and "--dpo-beta" in typed:
        raise UsageError("--dpo-beta is DPO's: add --objective dpo, or leave it out")
    if missing := [n for n in cfg.report_to if n in TRACKERS and importlib.util.find_spec(n) is None]:
        raise UsageError(f"--report-to {missing[0]} needs its library: pip install {' '.join(missing)}")
    if cfg.chat and not cfg.chat.exists():
        raise UsageError(f"--chat {cfg.chat}: no such file or folder; name a checkpoint or a folder a run wrote")
    if cfg.chat and (cfg.nproc or int(os.environ.get("WORLD_SIZE", "1")) > 1):  # one conversation, not one per rank
        raise UsageError("--chat runs as one process: leave out --nproc and torchrun")
    if cfg.checkpoint_policy == "selective" and not cfg.gradient_checkpointing:
        raise UsageError("--checkpoint-policy selective says what --gradient-checkpointing recomputes: add it")
    if cfg.compile and cfg.tp * cfg.pp * cfg.cp > 1:
        raise UsageError("--compile runs under DDP and --sharding; not yet with --tp, --pp or --cp: leave it out")
    if cfg.sample_every and (cfg.sharding == "full" or cfg.tp * cfg.pp * cfg.cp > 1):
        raise UsageError("--sample-every samples rank 0's whole model, which --sharding full, --tp and --pp split, "
                         "and whose attention --cp spreads over its ranks: leave it out (the sample at the end reads "
                         "the saved model back)")  # fmt: skip
    try:  # found now, not after hours of training when the sample is printed
        cfg.prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(
            f"--prompt cannot be encoded as UTF-8 (character {e.start} is {e.object[e.start]!a})"
        ) from None
    return cfg


def cannot_prefer(cfg: RunConfig, typed: set[str]) -> str | None:
    """What --objective dpo cannot do, each named before any rank starts."""
    if cfg.tp * cfg.pp * cfg.cp > 1:
        return ("--objective dpo with --tp, --pp or --cp: a pair's two sides go through one forward on one rank, and "
                "these cut the model or its sequences across ranks; use DDP or --sharding")  # fmt: skip
    if cfg.pack:
        return "--objective dpo keeps each side of a pair in a row of its own: leave out --pack"
    if cfg.train_on_prompt:
        return "--objective dpo compares the two completions alone: leave out --train-on-prompt"
    if cfg.trust_remote_code:  # a hub's own attention code may read the mask otherwise
        return "--trust-remote-code with --objective dpo: its shared-prompt mask is made for transformers' own models"
    if cfg.attn_implementation in ("eager", "flash_attention_2"):  # (varlen: packed rows, refused above)
        return (f"--attn-implementation {cfg.attn_implementation}: DPO computes each pair's shared prompt once, the "
                "two replies kept apart by a mask that sdpa takes; leave it out, or give sdpa")  # fmt: skip
    if "--head-loss" in typed and cfg.head_loss != "chunked":
        return f"--head-loss {cfg.head_loss}: DPO's per-sequence log-probabilities take the chunked head: leave it out"
    return None


def check_model_flags(parser: argparse.ArgumentParser, argv: list[str], args: argparse.Namespace) -> None:
    """Each model's flags are refused with the other, which would ignore them, when `argv` spells them out."""
    args.model = MODEL_ALIASES.get(args.model, args.model)
    group, meant_for, ignored_by, fix = {
        "tiny": (PRETRAINED_GROUP, "a pretrained model (--model hf)", "the tiny model", "add --model hf, or "),
        "hf": (TINY_GROUP, "the tiny model (--model tiny)", "a pretrained model", ""),
    }[args.model]
    if given := flags_given(parser, argv, args, group):
        is_, it = ("is", "it") if len(given) == 1 else ("are", "them")
        raise UsageError(
            f"{' and '.join([', '.join(given[:-1]), given[-1]] if len(given) > 1 else given)} {is_} for "
            f"{meant_for}; {ignored_by} would ignore {it}: {fix}leave {it} out"
        )


def flags_given(parser: argparse.ArgumentParser, argv: list[str], args: argparse.Namespace, title: str) -> list[str]:
    """The flags of the group `title` that the command line spells out (a default does not count)."""
    spelt = {word.split("=", 1)[0] for word in argv if word.startswith("--")}
    group = next(g for g in parser._action_groups if g.title == title)

    def spelled(a: argparse.Action) -> str:
        value = getattr(args, a.dest)
        if isinstance(value, bool):
            return a.option_strings[0]
        if isinstance(value, tuple):
            value = ",".join(value)
        return f"{a.option_strings[0]} {format(value, 'g') if isinstance(value, float) else value}"

    return [spelled(a) for a in group._group_actions if spelt & set(a.option_strings)]


# ----------------------------------------------------------------------------------------------
# 10. Launcher: ranks started without torchrun (--nproc), and meetings with no deadline
# ----------------------------------------------------------------------------------------------


# PyTorch's Windows wheels are built without libuv, which its TCPStore uses by default elsewhere.
USE_LIBUV = not sys.platform.startswith("win")
LAUNCHER_PIPE = "LLM_DDP_LAUNCHER_PIPE"  # set by --nproc: the rank's stdin is a pipe from its launcher
LAUNCHER_GONE_GRACE_S = 60.0


def launch_local_ranks(cfg: RunConfig, argv: list[str]) -> int:
    """--nproc N: start N ranks here with torchrun's environment, as torchrun --standalone would; forward
    SIGINT and SIGTERM; when a rank fails, the others get a few seconds to say so, then are stopped."""
    if launched_by_torchrun():
        raise UsageError("--nproc starts its own ranks: under torchrun, leave it out (--nproc_per_node sets the count)")
    store = dist.TCPStore(
        "127.0.0.1",
        0,  # a free port, which the store binds itself: no race with another program
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=cfg.timeout_s),
        use_libuv=USE_LIBUV,
    )
    env = os.environ | {
        "WORLD_SIZE": str(cfg.nproc),
        "LOCAL_WORLD_SIZE": str(cfg.nproc),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": os.urandom(8).hex(),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # as torchrun: N ranks share the cores
        LAUNCHER_PIPE: "1",
    }
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--nproc", "0"]  # the last --nproc wins
    # Each rank's stdin is a pipe from here that is never written: it closes when this process
    # ends, however it ends, and that is how the ranks learn it (see end_with_the_launcher).
    ranks = [
        subprocess.Popen(
            command, env=env | {"RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)}, stdin=subprocess.PIPE
        )
        for r in range(cfg.nproc)
    ]

    def forward(signum: int, frame: object) -> None:
        forwarded.append(signum)
        for rank in ranks:
            with contextlib.suppress(OSError):
                rank.send_signal(signum)

    forwarded: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    try:
        while (codes := [rank.poll() for rank in ranks]) and None in codes:
            if any(code not in (None, 0, EXIT_STOPPED) for code in codes):
                break
            time.sleep(0.1)
        failed = [(r, code) for r, code in enumerate(codes) if code not in (None, 0, EXIT_STOPPED)]
        if not failed:
            return EXIT_STOPPED if EXIT_STOPPED in codes else 0
        deadline = time.monotonic() + 10  # the others lose contact and each say so; then they are made to stop
        while any(rank.poll() is None for rank in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        rank, code = failed[0]
        # Bad input: rank 0 said it in one line. Ctrl-C before training: the ranks ended quietly (130; -2 in start-up)
        if code != EXIT_USAGE and not (forwarded and code in (130, -signal.SIGINT)):
            print(f"error: rank {rank} failed first (exit code {code}); every rank has stopped", file=sys.stderr)
        return code if code > 0 else 128 - code  # killed by a signal: a shell's code for it
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()


def end_with_the_launcher() -> None:
    """--nproc ranks end when their launcher does, however it ends (a killed notebook kernel): its end of
    their stdin pipe closes, and a rank stops as on SIGTERM, or leaves anyway LAUNCHER_GONE_GRACE_S later."""
    if os.environ.get(LAUNCHER_PIPE) != "1":
        return

    def watch() -> None:
        # A raw read, not sys.stdin's: a daemon thread blocked inside a buffered reader holds its
        # lock, and the interpreter aborts when it finds that lock taken at shutdown.
        while os.read(0, 64):  # b"": the end of the pipe, the launcher has gone
            pass
        if STOP.signal is None:
            STOP.signal, STOP.at = signal.SIGTERM, time.monotonic()
        try:
            if os.environ.get("LOCAL_RANK") == "0":
                os.write(2, b"[stop] the --nproc launcher has gone: every rank stops after this step\n")
        except OSError:  # and whoever read our output went with it: write nowhere from now on
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
        time.sleep(LAUNCHER_GONE_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def check_rank_variables() -> None:
    """The rank variables torchrun exports, checked first: a leftover `export RANK=...` gets one line,
    not a ValueError from init_process_group or a wait for ranks that never come."""
    env = os.environ
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    shown = ", ".join(f"{n}={env[n]}" for n in names if n in env)
    fix = "launch with torchrun (it sets them all), or unset them to run one process"
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", "0"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    except (KeyError, ValueError):
        raise UsageError(f"rank variables incomplete or not integers ({shown}): {fix}") from None
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise UsageError(f"rank variables are inconsistent ({shown}): {fix}")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
        raise UsageError(f"{shown} are set but MASTER_ADDR or MASTER_PORT is not: {fix}")


def rendezvous_store(timeout: timedelta) -> tuple[dist.Store | None, str | None]:
    """The store the ranks meet in (None: torch's, from MASTER_ADDR/PORT) and their launch (launch_token).
    torchrun's agent keeps one store across restarts, where a restarted rank could find the dead attempt's
    addresses and hang (pytorch#135712): a key prefix per attempt keeps them apart."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        return None, f"{run_id}@{socket.gethostname()}:{os.getppid()}" if run_id is not None else None
    reach_the_agent_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout, use_libuv=USE_LIBUV
    )
    attempt = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    return attempt, launch_token(store)


def reach_the_agent_store(host: str, port: int, seconds: float = 10.0) -> None:
    """Under torchrun the agent's store is up before any rank starts, so a rank that cannot connect to it in
    seconds never will: say so in one line, not after --timeout-s of silent retries. (The usual cause: each
    host's name resolves to a loopback address, so torchrun told the other hosts to meet at their own.)"""
    deadline, problem = time.monotonic() + seconds, ""
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=max(0.5, deadline - time.monotonic())).close()
            return
        except OSError as e:
            problem = e.strerror or str(e)
            time.sleep(0.5)
    try:
        where = socket.gethostbyname(host)
    except OSError:
        where = "nothing"
    raise TrainingError(
        f"rank {os.environ.get('RANK')} cannot reach the rendezvous store at {host}:{port} ({host} resolves to "
        f"{where} on this host; {problem}): start torchrun with --local-addr THIS_HOSTS_ADDRESS on every host "
        "(and --rdzv-conf is_host=1 on the first), and name the interface the hosts share in GLOO_SOCKET_IFNAME"
    )


def check_socket_interfaces() -> None:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name this host's interfaces: a wrong name is refused now,
    not after the rendezvous times out. (NCCL's names are prefixes unless the list starts with `=`; a list
    that starts with `^` excludes.)"""
    names = [name for _, name in socket.if_nameindex()]
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        wanted = os.environ.get(var, "")
        exact = var.startswith("GLOO") or wanted.startswith("=")
        for entry in [] if wanted.startswith("^") else filter(None, wanted.lstrip("=").split(",")):
            if not any(name == entry if exact else name.startswith(entry) for name in names):
                raise UsageError(f"{var}={wanted}: this host has no interface {entry} (it has {', '.join(names)}); "
                                 f"name the one the hosts share, or unset {var}")  # fmt: skip


def describe_nodes(d: Dist) -> str | None:
    """Which ranks run on which node (torchrun's GROUP_RANK), and the interface and address each node's
    sockets use: gathered from every rank (one collective) where the ranks span nodes; else None. Then a
    warning where torchrun's --max-restarts could not bring a lost node back."""
    if d.world_size == d.local_world_size:
        return None
    gloo = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    address = interface_address(gloo) if gloo else host_address()
    where = f"{gloo} {address} (GLOO_SOCKET_IFNAME)" if gloo else f"{address} (its name's)"
    nccl = f", NCCL on {os.environ.get('NCCL_SOCKET_IFNAME', 'its own choice')}" if d.backend == "nccl" else ""
    every = [None] * d.world_size
    mine = (os.environ.get("GROUP_RANK", "?"), socket.gethostname(), address, where + nccl)
    dist.all_gather_object(every, mine, d.control)
    nodes = {node: [r for r, other in enumerate(every) if other == node] for node in dict.fromkeys(every)}
    NODES.update({r: f"node {node[0]} ({node[1]}, {node[2]})" for node, ranks in nodes.items() for r in ranks})
    env = os.environ  # torch 2.13's agent on the store's host keeps its first round's store address, never resent:
    stuck = env.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return f"[nodes] {len(nodes)} nodes: " + "; ".join(
        f"node {n} ({host}): ranks {','.join(map(str, ranks))}, Gloo on {sockets}"
        for (n, host, _, sockets), ranks in nodes.items()
    ) + ("\n[nodes] warning: under --max-restarts a host started again would wait for the store's address: set "
         "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every host" if stuck else "")  # fmt: skip


NODES: dict[int, str] = {}  # each rank's node, by name, where ranks span nodes: a stalled rank names its node
BEAT_S = 1.0  # how often each rank of a run across nodes says in the rendezvous store that it is there


def store_client(seconds: float) -> dist.Store:
    """A connection of its own to the store the ranks met in (torchrun's agent's, or torch's on rank 0)."""
    where = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(*where, is_master=False, timeout=timedelta(seconds=seconds), use_libuv=USE_LIBUV)


def beat(rank: int) -> None:
    """Every BEAT_S, one more on this rank's counter in the rendezvous store; ends when the store cannot be
    reached. Its own connection: a beat waiting on a lost store holds up nothing else."""
    with contextlib.suppress(RuntimeError, OSError):  # (DistStoreError, DistNetworkError: RuntimeErrors)
        store = store_client(10)
        while True:
            store.add(f"llm_ddp/beat/{rank}", 1)
            time.sleep(BEAT_S)


def stalled_ranks() -> set[int] | None:
    """After a collective failed: the ranks that did not beat in the store for three beats (their process, host
    or link gone); None where this rank no longer reaches the store itself. What the ranks told the store, not a
    probe of a port a firewall may drop; by rank, so that two nodes behind one address stay two."""
    try:
        store, keys = store_client(5), {rank: f"llm_ddp/beat/{rank}" for rank in NODES}
        before = {rank: store.add(key, 0) for rank, key in keys.items()}
        time.sleep(3 * BEAT_S)
        return {rank for rank, key in keys.items() if store.add(key, 0) == before[rank]}
    except (RuntimeError, OSError, KeyError):  # (no MASTER_ADDR: a process group made without one)
        return None


def host_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        return f"none ({socket.gethostname()}: {e.strerror})"


def interface_address(name: str) -> str:
    """An interface's IPv4 address (Linux's SIOCGIFADDR ioctl); '?' where there is none to read."""
    try:
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, name[:15].encode().ljust(256, b"\0"))[20:24])
    except (ImportError, OSError):
        return "?"


def launch_token(store: dist.Store) -> str:
    """A name for this torchrun launch, the same in its restarts and new in the next: a random token in
    the agent's store, which lives as long as the launch (run ids repeat; the agent's pid may not be ours)."""
    return store.compare_set("llm_ddp/launch", "", os.urandom(8).hex()).decode()


def meet_without_deadline(d: Dist, name: str, problem: str) -> str:
    """Wait with no deadline (a download may outlast --timeout-s) until every rank gets here, in the store;
    return the first problem any rank brought ('' if none)."""
    failed, arrived = f"{name}/failed", f"{name}/arrived"
    if problem:
        d.store.set(failed, problem)  # before arriving, so no rank can see everyone arrived without it
    d.store.add(arrived, 1)
    while d.store.add(arrived, 0) < d.world_size and not d.store.check([failed]):
        time.sleep(0.2)
    return d.store.get(failed).decode() if d.store.check([failed]) else ""


# ----------------------------------------------------------------------------------------------
# 11. Records: .jsonl schemas, chat templates and assistant-only targets, packing, the token cache
# ----------------------------------------------------------------------------------------------


# The corpus file: a .txt file holds one text sample per line; a .jsonl file holds one JSON
# record per line, in one of the schemas fine-tuning users bring (TRL's, ShareGPT, Alpaca).
# Every record becomes text, a conversation, or a prompt with its completion.
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class Record:
    """One training sample as the file gives it: exactly one of the three shapes is set."""

    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) turns
    prompt: str | None = None
    completion: str | None = None
    source: str = field(default="", compare=False)  # FILE:LINE, for errors found later
    prompt_turns: int = 0  # a preference pair's side: its first turns are the prompt, never a target
    rejected: Record | None = None  # a preference pair: this record is its chosen side, and this its rejected one


# ----- the token cache: each record tokenized once, by one process per machine, read by every rank -----
# A corpus becomes flat arrays in --cache-dir, under a key made of everything that decides the tokens
# (corpus_key): a later run, a resume or a restart with the same inputs tokenizes nothing.
CACHE_FORMAT = 1  # raise when what a cache holds, or how records become tokens, changes
CHUNK_RECORDS = 2000  # records a tokenizing process takes at a time; a source of one chunk starts no pool
TEXT_CHUNK_BYTES = 4 << 20  # a text corpus is cleaned this many bytes at a time: memory stays flat
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")
READ_AS_NEEDED = ("stream", "edges", "ids", "is_target")  # one entry per token or line: FileArray
DATASET_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}


def check_readable(path: Path, what: str = "corpus") -> None:
    if not path.exists():
        raise UsageError(f"{what} file not found: {path}")
    if not path.is_file():
        raise UsageError(f"{what} path is not a file: {path}")


def not_utf8(path: Path, offset: int) -> UsageError:
    return UsageError(f"corpus file is not valid UTF-8: {path} (bad byte at offset {offset})")


def file_blocks(path: Path) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of the file's whole lines, TEXT_CHUNK_BYTES or so at a time, checked to be UTF-8.
    A byte-order mark (Windows editors add one) is dropped: it is not text."""
    check_readable(path)
    try:
        with open(path, "rb") as f:
            rest = f.read(len(codecs.BOM_UTF8))
            at = len(rest) if rest == codecs.BOM_UTF8 else 0
            rest = rest[at:]
            while True:
                block = f.read(TEXT_CHUNK_BYTES)
                data = rest + block
                cut = data.rfind(b"\n") + 1 if block else len(data)  # a newline never sits inside a UTF-8 character
                data, rest = data[:cut], data[cut:]
                try:
                    data.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise not_utf8(path, at + e.start) from None
                if data:
                    yield at, data
                at += cut
                if not block:
                    return
    except OSError as e:
        raise UsageError(f"cannot read corpus file {path}: {e.strerror}") from None


# What str.strip strips, as bytes: ASCII whitespace, and the UTF-8 forms of Unicode's (U+0085 ... U+3000).
ASCII_SPACE = np.array([b < 128 and chr(b).isspace() for b in range(256)])
UNICODE_SPACE = [c.encode() for c in map(chr, range(0x80, 0x3001)) if c.isspace()]
SPACE_PAIRS = np.array([int.from_bytes(s, "big") for s in UNICODE_SPACE if len(s) == 2])
SPACE_TRIPLES = np.array([int.from_bytes(s, "big") for s in UNICODE_SPACE if len(s) == 3])


def clean_lines(block: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The block's lines stripped as str.strip strips them, blank ones dropped, all at once in numpy:
    (the kept lines, each followed by a newline, as one byte array; their lengths)."""
    a = np.frombuffer(block + b"\0\0\0", dtype=np.uint8)  # room to look past the end
    breaks = np.flatnonzero(a[: len(block)] == NEWLINE)
    starts, ends = np.concatenate([[0], breaks + 1]), np.concatenate([breaks, [len(block)]])
    for _ in range(4):  # ASCII whitespace off both ends of every line, a byte a round
        lead = (starts < ends) & ASCII_SPACE[a[starts]]
        starts = starts + lead
        trail = (starts < ends) & ASCII_SPACE[a[ends - 1]]
        ends = ends - trail
        if not (lead.any() or trail.any()):
            break
    # The few lines with more whitespace at an edge, or Unicode's, go through str.strip itself.
    for i in np.flatnonzero((starts < ends) & (edge_space(a, starts, ends))):
        text = block[starts[i] : ends[i]].decode("utf-8")
        starts[i] += len(text[: len(text) - len(text.lstrip())].encode("utf-8"))
        ends[i] = starts[i] + len(text.strip().encode("utf-8"))
    keep = starts < ends
    starts, lengths = starts[keep], (ends - starts)[keep]
    framed = np.array(a)
    framed[starts + lengths] = NEWLINE  # each kept line's own end, closed by a newline
    out = np.cumsum(lengths + 1) - (lengths + 1)
    return framed[np.arange(int((lengths + 1).sum())) + np.repeat(starts - out, lengths + 1)], lengths


def edge_space(a: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Which lines still begin or end with whitespace (ASCII, or a Unicode space's 2 or 3 bytes)."""
    n = ends - starts

    def pairs(i: np.ndarray) -> np.ndarray:
        return a[i].astype(np.int64) << 8 | a[i + 1]

    def triples(i: np.ndarray) -> np.ndarray:
        return pairs(i) << 8 | a[i + 2]

    ascii_edge = ASCII_SPACE[a[starts]] | ASCII_SPACE[a[ends - 1]]
    head = (n >= 2) & np.isin(pairs(starts), SPACE_PAIRS) | (n >= 3) & np.isin(triples(starts), SPACE_TRIPLES)
    tail = (n >= 2) & np.isin(pairs(ends - 2), SPACE_PAIRS) | (n >= 3) & np.isin(triples(ends - 3), SPACE_TRIPLES)
    return ascii_edge | head | tail


def json_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line of a .jsonl file, read as it streams."""
    check_readable(path)
    at = 0
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                skip = len(codecs.BOM_UTF8) if number == 1 and raw.startswith(codecs.BOM_UTF8) else 0
                try:
                    line = raw[skip:].decode("utf-8")
                except UnicodeDecodeError as e:
                    raise not_utf8(path, at + skip + e.start) from None
                at += len(raw)
                if line.strip():
                    yield number, line
    except OSError as e:
        raise UsageError(f"cannot read corpus file {path}: {e.strerror}") from None


def is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in (".jsonl", ".json")


def check_text_format(data_format: str, path: Path) -> None:
    """A file that is not .jsonl is text lines: a record format named for it cannot apply."""
    if data_format not in ("auto", "text"):
        raise UsageError(f"--data-format {data_format} needs a .jsonl file; {path} is read as text lines")


def text_lines(path: Path) -> Iterator[str]:
    for _, block in file_blocks(path):  # stripped, blank ones dropped
        kept, _ = clean_lines(block)
        yield from kept.tobytes().decode("utf-8").split("\n")[:-1]


def read_records(path: Path, data_format: str, limit: int | None = None) -> tuple[list[Record], str]:
    """The corpus file's records (its first `limit`, the rest read and checked too) and their format, in memory:
    a look at a few (--show-examples) or a small file of one's own. Any bad record ends the run, naming its line."""
    if not is_jsonl(path):
        check_text_format(data_format, path)
        lines = (Record(text=line) for line in text_lines(path))
        records = [*itertools.islice(lines, limit), *collections.deque(lines, maxlen=0)]
        if not records:
            raise UsageError(f"corpus file has no non-blank lines: {path}")
        return records, "text"
    reading = Reading("jsonl", str(path), data_format)
    items = map(reading.record, json_lines(path))
    records = [*itertools.islice(items, limit), *collections.deque(items, maxlen=0)]
    if not records:
        raise UsageError(f"corpus file has no records: {path}")
    return records, reading.first[0]


@dataclass
class Reading:
    """How a source's items become records: lines of text, (number, line) of a .jsonl file, or
    (index, row) of a dataset (--dataset). The first record's format is every other's."""

    kind: str  # "text", "jsonl", "rows", or "records" (Record objects already)
    where: str  # the file or the dataset, for errors
    data_format: str
    train_on_prompt: bool = False
    first: tuple[str, int] | None = None  # the first record's format, and its line or row

    def record(self, item: Record | str | tuple[int, str | dict]) -> Record:
        if self.kind == "records":  # made already (as_tokens)
            return item
        if self.kind == "text":
            return Record(text=item)
        number, obj = item
        where = f"{self.where}:{number}" if self.kind == "jsonl" else f"{self.where} row {number}"
        if self.kind == "jsonl":
            try:
                obj = json.loads(obj)
            except ValueError as e:
                raise UsageError(f"{where}: not valid JSON ({e.msg})") from None
            except RecursionError:
                raise UsageError(f"{where}: JSON nested too deeply") from None
            if not isinstance(obj, dict):
                raise UsageError(f"{where}: a record must be a JSON object, got {type(obj).__name__}")
        fmt = detect_format(obj, where) if self.data_format == "auto" else self.data_format
        record = parse_record(obj, fmt, where)
        if self.first is None:
            self.first = (fmt, number)
        elif fmt != self.first[0]:
            line = "line" if self.kind == "jsonl" else "row"
            raise UsageError(
                f"{where}: a {fmt} record, but {line} {self.first[1]} is {self.first[0]}: one file holds one format "
                "(or name it with --data-format)"
            )
        return replace(record, source=where)


def in_chunks(items: Iterator, n: int = CHUNK_RECORDS) -> Iterator[list]:
    while chunk := list(itertools.islice(items, n)):
        yield chunk


def record_source(cfg: RunConfig) -> tuple[Reading, Iterator[list]]:
    """The records to tokenize, as chunks of items read as they stream, and how to read each."""
    if cfg.dataset:
        return Reading("rows", f"--dataset {cfg.dataset}", cfg.data_format, cfg.train_on_prompt), dataset_rows(cfg)
    path = cfg.corpus_file
    if not is_jsonl(path):
        check_text_format(cfg.data_format, path)
        return Reading("text", str(path), "text", cfg.train_on_prompt), in_chunks(text_lines(path))
    return Reading("jsonl", str(path), cfg.data_format, cfg.train_on_prompt), in_chunks(json_lines(path))


def detect_format(obj: dict, where: str) -> str:
    for fmt, keys in (
        ("preference", ("chosen", "rejected")),  # first: its explicit form has a prompt
        ("messages", ("messages",)),
        ("sharegpt", ("conversations",)),
        ("prompt-completion", ("prompt", "completion")),
        ("alpaca", ("instruction", "output")),
        ("text", ("text",)),
    ):
        if any(k in obj for k in keys):
            return fmt
    raise UsageError(
        f"{where}: no known fields ({', '.join(sorted(obj)) or 'none'}): expected text, messages, "
        "prompt + completion, conversations, instruction + output, or chosen + rejected"
    )


def parse_record(obj: dict, fmt: str, where: str) -> Record:
    def string(key: str, holder: dict = obj, optional: bool = False) -> str | None:
        value = holder.get(key)
        if value is None and optional:
            return None
        if not isinstance(value, str):
            what = "missing" if value is None else f"a {type(value).__name__}, not a string"
            raise UsageError(f"{where}: field '{key}' is {what}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError(f"{where}: field '{key}' is not valid text (it holds a lone surrogate)") from None
        return value

    if fmt == "text":
        return Record(text=string("text"))
    if fmt == "preference":
        return preference_record(obj, where)
    if fmt == "prompt-completion":
        return Record(prompt=string("prompt"), completion=string("completion"))
    if fmt == "alpaca":
        request = string("instruction") + (f"\n\n{extra}" if (extra := string("input", optional=True)) else "")
        system = string("system", optional=True)
        turns = ([("system", system)] if system else []) + [("user", request), ("assistant", string("output"))]
        return Record(messages=tuple(turns))
    key, role_key, content_key, roles = {
        "messages": ("messages", "role", "content", {r: r for r in ROLES}),
        "sharegpt": ("conversations", "from", "value", SHAREGPT_ROLES),
    }[fmt]
    turns = obj.get(key)
    if not isinstance(turns, list) or not turns:
        raise UsageError(f"{where}: field '{key}' must be a non-empty list of turns")
    parsed = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise UsageError(f"{where}: each of '{key}' must be an object with '{role_key}' and '{content_key}'")
        role = string(role_key, turn)
        if role not in roles:
            raise UsageError(f"{where}: unknown role '{role}' (expected one of {', '.join(roles)})")
        parsed.append((roles[role], string(content_key, turn)))
    if not any(role == "assistant" for role, _ in parsed):
        raise UsageError(f"{where}: the conversation has no assistant turn: nothing to train on")
    return Record(messages=tuple(parsed))


def preference_record(obj: dict, where: str) -> Record:
    """A preference pair in TRL's forms: prompt, chosen and rejected as strings or as message lists, or (the implicit
    prompt) chosen and rejected alone, whole texts or conversations whose shared opening is the prompt. Its chosen
    side as a record, holding its rejected side; each side's targets are its completion's."""
    for key in ("chosen", "rejected"):
        if not isinstance(obj.get(key), str | list) or not obj[key]:
            what = "missing" if obj.get(key) is None else "not a non-empty string or list of messages"
            raise UsageError(f"{where}: field '{key}' is {what}")
    prompt, chosen, rejected = obj.get("prompt"), obj["chosen"], obj["rejected"]
    if len({type(x) for x in (chosen, rejected, chosen if prompt is None else prompt)}) > 1:
        raise UsageError(f"{where}: prompt, chosen and rejected must be all strings or all lists of messages")
    if chosen == rejected:
        raise UsageError(f"{where}: chosen and rejected are the same: the pair prefers nothing")
    if prompt is None:  # the shared opening, as TRL's extract_prompt finds it (a space before the split left out)
        n = next((i for i, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if a != b), None)
        if n is None:
            raise UsageError(f"{where}: one of chosen and rejected ends where the other goes on: nothing to prefer")
        n -= isinstance(chosen, str) and n > 0 and chosen[n - 1] == " "
        if n == 0:
            raise UsageError(f"{where}: chosen and rejected share no opening to be the prompt: give it as 'prompt'")
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    if isinstance(chosen, str):
        sides = [parse_record({"prompt": prompt, "completion": side}, "prompt-completion", where) for side in (
            chosen, rejected)]  # fmt: skip
    else:  # the turns after the prompt's are the completion's
        sides = [replace(parse_record({"messages": prompt + c}, "messages", where), prompt_turns=len(prompt))
                 for c in (chosen, rejected)]  # fmt: skip
    return replace(sides[0], rejected=replace(sides[1], source=where))


def describe_records(fmt: str) -> str:
    return "lines" if fmt == "text" else f"{fmt} records"


@dataclass(frozen=True)
class TokenSequence:
    """One record as the model sees it: token ids, and which of them are targets."""

    ids: list[int]
    is_target: list[bool]  # is_target[j]: token j is predicted (from token j-1) and counts in the loss


def tokenize_record(
    record: Record, tokenizer: PreTrainedTokenizerBase, train_on_prompt: bool, masking: ChatMasking | None
) -> TokenSequence:
    """Text: [start] + text + [eos], all targets; prompt + completion + [eos], targets the completion and EOS;
    a conversation: its chat template's rendering, targets each reply and its turn's closing token
    (chat_segments). The user's own text never becomes control tokens (docs/chat-data.md)."""
    eos = tokenizer.eos_token_id
    if record.text is not None:
        return text_sequence(encode_texts([record.text], tokenizer)[0], tokenizer)
    if record.prompt is not None:
        text = record.prompt + record.completion
        completion = [(len(record.prompt), len(text))]
        seq = encode_with_targets(text, completion, [(0, len(text))], tokenizer)
        return TokenSequence([*seq.ids, eos], [train_on_prompt or t for t in seq.is_target] + [True])
    try:
        full = render_chat(record.messages, tokenizer)
        # Every token a target needs no mask, so any template will do for --train-on-prompt.
        segments = [] if train_on_prompt else chat_segments(record.messages, tokenizer, masking, full)
        ends = itertools.accumulate(len(text) for text, _ in segments)
        targets = [(end - len(text), end) for (text, target), end in zip(segments, ends, strict=True) if target]
        if record.prompt_turns:  # a preference pair's side: the completion's replies alone are targets
            prompt = record.messages[: record.prompt_turns]  # with the reply's opening, unless it ends in a reply
            opening = render_chat(prompt, tokenizer, prompt=prompt[-1][0] != "assistant")
            if not full.startswith(opening):
                raise UsageError("the chat template renders the prompt otherwise inside the conversation: the "
                                 "completion cannot be told from it")  # fmt: skip
            targets = [(max(a, len(opening)), b) for a, b in targets if b > len(opening)]
        users = message_ranges(record.messages, tokenizer, masking, full, refuse=not train_on_prompt)
        seq = encode_with_targets(full, targets, users, tokenizer)
        return TokenSequence(seq.ids, [train_on_prompt or t for t in seq.is_target])
    except UsageError as e:
        raise UsageError(f"{record.source or 'a conversation'}: {e}") from None
    except Exception as e:  # the template's own refusal (roles must alternate, ...) or a rendering error
        raise UsageError(
            f"{record.source or 'a conversation'}: the chat template cannot render it: {first_line(e)}"
        ) from None


def encode_texts(texts: list[str], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Text records' ids, many in one call (the same ids as one at a time, 1.6x faster here)."""
    return tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def text_sequence(ids: list[int], tokenizer: PreTrainedTokenizerBase) -> TokenSequence:
    eos = tokenizer.eos_token_id
    ids = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos, *ids, eos]
    return TokenSequence(ids, [False] + [True] * (len(ids) - 1))


def encode_with_targets(
    text: str, targets: list[tuple[int, int]], users: list[tuple[int, int]], tokenizer: PreTrainedTokenizerBase
) -> TokenSequence:
    """`text` encoded whole, as the model meets it when prompted (in pieces, a SentencePiece tokenizer would
    put a "▁" before each), each token a target when any of its characters lies in a `targets` range; a
    special token inside `users` (the user's own text) was typed, and is encoded as plain characters."""
    if not getattr(tokenizer, "is_fast", True):  # offsets come from the tokenizers library alone
        raise UsageError("chat and prompt-completion records need a fast tokenizer (with character offsets), "
                         f"and this model's is a slow {type(tokenizer).__name__}; text records do not")  # fmt: skip
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    spans = np.array(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    a, b = spans[:, 0].copy(), np.maximum(spans[:, 1], spans[:, 0] + 1)  # a token of no characters: where it stands
    specials = {tokenizer.convert_tokens_to_ids(t): t for t in special_tokens(tokenizer)}
    for i in (i for i, token in enumerate(ids) if token in specials):
        # Just its own characters: a token that strips the whitespace beside it (Phi-3's <|assistant|>)
        # has offsets that take it in, and that whitespace may open the reply.
        at = text.find(specials[ids[i]], a[i], b[i])
        a[i], b[i] = (at, at + len(specials[ids[i]])) if at >= 0 else (a[i], b[i])
    in_targets, in_users = characters_within(targets, len(text)), characters_within(users, len(text))
    is_target = (in_targets[b] > in_targets[a]).tolist()
    typed = [i for i, token in enumerate(ids) if token in specials and in_users[b[i]] - in_users[a[i]] == b[i] - a[i]]
    for i in reversed(typed):
        piece = mid_text_encoder(tokenizer).encode(text[a[i] : b[i]], add_special_tokens=False).ids
        ids[i : i + 1], is_target[i : i + 1] = piece, [is_target[i]] * len(piece)
    return TokenSequence(ids, is_target)


@functools.lru_cache(maxsize=4)
def mid_text_encoder(tokenizer: PreTrainedTokenizerBase) -> object:
    """The tokenizer's own pipeline (a tokenizers.Tokenizer) with special tokens read as ordinary
    characters, as in the middle of a text: encoded alone, a SentencePiece-style tokenizer
    (Mistral, Phi-3) would put a "▁" before them, a space the user never typed."""
    from tokenizers import Tokenizer, pre_tokenizers

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.encode_special_tokens = True
    if isinstance(backend.pre_tokenizer, pre_tokenizers.Metaspace):
        backend.pre_tokenizer.prepend_scheme = "never"
    return backend


def characters_within(ranges: list[tuple[int, int]], n: int) -> np.ndarray:
    """c[j]: how many of text's first j characters (of n) lie in `ranges`, so that characters a..b-1
    hold one when c[b] > c[a], and all when c[b] - c[a] == b - a."""
    edges = np.zeros(n + 2, dtype=np.int64)
    for start, end in ranges:
        edges[start] += 1
        edges[end] -= 1
    return np.concatenate([[0], np.cumsum(np.cumsum(edges) > 0)])


def message_ranges(
    turns: tuple[tuple[str, str], ...],
    tokenizer: PreTrainedTokenizerBase,
    masking: ChatMasking,
    full: str,
    refuse: bool = True,
) -> list[tuple[int, int]]:
    """Where each message's own text lies in `full`, the template's rendering: rendered with a marker for each
    message, `full` must be that with each message put back (or trimmed). A template that changes messages
    otherwise gives [] if none spells a special token; else the record is refused (unless not `refuse`)."""
    marks = [f"\ue000{i}\ue001" for i in range(len(turns))]  # private-use characters: never in a template
    roles = tuple(role for role, _ in turns)
    if roles not in masking.marked:
        masking.marked[roles] = render_chat(tuple(zip(roles, marks, strict=True)), tokenizer)
    ranges, at, rest = [], 0, masking.marked[roles]
    for (_, content), mark in zip(turns, marks, strict=True):
        template, found, rest = rest.partition(mark)
        shown = next((c for c in (content, content.strip()) if found and full.startswith(template + c, at)), None)
        if shown is None:
            break
        at += len(template)
        ranges.append((at, at + len(shown)))
        at += len(shown)
    if len(ranges) == len(turns) and full[at:] == rest:
        return ranges
    spelled = sorted({t for _, content in turns for t in masking.end_tokens if t in content})
    if spelled and refuse:
        raise UsageError(
            f"its text spells {', '.join(spelled)}, and the chat template changes message text in a way that "
            "cannot be followed, so that text could not be kept from becoming control tokens"
        )
    return []


def render_chat(turns: tuple[tuple[str, str], ...], tokenizer: PreTrainedTokenizerBase, prompt: bool = False) -> str:
    messages = [{"role": role, "content": content} for role, content in turns]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


@dataclass(frozen=True)
class ChatMasking:
    """How to find assistant replies in the tokenizer's chat template (checked once per run)."""

    end_tokens: tuple[str, ...]  # special tokens that may close a turn, longest first
    # The template rendered with a marker for each message depends on the roles alone: rendered
    # once for each pattern of roles (message_ranges), not for every record.
    marked: dict[tuple[str, ...], str] = field(default_factory=dict, compare=False, repr=False)


def chat_masking(tokenizer: PreTrainedTokenizerBase) -> ChatMasking:
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("chat records need a chat template, and this model's tokenizer has none")
    return ChatMasking(tuple(sorted(special_tokens(tokenizer), key=len, reverse=True)))


def special_tokens(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    return {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}


def chat_segments(
    turns: tuple[tuple[str, str], ...],
    tokenizer: PreTrainedTokenizerBase,
    masking: ChatMasking,
    full: str | None = None,
) -> list[tuple[str, bool]]:
    """The conversation rendered by its chat template, cut into (text, is_target): targets are each reply and
    the special token closing its turn. The mask comes from the template itself, not {% generation %} markers
    (Qwen2.5's has none, transformers#34172): docs/chat-data.md says how, and what is refused."""

    def render(upto: int, generation_prompt: bool) -> str:
        return render_chat(turns[:upto], tokenizer, generation_prompt)

    def refuse(why: str) -> UsageError:
        return UsageError(f"the chat template cannot be masked for assistant-only loss ({why}); "
                          "use --train-on-prompt to train on every token")  # fmt: skip

    full, segments, done = render(len(turns), False) if full is None else full, [], 0
    for i, (role, content) in enumerate(turns):
        if role != "assistant":
            continue
        if i == 0:
            raise refuse("the conversation opens with an assistant turn, which nothing prompts")
        before, through = render(i, True), full if i + 1 == len(turns) else render(i + 1, False)
        if not through.startswith(before):
            n = next(j for j, (x, y) in enumerate(zip(before + "\0", through + "\1", strict=False)) if x != y)
            raise refuse(f"the generation prompt goes on {clip(before[n:], 60)!r} where the conversation through "
                         f"the reply goes on {clip(through[n:], 60)!r}")  # fmt: skip
        appended = through[len(before) :]
        found = find_reply(appended, content, masking)
        if found is None:
            raise refuse(f"for the reply {clip(content, 60)!r} the template appends {clip(appended, 120)!r}, "
                         "which does not hold it closed by a special token")  # fmt: skip
        start, end = len(before) + found[0], len(before) + found[1]
        if not full.startswith(through[:end]):
            raise refuse(f"the whole conversation renders reply {clip(content, 60)!r} differently from the "
                         "conversation that ends with it")  # fmt: skip
        segments += [(full[done:start], False), (full[start:end], True)]
        done = end
    segments.append((full[done:], False))
    return [(text, target) for text, target in segments if text]


def find_reply(appended: str, content: str, masking: ChatMasking) -> tuple[int, int] | None:
    """Where the reply lies in the text the template appends for it, as it is or with the
    whitespace a template trims removed, and a special token closing it: (start, end of that token)."""
    for shown in dict.fromkeys((content, content.strip(), content.rstrip(), content.lstrip())):
        at = appended.find(shown)
        while at >= 0:
            close = next((t for t in masking.end_tokens if appended.startswith(t, at + len(shown))), None)
            if close is not None:
                return at, at + len(shown) + len(close)
            at = appended.find(shown, at + 1)
    return None


def clip(text: str, n: int) -> str:
    """The first n characters of text, for a message; "..." says where it was cut."""
    return text if len(text) <= n else text[:n] + "..."


def turn_closing_token(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The token id closing an assistant turn (Qwen: <|im_end|>); None for a template that cannot be masked."""
    try:
        probe = chat_segments((("user", "?"), ("assistant", "!")), tokenizer, chat_masking(tokenizer))
    except UsageError:
        return None
    reply = next(text for text, target in probe if target)
    return tokenizer.convert_tokens_to_ids(reply.removeprefix("!"))


@dataclass(frozen=True)
class Tokens:
    """Every record's tokens, end to end: record i is ids[offsets[i] : offsets[i + 1]], and token j
    counts in the loss where is_target[j] (predicted from token j - 1). Read from the
    token cache, or in memory; `chosen` marks the records this set uses, kept in file order."""

    ids: np.ndarray | FileArray  # uint16 or uint32: the smallest that holds the vocabulary
    offsets: np.ndarray  # (N + 1,) int64
    is_target: np.ndarray | FileArray  # bool, one per token
    target_bytes: np.ndarray  # (N,) UTF-8 bytes each whole record's targets spell (count_target_bytes)
    first_target: np.ndarray  # (N,) where each record's first target after its first token is; its length if none
    key: str  # the token cache's key, part of the training data's digest
    chat: bool  # conversations: sampling answers through the chat template
    completions: bool  # prompt-completion records: sampling continues a prompt with no start token
    fmt: str = "text"  # the records' format, as the file gives it (describe_records)
    chosen: np.ndarray | None = None  # bool, one per sequence; None: every one

    @property
    def pairs(self) -> bool:
        """Preference records: each two sequences (pair_sides), split, counted and drawn together."""
        return self.fmt == "preference"

    def __len__(self) -> int:
        """Records (pairs, of preference records)."""
        return (len(self.offsets) - 1 if self.chosen is None else int(self.chosen.sum())) // (1 + self.pairs)

    def subset(self, chosen: np.ndarray) -> Tokens:
        """The records (pairs) `chosen` marks."""
        return replace(self, chosen=np.repeat(chosen, 1 + self.pairs))

    def records(self) -> np.ndarray:
        return np.arange(len(self.offsets) - 1) if self.chosen is None else np.flatnonzero(self.chosen)


class TokenRows(Rows):
    """Pretrained-model examples: each record's tokens cut to its first seq_len + 1, one record a
    row, or (packed) whole records laid end to end, each with its own positions. A row is its
    records' slices of the flat arrays, made when a batch asks for it."""

    def __init__(self, tokens: Tokens, seq_len: int, tokenizer: PreTrainedTokenizerBase, pack: bool) -> None:
        records = tokens.records()
        lengths = tokens.offsets[records + 1] - tokens.offsets[records]
        kept_length = np.minimum(lengths, seq_len + 1)
        # A record cut so short that no target is left would train on nothing (and a step of
        # nothing but such records would divide by zero): it is dropped.
        keep, cut, self.unit = tokens.first_target[records] < kept_length, lengths > seq_len + 1, 1 + tokens.pairs
        if tokens.pairs:  # a pair is kept whole (each side with a target left) or dropped whole; cut where a side is
            keep, cut = np.repeat(keep[0::2] & keep[1::2], 2), np.repeat(cut[0::2] | cut[1::2], 2)
        self.counts = {"records": len(records) // self.unit, "truncated": int(cut.sum()) // self.unit,
                       "dropped": int((~keep).sum()) // self.unit}  # fmt: skip
        self.reference: np.ndarray | None = None  # each pair's reference log-probabilities (preference_path)
        if not keep.any():
            raise UsageError(f"no record keeps a target token within --seq-len {seq_len}: raise --seq-len")
        self.records, self.lengths = records[keep], kept_length[keep]
        self.whole_record = lengths[keep] == self.lengths
        self.row_starts = pack_rows(self.lengths - 1, seq_len) if pack else np.arange(len(self.records) + 1)
        self.tokens, self.seq_len, self.tokenizer, self.pack = tokens, seq_len, tokenizer, pack
        self.pad_id = tokenizer.pad_token_id or 0
        self.key = sha256(f"{tokens.key}:rows:{seq_len}:{pack}:".encode() + self.records.tobytes())

    def __len__(self) -> int:
        return (len(self.row_starts) - 1) // self.unit

    def __getitem__(self, r: int) -> tuple[torch.Tensor, ...]:
        """Row r; of pairs, pair r: its two sides' rows stacked (and their reference log-probabilities)."""
        if self.unit == 1:
            return self.row(r)
        sides = [torch.stack(column) for column in zip(self.row(2 * r), self.row(2 * r + 1), strict=True)]
        return (*sides, *([] if self.reference is None else [torch.from_numpy(self.reference[r])]))

    def row(self, r: int) -> tuple[torch.Tensor, ...]:
        inputs = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        targets = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        positions = torch.zeros(self.seq_len, dtype=torch.long)
        at = 0
        for j in range(self.row_starts[r], self.row_starts[r + 1]):
            # Targets are masked by *position*, never by token id: Qwen's pad token may equal its
            # EOS, and masking by id would also hide every real EOS from the loss.
            start, n = int(self.tokens.offsets[self.records[j]]), int(self.lengths[j]) - 1
            ids = torch.from_numpy(self.tokens.ids[start : start + n + 1].astype(np.int64))
            is_target = torch.from_numpy(self.tokens.is_target[start + 1 : start + n + 1].astype(bool))
            inputs[at : at + n] = ids[:-1]
            targets[at : at + n] = torch.where(is_target, ids[1:], IGNORE_INDEX)
            positions[at : at + n] = torch.arange(n)
            at += n
        positions[at:] = torch.arange(self.seq_len - at)  # the padded tail: a "sequence" of its own
        return (inputs, targets, positions) if self.pack else (inputs, targets)

    @functools.cached_property
    def target_bytes(self) -> torch.Tensor:
        """Each row's target bytes: a whole record's from the cache, a cut record's counted now
        (the held-out set asks, and evaluating it costs far more than this)."""
        per_record = self.tokens.target_bytes[self.records].astype(np.int64)
        for j in np.flatnonzero(~self.whole_record):
            start, n = int(self.tokens.offsets[self.records[j]]), int(self.lengths[j])
            ids, is_target = self.tokens.ids[start : start + n], self.tokens.is_target[start : start + n]
            per_record[j] = count_target_bytes(TokenSequence(ids.tolist(), is_target.tolist()), self.tokenizer)
        return torch.from_numpy(np.add.reduceat(per_record, self.row_starts[:-1]).reshape(-1, self.unit).sum(1))


def pack_rows(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """--pack: whole examples laid into rows of seq_len positions, in order, so that little compute
    goes to padding: where each row starts among the examples, and where the last one ends."""
    starts: list[int] = []
    free = 0
    for i, n in enumerate(lengths.tolist()):
        if n > free:
            starts.append(i)
            free = seq_len
        free -= n
    return np.array([*starts, len(lengths)], dtype=np.int64)


def encode_records_with_tokenizer(
    records: list[Record] | Tokens,
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    train_on_prompt: bool = False,
    pack: bool = False,
) -> tuple[TokenRows, dict[str, int]]:
    """Pretrained-model examples (TokenRows) from records, tokenized here, or from Tokens already
    made; and what became of the records (cut to --seq-len, dropped with no target left)."""
    rows = TokenRows(as_tokens(records, tokenizer, train_on_prompt), seq_len, tokenizer, pack)
    return rows, rows.counts


def as_tokens(records: list[Record] | Tokens, tokenizer: PreTrainedTokenizerBase, train_on_prompt: bool) -> Tokens:
    """Records as Tokens, tokenized in memory (the token cache holds a corpus's already)."""
    if isinstance(records, Tokens):
        return records
    part = tokenize_chunk(Reading("records", "", "auto", train_on_prompt), tokenizer, list(records))
    offsets = np.concatenate([[0], np.cumsum(part["lengths"])])
    key = sha256(b"".join(part[k].tobytes() for k in ("ids", "is_target")) + offsets.tobytes())
    kinds = part["kinds"]
    fmt = "preference" if "pairs" in kinds else "messages" if "chat" in kinds else "prompt-completion" if (
        "completions" in kinds) else "text"  # fmt: skip
    return Tokens(part["ids"], offsets, part["is_target"], part["target_bytes"], part["first_target"], key,
                  "chat" in part["kinds"], "completions" in part["kinds"], fmt)  # fmt: skip


def count_target_bytes(seq: TokenSequence, tokenizer: PreTrainedTokenizerBase) -> int:
    """UTF-8 bytes of the text the targets spell out; a special token (EOS, end of turn) counts
    as one byte, like the byte model's newline."""
    special = set(tokenizer.all_special_ids)
    targets = [t for t, target in zip(seq.ids[1:], seq.is_target[1:], strict=True) if target]
    text = tokenizer.decode([t for t in targets if t not in special])
    return len(text.encode("utf-8")) + sum(t in special for t in targets)


def first_records(cfg: RunConfig, n: int) -> list[Record]:
    """The first n records of the corpus file or --dataset, for --show-examples."""
    if cfg.dataset:
        reading = Reading("rows", f"--dataset {cfg.dataset}", cfg.data_format)
        return [reading.record(item) for item in itertools.islice(itertools.chain.from_iterable(dataset_rows(cfg)), n)]
    records, fmt = read_records(cfg.corpus_file, cfg.data_format, n)
    if cfg.model == "tiny" and fmt != "text":
        raise UsageError(f"{cfg.corpus_file} holds {fmt} records; the tiny byte model trains on text: use --model hf")
    return records


def print_examples(cfg: RunConfig, d: Dist, records: list[Record]) -> None:
    """--show-examples: the first records as the model will see them, each target run in [[ ]]; a pair, each side."""
    labels = [f"pair {n}, {side}" if r.rejected else f"example {n}" for n, r in enumerate(records, 1)
              for side in ("chosen", "rejected")[: 1 + bool(r.rejected)]]  # fmt: skip
    records = [side for r in records for side in pair_sides(r)]
    if cfg.model == "hf":
        tokenizer = load_tokenizer(cfg, resolve_model_files(cfg, d))
        masking = chat_masking(tokenizer) if any(r.messages for r in records) else None
        sequences = [tokenize_record(r, tokenizer, cfg.train_on_prompt, masking) for r in records]
        decode = functools.partial(tokenizer.decode, skip_special_tokens=False)
    else:
        framed = [b"\n" + r.text.encode("utf-8") + b"\n" for r in records]
        sequences = [TokenSequence(list(b), [False] + [True] * (len(b) - 1)) for b in framed]

        def decode(ids: list[int]) -> str:
            return bytes(ids).decode("utf-8", errors="replace")

    if not d.is_main:
        return
    for label, seq in zip(labels, sequences, strict=True):
        ids, is_target = seq.ids[: cfg.seq_len + 1], [False, *seq.is_target[1 : cfg.seq_len + 1]]
        note = f", cut from {len(seq.ids)} to --seq-len {cfg.seq_len} + 1" if len(seq.ids) > len(ids) else ""
        note += "; dropped: no target left" if not any(is_target) else ""
        say(f"--- {label}: {len(ids)} tokens, {sum(is_target)} targets{note}")
        # Each run as it reads within the whole: decoded alone, a SentencePiece run would lose its leading space.
        ends = [*itertools.accumulate(len(list(run)) for _, run in itertools.groupby(is_target))]
        texts = [decode(ids[:end]) for end in ends]
        runs = [(b[len(a) :], is_target[end - 1]) for a, b, end in zip(["", *texts], texts, ends, strict=False)]
        say("".join(f"[[{text}]]" if target else text for text, target in runs))


def collate_for(cfg: RunConfig, attention: str) -> Callable[[list], tuple[torch.Tensor, ...]]:
    """How a micro-batch is stacked: packed rows stay rows under sdpa and eager (one long row's mask would grow
    with the square of the micro-batch); flash_attention_2 and varlen take one row (flatten_rows)."""
    one_row = cfg.model == "hf" and cfg.pack and attention in ("flash_attention_2", "varlen")
    return flatten_rows if one_row else trim_padding


def flatten_rows(batch: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """The packed rows end to end as one row, position_ids restarting for each example: transformers reads them
    as boundaries under flash_attention_2 only in a batch of one row (_is_packed_sequence)."""
    return tuple(t.reshape(1, -1) for t in trim_padding(batch))


def tokenize_chunk(reading: Reading, tokenizer: PreTrainedTokenizerBase, items: list) -> dict:
    """A chunk of records as flat arrays (see Tokens), and what kinds of record it held."""
    ids, is_target, lengths, nbytes, first = [], [], [], [], []
    kinds: set[str] = set()
    records = [side for item in items for side in pair_sides(reading.record(item))]
    texts = [r.text for r in records if r.text is not None]
    encoded = iter(encode_texts(texts, tokenizer) if texts else [])
    masking = chat_masking(tokenizer) if any(r.messages is not None for r in records) else None
    for sample in records:
        if sample.text is not None:
            seq = text_sequence(next(encoded), tokenizer)
        else:
            seq = tokenize_record(sample, tokenizer, reading.train_on_prompt, masking)
        ids += seq.ids
        is_target += seq.is_target
        lengths.append(len(seq.ids))
        nbytes.append(count_target_bytes(seq, tokenizer))
        first.append(next((j for j, target in enumerate(seq.is_target) if target and j), len(seq.ids)))
        kinds.add("chat" if sample.messages is not None else "completions" if sample.prompt is not None else "text")
        kinds |= {"pairs"} if sample.rejected else set()
    return {
        "ids": np.array(ids, dtype=np.int64),
        "is_target": np.array(is_target, dtype=bool),
        "lengths": np.array(lengths, dtype=np.int64),
        "target_bytes": np.array(nbytes, dtype=np.int64),
        "first_target": np.array(first, dtype=np.int64),
        "kinds": kinds,
        "first": reading.first,
    }


def pair_sides(record: Record) -> tuple[Record, ...]:
    """A record as the sequences it trains: a preference pair's chosen side, then its rejected one (the token cache
    holds them in turn: pair i is sequences 2i and 2i + 1)."""
    return (record, record.rejected) if record.rejected else (record,)


TOKENIZING: tuple[Reading, PreTrainedTokenizerBase] | None = None  # a tokenizing process's (start_tokenizing)


def start_tokenizing(cfg: RunConfig, folder: Path, reading: Reading) -> None:
    """In each process of the pool: Ctrl-C is the parent's to act on, between chunks."""
    global TOKENIZING
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    TOKENIZING = (reading, load_tokenizer(cfg, folder))


def tokenize_in_pool(items: list) -> dict:
    return tokenize_chunk(*TOKENIZING, items)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def tokenized_chunks(cfg: RunConfig, folder: Path, tokenizer: PreTrainedTokenizerBase, workers: int) -> Iterator[dict]:
    """Each chunk of records as arrays, in order: here while a pool of `workers` starts, then by the pool a few
    chunks ahead of the writer, so the source is never held whole in memory."""
    reading, chunks = record_source(cfg)
    first, second = next(chunks, None), next(chunks, None)
    if second is None or workers == 1:
        yield from (
            tokenize_chunk(reading, tokenizer, chunk)
            for chunk in itertools.chain(filter(None, [first, second]), chunks)
        )
        return
    reading.record(first[0])  # the first record's format: what every later record's must be
    # spawn, not fork: this process already runs Gloo's threads, and a forked child inherits their locks.
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, context, initializer=start_tokenizing, initargs=(cfg, folder, reading))
    ready = pool.submit(int)  # the processes start now (importing torch takes them seconds) ...
    pending: collections.deque = collections.deque()
    try:
        for chunk in itertools.chain([first, second], chunks):
            if not (pending or ready.done()):  # ... while this one tokenizes, until they can
                yield tokenize_chunk(reading, tokenizer, chunk)
                continue
            pending.append(pool.submit(tokenize_in_pool, chunk))
            while len(pending) > 2 * workers or (pending and pending[0].done()):
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        # Ctrl-C reaches the whole process group, and a process still starting dies of it: then
        # the stop is the news. (The signal's watcher thread records it a moment after it lands.)
        time.sleep(0.5)
        stop_if_asked()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def stop_if_asked() -> None:
    if STOP.signal is not None:
        name = signal.Signals(STOP.signal).name
        raise TrainingError(f"stopped by {name} while building the token cache, before training: nothing was written")


def build_token_corpus(cfg: RunConfig, sink: ArraySink, folder: Path, workers: int) -> dict:
    """Tokenize every record once, into the sink's flat arrays (Tokens), with `workers` processes."""
    tokenizer = load_tokenizer(cfg, folder)
    dtype = np.uint16 if len(tokenizer) <= 1 << 16 else np.uint32
    sink.append("offsets", np.zeros(1, dtype=np.int64))
    end, kinds, first = 0, set(), None
    for part in tokenized_chunks(cfg, folder, tokenizer, workers):
        stop_if_asked()
        if len(part["ids"]) and part["ids"].max() > np.iinfo(dtype).max:
            raise TrainingError(f"token id {part['ids'].max()} is beyond the tokenizer's {len(tokenizer)}")
        sink.append("ids", part["ids"].astype(dtype))
        sink.append("is_target", part["is_target"])
        sink.append("offsets", end + np.cumsum(part["lengths"]))
        end += int(part["lengths"].sum())
        for name in ("target_bytes", "first_target"):
            sink.append(name, part[name])
        kinds |= part["kinds"]
        first = first or part["first"]
    records = sink.length("offsets") - 1
    if not records and cfg.dataset:
        raise UsageError(f"--dataset {cfg.dataset} has no records")
    if not records:
        what = "records" if is_jsonl(cfg.corpus_file) else "non-blank lines"
        raise UsageError(f"corpus file has no {what}: {cfg.corpus_file}")
    facts = {"records": records // (1 + ("pairs" in kinds)), "tokens": end, "fmt": first[0] if first else "text"}
    return facts | {"chat": "chat" in kinds, "completions": "completions" in kinds}


def build_byte_corpus(cfg: RunConfig, sink: ArraySink) -> dict:
    """The byte model's corpus (Lines): a text file cleaned in numpy, or a .jsonl file's text records."""
    path = cfg.corpus_file
    if is_jsonl(path):
        blocks = jsonl_texts(path, cfg.data_format)
    else:
        check_text_format(cfg.data_format, path)
        blocks = (clean_lines(block) for _, block in file_blocks(path))
    sink.append("stream", np.array([NEWLINE], dtype=np.uint8))
    sink.append("edges", np.zeros(1, dtype=np.int64))
    end = 0
    for kept, lengths in blocks:
        stop_if_asked()
        sink.append("stream", kept)
        sink.append("edges", end + np.cumsum(lengths + 1))
        end += len(kept)
    lines = sink.length("edges") - 1
    if not lines:
        raise UsageError(f"corpus file has no non-blank lines: {path}")
    return {"records": lines, "tokens": end + 1, "fmt": "text"}


def jsonl_texts(path: Path, data_format: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """A .jsonl file's text records as clean_lines gives a text file's lines (each kept as it is)."""
    reading = Reading("jsonl", str(path), data_format)
    for chunk in in_chunks(json_lines(path)):
        encoded = [reading.record(item).text for item in chunk]
        if reading.first[0] != "text":
            raise UsageError(
                f"{path} holds {reading.first[0]} records; the tiny byte model trains on text: use --model hf"
            )
        encoded = [text.encode("utf-8") for text in encoded]
        yield np.frombuffer(b"".join(b + b"\n" for b in encoded), dtype=np.uint8), np.array([len(b) for b in encoded])


class ArraySink:
    """Named arrays appended chunk by chunk: into NAME.bin files of a folder (a token cache being
    built), each with its length and CRC-32, or kept in memory (folder None: --cache-dir none)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder, self.facts, self.parts, self.files = folder, {}, {}, {}

    def append(self, name: str, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values)
        fact = self.facts.setdefault(name, {"dtype": values.dtype.str, "length": 0, "crc32": 0})
        fact["length"] += len(values)
        if self.folder is None:
            self.parts.setdefault(name, []).append(values)
            return
        if name not in self.files:
            self.files[name] = open(self.folder / f"{name}.bin", "wb")  # noqa: SIM115 (closed by close())
        data = memoryview(values).cast("B")
        fact["crc32"] = zlib.crc32(data, fact["crc32"])
        self.files[name].write(data)

    def length(self, name: str) -> int:
        return self.facts[name]["length"]

    def close(self) -> None:
        """Every file on disk, not only in the page cache, before the folder is renamed into place."""
        for f in self.files.values():
            if not f.closed:
                f.flush()
                os.fsync(f.fileno())
                f.close()

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: np.concatenate(parts) for name, parts in self.parts.items()}


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            crc = zlib.crc32(block, crc)
    return crc


def cache_problem(folder: Path, key: str) -> str | None:
    """Why the cache in `folder` cannot be used ("" when there is none), or None when its meta.json names this
    key and format and every array has its written length and CRC-32: a damaged cache is rebuilt."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except FileNotFoundError:
        return ""
    except (OSError, ValueError) as e:
        return f"its meta.json cannot be read ({describe_error(e)})"
    if not isinstance(meta, dict) or meta.get("key") != key or meta.get("format") != CACHE_FORMAT:
        return "its meta.json is not this cache's"
    if not isinstance(meta.get("arrays"), dict):
        return "its meta.json lists no arrays"
    for name, fact in meta["arrays"].items():
        path = folder / f"{name}.bin"
        want = fact["length"] * np.dtype(fact["dtype"]).itemsize
        have = path.stat().st_size if path.is_file() else None
        if have != want:
            return f"{name}.bin holds {have} bytes where {want} were written"
        if file_crc32(path) != fact["crc32"]:
            return f"{name}.bin fails its CRC-32 check"
    return None


class FileArray:
    """A 1-D array in a file of the token cache, read a slice at a time. Not a memory map: that keeps every
    page a batch touched resident, and a long run's memory would grow to the cache's size."""

    def __init__(self, path: Path, dtype: np.dtype, length: int) -> None:
        self.path, self.dtype, self.length = path, np.dtype(dtype), length
        self.file = open(path, "rb")  # noqa: SIM115 (open as long as the run: every batch reads it)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice | np.ndarray) -> np.ndarray:
        if isinstance(key, slice):
            start, stop, _ = key.indices(self.length)
            self.file.seek(start * self.dtype.itemsize)
            return np.frombuffer(self.file.read(max(0, stop - start) * self.dtype.itemsize), self.dtype)
        key = np.asarray(key)
        if key.size > self.length // 64:  # most of it: read it whole
            return np.fromfile(self.path, self.dtype)[key]
        return np.array([self[i : i + 1][0] for i in key.ravel().tolist()], self.dtype).reshape(key.shape)


def build_cache(cfg: RunConfig, folder: Path, key: str, build: Callable[[ArraySink], dict]) -> None:
    """Build in a folder of this process's own, then rename it into place: a build cut short leaves no cache a
    later run would load. If another run renamed the same cache into place first, that one stays."""
    host = socket.gethostname()
    leftover = re.compile(rf"\.(tokens|bytes)-\w+\.tmp-{re.escape(host)}-(\d+)")  # another machine's may live
    for left in folder.parent.glob(".*.tmp-*"):
        if (m := leftover.fullmatch(left.name)) and (process_gone(int(m[2])) or int(m[2]) == os.getpid()):
            shutil.rmtree(left, ignore_errors=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{host}-{os.getpid()}")
    sink = ArraySink(tmp)
    try:
        tmp.mkdir(parents=True)
        meta = build(sink)
        sink.close()
        meta |= {"key": key, "format": CACHE_FORMAT, "arrays": sink.facts}
        atomic_write(tmp / "meta.json", json.dumps(meta, indent=1).encode())
        while True:  # until this cache, or another build's that passes its check, is in place
            try:
                os.rename(tmp, folder)
                break
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
            if cache_problem(folder, key) is None:  # another run's, renamed in first (even after our swap): it stays
                break
            aside = folder.with_name(f".{folder.name}.damaged-{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):  # a damaged one: swap it out, unless another build just did
                os.rename(folder, aside)
            shutil.rmtree(aside, ignore_errors=True)
    except OSError as e:
        raise UsageError(
            f"cannot write the token cache in {cfg.cache_dir}: {e.strerror or e} "
            "(free some space, point --cache-dir at another folder, or pass --cache-dir none)"
        ) from None
    finally:
        sink.close()
        shutil.rmtree(tmp, ignore_errors=True)


def process_gone(pid: int) -> bool:
    """Whether no process on this machine has this id (never said on Windows, where os.kill(pid, 0) stops it)."""
    if sys.platform == "win32":
        return False
    try:
        os.kill(pid, 0)  # signal 0 sends nothing: it only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process
        pass
    return False


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def files_digest(paths: list[Path], root: Path) -> str:
    return sha256("".join(f"{p.relative_to(root)}:{file_digest(p)}\n" for p in sorted(paths)).encode())


def tokenizer_files(folder: Path) -> list[Path]:
    """The model folder's files but its weights and model config: the tokenizer's, whatever they are
    called (tokenizer.json, vocab + merges, tokenizer.model, the chat template, remote code)."""
    skip = ("config.json", "generation_config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
    return [p for p in folder.iterdir() if p.is_file() and p.suffix not in WEIGHT_FILES and p.name not in skip]


def corpus_key(cfg: RunConfig, folder: Path | None) -> str:
    """A digest of everything that decides the tokens and nothing else: the data's content (not its mtime), the
    format, and for a pretrained model the tokenizer's files, --train-on-prompt and the tokenizing libraries."""
    facts = {"cache_format": CACHE_FORMAT, "data": data_digest(cfg), "data_format": cfg.data_format}
    if folder is not None:
        import tokenizers
        import transformers

        facts |= {
            "tokenizer": files_digest(tokenizer_files(folder), folder),
            "train_on_prompt": cfg.train_on_prompt,
            "versions": [transformers.__version__, tokenizers.__version__],
        }
    return sha256(json.dumps(facts, sort_keys=True).encode())


def data_digest(cfg: RunConfig) -> str:
    if not cfg.dataset:
        check_readable(cfg.corpus_file)
        return file_digest(cfg.corpus_file)
    local = Path(cfg.dataset).expanduser()
    where = [cfg.dataset_config, cfg.dataset_split]
    if local.is_file():
        return sha256(json.dumps([file_digest(local), *where]).encode())
    if local.is_dir():
        return sha256(json.dumps([files_digest([p for p in local.rglob("*") if p.is_file()], local), *where]).encode())
    return sha256(json.dumps([cfg.dataset, load_dataset_split(cfg)._fingerprint, *where]).encode())


def datasets_library() -> Any:
    """Hugging Face datasets, imported only for --dataset (the tiny path never pays for it)."""
    try:
        import datasets
    except ImportError:
        raise UsageError(
            "--dataset reads with Hugging Face datasets, not installed here: pip install datasets"
        ) from None
    return datasets


def load_dataset_split(cfg: RunConfig) -> object:
    """--dataset: a Hub name, a local parquet/JSONL/CSV file, or a folder save_to_disk wrote, read
    with Hugging Face datasets (Arrow, memory-mapped): --dataset-split of it."""
    datasets = datasets_library()
    datasets.disable_progress_bars()
    local, split = Path(cfg.dataset).expanduser(), cfg.dataset_split
    try:
        if local.is_dir() and any((local / n).exists() for n in ("state.json", "dataset_dict.json")):
            data = datasets.load_from_disk(str(local))
            if isinstance(data, datasets.DatasetDict):
                if split not in data:
                    raise UsageError(f"--dataset {cfg.dataset} has no split '{split}' (it has {', '.join(data)})")
                data = data[split]
            return data
        if local.is_file():
            if local.suffix.lower() not in DATASET_BUILDERS:
                raise UsageError(f"--dataset {cfg.dataset}: a {local.suffix or 'suffix-less'} file; "
                                 f"expected one of {', '.join(DATASET_BUILDERS)}")  # fmt: skip
            return datasets.load_dataset(DATASET_BUILDERS[local.suffix.lower()], data_files=str(local), split=split)
        return datasets.load_dataset(cfg.dataset, cfg.dataset_config, split=split)
    except UsageError:
        raise
    except Exception as e:  # datasets' own: not found offline, unknown split or config, unreadable file
        raise UsageError(f"cannot load --dataset {cfg.dataset} (split '{split}'): {first_line(e)}") from None


def dataset_rows(cfg: RunConfig) -> Iterator[list[tuple[int, dict]]]:
    data, at = load_dataset_split(cfg), 0
    for batch in data.iter(batch_size=CHUNK_RECORDS):
        rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        yield list(enumerate(rows, at))
        at += len(rows)


def open_corpus(cfg: RunConfig, d: Dist, folder: Path | None, name: str = "corpus") -> Lines | Tokens:
    """The training data as tokens, from the token cache, built first where missing: rank 0 builds while the
    others wait; then the first rank of each machine that cannot see that cache (a node-local --cache-dir)
    builds its own; then every rank opens it. A failure anywhere stops every rank with its one line."""
    if cfg.cache_dir is None:  # every rank its own, all at once, each in one process: they share the cores
        return load_or_build_corpus(cfg, d, folder, workers=1 if d.distributed else usable_cores())
    corpus, problem, mine = None, "", None
    for turn, whose in (("global", d.is_main), ("local", d.local_rank == 0 and not d.is_main), ("rest", d.local_rank)):
        if whose and not problem:
            try:
                corpus = load_or_build_corpus(cfg, d, folder, usable_cores())
            except Exception as e:
                mine, problem = e, str(e) if isinstance(e, UsageError | TrainingError) else describe_error(e)
        if d.distributed:
            problem = meet_without_deadline(d, f"{name}_{turn}", problem)  # a name per corpus: met once each
    if mine is not None:
        raise mine
    if problem:
        raise UsageError(problem)
    return corpus


def load_or_build_corpus(cfg: RunConfig, d: Dist, folder: Path | None, workers: int) -> Lines | Tokens:
    """This process's view of the corpus: the cache opened if it passes its check, else built first."""
    started = time.perf_counter()
    key = corpus_key(cfg, folder)

    def build(sink: ArraySink) -> dict:
        facts = build_token_corpus(cfg, sink, folder, workers) if folder else build_byte_corpus(cfg, sink)
        return facts | {"source": str(cfg.dataset or cfg.corpus_file), "workers": workers if folder else 1}

    if cfg.cache_dir is None:
        sink = ArraySink(None)
        meta, arrays = build(sink), sink.arrays()
        took = time.perf_counter() - started
        log(d, f"[cache] none (--cache-dir none): {meta['records']:,} records tokenized in memory in {took:.1f} s")
        return corpus_from(arrays, meta, key)
    place = cfg.cache_dir / f"{'tokens' if folder else 'bytes'}-{key[:24]}"
    problem = cache_problem(place, key)
    if problem is not None:
        if problem:
            say(f"[cache] {place} {problem}: building it again")
        build_cache(cfg, place, key, build)
    meta, arrays = json.loads((place / "meta.json").read_text()), {}
    for name, fact in meta["arrays"].items():  # those with an entry per token or line read as batches ask
        path, dtype = place / f"{name}.bin", np.dtype(fact["dtype"])
        arrays[name] = FileArray(path, dtype, fact["length"]) if name in READ_AS_NEEDED else np.fromfile(path, dtype)
    what = f"{meta['records']:,} {describe_records(meta['fmt'])}, {meta['tokens']:,} tokens"
    if problem is not None:
        processes = meta["workers"] if meta["records"] > CHUNK_RECORDS else 1
        say(f"[cache] built {place}: {what} in {time.perf_counter() - started:.1f} s ({processes} process(es))")
    else:
        log(d, f"[cache] reused {place}: {what}, tokenized by an earlier run")
    return corpus_from(arrays, meta, key)


def corpus_from(arrays: dict[str, np.ndarray | FileArray], meta: dict, key: str) -> Lines | Tokens:
    if "stream" in arrays:
        return Lines(arrays["stream"], arrays["edges"], key)
    return Tokens(
        arrays["ids"], arrays["offsets"], arrays["is_target"], arrays["target_bytes"], arrays["first_target"],
        key, meta["chat"], meta["completions"], fmt=meta["fmt"],
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# 12. Pretrained models: Qwen2.5, Llama, Gemma, Mistral, Phi-3, ... with LoRA; the tiny model's size check
# ----------------------------------------------------------------------------------------------


# The pretrained path's outputs keep the names they had when it served Qwen alone: users' scripts read them.
QWEN_FINAL = "qwen_lora"  # the trained adapters and tokenizer, in OUTPUT_DIR
QWEN_FULL_FINAL = "qwen_full"  # --finetune full: the whole fine-tuned model and tokenizer, in OUTPUT_DIR


def tiny_parameter_count(c: TinyConfig) -> int:
    """Embeddings and head, plus per block: qkv 3d², proj d², MLP 8d², two norms."""
    return (2 * c.vocab_size + c.seq_len) * c.d_model + c.n_layers * (12 * c.d_model**2 + 2 * c.d_model) + c.d_model


def check_model_fits(n_params: int, d: Dist) -> None:
    """Refuse, before allocating, a model whose training state (16 bytes a parameter in fp32 with AdamW)
    cannot fit in this device's memory, rather than meet the OOM killer."""
    if d.device.type == "cuda":
        have = torch.cuda.get_device_properties(d.device).total_memory
    else:
        try:
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):  # no sysconf (Windows): leave it to the allocator
            return
    if 16 * n_params > have:
        raise UsageError(
            f"the tiny model would have {n_params:,} parameters, and training them needs about "
            f"{16 * n_params / 2**30:,.1f} GiB (weights, gradients, AdamW state) of the {have / 2**30:,.1f} GiB "
            f"on {d.device}: lower --d-model or --n-layers"
        )


def tiny_kit(cfg: RunConfig, d: Dist, lines: Lines, val_lines: Lines) -> ModelKit:
    """The core's tiny model (build_tiny_kit), refused clearly where it cannot fit (not by an allocation
    error), with what the full script adds: sampling, the FLOPs for MFU, its checkpoint read back."""
    check_model_fits(tiny_parameter_count(tiny_config(cfg)), d)
    kit = build_tiny_kit(cfg, d, lines, val_lines)
    return replace(
        kit,
        sample=lambda raw, prompt: generate_bytes(raw, prompt, cfg.sample_tokens, cfg.seed, cfg.temperature, cfg.top_p),
        flops_per_token=training_flops_per_token(kit.model, cfg.n_layers, cfg.d_model, cfg.seq_len),
        reload=lambda path: load_tiny_checkpoint(path, d.device),
    )


def build_pretrained_kit(
    cfg: RunConfig, d: Dist, records: list[Record] | Tokens, val_records: list[Record] | Tokens
) -> ModelKit:
    """A pretrained causal LM (Qwen2.5 by default) with LoRA adapters, or every weight trained (--finetune
    full); its records from the token cache (open_corpus), or as Record objects, tokenized here."""
    dtype, lora = choose_weights_dtype(cfg, d), cfg.finetune == "lora"
    tokenizer, model = load_pretrained(cfg, d, dtype)
    if tokenizer.pad_token is None:
        # Any id works for padding: padded positions are masked out of the loss by position.
        tokenizer.pad_token = tokenizer.eos_token
    records, val_records = (as_tokens(r, tokenizer, cfg.train_on_prompt) for r in (records, val_records))
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing: the reentrant kind re-runs forward inside backward, which
        # fires DDP's gradient hooks twice ("marked ready twice"), and it only backpropagates
        # through a checkpointed block whose input requires grad, which the frozen embedding's
        # output does not (hence enable_input_require_grads() in recipes that use it; not here).
        # (transformers 5 renamed gradient_checkpointing_enable to activation_checkpointing_enable.)
        enable = getattr(model, "activation_checkpointing_enable", None)
        options = {"use_reentrant": False} | (
            {"context_fn": keep_matmuls} if cfg.checkpoint_policy == "selective" else {}
        )
        if enable is not None:
            enable(activation_checkpointing_kwargs=options)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
        model.config.use_cache = False
    if lora and d.tp > 1:
        check_lora_under_tp(model, cfg.lora_targets)
    model = (add_lora(cfg, model) if lora else model).to(d.device)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    final = QWEN_FINAL if lora else QWEN_FULL_FINAL

    def save_final(raw: nn.Module, step: int, whole: dict | None = None) -> Path:
        path = cfg.output_dir / final
        with atomic_directory(path) as tmp:
            # LoRA: adapter_config.json + adapter_model.safetensors only. Full: the whole model,
            # config and weights, as from_pretrained reads it. (save_pretrained empties a
            # state_dict it is given, hence the copy.)
            with saved_as_one_process(raw):
                raw.save_pretrained(tmp, state_dict=dict(whole) if whole else None)
            tokenizer.save_pretrained(tmp)
        return path

    chat, completions = records.chat, records.completions

    @torch.no_grad()
    def sample(raw: nn.Module, prompt: str) -> str:
        """Continue --prompt as training saw text; after chat training, answer it: a user turn
        through the chat template, stopping at the end of the assistant's turn."""
        encode = functools.partial(tokenizer.encode, add_special_tokens=False)
        if chat:
            prefix = encode(render_chat((("user", prompt),), tokenizer, prompt=True))
            stop = [t for t in (tokenizer.eos_token_id, end_of_turn) if t is not None]
        else:  # text was trained after a start token; a prompt-completion prompt had none
            prefix, stop = ([] if completions else [start]) + encode(prompt), [tokenizer.eos_token_id]
        ids = torch.tensor([prefix], device=d.device)
        with torch.compiler.set_stance("force_eager"):  # compiled blocks: a KV cache would recompile each, each step
            out = raw.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.sample_tokens,
                               pad_token_id=tokenizer.pad_token_id, eos_token_id=stop, **sampling(cfg))  # fmt: skip
        reply = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        if not reply.strip():  # a random model's tokens may decode to blank lines (120 of them): one line says so
            reply = f"(nothing but {len(reply)} whitespace character(s): a model this untrained has no words yet)"
        return (f"{prompt} -> {reply}" if chat else prompt + reply).translate(CONTROL_ESCAPES)

    end_of_turn = turn_closing_token(tokenizer) if chat else None
    train, counts = encode_records_with_tokenizer(records, tokenizer, cfg.seq_len, cfg.train_on_prompt, cfg.pack)
    val = None
    if len(val_records):
        try:
            val = encode_records_with_tokenizer(val_records, tokenizer, cfg.seq_len, cfg.train_on_prompt)[0]
        except UsageError as e:
            source = f"--eval-file {cfg.eval_file}" if cfg.eval_file else f"--val-fraction {cfg.val_fraction}"
            raise UsageError(f"held-out records ({source}): {e}") from None

    if cfg.objective == "dpo":
        head, head_note = preference_path(cfg, d, model, train, val, resolve_model_files(cfg, d))
    else:
        head, head_note = loss_path(model, cfg.head_loss, d.tp, cfg.compile, cfg.seq_len + 1)
    attention, attention_note = packed_attention(cfg, model, d.device, lean="loss_module" in head)
    collate = collate_for(cfg, attention)
    if "collate" not in head:
        head["collate"] = functools.partial(lean_batch, collate, attention == "varlen") if "loss_module" in head else (
            collate)  # fmt: skip
    return ModelKit(
        model=model,
        train=train,
        val=val,
        **head,
        sample=sample,
        save_final=save_final,
        final_name=final,
        final_label="LoRA adapters and tokenizer" if lora else "fine-tuned model and tokenizer",
        flops_per_token=training_flops_per_token(
            model, model.config.num_hidden_layers, attention_width(model.config), cfg.seq_len
        ),
        describe=f"{cfg.model_name_or_path} ({dtype})"
        + (
            f" + LoRA r={cfg.lora_r} alpha={cfg.lora_alpha:g} on {','.join(cfg.lora_targets)}"
            if lora
            else ", every weight trained"
        )
        + f": {trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.3f}%){head_note}"
        + attention_note,
        blocks=list(decoder_body(model).layers),
        reload=functools.partial(reload_pretrained, cfg, dtype, d.device),
        split=PlannedTensorParallel(model, d) if d.tp > 1 else None,
        data_report=f"{counts['truncated']} cut to --seq-len {cfg.seq_len}, "
        f"{counts['dropped']} dropped with no target token left",
    )


def sampling(cfg: RunConfig) -> dict:
    """generate()'s arguments for --temperature and --top-p alone (a model's generation_config may add a top_k)."""
    if cfg.temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0}


def reload_pretrained(cfg: RunConfig, dtype: torch.dtype, device: torch.device, path: Path) -> nn.Module:
    """The saved output loaded back on this rank alone: the whole model, or the base plus the adapters."""
    from transformers import AutoModelForCausalLM

    options = dict(dtype=dtype, attn_implementation=loaded_attention(cfg), trust_remote_code=cfg.trust_remote_code)
    if cfg.finetune == "full":
        return AutoModelForCausalLM.from_pretrained(path, **options).to(device)
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(fetch_model_files(cfg), **options)
    return PeftModel.from_pretrained(base, path).to(device)


def cannot_merge(cfg: RunConfig) -> str | None:
    """What --merge-lora cannot do, named before anything runs."""
    if not cfg.merge_lora:
        return None if cfg.model == "hf" and cfg.finetune == "lora" else (
            "--merge-lora merges the LoRA adapters this run trains: it needs --model hf and --finetune lora, or an "
            "adapter folder to merge (--merge-lora ADAPTER_DIR)")  # fmt: skip
    if cfg.nproc or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return "--merge-lora ADAPTER_DIR runs as one process: leave out --nproc and torchrun"
    if not (Path(cfg.merge_lora) / "adapter_config.json").is_file():
        return f"--merge-lora {cfg.merge_lora}: no adapter_config.json there; name the folder a LoRA run wrote"
    return None


def merge_adapters(cfg: RunConfig, adapter: Path) -> Path:
    """OUTPUT_DIR/merged: the adapters folded into their base's weights (PEFT's merge_and_unload), saved with the
    adapter folder's tokenizer and chat template: a plain folder that from_pretrained loads without PEFT."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    quiet_transformers()
    options = {"trust_remote_code": cfg.trust_remote_code}
    merged = AutoPeftModelForCausalLM.from_pretrained(adapter, dtype="auto", **options).merge_and_unload()
    with atomic_directory(cfg.output_dir / "merged") as tmp:
        merged.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(adapter, **options).save_pretrained(tmp)
    return cfg.output_dir / "merged"


def chat_with(cfg: RunConfig, interactive: bool) -> None:
    """--chat PATH: a trained output answers --prompt, or, interactive, each line typed (an empty one ends),
    its reply streamed as it is generated."""
    answer, turns = replier(cfg, chat_target(cfg.chat)), []
    for line in iter(lambda: input("you> ").strip(), "") if interactive else [cfg.prompt]:
        if not interactive:
            say(f"you> {line}")
        print("model> ", end="", flush=True)
        turns.append(("user", line))
        turns.append(("assistant", answer(tuple(turns))))


def chat_target(path: Path) -> Path:
    """What --chat PATH loads: the path itself, or in a run's output folder what the run wrote (merged first)."""
    if path.is_file() or (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
        return path
    if found := [path / name for name in ("merged", QWEN_FULL_FINAL, QWEN_FINAL, TINY_FINAL) if (path / name).exists()]:
        say(f"[chat] {path} is a run's output folder: talking to {found[0]}")
        return found[0]
    raise UsageError(f"--chat {path}: no trained model in this folder; name a {TINY_FINAL}, or a folder of adapters, a "
                     "merged or a fully fine-tuned model")  # fmt: skip


def replier(cfg: RunConfig, path: Path) -> Callable[[tuple[tuple[str, str], ...]], str]:
    """What answers a conversation for --chat, each reply streamed and ended with a line break: a tiny checkpoint
    continues the last line, byte by byte; a transformers folder (adapters, merged or fully fine-tuned) replies
    through its chat template, if it has one. --temperature's default is what the model kind's samples use."""
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not cfg.cpu else "cpu")
    if path.is_file():
        try:
            model = load_tiny_checkpoint(path, device).eval()
        except Exception:  # torch's words would suggest weights_only=False: never for a file of unknown origin
            raise UsageError(f"--chat {path}: not a {TINY_FINAL} this script wrote") from None
        temperature = 0.8 if cfg.temperature is None else cfg.temperature

        def continue_line(turns: tuple[tuple[str, str], ...]) -> str:
            reply = generate_bytes(model, turns[-1][1], cfg.sample_tokens, cfg.seed, temperature, cfg.top_p,
                                   functools.partial(print, end="", flush=True))  # fmt: skip
            print(flush=True)
            return reply

        return continue_line
    cfg = replace(cfg, temperature=cfg.temperature or 0.0)
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    quiet_transformers()
    kind = AutoPeftModelForCausalLM if (path / "adapter_config.json").is_file() else AutoModelForCausalLM
    model = kind.from_pretrained(path, dtype="auto", trust_remote_code=cfg.trust_remote_code).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)

    @torch.no_grad()
    def answer(turns: tuple[tuple[str, str], ...]) -> str:
        text = render_chat(turns, tokenizer, prompt=True) if tokenizer.chat_template else turns[-1][1]
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=not tokenizer.chat_template)], device=device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.sample_tokens,
                             streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                             **sampling(cfg))  # fmt: skip
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    return answer


def add_lora(cfg: RunConfig, model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model  # imported here: the tiny path never pays for it

    check_lora_targets(model, cfg.lora_targets)
    torch.manual_seed(cfg.seed)  # LoRA A starts random (B at zero): the same on every rank
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=ALL_LINEAR if cfg.lora_targets == (ALL_LINEAR,) else list(cfg.lora_targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    # Trainability is settled before DDP wraps the model: DDP registers its gradient hooks on
    # the parameters that require grad when it is built, and only those ever travel.
    model = get_peft_model(model, lora)
    # adapter_config.json names the base as it was loaded: a folder as typed (relative), or the hub cache's
    # snapshot. A folder's full path and a hub name load the adapter from any working directory.
    local = local_model_folder(cfg.model_name_or_path)
    model.peft_config["default"].base_model_name_or_path = str(local.resolve()) if local else cfg.model_name_or_path
    # A drawn again, layer by layer from the seed, as PEFT draws it: PEFT's own draws sit between
    # the creation of layers whose sizes --tp changes, so its A would differ from one process's.
    torch.manual_seed(cfg.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name:
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))
    return model


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model itself, beneath PEFT's wrapper when there is one."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_body(model: nn.Module) -> nn.Module:  # Qwen2Model inside Qwen2ForCausalLM: no output head
    lm = causal_lm(model)
    return getattr(lm, lm.base_model_prefix)


# What --checkpoint-policy selective keeps of a checkpointed block for backward: the outputs of its matmuls and of
# attention, the costly to recompute (torchtitan's choice); its norms, activations and adds are recomputed.
KEPT_IN_CHECKPOINTS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                       "_scaled_dot_product_flash_attention_for_cpu")  # fmt: skip


def keep_matmuls() -> tuple:
    """Selective activation checkpointing's two contexts (torch's create_selective_checkpoint_contexts)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts([getattr(torch.ops.aten, op).default for op in KEPT_IN_CHECKPOINTS])


def gpu_computes_bf16() -> bool:
    # Not torch's default answer, which counts GPUs that only emulate bf16 (pre-Ampere, such
    # as a T4 or V100): there bf16 runs slower than fp32 and auto must not pick it.
    return torch.cuda.is_bf16_supported(including_emulation=False)


class LeanHeadLoss(nn.Module):
    """A causal LM whose forward returns the loss sum without full logits (151,936 of them a token dwarf a LoRA
    step): the head runs only at target positions, chunk by chunk, fused (FusedHeadLoss: each chunk's gradients
    found in forward) or chunked (each chunk checkpointed, recomputed in backward). DDP wraps this module. No mask:
    padding sits right; packed rows get a block-diagonal one from position_ids, or varlen_attention their bounds."""

    CHUNK = 1024  # target tokens per checkpointed chunk (--head-loss chunked): 1024 x 151,936 fp32 logits = 622 MB

    def __init__(self, lm: nn.Module, fused: bool = False, compiled: bool = False, longest: int = 2**31) -> None:
        super().__init__()
        self.lm, self.fused, self.longest = lm, fused, longest  # lm: the PEFT model (its body and head looked up)
        # --compile: one kernel makes a chunk's softmax gradient (fused); rows vary by chunk, the shapes are dynamic
        self.softmax_grad = torch.compile(softmax_grad, dynamic=True) if compiled else softmax_grad

    def forward(self, ids: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, bounds: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """rows, positions, bounds: as lean_batch finds them. Without rows (not from the loader) they are found
        here: on a GPU a nonzero, which makes the host wait for it."""
        if rows is None:
            rows = (targets.flatten() != IGNORE_INDEX).nonzero().squeeze(1)
        body, head = decoder_body(self.lm), causal_lm(self.lm).get_output_embeddings()
        examples = {} if bounds is None else {"cu_seq_lens_q": bounds, "max_length_q": min(ids.shape[1], self.longest)}
        hidden = body(input_ids=ids, position_ids=positions, use_cache=False, **examples).last_hidden_state
        hidden, targets = hidden.flatten(0, 1).index_select(0, rows), targets.flatten().index_select(0, rows)
        if self.fused:
            chunk = FusedHeadLoss.TRAINED_ROWS if head.weight.requires_grad else FusedHeadLoss.FROZEN_ROWS
            return FusedHeadLoss.apply(hidden, head.weight, targets, chunk, torch.is_grad_enabled(), self.softmax_grad)
        total = hidden.new_zeros((), dtype=torch.float32)
        for h, y in zip(hidden.split(self.CHUNK), targets.split(self.CHUNK), strict=True):
            total = total + checkpoint(head_loss_sum, head, h, y, use_reentrant=False)
        return total


def softmax_grad(z: torch.Tensor, y: torch.Tensor, with_grads: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk's logits z and targets y: the log-likelihood sum (log_softmax, as F.cross_entropy rounds it), and
    where asked g = softmax(z) - onehot(y), the negated sum's gradient in z, made in the log-probabilities' memory."""
    logp = torch.log_softmax(z, dim=-1)
    likelihood = logp.gather(1, y[:, None]).sum()
    if not with_grads:
        return likelihood, None
    g = logp.exp_()
    g[torch.arange(len(y), device=y.device), y] -= 1
    return likelihood, g


class FusedHeadLoss(torch.autograd.Function):
    """The head's cross-entropy summed over target rows, its gradients found in forward (--head-loss fused), chunk
    by chunk: no logits kept for backward, none recomputed. For rows h with targets y, z = h W^T: the loss is
    -log_softmax(z)_y; with g = softmax(z) - onehot(y), dh = g W, and dW += g^T h (fp32) where the head trains.
    Backward scales them by the loss's own gradient (the global-token scale); a tied embedding's weight gets dW
    added by autograd, as any second use of a tensor."""

    # Rows a chunk, whose fp32 logits and log-softmax are all it holds at a time (256 x 151,936 x 4 B = 156 MB each).
    # A trained head's chunk also reads and writes all of dW: 1,024 rows make a quarter of 256's passes over it
    # and still peak below the chunked head (benchmarks/lm_head_memory.py: 0.68x for full fine-tuning, CPU).
    FROZEN_ROWS, TRAINED_ROWS = 256, 1024

    @staticmethod
    def forward(ctx: object, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int,
                with_grads: bool, chunk_grad: Callable = softmax_grad) -> torch.Tensor:  # fmt: skip
        exact = torch.promote_types(weight.dtype, torch.float32)  # fp32 sums (fp64 for gradcheck)
        grad_hidden = torch.empty_like(hidden) if with_grads else None
        trains = with_grads and weight.requires_grad
        grad_weight = torch.zeros(weight.shape, dtype=exact, device=weight.device) if trains else None
        total = torch.zeros((), dtype=exact, device=hidden.device)
        for at in range(0, len(hidden), rows):
            h, y = hidden[at : at + rows], targets[at : at + rows]
            likelihood, g = chunk_grad((h @ weight.T).to(exact), y, with_grads)
            total -= likelihood
            if with_grads:
                grad_hidden[at : at + rows] = g.to(weight.dtype) @ weight
                if grad_weight is not None:
                    grad_weight.addmm_(g.T, h.to(exact))
            del g  # before the next chunk's logits are made: one chunk's alive at a time
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: object, grad_total: torch.Tensor) -> tuple:
        grad_hidden, grad_weight = ctx.saved_tensors
        dw = None if grad_weight is None else (grad_weight * grad_total).to(ctx.weight_dtype)
        return grad_hidden * grad_total.to(grad_hidden.dtype), dw, None, None, None, None


def loss_path(model: nn.Module, head_loss: str, tp: int, compiled: bool, longest: int) -> tuple[dict, str]:
    """--head-loss: fused or chunked, the lean head (LeanHeadLoss), where logits are the head's plain output; the
    model's own forward (full) where asked, or where a model rescales its logits (Gemma's soft-capping, Cohere's
    logit scale). Under --tp the head's weight is a DTensor slice: chunked. The kit's loss; the choice and why, for
    the header."""
    head = causal_lm(model).get_output_embeddings()
    if rescales_logits(model):
        head_loss, why = "full", " (the model rescales its logits)" if head_loss != "full" else ""
    elif head_loss == "fused" and (tp > 1 or type(head) is not nn.Linear or head.bias is not None):
        head_loss, why = "chunked", " (the head is not a plain Linear here)" if tp == 1 else " (--tp slices the head)"
    else:
        why = ""
    note = f"; head loss {head_loss}{why}"
    if head_loss == "full":
        return {"loss": lambda m, ids, targets, positions=None: token_loss_sum(
            m(input_ids=ids, position_ids=positions, use_cache=False).logits, targets)}, note  # fmt: skip
    return {
        "loss_module": LeanHeadLoss(model, fused=head_loss == "fused", compiled=compiled, longest=longest),
        "loss": lambda m, ids, targets, *rest: m(ids, targets, *rest),
    }, note


def rescales_logits(model: nn.Module) -> bool:
    """Whether the model's forward changes what its output layer gives (Gemma 2's soft-capping, Cohere's logit scale,
    Granite's logits scaling): a head run alone would not give its logits."""
    config = causal_lm(model).config
    scales = (getattr(config, k, None) for k in ("logit_scale", "logits_scaling"))
    return bool(getattr(config, "final_logit_softcapping", None)) or any(x not in (None, 1.0) for x in scales)


def lean_batch(collate: Callable, bounds: bool, batch: list) -> tuple[torch.Tensor, ...]:
    """A micro-batch for the lean head, made on the CPU (where a read makes no wait for a GPU): inputs, targets, the
    target positions as rows of the flattened batch (the head's gather needs no nonzero), positions where packed,
    and for varlen the bounds of the one packed row's examples (cu_seqlens: each one's start, the row's length)."""
    ids, targets, *positions = collate(batch)
    rows = (targets.flatten() != IGNORE_INDEX).nonzero().squeeze(1)
    if not bounds:
        return ids, targets, rows, *positions
    starts = (positions[0][0] == 0).nonzero().squeeze(1)
    return ids, targets, rows, positions[0], torch.cat([starts, torch.tensor([ids.shape[1]])]).int()


def packed_attention(cfg: RunConfig, model: nn.Module, device: torch.device, lean: bool) -> tuple[str, str]:
    """--attn-implementation auto and varlen, once the head is known: varlen (varlen_attention) where packed rows reach
    the lean head, which carries their bounds, and no layer slides a window; auto takes it on a GPU computing bf16
    (the kernel's dtypes, Ampere on) unless --precision fp32. The attention, and a note for the header."""
    lm, wanted = causal_lm(model), cfg.attn_implementation
    fits = cfg.pack and lean and attention_kinds(model) == {"full_attention"}
    if wanted == "varlen" and not fits:
        raise UsageError("--attn-implementation varlen keeps packed rows' examples apart for the lean head: it needs "
                         "--pack, --head-loss fused or chunked, and no layer sliding a window; use sdpa")  # fmt: skip
    kernel = device.type == "cuda" and gpu_computes_bf16() and cfg.precision != "fp32"
    if wanted == "varlen" or (wanted == "auto" and fits and kernel):
        from transformers import AttentionInterface

        AttentionInterface.register("varlen", varlen_attention)  # and no mask function: transformers makes no mask
        lm.set_attn_implementation("varlen")
        return "varlen", "; attention varlen (packed rows, no mask)"
    return lm.config._attn_implementation, ""


def attention_kinds(model: nn.Module) -> set[str]:
    """What the model's layers attend to: full_attention, sliding_attention, ... (a config with a sliding_window but no
    layer_types, as Mistral's, slides in every layer)."""
    config = causal_lm(model).config
    slides = "sliding" if getattr(config, "sliding_window", None) else "full"
    return set(getattr(config, "layer_types", None) or [f"{slides}_attention"])


def varlen_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     cu_seq_lens_q: torch.Tensor | None = None, **kwargs: object) -> tuple:  # fmt: skip
    """Attention as transformers calls it, for lean_batch's one packed row: each example attends causally to itself
    alone, by the bounds the loader found (cu_seq_lens_q), with no block-diagonal mask to keep SDPA off its flash
    kernel, and none for transformers to build (from position_ids read back). Without bounds (sampling): sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    half = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else value.dtype  # (rotary: fp32 q)
    q, k, v = (t[0].transpose(0, 1).to(half) for t in (query, key, value))  # (tokens, heads, head size)
    if q.is_cuda and half != torch.float32:  # the kernel's bound on the longest example: known on the host, no read
        from torch.nn.attention.varlen import varlen_attn

        n = kwargs["max_length_q"]
        out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, n, n, scale=scaling, window_size=(-1, 0),
                          enable_gqa=True)  # fmt: skip
    else:  # the same where there is no such kernel (CPU, fp32): example by example, its bounds read
        edges = cu_seq_lens_q.tolist()
        out = torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                                        scale=scaling, enable_gqa=True).transpose(0, 1)
                         for a, b in itertools.pairwise(edges)])  # fmt: skip
    return out[None], None


def head_loss_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


# ----- Preference tuning (--objective dpo): DPO's loss in the same loop, layouts, cache and checkpoints -----


class PreferenceLoss(nn.Module):
    """DPO's sigmoid loss summed over a micro-batch's pairs (one row each, preference_batch; sequences 2i and 2i + 1:
    pair i's chosen and rejected sides): -log sigmoid(beta ((log pi(c) - log pi_ref(c)) - (log pi(r) - log pi_ref(r)))),
    each log-probability a side's sum over its completion's targets; the reference's come with the batch
    (reference_log_probabilities). DDP wraps it."""

    def __init__(self, lm: nn.Module, beta: float, tally: RewardTally) -> None:
        super().__init__()
        self.lm, self.beta, self.tally = lm, beta, tally

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        *pairs, reference = batch
        policy = self.sequence_log_probabilities(*pairs)
        rewards = (self.beta * (policy - reference.to(policy.dtype))).view(-1, 2)  # pairs x (chosen, rejected)
        self.tally.add(rewards.detach())
        return -F.logsigmoid(rewards[:, 0] - rewards[:, 1]).sum()

    def sequence_log_probabilities(self, *batch: torch.Tensor) -> torch.Tensor:
        """Each side's log-likelihood of its targets, the batch as preference_batch lays it out: the head run at the
        positions that predict them only, chunk by chunk, each checkpointed (no chunk's logits kept for backward)."""
        ids, positions, mask, rows, targets, sides = batch
        body, head = decoder_body(self.lm), causal_lm(self.lm).get_output_embeddings()
        out = body(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False).last_hidden_state
        chunks = zip(out.flatten(0, 1)[rows].split(LeanHeadLoss.CHUNK), targets.split(LeanHeadLoss.CHUNK), strict=True)
        token = torch.cat([checkpoint(target_log_likelihoods, head, h, y, use_reentrant=False) for h, y in chunks])
        return token.new_zeros(2 * len(ids)).index_add(0, sides, token)


def target_log_likelihoods(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden)
    return -F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets, reduction="none")


class RewardTally:
    """DPO's implicit rewards, beta (log pi - log pi_ref) of each side, summed on the device over a step's pairs (or an
    evaluation's) until a step that reports reads them: means over the global batch, under TRL's names."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None  # chosen rewards, rejected rewards, pairs whose chosen side wins
        self.counting = True  # off for the batches an evaluation runs only to join the others' gathers

    def clear(self) -> None:
        self.sums = None

    def add(self, rewards: torch.Tensor) -> None:
        if self.counting:
            sums = torch.cat([rewards.sum(0), (rewards[:, 0] > rewards[:, 1]).sum(0, keepdim=True)]).double()
            self.sums = sums if self.sums is None else self.sums + sums

    def take(self, d: Dist, pairs: float, prefix: str = "") -> dict[str, float]:
        """The means over `pairs`, every rank's sums added (a collective), and the tally cleared."""
        sums, self.sums = [0.0] * 3 if self.sums is None else self.sums.tolist(), None
        chosen, rejected, wins = (v / pairs for v in all_reduce_sum(d, sums))
        return {f"{prefix}rewards/chosen": chosen, f"{prefix}rewards/rejected": rejected,
                f"{prefix}rewards/accuracies": wins, f"{prefix}rewards/margins": chosen - rejected}  # fmt: skip


def preference_batch(batch: list) -> tuple[torch.Tensor, ...]:
    """A micro-batch of pairs, made on the CPU, a row each (pair_row): its ids and positions, a mask keeping each
    rejected side from its chosen reply, the rows of the flattened batch that predict each target, the targets, whose
    they are (sides 2i and 2i + 1), and the pairs' reference log-probabilities once found."""
    laid = [pair_row(*pair[:2]) for pair in batch]
    width = -(-max(len(row[0]) for row in laid) // 8) * 8  # a multiple of 8: SDPA would copy its mask to pad it
    ids, positions = (torch.zeros(len(batch), width, dtype=torch.long) for _ in range(2))  # (padding: position 0)
    mask, gathered = torch.ones(len(batch), 1, width, width, dtype=torch.bool).tril(), []
    for i, (row_ids, row_positions, (c, p), at, targets, side) in enumerate(laid):
        ids[i, : len(row_ids)], positions[i, : len(row_ids)] = row_ids, row_positions
        mask[i, 0, c:, p:c] = False  # the rejected side sees the prompt they share, not the chosen reply
        gathered.append((i * width + at, targets, 2 * i + side))
    rows, targets, sides = (torch.cat(parts) for parts in zip(*gathered, strict=True))
    reference = [torch.cat([pair[2] for pair in batch])] if len(batch[0]) > 2 else []
    return ids, positions, mask, rows, targets, sides, *reference


def pair_row(ids: torch.Tensor, targets: torch.Tensor) -> tuple:
    """A pair's two sides (TokenRows' rows) as one row: the chosen side up to its last target, then the rejected side
    after the opening the two share (their prompt: computed once), each token at its place in its own sequence; each
    target with the row position that predicts it, and its side (0: chosen, 1: rejected)."""
    c, r = (int((side != IGNORE_INDEX).nonzero().max()) + 1 for side in targets)  # (inputs after it predict nothing)
    p = int((ids[0, : min(c, r)] != ids[1, : min(c, r)]).cumsum(0).eq(0).sum())  # how long the shared opening is
    at = (torch.arange(c), torch.cat([torch.arange(p), torch.arange(c, c + r - p)]))  # side s's input j: row at[s][j]
    kept = [targets[s, : len(at[s])] != IGNORE_INDEX for s in (0, 1)]
    return (torch.cat([ids[0, :c], ids[1, p:r]]), torch.cat([torch.arange(c), torch.arange(p, r)]), (c, p),
            torch.cat([at[s][kept[s]] for s in (0, 1)]), torch.cat([targets[s, : len(at[s])][kept[s]] for s in (0, 1)]),
            torch.cat([torch.full((int(kept[s].sum()),), s) for s in (0, 1)]))  # fmt: skip


def pairs_in(batch: tuple) -> int:
    return len(batch[0])  # a row a pair


def preference_path(cfg: RunConfig, d: Dist, model: nn.Module, train: TokenRows, val: TokenRows | None,
                    folder: Path) -> tuple[dict, str]:  # fmt: skip
    """--objective dpo: the kit's loss, batches, count (pairs) and rewards, each pair's reference found first. The
    note for the header."""
    if rescales_logits(model):
        raise UsageError("--objective dpo runs the output layer alone at the completions' positions, and this model "
                         "rescales its logits (soft-capping or a logit scale): not supported yet")  # fmt: skip
    window, kinds = getattr(causal_lm(model).config, "sliding_window", None) or 0, attention_kinds(model)
    if kinds - {"full_attention", "sliding_attention"} or ("sliding_attention" in kinds and window <= cfg.seq_len):
        raise UsageError(f"--objective dpo masks each pair's row itself, and this model's layers attend otherwise than "
                         f"to all before them within --seq-len {cfg.seq_len} ({', '.join(sorted(kinds))}, window "
                         f"{window}): not supported yet")  # fmt: skip
    tally = RewardTally()
    loss = PreferenceLoss(model, cfg.dpo_beta, tally)
    for rows in filter(None, (train, val)):
        rows.reference = reference_log_probabilities(cfg, d, loss, rows, weights_key(folder) if cfg.cache_dir else "")
    head = {"loss_module": loss, "loss": lambda m, *batch: m(*batch), "collate": preference_batch, "count": pairs_in,
            "tally": tally}  # fmt: skip
    return head, f"; DPO, beta {cfg.dpo_beta:g}, against the starting weights (found once, before training)"


def weights_key(folder: Path) -> str:
    """What the starting weights are, cheaply: each weight file's name, size and time (a hub snapshot's files link to
    blobs named by their content's hash), not a read of gigabytes by every rank at every launch."""
    files = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_FILES or p.name == "config.json")
    return sha256("".join(f"{p.name}:{p.resolve().name}:{p.stat().st_size}:{p.stat().st_mtime_ns}\n"
                          for p in files).encode())  # fmt: skip


@torch.no_grad()
def reference_log_probabilities(cfg: RunConfig, d: Dist, loss: PreferenceLoss, rows: TokenRows,
                                weights: str) -> np.ndarray:  # fmt: skip
    """DPO's reference: every pair's two log-probabilities under the starting weights (under LoRA, whose adapters
    start at zero, the base model's), found once before training by the ranks together (rank r takes pairs r, r + W,
    ...) and kept beside the token cache, keyed by the data, the weights and how they compute: neither a frozen copy
    of the model nor a second forward a step."""
    started, precision = time.perf_counter(), choose_precision(cfg, d)
    how = f"{rows.digest()}:{weights}:{loss.lm.dtype}:{precision}:{causal_lm(loss.lm).config._attn_implementation}"
    path = cfg.cache_dir / f"reference-{sha256(how.encode())[:24]}.npy" if cfg.cache_dir else None
    if path and all_reduce_sum(d, [float(path.exists())])[0] == d.world_size:  # every rank sees it: none computes
        log(d, f"[dpo] the reference log-probabilities of {len(rows):,} pairs: reused {path}")
        return np.load(path)
    found = torch.zeros(len(rows), 2, dtype=torch.float64, device=d.device)
    # Pairs of like lengths batched together (little padding; larger batches were slower on a CPU, measured).
    longest = torch.from_numpy(rows.lengths.reshape(-1, 2).sum(1))  # (a row is the two less their shared prompt)
    mine = torch.arange(d.rank, len(rows), d.world_size)
    loss.eval()  # as the first step's forward, but for dropout
    with autocast_for(precision, d.device):
        for pairs in mine[longest[mine].argsort(stable=True)].split(cfg.batch_size):
            batch = (t.to(d.device) for t in preference_batch([rows[i] for i in pairs.tolist()]))
            found[pairs.to(d.device)] = loss.sequence_log_probabilities(*batch).double().view(-1, 2)
    loss.train()
    if d.distributed:
        dist.all_reduce(found)  # each pair found by one rank, zeros elsewhere
    reference, buffer = found.cpu().numpy(), io.BytesIO()
    if path:  # rank 0 writes (a node-local --cache-dir elsewhere: every rank finds them again next time)
        np.save(buffer, reference)
        rank0_then_share(d, f"could not write {path}", lambda: atomic_write(path, buffer.getvalue()))
    log(d, f"[dpo] the reference log-probabilities of {len(rows):,} pairs: found by {d.world_size} rank(s) in "
           f"{time.perf_counter() - started:.1f} s" + (f", kept in {path}" if path else ""))  # fmt: skip
    return reference


def choose_weights_dtype(cfg: RunConfig, d: Dist) -> torch.dtype:
    on_gpu = d.device.type == "cuda"
    if cfg.dtype == "auto":
        # Qwen2, Llama and Gemma were trained in bf16; fp16 overflows in them: auto never picks it. Trained
        # weights stay fp32 (autocast computes in bf16): at a fine-tuning lr most AdamW updates
        # are smaller than half a bf16 step of the weight, and would round away.
        if cfg.finetune == "full":
            return torch.float32
        return torch.bfloat16 if on_gpu and gpu_computes_bf16() else torch.float32
    if cfg.dtype == "float16" and not on_gpu:
        raise UsageError("--dtype float16 needs a CUDA device; use float32 or bfloat16 on CPU")
    return getattr(torch, cfg.dtype)


def resolve_model_files(cfg: RunConfig, d: Dist) -> Path:
    """A local folder as it is; a hub name fetched into the hub's cache (its file locks let one process per
    machine download), then all ranks meet with no deadline, and a failed fetch's message reaches every rank."""
    try:
        path = fetch_model_files(cfg)
        problem = beyond_context(cfg, path)
    except UsageError as e:
        path, problem = None, str(e)
    if d.distributed:
        problem = meet_without_deadline(d, "model_files", problem)
    if problem:
        raise UsageError(problem)
    return path


def beyond_context(cfg: RunConfig, folder: Path) -> str:
    """A --seq-len past the positions the model has learnt (its config's max_position_embeddings), in words."""
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    if (n := config.get("max_position_embeddings")) and cfg.seq_len > n:
        return f"--seq-len {cfg.seq_len} is beyond {folder.name}'s context of {n} tokens: give at most {n}"
    return ""


@functools.cache  # the token cache's key and the model's loading both ask: one fetch
def fetch_model_files(cfg: RunConfig) -> Path:
    source = cfg.model_name_or_path
    if folder := local_model_folder(source):
        return folder
    from huggingface_hub import snapshot_download

    try:
        files = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
        if cfg.trust_remote_code:
            files.append("*.py")
        return Path(snapshot_download(source, allow_patterns=files))
    except (OSError, ValueError) as e:
        raise UsageError(
            f"cannot load model '{source}': it is not a local folder, and the Hugging Face Hub "
            f"could not provide it (offline, or a wrong name?): {first_line(e)}"
        ) from None


def local_model_folder(source: str) -> Path | None:
    """The folder --model-name-or-path names, or None for a hub name; one that looks like a path must be there."""
    if Path(source).expanduser().is_dir():
        return Path(source).expanduser()
    if source.startswith((".", "/", "~")) or "\\" in source or source.count("/") > 1:
        raise UsageError(f"cannot load model: no folder {source} (hub names look like Qwen/Qwen2.5-0.5B-Instruct)")
    return None


def load_tokenizer(cfg: RunConfig, folder: Path) -> PreTrainedTokenizerBase:
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, ImportError) as e:
        raise UsageError(f"cannot load model from {folder}: {first_line(e)}") from None
    if not tokenizer("a", add_special_tokens=False)["input_ids"]:
        raise UsageError(f"cannot load model from {folder}: its tokenizer encodes text to nothing (files missing?)")
    return tokenizer


def quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one bar per rank is noise, not news
    # peft and FSDP read a property transformers 5 renamed: a warning no user of this script can act on.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def loaded_attention(cfg: RunConfig) -> str:
    """What transformers loads the model with: auto and varlen load as sdpa (packed_attention may switch it)."""
    return "sdpa" if cfg.attn_implementation in ("auto", "varlen") else cfg.attn_implementation


def load_pretrained(cfg: RunConfig, d: Dist, dtype: torch.dtype) -> tuple[PreTrainedTokenizerBase, nn.Module]:
    """Tokenizer and model from a local folder (see resolve_model_files), onto this rank's device."""
    import transformers

    quiet_transformers()
    # flash_attention_2 runs on CUDA only, from the flash-attn package: said before loading, not after.
    if cfg.attn_implementation == "flash_attention_2" and d.device.type != "cuda":
        raise UsageError(
            "--attn-implementation flash_attention_2 needs a CUDA GPU; use auto (the default), sdpa or eager"
        )
    if cfg.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise UsageError(
            "--attn-implementation flash_attention_2 needs the flash-attn package (pip install flash-attn)"
        )
    folder = resolve_model_files(cfg, d)
    tokenizer = load_tokenizer(cfg, folder)
    # --tp: transformers cuts the weights by the model's own tensor-parallel plan as it loads them,
    # over a mesh of its own making that spans every rank.
    if d.tp > 1 and d.tp != d.world_size:
        raise UsageError(
            f"--tp {d.tp} on {d.world_size} ranks with --model hf: transformers' plan splits the model over every "
            f"rank; give --tp {d.world_size} (data parallelism beside it: the tiny model)"
        )
    split = {"distributed_config": transformers.DistributedConfig(tp_plan="auto", tp_size=d.tp)} if d.tp > 1 else {}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=dtype,
            attn_implementation=loaded_attention(cfg),
            trust_remote_code=cfg.trust_remote_code,
            **split,
        )
    except (OSError, ValueError, ImportError) as e:
        raise UsageError(unsupported_attention(cfg, e) or f"cannot load model from {folder}: {first_line(e)}") from None
    if split and not getattr(model.config, "base_model_tp_plan", None):
        raise UsageError(f"--tp {d.tp}: transformers has no tensor-parallel plan for {model.config.model_type} models")
    return tokenizer, model


class PlannedTensorParallel(TensorParallel):
    """A pretrained model under transformers' own tensor-parallel plan (from_pretrained(tp_plan="auto")): each
    sliced weight a DTensor cut along one dimension, gathered, cut and clipped as the tiny model's."""

    def __init__(self, model: nn.Module, d: Dist) -> None:
        self.group, self.n, self.rank, self.model = d.group("tp"), d.tp, d.tp_rank, model
        self.loss_share = float(d.tp_rank == 0)  # the head gathers its output: every slice computed the loss
        self.cuts = {name: (t.placements[0].dim, 1) for name, t in model.state_dict(keep_vars=True).items()
                     if hasattr(t, "placements") and t.placements[0].is_shard()}  # fmt: skip


@contextlib.contextmanager
def saved_as_one_process(model: nn.Module) -> Iterator[None]:
    """Rank 0 alone writes the gathered whole state: the model forgets its distributed config meanwhile, or
    save_pretrained would gather the slices itself and wait at a barrier for every rank."""
    config = causal_lm(model).config
    kept, config.distributed_config = getattr(config, "distributed_config", None), None
    try:
        yield
    finally:
        config.distributed_config = kept


def check_lora_under_tp(model: nn.Module, targets: tuple[str, ...]) -> None:
    """PEFT adds a LoRA branch's full output to a column-parallel layer's (probed: exact), but not
    to a row-parallel one's partial sums, where it fails on the shapes: refused before that."""
    plan = causal_lm(model).config.base_model_tp_plan
    rows = sorted({key.rsplit(".", 1)[-1] for key, style in plan.items() if style.startswith("rowwise")})
    if hit := [t for t in targets if t in rows or t == ALL_LINEAR]:
        raise UsageError(
            f"--lora-targets {','.join(hit)} under --tp: PEFT cannot add LoRA to the row-parallel layers "
            f"({', '.join(rows)}); target the column-parallel ones, such as q_proj,v_proj"
        )


def unsupported_attention(cfg: RunConfig, error: BaseException) -> str | None:
    """transformers refuses an attention kernel a model lacks (Gemma2 and sdpa) with advice in
    its own words (attn_implementation="eager"): say it in this script's."""
    advised = re.search(r'attn_implementation="(\w+)"', str(error))
    if "does not support" not in str(error) or advised is None:
        return None
    return (
        f"{first_line(error).split(' does not support')[0]} does not support --attn-implementation "
        f"{loaded_attention(cfg)}: run with --attn-implementation {advised.group(1)}"
    )


def attention_width(config: object) -> int:
    """Query heads x head size: the width of attention's score and mixing matmuls."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads * head_dim


def check_lora_targets(model: nn.Module, targets: tuple[str, ...]) -> None:
    """Every name in --lora-targets names linear layers of this model; else one line listing them (the head
    marked) and the fused projections of models that have them."""
    if targets == (ALL_LINEAR,):
        return
    head = causal_lm(model).get_output_embeddings()
    linear = {name.rsplit(".", 1)[-1]: m is head for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = [t for t in targets if t not in linear]
    if missing:
        listed = ", ".join(f"{name} (the output head)" if is_head else name for name, is_head in sorted(linear.items()))
        fused = [name for name in ("qkv_proj", "gate_up_proj") if name in linear]
        hint = f"; this model fuses projections ({', '.join(fused)}): try --lora-targets {fused[0]}" if fused else ""
        raise UsageError(
            f"--lora-targets {','.join(missing)} not found in the model; its linear layers are: {listed}{hint}, "
            f"or {ALL_LINEAR} for every one but the output head"
        )


# ----------------------------------------------------------------------------------------------
# 13. Reports and checks: how gradients travel, the whole state from shards, --inspect, --verify-sync
# ----------------------------------------------------------------------------------------------


def optimizer_share(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """Under ZeRO-1 (ShardedOptimizer, or torch's ZeroRedundancyOptimizer, which a script of one's own may hand
    in) the inner optimizer, holding the state of this rank's own parameters only; None for one of the whole."""
    return getattr(optimizer, "optim", None)


def describe_optimizer_share(named_params: list, optimizer: torch.optim.Optimizer) -> list[str]:
    mine = {p for group in optimizer_share(optimizer).param_groups for p in group["params"]}
    owned = [(n, p) for n, p in named_params if p in mine]
    names = ", ".join(n for n, _ in owned[:4]) + (f", ... ({len(owned)} tensors)" if len(owned) > 4 else "")
    total = sum(p.numel() for _, p in named_params)
    return [f"optimizer state of {sum(p.numel() for _, p in owned):,} of {total:,} weights: {names}"]


# What --inspect, --verify-sync and the memory table ask of each layout, answered here, below the banner, for every
# layout: DDP's answer first, then each other layout's (functools.singledispatch picks by the layout's class).
@functools.singledispatch
def ownership(model: Layout, named_params: list, optimizer: torch.optim.Optimizer) -> list[str]:
    """What this rank alone keeps (--inspect): under ZeRO-1, whose optimizer state; under DDP nothing."""
    return describe_optimizer_share(named_params, optimizer) if optimizer_share(optimizer) else []


@ownership.register
def _(model: SplitLayout, named_params: list, optimizer: torch.optim.Optimizer) -> list[str]:
    return describe_optimizer_share(named_params, optimizer) if optimizer_share(optimizer) else split_ownership(
        model.split, named_params)  # fmt: skip


@functools.singledispatch
def split_ownership(split: ModelSplit, named_params: list) -> list[str]:
    """What of a split model this rank holds, tensor by tensor (--inspect): under ModelSplit nothing of its own."""
    return []


@split_ownership.register
def _(split: TensorParallel, named_params: list) -> list[str]:
    lines = []
    for name, _ in named_params:
        if split.sliced(name) and len(lines) < 4:
            dim, parts = split.cuts[name]
            what = ("rows" if dim == 0 else "columns") + (" of each of q, k and v" if parts == 3 else "")
            lines.append(f"{name}: slice {split.rank} of {split.n} of its {what}")
    return [*lines, "... and the embeddings, norms and head whole, as every rank of the group holds them"]


@split_ownership.register
def _(split: StageSplit, named_params: list) -> list[str]:
    return [f"{split_holdings(split)} ({sum(p.numel() for _, p in named_params):,} weights)"]


@split_ownership.register
def _(split: TensorParallelStage, named_params: list) -> list[str]:
    return [*split_ownership(split.stage, named_params), *split_ownership.dispatch(TensorParallel)(split, named_params)]


@split_ownership.register
def _(split: ContextParallel, named_params: list) -> list[str]:
    (i, j), c = split.chunks(split.rank), split.seq_len // (2 * split.n)
    held = f"positions {i * c}-{(i + 1) * c - 1} and {j * c}-{(j + 1) * c - 1} of every example (chunks {i} and {j} of"
    return [f"{held} {2 * split.n})", *(split_ownership(split.inner, named_params) or ["every weight whole"])]


@ownership.register
def _(model: ManualFSDP, named_params: list, optimizer: torch.optim.Optimizer) -> list[str]:
    held = [(n, model.rank * p.numel() if p in model.shard else 0, p.numel(), math.prod(model.shape.get(p, p.shape)))
            for n, p in named_params[:4]]  # fmt: skip
    rest = f"... and so on for all {len(named_params)} trained tensors: weights, gradients, optimizer state"
    return [f"{n}: elements [{a:,}, {min(a + k, w):,}) of {w:,}, flattened" for n, a, k, w in held] + [rest]


@ownership.register
def _(model: SplitTorchFSDP, named_params: list, optimizer: torch.optim.Optimizer) -> list[str]:
    return [*split_ownership(model.split, named_params), "... each held in rows along the replicas (fully_shard)"]


@ownership.register
def _(model: TorchFSDP, named_params: list, optimizer: torch.optim.Optimizer) -> list[str]:
    lines = []
    for n, p in named_params[:4]:  # fully_shard cuts dim 0 into N row blocks, as torch.chunk does
        rows = math.ceil(p.shape[0] / p.device_mesh.size())
        start = p.device_mesh.get_local_rank() * rows
        lines.append(f"{n}: rows [{start:,}, {min(start + rows, p.shape[0]):,}) of {p.shape[0]:,}")
    return [*lines, f"... and so on for all {len(named_params)} trained tensors: weights, gradients, optimizer state"]


@functools.singledispatch
def held_alike(model: Layout, name: str, p: nn.Parameter) -> bool:
    """Whether every rank holds parameter `name` (p) bit for bit (--verify-sync compares those): under DDP, each."""
    return True


held_alike.register(ManualFSDP, lambda model, name, p: p not in model.shard)  # outside every unit: whole
held_alike.register(TorchFSDP, lambda model, name, p: False)  # each rank holds its rows of every parameter
held_alike.register(SplitTorchFSDP, lambda model, name, p: False)
held_alike.register(SplitLayout, lambda model, name, p: not model.split.sliced(name))
held_alike.register(Pipeline, lambda model, name, p: False)  # each stage holds its own blocks


@functools.singledispatch
def gradient_buffers(model: Layout) -> list[torch.Tensor]:
    """Gradient memory beyond the parameters' .grad (the memory table): none under torch's DDP (.grad is a view)."""
    return []


gradient_buffers.register(ManualDDP, lambda model: [bucket.flat for bucket in model.buckets])  # a second copy


@functools.singledispatch
def holdings(model: Layout) -> str:
    """What of one replica's model this rank holds, in words (the memory table)."""
    return "the whole model"


holdings.register(SplitLayout, lambda model: split_holdings(model.split))


@functools.singledispatch
def split_holdings(split: ModelSplit) -> str:
    return "the whole model"


split_holdings.register(ContextParallel, lambda split: split_holdings(split.inner))
split_holdings.register(TensorParallel, lambda split: f"slice {split.rank} of {split.n} of each block's q, k, v and "
                        "MLP rows and projection columns; embeddings, norms, head whole")  # fmt: skip
split_holdings.register(TensorParallelStage, lambda split: f"{split_holdings(split.stage)}; of its blocks, "
                        f"{split_holdings.dispatch(TensorParallel)(split)}")  # fmt: skip
split_holdings.register(PlannedTensorParallel, lambda split: f"slice {split.rank} of {split.n} of each layer's "
                        "projections, as the model's tensor-parallel plan cuts them")  # fmt: skip


@split_holdings.register
def _(split: StageSplit) -> str:
    parts = ["the embeddings"] * split.first + [f"blocks {split.owned.start}-{split.owned.stop - 1}"]
    return f"stage {split.stage}: " + ", ".join(parts + ["the final norm and head"] * split.last)


class Traffic(CommStats):
    """Counts every collective the wrappers start, by kind and per optimizer step (accumulation's k-1 silent
    micro-steps send nothing), for the summary and the metrics; for --inspect keeps the local gradients and the
    bucket layout; for --trace-steps makes each collective a span of the timeline."""

    def __init__(self, model: nn.Module, compress: bool) -> None:
        super().__init__(compress)
        self.model = model
        self.moved: dict[str, list[int]] = {}  # kind -> [calls, bytes], this rank's, over the attempt's steps
        self.counting = False  # in a training step's collectives (not evaluation's): set by the side work
        self.steps = 0
        self.calls = 0
        self.bytes = 0
        self.step_layout: dict[int, tuple[int, list[str]]] = {}
        self.layout: list[tuple[int, list[str]]] = []  # per bucket: (bytes, parameter names)
        self.local_grads: dict[str, torch.Tensor] | None = None  # set to {} to capture one step
        self.timeline: Any = None  # --trace-steps: a Timeline, on which each collective becomes a span

    @functools.cached_property
    def name_of(self) -> dict[int, str]:  # at the first bucket: after tensor parallelism made its parameters
        return {id(p): name for name, p in self.model.named_parameters()}

    def count(self, kind: str, nbytes: int) -> None:
        if not self.counting:
            return
        moved = self.moved.setdefault(kind, [0, 0])
        moved[0], moved[1] = moved[0] + 1, moved[1] + nbytes

    def record(self, index: int, nbytes: int, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.calls += 1
        self.bytes += nbytes
        self.count("all-reduce of gradient buckets", nbytes)
        self.step_layout[index] = (nbytes, [self.name_of[id(p)] for p in params])
        if self.local_grads is not None:  # the gradient this rank computed, before averaging
            for p, g in zip(params, grads, strict=True):
                self.local_grads[self.name_of[id(p)]] = g.detach().clone()

    def traced(self, future: torch.futures.Future, name: str, args: dict) -> torch.futures.Future:
        """The collective's future, a span of the timeline's (--trace-steps) from now until it arrives."""
        if self.timeline is None or not self.timeline.on:
            return future
        return self.timeline.collective(name, future, args)

    def mark(self) -> object:
        """Now on the timeline's clock while it traces, else None: where a span of sends or receives starts."""
        return self.timeline.now() if self.timeline is not None and self.timeline.on else None

    def span(self, name: str, start: object, args: dict) -> None:
        """A span from `start` (mark) to now: for point-to-point work, which has no future to wait on."""
        if start is not None and self.timeline.on:
            self.timeline.pending.append((name, start, self.timeline.now(), args))

    def per_step(self) -> dict[str, tuple[float, float]]:
        """Each kind of collective this rank started: (calls, bytes) per optimizer step."""
        return {kind: (calls / self.steps, nbytes / self.steps) for kind, (calls, nbytes) in self.moved.items()}

    def end_step(self) -> tuple[int, int]:
        """Close the optimizer step: return (all-reduce calls, bytes) and note the bucket layout."""
        calls, nbytes = self.calls, self.bytes
        self.calls, self.bytes, self.steps = 0, 0, self.steps + 1
        if self.step_layout:
            self.layout, self.step_layout = [self.step_layout[i] for i in sorted(self.step_layout)], {}
        return calls, nbytes


def describe_gradient_sync(cfg: RunConfig, d: Dist) -> str:
    if d.world_size == 1:  # one plain process, or a process group of one (torchrun with one rank)
        return "none (one process: its gradient is already the whole batch's)"
    if d.replicas == 1:
        return "none (one replica, split over every rank: no other replica to average with)"
    if cfg.sharding == "full":
        how = "torch's fully_shard (FSDP2)" if cfg.ddp == "torch" else "manual FSDP (from scratch)"
        return f"{how}: weights all-gathered per unit, gradients reduce-scattered to their shards"
    wrapper = "torch DDP" if cfg.ddp == "torch" else "manual DDP (from scratch)"
    sync = f"{wrapper}, {cfg.bucket_mb:g} MiB buckets" + (", sent as bf16" if cfg.grad_compression == "bf16" else "")
    if cfg.sharding == "optimizer":
        how = "torch's ZeroRedundancyOptimizer" if cfg.ddp == "torch" else "ShardedOptimizer (from scratch)"
        sync += f"; optimizer state sharded by {how}"
    return sync


def layout_refusal(cfg: RunConfig) -> str | None:
    """Why the sharding or model split asked for cannot run (cannot_shard_fully, cannot_split), if it cannot."""
    split = cfg.tp * cfg.pp * cfg.cp > 1
    return (cfg.sharding == "full" and cannot_shard_fully(cfg)) or (split and cannot_split(cfg)) or None


def cannot_shard_fully(cfg: RunConfig) -> str | None:
    """Flags --sharding full cannot honour (yet), each named, before any rank trains."""
    if cfg.gradient_checkpointing and cfg.ddp == "manual":
        return ("--gradient-checkpointing with --sharding full --ddp manual: the from-scratch FSDP does not "
                "re-gather a unit that checkpointing re-runs inside backward; use --ddp torch")  # fmt: skip
    if cfg.precision == "fp16":
        return ("--precision fp16 with --sharding full: an overflow would show in one rank's shard only, and the "
                "ranks would skip different steps; use --precision bf16 or fp32")  # fmt: skip
    if cfg.inject_fault and cfg.inject_fault.endswith(":desync"):
        return ("--inject-fault desync with --sharding full: there are no replicas to drift apart (each rank updates "
                "its own shard only), so no check could tell a wrong shard from a right one")  # fmt: skip
    if cfg.grad_compression != "none":
        return "--grad-compression compresses DDP's all-reduce; --sharding full reduce-scatters instead: drop it"
    if cfg.trace_steps and cfg.ddp == "torch":
        return ("--trace-steps with --sharding full --ddp torch: fully_shard's all-gathers and reduce-scatters "
                "run out of the timeline's sight; --ddp manual traces its own")  # fmt: skip
    return None


def cannot_split(cfg: RunConfig) -> str | None:
    """What --tp, --pp and --cp cannot do (yet), each named, before any rank trains."""
    if cfg.cp > 1 and cfg.pp > 1:
        return "--cp with --pp: the two do not compose yet; use --cp with --tp and data parallelism"
    if cfg.cp > 1 and cfg.model == "hf":
        return "--cp runs the tiny model; not yet with --model hf"
    if cfg.cp > 1 and cfg.seq_len % (2 * cfg.cp):
        return (f"--seq-len {cfg.seq_len} does not cut into 2 x --cp {cfg.cp} = {2 * cfg.cp} equal chunks (each cp "
                "rank holds two); give a multiple of it")  # fmt: skip
    if cfg.cp > 1 and cfg.tp == 1:
        return None
    if cfg.tp > 1 and cfg.pp > 1 and cfg.ddp == "torch":
        return "--tp with --pp --ddp torch: torch's pipeline takes no sliced stages here; --ddp manual composes them"
    if cfg.model == "hf" and cfg.pp > 1:
        return "--pp with --model hf: stages are cut from the tiny model's blocks only; use --tp or --sharding full"
    flag = f"--tp {cfg.tp}" if cfg.tp > 1 else f"--pp {cfg.pp}"
    if cfg.sharding == "optimizer" or (cfg.pp > 1 and cfg.sharding == "full"):
        return (
            f"{flag} with --sharding {cfg.sharding}: not built yet; --tp composes with --sharding full, both with none"
        )
    if cfg.tp > 1 and cfg.sharding == "full" and cfg.ddp == "manual":
        return "--tp with --sharding full --ddp manual: the from-scratch FSDP does not shard slices; use --ddp torch"
    if cfg.model == "tiny" and cfg.tp > 1 and (cfg.n_heads % cfg.tp or cfg.d_model % cfg.tp):
        return (
            f"--tp {cfg.tp} must divide --n-heads {cfg.n_heads} and --d-model {cfg.d_model}: a rank takes whole heads"
        )
    if cfg.model == "tiny" and cfg.pp > cfg.n_layers:
        return f"--pp {cfg.pp} is more stages than --n-layers {cfg.n_layers} blocks: each stage needs one at least"
    if cfg.precision == "fp16":
        return f"{flag} with --precision fp16: its loss scaler is not split with the model; use bf16 or fp32"
    if cfg.pp > 1 and cfg.inject_fault and cfg.inject_fault.endswith(":desync"):
        return "--inject-fault desync with --pp: no tensor is held by every rank, so no check could tell"
    if cfg.batch_size % cfg.pp:
        return (f"--pp {cfg.pp} cuts each micro-step's batch into {cfg.pp} micro-batches: --batch-size "
                f"{cfg.batch_size} does not divide; give a multiple of {cfg.pp}")  # fmt: skip
    if cfg.ddp == "torch" and (cfg.grad_compression != "none" or cfg.trace_steps):
        compressed = cfg.grad_compression != "none"
        what, own = ("--grad-compression", "compresses") if compressed else ("--trace-steps", "traces")
        return (f"{what} with {flag} --ddp torch: torch's split runs its collectives out of this script's "
                f"sight; --ddp manual {own} its own")  # fmt: skip
    return None


def rank0_state(model: Layout, d: Dist, named_params: list, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The trained weights and the optimizer's state, whole, on rank 0's CPU ({} elsewhere), numbered as one
    process's optimizer numbers them, from any layout: a collective (Layout.whole_tensor, then gather_to_rank0)."""
    keep = model.sends_to_rank0(d)
    weights = {n: kept(model.whole_tensor(n, p, p.detach()), keep) for n, p in named_params}
    state = whole_optimizer_state(d, optimizer, named_params, model.whole_tensor, keep)
    moments = {named_params[i][0]: s for i, s in state.get("state", {}).items()}  # by name: stages join by name
    stages = model.gather_to_rank0(d, (weights, moments))
    if not d.is_main:
        return {}, {}
    weights = {n: w for stage_weights, _ in stages for n, w in stage_weights.items()}
    index = {n: i for i, n in enumerate(weights)}  # the whole model's order, which is the stages' order
    moments = {index[n]: s for _, stage_moments in stages for n, s in stage_moments.items()}
    return weights, {"state": moments, "param_groups": [{**state["param_groups"][0], "params": list(index.values())}]}


def whole_optimizer_state(d: Dist, optimizer: torch.optim.Optimizer, named_params: list,
                          gather: Callable, keep: bool) -> dict:  # fmt: skip
    """The optimizer's state_dict() with every tensor whole, where this rank sends it to rank 0 ({} elsewhere).
    Under ZeRO-1 each rank holds the state of its own parameters: the optimizer collects them itself."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.state_dict(to=0, group=d.control)  # over Gloo: the state stays off the GPUs
    if optimizer_share(optimizer):  # torch's ZeroRedundancyOptimizer
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if d.is_main else {}
    state = optimizer.state_dict()
    moments = {i: {k: kept(gather(*named_params[i], v), keep) if torch.is_tensor(v) else v for k, v in s.items()}
               for i, s in state["state"].items()}  # fmt: skip
    return {**state, "state": moments} if keep else {}


def load_state(model: Layout, named_params: list, weights: dict, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Take a whole state, saved from any layout, into this run's: each rank keeps its part (Layout.tensor_part)."""
    index = {n: i for i, n in enumerate(weights)}  # the whole model's order; a pipeline stage holds some of it
    with torch.no_grad():
        for name, p in named_params:
            local_part(p).copy_(local_part(model.tensor_part(name, p, weights[name])))
    saved = state["state"]
    moments = {j: {k: model.tensor_part(n, p, v) if torch.is_tensor(v) else v for k, v in saved[index[n]].items()}
               for j, (n, p) in enumerate(named_params) if index[n] in saved}  # fmt: skip
    groups = [{**state["param_groups"][0], "params": list(range(len(named_params)))}]
    load_optimizer_state(optimizer, {"state": moments, "param_groups": groups})


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    inner = optimizer_share(optimizer) or optimizer
    # A saved group carries how the saving run stepped (fused or a per-tensor loop): this run keeps its own.
    kept = [[{k: g[k] for k in ("fused", "foreach") if k in g} for g in o.param_groups] for o in (optimizer, inner)]
    optimizer.load_state_dict(state)  # ShardedOptimizer and ZeroRedundancyOptimizer keep their own share
    for o, groups in zip((optimizer, inner), kept, strict=True):
        for group, own in zip(o.param_groups, groups, strict=True):
            group.update(own)
    # torch's ZeroRedundancyOptimizer moves every 0-d state tensor (Adam's step) to the CPU as it
    # loads (torch 2.13), and the fused and capturable kernels refuse a step that is not on its
    # parameter's device (pytorch#124133): put it where a step() would have kept it.
    if inner.defaults.get("fused") or inner.defaults.get("capturable"):
        for p, s in inner.state.items():
            if torch.is_tensor(s.get("step")):
                s["step"] = s["step"].to(p.device, torch.float32)


def all_gather_tensor(d: Dist, t: torch.Tensor) -> list[torch.Tensor]:
    if not d.distributed:
        return [t]
    t = t.detach().cpu()  # host numbers travel through Gloo (see all_reduce_sum)
    out = [torch.empty_like(t) for _ in range(d.world_size)]
    dist.all_gather(out, t, group=d.control)
    return out


def optimizer_state_tensors(named_params: list, optimizer: torch.optim.Optimizer) -> list:
    """(what, name, parameter, tensor) for each tensor of the optimizer's state (Adam's moments and step)."""
    return [(f"optimizer {k} of {n}", n, p, v) for n, p in named_params
            for k, v in optimizer.state.get(p, {}).items() if torch.is_tensor(v)]  # fmt: skip


def replicated(model: Layout, named_params: list, optimizer: torch.optim.Optimizer | None = None) -> list:
    """(name, tensor) every rank must hold bit for bit (--verify-sync): the averaged gradients, or, given the
    optimizer, the weights and its state, never a slice, a stage's own or a ZeRO-1 share. Under FSDP all are
    gathered whole (a collective): equal unless the gather is broken, as no rank holds another's shard."""
    alike = [(n, p) for n, p in named_params if held_alike(model, n, p)]
    if optimizer is None:
        return [(f"grad of {n}", p.grad) for n, p in alike if p.grad is not None]
    if model.gathers_in_forward:
        state = optimizer_state_tensors(named_params, optimizer)
        return [(n, model.whole_tensor(n, p, p.detach())) for n, p in named_params] + [
            (what, model.whole_tensor(n, p, t)) for what, n, p, t in state]  # fmt: skip
    state = [] if optimizer_share(optimizer) else optimizer_state_tensors(alike, optimizer)
    return [(n, p.detach()) for n, p in alike] + [(what, t) for what, _, _, t in state]


def verify_replicas_agree(d: Dist, step: int, when: str, named: list[tuple[str, torch.Tensor]]) -> None:
    """Every rank must hold bit-identical tensors: each one's fingerprint (fp64 sum and sum of squares) in one
    all-gather, compared as bit patterns (an fp16 overflow's NaN sums are never equal as numbers)."""
    if not named:  # every gradient is sharded: nothing is replicated to compare
        return
    fingerprint = torch.stack([torch.stack([t.double().sum(), t.double().square().sum()]) for _, t in named]).cpu()
    ranks = [fp.view(torch.int64) for fp in all_gather_tensor(d, fingerprint)]
    for i, (name, _) in enumerate(named):
        if differ := [r for r, fp in enumerate(ranks) if not torch.equal(fp[i], ranks[0][i])]:
            values = ", ".join(f"rank {r} sum {ranks[r][i].view(torch.float64)[0].item():.9g}" for r in [0, *differ])
            raise TrainingError(f"replicas diverged at step {step} ({when}): first differing tensor {name}; "
                                f"rank(s) {differ} differ from rank 0 ({values})")  # fmt: skip


INSPECT_STEPS = 3  # --inspect reports this many steps in detail


def print_in_rank_order(d: Dist, lines: list[str]) -> None:
    """Gather each rank's lines to rank 0 and print them rank by rank, never interleaved."""
    gathered: list[list[str]] = [lines]
    if d.distributed:
        gathered = [[] for _ in range(d.world_size)]
        dist.all_gather_object(gathered, lines)
    for rank, rank_lines in enumerate(gathered if d.is_main else []):
        for line in rank_lines:
            say(f"[inspect] rank {rank}: {line}")


def describe_shards(sampler: DistributedSampler) -> list[str]:
    lines = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        indices = list(sampler)
        lines.append(f"epoch {epoch} shard: {len(indices)} examples, first {indices[:8]}")
    return lines


def log_buckets(d: Dist, stats: CommStats, heading: str) -> None:
    log(d, heading)
    for i, (nbytes, names) in enumerate(stats.layout):
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} tensors)" if len(names) > 4 else "")
        log(d, f"[inspect]   bucket {i}: {nbytes / 2**20:.3f} MiB: {shown}")


def describe_local_gradient(stats: CommStats, named_params: list[tuple[str, nn.Parameter]]) -> str:
    """Compare the gradient this rank computed (before the all-reduce) with the average."""
    local_sq = avg_sq = dot = 0.0
    for name, p in named_params:
        if (local := stats.local_grads.get(name)) is not None and p.grad is not None:
            local_sq += local.double().square().sum().item()
            avg_sq += p.grad.double().square().sum().item()
            dot += (local.double() * p.grad.double()).sum().item()
    cosine = dot / math.sqrt(local_sq * avg_sq) if local_sq and avg_sq else float("nan")
    return (f"local grad norm {math.sqrt(local_sq):.4f} before sync, averaged {math.sqrt(avg_sq):.4f} after, "
            f"cosine(local, averaged) {cosine:.3f}")  # fmt: skip


def report_inspect_step(cfg: RunConfig, d: Dist, step: int, stats: CommStats, sent: tuple[int, int],
                        named_params: list, local_loss_sum: float, micro_tokens: list[int],
                        share: float) -> None:  # fmt: skip
    """The first steps through the eyes of each rank: its loss, its tokens, its gradient. (Under
    model splitting one rank of each replica counts its loss: share 1, the others 0.)"""
    local_tokens, unit = sum(micro_tokens), "pairs" if cfg.objective == "dpo" else "tokens"  # (what kit.count counts)
    # Both normalizations of this very step: the exact global mean, and the mean of per-rank means.
    loss_total, means_total, global_tokens = all_reduce_sum(d, [local_loss_sum, local_loss_sum / local_tokens,
                                                                local_tokens * share])  # fmt: skip
    bucketed = bool(stats.local_grads)  # DDP's buckets; under --sharding full there are none to show
    if step == 1 and bucketed:
        log_buckets(d, stats, "[inspect] gradient buckets at step 1 (a bucket is all-reduced as soon as all its "
                              "gradients are ready):")  # fmt: skip
    local = f"step {step}: local loss {local_loss_sum / local_tokens:.4f} over {local_tokens} {unit} " \
            f"({'+'.join(map(str, micro_tokens))} in {len(micro_tokens)} micro-step(s))"  # fmt: skip
    if not share:  # a tensor slice that is not its group's first, or a pipeline stage before the last
        local = f"step {step}: its replica's {local_tokens} tokens pass through here; another rank counts their loss"
    print_in_rank_order(d, [local, *([f"step {step}: {describe_local_gradient(stats, named_params)}"] * bucketed)])
    moved = f"all-reduced {sent[0]} bucket(s), {sent[1] / 2**20:.3f} MiB"
    if not sent[0] and d.tp * d.pp > 1:  # one replica: no gradient to average, only the split's own traffic
        moved = "all-reduced no gradient bucket, its split's own being in the summary's 'collectives'"
    log(d, f"[inspect] step {step}: global-token mean loss {loss_total / global_tokens:.4f} over "
           f"{int(global_tokens)} {unit}; mean of per-rank means {means_total / d.replicas:.4f}; this step "
           f"{moved} ({cfg.loss_normalization} normalization is training)")  # fmt: skip


# ----------------------------------------------------------------------------------------------
# 14. Timeline: every rank's first --trace-steps steps on one clock, as a trace file and a picture
# ----------------------------------------------------------------------------------------------


Span = tuple[str, float, float, dict]  # (name, start, end, args): seconds on one rank's clock


# What a timeline draws on its communication lanes: DDP's and tensor parallelism's all-reduces;
# FSDP's all-gathers of weights (before forward and again before backward) and reduce-scatters of
# gradients; a pipeline's sends and receives of activations and their gradients.
COMMUNICATION = ("all-reduce", "all-gather", "reduce-scatter", "send", "recv")
PHASE_COLOURS = {"data": "#b0b0b0", "forward": "#4c72b0", "backward": "#55a868", "sync": "#dd8452",
                 "optimizer": "#8172b3", "start-up": "#dcdcdc", "bubble": "#eeeeee", "drain": "#f4e1cf",
                 "all-reduce": "#c44e52", "all-gather": "#937860", "reduce-scatter": "#da8bc3", "send": "#64b5cd",
                 "recv": "#ccb974"}  # fmt: skip
IDLE = ("bubble", "drain")  # a pipeline stage waiting for a neighbour: filling, and draining at the step's end


class Timeline:
    """--trace-steps N: what every rank did, and when, in its first N optimizer steps of this attempt.

    The loop's phase marks become spans (data, forward, backward, sync, optimizer) inside a "step K"
    span; each collective is a span from hand-over to arrival, beside backward. It hooks the parameters
    before the wrapper does, so the last gradient is stamped before the last bucket leaves. The first
    traced step's opening sync is "start-up", a pipeline's last stage's closing one "drain". On a GPU a
    mark is a CUDA event, pinned to this rank's clock by a synchronize at each traced step's ends.
    """

    def __init__(self, last_step: int, device: torch.device, params: list[nn.Parameter] = (),
                 drains: bool = False) -> None:  # fmt: skip
        self.last_step, self.cuda, self.drains = last_step, device.type == "cuda", drains
        self.starting, self.last_phase = True, ""  # before the first traced step's forward; the phase just marked
        self.on, self.step = False, 0  # recording the current step, and which
        self.spans: list[Span] = []
        self.pending: list[tuple[str, object, object, dict]] = []  # this step's, marks unresolved
        self.step_start: object = 0.0
        self.phase_start: object = 0.0
        self.last_gradient: object | None = None
        self.anchor: tuple[float, torch.cuda.Event] | None = None
        for p in params:
            p.register_post_accumulate_grad_hook(self.gradient_ready)

    def now(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: the autograd stream, or the one a hook's future runs on
        return event

    def seconds(self, mark: object) -> float:
        if not self.cuda:
            return mark
        host, event = self.anchor
        return host + event.elapsed_time(mark) / 1000

    def begin_step(self, step: int) -> None:
        self.on, self.pending, self.step = step <= self.last_step, [], step
        if self.on and self.cuda:
            torch.cuda.synchronize()
            self.anchor = (time.perf_counter(), self.now())
        self.step_start = self.phase_start = self.now() if self.on else 0.0

    def gradient_ready(self, _: nn.Parameter) -> None:
        if self.on:
            self.last_gradient = self.now()

    def phase(self, name: str) -> None:
        now = self.now()
        previous, self.last_phase = self.last_phase, name
        if name == "sync" and (self.starting or (self.drains and previous == "sync")):
            name = "start-up" if self.starting else "drain"
        self.starting = self.starting and name == "data"
        if name == "backward" and self.last_gradient is not None:
            self.pending += [
                ("backward", self.phase_start, self.last_gradient, {}),
                ("sync", self.last_gradient, now, {}),
            ]
        else:
            self.pending.append((name, self.phase_start, now, {}))
        self.phase_start, self.last_gradient = now, None

    def collective(self, name: str, future: torch.futures.Future, args: dict) -> torch.futures.Future:
        """The collective's future, with its moment of arrival noted (returns the same value)."""
        start = self.now()

        def arrived(f: torch.futures.Future) -> object:
            self.pending.append((name, start, self.now(), args))  # on a communication thread
            return f.value()

        return future.then(arrived)

    def end_step(self) -> None:
        if not self.on:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.pending.append((f"step {self.step}", self.step_start, self.now(), {}))
        self.spans += [(name, self.seconds(a), self.seconds(b), args) for name, a, b, args in self.pending]
        self.on, self.pending = False, []


def clock_offsets(d: Dist, rounds: int = 9) -> list[float]:
    """What to add to each rank's clock to read rank 0's (seconds): each round all ranks leave a barrier and
    read their clocks; the median over rounds drops those a hiccup spoiled."""
    if not d.distributed:
        return [0.0]
    readings = []
    for _ in range(rounds):
        dist.barrier(group=d.control)
        readings.append(time.perf_counter())
    ranks = all_gather_tensor(d, torch.tensor(readings, dtype=torch.float64))
    return [(ranks[0] - r).median().item() for r in ranks]


def collect_trace(d: Dist, timeline: Timeline, offsets: list[float]) -> list[list[Span]]:
    """Every rank's spans, on rank 0's clock (a collective; rank 0 gets them, the others [])."""
    gathered: list = [timeline.spans]
    if d.distributed:
        gathered = [None] * d.world_size
        dist.all_gather_object(gathered, timeline.spans, group=d.control)
    if not d.is_main:
        return []
    return [
        [(n, a + off, b + off, args) for n, a, b, args in spans] for spans, off in zip(gathered, offsets, strict=True)
    ]


def hidden_fraction(spans: list[Span]) -> float | None:
    """Of the time one rank had communication in flight, the share its forward or backward was computing:
    that time is free; the rest is waited for."""

    def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
        merged: list[tuple[float, float]] = []
        for a, b in sorted(intervals):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        return merged

    comm = union([(a, b) for n, a, b, _ in spans if n in COMMUNICATION])
    compute = union([(a, b) for n, a, b, _ in spans if n in ("forward", "backward")])
    total = sum(b - a for a, b in comm)
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in compute) / total if total else None


def hidden_shares(ranks: list[list[Span]]) -> str:
    """Each rank's hidden fraction, as the summary and the timeline's title both show it."""
    hidden = [hidden_fraction(spans) for spans in ranks]
    return ", ".join(f"rank {r} {100 * h:.0f}%" for r, h in enumerate(hidden) if h is not None)


def bubble_shares(ranks: list[list[Span]]) -> str:
    """Each pipeline stage's idle share, the time it waited for a neighbour, over its traced steps
    after the first (whose start-up skew is not the pipeline's), or over the one step traced."""

    def share(spans: list[Span]) -> float:
        starts = sorted(a for n, a, _, _ in spans if n.startswith("step "))
        later = [(n, b - a) for n, a, b, _ in spans if a >= starts[min(1, len(starts) - 1)]]
        return sum(t for n, t in later if n in IDLE) / sum(t for n, t in later if n.startswith("step "))

    return ", ".join(f"rank {r} {100 * share(spans):.0f}%" for r, spans in enumerate(ranks))


def describe_overlap(ranks: list[list[Span]]) -> str:
    """What the trace shows of communication hidden behind compute, for the summary."""
    if len(ranks) == 1:
        return "none (one process: nothing to synchronise)"
    if not (per_rank := hidden_shares(ranks)):
        return "none traced (no traced step synchronised gradients)"
    steps = sum(name.startswith("step ") for name, *_ in ranks[0])
    if any(name == "all-gather" for name, *_ in ranks[0]):
        return (f"hidden behind forward and backward: {per_rank} of the time an all-gather or reduce-scatter "
                f"was in flight ({steps} traced steps)")  # fmt: skip
    return f"hidden behind backward: {per_rank} of the time a bucket was in flight ({steps} traced steps)" + \
        one_bucket_hint(ranks)  # fmt: skip


def one_bucket_hint(ranks: list[list[Span]]) -> str:
    """Why nothing hides when the whole gradient is one bucket, and what would show the overlap."""
    sizes = {
        args.get("bucket"): args.get("bytes", 0)
        for spans in ranks
        for name, _, _, args in spans
        if name == "all-reduce"
    }
    if set(sizes) != {0}:
        return ""
    return f"; the gradient is one bucket, sent when backward ends: --bucket-mb {sizes[0] / 4 / 2**20:.2g} splits it"


def describe_trace(cfg: RunConfig, ranks: list[list[Span]]) -> tuple[str, str]:
    """The summary's row on the trace: under a model split, what its communication costs; otherwise how
    much of it hid behind compute."""
    if cfg.pp > 1:
        s, m = cfg.pp, cfg.grad_accum_steps * cfg.pp
        ideal = f"{100 * (s - 1) / (m + s - 1):.0f}% for {s} stages and {m} micro-batches"
        # The last stage waits out the drain in the step's closing all-reduces (sync), not in a receive.
        return (
            "pipeline bubble",
            f"idle, waiting for a neighbour: {bubble_shares(ranks)} (ideal {ideal}, for the first)",
        )
    if cfg.tp > 1:
        return "tensor parallel", "its all-reduces sit inside forward and backward, which wait for them"
    sharded = any(name == "all-gather" for name, *_ in ranks[0])
    return "communication" if sharded else "all-reduce", describe_overlap(ranks)


def communication_lanes(spans: list[Span]) -> list[tuple[Span, int]]:
    """The communication spans in time order, each with a lane where it overlaps no other: the lanes show
    how deep the queue of buckets on the wire got."""
    ends: list[float] = []
    placed = []
    for span in sorted((s for s in spans if s[0] in COMMUNICATION), key=lambda s: s[1]):
        lane = next((i for i, end in enumerate(ends) if end <= span[1]), len(ends))
        ends[lane : lane + 1] = [span[2]]
        placed.append((span, lane))
    return placed


def write_trace(cfg: RunConfig, ranks: list[list[Span]]) -> Path | None:
    """The Chrome Trace Event Format (Perfetto, chrome://tracing): one process per rank, its compute
    spans on one thread, its communication on as many threads as were in flight at once."""
    if not any(ranks):
        return None  # stopped before the first step ended
    t0 = min(a for spans in ranks for _, a, _, _ in spans)
    events: list[dict] = []
    for rank, spans in enumerate(ranks):
        comm = communication_lanes(spans)
        names = {0: "compute"} | {1 + lane: "communication" for _, lane in comm}
        events += [
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
            {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
        ]
        events += [
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}
            for tid, name in sorted(names.items())
        ]
        placed = [(s, 0) for s in spans if s[0] not in COMMUNICATION] + [(s, 1 + lane) for s, lane in comm]
        events += [{"name": name, "cat": "communication" if tid else "step" if name.startswith("step ") else "compute",
                    "ph": "X", "ts": round((a - t0) * 1e6, 3), "dur": round((b - a) * 1e6, 3),  # microseconds
                    "pid": rank, "tid": tid, "args": args} for (name, a, b, args), tid in placed]  # fmt: skip
    path = cfg.output_dir / "trace.json"
    atomic_write(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}).encode())
    return path


def timeline_figure(plt: object, cfg: RunConfig, ranks: list[list[Span]]) -> object:
    """The traced steps as a picture: a lane per rank, compute above, communication below it, each
    step's start marked and labelled, and each rank's hidden share in the title."""
    t0 = min(a for spans in ranks for _, a, _, _ in spans)
    fig, ax = plt.subplots(figsize=(11, 1.4 + 1.1 * len(ranks)), layout="constrained")
    for rank, spans in enumerate(ranks):
        top = len(ranks) - 1 - rank  # rank 0 on top
        for name, a, b, _ in spans:
            if name in PHASE_COLOURS and name not in COMMUNICATION:
                ax.broken_barh([(1000 * (a - t0), 1000 * (b - a))], (top + 0.5, 0.4), color=PHASE_COLOURS[name])
            elif name.startswith("step "):
                ax.axvline(1000 * (a - t0), color="black", lw=0.5, alpha=0.3)
                if rank == 0:  # one label per step, above the top lane
                    ax.text(1000 * (a - t0), len(ranks), f" {name}", va="bottom", fontsize=7)
        comm = communication_lanes(spans)
        height = 0.4 / (max((lane for _, lane in comm), default=0) + 1)
        for (name, a, b, _), lane in comm:
            y = top + 0.5 - (lane + 1) * height
            ax.broken_barh([(1000 * (a - t0), 1000 * (b - a))], (y, height * 0.9), color=PHASE_COLOURS[name], alpha=0.8)
    ax.set_yticks([len(ranks) - 1 - r + 0.5 for r in range(len(ranks))], [f"rank {r}" for r in range(len(ranks))])
    ax.set_ylim(0, len(ranks))
    ax.set_xlabel("milliseconds (one clock for every rank)")
    shares, sharded = hidden_shares(ranks), cfg.sharding == "full"
    note = f"\n{'communication hidden behind compute' if sharded else 'all-reduce hidden behind backward'}: {shares}"
    how = "--sharding full" if sharded else f"{cfg.bucket_mb:g} MiB buckets"
    if cfg.tp > 1:  # its all-reduces sit inside forward and backward, which wait for them: nothing hides
        how, note = f"--tp {cfg.tp}", "\ntensor-parallel all-reduces inside forward and backward"
    if cfg.pp > 1:
        how = f"--pp {cfg.pp} ({cfg.pp_schedule})"
        note = f"\nidle, waiting for a neighbour (bubble and drain): {bubble_shares(ranks)}"
    elif hint := one_bucket_hint(ranks):
        note += f"\n{hint.removeprefix('; ')}"
    ax.set_title(f"{cfg.model} model, --ddp {cfg.ddp}, {how}{note if shares or cfg.tp * cfg.pp > 1 else ''}",
                 fontsize=10, pad=14)  # fmt: skip
    drawn = {name for spans in ranks for name, *_ in spans}
    shown = {k: c for k, c in PHASE_COLOURS.items() if k in drawn or k in SideWork.PHASES}
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in shown.values()]
    fig.legend(handles, list(shown), loc="outside lower center", ncol=len(shown), frameon=False)
    return fig


# ----------------------------------------------------------------------------------------------
# 15. Step side work: warmup, precision, faults on purpose, the step's side work, stop requests
# ----------------------------------------------------------------------------------------------


def describe_warmup(cfg: RunConfig) -> str | None:
    if (warmup := warmup_steps(cfg)) == cfg.warmup_steps:
        return None
    return (f"[run] --warmup-steps {cfg.warmup_steps} is more than half of this run's {cfg.max_steps} steps: warming "
            f"up for {warmup} step{'s' if warmup > 1 else ''} instead (a tenth of the run), then cosine decay to "
            "--min-lr")  # fmt: skip


def choose_precision(cfg: RunConfig, d: Dist) -> str:
    on_gpu = d.device.type == "cuda"
    if cfg.precision == "auto":
        return "bf16" if on_gpu and gpu_computes_bf16() else "fp32"
    if cfg.precision == "fp16" and not on_gpu:
        raise UsageError("--precision fp16 needs a CUDA GPU (its GradScaler is CUDA-only); use bf16 or fp32 on CPU")
    return cfg.precision


def warn_if_bf16_is_emulated(cfg: RunConfig, d: Dist) -> None:
    """bf16 on a CPU without bf16 instructions is emulated, and nothing else would say so (96 tokens/s against
    3,300 in fp32 on an AVX2-only EPYC). oneDNN says whether it lacks them; a build without oneDNN is timed."""
    wants_bf16 = cfg.precision == "bf16" or (cfg.model == "hf" and cfg.dtype == "bfloat16")
    if not (d.is_main and d.device.type == "cpu" and wants_bf16):
        return
    try:
        emulated = not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        emulated = cpu_bf16_slowdown() > 3
    if emulated:
        say(f"[run] warning: this CPU has no bf16 instructions: bf16 is emulated here, {cpu_bf16_slowdown():.0f}x "
            "slower than fp32 in a 256x256 matmul just now; --precision fp32 is faster")  # fmt: skip


def cpu_bf16_slowdown(n: int = 256, repeats: int = 3) -> float:
    """How many times longer an n x n matmul takes in bf16 than in fp32 on this CPU (best of a few):
    a CPU that computes bf16 does it about as fast as fp32; one that emulates it, many times slower."""
    seconds = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, n).to(dtype)
        x @ x  # warm up
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            x @ x
            best = min(best, time.perf_counter() - start)
        seconds.append(best)
    return seconds[1] / seconds[0]


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Matmuls in bf16/fp16 inside forward; weights, gradients and optimizer stay fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def check_gradients_arrived(model: nn.Module, d: Dist) -> None:
    """After the first backward some trainable weight must have a non-zero gradient: else nothing learns (a
    frozen input to a checkpointed block, adapters on unused layers). Every rank is asked: each holds a slice."""
    grads = [local_part(p.grad) for p in model.parameters() if p.requires_grad and p.grad is not None]
    if not all_reduce_sum(d, [any(bool(g.any()) for g in grads)])[0]:
        raise TrainingError("no gradient reached the trainable weights at step 1: nothing would learn")


FAULTS_IN_STEP = ("kill", "raise", "nan", "desync", "hang")  # the step acts on them; "save" the checkpoint's writer


def due_fault(cfg: RunConfig, d: Dist, step: int, acting_on: tuple[str, ...]) -> str | None:
    """The fault --inject-fault asks of this rank at this step, if the caller acts on its kind: once per run in
    the output folder, recorded beside its checkpoints (on this rank's machine) as it fires, so that a resumed
    run, or one torchrun restarted, passes the step that killed its predecessor instead of dying there for ever."""
    rank, at, kind = cfg.inject_fault.split(":") if cfg.inject_fault else (-1, 0, "")
    if (int(rank), int(at)) != (d.rank, step) or kind not in acting_on:
        return None
    fired = cfg.output_dir / "checkpoints" / f"fault_{rank}-{at}-{kind}.fired"
    if fired.exists():
        return None
    atomic_write(fired, b"")
    return kind


def crash_on_purpose(kind: str, d: Dist, step: int) -> None:
    print(f"[fault] rank {d.rank}: injected '{kind}' at step {step} (--inject-fault)", file=sys.stderr, flush=True)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no goodbye: like the OOM killer or a lost node
    if kind == "hang":  # alive but silent, like a deadlock: the others wait --timeout-s, then give up
        while STOP.signal is None:  # until torchrun, ending the job, signals it
            time.sleep(0.1)
        os._exit(1)
    raise RuntimeError(f"injected failure on rank {d.rank} at step {step} (--inject-fault)")


@contextlib.contextmanager
def without_stderr_lines(text: str) -> Iterator[None]:
    """Run the block with file descriptor 2 caught (C++ writes there, past Python's warnings filters), then
    write back every line but those holding text. Its lines go if the process dies inside the block."""
    sys.stderr.flush()
    try:
        caught = tempfile.TemporaryFile()  # noqa: SIM115 (closed by the with below)
    except OSError:  # nowhere to catch it: the line shows, the run goes on
        yield
        return
    saved = os.dup(2)
    with caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            with contextlib.suppress(OSError):  # a closed stderr (the launcher gone) must not mask the block's error
                os.write(2, b"".join(line for line in caught if text.encode() not in line))


class SideWork(Hooks):
    """Everything train() does besides the DDP steps, at its Hooks: resume and the header, the phase timer
    (--time-breakdown), the timeline, faults on purpose, the first step's gradient check, --inspect,
    --verify-sync, stop requests, evaluation, progress and metrics, checkpoints, and the memory table.
    With their flags off, the calls cost nothing (docs/training.md reads the phase timer)."""

    PHASES = ("data", "forward", "backward", "sync", "optimizer")

    def __init__(self, cfg: RunConfig, d: Dist, kit: ModelKit, resume: dict | None, settings: dict,
                 prompts: list[str] = ()) -> None:  # fmt: skip
        self.cfg, self.d, self.kit, self.resume, self.settings, self.prompts = cfg, d, kit, resume, settings, prompts
        self.precision = choose_precision(cfg, d)
        # fp16 needs loss scaling: small gradients would underflow to zero. bf16 has fp32's range.
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
        self.timed, self.cuda = cfg.time_breakdown, d.device.type == "cuda"
        self.phase_seconds, self.last = dict.fromkeys(self.PHASES, 0.0), 0.0
        self.fault: str | None = None
        self.stopped_by: str | None = None  # the signal's name, when a stop request ended the run early
        self.activations: list[int] | None = None  # bytes the first micro-batch's forward kept for backward
        self.step = self.first_step = 1  # the step running, and this attempt's first (start)
        self.unread: list[tuple[int, torch.Tensor]] = []  # steps whose numbers wait on the device (read)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's precision; the run's first micro-batch also counts what it saves for backward, and the
        attempt's first step keeps back torch's DDP's one warning that it found no unused parameter (TorchDDP)."""
        stack = contextlib.ExitStack()
        stack.enter_context(autocast_for(self.precision, self.d.device))
        if self.activations is None and not self.cfg.compile:  # (compiled blocks save inside their own graphs)
            self.activations = stack.enter_context(saved_for_backward())
        if self.cfg.ddp == "torch" and self.step == self.first_step:
            stack.enter_context(without_stderr_lines("find_unused_parameters=True was specified"))
        return stack

    def comm_stats(self, compress: bool) -> Traffic:
        self.stats = Traffic(self.kit.model, compress)
        return self.stats

    def before_wrap(self, kit: ModelKit, stats: Traffic) -> None:
        cfg, d = self.cfg, self.d
        params = [p for _, p in trainable_parameters(kit.model)]  # hooked before the wrapper hooks them
        drains = d.pp > 1 and d.pp_rank == d.pp - 1  # a pipeline's last stage
        first_step = self.resume["progress"]["step"] if self.resume else 0
        self.timeline = Timeline(first_step + cfg.trace_steps, d.device, params, drains) if cfg.trace_steps else None
        stats.timeline = self.timeline
        self.offsets = clock_offsets(d) if self.timeline else []
        self.predicted = predict_memory(cfg, d, kit)  # from the whole model, before any sharding

    def start(self, model: Layout, named_params: list, optimizer: torch.optim.Optimizer,
              sampler: DistributedSampler, steps_per_epoch: int) -> Progress:  # fmt: skip
        cfg, d, resume = self.cfg, self.d, self.resume
        for block in self.kit.blocks if cfg.compile else ():  # wrapped or sharded first (fully_shard's subclass: its
            block.forward = torch.compile(block.forward)  # forward checkpoints); block by block, as torchtitan does
        progress = resume_training(resume, model, named_params, optimizer, self.scaler, d) if resume else Progress()
        announce_run(cfg, d, sampler, steps_per_epoch, self.precision, model, optimizer, named_params)
        self.saver = StateSaver(cfg, d, self.settings, progress.step if resume else None)
        self.first_step = progress.step + 1
        rank0_writes(d, "the settings", lambda: write_settings(cfg))  # training starts: nothing refused it
        self.reporter = Reporter(cfg, d, self.kit, progress, self.precision, steps_per_epoch)
        return progress

    def begin_step(self, step: int) -> None:
        """The step's start; a crash on purpose (kill, raise, hang) happens here and now."""
        self.step = step
        if self.timeline:
            self.timeline.begin_step(step)
        if self.timed and self.cuda:
            torch.cuda.synchronize()
        self.last = time.perf_counter()
        self.fault = due_fault(self.cfg, self.d, step, FAULTS_IN_STEP)  # a teaching aid: None in real runs
        if self.kit.tally:  # a step's own rewards (read where it reports)
            self.kit.tally.clear()
        if self.fault in ("kill", "raise", "hang"):
            crash_on_purpose(self.fault, self.d, step)
        self.stats.local_grads = {} if self.cfg.inspect and step <= INSPECT_STEPS else None
        self.stats.counting = True  # until after_update: a step's collectives, not evaluation's

    def mark(self, phase: str) -> None:
        if self.timeline and self.timeline.on:
            self.timeline.phase(phase)
        if self.timed:
            if self.cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + now - self.last  # (a pipeline's bubble)
            self.last = now

    def take_times(self, steps: int) -> dict[str, float]:
        """Milliseconds per step in each phase since the last take (--time-breakdown; else {})."""
        per_step = {f"ms_{k}": 1000 * v / steps for k, v in self.phase_seconds.items()} if self.timed else {}
        self.phase_seconds = dict.fromkeys(self.PHASES, 0.0)
        return per_step

    def loss(self, micro_loss: torch.Tensor) -> torch.Tensor:
        return micro_loss * float("nan") if self.fault == "nan" else micro_loss

    def shared_votes(self) -> list[float]:
        # Which stop signal this rank has seen (STOP), and whether rank 0's last metrics write failed.
        return [STOP.signal == signal.SIGINT, STOP.signal == signal.SIGTERM, self.reporter.failure is not None]

    def should_stop(self, votes: list[float]) -> bool:
        interrupts, terminations, failed = votes
        if failed:
            self.reporter.share_failure()
        if interrupts or terminations:  # named by every rank's votes: rank 0's own may not have arrived yet
            self.stopped_by = "SIGTERM" if terminations else "SIGINT"
        return bool(interrupts or terminations)

    def gradients_synced(self, step: int, model: Layout, named_params: list, sent: tuple[int, int],
                         local_loss_sum: torch.Tensor, micro_tokens: list[int]) -> None:  # fmt: skip
        # The step's bucket all-reduces for the metrics, where gradients travel in DDP's buckets.
        self.sent = {"allreduce_calls": sent[0], "allreduce_bytes": sent[1]} if model.all_reduces_buckets else {}
        if self.fault == "desync":  # pretend this rank's gradient sync silently went wrong
            named_params[0][1].grad.add_(1e-3)
        if step == 1:
            check_gradients_arrived(self.kit.model, self.d)
        if self.stats.local_grads is not None:  # the averaged gradient as the all-reduce left it, before clipping
            report_inspect_step(self.cfg, self.d, step, self.stats, sent, named_params, local_loss_sum.item(),
                                micro_tokens, model.loss_share)  # fmt: skip

    def read(self, step: int, numbers: torch.Tensor) -> list[float] | None:
        """Read where the step reports, evaluates, saves or checks; between those steps the numbers wait on the
        device, and the next read checks them: a non-finite one stops the run there, before anything is saved."""
        if not self.reads_at(step):
            self.unread.append((step, numbers))
            return None
        self.read_unread()
        return numbers.tolist()

    def reads_at(self, step: int) -> bool:
        cfg = self.cfg
        due = (step % cfg.log_every == 0 or step in (1, cfg.max_steps) or evaluation_due(cfg, self.kit, step)
               or self.verifying(step) or self.stats.local_grads is not None)  # fmt: skip
        return due or any(every and step % every == 0 for every in (cfg.sample_every, cfg.save_every))

    def read_unread(self) -> None:
        """The steps read late, in order: each one's loss into the history; the run stopped at the first whose loss
        (or, without fp16's loss scaler, whose gradient norm) was not finite, as train() stops a step it reads."""
        for step, (loss, grad_norm, local) in [(s, n.tolist()) for s, n in self.unread]:
            if not math.isfinite(loss) or (not math.isfinite(grad_norm) and self.scaler is None):
                raise_non_finite(self.d, step, loss, grad_norm, local, stopped_at=self.step)
            self.reporter.progress.history.append({"step": step, "loss": loss})
        self.unread = []

    def non_finite(self, step: int, loss: float, grad_norm: float, local_loss_sum: float) -> None:
        raise_non_finite(self.d, step, loss, grad_norm, local_loss_sum)

    def verifying(self, step: int) -> bool:
        return bool(self.cfg.verify_sync and step % self.cfg.verify_sync == 0)

    def before_update(self, step: int, model: Layout, named_params: list) -> None:
        if self.verifying(step):
            verify_replicas_agree(self.d, step, "after the gradient all-reduce", replicated(model, named_params))

    def after_update(self, step: int, model: Layout, named_params: list, optimizer: torch.optim.Optimizer) -> None:
        self.mark("optimizer")
        self.stats.counting = False
        if self.verifying(step):
            state = replicated(model, named_params, optimizer)
            verify_replicas_agree(self.d, step, "after the optimizer step", state)
        if self.timeline:
            self.timeline.end_step()

    def step_done(self, metrics: dict[str, float], tokens: int, seconds: float, model: Layout,
                  named_params: list, optimizer: torch.optim.Optimizer, progress: Progress) -> None:  # fmt: skip
        cfg, step = self.cfg, int(metrics["step"])
        if self.kit.tally and "loss" in metrics:  # before evaluating, which counts its own
            metrics |= self.kit.tally.take(self.d, tokens)
        val = evaluate(cfg, self.d, self.kit, model, self.precision) if evaluation_due(cfg, self.kit, step) else {}
        if cfg.sample_every and step % cfg.sample_every == 0:  # rank 0's; the others wait at the next collective
            val["samples"] = sample_now(cfg, self.kit, self.prompts, self.d.device) if self.d.is_main else []
        self.reporter.step_done({**metrics, **val, **self.sent}, tokens, seconds, self.take_times)
        if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.max_steps):
            self.saver.save(model, named_params, optimizer, self.scaler, progress)

    def finish(self, model: Layout, named_params: list, optimizer: torch.optim.Optimizer, progress: Progress) -> None:
        """The last write's failure heard, a stop's checkpoint written; the trace and every rank's
        memory gathered to rank 0 (collectives)."""
        self.read_unread()  # before a stop's checkpoint: a step read late may stop the run instead
        if all_reduce_sum(self.d, [self.reporter.failure is not None])[0]:  # the last step's, which no vote followed
            self.reporter.share_failure()
        if self.stopped_by:
            self.saver.save(model, named_params, optimizer, self.scaler, progress)
        self.reporter.close()
        self.trace = collect_trace(self.d, self.timeline, self.offsets) if self.timeline else []
        self.memory = measure_memory(self.d, self.kit, model, optimizer, self.predicted, self.activations)
        self.traffic = self.stats.per_step()  # this rank's collectives by kind: (calls, bytes) per step


class StopRequest:
    """SIGTERM or SIGINT asks for a clean stop: finish this step, checkpoint, exit. Each rank only records
    it; the next step's first all-reduce tells every rank, so all stop at the same step. A repeat arriving
    within REPEAT_S is the agent's forwarded copy; a later one exits at once. Arrival is timed by a thread
    reading the wakeup socket: a handler waits for the main thread to leave its C call (docs/faults.md)."""

    REPEAT_S = 3.0

    def __init__(self) -> None:
        self.signal: int | None = None
        self.at = 0.0

    def install(self) -> None:
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._wakeup = (reader, writer)  # both ends live as long as the process
        threading.Thread(target=self._watch, args=(reader,), name="stop-signals", daemon=True).start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            # A Python handler must exist for the wakeup byte to be written; it has nothing to do.
            signal.signal(sig, lambda signum, frame: None)

    def _watch(self, reader: socket.socket) -> None:
        while data := reader.recv(64):
            now = time.monotonic()
            for signum in data:
                if signum in (signal.SIGTERM, signal.SIGINT):
                    self._arrived(signum, now)

    @staticmethod
    def fresh_line() -> str:
        """A terminal has just echoed ^C after the progress bar: start the line afresh."""
        return "\n" if os.isatty(2) else ""

    def _arrived(self, signum: int, now: float) -> None:
        name = signal.Signals(signum).name
        if self.signal is None:
            self.signal, self.at = signum, now
            if os.environ.get("LOCAL_RANK", "0") == "0":
                os.write(2, f"{self.fresh_line()}[stop] {name}: every rank stops after this step and writes a "
                            f"checkpoint (a second one, {self.REPEAT_S:g} s from now or later, stops at once without "
                            "one)\n".encode())  # fmt: skip
        elif now - self.at > self.REPEAT_S:
            os.write(2, f"{self.fresh_line()}[stop] second {name}: stopping at once, without a checkpoint\n".encode())
            os._exit(128 + signum)


STOP = StopRequest()


def raise_non_finite(d: Dist, step: int, loss: float, grad_norm: float, local_loss_sum: float,
                     stopped_at: int | None = None) -> None:  # fmt: skip
    """Stop every rank (all see the same summed loss and norm): before a NaN or inf reaches the weights, or, where
    the step was read later (SideWork.read), at step `stopped_at`, before anything after it is saved."""
    local_losses = all_gather_tensor(d, torch.tensor([local_loss_sum], dtype=torch.float64))
    bad = [r for r, t in enumerate(local_losses) if not math.isfinite(t.item())]
    where = f"non-finite local loss on rank(s) {bad}" if bad else "the losses were finite, the gradients were not"
    stop = (
        (f"every rank stopped at step {stopped_at}, where it was read (--log-every); nothing trained since was saved")
        if stopped_at
        else "stopped every rank before the optimizer step; the weights are untouched"
    )
    raise TrainingError(f"non-finite loss or gradient norm at step {step} (loss {loss}, grad norm {grad_norm}; "
                        f"{where}): {stop}. Try a lower --lr")  # fmt: skip


# ----------------------------------------------------------------------------------------------
# 16. Evaluate and report: held-out loss, progress, metrics, MFU, the loss plot, the memory table, summary
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def generate_bytes(model: TinyTransformer, prompt: str, max_new: int, seed: int, temperature: float = 0.8,
                   top_p: float = 1.0, stream: Callable[[str], object] | None = None) -> str:  # fmt: skip
    """Sample a continuation of the prompt until the end of the line (the model's own "\\n"); `stream`
    gets the text as it comes."""
    device = next(model.parameters()).device
    ids = torch.tensor([[NEWLINE, *prompt.encode("utf-8")]], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out, text = bytearray(), codecs.getincrementaldecoder("utf-8")("replace")
    for _ in range(max_new):
        nxt = next_token(model(ids[:, -model.config.seq_len :])[0, -1].float(), temperature, top_p, gen)
        if nxt.item() == NEWLINE:
            break
        out.append(int(nxt.item()))
        if stream:
            stream(text.decode(bytes(out[-1:])).translate(CONTROL_ESCAPES))
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return (prompt + out.decode("utf-8", errors="replace")).translate(CONTROL_ESCAPES)


def next_token(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """Greedy at temperature 0; else drawn from the fewest likeliest tokens whose probabilities reach top_p."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        ranked, order = probs.sort(descending=True)
        probs = probs.scatter(-1, order, ranked.masked_fill(ranked.cumsum(-1) - ranked > top_p, 0))
    return torch.multinomial(probs, 1, generator=gen)


# A sampled byte may be any control character (backspace, NUL, an escape sequence's ESC): shown as \x08 and
# the like, the sample stays one line of text that can neither drive the terminal nor break a log (a
# backslash doubled, so that an escape is never ambiguous; the Unicode line breaks too).
CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]} | {
    ord("\\"): "\\\\",
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}


def say(message: str) -> None:
    """Print a line on stdout without breaking a progress bar drawn on stderr."""
    tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()


def log(d: Dist, message: str) -> None:
    if d.is_main:
        say(message)


def global_batch(cfg: RunConfig, d: Dist) -> int:
    """Examples per optimizer step over all ranks: per-replica batch x replicas x micro-steps."""
    return cfg.batch_size * d.dp * cfg.grad_accum_steps


def announce_run(cfg: RunConfig, d: Dist, sampler: DistributedSampler, steps_per_epoch: int, precision: str,
                 model: Layout, optimizer: torch.optim.Optimizer, named_params: list) -> None:  # fmt: skip
    """The run's shape, once, before the first step: the global batch, and how the gradients travel;
    with --inspect, each rank's shard of the data and of the training state."""
    k, batch = cfg.grad_accum_steps, global_batch(cfg, d)
    split = d.tp * d.pp * d.cp > 1
    replicas = f"{d.dp} replica(s)" if split else f"{d.world_size} rank(s)"  # a replica's ranks: the lines below
    log(d, f"[run] {replicas} x {cfg.batch_size} examples x {k} micro-step(s) = global batch {batch}")
    if d.tp > 1:
        log(d, f"[run] --tp {d.tp}: each replica's {d.tp} ranks hold a slice of every weight and see the same batch")
    if d.pp > 1:
        log(d, f"[run] --pp {d.pp}: each replica's {d.pp} ranks hold a stage of blocks each; each micro-step's "
               f"{cfg.batch_size} examples flow through them as {d.pp} micro-batches of {cfg.batch_size // d.pp}, "
               f"{k * d.pp} a step (--grad-accum-steps adds more: a smaller bubble)")  # fmt: skip
    if d.cp > 1:
        log(d, f"[run] --cp {d.cp}: each replica's {d.cp} ranks see the same batch, each two of its {2 * d.cp} chunks "
               "of every example; keys and values travel round them (ring attention)")  # fmt: skip
    log(d, f"[run] up to {batch * cfg.seq_len:,} token positions per step (a batch is padded to its longest example)")
    each, steps = "replica" if split else "rank", "step" if steps_per_epoch == 1 else "steps"
    log(d, f"[run] {len(sampler)} examples per {each} per epoch = {steps_per_epoch} {steps} per epoch")
    if cfg.ddp == "manual" and (why := layout_refusal(replace(cfg, ddp="torch"))):
        log(d, f"[run] --ddp manual: only the from-scratch classes run this ({why})")
    over = " over pairs (DPO)" if cfg.objective == "dpo" else ""  # its "tokens" are pairs: kit.count
    log(d, f"[run] gradient sync: {describe_gradient_sync(cfg, d)}; loss: {cfg.loss_normalization}{over}; optimizer: "
           f"{cfg.optimizer}, lr {cfg.lr:g} (warmup {warmup_steps(cfg)}, cosine to {cfg.min_lr:g}); "
           f"precision {precision}")  # fmt: skip
    if cfg.sharding != "none" and not d.distributed:
        log(d, f"[run] --sharding {cfg.sharding}: one process holds the whole model, there is nothing to shard")
    if cfg.tp * cfg.pp * cfg.cp > 1 and not d.distributed:
        log(d, f"[run] --tp {cfg.tp} --pp {cfg.pp}" + f" --cp {cfg.cp}" * (cfg.cp > 1) + ": one process computes the "
               "whole model, there is nothing to split")  # fmt: skip
    if cfg.inspect:
        place = (
            f"dp {d.dp_rank} of {d.dp}, pp {d.pp_rank} of {d.pp}, tp {d.tp_rank} of {d.tp}, cp {d.cp_rank} of {d.cp}"
        )
        print_in_rank_order(d, [place, *describe_shards(sampler), *ownership(model, named_params, optimizer)])


def evaluation_due(cfg: RunConfig, kit: ModelKit, step: int) -> bool:
    return kit.val is not None and (step == cfg.max_steps or bool(cfg.eval_every and step % cfg.eval_every == 0))


@torch.no_grad()
def evaluate(cfg: RunConfig, d: Dist, kit: ModelKit, model: Layout, precision: str) -> dict[str, float]:
    """The exact token-weighted held-out loss, by all ranks: rank r takes examples r, r+W, ... (each once; a
    DistributedSampler would repeat some) through the unwrapped model, and one all-reduce sums the results.
    Under FSDP a rank with fewer batches runs uncounted ones to join every forward's gathers."""
    val, raw = kit.val, kit.trained
    raw.eval()
    loss_sum = tokens = nbytes = 0.0
    read = evaluated_examples(cfg, len(val))
    # With fewer held-out examples than ranks, some ranks hold none: they add zeros to the sums.
    mine = read[d.dp_rank :: d.dp]  # a replica's ranks (slices, stages) share its examples
    batches = [[val[i] for i in chunk.tolist()] for chunk in mine.split(cfg.batch_size)] if len(mine) else []
    if model.gathers_in_forward:  # rank 0 holds the most batches; the others join its gathers
        batches += [[val[0]]] * (math.ceil(math.ceil(len(read) / d.dp) / cfg.batch_size) - len(batches))
    tally = kit.tally or RewardTally()  # (DPO's rewards; else one that nothing adds to)
    tally.clear()
    for i, batch in enumerate(batches):
        cpu_batch = model.local_batch(kit.collate(batch))
        tally.counting = i * cfg.batch_size < len(mine)  # a batch of this rank's own, not one that only joins in
        with autocast_for(precision, d.device):
            loss = model.eval_loss(kit, tuple(t.to(d.device) for t in cpu_batch)).item()
        if tally.counting:
            loss_sum += loss
            tokens += kit.count(cpu_batch)
            nbytes += int(val.target_bytes[mine[i * cfg.batch_size : (i + 1) * cfg.batch_size]].sum())
    tally.counting = True
    model.after_evaluation()
    raw.train()
    share = model.loss_share  # one rank of each replica counts its examples
    loss_sum, tokens, nbytes = all_reduce_sum(d, [loss_sum * share, tokens * share, nbytes * model.example_share])
    loss = loss_sum / tokens
    if kit.tally:  # DPO: the loss per pair, and how often the held-out chosen replies win
        return {"val_loss": loss, **kit.tally.take(d, tokens, "val_")}
    # Perplexity is per token, so it depends on the tokenizer; bits per byte does not, and
    # compares the byte-level model with Qwen on the same text.
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_bpb": loss_sum / (math.log(2) * nbytes)}


def evaluated_examples(cfg: RunConfig, n: int) -> torch.Tensor:
    """Which held-out examples an evaluation reads: all, or --eval-examples spread evenly, the same each time."""
    if not cfg.eval_examples or cfg.eval_examples >= n:
        return torch.arange(n)
    return torch.arange(cfg.eval_examples) * n // cfg.eval_examples


def describe_evaluation(cfg: RunConfig, d: Dist, n: int) -> str:
    """What an evaluation reads, and its cost beside the training steps between two of them (a
    forward is about a third of a training step's forward and backward)."""
    read, between = len(evaluated_examples(cfg, n)), min(cfg.eval_every or cfg.max_steps, cfg.max_steps)
    share = read / 3 / max(1, between * global_batch(cfg, d))
    which = "every held-out example" if read == n else f"{read:,} of {n:,} held-out examples, spread evenly"
    when, of = (f"every {between} steps and at the end", "the steps between") if between < cfg.max_steps else (
        "at the end", "the training steps")  # fmt: skip
    return f"[eval] {which}, {when}: about {share:.1%} of the compute of {of} (--eval-examples; 0 reads all)"


# Dense bf16/fp16 tensor-core peaks in FLOP/s, from the vendors' data sheets, for MFU. Matched
# by the exact name torch reports: by substring, "NVIDIA L4" would match an L40, and "H100"
# would give an H100 PCIe (756) the SXM part's 989.
PEAK_FLOPS = {
    "NVIDIA H200": 989e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA L40S": 362e12,
    "NVIDIA L4": 121e12,
    "NVIDIA GeForce RTX 4090": 165e12,
}


def gpu_peak_flops(name: str) -> float | None:
    return PEAK_FLOPS.get(name.strip())


def peak_flops(d: Dist, precision: str) -> float | None:
    """This GPU's peak for MFU; None (and one line saying why) where it is not known."""
    if d.device.type != "cuda" or precision not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name(d.device)
    if (peak := gpu_peak_flops(name)) is None:
        log(d, f"[run] MFU not reported: no peak FLOP/s on file for '{name}' (PEAK_FLOPS in the script)")
    return peak


def training_flops_per_token(model: nn.Module, n_layers: int, attention_width: int, seq_len: int) -> float:
    """FLOPs to train on one token, for MFU (PaLM, appendix B, LoRA-aware): 6 per trained weight, 4 per frozen
    one (no weight gradient), plus attention's 12 x layers x width x sequence length."""
    linears = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    trained, frozen = (
        sum(w.numel() for w in linears if w.requires_grad),
        sum(w.numel() for w in linears if not w.requires_grad),
    )
    return 6 * trained + 4 * frozen + 12 * n_layers * attention_width * seq_len


class Reporter:
    """Rank 0's account of the run, in numbers already reduced over all ranks: a progress bar or log lines,
    the metrics file, the history. Speeds count training steps only, not evaluation or checkpoints."""

    def __init__(self, cfg: RunConfig, d: Dist, kit: ModelKit, progress: Progress, precision: str,
                 steps_per_epoch: int) -> None:  # fmt: skip
        self.cfg, self.d, self.progress, self.steps_per_epoch = cfg, d, progress, steps_per_epoch
        self.show_bar = d.is_main and (cfg.progress == "bar" or (cfg.progress == "auto" and sys.stderr.isatty()))
        self.bar = tqdm(total=cfg.max_steps, initial=progress.step, unit="step", dynamic_ncols=True,
                        disable=not self.show_bar)  # fmt: skip
        self.unit = "pairs" if cfg.objective == "dpo" else "tokens"  # what the loss averages over (kit.count)
        self.places = 1 if self.unit == "pairs" else 0  # a pair is hundreds of tokens: a CPU trains a few a second
        self.flops_per_token = kit.flops_per_token
        self.peak = peak_flops(d, precision) if self.unit == "tokens" else None  # MFU counts tokens
        self.window_tokens, self.window_seconds, self.window_steps = 0, 0.0, 0
        self.tokens, self.seconds = 0, 0.0  # this attempt's totals
        self.failure: OSError | None = None  # rank 0's failed metrics write, until every rank hears of it
        self.trackers = Trackers(cfg, cfg.report_to if d.is_main else ())

    def step_done(self, metrics: dict[str, float], tokens: int, seconds: float,
                  take_times: Callable[[int], dict[str, float]]) -> None:  # fmt: skip
        step, cfg = int(metrics["step"]), self.cfg
        self.window_tokens, self.window_seconds, self.window_steps = (
            self.window_tokens + tokens, self.window_seconds + seconds, self.window_steps + 1)  # fmt: skip
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        self.bar.update(1)
        if "loss" not in metrics:  # not read at this step (SideWork.read): nor reported
            return
        self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
        self.progress.history.append({k: metrics[k] for k in ("step", "loss", "val_loss") if k in metrics})
        if not (step % cfg.log_every == 0 or step in (1, cfg.max_steps) or {"val_loss", "samples"} & set(metrics)):
            return
        speed = self.window_tokens / self.window_seconds
        record = {
            **metrics,
            f"{self.unit}_per_sec": speed,  # real (non-padding) training tokens (DPO: pairs), all ranks together
            f"{self.unit}_seen": self.progress.tokens_seen,
            "epoch": (step - 1) // self.steps_per_epoch,
            **take_times(self.window_steps),
        }
        self.window_tokens, self.window_seconds, self.window_steps = 0, 0.0, 0
        if self.peak:
            record["mfu"] = speed * self.flops_per_token / (self.peak * self.d.world_size)
        if not self.d.is_main:
            return
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", **{f"{self.unit}_s": f"{speed:,.{self.places}f}"})
        line = format_metrics(record, cfg.max_steps, self.d.replicas > 1)
        if not self.show_bar:
            say(line)
        elif "val_loss" in record:
            self.bar.write(line)
        for sample in record.get("samples", []):
            say(f"[sample] step {step}: {sample}")
        self.trackers.log(record, step)
        if cfg.metrics_file and not self.failure:
            # No collective here: the failure reaches the other ranks with the next step's vote.
            try:
                with open(cfg.metrics_file, "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as e:
                self.failure = e

    def share_failure(self) -> None:
        """Stop every rank with rank 0's metrics-file error (a collective)."""

        def fail() -> None:
            raise self.failure

        rank0_then_share(self.d, f"could not write the metrics file {self.cfg.metrics_file}", fail)

    def close(self) -> None:
        self.bar.close()


class TensorBoard:
    """--report-to tensorboard: event files in OUTPUT_DIR/tensorboard, flushed at every log."""

    def __init__(self, cfg: RunConfig, settings: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(cfg.output_dir / "tensorboard"))
        self.writer.add_text("settings", "\n".join(f"    {k}: {v}" for k, v in settings.items()))  # as code

    def log(self, numbers: dict[str, float], texts: dict[str, list[str]], step: int) -> None:
        for key, value in numbers.items():
            self.writer.add_scalar(key, value, step)
        for key, lines in texts.items():
            self.writer.add_text(key, "\n\n".join(lines), step)
        self.writer.flush()

    def finish(self, summary: dict[str, float], step: int) -> None:
        for key, value in summary.items():
            self.writer.add_scalar(f"summary/{key}", value, step)
        self.writer.close()


class Wandb:
    """--report-to wandb: a run in OUTPUT_DIR/wandb (WANDB_MODE=offline keeps it there; WANDB_PROJECT names it)."""

    library = "wandb"

    def __init__(self, cfg: RunConfig, settings: dict) -> None:
        where = self.files(cfg)
        self.lib = importlib.import_module(self.library)
        project = os.environ.get("WANDB_PROJECT", "llm-ddp-parallel-training")
        self.run = self.lib.init(project=project, config=settings, **where)

    def files(self, cfg: RunConfig) -> dict:
        return {"dir": str(cfg.output_dir)}

    def log(self, numbers: dict[str, float], texts: dict[str, list[str]], step: int) -> None:
        tables = {key: self.lib.Table(columns=[key], data=[[line] for line in lines]) for key, lines in texts.items()}
        self.run.log(numbers | tables, step=step)

    def finish(self, summary: dict[str, float], step: int) -> None:
        self.run.summary.update(summary)
        self.run.finish()


class Trackio(Wandb):
    """--report-to trackio: wandb's calls, its local store in OUTPUT_DIR/trackio (unless TRACKIO_DIR says where)."""

    library = "trackio"

    def files(self, cfg: RunConfig) -> dict:
        os.environ.setdefault("TRACKIO_DIR", str(cfg.output_dir / "trackio"))  # read as trackio is imported
        return {}

    def finish(self, summary: dict[str, float], step: int) -> None:  # trackio keeps no summary: a last log
        self.run.log({f"summary/{key}": value for key, value in summary.items()}, step=step)
        self.run.finish()


TRACKERS = {"tensorboard": TensorBoard, "wandb": Wandb, "trackio": Trackio}


class Trackers:
    """Rank 0's --report-to trackers: the metrics file's records under its keys, the settings, the summary.
    One that fails costs one warning line and is dropped; the training goes on."""

    def __init__(self, cfg: RunConfig, names: tuple[str, ...]) -> None:
        self.live: dict[str, object] = {}
        chosen = [name for name in names if name in TRACKERS]  # not "none"
        settings = resolved_settings(cfg) if chosen else {}
        for name in chosen:
            self.call(name, lambda n=name: self.live.update({n: TRACKERS[n](cfg, settings)}))

    def call(self, name: str, work: Callable[[], object]) -> None:
        try:
            work()
        except Exception as e:  # a tracker's server, disk or key: the run's own outputs do not depend on it
            self.live.pop(name, None)
            say(f"[report] warning: {name} failed and is left out from here on: {describe_error(e)}")

    def log(self, record: dict, step: int) -> None:
        numbers = {k: v for k, v in record.items() if isinstance(v, int | float) and k != "step"}  # the x axis
        texts = {k: v for k, v in record.items() if isinstance(v, list) and v}
        for name, tracker in list(self.live.items()):
            self.call(name, lambda t=tracker: t.log(numbers, texts, step))

    def finish(self, summary: dict[str, float], step: int) -> None:
        for name, tracker in list(self.live.items()):
            self.call(name, lambda t=tracker: t.finish(summary, step))
        self.live = {}


def format_metrics(r: dict[str, float], max_steps: int, averaged: bool) -> str:
    speed = f"{r['tokens_per_sec']:,.0f} tok/s" if "tokens_per_sec" in r else f"{r['pairs_per_sec']:,.1f} pairs/s"
    line = (f"step {int(r['step']):>5}/{max_steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"grad norm {r['grad_norm']:.3f} | {speed}")  # fmt: skip
    if "rewards/accuracies" in r:
        line += f" | rewards: accuracy {r['rewards/accuracies']:.3f}, margin {r['rewards/margins']:.4f}"
    if averaged and "allreduce_calls" in r:  # replicas average their gradients: say what that cost
        line += f" | all-reduced {r['allreduce_calls']} bucket(s), {r['allreduce_bytes'] / 2**20:.2f} MiB"
    if "mfu" in r:
        line += f" | MFU {100 * r['mfu']:.1f}%"
    if "ms_data" in r:
        line += " | ms/step " + " ".join(f"{k[3:]} {r[k]:.1f}" for k in r if k.startswith("ms_"))
    if "val_ppl" in r:
        line += f" | val loss {r['val_loss']:.4f}, ppl {r['val_ppl']:.2f}, {r['val_bpb']:.3f} bits/byte"
    elif "val_loss" in r:
        line += f" | val loss {r['val_loss']:.4f}, rewards accuracy {r['val_rewards/accuracies']:.3f}"
    return line


def import_pyplot() -> object | None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no window, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        say("[plot] skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    return plt


def write_figure(cfg: RunConfig, name: str, draw: Callable[[object], object]) -> Path | None:
    """OUTPUT_DIR/name, the figure draw(pyplot) returns (None without matplotlib)."""
    if (plt := import_pyplot()) is None:
        return None
    fig = draw(plt)
    fig.savefig(cfg.output_dir / name, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return cfg.output_dir / name


def loss_figure(plt: object, cfg: RunConfig, history: list[dict[str, float]]) -> object:
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [h["step"] for h in history],
        [h["loss"] for h in history],
        lw=0.8,
        label="train loss, every step (global batch)",
    )
    if val := [h for h in history if "val_loss" in h]:
        ax.plot([h["step"] for h in val], [h["val_loss"] for h in val], "o-", zorder=3, label="validation loss")
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats per token)", title=f"{cfg.model} model")
    ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole: no 1.5 on a short run's axis
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


# Where each rank's memory goes. The training state is counted exactly: every live tensor's
# storage once (DDP's gradients are views into its buckets; tied weights are one tensor),
# beside what the ZeRO paper's arithmetic predicts for this strategy and world size N.
# Activations and temporary buffers are not state: they show in the peak.


def stage_of(name: str, n_layers: int, stages: int) -> int:
    """The stage that holds parameter `name`: its block's; the embeddings the first's, the rest the last's."""
    if name.startswith("blocks."):
        block = int(name.split(".")[1])
        return next(s for s in range(stages) if block in stage_blocks(s, n_layers, stages))
    return 0 if name.startswith(("tok_emb", "pos_emb")) else stages - 1


def predict_memory(cfg: RunConfig, d: Dist, kit: ModelKit) -> dict:
    """Bytes per rank by the ZeRO arithmetic (Rajbhandari et al. 2019, padding aside), for this
    run's dtypes: weights and gradients at the weights' dtype, AdamW two moments of the same."""
    n = d.replicas if d.distributed else 1  # sharding is along the ranks holding the same weights
    # A pipeline stage holds its own blocks (its part is cut out later); tensor parallelism has cut its slices already.
    layers = len(kit.blocks)
    named = [
        (name, p)
        for name, p in kit.trained.named_parameters()
        if d.pp == 1 or stage_of(name, layers, d.pp) == d.pp_rank
    ]
    later = {n for i in range(layers) for n in tensor_parallel_cuts(i)} if d.pp > 1 else set()  # TensorParallelStage
    size = {id(p): local_part(p).numel() * p.element_size() // (d.tp if name in later else 1) for name, p in named}
    params = [p for _, p in named]  # (a DTensor's size: this rank's part)
    trainable = [p for p in params if p.requires_grad]
    moments = 2 if cfg.optimizer == "adamw" else 0  # plain SGD keeps no state
    whole = {
        "parameters": sum(size[id(p)] for p in params),
        "gradients": sum(size[id(p)] for p in trainable),
        "optimizer_state": moments * sum(size[id(p)] for p in trainable),
    }
    split = {"none": (), "optimizer": ("optimizer_state",), "full": tuple(whole)}[cfg.sharding if n > 1 else "none"]
    units = [*kit.blocks, kit.trained]
    owner = innermost_units(kit.trained, units)
    largest = max(sum(p.numel() * p.element_size() for p in owner if owner[p] is u) for u in units)
    return {
        "predicted": {k: v // n if k in split else v for k, v in whole.items()},
        "largest_unit": largest if "parameters" in split else 0,
    }


@contextlib.contextmanager
def saved_for_backward() -> Iterator[list[int]]:
    """The bytes autograd keeps for backward in the block, the activations: each storage once, the weights not
    (they stay with or without a backward to come). Under --cp a rank keeps its own tokens' share."""
    seen, total = set(), [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = local_part(t).untyped_storage()
        weight = isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)  # a weight, or a view of one
        if not weight and (key := (storage.data_ptr(), str(t.device))) not in seen:
            seen.add(key)
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def measure_memory(d: Dist, kit: ModelKit, model: Layout, optimizer: torch.optim.Optimizer, predicted: dict,
                   activations: list[int] | None = None) -> list[dict]:  # fmt: skip
    """Every rank's parameters, gradients (with ManualDDP's buckets) and optimizer state in bytes, and its
    peaks. A collective."""
    counted: set[tuple[int, str]] = set()

    def storage_bytes(tensors: Iterator[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            storage = local_part(t).untyped_storage()
            if (key := (storage.data_ptr(), str(t.device))) not in counted:
                counted.add(key)
                total += storage.nbytes()
        return total

    params = list(kit.trained.parameters())
    # ZeRO-1 (torch's and ours) steps an inner optimizer that holds this rank's share of the state.
    state = (optimizer_share(optimizer) or optimizer).state.values()
    try:
        import resource  # POSIX only; ru_maxrss is in bytes on macOS, KiB on Linux

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    except ImportError:
        rss = 0
    cuda = torch.cuda.max_memory_allocated(d.device) if d.device.type == "cuda" else None
    mine = {
        "rank": d.rank,
        "parameters": storage_bytes(iter(params)),
        "gradients": storage_bytes([*(p.grad for p in params if p.grad is not None), *gradient_buffers(model)]),
        "optimizer_state": storage_bytes(t for s in state for t in s.values() if torch.is_tensor(t)),
        "activations": activations[0] if activations else None,  # one micro-batch's (saved_for_backward)
        "peak": rss if cuda is None else cuda,  # the peak CUDA allocation on a GPU, else the peak resident set
        "peak_rss": rss,
        "holds": holdings(model),
        **predicted,
    }
    ranks = [mine]
    if d.distributed:
        ranks = [{} for _ in range(d.world_size)]
        dist.all_gather_object(ranks, mine, group=d.control)
    return ranks


def describe_memory(cfg: RunConfig, d: Dist, ranks: list[dict]) -> str:
    keys = ("parameters", "gradients", "optimizer_state")
    strategy = cfg.sharding if d.distributed else "none (one process)"
    lines = [
        f"[memory] per rank, MiB, measured (predicted by the ZeRO arithmetic for --sharding {strategy}, "
        f"N={d.replicas}{' replicas of the split model' if d.tp * d.pp > 1 else ''}; weights, gradients and moments in "
        "the weights' dtype, no padding):",
        f"  rank  {'parameters':>18}  {'gradients':>18}  {'optimizer state':>18}  {'state vs predicted':>18}  "
        f"{'largest unit':>12}  {'activations':>11}  {'peak ' + ('CUDA' if d.device.type == 'cuda' else 'RSS'):>10}",
    ]
    for r in ranks:
        measured, predicted = sum(r[k] for k in keys), sum(r["predicted"][k] for k in keys)
        cells = [f"{mib(r[k])} ({mib(r['predicted'][k])})" for k in keys]
        off = f"{100 * (measured - predicted) / predicted:+.1f}%" if predicted else "-"
        lines.append(f"  {r['rank']:>4}  {cells[0]:>18}  {cells[1]:>18}  {cells[2]:>18}  {off:>18}  "
                     f"{mib(r['largest_unit']) if r['largest_unit'] else '-':>12}  "
                     f"{mib(r['activations']) if r['activations'] else '-':>11}  {mib(r['peak']):>10}")  # fmt: skip
    if d.tp * d.pp > 1:  # model splitting: what each rank holds of its replica's model
        lines += [f"  rank {r['rank']} holds {r['holds']}" for r in ranks]
    return "\n".join(lines)


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f}"


def describe_traffic(cfg: RunConfig, d: Dist, traffic: dict[str, tuple[float, float]]) -> str:
    """What rank 0's collectives moved per optimizer step, by kind (calls, MiB), and which crossed nodes."""
    shown = "; ".join(f"{kind} {calls:g} call(s), {mib(nbytes)} MiB" for kind, (calls, nbytes) in traffic.items())
    unseen = [what for what, on in (("fully_shard", cfg.sharding == "full"), ("ZeroRedundancyOptimizer",
              cfg.sharding == "optimizer"), ("tensor parallelism", cfg.tp > 1), ("pipelining", cfg.pp > 1))
              if on and cfg.ddp == "torch"]  # fmt: skip
    # Said first: after "nothing", a note reads as if torch's sharding sent nothing.
    unseen_note = f"collectives of torch's {' and '.join(unseen)}: not counted (out of this script's sight); the rest: "
    replica, spans = d.tp * d.pp * d.cp, d.world_size > d.local_world_size
    crossing = ("every collective (a replica's ranks span nodes)" if d.local_world_size % replica else
                f"the data-parallel ones alone (each replica's {replica} ranks share a node)" if replica > 1 else
                "every collective (each rank is a replica of its own)")  # fmt: skip
    return f"rank 0, per step: {unseen_note if unseen else ''}{shown or 'nothing'}" + (
        f"; across nodes: {crossing}" if spans else "")  # fmt: skip


def print_summary(cfg: RunConfig, d: Dist, side: SideWork, progress: Progress, wall_seconds: float,
                  outputs: list[Path]) -> dict[str, float]:  # fmt: skip
    """The run in a table, and in numbers for the trackers."""
    history, memory, tokens, seconds = progress.history, side.memory, side.reporter.tokens, side.reporter.seconds
    unit = side.reporter.unit
    last_val = next((h for h in reversed(history) if "val_loss" in h), None)
    speed = f"{tokens / seconds:,.{side.reporter.places}f} (this attempt's training steps)" if seconds else "-"
    train_loss = (
        f"{history[0]['loss']:.4f} at step {history[0]['step']} -> {history[-1]['loss']:.4f}" if history else "-"
    )
    # The memory table's own measurement: the summary and the table cannot disagree.
    cuda = d.device.type == "cuda"
    peaks = "; ".join(f"rank {r['rank']}: {r['peak_rss'] / 2**20:,.0f} MiB RSS"
                      + (f", {r['peak'] / 2**30:.2f} GiB CUDA" if cuda else "") for r in memory)  # fmt: skip
    rows = [
        ("steps", f"{progress.step:,} x global batch {global_batch(cfg, d)}"),
        (f"{unit} seen", f"{progress.tokens_seen:,}" + (" (real, non-padding)" if unit == "tokens" else "")),
        ("wall time", f"{wall_seconds:.1f} s (training steps {seconds:.1f} s)"),
        (f"{unit}/s", speed),
        ("train loss", train_loss),
        ("val loss", f"{last_val['val_loss']:.4f} at step {last_val['step']}" if last_val else "- (no held-out lines)"),
        ("peak memory", peaks),
        ("collectives", describe_traffic(cfg, d, side.traffic)),
        *([describe_trace(cfg, side.trace)] if side.trace else []),
        ("outputs", ", ".join(f"{p}/" if p.is_dir() else str(p) for p in outputs)),
    ]
    width = max(len(k) for k, _ in rows)
    say("[summary]\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows))
    numbers = {"steps": progress.step, f"{unit}_seen": progress.tokens_seen, "wall_seconds": wall_seconds,
               **{f"peak_memory_mib/rank{r['rank']}": r["peak"] / 2**20 for r in memory},
               **{f"{kind}/{what}_per_step": n for kind, sent in side.traffic.items()
                  for what, n in zip(("calls", "bytes"), sent, strict=True)}}  # fmt: skip
    if seconds:
        numbers[f"{unit}_per_sec"] = tokens / seconds
        if side.reporter.peak:
            numbers["mfu"] = tokens / seconds * side.reporter.flops_per_token / (side.reporter.peak * d.world_size)
    return numbers


# ----------------------------------------------------------------------------------------------
# 17. Save: rank 0 writes while the others wait for it; locks, checkpoints and resume, stop markers
# ----------------------------------------------------------------------------------------------


def load_tiny_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> TinyTransformer:
    """Rebuild the trained tiny model from its checkpoint file alone."""
    ckpt = torch.load(path, map_location=map_location, weights_only=True)
    model = TinyTransformer(TinyConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    return model.eval()


@contextlib.contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Fill a temp folder beside `path`, then swap it in: never a half-written folder at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = path.with_name(f".{path.name}.tmp-{os.getpid()}"), path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def describe_error(error: BaseException) -> str:
    """One line for any exception: an OSError in its own words, anything else by type and text."""
    if isinstance(error, OSError):
        return " ".join(str(error).split())  # the hub's errors run over several lines
    return f"{type(error).__name__}: {first_line(error)}"


def rank0_then_share(d: Dist, what: str, work: Callable[[], object], error: type[Exception] = TrainingError) -> object:
    """Rank 0 alone runs `work`; every rank receives its result, or its failure as text, in one broadcast
    outside the rank-0 branch: every rank ends with the same one line, none waits for the timeout."""
    outcome: dict = {}
    if d.is_main:
        try:
            outcome = {"value": work()}
        except UsageError as e:
            outcome = {"usage": str(e)}
        except Exception as e:
            outcome = {"error": f"{what}: {describe_error(e)}"}
    if d.distributed:
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if "usage" in outcome:
        raise UsageError(outcome["usage"])
    if "error" in outcome:
        raise error(outcome["error"])
    return outcome["value"]


def rank0_writes(
    d: Dist, what: str, write: Callable[[], Path | None], error: type[Exception] = TrainingError
) -> Path | None:
    """Rank 0 writes while the others wait; a failed write stops every rank with one line.
    Every rank gets the path written (None: there was nothing to write)."""
    path = rank0_then_share(d, f"could not write {what}", write, error)
    if path:
        log(d, f"[save] {what}: {path}")
    return path


def prepare_outputs(cfg: RunConfig) -> None:
    """Fail at the start, not after hours of training, if rank 0 cannot write its outputs."""
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=cfg.output_dir):
        pass
    if cfg.metrics_file:
        read_metrics_records(cfg.metrics_file)  # refuses a folder or another program's file now
        cfg.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        cfg.metrics_file.touch()


class OutputLock:
    """One run per output folder: rank 0 holds OUTPUT_DIR/run.lock (flock; on Windows a locked byte) as long as
    it lives, so it ends with the process however it ends; the file's text names the holder."""

    def __init__(self) -> None:
        self.file: io.TextIOWrapper | None = None  # open for the process's lifetime: the lock lives with it
        self.made: list[Path] = []  # the folders hold() created, deepest first

    def hold(self, folder: Path) -> None:
        if self.file is not None:
            return
        self.made = [p for p in (folder, *folder.parents) if not p.exists()]
        folder.mkdir(parents=True, exist_ok=True)
        try:
            f = open(folder / "run.lock", "a+", encoding="utf-8")  # noqa: SIM115 (held, not closed)
        except FileNotFoundError:  # a run that wrote nothing removed the folder as we made it: again
            return self.hold(folder)
        try:
            lock_file(f)
        except OSError as e:
            if e.errno not in LOCK_HELD:  # this filesystem keeps no locks (some Lustre, SMB, FUSE mounts)
                f.close()
                say(
                    f"[outputs] warning: cannot lock {folder} ({describe_error(e)}): "
                    "nothing stops a second run from using it"
                )
                return
            f.seek(0)
            holder = f.read().strip() or "a run that has not yet said who it is"
            f.close()
            raise UsageError(
                f"{folder} is in use by another run ({holder}): give this run its own --output-dir, "
                "or wait for that one to end"
            ) from None
        try:
            same = os.path.samestat(os.fstat(f.fileno()), os.stat(folder / "run.lock"))
        except FileNotFoundError:
            same = False
        if not same:  # locked a run.lock that its releasing run had just removed (release): take the new one
            f.close()
            return self.hold(folder)
        f.seek(0)
        f.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        f.write(f"host {socket.gethostname()}, pid {os.getpid()}, started {started}\n")
        f.flush()
        self.file = f

    def release(self) -> None:
        """At the run's end: a run that wrote nothing in its folder leaves nothing, neither its lock nor a
        folder it made (a folder that existed before, or holds anything else, stays)."""
        if self.file is None:
            return
        lock = Path(self.file.name)
        with contextlib.suppress(OSError):  # Windows cannot remove an open file: it stays
            if [p.name for p in lock.parent.iterdir()] == [lock.name]:
                lock.unlink()  # while still held: no other run can have taken it meanwhile
                for folder in self.made:  # rmdir stops at the first that holds anything
                    folder.rmdir()
        self.file.close()
        self.file = None


def lock_file(f: io.TextIOWrapper) -> None:
    """Take the operating system's lock on f now, or raise OSError if another process has it."""
    if sys.platform == "win32":
        import msvcrt

        f.seek(LOCKED_BYTE)  # a byte past the holder's text, which others must still read
        msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
    else:
        import fcntl

        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


LOCKED_BYTE = 4096
LOCK_HELD = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES, errno.EDEADLK)  # "another process has it"
OUTPUT_LOCK = OutputLock()


METRICS_RECORD_START = b'{"step": '  # every record opens so (json.dumps keeps the key order)


def read_metrics_records(path: Path) -> list[tuple[int, bytes]]:
    """(step, line) for each record of an existing metrics file: a cut-off last line is dropped; anything
    else that is not a record means the file is not ours, and it is never overwritten."""
    if not path.exists():
        return []
    if not path.is_file():
        raise UsageError(f"--metrics-file {path} is not a file")
    *complete, last = path.read_bytes().split(b"\n")
    records = []
    for number, line in enumerate([*complete, last], 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        step = record.get("step") if isinstance(record, dict) else None
        step = step if isinstance(step, int) else None
        torn = line.startswith(METRICS_RECORD_START) or METRICS_RECORD_START.startswith(line)
        if step is None and number > len(complete) and torn:
            continue  # the last write, cut off (anywhere, even inside its opening)
        if step is None:
            raise UsageError(
                f"--metrics-file {path} is not a metrics file (line {number} is not a JSON record with a step); "
                "name a new file"
            )
        records.append((step, line))
    return records


def prepare_metrics_file(cfg: RunConfig, start_step: int) -> None:
    """A resumed run drops the records of the steps after its checkpoint; a run from step 0 moves another
    run's file aside (a torchrun restart without a checkpoint owns its first attempt's)."""
    path = cfg.metrics_file
    records = read_metrics_records(path)
    if start_step == 0 and records and restart_count() == 0:
        aside = unused_path(path.with_name(f"{path.name}.before-{time.strftime('%Y%m%d-%H%M%S')}"))
        os.replace(path, aside)
        say(f"[metrics] {path} held {len(records)} record(s) of an earlier run: moved to {aside}")
        records = []
    atomic_write(path, b"".join(line + b"\n" for step, line in records if step <= start_step))


# Full training state: everything a resumed run needs to continue bit for bit.
#
#   OUTPUT_DIR/checkpoints/step_00000040/state.pt       weights (tiny) or adapters (hf), optimizer,
#                                                      progress, every rank's RNG, the run's settings
#   OUTPUT_DIR/checkpoints/step_00000040/manifest.json  SHA-256 of state.pt, written last
#
# A folder without a manifest, or whose state.pt does not match it, is not a checkpoint: a
# write interrupted at any point is never mistaken for one, and a damaged file is refused.

CHECKPOINT_FORMAT = 1


def capture_rng(d: Dist) -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(d.device) if d.device.type == "cuda" else None,
    }


def restore_rng(state: dict, d: Dist) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], d.device)


# Settings a resumed run may change: --max-steps grows to train a finished run further (the
# schedule is then recomputed for the new length, and the resume says so).
MAY_CHANGE_ON_RESUME = ("max_steps",)
# How the global batch is split may change on resume, the global batch itself may not. Rank r
# of W takes every W-th example, so every split of the same global batch trains each step on
# the same examples (tests/test_gradients.py): 2 ranks x 4 continue as 1 rank x 8, as a
# checkpoint from any --sharding, --tp, --pp or --cp continues under any other (replicas, not ranks,
# split the data: the ranks of a split model share one replica's batch).
BATCH_SPLIT = ("world_size", "tp", "pp", "cp", "batch_size", "grad_accum_steps")


def may_change(key: str, saved: dict, settings: dict) -> bool:
    if key in MAY_CHANGE_ON_RESUME:
        return True
    if key == "model_name_or_path":  # one local folder, named as typed or whole (config.yaml writes it whole)
        return len({Path(s[key]).expanduser().resolve() for s in (saved, settings)}) == 1
    if global_batch_of(saved) != global_batch_of(settings) or settings.get("loss_normalization") != "global-tokens":
        return False  # (a mean of per-rank means weighs tokens by how the batch is split)
    # The same global batch, split anew: and with another number of ranks, another way for them
    # to talk (a plain process has no backend at all; 2 Gloo ranks resume as one).
    return key in BATCH_SPLIT or (key == "backend" and saved.get("world_size") != settings.get("world_size"))


def global_batch_of(settings: dict) -> int | None:
    """Replicas x batch x micro-steps: the ranks of a split model (--tp x --pp x --cp) share one replica's batch."""
    split = {"tp": 1, "pp": 1, "cp": 1} | settings  # written before model splitting: one rank a replica
    if not all(k in split for k in BATCH_SPLIT):
        return None
    ranks = split["tp"] * split["pp"] * split["cp"]
    return split["world_size"] // ranks * split["batch_size"] * split["grad_accum_steps"]


def run_settings(cfg: RunConfig, d: Dist, kit: ModelKit) -> dict:
    """The settings that decide which example lands in which step, what the model is and how each step
    updates it: a resume that changes one is refused. What only watches or paces the run stays free,
    --max-steps may grow (MAY_CHANGE_ON_RESUME), and so may the layout (BATCH_SPLIT, --sharding)."""
    model = ("d_model", "n_heads", "n_layers", "dropout") if cfg.model == "tiny" else (
        "model_name_or_path", "finetune", "lora_r", "lora_alpha", "lora_dropout", "attn_implementation")  # fmt: skip
    taken = ("model", "tp", "pp", "batch_size", "grad_accum_steps", "seq_len", "seed", "optimizer", "lr", "min_lr",
             "warmup_steps", "weight_decay", "grad_clip", "loss_normalization", "max_steps", "grad_compression",
             "ddp", *model)  # fmt: skip
    settings = {k: getattr(cfg, k) for k in taken} | {
        "world_size": d.world_size,
        "training_data_sha256": kit.train.digest(),
        # How each step is computed: the numbers differ in their last bits or more when these do.
        # (An explicit --precision is taken as written: fp16 on a CPU is refused by train() on every
        # rank, and this runs on rank 0 alone, where a refusal would leave the others waiting.)
        "precision": choose_precision(cfg, d) if cfg.precision == "auto" else cfg.precision,
        "backend": d.backend,
        "device": d.device.type,
    }
    if d.device.type == "cuda":
        settings["tf32"] = cfg.tf32
    if cfg.cp > 1:  # recorded where it splits: a checkpoint of a run before --cp resumes as it always did
        settings["cp"] = cfg.cp
    if cfg.objective == "dpo":  # (as --cp: an SFT checkpoint records neither)
        settings |= {"objective": cfg.objective, "dpo_beta": cfg.dpo_beta}
    if cfg.model == "hf":  # as loaded: the targets a list, auto resolved
        settings |= {"lora_targets": list(cfg.lora_targets), "attn_implementation":
                     causal_lm(kit.model).config._attn_implementation,
                     "dtype": str(choose_weights_dtype(cfg, d)).removeprefix("torch.")}  # fmt: skip
    return settings


class StateSaver:
    """Saves the full training state at the current step, once: a stop right after a save has that
    checkpoint already. `settings` (run_settings, rank 0 only) go into every checkpoint."""

    def __init__(self, cfg: RunConfig, d: Dist, settings: dict, saved_step: int | None) -> None:
        self.cfg, self.d, self.settings, self.saved_step = cfg, d, settings, saved_step  # the step on disk

    def save(self, model: Layout, named_params: list, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler | None, progress: Progress) -> None:  # fmt: skip
        """A collective: every rank's RNG states and the whole state, on rank 0, which alone writes."""
        cfg, d, step = self.cfg, self.d, progress.step
        if step == self.saved_step:
            return
        rng: list = [capture_rng(d)]
        if d.distributed:
            rng = [None] * d.world_size if d.is_main else None
            dist.gather_object(capture_rng(d), rng, dst=0)
        # Trainable weights only: the whole tiny model, or just the LoRA adapters (the frozen
        # base comes back from --model-name-or-path).
        trainable, optimizer_state = rank0_state(model, d, named_params, optimizer)
        state = {
            "format": CHECKPOINT_FORMAT,
            "progress": asdict(progress),
            "trainable": trainable,
            "optimizer": optimizer_state,
            "scaler": scaler.state_dict() if scaler else None,
            "rng": rng,  # indexed by rank: each rank's dropout stream continues where it was
            "settings": self.settings,
        }

        def write() -> Path:
            folder = cfg.output_dir / "checkpoints" / f"step_{step:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            data = io.BytesIO()
            torch.save(state, data)
            if due_fault(cfg, d, step, ("save",)):  # teaching aid: die with half a file on disk
                (folder / f".state.pt.tmp-{os.getpid()}").write_bytes(data.getvalue()[: len(data.getvalue()) // 2])
                crash_on_purpose("kill", d, step)
            atomic_write(folder / "state.pt", data.getvalue())
            manifest = {"format": CHECKPOINT_FORMAT, "step": step, "sha256": {"state.pt": sha256(data.getvalue())}}
            atomic_write(folder / "manifest.json", json.dumps(manifest, indent=1).encode())  # the completion marker
            prune_checkpoints(cfg)
            return folder

        rank0_writes(d, f"training state at step {step}", write)
        self.saved_step = step


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def checkpoint_step(folder: Path) -> int | None:
    name = folder.name.removeprefix("step_")
    return int(name) if folder.name.startswith("step_") and name.isdigit() else None


def checkpoint_folders(root: Path) -> list[Path]:
    """Every step_* folder, highest step first (complete or not)."""
    folders = [f for f in root.glob("step_*") if f.is_dir() and checkpoint_step(f) is not None]
    return sorted(folders, key=checkpoint_step, reverse=True)


def verified_state_bytes(folder: Path) -> bytes:
    """state.pt's bytes once they match the manifest; otherwise UsageError saying what the folder is."""
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is a file, not a checkpoint folder"
        raise UsageError(f"{folder} {what} (--resume takes auto, none, or a checkpoints/step_* folder)")
    if not (folder / "manifest.json").exists():
        if (folder / "checkpoints").is_dir() or checkpoint_folders(folder):
            raise UsageError(f"{folder} holds checkpoints but is not one: name one of its step_* folders")
        if checkpoint_step(folder) is None:
            raise UsageError(f"{folder} is not a checkpoint folder (no manifest.json, and not named step_*)")
        raise UsageError(f"{folder} is incomplete (no manifest.json: its write was interrupted)")
    try:
        digest = json.loads((folder / "manifest.json").read_bytes())["sha256"]["state.pt"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"{folder} is damaged: its manifest.json is not a checkpoint manifest") from None
    try:
        data = (folder / "state.pt").read_bytes()
    except OSError as e:
        raise UsageError(f"{folder} cannot be read: {e.strerror}") from None
    if sha256(data) != digest:
        raise UsageError(f"{folder} is damaged: state.pt does not match the SHA-256 in its manifest")
    return data


def read_checkpoint(folder: Path) -> dict:
    """Load a checkpoint folder, or raise UsageError saying why it is not a usable one."""
    data = verified_state_bytes(folder)
    try:
        # weights_only: a checkpoint is data, and loading it must never run code from the file.
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(
            f"{folder}: state.pt matches its manifest but is not a training state this script wrote "
            f"({type(e).__name__} while loading it as plain data)"
        ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise UsageError(f"{folder}: state.pt is not a training state of this script (format {CHECKPOINT_FORMAT})")
    return state


def prune_checkpoints(cfg: RunConfig) -> None:
    """Keep the newest --keep-last *verified* checkpoints (state.pt matching its manifest): a damaged folder
    never pushes a good one out. Older ones and older debris go."""
    folders, verified = checkpoint_folders(cfg.output_dir / "checkpoints"), []
    for folder in folders:
        with contextlib.suppress(UsageError):
            verified_state_bytes(folder)
            verified.append(folder)
    if not verified:
        return
    newest = checkpoint_step(verified[0])
    for folder in folders:
        if folder not in verified[: cfg.keep_last] and checkpoint_step(folder) < newest:
            shutil.rmtree(folder, ignore_errors=True)


def choose_checkpoint(cfg: RunConfig, settings: dict, final_name: str) -> dict | None:
    """The checkpoint state to resume from, or None (rank 0 reads, and broadcasts): --resume, except that an
    attempt torchrun restarted continues from the newest checkpoint this job wrote."""
    root, mode = cfg.output_dir / "checkpoints", cfg.resume
    if mode != "auto" and restart_count() > 0:
        say(f"[resume] torchrun restarted the job: --resume {cfg.resume} was for its first attempt; using auto")
        mode = "auto"
    if mode == "none":
        keep_a_finished_model(cfg, final_name)
        if root.exists():
            # Starting over must not mix this run's checkpoints with an earlier run's.
            aside = unused_path(cfg.output_dir / f"checkpoints.before-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(root, aside)
            say(f"[resume] --resume none: moved the earlier run's checkpoints to {aside}")
        return None
    if mode == "auto":
        folder, state = newest_usable_checkpoint(root)
        if state is None:
            keep_a_finished_model(cfg, final_name)
            return None
    else:
        folder = Path(cfg.resume)
        if folder.name in ("state.pt", "manifest.json"):
            folder = folder.parent
        state = read_checkpoint(folder)
    check_same_run(state, settings, folder)
    step = state["progress"]["step"]
    if step >= cfg.max_steps and (cfg.output_dir / final_name).exists():  # the same command again, after the end
        say(f"[resume] {folder} is this run's last step and its model is saved: nothing to do")
        return state | {"finished": True}
    newest = " the newest complete checkpoint" if mode == "auto" else ""
    say(f"[resume] continuing from {folder} (step {step},{newest})".replace(",)", ")"))
    retire_newer_checkpoints(cfg, step)
    if (saved_max_steps := state["settings"].get("max_steps", cfg.max_steps)) != cfg.max_steps:
        before = lr_at(replace(cfg, max_steps=saved_max_steps), step)
        say(f"[resume] --max-steps {cfg.max_steps} (the checkpoint's run had {saved_max_steps}): the schedule now "
            f"spans {cfg.max_steps} steps, so the lr goes from {before:.3g} at step {step} to "
            f"{lr_at(cfg, step + 1):.3g} at step {step + 1}")  # fmt: skip
    return state


def keep_a_finished_model(cfg: RunConfig, final_name: str) -> None:
    """A run from step 0 in a folder holding a finished run's model would replace it: a folder the user named
    is refused (without --overwrite); the shared default keeps the earlier model under another name."""
    final = cfg.output_dir / final_name
    if not final.exists() or cfg.overwrite or restart_count() > 0:
        return
    if cfg.output_dir != DEFAULT_OUTPUT_DIR:
        raise UsageError(f"{cfg.output_dir} already holds a finished run's model ({final}); this run would replace "
                         "it: give it its own --output-dir, or pass --overwrite")  # fmt: skip
    aside = unused_path(final.with_name(f"{final.stem}.before-{time.strftime('%Y%m%d-%H%M%S')}{final.suffix}"))
    os.replace(final, aside)
    say(f"[outputs] {final} was an earlier run's finished model: moved to {aside} (an --output-dir of its own keeps "
        "a run apart)")  # fmt: skip


def unused_path(path: Path) -> Path:
    """`path`, or path-2, path-3, ... if it exists (names carry the time to the second only)."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def newest_usable_checkpoint(root: Path) -> tuple[Path | None, dict | None]:
    """The newest checkpoint that passes its check. Having none is fine when there were only
    interrupted writes (nothing was lost), and an error when complete ones were damaged."""
    folders, damaged = checkpoint_folders(root), []
    for folder in folders:
        try:
            return folder, read_checkpoint(folder)
        except UsageError as e:
            say(f"[resume] skipping {e}")
            if (folder / "manifest.json").exists():
                damaged.append(folder.name)
    if damaged:
        raise UsageError(
            f"no usable checkpoint in {root}: {', '.join(damaged)} failed their check and no older one passed; "
            "repair or remove them, or pass --resume none to start over (it moves them aside)"
        )
    if folders:
        say(f"[resume] no complete checkpoint in {root}, only interrupted writes: starting from step 0")
    return None, None


def retire_newer_checkpoints(cfg: RunConfig, step: int) -> None:
    """Continuing from `step` abandons every checkpoint after it: set those aside, so that a
    later --resume auto can never pick up the abandoned line (and pruning never weighs it)."""
    newer = [f for f in checkpoint_folders(cfg.output_dir / "checkpoints") if checkpoint_step(f) > step]
    debris = [f for f in newer if not (f / "manifest.json").exists()]  # interrupted writes: nothing to keep
    for folder in debris:
        shutil.rmtree(folder, ignore_errors=True)
    kept = [f for f in newer if f not in debris]
    if kept:
        aside = unused_path(cfg.output_dir / f"checkpoints.abandoned-{time.strftime('%Y%m%d-%H%M%S')}")
        aside.mkdir(parents=True)
        for folder in kept:
            os.replace(folder, aside / folder.name)
        say(f"[resume] {len(kept)} checkpoint(s) after step {step} belong to the abandoned run: moved to {aside}")


def check_same_run(state: dict, settings: dict, folder: Path) -> None:
    saved = dict(state.get("settings", {}))
    if "model" in saved:  # a checkpoint of --model qwen resumes under --model hf, its new name
        saved["model"] = MODEL_ALIASES.get(saved["model"], saved["model"])
    unrecorded = [k for k in settings if k not in saved]
    if unrecorded:  # written by an earlier version of this script, before these were checked
        say(f"[resume] {folder} does not record {', '.join(unrecorded)}: taking this command's values")
    changed = [
        f"{k}: {saved[k]!r} then, {v!r} now"
        for k, v in settings.items()
        if k in saved and saved[k] != v and not may_change(k, saved, settings)
    ]
    if changed:
        raise UsageError(
            f"cannot resume from {folder}: it belongs to a run with other settings ({'; '.join(changed)}). "
            "Use the original settings, or --resume none, or another --output-dir"
        )


# A stop that was asked for stays a stop. The stopped ranks exit with EXIT_STOPPED, which
# torchrun --max-restarts counts as a failure: it would restart the job, the restart would
# resume, and the run would train to the end after all. So rank 0 leaves this marker, and an
# attempt that torchrun restarts after it ends at once. A new launch removes it and resumes.
STOP_MARKER = "stop_request.json"


def restart_count() -> int:
    """How many times torchrun has restarted this job (0: the first attempt, or no torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def write_stop_marker(cfg: RunConfig, d: Dist, step: int, signal_name: str) -> None:
    if d.launch is not None:
        marker = {"launch": d.launch, "restart_count": restart_count(), "step": step, "signal": signal_name}
        atomic_write(cfg.output_dir / STOP_MARKER, json.dumps(marker).encode())


def stopped_in_an_earlier_attempt(cfg: RunConfig, d: Dist) -> bool:
    path = cfg.output_dir / STOP_MARKER
    if not path.exists():
        return False
    try:
        marker = json.loads(path.read_bytes())
    except (OSError, ValueError):
        marker = None
    attempt = restart_count()
    if isinstance(marker, dict) and marker.get("launch") == d.launch and attempt > marker.get("restart_count", attempt):
        return True
    path.unlink(missing_ok=True)  # another launch: the stop is over, and resuming is what is asked now
    return False


def resume_training(
    state: dict,
    model: Layout,
    named_params: list[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    d: Dist,
) -> Progress:
    """Put a checkpoint's whole state back, in whatever layout this run holds it."""
    load_state(model, named_params, state["trainable"], optimizer, state["optimizer"])
    if scaler and state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    saved = {k: state["settings"].get(k, 1) for k in ("tp", "pp", "cp")} | {"world_size": len(state["rng"])}
    if saved == {"tp": d.tp, "pp": d.pp, "cp": d.cp, "world_size": d.world_size}:
        restore_rng(state["rng"][d.rank], d)
    else:  # the examples per step are the same; rank r's saved stream may belong to another role (run seeds)
        was, now = (f"dp {w // (tp * pp * cp)} x tp {tp} x pp {pp}" + f" x cp {cp}" * (cp > 1)
                    for tp, pp, cp, w in (saved.values(), (d.tp, d.pp, d.cp, d.world_size)))  # fmt: skip
        log(d, f"[resume] saved by {saved['world_size']} rank(s), resumed by {d.world_size} ({was} -> {now}): every "
               "random stream (dropout) starts afresh, seeded as a fresh run of this layout seeds it")  # fmt: skip
    return Progress(**state["progress"])


# ----------------------------------------------------------------------------------------------
# 18. Main: launch -> connect -> shard -> train -> sync -> save -> sample
# ----------------------------------------------------------------------------------------------


def run(cfg: RunConfig, d: Dist, started: float) -> None:
    log(d, f"[launch] {d.world_size} process(es); this is rank {d.rank} (local rank {d.local_rank})")
    log(d, f"[connect] backend {d.backend or 'none'} on {d.device}: {d.why}")
    if nodes := describe_nodes(d):
        log(d, nodes)
        threading.Thread(target=beat, args=(d.rank,), daemon=True).start()  # for stalled_ranks, should a node go
    if not cfg.show_examples:  # first: before this run reads or clears anything in the folder
        rank0_then_share(d, "could not write the outputs", lambda: OUTPUT_LOCK.hold(cfg.output_dir), UsageError)
    if rank0_then_share(d, "could not read the stop marker", lambda: stopped_in_an_earlier_attempt(cfg, d)):
        log(d, "[stop] torchrun restarted the job after a requested stop: it stays stopped; run it again to resume")
        tell_torchrun("stopped on request in an earlier attempt (exit code 3): run the command again to resume")
        raise SystemExit(EXIT_STOPPED)
    if d.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32  # fp32 matmuls on tensor cores: ~10 bits of mantissa
    warn_if_bf16_is_emulated(cfg, d)
    if d.device.type == "cpu" and d.local_world_size > (cores := usable_cores()):
        log(d, f"[run] warning: {d.local_world_size} ranks on this machine share its {cores} CPU core(s): each "
               f"computes at a fraction of a core's speed; {cores} or fewer ranks train faster")  # fmt: skip
    if cfg.show_examples:
        print_examples(cfg, d, first_records(cfg, cfg.show_examples))
        return
    # The corpus as tokens, built into the token cache once; batches read their rows from it (open_corpus).
    folder = resolve_model_files(cfg, d) if cfg.model == "hf" else None
    corpus, held = open_corpus(cfg, d, folder), None
    if cfg.eval_file:  # the held-out data's own file, through the token cache as the training data's
        training, val = corpus, open_corpus(replace(cfg, corpus_file=cfg.eval_file, dataset=None), d, folder, "eval")
    else:
        held = held_out(len(corpus), cfg.val_fraction, cfg.seed)
        training, val = corpus.subset(~held), corpus.subset(held)
    for data, what in ((training, "the training data"), (val, "the held-out data")):
        if len(data) and (data.fmt == "preference") != (cfg.objective == "dpo"):  # before the model is loaded
            raise UsageError(f"{what} holds preference records (chosen, rejected): add --objective dpo" if cfg.objective
                             == "sft" else f"--objective dpo trains on preference records (chosen, rejected), and "
                             f"{what} holds {describe_records(data.fmt)}")  # fmt: skip
    kit = (build_pretrained_kit if cfg.model == "hf" else tiny_kit)(cfg, d, training, val)
    # Initialisation used --seed alone: the replicas start identical. Dropout must not: W ranks
    # dropping the same units of their different examples is not one process with a W-times batch.
    # A tensor-parallel group's ranks compute one replica's activations together: one seed for them.
    torch.manual_seed(cfg.seed + d.seed_offset)
    log(
        d,
        f"[data] {cfg.dataset or cfg.corpus_file}: {len(training)} training {describe_records(corpus.fmt)} -> "
        f"{len(kit.train)} examples of {cfg.seq_len} tokens{'; ' + kit.data_report if kit.data_report else ''}; "
        f"{len(val)} held out for validation{f' (--eval-file {cfg.eval_file})' if cfg.eval_file else ''}",
    )
    log(d, f"[model] {kit.describe}")
    cfg = steps_for_epochs(cfg, d, kit)
    if kit.val is not None:
        log(d, describe_evaluation(cfg, d, len(kit.val)))
    if warmup_note := describe_warmup(cfg):
        log(d, warmup_note)

    def figure(name: str, draw: Callable[[object], object]) -> Path | None:  # rank 0 draws it; its failure ends all
        return rank0_then_share(d, f"could not draw {name}", lambda: write_figure(cfg, name, draw))

    rank0_writes(d, "the outputs", lambda: prepare_outputs(cfg), error=UsageError)
    settings = run_settings(cfg, d, kit) if d.is_main else {}  # what a checkpoint must match to resume
    choose = functools.partial(choose_checkpoint, cfg, settings, kit.final_name)
    resume = rank0_then_share(d, "could not read the checkpoint", choose, UsageError)
    if resume and resume.get("finished"):  # its outputs stay as the run left them
        return
    if cfg.metrics_file:
        start = resume["progress"]["step"] if resume else 0
        rank0_writes(d, "the metrics file", lambda: prepare_metrics_file(cfg, start), error=UsageError)
    prompts = sample_prompts(cfg, corpus.chat, held) if cfg.sample_every and d.is_main else []
    hooks = SideWork(cfg, d, kit, resume, settings, prompts)
    model, progress = train(cfg, d, kit, hooks)
    step = progress.step
    # Also after a stop: the steps it traced are worth seeing.
    trace_file = rank0_writes(d, "the trace", lambda: write_trace(cfg, hooks.trace)) if cfg.trace_steps else None
    if cfg.trace_steps and not trace_file:
        log(d, "[trace] no step ended: nothing to write")
    if hooks.stopped_by:
        rank0_writes(d, "the stop marker", lambda: write_stop_marker(cfg, d, step, hooks.stopped_by))
        again = "the same command resumes there" if cfg.resume == "auto" else "--resume auto resumes there"
        hooks.reporter.trackers.finish({}, step)
        log(d, f"[stop] {hooks.stopped_by}: every rank stopped after step {step}; {again}")
        tell_torchrun(f"stopped cleanly by {hooks.stopped_by} after step {step}, checkpoint written (exit code 3)")
        raise SystemExit(EXIT_STOPPED)
    outputs = [cfg.output_dir / kit.final_name]
    whole = whole_state_dict(model, d, kit.model)  # sharded or split: gathered, on rank 0
    rank0_writes(d, kit.final_label, lambda: kit.save_final(kit.model, step, whole))
    if cfg.merge_lora is not None:  # from the adapters just saved, whatever the layout that trained them
        outputs.append(rank0_writes(d, "the merged model", lambda: merge_adapters(cfg, outputs[0])))
    if cfg.plot:
        outputs.append(figure("loss.png", functools.partial(loss_figure, cfg=cfg, history=progress.history)))
    outputs.append(trace_file)
    if cfg.plot and trace_file:
        outputs.append(figure("timeline.png", functools.partial(timeline_figure, cfg=cfg, ranks=hooks.trace)))
    memory = json.dumps(hooks.memory, indent=1).encode()
    rank0_then_share(d, "could not write memory.json", lambda: atomic_write(cfg.output_dir / "memory.json", memory))
    written = [cfg.output_dir / name for name in ("config.yaml", "checkpoints", *TRACKERS)]  # trackers: a folder each
    outputs = [p for p in [*outputs, cfg.output_dir / "memory.json", *filter(Path.exists, written)] if p]
    if d.is_main:
        kit.model.eval()
        # The unwrapped model: a forward through the DDP wrapper may talk to the other ranks,
        # which have moved on. Sampling is local to rank 0.
        if whole is None and d.cp == 1:
            say(f"[sample] {kit.sample(kit.model, cfg.prompt)}")
        else:  # the sharded model's forward would wait for the other ranks' shards (--cp: for the ring)
            say(sample_saved_model(kit, cfg, outputs[0]))
        if cfg.metrics_file:
            outputs.append(cfg.metrics_file)
        summary = print_summary(cfg, d, hooks, progress, time.perf_counter() - started, outputs)
        say(describe_memory(cfg, d, hooks.memory))
        hooks.reporter.trackers.finish(summary, step)


def sample_prompts(cfg: RunConfig, chat: bool, held: np.ndarray | None) -> list[str]:
    """--sample-every's prompts: --prompt, and on chat data the first user turn of the first three held-out
    records (--eval-file's, or those --val-fraction held out)."""
    picks = (np.arange(3) if held is None else np.flatnonzero(held)[:3]) if chat else []
    source = replace(cfg, corpus_file=cfg.eval_file, dataset=None) if cfg.eval_file else cfg
    records = first_records(source, int(picks[-1]) + 1) if len(picks) else []
    users = [next((t for role, t in records[i].messages or () if role == "user"), None) for i in picks[: len(records)]]
    return [cfg.prompt, *filter(None, users)]


def sample_now(cfg: RunConfig, kit: ModelKit, prompts: list[str], device: torch.device) -> list[str]:
    """--sample-every: rank 0's model answers each prompt, the training's random streams left as they were."""
    kit.model.eval()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed)  # the same draws at every sampling step: only the model changed
        samples = [kit.sample(kit.model, prompt) for prompt in prompts]
    kit.model.train()
    return samples


def sample_saved_model(kit: ModelKit, cfg: RunConfig, path: Path) -> str:
    """Under --sharding full no rank holds the whole model: rank 0 reads back what it saved and
    samples from that (which also shows the saved output works)."""
    try:
        model = kit.reload(path).eval()
    except torch.OutOfMemoryError:
        return f"[sample] none: {path} does not fit beside the sharded model on rank 0's device"
    return f"[sample] (from {path}, read back) {kit.sample(model, cfg.prompt)}"


def steps_for_epochs(cfg: RunConfig, d: Dist, kit: ModelKit) -> RunConfig:
    """--epochs E: the run's length in steps, settled once the data is built; --max-steps still caps."""
    if not cfg.epochs:
        return cfg
    # What the loader will give: the sampler's drop_last shard, whole batches, whole steps.
    per_epoch = len(kit.train) // d.dp // cfg.batch_size // cfg.grad_accum_steps
    steps = min(cfg.max_steps or math.inf, cfg.epochs * per_epoch)
    capped = f", capped by --max-steps {cfg.max_steps}" if steps < cfg.epochs * per_epoch else ""
    log(d, f"[run] --epochs {cfg.epochs} x {per_epoch} steps per epoch = {steps} steps{capped}")
    return replace(cfg, max_steps=steps)


EXIT_USAGE = 2  # bad input: flags, files, hardware (a UsageError)
EXIT_STOPPED = 3  # stopped cleanly by a signal, checkpoint written, not finished
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
PEER_SILENT = ("Timed out", "timed out", "Timeout", "timeout caused pair closure")  # (the last: Gloo's, under load)


def report_error(message: str, every_rank: bool = False, after_peer: bool = False) -> None:
    # Input errors are identical on every rank: under torchrun one line per machine is enough.
    # A lost peer is seen differently by each rank, so each says it; and a process that
    # torchrun did not start (whatever its LOCAL_RANK says) has no one to speak for it.
    if every_rank or os.environ.get("LOCAL_RANK", "0") == "0" or "TORCHELASTIC_RUN_ID" not in os.environ:
        print(f"error: {message}", file=sys.stderr, flush=True)
    tell_torchrun(f"error: {message}", later=after_peer)


def tell_torchrun(line: str, later: bool = False) -> None:
    """Leave the line in this rank's error file (as @record does for an uncaught exception), where torchrun
    finds the "root cause": the earliest stamp. A rank that only lost a peer stamps a second `later`."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"py_callstack": line, "timestamp": str(int(time.time()) + later)}
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps({"message": {"message": line, "extraInfo": info}}))


def leave_finished() -> None:
    """Exit 0 without the interpreter's shutdown, whose C++ destructors of torch's communication threads abort a
    finished run about once in a few hundred ("terminate called without an active exception")."""
    teardown_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def report_failure(error: Exception, cfg: RunConfig | None, d: Dist | None) -> int:
    """Say what ended the run in one line, and return its exit code; an error that is not one of
    these (a bug) is raised again, for its traceback. `d` is None before the process group exists."""
    if isinstance(error, UsageError):
        report_error(str(error))
        return EXIT_USAGE
    if isinstance(error, TrainingError):  # before the process group, every rank has its own reason
        report_error(str(error), every_rank=d is None)
        return 1
    # A collective that failed because another rank went away (it crashed, was killed, or hung) is
    # not this rank's fault: say so in one line, on every rank (each saw it from its own side); the
    # failed rank's own error and torchrun's summary say what happened there.
    silent = any(sign in str(error) for sign in PEER_SILENT)
    if not (d and d.distributed and (isinstance(error, dist.DistError) or silent or any(
            sign in str(error) for sign in PEER_GONE))):  # fmt: skip
        raise error
    stalled = stalled_ranks() if NODES else set()  # (one node: no beats to read)
    nodes = {node: {r for r, n in NODES.items() if n == node} for node in NODES.values()}
    if silent:
        gone = "".join(f"; {node} does not answer at all: its host or link is down" for node, ranks in nodes.items()
                       if stalled is not None and ranks <= stalled)  # fmt: skip
        gone += "; this rank cannot reach the rendezvous store either: its link, or the store's host, is down" * (
            stalled is None)  # fmt: skip
        report_error(f"rank {d.rank}: another rank did not answer within --timeout-s {cfg.timeout_s:g} (it hung, "
                     f"or is far slower{gone}): {first_line(error)}", every_rank=True, after_peer=True)  # fmt: skip
    else:
        who = " and ".join(node for node, ranks in nodes.items() if ranks & (stalled or set())) or "another rank"
        report_error(f"rank {d.rank} lost contact with {who}, which probably failed first: {first_line(error)}",
                     every_rank=True, after_peer=True)  # fmt: skip
    return 1


def refuse_missing_inputs(cfg: RunConfig) -> None:
    """What each rank can find missing alone, refused as quickly as a bad flag: before the process group."""
    check_socket_interfaces()
    if cfg.dataset:
        datasets_library()
    else:
        check_readable(cfg.corpus_file)
    if cfg.eval_file:
        check_readable(cfg.eval_file, "--eval-file")
    if cfg.model == "hf":
        local_model_folder(cfg.model_name_or_path)


@record  # a rank's uncaught exception is written where torchrun can show it as the root cause
def main(argv: list[str] | None = None) -> None:
    started = time.perf_counter()
    # Training drives some gradients into denormal floats (below 1.2e-38), which x86 CPUs compute
    # in slow microcode: without this, backward here slowed 1.8x after ~100 steps. Values that
    # small carry nothing a model can learn from. Set before the process group starts its threads.
    torch.set_flush_denormal(True)
    cfg = d = None
    try:
        cfg = parse_args(argv)
        if (cfg.merge_lora or cfg.chat) and __name__ == "__main__":  # Ctrl-C as Python has it: the merge cleaned up
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if cfg.merge_lora:  # an adapter folder given: merge it, and nothing else
            OUTPUT_LOCK.hold(cfg.output_dir)
            try:
                replaced = " (the one there replaced)" if (cfg.output_dir / "merged").exists() else ""
                say(f"[save] the merged model{replaced}: {merge_adapters(cfg, Path(cfg.merge_lora))}")
            except Exception as e:  # its base gone, a damaged file, a full disk: one line, as a run's failures
                raise TrainingError(f"could not merge {cfg.merge_lora}: {describe_error(e)}") from None
            return
        if cfg.chat:
            words = sys.argv[1:] if argv is None else list(argv)
            asked = any(w.split("=", 1)[0] == "--prompt" for w in words)
            try:
                return chat_with(cfg, interactive=not asked)  # turns typed, or piped in, until an empty line
            except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: the talk ends
                return print()
            except UsageError:
                raise
            except Exception as e:
                raise TrainingError(f"--chat {cfg.chat}: {describe_error(e)}") from None
        refuse_missing_inputs(cfg)
        if cfg.nproc:
            raise SystemExit(launch_local_ranks(cfg, sys.argv[1:] if argv is None else list(argv)))
        if launched_by_torchrun():
            check_rank_variables()
        d = laid_out(setup_distributed(cfg, rendezvous_store), cfg)  # the ranks as a grid, for any model split
        STOP.install()
        end_with_the_launcher()
        run(cfg, d, started)
    except (UsageError, TrainingError, RuntimeError) as e:
        raise SystemExit(report_failure(e, cfg, d)) from None
    finally:
        OUTPUT_LOCK.release()
        teardown_distributed()


if __name__ == "__main__":
    main()
    leave_finished()
