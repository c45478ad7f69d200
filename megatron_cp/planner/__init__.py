"""Planner: a pure function from (mask, cp_size, topology) to a per-rank plan (numpy, scipy only)."""

from .layout import default_degree, group_order, group_plan, head_context_degree, head_context_plan, kv_head_repeat
from .milp import ChunkOptimum, in_feasible_set, optimal_assignment
from .plan import Plan, RankPlan, plan, plan_groups, plan_like
from .solvers import SOLVERS
from .topology import LINKS, Links, Topology
from .workload import Workload

# the user API: plans, their topology and workload, the solvers and the exact chunk assignment to compare them with
__all__ = ["Plan", "RankPlan", "plan", "plan_like", "plan_groups", "Topology", "Links", "LINKS", "Workload", "SOLVERS",
           "optimal_assignment", "in_feasible_set", "ChunkOptimum"]
# shared with the layers above, not the user API: the group plans and head layouts of the Ulysses-style baselines
__shared__ = ["head_context_plan", "group_plan", "kv_head_repeat", "group_order", "default_degree",
              "head_context_degree"]
