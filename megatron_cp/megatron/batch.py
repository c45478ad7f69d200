"""Batch preparation replacing Megatron's ``get_batch_on_this_cp_rank``.

Megatron's split assumes the zigzag layout and equal token counts on every CP rank. Here a plan is
made per micro-batch and every per-token tensor is dispatched by it:

1. The ``b`` samples of the micro-batch are concatenated into one sequence of ``b * S`` tokens
   (one plan, one attention call per layer for the whole micro-batch). Sample boundaries are always
   document boundaries; with a packed mask, each EOD token also ends a document (the EOD belongs
   to the document it closes, as in Megatron's ``reset_attention_mask``).
2. Positions restart at 0 at every document (``reset_position_ids`` semantics), or at every sample.
3. The mask is built from these documents (``MaskSpec``) and planned with ``megatron_cp.plan``.
4. tokens, labels, loss_mask and position_ids are dispatched: each becomes ``[1, s_local]``.

Labels are already shifted by the data set (``labels[i]`` is the token after ``tokens[i]`` within
the sample), so shifting happens before dispatch and stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

import megatron_cp as mcp

from megatron_cp.kernels import upload
from megatron_cp.planner import plan_like

from . import planning
from .options import BOUNDARY_MASKS, BUILDER_MASKS, MASKS, MaskSpec, PlanOptions  # noqa: F401 (the batch API)
from .params import CPParams
from .planning import (GlobalPlan, PlanCache, build_mask, build_window_mask, document_bounds,  # noqa: F401
                       make_plan, plan_for_batch, plan_global_batch, positions_from_bounds, step_planner)


@dataclass
class CPBatch:
    tokens: torch.Tensor
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    position_ids: torch.Tensor
    params: CPParams
    cu_seqlens: np.ndarray = field(repr=False, default=None)


def prepare_batch(
    tokens: torch.Tensor,
    labels: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    spec: MaskSpec,
    cp_group,
    options: PlanOptions = PlanOptions(),
    gating=None,
    host_tokens: np.ndarray | None = None,
    planned=None,
) -> CPBatch:
    """Plan and dispatch one micro-batch.

    tokens / labels / loss_mask: ``[b, S]`` (int64, int64, float), the full micro-batch, identical on
    every rank of ``cp_group`` (as Megatron's data loader gives them). Returns ``[1, s_local]`` tensors
    on the same device plus ``params`` to pass as ``packed_seq_params``. ``cp_group=None`` means CP=1.
    No collective: that the CP ranks hold the same plan is checked by the attention's first call of it
    (``runtime.verify_plan``), before any exchange.

    With ``options.gating`` (a ``GatingSpec``) the params also carry the streaming plan
    (``plan_like(streaming_within(mask, sink, window), plan)``) and a gating object: ``gating`` if given
    (train mode needs one: a ``gating.GateSource`` over the training loop's gates), else the spec's own
    (pattern mode: the ``--cp-head-pattern`` file). ``host_tokens``: the same tokens on the host where the
    caller has them (the loader's copy): the plan is then found without copying ``tokens`` back from the
    GPU, a copy that would make the host wait for the previous micro-batch's kernels. ``planned``: the plan a
    planning thread made and checked across the CP ranks for this micro-batch (``checked_planner``): its first
    attention call then runs no check of its own.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [b, S], got shape {tuple(tokens.shape)}")
    for name, t in (("labels", labels), ("loss_mask", loss_mask)):
        if t is not None and t.shape != tokens.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} differs from tokens {tuple(tokens.shape)}")
    b, S = tokens.shape
    cp_size = 1 if cp_group is None else cp_group.size()
    cp_rank = 0 if cp_group is None else cp_group.rank()
    if host_tokens is None:
        tok_np = tokens.detach().cpu().numpy()
    else:
        tok_np = np.asarray(host_tokens)
        if tok_np.shape != tuple(tokens.shape):
            raise ValueError(f"host_tokens shape {tok_np.shape} differs from tokens {tuple(tokens.shape)}")
    plan, strategy, cu, plan_key = planning.batch_plan(tok_np, spec, cp_size, options)
    if planned is not None:  # taken now, at the same point of every rank's step (runtime.accept_plan_check)
        mcp.runtime.accept_plan_check(planned, cp_group)
    stream_plan = None
    if options.gating is not None:
        g = options.gating
        gating = gating if gating is not None else g.source()
        if gating is None:
            raise ValueError("head gating in train mode needs prepare_batch(..., gating=GateSource(...)): the "
                             "gates are the training loop's parameters")
        # the same token layout as the full plan: one dispatch serves both kinds of heads
        stream_plan = planning.PLANS.get(plan_key + ("stream", g.sink, g.window), lambda: plan_like(
            mcp.masks.streaming_within(build_mask(spec, cu, b, S), g.sink, g.window), plan))
    elif gating is not None:
        raise ValueError("prepare_batch(gating=...) needs PlanOptions.gating (sink, window) for the streaming plan")
    window_plan = None
    if spec.layer_window is not None:
        if strategy != "megatron_cp" or options.sparse is not None or options.gating is not None:
            raise ValueError(f"windowed layers (layer_window={spec.layer_window}) run with megatron_cp's own plan, "
                             f"without sparse attention or head gating (got strategy {strategy!r})")
        # the same token layout: the windowed layers' work follows the tokens, balanced with them
        window_plan = planning.PLANS.get(plan_key + ("layer window", spec.layer_window),
                                 lambda: plan_like(build_window_mask(spec, cu), plan))
    ids = upload(plan.local_ids(cp_rank), tokens.device)
    pos = upload(positions_from_bounds(cu), tokens.device)

    def take(x):
        return None if x is None else x.reshape(-1).index_select(0, ids).unsqueeze(0)

    local_pos = take(pos)
    params = CPParams(plan=plan, position_ids=local_pos, cp_rank=cp_rank, cp_group=cp_group,
                      layer=options.layer, gating=gating, stream_plan=stream_plan, layer_window=spec.layer_window,
                      window_plan=window_plan, qkv_format="sbhd")
    return CPBatch(take(tokens), take(labels), take(loss_mask), local_pos, params, cu)


def prepare_global_batch(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    spec: MaskSpec,
    group,
    *,
    dp_rank: int,
    cp_rank: int,
    cp_size: int,
    options: PlanOptions = PlanOptions(),
    host_tokens: np.ndarray | None = None,
    planned: "GlobalPlan | None" = None,
) -> CPBatch:
    """``prepare_batch`` with one plan over the whole DP x CP world (``--cp-balance-over-dp``).

    tokens / labels / loss_mask: ``[b, S]``, this DP group's micro-batch (the same on its CP ranks). Every DP
    group's micro-batch is gathered (``runtime.all_micro_batches``), their masks put side by side
    (``masks.block_diagonal``) and planned over ``group`` (every rank of the DP x CP world), and this rank keeps
    the tokens the plan gives it: ``[1, s_local]`` tensors and ``params`` whose ``cp_group`` is ``group``, which
    core attention then runs over. The per-token loss summed over the global batch and Megatron's gradient
    reduction over DP x CP make loss and gradients those of the fixed layout. ``planned``: this micro-batch's
    ``plan_global_batch``, made ahead by a planning thread (not used if made for other tokens); else it is made
    here from tokens gathered on the host over a gloo twin of ``group`` (``host_tokens``: the loader's host copy
    where there is one, else one copy back from the device), so the GPU queue is not waited for. The device
    fields are gathered on their own devices."""
    if not options.over_dp:
        raise ValueError("prepare_global_batch needs PlanOptions(over_dp=True) (--cp-balance-over-dp)")
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [b, S], got shape {tuple(tokens.shape)}")
    for name, t in (("labels", labels), ("loss_mask", loss_mask)):
        if t.shape != tokens.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} differs from tokens {tuple(tokens.shape)}")
    place = dict(dp_rank=dp_rank, cp_rank=cp_rank, cp_size=cp_size)
    if host_tokens is None:
        host = tokens.detach().cpu().numpy()
    else:
        host = np.ascontiguousarray(host_tokens, dtype=np.int64)
        if tuple(host.shape) != tuple(tokens.shape):
            raise ValueError(f"host_tokens shape {tuple(host.shape)} differs from tokens {tuple(tokens.shape)}")
    # a plan made ahead for other tokens (a micro-batch read again without its planning thread, as Megatron's
    # rerun of a step does on every rank) is not used: planned here instead
    if planned is None or not np.array_equal(planned.tokens[dp_rank], host):
        planned = plan_global_batch(host, spec, mcp.runtime.host_group(group), options=options, **place)
    plan, cus = planned.plan, planned.cu_seqlens
    full = mcp.runtime.all_micro_batches(
        {"tokens": tokens.reshape(-1), "labels": labels.reshape(-1), "loss_mask": loss_mask.reshape(-1)}, group,
        **place)
    rank = group.rank()
    ids = upload(plan.local_ids(rank), tokens.device)
    pos = upload(np.concatenate([positions_from_bounds(c) for c in cus]), tokens.device)

    def take(x):
        return x.index_select(0, ids).unsqueeze(0)

    local_pos = take(pos)
    params = CPParams(plan=plan, position_ids=local_pos, cp_rank=rank, cp_group=group,
                      layer=options.layer, layer_window=spec.layer_window,
                      window_plan=planned.window_plan, qkv_format="sbhd")
    return CPBatch(take(full["tokens"]), take(full["labels"]), take(full["loss_mask"]), local_pos, params,
                   cus[dp_rank])


def prepare_step_batch(tokens, labels, loss_mask, spec: MaskSpec, options: PlanOptions = PlanOptions(),
                       host_tokens: np.ndarray | None = None, planned: GlobalPlan | None = None) -> CPBatch:
    """A training step's micro-batch on Megatron's groups: ``prepare_batch`` over the CP group, or with
    ``options.over_dp`` ``prepare_global_batch`` over the DP x CP group. ``planned``: what the planning thread
    returned for this micro-batch (``step_planner``'s function), or None."""
    from megatron.core import parallel_state as ps

    if options.over_dp:
        world = ps.get_data_parallel_group(with_context_parallel=True)
        return prepare_global_batch(tokens, labels, loss_mask, spec, world, dp_rank=ps.get_data_parallel_rank(),
                                    cp_rank=ps.get_context_parallel_rank(),
                                    cp_size=ps.get_context_parallel_world_size(), options=options,
                                    host_tokens=host_tokens, planned=planned)
    return prepare_batch(tokens, labels, loss_mask, spec, ps.get_context_parallel_group(), options,
                         host_tokens=host_tokens, planned=planned)
