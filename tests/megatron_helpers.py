"""Shared helpers for the tests/test_megatron_*.py files (CPU, gloo, spawned processes).

Importing this module puts ``examples/`` on ``sys.path``, so the tests can use the example model and
training loop as ``tiny_llama.model`` / ``tiny_llama.trainer`` (examples are not installed with the
package; spawned workers inherit the path).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

EOD = 256


def make_global_batch(G: int, S: int, seed: int, packed: bool, vocab: int = 250):
    """Random tokens [G, S] (+ shifted labels); packed batches get EOD tokens at random places."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab, (G, S + 1), generator=g)
    if packed:
        for row in stream:
            n = int(torch.randint(1, 4, (1,), generator=g))
            where = torch.randint(0, S, (n,), generator=g)
            row[where] = EOD
    tokens, labels = stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
    loss_mask = torch.ones(G, S)
    loss_mask[:, -3:] = 0.0  # some masked tokens, so counts differ per rank
    return tokens, labels, loss_mask


def tp_shard(name: str, full: torch.Tensor, param, tp_rank: int, tp_size: int, glu: bool):
    """The TP shard of a full (TP=1) tensor for the parameter ``param`` of a TP model."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if glu and name.endswith("mlp.linear_fc1.weight"):
        # Megatron's SwiGLU: each TP rank holds [gate_r; up_r] of its slice of the FFN
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], 0)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def tp_gather(name: str, local: torch.Tensor, param, tp_group, glu: bool):
    """Inverse of ``tp_shard``: the full tensor from every TP rank's shard."""
    import torch.distributed as dist

    tp_size = dist.get_world_size(tp_group)
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return local
    parts = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(parts, local.contiguous(), group=tp_group)
    if glu and name.endswith("mlp.linear_fc1.weight"):
        gates = [p.chunk(2, 0)[0] for p in parts]
        ups = [p.chunk(2, 0)[1] for p in parts]
        return torch.cat(gates + ups, 0)
    return torch.cat(parts, dim=param.partition_dim)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||b||, tiny): the error relative to the reference's size."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def cuda_to_cpu_shim(schedules: bool = False) -> None:
    """Test-only, in a spawned CPU worker: Megatron allocates the buffers of its sequence-parallel
    mappings and pipeline p2p on ``torch.cuda.current_device()`` and synchronises with
    ``torch.cuda.synchronize()``; its embedding dropout (under SP) and activation recompute save and fork
    CUDA RNG states. On a CPU-only torch the tensors go to the CPU (gloo moves CPU tensors) and the CUDA
    RNG state is a stand-in (the models have no dropout). ``schedules``: also create ``device="cuda"``
    tensors on the CPU (the pipeline schedules' token counters; this costs every torch call a Python hook,
    so only the pipeline tests ask for it). Changes this process only; call once per worker.
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


class CPUBuffer:
    """Stands in for Megatron's global memory buffer (CUDA) on CPU: a fresh tensor per request."""

    def get_tensor(self, shape, dtype, name):
        return torch.empty(shape, dtype=dtype)


class NoRNG:
    """Stands in for Megatron's CUDA RNG tracker on CPU: ``fork()`` changes nothing (no dropout here)."""

    def fork(self, *a, **k):
        import contextlib

        return contextlib.nullcontext()


def reference_run(model, batches, spec, lr: float, micro_batch_size: int):
    """The CP = 1 / TP = 1 / PP = 1 reference: one AdamW step per global batch of ``batches`` on ``model``
    (all of it on this rank, no DP reduction; gradients divided by the token count as Megatron's per-token
    loss does). Returns (initial weights, per-step losses, step-0 gradients, final weights), each a
    {name: tensor} copy (losses a list of floats)."""
    from tiny_llama import trainer

    named = dict(model.named_parameters())
    w0 = {k: p.detach().clone() for k, p in named.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses, g0 = [], None
    for step, batch in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        s, n = trainer.forward_backward(model, trainer.dp_shard(batch, 0, 1, micro_batch_size), spec)
        for p in model.parameters():
            p.grad.div_(float(n))
        if step == 0:
            g0 = {k: p.grad.detach().clone() for k, p in named.items()}
        opt.step()
        losses.append(float(s) / float(n))
    return w0, losses, g0, {k: p.detach().clone() for k, p in named.items()}
