"""Early rows (planner.early): the split of a rank's tiles into rows that need only its own keys
(computed while the exchange flies) and the rest, and the runtime path that uses it, exact against the
fp64 reference on gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp import masks as M
from megatron_cp.masks import geometry
from megatron_cp.planner import early as early_mod
from megatron_cp.planner.early import KEY_BLOCK, early_split

from _dist import run_ranks
from reference import dense_attention, local_errors
from test_attention_dist import builder_masks, random_mask


def _cells(tiles: np.ndarray, sq: int, sk: int) -> np.ndarray:
    """Per-cell count of the tiles covering it (so overlaps show up as 2)."""
    d = np.zeros((sq, sk), dtype=np.int64)
    for t in np.asarray(tiles).reshape(-1, 5).tolist():
        tr = geometry.slice_to_trap(*t)
        if tr is not None:
            d += geometry.traps_to_dense(np.asarray([tr]), sq, sk)
    return d


def _masks():
    out = dict(builder_masks())
    out.update({f"random{s}": random_mask(s) for s in range(6)})
    out["docs"] = M.varlen([0, 9, 40, 41, 77, 120], causal=True)
    out["docs_long"] = M.varlen([0, 70, 75, 200, 230, 390, 400, 480], causal=True)
    out["window_long"] = M.sliding_window(320, 24, 0)
    return out


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("align", [1, 4, 16])
def test_split_is_exact_and_row_disjoint(cp, align):
    used = 0
    for name, mask in _masks().items():
        plan = mcp.plan(mask, cp)
        for r in range(cp):
            rp = plan.ranks[r]
            sp = early_split(plan, r, align)
            n, blen = rp.num_tokens, rp.buffer_len
            whole = _cells(rp.tiles, n, blen)
            e, lt = _cells(sp.early, n, blen), _cells(sp.late, n, blen)
            assert np.array_equal(e + lt, whole), (name, r)  # same cells, nothing twice
            e_rows, l_rows = e.any(1), lt.any(1)
            assert not (e_rows & l_rows).any(), (name, r)  # one call per row
            late = np.zeros(n, dtype=bool)
            for a, b in sp.late_rows.tolist():
                assert a % align == 0 and (b % align == 0 or b == n), (name, r, a, b)
                late[a:b] = True
            assert not (e_rows & late).any() and not (l_rows & ~late).any(), (name, r)
            own, recv = rp.buffer_index()
            assert not e[:, recv].any(), (name, r)  # early rows never read a received key
            # every late row reads a received key somewhere in its block
            for a, b in sp.late_rows.tolist():
                for b0 in range(a, b, align):
                    assert lt[b0:b0 + align][:, recv].any(), (name, r, b0)
            if len(sp.early) and len(recv):
                blk_own = np.zeros(-(-blen // KEY_BLOCK), dtype=bool)
                blk_own[own // KEY_BLOCK] = True
                assert set(sp.pad_rows.tolist()) == set(recv[blk_own[recv // KEY_BLOCK]].tolist())
            used += bool(len(sp.early) and len(sp.late))
    assert used >= 3  # both halves occur in several cases (coverage of the check above)


def test_plan_cache_and_bad_align():
    plan = mcp.plan(M.varlen([0, 30, 64], causal=True), 2)
    assert early_split(plan, 0, 8) is early_split(plan, 0, 8)
    with pytest.raises(ValueError, match="align must be positive, got 0"):
        early_split(plan, 0, 0)


def _dist_cases(rank, world, backend, align):
    early_mod.EARLY_ALIGN = align  # small blocks so that tiny masks have early and late rows
    masks = _masks()
    names = ["docs", "varlen", "sliding_window", "global_local", "star", "random1", "random4"]
    res, split_ranks = {}, 0
    for name in names:
        mask = masks[name]
        plan = mcp.plan(mask, world)
        sp = early_split(plan, rank)
        split_ranks += bool(len(sp.early) and len(sp.late))
        for dtype, hq, hkv in ((torch.float32, 4, 2), (torch.float64, 2, 2)):
            if backend == "triton" and dtype == torch.float64:
                continue
            s = mask.seqlen_q
            gen = torch.Generator().manual_seed(7 + s)
            q, do = (torch.randn(s, hq, 16, generator=gen, dtype=torch.float64) for _ in range(2))
            k, v = (torch.randn(s, hkv, 16, generator=gen, dtype=torch.float64) for _ in range(2))
            dl = torch.randn(s, hq, generator=gen, dtype=torch.float64)
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            o_ref, l_ref = dense_attention(qr, kr, vr, torch.as_tensor(mask.to_dense()), 0.3)
            fin = torch.isfinite(l_ref)
            ((o_ref * do).sum() + (torch.where(fin, l_ref, 0) * dl).sum()).backward()
            group = dist.group.WORLD
            ql, kl, vl = (mcp.dispatch(t.to(dtype), plan, group).detach().requires_grad_() for t in (q, k, v))
            out, lse = mcp.attention(ql, kl, vl, plan, group, softmax_scale=0.3, backend=backend, stages=0,
                                     early=True)
            ids = torch.from_numpy(plan.local_ids(rank))
            ((out.double() * do[ids]).sum() + (torch.where(torch.isfinite(lse), lse, 0).double() * dl[ids]).sum()).backward()
            assert torch.equal(torch.isfinite(lse), torch.isfinite(l_ref[ids])), name
            assert torch.isfinite(out).all(), name
            res[(name, str(dtype))] = local_errors(ids, out, lse, (ql, kl, vl), (o_ref, l_ref, qr, kr, vr))
    return res, split_ranks


@pytest.mark.parametrize("backend,world", [("reference", 2), ("reference", 4), ("triton", 2)])
def test_early_rows_runtime_matches_fp64_reference(backend, world):
    if backend == "triton":
        pytest.importorskip("triton")
    results = run_ranks(_dist_cases, world, backend, 4)
    assert sum(n for _, n in results) >= world  # the early path ran on several (plan, rank) pairs
    bad = [(r, key, k, v) for r, (res, _) in enumerate(results) for key, e in res.items() for k, v in e.items()
           if v > 1e-4]
    assert not bad, f"errors above 1e-4: {bad[:10]}"
