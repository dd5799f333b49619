"""Beyond Qwen: Llama 3, Gemma, Gemma2, Mistral and Phi-3, each a tiny random model with its own kind of
tokenizer and its family's stock chat template (tests/tiny_families.py), through --model hf.

For each family the tokens trained on are the template's own, the targets exactly each reply and the
token that ends its turn (--show-examples shows them), a packed row gives each example its own loss,
and two ranks train packed LoRA adapters that PEFT reloads. Tokenizer corners (a space fused into a
reply's first token, a special token that takes in the whitespace after it, one typed in a message),
templates that cannot be masked, and flags that do not fit the model are each refused in one line or
handled as documented. The runs share one launch per kind (2 ranks, one plain process)."""

from __future__ import annotations

import copy
import itertools
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY, assert_ok
from rows import stacked
from shared_launch import Shared, share
from test_chat_data import write_jsonl
from test_qwen_lora import saved_adapter
from tiny_families import FAMILIES, MISTRAL_V03_TEMPLATE, build_tiny_family

import llm_ddp_parallel_training as t

NAMES = list(FAMILIES)

# A reply that ends in a newline: templates that trim (Llama 3, Gemma) render it without one.
CONVERSATION = [{"role": "user", "content": "Who sums the gradients?"},
                {"role": "assistant", "content": "Every rank, in the all-reduce.\n"},
                {"role": "user", "content": "And then?"},
                {"role": "assistant", "content": "Each divides by the world size."}]  # fmt: skip
SYSTEM = {"role": "system", "content": "Be brief."}  # Gemma's template has no system role

# What each family trains on for CONVERSATION: the replies as the template renders them, and the
# token that closes each turn. (Mistral's template puts a space before the reply: prompt, unless the
# tokenizer fuses it into the reply's first token; see the SentencePiece test below.)
EXPECTED_TARGETS = {
    "llama3": ["Every rank, in the all-reduce.<|eot_id|>", "Each divides by the world size.<|eot_id|>"],
    "gemma": ["Every rank, in the all-reduce.<end_of_turn>", "Each divides by the world size.<end_of_turn>"],
    "gemma2": ["Every rank, in the all-reduce.<end_of_turn>", "Each divides by the world size.<end_of_turn>"],
    "mistral": ["Every rank, in the all-reduce.\n</s>", "Each divides by the world size.</s>"],
    "phi3": ["Every rank, in the all-reduce.\n<|end|>", "Each divides by the world size.<|end|>"],
}


def conversation(name: str) -> list[dict]:
    return CONVERSATION if name.startswith("gemma") else [SYSTEM, *CONVERSATION]


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory, corpus_lines) -> dict:
    """Each family's tiny model folder, built once per session when a test first asks for it."""
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = build_tiny_family(name, tmp_path_factory.mktemp(name), corpus_lines)
        return built[name]

    return get


@pytest.fixture(scope="module")
def family_chat_file(tmp_path_factory, corpus_lines) -> str:
    """One user/assistant conversation per corpus line (every family's template takes these)."""
    records = []
    for line in corpus_lines:
        words = line.split()
        half = max(1, len(words) // 2)
        records.append({"messages": [{"role": "user", "content": " ".join(words[:half])},
                                     {"role": "assistant", "content": " ".join(words[half:]) or "Yes."}]})  # fmt: skip
    return write_jsonl(tmp_path_factory.mktemp("family_chat") / "chat.jsonl", records)


def hf_args(model_dir, out_dir, *extra: str) -> list[str]:
    return ["--model", "hf", "--model-name-or-path", str(model_dir), "--cpu", "--output-dir", str(out_dir),
            "--batch-size", "2", "--seq-len", "128", "--sample-tokens", "8", "--lr", "1e-2", *extra]  # fmt: skip


def tokenizer_of(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


PLAIN_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant: {% endif %}")  # fmt: skip
TINY_REFUSALS = [
    (["--model-name-or-path", "meta-llama/Llama-3.2-1B"], "--model-name-or-path meta-llama/Llama-3.2-1B is"),
    (["--lora-r", "16", "--lora-targets", "all-linear"], "--lora-r 16 and --lora-targets all-linear are"),
    (["--gradient-checkpointing"], "--gradient-checkpointing is"),
]


def with_plain_template(tiny_qwen: Path, folder: Path) -> Path:
    """A copy of the tiny Qwen2 whose chat template has no special token closing a turn."""
    model_dir = shutil.copytree(tiny_qwen, folder)
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    for old in model_dir.glob("chat_template.*"):
        old.unlink()
    config_file.write_text(json.dumps(config | {"chat_template": PLAIN_TEMPLATE}))
    return model_dir


@pytest.fixture(scope="module")
def two_ranks(family_dirs, family_chat_file, tmp_path_factory) -> Shared:
    """Every family's packed LoRA training on two ranks, in one launch."""
    root = tmp_path_factory.mktemp("families_two_ranks")
    flags = ["--corpus-file", family_chat_file, "--pack", "--max-steps", "3", "--eval-every", "0"]
    jobs = {name: hf_args(family_dirs(name), root / name, *flags, *FAMILIES[name].flags) for name in NAMES}
    return share(root, jobs, nproc=2)


@pytest.fixture(scope="module")
def one_process(family_dirs, family_chat_file, tiny_qwen, tmp_path_factory) -> Shared:
    """This module's plain-process runs, in one launch: --show-examples for every family, Gemma2 with
    the default attention, a template that cannot be masked (with and without --train-on-prompt), and
    pretrained-model flags given to the tiny model."""
    root = tmp_path_factory.mktemp("families_one_process")
    jobs = {}
    for name in NAMES:
        path = write_jsonl(root / f"{name}.jsonl", [{"messages": conversation(name)}])
        jobs[f"show_{name}"] = hf_args(family_dirs(name), root / f"show_{name}", "--corpus-file", path,
                                       "--show-examples", "1")  # fmt: skip
    jobs["gemma2_sdpa"] = hf_args(family_dirs("gemma2"), root / "gemma2_sdpa", "--corpus-file", family_chat_file,
                                  "--max-steps", "1")  # fmt: skip
    plain = with_plain_template(tiny_qwen, root / "plain_template")
    flags = ["--corpus-file", family_chat_file, "--max-steps", "2", "--seq-len", "64"]
    jobs["masked"] = hf_args(plain, root / "masked", *flags)
    jobs["every_token"] = hf_args(plain, root / "every_token", *flags, "--train-on-prompt")
    for k, (refused, _) in enumerate(TINY_REFUSALS):
        jobs[f"tiny_{k}"] = [*TINY, "--max-steps", "1", "--output-dir", root / f"tiny_{k}", *refused]
    return share(root, jobs, nproc=None)


@pytest.mark.parametrize("name", NAMES)
def test_show_examples_targets_exactly_each_reply_and_the_token_that_ends_its_turn(name, family_dirs, one_process):
    run = one_process[f"show_{name}"]
    assert_ok(run)
    body = run.stdout.split("--- example 1: ")[1].split("\n", 1)[1].removesuffix("\n")
    assert re.findall(r"\[\[(.*?)\]\]", body, re.S) == EXPECTED_TARGETS[name]
    tokenizer = tokenizer_of(family_dirs(name))
    # The text of the template's own tokens (Phi-3's <|end|> takes in the newline after it).
    rendered = tokenizer.decode(tokenizer.apply_chat_template(conversation(name), tokenize=True)["input_ids"])
    assert body.replace("[[", "").replace("]]", "") == rendered, "nothing missing, nothing added"


@pytest.mark.parametrize("name", NAMES)
def test_the_tokens_trained_on_are_the_ones_the_chat_template_gives(name, family_dirs):
    tokenizer = tokenizer_of(family_dirs(name))
    messages = conversation(name)
    record = t.Record(messages=tuple((m["role"], m["content"]) for m in messages))
    seq = t.tokenize_record(record, tokenizer, False, t.chat_masking(tokenizer))
    assert seq.ids == list(tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"])
    end = tokenizer.convert_tokens_to_ids(FAMILIES[name].end_of_turn)
    assert t.turn_closing_token(tokenizer) == end
    assert [i for i, y in zip(seq.ids, seq.is_target, strict=True) if y].count(end) == 2, "one per reply"


@pytest.mark.parametrize("name", NAMES)
def test_a_packed_row_gives_each_example_its_own_loss(name, family_dirs, tmp_path):
    """Packed examples keep apart under each family's attention (sdpa; eager for Gemma2), and the
    loss the script computes (the lean head, or Gemma2's own soft-capped logits) is the model's."""
    model_dir = family_dirs(name)
    cfg = t.parse_args(hf_args(model_dir, tmp_path, "--pack", "--seq-len", "256", *FAMILIES[name].flags))
    records = [t.Record(messages=tuple((m["role"], m["content"]) for m in conversation(name)[-k:])) for k in (2, 4)]
    records.append(t.Record(text="every gradient, averaged"))
    kit = t.build_pretrained_kit(cfg, t.laid_out(t.setup_distributed(cfg), cfg), records, [])
    kit.model.eval()
    assert len(kit.train) == 1, "all three fit one row"
    rows = stacked(kit.train)
    inputs, targets, positions = rows.inputs, rows.targets, rows.positions
    starts = (positions[0] == 0).nonzero().flatten().tolist()  # each example's, then the padded tail's
    with torch.no_grad():
        packed = kit.loss(kit.trained, *kit.collate([kit.train[0]])).item()  # the batch as train() gets it
        alone = 0.0
        for a, b in itertools.pairwise([*starts, inputs.shape[1]]):
            logits = kit.model(input_ids=inputs[:, a:b], use_cache=False).logits
            alone += t.token_loss_sum(logits, targets[:, a:b]).item()
    print(f"{name}: packed row loss {packed:.6f}, examples alone {alone:.6f}")
    assert packed == pytest.approx(alone, rel=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_train_packed_lora_and_the_adapter_reloads_with_peft(name, family_dirs, two_ranks):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, out = two_ranks[name], two_ranks.out(name)
    assert_ok(run)
    assert "[sample] What does an all-reduce do? -> " in run.stdout
    weights = saved_adapter(out)[1]
    assert any(v.abs().max() > 0 for k, v in weights.items() if "lora_B" in k), "the adapters trained"
    all_linear = "all-linear" in FAMILIES[name].flags
    base = AutoModelForCausalLM.from_pretrained(family_dirs(name), attn_implementation="eager")
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        before = base(input_ids=ids).logits
        tuned = PeftModel.from_pretrained(base, out / "qwen_lora")
        after = tuned(input_ids=ids).logits
    assert (after - before).abs().max() > 0, "the reloaded adapters change the model's output"
    if all_linear:
        assert any("qkv_proj" in k for k in weights) and not any("lm_head" in k for k in weights)


def test_a_sentencepiece_token_that_carries_the_separating_space_into_the_reply_is_a_target(family_dirs):
    """Mistral renders "[/INST]" + " " + reply: the space is the template's, but where the tokenizer
    fuses it into the reply's first token ("▁rank"), the model emits that token after "[/INST]"
    and it is a target; the text before it is not."""
    tokenizer = tokenizer_of(family_dirs("mistral"))
    fused = tokenizer.convert_tokens_to_ids("▁rank")
    assert fused != tokenizer.unk_token_id, "this tiny vocabulary has the fused token"
    record = t.Record(messages=(("user", "Hi"), ("assistant", "rank by rank")))
    seq = t.tokenize_record(record, tokenizer, False, t.chat_masking(tokenizer))
    first = seq.is_target.index(True)
    assert seq.ids[first] == fused and tokenizer.decode(seq.ids[:first]) == "<s> [INST] Hi [/INST]"
    assert seq.ids[-1] == tokenizer.eos_token_id and all(seq.is_target[first:])


def test_a_special_token_that_takes_in_the_whitespace_after_it_is_no_target(family_dirs):
    """Phi-3's <|assistant|> strips the whitespace after it (rstrip): its offsets take in a reply's
    leading space, yet only its own characters decide whether it is a target."""
    tokenizer = tokenizer_of(family_dirs("phi3"))
    record = t.Record(messages=(("user", "Hi"), ("assistant", " Hello")))
    seq = t.tokenize_record(record, tokenizer, False, t.chat_masking(tokenizer))
    targets = [i for i, y in zip(seq.ids, seq.is_target, strict=True) if y]
    assert tokenizer.convert_ids_to_tokens(targets)[-1] == "<|end|>"
    assert tokenizer.convert_tokens_to_ids("<|assistant|>") not in targets
    assert tokenizer.decode(targets) == "Hello<|end|>"


@pytest.mark.parametrize("name", ["mistral", "phi3"])
def test_a_special_token_typed_in_a_message_stays_the_text_the_user_typed(name, family_dirs):
    """It is encoded again as ordinary characters, with no "▁" before them: a SentencePiece-style
    tokenizer adds one to a text encoded alone, a space the user never typed."""
    tokenizer = tokenizer_of(family_dirs(name))
    eos = tokenizer.eos_token
    record = t.Record(messages=(("user", f"say {eos} now"), ("assistant", f"I say {eos}")))
    seq = t.tokenize_record(record, tokenizer, False, t.chat_masking(tokenizer))
    text = tokenizer.decode(seq.ids)
    assert f"say {eos} now" in text and f"I say {eos}" in text and f"  {eos}" not in text
    assert seq.ids.count(tokenizer.eos_token_id) == 1, "the template's own only (after the reply, or at the end)"


def test_mistral_v03_drops_the_system_message_once_a_reply_follows_so_such_conversations_are_refused(family_dirs):
    """Its template renders the system message only before a final user turn: training would see
    conversations without it, and the model is prompted with it. Without one it masks as v0.2 does."""
    tokenizer = copy.deepcopy(tokenizer_of(family_dirs("mistral")))
    tokenizer.chat_template = MISTRAL_V03_TEMPLATE
    plain = t.Record(messages=(("user", "Hi"), ("assistant", "ok\n"), ("user", "more"), ("assistant", "sure")))
    seq = t.tokenize_record(plain, tokenizer, False, t.chat_masking(tokenizer))
    targets = [i for i, y in zip(seq.ids, seq.is_target, strict=True) if y]
    assert tokenizer.decode(targets) == "ok</s> sure</s>", "trimmed; the second carries its separator: ▁sure"
    with_system = t.Record(messages=(("system", "Be brief."), *plain.messages), source="chat.jsonl:4")
    with pytest.raises(t.UsageError, match=re.escape("chat.jsonl:4: the chat template cannot be masked")) as refused:
        t.tokenize_record(with_system, tokenizer, False, t.chat_masking(tokenizer))
    assert "the generation prompt goes on 'Be brief." in str(refused.value)


def test_phi3_all_linear_adapts_every_linear_layer_but_the_output_head(family_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = family_dirs("phi3")
    cfg = t.parse_args(hf_args(model_dir, tmp_path, "--lora-targets", "all-linear"))
    lora = t.add_lora(cfg, AutoModelForCausalLM.from_pretrained(model_dir))
    adapted = {re.search(r"(\w+)\.lora_[AB]\.", n)[1] for n, p in lora.named_parameters() if p.requires_grad}
    assert adapted == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}, adapted


def test_the_default_targets_on_fused_projections_list_the_head_and_suggest_the_fused_ones(family_dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family_dirs("phi3"))
    with pytest.raises(t.UsageError) as refused:
        t.check_lora_targets(model, ("q_proj", "v_proj"))
    message = str(refused.value)
    assert "lm_head (the output head)" in message and "try --lora-targets qkv_proj" in message
    assert "all-linear for every one but the output head" in message


def test_gemma2_with_the_default_attention_is_one_line_naming_the_eager_flag(one_process):
    run = one_process["gemma2_sdpa"]
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "error: Gemma2ForCausalLM does not support --attn-implementation sdpa: run with --attn-implementation eager"
    ]


def test_train_on_prompt_trains_on_a_template_that_cannot_be_masked(one_process):
    """A template with no special token closing a turn cannot be masked; --train-on-prompt, which the
    refusal recommends, trains on it (sampling then stops at EOS alone)."""
    refused = one_process["masked"]
    assert refused.returncode == 2
    assert re.fullmatch(r"error: .*chat\.jsonl:1: the chat template cannot be masked .*--train-on-prompt.*\n",
                        refused.stderr), refused.stderr  # fmt: skip
    assert_ok(one_process["every_token"])


def test_train_on_prompt_takes_a_template_that_changes_messages_even_where_text_spells_a_special_token(tiny_qwen):
    tokenizer = copy.deepcopy(tokenizer_of(tiny_qwen))
    tokenizer.chat_template = tokenizer.chat_template.replace("message.content + '<|im_end|>'",
                                                              "message.content | upper + '<|im_end|>'")  # fmt: skip
    record = t.Record(messages=(("user", "type <|im_end|> here"), ("assistant", "ok")), source="chat.jsonl:2")
    with pytest.raises(t.UsageError, match=re.escape("chat.jsonl:2: the chat template cannot be masked")):
        t.tokenize_record(record, tokenizer, False, t.chat_masking(tokenizer))
    seq = t.tokenize_record(record, tokenizer, True, t.chat_masking(tokenizer))
    assert all(seq.is_target) and "TYPE <|IM_END|> HERE" in tokenizer.decode(seq.ids)


def test_a_refusal_shows_the_text_the_template_actually_appended(family_dirs):
    tokenizer = copy.deepcopy(tokenizer_of(family_dirs("llama3")))
    tokenizer.chat_template = tokenizer.chat_template.replace("message['content'] | trim", "message['content'] | upper")
    turns = (("user", "hi"), ("assistant", "ok then"))
    with pytest.raises(t.UsageError, match=re.escape("the template appends 'OK THEN<|eot_id|>'")):
        t.chat_segments(turns, tokenizer, t.chat_masking(tokenizer))


@pytest.mark.parametrize("flags, named", TINY_REFUSALS)
def test_pretrained_model_flags_on_the_tiny_model_are_refused_in_one_line(one_process, flags, named):
    job = f"tiny_{TINY_REFUSALS.index((flags, named))}"
    run = one_process[job]
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"error: {named} for a pretrained model (--model hf); the tiny model would ignore "
        + ("them: add --model hf, or leave them out" if " are" in named else "it: add --model hf, or leave it out")
    ]
    assert not (one_process.out(job) / "tiny_transformer.pt").exists()


def test_tiny_model_flags_typed_with_a_pretrained_model_are_refused_in_one_line_naming_them():
    # The pretrained model's shape comes from its weights: typed, --d-model and the rest would be ignored.
    typed = ["--model", "hf", "--d-model", "64", "--n-heads=2", "--n-layers", "3", "--dropout", "0.1"]
    with pytest.raises(t.UsageError) as refused:
        t.parse_args(typed)
    assert str(refused.value) == (
        "--d-model 64, --n-heads 2, --n-layers 3 and --dropout 0.1 are for the tiny model (--model tiny); "
        "a pretrained model would ignore them: leave them out"
    )
    t.parse_args(["--model", "hf", "--seq-len", "64"])  # their defaults are not typed: nothing to refuse


def test_qwen_stays_a_spelling_of_hf_and_its_checkpoints_resume_under_hf():
    assert t.parse_args(["--model", "qwen"]).model == t.parse_args(["--model", "hf"]).model == "hf"
    assert t.parse_args(["--model", "qwen", "--lora-r", "4"]).lora_r == 4, "its flags are welcome"
    t.check_same_run({"settings": {"model": "qwen", "seed": 1}}, {"model": "hf", "seed": 1}, t.Path("ckpt"))
    with pytest.raises(t.UsageError, match="'tiny' then, 'hf' now"):
        t.check_same_run({"settings": {"model": "tiny"}}, {"model": "hf"}, t.Path("ckpt"))


def test_all_linear_is_given_alone():
    with pytest.raises(t.UsageError, match="all-linear already names every linear layer: give it alone"):
        t.parse_args(["--model", "hf", "--lora-targets", "all-linear,o_proj"])
