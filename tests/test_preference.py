"""Preference tuning (--objective dpo) on a tiny random Qwen2, offline: TRL's preference formats become pairs of
sequences whose targets are the completions, bad pairs are refused with their file and line, the loss is DPO's
sigmoid loss checked in float64 against a direct implementation, it starts at log 2, two ranks equal one process
accumulating, every data-parallel layout trains the same adapters, a model learns a preference it can learn, and a
killed worker of a full fine-tuning (whose reference is computed once, into the cache) resumes bit-exactly.

The runs whose subject is not the launch share one launch per kind (2 ranks, one plain process)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from conftest import assert_ok, run_cmd, torchrun_cmd
from shared_launch import Shared, assert_one_clear_error, share
from test_qwen_lora import NEEDS_PEFT, saved_adapter

import llm_ddp_parallel_training as t

pytestmark = NEEDS_PEFT

LOG_2 = math.log(2)
SEQ_LEN = 160  # the tiny tokenizer's chat template opens every conversation with Qwen's system prompt


def preference_records(lines: list[str], n: int, seed: int = 0) -> list[dict]:
    """Conversational pairs a tiny model can learn to tell apart: the user gives a corpus line's start; the chosen
    reply is its true rest, the rejected one those words backwards."""
    rng, records = random.Random(seed), []
    for _ in range(n):
        words = rng.choice(lines).split()
        cut = max(1, len(words) // 3)
        rest = words[cut:] or ["yes"]
        records.append({"prompt": [{"role": "user", "content": " ".join(words[:cut])}],
                        "chosen": [{"role": "assistant", "content": " ".join(rest)}],
                        "rejected": [{"role": "assistant", "content": " ".join(reversed(rest)) + " no"}]})  # fmt: skip
    return records


def write_jsonl(path, records: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def dpo_args(model_dir, data, out_dir, *extra: str) -> list[str]:
    return [
        "--model", "qwen", "--model-name-or-path", str(model_dir), "--cpu", "--corpus-file", str(data),
        "--objective", "dpo", "--output-dir", str(out_dir), "--seq-len", str(SEQ_LEN), "--sample-tokens", "4", *extra,
    ]  # fmt: skip


SGD = ["--optimizer", "sgd", "--lr", "0.5", "--max-steps", "4", "--log-every", "1", "--val-fraction", "0"]
RESUME_FLAGS = ["--finetune", "full", "--max-steps", "6", "--save-every", "2", "--log-every", "1", "--lr", "1e-3"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, corpus_lines):
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", preference_records(corpus_lines, 160))


@pytest.fixture(scope="module")
def two_ranks(tiny_qwen, pairs, corpus_lines, tmp_path_factory) -> Shared:
    """This module's 2-rank runs, in one launch: a run that learns, the same 4 SGD steps under each data-parallel
    layout, full fine-tuning (twice: the second reads the reference the first found), the run the resume test compares
    with, preference records given to supervised fine-tuning, and chat records given to DPO."""
    root = tmp_path_factory.mktemp("dpo_two_ranks")
    chat = write_jsonl(root / "chat.jsonl", [{"messages": [user(line), assistant(line)]} for line in corpus_lines])
    layouts = {"ddp": [], "manual": ["--ddp", "manual"], "zero1": ["--sharding", "optimizer"],
               "fsdp": ["--sharding", "full"], "fsdp-manual": ["--sharding", "full", "--ddp", "manual"]}  # fmt: skip
    learn = ["--max-steps", "30", "--lr", "5e-3", "--log-every", "1", "--eval-every", "0"]
    full = ["--finetune", "full", *SGD, "--lr", "1e-2", "--cache-dir", root / "cache"]
    jobs = {
        "learn": dpo_args(tiny_qwen, pairs, root / "learn", *learn, "--metrics-file", root / "learn.jsonl"),
        **{
            name: dpo_args(tiny_qwen, pairs, root / name, "--batch-size", "2", *SGD, *flags)
            for name, flags in layouts.items()
        },
        "full": dpo_args(tiny_qwen, pairs, root / "full", *full, "--metrics-file", root / "full.jsonl"),
        "full again": dpo_args(tiny_qwen, pairs, root / "full again", *full),
        "whole": dpo_args(tiny_qwen, pairs, root / "whole", *RESUME_FLAGS),
        "sft": dpo_args(tiny_qwen, pairs, root / "sft", "--max-steps", "2", "--objective", "sft"),  # (the last wins)
        "dpo on chat": dpo_args(tiny_qwen, chat, root / "dpo on chat", "--max-steps", "2"),
    }
    return share(root, jobs, nproc=2)


@pytest.fixture(scope="module")
def one_process(tiny_qwen, pairs, corpus_lines, tmp_path_factory) -> Shared:
    """The plain-process runs: two micro-batches accumulated to the 2-rank runs' global batch, --show-examples, a model
    whose forward rescales its logits (Granite's logits_scaling), and one whose layers slide a window (Qwen2's)."""
    from transformers import AutoTokenizer, GraniteConfig, GraniteForCausalLM, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("dpo_one_process")
    tokenizer, granite = AutoTokenizer.from_pretrained(tiny_qwen), root / "granite"
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    GraniteForCausalLM(GraniteConfig(vocab_size=len(tokenizer), logits_scaling=4.0, **shape)).save_pretrained(granite)
    tokenizer.save_pretrained(granite)
    sliding = root / "sliding"
    model = Qwen2ForCausalLM.from_pretrained(tiny_qwen)
    layers = {"layer_types": ["sliding_attention"] * model.config.num_hidden_layers, "max_window_layers": 0}
    model.config.update({"use_sliding_window": True, "sliding_window": 16, **layers})
    model.save_pretrained(sliding), tokenizer.save_pretrained(sliding)
    accumulate = ["--batch-size", "2", "--grad-accum-steps", "2", *SGD]
    jobs = {
        "accumulate": dpo_args(tiny_qwen, pairs, root / "accumulate", *accumulate),
        "show": dpo_args(tiny_qwen, pairs, root / "show", "--show-examples", "1"),
        "granite": dpo_args(granite, pairs, root / "granite", "--max-steps", "1"),
        "sliding": dpo_args(sliding, pairs, root / "sliding", "--max-steps", "1"),
    }
    return share(root, jobs, nproc=None)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen)


def sides(path, tokenizer) -> list[tuple[str, str]]:
    """Each pair's (chosen, rejected) targets, decoded, as the script tokenizes the file's records."""
    records, fmt = t.read_records(path, "auto")
    tokens = t.as_tokens(records, tokenizer, False)
    assert fmt == "preference" and tokens.pairs and len(tokens) == len(records)
    texts = []
    for i in range(len(tokens.offsets) - 1):
        a, b = tokens.offsets[i], tokens.offsets[i + 1]
        texts.append(tokenizer.decode([x for x, y in zip(tokens.ids[a:b], tokens.is_target[a:b], strict=True) if y]))
    return list(zip(texts[0::2], texts[1::2], strict=True))


# ----- the data: TRL's forms, each side's targets, and the pairs a file cannot give -----


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize(
    "record",
    [
        {"prompt": [user("Name a collective.")], "chosen": [assistant("all-reduce")], "rejected": [assistant("a cat")]},
        {
            "chosen": [user("Name a collective."), assistant("all-reduce")],
            "rejected": [user("Name a collective."), assistant("a cat")],
        },
    ],
    ids=["conversational", "implicit prompt"],
)
def test_a_conversational_pair_targets_each_completion_and_its_turn_end_alone(record, tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [record])
    assert sides(path, tokenizer) == [("all-reduce<|im_end|>", "a cat<|im_end|>")]


def test_an_implicit_prompt_that_ends_with_a_reply_leaves_the_next_user_turn_out_of_the_targets(tokenizer, tmp_path):
    # The sides part at a user turn: the prompt ends with the assistant's reply, and (as TRL) is rendered without the
    # assistant's opening; each side's targets are its own replies alone.
    shared = [user("Name a collective."), assistant("all-reduce")]
    record = {"chosen": [*shared, user("Another?"), assistant("broadcast")],
              "rejected": [*shared, user("And a pet?"), assistant("a cat")]}  # fmt: skip
    assert sides(write_jsonl(tmp_path / "pairs.jsonl", [record]), tokenizer) == [
        ("broadcast<|im_end|>", "a cat<|im_end|>")]  # fmt: skip


@pytest.mark.parametrize(
    "record",
    [
        {"prompt": "Name a collective:", "chosen": " all-reduce", "rejected": " the cat"},
        {"chosen": "Name a collective: all-reduce", "rejected": "Name a collective: the cat"},
    ],
    ids=["standard", "implicit prompt"],
)
def test_a_text_pair_targets_each_completion_and_its_eos(record, tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [record])
    # The implicit prompt stops before the space the two sides share, as TRL's extract_prompt does.
    assert sides(path, tokenizer) == [(" all-reduce<|endoftext|>", " the cat<|endoftext|>")]


@pytest.mark.parametrize(
    ("record", "why"),
    [
        ({"prompt": "Q:", "chosen": " yes"}, "field 'rejected' is missing"),
        ({"prompt": "Q:", "chosen": " yes", "rejected": ""}, "field 'rejected' is not a non-empty string"),
        ({"prompt": "Q:", "chosen": " yes", "rejected": " yes"}, "chosen and rejected are the same"),
        ({"chosen": "yes", "rejected": "no"}, "share no opening to be the prompt: give it as 'prompt'"),
        ({"chosen": "Q: yes", "rejected": "Q: yes, sure"}, "ends where the other goes on"),
        ({"prompt": "Q:", "chosen": [assistant("yes")], "rejected": [assistant("no")]}, "all strings or all lists"),
    ],
    ids=["missing", "empty", "identical", "no shared prefix", "one ends in the other", "mixed"],
)
def test_a_pair_without_a_usable_preference_is_refused_with_its_file_and_line(record, why, tmp_path):
    good = {"prompt": "Q:", "chosen": " yes", "rejected": " no"}
    path = write_jsonl(tmp_path / "pairs.jsonl", [good, record])
    with pytest.raises(t.UsageError) as refused:
        t.read_records(path, "auto")
    assert str(refused.value).startswith(f"{path}:2: ") and why in str(refused.value)


def test_a_pair_is_dropped_whole_when_the_sequence_length_cuts_either_completion_away(tokenizer):
    def pair(prompt: str, chosen: str, rejected: str) -> t.Record:
        return t.Record(prompt=prompt, completion=chosen, rejected=t.Record(prompt=prompt, completion=rejected))

    long = " and a long answer" * 8  # its side keeps its first targets within 32 tokens: cut, not dropped
    records = [pair("a long question " * 20, " yes", " no"), pair("Q:", " yes", long), pair("Q:", long, " no"),
               pair("Q: " + "why " * 12, " yes", "x" * 40), pair("Q:", " yes", " no")]  # fmt: skip
    rows = t.TokenRows(t.as_tokens(records, tokenizer, False), 32, tokenizer, pack=False)
    # The first pair's prompt fills the row; the fourth's rejected side starts past it: both dropped whole. The
    # second and third have one side cut: kept, and counted once each.
    assert rows.counts == {"records": 5, "truncated": 4, "dropped": 2} and len(rows) == 3
    ids, targets = rows[0]
    assert ids.shape == targets.shape == (2, 32)  # a kept pair: its chosen row, then its rejected row
    assert all((row[1] != t.IGNORE_INDEX).any(dim=1).all() for row in (rows[i] for i in range(3)))


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--pack"], "keeps each side of a pair in a row of its own: leave out --pack"),
        (["--tp", "2"], "a pair's two sides go through one forward on one rank"),
        (["--train-on-prompt"], "compares the two completions alone"),
        (["--head-loss", "fused"], "--head-loss fused: DPO's per-sequence log-probabilities take the chunked head"),
        (["--attn-implementation", "eager"], "two replies kept apart by a mask that sdpa takes"),
        (["--trust-remote-code"], "its shared-prompt mask is made for transformers' own models"),
    ],
    ids=["pack", "tp", "train-on-prompt", "head-loss", "eager", "remote-code"],
)
def test_what_dpo_cannot_do_is_refused_before_any_rank_starts(flags, why):
    with pytest.raises(t.UsageError, match=why):
        t.parse_args(["--model", "hf", "--objective", "dpo", *flags])


def test_dpo_alone_takes_its_beta_and_its_dropout_is_off_unless_asked_for():
    with pytest.raises(t.UsageError, match="--dpo-beta is DPO's: add --objective dpo"):
        t.parse_args(["--model", "hf", "--dpo-beta", "0.2"])
    assert t.parse_args(["--model", "hf", "--objective", "dpo", "--head-loss", "chunked"]).lora_dropout == 0.0
    assert t.parse_args(["--model", "hf", "--objective", "dpo", "--lora-dropout", "0.1"]).lora_dropout == 0.1
    assert t.parse_args(["--model", "hf"]).lora_dropout == 0.05


def test_preference_records_without_objective_dpo_end_every_rank_with_one_line(two_ranks):
    run = two_ranks["sft"]
    assert_one_clear_error(run, "holds preference records (chosen, rejected): add --objective dpo",
                           two_ranks.seconds("sft"), ranks=2)  # fmt: skip


def test_chat_records_under_objective_dpo_end_every_rank_with_one_line(two_ranks):
    assert_one_clear_error(
        two_ranks["dpo on chat"],
        "--objective dpo trains on preference records (chosen, rejected), and the training data holds messages records",
        two_ranks.seconds("dpo on chat"),
        ranks=2,
    )


def test_a_model_that_rescales_its_logits_is_refused_in_one_line(one_process):
    assert_one_clear_error(one_process["granite"], "this model rescales its logits (soft-capping or a logit scale)",
                           one_process.seconds("granite"), ranks=None)  # fmt: skip


def test_a_model_whose_layers_slide_a_window_shorter_than_the_sequence_is_refused_in_one_line(one_process):
    # The pair's row carries its own mask, which transformers passes to attention as it is: no window in it.
    expected = "layers attend otherwise than to all before them within --seq-len 160 (sliding_attention, window 16)"
    assert_one_clear_error(one_process["sliding"], expected, one_process.seconds("sliding"), ranks=None)


def test_show_examples_shows_each_side_of_a_pair_with_its_targets(one_process):
    run = one_process["show"]
    assert_ok(run)
    assert "--- pair 1, chosen:" in run.stdout and "--- pair 1, rejected:" in run.stdout
    assert run.stdout.count("[[") == 2 and "<|im_end|>]]" in run.stdout


# ----- the loss -----


def test_a_pair_shares_its_prompt_in_one_row_and_the_rejected_side_never_sees_the_chosen_reply():
    # Chosen: 5 6 | 7 8 9; rejected: 5 6 | 3 4 (the prompt 5 6). As TokenRows gives them: inputs, and each input's
    # next token where it is a target.
    ids = torch.tensor([[5, 6, 7, 8, 0, 0], [5, 6, 3, 0, 0, 0]])
    targets = torch.tensor([[-100, 7, 8, 9, -100, -100], [-100, 3, 4, -100, -100, -100]])
    row_ids, positions, mask, rows, ys, sides = t.preference_batch([(ids, targets)])
    assert row_ids.shape == (1, 8) and row_ids.tolist() == [[5, 6, 7, 8, 3, 0, 0, 0]]  # (padded to a multiple of 8)
    assert positions.tolist() == [[0, 1, 2, 3, 2, 0, 0, 0]]  # each token at its place in its own sequence
    assert not mask[0, 0, 4, 2:4].any() and mask[0, 0, 4, [0, 1, 4]].all()  # the rejected 3: the prompt and itself
    assert torch.equal(mask[0, 0, :4, :4], torch.ones(4, 4, dtype=torch.bool).tril())  # the chosen side: causal
    # Each target read where its own sequence predicts it: either side's first reply token from the prompt's end.
    assert rows.tolist() == [1, 2, 3, 1, 4] and ys.tolist() == [7, 8, 9, 3, 4] and sides.tolist() == [0, 0, 0, 1, 1]


def test_the_loss_and_its_gradient_equal_a_direct_float64_dpo(tiny_qwen, tokenizer, corpus_lines, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float64)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # off zero: the policy must differ from its reference
            torch.nn.init.normal_(p, std=0.05)
    records, _ = t.read_records(write_jsonl(tmp_path / "p.jsonl", preference_records(corpus_lines, 3)), "auto")
    rows = t.TokenRows(t.as_tokens(records, tokenizer, False), SEQ_LEN, tokenizer, pack=False)
    pairs = [rows[i] for i in range(len(rows))]
    ids, targets = torch.cat([pair[0] for pair in pairs]), torch.cat([pair[1] for pair in pairs])  # a row a side
    params = [p for p in model.parameters() if p.requires_grad]
    beta = 0.1

    def log_likelihoods() -> torch.Tensor:  # every logit, the plain way: each side whole, in a row of its own
        logp = torch.log_softmax(model(input_ids=ids).logits, dim=-1)
        picked = logp.gather(2, targets.clamp(min=0)[..., None])[..., 0]
        return (picked * (targets != t.IGNORE_INDEX)).sum(1)

    with torch.no_grad(), model.disable_adapter():  # the base model's: the reference
        reference = log_likelihoods()
    tally = t.RewardTally()
    loss = t.PreferenceLoss(model, beta, tally)(*t.preference_batch(pairs), reference)  # the prompt's once a pair
    ours = torch.autograd.grad(loss, params)

    rewards = beta * (log_likelihoods() - reference).view(-1, 2)
    direct = -torch.nn.functional.logsigmoid(rewards[:, 0] - rewards[:, 1]).sum()
    theirs = torch.autograd.grad(direct, params)
    assert abs(loss.item() - direct.item()) < 1e-12 and abs(direct.item() - 3 * LOG_2) > 1e-4
    # Qwen2's RMSNorm computes in float32 whatever the model's dtype, and so do the gradients through it: where the
    # prompt is computed once, its two sides' gradients meet in float32, 1e-8 of the gradient apart from the direct
    # sums (measured: below 1e-8 of the largest). A wrong mask or a target read from the wrong row is off by far more.
    scale = max(b.abs().max().item() for b in theirs)
    assert max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True)) < 1e-6 * scale
    # The rewards as logged: beta times each side's log-ratio, summed over the pairs, and the pairs the chosen wins.
    wins = (rewards[:, 0] > rewards[:, 1]).sum()
    assert torch.allclose(tally.sums, torch.stack([*rewards.sum(0), wins]).detach(), rtol=0, atol=1e-12)


def test_the_first_step_loss_is_log_2_and_the_rewards_are_logged_under_trls_names(two_ranks):
    assert_ok(two_ranks["learn"])
    first = json.loads((two_ranks.root / "learn.jsonl").read_text().splitlines()[0])
    assert abs(first["loss"] - LOG_2) < 1e-6  # the policy is its reference: every pair's loss is log 2
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "pairs_per_sec"):
        assert key in first, key
    assert first["rewards/margins"] == first["rewards/chosen"] - first["rewards/rejected"] == 0.0


def test_a_preference_a_tiny_model_can_learn_is_learned(two_ranks):
    records = [json.loads(line) for line in (two_ranks.root / "learn.jsonl").read_text().splitlines()]
    assert records[-1]["rewards/accuracies"] >= 0.9, records[-1]
    assert records[-1]["val_loss"] < LOG_2 and records[-1]["val_rewards/accuracies"] >= 0.9, records[-1]
    assert "pairs seen" in two_ranks["learn"].stdout


def test_two_ranks_equal_one_process_accumulating_two_micro_batches(two_ranks, one_process):
    ranks, one = two_ranks["ddp"], one_process["accumulate"]
    assert_ok(ranks), assert_ok(one)
    assert len(ranks.losses()) == 4 and np.allclose(ranks.losses(), one.losses(), rtol=0, atol=1e-6)
    a, b = saved_adapter(two_ranks.out("ddp"))[1], saved_adapter(one_process.out("accumulate"))[1]
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


@pytest.mark.parametrize("layout", ["manual", "zero1", "fsdp", "fsdp-manual"])
def test_every_data_parallel_layout_trains_the_same_adapters(two_ranks, layout):
    run, ddp = two_ranks[layout], two_ranks["ddp"]
    assert_ok(run)
    assert np.allclose(run.losses(), ddp.losses(), rtol=0, atol=1e-6)
    a, b = saved_adapter(two_ranks.out("ddp"))[1], saved_adapter(two_ranks.out(layout))[1]
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


def test_full_fine_tuning_computes_its_reference_once_into_the_cache(two_ranks):
    run = two_ranks["full"]
    assert_ok(run)
    first = json.loads((two_ranks.root / "full.jsonl").read_text().splitlines()[0])
    assert "against the starting weights" in run.stdout and abs(first["loss"] - LOG_2) < 1e-6
    assert "[dpo] the reference log-probabilities of 160 pairs: found by 2 rank(s)" in run.stdout
    assert run.losses()[-1] < run.losses()[0]
    saved = list((two_ranks.root / "cache").glob("reference-*.npy"))
    assert len(saved) == 1 and np.load(saved[0]).shape == (160, 2)
    again = two_ranks["full again"]  # a later run on the same data and weights finds nothing again
    assert_ok(again)
    assert f"[dpo] the reference log-probabilities of 160 pairs: reused {saved[0]}" in again.stdout
    assert again.losses() == run.losses()


def test_full_fine_tuning_resumes_after_a_killed_worker_bit_exactly(tiny_qwen, pairs, two_ranks, tmp_path):
    from safetensors.torch import load_file

    assert_ok(two_ranks["whole"])
    faulted = dpo_args(tiny_qwen, pairs, tmp_path / "faulted", *RESUME_FLAGS, "--inject-fault", "1:4")
    run = run_cmd(torchrun_cmd(2, faulted, ["--standalone", "--max-restarts=1"]), timeout=240)
    assert_ok(run)
    assert "continuing from" in run.stdout and "step_00000002 (step 2" in run.stdout
    whole = load_file(two_ranks.out("whole") / "qwen_full" / "model.safetensors")
    resumed = load_file(tmp_path / "faulted" / "qwen_full" / "model.safetensors")
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
