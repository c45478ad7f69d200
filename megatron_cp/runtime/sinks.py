"""Attention sinks: a per-head sink logit added to every row's softmax normaliser, applied once per row
after the partial results are merged.

A sink is an extra key column with logit ``sink[h]`` (already in scaled-score units, natural log) and a
zero value vector (gpt-oss; Megatron's ``softmax_type`` ``off-by-one``: sink 0, ``learnable``: a per-head
parameter). With the merged ``(out, lse)`` of a row over its real keys, the row's attention with the sink
column is

    lse' = logaddexp(lse, sink)          out' = out * exp(lse - lse') = out * sigmoid(lse - sink)

so a sink needs nothing from the kernels or the exchange: every strategy (megatron-cp's runtime, the
baselines, sparse attention) returns the merged, global ``(out, lse)`` of each local row, and the sink is
applied to that pair, once. Backward (``w = sigmoid(lse - sink)``, ``t = rowsum(dout' * out)``)::

    dout = w dout'     dlse = w (1 - w) t + w dlse'     dsink = sum over rows of (-w (1 - w) t + (1 - w) dlse')

and ``dlse`` flows into the attention's backward (which takes an lse gradient: ``delta = rowsum(dout *
out) - dlse``), which reproduces ``dS = P' (dP' - rowsum(dout' * out'))`` of the softmax with the sink
column. A row that keeps no key (lse -inf) gets out' 0 and lse' = sink, never NaN.
"""

from __future__ import annotations

import torch

from ..kernels import accumulate_dtype, refuse_double_backward


class _Sink(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, lse, sink):
        cdt = accumulate_dtype(out.dtype)
        z = sink.to(cdt)
        l32 = lse.to(cdt)
        w = torch.sigmoid(l32 - z)  # 0 on rows with lse -inf
        new_out = (out.to(cdt) * w.unsqueeze(-1)).to(out.dtype)
        new_lse = torch.logaddexp(l32, z.expand_as(l32)).to(lse.dtype)
        ctx.save_for_backward(out, w)
        ctx.sink_dtype, ctx.lse_dtype = sink.dtype, lse.dtype
        ctx.set_materialize_grads(False)
        return new_out, new_lse

    @staticmethod
    def backward(ctx, dout, dlse):
        refuse_double_backward("megatron_cp.apply_sink")  # w is saved without a graph: no second derivative
        out, w = ctx.saved_tensors
        cdt = w.dtype
        d_out = d_lse = d_sink = None
        t = None if dout is None else (dout.to(cdt) * out.to(cdt)).sum(-1)
        if dout is not None:
            d_out = (dout.to(cdt) * w.unsqueeze(-1)).to(out.dtype)
        g_lse = torch.zeros_like(w)  # gradient of the sink-free lse
        g_sink = torch.zeros_like(w)  # per row, summed over rows below
        if t is not None:
            ww = w * (1 - w) * t
            g_lse += ww
            g_sink -= ww
        if dlse is not None:
            dl = dlse.to(cdt)
            g_lse += w * dl
            g_sink += (1 - w) * dl
        if ctx.needs_input_grad[1]:
            d_lse = g_lse.to(ctx.lse_dtype)
        if ctx.needs_input_grad[2]:
            d_sink = g_sink.sum(0).to(ctx.sink_dtype)
        return d_out, d_lse, d_sink


def apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' attention with a sink column (module doc), from merged results.

    out ``[s, H, Dv]`` (float32/bfloat16/float16/float64), lse ``[s, H]`` float32, float64 for float64 out
    (natural log, -inf on rows that keep no key; it must carry its gradient: strategies with ``lse_grad=True``),
    sink ``[H]`` (any float dtype; a tensor without gradient for a fixed sink such as off-by-one's zeros).
    Returns ``(out' [s, H, Dv]`` of out's dtype, ``lse' [s, H]`` of lse's dtype); computed in
    ``accumulate_dtype(out.dtype)``. Differentiable once in out, lse and sink. Raises ValueError on shapes
    that do not fit.
    """
    if out.dim() != 3 or lse.shape != out.shape[:2]:
        raise ValueError(f"out must be [s, H, Dv] and lse [s, H], got out {tuple(out.shape)}, lse {tuple(lse.shape)}")
    if not isinstance(sink, torch.Tensor) or sink.dim() != 1 or sink.shape[0] != out.shape[1]:
        raise ValueError(f"sink must be a 1-D tensor with one logit per head ({out.shape[1]}), got "
                         f"{getattr(sink, 'shape', sink)}")
    if not sink.is_floating_point():
        raise ValueError(f"sink must be a floating-point tensor, got {sink.dtype}")
    return _Sink.apply(out, lse, sink.to(out.device))
