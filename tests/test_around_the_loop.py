"""Around the loop: --report-to (TensorBoard, Weights & Biases offline, trackio, each read back from its own
files), --sample-every (printed, in the metrics file, the training unchanged bit for bit), --eval-file (the
held-out data from a file of its own), and --chat (a trained output answers a prompt, or talks on a terminal)."""

from __future__ import annotations

import collections
import glob
import io
import itertools
import json
import os
import pty
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SCRIPT, assert_bitwise_equal, assert_ok, child_env, run_jobs, weights

import llm_ddp_parallel_training as t

TINY = ["--cpu", "--seq-len", "32", "--d-model", "32", "--dropout", "0.1", "--max-steps", "4", "--log-every", "2"]
USERS = ["Who sums the gradients?", "What does rank 0 write?", "Why pack examples?", "When is the step taken?"]


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def conversation(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_qwen, corpus_lines):
    """One launch of 2 ranks, its own (trackio reads where it keeps its files once per process), with the three
    trackers offline: a tiny run with every piece on, the same run without trackers or samples, and a LoRA run
    on chat data with a chat --eval-file."""
    root = tmp_path_factory.mktemp("loop")
    held = root / "held.txt"
    held.write_text("\n".join(corpus_lines[:40]) + "\n")
    chat = write_jsonl(root / "chat.jsonl", [conversation(a, b) for a, b in itertools.pairwise(corpus_lines[:60])])
    asked = write_jsonl(root / "asked.jsonl", [conversation(u, "Rank 0.") for u in USERS])
    every = ["--eval-file", str(held), "--eval-every", "2"]
    jobs = {
        "tracked": [*TINY, *every, "--output-dir", root / "tracked", "--metrics-file", root / "tracked.jsonl",
                    "--report-to", "tensorboard,wandb,trackio", "--sample-every", "2", "--sample-tokens", "16"],
        "plain": [*TINY, *every, "--output-dir", root / "plain"],
        "chat": ["--model", "hf", "--model-name-or-path", tiny_qwen, "--cpu", "--corpus-file", chat, "--eval-file",
                 asked, "--seq-len", "256", "--batch-size", "4", "--max-steps", "2", "--lr", "1e-2", "--sample-every",
                 "2", "--sample-tokens", "6", "--merge-lora", "--output-dir", root / "chat",
                 "--metrics-file", root / "chat-metrics.jsonl"],
    }  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        done = run_jobs({k: [str(a) for a in v] for k, v in jobs.items()}, nproc=2, timeout=300, fresh=True)
    for run in done.values():
        assert_ok(run)
    return done, root


def logged(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if isinstance(v, int | float) and k != "step"}


def test_tensorboard_gets_every_logged_metric_under_its_key_and_the_summary(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, root = runs
    events = EventAccumulator(str(root / "tracked" / "tensorboard")).Reload()
    for record in logged(root / "tracked.jsonl"):
        for key, value in numbers(record).items():
            got = {e.step: e.value for e in events.Scalars(key)}
            assert got[record["step"]] == pytest.approx(value, rel=1e-6), key  # stored as float32
    assert {"summary/tokens_per_sec", "summary/peak_memory_mib/rank0"} <= set(events.Tags()["scalars"])
    assert {"settings/text_summary", "samples/text_summary"} <= set(events.Tags()["tensors"])


def wandb_records(folder):
    """The records of an offline run's .wandb file: LevelDB's log format (32 KiB blocks of chunks, each with a
    7-byte header: CRC, length, type) after a 7-byte file header, each record one protobuf message."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(folder / "wandb" / "offline-run-*" / "run-*.wandb"))
    raw, pos, chunks = Path(path).read_bytes(), 7, b""
    while pos + 7 <= len(raw):
        if (room := 32768 - pos % 32768) < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        chunks, pos = chunks + raw[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a whole record, or a record's last chunk
            record = pb.Record()
            record.ParseFromString(chunks)
            yield record
            chunks = b""


def items(entries) -> dict[str, str]:
    """A record's key-value items (a key may be stored whole, or as its parts)."""
    return {i.key or "/".join(i.nested_key): i.value_json for i in entries}


def test_an_offline_wandb_run_in_the_output_folder_holds_the_metrics_the_settings_and_the_summary(runs):
    _, root = runs
    records = list(wandb_records(root / "tracked"))
    history = [items(r.history.item) for r in records if r.HasField("history")]
    steps = {int(h["_step"]): h for h in history}
    for record in logged(root / "tracked.jsonl"):
        got = steps[record["step"]]
        for key, value in numbers(record).items():
            assert json.loads(got[key]) == pytest.approx(value), key
    (run,) = [r.run for r in records if r.HasField("run")]
    settings = {k: json.loads(v) for k, v in items(run.config.update).items()}
    assert settings["seq_len"] == 32 and settings["report_to"] == "tensorboard,wandb,trackio"
    summary = {k for r in records if r.HasField("summary") for k in items(r.summary.update)}
    assert {"tokens_per_sec", "steps", "peak_memory_mib/rank0"} <= summary


def test_trackios_local_store_is_in_the_output_folder_and_holds_the_metrics(runs):
    import sqlite3

    _, root = runs
    (db,) = glob.glob(str(root / "tracked" / "trackio" / "*.db"))
    with sqlite3.connect(db) as con:
        rows = collections.defaultdict(dict)  # a step's rows: the metrics, and at the end the summary
        for step, metrics in con.execute("SELECT step, metrics FROM metrics"):
            rows[step] |= json.loads(metrics)
    for record in logged(root / "tracked.jsonl"):
        for key, value in numbers(record).items():
            assert rows[record["step"]][key] == pytest.approx(value), key
    assert any("summary/tokens_per_sec" in m for m in rows.values())


def test_a_tracker_that_fails_costs_one_warning_line_and_is_left_out(tmp_path, monkeypatch, capsys):
    class Broken:
        def __init__(self, cfg, settings) -> None:
            self.calls = 0

        def log(self, numbers, texts, step) -> None:
            raise OSError(28, "No space left on device")

    monkeypatch.setitem(t.TRACKERS, "broken", Broken)
    trackers = t.Trackers(t.parse_args(["--output-dir", str(tmp_path)]), ("broken",))
    for step in (1, 2):
        trackers.log({"step": step, "loss": 1.0}, step)
    trackers.finish({}, 2)
    assert capsys.readouterr().out == (
        "[report] warning: broken failed and is left out from here on: [Errno 28] No space left on device\n"
    )


def test_a_tracker_whose_library_is_missing_is_refused_with_its_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "trackio", None)  # not importable, as where it is not installed
    with pytest.raises(t.UsageError, match=r"^--report-to trackio needs its library: pip install trackio$"):
        t.parse_args(["--report-to", "tensorboard,trackio"])
    with pytest.raises(t.UsageError, match=r"unknown tracker 'mlflw': choose from none, tensorboard, wandb"):
        t.parse_args(["--report-to", "mlflw"])


def test_samples_every_n_steps_are_printed_and_written_to_the_metrics_file(runs):
    done, root = runs
    samples = {r["step"]: r["samples"] for r in logged(root / "tracked.jsonl") if "samples" in r}
    assert list(samples) == [2, 4] and all(len(s) == 1 and s[0].startswith("Each rank") for s in samples.values())
    for step, (text,) in samples.items():
        assert f"[sample] step {step}: {text}" in done["tracked"].stdout


def test_sampling_and_trackers_leave_the_training_bit_for_bit_as_it_was(runs):
    _, root = runs
    assert_bitwise_equal(weights(root / "tracked"), weights(root / "plain"), "with --sample-every and --report-to")


def test_on_chat_data_samples_answer_prompt_and_the_first_three_held_out_user_turns(runs):
    _, root = runs
    (record,) = [r for r in logged(root / "chat-metrics.jsonl") if "samples" in r]
    asked = [sample.split(" -> ")[0] for sample in record["samples"]]
    assert asked == ["What does an all-reduce do?", *USERS[:3]], record["samples"]  # a pretrained model's --prompt


def test_an_eval_file_is_the_held_out_data_and_nothing_is_carved_out_of_the_training_data(runs, corpus_lines):
    done, root = runs
    assert f"{len(corpus_lines)} training lines" in done["plain"].stdout
    assert f"40 held out for validation (--eval-file {root / 'held.txt'})" in done["plain"].stdout
    assert "4 held out for validation (--eval-file" in done["chat"].stdout
    assert "val_loss" in logged(root / "chat-metrics.jsonl")[-1]


def test_a_missing_eval_file_is_refused_in_one_line_before_anything_runs(tmp_path):
    with pytest.raises(t.UsageError, match=r"^--eval-file file not found: .*held\.jsonl$"):
        t.refuse_missing_inputs(t.parse_args(["--eval-file", str(tmp_path / "held.jsonl")]))


def test_sample_every_is_refused_where_no_rank_holds_the_whole_model():
    for split in (["--sharding", "full"], ["--tp", "2"], ["--pp", "2"]):
        with pytest.raises(t.UsageError, match=r"^--sample-every samples rank 0's whole model, which --sharding"):
            t.parse_args(["--sample-every", "5", *split])


def test_chat_is_refused_in_one_line_under_nproc_or_torchrun(tmp_path, monkeypatch):
    checkpoint = tmp_path / "tiny_transformer.pt"
    checkpoint.touch()
    with pytest.raises(t.UsageError, match=r"^--chat runs as one process: leave out --nproc and torchrun$"):
        t.parse_args(["--chat", str(checkpoint), "--nproc", "2"])
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it for each rank
    with pytest.raises(t.UsageError, match=r"^--chat runs as one process"):
        t.parse_args(["--chat", str(checkpoint)])


def test_top_p_draws_only_from_the_fewest_likeliest_tokens_and_temperature_0_is_greedy():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0]).log_softmax(-1)  # probabilities 0.61, 0.22, 0.14, 0.03
    gen = torch.Generator().manual_seed(0)
    drawn = {t.next_token(logits, 1.0, 0.8, gen).item() for _ in range(300)}
    assert drawn == {0, 1}, "0.61 alone is short of 0.8; with 0.22 it is reached, and no more are needed"
    assert t.next_token(logits, 0.0, 1.0, gen).item() == 0


def chat(args: list[str], capsys) -> str:
    """What --chat prints, run through the script's main() in this process (a process of its own costs seconds)."""
    t.main(args)
    return capsys.readouterr().out


def test_chat_answers_a_prompt_from_a_tiny_checkpoint_the_same_for_the_same_seed(runs, capsys):
    _, root = runs
    ask = ["--chat", str(root / "plain" / "tiny_transformer.pt"), "--prompt", "The gradient", "--cpu"]
    first, again, other = chat(ask, capsys), chat(ask, capsys), chat([*ask, "--seed", "7"], capsys)
    assert first.startswith("you> The gradient\nmodel> ") and first.endswith("\n") and first == again
    assert other != first


def test_samples_come_from_an_eval_file_of_fewer_conversations_than_three(tmp_path):
    held = write_jsonl(tmp_path / "held.jsonl", [conversation(u, "Rank 0.") for u in USERS[:2]])
    cfg = t.parse_args(["--model", "hf", "--corpus-file", held, "--eval-file", held, "--prompt", "Hi"])
    assert t.sample_prompts(cfg, True, None) == ["Hi", *USERS[:2]]


def test_flags_that_one_another_would_silently_drop_are_refused_in_one_line(tmp_path):
    with pytest.raises(t.UsageError, match=r"^--eval-file holds the held-out data, .*: leave out --val-fraction$"):
        t.parse_args(["--eval-file", str(tmp_path / "held.txt"), "--val-fraction", "0.2"])
    assert t.parse_args(["--eval-file", str(tmp_path / "held.txt"), "--val-fraction", "0"]).eval_file  # says the same
    with pytest.raises(t.UsageError, match=r"^--chat trains and merges nothing: merge first, then --chat OUTPUT_DIR"):
        t.parse_args(["--chat", str(tmp_path), "--model", "hf", "--merge-lora"])


def test_chat_given_a_runs_folder_talks_to_what_the_run_wrote_and_says_which(runs, capsys):
    _, root = runs
    ask = ["--prompt", "The gradient", "--cpu"]
    shown = chat(["--chat", str(root / "plain"), *ask], capsys)
    assert shown.startswith(f"[chat] {root / 'plain'} is a run's output folder: talking to {root / 'plain'}/tiny_")
    assert shown.endswith(chat(["--chat", str(root / "plain" / "tiny_transformer.pt"), *ask], capsys))
    assert "talking to " + str(root / "chat" / "merged") in chat(["--chat", str(root / "chat"), *ask], capsys)


@pytest.mark.parametrize(
    ("path", "refusal"),
    [("plain/config.yaml", "not a tiny_transformer.pt this script wrote"), ("", "no trained model in this folder")],
)
def test_chat_on_what_holds_no_model_is_refused_in_one_line(runs, path, refusal, capsys):
    _, root = runs
    with pytest.raises(SystemExit) as ended:
        t.main(["--chat", str(root / path), "--prompt", "x", "--cpu"])
    errors = capsys.readouterr().err.splitlines()
    assert ended.value.code == 2 and len(errors) == 1 and refusal in errors[0], errors


def test_chat_answers_lines_piped_in_turn_by_turn(runs, monkeypatch, capsys):
    _, root = runs
    monkeypatch.setattr(sys, "stdin", io.StringIO("The rank\nAll ranks\n"))  # a pipe: no terminal, lines, an end
    shown = chat(["--chat", str(root / "plain" / "tiny_transformer.pt"), "--cpu"], capsys)
    assert shown.count("model> ") == 2, shown


@pytest.mark.parametrize("folder", ["qwen_lora", "merged"])
def test_chat_answers_through_the_chat_template_from_an_adapter_folder_and_a_merged_one(runs, folder, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, root = runs
    shown = chat(["--chat", str(root / "chat" / folder), "--prompt", USERS[0], "--sample-tokens", "6"], capsys)
    # The same reply as the merged model's own greedy generate() through the chat template (streamed, then a line end).
    merged = root / "chat" / "merged"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(merged), AutoTokenizer.from_pretrained(merged)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": USERS[0]}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]  # fmt: skip
    reply = tokenizer.decode(model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :],
                             skip_special_tokens=True)  # fmt: skip
    assert shown == f"you> {USERS[0]}\nmodel> {reply}\n", (shown, reply)


def test_chat_on_a_terminal_without_a_prompt_talks_turn_by_turn_until_an_empty_line(runs):
    _, root = runs
    controller, terminal = pty.openpty()
    with os.fdopen(controller, "rb", buffering=0) as screen:
        args = [sys.executable, str(SCRIPT), "--chat", str(root / "plain" / "tiny_transformer.pt"), "--cpu"]
        talk = subprocess.Popen(args, stdin=terminal, stdout=terminal, stderr=terminal, env=child_env())
        os.close(terminal)
        os.write(controller, b"The rank\nAll ranks\n\n")
        assert talk.wait(timeout=120) == 0
        seen = b""
        while chunk := read_some(screen):
            seen += chunk
    assert seen.decode(errors="replace").count("model> ") == 2, seen


def read_some(screen) -> bytes:
    try:
        return screen.read(4096)
    except OSError:  # the terminal's other end closed: everything was read
        return b""
