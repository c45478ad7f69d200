"""Triton tile-list kernels on CPU through Triton's interpreter, against a dense fp64 reference.

TRITON_INTERPRET must be set before triton is first imported: tests/conftest.py does it for the whole
session. Tiny shapes keep the interpreter fast (about a minute on 2 cores).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from megatron_cp.kernels import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL  # noqa: E402
from megatron_cp.kernels import KernelConfig, PhaseConfigs, TritonBackend, TritonConfig  # noqa: E402
from megatron_cp.kernels.pieces import kept_area  # noqa: E402
from megatron_cp.kernels.triton.blocks import build_schedules  # noqa: E402
from megatron_cp.masks.catalog import tiles_to_dense  # noqa: E402
from megatron_cp.testing import reference_attention  # noqa: E402


def backend(bm=16, bn=16, d=16, tma=False, split_min=16):
    c = KernelConfig(bm, bn, 4, 1, tma)
    return TritonBackend(TritonConfig({d: PhaseConfigs(c, KernelConfig(bn, bm, 4, 1, tma), c)},
                                      dkdv_split_min=split_min))


def run_case(tiles, sq, sk, hq=2, hkv=1, d=16, bm=16, bn=16, dtype=torch.float32, seed=0, with_dlse=False,
             atol=1e-4, tma=False, split_min=16):
    torch.manual_seed(seed)
    tiles = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 5)
    q = torch.randn(sq, hq, d, dtype=dtype)
    k = torch.randn(sk, hkv, d, dtype=dtype)
    v = torch.randn(sk, hkv, d, dtype=dtype)
    dout = torch.randn(sq, hq, d, dtype=dtype)
    dlse = torch.randn(sq, hq) if with_dlse else None
    scale = 0.5
    be = backend(bm, bn, d, tma, split_min)
    prep = be.prepare(tiles, sq, sk, head_dims=(d,))
    out, lse = be.forward(q, k, v, prep, scale)
    keep = tiles_to_dense(tiles, sq, sk)  # raises if two tiles share a cell
    r_out, r_lse, r_dq, r_dk, r_dv = reference_attention(q, k, v, keep, scale, dout=dout, dlse=dlse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = ~keep.any(1)
    assert torch.equal(torch.isinf(lse), empty[:, None].expand_as(lse)), "lse = -inf exactly on empty rows"
    assert (lse[empty] == float("-inf")).all() and (out[empty] == 0).all()
    torch.testing.assert_close(out.double(), r_out, atol=atol, rtol=0)
    fin = ~empty
    torch.testing.assert_close(lse[fin].double(), r_lse[fin], atol=atol, rtol=0)
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse
    dq, dk, dv = be.backward(q, k, v, out, lse, dout, prep, scale, delta)
    for name, a, b in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
        assert not torch.isnan(a).any(), name
        torch.testing.assert_close(a.double(), b, atol=atol * 4, rtol=0, msg=lambda m: f"{name}: {m}")
    return be, prep, (q, k, v, dout, out, lse, delta), (dq, dk, dv)


# -- one tile per kind, equal and unequal lengths --------------------------------------------------
@pytest.mark.parametrize("kind", [FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL])
def test_single_tile_square(kind):
    run_case([0, 48, 0, 48, kind], 48, 48)


@pytest.mark.parametrize("kind", [FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL])
@pytest.mark.parametrize("sq,sk", [(40, 72), (72, 40)])
def test_single_tile_unequal(kind, sq, sk):
    # also leaves rows without keys for causal with sq > sk (fully masked rows)
    run_case([0, sq, 0, sk, kind], sq, sk)


def test_offset_tile_partial_blocks_and_empty_rows():
    # a tile that starts and ends inside blocks; rows 0..4 and 43.. are covered by nothing
    run_case([[5, 43, 7, 61, CAUSAL]], 50, 64)


# -- several tiles: shared rows, packed documents, global + local ----------------------------------
def test_packed_documents_causal():
    cu = [0, 13, 40, 41, 77, 96]
    run_case([[a, b, a, b, CAUSAL] for a, b in zip(cu[:-1], cu[1:])], 96, 96, hq=2, hkv=2)


def test_tiles_sharing_rows_global_local():
    # global keys 0..8 seen by every row, causal band over the rest, plus an inv_causal tile
    tiles = [[0, 96, 0, 8, FULL], [8, 96, 8, 96, CAUSAL], [0, 8, 8, 40, INV_CAUSAL]]
    run_case(tiles, 96, 96, hq=4, hkv=2)


def test_bi_causal_and_full_pieces_sharing_rows_and_blocks():
    tiles = [[0, 30, 0, 50, BI_CAUSAL], [0, 30, 50, 64, FULL], [30, 64, 10, 20, FULL], [30, 64, 33, 64, CAUSAL]]
    run_case(tiles, 64, 64)


def test_sliding_window_as_tiles():
    # window w (keys q-w+1..q): per chunk of w rows a causal diagonal tile and an inv_causal tile of
    # the w-1 keys before the chunk (top-left aligned: k >= q - w + 1)
    run_case(window_tiles(24, 80), 80, 80)


def window_tiles(w, s):
    """Sliding window w over s rows as tiles: per chunk of w rows a causal diagonal tile and an
    inv_causal tile of the w - 1 keys before the chunk."""
    tiles = []
    for q0 in range(0, s, w):
        q1 = min(q0 + w, s)
        tiles.append([q0, q1, q0, q1, CAUSAL])
        if q0 > 0:
            tiles.append([q0, q1, q0 - w + 1, q0, INV_CAUSAL])
    return tiles


# -- GQA / MQA, head_dim 32, asymmetric blocks ----------------------------------------------------
@pytest.mark.parametrize("hq,hkv", [(4, 1), (4, 2), (6, 3)])
def test_gqa(hq, hkv):
    run_case([[0, 64, 0, 64, CAUSAL]], 64, 64, hq=hq, hkv=hkv)


@pytest.mark.parametrize("bm,bn,tma", [(32, 16, False), (16, 32, False), (32, 16, True)])
def test_head_dim_32_asymmetric_blocks(bm, bn, tma):
    tiles = [[0, 50, 0, 70, CAUSAL], [50, 90, 0, 20, FULL], [50, 90, 20, 70, BI_CAUSAL]]
    run_case(tiles, 90, 70, hq=2, hkv=1, d=32, bm=bm, bn=bn, tma=tma)


def test_block_pointer_addressing_gqa_partial_rows():
    run_case([[5, 43, 7, 61, CAUSAL], [43, 50, 0, 64, FULL]], 50, 64, hq=4, hkv=2, tma=True)


@pytest.mark.parametrize("tma", [False, True])
def test_split_long_key_columns(tma):
    # attention sinks + window: key block 0 is met by every q block; split_min=2 cuts its dK/dV work into
    # segments reduced in a fixed order (checked bitwise-deterministic below)
    s, w = 112, 16  # 7 q blocks: key block 0's 7 entries exceed 2x the mean (19 / 7) + 1
    tiles = [[0, 2 * w, 0, 2 * w, CAUSAL]]
    for q0 in range(2 * w, s, w):
        tiles += [[q0, q0 + w, q0, q0 + w, CAUSAL], [q0, q0 + w, q0 - w, q0, INV_CAUSAL], [q0, q0 + w, 0, 4, FULL]]
    be, prep, (q, k, v, dout, out, lse, delta), first = run_case(tiles, s, s, hq=4, hkv=2, tma=tma, split_min=2)
    work = prep.schedules(16, 16, "cpu")[2].work
    assert work.n_slots > 0, "the sink column must be split"
    again = be.backward(q, k, v, out, lse, dout, prep, 0.5, delta)
    assert all(torch.equal(x, y) for x, y in zip(first, again))


def test_dlse_gradient():
    run_case([[0, 40, 0, 40, CAUSAL], [40, 64, 0, 64, FULL]], 64, 64, with_dlse=True)


def test_fp16_inputs():
    run_case([[0, 48, 0, 48, CAUSAL]], 48, 48, dtype=torch.float16, atol=2e-2)


def test_no_tiles():
    be = backend()
    tiles = torch.zeros(0, 5, dtype=torch.int32)
    q = torch.randn(20, 2, 16)
    k = torch.randn(30, 1, 16)
    prep = be.prepare(tiles, 20, 30, head_dims=(16,))
    out, lse = be.forward(q, k, k, prep, 0.3)
    assert (out == 0).all() and (lse == float("-inf")).all()
    dq, dk, dv = be.backward(q, k, k, out, lse, torch.randn_like(q), prep, 0.3)
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


def test_accumulate_two_stages_equals_one():
    torch.manual_seed(3)
    sq, sk, d = 48, 64, 16
    t_all = [[0, 48, 0, 32, FULL], [0, 48, 32, 64, CAUSAL]]
    q, k, v = torch.randn(sq, 2, d), torch.randn(sk, 1, d), torch.randn(sk, 1, d)
    be = backend()
    full = be.prepare(torch.tensor(t_all, dtype=torch.int32), sq, sk, head_dims=(d,))
    s1 = be.prepare(torch.tensor(t_all[:1], dtype=torch.int32), sq, sk, head_dims=(d,))
    s2 = be.prepare(torch.tensor(t_all[1:], dtype=torch.int32), sq, sk, head_dims=(d,))
    out_ref, lse_ref = be.forward(q, k, v, full, 0.4)
    out = torch.zeros_like(q)
    lse = torch.full((sq, 2), float("-inf"))
    be.forward_accumulate(q, k, v, s1, 0.4, out, lse)
    be.forward_accumulate(q, k, v, s2, 0.4, out, lse)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=0)


def test_accumulate_leaves_rows_without_tiles_untouched():
    """An accumulating launch visits only the q blocks its tiles cover (the early-rows split relies on
    it): other rows keep whatever they hold, bitwise, and covered rows that held nothing (lse -inf) get
    exactly what a plain forward of the same list gives."""
    torch.manual_seed(5)
    sq, sk, d = 96, 64, 16
    tiles = torch.tensor([[32, 64, 0, 40, CAUSAL], [32, 64, 40, 64, FULL]], dtype=torch.int32)
    q, k, v = torch.randn(sq, 2, d), torch.randn(sk, 1, d), torch.randn(sk, 1, d)
    be = backend()
    prep = be.prepare(tiles, sq, sk, head_dims=(d,))
    _, rows, _ = prep.schedules(16, 16, "cpu")
    assert rows.n_busy == 2 and rows.order.shape[1] == 6
    o_plain, l_plain = be.forward(q, k, v, prep, 0.4)
    out = torch.full((sq, 2, d), 7.0)
    lse = torch.full((sq, 2), 1.5)
    out[32:64], lse[32:64] = 0.0, float("-inf")
    be.forward_accumulate(q, k, v, prep, 0.4, out, lse)
    assert (out[:32] == 7.0).all() and (out[64:] == 7.0).all() and (lse[:32] == 1.5).all() and (lse[64:] == 1.5).all()
    assert torch.equal(out[32:64], o_plain[32:64]) and torch.equal(lse[32:64], l_plain[32:64])


def test_row_class_counts_covered_rows_only():
    """A list covering a few long rows of a long sequence is "long" (the early/late split's late list)."""
    from megatron_cp.kernels.pieces import covered_rows

    be = backend()
    t = torch.tensor([[0, 128, 0, 8192, FULL], [100, 256, 0, 8192, FULL]], dtype=torch.int32)
    assert covered_rows(t) == 256
    assert be.prepare(t[:1], 16384, 8192, head_dims=(16,)).row_class == "long"
    assert be.prepare(torch.tensor([[0, 128, 0, 64, CAUSAL]], dtype=torch.int32), 128, 8192,
                      head_dims=(16,)).row_class == "short"


def test_backward_deterministic():
    be, prep, (q, k, v, dout, out, lse, delta), first = run_case([[0, 64, 0, 64, CAUSAL]], 64, 64, hq=4, hkv=1)
    again = be.backward(q, k, v, out, lse, dout, prep, 0.5, delta)
    assert all(torch.equal(x, y) for x, y in zip(first, again))


# -- schedule: full blocks are all kept, partial+full blocks cover every kept cell ------------------
@pytest.mark.parametrize("bm,bn", [(16, 16), (32, 16), (16, 64)])
def test_schedule_covers_mask(bm, bn):
    sq, sk = 100, 90
    tiles = torch.tensor([[0, 40, 0, 45, CAUSAL], [40, 100, 0, 30, FULL], [40, 100, 30, 90, BI_CAUSAL],
                          [0, 40, 45, 90, INV_CAUSAL]], dtype=torch.int32)
    keep = tiles_to_dense(tiles, sq, sk)
    assert kept_area(tiles) == int(keep.sum())
    rows, cols = build_schedules(tiles, sq, sk, bm, bn)
    covered = torch.zeros(sq, sk, dtype=torch.bool)
    ptr, mid, off, tid = rows.ptr[0], rows.mid[0], rows.off[0], rows.tile[0]
    assert sorted(rows.order[0].tolist()) == list(range(len(mid)))
    for m in range(len(mid)):
        for e in range(int(ptr[m]), int(ptr[m + 1])):
            n0 = int(off[e])
            blk = keep[m * bm:(m + 1) * bm, n0:n0 + bn]
            assert blk.any(), "empty blocks must not be listed"
            if e < int(mid[m]):
                assert blk.all() and blk.shape == (bm, bn), "full blocks are entirely kept"
            covered[m * bm:(m + 1) * bm, n0:n0 + bn] = True
    assert not (keep & ~covered).any()
    # the column schedule lists the same (block, tile) pairs
    pairs_r = {(m, int(off[e]) // bn, int(tid[e])) for m in range(len(mid)) for e in range(int(ptr[m]), int(ptr[m + 1]))}
    cp, co, ct = cols.ptr[0], cols.off[0], cols.tile[0]
    pairs_c = {(int(co[e]) // bm, n, int(ct[e])) for n in range(len(cols.mid[0])) for e in range(int(cp[n]), int(cp[n + 1]))}
    assert pairs_r == pairs_c
    assert rows.n_full == cols.n_full and rows.n_partial == cols.n_partial


@pytest.mark.parametrize("with_dlse", [False, True])
def test_row_delta_head_major(with_dlse):
    """delta = rowsum(dout * out) - dlse from the one-pass kernel, against fp64, on a strided out (a
    slice of a wider tensor) and a ragged length (sq not a multiple of the row block); its layout is the
    head-major view the backward kernels read contiguously."""
    from megatron_cp.kernels.triton.delta import head_major, row_delta

    g = torch.Generator().manual_seed(3)
    sq, hq, d = 77, 3, 16
    wide = torch.randn(sq, hq + 2, d, generator=g).half()
    out = wide[:, 1:hq + 1]  # strides (hq+2)*d, d, 1
    dout = torch.randn(sq, hq, d, generator=g).half()
    dlse = torch.randn(sq, hq, generator=g) if with_dlse else None
    delta = row_delta(out, dout, dlse)
    ref = (out.double() * dout.double()).sum(-1) - (dlse.double() if with_dlse else 0)
    assert delta.shape == (sq, hq) and delta.dtype == torch.float32
    assert delta.stride() == (1, sq)
    assert (delta.double() - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())
    hm = head_major(ref.float())
    assert hm.stride() == (1, sq) and torch.equal(hm, ref.float())
    assert head_major(hm) is hm  # already head-major fp32: no copy


def test_row_classes_pick_block_shapes():
    """prepare() sorts tile lists into row classes: long rows, short rows whose 128 x 64 blocks are mostly
    full ("blocky": a 128-row forward block) and other short rows (64 x 64); head dims without a blocky
    entry fall back to their short configs."""
    from megatron_cp.kernels import DEFAULT_CONFIGS, TritonConfig as TC

    s, b = 16384, 512
    be = TritonBackend(TC())
    # blocks of 512, causal, q block - k block divisible by 4 (the benchmark's strided mask)
    stride = torch.tensor([[q, q + b, k, k + b, CAUSAL if q == k else FULL]
                           for q in range(0, s, b) for k in range(0, q + 1, b) if (q - k) % (4 * b) == 0])
    # sliding window of 1024 keys as 64-row causal bands
    band = torch.tensor([[q, q + 64, max(0, q - 1024), q + 64, CAUSAL] for q in range(0, s, 64)])
    assert be.prepare(stride, s, s, head_dims=(128,)).row_class == "blocky"
    assert be.prepare(band, s, s, head_dims=(128,)).row_class == "short"
    assert be.prepare(torch.tensor([[0, 64, 0, 8192, FULL]]), 64, 8192, head_dims=(128,)).row_class == "long"
    assert TC().for_head_dim(128, "blocky").fwd == DEFAULT_CONFIGS[(128, "blocky")].fwd
    assert TC().for_head_dim(64, "blocky") == DEFAULT_CONFIGS[(64, "short")]


# -- the backend protocol (kernels/protocol.py), every backend ----------------------------------------------
def _protocol_backends():
    from megatron_cp.kernels import ReferenceBackend

    return {"reference": lambda: ReferenceBackend(block_q=16, block_k=16), "triton": lambda: backend()}


@pytest.mark.parametrize("name,dtype", [("reference", torch.float64), ("reference", torch.float32),
                                        ("triton", torch.float32)])
def test_protocol_accumulate_and_backward_into(name, dtype):
    """forward_accumulate over two tile lists equals one forward over their union and the fp64 dense reference
    (megatron_cp.testing), rows a list does not cover stay bitwise as they were; backward_into adds exactly
    backward's gradients into running sums of accumulate_dtype (dK / dV the strided halves of one buffer)."""
    from megatron_cp.kernels import Backend, accumulate_dtype

    be = _protocol_backends()[name]()
    assert isinstance(be, Backend) and be.supports(torch.device("cpu"), dtype, 16) is None
    sq, sk, hq, hkv, d, scale = 48, 64, 4, 2, 16, 0.3
    t1 = [[0, 48, 0, 32, FULL]]
    t2 = [[8, 40, 32, 64, CAUSAL]]  # rows 0..8 and 40..48 keep nothing of it
    tiles = torch.tensor(t1 + t2, dtype=torch.int32)
    g = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(n, h, d, generator=g, dtype=torch.float64)
                     for n, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
    o_ref, l_ref, dq_ref, dk_ref, dv_ref = reference_attention(q, k, v, tiles_to_dense(tiles, sq, sk), scale, dout=dout)
    q, k, v, dout = (x.to(dtype) for x in (q, k, v, dout))
    adt = accumulate_dtype(dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    p1, p2, p_all = (be.prepare(torch.tensor(t, dtype=torch.int32), sq, sk) for t in (t1, t2, t1 + t2))
    out, lse = be.forward(q, k, v, p_all, scale)
    assert out.dtype == dtype and lse.dtype == adt  # float64 for float64 inputs (protocol)
    acc = torch.zeros(sq, hq, d, dtype=adt)
    run = torch.full((sq, hq), float("-inf"), dtype=adt)
    be.forward_accumulate(q, k, v, p1, scale, acc, run)
    before = acc.clone(), run.clone()
    be.forward_accumulate(q, k, v, p2, scale, acc, run)
    outside = torch.cat([torch.arange(0, 8), torch.arange(40, 48)])
    assert torch.equal(acc[outside], before[0][outside]) and torch.equal(run[outside], before[1][outside])
    assert (acc - o_ref).abs().max() < tol and (run - l_ref).abs().max() < tol
    assert (out.to(adt) - acc).abs().max() < tol and (lse - run).abs().max() < tol
    with pytest.raises(ValueError, match="out must be a"):
        be.forward_accumulate(q, k, v, p1, scale, acc.half(), run)
    # backward_into == backward added, and both == the fp64 reference (from the running lse)
    lse = run
    gq, gk, gv = be.backward(q, k, v, out, lse, dout, p_all, scale, None)
    dq0 = torch.randn(sq, hq, d, generator=g, dtype=adt)
    dkv0 = torch.randn(sk, 2 * hkv, d, generator=g, dtype=adt)
    dq, dkv = dq0.clone(), dkv0.clone()
    assert be.backward_into(q, k, v, out, lse, dout, p_all, scale, None, dq, dkv[:, :hkv], dkv[:, hkv:]) is None
    assert torch.equal(dq, dq0 + gq.to(adt))
    assert torch.equal(dkv[:, :hkv], dkv0[:, :hkv] + gk.to(adt)) and torch.equal(dkv[:, hkv:], dkv0[:, hkv:] + gv.to(adt))
    for got, want in ((gq, dq_ref), (gk, dk_ref), (gv, dv_ref)):
        assert (got.double() - want).abs().max() < 4 * tol
    with pytest.raises(ValueError, match="dq must be a"):
        be.backward_into(q, k, v, out, lse, dout, p_all, scale, None, dq.half(), dkv[:, :hkv], dkv[:, hkv:])


def test_supports_says_why_not():
    """supports(): None for inputs a backend runs, else the reason (Triton: no float64, head dims 16 .. 256
    (padded to a power of two inside), a v head dim of its own, CUDA or the CPU interpreter; the reference
    runs every float dtype anywhere)."""
    from megatron_cp.kernels import ReferenceBackend

    be = TritonBackend()
    cpu = torch.device("cpu")
    assert be.supports(cpu, torch.float32, 64) is None and be.supports("cuda", torch.bfloat16, 128) is None
    assert "float64" in be.supports(cpu, torch.float64, 64) and "reference" in be.supports(cpu, torch.float64, 64)
    assert be.supports(cpu, torch.float16, 48) is None and be.supports(cpu, torch.bfloat16, 192, 128) is None
    assert "head_dim" in be.supports(cpu, torch.float16, 8) and "head_dim" in be.supports(cpu, torch.float16, 320)
    assert "v head_dim" in be.supports(cpu, torch.float16, 192, 512)
    ref = ReferenceBackend()
    assert ref.supports(cpu, torch.float64, 48) is None and ref.supports("cuda", torch.bfloat16, 8) is None
    assert "int32" in ref.supports(cpu, torch.int32, 16)


# -- MLA / large heads: a v head dim of its own, head dims that are not powers of two, 256 ---------------
def run_dims(tiles, sq, sk, dk, dv, hq=4, hkv=2, bm=16, bn=16, split_min=1 << 30, with_dlse=True, seed=0):
    """Forward and backward with q/k head dim ``dk`` and v head dim ``dv`` against fp64 autograd
    (reference.dense_attention); returns the max abs errors."""
    from reference import dense_attention

    torch.manual_seed(seed)
    tiles = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 5)
    q, k, v = torch.randn(sq, hq, dk), torch.randn(sk, hkv, dk), torch.randn(sk, hkv, dv)
    dout, dlse = torch.randn(sq, hq, dv), torch.randn(sq, hq)
    be = backend(bm, bn, dk, split_min=split_min)
    prep = be.prepare(tiles, sq, sk, head_dims=(dk,))
    out, lse = be.forward(q, k, v, prep, 0.3)
    assert out.shape == (sq, hq, dv)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ro, rl = dense_attention(*leaves, tiles_to_dense(tiles, sq, sk), 0.3)
    fin = torch.isfinite(rl)
    ((ro * dout.double()).sum() + (torch.where(fin, rl, 0) * dlse.double()).sum()).backward()
    delta = (dout * out).sum(-1) - (dlse if with_dlse else 0)
    grads = be.backward(q, k, v, out, lse, dout, prep, 0.3, delta)
    errs = {"out": (out.double() - ro).abs().max(), "lse": (lse.double()[fin] - rl[fin]).abs().max()}
    for n, g, r in zip(("dq", "dk", "dv"), grads, leaves):
        assert g.shape == r.shape
        errs[n] = (g.double() - r.grad).abs().max()
    return {n: float(e) for n, e in errs.items()}


@pytest.mark.parametrize("dk,dv", [(48, 32), (32, 48), (256, 256)])
def test_value_head_dim_of_its_own_and_padded_dims(dk, dv):
    """MLA's 192/128 in miniature (48/32: q/k padded to a 64 block, v exact), a padded v, and 256; packed
    documents with an empty row, tiles sharing rows, partial blocks."""
    tiles = [[0, 13, 0, 13, CAUSAL], [14, 40, 14, 40, CAUSAL], [14, 40, 0, 5, FULL]]
    errs = run_dims(tiles, 40, 40, dk, dv)
    assert max(errs.values()) < 1e-4, errs


def test_value_head_dim_split_columns_and_accumulate():
    """Split key columns (the dK/dV workspace of padded blocks) and the staged protocol (forward_accumulate,
    backward_into) with v head dim 32 beside q/k 48."""
    tiles = [[0, 64, 0, 64, CAUSAL]]
    errs = run_dims(tiles, 64, 64, 48, 32, split_min=16)
    assert max(errs.values()) < 1e-4, errs
    torch.manual_seed(1)
    q, k, v = torch.randn(40, 2, 48), torch.randn(40, 1, 48), torch.randn(40, 1, 32)
    be = backend(16, 16, 48)
    a = be.prepare(torch.tensor([[0, 40, 0, 20, FULL]], dtype=torch.int32), 40, 40, head_dims=(48,))
    b = be.prepare(torch.tensor([[0, 40, 20, 40, CAUSAL]], dtype=torch.int32), 40, 40, head_dims=(48,))
    whole = be.prepare(torch.tensor([[0, 40, 0, 20, FULL], [0, 40, 20, 40, CAUSAL]], dtype=torch.int32), 40, 40,
                       head_dims=(48,))
    acc, lse = torch.zeros(40, 2, 32), torch.full((40, 2), float("-inf"))
    be.forward_accumulate(q, k, v, a, 0.3, acc, lse)
    be.forward_accumulate(q, k, v, b, 0.3, acc, lse)
    out, lse1 = be.forward(q, k, v, whole, 0.3)
    assert (acc - out).abs().max() < 1e-5 and (lse - lse1).abs().max() < 1e-5
    dout = torch.randn(40, 2, 32)
    want = be.backward(q, k, v, out, lse1, dout, whole, 0.3)
    run = [torch.zeros(40, 2, 48), torch.zeros(40, 1, 48), torch.zeros(40, 1, 32)]
    for p in (a, b):
        be.backward_into(q, k, v, out, lse1, dout, p, 0.3, None, *run)
    assert all((x - w).abs().max() < 1e-5 for x, w in zip(run, want))
