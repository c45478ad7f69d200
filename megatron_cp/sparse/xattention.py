"""XAttention: block-sparse attention with antidiagonal scoring (Xu et al. 2025, "XAttention: Block Sparse
Attention with Antidiagonal Scoring", arXiv:2503.16428). Published defaults: block 128, stride 8 (16 also
used), threshold 0.9 (per-head thresholds supported).

Estimate: inside each ``stride x stride`` sub-block of the score matrix only one antidiagonal is summed,
score(i', j') = sum_s q[i'S + S-1-s] . k[j'S + s] (S = stride), i.e. the dot product of the reversed
stacked queries of row group i' with the stacked keys of key group j'; times softmax_scale / S. A row
softmax over the reduced row (every key group of the row, masked to the envelope) gives each reduced
cell a probability; summed per block pair and over the q block's reduced rows it is the block's mass.
Per q block, the smallest set of key blocks (descending mass) whose normalised cumulative mass reaches
``threshold`` is kept, plus the first envelope block of the row (the attention sink of the paper's block
0) and the diagonal block.

Envelope: full block pairs keep every reduced cell, partial ones keep cell (i', j') iff the static mask
keeps (i'S + S - 1, j'S) (the antidiagonal's corner next to the diagonal), empty ones none.

Context parallelism: the estimate reads every key of a row (``view.envelope_keys()``, a dense K exchange
done by the runtime). The scores of a chunk of q blocks are computed against a global-length key axis
(zeros for absent blocks, masked anyway) with shapes fixed by the selector and the sequence alone (the
chunk is padded to ``chunk_blocks`` q blocks), so every reduction (softmax max and normaliser, block sums,
cumulative mass) runs on the same shapes whatever the layout: a q block's selection is bit-identical on
every CP size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .moba import acc_dtype, check_heads
from .selector import check_block, check_fraction
from .view import SelectionView


def envelope_cells(view: SelectionView, rows: torch.Tensor, stride: int) -> torch.Tensor:
    """bool [R, nb * B / stride]: the reduced cells (row group of sample row ``rows[r]``, key group j') the
    envelope keeps: ``view.keeps(rows[r], j' * stride)`` for every j', evaluated from ``view.traps``
    without a host synchronisation. rows: long [R] global positions (any value, e.g. -1, keeps nothing).

    Each trap keeps, in row i, the keys [lo, hi) = [lo_a + lo_s i, hi_a + hi_s i): key group j' is kept iff
    ceil(lo / S) <= j' < ceil(hi / S). The intervals are written as +1 / -1 into a difference array and
    summed along the row (integers: exact), O(traps x R + R x cells)."""
    ncols = view.seqlen // stride
    t = view.traps.to(rows.device)
    q0, q1, lo_a, lo_s, hi_a, hi_s = (c[:, None] for c in t.unbind(1))
    i = rows[None, :]
    inr = (i >= q0) & (i < q1)  # [nt, R]
    c0 = (-torch.div(-(lo_a + lo_s * i), stride, rounding_mode="floor")).clamp(0, ncols)
    c1 = (-torch.div(-(hi_a + hi_s * i), stride, rounding_mode="floor")).clamp(0, ncols)
    w = (inr & (c1 > c0)).to(torch.int32)
    diff = torch.zeros(rows.numel(), ncols + 1, dtype=torch.int32, device=rows.device)
    diff.scatter_add_(1, c0.T.contiguous(), w.T.contiguous())
    diff.scatter_add_(1, c1.T.contiguous(), -w.T.contiguous())
    return diff.cumsum(1)[:, :ncols] > 0


@dataclass(frozen=True)
class XAttention:
    """XAttention selector (see the module doc).

    ``block``: tokens per block (default 128); ``stride``: antidiagonal stride S, a divisor of ``block``
    (default 8); ``threshold``: cumulative block mass to reach, a number in (0, 1] or one per query head
    (a sequence of Hq numbers; stored as a tuple); ``chunk_elements``: bound on the elements of one chunk's
    reduced score tensor [Hq, rows, S / stride] (memory only: the chunk size derived from it is the same
    on every rank, so it never breaks exactness).
    """

    block: int = 128
    stride: int = 8
    threshold: float | tuple[float, ...] = 0.9
    chunk_elements: int = 1 << 25
    name: ClassVar[str] = "xattention"

    def __post_init__(self):
        th = self.threshold
        if not isinstance(th, (int, float, str, bytes)) and hasattr(th, "__len__"):
            object.__setattr__(self, "threshold", tuple(th))  # hashable and immutable like the dataclass

    def check(self, num_q_heads: int, num_kv_heads: int, head_dim: int, seqlen: int) -> None:
        """ValueError naming the bad value (block, stride, threshold, chunk_elements, head counts)."""
        check_block("XAttention", self.block, seqlen)
        s = self.stride
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"XAttention: stride must be a positive int, got {s!r}")
        if self.block % s:
            raise ValueError(f"XAttention: stride {s} must divide block {self.block}")
        check_heads("XAttention", num_q_heads, num_kv_heads, head_dim)
        th = self.threshold
        if isinstance(th, tuple):
            if len(th) != num_q_heads:
                raise ValueError(f"XAttention: per-head threshold needs one value per query head ({num_q_heads}), "
                                 f"got {len(th)}: {th!r}")
            for x in th:
                check_fraction("XAttention", "threshold", x)
        else:
            check_fraction("XAttention", "threshold", th)
        c = self.chunk_elements
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"XAttention: chunk_elements must be a positive int, got {c!r}")

    def chunk_blocks(self, num_q_heads: int, num_blocks: int) -> int:
        """q blocks per chunk: depends only on the selector, Hq and nb (the same on every rank)."""
        nr = self.block // self.stride
        per_block = num_q_heads * nr * num_blocks * nr
        return max(1, min(num_blocks, self.chunk_elements // per_block))

    def thresholds(self, num_q_heads: int, dtype: torch.dtype, device) -> torch.Tensor:
        """[Hq] thresholds in ``dtype``."""
        th = self.threshold
        vals = list(th) if isinstance(th, tuple) else [th] * num_q_heads
        return torch.tensor([float(x) for x in vals], dtype=dtype, device=device)

    def select(self, q: torch.Tensor, k: torch.Tensor, view: SelectionView) -> torch.Tensor:
        """q [nq*B, Hq, D], k [nq*B, Hkv, D] (this rank's blocks, local order) -> keep bool [Hq, nq, nb].

        K of the row comes from ``view.envelope_keys()`` (k itself is not needed beyond it). The scores are
        a matmul in q's dtype; softmax and masses in float32 (float64 for float64 q). Peak extra memory:
        the reduced keys [Hkv, S / stride, stride * D] plus about 1.5 x ``chunk_elements`` floats."""
        if view.envelope_keys is None:
            raise ValueError("XAttention: the view has no envelope_keys (K of the rows' envelope is needed)")
        b, st = self.block, self.stride
        nr, nb = b // st, view.num_blocks
        ncols = nb * nr
        nq, hq, d = view.q_blocks.numel(), q.shape[1], q.shape[2]
        hkv = k.shape[1]
        g = hq // hkv
        dev, mdt, adt = q.device, q.dtype, acc_dtype(q.dtype)

        # reduced keys [Hkv, ncols, S*D] over the global key axis: zeros where no local row looks
        ids, keys = view.envelope_keys()
        ks = torch.zeros(hkv, nb, nr, st * d, dtype=mdt, device=dev)
        ks[:, ids] = keys.reshape(-1, nr, st, hkv, d).permute(3, 0, 1, 2, 4).reshape(hkv, -1, nr, st * d).to(mdt)
        kt = ks.view(hkv, ncols, st * d).transpose(1, 2)  # [Hkv, S*D, ncols]

        qr = q.reshape(nq, nr, st, hq, d).flip(2)  # reversed within each row group: the antidiagonal
        thr = self.thresholds(hq, adt, dev)[:, None, None]
        scale = 1.0 / (d ** 0.5) / st
        c = self.chunk_blocks(hq, nb)
        col = torch.arange(nb, device=dev)
        sub = torch.arange(nr, device=dev) * st + st - 1  # sample row of each row group, within a block
        keep = torch.empty(hq, nq, nb, dtype=torch.bool, device=dev)
        for s0 in range(0, nq, c):
            m = min(c, nq - s0)
            # chunk padded to c q blocks: fixed shapes on every layout (padding rows keep nothing)
            qc = torch.zeros(c, nr, st, hq, d, dtype=mdt, device=dev)
            qc[:m] = qr[s0:s0 + m]
            qb = torch.full((c,), -1, dtype=torch.long, device=dev)
            qb[:m] = view.q_blocks[s0:s0 + m]
            env = torch.zeros(c, nb, dtype=view.envelope.dtype, device=dev)
            env[:m] = view.envelope[s0:s0 + m]

            rows = torch.where(qb[:, None] >= 0, qb[:, None] * b + sub[None], -1).reshape(-1)  # [c*nr]
            er = env.repeat_interleave(nr, 0)[:, :, None]  # [c*nr, nb, 1]
            allowed = (er == 2) | ((er == 1) & envelope_cells(view, rows, st).view(c * nr, nb, nr))

            qm = qc.permute(3, 0, 1, 2, 4).reshape(hkv, g * c * nr, st * d)
            sc = torch.bmm(qm, kt).to(adt).view(hq, c * nr, ncols)
            del qm
            sc.mul_(scale).masked_fill_(~allowed.view(1, c * nr, ncols), float("-inf"))
            # row softmax over the whole reduced row; a row with no kept cell gets probability 0 everywhere
            mx = sc.amax(-1, keepdim=True)
            sc.sub_(torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))).exp_()
            den = sc.sum(-1, keepdim=True)
            sc.div_(torch.where(den > 0, den, torch.ones_like(den)))
            mass = sc.view(hq, c, nr, nb, nr).sum(-1).sum(2)  # [hq, c, nb]
            del sc

            tot = mass.sum(-1, keepdim=True)
            frac = torch.where(tot > 0, mass / torch.where(tot > 0, tot, torch.ones_like(tot)), torch.zeros_like(mass))
            inenv = (env > 0)[None].expand(hq, c, nb)
            frac = torch.where(inenv, frac, torch.zeros_like(frac))
            # descending mass, ties by lower block id (stable sort of the negation); non-envelope blocks last
            order = torch.sort(torch.where(inenv, -frac, torch.full_like(frac, float("inf"))), dim=-1,
                               stable=True).indices
            srt = frac.gather(-1, order)
            cum = srt.cumsum(-1)
            before = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], -1)  # mass of the blocks before
            kc = torch.zeros(hq, c, nb, dtype=torch.bool, device=dev).scatter_(-1, order, before < thr)
            first = col[None] == (env > 0).to(torch.int8).argmax(-1, keepdim=True)  # first envelope block
            diag = col[None] == qb[:, None]
            kc = (kc | (first | diag)[None]) & inenv
            keep[:, s0:s0 + m] = kc[:, :m]
        return keep
