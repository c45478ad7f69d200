"""Triton backward over block schedules, atomic dQ (faster, not bitwise reproducible in dQ).

One kernel, ``attn_bwd_fused_atomic_kernel``: one program per dK/dV work item (k block or segment of a
split k block, x kv head), walking the column-major schedule exactly like
``triton_bwd.attn_bwd_dkdv_kernel`` (same loads, same masks, same arithmetic for dK and dV, so those are
bitwise equal to the deterministic kernel's on the same schedule). After forming dS^T it also computes
this block pair's share of dQ, ``dS @ K`` [BLOCK_M, HEAD_DIM] fp32, and adds it with ``tl.atomic_add``
into an fp32 workspace [sq, Hq, D]. Per block pair that is 5 matmuls (S^T, dV, dP^T, dK, dQ) instead of
the deterministic path's 7 (its dQ kernel recomputes S and dP); the price is that the order of the fp32
additions into dQ depends on program timing, so dQ differs between runs in its last bits.

dK/dV of split k blocks still go through the workspace slots and ``attn_bwd_dkdv_reduce_kernel``
(fixed order); each segment adds its own dQ share atomically. The softmax scale of dQ is applied once
afterwards by a torch op on the workspace (``launch_bwd_atomic``), not per block pair in the kernel.

Cost of the atomics: BLOCK_M x HEAD_DIM fp32 adds per block pair and q head, i.e. 4 / (10 BLOCK_N) bytes
of L2 read-modify-write per matmul FLOP; programs of neighbouring k blocks walk the same q blocks in the
same order, so they add into the same dQ rows at about the same time. Larger BLOCK_N means fewer adds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_bwd import _load_rows, _tile_keep, attn_bwd_dkdv_reduce_kernel
from .triton_fwd import LOG2E


@triton.jit
def _fused_inner(dk, dv, k, v, offs_n, Qh, DOh, QD, DOD, col0, lse_h, delta_h, DQh, stride_qs, stride_dos,
                 stride_ls, stride_dqs, OFF, TID, DESC, e0, e1, sq, qk_scale, BLOCK_M: tl.constexpr,
                 HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr):
    """Schedule entries e0..e1 of one k block for one q head: returns dk, dv [BLOCK_N, HEAD_DIM] fp32
    accumulated; adds each entry's unscaled dS @ K [BLOCK_M, HEAD_DIM] fp32 into DQh (head h's slice of
    the workspace, row stride stride_dqs). MASKED: partial entries (tile mask, rows past sq)."""
    # dK/dV part: statement for statement triton_bwd._dkdv_inner (the bitwise-equality test relies on it)
    offs_d = tl.arange(0, HEAD_DIM)
    for e in range(e0, e1):
        m0 = tl.load(OFF + e)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        q = _load_rows(Qh, QD, m0, col0, sq, stride_qs, BLOCK_M, HEAD_DIM, MASKED, TMA)
        do = _load_rows(DOh, DOD, m0, col0, sq, stride_dos, BLOCK_M, HEAD_DIM, MASKED, TMA)
        if MASKED:
            ok = offs_m < sq
            lse = tl.load(lse_h + offs_m * stride_ls, mask=ok, other=float("inf"))
            delta = tl.load(delta_h + offs_m * stride_ls, mask=ok, other=0.0)
        else:
            lse = tl.load(lse_h + offs_m * stride_ls)
            delta = tl.load(delta_h + offs_m * stride_ls)
        # lse = -inf marks a row with nothing kept anywhere: make its P (hence its dS and dQ share) exactly 0
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        if IEEE:
            sT = tl.dot(k, tl.trans(q), input_precision="ieee")
        else:
            sT = tl.dot(k, tl.trans(q))
        pT = tl.math.exp2(sT * qk_scale - lse2[None, :])
        if MASKED:
            keepT = _tile_keep(DESC, TID, e, offs_m, offs_n, True)
            pT = tl.where(keepT, pT, 0.0)
        if IEEE:
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision="ieee")
            dpT = tl.dot(v, tl.trans(do), input_precision="ieee")
        else:
            dv = tl.dot(pT.to(do.dtype), do, dv)
            dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        if IEEE:
            dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision="ieee")
            dq = tl.dot(tl.trans(dsT.to(k.dtype)), k, input_precision="ieee")
        else:
            dk = tl.dot(dsT.to(q.dtype), q, dk)
            # dS rounded to the input dtype as for dK (and as the deterministic dQ kernel does)
            dq = tl.dot(tl.trans(dsT.to(k.dtype)), k)
        ptrs = DQh + offs_m.to(tl.int64)[:, None] * stride_dqs + offs_d[None, :]
        # relaxed: only atomicity is needed (nothing reads dQ before the kernel ends), no fences
        if MASKED:
            # rows past sq exist only in partial entries (full blocks lie inside a tile, inside [0, sq))
            tl.atomic_add(ptrs, dq, mask=(offs_m < sq)[:, None], sem="relaxed")
        else:
            tl.atomic_add(ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit
def attn_bwd_fused_atomic_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQW, QD, DOD, DESC, PTR, MID, OFF, TID, W_N, W_SEG, W_NSEG, W_SLOT, WK, WV,
    stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_dos, stride_doh,
    stride_dks, stride_dkh, stride_dvs, stride_dvh, stride_dqs, stride_dqh, stride_ls, stride_lh,
    sched_stride_b, sched_stride_e,
    sq, sk, n_kv_heads, qk_scale, sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, TMA: tl.constexpr,
):
    """Grid: (work items x kv heads). As triton_bwd.attn_bwd_dkdv_kernel, plus DQW fp32 [sq, Hq, D]
    (zero-initialised) receiving the unscaled dS @ K of every block pair by atomic adds."""
    pid = tl.program_id(0)
    hk = pid % n_kv_heads
    i = pid // n_kv_heads
    # work item i: segment seg of nseg of k block n's entry list (see triton_schedule.ColumnWork)
    n = tl.load(W_N + i)
    seg = tl.load(W_SEG + i)
    nseg = tl.load(W_NSEG + i)
    slot = tl.load(W_SLOT + i)
    offs_n = n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n64 = offs_n.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < sk
    # keys past sk read as 0, so their (masked-out anyway) dQ contributions are 0 too
    k = tl.load(K + offs_n64[:, None] * stride_ks + hk * stride_kh + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    v = tl.load(V + offs_n64[:, None] * stride_vs + hk * stride_vh + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        # per-head schedule rows (stride 0 today: one schedule shared by all heads)
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
        dqh = DQW + h * stride_dqh  # q head h's own slice: heads of a group never add into each other
        col0 = h * HEAD_DIM
        dk, dv = _fused_inner(dk, dv, k, v, offs_n, qh, doh, QD, DOD, col0, lse_h, delta_h, dqh, stride_qs,
                              stride_dos, stride_ls, stride_dqs, off, tid, DESC, e0, e_mid, sq, qk_scale, BLOCK_M,
                              HEAD_DIM, False, IEEE, TMA)
        dk, dv = _fused_inner(dk, dv, k, v, offs_n, qh, doh, QD, DOD, col0, lse_h, delta_h, dqh, stride_qs,
                              stride_dos, stride_ls, stride_dqs, off, tid, DESC, e_mid, e1, sq, qk_scale, BLOCK_M,
                              HEAD_DIM, True, IEEE, TMA)
    dk = dk * sm_scale
    if slot < 0:
        tl.store(DK + offs_n64[:, None] * stride_dks + hk * stride_dkh + offs_d[None, :],
                 dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
        tl.store(DV + offs_n64[:, None] * stride_dvs + hk * stride_dvh + offs_d[None, :],
                 dv.to(DV.dtype.element_ty), mask=col_ok[:, None])
    else:  # one segment of a split k block: fp32 partial into its workspace slot (reduced in slot order)
        tile = tl.arange(0, BLOCK_N)[:, None] * HEAD_DIM + offs_d[None, :]
        base = (slot * n_kv_heads + hk).to(tl.int64) * (BLOCK_N * HEAD_DIM)
        tl.store(WK + base + tile, dk)
        tl.store(WV + base + tile, dv)


def launch_bwd_atomic(q, k, v, dout, lse, delta, dk, dv, desc, cols, config, scale: float, group: int):
    """Atomic-dQ backward: fills dk/dv in place and returns dq.

    q, dout [sq, Hq, D] and k, v [sk, Hkv, D] (fp16/bf16/fp32, unit stride along D, as prepared by
    triton_backend._rows); lse, delta fp32 [sq, Hq] of one layout (merged lse; delta = rowsum(dO * O) - dlse);
    dk, dv [sk, Hkv, D] outputs like k (every element written); desc int32 [n_tiles, 6] and cols the
    column-major BlockSchedule (with ``work``) from ``TritonPrepared.schedules(config.block_m,
    config.block_n, device)``; config the dK/dV KernelConfig; scale the softmax scale; group = Hq // Hkv.

    Returns dq [sq, Hq, D] in q's dtype: the fp32 workspace times ``scale`` (a torch op), cast.
    """
    # imported here: triton_backend imports this module
    from .triton_backend import _descriptor, _use_tma

    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    if hq != group * hkv:
        raise ValueError(f"group={group} x Hkv={hkv} must equal Hq={hq}")
    if sk == 0 or hkv == 0:
        return torch.zeros_like(q)  # no keys: every row's gradient is 0 (dk/dv are empty)
    if sq == 0:
        dk.zero_()
        dv.zero_()
        return torch.empty_like(q)
    # fp32 whatever the input dtype: low-precision atomics would lose the small per-block shares
    dqw = torch.zeros(sq, hq, d, device=q.device, dtype=torch.float32)
    tma = _use_tma(config, q)
    qd, dod = (_descriptor(x, config.block_m) for x in (q, dout)) if tma else (q, dout)
    _launch(q, k, v, dout, lse, delta, dk, dv, dqw, qd, dod, desc, cols, config, scale, group, tma)
    dqw.mul_(scale)
    return dqw if q.dtype == torch.float32 else dqw.to(q.dtype)


def _launch(q, k, v, dout, lse, delta, dk, dv, dqw, qd, dod, desc, cols, c, scale, group, tma):
    """The kernels of launch_bwd_atomic (sq, sk, Hkv > 0): fills dk/dv and adds the unscaled dQ into dqw
    fp32 [sq, Hq, D]; qd/dod the tensor descriptors of q/dout when tma, else q/dout. A separate step so
    tests can hand in dqw as a view of a larger, guarded buffer."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    w = cols.work
    if w.n_slots:
        wk = torch.empty(w.n_slots, hkv, c.block_n, d, device=q.device, dtype=torch.float32)
        wv = torch.empty_like(wk)
    else:
        wk = wv = dk  # unused
    attn_bwd_fused_atomic_kernel[(w.n.shape[0] * hkv,)](
        q, k, v, dout, lse, delta, dk, dv, dqw, qd, dod, desc, cols.ptr, cols.mid, cols.off, cols.tile,
        w.n, w.seg, w.nseg, w.slot, wk, wv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        dqw.stride(0), dqw.stride(1), lse.stride(0), lse.stride(1), 0, 0,
        sq, sk, hkv, scale * LOG2E, scale,
        GROUP=group, HEAD_DIM=d, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
        IEEE=q.dtype == torch.float32, TMA=tma,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    if w.n_slots:
        attn_bwd_dkdv_reduce_kernel[(w.red_n.shape[0] * hkv,)](
            wk, wv, dk, dv, w.red_n, w.red_slot0, w.red_nseg,
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), sk, hkv,
            HEAD_DIM=d, BLOCK_N=c.block_n, num_warps=4,
        )
