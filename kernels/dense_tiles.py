"""Decompose a tile list into dense tiles (for cuDNN) and the rest (for the Triton kernels).

cuDNN attention (PyTorch's SDPA cuDNN op) handles two shapes well: a full rectangle and a causal tile
whose causal mask is top-left aligned, which equals our bottom-right aligned CAUSAL exactly when the tile
is square. A bottom-right CAUSAL tile with ``sq`` rows and ``sk`` keys splits exactly into:

* ``sk >= sq``: a FULL rectangle ``rows x [ks, ks + sk - sq)`` (every row keeps these keys, since
  ``j <= i + (sk - sq)`` holds for ``j < sk - sq``) and a square causal tile
  ``rows x [ks + sk - sq, ke)`` (``j' = j - (sk - sq) <= i``);
* ``sk < sq``: rows ``i < sq - sk`` keep nothing; the last ``sk`` rows are a square causal tile.

Pieces of at least ``min_rows`` rows and ``min_keys`` keys are dense; smaller pieces (and every other
tile kind) stay in the rest list as valid tiles of the same cells. The pieces of one tile are
cell-disjoint and cover exactly its kept cells, so the decomposition of a cell-disjoint list is too
(tests/test_dense_tiles.py checks this with dense masks). Pure host-side tensor code.
"""

from __future__ import annotations

import torch

from .tiles import CAUSAL, FULL


def split_dense(tiles: torch.Tensor, min_rows: int = 512, min_keys: int = 512):
    """tiles int [n, 5] -> (dense, rest).

    dense: list of (q_start, q_end, k_start, k_end, is_causal) with is_causal meaning a square tile
    with top-left (== bottom-right) causal mask; rest: int32 [m, 5] tiles left to the Triton kernel.
    """
    dense: list[tuple[int, int, int, int, bool]] = []
    rest: list[list[int]] = []

    def big(sq, sk):
        return sq >= min_rows and sk >= min_keys

    for qs, qe, ks, ke, kind in tiles.to("cpu", torch.int64).tolist():
        sq, sk = qe - qs, ke - ks
        if kind == FULL:
            if big(sq, sk):
                dense.append((qs, qe, ks, ke, False))
            else:
                rest.append([qs, qe, ks, ke, kind])
        elif kind == CAUSAL:
            if sk < sq:  # the first sq - sk rows keep nothing
                qs = qe - sk
                sq = sk
            d = sk - sq  # keys every row keeps
            full_ok, sq_ok = d > 0 and big(sq, d), big(sq, sq)
            if not full_ok and not sq_ok:
                rest.append([qs, qe, ks, ke, kind])
                continue
            if d > 0:
                if full_ok:
                    dense.append((qs, qe, ks, ks + d, False))
                else:
                    rest.append([qs, qe, ks, ks + d, FULL])
            if sq_ok:
                dense.append((qs, qe, ks + d, ke, True))
            else:
                rest.append([qs, qe, ks + d, ke, CAUSAL])
        else:
            rest.append([qs, qe, ks, ke, kind])
    rest_t = torch.tensor(rest, dtype=torch.int32).reshape(-1, 5)
    return dense, rest_t


def dense_tiles_tensor(dense) -> torch.Tensor:
    """The dense pieces as an ordinary tile list (FULL, or CAUSAL for the square causal ones)."""
    return torch.tensor([[a, b, c, d, CAUSAL if causal else FULL] for a, b, c, d, causal in dense],
                        dtype=torch.int32).reshape(-1, 5)
