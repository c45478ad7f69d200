"""The Triton kernels' launches, one ``KernelConfig`` each: grids, schedules, head-dim constants and tensor
descriptors. ``prepared`` is a ``backend.TritonPrepared`` (its ``schedules`` / ``keep_schedule``); the backend
decides what runs where, this module only starts the kernels.
"""

from __future__ import annotations

import functools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..config import KernelConfig
from .bwd import attn_bwd_dkdv_kernel, attn_bwd_dkdv_reduce_kernel, attn_bwd_dq_kernel
from .delta import block_dim
from .fwd import LOG2E, attn_fwd_kernel

__all__ = ["launch_dkdv", "launch_dq", "launch_fwd", "plain_dims"]


def plain_dims(q, v) -> bool:
    """q/k and v share one power-of-two head dim (tensor descriptors and cuDNN pieces need that)."""
    return q.shape[-1] == v.shape[-1] == block_dim(q.shape[-1])


def _dims(q, v) -> dict:
    """The kernels' head-dim constants: power-of-two blocks and the true dims of q/k and v."""
    return dict(HEAD_DIM=block_dim(q.shape[-1]), DIM_QK=q.shape[-1], HEAD_DIM_V=block_dim(v.shape[-1]),
                DIM_V=v.shape[-1])


def _descriptor(t: torch.Tensor, block_rows: int):
    """Tensor descriptor of [s, H, D] viewed as [s, H * D], blocks of [block_rows, D] (one head)."""
    s, h, d = t.shape
    if t.stride(2) != 1 or t.stride(1) != d:
        t = t.contiguous()
    return TensorDescriptor(t, [s, h * d], [t.stride(0), 1], [block_rows, d])


@functools.lru_cache(maxsize=None)
def _sm_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _use_tma(c: KernelConfig, q: torch.Tensor) -> bool:
    """Tensor descriptors: wanted by the config and usable (Hopper or newer GPU, or the CPU interpreter)."""
    if not c.tma:
        return False
    if not q.is_cuda:
        return True
    return _sm_major(q.device.index if q.device.index is not None else torch.cuda.current_device()) >= 9



def _schedule(prepared, c: KernelConfig, device, keep, rows: bool):
    """(descriptors, the row (``rows``) or column schedule, sched_stride_b, sched_stride_e) for config c:
    the list's shared schedule (head strides 0), or with ``keep`` its per-head one (the head strides of
    ptr and off)."""
    if keep is None:
        desc, r, col = prepared.schedules(c.block_m, c.block_n, device)
        return desc, (r if rows else col), 0, 0
    desc, sched = prepared.keep_schedule(c.block_m, c.block_n, keep, rows=rows)
    return desc, sched, sched.ptr.stride(0), sched.off.stride(0)


def launch_fwd(c: KernelConfig, q, k, v, out, lse, prepared, scale: float, accumulate: bool, keep=None):
    """Forward kernel with config c: q [sq, Hq, D], k/v [sk, Hkv, D] (unit stride along D), out [sq, Hq, D]
    (q's dtype or float32) and lse [sq, Hq] float32 written, or merged into when ``accumulate``; ``keep``
    (BlockKeep or None): per-head row schedules (not with ``accumulate``)."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    desc, rows, sb, se = _schedule(prepared, c, q.device, keep, rows=True)
    # an accumulating launch leaves rows without tiles as they are: it skips their (empty) blocks;
    # a writing launch visits every block (rows without tiles get out 0, lse -inf)
    nm = rows.n_busy if accumulate else rows.order.shape[1]
    if nm == 0:
        return
    tma = _use_tma(c, q) and plain_dims(q, v)
    kd, vd = (_descriptor(x, c.block_n) for x in (k, v)) if tma else (k, v)
    attn_fwd_kernel[(nm * hq,)](
        q, k, v, out, lse, kd, vd, desc, rows.ptr, rows.mid, rows.order, rows.off, rows.tile,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), sb, se,
        sq, sk, hq, scale * LOG2E,
        GROUP=hq // hkv, BLOCK_M=c.block_m, BLOCK_N=c.block_n, **_dims(q, v),
        ACCUM=accumulate, IEEE=q.dtype == torch.float32, TMA=tma,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )


def launch_dkdv(c: KernelConfig, q, k, v, dout, lse, delta, dk, dv, prepared, scale: float, keep=None):
    """dK/dV kernels (and the fixed-order reduce of split key columns) with config c: q/dout [sq, Hq, D],
    k/v [sk, Hkv, D] (sk, Hkv > 0), lse/delta [sq, Hq] float32 of one layout (head-major views in
    backward(), contiguous rows also work); dk/dv like k, written. ``keep`` (BlockKeep or None): per-head
    column schedules, each q head of a kv group walking its own list; one work item per k block."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    desc, cols, sb, se = _schedule(prepared, c, q.device, keep, rows=False)
    w = cols.work
    tma = _use_tma(c, q) and plain_dims(q, v)
    qd, dod = (_descriptor(x, c.block_m) for x in (q, dout)) if tma else (q, dout)
    if w.n_slots:  # workspace blocks of the padded head dims
        wk = torch.empty(w.n_slots, hkv, c.block_n, block_dim(d), device=q.device, dtype=torch.float32)
        wv = torch.empty(w.n_slots, hkv, c.block_n, block_dim(v.shape[2]), device=q.device, dtype=torch.float32)
    else:
        wk = wv = dk  # unused
    attn_bwd_dkdv_kernel[(w.n.shape[0] * hkv,)](
        q, k, v, dout, lse, delta, dk, dv, qd, dod, desc, cols.ptr, cols.mid, cols.off, cols.tile,
        w.n, w.seg, w.nseg, w.slot, wk, wv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        lse.stride(0), lse.stride(1), sb, se,
        sq, sk, hkv, scale * LOG2E, scale,
        GROUP=hq // hkv, BLOCK_M=c.block_m, BLOCK_N=c.block_n, **_dims(q, v),
        IEEE=q.dtype == torch.float32, TMA=tma,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    if w.n_slots:
        attn_bwd_dkdv_reduce_kernel[(w.red_n.shape[0] * hkv,)](
            wk, wv, dk, dv, w.red_n, w.red_slot0, w.red_nseg,
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), sk, hkv,
            BLOCK_N=c.block_n, **_dims(q, v), num_warps=4,
        )


def launch_dq(c: KernelConfig, q, k, v, dout, lse, delta, dq, prepared, scale: float, keep=None):
    """dQ kernel with config c: shapes as launch_dkdv (sq > 0); dq like q, written; ``keep``: per-head row
    schedules."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    desc, rows, sb, se = _schedule(prepared, c, q.device, keep, rows=True)
    nm = rows.order.shape[1]
    tma = _use_tma(c, q) and plain_dims(q, v)
    kd, vd = (_descriptor(x, c.block_n) for x in (k, v)) if tma else (k, v)
    attn_bwd_dq_kernel[(nm * hq,)](
        q, k, v, dout, lse, delta, dq, kd, vd, desc, rows.ptr, rows.mid, rows.order, rows.off, rows.tile,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), lse.stride(0), lse.stride(1),
        sb, se, sq, sk, hq, scale * LOG2E, scale,
        GROUP=hq // hkv, BLOCK_M=c.block_m, BLOCK_N=c.block_n, **_dims(q, v),
        IEEE=q.dtype == torch.float32, TMA=tma,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
