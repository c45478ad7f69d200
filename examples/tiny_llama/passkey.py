"""Synthetic passkey retrieval for the tiny Llama (no download): the training data of DuoAttention / PruLong
in miniature.

One sample of ``seq_length + 1`` tokens::

    BOS  filler ...  KEY k_1 .. k_n  filler ...  QUERY k_1 .. k_n
                     ^ at a random depth                ^ the answer: the last n tokens

Filler is random tokens (structure-free, so nothing but the key can predict the answer). Key digits are
slot-coded tokens ``DIGIT_BASE + 10 * slot + digit``: the answer's i-th token names its slot, so one
attention head can retrieve it by content from anywhere in the context, and a head that sees only a
local window cannot (beyond its window the key is invisible: chance is 1/10 per digit). Returns
``tokens``, ``labels`` (next tokens) and ``loss_mask`` ``[n, seq_length]``; the mask is 1 only where the
label is an answer token. Deterministic in ``seed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BOS, KEY, QUERY = 1, 2, 3
DIGIT_BASE = 16  # slot-coded digits: DIGIT_BASE + 10 * slot + digit, slot < MAX_DIGITS
MAX_DIGITS = 8
FILLER = (100, 250)  # [lo, hi): below the demo's EOD (256) and any vocab >= 250


@dataclass(frozen=True)
class PasskeyTask:
    """seq_length: tokens per sample (input length); digits: key length; depth: the key's start as a
    fraction of the filler, drawn uniformly in [min_depth, max_depth]."""

    seq_length: int = 128
    digits: int = 3
    min_depth: float = 0.1
    max_depth: float = 0.8

    def __post_init__(self):
        if not 1 <= self.digits <= MAX_DIGITS:
            raise ValueError(f"digits must be in [1, {MAX_DIGITS}], got {self.digits}")
        if not 0.0 <= self.min_depth <= self.max_depth <= 1.0:
            raise ValueError(f"need 0 <= min_depth <= max_depth <= 1, got {self.min_depth}, {self.max_depth}")
        if self.filler_len < 2:
            raise ValueError(f"seq_length={self.seq_length} leaves no filler for a {self.digits}-digit key")

    @property
    def filler_len(self) -> int:
        # seq_length + 1 tokens = BOS + filler + KEY + n + QUERY + n
        return self.seq_length + 1 - 3 - 2 * self.digits

    def answer_positions(self) -> range:
        """Input positions whose label is an answer token (the same in every sample)."""
        return range(self.seq_length - self.digits, self.seq_length)

    def sample(self, g: torch.Generator) -> tuple[torch.Tensor, int]:
        """(one int64 sequence [seq_length + 1], the KEY token's position)."""
        n, f = self.digits, self.filler_len
        depth = self.min_depth + (self.max_depth - self.min_depth) * float(torch.rand((), generator=g))
        before = int(round(depth * f))
        digits = torch.randint(0, 10, (n,), generator=g)
        key = DIGIT_BASE + 10 * torch.arange(n) + digits
        filler = torch.randint(FILLER[0], FILLER[1], (f,), generator=g)
        seq = torch.cat([torch.tensor([BOS]), filler[:before], torch.tensor([KEY]), key, filler[before:],
                         torch.tensor([QUERY]), key])
        return seq, 1 + before

    def batch(self, n: int, seed: int):
        """(tokens int64, labels int64, loss_mask float32), each ``[n, seq_length]``."""
        g = torch.Generator().manual_seed(int(seed))
        seqs = torch.stack([self.sample(g)[0] for _ in range(n)])
        tokens, labels = seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
        loss_mask = torch.zeros(n, self.seq_length)
        loss_mask[:, self.seq_length - self.digits:] = 1.0
        return tokens, labels, loss_mask


def passkey_batch(n: int, seq_length: int = 128, digits: int = 3, seed: int = 0, **kw):
    """``PasskeyTask(seq_length, digits, **kw).batch(n, seed)``."""
    return PasskeyTask(seq_length, digits, **kw).batch(n, seed)
