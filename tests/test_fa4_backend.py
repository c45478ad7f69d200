"""The FA4 backend's tile-to-call mapping on the CPU: its calls run through a reference of FA4's call
semantics (tests/fa4_semantics.py: windows, varlen with seqused, in-place outputs, the merged-lse
backward; it asserts FA4's preconditions and poisons what a call does not own) and the results are
compared with the dense fp64 reference, forward and backward, for the benchmark masks, planner rank
lists (sq != sk, every kind) and random cell-disjoint lists. A wrong mapping fails here, in CI."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import fa4_semantics
import megatron_cp as mcp
from megatron_cp.kernels import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL, FA4Backend, TritonConfig, get_backend
from megatron_cp.kernels.fa4.backend import Fa4Functions, fa4_unavailable
from megatron_cp.kernels.fa4.calls import fa4_calls, segment_of
from megatron_cp.masks import catalog
from megatron_cp.masks.catalog import tiles_to_dense
from megatron_cp.testing import reference_attention

@pytest.fixture(params=["default", "blocks", "varlen"])
def route_rules(request, monkeypatch):
    """Every list through each route: the default rules, the block-sparse form wherever it exists (also
    for one-call lists), varlen calls however many."""
    from megatron_cp.kernels.fa4 import calls as fc

    if request.param == "blocks":
        monkeypatch.setattr(fc, "VARLEN_MAX_CALLS", 0)
        monkeypatch.setattr(fc, "BWD_MAX_PARTIAL_FRACTION", 1.0)
    elif request.param == "varlen":
        monkeypatch.setattr(fc, "VARLEN_MAX_CALLS", 10 ** 9)
    return request.param


EMULATED = Fa4Functions(fa4_semantics.fwd, fa4_semantics.bwd, "reference", (torch.float64,),
                        fa4_semantics.block_sparse, fa4_semantics.interval_masks(), fa4_semantics.band_mask)


def _inputs(sq, sk, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(sq, hq, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(sk, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, do, torch.randn(sq, hq, generator=g, dtype=torch.float64)


def _check(tiles, sq, sk, dlse=False, seed=0, deterministic=False):
    """FA4Backend (emulated FA4) against the fp64 dense reference: forward, forward_accumulate from an
    empty running pair, backward and backward_into (with and without an lse gradient)."""
    tiles = torch.as_tensor(np.asarray(tiles).reshape(-1, 5), dtype=torch.int32)
    be = FA4Backend(TritonConfig(deterministic=deterministic), functions=EMULATED)
    prep = be.prepare(tiles, sq, sk)
    q, k, v, do, dl = _inputs(sq, sk, seed=seed)
    scale = 0.3
    keep = tiles_to_dense(tiles, sq, sk)
    o_ref, l_ref, dq_ref, dk_ref, dv_ref = reference_attention(q, k, v, keep, scale, dout=do, dlse=dl if dlse else None)
    routes = {d: prep.calls.route(d) for d in ("fwd", "bwd")}
    for d, r in routes.items():  # Triton's own tests cover those directions
        assert (r == "triton") == bool(prep.calls.triton_reason(d)), (d, r)
    if routes["fwd"] == "triton":
        return prep.calls
    out, lse = be.forward(q, k, v, prep, scale)
    assert be.last_path == "fa4"
    torch.testing.assert_close(out, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, l_ref, rtol=1e-10, atol=1e-10)  # -inf where a row keeps nothing
    acc = torch.zeros_like(q)
    run = torch.full(lse.shape, float("-inf"), dtype=torch.float64)
    be.forward_accumulate(q, k, v, prep, scale, acc, run)
    torch.testing.assert_close(acc, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(run, l_ref, rtol=1e-10, atol=1e-10)
    if routes["bwd"] == "triton":
        return prep.calls
    delta = ((do * o_ref).sum(-1) - dl) if dlse else None
    dq, dk, dv = be.backward(q, k, v, o_ref, l_ref, do, prep, scale, delta)
    for got, want in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    sums = [torch.ones_like(t) for t in (q, k, v)]  # running sums start at 1: backward_into must add
    be.backward_into(q, k, v, o_ref, l_ref, do, prep, scale, delta, *sums)
    for got, want in zip(sums, (dq_ref, dk_ref, dv_ref)):
        torch.testing.assert_close(got, want + 1, rtol=1e-9, atol=1e-9)
    return prep.calls


@pytest.mark.parametrize("name", catalog.KERNEL_MASKS)
def test_kernel_masks(name, route_rules):
    s = 192
    calls = _check(catalog.tiles(catalog.build(name, s)), s, s)
    assert calls.fwd, name


@pytest.mark.parametrize("name", catalog.DIST_MASKS)
def test_dist_masks_with_lse_gradient(name, route_rules):
    s = 160
    _check(catalog.tiles(catalog.build(name, s)), s, s, dlse=True)


def test_the_natively_expressible_masks_are_one_call():
    """What FA4 expresses natively maps to one call each way: full and causal dense, documents one varlen
    call, a sliding window one window call (its causal head fused with its band)."""
    s = 4096
    for name, window in (("full", (None, None)), ("causal", (None, 0)), ("docs_causal", (None, 0)),
                         ("sliding_window_1024", (1024, 0))):
        c = fa4_calls(catalog.tiles(catalog.build(name, s)).numpy(), s, s)
        assert len(c.fwd) == len(c.bwd) == 1, (name, c.describe())
        assert (c.fwd[0].left, c.fwd[0].right) == window, name
        assert c.fwd[0].dense == (name != "docs_causal"), name


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", ["causal", "packed", "sliding_window", "global_local", "strided"])
def test_planner_rank_lists(name, cp, route_rules):
    """The lists the runtime gives the backend: a rank's rows against its key buffer (sq != sk); strided's blocks of
    one token at this size give its rank lists the bitmap form (by row forward, by key backward)."""
    s = 256
    plan = mcp.plan(catalog.build(name, s), cp)
    for rp in plan.ranks:
        if len(rp.tiles):
            _check(rp.tiles, rp.num_tokens, rp.buffer_len, seed=rp.rank)


def _random_disjoint(rng, sq, sk, n):
    """Up to n random tiles of random kinds, dropping any that would share a cell with an earlier one."""
    keep = torch.zeros(sq, sk, dtype=torch.bool)
    out = []
    for _ in range(n):
        q0 = int(rng.integers(0, sq - 1)); q1 = int(rng.integers(q0 + 1, sq + 1))
        k0 = int(rng.integers(0, sk - 1)); k1 = int(rng.integers(k0 + 1, sk + 1))
        t = [q0, q1, k0, k1, int(rng.integers(0, 4))]
        m = tiles_to_dense(torch.tensor([t]), sq, sk)
        if not (m & keep).any() and m.any():
            keep |= m
            out.append(t)
    return np.array(out, dtype=np.int64).reshape(-1, 5)


@pytest.mark.parametrize("seed", range(12))
def test_random_lists(seed, route_rules):
    """Small lists (one 128-block: the block-sparse route's partial blocks carry every cell) and lists
    over several blocks; the deterministic mode runs the backward as varlen calls."""
    rng = np.random.default_rng(seed)
    hi = 70 if seed % 3 else 400
    sq, sk = int(rng.integers(8, hi)), int(rng.integers(8, hi))
    tiles = _random_disjoint(rng, sq, sk, int(rng.integers(1, 10)))
    _check(tiles, sq, sk, dlse=bool(seed % 2), seed=seed)
    _check(tiles, sq, sk, seed=seed, deterministic=True)


def test_routes():
    """A list of whole 128-blocks (block-causal) is one block-sparse call without mask arithmetic; else up
    to two varlen calls per direction, more as one block-sparse call (the strided mask's eight), except a
    backward with many partial blocks (streaming: Triton, with the reason)."""
    s = 16384
    for name, fwd, bwd in (("causal", "varlen", "varlen"), ("block_causal_2048", "blocks", "blocks"),
                           ("docs_causal", "varlen", "varlen"), ("sliding_window_1024", "varlen", "varlen"),
                           ("strided_512x4", "blocks", "blocks"), ("streaming_1024", "blocks", "triton")):
        c = fa4_calls(catalog.tiles(catalog.build(name, s)).numpy(), s, s)
        assert (c.route("fwd"), c.route("bwd")) == (fwd, bwd), (name, c.describe())
    c = fa4_calls(catalog.tiles(catalog.build("block_causal_2048", s)).numpy(), s, s)
    assert c.blocks.partial_blocks == 0 and c.blocks.full_blocks == 16 * 16 * (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8)
    c = fa4_calls(catalog.tiles(catalog.build("streaming_1024", s)).numpy(), s, s)
    assert "partial blocks" in c.triton_reason("bwd"), c.describe()
    c = fa4_calls(catalog.tiles(catalog.build("strided_512x4", s)).numpy(), s, s)
    assert c.blocks.band == (0, -2 * s, 0) and c.blocks.intervals == 0  # causal diagonals: c - r <= 0
    c = fa4_calls(catalog.tiles(catalog.build("global_local_512", s)).numpy(), s, s)
    assert c.blocks.band == (0, -512, 512)  # the local band's edges
    c = fa4_calls(catalog.tiles(catalog.build("streaming_1024", s)).numpy(), s, s)
    assert c.blocks.band == (4, -1024, 0)  # a causal window of 1025 keys and 4 sink keys


def test_fusion_agrees_with_a_row_by_row_comparison():
    """Two row-adjacent segments fuse iff one window has exactly their cells: the check at the rows where the
    bounds change slope (calls._bounds_agree) decides as comparing every row's bounds does."""
    from megatron_cp.kernels.fa4 import calls as fc

    def by_rows(a, b):
        if a.q1 != b.q0:
            return None
        ra, rb = np.arange(a.q0, a.q1), np.arange(b.q0, b.q1)
        for left in dict.fromkeys((a.left, b.left, None)):
            for right in dict.fromkeys((a.right, b.right, None)):
                c = fc.Segment(a.q0, b.q1, min(a.k0, b.k0), max(a.k1, b.k1), left, right)
                if all(np.array_equal(x, y) for r, s in ((ra, a), (rb, b)) for x, y in zip(c.bounds(r), s.bounds(r))):
                    return fc._canonical(c)
        return None

    rng, fused, pairs = np.random.default_rng(0), 0, 0
    for _ in range(6000):
        q0, m1, m2 = (int(x) for x in rng.integers(1, 13, 3))
        k0, w = int(rng.integers(0, 30)), int(rng.integers(1, 20))
        a = fc.segment_of(q0, q0 + m1, k0, k0 + w, int(rng.integers(0, 4)))
        if a is None:
            continue
        if rng.random() < 0.5:  # the window of a carried on (shifted keys), so that fusions occur
            d0, d1 = (int(x) for x in rng.integers(-2, 3, 2))
            b = fc._canonical(fc.Segment(a.q1, a.q1 + m2, a.k0 + d0, a.k1 + m2 + d1, a.left, a.right))
        else:
            b0 = int(rng.integers(0, 30))
            b = fc.segment_of(a.q1, a.q1 + m2, b0, b0 + int(rng.integers(1, 20)), int(rng.integers(0, 4)))
        if b is None or b.k1 <= b.k0 or b.k0 < 0:
            continue
        want = by_rows(a, b)
        assert fc._fuse(a, b) == want, (a, b)
        pairs, fused = pairs + 1, fused + (want is not None)
    assert pairs > 4000 and fused > 100, (pairs, fused)


def test_block_cells_count_every_kept_cell():
    """calls._block_cells (kept cells per 128 x 128 block, from each row's key intervals) equals the dense count."""
    from megatron_cp.kernels.fa4 import calls as fc

    rng = np.random.default_rng(0)
    for _ in range(20):
        sq, sk, n = int(rng.integers(1, 700)), int(rng.integers(1, 900)), int(rng.integers(1, 300))
        row = np.sort(rng.integers(0, sq, n))
        lo = rng.integers(0, sk, n)
        hi = np.minimum(sk, lo + rng.integers(1, sk + 1, n))
        dense = np.zeros((sq, sk), dtype=np.int64)
        for r, a, b in zip(row, lo, hi):
            dense[r, a:b] += 1
        m, nb = -(-sq // fc.BLOCK), -(-sk // fc.BLOCK)
        pad = np.zeros((m * fc.BLOCK, nb * fc.BLOCK), dtype=np.int64)
        pad[:sq, :sk] = dense
        want = pad.reshape(m, fc.BLOCK, nb, fc.BLOCK).sum((1, 3))
        got = fc._block_cells(row, lo, hi, m, nb)
        assert got.dtype == np.int64 and np.array_equal(got, want)


@pytest.mark.parametrize("seed", range(4))
def test_band_check_agrees_with_a_cell_by_cell_comparison(monkeypatch, seed):
    """calls._band (are a list's partial blocks one diagonal band, with or without sink keys?) compares interval
    lengths per row; on windows, streaming, global + local, prefix-LM and packed documents, split over CP ranks,
    it answers as a cell-by-cell comparison of every partial block with every candidate band does."""
    from megatron_cp.kernels.fa4 import calls

    def cell_by_cell(segs, row, lo, hi, partial, sq, sk):
        mb, nb = np.nonzero(partial)
        if not len(mb) or len(mb) * calls.BLOCK ** 2 > calls.BAND_CHECK_MAX_CELLS:
            return None
        big = sq + sk
        cands = list(dict.fromkeys(
            (-big if g.left is None else g.k1 - g.q1 - g.left, big if g.right is None else g.k1 - g.q1 + g.right)
            for g in segs))
        keep = np.zeros((sq, sk), dtype=bool)
        for r, a, b in zip(row.tolist(), lo.tolist(), hi.tolist()):
            keep[r, max(a, 0):max(b, 0)] = True
        sinks = [0] + sorted({g.k1 for g in segs if g.k0 == 0 and g.left is None and g.right is None})
        for sink in sinks:
            for dlo, dhi in cands:
                if all(np.array_equal(keep[m * 128:(m + 1) * 128, n * 128:(n + 1) * 128],
                                      calls.band_keep(np.arange(m * 128, min((m + 1) * 128, sq)),
                                                      np.arange(n * 128, min((n + 1) * 128, sk)), sink, dlo, dhi))
                       for m, n in zip(mb.tolist(), nb.tolist())):
                    return int(sink), int(max(dlo, -big)), int(min(dhi, big))
        return None

    seen = []
    real = calls._band

    def both(*a):
        got = real(*a)
        seen.append((got, cell_by_cell(*a)))
        return got

    monkeypatch.setattr(calls, "_band", both)
    rng = np.random.default_rng(seed)
    s = 4096
    w = int(rng.integers(100, 1500))
    cuts = np.unique(np.concatenate([[0, s], rng.integers(1, s, size=int(rng.integers(2, 12)))])).tolist()
    masks = [mcp.masks.sliding_window(s, w), mcp.masks.sliding_window(s, w, int(rng.integers(1, 300))),
             mcp.masks.streaming(s, int(rng.integers(1, 200)), w), mcp.masks.global_local(s, 256, 1, 2),
             mcp.masks.prefix_lm(s, int(rng.integers(1, s))), mcp.masks.varlen(cuts, causal=True)]
    for mask in masks:
        for cp in (1, 2, 4):
            plan = mcp.plan(mask, cp)
            for rank in range(cp):
                rp = plan.ranks[rank]
                fa4_calls(rp.tiles.astype("int32"), plan.num_local(rank), max(rp.buffer_len, 1))
    # two windows of one width on other diagonals in one block: every row keeps as many keys as the first
    # window's band would give it, but not the same keys (no band)
    tiles = np.array([[0, 64, 0, 74, BI_CAUSAL], [64, 80, 84, 110, BI_CAUSAL], [80, 128, 80, 138, BI_CAUSAL]])
    n = len(seen)
    calls.block_lists([segment_of(*t) for t in tiles.tolist()], 128, 256)
    assert len(seen) == n + 1 and seen[-1] == (None, None), seen[-1]
    assert seen and all(got == want for got, want in seen), [x for x in seen if x[0] != x[1]]
    assert any(got is not None for got, _ in seen) and any(got is None for got, _ in seen)


def test_segments_keep_exactly_the_tiles_cells():
    """Each kind's window (and the trimming of rows that keep nothing) against the tile semantics."""
    for kind in (FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL):
        for sq in range(1, 9):
            for sk in range(1, 9):
                want = tiles_to_dense(torch.tensor([[2, 2 + sq, 3, 3 + sk, kind]]), 12, 12).numpy()
                seg = segment_of(2, 2 + sq, 3, 3 + sk, kind)
                got = np.zeros_like(want)
                if seg is not None:
                    rows = np.arange(seg.q0, seg.q1)
                    lo, hi = seg.bounds(rows)
                    assert (hi > lo).all(), (kind, sq, sk)  # no empty row
                    for r, a, b in zip(rows, lo, hi):
                        got[r, a:b] = True
                assert (got == want).all(), (kind, sq, sk)


def test_fallbacks_are_reported():
    """Inputs FA4 cannot run go to Triton with the reason in last_path and describe()."""
    be = FA4Backend(functions=Fa4Functions(fa4_semantics.fwd, fa4_semantics.bwd, "reference"))
    tiles = torch.tensor([[0, 32, 0, 32, CAUSAL]], dtype=torch.int32)
    prep = be.prepare(tiles, 32, 32, head_dims=(16,))
    q, k, v, do, _ = _inputs(32, 32, d=16)
    q, k, v, do = (t.float() for t in (q, k, v, do))
    out, lse = be.forward(q, k, v, prep)
    assert be.last_path.startswith("triton (") and "float32" in be.last_path
    assert any("float32" in r for r in be.describe()["fallbacks"].values())
    o_ref, l_ref = reference_attention(q, k, v, tiles_to_dense(tiles, 32, 32), 16 ** -0.5)[:2]
    torch.testing.assert_close(out.double(), o_ref, rtol=2e-5, atol=2e-5)


def test_auto_and_availability_on_the_cpu():
    assert fa4_unavailable("cpu") is not None
    assert get_backend("auto", "cpu").name == "reference"
    assert isinstance(get_backend("fa4"), FA4Backend)


def _masks_exact(b, tiles, s: int, sk: int | None = None) -> None:
    """Each direction's mask_mod (emulated) keeps exactly the list's cells on every partial block (``s`` rows and
    ``sk`` keys, default ``s``)."""
    sk = s if sk is None else sk
    keep = tiles_to_dense(torch.as_tensor(tiles, dtype=torch.int32), s, sk)
    masks = fa4_semantics.interval_masks()
    cnt, idx = b.fwd[0], b.fwd[1]
    for m in range(len(cnt)):
        for n in idx[m, :cnt[m]]:
            r, cols = torch.arange(m * 128, min(s, m * 128 + 128)), torch.arange(n * 128, min(sk, n * 128 + 128))
            for d in ("fwd", "bwd"):
                key, aux = b.mask(d)
                got = (fa4_semantics.band_mask(*b.band)(r, cols, None) if b.band is not None else
                       masks[key](r, cols, [torch.as_tensor(aux)]))
                assert torch.equal(got, keep[r[0]:r[-1] + 1, cols[0]:cols[-1] + 1]), (d, key, m, n)


@pytest.mark.parametrize("cp", [2, 4])
def test_every_rank_lists_block_form_is_exact(cp):
    """Each rank's list of every distributed catalog mask (its rows against its key buffer: zigzag and balanced
    layouts, INV_CAUSAL / BI_CAUSAL pieces) in its block-sparse form: the partial blocks' mask_mod keeps exactly the
    list's cells, forward (by row, a band, a periodic band or a bitmap) and backward (by key where it has that)."""
    from megatron_cp.kernels.fa4.calls import block_lists, fuse_segments

    forms = set()
    for name in catalog.DIST_MASKS:
        for rp in mcp.plan(catalog.build(name, 2048), cp).ranks:
            if not len(rp.tiles):
                continue
            segs = fuse_segments([g for g in (segment_of(*map(int, t)) for t in rp.tiles) if g is not None])
            b = block_lists(segs, rp.num_tokens, rp.buffer_len)
            if b is None or not b.partial_blocks:
                continue
            forms.add((b.band is not None and len(b.band), b.mask("fwd")[0], b.mask("bwd")[0]))
            _masks_exact(b, rp.tiles, rp.num_tokens, rp.buffer_len)
    assert any(f[2] in ("by_key_1", "by_key_2") for f in forms), forms  # the by-key backward is exercised


@pytest.mark.parametrize("name,s,band", [("strided_512x4", 2048, True), ("global_local_512", 2048, True),
                                         ("streaming_1024", 1280, True), ("block_causal", 1280, False),
                                         ("global_local", 1280, False), ("docs_causal", 1280, False)])
def test_block_sparse_lists_at_block_scale(name, s, band, monkeypatch):
    """Lists over several 128-blocks through the block-sparse route (forced for the smaller sizes the dense
    emulator affords): partial blocks masked by the band mask_mod (constants) where their cells are one
    diagonal band, else by the rows' intervals forward and the keys' intervals backward (each key's keeping
    rows: one or two runs on these masks), exact on every partial block."""
    from megatron_cp.kernels.fa4 import calls as fc

    monkeypatch.setattr(fc, "VARLEN_MAX_CALLS", 0)
    monkeypatch.setattr(fc, "BWD_MAX_PARTIAL_FRACTION", 1.0)
    tiles = catalog.tiles(catalog.build(name, s)).numpy()
    c = fa4_calls(tiles, s, s)
    assert c.route("fwd") == c.route("bwd") == "blocks", c.describe()
    b = c.blocks
    assert b.partial_blocks > 0 and (b.band is not None) == band, b.band
    if not band:
        assert b.mask("fwd")[0] in (1, 2) and b.mask("bwd")[0] in ("by_key_1", "by_key_2"), b.mask("bwd")[0]
        assert b.bounds_t.shape == (s, 2 * int(b.mask("bwd")[0][-1]))
        _masks_exact(b, tiles, s)
    _check(tiles, s, s, dlse=True)


def test_keys_kept_by_three_row_runs_read_the_rows_intervals_backward():
    """A key kept by three runs of rows on a partial block (one key column of three row bands): no by-key form, the
    backward reads the rows' intervals as the forward does, exact."""
    s = 256
    tiles = np.array([[0, 10, 0, 128, FULL], [20, 30, 0, 128, FULL], [40, 50, 0, 128, FULL],
                      [128, 256, 128, 256, CAUSAL]], dtype=np.int64)
    from megatron_cp.kernels.fa4.calls import block_lists, fuse_segments

    b = block_lists(fuse_segments([segment_of(*map(int, t)) for t in tiles]), s, s)
    assert b.bounds_t is None and b.mask("bwd") == b.mask("fwd") and b.mask("fwd")[0] == 1
    _masks_exact(b, tiles, s)


@pytest.mark.parametrize("s,block,stride,local", [(1024, 16, 4, 1), (768, 32, 3, 2), (640, 8, 3, 1), (600, 24, 5, 2)])
def test_strided_partial_blocks_run_as_a_periodic_band(s, block, stride, local, monkeypatch):
    """Strided masks of 8- to 32-token blocks (rows keeping several key intervals inside one 128-block) run as one
    block-sparse call whose mask_mod is arithmetic on the cell's group offset: the form found is the mask's own
    (group = its block, period = its stride, local = its local blocks), its cells are exactly every partial block's,
    and the call is exact against the dense reference, forward and backward."""
    from megatron_cp.kernels.fa4 import calls as fc
    from megatron_cp.masks import builders as B

    monkeypatch.setattr(fc, "BWD_MAX_PARTIAL_FRACTION", 1.0)
    tiles = catalog.tiles(B.strided(s, block, stride, local_blocks=local)).numpy()
    c = fa4_calls(tiles, s, s)
    b = c.blocks
    assert b is not None and not b.bitmap and b.band == (0, -2 * s, 0, block, stride, local), c.describe()
    assert b.mask("fwd") == b.mask("bwd") == (None, None) and b.bounds.shape == (s, 0)
    assert c.route("fwd") == c.route("bwd") == "blocks", c.describe()
    keep = tiles_to_dense(torch.as_tensor(tiles, dtype=torch.int32), s, s).numpy()
    cnt, idx = b.fwd[0], b.fwd[1]
    for m in range(len(cnt)):
        for n in idx[m, :cnt[m]]:
            r, cols = np.arange(m * 128, min(s, m * 128 + 128)), np.arange(n * 128, min(s, n * 128 + 128))
            assert np.array_equal(fc.band_keep(r, cols, *b.band), keep[r[0]:r[-1] + 1, cols[0]:cols[-1] + 1]), (m, n)
    _check(tiles, s, s, dlse=True)


@pytest.mark.parametrize("group", [1, 8, 16, 24])  # powers of two and not
@pytest.mark.parametrize("period", [1, 3, 4])
@pytest.mark.parametrize("local", [0, 1, 2])
def test_periodic_band_arithmetic_is_its_definition(group, period, local):
    """The periodic band's mask_mod arithmetic (the XOR of the offset's bits where group and period are powers of two,
    ANDs for the offset where local > 1, division otherwise) keeps exactly the definition's cells, on every cell of a
    grid crossing many groups and periods, for each causal edge dhi <= 0."""
    from megatron_cp.kernels.fa4.cells import periodic_cells, periodic_keep

    r = np.arange(0, 700, dtype=np.int64)
    c = np.arange(0, 700, dtype=np.int64)
    for dhi in (0, -1, -group, -5 * group - 3):
        want = periodic_keep(r, c, dhi, group, period, local)
        got = periodic_cells(r[:, None], c[None, :], dhi, group, period, local)
        assert got.dtype == np.bool_ and np.array_equal(got, want), (dhi, int((got != want).sum()))
        t = periodic_cells(torch.as_tensor(r)[:, None].int(), torch.as_tensor(c)[None, :].int(), dhi, group, period,
                           local)
        assert np.array_equal(t.numpy(), want), dhi  # int32, as the kernel's indices


def _random_blocks(s: int, block: int, seed: int) -> np.ndarray:
    """Each 16-row block keeps its causal diagonal block and a random half of the key blocks before it: several
    intervals a row inside one 128-block, no period."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(s // block):
        q0, q1 = b * block, (b + 1) * block
        out.append([q0, q1, q0, q1, CAUSAL])
        out += [[q0, q1, j * block, (j + 1) * block, FULL] for j in range(b) if rng.random() < 0.5]
    return np.array(out, dtype=np.int64)


@pytest.mark.parametrize("mask", [("mixed", 640), ("random", 512), ("strided_and_a_cell", 512)])
def test_fine_grained_partial_blocks_run_with_a_bitmap(mask, monkeypatch):
    """Rows keeping more than two key intervals over their partial blocks in no periodic band (documents with
    strided sink keys; random 16-token key blocks; a strided mask and one cell more) run as one block-sparse call whose mask_mod reads the cell's bit
    (bounds int32 [sq, 4 N]): exact against the dense reference, forward and backward; the bits are exactly every
    partial block's cells; above the size cap, Triton."""
    from megatron_cp.kernels.fa4 import calls as fc

    monkeypatch.setattr(fc, "BWD_MAX_PARTIAL_FRACTION", 1.0)
    s = mask[1]
    if mask[0] == "random":
        tiles = _random_blocks(s, 16, seed=3)
    elif mask[0] == "strided_and_a_cell":
        from megatron_cp.masks import builders as B
        tiles = np.concatenate([catalog.tiles(B.strided(s, 16, 4, local_blocks=1)).numpy(), [[300, 301, 17, 18, FULL]]])
    else:
        docs = [[a, e, a, e, CAUSAL] for a, e in ((0, 200), (200, 450), (450, 640))]
        sinks = [[200, 640, k, k + 8, FULL] for k in range(0, 200, 24)]  # strided sink keys of the first document
        tiles = np.array(docs + sinks, dtype=np.int64)
    c = fa4_calls(tiles, s, s)
    b = c.blocks
    assert b is not None and b.bitmap and b.band is None and b.bounds.shape == (s, 4 * -(-s // 128)), c.describe()
    assert c.route("fwd") == c.route("bwd") == "blocks", c.describe()
    # the bounds keep exactly the list's cells on every partial block
    keep = tiles_to_dense(torch.as_tensor(tiles, dtype=torch.int32), s, s)
    masks = fa4_semantics.interval_masks()
    cnt, idx = b.fwd[0], b.fwd[1]
    assert b.mask("bwd")[0] == "bitmap_t" and b.bounds_t.shape == (s, 4 * -(-s // 128))
    for m in range(len(cnt)):
        for n in idx[m, :cnt[m]]:
            r, cols = torch.arange(m * 128, min(s, m * 128 + 128)), torch.arange(n * 128, min(s, n * 128 + 128))
            for d in ("fwd", "bwd"):  # the forward's bits by row, the backward's by key
                key, aux = b.mask(d)
                got = masks[key](r, cols, [torch.as_tensor(aux)])
                assert torch.equal(got, keep[r[0]:r[-1] + 1, cols[0]:cols[-1] + 1]), (d, m, n)
    _check(tiles, s, s, dlse=True)
    monkeypatch.setattr(fc, "BITMAP_MAX_BYTES", b.bounds.nbytes - 1)
    c = fa4_calls(tiles, s, s)
    assert c.blocks is None and c.route("fwd") == "triton" and "bitmap of their cells above" in c.triton_reason("fwd")


def _compiled_interface(mode: str = "plain"):
    """A stand-in of flash_attn.cute's forward interface: Python in front (counted) that calls a "compiled kernel"
    from ``compile_cache`` with a flat argument list led by q, k, v, out, lse, as FA4's does. ``mode``: "copy_q", the
    front passes a copy of q (as FA4 does for a non-contiguous q), which a replay must not take; "workspace", the
    kernel reads q from a buffer the front fills on each call, so that a replay computes with a stale q."""
    workspace = []

    def kernel(q, k, v, out, lse, scale, kw):
        q = workspace[0] if mode == "workspace" else q
        fa4_semantics.fwd(q, k, v, softmax_scale=scale, return_lse=True, out=out, lse=lse, **dict(kw))

    def front(q, k, v, softmax_scale=None, return_lse=False, out=None, lse=None, **kw):
        front.calls += 1
        workspace[:] = [q.detach().clone()]
        key = (q.dtype, q.dim(), tuple(sorted(kw)))
        if key not in front.compile_cache:
            front.compile_cache[key] = kernel
        qq = q.detach().clone() if mode == "copy_q" else q.detach()
        front.compile_cache[key](qq, k.detach(), v.detach(), out.detach(), lse, softmax_scale, tuple(kw.items()))
        return out, lse

    front.calls, front.compile_cache = 0, {}
    return front


@pytest.mark.parametrize("mode", ["plain", "copy_q", "workspace"])
def test_fa4_forward_replays_each_runs_kernel_for_later_layers(mode):
    """replay.launch: the first layer's call goes through the interface and records the compiled kernel per run;
    the first replay of a kernel is checked against the interface's result (one more interface call), later
    layers (new q, k, v, same shapes) call the kernel directly with their own tensors. Every layer gets the
    reference's result: where the interface did not pass the given tensors through (a copy), or where the replay
    disagreed with it (a kernel reading per-call state), every call takes the interface."""
    from megatron_cp.kernels.fa4 import replay

    mask = catalog.build("packed", 96)
    tiles = catalog.tiles(mask)
    front = _compiled_interface(mode)
    be = FA4Backend(functions=Fa4Functions(front, fa4_semantics.bwd, "reference", (torch.float64,),
                                           fa4_semantics.block_sparse, fa4_semantics.interval_masks(),
                                           fa4_semantics.band_mask))
    prep = be.prepare(tiles, 96, 96)
    runs = len(prep.runs("fwd", torch.device("cpu"), be.functions, prep.calls.route("fwd")))
    assert runs >= 1
    keep = tiles_to_dense(tiles, 96, 96)
    layers = 5
    before = dict(replay.REFUSED)
    for layer in range(layers):
        q, k, v, _, _ = _inputs(96, 96, seed=layer)
        out, lse = be.forward(q, k, v, prep, 0.3)
        o_ref, l_ref = reference_attention(q, k, v, keep, 0.3)[:2]
        torch.testing.assert_close(out, o_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse, l_ref, rtol=1e-10, atol=1e-10)
    kernels = {id(r.replays[s][0]) for r in prep.runs("fwd", torch.device("cpu"), be.functions, prep.calls.route("fwd"))
               for s in r.replays if r.replays[s] is not None}
    # describe() names each launch kept on the interface with why, once per record
    why = {w: n - before.get((f, w), 0) for (f, w), n in replay.REFUSED.items() if n > before.get((f, w), 0)}
    not_replayed = {(d["function"], d["why"]) for d in be.describe()["not_replayed"]}
    assert all((front.__qualname__, w) in not_replayed for w in why)
    if mode == "plain":  # recorded, checked once, replayed: the interface ran twice per run
        assert front.calls == 2 * runs and all(replay._CHECKED[i] for i in kernels) and not why
    elif mode == "copy_q":  # never recorded: the kernel's q is a copy the interface made, and this stand-in's
        # module has no compile caches to record a program from (FA4's has: test_fa4_backward_... names its reason)
        assert front.calls == layers * runs and not kernels
        assert why == {"no compile caches in the interface's module": runs}, why
    else:  # recorded, its check failed (the checked layer's result is the interface's): then a program, which this
        # stand-in's module cannot give (no compile caches: test_fa4_forward_reading_a_zeroed_buffer_... can)
        assert front.calls == layers * runs and kernels and not any(replay._CHECKED[i] for i in kernels)
        assert why == {"no compile caches in the interface's module": runs}, why


@contextlib.contextmanager
def _standin_module(source: str, name: str, **attrs):
    """A stand-in of flash_attn.cute's interface module made from ``source`` (module-level compile caches, as FA4's),
    importable by ``name`` while the block runs."""
    import sys
    import types

    mod = types.ModuleType(name)
    vars(mod).update(attrs)
    sys.modules[name] = mod
    try:
        exec(compile(source, name, "exec"), mod.__dict__)
        yield mod
    finally:
        sys.modules.pop(name, None)


def _standin_backend(fwd, bwd) -> FA4Backend:
    return FA4Backend(functions=Fa4Functions(fwd, bwd, "reference", (torch.float64,), fa4_semantics.block_sparse,
                                             fa4_semantics.interval_masks(), fa4_semantics.band_mask))


def _standin_forward_layers(mod, layers: int, seed: int, s: int = 96) -> list:
    """``layers`` forward calls of one packed list through a stand-in module's ``fwd``, each layer's new q, k, v
    checked against the reference (1e-10); the list's forward runs."""
    tiles = catalog.tiles(catalog.build("packed", s))
    be = _standin_backend(mod.fwd, fa4_semantics.bwd)
    prep = be.prepare(tiles, s, s)
    keep = tiles_to_dense(tiles, s, s)
    for layer in range(layers):
        q, k, v, _, _ = _inputs(s, s, seed=seed + layer)
        out, lse = be.forward(q, k, v, prep, 0.3)
        o_ref, l_ref = reference_attention(q, k, v, keep, 0.3)[:2]
        torch.testing.assert_close(out, o_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse, l_ref, rtol=1e-10, atol=1e-10)
    return prep.runs("fwd", torch.device("cpu"), be.functions, prep.calls.route("fwd"))


_FWD_STANDIN = '''
import torch
import fa4_semantics


def _meta(buf, q):  # "compiled": fills a buffer the front allocated (as FA4's tile-count prefix sum)
    buf.fill_(1.0)


def _main(q4, k, v, out, lse, buf, scale, kw):  # reads that buffer; takes q as a 4-D view of the given q
    fa4_semantics.fwd(q4[0] * buf[0], k, v, softmax_scale=scale, return_lse=True, out=out, lse=lse, **dict(kw))


def fwd(q, k, v, softmax_scale=None, return_lse=False, out=None, lse=None, **kw):
    fwd.calls += 1
    buf = torch.empty(1, dtype=q.dtype, device=q.device)
    key = (q.dtype, q.dim(), tuple(sorted(kw)))
    CACHES["_meta"].setdefault(key, _meta)
    CACHES["_main"].setdefault(key, _main)
    _meta_front.compile_cache[key](buf, q.detach())
    fwd.compile_cache[key](q.detach().unsqueeze(0), k.detach(), v.detach(), out, lse, buf, softmax_scale,
                           tuple(kw.items()))
    return out, lse


def _meta_front():
    pass


CACHES = {"_meta": {}, "_main": {}}
_meta_front.compile_cache = CACHES["_meta"]
fwd.compile_cache = CACHES["_main"]
fwd.calls = 0
'''


def test_fa4_forward_of_two_compiled_calls_replays_as_a_program():
    """replay.launch: a forward whose interface makes two compiled calls (a metadata kernel filling a buffer the front
    allocated, then the main kernel reading it) and hands the kernel a view of q is not served by the one-kernel
    record; the second layer records it as a program (replay.launch_program), the third checks its first replay
    against the interface, later layers replay it, each with a fresh buffer its metadata kernel fills again. Every
    layer gets the reference's result."""
    from megatron_cp.kernels.fa4 import replay

    with _standin_module(_FWD_STANDIN, "fa4_fwd_standin_program") as mod:
        runs = _standin_forward_layers(mod, layers=6, seed=20)
        # per run: the one-kernel record, the program's record, its checked first replay; then replays only
        assert mod.fwd.calls == 3 * len(runs), (mod.fwd.calls, len(runs))
        progs = [p for r in runs for p in r.fwd_programs.values()]
        assert len(progs) == len(runs) and all(p is not None and replay._CHECKED[p[2]] for p in progs)
        assert all(v is None for r in runs for v in r.replays.values())  # the one-kernel record did not serve


_COUNTER_STANDIN = '''
import torch
import fa4_semantics


def _main(q, k, v, out, lse, counter, scale, kw):  # a persistent kernel's tile counter, zero-filled by the front
    fa4_semantics.fwd(q * (1.0 + counter[0]), k, v, softmax_scale=scale, return_lse=True, out=out, lse=lse,
                      **dict(kw))
    counter += 1.0  # left counted up: a replay with the recorded counter reads 1, not 0


def fwd(q, k, v, softmax_scale=None, return_lse=False, out=None, lse=None, **kw):
    fwd.calls += 1
    counter = torch.zeros(1, dtype=q.dtype, device=q.device)
    key = (q.dtype, q.dim(), tuple(sorted(kw)))
    fwd.compile_cache.setdefault(key, _main)
    fwd.compile_cache[key](q.detach(), k.detach(), v.detach(), out, lse, counter, softmax_scale, tuple(kw.items()))
    return out, lse


fwd.compile_cache = {}
fwd.calls = 0
'''


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_replay_check_compares_bits_where_no_launch_wrote(dtype):
    """replay._agree: cells no launch writes keep the same prior contents in both outputs (an empty buffer's NaN
    too: the rows outside a list are filled after the launch) and agree; a written cell that is NaN in one, or off by
    more than the atomic sums' spread, or any bit off where exact, does not."""
    from megatron_cp.kernels.fa4 import replay

    ref = torch.randn(64, 4, 8).to(dtype)
    ref[10:20] = float("nan")  # garbage of an empty buffer, the same in both
    assert replay._agree(ref.clone(), ref, True) and replay._agree(ref.clone(), ref, False)
    near = ref.clone()
    near[0, 0, 0] = ref[0, 0, 0] * (1 + 2.0 ** -7)  # an atomic sum's last bits
    assert replay._agree(near, ref, False) and not replay._agree(near, ref, True)
    nan = ref.clone()
    nan[0, 0, 0] = float("nan")
    assert not replay._agree(nan, ref, False) and not replay._agree(nan, ref, True)
    signed = ref.clone()
    signed[10:20] = -signed[10:20]  # NaN in the same cells, another sign bit: what the interface wrote, written
    assert replay._agree(signed, ref, True)
    far = ref.clone()
    far[1] = ref[1] * 3 + 1  # a stale or misplaced argument
    assert not replay._agree(far, ref, False)


def test_fa4_forward_reading_a_zeroed_buffer_of_its_front_replays_as_a_program():
    """replay.launch: a forward of one compiled call on the given tensors and a counter its front zero-fills per call
    is recorded as one kernel, whose first replay (the recorded counter, counted up) differs from the interface's
    result; the layer gets the interface's result and later layers take the program path, which allocates and
    zero-fills the counter each call: recorded, its first replay checked, then replayed. Every layer exact."""
    from megatron_cp.kernels.fa4 import replay

    with _standin_module(_COUNTER_STANDIN, "fa4_fwd_standin_counter") as mod:
        runs = _standin_forward_layers(mod, layers=7, seed=40)
        # per run: the kernel's record, its failed check, the program's record, the program's check; then replays
        assert mod.fwd.calls == 4 * len(runs), (mod.fwd.calls, len(runs))
        kernels = [r.replays[sig][0] for r in runs for sig in r.replays]
        assert kernels and not any(replay._CHECKED[id(k)] for k in kernels)
        progs = [p for r in runs for p in r.fwd_programs.values()]
        assert len(progs) == len(runs) and all(p is not None and replay._CHECKED[p[2]] for p in progs)


_BWD_STANDIN = '''
import torch
import torch as kernel_torch  # what the "compiled kernels" use: not the front's allocations
import fa4_semantics


def _pre(dout, scratch):  # "compiled": a kernel writes the front's buffer
    scratch.copy_(dout)


def _main(q, k, v, out, dout, lse, acc, dk, dv, dlse, scale, det, kw):
    # accumulates into the front's zero-filled buffer: a replay that skipped the zero fill would double dq
    dq = kernel_torch.empty_like(q)
    fa4_semantics.bwd(q, k, v, out, dout, lse, scale, deterministic=det, dq=dq, dk=dk, dv=dv, dlse=dlse, **dict(kw))
    acc.add_(dq)


def _post(acc, dq):
    dq.copy_(acc)


def bwd(q, k, v, out, dout, lse, softmax_scale=None, deterministic=False, dq=None, dk=None, dv=None, dlse=None, **kw):
    bwd.calls += 1
    acc = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    scratch = torch.empty_like(dout)
    if MODE == "workspace":  # the kernel reads q from a buffer the front fills with a torch op: stale on a replay
        ws = torch.empty_like(q)
        ws.copy_(q)
        q = ws
    if MODE == "derived":  # the front hands the kernel a tensor it computed (not one it allocated): never replayed
        lse = lse * 1.0
    key = (q.dtype, q.dim(), tuple(sorted(kw)))
    for f, k_ in ((_pre, key), (_main, key), (_post, key)):
        if k_ not in CACHES[f.__name__]:
            CACHES[f.__name__][k_] = f
    _pre_front.compile_cache[key](dout, scratch)
    bwd.compile_cache[key](q, k, v, out, scratch, lse, acc, dk, dv, dlse, softmax_scale, deterministic,
                           tuple(kw.items()))
    _post_front.compile_cache[key](acc, dq)
    return dq, dk, dv


def _pre_front():
    pass


def _post_front():
    pass


CACHES = {"_pre": {}, "_main": {}, "_post": {}}
_pre_front.compile_cache = CACHES["_pre"]
bwd.compile_cache = CACHES["_main"]
_post_front.compile_cache = CACHES["_post"]
bwd.calls = 0
'''


@pytest.mark.parametrize("mode", ["plain", "workspace", "derived"])
def test_fa4_backward_replays_each_runs_program_for_later_layers(mode):
    """replay.launch_bwd: the first layer's backward goes through the interface (a stand-in module with FA4's
    structure: compile caches for a preprocess, the main kernel and a postprocess, a zero-filled accumulator and an
    empty scratch it allocates) and records the run's program; the first replay is checked against the interface,
    later layers run the program with their own tensors and fresh buffers. Every layer's gradients are the
    reference's: where the front computed a kernel argument itself (derived) the program is never made, where a
    kernel read a buffer the front filled by a torch op (workspace) the first replay's check fails and the interface
    runs from then on."""
    from megatron_cp.kernels.fa4 import replay

    with _standin_module(_BWD_STANDIN, f"fa4_bwd_standin_{mode}", MODE=mode) as mod:
        s = 96
        tiles = catalog.tiles(catalog.build("packed", s))
        be = _standin_backend(fa4_semantics.fwd, mod.bwd)
        prep = be.prepare(tiles, s, s)
        runs = prep.runs("bwd", torch.device("cpu"), be.functions, prep.calls.route("bwd"))
        assert len(runs) == 1, "one launch a layer: the counts below assume it"
        keep = tiles_to_dense(tiles, s, s)
        layers = 5
        before = dict(replay.REFUSED)
        for layer in range(layers):
            q, k, v, do, _ = _inputs(s, s, seed=10 + layer)
            out, lse = be.forward(q, k, v, prep, 0.3)
            dq, dk, dv = be.backward(q, k, v, out, lse, do, prep, 0.3)
            ref = reference_attention(q, k, v, keep, 0.3, dout=do)
            for got, want in zip((dq, dk, dv), ref[2:]):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        progs = [p for p in runs[0].bwd_replays.values()]
        if mode == "plain":  # recorded, checked once (one more interface call), then replayed
            assert mod.bwd.calls == 2 and progs[0] is not None and replay._CHECKED[progs[0][2]]
            assert [z for *_, z in progs[0][1]] == [True, False], "the accumulator zero-filled again, the scratch not"
        elif mode == "workspace":  # recorded, its check failed (that layer kept the interface's result): the
            # interface from then on
            assert mod.bwd.calls == layers and progs[0] is not None and not replay._CHECKED[progs[0][2]]
        else:  # never recorded
            assert mod.bwd.calls == layers and progs == [None]
        why = {w: n - before.get((f, w), 0) for (f, w), n in replay.REFUSED.items() if n > before.get((f, w), 0)}
        assert why == {"plain": {}, "workspace": {"the program's first replay differed from the interface's result": 1},
                       "derived": {"argument 5 of compiled call 2 of 3: a tensor the interface computed ((4, 96) "
                                   "torch.float64), not a given tensor, a buffer it allocated or the run's own": 1}
                       }[mode], why
