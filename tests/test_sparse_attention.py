"""Sparse attention under CP (megatron_cp.sparse): exchange of selected blocks and the kernels' per-head
selection, against the fp64 dense reference restricted to the selected blocks, on gloo CPU ranks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp.sparse import attention as sparse_mod
from megatron_cp.sparse.view import single_view
from megatron_cp.testing import reference_attention, run_ranks

S, HQ, HKV, D, B = 256, 4, 2, 8, 16


@dataclass(frozen=True)
class Pattern:
    """A selector whose choice is a fixed function of (head, q block, key block): layout-independent by
    construction, so the runtime's exchange and kernels are tested apart from any method."""

    density: float = 0.1
    seed: int = 0
    name: str = "pattern"
    block: int = B

    def check(self, num_q_heads, num_kv_heads, head_dim, seqlen):
        if not 0 < self.density <= 1:
            raise ValueError(f"density must be in (0, 1], got {self.density}")

    def table(self, nb: int, hq: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        return torch.rand(hq, nb, nb, generator=g) < self.density

    def select(self, q, k, view):
        t = self.table(view.num_blocks, q.shape[1]).to(q.device)
        return t[:, view.q_blocks] & (view.envelope > 0)[None]


def _mask(name="packed"):
    if name == "causal":
        return mcp.masks.causal(S)
    return mcp.masks.varlen([0, 40, 100, 180, 256], causal=True)


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"q": r(S, HQ, D), "k": r(S, HKV, D), "v": r(S, HKV, D), "dout": r(S, HQ, D), "dlse": r(S, HQ)}


def _cells(keep_blocks: torch.Tensor, block: int) -> torch.Tensor:
    """bool [Hq, S, S] from a global block selection [Hq, nb, nb]."""
    return keep_blocks.repeat_interleave(block, 1).repeat_interleave(block, 2)


def _rank(rank, world, selector, tensors, chunk, mask_name="packed", solver="auto"):
    group = dist.group.WORLD
    mask = _mask(mask_name)
    plan = mcp.plan(mask, world, chunk_size=chunk, guest_rows="none", block=selector.block, solver=solver)
    t = {n: torch.from_numpy(a) for n, a in tensors.items()}
    ids = torch.from_numpy(plan.local_ids(rank))
    q, k, v = (mcp.dispatch(t[n], plan, group).detach().requires_grad_() for n in ("q", "k", "v"))
    stats = {}
    out, lse = mcp.sparse.sparse_attention(q, k, v, plan, group, selector, backend="reference", stats=stats)
    loss = (out * t["dout"][ids]).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * t["dlse"][ids]).sum()
    loss.backward()
    keep = sparse_mod.select_blocks(q.detach(), k.detach(), plan, group, selector)
    envelope_rows = sum(int((r.recv_runs[s][:, 1] - r.recv_runs[s][:, 0]).sum()) if len(r.recv_runs[s]) else 0
                        for r in plan.ranks[rank:rank + 1] for s in range(world))
    return {"ids": ids.numpy(), "out": out.detach().numpy(), "lse": lse.detach().numpy(), "dq": q.grad.numpy(),
            "dk": k.grad.numpy(), "dv": v.grad.numpy(), "keep": keep.numpy(),
            "q_blocks": (plan.local_ids(rank)[::selector.block] // selector.block), "stats": stats,
            "dense_rows": envelope_rows}


def _gather(ranks, name, shape):
    full = np.zeros(shape)
    for r in ranks:
        full[r["ids"]] = r[name]
    return torch.from_numpy(full)


def _reference(selector, t, mask_name="packed"):
    mask = _mask(mask_name)
    view = single_view(mask, selector.block, t["k"])
    keep = selector.select(t["q"], t["k"], view) & (view.envelope > 0)[None]
    cells = _cells(keep, selector.block) & torch.from_numpy(mask.to_dense())[None]
    return keep, reference_attention(t["q"], t["k"], t["v"], cells, dout=t["dout"], dlse=t["dlse"])


CASES = [
    (2, 16, "packed", "auto", Pattern()),
    (4, 32, "packed", "auto", Pattern()),
    # rank 0 holds the first half and needs no remote block, yet must join every collective
    (2, 32, "causal", "contiguous", Pattern(density=0.03)),
    (4, 16, "packed", "auto", mcp.sparse.MoBA(block=16, top_k=2)),
    # every q block has at most 5 candidates besides its own: MoBA keeps the whole envelope, so dense attention
    # runs on the plan (no selection); the same result as the selection's
    (2, 16, "packed", "auto", mcp.sparse.MoBA(block=16, top_k=5)),
]


@pytest.mark.parametrize("world,chunk,mask_name,solver,sel", CASES,
                         ids=[f"cp{c[0]}-{c[2]}-{c[3]}-{c[4].name}" for c in CASES])
def test_selection_exact_under_cp(world, chunk, mask_name, solver, sel):
    t = _tensors()
    keep, ref = _reference(sel, t, mask_name)
    ranks = run_ranks(_rank, world, sel, {n: a.numpy() for n, a in t.items()}, chunk, mask_name, solver)
    for name, shape in (("out", (S, HQ, D)), ("lse", (S, HQ)), ("dq", (S, HQ, D)), ("dk", (S, HKV, D)),
                        ("dv", (S, HKV, D))):
        got = _gather(ranks, name, shape)
        want = getattr(ref, name)
        fin = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), fin), name
        # fp64 throughout: lse is float64 for float64 inputs, and the backward's probabilities come from it
        tol = 1e-10
        torch.testing.assert_close(got[fin], want[fin], rtol=tol, atol=tol, msg=name)
    dense = getattr(sel, "top_k", 0) >= 5
    assert all(r["stats"]["dense"] is dense for r in ranks)
    assert sum(r["stats"]["blocks_selected"] for r in ranks) == int(keep.sum())
    # each rank's selection is the single-process selection of its blocks
    for r in ranks:
        assert np.array_equal(r["keep"], keep[:, r["q_blocks"]].numpy())
    # only rows of selected blocks that the envelope reads travel: never more than the dense plan moves,
    # fewer where some envelope block no head of the rank selected (MoBA's union over 4 heads and every
    # local q block covers this tiny envelope: equal there)
    got_rows = sum(r["stats"]["rows_received"] for r in ranks)
    dense_rows = sum(r["dense_rows"] for r in ranks)
    assert 0 < got_rows <= dense_rows
    if sel.name == "pattern":
        assert got_rows < dense_rows


def test_the_most_candidates_decide_whether_moba_keeps_the_whole_envelope():
    """MoBA keeps every envelope block exactly when no q block has more than top_k candidates besides its own:
    the packed mask here has at most 5 (the 80-token document over blocks 6-11), causal up to nb - 1."""
    from megatron_cp.sparse.view import most_candidates

    packed, causal = _mask("packed"), _mask("causal")
    assert most_candidates(packed.traps, S, B) == 5 and most_candidates(causal.traps, S, B) == S // B - 1
    for top_k, want in ((4, False), (5, True)):
        plan = mcp.plan(packed, 2, block=B, guest_rows="none")
        assert sparse_mod.keeps_whole_envelope(plan, mcp.sparse.MoBA(block=B, top_k=top_k)) is want
    assert not sparse_mod.keeps_whole_envelope(mcp.plan(packed, 2, block=B, guest_rows="none"), Pattern(density=1.0))


def _single(mask, **kw):
    plan = mcp.plan(mask, 1, **kw)
    t = _tensors()
    return plan, t["q"], t["k"], t["v"]


def test_bad_input_raises_before_any_collective():
    from megatron_cp.sparse.layout import check_plan

    mask = _mask()
    # a plan cut at document ends (40, 100, 180) is not in whole blocks of 16
    with pytest.raises(ValueError, match="whole blocks of 16"):
        check_plan(mcp.plan(mask, 2, solver="documents"), B)
    # a chunk of the block's size still cuts at document ends: the message names the argument that helps
    with pytest.raises(ValueError, match=r"mcp.plan\(mask, cp_size, block=16, guest_rows='none'\)"):
        check_plan(mcp.plan(mask, 2, chunk_size=B, solver="documents"), B)
    check_plan(mcp.plan(mask, 2, solver="documents", block=B), B)
    plan, q, k, v = _single(mask, block=B, guest_rows="none")
    with pytest.raises(ValueError, match="density"):
        mcp.sparse.sparse_attention(q, k, v, plan, None, Pattern(density=1.5), backend="reference")
    with pytest.raises(ValueError, match="Selector"):
        mcp.sparse.sparse_attention(q, k, v, plan, None, object(), backend="reference")
    with pytest.raises(ValueError, match="block=24"):
        mcp.plan(mask, 2, block=24)
    heavy = mcp.masks.causal(S)
    gplan = mcp.plan(heavy, 4, block=B, guest_rows=np.array([[S - 16, S]]))
    assert gplan.has_guests
    with pytest.raises(ValueError, match="guest_rows='none'"):
        check_plan(gplan, B)


def test_single_process_matches_reference():
    sel = Pattern(density=0.3, seed=3)
    t = _tensors(1)
    keep, ref = _reference(sel, t)
    plan = mcp.plan(_mask(), 1, block=B, guest_rows="none")
    q, k, v = (t[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out, lse = mcp.sparse.sparse_attention(q, k, v, plan, None, sel, backend="reference")
    torch.testing.assert_close(out, ref.out, rtol=1e-10, atol=1e-10)
    ((out * t["dout"]).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * t["dlse"]).sum()).backward()
    for name, g in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        torch.testing.assert_close(g, getattr(ref, name), rtol=2e-6, atol=2e-6, msg=name)
    assert keep.any() and not keep.all()


def _disagreeing_rank(rank, world):
    """Rank 1 runs MoBA with another top_k than rank 0: both must raise the same error before any exchange."""
    plan = mcp.plan(_mask(), world, block=B, guest_rows="none")
    t = _tensors()
    ids = torch.from_numpy(plan.local_ids(rank))
    q, k, v = (t[n][ids].float() for n in ("q", "k", "v"))
    sel = mcp.sparse.MoBA(block=B, top_k=2 if rank == 0 else 3)
    try:
        mcp.sparse.sparse_attention(q, k, v, plan, dist.group.WORLD, sel, backend="reference")
    except RuntimeError as e:
        return str(e)
    return None


def test_ranks_with_another_selector_raise_together():
    """A rank whose selector differs (MoBA top_k 3 against 2) is named on every rank, before the exchange
    (which would otherwise move other blocks on each rank, or wait for rows never sent)."""
    msgs = run_ranks(_disagreeing_rank, 2)
    assert all(m is not None and "sparse selector differs across ranks" in m for m in msgs), msgs
