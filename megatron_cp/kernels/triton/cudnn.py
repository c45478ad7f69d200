"""cuDNN attention (PyTorch's SDPA cuDNN ops) for the dense pieces of a tile list (kernels/pieces.py),
and the probe that decides, once per shape family, whether and how they run.

The ops return the LSE the merges need. They run only on CUDA, in the non-deterministic mode (cuDNN's
backward is not guaranteed bitwise reproducible), and for the backward only when ``delta`` is
rowsum(dout * out), i.e. no LSE gradient (cuDNN computes that rowsum itself).

Layouts: a cuDNN build may reject K/V with fewer heads than Q (GQA) or strided views (the K half of a
packed K/V buffer, the overlapping windows of a batched band piece). ``probe`` tries, on small inputs of
exactly those kinds, the inputs as they are ("as_is"), contiguous copies ("contiguous"), then copies with
K/V expanded to Hq heads ("expand"); the first layout that runs and matches a float32 reference is used
for every later call of that (device, dtype, head_dim, Hq / Hkv) family; if none does, that family runs
on the Triton kernels alone. A cuDNN error after the probe is raised, never caught.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LAYOUTS = ("as_is", "contiguous", "expand")


@dataclass(frozen=True)
class CudnnSupport:
    """What ``probe`` found for one family: ``layout`` (one of LAYOUTS) or None with the ``reason``."""

    layout: str | None
    reason: str | None = None


# -- the raw ops: [n, s, H, D] views in, the op's [n, H, s, D] layout inside -------------------------------
def _b(x):
    return x.permute(0, 2, 1, 3)


def sdpa_forward(qb, kb, vb, scale: float, is_causal: bool):
    """qb [n, r, Hq, D], kb/vb [n, kw, H, D] -> out [n, r, Hq, D], lse [n, r, Hq] float32 (one cuDNN call)."""
    n, r, hq, _ = qb.shape
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _b(qb), _b(kb), _b(vb), None, True, 0.0, is_causal, False, scale=scale)
    return res[0].permute(0, 2, 1, 3), res[1].reshape(n, hq, r).permute(0, 2, 1).float()


def sdpa_backward(qb, kb, vb, ob, lseb, dob, scale: float, is_causal: bool):
    """Gradients of one batched call from the global out / lse (lseb [n, r, Hq]); delta = rowsum(dout * out)
    implied. Returns dq [n, r, Hq, D], dk / dv [n, kw, H, D]."""
    n, r = qb.shape[:2]
    kw = kb.shape[1]
    lse_b = lseb.permute(0, 2, 1).contiguous().unsqueeze(-1)  # [n, Hq, r, 1]
    seed = torch.zeros((), dtype=torch.int64, device=qb.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _b(dob), _b(qb), _b(kb), _b(vb), _b(ob), lse_b, seed, seed, None, None, None, r, kw,
        0.0, is_causal, scale=scale)
    return dq.permute(0, 2, 1, 3), dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)


# -- calls in a probed layout -----------------------------------------------------------------------------
def forward_batched(qb, kb, vb, scale: float, is_causal: bool, layout: str):
    """qb [n, r, Hq, D], kb/vb [n, kw, Hkv, D] (views, possibly overlapping) -> out [n, r, Hq, D],
    lse [n, r, Hq] float32, with the inputs arranged as ``layout`` says."""
    if layout != "as_is":
        qb, kb, vb = qb.contiguous(), kb.contiguous(), vb.contiguous()
        if layout == "expand":
            g = qb.shape[2] // kb.shape[2]
            kb, vb = kb.repeat_interleave(g, 2), vb.repeat_interleave(g, 2)
    return sdpa_forward(qb, kb, vb, scale, is_causal)


def backward_batched(qb, kb, vb, ob, lseb, dob, scale: float, is_causal: bool, layout: str):
    """Gradients of a batched piece (``sdpa_backward``) with the inputs arranged as ``layout`` says;
    dk / dv [n, kw, Hkv, D] (summed over each K/V head's group when expanded)."""
    if layout == "as_is":
        return sdpa_backward(qb, kb, vb, ob, lseb, dob, scale, is_causal)
    qb, kb, vb, ob, dob = (x.contiguous() for x in (qb, kb, vb, ob, dob))
    if layout == "contiguous":
        return sdpa_backward(qb, kb, vb, ob, lseb, dob, scale, is_causal)
    n, kw, hkv, d = kb.shape
    g = qb.shape[2] // hkv
    dq, dk, dv = sdpa_backward(qb, kb.repeat_interleave(g, 2), vb.repeat_interleave(g, 2), ob, lseb, dob, scale,
                               is_causal)
    return dq, dk.view(n, kw, hkv, g, d).sum(3), dv.view(n, kw, hkv, g, d).sum(3)


def forward(q, k, v, scale: float, is_causal: bool, layout: str):
    """One piece: q [sq, Hq, D], k/v [sk, Hkv, D] -> out [sq, Hq, D], lse [sq, Hq] float32."""
    out, lse = forward_batched(q[None], k[None], v[None], scale, is_causal, layout)
    return out[0].contiguous(), lse[0].contiguous()


def backward(q, k, v, out, lse, dout, scale: float, is_causal: bool, layout: str):
    """Gradients of one piece from the global lse [sq, Hq]; delta = rowsum(dout * out) implied."""
    dq, dk, dv = backward_batched(q[None], k[None], v[None], out[None], lse[None], dout[None], scale, is_causal,
                                  layout)
    return dq[0].contiguous(), dk[0].contiguous(), dv[0].contiguous()


def band_view(x, start: int, n: int, step: int, length: int):
    """Rows ``[start + b*step, start + b*step + length)`` of x [s, H, D] for b < n as a view [n, length, H, D]
    (windows overlap when length > step; nothing is copied)."""
    s0, s1, s2 = x.stride()
    return x.as_strided((n, length, x.shape[1], x.shape[2]), (step * s0, s0, s1, s2),
                        x.storage_offset() + start * s0)


# -- the probe ------------------------------------------------------------------------------------------
def probe(device, dtype: torch.dtype, head_dim: int, group: int) -> CudnnSupport:
    """Find the first layout of LAYOUTS in which cuDNN runs this family's pieces and matches a float32
    reference: a batched band piece (overlapping K/V windows, the K and V halves of one [s, 2*Hkv, D]
    buffer) and a causal square, forward and backward, with Hq = group * Hkv. Run once per family by
    TritonBackend (a few small calls, one host sync); not while a CUDA graph is being captured."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("TritonBackend probes cuDNN on the first call of each (device, dtype, head_dim, Hq/Hkv): "
                           "run one call outside CUDA graph capture first")
    errors = []
    for layout in LAYOUTS:
        if layout == "expand" and group == 1:
            continue
        try:  # once per family: an op that rejects these inputs raises here, never on a later call
            err = _probe_layout(device, dtype, head_dim, group, layout)
        except RuntimeError as e:
            err = f"{type(e).__name__}: {e}"
        if err is None:
            return CudnnSupport(layout)
        errors.append(f"{layout}: {err[:200]}")
    return CudnnSupport(None, "cuDNN attention unusable (" + "; ".join(errors) + ")")


def _probe_layout(device, dtype, head_dim: int, group: int, layout: str) -> str | None:
    """None when both probe pieces match the reference in ``layout``, else what differed."""
    n, r, kw, hkv = 2, 64, 128, 2
    hq = hkv * group
    gen = torch.Generator(device=device).manual_seed(0)
    span = (n - 1) * r + kw
    q = torch.randn(n * r, hq, head_dim, generator=gen, device=device).to(dtype)
    kv = torch.randn(span, 2 * hkv, head_dim, generator=gen, device=device).to(dtype)
    dout = torch.randn(n * r, hq, head_dim, generator=gen, device=device).to(dtype)
    k, v = kv[:, :hkv], kv[:, hkv:]
    scale = 1.0 / math.sqrt(head_dim)
    for is_causal, width in ((False, kw), (True, r)):  # a band piece's rectangles, a causal square
        qb, kb, vb, dob = band_view(q, 0, n, r, r), band_view(k, 0, n, r, width), band_view(v, 0, n, r, width), \
            band_view(dout, 0, n, r, r)
        ob, lb = forward_batched(qb, kb, vb, scale, is_causal, layout)
        grads = backward_batched(qb, kb, vb, ob, lb, dob, scale, is_causal, layout)
        ref = _reference(qb, kb, vb, dob, scale, is_causal)
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (ob, lb) + tuple(grads), ref):
            if got.shape != want.shape:
                return f"{name} shape {tuple(got.shape)}, expected {tuple(want.shape)}"
            err = float((got.float() - want).abs().max())
            tol = 0.05 * float(want.abs().max()) + 0.02
            if not err <= tol:
                return f"{name} differs from the float32 reference by {err:.3g} (causal={is_causal})"
    return None


def _reference(qb, kb, vb, dob, scale, is_causal):
    """float32 (out, lse, dq, dk, dv) of a batched piece, shapes as forward_batched / backward_batched."""
    g = qb.shape[2] // kb.shape[2]
    q, k, v, do = (x.float().detach() for x in (qb, kb, vb, dob))
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    with torch.enable_grad():
        s = torch.einsum("nqhd,nkhd->nhqk", q, k.repeat_interleave(g, 2)) * scale
        if is_causal:  # top-left aligned
            keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(s, -1)
        out = torch.einsum("nhqk,nkhd->nqhd", torch.softmax(s, -1), v.repeat_interleave(g, 2))
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    return out.detach(), lse.detach().permute(0, 2, 1), dq, dk, dv
