"""--help, docs/flags.md and the command line users know describe the same flags with the same defaults."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from conftest import REPO
from flags_doc import flags_markdown

import llm_ddp_parallel_training as t

FLAGS_PAGE = REPO / "docs" / "flags.md"


def parser_actions() -> dict[str, argparse.Action]:
    return {a.option_strings[0]: a for a in t.build_arg_parser()._actions if a.option_strings[0] != "-h"}


def test_docs_flags_md_is_what_the_parser_makes():
    assert FLAGS_PAGE.read_text(encoding="utf-8") == flags_markdown(), (
        "regenerate: python tests/flags_doc.py > docs/flags.md"
    )


def test_every_flag_is_in_docs_flags_md_with_its_default_and_every_row_is_a_flag():
    rows = {row.split("`")[1].split()[0].rstrip(","): row for row in FLAGS_PAGE.read_text().splitlines()
            if row.startswith("| `--")}  # fmt: skip
    assert set(rows) == set(parser_actions())
    for flag, action in parser_actions().items():
        default = action.default
        if default is None or (default is False and action.nargs == 0):
            continue  # decided later, or a switch that is off: the page says it in words
        shown = rows[flag].split(" | ")[1]
        assert f"`{Path(default).name if flag == '--corpus-file' else default}`" in shown, (flag, shown)


def test_help_shows_no_placeholder_defaults_or_python_tuples():
    text = t.build_arg_parser().format_help()
    assert "(default: None)" not in text and "(default: (" not in text and "(default: False)" not in text
    assert text.count("\nreporting:") + text.count("\nvalidation and reporting:") == 1


def test_help_names_both_paths_and_who_each_is_for():
    help_text = " ".join(t.build_arg_parser().format_help().split())
    assert "byte-level Transformer from scratch" in help_text and "--nproc 2" in help_text
    assert "LoRA adapters on Qwen2.5" in help_text and "--model qwen" in help_text


# The command line as users knew it before the parser was generated from RunConfig: every group,
# flag, alias, default, choice and refusal (tests/interface_snapshot.json, taken from that parser).
SNAPSHOT = json.loads((REPO / "tests" / "interface_snapshot.json").read_text(encoding="utf-8"))


def parser_groups() -> list[dict]:
    groups = []
    for group in t.build_arg_parser()._action_groups:
        rows = []
        for a in group._group_actions:
            if a.option_strings[0] == "-h":
                continue
            default = "corpus.txt" if a.dest == "corpus_file" else a.default
            rows.append({"flags": a.option_strings, "default": str(default) if isinstance(default, Path) else default,
                         "choices": list(a.choices) if a.choices else None, "metavar": a.metavar,
                         "switch": a.nargs == 0 or isinstance(a, argparse.BooleanOptionalAction)})  # fmt: skip
        if rows:
            groups.append({"title": group.title, "flags": rows})
    return groups


def test_the_parser_offers_the_same_flags_in_the_same_groups_with_the_same_defaults_and_choices():
    assert parser_groups() == SNAPSHOT["groups"]


@pytest.mark.parametrize("flag", sorted(SNAPSHOT["refusals"]))
def test_every_refusal_of_a_bad_value_keeps_its_wording(flag):
    for value, expected in SNAPSHOT["refusals"][flag].items():
        if expected is None:
            t.parse_args([flag, value])
        else:
            with pytest.raises(t.UsageError) as refused:
                t.parse_args([flag, value])
            assert str(refused.value) == expected, (flag, value)


@pytest.mark.parametrize("flag", sorted(SNAPSHOT["refusals with --model hf"]))
def test_every_refusal_of_a_tiny_model_flag_with_model_hf_keeps_its_wording(flag):
    for value, expected in SNAPSHOT["refusals with --model hf"][flag].items():
        with pytest.raises(t.UsageError) as refused:
            t.parse_args(["--model", "hf", flag, value])
        assert str(refused.value) == expected, (flag, value)


def test_a_misspelt_flag_is_refused_with_the_flag_it_most_likely_meant():
    for typo in ("--max-step", "--max-stpes"):
        with pytest.raises(t.UsageError, match=f"unrecognized arguments: {typo} 3; did you mean --max-steps\\?$"):
            t.parse_args([typo, "3"])
    with pytest.raises(t.UsageError, match=r"unrecognized arguments: --bogus$"):  # nothing close: no guess
        t.parse_args(["--bogus"])
