"""How a tile list splits into kernel pieces: the one owner of these rules (``TritonBackend.prepare``
calls exactly these functions; a cost model that needs the split calls them too, never restates them).

cuDNN pieces
------------
cuDNN attention (PyTorch's SDPA cuDNN op) handles two shapes well: a full rectangle and a causal tile
whose causal mask is top-left aligned, which equals our bottom-right aligned CAUSAL exactly when the
tile is square. A bottom-right CAUSAL tile with ``sq`` rows and ``sk`` keys splits exactly into:

* ``sk >= sq``: a FULL rectangle ``rows x [ks, ks + sk - sq)`` (every row keeps these keys, since
  ``j <= i + (sk - sq)`` holds for ``j < sk - sq``) and a square causal tile ``rows x [ks + sk - sq, ke)``
  (``j' = j - (sk - sq) <= i``);
* ``sk < sq``: rows ``i < sq - sk`` keep nothing; the last ``sk`` rows are a square causal tile.

Pieces of at least ``min_rows`` rows and ``min_keys`` keys go to cuDNN; smaller pieces (and every other
tile kind) stay in the rest, for the Triton kernels, as valid tiles of the same cells. Long pieces (zigzag
rank lists: 16k rows, >= 16k keys) run faster this way, while short ones (packed documents with 512-key
pieces) run slower (per-piece launches and float32 merges dominate short rows), hence
TritonConfig.dense_min_keys 8192 (docs/measurements.md).

Whole call: a list of one FULL tile, or one square CAUSAL tile, covering all ``seqlen_q`` rows and
``seqlen_k`` keys is one cuDNN piece whatever its size (cuDNN's output is the call's: no merge).

Band squares (forward only): a BI_CAUSAL tile (a band, ``w = sk - sq`` keys past the diagonal per row)
with ``C = min(w, sq) >= band_squares`` is cut into ``n = sq // C`` chunks of ``C`` rows; chunk ``b``
(local rows ``[bC, bC + C)``) keeps an INV_CAUSAL square ``[bC, bC + C)`` of keys, a FULL rectangle
``[bC + C, bC + w)`` (none when ``C = w``) and a causal square ``[bC + w, bC + w + C)``: three *batched*
pieces. The INV_CAUSAL square (row i keeps j >= i) is a top-left causal square of the problem with rows
and keys reversed, so cuDNN runs all three (the backend flips the rows in and the output back). The rows
below the last whole chunk stay one BI_CAUSAL tile in the rest. The backward keeps bands on Triton: the
flips and the gradients' extra passes would cost what cuDNN gains.

Pieces are tuples ``(q_start, q_end, k_start, k_end, kind, batch)`` with ``kind`` a ``Kind``: FULL,
CAUSAL (a square: top-left = bottom-right) or INV_CAUSAL (a square, band squares only). ``batch = n > 1``
stands for the ``n`` pieces ``b = 0 .. n-1`` of rows ``[q_start + b r, q_start + (b+1) r)`` (``r =
(q_end - q_start) / n``) and keys ``[k_start + b r, k_end + b r)``: one cuDNN call with batch ``n``.

The pieces of one tile are cell-disjoint and cover exactly its kept cells, so the split of a cell-disjoint
list is too (tests/test_dense_tiles.py checks this with dense masks). Pure host-side code: the counters
(areas, covered rows, block counts) are numpy, so a planning thread prices a new plan with few calls that
release the interpreter lock.

Row classes
-----------
``row_class`` sorts the list the Triton kernels run into the classes that pick their block shapes
(``TritonConfig.for_head_dim``): "long" when the mean kept keys per covered row is at least
``LONG_ROW_KEYS`` (dense, causal-like), else "blocky" when at least ``BLOCKY_FULL_FRACTION`` of the
visited ``BLOCKY_BLOCK`` (128 x 64) blocks are fully kept, else "short" (windows, short documents),
where smaller blocks waste less on partial blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..kinds import Kind

LONG_ROW_KEYS = 4096
# "blocky": short rows whose 128 x 64 forward blocks are mostly full (strided blocks, documents, global +
# local), where a 128-row forward block with 4 warps pays: it wins where at least 0.8 of the blocks are
# full and loses below (sliding window, streaming); docs/measurements.md.
BLOCKY_FULL_FRACTION = 0.8
BLOCKY_BLOCK = (128, 64)

Piece = tuple  # (q_start, q_end, k_start, k_end, kind: Kind, batch: int)


@dataclass(frozen=True, eq=False)
class Pieces:
    """A tile list split for one direction: ``cudnn`` pieces (tuples, module doc), ``rest`` the tiles
    left to the Triton kernels (int32 [m, 5], cells disjoint from the pieces'), ``direct`` (forward only)
    the pieces are band-square pairs on rows nothing else covers, so each pair's merge can write the
    output directly, ``whole`` the one piece is the whole call (cuDNN's output is the result)."""

    cudnn: tuple
    rest: torch.Tensor
    direct: bool = False
    whole: bool = False


def split_pieces(tiles: torch.Tensor, *, min_rows: int, min_keys: int, band_squares: int, forward: bool,
                 seqlen_q: int | None = None, seqlen_k: int | None = None) -> Pieces:
    """tiles int [n, 5] -> Pieces: cuDNN pieces of at least ``min_rows`` x ``min_keys``, and for the
    forward band squares of windows and rows of at least ``band_squares`` (0: none; never when
    ``forward`` is False). With ``seqlen_q``/``seqlen_k``, a list that is one FULL or square CAUSAL tile
    over everything is the whole call's single piece whatever its size."""
    tiles = tiles.to("cpu", torch.int64).reshape(-1, 5)
    if seqlen_q is not None and seqlen_k is not None:
        kind = whole_kind(tiles, seqlen_q, seqlen_k)
        if kind is not None:
            return Pieces(((0, int(seqlen_q), 0, int(seqlen_k), kind, 1),), torch.zeros(0, 5, dtype=torch.int32),
                          whole=True)
    dense, rest = _split_dense(tiles, min_rows, min_keys)
    if not forward or band_squares <= 0:
        return Pieces(tuple(dense), rest)
    bands, rest_f = _split_band_squares(rest, band_squares)
    return Pieces(tuple(dense + bands), rest_f, direct=_direct_pairs(dense, bands, rest_f))


def whole_kind(tiles: torch.Tensor, seqlen_q: int, seqlen_k: int) -> Kind | None:
    """Kind.FULL or Kind.CAUSAL when ``tiles`` is one full rectangle or one square causal tile covering all
    ``seqlen_q`` rows and ``seqlen_k`` keys (cuDNN's causal is top-left aligned), else None."""
    if tiles.shape[0] != 1:
        return None
    qs, qe, ks, ke, kind = (int(x) for x in tiles[0].tolist())
    if (qs, qe, ks, ke) != (0, seqlen_q, 0, seqlen_k):
        return None
    if kind == Kind.FULL:
        return Kind.FULL
    if kind == Kind.CAUSAL and seqlen_q == seqlen_k:
        return Kind.CAUSAL
    return None


def as_tiles(pieces) -> torch.Tensor:
    """cuDNN pieces as an ordinary tile list (int32 [m, 5]; FULL, CAUSAL or INV_CAUSAL tiles), a batched
    piece as its ``batch`` tiles."""
    out = []
    for a, b, c, d, kind, n in pieces:
        r = (b - a) // n
        out += [[a + i * r, a + (i + 1) * r, c + i * r, d + i * r, int(kind)] for i in range(n)]
    return torch.tensor(out, dtype=torch.int32).reshape(-1, 5)


def _host(tiles) -> np.ndarray:
    """int64 [n, 5] numpy of a tile list given as a tensor (any device) or an array."""
    if isinstance(tiles, torch.Tensor):
        tiles = tiles.to("cpu", torch.int64).numpy()
    return np.asarray(tiles, dtype=np.int64).reshape(-1, 5)


def _kept_cells(t: np.ndarray) -> np.ndarray:
    """int64 [n]: the kept cells of each tile of ``t`` (int64 [n, 5]), closed forms of the four kinds."""
    sq, sk, kind = t[:, 1] - t[:, 0], t[:, 3] - t[:, 2], t[:, 4]
    d = sk - sq
    # causal: row i keeps max(0, i + d + 1) keys (never more than sk for i < sq)
    a = np.maximum(0, -d)
    n = np.maximum(0, sq - a)
    causal = n * (d + 1) + (n * (a + sq - 1)) // 2
    # inv_causal: row i keeps max(0, sk - i)
    m = np.minimum(sq, sk)
    inv = m * sk - (m * (m - 1)) // 2
    return np.select([kind == Kind.FULL, kind == Kind.CAUSAL, kind == Kind.INV_CAUSAL], [sq * sk, causal, inv],
                     sq * np.maximum(0, d + 1))


def tile_areas(tiles) -> tuple[np.ndarray, np.ndarray]:
    """(kept cells, rows) of every tile of ``tiles`` (int [n, 5]), float64 [n] each, exact."""
    t = _host(tiles)
    return _kept_cells(t).astype(np.float64), (t[:, 1] - t[:, 0]).astype(np.float64)


def kept_area(tiles) -> int:
    """Number of kept cells of a (cell-disjoint) tile list, exact; for FLOP counts."""
    return int(_kept_cells(_host(tiles)).sum())


def covered_rows(tiles) -> int:
    """Number of query rows at least one tile of ``tiles`` (int [n, 5]) covers."""
    r = _host(tiles)[:, :2]
    if len(r) == 0:
        return 0
    r = r[np.argsort(r[:, 0], kind="stable")]
    ends = np.maximum.accumulate(r[:, 1])
    # a run of overlapping ranges starts where a range begins past every earlier end
    new = np.ones(len(r), dtype=bool)
    new[1:] = r[1:, 0] >= ends[:-1]
    run_end = np.maximum.reduceat(ends, np.flatnonzero(new))
    return int((run_end - r[new, 0]).sum())


def row_class(tiles) -> str:
    """"long", "blocky" or "short" for the tile list ``tiles`` (int [n, 5]) the Triton kernels run (module
    doc); the kept keys per row count over the rows the list covers (a list may cover a few rows of many)."""
    t = _host(tiles)
    if kept_area(t) >= LONG_ROW_KEYS * max(covered_rows(t), 1):
        return "long"
    if len(t):
        visited, full = block_counts(t, *BLOCKY_BLOCK)
        v, f = int(visited.sum()), int(full.sum())
        if v and f >= BLOCKY_FULL_FRACTION * v:
            return "blocky"
    return "short"


def block_rows(tiles, block_m: int, block_n: int):
    """Per (tile, q block) pair of ``tiles`` (int [n, 5]), int64 numpy each: (tile id, q block index, k blocks
    the kernels' block schedule visits in that row for that tile, those of them fully kept). Closed forms
    per row of blocks (the kept keys of a block's rows form one run), never one entry per block: equal to
    counting ``triton_blocks``' schedule entries (tests/test_cost_model.py checks it)."""
    t = _host(tiles)
    qs, qe, ks, ke, kind = t.T
    big = 1 << 40
    # a tile keeps lo <= k - q <= hi
    hi = np.where((kind == Kind.CAUSAL) | (kind == Kind.BI_CAUSAL), ke - qe, big)
    lo = np.where((kind == Kind.INV_CAUSAL) | (kind == Kind.BI_CAUSAL), ks - qs, -big)
    m0, m1 = qs // block_m, (qe - 1) // block_m + 1
    cnt = np.maximum(m1 - m0, 0)
    tid = np.repeat(np.arange(len(t)), cnt)
    first = np.repeat(np.cumsum(cnt) - cnt, cnt)
    m = np.repeat(m0, cnt) + np.arange(int(cnt.sum())) - first
    bq0, bq1 = m * block_m, (m + 1) * block_m - 1
    qs_t, qe_t, ks_t, ke_t, lo_t, hi_t = qs[tid], qe[tid], ks[tid], ke[tid], lo[tid], hi[tid]
    r0, r1 = np.maximum(qs_t, bq0), np.minimum(qe_t - 1, bq1)
    c0, c1 = np.maximum(ks_t, r0 + lo_t), np.minimum(ke_t - 1, r1 + hi_t)
    visited = np.where(c1 >= c0, c1 // block_n - c0 // block_n + 1, 0)
    # a full block: all its rows in the tile and every key of it kept by every row
    a = np.maximum(ks_t, lo_t + bq1)
    b = np.minimum(ke_t - 1, hi_t + bq0)
    inside = (qs_t <= bq0) & (qe_t - 1 >= bq1)
    full = np.where(inside, np.maximum((b + 1) // block_n - 1 - (-(-a // block_n)) + 1, 0), 0)
    return tid, m, visited, full


def block_counts(tiles, block_m: int, block_n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per tile of ``tiles`` (int [n, 5]): (visited, full), int64 numpy [n]: the (block_m x block_n) blocks
    the kernels' block schedule visits for it (those holding a kept cell of the tile) and those of them
    whose every cell the tile keeps (no mask arithmetic)."""
    t = _host(tiles)
    tid, _, visited, full = block_rows(t, block_m, block_n)
    return np.bincount(tid, visited, minlength=len(t)).astype(np.int64), np.bincount(
        tid, full, minlength=len(t)).astype(np.int64)


# -- the rules --------------------------------------------------------------------------------------------
def _split_dense(tiles: torch.Tensor, min_rows: int, min_keys: int):
    """tiles int64 [n, 5] -> (pieces: list of FULL / square CAUSAL pieces of batch 1, rest int32 [m, 5])."""
    dense: list[Piece] = []
    rest: list[list[int]] = []

    def big(sq, sk):
        return sq >= min_rows and sk >= min_keys

    for qs, qe, ks, ke, kind in tiles.tolist():
        sq, sk = qe - qs, ke - ks
        if kind == Kind.FULL:
            if big(sq, sk):
                dense.append((qs, qe, ks, ke, Kind.FULL, 1))
            else:
                rest.append([qs, qe, ks, ke, kind])
        elif kind == Kind.CAUSAL:
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
                    dense.append((qs, qe, ks, ks + d, Kind.FULL, 1))
                else:
                    rest.append([qs, qe, ks, ks + d, Kind.FULL])
            if sq_ok:
                dense.append((qs, qe, ks + d, ke, Kind.CAUSAL, 1))
            else:
                rest.append([qs, qe, ks + d, ke, Kind.CAUSAL])
        else:
            rest.append([qs, qe, ks, ke, kind])
    return dense, torch.tensor(rest, dtype=torch.int32).reshape(-1, 5)


def _split_band_squares(tiles: torch.Tensor, min_window: int):
    """tiles int [n, 5] -> (pieces, rest): the band squares of every BI_CAUSAL tile with a window and rows
    of at least ``min_window`` (module doc), and the other tiles plus each band's rows below its last
    chunk (int32 [m, 5]). ``min_window`` 0: none."""
    pieces: list[Piece] = []
    rest: list[list[int]] = []
    for qs, qe, ks, ke, kind in tiles.to("cpu", torch.int64).tolist():
        sq, w = qe - qs, ke - ks - (qe - qs)
        c = min(w, sq)
        if kind != Kind.BI_CAUSAL or min_window <= 0 or c < min_window:
            rest.append([qs, qe, ks, ke, kind])
            continue
        n = sq // c
        e = qs + n * c
        pieces.append((qs, e, ks, ks + c, Kind.INV_CAUSAL, n))
        if w > c:
            pieces.append((qs, e, ks + c, ks + w, Kind.FULL, n))
        pieces.append((qs, e, ks + w, ks + w + c, Kind.CAUSAL, n))
        if e < qe:
            rest.append([e, qe, ks + n * c, ke, Kind.BI_CAUSAL])
    return pieces, torch.tensor(rest, dtype=torch.int32).reshape(-1, 5)


def _direct_pairs(dense, bands, rest: torch.Tensor) -> bool:
    """Whether the forward's pieces are only band-square pairs (reversed + causal square, no rectangle) on
    rows no other piece nor ``rest`` tile touches: each pair's merge then writes the output directly."""
    if dense or not bands or len(bands) % 2 or any(p[4] != Kind.INV_CAUSAL for p in bands[0::2]) \
            or any(p[4] != Kind.CAUSAL or p[:2] != i[:2] for i, p in zip(bands[0::2], bands[1::2])):
        return False
    rows = sorted(p[:2] for p in bands[0::2])
    if any(b[0] < a[1] for a, b in zip(rows, rows[1:])):
        return False
    return not any(qs < b and a < qe for qs, qe, *_ in rest.tolist() for a, b in rows)


def uncovered_rows(pieces, seqlen_q: int) -> list[tuple[int, int]]:
    """(start, end) row ranges of ``[0, seqlen_q)`` that no piece of ``pieces`` covers, in order."""
    gaps, at = [], 0
    for a, b in sorted(p[:2] for p in pieces):
        if a > at:
            gaps.append((at, a))
        at = max(at, b)
    if at < seqlen_q:
        gaps.append((at, seqlen_q))
    return gaps
