"""Which rank of the plan this process is: checked against the plan without any collective."""

from __future__ import annotations

import torch.distributed as dist

from ..planner import Plan


def plan_rank(plan: Plan, group=None, rank: int | None = None) -> int:
    """This process's rank in ``plan``: from ``group`` (its size must equal ``plan.cp_size``), or
    ``rank`` given explicitly for single-process use; ``group=None`` means cp_size 1."""
    if rank is not None:
        if group is not None:
            raise ValueError("pass either group= or rank=, not both")
        if not 0 <= int(rank) < plan.cp_size:
            raise ValueError(f"rank={rank} is outside this plan's cp_size={plan.cp_size}")
        return int(rank)
    if group is None:
        if plan.cp_size != 1:
            raise ValueError(f"plan is for cp_size={plan.cp_size} but no process group was given")
        return 0
    size = dist.get_world_size(group)
    if size != plan.cp_size:
        raise ValueError(f"plan was made for cp_size={plan.cp_size} but the group has {size} ranks")
    return dist.get_rank(group)
