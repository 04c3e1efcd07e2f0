"""The main job's data: a text shipped with minidist, read as bytes, cut into batches that
depend only on (seed, step), and each data-parallel rank's equal share of them.

Equals: the whole batch of step k is the same on every rank and in the single-process run;
data-parallel rank d takes rows [d B/dp, (d+1) B/dp). So a resumed run sees exactly the batches
an uninterrupted one would, and any dp x pp x tp layout trains on the same tokens.
Communication: none (every rank reads the file; it is small).
Memory per rank: the text, one int64 per byte (11 KB of sonnets: 90 KB).
Lesson: lessons/12_3d_parallel/.

The text: Shakespeare's sonnets (1609, public domain), minidist/gpt/data/sonnets.txt. Any other
file works with --data PATH. Byte level: the vocabulary is the 256 byte values, no tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch

SONNETS = Path(__file__).parent / "data" / "sonnets.txt"


def load_bytes(path: str | Path = SONNETS) -> torch.Tensor:
    """The file's bytes as an int64 tensor (N,): the token ids."""
    data = Path(path).read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch_at(
    data: torch.Tensor, step: int, batch: int, seq_len: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s whole batch: ids (B, T) and targets (B, T), the ids shifted by one.

    B windows of T + 1 bytes at offsets drawn from torch.Generator(seed, step): a pure function
    of its arguments, on every rank and in every run."""
    if len(data) < seq_len + 1:
        raise ValueError(
            f"the text has {len(data)} bytes; seq_len={seq_len} needs at least {seq_len + 1}"
        )
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq_len, (batch,), generator=gen)  # (B,)
    windows = data[starts[:, None] + torch.arange(seq_len + 1)]  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]


def dp_share(t: torch.Tensor, d: int, dp: int) -> torch.Tensor:
    """Rows [d B/dp, (d+1) B/dp) of t (B, ..): data-parallel rank d's equal share."""
    n = t.shape[0]
    if n % dp:
        raise ValueError(f"batch={n} is not divisible by dp={dp}")
    return t[d * n // dp : (d + 1) * n // dp]
