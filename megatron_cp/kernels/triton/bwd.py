"""Triton backward over block schedules, deterministic (no atomics).

Two kernels, each writing every output element exactly once:

* ``attn_bwd_dkdv_kernel``: one program per (k block, kv head). It walks the column-major schedule
  (the q blocks meeting its k block, full ones first) for each of the ``group`` q heads sharing the kv
  head, accumulating dK and dV in registers: GQA needs no expanded K/V and no reduction pass.
* ``attn_bwd_dq_kernel``: one program per (q block, q head), walking the row-major schedule.

Both recompute P = exp(S - lse) from the merged (global) lse, and dS = P * (dP - delta) with
delta = rowsum(dO * O) - dlse supplied by the caller. Rows with lse = -inf contribute nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fwd import load_block, row_schedule, store_block, tile_keep


@triton.jit
def _load_rows(base, desc, row0, col0, n_rows, stride, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
               MASKED: tl.constexpr, TMA: tl.constexpr, DIM: tl.constexpr):
    """Rows row0 .. row0+BLOCK of a [n_rows, DIM] matrix as a [BLOCK, HEAD_DIM] block (HEAD_DIM: DIM's
    power-of-two block, padded columns read as 0); rows past n_rows read as 0 when MASKED.
    TMA: through the tensor descriptor ``desc`` of the [rows, heads * HEAD_DIM] view at column col0
    (the copy engine zero-fills rows out of bounds); else plain pointers from ``base`` (row stride
    ``stride``)."""
    if TMA:
        x = desc.load([row0, col0])
    else:
        offs = row0 + tl.arange(0, BLOCK)
        ptrs = base + offs.to(tl.int64)[:, None] * stride + tl.arange(0, HEAD_DIM)[None, :]
        x = load_block(ptrs, offs < n_rows, DIM, HEAD_DIM, MASKED)
    return x


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """``a @ b`` (+ ``acc`` when given): with IEEE fp32 products (the exact float32 / float64 path), else the
    tensor cores' default precision."""
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _dkdv_inner(dk, dv, k, v, offs_n, Qh, DOh, QD, DOD, col0, lse_h, delta_h, stride_qs, stride_dos, stride_ls,
                OFF, TID, DESC, e0, e1, sq, qk_scale, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                MASKED: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, DIM_QK: tl.constexpr,
                HEAD_DIM_V: tl.constexpr, DIM_V: tl.constexpr):
    for e in range(e0, e1):
        m0 = tl.load(OFF + e)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        q = _load_rows(Qh, QD, m0, col0, sq, stride_qs, BLOCK_M, HEAD_DIM, MASKED, TMA, DIM_QK)
        do = _load_rows(DOh, DOD, m0, col0, sq, stride_dos, BLOCK_M, HEAD_DIM_V, MASKED, TMA, DIM_V)
        if MASKED:
            ok = offs_m < sq
            lse = tl.load(lse_h + offs_m * stride_ls, mask=ok, other=float("inf"))
            delta = tl.load(delta_h + offs_m * stride_ls, mask=ok, other=0.0)
        else:
            lse = tl.load(lse_h + offs_m * stride_ls)
            delta = tl.load(delta_h + offs_m * stride_ls)
        # lse = -inf marks a row with nothing kept anywhere: make its P exactly 0
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        sT = _dot(k, tl.trans(q), None, IEEE)
        pT = tl.math.exp2(sT * qk_scale - lse2[None, :])
        if MASKED:
            keepT = tile_keep(DESC, TID, e, offs_m, offs_n, True)
            pT = tl.where(keepT, pT, 0.0)
        dv = _dot(pT.to(do.dtype), do, dv, IEEE)
        dpT = _dot(v, tl.trans(do), None, IEEE)
        dsT = pT * (dpT - delta[None, :])
        dk = _dot(dsT.to(q.dtype), q, dk, IEEE)
    return dk, dv


@triton.jit
def _column_program(W_N, n_kv_heads):
    """(work item, kv head, k block) of this program: programs run work items x kv heads, the head fastest."""
    pid = tl.program_id(0)
    i = pid // n_kv_heads
    return i, pid % n_kv_heads, tl.load(W_N + i)


@triton.jit
def _store_dkdv(DK, DV, dk, dv, n, hk, sk, stride_dks, stride_dkh, stride_dvs, stride_dvh, BLOCK_N: tl.constexpr,
                HEAD_DIM: tl.constexpr, DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, DIM_V: tl.constexpr):
    """k block ``n``'s finished dK (scaled) and dV of kv head ``hk`` into their outputs (rows past sk left alone)."""
    offs_n = n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n64 = offs_n.to(tl.int64)
    col_ok = offs_n < sk
    store_block(DK + offs_n64[:, None] * stride_dks + hk * stride_dkh + tl.arange(0, HEAD_DIM)[None, :],
                dk.to(DK.dtype.element_ty), col_ok, DIM_QK, HEAD_DIM)
    store_block(DV + offs_n64[:, None] * stride_dvs + hk * stride_dvh + tl.arange(0, HEAD_DIM_V)[None, :],
                dv.to(DV.dtype.element_ty), col_ok, DIM_V, HEAD_DIM_V)


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, QD, DOD, DESC, PTR, MID, OFF, TID, W_N, W_SEG, W_NSEG, W_SLOT, WK, WV,
    stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_dos, stride_doh,
    stride_dks, stride_dkh, stride_dvs, stride_dvh, stride_ls, stride_lh,
    sched_stride_b, sched_stride_e,
    sq, sk, n_kv_heads, qk_scale, sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, TMA: tl.constexpr, DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, DIM_V: tl.constexpr,
):
    # work item i: segment seg of nseg of k block n's entry list (see triton_blocks.ColumnWork)
    i, hk, n = _column_program(W_N, n_kv_heads)
    seg = tl.load(W_SEG + i)
    nseg = tl.load(W_NSEG + i)
    slot = tl.load(W_SLOT + i)
    offs_n = n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n64 = offs_n.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    col_ok = offs_n < sk
    k = load_block(K + offs_n64[:, None] * stride_ks + hk * stride_kh + offs_d[None, :], col_ok, DIM_QK, HEAD_DIM,
                   True)
    v = load_block(V + offs_n64[:, None] * stride_vs + hk * stride_vh + offs_dv[None, :], col_ok, DIM_V,
                   HEAD_DIM_V, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        # this q head's own schedule row (stride 0 when all heads share one; per-head lists under BlockKeep)
        p0 = tl.load(PTR + h * sched_stride_b + n)
        p1 = tl.load(PTR + h * sched_stride_b + n + 1)
        mid = tl.load(MID + h * sched_stride_b + n)
        e0 = p0 + ((p1 - p0) * seg) // nseg
        e1 = p0 + ((p1 - p0) * (seg + 1)) // nseg
        e_mid = tl.minimum(tl.maximum(mid, e0), e1)
        off = OFF + h * sched_stride_e
        tid = TID + h * sched_stride_e
        qh = Q + h * stride_qh
        doh = DO + h * stride_doh
        lse_h = LSE + h * stride_lh
        delta_h = DELTA + h * stride_lh
        col0 = h * HEAD_DIM
        dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, qh, doh, QD, DOD, col0, lse_h, delta_h, stride_qs, stride_dos,
                             stride_ls, off, tid, DESC, e0, e_mid, sq, qk_scale, BLOCK_M, HEAD_DIM, False, IEEE,
                             TMA, DIM_QK, HEAD_DIM_V, DIM_V)
        dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, qh, doh, QD, DOD, col0, lse_h, delta_h, stride_qs, stride_dos,
                             stride_ls, off, tid, DESC, e_mid, e1, sq, qk_scale, BLOCK_M, HEAD_DIM, True, IEEE,
                             TMA, DIM_QK, HEAD_DIM_V, DIM_V)
    dk = dk * sm_scale
    if slot < 0:
        _store_dkdv(DK, DV, dk, dv, n, hk, sk, stride_dks, stride_dkh, stride_dvs, stride_dvh, BLOCK_N, HEAD_DIM,
                    DIM_QK, HEAD_DIM_V, DIM_V)
    else:  # one segment of a split k block: fp32 partial into its workspace slot (whole padded blocks)
        base = (slot * n_kv_heads + hk).to(tl.int64)
        tl.store(WK + base * (BLOCK_N * HEAD_DIM) + tl.arange(0, BLOCK_N)[:, None] * HEAD_DIM + offs_d[None, :], dk)
        tl.store(WV + base * (BLOCK_N * HEAD_DIM_V) + tl.arange(0, BLOCK_N)[:, None] * HEAD_DIM_V + offs_dv[None, :],
                 dv)


@triton.jit
def attn_bwd_dkdv_reduce_kernel(
    WK, WV, DK, DV, RED_N, RED_SLOT0, RED_NSEG, stride_dks, stride_dkh, stride_dvs, stride_dvh, sk, n_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    DIM_V: tl.constexpr,
):
    """dK/dV of split k blocks: the sum of their segments' partials, always in slot order."""
    i, hk, n = _column_program(RED_N, n_kv_heads)
    s0 = tl.load(RED_SLOT0 + i)
    ns = tl.load(RED_NSEG + i)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    tile_k = tl.arange(0, BLOCK_N)[:, None] * HEAD_DIM + offs_d[None, :]
    tile_v = tl.arange(0, BLOCK_N)[:, None] * HEAD_DIM_V + offs_dv[None, :]
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], tl.float32)
    for s in range(s0, s0 + ns):
        base = (s * n_kv_heads + hk).to(tl.int64)
        dk += tl.load(WK + base * (BLOCK_N * HEAD_DIM) + tile_k)
        dv += tl.load(WV + base * (BLOCK_N * HEAD_DIM_V) + tile_v)
    _store_dkdv(DK, DV, dk, dv, n, hk, sk, stride_dks, stride_dkh, stride_dvs, stride_dvh, BLOCK_N, HEAD_DIM, DIM_QK,
                HEAD_DIM_V, DIM_V)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, offs_m, Kh, Vh, KD, VD, col0, stride_ks, stride_vs, OFF, TID, DESC, e0,
              e1, sk, qk_scale, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
              IEEE: tl.constexpr, TMA: tl.constexpr, DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              DIM_V: tl.constexpr):
    for e in range(e0, e1):
        n0 = tl.load(OFF + e)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _load_rows(Kh, KD, n0, col0, sk, stride_ks, BLOCK_N, HEAD_DIM, MASKED, TMA, DIM_QK)
        v = _load_rows(Vh, VD, n0, col0, sk, stride_vs, BLOCK_N, HEAD_DIM_V, MASKED, TMA, DIM_V)
        s = _dot(q, tl.trans(k), None, IEEE)
        dp = _dot(do, tl.trans(v), None, IEEE)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            keep = tile_keep(DESC, TID, e, offs_m, offs_n, False)
            p = tl.where(keep, p, 0.0)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(k.dtype), k, dq, IEEE)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, KD, VD, DESC, PTR, MID, ORDER, OFF, TID,
    stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_dos, stride_doh,
    stride_dqs, stride_dqh, stride_ls, stride_lh, sched_stride_b, sched_stride_e,
    sq, sk, n_heads, qk_scale, sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, TMA: tl.constexpr, DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, DIM_V: tl.constexpr,
):
    h, m, e0, e_mid, e1, OFF, TID = row_schedule(PTR, MID, ORDER, OFF, TID, n_heads, sched_stride_b, sched_stride_e)
    hk = h // GROUP
    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_m64 = offs_m.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_m < sq
    q = load_block(Q + offs_m64[:, None] * stride_qs + h * stride_qh + offs_d[None, :], ok, DIM_QK, HEAD_DIM, True)
    do = load_block(DO + offs_m64[:, None] * stride_dos + h * stride_doh + tl.arange(0, HEAD_DIM_V)[None, :], ok,
                    DIM_V, HEAD_DIM_V, True)
    lse = tl.load(LSE + offs_m64 * stride_ls + h * stride_lh, mask=ok, other=float("inf"))
    delta = tl.load(DELTA + offs_m64 * stride_ls + h * stride_lh, mask=ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    Kh = K + hk * stride_kh
    Vh = V + hk * stride_vh
    col0 = hk * HEAD_DIM
    dq = _dq_inner(dq, q, do, lse2, delta, offs_m, Kh, Vh, KD, VD, col0, stride_ks, stride_vs, OFF, TID, DESC,
                   e0, e_mid, sk, qk_scale, BLOCK_N, HEAD_DIM, False, IEEE, TMA, DIM_QK, HEAD_DIM_V, DIM_V)
    dq = _dq_inner(dq, q, do, lse2, delta, offs_m, Kh, Vh, KD, VD, col0, stride_ks, stride_vs, OFF, TID, DESC,
                   e_mid, e1, sk, qk_scale, BLOCK_N, HEAD_DIM, True, IEEE, TMA, DIM_QK, HEAD_DIM_V, DIM_V)
    dq = dq * sm_scale
    store_block(DQ + offs_m64[:, None] * stride_dqs + h * stride_dqh + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                ok, DIM_QK, HEAD_DIM)
