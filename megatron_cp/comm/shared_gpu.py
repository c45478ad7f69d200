"""Ranks sharing a GPU: several processes on one device, every collective through host copies over gloo.

NCCL refuses two ranks on one GPU, so a CP configuration (mask, layout, kernels, Megatron flags) cannot be checked
with NCCL where there are fewer GPUs than ranks. Gloo can carry the traffic, but it serves CUDA tensors for only
some collectives and dtypes. ``SharedGPUGroup`` is a process group (backend name ``BACKEND``) that runs every
collective on an inner gloo group: CUDA tensors are copied to the host on the caller's stream, moved there and
copied back. 16-bit data moves travel as bytes; 16-bit reductions add in float32 on the host and round once (NCCL
adds in the tensor's dtype: the sums can differ in the last bit); reduce-scatter is an all-reduce of which each rank
keeps its part. Everything but point-to-point receives completes before the call returns.

This mode is for correctness only: gloo over host copies and ranks taking turns on one GPU make every time
meaningless, and the timing tools refuse it (``refuse_timing``).

    # local_rank, local_world: the launcher's (torchrun: LOCAL_RANK, LOCAL_WORLD_SIZE); this module reads no environment
    device = shared_gpu.rank_device(local_rank, local_world, share_gpu=True)   # cuda:(local_rank % GPUs)
    torch.cuda.set_device(device)
    dist.init_process_group(shared_gpu.backend_for(device, share_gpu=True))    # "gloo_shared_gpu"
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

BACKEND = "gloo_shared_gpu"
_SIXTEEN = (torch.bfloat16, torch.float16)


def rank_device(local_rank: int, local_world: int, share_gpu: bool = False) -> torch.device:
    """The GPU of local rank ``local_rank`` of ``local_world`` ranks on this host: its own
    (``cuda:local_rank``), or with ``share_gpu`` ``cuda:(local_rank % GPUs)`` (ranks spread evenly over the visible
    GPUs). Raises ValueError, before any process group exists, where there is no GPU or where ranks outnumber GPUs
    and ``share_gpu`` is off."""
    n = torch.cuda.device_count()
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} is outside the {local_world} ranks of this host")
    if n == 0:
        raise ValueError(f"local rank {local_rank} needs a GPU and none is visible (CPU ranks run on gloo)")
    if share_gpu:
        return torch.device("cuda", local_rank % n)
    if local_world > n:
        raise ValueError(f"{local_world} ranks on this host but {n} GPU(s) visible: NCCL needs a GPU per rank; "
                         "to check a configuration with ranks sharing a GPU, ask for it (share_gpu=True, --share-gpu)")
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device | str, share_gpu: bool = False) -> str:
    """The process group backend for ranks on ``device``: gloo on CPU, NCCL on a GPU of their own, ``BACKEND``
    (gloo through host copies) for ranks that share a GPU."""
    if torch.device(device).type == "cpu":
        return "gloo"
    return BACKEND if share_gpu else "nccl"


def ranks_share_gpu(group=None) -> bool:
    """Whether ``group`` (default: the world) runs in this mode."""
    return dist.is_initialized() and dist.get_backend(group) == BACKEND


def refuse_timing(tool: str, group=None) -> None:
    """Raise where ranks share a GPU: ``tool`` times, and times in this mode mean nothing."""
    if ranks_share_gpu(group):
        raise RuntimeError(f"{tool} measures time, and ranks sharing a GPU ({BACKEND}: gloo through host copies, "
                           "ranks taking turns on one device) give times that mean nothing; run it with a GPU per "
                           "rank (NCCL)")


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host (itself where it is there already), contiguous."""
    return t.contiguous() if t.device.type == "cpu" else t.detach().to("cpu").contiguous()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A host tensor as gloo moves it: 16-bit dtypes as their bytes (a view)."""
    return t.view(torch.uint8) if t.dtype in _SIXTEEN else t


def _summable(t: torch.Tensor) -> torch.Tensor:
    """A host tensor as gloo reduces it: 16-bit dtypes in float32."""
    return t.float() if t.dtype in _SIXTEEN else t


@torch.no_grad()  # a received buffer may require grad (Megatron's pipeline receives do)
def _back(dst: torch.Tensor, host: torch.Tensor) -> None:
    """The result ``host`` into the caller's ``dst`` (wherever it lives), unless it is ``dst`` itself."""
    if host.data_ptr() != dst.data_ptr() or host.device != dst.device or host.dtype != dst.dtype:
        dst.copy_(host.reshape(dst.shape))


def _done(result=None) -> dist.Work:
    fut = torch.futures.Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


_Work = getattr(dist, "Work", None) or dist._Work


class _RecvWork(_Work):
    """A point-to-point receive in flight: waits for gloo's receive into the host buffer, then copies it out."""

    def __init__(self, inner, host, dst):
        super().__init__()
        self._inner, self._host, self._dst, self._copied = inner, host, dst, False

    def wait(self, timeout=None):
        self._inner.wait()
        if not self._copied:
            _back(self._dst, self._host)
            self._copied = True
        return True

    def is_completed(self):
        return self._copied

    def is_success(self):
        return self._copied

    def source_rank(self):
        return self._inner.source_rank()

    def get_future(self):
        self.wait()
        return _done([self._dst]).get_future()


class _Uncoalesced:
    """The inner gloo backend as torch's front sees it, saying it does not coalesce: batched point-to-point ops
    then go one by one through this group's send / recv (whose receives copy out when waited on)."""

    supports_coalescing = False

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


class SharedGPUGroup(dist.ProcessGroup):
    """A process group whose collectives run on a gloo group of the same ranks through host copies (module
    docstring). Made by ``init_process_group(BACKEND)`` and by ``new_group`` under it."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        # the group's name lives on its backends: the inner gloo group serves as the CPU one (CUDA tensors have
        # none, so whatever reaches this group from C++ rather than through the methods below fails loudly)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)

    def getBackendName(self) -> str:
        return BACKEND

    def _get_backend(self, device):  # what torch asks a group's backend, e.g. whether it batches p2p ops: no
        return _Uncoalesced(self._gloo)

    # ----------------------------------------------------------------------------------- data moves
    def broadcast(self, tensors, opts):
        for t in tensors:
            h = _host(t)
            o = dist.BroadcastOptions()
            o.rootRank, o.rootTensor = opts.rootRank, 0
            self._gloo.broadcast([_bytes(h)], o).wait()
            _back(t, h)
        return _done(tensors)

    def allgather(self, outputs, inputs, opts=None):
        for outs, x in zip(outputs, inputs):
            hx, hs = _host(x), [_host(o) for o in outs]
            self._gloo.allgather([[_bytes(h) for h in hs]], [_bytes(hx)]).wait()
            for o, h in zip(outs, hs):
                _back(o, h)
        return _done(outputs)

    def _allgather_base(self, output, input, opts=None):
        hx, ho = _host(input), _host(output)
        self._gloo.allgather([[_bytes(p) for p in ho.chunk(self.size())]], [_bytes(hx)]).wait()
        _back(output, ho)
        return _done([output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, x in zip(outputs, inputs):
            self._allgather_base(o, x)
        return _done(outputs)

    def _rooted(self, one, many, options, root, call):
        """Gather or scatter through host copies: ``one`` the tensor every rank has, ``many`` the root's list (empty
        elsewhere), ``call(one, many, options)`` gloo's op on their host copies as bytes. Returns the host copies
        (one, many) for the caller to copy back the side it received."""
        h, hs = _host(one), [_host(t) for t in many]
        options.rootRank = root
        call([_bytes(h)], [[_bytes(x) for x in hs]] if hs else [], options).wait()
        return h, hs

    def gather(self, outputs, inputs, opts):
        received = outputs[0] if outputs else []
        _, hs = self._rooted(inputs[0], received, dist.GatherOptions(), opts.rootRank,
                             lambda one, many, o: self._gloo.gather(many, one, o))
        for dst, h in zip(received, hs):
            _back(dst, h)
        return _done(outputs)

    def scatter(self, outputs, inputs, opts):
        h, _ = self._rooted(outputs[0], inputs[0] if inputs else [], dist.ScatterOptions(), opts.rootRank,
                            self._gloo.scatter)
        _back(outputs[0], h)
        return _done(outputs)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        hx, ho = _host(input), _host(output)
        self._gloo.alltoall_base(_bytes(ho), _bytes(hx), list(output_split_sizes), list(input_split_sizes),
                                 dist.AllToAllOptions()).wait()
        _back(output, ho)
        return _done([output])

    def alltoall(self, outputs, inputs, opts=None):
        hx, ho = [_host(x) for x in inputs], [_host(o) for o in outputs]
        sizes_in, sizes_out = [h.shape[0] for h in hx], [h.shape[0] for h in ho]
        flat_in = torch.cat([h.reshape(h.shape[0], -1) for h in hx]) if hx else None
        flat_out = torch.cat([h.reshape(h.shape[0], -1) for h in ho])
        self._gloo.alltoall_base(_bytes(flat_out), _bytes(flat_in), sizes_out, sizes_in,
                                 dist.AllToAllOptions()).wait()
        for o, part in zip(outputs, flat_out.split(sizes_out)):
            _back(o, part)
        return _done(outputs)

    def send(self, tensors, dst, tag):
        h = _host(tensors[0])
        return self._gloo.send([_bytes(h)], dst, tag)  # its work keeps the host copy alive until sent

    def recv(self, tensors, src, tag):
        t = tensors[0]
        h = torch.empty(t.shape, dtype=t.dtype)
        return _RecvWork(self._gloo.recv([_bytes(h)], src, tag), h, t)

    def recv_anysource(self, tensors, tag):
        t = tensors[0]
        h = torch.empty(t.shape, dtype=t.dtype)
        return _RecvWork(self._gloo.recv_anysource([_bytes(h)], tag), h, t)

    def barrier(self, opts=None):
        self._gloo.barrier(dist.BarrierOptions()).wait()
        return _done()

    # ----------------------------------------------------------------------------------- reductions
    def _reduced(self, t, op):
        h = _summable(_host(t))
        o = dist.AllreduceOptions()
        o.reduceOp = op
        self._gloo.allreduce([h], o).wait()
        return h

    def allreduce(self, tensors, opts):
        for t in tensors:
            _back(t, self._reduced(t, opts.reduceOp))
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts):
        for t in tensors:
            _back(t, self._reduced(t, opts.reduceOp))
        return _done(tensors)

    def reduce(self, tensors, opts):  # an all-reduce; only the root's result is defined, and it is this one
        for t in tensors:
            h = self._reduced(t, opts.reduceOp)
            if self.rank() == opts.rootRank:
                _back(t, h)
        return _done(tensors)

    def reduce_scatter(self, outputs, inputs, opts):
        for y, xs in zip(outputs, inputs):
            _back(y, self._reduced(torch.stack([_host(x) for x in xs]), opts.reduceOp)[self.rank()])
        return _done(outputs)

    def _reduce_scatter_base(self, output, input, opts):
        part = self._reduced(input, opts.reduceOp).chunk(self.size())[self.rank()]
        _back(output, part)
        return _done([output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        for y, x in zip(outputs, inputs):
            self._reduce_scatter_base(y, x, opts)
        return _done(outputs)


    # the names torch's Python front calls these by in later versions
    all_gather_single, all_gather_single_coalesced = _allgather_base, allgather_into_tensor_coalesced
    all_to_all_single, allgather_coalesced = alltoall_base, allgather
    reduce_scatter_single, reduce_scatter_single_coalesced = _reduce_scatter_base, reduce_scatter_tensor_coalesced


def _create(opts, _options):
    group = SharedGPUGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    # torch names the groups it makes, but hands a Python group back before naming it: destroying or looking up
    # the group needs the name
    group._set_group_name(opts.group_id)
    return group


if BACKEND.upper() not in getattr(dist.Backend, "_plugins", {}):
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
