"""One rank of a plan run alone: a process group whose collectives return at once and move nothing.

What a one-rank profile of the host path needs (tools/host_path.py): rank r of a cp N plan runs its input checks,
state, index copies, exchange calls and kernels exactly as in a job of N ranks, in one process on one GPU, with no
peer to wait for. Received rows are whatever the buffers held. torch's own ``fake`` backend does the same but
checks its arguments differently across versions (some refuse an all-to-all whose send side is empty).

    dist.init_process_group(loopback.BACKEND, store=dist.HashStore(), rank=r, world_size=N)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

BACKEND = "loopback"


def _done(result=None) -> dist.Work:
    fut = torch.futures.Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


class _NoCoalescing:
    supports_coalescing = False  # batched point-to-point ops then go one by one through the group's methods


class LoopbackGroup(dist.ProcessGroup):
    """Every collective and point-to-point op completes at once without moving data."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._name = ""

    def getBackendName(self) -> str:
        return BACKEND

    def _get_backend(self, device):
        return _NoCoalescing()

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def _nothing(self, *args, **kwargs):
        return _done()

    broadcast = allgather = _allgather_base = allgather_into_tensor_coalesced = gather = scatter = _nothing
    alltoall_base = alltoall = send = recv = recv_anysource = barrier = _nothing
    allreduce = allreduce_coalesced = reduce = reduce_scatter = _reduce_scatter_base = _nothing
    reduce_scatter_tensor_coalesced = _nothing
    # the names torch's Python front calls these by in later versions
    all_gather_single = all_gather_single_coalesced = all_to_all_single = allgather_coalesced = _nothing
    reduce_scatter_single = reduce_scatter_single_coalesced = _nothing


def _create(opts, _options):
    group = LoopbackGroup(opts.group_rank, opts.group_size)
    group._set_group_name(opts.group_id)
    return group


if BACKEND.upper() not in getattr(dist.Backend, "_plugins", {}):
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
