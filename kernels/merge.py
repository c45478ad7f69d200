"""LSE merge of a partial attention result into a running one, in place, in one pass.

The dense-tile path (cuDNN pieces beside Triton tiles) and the staged runtime add partial results
(o, l) into a running (acc, lse): L = log(exp(lse) + exp(l)), acc = (exp(lse - L) acc + exp(l - L) o).
Done with torch ops this is ~8 passes over [s, H, D] fp32; the Triton kernel reads acc and o once and
writes acc once, which matters when a rank merges a few 100 MB per stage. Rows where both sides are
empty (lse = l = -inf) keep acc 0 and lse -inf; a row whose running lse is -inf takes o as it is
(whatever acc held is ignored).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(ACC, LSE, O, L, n_rows, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < n_rows
    r64 = r.to(tl.int64)
    a_lse = tl.load(LSE + r64, mask=ok, other=float("-inf"))
    b_lse = tl.load(L + r64, mask=ok, other=float("-inf")).to(tl.float32)
    mx = tl.maximum(a_lse, b_lse)
    m0 = tl.where(mx == float("-inf"), 0.0, mx)
    wa = tl.exp(a_lse - m0)
    wb = tl.exp(b_lse - m0)
    tot = wa + wb
    keep = tot > 0.0
    tot_s = tl.where(keep, tot, 1.0)
    wa = wa / tot_s
    wb = wb / tot_s
    cols = tl.arange(0, HEAD_DIM)
    off = r64[:, None] * HEAD_DIM + cols[None, :]
    acc = tl.load(ACC + off, mask=ok[:, None], other=0.0)
    o = tl.load(O + off, mask=ok[:, None], other=0.0).to(tl.float32)
    # weights of exactly 0 must not touch the other side: 0 * (garbage or inf) would give NaN
    new = tl.where(wa[:, None] > 0.0, acc * wa[:, None], 0.0) + tl.where(wb[:, None] > 0.0, o * wb[:, None], 0.0)
    tl.store(ACC + off, new, mask=ok[:, None])
    tl.store(LSE + r64, tl.where(keep, m0 + tl.log(tot_s), float("-inf")), mask=ok)


def merge_torch(acc: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> None:
    """In place: (acc fp32 [s, H, D], lse fp32 [s, H]) <- merge with (o [s, H, D], l [s, H])."""
    l = l.float()
    m = torch.maximum(lse, l)
    m0 = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w1 = torch.exp(lse - m0)
    w2 = torch.exp(l - m0)
    s = w1 + w2
    keep = s > 0
    s1 = torch.where(keep, s, torch.ones_like(s))
    a = torch.where((w1 > 0).unsqueeze(-1), acc * (w1 / s1).unsqueeze(-1), torch.zeros_like(acc))
    b = torch.where((w2 > 0).unsqueeze(-1), o.float() * (w2 / s1).unsqueeze(-1), torch.zeros_like(acc))
    acc.copy_(a + b)
    lse.copy_(torch.where(keep, m0 + torch.log(s1), torch.full_like(m, float("-inf"))))


def merge_into(acc: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor, use_triton=None) -> None:
    """In place: (acc fp32 [s, H, D], lse fp32 [s, H]) <- LSE merge with (o [s, H, D] any float dtype,
    l [s, H]). ``use_triton``: None = on CUDA tensors with contiguous rows (the one-pass kernel), else
    torch ops; True forces the kernel (tests run it under the CPU interpreter)."""
    if acc.dtype != torch.float32 or lse.dtype != torch.float32:
        raise ValueError(f"running acc/lse must be float32, got {acc.dtype}/{lse.dtype}")
    if o.shape != acc.shape or l.shape != lse.shape or lse.shape != acc.shape[:2]:
        raise ValueError(f"shapes differ: acc {tuple(acc.shape)}, lse {tuple(lse.shape)}, "
                         f"o {tuple(o.shape)}, l {tuple(l.shape)}")
    d = acc.shape[-1]
    flat = all(t.is_contiguous() for t in (acc, lse, o, l)) and d >= 16 and d & (d - 1) == 0
    if use_triton is None:
        use_triton = flat and acc.is_cuda
    if not use_triton or not flat:
        if use_triton:
            raise ValueError("the Triton merge needs contiguous tensors and a power-of-two head_dim >= 16")
        merge_torch(acc, lse, o, l)
        return
    n = lse.numel()
    if n == 0:
        return
    block = max(1, min(64, 8192 // d))
    _merge_kernel[(triton.cdiv(n, block),)](acc, lse, o, l.float() if l.dtype != torch.float32 else l, n,
                                            HEAD_DIM=d, BLOCK_R=block, num_warps=4)
