"""Dynamic block-sparse attention under a plan: select, exchange the selected blocks, compute.

Per call, on each rank: the selector reads this rank's q / k and small summaries (``SelectionView``:
all-reduces), returns ``keep [Hq, nq, nb]`` inside the envelope; the K/V blocks some head selected travel
to the rank (``sparse.exchange``: one count synchronisation); the kernel computes the envelope's tiles
narrowed by the per-head selection (``kernels.BlockKeep``), forward and backward. Selection is not
differentiable; gradients flow through the kept cells.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import kernels
from ..kernels.block_keep import BlockKeep
from ..planner import Plan
from ..runtime import attention as dense_attention
from ..runtime import check_inputs, plan_cache, plan_rank, resolve_backend, tell_peers
from ..runtime.state import fingerprint, input_fields, verify_plan
from . import exchange
from .layout import SparseLayout, check_plan, sparse_layout
from .selector import Selector
from .view import SelectionView, envelope_spans, most_candidates


def _state(plan: Plan, rank: int, block: int, device, be, bkey) -> dict:
    """Cached per (plan, rank, block, device, backend): the layout, its device arrays, prepared tiles
    (``be`` None: none)."""
    cache = plan_cache(plan)
    key = ("sparse", rank, block, str(device), bkey)
    st = cache.get(key)
    if st is None:
        lay: SparseLayout = sparse_layout(plan, rank, block)
        st = {
            "layout": lay,
            "dev": exchange.DeviceLayout.of(lay, device),
            "envelope": lay.envelope.to(device),
            "q_blocks": torch.as_tensor(lay.q_blocks, dtype=torch.long, device=device),
            "traps": torch.as_tensor(lay.traps, dtype=torch.long, device=device),
            "spans": envelope_spans(lay.traps, lay.num_blocks * block, block),
            "selector cache": {},  # SelectionView.cache: what selectors derive from this layout, kept with it
            # selection alone (select_blocks) needs no kernel: no prepared tiles
            "prepared": None if be is None else be.prepare(lay.tiles, lay.nq * block, lay.ne * block),
        }
        cache[key] = st
    return st


def _combine(group, op):
    def f(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, op=op, group=group)
        return t
    return f


def _view(st: dict, k: torch.Tensor, group) -> SelectionView:
    lay: SparseLayout = st["layout"]
    dev: exchange.DeviceLayout = st["dev"]
    multi = group is not None and lay.cp_size > 1
    view = SelectionView(lay.block, lay.num_blocks, st["q_blocks"], st["envelope"], st["traps"], spans=st["spans"],
                         q_host=lay.q_blocks, traps_host=lay.traps, envelope_host=lay.envelope,
                         cache=st["selector cache"])
    if multi:
        view.combine = _combine(group, dist.ReduceOp.SUM)
        view.combine_max = _combine(group, dist.ReduceOp.MAX)

    def envelope_keys():
        # every block the local envelope touches: a dense K exchange (XAttention reads every key of a row)
        need = torch.zeros(lay.num_blocks, dtype=torch.bool, device=k.device)
        need[dev.env_ids] = True
        # whole blocks: the antidiagonal sums of a partial block read keys the envelope does not
        r = exchange.route(need, dev, group if multi else None, whole=True)
        buf = exchange.fill(r, k, dev, group if multi else None)
        return dev.env_ids, buf.view(lay.ne, lay.block, *k.shape[1:])
    view.envelope_keys = envelope_keys
    return view


def keeps_whole_envelope(plan: Plan, selector) -> bool:
    """True when ``selector`` keeps every envelope block of ``plan``'s mask whatever q and k are (MoBA on
    documents of at most top_k + 1 blocks): the same on every rank (a function of the plan), cached with it."""
    keeps_all = getattr(selector, "keeps_all", None)  # optional in the Selector protocol
    if keeps_all is None:
        return False
    cache = plan_cache(plan)
    key = ("sparse most candidates", selector.block)
    if key not in cache:
        cache[key] = most_candidates(plan.traps, plan.seqlen, selector.block)
    return bool(keeps_all(cache[key]))


def check_selector(selector, q: torch.Tensor, k: torch.Tensor, plan: Plan) -> None:
    """ValueError unless ``selector`` implements ``Selector`` and accepts these shapes (no collective)."""
    if not isinstance(selector, Selector):
        raise ValueError(f"selector must implement megatron_cp.sparse.Selector (name, block, check, select), got "
                         f"{type(selector).__name__}")
    selector.check(q.shape[1], k.shape[1], q.shape[2], plan.seqlen)


def select_blocks(q: torch.Tensor, k: torch.Tensor, plan: Plan, group, selector: Selector) -> torch.Tensor:
    """This rank's selection: bool [Hq, nq, nb] (its q blocks in local order x global key blocks),
    inside the envelope. q [s_local, Hq, D], k [s_local, Hkv, D] as for ``attention``. Collective."""
    rank = plan_rank(plan, group)
    check_inputs(q, k, k, plan, rank, None)
    check_selector(selector, q, k, plan)
    st = _state(plan, rank, selector.block, q.device, None, None)
    grp = group if plan.cp_size > 1 else None
    return _select(selector, q, k, st, grp)


def _select(selector, q, k, st, group) -> torch.Tensor:
    with torch.no_grad():
        keep = selector.select(q.detach(), k.detach(), _view(st, k.detach(), group))
    return keep & (st["envelope"] > 0)[None]


class _SparseKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kbuf, vbuf, keep: BlockKeep, prepared, be, scale):
        out, lse = be.forward(q, kbuf, vbuf, prepared, scale, keep=keep)
        ctx.save_for_backward(q, kbuf, vbuf, out, lse)
        ctx.keep, ctx.prepared, ctx.be, ctx.scale = keep, prepared, be, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        kernels.refuse_double_backward("megatron_cp.sparse.sparse_attention")
        q, kbuf, vbuf, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        delta = None
        if dlse is not None:
            cdt = kernels.accumulate_dtype(out.dtype)
            delta = (dout.to(cdt) * out.to(cdt)).sum(-1) - dlse.to(cdt)
        dq, dk, dv = ctx.be.backward(q, kbuf, vbuf, out, lse, dout, ctx.prepared, ctx.scale, delta, keep=ctx.keep)
        return dq, dk, dv, None, None, None, None


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan,
    group: dist.ProcessGroup | None,
    selector: Selector,
    softmax_scale: float | None = None,
    *,
    backend: str | kernels.Backend = "auto",
    stats: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context-parallel attention of this rank's tokens under ``plan``, narrowed per head to the key
    blocks ``selector`` chooses at run time (``megatron_cp.sparse``: MoBA, XAttention, FlexPrefill,
    MInference).

    q [s_local, Hq, D], k/v [s_local, Hkv, D] in the plan's local order (``dispatch``); the plan's
    chunks must be whole blocks of ``selector.block`` and it must have no guest rows (``plan(...,
    chunk_size=<multiple of block>, guest_rows="none")``). Returns ``out`` [s_local, Hq, D] (q's dtype) and
    ``lse`` [s_local, Hq] float32 (float64 for float64 inputs); rows with no kept key give 0 / -inf.
    Differentiable once in q, k, v (not through the selection). ``stats``: a dict filled with ``rows_received`` (K/V rows this rank
    received), ``blocks_selected`` and ``blocks_envelope`` (head x q block x key block pairs kept / in the
    envelope) and ``dense`` (the selector keeps every envelope block of this mask whatever q and k are, e.g.
    MoBA on documents of at most top_k + 1 blocks: dense attention ran on the plan, with no selection, the same
    result): host values, so passing it synchronises. Bad input raises ValueError before any collective.
    """
    try:
        rank = plan_rank(plan, group)
        check_inputs(q, k, v, plan, rank, softmax_scale)
        check_selector(selector, q, k, plan)
        bkey, be = resolve_backend(backend, q.device)
        why = be.supports(q.device, q.dtype, q.shape[2])
        if why is not None:
            raise ValueError(f"backend {be.name!r} cannot run these inputs: {why}")
        check_plan(plan, selector.block)
    except ValueError as e:  # on this rank alone, its peers may be in the call's exchange: they raise it too
        tell_peers(group, e)
        raise
    # before any exchange (once per plan; every call on gloo): ranks with another selector raise together
    verify_plan(plan, group, {**input_fields(q, k, v), "sparse selector": fingerprint(selector)})
    if keeps_whole_envelope(plan, selector):  # the selection would be the envelope: dense attention, no selection
        out, lse = dense_attention(q, k, v, plan, group, softmax_scale, backend=be)
        if stats is not None:
            env = int((_state(plan, rank, selector.block, q.device, None, None)["envelope"] > 0).sum())
            stats.update(rows_received=plan.ranks[rank].num_remote, dense=True,
                         blocks_selected=env * q.shape[1], blocks_envelope=env * q.shape[1])
        return out, lse
    st = _state(plan, rank, selector.block, q.device, be, bkey)
    grp = group if plan.cp_size > 1 else None
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    keep = _select(selector, q, k, st, grp)
    dev: exchange.DeviceLayout = st["dev"]
    if st["layout"].identity:  # nothing to move or place: the kernels skip unselected blocks
        r, kbuf, vbuf = None, k, v
    else:
        r = exchange.route(keep.any(1).any(0), dev, grp)
        kbuf, vbuf = exchange.GatherBlocks.apply(r, dev, grp, k, v)
    bk = BlockKeep(keep[:, :, dev.env_ids].contiguous(), selector.block)
    out, lse = _SparseKernel.apply(q, kbuf, vbuf, bk, st["prepared"], be, scale)
    if stats is not None:
        stats["rows_received"] = 0 if r is None else r.rows_received
        stats["dense"] = False
        stats["blocks_selected"] = int(keep.sum())
        stats["blocks_envelope"] = int((st["envelope"] > 0).sum()) * q.shape[1]
    return out, lse
