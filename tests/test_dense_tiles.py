"""The split of tile lists into kernel pieces (kernels/pieces.py) and the LSE merge of the pieces.

Pure tensor code on CPU: the cuDNN pieces and the rest must be cell-disjoint and cover exactly the cells
of the original tile list (checked with dense masks); merging per-piece (out, lse) must give the
attention of the union; row classes and block counts follow the kernels' block schedule.
"""

import random

import torch

import numpy as np
import pytest

from megatron_cp.kernels import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL
from megatron_cp.kernels.merge import merge_torch as _merge_lse
from megatron_cp.kernels.pieces import (BLOCKY_FULL_FRACTION, LONG_ROW_KEYS, as_tiles, block_counts, covered_rows,
                                        kept_area, row_class, split_pieces)
from megatron_cp.kernels.triton.blocks import build_schedules

NEVER = 1 << 62  # a piece size no list reaches


def split_dense(tiles, min_rows, min_keys):
    """The backward's split (no band squares) as (pieces, rest)."""
    p = split_pieces(tiles, min_rows=min_rows, min_keys=min_keys, band_squares=4, forward=False)
    assert not p.direct and not p.whole
    return list(p.cudnn), p.rest


def split_band_squares(tiles, min_window):
    """The forward's band squares alone (no other piece is large enough) as (pieces, rest)."""
    p = split_pieces(tiles, min_rows=NEVER, min_keys=NEVER, band_squares=min_window, forward=True)
    return list(p.cudnn), p.rest


def cell_counts(tiles, sq, sk):
    """int [sq, sk]: how many tiles keep each cell (bottom-right CAUSAL etc., kernels/__init__.py)."""
    cnt = torch.zeros(sq, sk, dtype=torch.int32)
    for qs, qe, ks, ke, kind in tiles.tolist():
        a, b = qe - qs, ke - ks
        i = torch.arange(a)[:, None]
        j = torch.arange(b)[None, :]
        if kind == FULL:
            m = torch.ones(a, b, dtype=torch.bool)
        elif kind == CAUSAL:
            m = j <= i + (b - a)
        elif kind == INV_CAUSAL:
            m = j >= i
        else:
            m = (j >= i) & (j <= i + (b - a))
        cnt[qs:qe, ks:ke] += m.int()
    return cnt


def check_split(tiles, sq, sk, min_rows, min_keys):
    dense, rest = split_dense(tiles, min_rows, min_keys)
    dt = as_tiles(dense)
    for qs, qe, ks, ke, causal, n in dense:
        assert n == 1 and 0 <= qs < qe <= sq and 0 <= ks < ke <= sk
        assert qe - qs >= min_rows and ke - ks >= min_keys
        if causal:
            assert qe - qs == ke - ks  # square: top-left == bottom-right
    for qs, qe, ks, ke, _ in rest.tolist():
        assert 0 <= qs < qe <= sq and 0 <= ks < ke <= sk
    orig = cell_counts(tiles, sq, sk)
    assert int(orig.max()) <= 1
    new = cell_counts(torch.cat([dt, rest]), sq, sk)
    assert torch.equal(new, orig), "decomposition must keep exactly the original cells, each once"
    return dense, rest


def test_zigzag_causal_rectangles():
    # zigzag rank: two chunks of 16 rows, keys [0, b) bottom-right causal
    s = 128
    tiles = torch.tensor([[0, 16, 0, 32, CAUSAL], [16, 32, 0, 128, CAUSAL]], dtype=torch.int32)
    dense, rest = check_split(tiles, 32, s, 8, 8)
    assert rest.shape[0] == 0
    assert sorted(dense) == sorted([(0, 16, 0, 16, False, 1), (0, 16, 16, 32, True, 1),
                                    (16, 32, 0, 112, False, 1), (16, 32, 112, 128, True, 1)])


def test_small_pieces_stay_triton():
    tiles = torch.tensor([[0, 16, 0, 20, CAUSAL],  # full part 4 keys: too small, stays FULL in the rest
                          [16, 20, 20, 80, CAUSAL],  # 4 rows: all rest
                          [20, 40, 80, 90, CAUSAL],  # sk < sq: first 10 rows empty, square 10x10 too small
                          [40, 60, 90, 130, FULL],
                          [60, 70, 0, 30, INV_CAUSAL]], dtype=torch.int32)
    dense, rest = check_split(tiles, 70, 130, 8, 8)
    assert (0, 16, 4, 20, True, 1) in dense and (40, 60, 90, 130, False, 1) in dense
    assert [0, 16, 0, 4, FULL] in rest.tolist()


def test_sk_less_than_sq():
    tiles = torch.tensor([[0, 40, 0, 24, CAUSAL]], dtype=torch.int32)
    dense, rest = check_split(tiles, 40, 24, 8, 8)
    assert dense == [(16, 40, 0, 24, True, 1)] and rest.shape[0] == 0


def test_backward_never_cuts_band_squares():
    """forward=False: bands stay whole in the rest whatever band_squares says; forward=True cuts them."""
    tiles = torch.tensor([[0, 70, 3, 3 + 70 + 16, BI_CAUSAL]], dtype=torch.int32)
    bwd = split_pieces(tiles, min_rows=1, min_keys=1, band_squares=16, forward=False)
    assert bwd.cudnn == () and bwd.rest.tolist() == tiles.tolist() and not bwd.direct
    fwd = split_pieces(tiles, min_rows=1, min_keys=1, band_squares=16, forward=True)
    assert len(fwd.cudnn) == 2 and fwd.direct


def test_whole_call_piece():
    """With the lengths given, one FULL tile or one square CAUSAL tile over everything is the whole call's
    piece whatever its size; anything else (a bottom-right causal non-square, a partial cover) is not."""
    for kind, sq, sk in ((FULL, 8, 12), (CAUSAL, 10, 10)):
        t = torch.tensor([[0, sq, 0, sk, kind]], dtype=torch.int32)
        for forward in (False, True):
            p = split_pieces(t, min_rows=512, min_keys=8192, band_squares=4096, forward=forward, seqlen_q=sq,
                             seqlen_k=sk)
            assert p.whole and p.cudnn == ((0, sq, 0, sk, kind, 1),) and p.rest.shape[0] == 0
        assert not split_pieces(t, min_rows=512, min_keys=8192, band_squares=0, forward=False).whole
    for t, sq, sk in (([[0, 8, 0, 12, CAUSAL]], 8, 12), ([[0, 8, 0, 12, FULL]], 9, 12)):
        p = split_pieces(torch.tensor(t, dtype=torch.int32), min_rows=512, min_keys=8192, band_squares=0,
                         forward=False, seqlen_q=sq, seqlen_k=sk)
        assert not p.whole and p.cudnn == () and p.rest.tolist() == t


def check_band_squares(tiles, sq, sk, min_window):
    pieces, rest = split_band_squares(tiles, min_window)
    if min_window > 0:  # direct: pairs only (no rectangle), each on rows nothing else covers
        p = split_pieces(tiles, min_rows=NEVER, min_keys=NEVER, band_squares=min_window, forward=True)
        pairs = bool(pieces) and all(x[4] != FULL for x in pieces)
        rows = [x[:2] for x in pieces[0::2]]
        alone = not any(a < r1 and r0 < b for a, b, *_ in rest.tolist() for r0, r1 in rows)
        assert p.direct == (pairs and alone)
    for qs, qe, ks, ke, kind, n in pieces:
        r = (qe - qs) // n
        assert (qe - qs) % n == 0 and r >= min_window and 0 <= qs < qe <= sq and 0 <= ks < ke + (n - 1) * r <= sk
        if kind != FULL:
            assert ke - ks == r  # squares: top-left causal, reversed or not
    orig = cell_counts(tiles, sq, sk)
    new = cell_counts(torch.cat([as_tiles(pieces), rest]), sq, sk)
    assert torch.equal(new, orig), "band squares must keep exactly the original cells, each once"
    return pieces, rest


def test_band_squares():
    """Forward band squares: a window of 16 over 70 rows -> 4 chunks of 16 rows, each a reversed
    (INV_CAUSAL) and a causal 16-square, and the 6 rows below; a window wider than the rows -> one chunk
    of all rows with a full rectangle between its squares; below the threshold or not a band: unchanged."""
    tiles = torch.tensor([[0, 70, 3, 3 + 70 + 16, BI_CAUSAL]], dtype=torch.int32)
    pieces, rest = check_band_squares(tiles, 70, 89, 16)
    assert pieces == [(0, 64, 3, 19, INV_CAUSAL, 4), (0, 64, 19, 35, CAUSAL, 4)]
    assert rest.tolist() == [[64, 70, 67, 89, BI_CAUSAL]]
    wide = torch.tensor([[5, 25, 0, 60, BI_CAUSAL]], dtype=torch.int32)  # 20 rows, w = 40
    pieces, rest = check_band_squares(wide, 25, 60, 16)
    assert pieces == [(5, 25, 0, 20, INV_CAUSAL, 1), (5, 25, 20, 40, FULL, 1), (5, 25, 40, 60, CAUSAL, 1)]
    assert rest.shape[0] == 0
    # off (0); window 16 < 17; rows 20 < 21: the tile stays whole
    for t, sq, sk, mw in ((tiles, 70, 89, 0), (tiles, 70, 89, 17), (wide, 25, 60, 21)):
        pieces, rest = check_band_squares(t, sq, sk, mw)
        assert pieces == [] and rest.tolist() == t.tolist()
    mixed = torch.tensor([[0, 8, 0, 8, CAUSAL], [8, 40, 0, 8, FULL], [8, 40, 8, 48, BI_CAUSAL]], dtype=torch.int32)
    pieces, rest = check_band_squares(mixed, 40, 48, 8)
    assert [p[4:] for p in pieces] == [(INV_CAUSAL, 4), (CAUSAL, 4)] and rest.tolist() == mixed[:2].tolist()


def test_band_squares_random():
    rng = random.Random(1)
    for _ in range(200):
        sq, w = rng.randint(1, 40), rng.randint(0, 40)
        q0, k0 = rng.randint(0, 5), rng.randint(0, 5)
        tiles = torch.tensor([[q0, q0 + sq, k0, k0 + sq + w, BI_CAUSAL]], dtype=torch.int32)
        check_band_squares(tiles, q0 + sq, k0 + sq + w, rng.choice([1, 4, 8]))


def test_random_lists():
    rng = random.Random(0)
    for _ in range(200):
        sq, sk = rng.randint(1, 48), rng.randint(1, 48)
        # disjoint tiles: cut q into row bands and k into column bands, one tile per (band, band) pick
        qcuts = sorted(set([0, sq] + [rng.randint(0, sq) for _ in range(3)]))
        kcuts = sorted(set([0, sk] + [rng.randint(0, sk) for _ in range(3)]))
        tiles = []
        for a, b in zip(qcuts, qcuts[1:]):
            for c, d in zip(kcuts, kcuts[1:]):
                if rng.random() < 0.7:
                    tiles.append([a, b, c, d, rng.choice([FULL, CAUSAL, CAUSAL, INV_CAUSAL, BI_CAUSAL])])
        if not tiles:
            continue
        t = torch.tensor(tiles, dtype=torch.int32)
        for mr, mk in ((1, 1), (4, 4), (8, 3), (1000, 1000)):
            check_split(t, sq, sk, mr, mk)


def _attn(q, k, v, keep, scale):
    s = (q @ k.T) * scale
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v, lse


def test_merge_matches_union():
    torch.manual_seed(0)
    sq, sk, d = 40, 64, 8
    tiles = torch.tensor([[0, 24, 0, 40, CAUSAL], [24, 40, 0, 64, CAUSAL]], dtype=torch.int32)
    q, k, v = (torch.randn(n, d, dtype=torch.float64) for n in (sq, sk, sk))
    scale = d ** -0.5
    full_keep = cell_counts(tiles, sq, sk).bool()
    full_keep[35:, :] = False  # rows with nothing kept: out 0, lse -inf
    o_ref, l_ref = _attn(q, k, v, full_keep, scale)
    dense, rest = split_dense(tiles, 4, 4)
    pieces = as_tiles(dense).tolist() + rest.tolist()
    acc = torch.full((sq, 1, d), float("nan"), dtype=torch.float32)  # ignored where lse is -inf
    lse = torch.full((sq, 1), float("-inf"), dtype=torch.float32)
    for p in pieces:
        keep = cell_counts(torch.tensor([p], dtype=torch.int32), sq, sk).bool() & full_keep
        o, l = _attn(q, k, v, keep, scale)
        _merge_lse(acc, lse, o[:, None].float(), l[:, None].float())
    assert torch.allclose(acc[:, 0].double(), o_ref, atol=1e-5)
    fin = torch.isfinite(l_ref)
    assert torch.allclose(lse[fin, 0].double(), l_ref[fin], atol=1e-5)
    assert bool((lse[~fin] == float("-inf")).all()) and bool((acc[~fin] == 0).all())


@pytest.mark.parametrize("bm,bn", [(128, 64), (64, 64), (32, 16), (16, 32)])
def test_block_counts_match_the_schedule(bm, bn):
    """block_counts per tile sum to the row-major schedule's entries and full entries."""
    rng = random.Random(bm + bn)
    tiles = []
    for _ in range(60):
        sq, sk = rng.randint(1, 300), rng.randint(1, 300)
        q0, k0 = rng.randint(0, 50), rng.randint(0, 50)
        tiles.append([q0, q0 + sq, k0, k0 + sk, rng.randint(0, 3)])
    t = torch.tensor(tiles, dtype=torch.int32)
    visited, full = block_counts(t, bm, bn)
    assert visited.dtype == full.dtype == np.int64 and visited.shape == full.shape == (len(tiles),)
    rows, _ = build_schedules(t, 400, 400, bm, bn)
    assert int(visited.sum()) == int(rows.ptr[0, -1]) and int(full.sum()) == rows.n_full
    assert bool((full <= visited).all()) and int(visited.sum()) > int(full.sum()) > 0


def test_row_class_rule():
    """"long": mean kept keys per covered row >= LONG_ROW_KEYS; else "blocky" when >= BLOCKY_FULL_FRACTION of
    the visited 128 x 64 blocks are full; else "short"."""
    long_t = torch.tensor([[0, 128, 0, LONG_ROW_KEYS, FULL]], dtype=torch.int32)
    assert kept_area(long_t) == LONG_ROW_KEYS * covered_rows(long_t) and row_class(long_t) == "long"
    assert row_class(torch.tensor([[0, 128, 0, LONG_ROW_KEYS - 64, FULL]], dtype=torch.int32)) == "blocky"
    docs = torch.tensor([[a, a + 512, a, a + 512, CAUSAL] for a in range(0, 4096, 512)], dtype=torch.int32)
    visited, full = block_counts(docs, 128, 64)
    assert (int(full.sum()) >= BLOCKY_FULL_FRACTION * int(visited.sum())) == (row_class(docs) == "blocky")
    band = torch.tensor([[0, 1024, 0, 1024 + 100, BI_CAUSAL]], dtype=torch.int32)
    assert row_class(band) == "short"
    assert row_class(torch.zeros(0, 5, dtype=torch.int32)) == "short"
