"""Triton forward over a block schedule: one launch computes out and lse of every (q block, q head).

Each program owns one q block of one q head and walks the k blocks its schedule lists: first the full
blocks (no mask arithmetic), then the partial ones (tile descriptor applied). All blocks of all tiles
touching the rows merge in registers by online softmax (base-2 exponent, fp32 statistics), so tiles
sharing rows need no second pass. GQA/MQA: the program reads K/V of head ``h // group`` in place.

Programs are numbered ``i * Hq + h`` with ``m = order[i]``: heads of one q block run side by side
(they share K/V through L2) and the heaviest q blocks start first.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def load_block(ptrs, row_ok, DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """A [rows, BLOCK_D] block at ``ptrs``: rows where ``row_ok`` is False (when ROWS) and the columns from
    DIM on (a head dim padded to the power of two BLOCK_D) read as 0; no mask at all when neither applies."""
    if DIM < BLOCK_D:
        cols = tl.arange(0, BLOCK_D) < DIM
        if ROWS:
            x = tl.load(ptrs, mask=row_ok[:, None] & cols[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=cols[None, :], other=0.0)
    else:
        if ROWS:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def row_schedule(PTR, MID, ORDER, OFF, TID, n_heads, sched_stride_b, sched_stride_e):
    """This program's (q block, q head) and its row-major schedule: the head h, the q block m (programs take
    q blocks in ORDER), its entries [e0, e_mid) full and [e_mid, e1) masked, and OFF / TID advanced to head h.
    Schedules carry a head axis; its strides are 0 while all heads share one schedule."""
    pid = tl.program_id(0)
    h = pid % n_heads
    i = pid // n_heads
    m = tl.load(ORDER + h * sched_stride_b + i)
    e0 = tl.load(PTR + h * sched_stride_b + m)
    e_mid = tl.load(MID + h * sched_stride_b + m)
    e1 = tl.load(PTR + h * sched_stride_b + m + 1)
    return h, m, e0, e_mid, e1, OFF + h * sched_stride_e, TID + h * sched_stride_e


@triton.jit
def store_block(ptrs, x, row_ok, DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store a [rows, BLOCK_D] block: rows where ``row_ok`` and the columns below DIM."""
    if DIM < BLOCK_D:
        tl.store(ptrs, x, mask=row_ok[:, None] & (tl.arange(0, BLOCK_D) < DIM)[None, :])
    else:
        tl.store(ptrs, x, mask=row_ok[:, None])


@triton.jit
def tile_keep(DESC, TID, e, offs_m, offs_n, TRANSPOSED: tl.constexpr):
    """Kept cells of the tile of schedule entry e: [BLOCK_M, BLOCK_N] (q rows x k cols), or its
    transpose [BLOCK_N, BLOCK_M] when TRANSPOSED."""
    t = tl.load(TID + e)
    qs = tl.load(DESC + t * 6 + 0)
    qe = tl.load(DESC + t * 6 + 1)
    ks = tl.load(DESC + t * 6 + 2)
    ke = tl.load(DESC + t * 6 + 3)
    lo = tl.load(DESC + t * 6 + 4)
    hi = tl.load(DESC + t * 6 + 5)
    if TRANSPOSED:
        dkq = offs_n[:, None] - offs_m[None, :]
        keep = ((offs_m[None, :] >= qs) & (offs_m[None, :] < qe) & (offs_n[:, None] >= ks)
                & (offs_n[:, None] < ke) & (dkq >= lo) & (dkq <= hi))
    else:
        dkq = offs_n[None, :] - offs_m[:, None]
        keep = ((offs_m[:, None] >= qs) & (offs_m[:, None] < qe) & (offs_n[None, :] >= ks)
                & (offs_n[None, :] < ke) & (dkq >= lo) & (dkq <= hi))
    return keep


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, offs_m, k_base, v_base, KD, VD, col0, stride_ks, stride_vs, OFF, TID, DESC,
               e0, e1, sk, qk_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr,
               TMA: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               DIM_V: tl.constexpr):
    # k_base / v_base: pointers of k block 0 ([BLOCK_N, D], built once); an entry adds one scalar offset,
    # which keeps per-iteration address arithmetic to one add per element
    for e in range(e0, e1):
        n0 = tl.load(OFF + e)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if TMA:  # copy engine; rows past sk come back as zeros
            k = KD.load([n0, col0])
        else:
            k_ptrs = k_base + n0.to(tl.int64) * stride_ks
            v_ptrs = v_base + n0.to(tl.int64) * stride_vs
            k = load_block(k_ptrs, offs_n < sk, DIM_QK, HEAD_DIM, MASKED)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        if MASKED:
            s = tl.where(tile_keep(DESC, TID, e, offs_m, offs_n, False), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # rows with nothing kept yet keep m = -inf; subtract 0 instead so exp2 gives 0, not NaN
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if TMA:
            v = VD.load([n0, col0])
        else:
            v = load_block(v_ptrs, offs_n < sk, DIM_V, HEAD_DIM_V, MASKED)
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd_kernel(
    Q, K, V, O, LSE, KD, VD, DESC, PTR, MID, ORDER, OFF, TID,
    stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_os, stride_oh,
    stride_ls, stride_lh, sched_stride_b, sched_stride_e,
    sq, sk, n_heads, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACCUM: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr,
    DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, DIM_V: tl.constexpr,
):
    # HEAD_DIM / HEAD_DIM_V: power-of-two blocks of the q/k and v head dims DIM_QK / DIM_V (MLA: 192 -> 256
    # and 128); padded columns read as 0 and are not written
    h, m, e0, e_mid, e1, OFF, TID = row_schedule(PTR, MID, ORDER, OFF, TID, n_heads, sched_stride_b, sched_stride_e)
    hk = h // GROUP

    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    row_ok = offs_m < sq
    q_ptrs = Q + offs_m.to(tl.int64)[:, None] * stride_qs + h * stride_qh + offs_d[None, :]
    q = load_block(q_ptrs, row_ok, DIM_QK, HEAD_DIM, True)
    offs_b = tl.arange(0, BLOCK_N)
    k_base = K + hk * stride_kh + offs_b[:, None] * stride_ks + offs_d[None, :]
    v_base = V + hk * stride_vh + offs_b[:, None] * stride_vs + offs_dv[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], tl.float32)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, k_base, v_base, KD, VD, hk * HEAD_DIM, stride_ks,
                               stride_vs, OFF, TID, DESC, e0, e_mid, sk, qk_scale, BLOCK_N, False, IEEE, TMA,
                               HEAD_DIM, DIM_QK, HEAD_DIM_V, DIM_V)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, k_base, v_base, KD, VD, hk * HEAD_DIM, stride_ks,
                               stride_vs, OFF, TID, DESC, e_mid, e1, sk, qk_scale, BLOCK_N, True, IEEE, TMA,
                               HEAD_DIM, DIM_QK, HEAD_DIM_V, DIM_V)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    o_ptrs = O + offs_m.to(tl.int64)[:, None] * stride_os + h * stride_oh + offs_dv[None, :]
    l_ptrs = LSE + offs_m.to(tl.int64) * stride_ls + h * stride_lh
    if ACCUM:
        # add this stage into the running (out, lse) of earlier stages: LSE-weighted merge
        lse_prev = tl.load(l_ptrs, mask=row_ok, other=float("-inf"))
        out_prev = load_block(o_ptrs, row_ok, DIM_V, HEAD_DIM_V, True).to(tl.float32)
        mx = tl.maximum(lse_prev, lse)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w_prev = tl.exp(lse_prev - mx)
        w_cur = tl.exp(lse - mx)
        tot = w_prev + w_cur
        tot_safe = tl.where(tot == 0.0, 1.0, tot)
        out = (out_prev * w_prev[:, None] + out * w_cur[:, None]) / tot_safe[:, None]
        lse = tl.where(tot == 0.0, float("-inf"), mx + tl.log(tot_safe))
    store_block(o_ptrs, out.to(O.dtype.element_ty), row_ok, DIM_V, HEAD_DIM_V)
    tl.store(l_ptrs, lse, mask=row_ok)
