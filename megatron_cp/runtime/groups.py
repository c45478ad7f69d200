"""Which rank of the plan this process is: checked against the plan without any collective."""

from __future__ import annotations

import itertools
import threading
import weakref

import torch.distributed as dist

from ..comm import loopback
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
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group must be the CP torch.distributed.ProcessGroup (or None for cp_size 1), got {group!r}")
    size = dist.get_world_size(group)
    if size != plan.cp_size:
        raise ValueError(f"plan was made for cp_size={plan.cp_size} but the group has {size} ranks")
    return dist.get_rank(group)


_HOST_GROUPS: dict = {}  # ranks -> the gloo group over them: groups live as long as the job


def _serves_host(group) -> bool:
    """Whether ``group`` itself runs collectives of CPU tensors: gloo (and gloo through host copies), or a group
    with no peer (``comm.loopback``, torch's ``fake``: one rank of a plan run alone, tools/host_path.py)."""
    backend = str(dist.get_backend(group))
    return "gloo" in backend or backend in (loopback.BACKEND, "fake")


def host_group(group):
    """A process group over ``group``'s ranks that reduces CPU tensors: ``group`` itself where its backend
    has gloo, else a gloo group of the same ranks, made on first use by those ranks alone
    (``use_local_synchronization``: other CP groups need not join) and kept, one per set of ranks.

    What the once-per-plan check runs on: an all-reduce on the device makes the host read its result after
    everything queued on the stream (the previous micro-batch's backward), a stall of the whole GPU queue per
    plan; over gloo the host waits only for the other ranks' hosts, which issue the same calls."""
    if _serves_host(group):
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    twin = _HOST_GROUPS.get(ranks)
    if twin is None:
        twin = _HOST_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return twin


_PLANNING_GROUPS: dict = {}  # (ranks, purpose) -> the gloo group a planning thread runs its collectives on


def planning_group(group, purpose: str = ""):
    """A gloo group over ``group``'s ranks for one planning thread's collectives (one plan over DP x CP gathers
    every DP group's tokens ahead of the step; a plan made ahead is checked across the CP ranks), apart from
    ``host_group``'s: a gloo group's collectives must come in one order on every rank, and the step's checks and
    a thread's collectives run concurrently, as do two threads' (``purpose`` tells their groups apart). Made on
    first use by ``group``'s ranks alone, all at the same point (not from the thread), and kept, one per set of
    ranks and purpose."""
    if str(dist.get_backend(group)) in (loopback.BACKEND, "fake"):
        return group
    key = (tuple(dist.get_process_group_ranks(group)), purpose)
    g = _PLANNING_GROUPS.get(key)
    if g is None:
        g = _PLANNING_GROUPS[key] = dist.new_group(list(key[0]), backend="gloo", use_local_synchronization=True)
    return g


_TOKENS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_NEXT_TOKEN = itertools.count(1)
_TOKENS_LOCK = threading.Lock()  # planning threads ask too


def group_token(group) -> int:
    """A number for ``group`` that no other group object of this process ever gets: what the once-per-group
    records (checks made, fields agreed) are keyed by. Not ``id(group)``: a process that destroys its groups
    and makes new ones (a layout change) gets old ids back once the old objects are collected, on some ranks
    and not others, and a rank that took a new group for an old one would skip a check the others run (a
    hang)."""
    with _TOKENS_LOCK:
        t = _TOKENS.get(group)
        if t is None:
            t = _TOKENS[group] = next(_NEXT_TOKEN)
        return t
