"""One plan over the whole DP x CP world: every data-parallel rank's micro-batch placed on the rank that should
run it.

With ``dp`` data-parallel groups of ``cp`` context-parallel ranks, each group's loader gives it its own
micro-batch of ``L`` tokens, and with packed documents of heavy-tailed lengths the groups' attention work differs
by up to tens of times; a fixed layout waits for the slowest group every step. Concatenated, the micro-batches
are one sequence of ``dp * L`` tokens whose mask is ``masks.block_diagonal`` of theirs: ``plan(that, dp * cp)``
balances the work over all ranks, keeps short documents whole on one rank and splits long ones where balance
needs it, and ``attention`` over the DP x CP group moves only what split documents need. ``gather_global_batch``
is the data path: each rank gets the tokens (and labels, loss mask, positions, ...) the plan gives it.

The model's weights are replicated over DP x CP (Megatron reduces their gradients over that group), and a
per-token loss summed over the global batch and divided by its token count is the same sum whatever rank holds
a token: loss and gradients equal the fixed layout's (tests/test_global_batch.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.distributed as dist

from ..planner import Plan
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
