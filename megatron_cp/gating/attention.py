"""Head-gated hybrid attention (DuoAttention, PruLong): full attention or a streaming window per KV head.

Training mixes, per KV head, full attention under the micro-batch's mask with streaming attention (the
mask's cells within ``sink`` first keys or ``window`` recent keys, ``masks.streaming_within``) by a
differentiable gate ``alpha`` in [0, 1]::

    out[:, h] = alpha[h // G] * full[:, h] + (1 - alpha[h // G]) * streaming[:, h]

Both parts run the CP runtime on plans sharing one token layout (``streaming_plans``): the streaming
plan moves only what its window and sinks read. After training, ``pattern_attention`` runs each KV head
either full or streaming: one attention call for the full heads and one for the streaming heads, so
streaming heads cost only their window in compute and K/V traffic.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..kernels import accumulate_dtype
from ..masks import AttnMask, streaming_within
from ..planner import Plan, plan, plan_like
from ..runtime import attention


def streaming_plans(mask: AttnMask, cp_size: int, sink: int, window: int, **plan_kwargs) -> tuple[Plan, Plan]:
    """(full plan of ``mask``, streaming plan of ``streaming_within(mask, sink, window)``) with one token
    layout: tokens dispatched by either plan serve both. ``plan_kwargs`` go to ``plan`` for the full one."""
    full = plan(mask, cp_size, **plan_kwargs)
    return full, plan_like(streaming_within(mask, sink, window), full)


def _check_pair(full: Plan, stream: Plan) -> None:
    if full.cp_size != stream.cp_size or not (np.array_equal(full.bounds, stream.bounds)
                                               and np.array_equal(full.owner, stream.owner)):
        raise ValueError("the full and streaming plans must share one token layout: make them with "
                         "streaming_plans(...) or planner.plan_like(streaming_mask, full_plan)")


def _check_gate(gate: torch.Tensor, hq: int, hkv: int) -> None:
    if not isinstance(gate, torch.Tensor) or gate.dim() != 1 or gate.shape[0] != hkv:
        raise ValueError(f"gate must be a 1-D tensor with one value per KV head ({hkv}), got "
                         f"{getattr(gate, 'shape', gate)}")


def gated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, full_plan: Plan, stream_plan: Plan,
                    group: dist.ProcessGroup | None, gate: torch.Tensor, softmax_scale: float | None = None, *,
                    backend="auto") -> torch.Tensor:
    """alpha * full + (1 - alpha) * streaming per KV head (module doc).

    q [s_local, Hq, D], k / v [s_local, Hkv, D] in the plans' local order; gate float [Hkv] (alpha,
    differentiable; values outside [0, 1] are the caller's choice, e.g. before a clamp). Returns out
    [s_local, Hq, D] of q's dtype; differentiable in q, k, v and gate. Bad input raises ValueError before
    any collective."""
    _check_pair(full_plan, stream_plan)
    _check_gate(gate, q.shape[1], k.shape[1])
    full, _ = attention(q, k, v, full_plan, group, softmax_scale, backend=backend)
    stream, _ = attention(q, k, v, stream_plan, group, softmax_scale, backend=backend)
    a = gate.to(full.dtype).repeat_interleave(q.shape[1] // k.shape[1])[None, :, None]
    return a * full + (1 - a) * stream


def pattern_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, full_plan: Plan, stream_plan: Plan,
                      group: dist.ProcessGroup | None, full_heads, softmax_scale: float | None = None, *,
                      backend="auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Each KV head full (``full_heads[h]`` True) or streaming: one attention call per kind over its heads.

    ``full_heads``: a sequence of Hkv bools (a learned pattern). Returns (out [s_local, Hq, D], lse
    [s_local, Hq] float32, float64 for float64 inputs), as ``megatron_cp.attention``."""
    _check_pair(full_plan, stream_plan)
    hq, hkv = q.shape[1], k.shape[1]
    f = [bool(x) for x in full_heads]
    if len(f) != hkv:
        raise ValueError(f"full_heads has {len(f)} entries, expected one per KV head ({hkv})")
    g = hq // hkv
    out = q.new_empty(q.shape[:2] + (v.shape[2],))
    lse = torch.empty(q.shape[:2], dtype=accumulate_dtype(q.dtype), device=q.device)
    parts = []
    for want, p in ((True, full_plan), (False, stream_plan)):
        kv = [h for h in range(hkv) if f[h] == want]
        if not kv:
            continue
        qh = [h * g + i for h in kv for i in range(g)]
        kvi = torch.tensor(kv, device=q.device)
        qi = torch.tensor(qh, device=q.device)
        o, l = attention(q.index_select(1, qi), k.index_select(1, kvi), v.index_select(1, kvi), p, group,
                         softmax_scale, backend=backend)
        parts.append((qi, o, l))
    # out-of-place scatter keeps autograd simple: index_copy on a fresh tensor per part
    for qi, o, l in parts:
        out = out.index_copy(1, qi, o)
        lse = lse.index_copy(1, qi, l)
    return out, lse
