"""Old import path of the dense split, kept for tests/test_cost_model.py until it calls
``megatron_cp.kernels.pieces.split_pieces``; the rules live in kernels/pieces.py only."""

from __future__ import annotations

import torch

from .pieces import _split_band_squares as split_band_squares
from .pieces import _split_dense


def split_dense(tiles: torch.Tensor, min_rows: int = 512, min_keys: int = 512, band_chunk: int = 0,
                band_min_keys: int = 1024):
    """``pieces.split_pieces(tiles, min_rows=, min_keys=, band_squares=0, forward=False)`` as the old
    (pieces list, rest) pair. ``band_chunk`` (bands as chunked cuDNN pieces) was removed: only 0 is taken."""
    if band_chunk:
        raise ValueError(f"band_chunk was removed (bands as chunked cuDNN pieces measured slower); got {band_chunk}")
    return _split_dense(tiles.to("cpu", torch.int64).reshape(-1, 5), min_rows, min_keys)


__all__ = ["split_dense", "split_band_squares"]
