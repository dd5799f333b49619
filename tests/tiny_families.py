"""Tiny random models of other families than Qwen2, each with its own kind of tokenizer and its
family's stock chat template, built offline for the model-family tests.

    Llama 3   byte-level BPE (as tiktoken), <|eot_id|> closes a turn, the template trims messages
    Gemma     SentencePiece-style BPE with spaces as "▁", no prefix space; <end_of_turn>, trims
    Gemma2    the same, with logit soft-capping (its own forward, not the lean head; eager attention)
    Mistral   SentencePiece-style BPE with a prefix space; " [INST] ... [/INST]" then " reply</s>":
              a separator before the reply, and a system message folded into the first user turn
    Phi-3     the same tokenizer kind; fused projections (qkv_proj, gate_up_proj); <|end|> closes a
              turn, the template appends EOS after the last message when not prompting, and the
              role tokens and <|end|> strip the whitespace after them (rstrip), as Phi-3's own do

The templates are the ones the families' instruct checkpoints ship in tokenizer_config.json
(Meta-Llama-3-8B-Instruct, gemma-7b-it and gemma-2-9b-it, Mistral-7B-Instruct-v0.2 and
Mixtral-8x7B-Instruct-v0.1, Phi-3-mini-4k-instruct); MISTRAL_V03_TEMPLATE is Mistral-7B-Instruct-v0.3's
with its tool-call parts left out. Weights are random and small; the architecture classes are the real ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.first and system_message is defined %}\n"
    "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token}}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial "
    "optional system message!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)

# v0.3 renders the system message only before the last message, when that is a user turn: once a
# reply follows, the system message is gone from the rendering.
MISTRAL_V03_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.last and system_message is defined %}\n"
    "            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- '[INST] ' + message['content'] + '[/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content']|trim + eos_token }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)

PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


@dataclass(frozen=True)
class Family:
    name: str
    tokenizer: str  # "byte-level", "prefix-space" (Llama 2's SentencePiece) or "gemma"
    template: str
    bos: str | None
    eos: str
    end_of_turn: str  # the special token that closes an assistant turn
    specials: tuple[str, ...]  # every special token, bos and eos included
    config: str  # transformers' config class
    config_options: dict = field(default_factory=dict)
    flags: tuple[str, ...] = ()  # what this script needs for it beyond --model hf
    rstrip: tuple[str, ...] = ()  # special tokens that take in the whitespace after them


FAMILIES = {
    "llama3": Family(
        "llama3",
        "byte-level",
        LLAMA3_TEMPLATE,
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|eot_id|>",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "LlamaConfig",
    ),
    "gemma": Family(
        "gemma",
        "gemma",
        GEMMA_TEMPLATE,
        "<bos>",
        "<eos>",
        "<end_of_turn>",
        ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        "GemmaConfig",
        {"head_dim": 16, "tie_word_embeddings": True},
    ),
    "mistral": Family(
        "mistral",
        "prefix-space",
        MISTRAL_TEMPLATE,
        "<s>",
        "</s>",
        "</s>",
        ("<unk>", "<s>", "</s>"),
        "MistralConfig",
        {"sliding_window": None},
    ),
    "phi3": Family(
        "phi3",
        "prefix-space",
        PHI3_TEMPLATE,
        "<s>",
        "<|endoftext|>",
        "<|end|>",
        ("<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        "Phi3Config",
        {"num_key_value_heads": 4},
        ("--lora-targets", "all-linear"),
        ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
    ),
}


# Gemma2: Gemma's tokenizer and template, another architecture (soft-capping, sliding window).
FAMILIES["gemma2"] = replace(
    FAMILIES["gemma"],
    name="gemma2",
    config="Gemma2Config",
    config_options=FAMILIES["gemma"].config_options | {"sliding_window": 64, "query_pre_attn_scalar": 16},
    flags=("--attn-implementation", "eager"),
)


def train_bpe(lines: list[str], family: Family, vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A BPE vocabulary and merges in the family's style: byte-level symbols (Llama 3), or words
    with spaces as "▁" and every byte as a <0xNN> fallback token (SentencePiece-style)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    if family.tokenizer == "byte-level":
        bpe.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(r"\s?\p{L}+|\s?\p{N}|\s?[^\s\p{L}\p{N}]+|\s+"), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        bpe.normalizer = normalizers.Replace(" ", "▁")
        bpe.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
        alphabet = ["▁"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(family.specials), initial_alphabet=alphabet, show_progress=False
    )
    bpe.train_from_iterator(lines, trainer=trainer)
    trained = json.loads(bpe.to_str())["model"]
    vocab, merges = trained["vocab"], [tuple(m) for m in trained["merges"]]
    if family.tokenizer != "byte-level":  # byte fallback: any character the merges never saw
        for byte in range(256):
            vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return vocab, merges


def build_tokenizer(family: Family, lines: list[str], vocab_size: int) -> object:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import GemmaTokenizer, LlamaTokenizer, PreTrainedTokenizerFast

    vocab, merges = train_bpe(lines, family, vocab_size)
    specials = {"bos_token": family.bos, "eos_token": family.eos}
    extra = [
        AddedToken(t, rstrip=t in family.rstrip, lstrip=False, normalized=False, special=True)
        for t in family.specials
        if t not in (family.bos, family.eos, "<unk>", "<pad>")
    ]
    if family.tokenizer == "byte-level":
        bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, extra_special_tokens=extra, **specials)
    elif family.tokenizer == "gemma":
        tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, extra_special_tokens=extra, **specials)
    else:
        tokenizer = LlamaTokenizer(vocab=vocab, merges=merges, extra_special_tokens=extra, **specials)
    tokenizer.chat_template = family.template
    tokenizer.model_max_length = 512
    return tokenizer


def build_tiny_family(name: str, out_dir: Path, lines: list[str], vocab_size: int = 600, seed: int = 0) -> Path:
    """Save a tiny random model of family `name` (see FAMILIES) and its tokenizer in out_dir."""
    import transformers

    family = FAMILIES[name]
    tokenizer = build_tokenizer(family, lines, vocab_size)
    tokenizer.save_pretrained(out_dir)
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in (("bos", family.bos), ("eos", family.eos))}
    options = SHAPE | family.config_options
    config = getattr(transformers, family.config)(
        vocab_size=len(tokenizer),
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["eos"],
        **options,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = [ids["eos"], tokenizer.convert_tokens_to_ids(family.end_of_turn)]
    model.save_pretrained(out_dir)
    return out_dir
