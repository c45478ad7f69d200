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
