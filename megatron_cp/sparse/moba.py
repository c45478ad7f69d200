"""MoBA: Mixture of Block Attention (Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context
LLMs", arXiv:2502.13189). Published defaults: block (``moba_chunk_size``) 512, top-k 3.

Gating is parameter free: the key blocks are scored by the dot product of the query with the mean-pooled
keys of each block, the top-k blocks are kept, and the query's own block is always computed (with its
static mask inside). Here the gate is taken per q block (mean of the block's queries . mean of each key
block's keys, i.e. the mean over the block's queries of the paper's per-token gate) because the kernels
select whole block pairs; the candidates are the blocks of the static mask's envelope other than the
q block's own one, and ``top_k`` counts those candidates (the own block comes on top of them).

Departures from the paper, and why: the gate is per q block, not per query token (the kernels select
block pairs); ``top_k`` counts the gated blocks besides the own block, whereas the paper forces the current
block into its top-k (so its default 3 means 2 gated + the own block; here the defaults give 3 + 1); the
candidates are the envelope's blocks (the paper's "no future block" rule generalised to any static mask,
e.g. packed documents: no block of another document).

Context parallelism: the pooled key of block ``g`` is computed by the owner of ``g`` from its own tokens,
written into a zero [nb, Hkv, D] tensor and summed over the group (``view.combine``: each entry written by
exactly one rank, so the sum is exact). Every reduction whose operand size depends on how many blocks a
rank holds (the token means, the dot products over D) is an elementwise pairwise fold (``tree_sum``), so
each value is the same sequence of floating-point operations on every layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..kernels import accumulate_dtype, block_means_f32, pair_dots, upload_all
from .selector import check_block, check_heads
from .view import SelectionView


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` (removed) by pairwise elementwise folds: the order of additions depends only on the
    length of ``dim``, never on the other dimensions or the device's reduction heuristics."""
    dim = dim % x.dim()
    while x.shape[dim] > 1:
        n = x.shape[dim]
        h = n // 2
        y = x.narrow(dim, 0, h) + x.narrow(dim, h, h)
        if n % 2:
            y = torch.cat([y, x.narrow(dim, 2 * h, 1)], dim)
        x = y
    return x.squeeze(dim)


def fused(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the pooling runs as Triton launches (``kernels.block_means_f32``, ``kernels.pair_dots``): CUDA
    inputs summed in float32. Elsewhere (the CPU, float64) PyTorch's pairwise folds; either way a block's or a pair's
    value is the same bits on every CP layout."""
    return x.is_cuda and dtype == torch.float32 and x.dtype in (torch.float32, torch.float16, torch.bfloat16)


def block_means(x: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """x [n*block, H, D] -> [n, H, D] in ``dtype``: the mean of each block's rows, one Triton launch where
    ``fused``, else by ``tree_sum``, converted in chunks of blocks so the upcast copy stays small (chunking does
    not change any value)."""
    if fused(x, dtype):
        return block_means_f32(x, block)
    n = x.shape[0] // block
    xb = x.reshape(n, block, *x.shape[1:])
    out = torch.empty(n, *x.shape[1:], dtype=dtype, device=x.device)
    c = max(1, (1 << 24) // max(1, xb[0].numel()))
    for s in range(0, n, c):
        out[s:s + c] = tree_sum(xb[s:s + c].to(dtype), 1) / block
    return out


@dataclass(frozen=True)
class MoBA:
    """MoBA selector: per q head and q block, the ``top_k`` envelope key blocks (own block excluded) with the
    highest gate (mean query of the q block . mean key of the key block; q head h reads kv head
    h // (Hq / Hkv)), plus the own block when it is in the envelope. Ties: lower block id first.

    ``block``: tokens per block (default 512, the paper's); ``top_k``: gated blocks per q block (default 3).
    """

    block: int = 512
    top_k: int = 3
    name: ClassVar[str] = "moba"

    def __post_init__(self):  # what needs no shapes is refused when the selector is made, not at its first call
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"MoBA: top_k must be a positive int, got {self.top_k!r}")
        check_block("MoBA", self.block, self.block if isinstance(self.block, int) else 1)

    def check(self, num_q_heads: int, num_kv_heads: int, head_dim: int, seqlen: int) -> None:
        """ValueError naming the bad value (block, top_k, head counts); no collective."""
        self.__post_init__()
        check_block("MoBA", self.block, seqlen)
        check_heads("MoBA", num_q_heads, num_kv_heads, head_dim)

    def keeps_all(self, most: int) -> bool:
        """Every envelope block is kept when no q block has more than ``top_k`` candidates besides its own
        (short documents, small envelopes): the selection is the envelope, whatever the gates."""
        return most <= self.top_k

    # -- the two halves of ``select``: owner-side summary, then the local selection ------------------------

    def summaries(self, k: torch.Tensor, view: SelectionView) -> torch.Tensor:
        """This rank's contribution to the pooled keys: [nb, Hkv, D] (float32, float64 for float64 k), the
        mean key of each local block at its global id, 0 elsewhere. ``view.combine`` of it is the pooled
        keys of every block (each entry written by its owner only)."""
        b, nb = self.block, view.num_blocks
        pooled = block_means(k, b, accumulate_dtype(k.dtype))  # [nq, Hkv, D]
        out = torch.zeros(nb, *pooled.shape[1:], dtype=pooled.dtype, device=pooled.device)
        out[view.q_blocks] = pooled
        return out

    def gates(self, q: torch.Tensor, pooled: torch.Tensor, view: SelectionView) -> torch.Tensor:
        """Gate scores [Hq, nq, nb] (pooled's dtype): mean query of each local q block . pooled key of each
        global block, through the q head's kv head, on the envelope's block pairs (the only candidates); 0
        elsewhere. q [nq*B, Hq, D]; pooled [nb, Hkv, D] (combined).

        Only the envelope's pairs are computed: a product tensor over every pair costs nq x nb x D per head
        whatever the mask, as much for packed documents as for causal attention, where the envelope is a small
        part of it. Each pair's value is the same fold over D as over every pair (the same operations)."""
        qi, kj = self._pairs(view, q.device)
        hq, hkv, nq = q.shape[1], pooled.shape[1], view.q_blocks.numel()
        qm = block_means(q, self.block, pooled.dtype).transpose(0, 1)  # [Hq, nq, D]
        if fused(q, pooled.dtype):  # one launch over the pairs, q head h reading kv head h // (Hq / Hkv)
            return pair_dots(qm, pooled.transpose(0, 1), qi, kj, view.num_blocks).view(hq, nq, view.num_blocks)
        kp = pooled.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, nb, D]
        flat = torch.zeros(hq, nq * view.num_blocks, dtype=pooled.dtype, device=pooled.device)
        # the fold over D of [Hq, c, D] products, chunked over pairs to bound memory (elementwise: any chunking
        # gives the same values)
        c = max(1, (1 << 24) // max(1, hq * qm.shape[-1]))
        for s in range(0, qi.numel(), c):
            i, j = qi[s:s + c], kj[s:s + c]
            flat[:, i * view.num_blocks + j] = tree_sum(qm[:, i] * kp[:, j], -1)
        return flat.view(hq, nq, view.num_blocks)

    @staticmethod
    def _pairs(view: SelectionView, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(local q block, global key block) of the envelope's pairs, long on ``device``, made once per layout
        from the host's envelope (no wait for the device) and kept in ``view.cache``."""
        key = ("moba envelope pairs", str(device))
        got = view.cache.get(key)
        if got is None:
            got = view.cache[key] = tuple(upload_all([x.astype(np.int64) for x in
                                                      np.nonzero(view.host_envelope().numpy() > 0)], device))
        return got

    def select_from(self, q: torch.Tensor, pooled: torch.Tensor, view: SelectionView) -> torch.Tensor:
        """keep bool [Hq, nq, nb] from the local queries q [nq*B, Hq, D] and the combined pooled keys
        [nb, Hkv, D] (``view.combine(self.summaries(k, view))``)."""
        gate = self.gates(q, pooled, view)
        hq, nq, nb = gate.shape
        env = view.envelope > 0  # [nq, nb]
        diag = torch.arange(nb, device=env.device)[None, :] == view.q_blocks[:, None]  # own block
        cand = (env & ~diag)[None].expand(hq, nq, nb)
        # descending gate, ties by lower block id: a stable ascending sort of the negated gate
        key = torch.where(cand, -gate, torch.full_like(gate, float("inf")))
        order = torch.sort(key, dim=-1, stable=True).indices[..., : min(self.top_k, nb)]
        keep = torch.zeros(hq, nq, nb, dtype=torch.bool, device=env.device)
        keep.scatter_(-1, order, True)
        keep &= cand  # fewer candidates than top_k: the filler picks are not candidates
        return keep | (diag & env)[None]

    def select(self, q: torch.Tensor, k: torch.Tensor, view: SelectionView) -> torch.Tensor:
        """q [nq*B, Hq, D], k [nq*B, Hkv, D] (this rank's blocks, local order) -> keep bool [Hq, nq, nb].
        One all-reduce of [nb, Hkv, D] (``view.combine``); no host synchronisation."""
        return self.select_from(q, view.combine(self.summaries(k, view)), view)
