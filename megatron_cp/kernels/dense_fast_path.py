"""Dense fast path: a tile list that is one plain full or causal rectangle over all of q and k goes to
cuDNN attention through PyTorch's SDPA ops, which return the LSE we need.

Chosen by measurement (benchmarks/kernels/): cuDNN is faster than our Triton kernel on dense
masks on H100. Used only on CUDA, only in the non-deterministic mode (cuDNN's backward is not
guaranteed bitwise reproducible), and for the backward only when ``delta`` is rowsum(dout * out), i.e.
no LSE gradient (cuDNN computes that rowsum itself). Any failure falls back to the Triton kernels.
"""

from __future__ import annotations

import torch

from .tiles import CAUSAL, FULL


def dense_kind(tiles: torch.Tensor, seqlen_q: int, seqlen_k: int):
    """is_causal (bool) when ``tiles`` is one full rectangle or one square causal tile, else None."""
    if tiles.shape[0] != 1:
        return None
    qs, qe, ks, ke, kind = (int(x) for x in tiles[0].tolist())
    if (qs, qe, ks, ke) != (0, seqlen_q, 0, seqlen_k):
        return None
    if kind == FULL:
        return False
    if kind == CAUSAL and seqlen_q == seqlen_k:  # cuDNN's causal is top-left aligned
        return True
    return None


def cudnn_forward(q, k, v, scale, is_causal):
    """q [sq,Hq,D], k/v [sk,Hkv,D] -> out [sq,Hq,D], lse [sq,Hq] fp32 (natural log): one piece, i.e.
    ``cudnn_forward_batched`` with a batch of 1 (GQA: K/V passed as they are; if this cuDNN rejects them
    (Hkv != Hq, or strided views such as the K half of a packed K/V buffer), retried with contiguous
    copies, then expanded to Hq heads)."""
    out, lse = cudnn_forward_batched(q[None], k[None], v[None], scale, is_causal)
    return out[0].contiguous(), lse[0].contiguous()


def cudnn_backward(q, k, v, out, lse, dout, scale, is_causal):
    """Gradients of one piece from the global lse [sq, Hq]; delta = rowsum(dout * out) implied."""
    dq, dk, dv = cudnn_backward_batched(q[None], k[None], v[None], out[None], lse[None], dout[None], scale,
                                        is_causal)
    return dq[0].contiguous(), dk[0].contiguous(), dv[0].contiguous()


# -- batched pieces: n equal pieces (band pieces slide down the diagonal, kernels/dense_tiles.py) ---------
def band_view(x, start: int, n: int, step: int, length: int):
    """Rows ``[start + b*step, start + b*step + length)`` of x [s, H, D] for b < n as a view [n, length, H, D]
    (windows overlap when length > step; nothing is copied)."""
    s0, s1, s2 = x.stride()
    return x.as_strided((n, length, x.shape[1], x.shape[2]), (step * s0, s0, s1, s2),
                        x.storage_offset() + start * s0)


def _b(x):
    # [n, s, H, D] -> [n, H, s, D] view
    return x.permute(0, 2, 1, 3)


def cudnn_forward_batched(qb, kb, vb, scale, is_causal):
    """qb [n, r, Hq, D], kb/vb [n, kw, Hkv, D] (views, possibly overlapping) -> out [n, r, Hq, D],
    lse [n, r, Hq] fp32. Retried with contiguous copies, then with K/V expanded to Hq heads, if this
    cuDNN rejects the views or the head counts."""
    try:
        return _cudnn_forward_batched(qb, kb, vb, scale, is_causal)
    except RuntimeError:
        qb, kb, vb = qb.contiguous(), kb.contiguous(), vb.contiguous()
        try:
            return _cudnn_forward_batched(qb, kb, vb, scale, is_causal)
        except RuntimeError:
            hq = qb.shape[2]
            if kb.shape[2] == hq:
                raise
        g = hq // kb.shape[2]
        return _cudnn_forward_batched(qb, kb.repeat_interleave(g, 2), vb.repeat_interleave(g, 2), scale, is_causal)


def _cudnn_forward_batched(qb, kb, vb, scale, is_causal):
    n, r, hq, _ = qb.shape
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _b(qb), _b(kb), _b(vb), None, True, 0.0, is_causal, False, scale=scale)
    return res[0].permute(0, 2, 1, 3), res[1].reshape(n, hq, r).permute(0, 2, 1).float()


def cudnn_backward_batched(qb, kb, vb, ob, lseb, dob, scale, is_causal):
    """Gradients of a batched piece from the global out / lse (lseb [n, r, Hq]); delta = rowsum(dout *
    out) implied. Returns dq [n, r, Hq, D], dk / dv [n, kw, Hkv, D]."""
    try:
        return _cudnn_backward_batched(qb, kb, vb, ob, lseb, dob, scale, is_causal)
    except RuntimeError:
        qb, kb, vb, ob, dob = (x.contiguous() for x in (qb, kb, vb, ob, dob))
        try:
            return _cudnn_backward_batched(qb, kb, vb, ob, lseb, dob, scale, is_causal)
        except RuntimeError:
            hq, hkv = qb.shape[2], kb.shape[2]
            if hkv == hq:
                raise
        g = hq // hkv
        dq, dk, dv = _cudnn_backward_batched(qb, kb.repeat_interleave(g, 2), vb.repeat_interleave(g, 2), ob, lseb,
                                             dob, scale, is_causal)
        n, kw, _, d = kb.shape
        return dq, dk.view(n, kw, hkv, g, d).sum(3), dv.view(n, kw, hkv, g, d).sum(3)


def _cudnn_backward_batched(qb, kb, vb, ob, lseb, dob, scale, is_causal):
    n, r = qb.shape[:2]
    kw = kb.shape[1]
    lse_b = lseb.permute(0, 2, 1).contiguous().unsqueeze(-1)  # [n, Hq, r, 1]
    seed = torch.zeros((), dtype=torch.int64, device=qb.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _b(dob), _b(qb), _b(kb), _b(vb), _b(ob), lse_b, seed, seed, None, None, None, r, kw,
        0.0, is_causal, scale=scale)
    return dq.permute(0, 2, 1, 3), dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)
