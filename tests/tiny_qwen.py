"""Build a tiny random Qwen2 model and a byte-level BPE tokenizer offline, for the LoRA tests and
for trying the pretrained/chat path with no download.

The architecture is the real one (transformers' Qwen2ForCausalLM: grouped KV heads, RoPE, RMSNorm,
tied embeddings like Qwen2.5-0.5B), only small. The tokenizer is trained here with the tokenizers
library using Qwen2's own normalizer and pre-tokenizer: transformers 5 always rebuilds a "qwen2"
folder's tokenizer as Qwen2Tokenizer from vocab + merges, so any other pipeline would not survive
the reload. Like many base checkpoints it has an EOS token and no pad token; it carries Qwen2.5's
stock chat template.

From the command line (the README's offline chat example):

    python tests/tiny_qwen.py runs/tiny-qwen --chat-file runs/chat.jsonl

writes the model folder (BPE trained on corpus.txt's lines) and, with --chat-file, a chat file in
the "messages" format made from the same lines: one conversation per line, the user says its
first half and the assistant its second.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# Qwen2.5-Instruct's chat template, as its tokenizer_config.json ships it (tool calls included):
# ChatML turns, a default system prompt when none is given, and no {% generation %} markers.
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def build_tiny_qwen(out_dir: Path, lines: list[str], vocab_size: int = 400, seed: int = 0, **config: object) -> Path:
    """Save a random Qwen2ForCausalLM and its tokenizer in out_dir. `config` overrides the tiny
    shape (vocab_size is the tokenizer's; benchmarks/gpu_check.py keeps the tokenizer and builds
    Qwen2.5's full shapes itself, with Qwen's 151,936-token vocabulary)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no unknown tokens
        show_progress=False,
    )
    bpe.train_from_iterator(lines, trainer=trainer)
    trained = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=trained["vocab"],
        merges=[tuple(m) for m in trained["merges"]],
        eos_token="<|endoftext|>",
        pad_token=None,
        unk_token=None,
        bos_token=None,
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=512,
    )
    tokenizer.chat_template = QWEN25_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)

    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    shape = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # grouped KV heads, as in Qwen2.5
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
    }
    config = Qwen2Config(**(shape | config), bos_token_id=eos, eos_token_id=eos)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(out_dir)
    return out_dir


def corpus_lines(path: Path) -> list[str]:
    """The corpus's non-blank lines, as the training script reads a .txt corpus."""
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def halves(line: str) -> tuple[str, str]:
    """Split a line at the space nearest its middle: (first half, second half), neither empty."""
    words = line.split()
    if len(words) < 2:
        raise ValueError(f"a line of one word cannot be split into a question and a reply: {line!r}")
    middle = len(line) / 2
    ends = [len(" ".join(words[:i])) for i in range(1, len(words))]
    cut = min(range(1, len(words)), key=lambda i: abs(ends[i - 1] - middle))
    return " ".join(words[:cut]), " ".join(words[cut:])


def write_chat_file(path: Path, lines: list[str]) -> int:
    """One {"messages": [user, assistant]} record per line that has two words or more; returns the count."""
    records = []
    for line in lines:
        if len(line.split()) < 2:
            continue
        user, assistant = halves(line)
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        records.append(json.dumps({"messages": messages}, ensure_ascii=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(r + "\n" for r in records), encoding="utf-8")
    return len(records)


def main(argv: list[str] | None = None) -> int:
    repo = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(
        description="Build a tiny random Qwen2 model with a BPE tokenizer and Qwen2.5's chat template, "
        "offline: a stand-in for --model-name-or-path to try the --model hf path without a download.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the model folder to write")
    parser.add_argument(
        "--corpus", type=Path, default=repo / "corpus.txt", help="text whose lines train the BPE tokenizer"
    )
    parser.add_argument(
        "--chat-file",
        type=Path,
        default=None,
        help="also write a .jsonl chat file: one conversation per corpus line, "
        "the user says its first half, the assistant its second",
    )
    parser.add_argument(
        "--chat-lines",
        type=int,
        default=None,
        help="only the first N corpus lines go into the chat file (all: every one)",
    )
    parser.add_argument("--vocab-size", type=int, default=400, help="BPE vocabulary size, special tokens included")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)

    try:
        lines = corpus_lines(args.corpus)
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: cannot read --corpus {args.corpus}: {e}", file=sys.stderr)
        return 2
    if not lines:
        print(f"error: --corpus {args.corpus} has no non-blank lines", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar for writing one small file says nothing
    build_tiny_qwen(args.out_dir, lines, vocab_size=args.vocab_size, seed=args.seed)
    print(f"model: {args.out_dir} (tiny random Qwen2, BPE tokenizer trained on {len(lines)} lines of {args.corpus})")
    if args.chat_file:
        count = write_chat_file(args.chat_file, lines[: args.chat_lines])
        which = "" if args.chat_lines is None else f", its first {args.chat_lines}"
        print(f"chat file: {args.chat_file} ({count} conversations, one per line of {args.corpus}{which})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
