"""Dense references for tests: the mask as a boolean matrix and plain softmax attention."""

from __future__ import annotations

import torch


def dense_attention(q, k, v, mask, scale):
    """q [S, Hq, D], k/v [S, Hkv, D], mask bool [S, S] -> out [S, Hq, D], lse [S, Hq] (q's dtype).

    Plain softmax in the inputs' precision; rows with no kept key give out 0 and lse -inf.
    """
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    s = s.masked_fill(~torch.as_tensor(mask, device=q.device)[None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return torch.einsum("hqk,khd->qhd", p, vv), lse.transpose(0, 1)


def _max_err(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def local_errors(ids, out, lse, locals_, refs):
    """Max abs errors of one rank's results against the dense reference's rows ``ids``.

    out/lse: this rank's attention output; locals_: its (q, k, v) leaves after backward; refs:
    (out, lse, q, k, v) of the dense reference after backward. lse is compared on finite rows only
    (callers check separately that the -inf rows coincide).
    """
    o_ref, l_ref, qr, kr, vr = refs
    ql, kl, vl = locals_
    fin = torch.isfinite(l_ref[ids])
    return {
        "out": _max_err(out, o_ref[ids]),
        "lse": _max_err(lse[fin], l_ref[ids][fin]),
        "dq": _max_err(ql.grad, qr.grad[ids]),
        "dk": _max_err(kl.grad, kr.grad[ids]),
        "dv": _max_err(vl.grad, vr.grad[ids]),
    }


def bf16_errors(rank, world, mask, plan=None, attend=None, **attention_kwargs):
    """One rank's bf16 errors against the fp64 dense reference, beside a plain bf16 dense run's.

    Random fp64 q/k/v/dout (Hq 4, Hkv 2, D 16, seed 5, scale 0.25); attention in bf16 on this rank's
    tokens of ``plan`` (default ``mcp.plan(mask, world)``): ``attend(q, k, v, plan, group, scale)`` (a
    baseline strategy) or megatron-cp attention with ``attention_kwargs`` (e.g. ``stages``). Returns {name: (max abs
    error of ours, max abs error of the plain bf16 reference)} for out, dq, dk, dv on this rank's rows:
    the ANCHORS.md rule compares the two (ours <= 2x plain + 1e-3).
    """
    import torch.distributed as dist

    import megatron_cp as mcp

    s, hq, hkv, d = mask.seqlen_q, 4, 2, 16
    gen = torch.Generator().manual_seed(5)
    q, do = (torch.randn(s, hq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(s, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    dense = torch.as_tensor(mask.to_dense())
    grads = {}
    for tag, dt in (("fp64", torch.float64), ("bf16", torch.bfloat16)):
        ts = [t.detach().clone().to(dt).requires_grad_() for t in (q, k, v)]
        o, _ = dense_attention(*ts, dense, 0.25)
        (o * do.to(dt)).sum().backward()
        grads[tag] = [o.detach()] + [t.grad for t in ts]
    plan = plan if plan is not None else mcp.plan(mask, world)
    group = dist.group.WORLD
    ids = torch.from_numpy(plan.local_ids(rank))
    ls = [mcp.dispatch(t.to(torch.bfloat16), plan, group).detach().requires_grad_() for t in (q, k, v)]
    if attend is not None:
        o, _ = attend(*ls, plan, group, 0.25)
    else:
        o, _ = mcp.attention(*ls, plan, group, softmax_scale=0.25, **attention_kwargs)
    (o * do[ids].to(torch.bfloat16)).sum().backward()
    ours = [o] + [t.grad for t in ls]
    out = {}
    for i, tag in enumerate(("out", "dq", "dk", "dv")):
        ref64, ref16 = grads["fp64"][i][ids], grads["bf16"][i][ids]
        out[tag] = (float((ours[i].double() - ref64).abs().max()), float((ref16.double() - ref64).abs().max()))
    return out


def tiny_masks(s: int, names=None) -> dict:
    """Builder masks the distributed tests share, at sequence length ``s`` (> 45; the tests use 61, which
    no cp size divides), by name; ``names`` picks a subset in that order."""
    from megatron_cp import masks as M

    every = {
        "causal": M.causal(s),
        "full": M.full(s),
        "varlen": M.varlen([0, 7, 20, 21, 45, s], causal=True),
        "sliding_window": M.sliding_window(s, 9, 2),
        "strided": M.strided(s, 5, 3),
        "global_local": M.global_local(s, 4, 2, 2),
        "block_causal": M.block_causal(s, 8),
    }
    return every if names is None else {n: every[n] for n in names}
