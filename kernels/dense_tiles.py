"""Decompose a tile list into dense tiles (for cuDNN) and the rest (for the Triton kernels).

cuDNN attention (PyTorch's SDPA cuDNN op) handles two shapes well: a full rectangle and a causal tile
whose causal mask is top-left aligned, which equals our bottom-right aligned CAUSAL exactly when the tile
is square. A bottom-right CAUSAL tile with ``sq`` rows and ``sk`` keys splits exactly into:

* ``sk >= sq``: a FULL rectangle ``rows x [ks, ks + sk - sq)`` (every row keeps these keys, since
  ``j <= i + (sk - sq)`` holds for ``j < sk - sq``) and a square causal tile
  ``rows x [ks + sk - sq, ke)`` (``j' = j - (sk - sq) <= i``);
* ``sk < sq``: rows ``i < sq - sk`` keep nothing; the last ``sk`` rows are a square causal tile.

Pieces of at least ``min_rows`` rows and ``min_keys`` keys are dense; smaller pieces (and every other
tile kind) stay in the rest list as valid tiles of the same cells.

A BI_CAUSAL tile is a band (a sliding window): with ``w = sk - sq``, row ``i`` keeps keys
``[i, i + w]``. With ``band_chunk = C > 0``, ``w >= C + band_min_keys`` and ``n = sq // C`` chunks of
at least ``min_rows`` rows in all, its first ``n`` chunks of ``C`` rows split exactly into, for chunk ``b`` (local rows
``[bC, bC + C)``): an INV_CAUSAL square ``[bC, bC + C)`` of keys (row ``i`` keeps ``j >= i``; rest), a
FULL rectangle ``[bC + C, bC + w)`` and a square causal tile ``[bC + w, bC + w + C)``. The rectangles
of all chunks are one *batched* dense piece, the squares another: piece ``(qs, qe, ks, ke, causal,
n)`` stands for the ``n`` pieces ``b = 0 .. n-1`` of rows ``[qs + b r, qs + (b+1) r)`` (``r = (qe - qs)
/ n``) and keys ``[ks + b r, ke + b r)``, one cuDNN call with batch ``n``; ordinary pieces have ``n = 1``.
The rows left below the last whole chunk stay one BI_CAUSAL tile in the rest.

The pieces of one tile are cell-disjoint and cover exactly its kept cells, so the decomposition of a
cell-disjoint list is too (tests/test_dense_tiles.py checks this with dense masks). Pure host-side
tensor code.
"""

from __future__ import annotations

import torch

from .tiles import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL


def split_dense(tiles: torch.Tensor, min_rows: int = 512, min_keys: int = 512, band_chunk: int = 0,
                band_min_keys: int = 1024):
    """tiles int [n, 5] -> (dense, rest).

    dense: list of (q_start, q_end, k_start, k_end, is_causal, n) with is_causal meaning a square tile
    with top-left (== bottom-right) causal mask and n the batch of a band piece (see module doc; 1 for
    ordinary pieces); rest: int32 [m, 5] tiles left to the Triton kernel.
    """
    dense: list[tuple[int, int, int, int, bool, int]] = []
    rest: list[list[int]] = []

    def big(sq, sk):
        return sq >= min_rows and sk >= min_keys

    for qs, qe, ks, ke, kind in tiles.to("cpu", torch.int64).tolist():
        sq, sk = qe - qs, ke - ks
        if kind == FULL:
            if big(sq, sk):
                dense.append((qs, qe, ks, ke, False, 1))
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
                    dense.append((qs, qe, ks, ks + d, False, 1))
                else:
                    rest.append([qs, qe, ks, ks + d, FULL])
            if sq_ok:
                dense.append((qs, qe, ks + d, ke, True, 1))
            else:
                rest.append([qs, qe, ks + d, ke, CAUSAL])
        elif kind == BI_CAUSAL and band_chunk > 0 and sk - sq >= band_chunk + band_min_keys \
                and sq // band_chunk * band_chunk >= max(min_rows, 1):
            c, w = band_chunk, sk - sq
            n = sq // c
            e = qs + n * c  # rows of whole chunks end here
            dense.append((qs, e, ks + c, ks + w, False, n))
            dense.append((qs, e, ks + w, ks + w + c, True, n))
            rest.extend([qs + b * c, qs + (b + 1) * c, ks + b * c, ks + (b + 1) * c, INV_CAUSAL] for b in range(n))
            if e < qe:
                rest.append([e, qe, ks + n * c, ke, BI_CAUSAL])
        else:
            rest.append([qs, qe, ks, ke, kind])
    rest_t = torch.tensor(rest, dtype=torch.int32).reshape(-1, 5)
    return dense, rest_t


def dense_tiles_tensor(dense) -> torch.Tensor:
    """The dense pieces as an ordinary tile list (FULL, or CAUSAL for the square causal ones), a batched
    piece as its ``n`` tiles."""
    out = []
    for a, b, c, d, causal, n in dense:
        r = (b - a) // n
        out += [[a + i * r, a + (i + 1) * r, c + i * r, d + i * r, CAUSAL if causal else FULL] for i in range(n)]
    return torch.tensor(out, dtype=torch.int32).reshape(-1, 5)
