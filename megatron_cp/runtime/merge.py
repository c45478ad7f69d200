"""Merging partial attention outputs by their LSE (stages, baselines, guest rows)."""

from __future__ import annotations

import torch


def merge_lse(acc, lse, o, l):
    """Merge a partial (``o`` [s, H, D], ``l`` [s, H]) into the running (``acc``, ``lse``) in place:
    L = max + log1p(exp(min - max)), O = sum_i exp(L_i - L) O_i; rows where both are -inf stay 0/-inf."""
    mx = torch.maximum(lse, l)
    dead = mx == float("-inf")
    mxs = torch.where(dead, torch.zeros_like(mx), mx)
    new = mxs + torch.log1p(torch.exp(torch.minimum(lse, l) - mxs))
    new = torch.where(dead, mx, new)
    ns = torch.where(dead, torch.zeros_like(new), new)
    acc.mul_(torch.exp(lse - ns).unsqueeze(-1)).add_(o.to(acc.dtype) * torch.exp(l - ns).unsqueeze(-1))
    lse.copy_(new)
