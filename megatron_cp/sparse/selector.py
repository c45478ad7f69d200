"""The selector protocol (docs/sparse.md) and checks every selector shares."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .view import SelectionView


@runtime_checkable
class Selector(Protocol):
    """Chooses, per query head and local q block, the global key blocks to compute (docs/sparse.md)."""

    name: str
    block: int

    def check(self, num_q_heads: int, num_kv_heads: int, head_dim: int, seqlen: int) -> None: ...

    def select(self, q: torch.Tensor, k: torch.Tensor, view: SelectionView) -> torch.Tensor: ...


def check_block(name: str, block, seqlen: int) -> None:
    """ValueError unless ``block`` is a positive int dividing ``seqlen``."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{name}: block must be a positive int, got {block!r}")
    if seqlen % block:
        raise ValueError(f"{name}: sequence length {seqlen} is not a multiple of block {block}")


def check_heads(name: str, num_q_heads, num_kv_heads, head_dim) -> None:
    """ValueError unless the head counts / head size are positive ints with Hq a multiple of Hkv."""
    for what, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: {what} must be a positive int, got {v!r}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{name}: num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")


def check_fraction(name: str, what: str, x, closed_low: bool = False) -> None:
    """ValueError unless ``x`` is a number in (0, 1] ([0, 1] with ``closed_low``)."""
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and (0 <= x <= 1 if closed_low else 0 < x <= 1)
    if not ok:
        raise ValueError(f"{name}: {what} must be a number in {'[0' if closed_low else '(0'}, 1], got {x!r}")
