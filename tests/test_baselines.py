"""Baseline strategies (ring, ulysses, usp, allgather) against the fp64 dense reference on CPU/gloo.

One spawn per world size (2 and 4) runs every strategy on causal and full (the masks the ring-style
strategies are designed for) plus packed documents, sliding window and a random mask (exact for any
mask), forward and backward (with an lse gradient), MHA and GQA; bf16 under the 2x rule; bad
arguments raise ValueError before any collective.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp import masks as M
from megatron_cp.baselines import STRATEGIES, get_strategy, plan_for

from _dist import raise_before_collectives
from reference import assert_bf16, bf16_errors, local_errors, tiny_masks

from megatron_cp.testing import reference_attention, run_ranks
from test_overlap import _random_mask

S = 61


def _masks():
    return {**tiny_masks(S, ("causal", "full", "varlen", "sliding_window")), "random": _random_mask(5)}


def _case(rank, world, name, mask, hq, hkv, options=None, dtype=torch.float64, plan_kwargs=None, plan_name=None,
          d=8, lse_grad="all"):
    """lse_grad: which ranks' losses use lse ("all", "none": out only, "rank0": rank 0 only; the exchanges
    carry a missing lse gradient as zeros plus a flag, and drop it only where no rank has one)."""
    s = mask.seqlen_q
    gen = torch.Generator().manual_seed(3 + hq + hkv)
    q, do = (torch.randn(s, hq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(s, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    dl = torch.randn(s, hq, generator=gen, dtype=torch.float64)
    plan = plan_for(plan_name or name, mask, world, **(plan_kwargs or {}))
    uses_lse = {"all": True, "none": False, "rank0": rank == 0}[lse_grad]
    if lse_grad != "all":  # only the rows of ranks whose loss uses lse get an lse gradient
        keep = torch.zeros(s, dtype=torch.bool)
        if lse_grad == "rank0":
            keep[torch.from_numpy(plan.local_ids(0))] = True
        dl = torch.where(keep[:, None], dl, 0)
    ref = reference_attention(q, k, v, mask, 0.3, dout=do, dlse=dl)
    group = dist.group.WORLD
    ql, kl, vl = (mcp.dispatch(t.to(dtype), plan, group).detach().requires_grad_() for t in (q, k, v))
    fn = get_strategy(name, **(options or {}))
    out, lse = fn(ql, kl, vl, plan, group, 0.3)
    ids = torch.from_numpy(plan.local_ids(rank))
    fin = torch.isfinite(ref.lse[ids])
    assert torch.equal(torch.isfinite(lse), fin), "fully masked rows must give lse -inf exactly there"
    loss = (out.double() * do[ids]).sum()
    if uses_lse:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0).double() * dl[ids]).sum()
    if (options or {}).get("lse_grad") is False:
        # lse without gradient: its backward exchange and the flags' host read are skipped entirely
        assert not lse.requires_grad
        with _no_host_reads():
            loss.backward()
    else:
        loss.backward()
    return local_errors(ids, out, lse, (ql, kl, vl), ref)


class _no_host_reads:
    """Inside: reading a tensor back to the host (``.cpu()``, ``.tolist()``, ``.item()``: a sync on a GPU)
    raises."""

    NAMES = ("cpu", "tolist", "item")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}
        for n in self.NAMES:
            setattr(torch.Tensor, n, self._raise(n))

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)

    @staticmethod
    def _raise(name):
        def read(self, *a, **k):
            raise AssertionError(f"host read Tensor.{name}() in a backward that must not sync")
        return read


def _bad_cases(rank, world):
    group = dist.group.WORLD
    mask = M.causal(S)
    greedy = mcp.plan(mask, world, solver="greedy")
    zz = plan_for("ring", mask, world)
    n = zz.num_local(rank)
    q, k = torch.randn(n, 4, 8), torch.randn(n, 2, 8)
    cases = {
        "ring_plan": (lambda: get_strategy("ring")(q, k, k, greedy, group, None), "solver='zigzag'.*got solver='greedy'"),
        "usp_degree": (lambda: get_strategy("usp", ulysses_degree=3)(q, k, k, zz, group, None), "ulysses_degree=3"),
        "ulysses_heads": (lambda: get_strategy("ulysses")(torch.randn(n, 3, 8), torch.randn(n, 1, 8),
                                                          torch.randn(n, 1, 8), zz, group, None), "query heads \\(3\\)"),
        "tokens": (lambda: get_strategy("allgather")(q[:-1], k, k, zz, group, None), f"{n - 1} tokens"),
        "name": (lambda: get_strategy("stripe"), "unknown context-parallel strategy 'stripe'"),
        "lse_grad": (lambda: get_strategy("ulysses", lse_grad="no")(q, k, k, zz, group, None), "lse_grad must be"),
    }
    return raise_before_collectives(cases)


def _bf16(rank, world):
    res = {}
    mask = M.causal(S)
    for name in STRATEGIES:
        errs = bf16_errors(rank, world, mask, plan=plan_for(name, mask, world), attend=get_strategy(name))
        for tag, e in errs.items():
            res[(name, tag)] = e
    return res


def _all(rank, world):
    exact = {}
    for name in STRATEGIES:
        for mname, mask in _masks().items():
            for hq, hkv in ((4, 4), (4, 2)):
                if hq == hkv and mname not in ("causal", "full"):
                    continue
                exact[(name, mname, hq, hkv)] = _case(rank, world, name, mask, hq, hkv)
    for name in ("ulysses", "usp", "head_context", "allgather"):
        for how in ("none", "rank0"):
            exact[(name, f"lse_{how}", 4, 2)] = _case(rank, world, name, _masks()["varlen"], 4, 2, lse_grad=how)
    for name in STRATEGIES:  # lse returned without gradient (what Megatron's adapter asks for)
        exact[(name, "no_lse_grad", 4, 2)] = _case(rank, world, name, _masks()["varlen"], 4, 2,
                                                   {"lse_grad": False}, lse_grad="none")
    # rows 30.. keep no key: with a contiguous layout the last rank has no tiles, yet joins the gather's
    # backward collective (no hang) and gets zero gradients
    head_only = M.from_mask_mod(lambda b, h, qi, ki: (qi < 30) & (ki <= qi), S)
    exact[("allgather", "empty_rank", 4, 2)] = _case(rank, world, "allgather", head_only, 4, 2,
                                                     plan_kwargs={"solver": "contiguous"})
    # S = 64: every rank holds the same count, so the gathered buffer needs no compaction
    exact[("allgather", "equal_counts", 4, 2)] = _case(rank, world, "allgather", M.causal(64), 4, 2)
    if world == 4:
        for deg in (2, 4):
            exact[("usp", f"u{deg}", 8, 4)] = _case(rank, world, "usp", _masks()["causal"], 8, 4, {"ulysses_degree": deg})
        exact[("ulysses", "kv_repeat", 8, 2)] = _case(rank, world, "ulysses", _masks()["varlen"], 8, 2)
    else:  # the ring on the Triton backend (interpreter, fp32): steps merge inside the kernel (accumulate)
        for mname in ("causal", "varlen"):
            exact[("ring", "triton", mname, 4, 2)] = _case(rank, world, "ring", _masks()[mname], 4, 2,
                                                           {"backend": "triton"}, dtype=torch.float32, d=16)
    return {"exact": exact, "bad": _bad_cases(rank, world), "bf16": _bf16(rank, world)}


@pytest.mark.parametrize("world", [2, 4])
def test_baselines_match_fp64_reference(world):
    results = run_ranks(_all, world)
    bad = [(r, key, k, v) for r, res in enumerate(results) for key, e in res["exact"].items()
           for k, v in e.items() if v > 1e-5]
    assert any(key[1] == "triton" for key in results[0]["exact"]) == (world == 2)
    assert not bad, bad[:10]
    for res in results:
        assert all(v == "ok" for v in res["bad"].values()), res["bad"]
        for key, errs in res["bf16"].items():
            assert_bf16({key[1]: errs}, key[0])


def test_plan_for_layouts():
    assert plan_for("ring", M.causal(256), 4).solver == "zigzag"
    assert plan_for("ring", M.full(256), 4).solver == "contiguous"
    assert set(STRATEGIES) == {"ring", "ulysses", "usp", "allgather", "head_context"}
    with pytest.raises(ValueError, match="'stripe'"):
        plan_for("stripe", M.causal(8), 2)
    # every strategy documents its plan layout and masks
    for fn in STRATEGIES.values():
        assert "Plan" in fn.__doc__ and "Masks" in fn.__doc__ or "mask" in fn.__doc__.lower()
    assert np.all(np.diff(plan_for("ring", M.causal(256), 4).bounds) == 32)
