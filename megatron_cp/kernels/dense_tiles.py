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

Band squares (forward only, ``split_band_squares``): a band of ``w = sk - sq >= min_window`` keys per
row and at least ``min_window`` rows is cut into ``n = sq // C`` chunks of ``C = min(w, sq)`` rows; chunk ``b``
(local rows ``[bC, bC + C)``) keeps an INV_CAUSAL square ``[bC, bC + C)`` of keys, a FULL rectangle
``[bC + C, bC + w)`` (none when ``C = w``) and a square causal tile ``[bC + w, bC + w + C)``, three
batched pieces. The INV_CAUSAL square (row i keeps j >= i) is a top-left causal square of the problem
with rows and keys reversed, so cuDNN runs all three (the backend flips the rows in and the output back).

Dense pieces are tuples ``(qs, qe, ks, ke, kind, n)`` with ``kind`` FULL (0), CAUSAL (1: square, top-left
= bottom-right) or INV_CAUSAL (2: square, band squares only).

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

    dense: list of (q_start, q_end, k_start, k_end, kind, n) with kind FULL or CAUSAL (a square tile with
    top-left (== bottom-right) causal mask) and n the batch of a band piece (see module doc; 1 for
    ordinary pieces); rest: int32 [m, 5] tiles left to the Triton kernel.
    """
    dense: list[tuple[int, int, int, int, int, int]] = []
    rest: list[list[int]] = []

    def big(sq, sk):
        return sq >= min_rows and sk >= min_keys

    for qs, qe, ks, ke, kind in tiles.to("cpu", torch.int64).tolist():
        sq, sk = qe - qs, ke - ks
        if kind == FULL:
            if big(sq, sk):
                dense.append((qs, qe, ks, ke, FULL, 1))
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
                    dense.append((qs, qe, ks, ks + d, FULL, 1))
                else:
                    rest.append([qs, qe, ks, ks + d, FULL])
            if sq_ok:
                dense.append((qs, qe, ks + d, ke, CAUSAL, 1))
            else:
                rest.append([qs, qe, ks + d, ke, CAUSAL])
        elif kind == BI_CAUSAL and band_chunk > 0 and sk - sq >= band_chunk + band_min_keys \
                and sq // band_chunk * band_chunk >= max(min_rows, 1):
            c, w = band_chunk, sk - sq
            n = sq // c
            e = qs + n * c  # rows of whole chunks end here
            dense.append((qs, e, ks + c, ks + w, FULL, n))
            dense.append((qs, e, ks + w, ks + w + c, CAUSAL, n))
            rest.extend([qs + b * c, qs + (b + 1) * c, ks + b * c, ks + (b + 1) * c, INV_CAUSAL] for b in range(n))
            if e < qe:
                rest.append([e, qe, ks + n * c, ke, BI_CAUSAL])
        else:
            rest.append([qs, qe, ks, ke, kind])
    rest_t = torch.tensor(rest, dtype=torch.int32).reshape(-1, 5)
    return dense, rest_t


def split_band_squares(tiles: torch.Tensor, min_window: int):
    """tiles int [n, 5] -> (pieces, rest): the band squares of every BI_CAUSAL tile with a window and rows
    of at least ``min_window`` (module doc; pieces as split_dense's, kinds FULL / CAUSAL / INV_CAUSAL),
    and the other tiles plus each band's rows below its last chunk (int32 [m, 5]). ``min_window`` 0: none."""
    pieces: list[tuple[int, int, int, int, int, int]] = []
    rest: list[list[int]] = []
    for qs, qe, ks, ke, kind in tiles.to("cpu", torch.int64).tolist():
        sq, w = qe - qs, ke - ks - (qe - qs)
        c = min(w, sq)
        if kind != BI_CAUSAL or min_window <= 0 or c < min_window:
            rest.append([qs, qe, ks, ke, kind])
            continue
        n = sq // c
        e = qs + n * c
        pieces.append((qs, e, ks, ks + c, INV_CAUSAL, n))
        if w > c:
            pieces.append((qs, e, ks + c, ks + w, FULL, n))
        pieces.append((qs, e, ks + w, ks + w + c, CAUSAL, n))
        if e < qe:
            rest.append([e, qe, ks + n * c, ke, BI_CAUSAL])
    return pieces, torch.tensor(rest, dtype=torch.int32).reshape(-1, 5)


def dense_tiles_tensor(dense) -> torch.Tensor:
    """The dense pieces as an ordinary tile list (FULL, CAUSAL or INV_CAUSAL tiles), a batched piece as its
    ``n`` tiles."""
    out = []
    for a, b, c, d, kind, n in dense:
        r = (b - a) // n
        out += [[a + i * r, a + (i + 1) * r, c + i * r, d + i * r, int(kind)] for i in range(n)]
    return torch.tensor(out, dtype=torch.int32).reshape(-1, 5)
