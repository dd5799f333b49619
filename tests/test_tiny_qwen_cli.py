"""tests/tiny_qwen.py from the command line: the chat file it writes, and its one-line errors.

Building a model with it and training on its chat file, end to end, is the README's offline chat
example (test_readme.py runs it as the README writes it).
"""

from __future__ import annotations

import json
import sys

from conftest import REPO, run_cmd
from tiny_qwen import halves, write_chat_file

TINY_QWEN = REPO / "tests" / "tiny_qwen.py"


def test_the_chat_file_has_one_conversation_per_line_the_user_saying_its_first_half(tmp_path):
    lines = ["Every rank holds a full copy of the model.", "The all-reduce averages gradients."]
    count = write_chat_file(tmp_path / "chat.jsonl", lines)
    records = [json.loads(r) for r in (tmp_path / "chat.jsonl").read_text(encoding="utf-8").splitlines()]
    assert count == len(records) == 2
    for line, record in zip(lines, records, strict=True):
        user, assistant = record["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert f"{user['content']} {assistant['content']}" == line
    assert records[0]["messages"][0]["content"] == "Every rank holds a full"  # the space nearest the middle (char 21)


def test_a_line_of_one_word_has_no_halves_and_is_left_out_of_the_chat_file(tmp_path):
    assert halves("two words") == ("two", "words")
    assert write_chat_file(tmp_path / "chat.jsonl", ["alone", "a pair"]) == 1


def test_a_missing_corpus_is_one_error_line_and_exit_code_2(tmp_path):
    run = run_cmd([sys.executable, str(TINY_QWEN), str(tmp_path / "model"), "--corpus", "/nonexistent.txt"], 60)
    assert run.returncode == 2
    assert run.stderr.startswith("error: cannot read --corpus /nonexistent.txt") and run.stderr.count("\n") == 1
    assert not (tmp_path / "model").exists()
