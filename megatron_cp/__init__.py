"""megatron-cp: context-parallel attention for any mask, as a Megatron-Core plugin.

    import megatron_cp as mcp
    mask = mcp.masks.varlen(cu_seqlens, causal=True)
    plan = mcp.plan(mask, cp_size)
    q_local = mcp.dispatch(q, plan, group)
    out, lse = mcp.attention(q_local, k_local, v_local, plan, group)
"""

from . import gating, masks, sparse
from .masks import AttnMask, AttnSlice
from .planner import Plan, Topology, plan
from .runtime import apply_sink, attention, dispatch, gather_global_batch, undispatch

__version__ = "0.1.0"
__all__ = ["masks", "sparse", "gating", "AttnMask", "AttnSlice", "Plan", "Topology", "plan", "attention", "apply_sink",
           "dispatch", "undispatch", "gather_global_batch"]
