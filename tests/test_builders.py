"""Mask builders against independent dense formulas of their rules.

Each reference below is written from the rule in the builder's docstring with numpy broadcasting
over (row i, key j), never from the builder's slices. Every check also compares ``area()`` with the
dense count, checks that the builder's slices do not overlap (the sum of per-slice areas equals the
union's area), and bounds the number of slices.
"""

import time

import numpy as np
import pytest
import torch

from megatron_cp import masks as B
from megatron_cp.masks.slices import AttnMask


def _ij(sq, sk=None):
    sk = sq if sk is None else sk
    return np.arange(sq)[:, None], np.arange(sk)[None, :]


def _check(mask, ref, max_slices=None):
    ref = np.broadcast_to(ref, ref.shape)
    assert isinstance(mask, AttnMask)
    assert (mask.seqlen_q, mask.seqlen_k) == ref.shape
    dense = mask.to_dense()
    if not np.array_equal(dense, ref):
        bad = np.argwhere(dense != ref)
        raise AssertionError(f"{len(bad)} cells differ, first (row, key) {bad[:5].tolist()}; slices {mask.slices}")
    assert mask.area() == int(ref.sum())
    # builders emit disjoint slices: no cell is computed twice downstream
    assert sum(AttnMask([s], mask.seqlen_q, mask.seqlen_k).area() for s in mask.slices) == mask.area()
    if max_slices is not None:
        assert len(mask.slices) <= max_slices, mask.slices


# ---------------------------------------------------------------------------------------------- dense


@pytest.mark.parametrize("sq,sk", [(1, 1), (5, None), (3, 7), (7, 3), (16, 16)])
def test_full(sq, sk):
    i, j = _ij(sq, sk)
    _check(B.full(sq, sk), (i >= 0) & (j >= 0), max_slices=1)


@pytest.mark.parametrize("sq,sk", [(1, 1), (5, None), (3, 7), (7, 3), (16, 16), (1, 9), (9, 1)])
def test_causal(sq, sk):
    skk = sq if sk is None else sk
    i, j = _ij(sq, skk)
    _check(B.causal(sq, sk), j - i <= skk - sq, max_slices=1)


@pytest.mark.parametrize(
    "n,left,right",
    [(1, 0, 0), (8, 0, 0), (8, 2, 1), (10, 3, 0), (10, 0, 3), (7, 20, 0), (7, 0, 20), (7, 20, 20),
     (12, 5, 5), (12, 11, 0), (12, 6, 2), (5, 4, 4)],
)
def test_sliding_window(n, left, right):
    i, j = _ij(n)
    _check(B.sliding_window(n, left, right), (j >= i - left) & (j <= i + right), max_slices=3)


@pytest.mark.parametrize("n,prefix", [(1, 0), (1, 1), (8, 0), (8, 3), (8, 8), (9, 1), (9, 8)])
def test_prefix_lm(n, prefix):
    i, j = _ij(n)
    ref = np.where(i < prefix, j < prefix, j <= i)
    _check(B.prefix_lm(n, prefix), ref, max_slices=2)


@pytest.mark.parametrize(
    "n,sink,window", [(1, 0, 1), (8, 1, 3), (8, 0, 2), (10, 4, 1), (10, 20, 3), (10, 2, 30), (13, 3, 5), (6, 6, 6)]
)
def test_streaming(n, sink, window):
    i, j = _ij(n)
    ref = (j <= i) & ((j < sink) | (j > i - window))
    _check(B.streaming(n, sink, window), ref, max_slices=5)


# ---------------------------------------------------------------------------------------------- varlen


def _doc_ids(cu, n):
    return np.searchsorted(np.asarray(cu), np.arange(n), side="right") - 1


def _varlen_ref(cu, causal, left, right):
    n = int(cu[-1])
    i, j = _ij(n)
    d = _doc_ids(cu, n)
    ref = d[:, None] == d[None, :]
    if causal:
        ref = ref & (j <= i)
    if left is not None:
        ref = ref & (j >= i - left)
    if right is not None:
        ref = ref & (j <= i + right)
    return ref


CU = [[0, 1], [0, 7], [0, 3, 4, 8], [0, 1, 2, 3, 4, 5], [0, 5, 6, 13, 14, 30], [0, 2, 11, 12, 20]]


@pytest.mark.parametrize("cu", CU)
@pytest.mark.parametrize(
    "causal,window,left,right",
    [(True, None, None, None), (False, None, None, None), (True, 2, 2, None), (True, 0, 0, None),
     (True, 50, 50, None), (True, (3, 5), 3, None), (False, (2, 1), 2, 1), (False, (None, 2), None, 2),
     (False, (3, None), 3, None), (False, (0, 0), 0, 0), (True, (None, None), None, None)],
)
def test_varlen(cu, causal, window, left, right):
    m = B.varlen(cu, causal=causal, window=window)
    _check(m, _varlen_ref(cu, causal, left, right), max_slices=3 * (len(cu) - 1))
    if window is None:
        assert len(m.slices) == len(cu) - 1


def test_varlen_input_types():
    cu = [0, 3, 4, 9]
    ref = _varlen_ref(cu, True, None, None)
    for arg in (cu, np.array(cu, dtype=np.int32), torch.tensor(cu, dtype=torch.int32), tuple(cu)):
        _check(B.varlen(arg), ref)


def test_varlen_many_documents_fast():
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 40, size=3000)
    cu = np.concatenate([[0], np.cumsum(lens)])
    t = time.perf_counter()
    m = B.varlen(torch.from_numpy(cu))
    mw = B.varlen(cu, window=7)
    elapsed = time.perf_counter() - t
    assert elapsed < 2.0, elapsed
    assert len(m.slices) == 3000 and len(mw.slices) <= 2 * 3000
    assert m.area() == int(np.sum(lens * (lens + 1) // 2))
    w = np.minimum(lens, 8)  # a causal window of 8 keys (left = 7) per doc: triangle then a band
    assert mw.area() == int(np.sum(w * (w + 1) // 2 + (lens - w) * 8))


# ---------------------------------------------------------------------------------------------- blocks


@pytest.mark.parametrize("n,block", [(1, 1), (8, 3), (9, 3), (8, 1), (5, 8), (17, 4)])
def test_block_causal(n, block):
    i, j = _ij(n)
    _check(B.block_causal(n, block), j // block <= i // block, max_slices=-(-n // block))


@pytest.mark.parametrize(
    "n,block,stride,local",
    [(8, 2, 3, 1), (1, 1, 1, 1), (30, 3, 4, 2), (31, 4, 2, 1), (25, 2, 5, 3), (20, 3, 1, 1), (20, 4, 3, 0),
     (10, 16, 2, 1), (40, 2, 3, 10)],
)
def test_strided(n, block, stride, local):
    i, j = _ij(n)
    d = i // block - j // block
    ref = (d >= 0) & ((d < local) | (d % stride == 0))
    ref &= (d != 0) | (j <= i)  # the diagonal block is causal
    nb = -(-n // block)
    # per block row: one slice per run of kept blocks; the kept blocks off the local run are apart
    _check(B.strided(n, block, stride, local), ref, max_slices=sum(1 + b // stride for b in range(nb)))


@pytest.mark.parametrize(
    "n,block,n_global,window",
    [(8, 2, 1, 1), (1, 1, 0, 0), (17, 3, 1, 1), (17, 3, 0, 1), (17, 3, 2, 0), (16, 2, 20, 1), (16, 2, 1, 20),
     (19, 4, 1, 2), (12, 5, 0, 0)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_global_local(n, block, n_global, window, causal):
    i, j = _ij(n)
    g = n_global * block  # token index below which everything is global
    bi, bj = i // block, j // block
    ref = (i < g) | (j < g) | (np.abs(bi - bj) <= window)
    if causal:
        ref = ref & (j <= i)
    nb = -(-n // block)
    _check(B.global_local(n, block, n_global, window, causal=causal), ref, max_slices=2 + nb)


@pytest.mark.parametrize(
    "n,anchor,block", [(8, 2, 3), (1, 1, None), (8, 8, None), (10, 3, None), (10, 3, 2), (11, 4, 20), (9, 1, 1)]
)
def test_star(n, anchor, block):
    i, j = _ij(n)
    bs = anchor if block is None else block
    blk_i = np.where(i < anchor, -1, (i - anchor) // bs)
    blk_j = np.where(j < anchor, -1, (j - anchor) // bs)
    ref = np.where(i < anchor, j <= i, (j < anchor) | ((blk_i == blk_j) & (j <= i)))
    nblocks = -(-(n - anchor) // bs)
    _check(B.star(n, anchor, block), ref, max_slices=max(1, 1 + nblocks))


def _table_ref(table, bs, sq, sk):
    table = np.asarray(table)
    ref = np.zeros((sq, sk), dtype=bool)
    for qb in range(table.shape[0]):
        for kb in range(table.shape[1]):
            q0, q1 = qb * bs, min((qb + 1) * bs, sq)
            k0, k1 = kb * bs, min((kb + 1) * bs, sk)
            li, lj = _ij(q1 - q0, k1 - k0)
            if table[qb, kb] == B.Block.FULL:
                ref[q0:q1, k0:k1] = True
            elif table[qb, kb] == B.Block.CAUSAL:
                ref[q0:q1, k0:k1] = lj <= li + (k1 - k0) - (q1 - q0)
    return ref


def test_block_table_constants():
    assert (B.Block.EMPTY, B.Block.FULL, B.Block.CAUSAL) == (0, 1, 2)


def test_from_block_table_example():
    t = [[2, 0, 0], [1, 2, 0], [1, 0, 2]]
    m = B.from_block_table(t, 3, 8, 8)
    _check(m, _table_ref(t, 3, 8, 8), max_slices=4)


@pytest.mark.parametrize("seed", range(12))
def test_from_block_table_random(seed):
    rng = np.random.default_rng(seed)
    nqb, nkb, bs = rng.integers(1, 7), rng.integers(1, 7), int(rng.integers(1, 6))
    t = rng.choice([0, 1, 2], size=(nqb, nkb), p=[0.3, 0.45, 0.25])
    sq = int(rng.integers((nqb - 1) * bs + 1, nqb * bs + 1))
    sk = int(rng.integers((nkb - 1) * bs + 1, nkb * bs + 1))
    m = B.from_block_table(torch.from_numpy(t) if seed % 2 else t, bs, sq, sk)
    _check(m, _table_ref(t, bs, sq, sk), max_slices=int((t != 0).sum()))


def test_from_block_table_defaults_and_merging():
    nb, bs = 6, 4
    bc = np.tril(np.ones((nb, nb), dtype=np.int64)) + np.eye(nb, dtype=np.int64)  # FULL below, CAUSAL on diag
    m = B.from_block_table(bc, bs)
    i, j = _ij(nb * bs)
    _check(m, j <= i, max_slices=nb)  # each FULL run joins the CAUSAL block to its right
    dense = np.ones((3, 5), dtype=bool)
    _check(B.from_block_table(dense, 2), np.ones((6, 10), dtype=bool), max_slices=3)
    # truncated edges: a causal block with fewer keys than rows is bottom-right aligned
    # (and joins the FULL run to its left only while that stays exact: at most one empty top row)
    t = [[1, 2]]
    _check(B.from_block_table(t, 4, 4, 7), _table_ref(t, 4, 4, 7), max_slices=1)  # 4 rows x 3 keys
    _check(B.from_block_table(t, 4, 4, 6), _table_ref(t, 4, 4, 6), max_slices=2)  # 4 rows x 2 keys
    _check(B.from_block_table(t, 4, 4, 5), _table_ref(t, 4, 4, 5), max_slices=2)
    _check(B.from_block_table([[1, 1, 2], [2, 0, 0]], 4, 5, 9), _table_ref([[1, 1, 2], [2, 0, 0]], 4, 5, 9))


# ---------------------------------------------------------------------------------------------- mask_mod


def test_from_mask_mod_causal_and_window():
    n = 300
    i, j = _ij(n)
    m = B.from_mask_mod(lambda b, h, q, kv: kv <= q, n, block=64)
    _check(m, j <= i, max_slices=1)
    m = B.from_mask_mod(lambda b, h, q, kv: (kv <= q) & (q - kv <= 40), n, block=50)
    _check(m, (j <= i) & (j >= i - 40), max_slices=3)
    m = B.from_mask_mod(lambda b, h, q, kv: (kv - q).abs() <= 7, n, block=128)
    _check(m, np.abs(i - j) <= 7, max_slices=3)


def test_from_mask_mod_non_square():
    i, j = _ij(37, 90)
    m = B.from_mask_mod(lambda b, h, q, kv: kv <= q + 53, 37, 90, block=8)
    _check(m, j <= i + 53, max_slices=1)
    i, j = _ij(90, 37)
    m = B.from_mask_mod(lambda b, h, q, kv: kv <= q - 53, 90, 37, block=8)
    _check(m, j <= i - 53, max_slices=1)


def test_from_mask_mod_documents():
    cu = [0, 1, 9, 10, 30, 61, 64, 100]
    doc = torch.from_numpy(_doc_ids(cu, 100))

    def mod(b, h, q, kv):
        return (doc[q] == doc[kv]) & (kv <= q)

    _check(B.from_mask_mod(mod, 100, block=16), _varlen_ref(cu, True, None, None), max_slices=len(cu) - 1)

    def mod_full(b, h, q, kv):
        return doc[q] == doc[kv]

    _check(B.from_mask_mod(mod_full, 100, block=7), _varlen_ref(cu, False, None, None), max_slices=len(cu) - 1)


def test_from_mask_mod_modular_pattern():
    sq, sk = 61, 47
    i, j = _ij(sq, sk)
    ref = (i * 7 + j * 3) % 5 < 2
    m = B.from_mask_mod(lambda b, h, q, kv: (q * 7 + kv * 3) % 5 < 2, sq, sk, block=16)
    _check(m, ref)
    assert len(m.slices) < ref.sum() / 4  # the diagonal stripes are found, not cut per cell


@pytest.mark.parametrize("seed", range(6))
def test_from_mask_mod_random_dense(seed):
    # arbitrary masks, looked up from a table: exactness, and independence from the row block size
    g = torch.Generator().manual_seed(seed)
    sq, sk = 40 + seed * 7, 33 + seed * 5
    dense = torch.rand(sq, sk, generator=g) < [0.1, 0.5, 0.9][seed % 3]
    m = B.from_mask_mod(lambda b, h, q, kv: dense[q, kv], sq, sk, block=1 + seed * 5)
    _check(m, dense.numpy())
    m2 = B.from_mask_mod(lambda b, h, q, kv: dense[q, kv], sq, sk, block=sk)
    assert m2.slices == m.slices


def test_from_mask_mod_shapes_and_empty():
    # a result that broadcasts (row-only predicate), and an all-masked predicate
    i, j = _ij(20, 13)
    m = B.from_mask_mod(lambda b, h, q, kv: q % 3 == 0, 20, 13, block=4)
    _check(m, np.broadcast_to(i % 3 == 0, (20, 13)), max_slices=7)
    m = B.from_mask_mod(lambda b, h, q, kv: torch.zeros(q.shape[0], kv.shape[1], dtype=torch.bool), 9, 5)
    assert len(m.slices) == 0 and m.area() == 0


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: B.full(0), "seqlen_q.*0"),
        # a predicate that reads the head (or batch) index: it was taken at h = 0 for every head without a word
        (lambda: B.from_mask_mod(lambda b, h, q, kv: kv <= q - 4 * h, 16), r"depends on b or h \(row 0 differs"),
        (lambda: B.from_mask_mod(lambda b, h, q, kv: (kv <= q) & (b == 0), 16), "depends on b or h"),
        (lambda: B.full(4, -2), "seqlen_k.*-2"),
        (lambda: B.causal(2.5), "seqlen_q.*2.5"),
        (lambda: B.sliding_window(8, -1), "left.*-1"),
        (lambda: B.sliding_window(8, 1, -3), "right.*-3"),
        (lambda: B.prefix_lm(8, 9), "prefix.*9"),
        (lambda: B.prefix_lm(8, -1), "prefix.*-1"),
        (lambda: B.streaming(8, -1, 2), "sink.*-1"),
        (lambda: B.streaming(8, 1, 0), "window.*0"),
        (lambda: B.block_causal(8, 0), "block.*0"),
        (lambda: B.strided(8, 2, 0), "stride.*0"),
        (lambda: B.strided(8, 2, 2, -1), "local_blocks.*-1"),
        (lambda: B.global_local(8, 2, -1, 1), "n_global.*-1"),
        (lambda: B.global_local(8, 2, 1, -2), "window_blocks.*-2"),
        (lambda: B.star(8, 0), "anchor.*0"),
        (lambda: B.star(8, 9), "anchor.*9"),
        (lambda: B.star(8, 2, 0), "block.*0"),
        (lambda: B.varlen([1, 4]), r"cu_seqlens\[0\].*1"),
        (lambda: B.varlen([0, 3, 3, 5]), r"cu_seqlens\[2\]=3"),
        (lambda: B.varlen([0, 3, 5, 4]), r"cu_seqlens\[3\]=4"),
        (lambda: B.varlen([0]), r"\[0\]"),
        (lambda: B.varlen([[0, 1]]), r"\(1, 2\)"),
        (lambda: B.varlen([0.0, 2.0]), "float64"),
        (lambda: B.varlen([0, 4], window=-1), "window.*-1"),
        (lambda: B.varlen([0, 4], window=(1, -2)), "right.*-2"),
        (lambda: B.varlen([0, 4], window=(1, 2, 3)), r"\(1, 2, 3\)"),
        (lambda: B.varlen([0, 4], causal=False, window=3), "window=3"),
        (lambda: B.from_block_table([[0, 3]], 2), r"table\[0, 1\] = 3"),
        (lambda: B.from_block_table([[1, 0], [0, -1]], 2), r"table\[1, 1\] = -1"),
        (lambda: B.from_block_table([1, 0], 2), r"shape \(2,\)"),
        (lambda: B.from_block_table([[0.5]], 2), "float64"),
        (lambda: B.from_block_table([[1]], 0), "block_size.*0"),
        (lambda: B.from_block_table([[1], [1]], 4, seqlen_q=4), "seqlen_q.*4"),
        (lambda: B.from_block_table([[1, 1]], 4, seqlen_k=9), "seqlen_k.*9"),
        (lambda: B.from_mask_mod(lambda b, h, q, kv: kv <= q, 8, block=0), "block.*0"),
        (lambda: B.from_mask_mod(lambda b, h, q, kv: (kv <= q).int(), 8), "int32"),
        (lambda: B.from_mask_mod(lambda b, h, q, kv: torch.ones(3, 3, dtype=torch.bool), 8), r"\(3, 3\)"),
        (lambda: B.from_mask_mod("causal", 8), "causal"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
