"""Pure-PyTorch tile-list attention: the reference backend and the CPU fallback.

Implements the whole backend protocol (kernels/protocol.py). Works blockwise like FlashAttention, so
memory is bounded by one ``[block_q, block_k]`` score block per head, never by ``S^2``. Inputs are
computed in ``accumulate_dtype`` (float64 for float64 inputs, float32 otherwise); running sums
(``forward_accumulate``, ``backward_into``) take that precision as it is, unrounded.
"""

from __future__ import annotations

import math

import torch

from ..kinds import Kind
from .protocol import accumulate_dtype, check_running
from .tiles import check_tiles

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _row_bounds(kind: int, sq: int, sk: int, rows: torch.Tensor):
    """Kept key interval [lo, hi) (tile-local) of tile-local ``rows`` for a tile of ``kind``."""
    d = sk - sq
    lo = rows if kind in (Kind.INV_CAUSAL, Kind.BI_CAUSAL) else torch.zeros_like(rows)
    hi = rows + d + 1 if kind in (Kind.CAUSAL, Kind.BI_CAUSAL) else torch.full_like(rows, sk)
    return lo.clamp(0, sk), hi.clamp(0, sk)


def _blocks(tiles: torch.Tensor, block_q: int, block_k: int):
    """Yield (q0, q1, k0, k1, lo, hi) blocks of every tile; lo/hi are absolute key bounds per row,
    or None when the block is fully kept (no mask arithmetic)."""
    for q_start, q_end, k_start, k_end, kind in tiles.tolist():
        sq, sk = q_end - q_start, k_end - k_start
        for a in range(0, sq, block_q):
            b = min(a + block_q, sq)
            rows = torch.arange(a, b)
            lo, hi = _row_bounds(kind, sq, sk, rows)
            k_lo, k_hi = int(lo.min()), int(hi.max())
            for c in range(k_lo, k_hi, block_k):
                e = min(c + block_k, k_hi)
                full = bool((lo <= c).all() and (hi >= e).all())
                if not full and bool(((hi <= c) | (lo >= e)).all()):
                    continue  # empty block
                yield (
                    q_start + a, q_start + b, k_start + c, k_start + e,
                    None if full else (lo + k_start, hi + k_start),
                )


def _scores(qb, kb, mask_bounds, k0, keep=None, q0=0):
    """Scores [Hkv, G, bq, bk] of q block [bq, Hkv, G, D] (rows q0.., already scaled) against k block [bk, Hkv, D]
    (keys k0..); cells outside the tile's bounds or, with ``keep`` (a BlockKeep), outside the selection: -inf."""
    s = torch.einsum("qhgd,khd->hgqk", qb, kb)
    if mask_bounds is not None:
        lo, hi = mask_bounds
        j = torch.arange(k0, k0 + kb.shape[0])
        keep_t = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])
        s.masked_fill_(~keep_t, float("-inf"))
    if keep is not None:
        rows = torch.arange(q0, q0 + qb.shape[0], device=keep.mask.device)
        cols = torch.arange(k0, k0 + kb.shape[0], device=keep.mask.device)
        sel = keep.cells(rows, cols).view(s.shape)  # [Hq, bq, bk] -> [Hkv, G, bq, bk]: q head h = (h // G, h % G)
        s.masked_fill_(~sel, float("-inf"))
    return s


class ReferenceBackend:
    """Blockwise PyTorch implementation of the backend protocol (``kernels/protocol.py``)."""

    name = "reference"

    def __init__(self, block_q: int = 128, block_k: int = 256):
        self.block_q, self.block_k = block_q, block_k

    def supports(self, device, dtype: torch.dtype, head_dim: int, head_dim_v: int | None = None) -> str | None:
        """Any device; float16, bfloat16, float32 and float64; any head_dim >= 1 and any v head dim."""
        if dtype not in _DTYPES:
            return f"the reference backend runs float16, bfloat16, float32 and float64 inputs, not {dtype}"
        if head_dim < 1 or (head_dim_v is not None and head_dim_v < 1):
            return f"head dims must be >= 1, got {head_dim} (q/k) and {head_dim_v} (v)"
        return None

    def prepare(self, tiles: torch.Tensor, seqlen_q: int, seqlen_k: int):
        check_tiles(tiles, seqlen_q, seqlen_k)
        return list(_blocks(tiles.to("cpu", torch.int64), self.block_q, self.block_k))

    @staticmethod
    def _setup(q, k, softmax_scale):
        sq, hq, d = q.shape
        hkv = k.shape[1]
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        return sq, hq, hkv, hq // hkv, d, accumulate_dtype(q.dtype), scale

    def _forward(self, q, k, v, prepared, softmax_scale, keep=None):
        """(out [sq, Hq, D], lse [sq, Hq]) in accumulate_dtype; rows without a kept cell: 0 / -inf.
        keep: None or a BlockKeep narrowing the list per q head (checked by the caller).
        FlashAttention's online softmax: per row a running max ``m``, sum ``l`` of exp(s - m) and unnormalised
        output, rescaled when a block raises the max; divided once at the end (the fewest passes over each
        [bq, bk] score block, which is what a CPU run of a whole model spends its attention time on)."""
        sq, hq, hkv, g, d, cdt, scale = self._setup(q, k, softmax_scale)
        qg = q.to(cdt).view(sq, hkv, g, d) * scale
        kc, vc = k.to(cdt), v.to(cdt)
        acc = torch.zeros(hkv, g, sq, v.shape[-1], dtype=cdt, device=q.device)
        m = torch.full((hkv, g, sq), float("-inf"), dtype=cdt, device=q.device)
        l = torch.zeros((hkv, g, sq), dtype=cdt, device=q.device)
        for q0, q1, k0, k1, bounds in prepared:
            s = _scores(qg[q0:q1], kc[k0:k1], bounds, k0, keep, q0)
            old = m[..., q0:q1]
            new = torch.maximum(old, s.amax(-1))
            safe = new.masked_fill(torch.isinf(new), 0.0)  # rows with no kept cell yet: every exp below is 0
            p = s.sub_(safe.unsqueeze(-1)).exp_()
            rescale = torch.exp(old - safe)
            l[..., q0:q1] = l[..., q0:q1] * rescale + p.sum(-1)
            acc[..., q0:q1, :] = acc[..., q0:q1, :] * rescale.unsqueeze(-1) + torch.einsum("hgqk,khd->hgqd", p,
                                                                                            vc[k0:k1])
            m[..., q0:q1] = new
        # l >= 1 on every row with a kept cell (its maximum contributes exp(0)); 0 elsewhere, where acc is 0 too
        out = acc / l.clamp_min(1.0).unsqueeze(-1)
        lse = m + torch.log(l)  # -inf where l = 0
        return out.permute(2, 0, 1, 3).reshape(sq, hq, v.shape[-1]), lse.permute(2, 0, 1).reshape(sq, hq)

    def forward(self, q, k, v, prepared, softmax_scale=None, keep=None):
        """q [sq, Hq, D], k/v [sk, Hkv, D] -> out [sq, Hq, D] (q's dtype), lse [sq, Hq] (float32, float64 for
        float64 inputs); ``keep``: None or a BlockKeep (per-head block selection; ValueError when it does not fit
        q, k)."""
        if keep is not None:
            keep.check(q, k)
        out, lse = self._forward(q, k, v, prepared, softmax_scale, keep)
        return out.to(q.dtype), lse

    def forward_accumulate(self, q, k, v, prepared, softmax_scale, out, lse) -> None:
        """Merges this list's (o, l) into the running (out, lse) by LSE; rows with l = -inf (the list keeps
        no cell of them) stay bitwise as they are, rows with a running lse of -inf take (o, l)."""
        check_running("out", out, q, tuple(q.shape[:2]) + (v.shape[-1],))
        check_running("lse", lse, q, tuple(q.shape[:2]))
        o, l = self._forward(q, k, v, prepared, softmax_scale)
        take = torch.isfinite(l)
        had = torch.isfinite(lse)
        new = torch.where(had, torch.logaddexp(lse, l), l)
        safe = torch.where(take, new, torch.zeros_like(new))
        w_old = torch.where(had & take, torch.exp(lse - safe), torch.zeros_like(new)).unsqueeze(-1)
        w_new = torch.where(take, torch.exp(l - safe), torch.zeros_like(new)).unsqueeze(-1)
        merged = torch.where(had.unsqueeze(-1), out * w_old, torch.zeros_like(out)) + o * w_new
        out.copy_(torch.where(take.unsqueeze(-1), merged, out))
        lse.copy_(torch.where(take, new, lse))

    def _backward(self, q, k, v, out, lse, dout, prepared, softmax_scale, delta, keep=None):
        """(dq, dk, dv) in accumulate_dtype, shaped like q, k, v."""
        sq, hq, hkv, g, d, cdt, scale = self._setup(q, k, softmax_scale)
        qg = q.to(cdt).view(sq, hkv, g, d) * scale
        kc, vc = k.to(cdt), v.to(cdt)
        do = dout.to(cdt).view(sq, hkv, g, -1)
        if delta is None:
            delta = (dout.to(cdt) * out.to(cdt)).sum(-1)
        # rows without a kept cell have lse -inf and every score -inf: exp(s - 0) = 0 there, as for masked cells
        lse_g = lse.to(cdt).view(sq, hkv, g).permute(1, 2, 0)  # [Hkv, G, sq]
        lse_g = lse_g.masked_fill(torch.isinf(lse_g), 0.0).unsqueeze(-1)
        dl_g = delta.to(cdt).view(sq, hkv, g).permute(1, 2, 0).unsqueeze(-1)
        dq = torch.zeros_like(qg)
        dk = torch.zeros_like(kc)
        dv = torch.zeros_like(vc)
        for q0, q1, k0, k1, bounds in prepared:
            p = _scores(qg[q0:q1], kc[k0:k1], bounds, k0, keep, q0).sub_(lse_g[..., q0:q1, :]).exp_()
            dob = do[q0:q1]
            dv[k0:k1] += torch.einsum("hgqk,qhgd->khd", p, dob)
            ds = torch.einsum("qhgd,khd->hgqk", dob, vc[k0:k1]).sub_(dl_g[..., q0:q1, :]).mul_(p)
            dq[q0:q1] += torch.einsum("hgqk,khd->qhgd", ds, kc[k0:k1])
            dk[k0:k1] += torch.einsum("hgqk,qhgd->khd", ds, qg[q0:q1])  # q scaled: dS/dk = scale * q
        return (dq * scale).reshape(sq, hq, d), dk, dv

    def backward(self, q, k, v, out, lse, dout, prepared, softmax_scale=None, delta=None, keep=None):
        """(dq, dk, dv) in the dtypes of q, k, v; ``keep`` as in ``forward`` (the forward's selection)."""
        if keep is not None:
            keep.check(q, k)
        dq, dk, dv = self._backward(q, k, v, out, lse, dout, prepared, softmax_scale, delta, keep)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def backward_into(self, q, k, v, out, lse, dout, prepared, softmax_scale, delta, dq, dk, dv) -> None:
        for name, acc, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
            check_running(name, acc, q, tuple(like.shape))
        for acc, g in zip((dq, dk, dv), self._backward(q, k, v, out, lse, dout, prepared, softmax_scale, delta)):
            acc += g
