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
