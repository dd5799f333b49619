"""--config FILE: settings from YAML, keys named as the flags, the command line over them; an unknown key or a
file that holds no settings refused in one line; and OUTPUT_DIR/config.yaml, which every run writes as training
starts and which --config takes back to repeat the run bit for bit (a refused run writes none)."""

from __future__ import annotations

import re
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest
from conftest import assert_bitwise_equal, assert_ok, launch, run_jobs, weights

import llm_ddp_parallel_training as t


def settings(tmp_path, text: str) -> str:
    path = tmp_path / "settings.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_a_config_files_settings_reach_the_run_and_the_command_line_overrides_them(tmp_path):
    path = settings(tmp_path, "max_steps: 9\nseq-len: 64\nlr: 1e-3\nplot: true\npack: false\n")
    cfg = t.parse_args(["--config", path, "--max-steps", "11"])
    assert (cfg.max_steps, cfg.seq_len, cfg.lr, cfg.plot, cfg.pack) == (11, 64, 1e-3, True, False)
    assert cfg.min_lr == 1e-4, "a default decided later follows the file's settings, as it follows the flags"


def test_a_config_file_is_read_as_the_flags_are_with_their_ranges_and_refusals(tmp_path):
    cfg = t.parse_args(["--config", settings(tmp_path, "model: hf\nlora_targets: [q_proj, k_proj]\n")])
    assert cfg.lora_targets == ("q_proj", "k_proj")
    # A bad value is blamed on the file that holds it, not on the command line, which never said it.
    with pytest.raises(
        t.UsageError, match=r"^--config \S+settings.yaml: --seq-len: must be a positive integer, got 0$"
    ):
        t.parse_args(["--config", settings(tmp_path, "seq_len: 0\n")])
    with pytest.raises(t.UsageError, match=r"^--d-model 128 is for the tiny model \(--model tiny\)"):
        t.parse_args(["--config", settings(tmp_path, "d_model: 128\n"), "--model", "hf"])


@pytest.mark.parametrize(
    ("text", "refusal"),
    [
        ("max_stepz: 3\n", "unknown setting max_stepz (did you mean max_steps?)"),  # as the key was spelled
        ("max-stepz: 3\n", "unknown setting max-stepz (did you mean max-steps?)"),
        # every unknown key at once, each with the nearest setting; TrainingArguments' names with ours
        (
            "learning_rate: 1e-4\nlora_rank: 16\nseq_len: 64\nzzz: 1\n",
            "unknown settings learning_rate (did you mean lr?), lora_rank (did you mean lora_r?), zzz$",
        ),
        ("model: hf\ndropout: 0.1\n", "--dropout 0.1 is for the tiny model (--model tiny)"),  # blamed on the file
        ("- max_steps\n", "expected one `name: value` line per setting"),
        ("max_steps: [3\n", "not YAML (while parsing a flow sequence"),
    ],
)
def test_a_file_that_holds_no_settings_of_ours_is_refused_in_one_line(tmp_path, text, refusal):
    path = settings(tmp_path, text)
    with pytest.raises(t.UsageError) as refused:
        t.parse_args(["--config", path])
    assert re.match(re.escape(f"--config {path}: ") + re.escape(refusal).replace(r"\$", "$"), str(refused.value))
    assert "\n" not in str(refused.value)


def test_a_missing_config_file_is_refused_in_one_line(tmp_path):
    with pytest.raises(t.UsageError, match=r"^--config .*nope\.yaml: No such file or directory$"):
        t.parse_args(["--config", str(tmp_path / "nope.yaml")])


def test_without_pyyaml_config_names_the_package_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml now fails, as where it is not installed
    with pytest.raises(t.UsageError, match=r"^--config reads YAML: pip install pyyaml$"):
        t.parse_args(["--config", settings(tmp_path, "max_steps: 3\n")])


@pytest.mark.parametrize(
    "argv",
    [
        ["--cpu", "--max-steps", "7", "--no-pack", "--inject-fault", "1:3:nan", "--cache-dir", "none", "--plot"],
        ["--model", "hf", "--lora-targets", "q_proj,k_proj", "--merge-lora", "--metrics-file", "m.jsonl"],
        ["--epochs", "2", "--pp", "2", "--ddp", "manual", "--trace-steps", "3"],
        ["--model", "hf", "--objective", "dpo", "--dpo-beta", "0.2"],  # (its --head-loss unwritten: refused with it)
    ],
)
def test_every_setting_written_to_config_yaml_reads_back_as_the_same_settings(tmp_path, argv):
    cfg = t.parse_args([*argv, "--output-dir", str(tmp_path)])
    absolute = {f.name: getattr(cfg, f.name).resolve() for f in fields(cfg) if isinstance(getattr(cfg, f.name), Path)}
    assert t.parse_args(["--config", str(t.write_settings(cfg))]) == replace(cfg, **absolute)


def test_config_yaml_names_its_files_absolutely_so_it_repeats_the_run_from_any_folder(tmp_path, monkeypatch):
    (tmp_path / "data.txt").write_text("one line\n")
    monkeypatch.chdir(tmp_path)
    cfg = t.parse_args(["--corpus-file", "data.txt", "--output-dir", "out", "--metrics-file", "m.jsonl"])
    written = t.write_settings(cfg).resolve()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    again, here = t.parse_args(["--config", str(written)]), tmp_path.resolve()
    assert [again.corpus_file, again.output_dir, again.metrics_file] == [
        here / n for n in ("data.txt", "out", "m.jsonl")
    ]


def test_config_yaml_leaves_out_how_the_run_was_launched_and_the_readme_says_so(tmp_path):
    import yaml

    written = t.write_settings(t.parse_args(["--nproc", "2", "--output-dir", str(tmp_path)]))
    assert "nproc" not in yaml.safe_load(written.read_text())
    readme = (Path(t.__file__).parent / "README.md").read_text(encoding="utf-8").splitlines()
    assert "(`--nproc` and torchrun's flags are not in it)" in next(r for r in readme if "`config.yaml`" in r)


def test_a_repeat_into_another_folder_writes_there_what_the_first_run_wrote_in_its_own(tmp_path):
    first = t.parse_args(["--output-dir", str(tmp_path / "m1"), "--metrics-file", str(tmp_path / "m1" / "m.jsonl"),
                          "--eval-file", str(tmp_path / "held.txt")])  # fmt: skip
    again = t.parse_args(["--config", str(t.write_settings(first)), "--output-dir", str(tmp_path / "m2")])
    assert (again.output_dir, again.metrics_file) == (tmp_path / "m2", tmp_path / "m2" / "m.jsonl")
    assert again.eval_file == (tmp_path / "held.txt").resolve()  # outside the first run's folder: as written


@pytest.mark.parametrize(
    ("argv", "then", "derived"),
    [
        (["--cpu"], ["--lr", "1e-4"], {"min_lr": 1e-5}),  # --min-lr: a tenth of --lr
        (["--model", "hf"], ["--finetune", "full"], {"lr": 2e-5, "min_lr": 2e-6}),  # gentler for all the weights
    ],
)
def test_a_setting_the_run_derived_is_derived_anew_when_config_yaml_is_changed(tmp_path, argv, then, derived):
    written = t.write_settings(t.parse_args([*argv, "--output-dir", str(tmp_path)]))
    again = t.parse_args(["--config", str(written), *then])
    assert {name: getattr(again, name) for name in derived} == pytest.approx(derived)


def test_merge_lora_is_true_or_false_in_a_config_file_and_a_switch_takes_no_other_word(tmp_path):
    hf = "model: hf\nfinetune: lora\n"
    assert t.parse_args(["--config", settings(tmp_path, hf + "merge_lora: true\n")]).merge_lora == ""
    assert t.parse_args(["--config", settings(tmp_path, hf + "merge_lora: false\n")]).merge_lora is None
    path = settings(tmp_path, "cpu: 'no'\n")  # a word, not a boolean: it would have turned --cpu on
    with pytest.raises(t.UsageError, match=r": cpu is on or off: true or false, not 'no'$"):
        t.parse_args(["--config", path])


def test_a_run_writes_config_yaml_which_repeats_it_bit_for_bit_and_a_refused_run_writes_none(tmp_path):
    # The run and its repeat are jobs of a shared launch (conftest.run_jobs): their subject is where the
    # numbers land; the refused run, whose subject is its exit, is a launch of its own.
    args = ["--cpu", "--max-steps", "4", "--seq-len", "32", "--d-model", "32", "--output-dir", str(tmp_path / "first")]
    first = run_jobs({"first": args})["first"]
    assert_ok(first)
    written = tmp_path / "first" / "config.yaml"
    assert f"[save] the settings: {written}" in first.stdout
    again = run_jobs({"again": ["--config", str(written), "--output-dir", str(tmp_path / "again")]})["again"]
    assert_ok(again)
    assert_bitwise_equal(weights(tmp_path / "first"), weights(tmp_path / "again"), "repeated from config.yaml")
    before = written.read_bytes()
    refused = launch(["--config", str(written), "--lr", "0.1"])  # into the first run's folder: its model stays
    assert refused.returncode == 2 and "already holds a finished run's model" in refused.stderr
    assert written.read_bytes() == before, "a refused run leaves the settings it did not train with unwritten"


def test_a_checkpoint_that_named_its_model_folder_relatively_resumes_under_config_yaml_naming_it_whole(
    tmp_path, monkeypatch
):
    (tmp_path / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    saved, whole, other = ({"model_name_or_path": name} for name in ("model", str(tmp_path / "model"), "Qwen/other"))
    assert t.may_change("model_name_or_path", saved, whole)
    assert not t.may_change("model_name_or_path", saved, other)
