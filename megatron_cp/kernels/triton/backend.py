"""TritonBackend: fused attention over tile lists, with cuDNN for the dense pieces.

Implements the backend protocol (kernels/protocol.py). Configuration is explicit (``TritonConfig``);
nothing is read from the environment. Triton's CPU interpreter (``TRITON_INTERPRET=1`` set by the caller
before ``triton`` is imported) runs the same kernels on CPU tensors for tests.

How a list runs is decided in ``prepare`` (the split into cuDNN pieces and a Triton rest,
kernels/pieces.py) and, for cuDNN, once per (device, dtype, head_dim, Hq / Hkv) by a probe
(kernels/triton/cudnn.py) on the first call of that family: a family cuDNN cannot run goes to the Triton
kernels alone, and a cuDNN error after the probe is raised.

A ``BlockKeep`` (``forward`` / ``backward``'s ``keep``, dynamic sparse attention) runs on the Triton kernels
alone, over per-head schedules built on the device per call (kernels/triton/sparse.py). The kernels' launches
(grids, schedules, descriptors) are kernels/triton/launch.py's.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from triton.runtime.interpreter import InterpretedFunction

from ...kinds import Kind
from . import cudnn
from ..config import DEFAULT_CONFIGS, KernelConfig, PhaseConfigs, TritonConfig, configs_from_json
from ..merge import merge_into
from ..pieces import BLOCKY_FULL_FRACTION, LONG_ROW_KEYS
from ..protocol import check_running
from .delta import head_major, row_delta
from .fwd import attn_fwd_kernel
from .launch import launch_dkdv, launch_dq, launch_fwd, plain_dims
from .prepared import CudnnSplit, HostPrepare, TritonPrepared, prepare_list
from .sparse import kernel_blocks

__all__ = ["BLOCKY_FULL_FRACTION", "DEFAULT_CONFIGS", "KernelConfig", "LONG_ROW_KEYS", "PhaseConfigs", "TritonBackend",
           "TritonConfig", "TritonPrepared", "CudnnSplit", "HostPrepare", "configs_from_json"]

# Triton's interpreter (TRITON_INTERPRET=1 before triton was imported) runs the kernels on CPU tensors
INTERPRETED = isinstance(attn_fwd_kernel, InterpretedFunction)


def _check_call(q, k, v, prepared) -> None:
    """``_check_qkv`` and the lengths ``prepared`` was built for."""
    _check_qkv(q, k, v)
    if q.shape[0] != prepared.seqlen_q or k.shape[0] != prepared.seqlen_k:
        raise ValueError(f"q/k lengths {q.shape[0]}/{k.shape[0]} differ from the prepared "
                         f"{prepared.seqlen_q}/{prepared.seqlen_k}")


def _check_qkv(q, k, v):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [s, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same rows and heads; got {tuple(k.shape)} and {tuple(v.shape)}")
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    if k.shape[2] != d:
        raise ValueError(f"q and k head_dim differ: {d} vs {k.shape[2]}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hkv={hkv} must divide Hq={hq}")
    why = _head_dims_unsupported(d, v.shape[2])
    if why is not None:
        raise ValueError(why)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one of fp16/bf16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")


def _head_dims_unsupported(d: int, dv: int) -> str | None:
    """Why the kernels cannot run q/k head dim ``d`` with v head dim ``dv``, or None: any of 16 .. 256 (a
    dim that is not a power of two runs in its power-of-two block, the padding masked)."""
    for name, x in (("head_dim", d), ("v head_dim", dv)):
        if not 16 <= x <= 256:
            return f"TritonBackend supports {name} 16 .. 256, got {x}"
    return None


def _cuda_present() -> bool:
    # pieces are split only where cuDNN can run them (a function so CPU tests can stand in a fake cuDNN)
    return torch.cuda.is_available()


def _rows(t: torch.Tensor) -> torch.Tensor:
    # kernels need unit stride along head_dim only
    return t if t.stride(-1) == 1 else t.contiguous()


def _path(split: CudnnSplit) -> str:
    return "cudnn+triton" if split.rest is not None else "cudnn"


class TritonBackend:
    """Fused Triton attention over tile lists (deterministic backward: no atomics), dense pieces on cuDNN.

    cudnn_probes: (device, dtype, head_dim, Hq // Hkv) -> cudnn.CudnnSupport, what the probe found for each
        family met so far (``layout`` None: that family runs on Triton only, ``reason`` says why).
    last_path: "cudnn", "cudnn+triton" or "triton": what the latest call ran.
    last_configs: phase -> KernelConfig the Triton kernels of the latest calls ran with.
    """

    name = "triton"

    def __init__(self, config: TritonConfig | None = None):
        self.config = config or TritonConfig()
        self.cudnn_probes: dict[tuple, cudnn.CudnnSupport] = {}
        self.last_path: str | None = None
        self.last_configs: dict[str, KernelConfig] = {}

    def supports(self, device, dtype: torch.dtype, head_dim: int, head_dim_v: int | None = None) -> str | None:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return (f"TritonBackend runs float16, bfloat16 and float32 inputs, not {dtype} "
                    "(the reference backend runs float64)")
        why = _head_dims_unsupported(head_dim, head_dim if head_dim_v is None else head_dim_v)
        if why is not None:
            return why
        device = torch.device(device)
        if device.type == "cuda" or (device.type == "cpu" and INTERPRETED):
            return None
        return (f"TritonBackend runs on CUDA devices (on the CPU only under Triton's interpreter: "
                f"TRITON_INTERPRET=1 set before triton is imported), not {device}")

    @property
    def _cudnn_wanted(self) -> bool:
        return self.config.dense_fast_path and not self.config.deterministic

    def _cudnn_allowed(self, q) -> bool:
        """The rules known up front: cuDNN wanted by the config, CUDA tensors, float16 / bfloat16."""
        return self._cudnn_wanted and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)

    def _cudnn_layout(self, q, k, v) -> str | None:
        """The cuDNN layout of this call's family (cudnn.probe, run on the family's first call), or None:
        no cuDNN for it (config, device, dtype, head dims other than one power of two, or the probe found
        none), the whole list runs on Triton."""
        if not self._cudnn_allowed(q) or not plain_dims(q, v):
            return None
        key = (q.device, q.dtype, q.shape[2], q.shape[1] // k.shape[1])
        found = self.cudnn_probes.get(key)
        if found is None:
            found = self.cudnn_probes[key] = cudnn.probe(*key)
        return found.layout

    def _kernel_config(self, phase: str, q, prepared, keep=None) -> KernelConfig:
        """The phase's KernelConfig; with ``keep`` its blocks reduced to divide keep.block
        (``triton_sparse.kernel_blocks``: ValueError when they cannot)."""
        c = getattr(self.config.for_head_dim(q.shape[2], prepared.row_class, q.dtype), phase)
        if keep is not None:
            bm, bn = kernel_blocks(c.block_m, c.block_n, keep.block)
            if (bm, bn) != (c.block_m, c.block_n):
                c = dataclasses.replace(c, block_m=bm, block_n=bn)
        self.last_configs[phase] = c
        return c

    @staticmethod
    def _scale(softmax_scale, q):
        return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])

    # -- per list ---------------------------------------------------------------------------------
    def prepare(self, tiles: torch.Tensor, seqlen_q: int, seqlen_k: int, head_dims=()) -> TritonPrepared:
        """tiles int [n, 5] (cpu) -> TritonPrepared (``prepared.prepare_list``): the schedules of ``head_dims``'
        configs built now, the others' on their first use (by default each block shape's: a list whose forward alone
        runs here, as under FA4's routes, never builds the backward's, nor another head dim's); split into cuDNN
        pieces and a Triton rest per direction where cuDNN may run (dense_fast_path, not deterministic, CUDA
        present), the whole list prepared too for families the cuDNN probe rejects."""
        return prepare_list(self.config, tiles, seqlen_q, seqlen_k, head_dims, self._splits())

    @property
    def prepare_host(self) -> HostPrepare:
        """``prepare`` made anywhere (protocol): a new plan's lists in the planning helper process, with the schedules
        of the calls' head dim (``HostPrepare.with_head_dims``) built there too."""
        return HostPrepare(self.config, self._splits())

    def _splits(self) -> bool:
        return self._cudnn_wanted and _cuda_present()

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, q, k, v, prepared: TritonPrepared, softmax_scale=None, keep=None):
        """q [sq, Hq, D], k/v [sk, Hkv, D] -> out [sq, Hq, D] (q's dtype), lse [sq, Hq] float32.

        keep: None or a BlockKeep (per-head selection, kernels/block_keep.py): then the Triton kernels run
        per-head schedules built on the device (no cuDNN pieces: their split does not know the selection),
        with kernel blocks that divide keep.block."""
        _check_call(q, k, v, prepared)
        scale = self._scale(softmax_scale, q)
        if keep is not None:
            keep.check(q, k)
        split = prepared.cudnn_fwd if keep is None else None
        layout = self._cudnn_layout(q, k, v) if split is not None else None
        if layout is None:
            self.last_path = "triton"
            out = torch.empty(q.shape[:2] + (v.shape[2],), device=q.device, dtype=q.dtype)
            lse = torch.empty(q.shape[0], q.shape[1], device=q.device, dtype=torch.float32)
            self._forward(q, k, v, prepared, scale, out, lse, accumulate=False, keep=keep)
            return out, lse
        self.last_path = _path(split)
        if split.whole:
            return cudnn.forward(q, k, v, scale, split.pieces[0][4] == Kind.CAUSAL, layout)
        if split.direct:
            return self._direct_forward(q, k, v, split, scale, layout)
        acc, lse = self._pieces_forward(q, k, v, split, scale, layout)
        return acc.to(q.dtype), lse

    def forward_accumulate(self, q, k, v, prepared: TritonPrepared, softmax_scale, out, lse) -> None:
        """Add this list into the running (out [sq, Hq, D], lse [sq, Hq]), both float32, in place (protocol).
        The Triton kernels merge in registers and skip rows the list does not cover; cuDNN pieces merge in
        one pass each (through a contiguous copy when out or lse is strided)."""
        _check_call(q, k, v, prepared)
        check_running("out", out, q, tuple(q.shape[:2]) + (v.shape[2],))
        check_running("lse", lse, q, tuple(q.shape[:2]))
        scale = self._scale(softmax_scale, q)
        split = prepared.cudnn_fwd
        layout = self._cudnn_layout(q, k, v) if split is not None else None
        if layout is None:
            self.last_path = "triton"
            self._forward(q, k, v, prepared, scale, out, lse, accumulate=True)
            return
        self.last_path = _path(split)
        if out.is_contiguous() and lse.is_contiguous():
            self._pieces_forward(q, k, v, split, scale, layout, out, lse)
            return
        acc, lse_new = self._pieces_forward(q, k, v, split, scale, layout, out.contiguous(), lse.contiguous())
        out.copy_(acc)
        lse.copy_(lse_new)

    def _pieces_forward(self, q, k, v, split: CudnnSplit, scale, layout, acc=None, lse=None):
        """cuDNN pieces, the rest through Triton, merged by LSE in float32 into the running (acc [sq, Hq, D],
        lse [sq, Hq], contiguous) when given (rows with lse -inf hold nothing), else into a new pair. With a
        running pair the pieces go first and the Triton rest merges inside its kernel (accumulating launch,
        no extra pass). Returns (acc, lse)."""
        sq, hq, d = q.shape
        rest_left = split.rest is not None
        if acc is None:
            if rest_left:  # the Triton rest writes the float32 running output itself (no conversion pass)
                acc = torch.empty(q.shape, device=q.device, dtype=torch.float32)
                lse = torch.empty(sq, hq, device=q.device, dtype=torch.float32)
                self._forward(q, k, v, split.rest, scale, acc, lse, accumulate=False)
                rest_left = False
            else:
                acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
                lse = torch.full((sq, hq), float("-inf"), device=q.device, dtype=torch.float32)
        pending = None  # a reversed piece's (rows, out, lse), merged together with the next piece on its rows
        for piece in split.pieces:
            qs, qe = piece[:2]
            o_t, l_t = _piece_forward(q, k, v, piece, scale, layout)
            if piece[4] == Kind.INV_CAUSAL:
                pending = (qs, qe, o_t, l_t)
                continue
            if pending is not None and pending[:2] == (qs, qe):
                merge_into(acc[qs:qe], lse[qs:qe], o_t, l_t, o2=pending[2], l2=pending[3], reverse2=True)
                pending = None
            else:
                merge_into(acc[qs:qe], lse[qs:qe], o_t, l_t)
        if pending is not None:
            qs, qe, o_t, l_t = pending
            merge_into(acc[qs:qe], lse[qs:qe], o_t, l_t, reverse=True)
        if rest_left:
            self._forward(q, k, v, split.rest, scale, acc, lse, accumulate=True)
        return acc, lse

    def _direct_forward(self, q, k, v, split: CudnnSplit, scale, layout):
        """Band-square pairs written straight into out (q's dtype) by one fresh merge each; the Triton rest,
        row-disjoint from them, writes its rows first (every row: its launch visits every block)."""
        sq, hq, d = q.shape
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        lse = torch.empty(sq, hq, device=q.device, dtype=torch.float32)
        if split.rest is not None:
            self._forward(q, k, v, split.rest, scale, out, lse, accumulate=False)
        for a, b in split.gaps:
            out[a:b] = 0
            lse[a:b] = float("-inf")
        for inv, causal in zip(split.pieces[0::2], split.pieces[1::2]):
            qs, qe = inv[:2]
            o_r, l_r = _piece_forward(q, k, v, inv, scale, layout)
            o_c, l_c = _piece_forward(q, k, v, causal, scale, layout)
            merge_into(out[qs:qe], lse[qs:qe], o_c, l_c, o2=o_r, l2=l_r, reverse2=True, fresh=True)
        return out, lse

    def _forward(self, q, k, v, prepared, scale, out, lse, accumulate, keep=None):
        if q.shape[0] == 0:
            return
        q, k, v = _rows(q), _rows(k), _rows(v)
        launch_fwd(self._kernel_config("fwd", q, prepared, keep), q, k, v, out, lse, prepared, scale, accumulate,
                    keep)

    # -- backward ---------------------------------------------------------------------------------
    def backward(self, q, k, v, out, lse, dout, prepared: TritonPrepared, softmax_scale=None, delta=None, keep=None):
        """Gradients (dq like q, dk/dv like k) from the merged lse [sq, Hq] and
        delta [sq, Hq] float32 = rowsum(dout * out) - dlse (computed from out, dout when None).
        keep: as in ``forward`` (Triton kernels only, per-head schedules; dK/dV without column splitting)."""
        _check_call(q, k, v, prepared)
        scale = self._scale(softmax_scale, q)
        if keep is not None:
            keep.check(q, k)
            self.last_path = "triton"
            return self._triton_backward(q, k, v, out, lse, dout, prepared, scale, delta, q.dtype, keep)
        split = prepared.cudnn_bwd
        layout = self._cudnn_layout(q, k, v) if split is not None else None
        # cuDNN computes delta = rowsum(dout * out) itself: usable only when the given delta is that (no LSE
        # gradient); checked bitwise against the same float32 computation, else Triton for all
        if layout is not None and (delta is None or torch.equal(delta.float(), (dout.float() * out.float()).sum(-1))):
            self.last_path = _path(split)
            if delta is None and split.rest is not None:
                delta = row_delta(out, dout)
            return self._pieces_backward(q, k, v, out, lse, dout, split, scale, delta, layout)
        self.last_path = "triton"
        return self._triton_backward(q, k, v, out, lse, dout, prepared, scale, delta, q.dtype)

    def backward_into(self, q, k, v, out, lse, dout, prepared: TritonPrepared, softmax_scale, delta, dq, dk, dv) -> None:
        """``backward``'s gradients added into float32 running sums ``dq``/``dk``/``dv`` shaped like q/k/v, any
        strides (e.g. the K and V halves of a [rows, 2*Hkv, D] buffer): what the staged runtime sums its
        stages' gradients in. The cuDNN pieces' gradients add straight into them; Triton's go through a
        float32 result (protocol)."""
        _check_call(q, k, v, prepared)
        for name, acc, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
            check_running(name, acc, q, tuple(like.shape))
        scale = self._scale(softmax_scale, q)
        split = prepared.cudnn_bwd
        layout = self._cudnn_layout(q, k, v) if split is not None and delta is None else None
        if layout is not None:
            self.last_path = _path(split)
            self._pieces_backward(q, k, v, out, lse, dout, split, scale,
                                  row_delta(out, dout) if split.rest is not None else None, layout, acc=(dq, dk, dv))
            return
        self.last_path = "triton"
        for acc, g in zip((dq, dk, dv), self._triton_backward(q, k, v, out, lse, dout, prepared, scale, delta,
                                                              torch.float32)):
            acc += g

    def _triton_backward(self, q, k, v, out, lse, dout, prepared, scale, delta, gdt, keep=None):
        """The Triton kernels' gradients of the whole of ``prepared`` (narrowed by ``keep`` when given), of
        dtype ``gdt``."""
        sq, hq, d = q.shape
        sk, hkv = k.shape[0], k.shape[1]
        # head-major lse / delta: the kernels' per-block row reads are then contiguous
        delta = row_delta(out, dout) if delta is None else head_major(delta)
        lse = head_major(lse)
        q, k, v, dout = _rows(q), _rows(k), _rows(v), _rows(dout)
        dk = torch.empty(k.shape, device=k.device, dtype=gdt)
        dv = torch.empty(v.shape, device=v.device, dtype=gdt)
        dq = torch.empty(q.shape, device=q.device, dtype=gdt)
        if sk > 0 and hkv > 0:
            launch_dkdv(self._kernel_config("dkdv", q, prepared, keep), q, k, v, dout, lse, delta, dk, dv, prepared,
                         scale, keep)
        if sq > 0:
            launch_dq(self._kernel_config("dq", q, prepared, keep), q, k, v, dout, lse, delta, dq, prepared, scale,
                       keep)
        return dq, dk, dv

    def _pieces_backward(self, q, k, v, out, lse, dout, split: CudnnSplit, scale, delta, layout, acc=None):
        """Gradients of the cuDNN pieces (global out/lse) and the rest (Triton, global lse and delta), summed
        in float32 and returned in the inputs' dtypes; with ``acc`` (dq, dk, dv running sums) added into
        those instead."""
        lse = lse.float().contiguous()
        if split.whole:  # one piece that is the whole call: cuDNN's gradients as they are
            grads = cudnn.backward(q, k, v, out, lse, dout, scale, split.pieces[0][4] == Kind.CAUSAL, layout)
            if acc is None:
                return grads
            for a, g in zip(acc, grads):
                a += g
            return None
        parts = []
        for qs, qe, ks, ke, kind, n in split.pieces:
            causal = kind == Kind.CAUSAL  # the backward's pieces are FULL or CAUSAL
            if n == 1:
                parts.append(cudnn.backward(q[qs:qe], k[ks:ke], v[ks:ke], out[qs:qe], lse[qs:qe], dout[qs:qe], scale,
                                            causal, layout))
                continue
            r, kw = (qe - qs) // n, ke - ks
            parts.append(cudnn.backward_batched(
                cudnn.band_view(q, qs, n, r, r), cudnn.band_view(k, ks, n, r, kw), cudnn.band_view(v, ks, n, r, kw),
                cudnn.band_view(out, qs, n, r, r), lse[qs:qe].view(n, r, -1), cudnn.band_view(dout, qs, n, r, r),
                scale, causal, layout))
        if split.rest is not None:  # float32 straight from the kernels: the pieces add into them
            rest = self._triton_backward(q, k, v, out, lse, dout, split.rest, scale, delta, torch.float32)
            if acc is None:
                dq, dk, dv = rest
            else:
                dq, dk, dv = acc
                for a, g in zip(acc, rest):
                    a += g
        elif acc is None:
            dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
            dk = torch.zeros(k.shape, device=q.device, dtype=torch.float32)
            dv = torch.zeros(v.shape, device=q.device, dtype=torch.float32)
        else:
            dq, dk, dv = acc
        for (qs, qe, ks, ke, kind, n), (gq, gk, gv) in zip(split.pieces, parts):
            if n == 1:
                dq[qs:qe] += gq
                dk[ks:ke] += gk
                dv[ks:ke] += gv
                continue
            r = (qe - qs) // n
            dq[qs:qe].view(n, r, *dq.shape[1:]).add_(gq)
            _fold_add(dk, gk, ks, r)
            _fold_add(dv, gv, ks, r)
        if acc is not None:
            return None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _piece_forward(q, k, v, piece, scale, layout):
    """(out [rows, Hq, D], lse [rows, Hq]) of one cuDNN piece; an INV_CAUSAL (band-square) piece's rows come
    back reversed (row p is the piece's row rows - 1 - p): top-left causal squares of the problem with its
    rows and keys flipped."""
    qs, qe, ks, ke, kind, n = piece
    hq, d = q.shape[1:]
    r = (qe - qs) // n
    if kind == Kind.INV_CAUSAL:
        span = (n - 1) * r + (ke - ks)
        qr, kr, vr = q[qs:qe].flip(0), k[ks:ks + span].flip(0), v[ks:ks + span].flip(0)
        o_t, l_t = cudnn.forward_batched(cudnn.band_view(qr, 0, n, r, r), cudnn.band_view(kr, 0, n, r, ke - ks),
                                         cudnn.band_view(vr, 0, n, r, ke - ks), scale, True, layout)
    elif n == 1:
        return cudnn.forward(q[qs:qe], k[ks:ke], v[ks:ke], scale, kind == Kind.CAUSAL, layout)
    else:  # a band piece: n chunks of r rows, keys sliding by r (one batched call)
        o_t, l_t = cudnn.forward_batched(cudnn.band_view(q, qs, n, r, r), cudnn.band_view(k, ks, n, r, ke - ks),
                                         cudnn.band_view(v, ks, n, r, ke - ks), scale, kind == Kind.CAUSAL, layout)
    return o_t.reshape(qe - qs, hq, d), l_t.reshape(qe - qs, hq).contiguous()


def _fold_add(dst, g, start: int, step: int):
    """dst[start + b*step + j] += g[b, j] for g [n, kw, H, D] (overlapping windows of a band piece)."""
    n, kw = g.shape[:2]
    if kw % step == 0:  # kw / step shifted, non-overlapping adds
        for t in range(kw // step):
            a = start + t * step
            dst[a:a + n * step].view(n, step, *dst.shape[1:]).add_(g[:, t * step:(t + 1) * step])
        return
    idx = (start + torch.arange(n, device=dst.device)[:, None] * step
           + torch.arange(kw, device=dst.device)[None, :]).reshape(-1)
    dst.index_add_(0, idx, g.reshape(n * kw, *g.shape[2:]).to(dst.dtype))
