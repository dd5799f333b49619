"""Every row of a dataset at once, padded, for a test or a benchmark to look at a few rows: the script makes
rows one at a time, as a batch asks, and never holds a data set padded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import llm_ddp_parallel_training as t


@dataclass(frozen=True)
class Stacked:
    inputs: torch.Tensor  # (N, T)
    targets: torch.Tensor  # (N, T), IGNORE_INDEX on padding
    positions: torch.Tensor | None  # (N, T) for packed rows: each example's positions restart at 0
    target_bytes: torch.Tensor  # (N,) UTF-8 bytes the targets spell out

    def __len__(self) -> int:
        return self.inputs.shape[0]


def stacked(rows: t.Rows) -> Stacked:
    columns = [torch.stack(c) for c in zip(*(rows[i] for i in range(len(rows))), strict=True)]
    return Stacked(columns[0], columns[1], columns[2] if len(columns) > 2 else None, rows.target_bytes)


def byte_examples(lines: list[str], seq_len: int, pack: bool) -> Stacked:
    """Lines as the tiny model's byte examples, each framed by newlines: the first byte is predicted from
    "start of line", and the closing newline teaches where a line ends."""
    return stacked(t.ByteWindows(t.Lines.from_texts(lines), seq_len, pack))
