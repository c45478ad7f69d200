"""The backward's row term delta = rowsum(dout * out) - dlse, in one pass, laid out head-major.

The backward kernels read lse and delta once per (q block, head) visit: from a [Hq, sq] layout those
reads are contiguous, from the natural [sq, Hq] they are strided by Hq. This kernel reads out and dout
in their own dtype (no fp32 copies of them) and writes delta [Hq, sq] fp32 directly; callers use the
transposed view, which has the [sq, Hq] shape of the API with strides (1, sq).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_S = 64


def block_dim(d: int) -> int:
    """The kernels' block along a head dim of ``d``: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (int(d) - 1).bit_length())


@triton.jit
def row_delta_kernel(O, DO, DLSE, DELTA, stride_os, stride_oh, stride_dos, stride_doh, stride_ls, stride_lh, sq,
                     HAS_DLSE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    offs64 = offs.to(tl.int64)
    ok = offs < sq
    d = tl.arange(0, HEAD_DIM)  # a power of two; columns from DIM on (a padded head dim) read as 0
    m = ok[:, None] & (d < DIM)[None, :]
    o = tl.load(O + offs64[:, None] * stride_os + h * stride_oh + d[None, :], mask=m, other=0.0)
    do = tl.load(DO + offs64[:, None] * stride_dos + h * stride_doh + d[None, :], mask=m, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + offs64 * stride_ls + h * stride_lh, mask=ok, other=0.0).to(tl.float32)
    tl.store(DELTA + h.to(tl.int64) * sq + offs64, delta, mask=ok)


def row_delta(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None = None) -> torch.Tensor:
    """delta = rowsum(dout * out) - dlse as an fp32 [sq, Hq] view of a head-major [Hq, sq] buffer.

    out, dout [sq, Hq, D] (unit stride along D; any D, the kernel pads it to a power of two); dlse [sq, Hq]
    or None."""
    sq, hq, d = out.shape
    if dout.shape != out.shape:
        raise ValueError(f"dout {tuple(dout.shape)} and out {tuple(out.shape)} differ")
    if dlse is not None and tuple(dlse.shape) != (sq, hq):
        raise ValueError(f"dlse must be [{sq}, {hq}]; got {tuple(dlse.shape)}")
    if out.stride(-1) != 1:
        out = out.contiguous()
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    delta = torch.empty(hq, sq, device=out.device, dtype=torch.float32)
    if sq > 0 and hq > 0:
        dl = dlse if dlse is not None else delta
        row_delta_kernel[(triton.cdiv(sq, BLOCK_S), hq)](
            out, dout, dl, delta, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
            dl.stride(0) if dlse is not None else 0, dl.stride(1) if dlse is not None else 0, sq,
            HAS_DLSE=dlse is not None, HEAD_DIM=block_dim(d), DIM=d, BLOCK=BLOCK_S, num_warps=4,
        )
    return delta.t()


def head_major(x: torch.Tensor) -> torch.Tensor:
    """An fp32 [sq, Hq] tensor as a view of a head-major [Hq, sq] buffer (copied only when it is not)."""
    x = x.float()
    if x.dim() == 2 and x.stride(0) == 1 and x.stride(1) == x.shape[0]:
        return x
    return x.t().contiguous().t()
