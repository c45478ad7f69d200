"""Baseline context-parallel strategies, one plain file each, one uniform entry point:

    fn = get_strategy(name, **options)
    out, lse = fn(q, k, v, plan, group, softmax_scale)

q [s_local, Hq, D], k/v [s_local, Hkv, D] in the plan's local order (``dispatch``); out like q, lse
[s_local, Hq] float32 (float64 for float64 inputs). Every strategy is differentiable (once) and exact for any mask
the plan describes (the plan carries the mask exactly); they differ in what moves and how work is balanced:

- ``ring`` (ring.py): K/V blocks travel around a p2p ring (next block in flight while the current one
  computes; dK/dV travel with them in backward). Needs a ``zigzag`` (causal) or ``contiguous`` (full)
  plan.
- ``ulysses`` (ulysses.py): all-to-all from sequence to heads, every rank attends over the whole
  sequence for Hq/cp heads, all-to-all back. Needs Hkv*f divisible by cp for some f with
  Hq % (Hkv*f) == 0 (K/V heads are repeated when Hkv < cp). Any plan.
- ``usp`` (ulysses.py): Ulysses inside groups of ``ulysses_degree`` consecutive ranks (a node) x the
  ring across groups.
- ``allgather`` (allgather.py): all-gather K/V, local tiles, reduce-scatter dK/dV. Any plan, any mask.
- ``head_context`` (head_context.py; not a peer baseline: our 2-D option): Ulysses all-to-all over
  heads inside groups of ``ulysses_degree`` consecutive ranks (default: the plan topology's GPUs per
  node), then megatron-cp's planned, staged GroupCast attention across the cp/u groups over the
  group-level plan (``planner.group_plan``), then the all-to-all back. Like usp, but the cross-group
  part only moves the key rows the mask needs, balanced by the planner, for any mask. It needs one
  process group per position in a group; they are created once per (CP group, u) on first use, by
  every CP rank in the same order (``head_context_groups``).

Options every strategy takes: ``backend`` (a kernel backend name or ``kernels.Backend`` object) and
``lse_grad`` (False: lse comes back without gradient, and the exchanges skip its backward). What a
strategy derives from a plan (prepared tile lists, group plans, row permutations) is built on first
use and kept per plan object (``common.cached``), never on the plan.

The tiles each strategy's kernel calls compute (for cost models and benchmarks): ``ring_tiles(plan,
u, g)`` (ring, usp: per ring step), ``mask_tiles(plan)`` (ulysses: the whole sequence in global
order), ``rank_tiles(plan, rank)`` (allgather).

``plan_for(name, mask, cp_size)`` builds the plan layout each strategy is meant for (ring: zigzag for
causal-like masks, contiguous when it is as balanced; ulysses contiguous; allgather the planner's
``auto`` layout; head_context ``planner.head_context_plan``: each group's tokens are what a cp/u-rank
plan gives it, cut into u equal pieces).
"""

from __future__ import annotations

from ..planner import Plan, head_context_plan
from ..planner import plan as make_plan
from .allgather import allgather, rank_tiles
from .head_context import head_context, head_context_groups
from .common import mask_tiles
from .ring import ring, ring_tiles
from .ulysses import ulysses, usp

STRATEGIES = {"ring": ring, "ulysses": ulysses, "usp": usp, "allgather": allgather, "head_context": head_context}
# every context-parallel strategy by name: megatron-cp's planned attention (``megatron_cp.attention``) and the
# baselines; the one list the Megatron flag --context-parallel-impl and the tools read
OWN = "megatron_cp"
STRATEGY_NAMES = (OWN, *STRATEGIES)


def get_strategy(name: str, **options):
    """The strategy function called ``name`` (a key of ``STRATEGIES``); options (e.g. ``ulysses_degree`` for usp /
    head_context, ``backend``, ``lse_grad``) are bound as keyword arguments."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown context-parallel strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    fn = STRATEGIES[name]
    if not options:
        return fn

    def bound(q, k, v, plan, group=None, softmax_scale=None):
        return fn(q, k, v, plan, group, softmax_scale, **options)

    bound.__name__ = bound.__qualname__ = f"{name}_strategy"
    bound.__doc__ = fn.__doc__
    return bound


def plan_for(name: str, mask, cp_size: int, **plan_kwargs) -> Plan:
    """The plan layout strategy ``name`` is meant for: ring/usp use zigzag (balanced causal) unless
    the contiguous layout is as balanced (full, windows); ulysses contiguous; allgather ``auto``;
    head_context ``planner.head_context_plan`` (keyword ``ulysses_degree``, default the topology's
    GPUs per node, else cp; ``solver`` etc. go to its group-level plan). No guest rows (queries
    computed by their keys' owners are megatron-cp's, not the baselines')."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown context-parallel strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    if name == "head_context":
        u = plan_kwargs.pop("ulysses_degree", None)
        return head_context_plan(mask, cp_size, u, **plan_kwargs)
    plan_kwargs.setdefault("guest_rows", "none")
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


__all__ = ["get_strategy", "plan_for", "STRATEGIES", "STRATEGY_NAMES", "OWN", "ring", "ulysses", "usp", "allgather",
           "head_context"]
# shared with the layer above and the tools, not the user API: the groups head_context makes, and the tiles each
# strategy's kernel calls compute (for cost models and benchmarks)
__shared__ = ["head_context_groups", "rank_tiles", "ring_tiles", "mask_tiles"]
