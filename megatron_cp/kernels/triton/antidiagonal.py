"""XAttention's block masses in one Triton kernel: antidiagonal scores, envelope, row softmax and the sums
per key block, reading K twice and writing only the masses (megatron_cp/sparse/xattention.py has the method).

Program (q block i, K/V head h) holds the reduced rows of the ``G`` query heads of h in that block
(``G x NR`` rows, NR = block / stride). Score of reduced row (head, r) and key group j:
sum_s q[i B + r S + S-1-s, head] . k[j S + s, h] (S = stride), i.e. ``S`` matmuls of [rows, D] x [D, cols].
Pass 1 walks the row's key span in tiles of BLOCK_N groups (online max and normaliser, base 2); pass 2 scores
each tile again and sums the probabilities per (head, key block) over the block's NR rows and NR groups. Tiles
start on a multiple of BLOCK_N groups (a multiple of NR): each holds whole key blocks, and the order of every
reduction depends only on global positions, so a q block's masses are the same bits on any CP layout.

Envelope per cell: ``slot[i, jb]`` is -1 for a full block pair, -2 for an empty one, else the index of the
pair's cell bits (``bits[slot, r, word]``: bit c of word c // 32 set iff group jb NR + c is kept for row r).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _tile(q_ptrs, row_ok, K, SLOT, BITS, i, h, c, hi, r, offs_d, d_ok, stride_qt, stride_kt, stride_kh,
          stride_slot, stride_bp, stride_br, scale2,
          NR: tl.constexpr, ST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Scores of key groups [c, c + BLOCK_N) in base-2 units, -inf where the envelope drops the cell."""
    cols = c + tl.arange(0, BLOCK_N)
    col_ok = cols < hi
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(ST):  # a loop, not unrolled: one Q and one K tile in shared memory at a time
        qs = tl.load(q_ptrs + (ST - 1 - s) * stride_qt, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        ks = tl.load(K + (cols * ST + s)[:, None] * stride_kt + h * stride_kh + offs_d[None, :],
                     mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(qs, tl.trans(ks), input_precision="ieee")
        else:
            acc += tl.dot(qs, tl.trans(ks))
    jb = cols // NR
    sl = tl.load(SLOT + i * stride_slot + jb, mask=col_ok, other=-2)
    part = sl >= 0
    cc = cols % NR
    word = tl.load(BITS + tl.maximum(sl, 0)[None, :] * stride_bp + r[:, None] * stride_br + (cc // 32)[None, :],
                   mask=row_ok[:, None] & part[None, :], other=0)
    bit = (word >> (cc % 32)[None, :]) & 1
    keep = row_ok[:, None] & col_ok[None, :] & ((sl == -1)[None, :] | (part[None, :] & (bit != 0)))
    return tl.where(keep, acc * scale2, float("-inf"))


@triton.jit
def antidiagonal_mass_kernel(Q, K, SLOT, BITS, SPAN, MASS, stride_qt, stride_qh, stride_kt, stride_kh, stride_slot,
                             stride_bp, stride_br, stride_mh, stride_mi, nb, scale2,
                             NR: tl.constexpr, ST: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    gh = offs_m // NR
    r = offs_m % NR
    row_ok = offs_m < G * NR
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    lo = tl.load(SPAN + 2 * i) * NR
    hi = tl.load(SPAN + 2 * i + 1) * NR
    c0 = (lo // BLOCK_N) * BLOCK_N
    q_ptrs = Q + (i * NR * ST + r * ST)[:, None] * stride_qt + (h * G + gh)[:, None] * stride_qh + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c in range(c0, hi, BLOCK_N):
        s2 = _tile(q_ptrs, row_ok, K, SLOT, BITS, i, h, c, hi, r, offs_d, d_ok, stride_qt, stride_kt, stride_kh,
                   stride_slot, stride_bp, stride_br, scale2, NR, ST, BLOCK_M, BLOCK_N, IEEE)
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s2 - m_safe[:, None]), 1)
        m_i = m_new
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)  # a row with no kept cell adds nothing
    NB_T: tl.constexpr = BLOCK_N // NR
    for c in range(c0, hi, BLOCK_N):
        s2 = _tile(q_ptrs, row_ok, K, SLOT, BITS, i, h, c, hi, r, offs_d, d_ok, stride_qt, stride_kt, stride_kh,
                   stride_slot, stride_bp, stride_br, scale2, NR, ST, BLOCK_M, BLOCK_N, IEEE)
        p = tl.exp2(s2 - m_safe[:, None]) * inv[:, None]
        pb = tl.sum(tl.reshape(p, [BLOCK_M, NB_T, NR]), 2)  # [rows, key blocks of the tile]
        blk = c // NR + tl.arange(0, NB_T)
        for g in tl.static_range(G):
            mg = tl.sum(tl.where((gh == g)[:, None], pb, 0.0), 0)
            tl.store(MASS + (h * G + g) * stride_mh + i * stride_mi + blk, mg, mask=blk < nb)


def fused_mass_supported(q: torch.Tensor, block: int, stride: int) -> bool:
    """Whether ``antidiagonal_mass`` runs these inputs: CUDA (or Triton's interpreter on CPU tensors) in float32,
    float16 or bfloat16, and a power-of-two number of row groups per block."""
    nr = block // stride
    return q.dtype in (torch.float32, torch.float16, torch.bfloat16) and nr & (nr - 1) == 0


def antidiagonal_mass(q: torch.Tensor, k: torch.Tensor, slot: torch.Tensor, bits: torch.Tensor, span: torch.Tensor,
                      num_blocks: int, block: int, stride: int, scale: float) -> torch.Tensor:
    """Block masses float32 [Hq, nq, nb] of XAttention's estimate (module doc).

    q [nq * block, Hq, D]: this rank's q blocks in local order; k [nb * block, Hkv, D]: the keys at their global
    positions (any value where no local row's envelope looks); slot int32 [nq, nb] and bits int32 [P, NR, words]
    (module doc); span int32 [nq, 2]: per local q block, the key blocks [first, last + 1) its envelope touches;
    ``scale``: applied to the antidiagonal dot products (softmax_scale / stride)."""
    nr = block // stride
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    nq, hq, d = q.shape[0] // block, q.shape[1], q.shape[2]
    hkv = k.shape[1]
    g = hq // hkv
    mass = torch.zeros(hq, nq, num_blocks, dtype=torch.float32, device=q.device)
    if nq == 0:
        return mass
    # 128 key groups a tile, 8 warps, 3 stages: the fastest of the launch shapes tried (half the time of
    # 64 / 4 / 2 at 128k causal; 32 or 256 groups, 1-2 stages slower)
    block_n = max(128, nr)
    block_m = max(16, triton.next_power_of_2(g * nr))
    antidiagonal_mass_kernel[(nq, hkv)](
        q, k, slot, bits, span, mass, q.stride(0), q.stride(1), k.stride(0), k.stride(1), slot.stride(0),
        bits.stride(0), bits.stride(1), mass.stride(0), mass.stride(1), num_blocks, scale * LOG2E,
        NR=nr, ST=stride, G=g, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, num_warps=8, num_stages=3,
    )
    return mass
