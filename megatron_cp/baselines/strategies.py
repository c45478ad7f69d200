"""Ring, Ulysses, USP and all-gather context parallelism over the same plans, masks and kernels.

One core, ``_usp``: Ulysses all-to-all inside groups of ``u`` consecutive ranks, then a K/V ring over
the ``cp / u`` groups. ``ring`` is u = 1, ``ulysses`` is u = cp. The all-to-alls and the ring use
point-to-point ops inside the CP group (no sub-groups are created, so any CP group works).
Tiles of every step are the plan's mask clipped to (query runs x key runs) of that step, so every
strategy is exact for any mask; the layouts they need are about balance, not correctness.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from ..comm.collectives import _wire, all_gather_rows, all_to_all_v
from ..planner import Plan
from ..planner import plan as make_plan
from ..planner.layout import head_context_plan, kv_head_repeat
from ..planner.schedule import clip_tiles, mask_traps, rank_traps
from ..runtime.attention import _backend, _check_inputs, _group_rank, merge_lse
from .exchange import _SplitHeads, check_lse_grad, to_heads, to_seq
from .hybrid import head_context


# ----------------------------------------------------------------------------------------- helpers


def _cached(plan: Plan, key, build):
    v = plan.cache.get(key)
    if v is None:
        v = build()
        plan.cache[key] = v
    return v


def _traps(plan: Plan) -> np.ndarray:
    return _cached(plan, ("baseline", "mask_traps"), lambda: mask_traps(plan))


def _prepared(plan, key, backend, tiles: np.ndarray, sq: int, sk: int):
    """Backend-prepared tile list (None when empty), cached on the plan."""

    def build():
        if len(tiles) == 0:
            return None
        return backend.prepare(torch.from_numpy(tiles.astype("int32")), sq, max(sk, 1))

    return _cached(plan, ("baseline", "prep") + key, build)


def _rank_order_ids(plan: Plan) -> np.ndarray | None:
    """Global ids of the rows concatenated in rank order; None when that is global order (contiguous
    layouts)."""
    ids = np.concatenate([plan.local_ids(r) for r in range(plan.cp_size)])
    return None if np.array_equal(ids, np.arange(len(ids))) else ids


def _global_order(plan: Plan, device):
    """(perm, inv): rows concatenated in rank order -> global order, and back (int64 tensors); (None, None)
    when rank order is global order."""
    ids = _rank_order_ids(plan)
    if ids is None:
        return None, None
    perm = np.empty_like(ids)
    perm[ids] = np.arange(len(ids))
    return torch.from_numpy(perm).to(device), torch.from_numpy(ids).to(device)


def _traps_to_tiles(traps) -> np.ndarray:
    from ..masks import geometry

    return np.asarray([geometry.trap_to_slice(t) for t in traps], dtype=np.int32).reshape(-1, 5)


def _runs_len(runs) -> int:
    return int((runs[:, 1] - runs[:, 0]).sum()) if len(runs) else 0


def _scale(q, softmax_scale):
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


class _TileAttention(torch.autograd.Function):
    """Differentiable backend call on one tile list (used by the composed strategies)."""

    @staticmethod
    def forward(ctx, q, k, v, backend, prepared, scale):
        out, lse = backend.forward(q, k, v, prepared, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backend, ctx.prepared, ctx.scale = backend, prepared, scale
        ctx.set_materialize_grads(False)  # an unused lse gives dlse None
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        # None: the backend computes rowsum(dout * out) itself (one fused pass; dense pieces may use cuDNN)
        delta = None if dlse is None else (dout.to(cdt) * out.to(cdt)).sum(-1) - dlse.to(cdt)
        dq, dk, dv = ctx.backend.backward(q, k, v, out, lse, dout, ctx.prepared, ctx.scale, delta)
        return dq, dk, dv, None, None, None


def _empty_result(q, hv):
    out = q.new_zeros(q.shape[:2] + (hv,))
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    return out + 0 * q.sum(), lse  # keep q in the graph (zero gradient)


# ---------------------------------------------------------------------------------------- the ring


class _Ring(torch.autograd.Function):
    """K/V ring over ``peers`` (group ranks in ring order; this rank is ``peers[me]``).

    Step i computes local queries against the block that started at ring position (me - i) % R,
    while block i+1 is in flight. Backward: the same order; each block's dK/dV accumulator travels
    with it and arrives home after R hops, each send overlapping the next step's kernel.
    """

    @staticmethod
    def forward(ctx, q, kv, hkv, peers, me, block_rows, steps, backend, scale, group):
        R = len(peers)
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        # a backend with an accumulating forward merges each step inside its kernel (fp32 running
        # output, no extra passes); otherwise steps are merged here by LSE
        fused = getattr(backend, "forward_accumulate", None) if q.dtype != torch.float64 else None
        acc = torch.zeros(q.shape[:2] + (q.shape[-1],), dtype=cdt, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=cdt, device=q.device)
        nxt_peer, prv_peer = peers[(me + 1) % R], peers[(me - 1) % R]
        cur, blocks = kv, []
        for i in range(R):
            works = []
            if i < R - 1:
                nxt = kv.new_empty((block_rows[(me - i - 1) % R],) + tuple(kv.shape[1:]))
                ops = [dist.P2POp(dist.isend, _wire(cur), group=group, group_peer=nxt_peer),
                       dist.P2POp(dist.irecv, _wire(nxt), group=group, group_peer=prv_peer)]
                works = dist.batch_isend_irecv(ops)
            if steps[i] is not None and fused is not None:
                fused(q, cur[:, :hkv], cur[:, hkv:], steps[i], scale, acc, lse)
            elif steps[i] is not None:
                o, l = backend.forward(q, cur[:, :hkv], cur[:, hkv:], steps[i], scale)
                merge_lse(acc, lse, o, l.to(cdt))
            blocks.append(cur)
            for w in works:
                w.wait()
            if i < R - 1:
                cur = nxt
        out, lse = acc.to(q.dtype), lse.to(torch.float32)
        ctx.save_for_backward(q, out, lse, *blocks)
        ctx.args = (hkv, peers, me, block_rows, steps, backend, scale, group)
        ctx.set_materialize_grads(False)  # an unused lse gives dlse None
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, out, lse, *blocks = ctx.saved_tensors
        hkv, peers, me, block_rows, steps, backend, scale, group = ctx.args
        R = len(peers)
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        # None: each step's backend call computes rowsum(dout * out) itself (one fused pass on GPU, and
        # dense steps may then run on cuDNN); with an lse gradient it is computed here once
        delta = None if dlse is None else (dout.to(cdt) * out.to(cdt)).sum(-1) - dlse.to(cdt)
        nxt_peer, prv_peer = peers[(me + 1) % R], peers[(me - 1) % R]
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        works, recv, sent = [], None, None
        for i in range(R):
            b = blocks[i]
            if steps[i] is not None:
                dq_i, dk_i, dv_i = backend.backward(q, b[:, :hkv], b[:, hkv:], out, lse, dout, steps[i], scale, delta)
                dq += dq_i
                g = torch.cat([dk_i, dv_i], dim=1).to(cdt)
            else:
                g = torch.zeros(b.shape, dtype=cdt, device=q.device)
            for w in works:
                w.wait()
            acc = g if recv is None else recv + g
            if R == 1:
                recv = acc
                break
            recv = torch.empty((block_rows[(me - i - 1) % R],) + tuple(b.shape[1:]), dtype=cdt, device=q.device)
            sent = acc  # keep alive until the send completes
            ops = [dist.P2POp(dist.isend, sent, group=group, group_peer=nxt_peer),
                   dist.P2POp(dist.irecv, recv, group=group, group_peer=prv_peer)]
            works = dist.batch_isend_irecv(ops)
        for w in works:
            w.wait()
        d = recv.to(q.dtype)  # this rank's own block, home after R hops
        return dq.to(q.dtype), d, None, None, None, None, None, None, None, None


# ------------------------------------------------------------------------------------- strategies


def _check_ring_plan(plan: Plan, name: str):
    if plan.cp_size > 1 and not (plan.solver.startswith("zigzag") or plan.solver == "contiguous"):
        raise ValueError(
            f"{name} needs a plan made with solver='zigzag' (causal) or 'contiguous' (full), got "
            f"solver={plan.solver!r}; build it with megatron_cp.baselines.plan_for"
        )


def _usp(q, k, v, plan, group, softmax_scale, u, backend, name, lse_grad=True):
    rank = _group_rank(plan, group)
    _check_inputs(q, k, v, plan, rank, softmax_scale)
    check_lse_grad(lse_grad, name)
    cp = plan.cp_size
    if u < 1 or cp % u:
        raise ValueError(f"{name}: ulysses_degree={u} must divide cp_size={cp}")
    hq, hkv = q.shape[1], k.shape[1]
    f = kv_head_repeat(hq, hkv, u) if u > 1 else 1
    if hq % u:
        raise ValueError(f"{name}: ulysses_degree={u} must divide the query heads ({hq})")
    scale = _scale(q, softmax_scale)
    bkey, be = _backend(backend, q.device)  # a name or a backend object
    g, j = divmod(rank, u)  # ulysses group g (ranks g*u .. g*u+u-1), position j inside it
    members = [g * u + i for i in range(u)]
    counts = [plan.num_local(r) for r in members]
    kr = k.repeat_interleave(f, dim=1) if f > 1 else k
    vr = v.repeat_interleave(f, dim=1) if f > 1 else v
    hkv_u = hkv * f // u
    R = cp // u
    # one group holds the whole sequence (R == 1): there, in global order, the mask's own trapezoids are
    # the tiles (no clipping over pairs of runs); the received rows are put in it unless already so
    perm, inv = (_cached(plan, ("baseline", "global_order", str(q.device)), lambda: _global_order(plan, q.device))
                 if R == 1 else (None, None))
    if u > 1:
        # q, k and v in one exchange, each received into its own contiguous buffer
        qh, kh, vh = to_heads([q, kr, vr], members, j, counts, group, perm)
    else:
        qh, kh, vh = q, kr, vr
        if perm is not None:
            qh, kh, vh = (x.index_select(0, perm) for x in (qh, kh, vh))
    # the ring across groups: ring position = group index, peers hold the same head group
    group_runs = [np.concatenate([plan.ranks[gg * u + i].segments for i in range(u)]) for gg in range(R)]
    rows = [_runs_len(r) for r in group_runs]
    traps = _traps(plan)

    def steps():
        out = []
        for i in range(R):
            src = (g - i) % R
            tiles = _cached(plan, ("baseline", "tiles", u, g, src),
                            lambda: clip_tiles(traps, group_runs[g], group_runs[src]))
            out.append(_prepared(plan, (bkey, u, g, src), be, tiles, rows[g], rows[src]))
        return out

    peers = [gg * u + j for gg in range(R)]
    if R == 1:
        tiles = _cached(plan, ("baseline", "mask_tiles"), lambda: _traps_to_tiles(traps))
        st = _prepared(plan, (bkey, "global"), be, tiles, plan.seqlen, plan.seqlen)
        if st is None:
            o, l = _empty_result(qh, qh.shape[-1])
        else:
            o, l = _TileAttention.apply(qh, kh, vh, be, st, scale)
        if perm is not None:
            o, l = o.index_select(0, inv), l.index_select(0, inv)
    else:
        kv_h = torch.cat([kh, vh], dim=1)
        o, l = _Ring.apply(qh, kv_h, hkv_u, peers, g, rows, steps(), be, scale, group)
    if u > 1:
        o, l = to_seq([o, l.unsqueeze(-1)], members, j, counts, group, grads=(True, lse_grad))
        l = l.squeeze(-1)
    return o, (l if lse_grad else l.detach())


def ring(q, k, v, plan: Plan, group=None, softmax_scale=None, *, backend: str = "auto", lse_grad: bool = True):
    """Ring attention (p2p K/V ring, next block prefetched, dK/dV travel home in backward).

    Plan: ``solver='zigzag'`` (2*cp runs, rank r owns r and 2cp-1-r: balanced causal) or
    ``'contiguous'`` (full); other solvers raise ValueError. Masks: exact for any mask; balanced for
    causal (zigzag) and full (contiguous). Shapes as ``megatron_cp.attention``. ``lse_grad=False``
    (every strategy): lse comes back without gradient (for callers that use only out, as Megatron's
    core attention; the Ulysses exchanges then skip the lse gradient and its flags, a host sync).
    """
    if group is not None:
        _check_ring_plan(plan, "ring")
    return _usp(q, k, v, plan, group, softmax_scale, 1, backend, "ring", lse_grad)


def ulysses(q, k, v, plan: Plan, group=None, softmax_scale=None, *, backend: str = "auto", lse_grad: bool = True):
    """DeepSpeed-Ulysses: all-to-all sequence -> heads, full-sequence attention on Hq/cp heads,
    all-to-all back. Plan: any (contiguous recommended). Masks: any. Needs cp to divide Hq and
    Hkv*f for some K/V head repeat f (raises ValueError otherwise). ``lse_grad``: as ``ring``."""
    cp = plan.cp_size
    return _usp(q, k, v, plan, group, softmax_scale, cp, backend, "ulysses", lse_grad)


def usp(q, k, v, plan: Plan, group=None, softmax_scale=None, *, ulysses_degree: int | None = None,
        backend: str = "auto", lse_grad: bool = True):
    """USP: Ulysses inside groups of ``ulysses_degree`` consecutive ranks x ring across groups.

    ``ulysses_degree`` None: the largest divisor of cp that divides Hkv (capped by the plan's
    topology GPUs per node). Plan: ``zigzag`` or ``contiguous`` (the ring's layout). Masks: any,
    balanced for causal/full. ``lse_grad``: as ``ring``.
    """
    cp = plan.cp_size
    if ulysses_degree is None:
        cap = plan.topology.gpus_per_node if plan.topology is not None else cp
        hkv = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 3 else 1
        ulysses_degree = max(d for d in range(1, cp + 1) if cp % d == 0 and d <= cap and (hkv % d == 0 or d == 1))
    if group is not None and ulysses_degree < cp:
        _check_ring_plan(plan, "usp")
    return _usp(q, k, v, plan, group, softmax_scale, int(ulysses_degree), backend, "usp", lse_grad)


class _GatherKV(torch.autograd.Function):
    """All-gather K|V rows of every rank (concatenated in rank order); backward reduce-scatters."""

    @staticmethod
    def forward(ctx, kv, counts, rank, group):
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        return all_gather_rows(kv.contiguous(), counts, group)

    @staticmethod
    def backward(ctx, g):
        counts, rank = ctx.counts, ctx.rank
        back = all_to_all_v(g.contiguous(), counts, [counts[rank]] * len(counts), ctx.group)
        return back.view((len(counts), counts[rank]) + tuple(g.shape[1:])).sum(0), None, None, None


def _allgather_tiles(plan: Plan, rank: int) -> np.ndarray:
    if plan.has_guests:  # guest rows' cells are not among the rank's tiles: clip the whole mask
        runs = np.concatenate([plan.ranks[r].segments for r in range(plan.cp_size)])
        return clip_tiles(_traps(plan), plan.ranks[rank].segments, runs)
    if _rank_order_ids(plan) is None:
        return _traps_to_tiles(rank_traps(plan, rank))
    runs = np.concatenate([plan.ranks[r].segments for r in range(plan.cp_size)])
    return clip_tiles(rank_traps(plan, rank), None, runs)


def allgather(q, k, v, plan: Plan, group=None, softmax_scale=None, *, backend: str = "auto",
              lse_grad: bool = True):
    """All-gather K/V (Megatron/TE ``all_gather`` CP, PyTorch's Flex CP): every rank holds the whole
    K/V, computes its own rows' tiles, and dK/dV are reduce-scattered. Plan: any. Masks: any.
    ``lse_grad``: as ``ring``."""
    rank = _group_rank(plan, group)
    _check_inputs(q, k, v, plan, rank, softmax_scale)
    check_lse_grad(lse_grad, "allgather")
    scale = _scale(q, softmax_scale)
    bkey, be = _backend(backend, q.device)  # a name or a backend object
    hkv = k.shape[1]
    cp = plan.cp_size
    counts = [plan.num_local(r) for r in range(cp)]
    kv_all = _GatherKV.apply(torch.cat([k, v], dim=1), counts, rank, group) if cp > 1 else None
    # keys stay in rank order (no permutation pass over the gathered K/V): the mask clipped to this
    # rank's rows x every rank's runs; with a contiguous layout that is its own trapezoids
    tiles = _cached(plan, ("baseline", "ag_tiles", rank), lambda: _allgather_tiles(plan, rank))
    prep = _prepared(plan, (bkey, "ag", rank), be, tiles, counts[rank], sum(counts))
    if prep is None:
        out, lse = _empty_result(q, v.shape[-1])
        # keep the gather in the graph: its backward is a collective every rank must join
        return (out if kv_all is None else out + kv_all[:0].sum()), lse
    kh, vh = _SplitHeads.apply(kv_all, [hkv, hkv]) if cp > 1 else (k, v)
    out, lse = _TileAttention.apply(q, kh, vh, be, prep, scale)
    return out, (lse if lse_grad else lse.detach())


STRATEGIES = {"ring": ring, "ulysses": ulysses, "usp": usp, "allgather": allgather, "head_context": head_context}

_CAUSAL_LIKE = ("causal",)


def plan_for(name: str, mask, cp_size: int, **plan_kwargs) -> Plan:
    """The plan layout strategy ``name`` is meant for: ring/usp use zigzag (balanced causal) unless
    the contiguous layout is as balanced (full, windows); ulysses contiguous; allgather ``auto``;
    head_context ``planner.layout.head_context_plan`` (keyword ``ulysses_degree``, default the
    topology's GPUs per node, else cp; ``solver`` etc. go to its group-level plan). No guest rows
    (queries computed by their keys' owners are megatron-cp's, not the baselines')."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown context-parallel strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    if name != "head_context":
        plan_kwargs.setdefault("guest_rows", "none")
    if name == "head_context":
        u = plan_kwargs.pop("ulysses_degree", None)
        return head_context_plan(mask, cp_size, u, **plan_kwargs)
    if name == "ulysses":  # every rank attends over the whole sequence: balance needs no layout
        return make_plan(mask, cp_size, solver="contiguous", **plan_kwargs)
    if name in ("ring", "usp"):
        z = make_plan(mask, cp_size, solver="zigzag", **plan_kwargs)
        c = make_plan(mask, cp_size, solver="contiguous", **plan_kwargs)
        iz, ic = (p.candidates.get(p.solver, (None,))[0] for p in (z, c))
        iz = z.stats()["imbalance"] if iz is None else iz
        ic = c.stats()["imbalance"] if ic is None else ic
        return c if ic <= iz + 1e-9 else z
    return make_plan(mask, cp_size, **plan_kwargs)
