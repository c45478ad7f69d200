"""MoBA and XAttention selectors: against plain loop re-implementations (float64) on one process, bit-exact
under emulated context parallelism (blocks split over fake ranks), and their hyperparameter checks.

(FlexPrefill and MInference: tests/test_flexprefill_minference_selectors.py.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_cp import masks
from megatron_cp.sparse import Selector, SelectionView, single_view
from megatron_cp.sparse.moba import MoBA, tree_sum
from megatron_cp.sparse.xattention import XAttention

S, HQ, HKV, D = 256, 4, 2, 16
# packed documents whose lengths are not multiples of any block used here
CU = [0, 37, 101, 150, 256]
MASKS = {
    "causal": lambda: masks.causal(S),
    "docs": lambda: masks.varlen(CU, causal=True),
    "docs_bidir": lambda: masks.varlen(CU, causal=False),
}


def qk(seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(S, HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(S, HKV, D, generator=g, dtype=torch.float64)
    # a shared "topic" per 16 keys so that key blocks differ in relevance (not pure noise)
    topic = torch.randn(S // 16, 1, HKV, D, generator=g, dtype=torch.float64)
    k = k + 2 * topic.repeat(1, 16, 1, 1).view(S, HKV, D)
    return q.to(dtype), k.to(dtype)


def ref_envelope(dense: np.ndarray, block: int) -> np.ndarray:
    """int [nb, nb]: 0 empty, 1 partial, 2 full block pairs, from the dense mask."""
    nb = dense.shape[0] // block
    env = np.zeros((nb, nb), dtype=int)
    for i in range(nb):
        for j in range(nb):
            t = dense[i * block:(i + 1) * block, j * block:(j + 1) * block]
            env[i, j] = 2 if t.all() else (1 if t.any() else 0)
    return env


# ------------------------------------------------------------------------------------------- references


def ref_moba(q, k, dense, block, top_k) -> torch.Tensor:
    q, k = q.double().numpy(), k.double().numpy()
    nb = S // block
    env = ref_envelope(dense, block)
    keep = torch.zeros(HQ, nb, nb, dtype=torch.bool)
    for h in range(HQ):
        kh = h // (HQ // HKV)
        for i in range(nb):
            qm = q[i * block:(i + 1) * block, h].mean(0)
            cand = []
            for g in range(nb):
                if env[i, g] > 0 and g != i:
                    cand.append((-float(qm @ k[g * block:(g + 1) * block, kh].mean(0)), g))
            for _, g in sorted(cand)[:top_k]:
                keep[h, i, g] = True
            if env[i, i] > 0:
                keep[h, i, i] = True
    return keep


def ref_xattention(q, k, dense, block, stride, threshold) -> torch.Tensor:
    q, k = q.double().numpy(), k.double().numpy()
    nb, nr, ncol = S // block, block // stride, S // stride
    env = ref_envelope(dense, block)
    th = list(threshold) if isinstance(threshold, (list, tuple)) else [threshold] * HQ
    scale = 1.0 / math.sqrt(D) / stride
    keep = torch.zeros(HQ, nb, nb, dtype=torch.bool)
    for h in range(HQ):
        kh = h // (HQ // HKV)
        mass = np.zeros((nb, nb))
        for r in range(S // stride):  # reduced row r: rows r*stride .. r*stride + stride - 1
            i = r * stride + stride - 1
            sc = np.full(ncol, -np.inf)
            for j in range(ncol):
                if dense[i, j * stride]:  # the antidiagonal's corner next to the diagonal
                    anti = (q[r * stride + stride - 1 - s, h] @ k[j * stride + s, kh] for s in range(stride))
                    sc[j] = sum(anti) * scale
            if np.isfinite(sc).any():
                p = np.exp(sc - sc.max())
                p = p / p.sum()
                for j in range(ncol):
                    mass[(r * stride) // block, j // nr] += p[j]
        for i in range(nb):
            tot = mass[i].sum()
            frac = {g: (mass[i, g] / tot if tot > 0 else 0.0) for g in range(nb) if env[i, g] > 0}
            cum = 0.0
            for g in sorted(frac, key=lambda g: (-frac[g], g)):
                if cum < th[h]:
                    keep[h, i, g] = True
                cum += frac[g]
            firsts = [g for g in range(nb) if env[i, g] > 0]
            if firsts:
                keep[h, i, firsts[0]] = True
            if env[i, i] > 0:
                keep[h, i, i] = True
    return keep


# ------------------------------------------------------------------------------------- single process


def test_protocol_and_tree_sum():
    assert isinstance(MoBA(), Selector) and isinstance(XAttention(), Selector)
    assert (MoBA().name, MoBA().block, MoBA().top_k) == ("moba", 512, 3)
    x = XAttention()
    assert (x.name, x.block, x.stride, x.threshold) == ("xattention", 128, 8, 0.9)
    assert XAttention(threshold=[0.5, 0.9]).threshold == (0.5, 0.9)
    hash(XAttention(threshold=[0.5, 0.9]))
    t = torch.randn(3, 13, 5, dtype=torch.float64)
    torch.testing.assert_close(tree_sum(t, 1), t.sum(1))
    torch.testing.assert_close(tree_sum(t, -1), t.sum(-1))


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("top_k", [1, 3])
def test_moba_matches_reference(mask, top_k):
    m = MASKS[mask]()
    q, k = qk(1)
    sel = MoBA(block=32, top_k=top_k)
    sel.check(HQ, HKV, D, S)
    view = single_view(m, 32, k)
    keep = sel.select(q, k, view)
    assert keep.dtype == torch.bool and keep.shape == (HQ, S // 32, S // 32)
    dense = m.to_dense()
    assert torch.equal(keep, ref_moba(q, k, dense, 32, top_k))
    env = torch.as_tensor(ref_envelope(dense, 32))
    assert torch.equal(view.envelope.long(), env)
    assert not (keep & (env == 0)[None]).any()
    assert (keep.sum(-1) <= top_k + 1).all()


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moba_gates_only_the_envelope_pairs_and_each_as_over_every_pair(mask, dtype):
    """MoBA's gates are computed on the envelope's block pairs only (packed documents: a small part of nq x nb),
    each bitwise the fold over D that every pair's product tensor gave; 0 off the envelope."""
    from megatron_cp.sparse.moba import block_means

    q, k = qk(4, dtype)
    sel, view = MoBA(block=32), single_view(MASKS[mask](), 32, k)
    pooled = view.combine(sel.summaries(k, view))
    got = sel.gates(q, pooled, view)
    qm = block_means(q, 32, pooled.dtype).transpose(0, 1)
    kp = pooled.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)
    every = tree_sum(qm[:, :, None, :] * kp[:, None], -1)
    env = (view.envelope > 0)[None].expand_as(got)
    assert torch.equal(got[env], every[env]) and not got[~env].any()
    qi, _ = sel._pairs(view, q.device)
    assert qi.numel() == int((view.envelope > 0).sum()) < (S // 32) ** 2


def test_moba_default_block_and_ties():
    # block 64, top_k larger than the candidates; equal keys in every block: gate ties -> lower ids first
    m = masks.causal(S)
    q, _ = qk(2)
    k = torch.ones(S, HKV, D, dtype=torch.float64)
    keep = MoBA(block=64, top_k=2).select(q, k, single_view(m, 64, k))
    want = torch.zeros(4, 4, dtype=torch.bool)
    for i in range(4):
        want[i, :min(i, 2)] = True
        want[i, i] = True
    assert torch.equal(keep, want[None].expand(HQ, 4, 4))
    q, k = qk(3)
    assert torch.equal(MoBA(block=64, top_k=8).select(q, k, single_view(m, 64, k)),
                       torch.ones(4, 4, dtype=torch.bool).tril()[None].expand(HQ, 4, 4))
    assert torch.equal(MoBA(block=64).select(q, k, single_view(masks.varlen(CU), 64, k)),
                       ref_moba(q, k, masks.varlen(CU).to_dense(), 64, 3))


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("stride,threshold", [(4, 0.9), (8, (0.3, 0.6, 0.9, 0.95)), (4, 0.5)])
def test_xattention_matches_reference(mask, stride, threshold):
    m = MASKS[mask]()
    q, k = qk(4)
    b = 16 if mask == "docs" else 32  # more blocks per document row to choose from
    nb = S // b
    # small chunk_elements: several chunks of 3 q blocks, the last padded
    sel = XAttention(block=b, stride=stride, threshold=threshold, chunk_elements=3 * HQ * (b // stride) ** 2 * nb)
    sel.check(HQ, HKV, D, S)
    assert sel.chunk_blocks(HQ, nb) == 3
    view = single_view(m, b, k)
    keep = sel.select(q, k, view)
    assert keep.dtype == torch.bool and keep.shape == (HQ, nb, nb)
    assert torch.equal(keep, ref_xattention(q, k, m.to_dense(), b, stride, threshold))
    env = view.envelope > 0
    assert not (keep & ~env[None]).any()
    assert keep.sum() < env.sum() * HQ  # the data is structured enough for some sparsity
    # the default chunking (one chunk here) selects the same
    assert torch.equal(XAttention(block=b, stride=stride, threshold=threshold).select(q, k, view), keep)


def test_xattention_threshold_one_and_sparsity():
    m = masks.causal(S)
    q, k = qk(5)
    view = single_view(m, 32, k)
    lo = XAttention(block=32, stride=8, threshold=0.1).select(q, k, view)
    hi = XAttention(block=32, stride=8, threshold=0.99).select(q, k, view)
    assert (lo <= hi).all() and lo.sum() < hi.sum()
    # the first block and the diagonal are always kept
    assert lo[:, :, 0].all() and lo.diagonal(dim1=1, dim2=2).all()


def test_envelope_cells_matches_keeps():
    from megatron_cp.sparse.xattention import envelope_cells

    m = masks.varlen(CU, causal=True, window=20)
    view = single_view(m, 32)
    rows = torch.arange(-1, S, 3)
    for st in (4, 8):
        cells = envelope_cells(view, rows, st)
        want = view.keeps(rows[:, None], torch.arange(S // st)[None] * st)
        assert torch.equal(cells, want)


# ------------------------------------------------------------------------------ emulated context parallel


def split_blocks(nb: int, cp: int, seed: int) -> list[torch.Tensor]:
    """Blocks spread over ``cp`` fake ranks in a shuffled, uneven local order."""
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(seed))
    return [perm[r::cp] for r in range(cp)]


def rank_view(single: SelectionView, ids: torch.Tensor, k: torch.Tensor) -> SelectionView:
    b = single.block
    env = single.envelope[ids]
    view = SelectionView(b, single.num_blocks, ids, env, single.traps)

    def keys():  # as the runtime: every block the local envelope touches, ascending ids
        need = torch.nonzero((env > 0).any(0)).flatten()
        return need, k.view(single.num_blocks, b, *k.shape[1:])[need]
    view.envelope_keys = keys
    return view


def local(x: torch.Tensor, ids: torch.Tensor, b: int) -> torch.Tensor:
    return x.view(-1, b, *x.shape[1:])[ids].reshape(-1, *x.shape[1:])


@pytest.mark.parametrize("mask", ["causal", "docs"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_moba_cp_exact(mask, dtype, fused, monkeypatch):
    """Each q block's selection is the same on every emulated CP layout; ``fused``: with the pooling in Triton (as on
    a GPU; float64 keeps PyTorch's), then also what the float64 reference selects."""
    if fused:
        _fused_pooling(monkeypatch)
    m = MASKS[mask]()
    q, k = qk(6, dtype)
    b = 16
    sel = MoBA(block=b, top_k=3)
    single = single_view(m, b, k)
    want = sel.select(q, k, single)
    if fused:
        assert torch.equal(want, ref_moba(q, k, m.to_dense(), b, 3))
    for cp in (2, 4):
        ranks = split_blocks(S // b, cp, seed=cp)
        views = [rank_view(single, ids, k) for ids in ranks]
        # each fake rank's owner-side part first, then the group sum (what view.combine returns)
        parts = [sel.summaries(local(k, ids, b), v) for ids, v in zip(ranks, views)]
        total = sum(parts[1:], parts[0])
        got = torch.zeros_like(want)
        for ids, v, part in zip(ranks, views, parts):
            def combine(t, part=part):
                assert torch.equal(t, part)
                return total
            v.combine = combine
            got[:, ids] = sel.select(local(q, ids, b), local(k, ids, b), v)
        assert torch.equal(got, want), (mask, dtype, cp)


def _fused_pooling(monkeypatch):
    """MoBA's pooling through its Triton launches (Triton's interpreter on CPU tensors), as on a GPU."""
    import megatron_cp.sparse.moba as moba

    monkeypatch.setattr(moba, "fused", lambda x, dtype: dtype == torch.float32 and x.dtype != torch.float64)


def test_fused_block_means_and_pair_dots():
    """The Triton pooling against float64 sums, any strides; a block's mean and a pair's dot product the same bits
    whatever other blocks or pairs the launch holds (the selections' exactness across CP layouts)."""
    from megatron_cp.kernels import block_means_f32, pair_dots

    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(6 * 24, 3, 8, generator=g).to(dtype)  # blocks of 24 rows: 3 steps of 8
        strided = x.transpose(1, 2).contiguous().transpose(1, 2)
        got = block_means_f32(x, 24)
        assert got.dtype == torch.float32 and got.shape == (6, 3, 8)
        assert (got.double() - x.double().view(6, 24, 3, 8).mean(1)).abs().max() < 1e-6
        assert torch.equal(block_means_f32(strided, 24), got)
        assert torch.equal(block_means_f32(x[2 * 24:5 * 24], 24), got[2:5])
    a, b = torch.randn(4, 5, 8, generator=g), torch.randn(2, 7, 8, generator=g)
    ai, bj = torch.tensor([0, 1, 4, 4, 2, 3]), torch.tensor([0, 6, 3, 1, 2, 2])
    got = pair_dots(a, b, ai, bj, 7).view(4, 5, 7)
    want = torch.zeros(4, 5, 7, dtype=torch.float64)
    for i, j in zip(ai.tolist(), bj.tolist()):
        want[:, i, j] = (a[:, i].double() * b.double().repeat_interleave(2, 0)[:, j]).sum(-1)
    assert (got - want).abs().max() < 1e-5 and not got[want == 0].any()
    part = pair_dots(a[:, 4:], b, ai[2:4] - 4, bj[2:4], 7).view(4, 1, 7)
    assert torch.equal(part[:, 0], got[:, 4])


@pytest.mark.parametrize("mask", ["causal", "docs"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_xattention_cp_exact(mask, dtype):
    m = MASKS[mask]()
    q, k = qk(7, dtype)
    b, st = 16, 4
    nb = S // b
    sel = XAttention(block=b, stride=st, threshold=(0.5, 0.8, 0.9, 0.95),
                     chunk_elements=3 * HQ * (b // st) ** 2 * nb)
    single = single_view(m, b, k)
    want = sel.select(q, k, single)
    # the fixed example of the brief: one rank holding blocks 3, 0, 5
    ids = torch.tensor([3, 0, 5])
    assert torch.equal(sel.select(local(q, ids, b), local(k, ids, b), rank_view(single, ids, k)), want[:, ids])
    for cp in (2, 4):
        got = torch.zeros_like(want)
        for ids in split_blocks(nb, cp, seed=10 + cp):
            got[:, ids] = sel.select(local(q, ids, b), local(k, ids, b), rank_view(single, ids, k))
        assert torch.equal(got, want), (mask, dtype, cp)


@pytest.mark.parametrize("mask,b,st,th", [("causal", 32, 8, 0.9), ("docs", 16, 4, (0.5, 0.8, 0.9, 0.95)),
                                          ("docs_bidir", 32, 8, 0.9), ("window", 16, 4, 0.5)])
def test_xattention_fused_masses(mask, b, st, th):
    """The Triton masses (Triton's interpreter on CPU tensors, float32) against the PyTorch ones in float64, and
    the selection from them against the float64 reference; fully masked rows add nothing."""
    m = masks.varlen(CU, causal=True, window=20) if mask == "window" else MASKS[mask]()
    q, k = qk(8)
    sel = XAttention(block=b, stride=st, threshold=th)
    view = single_view(m, b, k)
    want = sel.masses(q, view)
    v32 = single_view(m, b, k.float())
    got = sel.masses_fused(q.float(), v32)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max() < 1e-5
    assert torch.equal(sel.choose(got, v32), ref_xattention(q, k, m.to_dense(), b, st, th))
    assert not got[:, ~(view.envelope > 0)].any()  # nothing outside the envelope


def test_xattention_fused_cp_exact():
    """A q block's fused masses are the same bits whichever rank holds it, with whatever other blocks."""
    m = MASKS["docs"]()
    q, k = qk(9, torch.float32)
    b, st = 16, 4
    sel = XAttention(block=b, stride=st)
    single = single_view(m, b, k)
    want = sel.masses_fused(q, single)
    for cp in (2, 4):
        got = torch.zeros_like(want)
        for ids in split_blocks(S // b, cp, seed=20 + cp):
            got[:, ids] = sel.masses_fused(local(q, ids, b), rank_view(single, ids, k))
        assert torch.equal(got, want), cp


def test_partial_cells_match_envelope_cells():
    from megatron_cp.sparse.xattention import envelope_cells, partial_cells

    m = masks.varlen(CU, causal=True, window=20)
    b, st = 32, 4
    nr = b // st
    view = single_view(m, b)
    env = view.envelope.numpy()
    slot, bits = partial_cells(np.asarray(m.traps), np.arange(S // b), env, b, st)
    assert ((slot == -1) == (env == 2)).all() and ((slot == -2) == (env == 0)).all()
    for i, j in zip(*np.nonzero(env == 1)):
        rows = torch.as_tensor(i * b + np.arange(nr) * st + st - 1)
        cells = envelope_cells(view, rows, st, j * nr, (j + 1) * nr).numpy()
        got = (bits[slot[i, j], :, 0][:, None] >> np.arange(nr)[None]) & 1
        assert (got.astype(bool) == cells).all(), (i, j)


# --------------------------------------------------------------------------------------------- checks


@pytest.mark.parametrize("make,args,match", [
    (lambda: MoBA(top_k=0), (4, 2, 16, 1024), "top_k must be a positive int, got 0"),
    (lambda: MoBA(top_k=2.5), (4, 2, 16, 1024), "got 2.5"),
    (lambda: MoBA(top_k=True), (4, 2, 16, 1024), "got True"),
    (lambda: MoBA(block=100), (4, 2, 16, 1024), "not a multiple of block 100"),
    (lambda: MoBA(block=0), (4, 2, 16, 1024), "block must be a positive int, got 0"),
    (lambda: MoBA(block=64), (6, 4, 16, 1024), "num_q_heads 6 is not a multiple of num_kv_heads 4"),
    (lambda: XAttention(threshold=1.5), (4, 2, 16, 1024), "threshold must be .* got 1.5"),
    (lambda: XAttention(threshold=0.0), (4, 2, 16, 1024), "threshold must be .* got 0.0"),
    (lambda: XAttention(threshold="0.9"), (4, 2, 16, 1024), "threshold must be"),
    (lambda: XAttention(threshold=[0.9, 0.5]), (4, 2, 16, 1024), r"one value per query head \(4\), got 2"),
    (lambda: XAttention(threshold=[0.9, 0.5, 0.1, 2.0]), (4, 2, 16, 1024), "got 2.0"),
    (lambda: XAttention(stride=3), (4, 2, 16, 1024), "stride 3 must divide block 128"),
    (lambda: XAttention(stride=0), (4, 2, 16, 1024), "stride must be a positive int, got 0"),
    (lambda: XAttention(block=96), (4, 2, 16, 1024), "not a multiple of block 96"),
    (lambda: XAttention(chunk_elements=0), (4, 2, 16, 1024), "chunk_elements must be a positive int, got 0"),
    (lambda: XAttention(), (4, 0, 16, 1024), "num_kv_heads must be a positive int, got 0"),
])
def test_bad_hyperparameters(make, args, match):
    with pytest.raises(ValueError, match=match):
        make().check(*args)


@pytest.mark.parametrize("make,match", [
    (lambda: MoBA(top_k=0), "top_k must be a positive int, got 0"),
    (lambda: MoBA(block=0), "block must be a positive int, got 0"),
    (lambda: XAttention(threshold=2.0), "threshold must be .* got 2.0"),
    (lambda: XAttention(threshold=[0.9, 2.0]), "got 2.0"),
    (lambda: XAttention(stride=3), "stride 3 must divide block 128"),
    (lambda: XAttention(chunk_elements=0), "chunk_elements must be a positive int, got 0"),
])
def test_bad_hyperparameters_refused_when_made(make, match):
    """What needs no shapes fails when the selector is made, not at its first call."""
    with pytest.raises(ValueError, match=match):
        make()


def test_good_hyperparameters():
    MoBA().check(32, 8, 128, 1 << 17)
    XAttention().check(32, 8, 128, 1 << 17)
    XAttention(stride=16, threshold=[0.9] * 32).check(32, 8, 128, 1 << 17)
    XAttention(threshold=1).check(4, 4, 64, 1024)


# --------------------------------------------------------------------- the runtime, on gloo CPU ranks


def _runtime_rank(rank, world, selectors, q, k, chunk):
    import megatron_cp as mcp
    import torch.distributed as dist
    from megatron_cp.sparse import select_blocks

    group = dist.group.WORLD
    plan = mcp.plan(MASKS["docs"](), world, chunk_size=chunk, guest_rows="none", block=selectors[0].block)
    ql = mcp.dispatch(torch.from_numpy(q), plan, group)
    kl = mcp.dispatch(torch.from_numpy(k), plan, group)
    q_blocks = plan.local_ids(rank)[::selectors[0].block] // selectors[0].block
    return q_blocks, [select_blocks(ql, kl, plan, group, s).numpy() for s in selectors]


@pytest.mark.parametrize("world,chunk", [(2, 16), (4, 32)])
def test_runtime_select_blocks_exact(world, chunk):
    """select_blocks under a real plan (view.combine = all-reduce, envelope_keys = the runtime's K exchange)
    equals the single-process selection of each rank's blocks."""
    from megatron_cp.testing import run_ranks

    b = 16
    sels = [MoBA(block=b, top_k=2), XAttention(block=b, stride=4, threshold=(0.5, 0.8, 0.9, 0.95))]
    q, k = qk(8)
    m = MASKS["docs"]()
    want = [s.select(q, k, single_view(m, b, k)) & (single_view(m, b).envelope > 0)[None] for s in sels]
    for q_blocks, keeps in run_ranks(_runtime_rank, world, sels, q.numpy(), k.numpy(), chunk):
        for w, got in zip(want, keeps):
            assert np.array_equal(got, w[:, q_blocks].numpy())
