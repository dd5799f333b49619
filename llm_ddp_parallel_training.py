"""Train a causal language model across processes with PyTorch DistributedDataParallel.

One file, read top to bottom, follows one training run:

    1. Settings      the command line becomes one frozen RunConfig
    2. Launch        torchrun starts one process per rank; each reads its rank from the environment
    3. Connect       the ranks join a process group (NCCL on Linux GPUs, Gloo on CPU)
    4. Shard         a DistributedSampler hands every rank a disjoint slice of each epoch
    5. Train         forward and backward on the local slice; DDP all-reduces the gradients
    6. Sync          every rank applies the same averaged gradient, so the replicas stay identical
    7. Save          rank 0 alone writes the checkpoint while the others wait at a barrier

Run it as one plain process, or under torchrun on one or many machines:

    python llm_ddp_parallel_training.py --cpu --max-steps 20
    torchrun --standalone --nproc_per_node=2 llm_ddp_parallel_training.py --cpu
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

if TYPE_CHECKING:  # type hints only: the tiny path never imports transformers
    from transformers import PreTrainedTokenizerBase

DEFAULT_CORPUS = Path(__file__).resolve().parent / "corpus.txt"
IGNORE_INDEX = -100  # target id that cross-entropy skips: padding never counts in the loss
NEWLINE = 10  # the byte that opens and closes every line for the byte-level model


class UsageError(Exception):
    """Bad input (flags, files, hardware): the same on every rank, reported as one line."""


class TrainingError(Exception):
    """A run-time failure that every rank agreed on (through a collective), reported as one line."""


# ----------------------------------------------------------------------------------------------
# 1. Settings: the command line becomes one frozen RunConfig
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    model: str
    corpus_file: Path
    output_dir: Path
    seed: int
    seq_len: int
    # tiny model shape
    d_model: int
    n_heads: int
    n_layers: int
    dropout: float
    # Qwen + LoRA
    model_name_or_path: str
    lora_r: int
    lora_alpha: float
    lora_dropout: float
    lora_targets: tuple[str, ...]
    dtype: str
    trust_remote_code: bool
    gradient_checkpointing: bool
    # optimisation
    batch_size: int
    max_steps: int
    lr: float
    weight_decay: float
    # hardware and process group
    backend: str
    cpu: bool
    timeout_s: float
    # reporting
    log_every: int
    prompt: str
    sample_tokens: int


class _Parser(argparse.ArgumentParser):
    # argparse prints a usage wall and exits; every rank would do it. Raise instead, report once.
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be zero or a positive number, got {text}")
    return value


def _probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _name_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("must name at least one layer, e.g. q_proj,v_proj")
    return names


def build_arg_parser() -> argparse.ArgumentParser:
    p = _Parser(
        description="Train a byte-level causal Transformer with DistributedDataParallel.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("run")
    g.add_argument(
        "--model", choices=["tiny", "qwen"], default="tiny", help="tiny: from scratch; qwen: pretrained + LoRA"
    )
    g.add_argument(
        "--corpus-file",
        type=Path,
        default=DEFAULT_CORPUS,
        help="UTF-8 text, one training sample per line; blank lines are skipped",
    )
    g.add_argument("--output-dir", type=Path, default=Path("outputs"), help="where rank 0 writes")
    g.add_argument("--seed", type=int, default=1337, help="same on every rank: init, shuffle")

    g.add_argument("--seq-len", type=_positive_int, default=128, help="tokens per example (bytes for tiny)")

    g = p.add_argument_group("tiny model")
    g.add_argument("--d-model", type=_positive_int, default=128, help="embedding width")
    g.add_argument("--n-heads", type=_positive_int, default=4, help="attention heads")
    g.add_argument("--n-layers", type=_positive_int, default=1, help="Transformer blocks")
    g.add_argument("--dropout", type=_probability, default=0.0, help="dropout probability")

    g = p.add_argument_group("qwen + LoRA")
    g.add_argument("--model-name-or-path", default="Qwen/Qwen2.5-0.5B-Instruct", help="hub name or local folder")
    g.add_argument("--lora-r", type=_positive_int, default=8, help="rank of the low-rank update B @ A")
    g.add_argument("--lora-alpha", type=_positive_float, default=16.0, help="update scale is alpha / r")
    g.add_argument("--lora-dropout", type=_probability, default=0.05, help="dropout on the adapter input")
    g.add_argument("--lora-targets", type=_name_list, default=("q_proj", "v_proj"), help="linear layers to adapt")
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="weights dtype; auto: bfloat16 on GPUs that support it, else float32",
    )
    g.add_argument("--trust-remote-code", action="store_true", help="allow model code from the hub (Qwen2 needs none)")
    g.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute activations in backward to save memory"
    )

    g = p.add_argument_group("optimisation")
    g.add_argument("--batch-size", type=_positive_int, default=16, help="examples per rank per step")
    g.add_argument("--max-steps", type=_positive_int, default=800, help="optimizer steps, across epochs")
    g.add_argument(
        "--lr", type=_positive_float, default=None, help="peak learning rate (default: 3e-3 tiny, 2e-4 qwen)"
    )
    g.add_argument("--weight-decay", type=_non_negative_float, default=0.01, help="AdamW weight decay")

    g = p.add_argument_group("hardware and process group")
    g.add_argument(
        "--backend", choices=["auto", "gloo", "nccl"], default="auto", help="auto: NCCL on Linux with CUDA, else Gloo"
    )
    g.add_argument("--cpu", action="store_true", help="train on CPU even if CUDA is available")
    g.add_argument(
        "--timeout-s", type=_positive_float, default=300.0, help="how long a collective may wait for the other ranks"
    )

    g = p.add_argument_group("reporting")
    g.add_argument("--log-every", type=_positive_int, default=25, help="steps between log lines")
    g.add_argument("--prompt", default="Each rank", help="text the trained model continues")
    g.add_argument("--sample-tokens", type=_positive_int, default=120, help="length of the sample")
    return p


def parse_args(argv: list[str] | None = None) -> RunConfig:
    args = build_arg_parser().parse_args(argv)
    if args.lr is None:  # adapters on a pretrained model want a far gentler step than a model from scratch
        args.lr = 2e-4 if args.model == "qwen" else 3e-3
    cfg = RunConfig(**vars(args))
    if cfg.d_model % cfg.n_heads:
        raise UsageError(f"--d-model {cfg.d_model} is not divisible by --n-heads {cfg.n_heads}")
    return cfg


# ----------------------------------------------------------------------------------------------
# 2-3. Launch and connect: rank facts from torchrun's environment, then the process group
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

    @property
    def is_main(self) -> bool:
        # Decisions "only one process does this" use the global rank: LOCAL_RANK 0 exists
        # once per machine, so testing it would make every machine write the checkpoint.
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


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


def setup_distributed(cfg: RunConfig) -> Dist:
    """Read the rank facts torchrun exported and join the process group (or stay single)."""
    if not launched_by_torchrun():
        use_cuda = torch.cuda.is_available() and not cfg.cpu
        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        return Dist(0, 0, 1, 1, device, None, "not launched by torchrun: one process, no process group")
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank = int(env.get("LOCAL_RANK", "0"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    backend, device, why = choose_backend_and_device(cfg, local_rank, local_world)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, so rank r never touches GPU 0
    # MASTER_ADDR/MASTER_PORT come from torchrun's rendezvous; the timeout bounds every
    # collective, so a rank that stops answering fails the job instead of hanging it.
    dist.init_process_group(
        backend=backend,
        timeout=timedelta(seconds=cfg.timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return Dist(rank, local_rank, world, local_world, device, backend, why)


def teardown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(d: Dist, values: list[float]) -> list[float]:
    """Sum a few numbers over all ranks (a collective: every rank must call it)."""
    if not d.distributed:
        return list(values)
    comm_device = d.device if d.backend == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=comm_device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_ranks_ok(d: Dist, ok: bool) -> bool:
    """A barrier that also carries an outcome: True only if every rank reports ok."""
    return all_reduce_sum(d, [0.0 if ok else 1.0])[0] == 0.0


def log(d: Dist, message: str) -> None:
    if d.is_main:
        print(message, flush=True)


# ----------------------------------------------------------------------------------------------
# 4. Shard: corpus lines -> fixed-length examples -> a DistributedSampler slice per rank
# ----------------------------------------------------------------------------------------------


def read_corpus_lines(path: Path) -> list[str]:
    """One training sample per line; blank lines are skipped."""
    if not path.exists():
        raise UsageError(f"corpus file not found: {path}")
    if not path.is_file():
        raise UsageError(f"corpus path is not a file: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"corpus file is not valid UTF-8: {path} (bad byte at offset {e.start})") from None
    except OSError as e:
        raise UsageError(f"cannot read corpus file {path}: {e.strerror}") from None
    lines = [line.strip() for line in text.split("\n")]
    lines = [line for line in lines if line]
    if not lines:
        raise UsageError(f"corpus file has no non-blank lines: {path}")
    return lines


@dataclass(frozen=True)
class Examples:
    """Token tensors built once, up front. Row i is one example: inputs[i] predicts targets[i]."""

    inputs: torch.Tensor  # (N, T) int64
    targets: torch.Tensor  # (N, T) int64, IGNORE_INDEX on padding

    def __len__(self) -> int:
        return self.inputs.shape[0]


def encode_lines_as_bytes(lines: list[str], seq_len: int) -> Examples:
    """Byte-level examples: each line becomes b"\\n" + line + b"\\n", cut into windows.

    The opening newline is the "start of line" the first byte is predicted from; the closing
    newline teaches the model where a line ends. A line longer than seq_len is cut into windows
    that overlap by one byte, so every byte is a target exactly once and nothing is dropped.
    Windows are right-padded; padded positions get IGNORE_INDEX and never enter the loss.
    """
    windows: list[bytes] = []
    for line in lines:
        data = b"\n" + line.encode("utf-8") + b"\n"
        for start in range(0, len(data) - 1, seq_len):
            windows.append(data[start : start + seq_len + 1])
    inputs = torch.zeros(len(windows), seq_len, dtype=torch.long)
    targets = torch.full((len(windows), seq_len), IGNORE_INDEX, dtype=torch.long)
    for i, w in enumerate(windows):
        ids = torch.frombuffer(bytearray(w), dtype=torch.uint8).long()
        inputs[i, : len(ids) - 1] = ids[:-1]
        targets[i, : len(ids) - 1] = ids[1:]
    return Examples(inputs, targets)


def encode_lines_with_tokenizer(lines: list[str], tokenizer: PreTrainedTokenizerBase, seq_len: int) -> Examples:
    """Pretrained-model examples: [start] + tokens(line) + [eos], truncated to seq_len + 1 tokens.

    The start token (the tokenizer's BOS, or its EOS where there is no BOS, as in Qwen) lets
    the model predict the line's first token; the EOS at the end teaches it to stop. Targets
    are masked by *position* (beyond each line's real length), never by token id: Qwen's pad
    token may equal its EOS, and masking by id would also hide every real EOS from the loss,
    teaching the model never to stop.
    """
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    token_lists = tokenizer(lines, add_special_tokens=False)["input_ids"]
    inputs = torch.full((len(lines), seq_len), tokenizer.pad_token_id, dtype=torch.long)
    targets = torch.full((len(lines), seq_len), IGNORE_INDEX, dtype=torch.long)
    for i, ids in enumerate(token_lists):
        seq = torch.tensor([start, *ids, tokenizer.eos_token_id][: seq_len + 1])
        inputs[i, : len(seq) - 1] = seq[:-1]
        targets[i, : len(seq) - 1] = seq[1:]
    return Examples(inputs, targets)


def make_train_loader(examples: Examples, cfg: RunConfig, d: Dist) -> tuple[DataLoader, DistributedSampler]:
    dataset = TensorDataset(examples.inputs, examples.targets)
    # Every rank builds the same permutation (same seed, same epoch) and keeps every
    # world_size-th index starting at its rank: disjoint shards that together cover the data.
    # drop_last trims the permutation to a multiple of world_size instead of padding it with
    # repeats, so no example is trained twice in an epoch.
    sampler = DistributedSampler(
        dataset, num_replicas=d.world_size, rank=d.rank, shuffle=True, seed=cfg.seed, drop_last=True
    )
    if len(sampler) < cfg.batch_size:
        raise UsageError(
            f"corpus too small: {len(examples)} examples give each of {d.world_size} rank(s) "
            f"{len(sampler)} per epoch, fewer than one batch of {cfg.batch_size}; "
            "use a larger corpus, a smaller --batch-size or fewer ranks"
        )
    loader = DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        drop_last=True,  # equal batch counts on every rank, so no rank waits in an all-reduce alone
        pin_memory=d.device.type == "cuda",
    )
    return loader, sampler


def batches_forever(loader: DataLoader, sampler: DistributedSampler) -> Iterator[tuple[torch.Tensor, ...]]:
    """Yield batches across epochs, reshuffling at each epoch boundary."""
    epoch = 0
    while True:
        # Without set_epoch every epoch would replay epoch 0's order. The epoch number must
        # be the same on all ranks, or their shards would overlap.
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


# ----------------------------------------------------------------------------------------------
# 5. Models: a byte-level causal Transformer trained from scratch
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
        self.n_heads, self.dropout = c.n_heads, c.dropout
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        # is_causal masks every position j > i: a token never sees the bytes it must predict.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d_model)
        self.attn = CausalSelfAttention(c)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.mlp = nn.Sequential(nn.Linear(c.d_model, 4 * c.d_model), nn.GELU(), nn.Linear(4 * c.d_model, c.d_model))
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
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device)
        x = self.drop(self.tok_emb(ids) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def load_tiny_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> TinyTransformer:
    """Rebuild the trained tiny model from its checkpoint file alone."""
    ckpt = torch.load(path, map_location=map_location, weights_only=True)
    model = TinyTransformer(TinyConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    return model.eval()


@torch.no_grad()
def generate_bytes(model: TinyTransformer, prompt: str, max_new: int, seed: int) -> str:
    """Sample a continuation of the prompt until the end of the line (the model's own "\\n")."""
    device = next(model.parameters()).device
    ids = torch.tensor([[NEWLINE, *prompt.encode("utf-8")]], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = bytearray()
    for _ in range(max_new):
        logits = model(ids[:, -model.config.seq_len :])[0, -1].float()
        probs = torch.softmax(logits / 0.8, dim=-1)  # temperature 0.8: a little sharper than raw
        nxt = torch.multinomial(probs, 1, generator=gen)
        if nxt.item() == NEWLINE:
            break
        out.append(int(nxt.item()))
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return prompt + out.decode("utf-8", errors="replace")


@dataclass
class ModelKit:
    """What the shared training loop needs from a model path; the rest stays in its builder."""

    model: nn.Module  # the plain model; DDP wraps it later
    train: Examples
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (model, ids) -> logits
    sample: Callable[[nn.Module, str], str]  # (unwrapped model, prompt) -> text
    save_final: Callable[[nn.Module, int], Path]  # (unwrapped model, step) -> path written
    final_label: str  # what save_final writes, for the log
    describe: str


def build_tiny_kit(cfg: RunConfig, d: Dist, lines: list[str]) -> ModelKit:
    config = TinyConfig(
        seq_len=cfg.seq_len, d_model=cfg.d_model, n_heads=cfg.n_heads, n_layers=cfg.n_layers, dropout=cfg.dropout
    )
    # Same seed on every rank: the replicas start identical. (DDP would also broadcast rank
    # 0's weights when it wraps the model, but equal seeds make single-process runs match.)
    torch.manual_seed(cfg.seed)
    model = TinyTransformer(config).to(d.device)
    n_params = sum(p.numel() for p in model.parameters())

    def save_final(raw: nn.Module, step: int) -> Path:
        path = cfg.output_dir / "tiny_transformer.pt"
        atomic_torch_save({"model": raw.state_dict(), "config": asdict(config), "step": step}, path)
        return path

    return ModelKit(
        model=model,
        train=encode_lines_as_bytes(lines, cfg.seq_len),
        forward=lambda m, ids: m(ids),
        sample=lambda raw, prompt: generate_bytes(raw, prompt, cfg.sample_tokens, cfg.seed),
        save_final=save_final,
        final_label="model checkpoint",
        describe=f"tiny Transformer: {cfg.n_layers} layer(s), d_model {cfg.d_model}, "
        f"{cfg.n_heads} heads, {n_params:,} parameters",
    )


def build_qwen_kit(cfg: RunConfig, d: Dist, lines: list[str]) -> ModelKit:
    """A pretrained causal LM (Qwen2.5 by default) with LoRA adapters; only the adapters train."""
    from peft import LoraConfig, get_peft_model  # imported here: the tiny path never pays for it

    dtype = choose_weights_dtype(cfg, d)
    tokenizer, model = load_pretrained(cfg, d, dtype)
    if tokenizer.pad_token is None:
        # Any id works for padding: padded positions are masked out of the loss by position.
        tokenizer.pad_token = tokenizer.eos_token
    check_lora_targets(model, cfg.lora_targets)
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing: the reentrant kind re-runs forward inside backward,
        # which fires DDP's gradient hooks twice ("marked ready twice"), and it needs an input
        # that requires grad, which the frozen embedding does not give without help.
        # (transformers 5 renamed gradient_checkpointing_enable to activation_checkpointing_enable.)
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        model.config.use_cache = False
    torch.manual_seed(cfg.seed)  # LoRA A starts random (B at zero): the same on every rank
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    # Trainability is settled before DDP wraps the model: DDP registers its gradient hooks on
    # the parameters that require grad when it is built, and only those ever travel.
    with warnings.catch_warnings():  # peft reads a property transformers 5 renamed; harmless
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(model, lora).to(d.device)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id

    def save_final(raw: nn.Module, step: int) -> Path:
        path = cfg.output_dir / "qwen_lora"
        with atomic_directory(path) as tmp:
            raw.save_pretrained(tmp)  # adapter_config.json + adapter_model.safetensors only
            tokenizer.save_pretrained(tmp)
        return path

    @torch.no_grad()
    def sample(raw: nn.Module, prompt: str) -> str:
        ids = torch.tensor([[start, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]], device=d.device)
        out = raw.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=cfg.sample_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        return prompt + tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    return ModelKit(
        model=model,
        train=encode_lines_with_tokenizer(lines, tokenizer, cfg.seq_len),
        # No attention mask: padding sits on the right, and causal attention never lets a real
        # token look right, so the pads cannot change any real position's output.
        forward=lambda m, ids: m(input_ids=ids, use_cache=False).logits,
        sample=sample,
        save_final=save_final,
        final_label="LoRA adapters and tokenizer",
        describe=f"{cfg.model_name_or_path} ({dtype}) + LoRA r={cfg.lora_r} alpha={cfg.lora_alpha:g} on "
        f"{','.join(cfg.lora_targets)}: {trainable:,} trainable of {total:,} parameters "
        f"({100 * trainable / total:.3f}%)",
    )


def choose_weights_dtype(cfg: RunConfig, d: Dist) -> torch.dtype:
    on_gpu = d.device.type == "cuda"
    if cfg.dtype == "auto":
        # Qwen2 was trained in bf16; fp16 overflows in it, so auto never picks fp16.
        return torch.bfloat16 if on_gpu and torch.cuda.is_bf16_supported() else torch.float32
    if cfg.dtype == "float16" and not on_gpu:
        raise UsageError("--dtype float16 needs a CUDA device; use float32 or bfloat16 on CPU")
    return getattr(torch, cfg.dtype)


def resolve_model_files(cfg: RunConfig, d: Dist) -> Path:
    """A local folder is used as it is. A hub name is fetched once per machine: local rank 0
    downloads into the shared cache while the other ranks wait, then they read the cache, so
    N ranks never download the same weights at once."""
    source = cfg.model_name_or_path
    if Path(source).expanduser().is_dir():
        return Path(source).expanduser()
    if source.startswith((".", "/", "~")) or "\\" in source or source.count("/") > 1:
        raise UsageError(f"cannot load model: no folder {source} (hub names look like Qwen/Qwen2.5-0.5B-Instruct)")
    from huggingface_hub import snapshot_download

    def fetch(local_files_only: bool) -> Path:
        try:
            files = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
            if cfg.trust_remote_code:
                files.append("*.py")
            return Path(snapshot_download(source, allow_patterns=files, local_files_only=local_files_only))
        except (OSError, ValueError) as e:
            raise UsageError(
                f"cannot load model '{source}': it is not a local folder, and the Hugging Face Hub "
                f"could not provide it (offline, or a wrong name?): {first_line(e)}"
            ) from None

    if not d.distributed:
        return fetch(local_files_only=False)
    # The wait is a collective that carries rank 0's outcome, so a failed download stops every
    # rank at once instead of leaving them at a barrier.
    path, error = None, ""
    if d.local_rank == 0:
        try:
            path = fetch(local_files_only=False)
        except UsageError as e:
            error = str(e)
    if not all_ranks_ok(d, not error):
        raise UsageError(error or f"cannot load model '{source}': the download failed on another machine")
    return path or fetch(local_files_only=True)


def load_pretrained(cfg: RunConfig, d: Dist, dtype: torch.dtype) -> tuple[PreTrainedTokenizerBase, nn.Module]:
    """Tokenizer and model from a local folder (see resolve_model_files), onto this rank's device."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one bar per rank is noise, not news
    folder = resolve_model_files(cfg, d)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation="sdpa", trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError, ImportError) as e:
        raise UsageError(f"cannot load model from {folder}: {first_line(e)}") from None
    if not tokenizer("a", add_special_tokens=False)["input_ids"]:
        raise UsageError(f"cannot load model from {folder}: its tokenizer encodes text to nothing (files missing?)")
    return tokenizer, model


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_lora_targets(model: nn.Module, targets: tuple[str, ...]) -> None:
    linear_names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    missing = [t for t in targets if t not in linear_names]
    if missing:
        raise UsageError(
            f"--lora-targets {','.join(missing)} not found in the model; its linear layers are: "
            + ", ".join(linear_names)
        )


# ----------------------------------------------------------------------------------------------
# 6. Train and sync: one loop for every model
# ----------------------------------------------------------------------------------------------


def wrap_data_parallel(model: nn.Module, d: Dist) -> nn.Module:
    if not d.distributed:
        return model
    # DDP broadcasts rank 0's parameters to all ranks now, then hooks every parameter: during
    # backward, finished gradients are grouped into buckets and all-reduced (averaged) while
    # the rest of backward still runs, so every rank ends the step with the same gradient.
    return DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over the real (non-padding) targets."""
    return F.cross_entropy(
        logits.float().view(-1, logits.shape[-1]), targets.view(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def check_gradients_arrived(model: nn.Module) -> None:
    """After the first backward some trainable weight must have a non-zero gradient.

    Catches the silent failure where nothing learns: a frozen input to a checkpointed block,
    adapters attached to layers the forward never uses. (LoRA's A gets exactly zero gradient
    at step 1, because B starts at zero; B's gradient is what shows the path works.)
    """
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    if not any(bool(g.any()) for g in grads):
        raise TrainingError("no gradient reached the trainable weights at step 1: nothing would learn")


@dataclass
class TrainResult:
    steps: int
    first_loss: float
    last_loss: float
    tokens: int
    seconds: float


def train(cfg: RunConfig, d: Dist, kit: ModelKit) -> TrainResult:
    loader, sampler = make_train_loader(kit.train, cfg, d)
    model = wrap_data_parallel(kit.model, d)
    trainable = [p for p in kit.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    global_batch = cfg.batch_size * d.world_size
    log(d, f"[run] {d.world_size} rank(s) x {cfg.batch_size} examples per rank = global batch {global_batch}")
    log(d, f"[run] up to {global_batch * cfg.seq_len:,} token positions per step (padding excluded from the loss)")
    log(d, f"[run] {len(sampler)} examples per rank per epoch = {len(loader)} steps per epoch")

    model.train()
    stream = batches_forever(loader, sampler)
    first_loss = last_loss = float("nan")
    tokens_seen, window_tokens = 0, 0
    t_start = t_window = time.perf_counter()
    for step in range(1, cfg.max_steps + 1):
        inputs, targets = next(stream)
        inputs, targets = inputs.to(d.device, non_blocking=True), targets.to(d.device, non_blocking=True)
        # The loss is the mean over every target token of the *global* batch. Ranks hold
        # different numbers of real tokens (lines differ in length), so each rank scales its
        # token sum by world_size / global_tokens; DDP's average then divides the world_size
        # back out, leaving exactly sum(all token losses) / global_tokens.
        local_tokens = int((targets != IGNORE_INDEX).sum())
        (global_tokens,) = all_reduce_sum(d, [local_tokens])
        loss_sum = token_loss_sum(kit.forward(model, inputs), targets)
        (loss_sum * (d.world_size / global_tokens)).backward()  # DDP all-reduces gradients here
        if step == 1:
            check_gradients_arrived(kit.model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # The loss each rank computed covers its own shard; summing over ranks gives the loss
        # of the global batch, the number that the update actually followed.
        (global_loss_sum,) = all_reduce_sum(d, [loss_sum.item()])
        loss = global_loss_sum / global_tokens
        first_loss = loss if step == 1 else first_loss
        last_loss = loss
        tokens_seen += int(global_tokens)
        window_tokens += int(global_tokens)
        if step % cfg.log_every == 0 or step == cfg.max_steps or step == 1:
            now = time.perf_counter()
            log(d, f"step {step:>5}/{cfg.max_steps} | loss {loss:.4f} | {window_tokens / (now - t_window):,.0f} tok/s")
            t_window, window_tokens = now, 0
    return TrainResult(cfg.max_steps, first_loss, last_loss, tokens_seen, time.perf_counter() - t_start)


# ----------------------------------------------------------------------------------------------
# 7. Save: rank 0 writes, everyone meets at a barrier
# ----------------------------------------------------------------------------------------------


def atomic_torch_save(obj: object, path: Path) -> None:
    """Write to a temp file in the same folder, fsync, then rename over the target.

    A rename within one file system is atomic: readers see the old file or the new one,
    never half of one, even if the process dies mid-write.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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


def rank0_writes(d: Dist, what: str, write: Callable[[], Path]) -> None:
    """Rank 0 runs `write`; then all ranks meet at a barrier that also carries the outcome.

    The barrier sits outside the rank-0 branch: every rank must reach it, or the ones that
    do would wait for ever. Carrying the outcome means a failed write stops every rank.
    """
    error = ""
    if d.is_main:
        try:
            path = write()
            print(f"[save] {what}: {path}", flush=True)
        except OSError as e:
            error = f"could not write {what}: {e}"
    if not all_ranks_ok(d, not error):
        raise TrainingError(error or f"rank 0 could not write {what}")


# ----------------------------------------------------------------------------------------------
# 8. Main: launch -> connect -> shard -> train -> sync -> save -> sample
# ----------------------------------------------------------------------------------------------


def run(cfg: RunConfig, d: Dist) -> None:
    log(d, f"[launch] {d.world_size} process(es); this is rank {d.rank} (local rank {d.local_rank})")
    log(d, f"[connect] backend {d.backend or 'none'} on {d.device}: {d.why}")
    lines = read_corpus_lines(cfg.corpus_file)
    kit = (build_qwen_kit if cfg.model == "qwen" else build_tiny_kit)(cfg, d, lines)
    log(d, f"[data] {cfg.corpus_file}: {len(lines)} lines -> {len(kit.train)} examples of {cfg.seq_len} tokens")
    log(d, f"[model] {kit.describe}")

    result = train(cfg, d, kit)
    rank0_writes(d, kit.final_label, lambda: kit.save_final(kit.model, result.steps))
    if d.is_main:
        kit.model.eval()
        # The unwrapped model: a forward through the DDP wrapper may talk to the other ranks,
        # which have moved on. Sampling is local to rank 0.
        print(f"[sample] {kit.sample(kit.model, cfg.prompt)}", flush=True)
        print(
            f"[done] {result.steps} steps, loss {result.first_loss:.4f} -> {result.last_loss:.4f}, "
            f"{result.tokens:,} tokens in {result.seconds:.1f} s",
            flush=True,
        )


def report_error(message: str) -> None:
    # Input errors are identical on every rank; one line per machine is enough.
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)


@record  # a rank's uncaught exception is written where torchrun can show it as the root cause
def main(argv: list[str] | None = None) -> None:
    try:
        cfg = parse_args(argv)
        d = setup_distributed(cfg)
    except UsageError as e:
        report_error(str(e))
        raise SystemExit(2) from None
    try:
        run(cfg, d)
    except UsageError as e:
        report_error(str(e))
        raise SystemExit(2) from None
    except TrainingError as e:
        report_error(str(e))
        raise SystemExit(1) from None
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main()
