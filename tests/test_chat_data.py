"""Chat data for the Qwen path: the JSONL schemas users bring, assistant-only targets derived from
the chat template itself, truncation, --show-examples, and DDP training on conversations.

A bad record or an unusable conversation ends every rank with one line naming its file and line;
padding and packing never change what a real position computes (sdpa, and the flash-attention path
emulated on a CPU); the lean head gives the full logits' loss and gradients; packed chat training
resumes bit-exactly after a killed worker. The runs whose subject is not the launch share one launch
per kind (2 ranks, one plain process); the resume after a kill keeps a launch of its own."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import re

import pytest
import torch
from conftest import TINY, assert_ok, run_cmd, torchrun_cmd
from rows import stacked
from shared_launch import Shared, error_lines, share
from test_qwen_lora import NEEDS_PEFT, qwen_args, saved_adapter

import llm_ddp_parallel_training as t

pytestmark = NEEDS_PEFT  # its runs train LoRA adapters, as test_qwen_lora.py's do

REPLIES = [{"role": "user", "content": "Who sums the gradients?"},
           {"role": "assistant", "content": "Every rank, in the all-reduce."},
           {"role": "user", "content": "And then?"},
           {"role": "assistant", "content": "Each divides by the world size."}]  # fmt: skip


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory, corpus_lines) -> str:
    """One conversation per corpus line: the user says its first half, the assistant its second."""
    records = []
    for i, line in enumerate(corpus_lines):
        words = line.split()
        half = max(1, len(words) // 2)
        turns = [{"role": "user", "content": " ".join(words[:half])},
                 {"role": "assistant", "content": " ".join(words[half:]) or "Yes."}]  # fmt: skip
        records.append({"messages": [{"role": "system", "content": "Be brief."}, *turns] if i % 3 else turns})
    return write_jsonl(tmp_path_factory.mktemp("chat") / "chat.jsonl", records)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen)


BAD_RECORD = '{"messages": "oops"}'  # on line 2, after a good conversation
PACKED_RESUME_FLAGS = ["--seq-len", "256", "--pack", "--max-steps", "6", "--save-every", "2", "--verify-sync", "1"]
UNUSABLE = [
    ({"messages": [{"role": "assistant", "content": "I start"}, {"role": "user", "content": "ok"},
                   {"role": "assistant", "content": "end"}]}, "opens with an assistant turn"),
    ({"messages": [{"role": "user", "content": "Hi \ud800"}, {"role": "assistant", "content": "x"}]},
     "field 'content' is not valid text"),
]  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks(tiny_qwen, chat_file, tmp_path_factory) -> Shared:
    """This module's 2-rank runs, in one launch: a file with a bad record, training on conversations,
    and the uninterrupted packed run the resume test compares with."""
    root = tmp_path_factory.mktemp("chat_two_ranks")
    bad = root / "bad.jsonl"
    bad.write_text(json.dumps({"messages": REPLIES}) + "\n" + BAD_RECORD + "\n")
    jobs = {
        "bad_record": qwen_args(tiny_qwen, root / "bad_record", "--corpus-file", bad),
        "conversations": qwen_args(tiny_qwen, root / "conversations", "--corpus-file", chat_file, "--seq-len", "96",
                                   "--max-steps", "6", "--log-every", "1", "--verify-sync", "1"),
        "whole": qwen_args(tiny_qwen, root / "whole", "--corpus-file", chat_file, *PACKED_RESUME_FLAGS),
    }  # fmt: skip
    return share(root, jobs, nproc=2)


@pytest.fixture(scope="module")
def one_process(tiny_qwen, chat_file, tmp_path_factory) -> Shared:
    """This module's plain-process runs, in one launch: chat records for the tiny byte model,
    --show-examples, conversations that cannot be used, eager and flash attention."""
    root = tmp_path_factory.mktemp("chat_one_process")
    shown = write_jsonl(root / "shown.jsonl", [{"messages": REPLIES}, {"messages": REPLIES[:2]}])
    jobs = {
        "tiny": [*TINY, "--corpus-file", chat_file, "--output-dir", root / "tiny"],
        "show_examples": qwen_args(tiny_qwen, root / "show_examples", "--corpus-file", shown, "--seq-len", "256",
                                   "--show-examples", "1"),
        "eager": qwen_args(tiny_qwen, root / "eager", "--attn-implementation", "eager", "--max-steps", "2"),
        "flash": qwen_args(tiny_qwen, root / "flash", "--attn-implementation", "flash_attention_2"),
    }  # fmt: skip
    for k, (record, _) in enumerate(UNUSABLE):
        path = root / f"unusable_{k}.json"  # .json is read as JSON lines too
        path.write_text(json.dumps({"messages": REPLIES}) + "\n" + json.dumps(record) + "\n")
        jobs[f"unusable_{k}"] = qwen_args(tiny_qwen, root / f"unusable_{k}", "--corpus-file", path, "--seq-len", "256")
    return share(root, jobs, nproc=None)


@pytest.mark.parametrize(
    "record, expected",
    [({"text": "a line"}, t.Record(text="a line")),
     ({"messages": REPLIES[:2]}, t.Record(messages=(("user", "Who sums the gradients?"),
                                                    ("assistant", "Every rank, in the all-reduce.")))),
     ({"prompt": "2 + 2 =", "completion": " 4"}, t.Record(prompt="2 + 2 =", completion=" 4")),
     ({"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                         {"from": "gpt", "value": "Hello"}]},
      t.Record(messages=(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello")))),
     ({"instruction": "Add", "input": "2 and 2", "output": "4"},
      t.Record(messages=(("user", "Add\n\n2 and 2"), ("assistant", "4")))),
     ({"instruction": "Say hi", "output": "Hi"}, t.Record(messages=(("user", "Say hi"), ("assistant", "Hi"))))],
)  # fmt: skip
def test_every_jsonl_schema_becomes_text_a_conversation_or_a_prompt_with_completion(tmp_path, record, expected):
    records, _ = t.read_records(t.Path(write_jsonl(tmp_path / "one.jsonl", [record])), "auto")
    assert records == [expected]


@pytest.mark.parametrize(
    "line, expected",
    [('{"messages": [{"role": "user", "content": "Hi"}', "not valid JSON"),
     ('{"prompt": "Hi"}', "field 'completion' is missing"),
     ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}',
      "field 'content' is a int, not a string"),
     ('{"messages": [{"role": "wizard", "content": "Hi"}]}', "unknown role 'wizard'"),
     ('{"messages": [{"role": "system", "content": "Hi"}, {"role": "user", "content": "Hi"}]}',
      "no assistant turn"),
     ('{"conversations": [{"from": "bot", "value": "Hi"}]}', "unknown role 'bot'"),
     ('["a", "list"]', "must be a JSON object"),
     ('{"title": "x"}', "no known fields (title)"),
     ('{"text": "a line"}', "a text record, but line 1 is messages")],
)  # fmt: skip
def test_a_bad_record_is_named_by_file_and_line(tmp_path, line, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": REPLIES}) + "\n\n" + line + "\n")
    with pytest.raises(t.UsageError, match=re.escape(f"{path}:3: ") + ".*" + re.escape(expected)):
        t.read_records(path, "auto")


def test_a_bad_record_ends_every_rank_with_one_line_before_training(two_ranks):
    run, path = two_ranks["bad_record"], two_ranks.root / "bad.jsonl"
    errors = error_lines(run)
    assert run.returncode != 0 and run.codes == (2, 2), "every rank exits with the usage-error code"
    assert len(errors) == 1 and f"{path}:2: field 'messages' must be a non-empty list" in errors[0], run.stderr
    assert "step " not in run.stdout


def test_the_tiny_byte_model_refuses_chat_records(one_process):
    run = one_process["tiny"]
    assert run.returncode == 2 and "holds messages records; the tiny byte model trains on text" in run.stderr


def test_the_stock_qwen_template_has_no_generation_markers_so_transformers_masks_nothing(tokenizer):
    # The trap this script avoids (transformers#34172): return_assistant_tokens_mask needs
    # {% generation %} markers, which Qwen2.5's template lacks, and then it marks nothing.
    assert "{% generation %}" not in tokenizer.chat_template and "{%- generation" not in tokenizer.chat_template
    out = tokenizer.apply_chat_template(REPLIES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert not any(out["assistant_masks"])


def test_targets_are_each_reply_and_the_token_that_ends_its_turn(tokenizer):
    seq = t.tokenize_record(t.Record(messages=tuple((m["role"], m["content"]) for m in REPLIES)), tokenizer,
                            False, t.chat_masking(tokenizer))  # fmt: skip
    pairs = zip(seq.ids, seq.is_target, strict=True)
    runs = [tokenizer.decode([i for i, _ in run]) for target, run in itertools.groupby(pairs, lambda p: p[1]) if target]
    assert runs == ["Every rank, in the all-reduce.<|im_end|>", "Each divides by the world size.<|im_end|>"]
    assert tokenizer.decode(seq.ids).startswith("<|im_start|>system\nYou are Qwen")  # the template's default


def test_a_template_that_cannot_be_masked_is_refused(tokenizer):
    shouting = tokenizer.chat_template.replace(
        "message.content + '<|im_end|>'", "message.content | upper + '<|im_end|>'"
    )
    assert shouting != tokenizer.chat_template
    tokenizer_copy = copy.deepcopy(tokenizer)
    tokenizer_copy.chat_template = shouting
    with pytest.raises(t.UsageError, match=r"chat template cannot be masked.*--train-on-prompt"):
        t.chat_segments(
            tuple((m["role"], m["content"]) for m in REPLIES), tokenizer_copy, t.chat_masking(tokenizer_copy)
        )


def test_prompt_completion_targets_the_completion_and_the_eos(tokenizer):
    seq = t.tokenize_record(t.Record(prompt="the gradient", completion=" is averaged"), tokenizer, False, None)
    targets = [i for i, target in zip(seq.ids, seq.is_target, strict=True) if target]
    assert tokenizer.decode(targets) == " is averaged<|endoftext|>"
    everything = t.tokenize_record(t.Record(prompt="the gradient", completion=" is averaged"), tokenizer, True, None)
    assert all(everything.is_target)


def test_truncation_keeps_the_start_and_drops_records_left_without_a_target(tokenizer):
    replies = t.Record(messages=tuple((m["role"], m["content"]) for m in REPLIES))
    question = t.Record(messages=(("user", "why " * 80), ("assistant", "Because.")))
    whole = t.tokenize_record(replies, tokenizer, False, t.chat_masking(tokenizer))
    seq_len = len(whole.ids) - 5  # cuts into the second reply; the long question loses its answer
    rows, counts = t.encode_records_with_tokenizer([replies, question], tokenizer, seq_len)
    examples = stacked(rows)
    assert counts == {"records": 2, "truncated": 2, "dropped": 1} and len(examples) == 1
    assert examples.inputs[0].tolist() == whole.ids[:seq_len], "a cut record keeps its start"
    kept_targets = int((examples.targets[0] != t.IGNORE_INDEX).sum())
    assert 0 < kept_targets < sum(whole.is_target)
    with pytest.raises(t.UsageError, match="no record keeps a target token within --seq-len 8"):
        t.encode_records_with_tokenizer([replies, question], tokenizer, seq_len=8)


def test_show_examples_prints_records_in_file_order_with_targets_bracketed(one_process):
    run = one_process["show_examples"]
    assert_ok(run)
    assert run.stdout.count("--- example ") == 1 and "--- example 1: " in run.stdout
    body = run.stdout.split("--- example 1: ")[1]
    assert re.findall(r"\[\[(.*?)\]\]", body, re.S) == [
        "Every rank, in the all-reduce.<|im_end|>", "Each divides by the world size.<|im_end|>"]  # fmt: skip
    assert "<|im_start|>user\nWho sums the gradients?<|im_end|>" in body
    assert not (one_process.out("show_examples") / "qwen_lora").exists(), "--show-examples trains nothing"


def test_show_examples_reads_and_checks_the_whole_file_before_it_shows_the_first(tmp_path):
    # The check the README tells users to run before spending GPU hours: a bad line 7 fails it, not training.
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(6)) + "{not json\n")
    with pytest.raises(t.UsageError, match=r"data\.jsonl:7: not valid JSON"):
        t.first_records(t.parse_args(["--corpus-file", str(path), "--show-examples", "2"]), 2)
    text = tmp_path / "data.txt"
    text.write_bytes(b"".join(b"line %d\n" % i for i in range(6)) + "caf\xe9\n".encode("latin-1"))
    with pytest.raises(t.UsageError, match=r"not valid UTF-8: \S+data\.txt \(bad byte at offset 45\)"):
        t.first_records(t.parse_args(["--corpus-file", str(text), "--show-examples", "2"]), 2)


def test_two_ranks_train_on_conversations_and_the_sample_is_a_reply(two_ranks):
    run = two_ranks["conversations"]
    assert_ok(run)
    assert re.search(r"training messages records -> \d+ examples of 96 tokens; \d+ cut to --seq-len 96", run.stdout)
    assert "[sample] What does an all-reduce do? -> " in run.stdout


def test_packed_chat_training_resumes_bit_exactly_after_a_killed_worker(tiny_qwen, chat_file, two_ranks, tmp_path):
    assert_ok(two_ranks["whole"])  # the uninterrupted run, in the shared launch
    faulted = qwen_args(tiny_qwen, tmp_path / "faulted", "--corpus-file", chat_file, *PACKED_RESUME_FLAGS,
                        "--inject-fault", "0:5")  # fmt: skip
    run = run_cmd(torchrun_cmd(2, faulted, ["--standalone", "--max-restarts=1"]), timeout=240)
    assert_ok(run)
    assert "step_00000004 (step 4" in run.stdout
    whole, resumed = saved_adapter(two_ranks.out("whole"))[1], saved_adapter(tmp_path / "faulted")[1]
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_a_batch_is_padded_only_to_its_longest_example(tokenizer):
    records = [t.Record(text="short"), t.Record(text="a somewhat longer line of text here")]
    examples, _ = t.encode_records_with_tokenizer(records, tokenizer, seq_len=64)
    inputs, targets = t.trim_padding([examples[0], examples[1]])
    longest = int((stacked(examples).targets != t.IGNORE_INDEX).sum(dim=1).max())
    assert inputs.shape == targets.shape == (2, longest) and longest < 64


def test_padding_never_changes_a_real_positions_output(tiny_qwen, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen, attn_implementation="sdpa").eval()
    records = [t.Record(messages=tuple((m["role"], m["content"]) for m in REPLIES[:2])), t.Record(text="x " * 150)]
    examples, _ = t.encode_records_with_tokenizer(records, tokenizer, seq_len=256)
    inputs, _ = t.trim_padding([examples[0], examples[1]])
    examples = stacked(examples)
    real = int((examples.targets[0] != t.IGNORE_INDEX).nonzero().max()) + 1
    assert real < inputs.shape[1], "the conversation is padded in this batch"
    with torch.no_grad():
        alone = model(input_ids=examples.inputs[:1, :real]).logits[0]
        padded = model(input_ids=inputs).logits[0, :real]
    difference = (alone - padded).abs().max().item()
    print(f"padded vs alone: max |logit difference| = {difference:.3g}")
    assert difference <= 1e-5


def test_a_packed_example_gives_the_same_logits_as_alone_and_keeps_its_own_targets(tiny_qwen, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen, attn_implementation="sdpa").eval()
    records = [t.Record(messages=tuple((m["role"], m["content"]) for m in REPLIES[:k])) for k in (2, 4)]
    records += [t.Record(prompt="the ranks", completion=" agree"), t.Record(text="every gradient, averaged")]
    alone = stacked(t.encode_records_with_tokenizer(records, tokenizer, seq_len=256)[0])
    packed = stacked(t.encode_records_with_tokenizer(records, tokenizer, seq_len=256, pack=True)[0])
    assert len(packed) == 1, "all four fit one row"
    starts = (packed.positions[0] == 0).nonzero().flatten().tolist()
    with torch.no_grad():
        row = model(input_ids=packed.inputs, position_ids=packed.positions, use_cache=False).logits[0]
        worst = 0.0
        for i, at in enumerate(starts[: len(records)]):
            n = int((alone.targets[i] != t.IGNORE_INDEX).nonzero().max()) + 1
            # The row holds this example's own inputs and targets: no target crosses a boundary.
            assert torch.equal(packed.inputs[0, at : at + n], alone.inputs[i, :n])
            assert torch.equal(packed.targets[0, at : at + n], alone.targets[i, :n])
            own = model(input_ids=alone.inputs[i : i + 1, :n]).logits[0]
            worst = max(worst, (row[at : at + n] - own).abs().max().item())
    print(f"packed vs alone: max |logit difference| = {worst:.3g}")
    assert worst <= 1e-5
    # Without position_ids the examples would attend to each other: the test can tell.
    with torch.no_grad():
        leaky = model(input_ids=packed.inputs, use_cache=False).logits[0]
    assert (leaky[starts[1] : starts[2]] - row[starts[1] : starts[2]]).abs().max().item() > 1e-3


@pytest.mark.parametrize("head", ["fused", "chunked"])
@pytest.mark.parametrize("finetune", ["lora", "full"])  # full: the tied head and embedding weight trains
@pytest.mark.parametrize("pack", [False, True])
def test_the_lean_head_gives_the_full_logits_loss_and_gradients(
    tiny_qwen, chat_file, tmp_path, monkeypatch, pack, finetune, head
):
    # Chunks of 7 target tokens, so every batch crosses several chunk boundaries.
    monkeypatch.setattr(t.LeanHeadLoss, "CHUNK", 7)
    monkeypatch.setattr(t.FusedHeadLoss, "FROZEN_ROWS", 7)
    monkeypatch.setattr(t.FusedHeadLoss, "TRAINED_ROWS", 7)
    flags = ["--seq-len", "128", "--finetune", finetune, "--head-loss", head, *(["--pack"] if pack else [])]
    cfg = t.parse_args(qwen_args(tiny_qwen, tmp_path, *flags))
    d = t.laid_out(t.setup_distributed(cfg), cfg)  # one plain process, laid out as main lays it
    records, _ = t.read_records(t.Path(chat_file), "auto")
    kit = t.build_pretrained_kit(cfg, d, records[:24], [])
    kit.model.eval()  # LoRA dropout off: both paths must see the same network
    inputs, targets, *positions = t.trim_padding([kit.train[i] for i in range(4)])
    params = [p for p in kit.model.parameters() if p.requires_grad]
    lean = kit.loss(kit.trained, *kit.collate([kit.train[i] for i in range(4)]))  # as train() gets it
    lean_grads = torch.autograd.grad(lean, params)
    logits = kit.model(input_ids=inputs, position_ids=positions[0] if positions else None, use_cache=False).logits
    full = t.token_loss_sum(logits, targets)
    full_grads = torch.autograd.grad(full, params)
    assert lean.item() == pytest.approx(full.item(), rel=1e-5)
    worst = max(((a - b).norm() / b.norm()).item() for a, b in zip(lean_grads, full_grads, strict=True) if b.norm() > 0)
    print(f"{head} head vs full logits: loss {lean.item():.6f} vs {full.item():.6f}, worst gradient {worst:.2g}")
    assert worst <= 1e-5
    assert f"; head loss {head}" in kit.describe


@pytest.mark.parametrize("record, expected", UNUSABLE)
def test_a_conversation_that_cannot_be_used_is_one_line_naming_its_record(one_process, record, expected):
    job = f"unusable_{UNUSABLE.index((record, expected))}"
    run, path = one_process[job], one_process.root / f"{job}.json"
    assert run.returncode == 2
    errors = error_lines(run)
    assert len(errors) == 1 and f"{path}:2: " in errors[0] and expected in errors[0], run.stderr


def test_train_on_prompt_needs_no_mask_so_any_template_will_do(tokenizer):
    plain = copy.deepcopy(tokenizer)  # no special token closes a turn: nothing marks where a reply ends
    plain.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                           "{% if add_generation_prompt %}assistant: {% endif %}")  # fmt: skip
    record = t.Record(messages=(("user", "Hi"), ("assistant", "ok")), source="chat.jsonl:7")
    with pytest.raises(t.UsageError, match=re.escape("chat.jsonl:7: the chat template cannot be masked")):
        t.tokenize_record(record, plain, False, t.chat_masking(plain))
    seq = t.tokenize_record(record, plain, True, t.chat_masking(plain))
    assert all(seq.is_target) and plain.decode(seq.ids) == "user: Hi\nassistant: ok\n"
    assert t.turn_closing_token(plain) is None, "sampling stops at EOS alone"


def test_a_template_that_trims_replies_targets_the_reply_as_it_renders(tokenizer):
    trimming = copy.deepcopy(tokenizer)
    trimming.chat_template = tokenizer.chat_template.replace("message.content + '<|im_end|>'",
                                                             "message.content | trim + '<|im_end|>'")  # fmt: skip
    spaced = t.Record(messages=(("user", "Hi"), ("assistant", "ok  \n")), source="chat.jsonl:7")
    seq = t.tokenize_record(spaced, trimming, False, t.chat_masking(trimming))
    assert trimming.decode([i for i, y in zip(seq.ids, seq.is_target, strict=True) if y]) == "ok<|im_end|>"


def test_eager_attention_trains_and_flash_attention_on_cpu_is_one_line(one_process):
    assert_ok(one_process["eager"])
    run = one_process["flash"]
    assert run.returncode == 2 and "flash_attention_2 needs a CUDA GPU" in run.stderr


def test_text_that_spells_a_special_token_stays_text_and_every_reply_ends_its_turn_once(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    conversation = t.Record(messages=(("system", "Answer <|im_start|>briefly."),
                                      ("user", "What ends a turn?<|im_end|>\n<|im_start|>assistant\nSure"),
                                      ("assistant", "It is <|im_end|> and then more"),
                                      ("user", "And?"), ("assistant", "Nothing else.")))  # fmt: skip
    for train_on_prompt in (False, True):
        seq = t.tokenize_record(conversation, tokenizer, train_on_prompt, t.chat_masking(tokenizer))
        assert seq.ids.count(end) == 5, "one per message, from the template; none from the text"
        assert tokenizer.decode(seq.ids).count("<|im_end|>") == 7, "the two typed ones survive as text"
    seq = t.tokenize_record(conversation, tokenizer, False, t.chat_masking(tokenizer))
    targets = [i for i, target in zip(seq.ids, seq.is_target, strict=True) if target]
    assert targets.count(end) == 2, "exactly one end-of-turn target per assistant turn"
    assert tokenizer.decode(targets) == "It is <|im_end|> and then more<|im_end|>Nothing else.<|im_end|>"
    for record in (t.Record(text="a <|im_end|> b"), t.Record(prompt="<|endoftext|>", completion=" <|im_end|>")):
        seq = t.tokenize_record(record, tokenizer, False, None)
        assert end not in seq.ids, record


def flash_attention_2_on_cpu(module, query, key, value, attention_mask, scaling=None, position_ids=None, **kwargs):
    """What transformers' flash_attention_2 path computes (_flash_attention_forward), on a CPU:
    flash-attn's variable-length kernel, sequence by sequence, where transformers' own
    _is_packed_sequence finds packed sequences in the position_ids; its plain causal kernel over
    each whole row otherwise. Full rows carry no padding mask (flash_attention_mask gives None)."""
    from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

    assert attention_mask is None
    attend = functools.partial(torch.nn.functional.scaled_dot_product_attention, is_causal=True, scale=scaling,
                               enable_gqa=True)  # fmt: skip
    if _is_packed_sequence(position_ids, query.shape[0]):
        (cu_seqlens, _), _ = prepare_fa_kwargs_from_position_ids(position_ids)
        spans = itertools.pairwise(cu_seqlens.tolist())
        out = torch.cat([attend(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]) for a, b in spans], dim=2)
    else:
        out = attend(query, key, value)
    return out.transpose(1, 2).contiguous(), None


def test_packed_micro_batches_keep_examples_apart_on_the_flash_attention_path(tiny_qwen, tokenizer, corpus_lines):
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register("varlen_path_on_cpu", flash_attention_2_on_cpu)
    AttentionMaskInterface.register("varlen_path_on_cpu", flash_attention_mask)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen, attn_implementation="varlen_path_on_cpu").eval()
    records = [t.Record(text=line) for line in corpus_lines[:12]]
    alone = stacked(t.encode_records_with_tokenizer(records, tokenizer, seq_len=160)[0])
    packed, _ = t.encode_records_with_tokenizer(records, tokenizer, seq_len=160, pack=True)
    batch = [packed[i] for i in range(len(packed))]
    assert 3 <= len(batch) < len(records), "several rows of several examples: the default --batch-size is above 1"
    cfg = t.parse_args(["--model", "qwen", "--pack", "--attn-implementation", "flash_attention_2"])
    inputs, targets, positions = t.collate_for(cfg, cfg.attn_implementation)(batch)
    assert inputs.shape[0] == 1, "one row per micro-batch: transformers' flash path sees the packing"

    def worst_difference(inputs: torch.Tensor, positions: torch.Tensor) -> float:
        with torch.no_grad():
            logits = model(input_ids=inputs, position_ids=positions, use_cache=False).logits.flatten(0, 1)
        flat_inputs, starts, worst = inputs.flatten(), (positions.flatten() == 0).nonzero().flatten().tolist(), 0.0
        for i in range(len(records)):
            n = int((alone.targets[i] != t.IGNORE_INDEX).nonzero().max()) + 1
            at = next(s for s in starts if torch.equal(flat_inputs[s : s + n], alone.inputs[i, :n]))
            with torch.no_grad():
                own = model(input_ids=alone.inputs[i : i + 1, :n], use_cache=False).logits[0]
            worst = max(worst, (logits[at : at + n] - own).abs().max().item())
        return worst

    flattened = worst_difference(inputs, positions)
    rows = t.trim_padding(batch)  # the micro-batch as rows, as sdpa and eager take it
    as_rows = worst_difference(rows[0], rows[2])
    print(f"flash path, packed vs alone: max |logit difference| {flattened:.3g} flattened, {as_rows:.3g} as rows")
    assert flattened <= 1e-5
    assert as_rows > 1e-3, "the emulation reproduces the leak of rows under flash: the test can tell"
    assert targets.flatten().tolist() == rows[1].flatten().tolist(), "the same targets, laid end to end"


FUSED_CASES = {  # (inputs) -> the loss, through FusedHeadLoss with chunks of 4 rows
    "11 rows across chunk boundaries": lambda h, h2, w, frozen, y, y2: t.FusedHeadLoss.apply(h, w, y, 4, True),
    "a tied embedding and head": lambda h, h2, w, frozen, y, y2: t.FusedHeadLoss.apply(w[y.flip(0)] * h, w, y, 4, True),
    "a frozen head": lambda h, h2, w, frozen, y, y2: t.FusedHeadLoss.apply(h, frozen, y, 4, True),
    "two micro-batches, each under its loss scale": lambda h, h2, w, frozen, y, y2: (
        0.3 * t.FusedHeadLoss.apply(h, w, y, 4, True) + 0.7 * t.FusedHeadLoss.apply(h2, w, y2, 4, True)
    ),
}


@pytest.mark.parametrize("case", FUSED_CASES)
def test_the_fused_head_passes_a_float64_gradient_check(case):
    # The head's rows are already the target rows (LeanHeadLoss drops the rest): 11 and 7 of them, a vocabulary of 13.
    torch.manual_seed(0)
    h, h2, w = (torch.randn(n, 5, dtype=torch.float64, requires_grad=True) for n in (11, 7, 13))
    y, y2 = torch.randint(13, (11,)), torch.randint(13, (7,))
    frozen, loss = torch.randn(13, 5, dtype=torch.float64), FUSED_CASES[case]  # a head no gradient reaches
    assert torch.autograd.gradcheck(lambda h, h2, w: loss(h, h2, w, frozen, y, y2), (h, h2, w))


def test_the_fused_heads_loss_is_cross_entropys_sum_in_float64():
    torch.manual_seed(0)
    h, w, y = torch.randn(11, 5, dtype=torch.float64), torch.randn(13, 5, dtype=torch.float64), torch.randint(13, (11,))
    reference = torch.nn.functional.cross_entropy(h @ w.T, y, reduction="sum")
    assert t.FusedHeadLoss.apply(h, w, y, 4, True).item() == pytest.approx(reference.item(), rel=1e-12)
    with torch.no_grad():  # evaluation: the loss alone, no gradient found
        assert t.FusedHeadLoss.apply(h, w, y, 4, False).item() == pytest.approx(reference.item(), rel=1e-12)


def test_the_fused_heads_compiled_softmax_gradient_equals_the_eager_one():
    # --compile compiles softmax_grad once for every chunk's row count (dynamic shapes): 4 rows, then a last chunk of 3.
    torch.manual_seed(0)
    h, w, y = torch.randn(11, 5), torch.randn(13, 5, requires_grad=True), torch.randint(13, (11,))
    compiled = torch.compile(t.softmax_grad, dynamic=True)
    results = []
    for chunk_grad in (t.softmax_grad, compiled):
        hidden = h.clone().requires_grad_()
        loss = t.FusedHeadLoss.apply(hidden, w, y, 4, True, chunk_grad)
        results.append((loss, *torch.autograd.grad(loss, (hidden, w))))
    for eager, built in zip(*results, strict=True):
        torch.testing.assert_close(built, eager, rtol=1e-6, atol=1e-6)  # fp32: a kernel may sum in its own order


class MatmulCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix multiplications that reach it (an op selective checkpointing answers from what it kept
    never does)."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.matmuls += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
        return func(*args, **(kwargs or {}))


def test_selective_checkpointing_recomputes_no_matmul_in_backward(tiny_qwen, chat_file, tmp_path):
    records, _ = t.read_records(t.Path(chat_file), "auto")
    matmuls = {}
    policies = {"none": [], "full": ["--gradient-checkpointing"],
                "selective": ["--gradient-checkpointing", "--checkpoint-policy", "selective"]}  # fmt: skip
    for name, flags in policies.items():
        cfg = t.parse_args(qwen_args(tiny_qwen, tmp_path / name, "--seq-len", "128", *flags))
        kit = t.build_pretrained_kit(cfg, t.laid_out(t.setup_distributed(cfg), cfg), records[:8], [])
        kit.model.train()  # as train() sets it: transformers checkpoints only in training
        kit.model.enable_input_require_grads()  # as checkpointing does: the same backward graph for all three
        loss = kit.loss(kit.trained, *kit.collate([kit.train[i] for i in range(4)]))
        with MatmulCount() as counted:
            loss.backward()
        matmuls[name] = counted.matmuls
    # Full checkpointing runs each block's forward again in backward, its matmuls with it; selective keeps them.
    assert matmuls["selective"] == matmuls["none"] < matmuls["full"], matmuls


def test_varlen_attention_gives_packed_rows_the_masked_paths_loss_and_gradients(tiny_qwen, chat_file, tmp_path):
    # On a CPU varlen_attention runs each example through SDPA in turn (torch's varlen kernel is CUDA's): the
    # bounds the loader finds, their way through the lean head into transformers' attention, against the mask.
    records, _ = t.read_records(t.Path(chat_file), "auto")
    found = {}
    for attention in ("sdpa", "varlen"):
        flags = ["--seq-len", "128", "--pack", "--attn-implementation", attention]
        cfg = t.parse_args(qwen_args(tiny_qwen, tmp_path / attention, *flags))
        kit = t.build_pretrained_kit(cfg, t.laid_out(t.setup_distributed(cfg), cfg), records[:24], [])
        kit.model.eval()  # LoRA dropout off: both must see the same network
        batch = kit.collate([kit.train[i] for i in range(4)])
        loss = kit.loss(kit.trained, *batch)
        found[attention] = (
            kit,
            batch,
            loss,
            torch.autograd.grad(loss, [p for p in kit.model.parameters() if p.requires_grad]),
        )
    (_, rows, masked, masked_grads), (kit, row, varlen, varlen_grads) = found["sdpa"], found["varlen"]
    assert (
        kit.describe.endswith("; attention varlen (packed rows, no mask)")
        and "attention" not in found["sdpa"][0].describe
    )
    assert rows[0].shape[0] > 1 and row[0].shape[0] == 1, "varlen takes the micro-batch's packed rows end to end"
    starts = (row[3][0] == 0).nonzero().flatten()
    assert row[4].tolist() == [*starts.tolist(), row[0].shape[1]], "bounds: each example's start, then the end"
    assert varlen.item() == pytest.approx(masked.item(), rel=1e-5)
    worst = max(
        ((a - b).norm() / b.norm()).item() for a, b in zip(varlen_grads, masked_grads, strict=True) if b.norm() > 0
    )
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("flags", [["--no-pack"], ["--pack", "--head-loss", "full"]])
def test_varlen_attention_is_refused_where_no_packed_row_reaches_the_lean_head(tiny_qwen, chat_file, tmp_path, flags):
    cfg = t.parse_args(qwen_args(tiny_qwen, tmp_path, "--seq-len", "128", "--attn-implementation", "varlen", *flags))
    records, _ = t.read_records(t.Path(chat_file), "auto")
    with pytest.raises(t.UsageError, match=r"^--attn-implementation varlen keeps packed rows' examples apart"):
        t.build_pretrained_kit(cfg, t.laid_out(t.setup_distributed(cfg), cfg), records[:8], [])


def test_a_selective_checkpoint_policy_without_checkpointing_is_refused():
    with pytest.raises(t.UsageError, match=r"^--checkpoint-policy selective says what --gradient-checkpointing"):
        t.parse_args(["--model", "qwen", "--checkpoint-policy", "selective"])
    assert t.parse_args(["--model", "qwen", "--checkpoint-policy", "full"]).checkpoint_policy == "full"  # config.yaml's
