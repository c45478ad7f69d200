"""One plan over the whole DP x CP world: every data-parallel rank's micro-batch placed on the rank that should
run it.

With ``dp`` data-parallel groups of ``cp`` context-parallel ranks, each group's loader gives it its own
micro-batch of ``L`` tokens, and with packed documents of heavy-tailed lengths the groups' attention work differs
by up to tens of times; a fixed layout waits for the slowest group every step. Concatenated, the micro-batches
are one sequence of ``dp * L`` tokens whose mask is ``masks.block_diagonal`` of theirs: ``plan(that, dp * cp)``
balances the work over all ranks, keeps short documents whole on one rank and splits long ones where balance
needs it, and ``attention`` over the DP x CP group moves only what split documents need. ``gather_global_batch``
is the data path: each rank gets the tokens (and labels, loss mask, positions, ...) the plan gives it.
Balance is not the whole step: the global plan's calls span every rank and move the documents it splits, so on
short documents DP's own layout (``planner.plan_groups``: each group's micro-batch on its own CP ranks) finishes
sooner; ``plan_over_dp`` weighs the two by ``predict_layer`` (kernels, exchange, host time per call).

The model's weights are replicated over DP x CP (Megatron reduces their gradients over that group), and a
per-token loss summed over the global batch and divided by its token count is the same sum whatever rank holds
a token: loss and gradients equal the fixed layout's (tests/test_global_batch.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..masks import block_diagonal
from ..planner import Plan, Workload, plan, plan_groups
from .cost import CostModel
from .groups import host_group


def _check_fields(fields: Mapping[str, torch.Tensor], world: int, dp_rank: int, cp_rank: int,
                  cp_size: int) -> tuple[int, int]:
    """(dp, L), or ValueError naming the value: what a rank can check alone, before any collective."""
    if not isinstance(cp_size, (int, np.integer)) or cp_size < 1 or world % cp_size:
        raise ValueError(f"cp_size={cp_size!r} must be a positive int dividing the group's {world} ranks")
    dp = world // int(cp_size)
    if not 0 <= dp_rank < dp or not 0 <= cp_rank < cp_size:
        raise ValueError(f"dp_rank={dp_rank} / cp_rank={cp_rank} outside DP {dp} x CP {cp_size}")
    if not fields:
        raise ValueError("the global batch needs at least one field (e.g. tokens)")
    for name, t in fields.items():
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            what = f"a {t.dim()}-dim tensor" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
            raise ValueError(f"field {name!r} is {what}, expected the micro-batch's tokens along dim 0")
    lens = {name: int(t.shape[0]) for name, t in sorted(fields.items())}
    if len(set(lens.values())) > 1:
        raise ValueError(f"the fields' lengths along dim 0 differ: {lens}")
    L = next(iter(lens.values()))
    if L % cp_size:
        raise ValueError(f"the micro-batch length {L} must be a multiple of cp_size={cp_size} (each CP rank sends "
                         f"1/{cp_size} of its group's micro-batch)")
    return dp, L


def _check_plan(plan: Plan, world: int, cp_size: int, fields: Mapping[str, torch.Tensor]) -> None:
    """ValueError naming the value when the plan is not one of the concatenated micro-batches over ``world``."""
    if plan.cp_size != world:
        raise ValueError(f"the plan covers {plan.cp_size} ranks but the group has {world}: plan the concatenated "
                         f"micro-batches over every rank of the DP x CP group")
    dp = world // cp_size
    for name, t in fields.items():
        if t.shape[0] * dp != plan.seqlen:
            raise ValueError(f"field {name!r}: {tuple(t.shape)}, expected the micro-batch's {plan.seqlen // dp} "
                             f"tokens along dim 0 (the plan's {plan.seqlen} tokens over DP {dp})")


_PLACES: dict = {}  # (group's ranks, dp_rank, cp_rank, L, field names) -> every rank's (dp, cp) place, checked


def _places(group, dp_rank: int, cp_rank: int, L: int, names: list) -> np.ndarray:
    """Every rank's (dp_rank, cp_rank) in ``group``: all-gathered and checked the first time a layout is seen
    (the ranks meet a new micro-batch length or field set together), then remembered: no collective per
    micro-batch for what does not change."""
    key = (tuple(dist.get_process_group_ranks(group)), dp_rank, cp_rank, L, tuple(names))
    if key not in _PLACES:
        world = len(key[0])
        mine = torch.tensor([dp_rank, cp_rank, L, len(names)], dtype=torch.int64)
        got = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(got, mine, group=host_group(group))  # host tensors: gloo, whatever group's backend
        got = torch.stack(got).numpy()
        if len({(int(d), int(c)) for d, c in got[:, :2]}) != world or (got[:, 2:] != got[0, 2:]).any():
            raise ValueError(f"the ranks' (dp_rank, cp_rank, micro-batch length, fields) disagree: {got.tolist()}; "
                             f"every (dp, cp) place must be taken once, with the same micro-batch length and fields")
        _PLACES[key] = got[:, :2]
    return _PLACES[key]


def all_micro_batches(fields: Mapping[str, torch.Tensor], group: dist.ProcessGroup, *, dp_rank: int, cp_rank: int,
                      cp_size: int) -> dict[str, torch.Tensor]:
    """Every DP group's micro-batch, concatenated: ``{name: [dp * L, ...]}``, micro-batch ``d`` at tokens
    ``[d * L, (d + 1) * L)``, the same on every rank of ``group`` (the DP x CP world).

    ``fields``: this rank's DP group's micro-batch, ``[L, ...]`` each (any dtype), the same on every CP rank of the
    group (as Megatron's loaders give it). Each CP rank contributes 1/cp of it to one all-gather per field, so each
    token travels once to every rank: ``dp * L`` tokens per rank and field, small beside the activations (an
    all-to-all sending each rank only its tokens is the form for many ranks; not built). Bad input raises before
    any collective; ranks that disagree on their places raise together after the first (a small all-gather, once
    per layout)."""
    world = dist.get_world_size(group)
    dp, L = _check_fields(fields, world, dp_rank, cp_rank, cp_size)
    seg = L // cp_size
    names = sorted(fields)
    places = _places(group, dp_rank, cp_rank, L, names)
    out = {}
    for name in names:
        t = fields[name]
        part = t[cp_rank * seg:(cp_rank + 1) * seg].contiguous()
        parts = [torch.empty_like(part) for _ in range(world)]
        dist.all_gather(parts, part, group=group)
        full = torch.empty((dp * L, *t.shape[1:]), dtype=t.dtype, device=t.device)
        for r, (d, c) in enumerate(places.tolist()):
            full[d * L + c * seg:d * L + (c + 1) * seg] = parts[r]
        out[name] = full
    return out


def gather_global_batch(fields: Mapping[str, torch.Tensor], plan: Plan, group: dist.ProcessGroup, *, dp_rank: int,
                        cp_rank: int, cp_size: int) -> dict[str, torch.Tensor]:
    """This rank's tokens of the global batch: ``{name: field of the concatenated micro-batches at
    plan.local_ids(rank)}``, in the plan's local order (what ``attention`` over ``group`` with ``plan`` expects).

    ``fields``, ``dp_rank``, ``cp_rank``, ``cp_size``: as ``all_micro_batches``. ``group``: every rank of the DP x
    CP world, ``plan`` over all of them (``plan(masks.block_diagonal(micro-batch masks), dp * cp)``)."""
    world = dist.get_world_size(group)
    if not isinstance(plan, Plan):
        raise TypeError(f"gather_global_batch needs a Plan, got {type(plan).__name__}")
    _check_fields(fields, world, dp_rank, cp_rank, cp_size)
    _check_plan(plan, world, cp_size, fields)
    full = all_micro_batches(fields, group, dp_rank=dp_rank, cp_rank=cp_rank, cp_size=cp_size)
    ids = torch.from_numpy(plan.local_ids(dist.get_rank(group)))
    return {n: t[ids.to(t.device)] for n, t in full.items()}


@dataclass(frozen=True)
class HostCost:
    """Host seconds of one attention call on a plan whose exchange spans ``span`` ranks (1 when nothing moves):
    ``fwd_s + fwd_per_rank_s * (span - 1)``, likewise the backward node. Defaults: one rank alone on one H200
    (benchmarks/2026-11-29_1xH200_host-path, sitting 1: packed documents, 8k tokens per rank, 32:8 heads; a line
    through its cp 4 and cp 8 rows, the only spans measured). ``layer_s``: the rest of a layer's host time per
    micro-batch (Megatron's own modules), the same under every plan but what decides whether a call waits on the
    host or on the GPU; 0 prices the attention calls alone."""

    fwd_s: float = 0.301e-3
    fwd_per_rank_s: float = 0.102e-3
    bwd_s: float = 0.849e-3
    bwd_per_rank_s: float = 0.084e-3
    layer_s: float = 0.0

    def call(self, span: int) -> float:
        """Forward call + backward node, seconds."""
        return self.fwd_s + self.bwd_s + (self.fwd_per_rank_s + self.bwd_per_rank_s) * (max(int(span), 1) - 1)


def exchange_span(plan: Plan) -> int:
    """Ranks in the largest set that ``plan``'s exchanges link (1 when nothing moves): a DP group's own plan links
    its CP ranks only, and run on them (as the fixed layout runs it) its calls span those."""
    parent = list(range(plan.cp_size))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for r in plan.ranks:
        for src, runs in enumerate(r.recv_runs):
            if len(runs) and int((runs[:, 1] - runs[:, 0]).sum()):
                parent[root(src)] = root(r.rank)
    return int(np.bincount([root(i) for i in range(plan.cp_size)]).max())


def predict_layer(plan: Plan, work: Workload, cost: CostModel | None = None, host: HostCost | None = None,
                  gpu_s_per_token: float = 0.0) -> float:
    """Predicted seconds of one layer's attention forward + backward under ``plan``: its slowest rank's
    ``max(host, GPU)``, GPU = kernels on the rank's tiles (``cost.tile_time``) + the K/V exchange and the dK/dV
    return (fp32 sums: twice the bytes) when anything moves + ``gpu_s_per_token`` x its tokens (the layer's other
    GPU work); host = ``host.call`` over ``exchange_span(plan)`` ranks + ``host.layer_s``. The ranks wait for each
    other at the exchange, and the step for the slowest rank, so the slowest rank's time is the layer's."""
    cost, host = cost or CostModel(), host or HostCost()
    moves = any(r.num_remote for r in plan.ranks)
    recv = max(r.num_remote for r in plan.ranks) * work.kv_bytes_per_token
    ex = cost.comm_time(recv, 0.0) + cost.comm_time(2 * recv, 0.0) if moves else 0.0
    h = host.call(exchange_span(plan)) + host.layer_s
    return max(max(h, cost.tile_time(r.tiles, work) + cost.tile_time(r.tiles, work, True) + ex
                   + gpu_s_per_token * r.num_tokens) for r in plan.ranks)


def plan_over_dp(masks, cp_size: int, *, work: Workload, cost: CostModel | None = None, host: HostCost | None = None,
                 gpu_s_per_token: float = 0.0, topology=None, **plan_kwargs) -> tuple[Plan, dict]:
    """The plan of one global micro-batch over DP x CP: ``masks`` are the DP groups' micro-batches (DP rank order),
    ``cp_size`` ranks each. Two candidates: ``global``, ``plan(block_diagonal(masks), dp * cp)`` (balanced over every
    rank, documents split across groups where balance needs it; ``topology``: the world's), and ``dp_whole``,
    ``planner.plan_groups(masks, cp_size)`` (every group's documents on its own ranks, as DP keeps them; nothing
    moves at CP 1; group ``d``'s part is ``plan(masks[d], cp_size)`` shifted to its ranks, what the fixed layout runs
    on that group's CP ranks). Returns the one whose ``predict_layer`` is lower (``dp_whole`` on a tie: it moves
    less) and ``{candidate: predicted seconds}``. Short documents: each group is balanced already and the global
    plan only adds exchange and host time, so DP's layout wins; a heavy-tailed draw leaves one group with most of the
    work and the global plan wins by its balance. Pure host work, the same on every rank."""
    masks = list(masks)
    cands = {"dp_whole": plan_groups(masks, cp_size, **plan_kwargs),
             "global": plan(block_diagonal(masks), len(masks) * int(cp_size), topology=topology, **plan_kwargs)}
    pred = {k: predict_layer(p, work, cost, host, gpu_s_per_token) for k, p in cands.items()}
    best = min(cands, key=lambda k: (pred[k], k != "dp_whole"))
    return cands[best], pred
