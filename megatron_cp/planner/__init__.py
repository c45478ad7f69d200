"""Planner: a pure function from (mask, cp_size, topology) to a per-rank plan (numpy, scipy only)."""

from .layout import LayoutChoice, LayoutPrediction, choose_layout, head_context_plan
from .plan import Plan, RankPlan, plan
from .solvers import SOLVERS
from .topology import Topology

__all__ = ["Plan", "RankPlan", "plan", "Topology", "SOLVERS", "choose_layout", "LayoutChoice", "LayoutPrediction",
           "head_context_plan"]
