"""Communication primitives over torch.distributed (no planner, kernel or Megatron imports)."""

from . import loopback, shared_gpu
from .collectives import all_gather_rows, all_gather_single, all_to_all_v, check_same_on_all_ranks, wire
from .routes import (COMM_LEAD_US, BufferPool, DeviceRoute, RouteIndex, cast_steps, column_blocks, comm_lead,
                     device_pool, grad_buffer, reduce_steps)

# the user API: process groups for ranks sharing GPUs (shared_gpu) and with no peer at all (loopback)
__all__ = ["loopback", "shared_gpu"]
# shared with the layers above, not the user API: the collectives and the K/V routes the runtime and baselines run
__shared__ = [
    "all_gather_rows", "all_gather_single", "all_to_all_v", "check_same_on_all_ranks", "wire",
    "BufferPool", "DeviceRoute", "RouteIndex", "cast_steps", "column_blocks", "COMM_LEAD_US", "comm_lead", "device_pool",
    "grad_buffer", "reduce_steps",
]
