"""docs/flags.md, made from the script's parser: every flag, its default, what it accepts and its help.

    python tests/flags_doc.py > docs/flags.md

tests/test_help.py keeps the file equal to what this prints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import llm_ddp_parallel_training as t

HEADER = """# Flags

Every flag of `llm_ddp_parallel_training.py`, grouped as `--help` prints them, made from the parser (and so
from the script's `RunConfig`, where each setting is declared once) by `python tests/flags_doc.py >
docs/flags.md`; a test keeps this page equal to it. A default that says "decided later" depends on other
flags: the flag's own line says how.
"""


def default_of(action: argparse.Action) -> str:
    if action.default is None:
        return "decided later"
    if action.default is False and action.nargs == 0:
        return "off"
    if action.dest == "corpus_file":
        return f"`{Path(action.default).name}` (beside the script)"
    return f"`{action.default}`"


def accepts(action: argparse.Action) -> str:
    if action.choices:
        return ", ".join(f"`{c}`" for c in action.choices)
    if isinstance(action.type, t.Within):
        return str(action.type)
    return ""


def flags_markdown() -> str:
    parser = t.build_arg_parser()
    spell = parser._get_formatter()._format_action_invocation
    out = [HEADER]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.option_strings[0] != "-h"]
        if not actions:
            continue
        out += [f"## {group.title}", "", "| flag | default | accepts | what it does |", "|---|---|---|---|"]
        for a in actions:
            flag = spell(a).replace(" {" + ",".join(map(str, a.choices or [])) + "}", "")
            out.append(f"| `{flag}` | {default_of(a)} | {accepts(a)} | {a.help.replace('|', '/')} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(flags_markdown())
