"""LSE merge of a partial attention result into a running one, in place, in one pass.

The dense-tile path (cuDNN pieces beside Triton tiles) and the staged runtime add partial results
(o, l) into a running (acc, lse): L = log(exp(lse) + exp(l)), acc = (exp(lse - L) acc + exp(l - L) o);
one or two partials per pass, either of which may hold its positions in reverse order (the band
squares' reversed pieces, kernels/pieces.py).
Done with torch ops this is ~8 passes over [s, H, D] fp32; the Triton kernel reads acc and o once and
writes acc once, which matters when a rank merges a few 100 MB per stage. Rows where both sides are
empty (lse = l = -inf) keep acc 0 and lse -inf; a row whose running lse is -inf takes o as it is
(whatever acc held is ignored).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rows import cdiv, next_power_of_2


@triton.jit
def _side(L, r64, ok, n_heads, n_rows, REV: tl.constexpr):
    # row index of (position, head) pair r in a partial whose positions are reversed when REV
    if REV:
        src = (n_rows // n_heads - 1 - r64 // n_heads) * n_heads + r64 % n_heads
    else:
        src = r64
    return src, tl.load(L + src, mask=ok, other=float("-inf")).to(tl.float32)


@triton.jit
def _merge_kernel(ACC, LSE, O, L, O2, L2, n_rows, n_heads, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                  REV: tl.constexpr, TWO: tl.constexpr, REV2: tl.constexpr, FRESH: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < n_rows
    r64 = r.to(tl.int64)
    if FRESH:  # nothing written yet: the running side is empty and not read
        a_lse = tl.full([BLOCK_R], float("-inf"), tl.float32)
    else:
        a_lse = tl.load(LSE + r64, mask=ok, other=float("-inf"))
    src1, b_lse = _side(L, r64, ok, n_heads, n_rows, REV)
    mx = tl.maximum(a_lse, b_lse)
    if TWO:
        src2, c_lse = _side(L2, r64, ok, n_heads, n_rows, REV2)
        mx = tl.maximum(mx, c_lse)
    m0 = tl.where(mx == float("-inf"), 0.0, mx)
    wa = tl.exp(a_lse - m0)
    wb = tl.exp(b_lse - m0)
    tot = wa + wb
    if TWO:
        wc = tl.exp(c_lse - m0)
        tot += wc
    keep = tot > 0.0
    tot_s = tl.where(keep, tot, 1.0)
    wa = wa / tot_s
    wb = wb / tot_s
    cols = tl.arange(0, HEAD_DIM)
    off = r64[:, None] * HEAD_DIM + cols[None, :]
    o = tl.load(O + src1[:, None] * HEAD_DIM + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    # weights of exactly 0 must not touch the other side: 0 * (garbage or inf) would give NaN
    new = tl.where(wb[:, None] > 0.0, o * wb[:, None], 0.0)
    if not FRESH:
        acc = tl.load(ACC + off, mask=ok[:, None], other=0.0).to(tl.float32)
        new += tl.where(wa[:, None] > 0.0, acc * wa[:, None], 0.0)
    if TWO:
        wc = wc / tot_s
        o2 = tl.load(O2 + src2[:, None] * HEAD_DIM + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        new += tl.where(wc[:, None] > 0.0, o2 * wc[:, None], 0.0)
    tl.store(ACC + off, new.to(ACC.dtype.element_ty), mask=ok[:, None])
    tl.store(LSE + r64, tl.where(keep, m0 + tl.log(tot_s), float("-inf")), mask=ok)


def merge_torch(acc: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> None:
    """In place: (acc [s, H, D], lse [s, H], float32 or float64) <- merge with (o [s, H, D], l [s, H])."""
    l = l.to(lse.dtype)
    m = torch.maximum(lse, l)
    m0 = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w1 = torch.exp(lse - m0)
    w2 = torch.exp(l - m0)
    s = w1 + w2
    keep = s > 0
    s1 = torch.where(keep, s, torch.ones_like(s))
    a = torch.where((w1 > 0).unsqueeze(-1), acc * (w1 / s1).unsqueeze(-1), torch.zeros_like(acc))
    b = torch.where((w2 > 0).unsqueeze(-1), o.to(acc.dtype) * (w2 / s1).unsqueeze(-1), torch.zeros_like(acc))
    acc.copy_(a + b)
    lse.copy_(torch.where(keep, m0 + torch.log(s1), torch.full_like(m, float("-inf"))))


def merge_into(acc: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor, use_triton=None,
               reverse: bool = False, o2: torch.Tensor | None = None, l2: torch.Tensor | None = None,
               reverse2: bool = False, fresh: bool = False) -> None:
    """In place: (acc fp32 [s, H, D], lse fp32 [s, H]) <- LSE merge with (o [s, H, D] any float dtype,
    l [s, H]), and with (o2, l2) too when given (one pass for both). ``reverse`` / ``reverse2``: that
    partial's positions run backwards (its row p is acc's row s - 1 - p; the band squares' reversed
    pieces). ``fresh``: acc and lse hold nothing yet, are not read, and acc may have any float dtype
    (written once, rounded once: for the last merge of rows nothing else writes). ``use_triton``: None =
    on CUDA tensors with contiguous rows (the one-pass kernel), else torch ops; True forces the kernel
    (tests run it under the CPU interpreter). float64 running pairs (float64 inputs) merge by torch ops."""
    wide = lse.dtype == torch.float64 and (acc.dtype == torch.float64 or fresh)
    if not wide and (lse.dtype != torch.float32 or (acc.dtype != torch.float32 and not fresh)
                     or not acc.is_floating_point()):
        raise ValueError(f"running acc/lse must be float32 or float64 (acc any float dtype when fresh), got "
                         f"{acc.dtype}/{lse.dtype}")
    parts = [(o, l)] + ([(o2, l2)] if o2 is not None else [])
    for x, y in parts:
        if x.shape != acc.shape or y is None or y.shape != lse.shape or lse.shape != acc.shape[:2]:
            raise ValueError(f"shapes differ: acc {tuple(acc.shape)}, lse {tuple(lse.shape)}, "
                             f"o {tuple(x.shape)}, l {None if y is None else tuple(y.shape)}")
    d = acc.shape[-1]
    flat = all(t.is_contiguous() for t in (acc, lse) + tuple(t for p in parts for t in p)) and d >= 16 and d & (d - 1) == 0
    if use_triton is None:
        use_triton = flat and acc.is_cuda and not wide
    if not use_triton or not flat:
        if use_triton:
            raise ValueError("the Triton merge needs contiguous tensors and a power-of-two head_dim >= 16")
        run = torch.zeros(acc.shape, dtype=lse.dtype, device=acc.device) if fresh else acc
        if fresh:
            lse.fill_(float("-inf"))
        for (x, y), rev in zip(parts, (reverse, reverse2)):
            merge_torch(run, lse, x.flip(0) if rev else x, y.flip(0) if rev else y)
        if fresh:
            acc.copy_(run)
        return
    n = lse.numel()
    if n == 0:
        return
    block = max(1, min(64, 8192 // d))
    lf = [y.float() if y.dtype != torch.float32 else y for _, y in parts]
    two = o2 is not None
    _merge_kernel[(cdiv(n, block),)](acc, lse, o, lf[0], o2 if two else o, lf[-1], n, lse.shape[1],
                                     HEAD_DIM=d, BLOCK_R=block, REV=bool(reverse), TWO=two,
                                     REV2=bool(reverse2) and two, FRESH=bool(fresh), num_warps=4)


@triton.jit
def _merge_sources_kernel(OUT, LSE, ROWS, PARTS, n_src, n_rows, n_heads, dim, stride_or, stride_oh, stride_lr,
                          stride_lh, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hok = h < n_heads
    cols = tl.arange(0, BLOCK_D)
    cok = cols < dim
    w = dim + 1  # a source's row: its output, then its lse
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(n_src):
        base = (s * n_rows + i).to(tl.int64) * n_heads
        m = tl.maximum(m, tl.load(PARTS + (base + h) * w + dim, mask=hok, other=float("-inf")).to(tl.float32))
    m0 = tl.where(m == float("-inf"), 0.0, m)
    tot = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(n_src):  # source order: the same sum on every run
        base = (s * n_rows + i).to(tl.int64) * n_heads
        l = tl.load(PARTS + (base + h) * w + dim, mask=hok, other=float("-inf")).to(tl.float32)
        e = tl.exp(l - m0)
        o = tl.load(PARTS + (base + h)[:, None] * w + cols[None, :], mask=hok[:, None] & cok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.where(e[:, None] > 0.0, o * e[:, None], 0.0)  # 0 * a source's empty row stays 0
        tot += e
    keep = tot > 0.0
    tot_s = tl.where(keep, tot, 1.0)
    row = tl.load(ROWS + i).to(tl.int64)
    o_ptr = OUT + row * stride_or + h[:, None].to(tl.int64) * stride_oh + cols[None, :]
    tl.store(o_ptr, (acc / tot_s[:, None]).to(OUT.dtype.element_ty), mask=hok[:, None] & cok[None, :])
    tl.store(LSE + row * stride_lr + h.to(tl.int64) * stride_lh, tl.where(keep, m0 + tl.log(tot_s), float("-inf")),
             mask=hok)


def merge_sources(out: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, parts: torch.Tensor,
                  use_triton=None) -> None:
    """In place: ``out[rows[i]]`` / ``lse[rows[i]]`` <- the LSE merge of every source's partial of row i, in source
    order, rounded once to out's dtype. parts: [sources, len(rows), H, Dv + 1] in the accumulation dtype, each
    source's output then its lse (-inf: the source kept no cell of that row); out [s, H, Dv] with unit stride along
    Dv, lse [s, H] any strides. Rows no source kept get 0 / -inf. One launch on a GPU (torch ops otherwise; float64
    always): guest rows' partials come back to their owner every layer call, and the merge by torch ops was a dozen
    small ops on the host's critical path."""
    k, n, hq, w = parts.shape
    d = w - 1
    if tuple(out.shape[1:]) != (hq, d) or tuple(lse.shape[1:]) != (hq,) or rows.shape != (n,):
        raise ValueError(f"shapes differ: out {tuple(out.shape)}, lse {tuple(lse.shape)}, rows {tuple(rows.shape)}, "
                         f"parts {tuple(parts.shape)}")
    if n == 0:
        return
    if use_triton is None:
        use_triton = out.is_cuda
    if not use_triton or parts.dtype == torch.float64 or not parts.is_contiguous() or out.stride(2) != 1:
        l = parts[..., d]
        L = torch.logsumexp(l, dim=0)  # -inf where no source kept a cell
        wt = torch.exp(l - torch.where(torch.isinf(L), 0.0, L))  # 0 for a source's empty rows
        out[rows] = (parts[..., :d] * wt.unsqueeze(-1)).sum(0).to(out.dtype)
        lse[rows] = L.to(lse.dtype)
        return
    block_h = min(next_power_of_2(hq), 16)
    _merge_sources_kernel[(n, cdiv(hq, block_h))](
        out, lse, rows, parts, k, n, hq, d, out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        BLOCK_H=block_h, BLOCK_D=next_power_of_2(max(d, 16)), num_warps=4)
