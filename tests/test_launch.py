"""The ways to launch, end to end: one process, torchrun on one machine, two nodes, and --nproc.

torchrun and --nproc each start one same run (dropout included) for the module: the loss falls
under torchrun, and the two write the same bytes. What --nproc's own launcher does when a rank
fails, on Ctrl-C and when it is killed: tests/test_nproc.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import TINY, assert_ok, child_env, free_port, launch, run_cmd, torchrun_cmd

import llm_ddp_parallel_training as t


def test_single_process_run_writes_a_checkpoint_that_reloads(tmp_path):
    run = launch([*TINY, "--max-steps", "3", "--output-dir", str(tmp_path)])
    assert_ok(run)
    assert "no process group" in run.stdout
    ckpt = torch.load(tmp_path / "tiny_transformer.pt", weights_only=True)
    assert ckpt["step"] == 3 and ckpt["config"]["d_model"] == 32
    assert not any(k.startswith("module.") for k in ckpt["model"])
    model = t.load_tiny_checkpoint(tmp_path / "tiny_transformer.pt")
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 256)


@pytest.fixture(scope="module")
def torchrun_and_nproc(tmp_path_factory) -> dict[str, tuple]:
    """The same run, started by torchrun and by --nproc 2: {launcher: (run, output folder)}."""
    root = tmp_path_factory.mktemp("launchers")
    args = [*TINY, "--max-steps", "40", "--log-every", "10", "--dropout", "0.1"]
    torchrun = launch([*args, "--output-dir", str(root / "torchrun")], nproc=2)
    nproc = launch([*args, "--nproc", "2", "--output-dir", str(root / "nproc")])
    return {"torchrun": (torchrun, root / "torchrun"), "nproc": (nproc, root / "nproc")}


def test_two_gloo_ranks_train_and_the_loss_falls(torchrun_and_nproc):
    run, out = torchrun_and_nproc["torchrun"]
    assert_ok(run)
    assert "2 rank(s) x 4 examples x 1 micro-step(s) = global batch 8" in run.stdout
    losses = run.losses()
    assert len(losses) >= 4 and losses[-1] < losses[0] - 1.0, losses
    assert (out / "tiny_transformer.pt").exists()
    assert "[sample] Each rank" in run.stdout


@pytest.mark.parametrize("launcher", ["torchrun", "nproc"])
def test_torchs_ddp_keeps_its_expected_unused_parameter_warning_off_every_ranks_stderr(torchrun_and_nproc, launcher):
    run, _ = torchrun_and_nproc[launcher]
    assert_ok(run)
    assert "find_unused_parameters" not in run.output  # TorchDDP searches for unused parameters on purpose


def test_two_nodes_meet_through_c10d_rendezvous(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    args = [*TINY, "--max-steps", "3", "--output-dir", str(tmp_path)]
    launcher = f"--nnodes 2 --rdzv-backend c10d --rdzv-endpoint {endpoint} --rdzv-id two-node-test".split()
    cmds = [torchrun_cmd(1, args, [*launcher, "--node-rank", str(k)]) for k in (0, 1)]
    # The second "node" runs in the background; both must finish.
    other = subprocess.Popen(
        cmds[1], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(), start_new_session=True
    )
    try:
        run = run_cmd(cmds[0], timeout=240)
        other_out, _ = other.communicate(timeout=120)
    finally:
        other.kill()
    assert_ok(run)
    assert other.returncode == 0, other_out
    assert "2 process(es)" in run.stdout + other_out
    assert (tmp_path / "tiny_transformer.pt").exists()


def test_same_seed_same_world_size_gives_bitwise_identical_checkpoints(torchrun_and_nproc):
    # Two launches of one run (seed 1337, 2 ranks, dropout 0.1): one by torchrun, one by --nproc 2.
    paths = []
    for name in ("torchrun", "nproc"):
        run, out = torchrun_and_nproc[name]
        assert_ok(run)
        paths.append(out / "tiny_transformer.pt")
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_the_tiny_path_never_imports_transformers_or_peft(tmp_path):
    args = [*TINY, "--max-steps", "1", "--output-dir", str(tmp_path)]
    code = (
        "import sys, llm_ddp_parallel_training as t\n"
        f"t.main({args!r})\n"
        "print('IMPORTED', [m for m in ('transformers', 'peft') if m in sys.modules])"
    )
    run = run_cmd([sys.executable, "-c", code], timeout=120)
    assert_ok(run)
    assert "IMPORTED []" in run.stdout


MEETING_PROBE = """
import sys, time
import llm_ddp_parallel_training as t

cfg = t.parse_args(sys.argv[1:])
d = t.setup_distributed(cfg)
time.sleep(4 if d.rank == 1 else 0)  # rank 1's "download" outlasts --timeout-s 1
problem = t.meet_without_deadline(d, "probe", "")
print(f"rank {d.rank} met, problem {problem!r}", flush=True)
t.teardown_distributed()
"""


def test_waiting_for_a_download_has_no_collective_deadline(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(MEETING_PROBE)
    run = run_cmd(torchrun_cmd(2, [*TINY, "--timeout-s", "1"], script=probe), timeout=180)
    assert_ok(run)
    assert "rank 0 met, problem ''" in run.stdout and "rank 1 met, problem ''" in run.stdout


def test_nproc_runs_the_ranks_itself_and_writes_what_torchrun_writes_bit_for_bit(torchrun_and_nproc):
    assert_ok(torchrun_and_nproc["torchrun"][0])
    run = torchrun_and_nproc["nproc"][0]
    assert_ok(run)
    assert "2 process(es)" in run.stdout
    checkpoints = [(out / "tiny_transformer.pt").read_bytes() for _, out in torchrun_and_nproc.values()]
    assert checkpoints[0] == checkpoints[1]
