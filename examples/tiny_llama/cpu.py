"""Megatron-Core's tensor-parallel mappings and pipeline schedules on a CPU-only torch (gloo)."""

from __future__ import annotations

import torch


def cuda_to_cpu_shim(schedules: bool = False) -> None:
    """In a spawned CPU worker (the tests; the recipes' CPU runs of sequence and pipeline parallelism):
    Megatron allocates the buffers of its sequence-parallel mappings and pipeline p2p on
    ``torch.cuda.current_device()`` and synchronises with ``torch.cuda.synchronize()``; its embedding dropout (under SP) and activation recompute save and fork
    CUDA RNG states. On a CPU-only torch the tensors go to the CPU (gloo moves CPU tensors) and the CUDA
    RNG state is a stand-in (the models have no dropout). ``schedules``: also create ``device="cuda"``
    tensors on the CPU (the pipeline schedules' token counters; this costs every torch call a Python hook,
    so only pipeline runs ask for it). Changes this process only; call once per worker.
    """
    from megatron.core.tensor_parallel import random as mrandom
    from torch.overrides import TorchFunctionMode

    class _CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type == "cuda":
                kwargs = dict(kwargs, device="cpu")
            return func(*args, **kwargs)

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    mrandom.get_cuda_rng_tracker().set_states({mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME: torch.get_rng_state()})
    if schedules:
        _CudaToCpu().__enter__()
