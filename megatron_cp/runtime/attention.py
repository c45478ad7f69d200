"""Distributed attention over a plan: GroupCast K/V, compute local tiles, GroupReduce dK/dV.

Queries stay where they are: each rank computes every cell of its own rows, so the LSE a rank computes
is already the global one that its backward uses. The exception are a plan's guest rows (rows keeping
most of the sequence, ``planner.guests``): their q travels to the keys' owners and partial outputs come
back, merged by LSE (``runtime.guests``), on either path.

Staged path (default): the schedule (``runtime.schedule``) splits the remote keys into stages chosen
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
(``runtime.schedule.choose_schedule``). Which of the two runs, with what index tensors and prepared
tiles, is the rank's execution state (``runtime.state``), built once per plan.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import kernels
from ..comm import COMM_LEAD_US, all_to_all_v, cast_steps, column_blocks, comm_lead, grad_buffer, reduce_steps
from ..kernels import accumulate_dtype, reduce_row_pairs
from ..planner import Plan, Workload
from . import faults, guests
from .cost import CostModel
from .groups import group_token, plan_rank
from .rowmap import RowMap, copy_pairs
from .state import RankRuntime, exchange_choice, input_fields, plan_cache, rank_state, verify_plan


DEFAULT_COST = CostModel()  # built once: the state cache hashes it on every call


_NAMED: dict = {}  # (name, device) -> the backend object a name gives there, made once


def resolve_backend(backend, device) -> tuple[object, kernels.Backend]:
    """(cache key, backend object) for a backend name (one object per name and device, made on first use:
    not a new object and availability probe per call) or an object implementing ``kernels.Backend``."""
    if isinstance(backend, str):
        key = (backend, str(device))
        be = _NAMED.get(key)
        if be is None:
            be = _NAMED.setdefault(key, kernels.get_backend(backend, device))
        return backend, be
    if not isinstance(backend, kernels.Backend):
        raise ValueError(f"backend must be a name or an object implementing megatron_cp.kernels.Backend, got "
                         f"{backend!r}")
    return ("object", id(backend)), backend


def check_inputs(q, k, v, plan: Plan, rank: int, softmax_scale, *, value_head_dim: bool = False) -> None:
    """Raise ValueError naming the bad value unless q/k/v fit ``plan``'s rank ``rank``; no collective.
    ``value_head_dim``: v may have its own head dim (MLA), as ``attention`` allows; other strategies not."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [s_local, heads, head_dim], got {getattr(t, 'shape', t)}")
    n = plan.num_local(rank)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[0] != n:
            raise ValueError(f"{name} has {t.shape[0]} tokens but the plan gives rank {rank} {n} tokens")
    if k.shape[:2] != v.shape[:2] or (k.shape[2] != v.shape[2] and not value_head_dim):
        why = "" if k.shape[:2] != v.shape[:2] else (
            " (a v head_dim of its own, as MLA's, runs with megatron-cp's own attention only, not this strategy)")
        raise ValueError(f"k and v shapes differ: k {tuple(k.shape)}, v {tuple(v.shape)}{why}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and k ({k.shape[2]}) differ")
    hq, hkv = q.shape[1], k.shape[1]
    if hq < 1 or hkv < 1:
        raise ValueError(f"q and k need at least one head each, got {hq} query and {hkv} key/value heads")
    if hq % hkv != 0:
        raise ValueError(f"number of key/value heads {hkv} must divide number of query heads {hq}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"unsupported dtype {q.dtype}; use float32, bfloat16, float16 or float64")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive number, got {softmax_scale!r}")


def kv_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """K and V (or dK and dV; [rows, H, Da] and [rows, H, Db]) side by side in one row per token,
    [rows, H*Da + H*Db]: one exchange moves both, whatever their head dims (MLA: 192 and 128)."""
    return torch.cat([a.flatten(1), b.flatten(1)], dim=1)


def split_kv(buf: torch.Tensor, h: int, da: int, db: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ([rows, H, Da], [rows, H, Db]) of a ``kv_rows`` buffer (unit stride along the head dim; with
    Da == Db the same strides as the two halves of a [rows, 2H, D] buffer)."""
    if da == db:  # two view ops instead of column_blocks' four (each costs the host microseconds, every stage)
        a, b = buf.unflatten(1, (2, h, da)).unbind(1)
        return a, b
    a, b = column_blocks(buf, ((h, da), (h, db)))
    return a, b


def _kv_buffer(k: torch.Tensor, v: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A new key buffer of ``rows`` rows in ``kv_rows``' layout (each token's K row, then its V row) and its K and V
    views: the all-to-all delivers received rows in that layout, so they land in it without a copy. The kernels read
    the views as they read contiguous K / V (each row's heads are one dense block; its stride only is longer)."""
    kv = k.new_empty((rows, k.shape[1] * (k.shape[2] + v.shape[2])))
    return (kv, *split_kv(kv, k.shape[1], k.shape[2], v.shape[2]))


def _cast_kv(pick: RowMap, a: torch.Tensor, b: torch.Tensor, send_counts, recv_counts, group, pool, tag, also=(),
             into=None):
    """Rows ``pick`` selects of ``a`` and ``b`` (K and V, or dK and dV: [rows, H, Da] / [rows, H, Db])
    travel together in one all-to-all-v; returns the received rows (``kv_rows``' layout) and their views (a's,
    b's). Both buffers come from the shared pool (bounded, reused by every layer). ``also``: more
    ``rowmap.copy_pairs`` moves, run with the send gather (one kernel launch for two). ``into``: where the received
    rows go instead of the pool's buffer (contiguous, ``kv_rows``' layout); then nothing is returned."""
    h, da, db = a.shape[1], a.shape[2], b.shape[2]
    parts = ((h, da), (h, db))  # split_kv's views, made by the pool once per shape
    send, sa, sb = pool.get((pick.n, h * (da + db)), a.dtype, a.device, (tag, "send"), parts)
    copy_pairs([(pick, sa, a, sb, b), *also])
    return _send_rows(send, parts, send_counts, recv_counts, group, pool, tag, into)


def _send_rows(send, parts, send_counts, recv_counts, group, pool, tag, into):
    """``_cast_kv``'s all-to-all of ``send`` (rows in ``kv_rows``' layout of the column blocks ``parts``)."""
    if into is not None:
        all_to_all_v(send, send_counts, recv_counts, group, into)
        return None
    got = pool.get((sum(recv_counts), send.shape[1]), send.dtype, send.device, (tag, "recv"), parts)
    all_to_all_v(send, send_counts, recv_counts, group, got[0])
    return got


def _delta(dout, out, dlse):
    """None when there is no lse gradient (the backend computes rowsum(dout * out) itself: dense pieces
    may then run on cuDNN), else rowsum(dout * out) - dlse in the accumulation dtype."""
    if dlse is None:
        return None
    cdt = accumulate_dtype(out.dtype)
    return (dout.to(cdt) * out.to(cdt)).sum(-1) - dlse.to(cdt)


class _SingleExchangeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rt: RankRuntime, group, scale):
        hkv, ex, be = k.shape[1], rt.single, rt.backend
        gr = rt.guests
        # guest rows first: their partials travel back while this rank's own tiles compute
        pend = guests.start_forward(gr, be, q, k, v, group, scale) if gr is not None else None
        own, into = (), None
        if ex.identity:
            kbuf, vbuf = k, v  # the buffer is the local K/V: nothing to place
        else:
            kv, kbuf, vbuf = _kv_buffer(k, v, ex.buffer_len)
            own = ((ex.own, kbuf, k, vbuf, v),)
            # received rows that are one run of the buffer in arrival order are received there: no copy, on the
            # GPU or the host (a copy's launch costs a layer call tens of us of host; docs/measurements.md)
            into = None if ex.recv_into is None else kv.narrow(0, *ex.recv_into)
        if group is None or not rt.exchanges:
            copy_pairs(own)
        else:
            if ex.send_from is None:  # the own rows placed in the send gather's launch
                got = _cast_kv(ex.send, k, v, ex.send_counts, ex.recv_counts, group, rt.pool, "single_fwd", also=own,
                               into=into)
            else:  # the rows to send are own rows, one run of the buffer once placed: sent from there, no gather
                copy_pairs(own)
                got = _send_rows(kv.narrow(0, *ex.send_from), ((hkv, k.shape[2]), (hkv, v.shape[2])),
                                 ex.send_counts, ex.recv_counts, group, rt.pool, "single_fwd", into)
            if got is not None:  # K and V rows together: one copy a run
                ex.recv.copy(kv, got[0])
        out, lse = be.forward(q, kbuf, vbuf, ex.prepared, scale)
        gq = guests.finish_forward(gr, pend, out, lse) if gr is not None else None
        # k / v themselves only for guest rows (their dK/dV are of the own keys in local order)
        ctx.save_for_backward(q, kbuf, vbuf, out, lse, *((k, v) if gr is not None else (None, None)), gq)
        ctx.rt, ctx.group, ctx.scale, ctx.hkv = rt, group, scale, hkv
        ctx.set_materialize_grads(False)  # an unused lse gives dlse None, not a zero tensor
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        kernels.refuse_double_backward("megatron_cp.attention")
        q, kbuf, vbuf, out, lse, k, v, gq = ctx.saved_tensors
        rt, group, hkv = ctx.rt, ctx.group, ctx.hkv
        ex, be, gr = rt.single, rt.backend, rt.guests
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        delta = _delta(dout, out, dlse)
        if gr is not None:  # guest rows first: their dq travels back while the own tiles compute
            pend, dk_g, dv_g = guests.start_backward(gr, be, gq, k, v, out, lse, dout, dlse, group, ctx.scale)
        dq, dk_buf, dv_buf = be.backward(q, kbuf, vbuf, out, lse, dout, ex.prepared, ctx.scale, delta)
        dk_buf, dv_buf = dk_buf.contiguous(), dv_buf.contiguous()
        # own rows: a view of the buffer's gradient when they are one run (no copy), else dK's and dV's gathered in
        # the launch of the partials' send gather: a launch less per call (each costs the host tens of us), their
        # exchange starting after both gathers (tens of us of GPU at most; docs/measurements.md)
        own = ()
        if ex.own_rows.indexed:
            dk = dk_buf.new_empty((ex.own_rows.n,) + tuple(dk_buf.shape[1:]))
            dv = dv_buf.new_empty((ex.own_rows.n,) + tuple(dv_buf.shape[1:]))
            own = ((ex.own_rows, dk, dk_buf, dv, dv_buf),)
        else:
            dk, dv = ex.own_rows.gather(dk_buf), ex.own_rows.gather(dv_buf)
        back = None
        if group is not None and rt.exchanges:  # partial dK/dV of received rows go back to their owners
            back = _cast_kv(ex.recv_rows, dk_buf, dv_buf, ex.recv_counts, ex.send_counts, group, rt.pool, "single_bwd",
                            also=own)[1:]
        else:
            copy_pairs(own)
        if back is not None and back[0].shape[0]:
            # rows with partials from other ranks: summed in fp32 (fp64), in source order, rounded once
            reduce_row_pairs(dk, back[0], dv, back[1], ex.red_rows, ex.red_ptr, ex.red_pos)
        if gr is not None:  # guest rows' dq back; dK/dV of the own keys from the rows computed here
            guests.finish_backward(gr, pend, dq)
            if dk_g is not None:
                dk = dk.to(torch.promote_types(dk.dtype, dk_g.dtype)) + dk_g
                dv = dv.to(torch.promote_types(dv.dtype, dv_g.dtype)) + dv_g
        dt = q.dtype  # ``to`` only where it converts: a no-op ``to`` still costs the host a microsecond
        return dq, dk if dk.dtype == dt else dk.to(dt), dv if dv.dtype == dt else dv.to(dt), None, None, None


class _StagedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rt: RankRuntime, group, scale, lead_us):
        hkv, ex, be, gr = k.shape[1], rt.staged, rt.backend, rt.guests
        dims = (hkv, k.shape[2], v.shape[2])
        pend = guests.start_forward(gr, be, q, k, v, group, scale) if gr is not None else None
        kv = kv_rows(k, v)  # [s, Hkv*(Dk+Dv)]: one exchange for K and V
        n = len(ex.prepared) - 1
        bufs = [kv] + [None] * n
        gens = {}

        def start(s):
            if s > n:
                return
            bufs[s] = kv.new_empty((ex.buf_len[s],) + tuple(kv.shape[1:]))
            if ex.active[s]:
                gens[s] = cast_steps(kv, ex.routes[s], group, bufs[s], rt.pool, "cast")
                next(gens[s])

        # the backend merges each stage into a full-precision running output inside the kernel (no
        # rounding between stages, no extra passes)
        cdt = accumulate_dtype(q.dtype)
        acc = torch.zeros(q.shape[:2] + (v.shape[-1],), dtype=cdt, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=cdt, device=q.device)
        for s in range(n + 1):
            if s in gens:
                for _ in gens.pop(s):
                    pass
            start(s + 1)  # prefetch the next stage while this one computes
            if ex.prepared[s] is not None:
                if s + 1 in gens:  # its all-to-all's kernel reaches the multiprocessors before this stage's
                    comm_lead(q.device, lead_us)
                be.forward_accumulate(q, *split_kv(bufs[s], *dims), ex.prepared[s], scale, acc, lse)
        out = acc.to(q.dtype)  # lse stays in the accumulation dtype (float64 for float64 inputs)
        gq = guests.finish_forward(gr, pend, out, lse) if gr is not None else None
        ctx.save_for_backward(q, out, lse, gq, *bufs)
        ctx.rt, ctx.group, ctx.scale, ctx.dims = rt, group, scale, dims
        ctx.set_materialize_grads(False)  # an unused lse gives dlse None, not a zero tensor
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        kernels.refuse_double_backward("megatron_cp.attention")
        q, out, lse, gq, *bufs = ctx.saved_tensors
        rt, group, dims = ctx.rt, ctx.group, ctx.dims
        ex, be, gr = rt.staged, rt.backend, rt.guests
        cdt = accumulate_dtype(q.dtype)
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        delta = _delta(dout, out, dlse)
        n = len(bufs) - 1
        if gr is not None:  # guest rows first (see _SingleExchangeAttention.backward)
            pend, dk_g, dv_g = guests.start_backward(gr, be, gq, *split_kv(bufs[0], *dims), out, lse, dout, dlse,
                                                     group, ctx.scale)
        # running sums in fp32 (fp64): dq, the own keys' dK|dV, and each remote stage's dK|dV in the buffer
        # its GroupReduce sends from (comm.grad_buffer); the backend adds into them (``backward_into``)
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        d_local = torch.zeros(bufs[0].shape, dtype=cdt, device=q.device)
        pending = []
        for s in list(range(1, n + 1)) + [0]:  # remote stages first; own keys hide the last reduce
            b = bufs[s]
            remote = s > 0 and ex.active[s]
            tag = ("reduce", s % 3)
            # (a slot is reused three stages later, when the reduce that last used it has finished)
            dkv = d_local if s == 0 else grad_buffer(ex.routes[s], b.shape[1:], cdt, b.device, rt.pool, tag) \
                if remote else None
            if ex.prepared[s] is not None and dkv is not None:
                be.backward_into(q, *split_kv(b, *dims), out, lse, dout, ex.prepared[s], ctx.scale, delta, dq,
                                 *split_kv(dkv, *dims))
            for g in list(pending):  # advance in-flight reduces by one phase
                if next(g, StopIteration) is StopIteration:
                    pending.remove(g)
            if remote:  # every rank joins a stage's reduce, with zeros when it computed nothing there
                g = reduce_steps(dkv, ex.routes[s], group, d_local, rt.pool, tag)
                next(g)
                pending.append(g)
        for g in pending:
            for _ in g:
                pass
        if gr is not None:
            guests.finish_backward(gr, pend, dq)
            if dk_g is not None:
                dk_l, dv_l = split_kv(d_local, *dims)
                dk_l += dk_g
                dv_l += dv_g
        return dq.to(q.dtype), *split_kv(d_local.to(q.dtype), *dims), None, None, None, None


def prebuild(plan: Plan, work: Workload, *, stages: int | None = None, cost_model: CostModel | None = None,
             hierarchical: bool = True) -> None:
    """Make ahead of ``plan``'s first ``attention`` call its exchange choice (the cost model's single exchange or
    staged schedule) for inputs of shape ``work`` (``Workload(query heads, key/value heads, head_dim, bytes per
    element)`` of the q / k it will get, batch folded into heads) and the same ``stages`` / ``cost_model`` /
    ``hierarchical``: pricing a fresh plan's candidate schedules is the costliest host work of a new plan (tens
    of milliseconds for packed documents at 32k tokens). No collective; a ``work`` that differs from the
    call's only means the call chooses for itself. ``plan_in_helper`` makes the plan and this choice in a
    helper process instead (off the training loop's GIL).

    The rank's execution state (index tensors, prepared tile lists, launch metadata) is built by the first
    call, on the step's thread and stream: built in a planning thread beside a host-bound step it cost the
    step more than building it in the call (the thread holds the GIL the step needs to issue work;
    docs/measurements.md)."""
    if not isinstance(work, Workload):
        raise ValueError(f"work must be a megatron_cp.planner.Workload, got {type(work).__name__}")
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
    exchange_choice(plan, stages=stages, hierarchical=hierarchical, cost=cost_model or DEFAULT_COST, work=work)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan,
    group: dist.ProcessGroup | None = None,
    softmax_scale: float | None = None,
    *,
    backend: str | kernels.Backend = "auto",
    stages: int | None = None,
    cost_model: CostModel | None = None,
    hierarchical: bool = True,
    comm_lead_us: float = COMM_LEAD_US,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context-parallel attention of this rank's tokens under ``plan``.

    q: [s_local, Hq, D], k: [s_local, Hkv, D], v: [s_local, Hkv, Dv] (Hkv divides Hq; Dv = D, or its own
    head dim as MLA's 192 / 128 where the backend supports it), this rank's tokens in the plan's local
    order (``dispatch``); float32/bfloat16/float16/float64. ``group``: the CP process group
    (None when ``plan.cp_size == 1``). Returns ``out`` [s_local, Hq, Dv] (q's dtype) and ``lse``
    [s_local, Hq] natural log, float32 (float64 for float64 inputs: lse, merges and gradient sums keep float64,
    exact to ~1e-15); rows with no kept key give out 0 and lse -inf. Differentiable once in q, k, v and through
    lse (attention sinks: ``apply_sink``; double backward raises). Bad input raises before any collective, and
    the CP ranks check they agree on the plan, head counts, head dims and dtype (``verify_plan``: a ValueError on
    every rank otherwise), once per plan, on every call where ``group`` is a gloo group, and on a later call whose
    fields the group never agreed on (a rank alone in such a change raises, and its peers with it: ``runtime.faults``).

    ``backend``: a kernel backend name (one of ``kernels.BACKEND_CHOICES``) or an object implementing
    ``kernels.Backend``, e.g. ``kernels.TritonBackend(kernels.TritonConfig(deterministic=True))`` (its
    prepared tiles are kept per object: keep using the same one). ``stages``: remote K/V stages
    overlapped with compute; None (default) lets ``cost_model`` (``runtime.CostModel``, defaults when
    None; see ``tools/sim/calibrate.py``) choose; 0 uses one exchange without overlap.
    ``hierarchical``: two-phase routes when ``plan.topology`` has several nodes (each K/V row crosses
    nodes once per destination node). ``comm_lead_us``: in the staged forward, microseconds the compute
    stream waits after issuing a stage's all-to-all before the kernel that overlaps it, so that NCCL's
    kernel gets multiprocessors first (``comm.comm_lead``; 0: off).
    """
    try:
        rt, scale, fields = _checked_call(q, k, v, plan, group, softmax_scale, backend, stages, cost_model,
                                          hierarchical, comm_lead_us)
    except ValueError as e:  # on this rank alone, its peers may be in the call's exchange: they raise it too
        faults.tell_peers(group, e)
        raise
    # the plan check: a host all-reduce once per plan; every call on a gloo group; a later call with fields never
    # agreed on the group
    verify_plan(plan, group, fields)
    grp = group if plan.cp_size > 1 else None
    if rt.schedule is None:
        return _SingleExchangeAttention.apply(q, k, v, rt, grp, scale)
    return _StagedAttention.apply(q, k, v, rt, grp, scale, float(comm_lead_us))


def _checked_call(q, k, v, plan: Plan, group, softmax_scale, backend, stages, cost_model, hierarchical,
                  comm_lead_us) -> tuple[RankRuntime, float, dict]:
    """A call's input checks and its rank state: (state, softmax scale, the fields ranks must agree on). Made once
    per plan and call signature (what the checks read: shapes, dtypes, devices, group, settings) and returned
    again for a call with the same signature, which would pass the same checks: every layer of a micro-batch
    makes the same call, and the checks and look-ups cost the host tens of microseconds."""
    memo, key = None, None
    if (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and (softmax_scale is None or type(softmax_scale) in (float, int))
            and type(comm_lead_us) in (float, int) and (stages is None or type(stages) is int)
            and type(hierarchical) is bool and (group is None or isinstance(group, dist.ProcessGroup))):
        # objects by identity, held by the entry (a backend or cost model need not hash, nor hash cheaply)
        # the group by its token: a key must not keep a destroyed group alive
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
               None if group is None else group_token(group),
               softmax_scale, backend if isinstance(backend, str) else id(backend), stages, id(cost_model),
               hierarchical, comm_lead_us)
        memo = plan_cache(plan).setdefault("checked calls", {})
        hit = memo.get(key)
        if hit is not None:
            return hit[0]
    rank = plan_rank(plan, group)
    check_inputs(q, k, v, plan, rank, softmax_scale, value_head_dim=True)
    if stages is not None and (not isinstance(stages, int) or isinstance(stages, bool) or stages < 0):
        raise ValueError(f"stages must be None or an int >= 0, got {stages!r}")
    if isinstance(comm_lead_us, bool) or not isinstance(comm_lead_us, (int, float)) or not 0 <= comm_lead_us < 1e4:
        raise ValueError(f"comm_lead_us must be a number of microseconds in [0, 1e4), got {comm_lead_us!r}")
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
    bkey, be = resolve_backend(backend, q.device)  # unknown names / bad objects raise here, before any collective
    # a v head dim of its own (MLA) is asked about only then: backends that predate it keep working
    why = be.supports(q.device, q.dtype, q.shape[2]) if v.shape[2] == q.shape[2] else \
        be.supports(q.device, q.dtype, q.shape[2], v.shape[2])
    if why is not None:
        raise ValueError(f"backend {be.name!r} cannot run these inputs: {why}")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    work = Workload(q.shape[1], k.shape[1], q.shape[2], q.element_size())
    # the state before the plan check (host work, no collective: built by a plan's first call, it overlaps the
    # kernels still queued)
    rt = rank_state(plan, rank, q.device, be, bkey, stages=stages, hierarchical=hierarchical,
                    cost=cost_model or DEFAULT_COST, work=work)
    out = (rt, scale, input_fields(q, k, v))
    if memo is not None:
        memo[key] = (out, backend, cost_model)
    return out
