"""Block means and the dot products of block pairs, one Triton launch each: what MoBA's gate and the pooled
estimates of MInference and FlexPrefill read (megatron_cp/sparse has the methods).

Each reduction is one program's fixed sequence of operations on one block (the mean of a block's rows) or one pair
(a dot product over the head dim), whatever else the launch holds: a block's mean and a pair's dot product are the
same bits on every CP layout, which is what the selections' exactness across layouts needs. In PyTorch the same
means took a float32 copy of the rows and a pairwise fold of ~10 launches per chunk of blocks (docs/sparse.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 256  # rows summed per step of a block's loop
BLOCK_W = 128  # columns (head x dim) per program
WARPS = 4
BLOCK_P = 32  # pairs per program


@triton.jit
def _block_means_kernel(X, OUT, width, stride_xt, stride_xh, stride_xd, stride_o, inv_block, D: tl.constexpr,
                        BLOCK: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    ok = c < width
    col = (c // D) * stride_xh + (c % D) * stride_xd
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    for r0 in range(0, BLOCK, ROWS):
        r = (i * BLOCK + r0 + tl.arange(0, ROWS)).to(tl.int64)
        x = tl.load(X + r[:, None] * stride_xt + col[None, :], mask=ok[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32), 0)
    tl.store(OUT + i.to(tl.int64) * stride_o + c, acc * inv_block, mask=ok)


@triton.jit
def _pair_dots_kernel(A, B, AI, BJ, OUT, n, nb, stride_ah, stride_ai, stride_bh, stride_bj, stride_oh,
                      G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr):
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    h = tl.program_id(1)
    ok = p < n
    i = tl.load(AI + p, mask=ok, other=0).to(tl.int64)
    j = tl.load(BJ + p, mask=ok, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = ok[:, None] & (d < D)[None, :]
    a = tl.load(A + h * stride_ah + i[:, None] * stride_ai + d[None, :], mask=m, other=0.0)
    b = tl.load(B + (h // G) * stride_bh + j[:, None] * stride_bj + d[None, :], mask=m, other=0.0)
    tl.store(OUT + h * stride_oh + i * nb + j, tl.sum(a * b, 1), mask=ok)


def block_means_f32(x: torch.Tensor, block: int) -> torch.Tensor:
    """float32 [n, H, D]: the mean of each block of ``block`` rows of x [n * block, H, D] (float32, float16 or
    bfloat16, any strides; CUDA, or the CPU under Triton's interpreter), summed in float32."""
    n, h, d = x.shape[0] // block, x.shape[1], x.shape[2]
    out = torch.empty(n, h, d, dtype=torch.float32, device=x.device)
    if n:
        w = h * d
        rows = min(ROWS, block & -block)  # the largest power of two up to ROWS that divides the block
        _block_means_kernel[(n, triton.cdiv(w, BLOCK_W))](
            x, out, w, x.stride(0), x.stride(1), x.stride(2), out.stride(0), 1.0 / block, D=d, BLOCK=block, ROWS=rows,
            BLOCK_W=BLOCK_W, num_warps=WARPS)
    return out


def pair_dots(a: torch.Tensor, b: torch.Tensor, ai: torch.Tensor, bj: torch.Tensor, nb: int) -> torch.Tensor:
    """float32 [Ha, na * nb]: at column ``ai[p] * nb + bj[p]`` of row h, the dot product of a[h, ai[p]] and
    b[h // (Ha / Hb), bj[p]] over the last dim; 0 at the columns no pair names. a [Ha, na, D] and b [Hb, nb, D]
    float32 with unit stride along D; ai, bj int64 [P] on their device."""
    ha, na, d = a.shape
    out = torch.zeros(ha, na * nb, dtype=torch.float32, device=a.device)
    n = ai.numel()
    if n:
        _pair_dots_kernel[(triton.cdiv(n, BLOCK_P), ha)](
            a, b, ai, bj, out, n, nb, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0),
            G=ha // b.shape[0], D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_P=BLOCK_P, num_warps=4)
    return out
