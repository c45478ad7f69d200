"""Tile-list validation shared by every backend, and the kind codes (``megatron_cp.kinds.Kind``, the one
definition) under short names."""

import numpy as np
import torch

from ..kinds import KIND_NAMES, Kind

FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = Kind.FULL, Kind.CAUSAL, Kind.INV_CAUSAL, Kind.BI_CAUSAL
KIND_CODES = {name: Kind(c) for c, name in enumerate(KIND_NAMES)}  # "causal" -> Kind.CAUSAL, ...


def check_tiles(tiles: torch.Tensor, seqlen_q: int, seqlen_k: int) -> None:
    """Raise ValueError naming the first bad tile of ``tiles`` (int [n, 5]); cheap, host-side."""
    if tiles.dim() != 2 or tiles.shape[1] != 5:
        raise ValueError(f"tiles must have shape [n, 5], got {tuple(tiles.shape)}")
    if tiles.numel() == 0:
        return
    t = tiles.cpu().numpy().astype(np.int64, copy=False)  # numpy: a dozen ops on a small array
    bad = (
        (t[:, 0] < 0) | (t[:, 1] > seqlen_q) | (t[:, 0] >= t[:, 1])
        | (t[:, 2] < 0) | (t[:, 3] > seqlen_k) | (t[:, 2] >= t[:, 3])
        | (t[:, 4] < 0) | (t[:, 4] > 3)
    )
    if bool(bad.any()):
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"tile {i} = {t[i].tolist()} is invalid for seqlen_q={seqlen_q}, seqlen_k={seqlen_k} "
            "(need 0 <= q_start < q_end <= seqlen_q, 0 <= k_start < k_end <= seqlen_k, kind in 0..3)"
        )
