"""What a newcomer met, each fixed and kept fixed: the seed page's two commands one after the other,
a summary whose memory agrees with the memory table, whole steps on loss.png, a stop line of its own
after a terminal's ^C, a word when the ranks outnumber the cores, and a pretrained run that prints
neither transformers' deprecation warning nor a sample of 120 blank lines."""

from __future__ import annotations

import contextlib
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import torch
from conftest import SCRIPT, TINY, assert_ok, child_env, run_cmd, torchrun_cmd

import llm_ddp_parallel_training as t


def test_the_seed_commands_run_one_after_the_other_into_the_default_outputs(tmp_path):
    # Both write into outputs/: the second keeps the first's finished model beside its own instead of
    # refusing. A folder the user names is still refused (tests/test_output_lock.py).
    first = run_cmd(torchrun_cmd(2, ["--model", "tiny", "--cpu", "--batch-size", "2", "--max-steps", "2"]), 120)
    assert_ok(first)
    second = run_cmd([sys.executable, str(SCRIPT), "--model", "tiny", "--cpu", "--max-steps", "2"], 120)
    assert_ok(second)
    kept = list((tmp_path / "outputs").glob("tiny_transformer.before-*.pt"))
    assert len(kept) == 1 and f"moved to {kept[0].relative_to(tmp_path)}" in second.stdout
    assert torch.load(kept[0], weights_only=True)["step"] == 2  # the first run's model, whole
    assert torch.load(tmp_path / "outputs" / "tiny_transformer.pt", weights_only=True)["step"] == 2
    # One measurement of each rank's peak: the summary's whole MiB are the memory table's, rounded. (The
    # table shows two decimals: 431.50 may be 431.496, which the summary rounds to 431.)
    for run in (first, second):
        summary = [int(mib.replace(",", "")) for mib in re.findall(r"rank \d+: ([\d,]+) MiB RSS", run.stdout)]
        table = [float(row.split()[-1].replace(",", "")) for row in run.stdout.split("peak RSS\n")[1].splitlines()]
        assert summary and len(table) >= len(summary), run.stdout
        for whole, shown in zip(summary, table, strict=False):
            assert whole in {round(shown - 0.005), round(shown + 0.005)}, run.stdout


def test_the_loss_plot_marks_whole_steps_only():
    plt = t.import_pyplot()
    history = [{"step": 1, "loss": 5.6}, {"step": 2, "loss": 5.1, "val_loss": 4.9}]
    fig = t.loss_figure(plt, t.parse_args(["--cpu"]), history)
    fig.canvas.draw()
    ticks = [tick for tick in fig.axes[0].get_xticks() if 1 <= tick <= 2]
    assert ticks == [1.0, 2.0], ticks
    plt.close(fig)


def test_a_stop_request_starts_its_line_afresh_on_a_terminal(tmp_path):
    # On a terminal, Ctrl-C echoes ^C at the end of the progress bar's line: [stop] must not be glued to it.
    primary, secondary = pty.openpty()
    cmd = [
        sys.executable,
        str(SCRIPT),
        *TINY,
        "--max-steps",
        "5000",
        "--progress",
        "bar",
        "--output-dir",
        str(tmp_path),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=secondary, env=child_env(), start_new_session=True)
    os.close(secondary)
    seen = bytearray()
    try:
        assert proc.stdout.readline().startswith(b"[launch]")  # signals are this run's to handle from here on
        os.kill(proc.pid, signal.SIGINT)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if select.select([primary], [], [], 1)[0]:
                with contextlib.suppress(OSError):  # the process has gone, and the terminal with it
                    seen.extend(os.read(primary, 4096))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        os.close(primary)
    assert b"\n[stop] SIGINT: every rank stops after this step" in bytes(seen).replace(b"\r\n", b"\n"), seen


def test_more_ranks_than_cores_get_a_word_that_they_share_them(tmp_path):
    cmd = [sys.executable, str(SCRIPT), *TINY, "--max-steps", "1", "--nproc", "2", "--output-dir", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=120,
                         preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "[run] warning: 2 ranks on this machine share its 1 CPU core(s)" in run.stdout


def test_a_pretrained_run_prints_no_deprecation_warning_and_an_empty_sample_on_one_line(
    tiny_qwen, corpus_lines, tmp_path
):
    # A random tiny Qwen2's chat reply decodes to 120 blank lines; --sharding full reloads the saved
    # adapter through PEFT, which read a property transformers 5 renamed and warned about it.
    from tiny_qwen import write_chat_file

    write_chat_file(tmp_path / "chat.jsonl", corpus_lines)
    args = ["--model", "hf", "--model-name-or-path", str(tiny_qwen), "--corpus-file", str(tmp_path / "chat.jsonl"),
            "--cpu", "--max-steps", "1", "--batch-size", "2", "--seq-len", "256", "--sharding", "full",
            "--output-dir", str(tmp_path / "out")]  # fmt: skip
    run = run_cmd(torchrun_cmd(2, args), 180)
    assert_ok(run)
    assert "FutureWarning" not in run.stderr and "is_gradient_checkpointing" not in run.stderr, run.stderr
    sample = run.stdout.split("[sample] ", 1)[1].split("\n[summary]", 1)[0]
    assert "\n" not in sample.strip() and "whitespace character(s)" in sample, sample
