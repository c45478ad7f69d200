"""Dense-tile decomposition (kernels/dense_tiles.py) and the LSE merge of the generalised dense fast path.

Pure tensor code on CPU: the dense pieces and the rest must be cell-disjoint and cover exactly the cells
of the original tile list (checked with dense masks); merging per-piece (out, lse) must give the
attention of the union.
"""

import random

import torch

from megatron_cp.kernels import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL
from megatron_cp.kernels.dense_tiles import dense_tiles_tensor, split_band_squares, split_dense
from megatron_cp.kernels.merge import merge_torch as _merge_lse


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


def check_split(tiles, sq, sk, min_rows, min_keys, band_chunk=0, band_min_keys=1):
    dense, rest = split_dense(tiles, min_rows, min_keys, band_chunk, band_min_keys)
    dt = dense_tiles_tensor(dense)
    for qs, qe, ks, ke, causal, n in dense:
        r = (qe - qs) // n
        assert (qe - qs) % n == 0 and 0 <= qs < qe <= sq and 0 <= ks < ke + (n - 1) * r <= sk
        assert qe - qs >= min_rows
        if n > 1 or ke - ks < min_keys:  # band pieces: chunks of band_chunk rows sliding down the diagonal
            assert r == band_chunk and (causal or ke - ks >= band_min_keys)
        if causal:
            assert r == ke - ks  # square: top-left == bottom-right
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


def test_band_pieces():
    """A sliding window (BI_CAUSAL, w = 40: row i keeps [i, i + 40]) of 70 rows in chunks of 8: 8 chunks
    of a full 8 x 32 rectangle and a causal 8-square on cuDNN (two batched pieces), the chunks'
    INV_CAUSAL squares and the 6 rows below the last chunk on Triton."""
    tiles = torch.tensor([[0, 70, 3, 113, BI_CAUSAL]], dtype=torch.int32)
    dense, rest = check_split(tiles, 70, 120, 16, 16, 8, 16)
    assert dense == [(0, 64, 11, 43, False, 8), (0, 64, 43, 51, True, 8)]
    assert rest.tolist() == [[b, b + 8, 3 + b, 11 + b, INV_CAUSAL] for b in range(0, 64, 8)] + [[64, 70, 67, 113, BI_CAUSAL]]
    # too narrow for the chunk (w < band_chunk + band_min_keys), or too few rows: stays whole
    for chunk, min_keys, min_rows in ((8, 33, 16), (32, 16, 16), (8, 16, 71)):
        dense, rest = check_split(tiles, 70, 120, min_rows, 16, chunk, min_keys)
        assert dense == [] and rest.tolist() == tiles.tolist()


def check_band_squares(tiles, sq, sk, min_window):
    pieces, rest = split_band_squares(tiles, min_window)
    for qs, qe, ks, ke, kind, n in pieces:
        r = (qe - qs) // n
        assert (qe - qs) % n == 0 and r >= min_window and 0 <= qs < qe <= sq and 0 <= ks < ke + (n - 1) * r <= sk
        if kind != FULL:
            assert ke - ks == r  # squares: top-left causal, reversed or not
    orig = cell_counts(tiles, sq, sk)
    new = cell_counts(torch.cat([dense_tiles_tensor(pieces), rest]), sq, sk)
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
        for mr, mk, bc, bk in ((1, 1, 0, 1), (4, 4, 0, 1), (8, 3, 0, 1), (1000, 1000, 0, 1), (1, 1, 2, 1),
                               (4, 4, 3, 2), (8, 3, 4, 1)):
            check_split(t, sq, sk, mr, mk, bc, bk)


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
    pieces = dense_tiles_tensor(dense).tolist() + rest.tolist()
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
