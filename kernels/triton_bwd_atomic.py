"""Triton backward over block schedules, atomic dQ (faster, not bitwise reproducible in dQ).

One kernel, ``attn_bwd_fused_atomic_kernel``: ``triton_bwd.attn_bwd_dkdv_kernel`` itself, launched with
ATOMIC_DQ=True. One program per dK/dV work item (k block or segment of a split k block, x kv head), walking
the column-major schedule exactly as the deterministic launch does (same inner loop, same loads, masks and
arithmetic for dK and dV, so those are bitwise equal to the deterministic kernel's on the same schedule). After forming dS^T it also computes
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

from .triton_bwd import attn_bwd_dkdv_kernel

# The fused kernel is triton_bwd.attn_bwd_dkdv_kernel launched with ATOMIC_DQ=True: one dK/dV inner loop
# (triton_bwd._dkdv_inner) serves both modes, so dK/dV are the deterministic kernel's statement for
# statement. A name of its own here so that launches of the atomic phase can be told apart (and spied on).
attn_bwd_fused_atomic_kernel = attn_bwd_dkdv_kernel


def launch_bwd_atomic(q, k, v, dout, lse, delta, dk, dv, desc, cols, config, scale: float, group: int):
    """Atomic-dQ backward: fills dk/dv in place and returns dq.

    q, dout [sq, Hq, D] and k, v [sk, Hkv, D] (fp16/bf16/fp32, unit stride along D, as prepared by
    triton_backend._rows); lse, delta fp32 contiguous [sq, Hq] (merged lse; delta = rowsum(dO * O) - dlse);
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
    from .triton_backend import _launch_dkdv_kernels

    _launch_dkdv_kernels(attn_bwd_fused_atomic_kernel, q, k, v, dout, lse, delta, dk, dv, qd, dod, desc, cols, c,
                         scale, group, tma, dqw)
