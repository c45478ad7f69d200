"""Communication primitives over torch.distributed (no planner, kernel or Megatron imports)."""

from .collectives import all_gather_v, all_to_all_v, check_same_on_all_ranks, group_cast, group_reduce
from .routes import COMM_LEAD_US, BufferPool, DeviceRoute, cast_steps, comm_lead, drain, grad_buffer, reduce_steps

__all__ = [
    "all_gather_v", "all_to_all_v", "group_cast", "group_reduce", "check_same_on_all_ranks",
    "BufferPool", "DeviceRoute", "cast_steps", "COMM_LEAD_US", "comm_lead", "grad_buffer", "reduce_steps", "drain",
]
