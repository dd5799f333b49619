"""The README's promises: its first screen, its first commands, its offline chat example, the commands of the
chapters under docs/, and every relative link in them."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from conftest import REPO, SCRIPT, assert_ok, run_cmd

README = (REPO / "README.md").read_text(encoding="utf-8")
DOCS = {path.name: path.read_text(encoding="utf-8") for path in sorted((REPO / "docs").glob("*.md"))}
NOTEBOOK = (REPO / "ddp_walkthrough.ipynb").read_text(encoding="utf-8")
FENCE = re.compile(r"^ *```(\w*)\n(.*?)^ *```$", re.M | re.S)  # indented too: inside a list item


def section(heading: str) -> str:
    """A section's text, from its heading to the next heading of the same level or higher (a "# "
    inside a code block is a comment, not a heading)."""
    level, lines, inside, in_code = len(heading.split(" ")[0]), [], False, False
    for line in README.splitlines():
        in_code ^= line.lstrip().startswith("```")
        depth = len(line) - len(line.lstrip("#")) if not in_code and line.startswith("#") else 0
        if inside and 0 < depth <= level:
            break
        inside = inside or line == heading
        if inside:
            lines.append(line)
    assert lines, heading
    return "\n".join(lines) + "\n"


def blocks(text: str, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang == language]


def commands(block: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and blank lines left out."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def script_commands() -> list[list[str]]:
    """Every command in the bash blocks of the README and of docs/*.md that runs the training script, as its
    arguments."""
    found = []
    for block in [b for text in (README, *DOCS.values()) for b in blocks(text, "bash")]:
        for command in commands(block):
            words = shlex.split(command.split("&&")[-1], comments=True)
            if "llm_ddp_parallel_training.py" in words and words[0] != "sed":  # sed reads the file, not runs it
                found.append(words)
    return found


def test_the_first_screen_names_both_users_with_one_command_each():
    first_screen = "\n".join(README.splitlines()[:30])
    learner, practitioner = (commands(block) for block in blocks(first_screen, "bash"))
    assert learner == ["python llm_ddp_parallel_training.py --cpu --nproc 2"]
    assert len(practitioner) == 1 and practitioner[0].startswith("torchrun ")
    assert "--model hf" in practitioner[0] and "--corpus-file chat.jsonl" in practitioner[0]
    assert "LoRA" in first_screen and "CPU" in first_screen and "GPU" in first_screen


def test_the_quick_starts_first_command_is_the_nproc_run_with_no_other_flags():
    first = commands(blocks(section("## Quick start"), "bash")[0])[0]
    run = shlex.split(first.split("&&")[-1])
    assert run == ["python", "llm_ddp_parallel_training.py", "--cpu", "--nproc", "2"]


def test_cpu_examples_use_torchrun_only_for_what_only_torchrun_does():
    """On one machine's CPU, --nproc is the clean path; torchrun's own report and exit code 1 are worth
    it only for elastic restarts (--max-restarts), which --nproc does not do."""
    for words in script_commands():
        if "--cpu" in words and ("torchrun" in words or "torch.distributed.run" in words):
            assert any(w.startswith("--max-restarts") for w in words), " ".join(words)


def test_examples_that_train_write_into_folders_of_their_own():
    """A folder that holds a finished run's model refuses a new run, so no two different example
    commands may share one (repeating the same command, to resume it, is the point of the repeat)."""
    folders: dict[str, str] = {}
    for words in script_commands():
        if any(w.startswith(("--show-examples", "--chat")) for w in words):
            continue  # prints and exits: writes nothing
        folder = words[words.index("--output-dir") + 1] if "--output-dir" in words else "outputs"
        command = " ".join(words)
        assert folders.setdefault(folder, command) == command, f"{folder}: {folders[folder]!r} and {command!r}"
    assert len(folders) > 10


def test_no_timing_is_a_bare_about_n_seconds_or_minutes():
    numbers = r"(?:\d+|one|two|three|four|five|six|seven|eight|nine|ten|twenty|thirty|forty|fifty|sixty)"
    bare = re.compile(rf"\babout {numbers}\s*(?:s|sec|seconds?|min|minutes?)\b", re.I)
    for name, text in (("README.md", README), ("ddp_walkthrough.ipynb", NOTEBOOK)):
        assert not bare.findall(text), (name, bare.findall(text))


def offline_chat_commands(tmp_path: Path) -> list[list[str]]:
    """The offline chat example's commands as the README writes them, with runs/ moved into tmp_path."""
    (block,) = blocks(section("### Try the chat path offline: a tiny Qwen2"), "bash")
    programs = {"tests/tiny_qwen.py": str(REPO / "tests" / "tiny_qwen.py"), SCRIPT.name: str(SCRIPT)}
    found = []
    for command in commands(block):
        words = shlex.split(command)
        assert words[0] == "python" and words[1] in programs, command
        args = [str(tmp_path / w) if w.startswith("runs/") else w for w in words[2:]]
        found.append([sys.executable, programs[words[1]], *args])
    return found


def printed_as_in_the_readme(output: str, tmp_path: Path) -> str:
    return output.replace(f"{tmp_path}/", "").replace(f"{REPO}/", "/path/to/repo/")


@pytest.mark.timeout(480)
def test_the_offline_chat_example_runs_as_the_readme_writes_it(tmp_path):
    build, show, train, lora = offline_chat_commands(tmp_path)
    assert "--chat-file" in build and "--show-examples" in show[2:] and "--nproc" in train[2:]
    assert "--finetune" not in lora and "all-linear" in lora  # LoRA, the default, set where it visibly learns
    shown = blocks(section("### Try the chat path offline: a tiny Qwen2"), "")

    built = run_cmd(build, timeout=120)
    assert_ok(built)
    assert printed_as_in_the_readme(built.stdout, tmp_path) == shown[0], "the builder prints what the README shows"

    examples = run_cmd(show, timeout=120)
    assert_ok(examples)
    assert shown[1] in printed_as_in_the_readme(examples.stdout, tmp_path), "the first example, as the README shows it"

    trained = run_cmd(train, timeout=180)
    assert_ok(trained)
    printed = [line.rstrip() for line in printed_as_in_the_readme(trained.stdout, tmp_path).splitlines()]
    for line in shown[2].splitlines():
        if "tok/s" not in line:  # the step line's speed is the machine's own
            assert line in printed, line
    assert "[run] 4 examples per rank per epoch = 1 step per epoch" in trained.stdout  # one, singular
    answers = run_cmd([sys.executable, "-c", ASK, str(tmp_path / "runs" / "tiny-qwen-chat" / "qwen_full"),
                       str(tmp_path / "runs" / "tiny-chat.jsonl")], timeout=120)  # fmt: skip
    assert_ok(answers)
    right = answers.stdout.splitlines().count("right")
    # A random model answers none; the demo's run answers all 8 here. One may fall to another CPU's rounding.
    assert right >= 7, answers.stdout

    adapted = run_cmd(lora, timeout=180)
    assert_ok(adapted)
    printed = [line.rstrip() for line in printed_as_in_the_readme(adapted.stdout, tmp_path).splitlines()]
    for line in shown[3].splitlines():
        if "tok/s" not in line:
            assert line in printed, line


# The saved folder as a user loads it: transformers alone, each training question through the chat
# template, the greedy reply compared with the one it trained on.
ASK = """
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
model, tok = AutoModelForCausalLM.from_pretrained(sys.argv[1]), AutoTokenizer.from_pretrained(sys.argv[1])
for line in open(sys.argv[2]):
    user, assistant = (m["content"] for m in json.loads(line)["messages"])
    ids = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=40, do_sample=False)
    reply = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    print("right" if reply == assistant else f"wrong: {user!r} -> {reply!r}")
"""


def test_the_readme_stays_the_front_door():
    """The manual lives in docs/; the README says what the script is, how to start, and where to read on."""
    assert len(README.splitlines()) <= 450
    assert all(f"(docs/{name})" in README for name in DOCS), "every chapter is in the README's index"


LINK = re.compile(r"\]\(([^()\s]+)\)")  # the target of [text](target) and ![alt](target)


def anchors(markdown: str) -> set[str]:
    """The #fragments GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens, and
    -1, -2, ... after a repeated one."""
    seen: dict[str, int] = {}
    for line in re.sub(r"^ *```.*?^ *```$", "", markdown, flags=re.M | re.S).splitlines():
        if heading := re.match(r"#{1,6} (.+)", line):
            slug = re.sub(r"[^\w\- ]", "", heading[1].strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def relative_links(markdown: str) -> list[str]:
    """Every link target outside code that is not a URL with a scheme (http:, mailto:, ...)."""
    prose = re.sub(r"`[^`]*`", "", re.sub(r"^ *```.*?^ *```$", "", markdown, flags=re.M | re.S))
    return [target for target in LINK.findall(prose) if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_every_relative_link_in_the_readme_and_docs_resolves():
    pages = {REPO / "README.md": README} | {REPO / "docs" / name: text for name, text in DOCS.items()}
    checked, broken = 0, []
    for page, text in pages.items():
        for target in relative_links(text):
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            checked += 1
            if not file.is_relative_to(REPO) or not file.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif fragment and file.suffix == ".md" and fragment not in anchors(file.read_text(encoding="utf-8")):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert checked > 50 and not broken, "\n".join(broken)
