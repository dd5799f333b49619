"""The pieces a learner reads first: the causal model, the byte examples, the sampler shards, the sample line."""

from __future__ import annotations

import itertools

import torch
from rows import byte_examples

import llm_ddp_parallel_training as t


def tiny(seq_len: int = 16) -> t.TinyTransformer:
    torch.manual_seed(0)
    return t.TinyTransformer(t.TinyConfig(seq_len=seq_len, d_model=32, n_heads=4, n_layers=2)).eval()


def test_model_maps_ids_to_logits_over_bytes():
    ids = torch.randint(0, 256, (3, 16))
    assert tiny()(ids).shape == (3, 16, 256)


def test_changing_a_future_byte_never_changes_earlier_logits():
    model = tiny()
    ids = torch.randint(0, 256, (1, 16))
    for pos in (1, 7, 15):
        changed = ids.clone()
        changed[0, pos] = (changed[0, pos] + 1) % 256
        a, b = model(ids), model(changed)
        assert torch.equal(a[0, :pos], b[0, :pos]), f"position < {pos} saw the byte at {pos}"
        assert not torch.allclose(a[0, pos], b[0, pos]), "the changed position itself must change"


def test_lines_become_newline_framed_byte_examples_with_padding_ignored():
    ex = byte_examples(["ab"], seq_len=8, pack=False)
    # "\nab\n": inputs "\nab", targets "ab\n", the rest is padding that the loss skips
    assert ex.inputs[0, :3].tolist() == [10, 97, 98]
    assert ex.targets[0, :3].tolist() == [97, 98, 10]
    assert (ex.targets[0, 3:] == t.IGNORE_INDEX).all()


def test_long_lines_are_windowed_so_every_byte_is_a_target_once():
    line = "x" * 20 + "é"  # 23 bytes of UTF-8 inside the newlines
    ex = byte_examples([line], seq_len=8, pack=False)
    targets = ex.targets[ex.targets != t.IGNORE_INDEX].tolist()
    assert bytes(targets) == (line + "\n").encode()


def test_packed_lines_fill_every_window_and_keep_every_byte():
    lines = ["first line", "second", "a third, longer line of text"]
    ex = byte_examples(lines, seq_len=8, pack=True)
    assert (ex.targets[:-1] != t.IGNORE_INDEX).all(), "only the last window may be padded"
    targets = ex.targets[ex.targets != t.IGNORE_INDEX].tolist()
    assert bytes(targets) == ("\n".join(lines) + "\n").encode()
    assert ex.target_bytes.sum() == len(targets)


def shard_indices(n: int, world: int, batch: int, epoch: int) -> list[list[int]]:
    ex = torch.utils.data.TensorDataset(torch.zeros(n))  # the sampler looks at the length alone
    cfg = t.parse_args(["--batch-size", str(batch), "--seed", "7"])
    shards = []
    for rank in range(world):
        d = t.Dist(rank, rank, world, world, torch.device("cpu"), "gloo", "test")
        _, sampler = t.make_train_loader(ex, cfg, d)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


def test_sampler_shards_are_disjoint_and_cover_the_data():
    shards = shard_indices(n=101, world=3, batch=4, epoch=0)
    seen = [i for s in shards for i in s]
    assert len(seen) == len(set(seen)), "two ranks got the same example"
    assert len(seen) == 99 and set(seen) <= set(range(101)), "drop_last trims only the remainder (101 % 3)"
    assert len({len(s) for s in shards}) == 1, "every rank gets the same number of examples"


def test_sampler_reshuffles_each_epoch():
    assert shard_indices(50, 2, 4, epoch=0)[0] != shard_indices(50, 2, 4, epoch=1)[0]


def test_the_lean_sampler_hands_out_torchs_order_for_every_shuffle_drop_last_size_seed_and_epoch():
    # Importable from a learner's own script: it must be torch's DistributedSampler for every argument,
    # padding included (without drop_last torch repeats indices from the start to fill the last round).
    sizes, worlds, flags, seeds = [*range(14), 97, 1_003], range(1, 5), (True, False), (0, 1337)
    for n, world, shuffle, drop_last, seed in itertools.product(sizes, worlds, flags, flags, seeds):
        for rank in range(world):
            kw = dict(num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            ours, torchs = t.LeanDistributedSampler(range(n), **kw), torch.utils.data.DistributedSampler(range(n), **kw)
            for epoch in range(3):
                ours.set_epoch(epoch)
                torchs.set_epoch(epoch)
                assert list(ours) == list(torchs) and len(ours) == len(torchs), (n, kw, epoch)


class Scripted(torch.nn.Module):
    """A byte model that samples the bytes of its script, one a step, after "\\n" and the prompt."""

    def __init__(self, prompt: str, script: bytes) -> None:
        super().__init__()
        self.before, self.script = 1 + len(prompt.encode()), script
        self.config = t.TinyConfig(seq_len=64)
        self.device_of = torch.nn.Parameter(torch.zeros(()))  # generate_bytes takes its device from a parameter

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = torch.full((1, ids.shape[1], 256), -1e4)
        logits[0, -1, self.script[ids.shape[1] - self.before]] = 0.0
        return logits


def test_a_byte_sample_shows_control_characters_as_escapes_on_one_line():
    # Backspace, NUL, DC1, ESC, DEL, C1's NEL (U+0085, two bytes of UTF-8), a carriage return, then the line's end.
    script = b"a\x08b\x00\x11\x1b[2J\x7f\xc2\x85\xc3\xa9\rz\n"
    sample = t.generate_bytes(Scripted("Hi", script), "Hi", max_new=64, seed=0)
    assert sample == "Hia\\x08b\\x00\\x11\\x1b[2J\\x7f\\x85\u00e9\\x0dz"


def test_an_escape_in_a_sample_is_never_ambiguous_and_unicode_line_breaks_are_escaped_too():
    sample = t.generate_bytes(Scripted("Hi", b"\\x08\xe2\x80\xa8\n"), "Hi", max_new=64, seed=0)
    assert sample == "Hi\\\\x08\\u2028"  # a literal backslash doubled, U+2028 shown, not obeyed
