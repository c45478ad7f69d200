"""Per-rank execution state: everything one rank needs to run a plan, built once from the plan.

The plan says what each rank computes and receives; ``rank_state`` turns that into what the forward and
backward calls use - index tensors on the device, tile lists prepared by the kernel backend, and the
exchange the cost model chose (one GroupCast of everything, or staged GroupCasts overlapped with the
kernels, ``runtime.schedule``) - and keeps it in a cache keyed weakly by the plan object, so a plan that
is dropped takes its state with it. Nothing is written on the (frozen) plan and nothing is derived again
from the planner's internals: the runtime reads the plan's public fields only.
"""

from __future__ import annotations

import datetime
import hashlib
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..comm import BufferPool, DeviceRoute, RouteIndex, device_pool
from ..kernels import Backend, upload_all
from ..planner import Plan, Workload
from . import faults, guests
from .faults import RanksDisagreeError
from .cost import CostModel
from .groups import group_token, host_group
from .rowmap import RowIndex, RowMap, grouped
from .schedule import Schedule, choose_schedule


@dataclass
class SingleExchange:
    """One GroupCast of every remote K/V row, then one kernel call over the rank's whole tile list.

    K and V live in one buffer per call, each token's K row then its V row (``kv_rows``' layout, the
    all-to-all's); ``own``/``recv`` place the own and received rows in it (``recv_into``: the received rows
    are one run in arrival order, received in place), ``send`` gathers the rows to send and
    ``own_rows``/``recv_rows`` take gradients back out. ``red_rows`` are the local rows that get
    partial gradients from other ranks; the returned rows ``red_pos[red_ptr[i]:red_ptr[i+1]]`` add
    into ``red_rows[i]``."""

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
    prepared: object
    # the local K/V are the buffer as they are: no exchange anywhere and the buffer is the local rows
    identity: bool
    # (first buffer row, rows) where every received row lands in arrival order, one run: received in place
    recv_into: tuple | None = None
    # (first buffer row, rows) where the rows to send lie in send order once the own rows are placed (both one run):
    # sent from there, with no gather
    send_from: tuple | None = None


@dataclass
class SingleHost:
    """A ``SingleExchange``'s host part (``single_host``): what the device state is built from by uploads alone,
    made anywhere (the planning helper process makes a new plan's ahead)."""

    buffer_len: int
    send_counts: list
    recv_counts: list
    own: RowIndex
    recv: RowIndex
    send: RowIndex
    own_rows: RowIndex
    recv_rows: RowIndex
    red_rows: np.ndarray
    red_ptr: np.ndarray
    red_pos: np.ndarray
    identity: bool


@dataclass
class RankAhead:
    """What a planning helper made ahead of a rank's first call for one exchange choice (``keep_rank_ahead``):
    the single exchange's host part or a staged one's routes, and the tile lists ``prepare_lists`` made with a
    backend's ``prepare_host`` named ``prepare`` (None: none)."""

    single: SingleHost | None
    routes: list | None  # a staged exchange's routes per stage (None for stage 0), host parts
    guests: guests.GuestHost | None  # the guest rows' host part (None: the plan has none)
    prepare: str | None
    lists: list | None
    guest_list: object = None  # the guest tile list prepared with ``prepare`` (None: none)


@dataclass
class StagedExchange:
    """Stage 0 computes the own keys; remote stage ``s`` receives its keys over ``routes[s]`` while
    stage ``s - 1`` computes (``runtime.schedule``)."""

    prepared: list  # per stage (None when the stage has no tile on this rank)
    buf_len: list
    routes: list  # per stage (None for stage 0)
    active: list  # per stage: does its exchange move anything on any rank


@dataclass
class RankRuntime:
    """One rank's execution state for one (plan, device, backend, exchange options)."""

    rank: int
    s_local: int
    backend: Backend
    exchanges: bool  # does any rank of the plan move a key (collectives are joined by every rank)
    schedule: Schedule | None  # None: the single exchange
    single: SingleExchange | None
    staged: StagedExchange | None
    guests: guests.GuestRuntime | None
    pool: BufferPool

    def prepared_lists(self) -> list:
        """Every tile list this state prepared with its backend (the single exchange's, each stage's, the
        guest rows')."""
        out = [self.single.prepared] if self.single is not None else [p for p in self.staged.prepared if p is not None]
        if self.guests is not None and self.guests.prepared is not None:
            out.append(self.guests.prepared)
        return out


_STATES: "weakref.WeakKeyDictionary[Plan, dict]" = weakref.WeakKeyDictionary()
def plan_cache(plan: Plan) -> dict:
    """The runtime's dict of things derived from ``plan`` (per-rank states, dispatch indices), created on
    first use and dropped with the plan."""
    d = _STATES.get(plan)
    if d is None:
        d = _STATES[plan] = {}
    return d


def states_of(plan: Plan) -> list[RankRuntime]:
    """The execution states built for ``plan`` so far in this process (for inspection and tests)."""
    return [v for k, v in plan_cache(plan).items() if isinstance(k, tuple) and k[0] == "rank"]


DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


def input_fields(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """The attention inputs' facts every CP rank must share, as named ints for ``verify_plan``."""
    return {"query heads": q.shape[1], "key/value heads": k.shape[1], "q/k head_dim": q.shape[2],
            "v head_dim": v.shape[2], "dtype": DTYPE_CODES.get(q.dtype, -1)}


def fingerprint(obj) -> int:
    """A 60-bit int of ``repr(obj)`` (sha256), the same in every process: a ``verify_plan`` field for
    settings that are not ints (a sparse selector's method and parameters)."""
    return int(hashlib.sha256(repr(obj).encode()).hexdigest()[:15], 16)


def _shown(name: str, x: int) -> str:
    if name == "dtype":
        return next((str(t).removeprefix("torch.") for t, c in DTYPE_CODES.items() if c == x), str(x))
    return str(x)


_FIELDS_AGREED: set = set()  # (group_token(group), fields) every rank of the group was found to share


def _agree(names: list, vals: list, check_group) -> None:
    """One tiny all-reduce of (max, -max) of ``vals`` over ``check_group`` (gloo, on the host); where ranks
    differ, a ``RanksDisagreeError`` on every rank naming this rank's value and the range seen across ranks."""
    t = torch.tensor(vals + [-x for x in vals], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=check_group)
    _raise_where_they_differ(names, vals, t[:len(vals)].tolist(), [-x for x in t[len(vals):].tolist()])


def _raise_where_they_differ(names: list, vals: list, hi: list, lo: list) -> None:
    bad = [f"{n} differs across ranks (this rank: {_shown(n, x)}, seen from {_shown(n, a)} to {_shown(n, b)})"
           for n, x, a, b in zip(names, vals, lo, hi) if a != b]
    if bad:
        raise RanksDisagreeError("CP ranks disagree: " + "; ".join(bad) + ". Every rank of a CP group must build "
                                 "the same plan from the same mask and call attention with the same heads, head "
                                 "dims and dtype, on every call")


_STORE_CHECKS: dict = {}  # group token -> how many checks through the group's store this process made


def _agree_unless_alone(names: list, vals: list, group, alone: str) -> None:
    """``_agree`` where the other ranks may not come (they may be in an exchange instead): through the store of
    ``group``'s host group, whose wait ends after ``FIELD_CHANGE_TIMEOUT_S`` and leaves nothing pending (a gloo
    collective left waiting would hold this process at exit). Ranks that come compare as ``_agree`` does; a rank
    left alone raises a ``RanksDisagreeError`` saying ``alone``."""
    from torch.distributed import distributed_c10d as c10d

    hg = host_group(group)
    store = c10d._get_process_group_store(hg)
    token = group_token(hg)
    n = _STORE_CHECKS[token] = _STORE_CHECKS.get(token, 0) + 1  # the same on every rank that comes
    keys = [f"megatron_cp/fields/{n}/{r}" for r in range(hg.size())]
    store.set(keys[hg.rank()], ",".join(str(int(x)) for x in vals))
    try:
        store.wait(keys, datetime.timedelta(seconds=FIELD_CHANGE_TIMEOUT_S))
    except (RuntimeError, dist.DistError) as e:
        msg = f"{alone} (no other rank came to check them within {FIELD_CHANGE_TIMEOUT_S:g} s: {type(e).__name__})"
        faults.post(group, msg)  # the peers, in this call's exchange, raise it too
        raise RanksDisagreeError(msg) from None
    seen = [[int(x) for x in store.get(k).decode().split(",")] for k in keys]
    _raise_where_they_differ(names, vals, [max(c) for c in zip(*seen)], [min(c) for c in zip(*seen)])


def check_plan_ahead(plan: Plan, group, check_group) -> None:
    """Check, ahead of the step, that every rank of ``group`` holds ``plan`` (its digest all-reduced over
    ``check_group``: a gloo group over the same ranks that only this planning thread uses, e.g.
    ``groups.planning_group``), and remember it; the step takes the result with ``accept_plan_check`` when it
    takes the micro-batch, and the plan's first attention call then runs no collective of its own once its input
    fields were agreed on an earlier plan (``verify_plan``). Every rank's planning thread calls it for the same
    plans in the same order; a mismatch raises ``RanksDisagreeError`` (a ValueError) on every rank."""
    if group is None or plan.cp_size == 1:
        return
    # per check group: two threads (say training's and evaluation's) may meet the same cached plan, and whether
    # one of them has finished checking it is not the same moment on every rank
    checked = plan_cache(plan).setdefault("checked ahead", set())
    key = (group_token(group), group_token(check_group))
    if key not in checked:
        _agree(["plan digest"], [int(plan.digest64)], check_group)
        checked.add(key)


def accept_plan_check(plan: Plan, group) -> None:
    """On the step's thread, when it takes the micro-batch whose plan a planning thread checked
    (``check_plan_ahead``): from here the plan's first call may skip its own check. The step, not the thread,
    decides when, so every rank decides it at the same point of its step (a thread's progress differs across
    ranks). Nothing for a plan not checked ahead."""
    cache = plan_cache(plan)
    token = group_token(group)
    if any(g == token for g, _ in cache.get("checked ahead", ())):
        cache.setdefault("accepted", set()).add(token)


# how long a rank whose call brings fields not agreed on its group waits for the other ranks to check them with
# it: they come at once where every rank's call changed alike (a model whose layers differ); where this rank is
# alone in its change they are in the call's exchange instead, and this rank raises
FIELD_CHANGE_TIMEOUT_S = 120.0


def _checks_every_call(group) -> bool:
    """Whether every call on ``group`` checks again (a gloo group: its exchanges block the host on the peers
    anyway), the same answer on every rank."""
    return "gloo" in str(dist.get_backend(group))


def verify_plan(plan: Plan, group, fields: dict | None = None) -> None:
    """Every rank must hold the same plan and pass the same ``fields`` (named ints, e.g. ``input_fields``: head
    counts, head dims, dtype code). One tiny all-reduce of (max, -max) of the digest and the fields, on the host
    (``groups.host_group``: no wait for the GPU's queue); where ranks differ, a ``RanksDisagreeError`` (a
    ValueError) on every rank naming this rank's value and the range seen across ranks, before any exchange of
    the attention (whose mismatched sizes would abort gloo or hang NCCL).

    When: on a plan's first call with ``group`` (no collective where the step accepted a planning thread's check
    of the plan, ``check_plan_ahead`` / ``accept_plan_check``, and these fields were agreed on an earlier plan);
    again on every later call where ``group`` is a gloo group whose plan was not checked ahead. Other later calls
    (NCCL; gloo checked ahead) run no collective while their fields are ones agreed on the group: a comparison on
    the host. A later call whose fields were never agreed on the group checks them: where every rank's call
    changed alike (a model whose layers differ in heads or head dims) the ranks meet there and go on; a rank
    alone in its change (another dtype or head count than its peers') raises a ``RanksDisagreeError`` naming its
    fields and the agreed ones after ``FIELD_CHANGE_TIMEOUT_S``, before any exchange. Its peers, in that call's
    exchange meanwhile, raise it too (``runtime.faults``: the rank posts it in the group's store; each peer's
    watcher raises it in the peer's step thread and aborts the group, ending the exchange's wait). Each decision
    is the same on every rank where the fields agree (the group's backend, the plan, the step's acceptance)."""
    if group is None or plan.cp_size == 1:
        return
    faults.raise_posted(group)  # a peer raised alone and this rank's watcher met it (a dict look-up otherwise)
    cache = plan_cache(plan)
    seen = cache.setdefault("verified", {})  # group token -> (every later call checks again, first fields)
    token = group_token(group)
    items = tuple((fields or {}).items())
    state = seen.get(token)
    if state is not None:
        again, first = state
        if not again or token in cache.get("accepted", ()):
            if items == first or (token, items) in _FIELDS_AGREED:
                return
            agreed = "; ".join(f"{n} {_shown(n, x)}" for n, x in first)
            mine = "; ".join(f"{n} {_shown(n, x)}" for n, x in items)
            _agree_unless_alone(["plan digest"] + [n for n, _ in items],
                                [int(plan.digest64)] + [int(x) for _, x in items], group,
                                f"CP ranks disagree: this rank's attention call brings {mine}, not what the group "
                                f"agreed on for this plan ({agreed}); every rank of a CP group must call attention "
                                "with the same heads, head dims and dtype")
            _FIELDS_AGREED.add((token, items))
            return
    elif token in cache.get("accepted", ()) and (token, items) in _FIELDS_AGREED:
        seen[token] = (False, items)
        faults.watch(group)  # later calls check nothing: a peer alone in a change tells this rank through it
        return
    _agree(["plan digest"] + [n for n, _ in items], [int(plan.digest64)] + [int(x) for _, x in items],
           host_group(group))
    _FIELDS_AGREED.add((token, items))
    if state is None:
        seen[token] = (_checks_every_call(group), items)
        # a rank's error alone on a later call reaches this one through it, in that call's exchange or check
        faults.watch(group)


def exchange_choice(plan: Plan, *, stages: int | None, hierarchical: bool, cost: CostModel,
                    work: Workload) -> Schedule | None:
    """``choose_schedule``'s answer for ``plan`` (None: the single exchange), made once per (stages,
    hierarchical, cost model, workload) and kept with the plan. Pure host work on the plan's public fields:
    a planning thread may make it ahead of the step (``prebuild``); every rank makes the same choice."""
    key = _exchange_key(stages, hierarchical, cost, work)
    cache = plan_cache(plan)
    if key not in cache:
        cache[key] = choose_schedule(plan, stages, cost, work, hierarchical)
    return cache[key]


def keep_exchange_choice(plan: Plan, sched: Schedule | None, *, stages: int | None, hierarchical: bool,
                         cost: CostModel, work: Workload) -> None:
    """Keep ``sched`` as ``plan``'s exchange choice for these settings: the answer ``exchange_choice`` gives,
    made elsewhere (``runtime.plan_process``: a helper process made it on a copy of the plan)."""
    plan_cache(plan)[_exchange_key(stages, hierarchical, cost, work)] = sched


def _exchange_key(stages, hierarchical, cost, work) -> tuple:
    return ("exchange", stages, hierarchical, cost, work)


def prepare_lists(plan: Plan, rank: int, sched: Schedule | None, prepare) -> list:
    """``rank``'s tile lists under the exchange ``sched`` (None: the single exchange), each through ``prepare``
    (a backend's ``prepare`` or ``prepare_host``): [the whole list] for the single exchange, one per stage
    (None for a stage without tiles) for a staged one."""
    if sched is None:
        rp = plan.ranks[rank]
        return [prepare(torch.from_numpy(rp.tiles.astype("int32")), rp.num_tokens, max(rp.buffer_len, 1))]
    return [prepare(torch.from_numpy(st.tiles.astype("int32")), plan.num_local(rank), max(st.buf_len, 1))
            if len(st.tiles) else None for st in sched.ranks[rank]]


def prepare_name(prepare) -> str:
    """What names a backend's ``prepare_host`` across processes: its ``name`` where it has one (an object that says
    which lists it makes, e.g. the Triton backend's, of a configuration), else its module and qualified name."""
    return getattr(prepare, "name", None) or f"{prepare.__module__}.{prepare.__qualname__}"


def rank_ahead(plan: Plan, rank: int, sched: Schedule | None, prepare=None) -> RankAhead:
    """``rank``'s host work for its first call under the exchange ``sched``, made ahead: the single exchange's
    host part or the staged exchange's routes and, given a backend's ``prepare_host``, the tile lists. Host work
    only (numpy); picklable."""
    gh = guests.guest_host(plan, rank) if plan.has_guests else None
    return RankAhead(single_host(plan, rank) if sched is None else None,
                     None if sched is None else [None] + [RouteIndex.of(st.route) for st in sched.ranks[rank][1:]],
                     gh,
                     None if prepare is None else prepare_name(prepare),
                     None if prepare is None else prepare_lists(plan, rank, sched, prepare),
                     None if prepare is None or gh is None else guests.guest_list(gh, prepare))


def _ahead_key(rank: int, stages, hierarchical, cost, work) -> tuple:
    return ("ahead", rank, stages, hierarchical, cost, work)


def keep_rank_ahead(plan: Plan, rank: int, ahead: RankAhead, *, stages: int | None, hierarchical: bool,
                    cost: CostModel, work: Workload) -> None:
    """Keep ``rank_ahead``'s answer, made elsewhere (``runtime.plan_process``: the planning helper process made it
    on a copy of the plan), for ``rank``'s first ``rank_state`` with these exchange settings to take instead of
    making it on the step's thread (its lists where the state's backend has that ``prepare_host``)."""
    plan_cache(plan)[_ahead_key(rank, stages, hierarchical, cost, work)] = ahead


def rank_state(plan: Plan, rank: int, device: torch.device, backend: Backend, backend_key, *,
               stages: int | None, hierarchical: bool, cost: CostModel, work: Workload) -> RankRuntime:
    """The cached ``RankRuntime`` of ``rank`` (built on first use; every rank makes the same exchange
    choice, since the cost model's inputs are the same on every rank). Its host part is the one made ahead
    (``keep_rank_ahead``) where there is one (its tile lists where the backend's ``prepare_host`` made them), else
    made here."""
    key = ("rank", rank, str(device), backend_key, stages, hierarchical, cost, work)
    cache = plan_cache(plan)
    st = cache.get(key)
    if st is None:
        sched = exchange_choice(plan, stages=stages, hierarchical=hierarchical, cost=cost, work=work)
        exchanges = any(r.num_remote > 0 for r in plan.ranks)
        # taken, not shared: a prepared list caches device metadata and routes for the state that uses it
        ahead = cache.pop(_ahead_key(rank, stages, hierarchical, cost, work), None)
        ahead = ahead or RankAhead(None, None, None, None, None)
        host = getattr(backend, "prepare_host", None)
        taken = host is not None and ahead.prepare == prepare_name(host)  # lists prepared ahead for this backend
        lists = ahead.lists if taken else prepare_lists(plan, rank, sched, backend.prepare)
        single = None
        if sched is None:
            single = _single(ahead.single or single_host(plan, rank), device, lists[0])
        guest_rt = None
        if plan.has_guests:
            gh = ahead.guests or guests.guest_host(plan, rank)
            guest_rt = guests.guest_runtime(gh, device, ahead.guest_list if taken else
                                            guests.guest_list(gh, backend.prepare))
        st = RankRuntime(
            rank=rank,
            s_local=plan.num_local(rank),
            backend=backend,
            exchanges=exchanges,
            schedule=sched,
            single=single,
            staged=_staged(sched, rank, device, lists, ahead.routes) if sched is not None else None,
            guests=guest_rt,
            pool=device_pool(device),
        )
        cache[key] = st
    return st


def single_host(plan: Plan, rank: int) -> SingleHost:
    """The single exchange's host part for ``rank``: index arrays, counts and row maps (numpy)."""
    rp = plan.ranks[rank]
    exchanges = any(r.num_remote > 0 for r in plan.ranks)
    send_index, send_counts = rp.send_index()
    own_pos, recv_pos = rp.buffer_index()
    buffer_len = max(rp.buffer_len, 1)
    # returned partial rows grouped by the local row they add to (CSR, source order kept)
    red_rows, red_ptr, red_order = grouped(send_index, rp.num_tokens)  # send_index: local rows
    own_identity = len(own_pos) == rp.num_tokens and bool(np.array_equal(own_pos, np.arange(rp.num_tokens)))
    return SingleHost(
        buffer_len=buffer_len,
        send_counts=send_counts,
        recv_counts=rp.recv_counts(),
        own=RowIndex.of(own_pos, None),
        recv=RowIndex.of(recv_pos, None),
        send=RowIndex.of(None, send_index),
        own_rows=RowIndex.of(None, own_pos),
        recv_rows=RowIndex.of(None, recv_pos),
        red_rows=red_rows,
        red_ptr=red_ptr,
        red_pos=red_order,
        identity=(not exchanges or plan.cp_size == 1) and own_identity and buffer_len == rp.num_tokens,
    )


def _single(h: SingleHost, device, prepared) -> SingleExchange:
    maps = (h.own, h.recv, h.send, h.own_rows, h.recv_rows)
    t = upload_all([a for m in maps for a in (m.dst, m.src)] + [h.red_rows, h.red_ptr, h.red_pos], device)
    own, recv, send, own_rows, recv_rows = (RowMap.placed(m, t[2 * i], t[2 * i + 1]) for i, m in enumerate(maps))
    return SingleExchange(
        buffer_len=h.buffer_len,
        send_counts=h.send_counts,
        recv_counts=h.recv_counts,
        own=own,
        recv=recv,
        send=send,
        own_rows=own_rows,
        recv_rows=recv_rows,
        red_rows=t[-3],
        red_ptr=t[-2],
        red_pos=t[-1],
        prepared=prepared,
        identity=h.identity,
        recv_into=_in_order(h.recv, sum(h.recv_counts)),
        send_from=_sent_from_buffer(h),
    )


def _in_order(m: RowIndex, n: int) -> tuple | None:
    """(first row, n) where ``m`` places rows 0..n-1 of its source at n consecutive rows, in order; else None."""
    if n and not m.indexed and len(m.runs) == 1 and m.runs[0][1] == 0 and m.runs[0][2] == n:
        return (int(m.runs[0][0]), n)
    return None


def _sent_from_buffer(h: SingleHost) -> tuple | None:
    """(first buffer row, rows) where the key buffer holds the rows ``h.send`` gathers, in its order, once ``h.own``
    has placed the local rows: both one run (a sliding window's rank sends one run of its rows on). Else None."""
    own, send = h.own, h.send
    if h.identity or not send.n or own.indexed or send.indexed or len(own.runs) != 1 or len(send.runs) != 1:
        return None
    (od, os_, oc), (_, ss, sc) = own.runs[0], send.runs[0]  # own: local rows os_.. at od..; send: local ss..
    if ss < os_ or ss + sc > os_ + oc:
        return None
    return (int(od + ss - os_), int(sc))


def _staged(sched: Schedule, rank: int, device, prepared: list, routes: list | None) -> StagedExchange:
    stages = sched.ranks[rank]
    routes = routes or [None] + [RouteIndex.of(st.route) for st in stages[1:]]
    idle = [i for i, st in enumerate(stages) if i > 0 and len(st.tiles) and not sched.active[i - 1]]
    if idle:  # its keys would never arrive (and its backward has no reduce to join)
        raise RuntimeError(f"rank {rank}: stages {idle} have tiles but exchange nothing (schedule bug)")
    return StagedExchange(
        prepared=prepared,
        buf_len=[st.buf_len for st in stages],
        routes=[None] + [DeviceRoute.on(h, device, upload_all) for h in routes[1:]],
        active=[False] + list(sched.active),
    )
