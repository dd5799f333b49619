"""The token cache: a corpus is tokenized once, memory-mapped by every rank, and trains exactly as
the examples the script built in memory before it had one; what decides the tokens is its key.

The byte path's examples, the split and the sampler are the ones built before the cache; the token
rows from the cache are, in every format, packed and not, cut and not; a --dataset gives the tokens
of the same records in a JSONL file; a pretrained run on two ranks trains from the cache exactly as
in memory, and so does a parquet dataset a second time. A broken line, an unwritable --cache-dir or
a dataset that cannot be read is one line on every rank and leaves no cache. The 2-rank runs are
jobs of one shared launch (two_ranks); a missing datasets library keeps a launch of its own. Reuse,
damage, killed builds, concurrent builds, two machines, memory and a full disk:
tests/test_token_cache_runs.py."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, TINY, assert_ok, child_env, run_cmd, split_lines, torchrun_cmd
from rows import stacked
from shared_launch import Shared, assert_one_clear_error, share

import llm_ddp_parallel_training as t

# ----- the examples as the script built them before the token cache (commit 7d6693c), the reference -----


def reference_byte_examples(lines: list[str], seq_len: int, pack: bool) -> tuple[torch.Tensor, torch.Tensor]:
    spans = [t.packed_stream(lines)] if pack else [b"\n" + line.encode("utf-8") + b"\n" for line in lines]
    windows = [span[start : start + seq_len + 1] for span in spans for start in range(0, len(span) - 1, seq_len)]
    inputs = torch.zeros(len(windows), seq_len, dtype=torch.long)
    targets = torch.full((len(windows), seq_len), t.IGNORE_INDEX, dtype=torch.long)
    for i, w in enumerate(windows):
        ids = torch.frombuffer(bytearray(w), dtype=torch.uint8).long()
        inputs[i, : len(ids) - 1] = ids[:-1]
        targets[i, : len(ids) - 1] = ids[1:]
    return inputs, targets


def reference_shifting_window(lines: list[str], seq_len: int, seed: int, epoch: int, i: int) -> torch.Tensor:
    stream = torch.frombuffer(bytearray(t.packed_stream(lines)), dtype=torch.uint8)
    offset = int(torch.randint(seq_len, (), generator=torch.Generator().manual_seed(seed + epoch)))
    return stream[offset + i * seq_len : offset + i * seq_len + seq_len + 1].long()


def reference_token_rows(records, tokenizer, seq_len: int, train_on_prompt: bool, pack: bool) -> list[tuple]:
    """(inputs, targets, positions, target bytes) of each row, as encode_records_with_tokenizer made them."""
    masking = t.chat_masking(tokenizer) if any(r.messages for r in records) else None
    kept = []
    for sample in records:
        seq = t.tokenize_record(sample, tokenizer, train_on_prompt, masking)
        seq = t.TokenSequence(seq.ids[: seq_len + 1], seq.is_target[: seq_len + 1])
        if any(seq.is_target[1:]):
            kept.append(seq)
    rows, free = [], 0
    for seq in kept if pack else []:
        if len(seq.ids) - 1 > free:
            rows.append([])
            free = seq_len
        rows[-1].append(seq)
        free -= len(seq.ids) - 1
    out = []
    for row in rows if pack else [[seq] for seq in kept]:
        inputs = torch.full((seq_len,), tokenizer.pad_token_id or 0, dtype=torch.long)
        targets = torch.full((seq_len,), t.IGNORE_INDEX, dtype=torch.long)
        positions = torch.zeros(seq_len, dtype=torch.long)
        nbytes, at = 0, 0
        for seq in row:
            ids, n = torch.tensor(seq.ids), len(seq.ids) - 1
            inputs[at : at + n] = ids[:-1]
            targets[at : at + n] = torch.where(torch.tensor(seq.is_target[1:]), ids[1:], t.IGNORE_INDEX)
            positions[at : at + n] = torch.arange(n)
            nbytes += t.count_target_bytes(seq, tokenizer)
            at += n
        positions[at:] = torch.arange(seq_len - at)
        out.append((inputs, targets, positions, nbytes))
    return out


# ----- helpers -----


def cfg_for(*args: str) -> t.RunConfig:
    return t.parse_args(["--cpu", *args])


def built_in_memory(cfg: t.RunConfig, folder: Path | None = None) -> t.Lines | t.Tokens:
    return t.open_corpus(cfg, t.setup_distributed(cfg), folder)


def caches(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def cache_line(run) -> str:
    return next(line for line in run.stdout.splitlines() if line.startswith("[cache]"))


def same_weights(a: Path, b: Path) -> bool:
    x, y = torch.load(a, weights_only=False)["model"], torch.load(b, weights_only=False)["model"]
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def adapter(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "qwen_lora" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen):
    return t.load_tokenizer(t.parse_args(["--model", "hf"]), tiny_qwen)


def varied_conversations(corpus_lines: list[str]) -> list[dict]:
    """Varied conversations: a system message in some, two exchanges in others."""
    out = []
    for i, line in enumerate(corpus_lines * 8):
        words = line.split()
        turns = [{"role": "system", "content": "Answer briefly."}] if i % 5 == 0 else []
        for k in range(1 + (i % 3 == 0)):
            turns += [
                {"role": "user", "content": " ".join(words[: 3 + k])},
                {"role": "assistant", "content": " ".join(words[3 + k :]) or "yes"},
            ]
        out.append({"messages": turns})
    return out  # 8 x 375 = 3,000: more than one chunk (CHUNK_RECORDS), so a build starts its pool


@pytest.fixture(scope="module")
def conversations(corpus_lines) -> list[dict]:
    return varied_conversations(corpus_lines)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def hf(tiny_qwen: Path, *args: str) -> list[str]:
    return ["--cpu", "--model", "hf", "--model-name-or-path", str(tiny_qwen), "--batch-size", "4", *args]


# ----- the shared launches: every run whose subject is not the launch itself, one job each -----

BAD_DATASETS = {
    "no split": "has no split 'validation'",
    "no usable column": "no known fields (answer, question)",
    "not on the Hub": "cannot load --dataset nobody/no-such-dataset",
}


def pretrained_on_3000(tiny_qwen: Path, data: Path, *args: str) -> list[str]:
    return hf(tiny_qwen, "--corpus-file", str(data), "--max-steps", "3", "--pack", "--seq-len", "256",
              "--val-fraction", "0.01", *args)  # fmt: skip


def parquet_run(tiny_qwen: Path, saved_datasets: dict, root: Path, name: str) -> list[str]:
    return [*hf(tiny_qwen, "--dataset", str(saved_datasets["parquet"]), "--max-steps", "2", "--seq-len", "256"),
            "--cache-dir", root / "parquet_cache", "--output-dir", root / name]  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks(tiny_qwen, conversations, saved_datasets, tmp_path_factory) -> Shared:
    """This module's 2-rank runs, in one launch: 3,000 conversations built into a cache, then trained
    on from it again and in memory; a parquet dataset twice; a broken line in the pool's second chunk;
    a --cache-dir that cannot be written; datasets that cannot be read (BAD_DATASETS)."""
    import datasets

    root = tmp_path_factory.mktemp("cache_two_ranks")
    data = write_jsonl(root / "chat.jsonl", conversations)
    lines = [json.dumps(c) for c in conversations]
    lines[2_800] = lines[2_800][:-3]  # in the pool's second chunk
    broken = root / "broken.jsonl"
    broken.write_text("\n".join(lines) + "\n")
    (root / "a file").write_text("not a folder")
    datasets.Dataset.from_list([{"question": "?", "answer": "!"}]).to_parquet(str(root / "qa.parquet"))
    bad_datasets = {
        "no split": ["--dataset", str(saved_datasets["saved_dict"]), "--dataset-split", "validation"],
        "no usable column": ["--dataset", str(root / "qa.parquet")],
        "not on the Hub": ["--dataset", "nobody/no-such-dataset"],
    }
    jobs = {
        "built": [*pretrained_on_3000(tiny_qwen, data), "--output-dir", root / "built", "--cache-dir", root / "c"],
        "reused": [*pretrained_on_3000(tiny_qwen, data), "--output-dir", root / "reused", "--cache-dir", root / "c"],
        "memory": [*pretrained_on_3000(tiny_qwen, data), "--output-dir", root / "memory", "--cache-dir", "none"],
        "parquet_first": parquet_run(tiny_qwen, saved_datasets, root, "parquet_first"),
        "parquet_second": parquet_run(tiny_qwen, saved_datasets, root, "parquet_second"),
        "broken_line": [*hf(tiny_qwen, "--corpus-file", str(broken)), "--cache-dir", root / "broken_cache",
                        "--output-dir", root / "broken_line"],
        "unwritable": [*TINY, "--cache-dir", root / "a file" / "cache", "--output-dir", root / "unwritable"],
    } | {what: [*hf(tiny_qwen, *args), "--cache-dir", root / f"{what}_cache", "--output-dir", root / what]
         for what, args in bad_datasets.items()}  # fmt: skip
    return share(root, jobs, nproc=2, timeout=480)


# ----- 4. the byte path: the file's bytes are the tokens, cleaned in numpy, examples as before -----

TRICKY = (
    "\ufeffFirst line\r\n"  # a byte-order mark, a Windows line end
    "\t  indented and trailing  \t\n"
    "\n   \n"  # blank lines
    "\u3000\u00a0Unicode spaces at both ends\u2028\u2003\n"
    "a \u00a0 space inside stays\n" + " " * 40 + "more leading spaces than a vectorised round takes\x1f\n"
    "caf\u00e9 \u4e2d\u6587\u3002\n"  # non-ASCII that is not whitespace: kept
    "no final newline"
)


def test_the_text_cleaner_strips_and_drops_lines_exactly_as_str_strip_does(tmp_path, monkeypatch):
    path = tmp_path / "tricky.txt"
    path.write_bytes((TRICKY * 7).encode("utf-8"))
    monkeypatch.setattr(t, "TEXT_CHUNK_BYTES", 37)  # many blocks, cut mid-line and mid-character
    expected = [line.strip() for line in (TRICKY * 7).removeprefix("\ufeff").split("\n") if line.strip()]
    corpus = built_in_memory(cfg_for("--corpus-file", str(path), "--cache-dir", "none"))
    assert bytes(corpus.stream) == t.packed_stream(expected)
    lines = [bytes(corpus.stream[a + 1 : b]).decode() for a, b in zip(corpus.edges[:-1], corpus.edges[1:], strict=True)]
    assert lines == expected
    assert list(t.text_lines(path)) == expected


@pytest.mark.parametrize("pack", [True, False])
def test_byte_examples_are_the_ones_built_in_memory_before_the_cache(corpus_lines, pack):
    val_idx = t.held_out(len(corpus_lines), 0.1, seed=1337)
    train_idx = ~val_idx
    corpus = t.Lines.from_texts(corpus_lines)
    train_lines, val_lines = split_lines(corpus_lines, 0.1, seed=1337)
    val = stacked(t.ByteWindows(corpus.subset(val_idx), 64, pack))
    inputs, targets = reference_byte_examples(val_lines, 64, pack)
    assert torch.equal(val.inputs, inputs) and torch.equal(val.targets, targets)
    assert torch.equal(val.target_bytes, (targets != t.IGNORE_INDEX).sum(dim=1))
    if pack:
        train = t.ShiftingWindows(corpus.subset(train_idx), 64, seed=7)
        for epoch in (0, 1, 5):
            train.set_epoch(epoch)
            for i in (0, 1, len(train) // 2, len(train) - 1):
                window = reference_shifting_window(train_lines, 64, 7, epoch, i)
                assert torch.equal(torch.cat([train[i][0], train[i][1][-1:]]), window), (epoch, i)
    else:
        train = stacked(t.ByteWindows(corpus.subset(train_idx), 64, False))
        inputs, targets = reference_byte_examples(train_lines, 64, False)
        assert torch.equal(train.inputs, inputs) and torch.equal(train.targets, targets)


def test_the_split_holds_out_the_same_lines_as_before(corpus_lines):
    order = torch.randperm(len(corpus_lines), generator=torch.Generator().manual_seed(5)).tolist()
    held_out = sorted(order[: round(len(corpus_lines) * 0.2)])
    assert np.flatnonzero(t.held_out(len(corpus_lines), 0.2, seed=5)).tolist() == held_out


def test_the_lean_sampler_hands_each_rank_what_torchs_distributed_sampler_does():
    data = list(range(1_003))
    for world, seed, epoch in ((1, 0, 0), (2, 1337, 0), (3, 5, 4), (8, 9, 1)):
        for rank in range(world):
            ours = t.LeanDistributedSampler(data, num_replicas=world, rank=rank, seed=seed, drop_last=True)
            torchs = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, seed=seed, drop_last=True)
            ours.set_epoch(epoch)
            torchs.set_epoch(epoch)
            assert list(ours) == list(torchs) and len(ours) == len(torchs)


# ----- 6. pretrained rows: the same batches, in every format, packed and not, cut and not -----

FORMATS = ("messages", "sharegpt", "prompt-completion", "alpaca", "text")


def in_format(fmt: str, conversation: dict) -> dict:
    """The conversation as a record of another schema (its last exchange, where the schema has one)."""
    turns = conversation["messages"]
    question, answer = turns[-2]["content"], turns[-1]["content"]
    if fmt == "sharegpt":
        names = {"user": "human", "assistant": "gpt", "system": "system"}
        return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in turns]}
    if fmt == "prompt-completion":
        return {"prompt": question, "completion": " " + answer}
    if fmt == "alpaca":
        return {"instruction": question, "output": answer}
    if fmt == "text":
        return {"text": " ".join(m["content"] for m in turns)}
    return conversation


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("seq_len", "pack"), [(256, False), (256, True), (100, False)])
def test_token_rows_from_the_cache_are_the_rows_built_in_memory_before_it(
    tiny_qwen, tokenizer, conversations, tmp_path, fmt, seq_len, pack
):
    path = write_jsonl(tmp_path / f"{fmt}.jsonl", [in_format(fmt, c) for c in conversations[:400]])
    cfg = cfg_for("--model", "hf", "--model-name-or-path", str(tiny_qwen), "--corpus-file", str(path),
                  "--cache-dir", str(tmp_path / "cache"))  # fmt: skip
    corpus = built_in_memory(cfg, tiny_qwen)
    assert isinstance(corpus.ids, t.FileArray) and corpus.ids.dtype == np.uint16, "read as needed, 2 bytes a token"
    records, _ = t.read_records(path, "auto")
    val = t.held_out(len(records), 0.1, seed=1)
    for chosen, rows_pack in ((~val, pack), (val, False)):
        rows, _ = t.encode_records_with_tokenizer(corpus.subset(chosen), tokenizer, seq_len, False, rows_pack)
        reference = reference_token_rows([r for r, c in zip(records, chosen, strict=True) if c], tokenizer, seq_len,
                                         False, rows_pack)  # fmt: skip
        assert len(rows) == len(reference)
        for r, (inputs, targets, positions, nbytes) in enumerate(reference):
            row = rows[r]
            assert torch.equal(row[0], inputs) and torch.equal(row[1], targets), r
            assert not rows_pack or torch.equal(row[2], positions), r
            assert int(rows.target_bytes[r]) == nbytes, r


# ----- 1. built once, reused, keyed by what decides the tokens -----


def test_the_key_changes_with_what_decides_the_tokens_and_with_nothing_else(tiny_qwen, conversations, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", conversations[:50])
    base = ["--model", "hf", "--model-name-or-path", str(tiny_qwen), "--corpus-file", str(data)]
    key = t.corpus_key(cfg_for(*base), tiny_qwen)
    for same in (["--lr", "1e-3"], ["--batch-size", "2"], ["--seed", "3"], ["--max-steps", "9"], ["--seq-len", "64"],
                 ["--pack"], ["--val-fraction", "0.3"], ["--output-dir", "elsewhere"]):  # fmt: skip
        assert t.corpus_key(cfg_for(*base, *same), tiny_qwen) == key, same
    assert t.corpus_key(cfg_for(*base, "--train-on-prompt"), tiny_qwen) != key
    assert t.corpus_key(cfg_for(*base, "--data-format", "messages"), tiny_qwen) != key
    copy = tmp_path / "chat copy.jsonl"
    shutil.copy(data, copy)
    os.utime(copy, (1, 1))
    assert t.corpus_key(cfg_for(*base, "--corpus-file", str(copy)), tiny_qwen) == key, "the content, not the name"
    copy.write_text(copy.read_text().replace("Answer briefly.", "Answer at length."))
    assert t.corpus_key(cfg_for(*base, "--corpus-file", str(copy)), tiny_qwen) != key, "an edited file"
    template = tmp_path / "another template"
    shutil.copytree(tiny_qwen, template)
    jinja = template / "chat_template.jinja"
    jinja.write_text(jinja.read_text().replace("<|im_start|>", "<|im_start|> "))
    assert t.corpus_key(cfg_for(*base), template) != key, "another chat template"
    from tiny_qwen import build_tiny_qwen

    other = build_tiny_qwen(tmp_path / "another tokenizer", [c["messages"][-1]["content"] for c in conversations], 300)
    assert t.corpus_key(cfg_for(*base), other) != key, "another tokenizer"


def test_a_pretrained_run_on_two_ranks_trains_from_the_cache_exactly_as_in_memory(two_ranks):
    """3,000 conversations: rank 0 builds with a pool of processes, rank 1 waits, both map it."""
    built, reused, memory = two_ranks["built"], two_ranks["reused"], two_ranks["memory"]
    for run in (built, reused, memory):
        assert_ok(run)
    assert re.search(
        r"\[cache\] built .*: 3,000 messages records, [\d,]+ tokens in [\d.]+ s \(\d+ process", built.stdout
    )
    assert built.stdout.count("[cache]") == 1, "rank 0 built it; rank 1 mapped it without a word"
    assert "[cache] reused" in reused.stdout and "[cache] none" in memory.stdout
    assert built.losses() == reused.losses() == memory.losses()
    weights = [adapter(two_ranks.out(name)) for name in ("built", "reused", "memory")]
    assert all(torch.equal(weights[0][k], w[k]) for w in weights[1:] for k in weights[0])


# ----- 3. the source streams; a broken line stops the build before training, leaving nothing -----


def test_a_broken_line_stops_every_rank_naming_it_and_leaves_no_cache(two_ranks):
    data = two_ranks.root / "broken.jsonl"
    assert_one_clear_error(
        two_ranks["broken_line"], f"{data}:2801: not valid JSON", two_ranks.seconds("broken_line"), 2
    )
    assert caches(two_ranks.root / "broken_cache") == [], "no cache, not even a half-written one"


# ----- 8. bad input: one line on every rank, before training, nothing half-written left behind -----


def test_a_cache_dir_that_cannot_be_written_is_one_line(two_ranks):
    run = two_ranks["unwritable"]
    assert_one_clear_error(run, "cannot write the token cache in", two_ranks.seconds("unwritable"), 2)
    assert "--cache-dir none" in run.stderr


# ----- 5. --dataset: the Hub, parquet and save_to_disk through Hugging Face datasets -----


@pytest.fixture(scope="module")
def saved_datasets(conversations, tmp_path_factory) -> dict[str, Path]:
    import datasets

    root = tmp_path_factory.mktemp("datasets")
    data = datasets.Dataset.from_list(conversations[:600])
    data.to_parquet(str(root / "chat.parquet"))
    data.save_to_disk(str(root / "saved"))
    datasets.DatasetDict({"train": data, "test": data.select(range(10))}).save_to_disk(str(root / "saved_dict"))
    write_jsonl(root / "chat.jsonl", conversations[:600])
    return {"parquet": root / "chat.parquet", "saved": root / "saved", "saved_dict": root / "saved_dict",
            "jsonl": root / "chat.jsonl"}  # fmt: skip


@pytest.mark.parametrize("kind", ["parquet", "saved", "saved_dict"])
def test_a_dataset_gives_the_tokens_of_the_same_records_in_a_jsonl_file(tiny_qwen, saved_datasets, tmp_path, kind):
    from_file = built_in_memory(cfg_for(*hf(tiny_qwen, "--corpus-file", str(saved_datasets["jsonl"])),
                                        "--cache-dir", "none"), tiny_qwen)  # fmt: skip
    from_dataset = built_in_memory(cfg_for(*hf(tiny_qwen, "--dataset", str(saved_datasets[kind])),
                                           "--cache-dir", str(tmp_path)), tiny_qwen)  # fmt: skip
    for name in ("ids", "offsets", "is_target", "target_bytes", "first_target"):
        assert np.array_equal(getattr(from_file, name), getattr(from_dataset, name)), name
    assert from_dataset.fmt == "messages" and from_dataset.chat


def test_a_parquet_dataset_trains_on_two_ranks_and_a_second_run_reuses_its_cache(two_ranks, saved_datasets):
    first, second = two_ranks["parquet_first"], two_ranks["parquet_second"]
    assert_ok(first)
    assert_ok(second)
    assert "[cache] built" in first.stdout and "[cache] reused" in second.stdout
    assert f"[data] {saved_datasets['parquet']}: 540 training messages records" in first.stdout
    assert first.losses() == second.losses()


@pytest.mark.parametrize("what", BAD_DATASETS)
def test_a_dataset_that_cannot_be_read_is_one_line(two_ranks, what):
    assert_one_clear_error(two_ranks[what], BAD_DATASETS[what], two_ranks.seconds(what), 2)
    assert caches(two_ranks.root / f"{what}_cache") == []


def test_without_the_datasets_library_a_dataset_is_one_line_naming_its_install(tiny_qwen, saved_datasets, tmp_path):
    """A launch of its own: a datasets module that cannot be imported stands first on the path."""
    (tmp_path / "shadow").mkdir()
    (tmp_path / "shadow" / "datasets.py").write_text("raise ImportError('No module named datasets')\n")
    env = child_env({"PYTHONPATH": f"{tmp_path / 'shadow'}{os.pathsep}{REPO}"})
    args = ["--dataset", str(saved_datasets["parquet"])]
    run = run_cmd(torchrun_cmd(2, [*hf(tiny_qwen, *args), "--cache-dir", str(tmp_path / "cache")]), 120, env)
    assert_one_clear_error(run, "pip install datasets", run.seconds, 2)
    assert caches(tmp_path / "cache") == []
