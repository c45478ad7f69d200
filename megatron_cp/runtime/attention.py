"""Distributed attention over a plan: GroupCast K/V, compute local tiles, GroupReduce dK/dV.

Queries stay where they are: each rank computes every cell of its own rows, so the LSE a rank computes
is already the global one that its backward uses. The exception are a plan's guest rows (rows keeping
most of the sequence, ``planner.guests``): their q travels to the keys' owners and partial outputs come
back, merged by LSE (``runtime.guests``), on either path.

Staged path (default): the schedule (``planner.schedule``) splits the remote keys into stages chosen
by the cost model; the GroupCast of stage ``s + 1`` is in flight while the kernel computes stage ``s``
(own keys first), and stage outputs are merged by LSE. Backward computes the remote stages first and
GroupReduces each one's dK/dV while the next stage computes, ending with the own-key stage so the
last reduce hides behind it; the backend adds every stage's gradients into fp32 running sums in place
(``backward_into``: one dQ, the own keys' dK|dV, and each remote stage's dK|dV in the buffer its reduce
sends from, ``comm.grad_buffer``). Remote K/V are kept from forward (no second cast). Forward, a stage's
kernel is queued ``comm_lead_us`` (default 20 us) after the next stage's all-to-all, so that NCCL's kernel
reaches the multiprocessors before the attention kernel fills them (``comm.comm_lead``). With a multi-node
``plan.topology``, routes are hierarchical (one crossing per destination node). ``stages=0`` is the
single-exchange path (one GroupCast of everything, then one kernel call over all tiles); by default the
cost model picks it when overlap would not repay the staged path's extra passes over the running output
(``planner.schedule.choose_stages``). With ``early=True`` the rows whose keys are all the rank's own
compute while its GroupCast is in flight (``planner.early``: row-disjoint from the rest, so no merge and
no extra pass) and the other rows once the received keys are placed. Off by default: on 4 x H200
(NVLink, NCCL) it measured equal in wall time and up to 1.5x slower forward in GPU time for packed
documents, because a rank whose early kernel fills every SM keeps its NCCL all-to-all kernel from
running, and the collective stalls every other rank (benchmarks/dist/README.md, 12:45 run); over a CP
group whose NCCL stream has high priority (Megatron's ``high_priority_stream_groups=['cp']``) it was 2%
faster than without (15:37 run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .. import kernels
from ..kernels.rows import reduce_rows
from ..comm import (COMM_LEAD_US, BufferPool, DeviceRoute, all_to_all_v, cast_steps, check_same_on_all_ranks, comm_lead,
                    grad_buffer, reduce_steps)
from ..masks.geometry import KINDS
from ..planner import Plan
from ..planner.early import early_split
from ..planner.cost import CostModel, Workload
from ..planner.schedule import Schedule, choose_stages, schedule as build_schedule
from .groups import plan_rank
from . import guests
from .merge import merge_lse  # noqa: F401  (re-exported: baselines and tests import it from here)
from .rowmap import RowMap

# The planner's kind codes are the kernels' tile codes; fail at import if they ever drift apart.
assert all(kernels.KIND_CODES[k] == c for c, k in enumerate(KINDS)), "mask and kernel kind codes differ"


@dataclass
class _RankRuntime:
    """Row maps and prepared tiles for one (plan, rank, device, backend); built once.

    K and V live in separate contiguous buffers (what cuDNN pieces and the kernels read best);
    ``own``/``recv`` place the own and received rows in them, ``send`` gathers the rows to send and
    ``own_rows``/``recv_rows`` take gradients back out. ``red_rows`` are the local rows that get
    partial gradients from other ranks; the returned rows ``red_pos[red_ptr[i]:red_ptr[i+1]]`` add
    into ``red_rows[i]``."""

    s_local: int
    buffer_len: int
    send_counts: list
    recv_counts: list
    own: RowMap
    recv: RowMap
    send: RowMap
    own_rows: RowMap
    recv_rows: RowMap
    red_rows: torch.Tensor
    red_ptr: torch.Tensor
    red_pos: torch.Tensor
    backend: object
    prepared: object
    # early rows (planner.early): tiles whose rows need no received key run while the exchange flies;
    # None when the rank has no exchange or no such rows
    early: object = None
    late: object = None  # prepared late tiles (None: every row is early)
    late_runs: list = None  # [(start, end)] late rows, for backends without forward_accumulate
    pad: torch.Tensor | None = None  # received buffer rows zeroed before the early kernel reads near them

    # does any rank of the plan move a key (the all-to-all is collective: every rank joins it when
    # any rank has traffic, even one that itself sends and receives nothing)
    exchanges: bool = False


def _backend(backend, device):
    """(cache key, backend object) for a backend name or a backend object (``kernels`` interface)."""
    if isinstance(backend, str):
        return backend, kernels.get_backend(backend, device)
    if not all(callable(getattr(backend, n, None)) for n in ("prepare", "forward", "backward")):
        raise ValueError(f"backend must be a name or an object with prepare/forward/backward, got {backend!r}")
    return ("object", id(backend)), backend


def _runtime(plan: Plan, rank: int, device: torch.device, backend_arg) -> _RankRuntime:
    bkey, backend = _backend(backend_arg, device)
    key = ("runtime", rank, str(device), bkey)
    rt = plan.cache.get(key)
    if rt is None:
        rp = plan.ranks[rank]
        send_index, send_counts = rp.send_index()
        own_pos, recv_pos = rp.buffer_index()
        tiles = torch.from_numpy(rp.tiles.astype("int32"))
        buffer_len = max(rp.buffer_len, 1)
        # returned partial rows grouped by the local row they add to (CSR, source order kept)
        red_order = np.argsort(send_index, kind="stable")
        red_rows, red_counts = np.unique(send_index, return_counts=True)
        red_ptr = np.concatenate([[0], np.cumsum(red_counts)])
        rt = _RankRuntime(
            s_local=rp.num_tokens,
            buffer_len=buffer_len,
            send_counts=send_counts,
            recv_counts=rp.recv_counts(),
            own=RowMap(own_pos, None, device),
            recv=RowMap(recv_pos, None, device),
            send=RowMap(None, send_index, device),
            own_rows=RowMap(None, own_pos, device),
            recv_rows=RowMap(None, recv_pos, device),
            red_rows=torch.from_numpy(red_rows.astype(np.int64)).to(device),
            red_ptr=torch.from_numpy(red_ptr.astype(np.int64)).to(device),
            red_pos=torch.from_numpy(red_order.astype(np.int64)).to(device),
            backend=backend,
            prepared=backend.prepare(tiles, rp.num_tokens, buffer_len),
            exchanges=any(r.num_remote > 0 for r in plan.ranks),
        )
        plan.cache[key] = rt
    return rt


def _prepare_early(rt: _RankRuntime, plan: Plan, rank: int, device) -> None:
    """Early/late tile lists of ``rt`` (``early=True`` only: opt-in, so plans that never use it do not
    pay the split and two more schedule builds). Once per runtime."""
    if rt.late_runs is not None or not rt.exchanges:
        return
    rp = plan.ranks[rank]
    sp = early_split(plan, rank)
    rt.late_runs = [(int(a), int(b)) for a, b in sp.late_rows.tolist()]
    if sp.useful:
        prep = lambda t: rt.backend.prepare(torch.from_numpy(t), rp.num_tokens, rt.buffer_len)  # noqa: E731
        rt.early = prep(sp.early)
        rt.late = prep(sp.late) if len(sp.late) else None
        rt.pad = torch.from_numpy(sp.pad_rows).to(device) if len(sp.pad_rows) else None


def _group_rank(plan: Plan, group) -> int:
    """This rank's index in ``group`` (see ``groups.plan_rank``)."""
    return plan_rank(plan, group)


def _check_inputs(q, k, v, plan: Plan, rank: int, softmax_scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [s_local, heads, head_dim], got {getattr(t, 'shape', t)}")
    n = plan.num_local(rank)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[0] != n:
            raise ValueError(f"{name} has {t.shape[0]} tokens but the plan gives rank {rank} {n} tokens")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and k ({k.shape[2]}) differ")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"number of key/value heads {hkv} must divide number of query heads {hq}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"unsupported dtype {q.dtype}; use float32, bfloat16, float16 or float64")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive number, got {softmax_scale!r}")


def _verify_plan(plan: Plan, group, device) -> None:
    """Once per (plan, group): all ranks must hold the same plan (one tiny all-reduce)."""
    key = ("verified", id(group))
    if group is not None and plan.cp_size > 1 and key not in plan.cache:
        check_same_on_all_ranks(plan.digest64, group, device, "plan digest")
        plan.cache[key] = True


def _exchange(pick: RowMap, a: torch.Tensor, b: torch.Tensor, send_counts, recv_counts, group, tag,
              async_op: bool = False):
    """Rows ``pick`` selects of ``a`` and ``b`` (K and V, or dK and dV: [rows, H, D] each) travel together
    in one all-to-all-v; returns the received [rows, 2H, D] (H of a, then H of b), or (that buffer,
    handle) with ``async_op`` (``handle.wait()`` before reading it). Both buffers come from the shared
    pool (bounded, reused by every layer)."""
    h = a.shape[1]
    pool, row = buffer_pool(a.device), (2 * h,) + tuple(a.shape[2:])
    send = pool.get((pick.n,) + row, a.dtype, a.device, (tag, "send"))
    pick.copy(send[:, :h], a)
    pick.copy(send[:, h:], b)
    recv = pool.get((sum(recv_counts),) + row, a.dtype, a.device, (tag, "recv"))
    return all_to_all_v(send, send_counts, recv_counts, group, recv, async_op=async_op)


def _early_forward(q, kbuf, vbuf, rt: _RankRuntime, scale, land):
    """Early rows' tiles first (own keys only), then ``land()`` (wait for the exchange and place the
    received rows), then the late rows' tiles. The two lists are row-disjoint, so each row's output
    comes from one call: a backend with ``forward_accumulate`` adds the late rows into the running
    output in place (rows it does not cover untouched), any other backend's late rows are copied over."""
    be = rt.backend
    fused = getattr(be, "forward_accumulate", None) if q.dtype != torch.float64 else None
    if fused is not None and callable(getattr(be, "running_dtype", None)):
        out, lse = be.forward(q, kbuf, vbuf, rt.early, scale, out_dtype=be.running_dtype(q, rt.early, rt.late))
        land()
        if rt.late is not None:
            fused(q, kbuf, vbuf, rt.late, scale, out, lse)
        return out.to(q.dtype), lse
    out, lse = be.forward(q, kbuf, vbuf, rt.early, scale)
    land()
    if rt.late is not None:
        o, l = be.forward(q, kbuf, vbuf, rt.late, scale)
        for a, b in rt.late_runs:
            out[a:b] = o[a:b]
            lse[a:b] = l[a:b]
    return out, lse


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rt: _RankRuntime, group, scale, early, gr):
        hkv = k.shape[1]
        # guest rows first: their partials travel back while this rank's own tiles compute
        pend = guests.start_forward(gr, rt.backend, q, k, v, group, scale) if gr is not None else None
        exchange = group is not None and rt.exchanges
        if not exchange and rt.own.runs == [(0, 0, rt.s_local)] and rt.buffer_len == rt.s_local:
            kbuf, vbuf = k, v  # the buffer is the local K/V: nothing to place
        else:
            kbuf = k.new_empty((rt.buffer_len,) + tuple(k.shape[1:]))
            vbuf = v.new_empty(kbuf.shape)
            rt.own.copy(kbuf, k)
            rt.own.copy(vbuf, v)
        if exchange and early and rt.early is not None:  # rows needing only own keys run during the exchange
            if rt.pad is not None:
                kbuf.index_fill_(0, rt.pad, 0)
                vbuf.index_fill_(0, rt.pad, 0)
            got, handle = _exchange(rt.send, k, v, rt.send_counts, rt.recv_counts, group, "single_fwd", True)

            def land():
                handle.wait()
                rt.recv.copy(kbuf, got[:, :hkv])
                rt.recv.copy(vbuf, got[:, hkv:])

            out, lse = _early_forward(q, kbuf, vbuf, rt, scale, land)
        else:
            if exchange:
                got = _exchange(rt.send, k, v, rt.send_counts, rt.recv_counts, group, "single_fwd")
                rt.recv.copy(kbuf, got[:, :hkv])
                rt.recv.copy(vbuf, got[:, hkv:])
            out, lse = rt.backend.forward(q, kbuf, vbuf, rt.prepared, scale)
        gq = guests.finish_forward(gr, pend, out, lse) if gr is not None else None
        # k / v themselves only for guest rows (their dK/dV are of the own keys in local order)
        ctx.save_for_backward(q, kbuf, vbuf, out, lse, *((k, v) if gr is not None else (None, None)), gq)
        ctx.rt, ctx.group, ctx.scale, ctx.hkv, ctx.gr = rt, group, scale, hkv, gr
        ctx.set_materialize_grads(False)  # an unused lse gives dlse None, not a zero tensor
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, kbuf, vbuf, out, lse, k, v, gq = ctx.saved_tensors
        rt, group, hkv = ctx.rt, ctx.group, ctx.hkv
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        delta = None  # None: rowsum(dout * out), no lse gradient (lets dense tiles use cuDNN)
        if dlse is not None:
            delta = (dout.to(cdt) * out.to(cdt)).sum(-1) - dlse.to(cdt)
        if ctx.gr is not None:  # guest rows first: their dq travels back while the own tiles compute
            pend, dk_g, dv_g = guests.start_backward(ctx.gr, rt.backend, gq, k, v, out, lse, dout, dlse, group,
                                                     ctx.scale)
        dq, dk_buf, dv_buf = rt.backend.backward(q, kbuf, vbuf, out, lse, dout, rt.prepared, ctx.scale, delta)
        dk_buf, dv_buf = dk_buf.contiguous(), dv_buf.contiguous()
        exchange = group is not None and rt.exchanges
        back = None
        if exchange:  # partial dK/dV of received rows go back to their owners (the adjoint exchange)
            back = _exchange(rt.recv_rows, dk_buf, dv_buf, rt.recv_counts, rt.send_counts, group, "single_bwd")
        # own rows: a view of the buffer's gradient when they are one run (no copy)
        dk, dv = rt.own_rows.gather(dk_buf), rt.own_rows.gather(dv_buf)
        if back is not None and back.shape[0]:
            # rows with partials from other ranks: summed in fp32 (fp64), in source order, rounded once
            reduce_rows(dk, back[:, :hkv], rt.red_rows, rt.red_ptr, rt.red_pos)
            reduce_rows(dv, back[:, hkv:], rt.red_rows, rt.red_ptr, rt.red_pos)
        if ctx.gr is not None:  # guest rows' dq back; dK/dV of the own keys from the rows computed here
            guests.finish_backward(ctx.gr, pend, dq)
            if dk_g is not None:
                dk = dk.to(torch.promote_types(dk.dtype, dk_g.dtype)) + dk_g
                dv = dv.to(torch.promote_types(dv.dtype, dv_g.dtype)) + dv_g
        return dq, dk.to(q.dtype), dv.to(q.dtype), None, None, None, None, None


_POOLS: dict = {}


def buffer_pool(device) -> BufferPool:
    """The communication scratch pool of ``device`` (shared by every layer; bounded by the largest
    stage)."""
    key = str(device)
    if key not in _POOLS:
        _POOLS[key] = BufferPool()
    return _POOLS[key]


@dataclass
class _StagedRuntime:
    s_local: int
    backend: object
    prepared: list  # per stage (None when the stage has no tile on this rank)
    buf_len: list
    routes: list  # per stage (None for stage 0)
    active: list  # per stage: does its exchange move anything anywhere
    pool: BufferPool


def _staged_runtime(plan: Plan, sched: Schedule, rank: int, device, backend_arg) -> _StagedRuntime:
    bkey, backend = _backend(backend_arg, device)
    key = ("staged", id(sched), rank, str(device), bkey)
    rt = plan.cache.get(key)
    if rt is None:
        stages = sched.ranks[rank]
        prepared = []
        for st in stages:
            if len(st.tiles):
                tiles = torch.from_numpy(st.tiles.astype("int32"))
                prepared.append(backend.prepare(tiles, plan.num_local(rank), max(st.buf_len, 1)))
            else:
                prepared.append(None)
        idle = [i for i, st in enumerate(stages) if i > 0 and len(st.tiles) and not sched.active[i - 1]]
        if idle:  # its keys would never arrive (and its backward has no reduce to join)
            raise RuntimeError(f"rank {rank}: stages {idle} have tiles but exchange nothing (schedule bug)")
        rt = _StagedRuntime(
            s_local=plan.num_local(rank),
            backend=backend,
            prepared=prepared,
            buf_len=[st.buf_len for st in stages],
            routes=[None] + [DeviceRoute.from_route(st.route, device) for st in stages[1:]],
            active=[False] + list(sched.active),
            pool=buffer_pool(device),
        )
        plan.cache[key] = rt
    return rt


class _StagedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rt: _StagedRuntime, group, scale, gr, lead_us):
        hkv = k.shape[1]
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        pend = guests.start_forward(gr, rt.backend, q, k, v, group, scale) if gr is not None else None
        kv = torch.cat([k, v], dim=1)  # [s, 2*Hkv, D]: one exchange for K and V
        n = len(rt.prepared) - 1
        bufs = [kv] + [None] * n
        gens = {}

        def start(s):
            if s > n:
                return
            bufs[s] = kv.new_empty((rt.buf_len[s],) + tuple(kv.shape[1:]))
            if rt.active[s]:
                gens[s] = cast_steps(kv, rt.routes[s], group, bufs[s], rt.pool, "cast")
                next(gens[s])

        # a backend with an accumulating forward merges stages inside the kernel (no extra passes);
        # otherwise partial outputs are merged here by LSE in fp32 (fp64 for fp64 inputs)
        fused = getattr(rt.backend, "forward_accumulate", None) if q.dtype != torch.float64 else None
        if fused is not None:  # fp32 running output: no rounding to bf16 between stages
            acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        else:
            acc = torch.zeros(q.shape[:2] + (v.shape[-1],), dtype=cdt, device=q.device)
            lse = torch.full(q.shape[:2], float("-inf"), dtype=cdt, device=q.device)
        for s in range(n + 1):
            if s in gens:
                for _ in gens.pop(s):
                    pass
            start(s + 1)  # prefetch the next stage while this one computes
            if rt.prepared[s] is not None:
                if s + 1 in gens:  # its all-to-all's kernel reaches the multiprocessors before this stage's
                    comm_lead(q.device, lead_us)
                b = bufs[s]
                if fused is not None:
                    fused(q, b[:, :hkv], b[:, hkv:], rt.prepared[s], scale, acc, lse)
                else:
                    o, l = rt.backend.forward(q, b[:, :hkv], b[:, hkv:], rt.prepared[s], scale)
                    merge_lse(acc, lse, o, l.to(cdt))
        out = acc.to(q.dtype)
        lse = lse.to(torch.float32)
        gq = guests.finish_forward(gr, pend, out, lse) if gr is not None else None
        ctx.save_for_backward(q, out, lse, gq, *bufs)
        ctx.rt, ctx.group, ctx.scale, ctx.hkv, ctx.gr = rt, group, scale, hkv, gr
        ctx.set_materialize_grads(False)  # an unused lse gives dlse None, not a zero tensor
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, out, lse, gq, *bufs = ctx.saved_tensors
        rt, group, hkv = ctx.rt, ctx.group, ctx.hkv
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        # delta None tells the backend it is rowsum(dout * out) (no lse gradient): dense pieces may then
        # run on cuDNN, which computes that rowsum itself
        delta = None
        if dlse is not None:
            delta = (dout.to(cdt) * out.to(cdt)).sum(-1) - dlse.to(cdt)
        n = len(bufs) - 1
        if ctx.gr is not None:  # guest rows first (see _CPAttention.backward)
            kv = bufs[0]
            pend, dk_g, dv_g = guests.start_backward(ctx.gr, rt.backend, gq, kv[:, :hkv], kv[:, hkv:], out, lse,
                                                     dout, dlse, group, ctx.scale)
        # running sums in fp32 (fp64): dq, the own keys' dK|dV, and each remote stage's dK|dV in the buffer
        # its GroupReduce sends from (comm.grad_buffer); the backend adds into them (``backward_into``)
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        d_local = torch.zeros(bufs[0].shape, dtype=cdt, device=q.device)
        pending = []
        for s in list(range(1, n + 1)) + [0]:  # remote stages first; own keys hide the last reduce
            b = bufs[s]
            remote = s > 0 and rt.active[s]
            tag = ("reduce", s % 3)
            # (a slot is reused three stages later, when the reduce that last used it has finished)
            dkv = d_local if s == 0 else grad_buffer(rt.routes[s], b.shape[1:], cdt, b.device, rt.pool, tag) \
                if remote else None
            if rt.prepared[s] is not None and dkv is not None:
                _backward_into(rt.backend, q, b, out, lse, dout, rt.prepared[s], ctx.scale, delta, dq, dkv, hkv)
            for g in list(pending):  # advance in-flight reduces by one phase
                if next(g, StopIteration) is StopIteration:
                    pending.remove(g)
            if remote:  # every rank joins a stage's reduce, with zeros when it computed nothing there
                g = reduce_steps(dkv, rt.routes[s], group, d_local, rt.pool, tag)
                next(g)
                pending.append(g)
        for g in pending:
            for _ in g:
                pass
        if ctx.gr is not None:
            guests.finish_backward(ctx.gr, pend, dq)
            if dk_g is not None:
                d_local[:, :hkv] += dk_g
                d_local[:, hkv:] += dv_g
        d_local = d_local.to(q.dtype)
        return dq.to(q.dtype), d_local[:, :hkv], d_local[:, hkv:], None, None, None, None, None


def _backward_into(be, q, kv, out, lse, dout, prepared, scale, delta, dq, dkv, hkv):
    """One stage's gradients added into the running sums dq and dkv ([rows, 2*Hkv, D]: dK then dV) by a
    backend's ``backward_into``, or by ``backward`` and adds for backends without it."""
    k, v, dk, dv = kv[:, :hkv], kv[:, hkv:], dkv[:, :hkv], dkv[:, hkv:]
    into = getattr(be, "backward_into", None)
    if into is not None:
        into(q, k, v, out, lse, dout, prepared, scale, delta, dq, dk, dv)
        return
    gq, gk, gv = be.backward(q, k, v, out, lse, dout, prepared, scale, delta)
    dq += gq
    dk += gk
    dv += gv


def attention(
    q,
    k,
    v,
    plan: Plan,
    group=None,
    softmax_scale=None,
    *,
    backend="auto",
    stages: int | None = None,
    cost_model: CostModel | None = None,
    hierarchical: bool = True,
    early: bool = False,
    comm_lead_us: float = COMM_LEAD_US,
):
    """Context-parallel attention of this rank's tokens under ``plan``.

    q: [s_local, Hq, D], k/v: [s_local, Hkv, D] (Hkv divides Hq), this rank's tokens in the plan's
    local order (``dispatch``); float32/bfloat16/float16/float64. ``group``: the CP process group
    (None when ``plan.cp_size == 1``). Returns ``out`` [s_local, Hq, D] (q's dtype) and ``lse``
    [s_local, Hq] float32 natural log; rows with no kept key give out 0 and lse -inf.
    Differentiable in q, k, v; bad input raises before any collective.

    ``backend``: a kernel backend name (``auto``, ``triton``, ``reference``) or a backend object, e.g.
    ``kernels.triton_backend.TritonBackend(TritonConfig(deterministic=True))`` (cached per object: keep
    using the same one). ``stages``: remote K/V stages overlapped with compute; None (default) lets ``cost_model``
    (``planner.cost.CostModel``, defaults when None; see ``tools/calibrate.py``) choose; 0 uses one
    exchange without overlap. ``hierarchical``: two-phase routes when ``plan.topology`` has several
    nodes (each K/V row crosses nodes once per destination node). ``early``: in the single-exchange
    path, compute the rows that need only this rank's own keys while the exchange is in flight
    (``planner.early``; exact, row-disjoint). Off by default: measured no faster on NVLink, where the
    concurrent kernel can starve NCCL's all-to-all (module doc); for slower links, measure it with
    ``tools/bench_dist.py --impls megatron-cp,megatron-cp-early``. ``comm_lead_us``: in the staged
    forward, microseconds the compute stream waits after issuing a stage's all-to-all before the kernel
    that overlaps it, so that NCCL's kernel gets multiprocessors first (``comm.comm_lead``; 0: off).
    """
    rank = _group_rank(plan, group)
    _check_inputs(q, k, v, plan, rank, softmax_scale)
    if stages is not None and (not isinstance(stages, int) or isinstance(stages, bool) or stages < 0):
        raise ValueError(f"stages must be None or an int >= 0, got {stages!r}")
    if isinstance(comm_lead_us, bool) or not isinstance(comm_lead_us, (int, float)) or not 0 <= comm_lead_us < 1e4:
        raise ValueError(f"comm_lead_us must be a number of microseconds in [0, 1e4), got {comm_lead_us!r}")
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
    _backend(backend, q.device)  # unknown names / bad objects raise here, before any collective
    _verify_plan(plan, group, q.device)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    work = Workload(q.shape[1], k.shape[1], q.shape[2], q.element_size())
    if stages is None:
        stages = choose_stages(plan, cost_model, work, hierarchical)
    grp = group if plan.cp_size > 1 else None
    gr = None
    if plan.has_guests:
        bkey, be = _backend(backend, q.device)
        gr = guests.guest_runtime(plan, rank, q.device, be, bkey)
    if stages == 0:
        rt = _runtime(plan, rank, q.device, backend)
        if early and plan.cp_size > 1:
            _prepare_early(rt, plan, rank, q.device)
        return _CPAttention.apply(q, k, v, rt, grp, scale, bool(early), gr)
    sched = build_schedule(plan, stages, cost=cost_model, work=work, hierarchical=hierarchical)
    rt = _staged_runtime(plan, sched, rank, q.device, backend)
    return _StagedAttention.apply(q, k, v, rt, grp, scale, gr, float(comm_lead_us))
