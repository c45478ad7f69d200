"""The distributed tests' shared harness on top of megatron_cp.testing (which holds the fp64 dense
reference, the 2x-low-precision rule and the spawn helper): per-rank errors, the bf16 check and the masks
the distributed tests share."""

from __future__ import annotations

import torch

from megatron_cp.testing import Attention, low_precision_errors, reference_attention


def _max_err(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def local_errors(ids, out, lse, locals_, ref: Attention) -> dict:
    """Max abs errors of one rank's results against the dense reference's rows ``ids``.

    out/lse: this rank's attention output; locals_: its (q, k, v) leaves after backward; ref: the fp64
    ``reference_attention`` with gradients. lse is compared on finite rows only (callers check separately
    that the -inf rows coincide).
    """
    ql, kl, vl = locals_
    fin = torch.isfinite(ref.lse[ids])
    return {
        "out": _max_err(out, ref.out[ids]),
        "lse": _max_err(lse[fin], ref.lse[ids][fin]),
        "dq": _max_err(ql.grad, ref.dq[ids]),
        "dk": _max_err(kl.grad, ref.dk[ids]),
        "dv": _max_err(vl.grad, ref.dv[ids]),
    }


def bf16_errors(rank, world, mask, plan=None, attend=None, **attention_kwargs):
    """One rank's bf16 errors against the fp64 dense reference, beside a plain bf16 dense run's.

    Random fp64 q/k/v/dout (Hq 4, Hkv 2, D 16, seed 5, scale 0.25); attention in bf16 on this rank's
    tokens of ``plan`` (default ``mcp.plan(mask, world)``): ``attend(q, k, v, plan, group, scale)`` (a
    baseline strategy) or megatron-cp attention with ``attention_kwargs`` (e.g. ``stages``). Returns
    ``megatron_cp.testing.low_precision_errors`` for out, dq, dk, dv on this rank's rows; check them with
    ``assert_bf16``.
    """
    import torch.distributed as dist

    import megatron_cp as mcp

    s, hq, hkv, d = mask.seqlen_q, 4, 2, 16
    gen = torch.Generator().manual_seed(5)
    q, do = (torch.randn(s, hq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(s, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    ref, plain = (reference_attention(q, k, v, mask, 0.25, dout=do, dtype=dt) for dt in (torch.float64, torch.bfloat16))
    plan = plan if plan is not None else mcp.plan(mask, world)
    group = dist.group.WORLD
    ids = torch.from_numpy(plan.local_ids(rank))
    ls = [mcp.dispatch(t.to(torch.bfloat16), plan, group).detach().requires_grad_() for t in (q, k, v)]
    if attend is not None:
        o, _ = attend(*ls, plan, group, 0.25)
    else:
        o, _ = mcp.attention(*ls, plan, group, softmax_scale=0.25, **attention_kwargs)
    (o * do[ids].to(torch.bfloat16)).sum().backward()
    ours = {"out": o, "dq": ls[0].grad, "dk": ls[1].grad, "dv": ls[2].grad}
    rows = lambda r: {n: getattr(r, n)[ids] for n in ours}  # noqa: E731
    return low_precision_errors(ours, rows(ref), rows(plain))


def assert_bf16(errs: dict, where) -> None:
    """The project's 2x rule (rms within 2x plain bf16's plus 1e-6 x rms(reference)) and, as before it,
    the max abs error within 2x plain bf16's plus 1e-3."""
    for tag, e in errs.items():
        assert e.ok, (where, tag, e)
        assert e.max <= 2 * e.plain_max + 1e-3, (where, tag, e)


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


def dense_attention(q, k, v, keep, scale: float, sink=None):
    """Differentiable dense attention (autograd; pass float64 leaves for the reference): q ``[S, Hq, Dk]``,
    k ``[S, Hkv, Dk]``, v ``[S, Hkv, Dv]`` (Dv may differ from Dk, MLA), ``keep`` bool ``[S, S]``, ``sink``
    None or ``[Hq]`` (a sink column with that logit and a zero value). Returns (out ``[S, Hq, Dv]``, lse
    ``[S, Hq]``, the sink column included). Rows that keep nothing (and have no sink) give out 0, lse -inf
    and zero gradients, never NaN."""
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    cells = keep[None].expand(hq, -1, -1)
    if sink is not None:
        s = torch.cat([s, sink.to(s.dtype)[:, None, None].expand(hq, s.shape[1], 1)], -1)
        cells = torch.cat([cells, torch.ones(hq, s.shape[1], 1, dtype=torch.bool)], -1)
    empty = ~cells.any(-1, keepdim=True)
    s = torch.where(cells, s, float("-inf"))
    s = torch.where(empty, 0.0, s)  # a finite row: logsumexp's backward stays NaN-free
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.exp(s - lse) * (~empty)
    if sink is not None:
        p = p[..., :-1]
    out = torch.einsum("hqk,khd->qhd", p, vv)
    lse = torch.where(empty, float("-inf"), lse)[..., 0].T
    return out, lse
