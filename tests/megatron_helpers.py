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

from tiny_llama.cpu import cuda_to_cpu_shim  # noqa: E402,F401  (the tests' names for them)
from tiny_llama.model import full_param_name, tp_gather  # noqa: E402,F401


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


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||b||, tiny): the error relative to the reference's size."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


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


def reference_for(mask: str, shape, build, *, weight_seed: int, batch_seed: int, steps: int, G: int, S: int,
                  lr: float, micro_batch_size: int):
    """A parity test's start: the mask's spec, ``steps`` global batches and the TP = CP = PP = 1 reference run
    (``reference_run``) of ``build(shape)`` from ``weight_seed``. Returns (spec, batches, reference_run's
    four results)."""
    from megatron_cp.megatron.batch import MaskSpec
    from tiny_llama import trainer

    spec = MaskSpec(mask, eod=EOD if mask == "packed" else None)
    batches = [make_global_batch(G, S, seed=batch_seed + i, packed=mask == "packed") for i in range(steps)]
    trainer.init_parallel(1, 1)
    torch.manual_seed(weight_seed)
    ref = build(shape)
    return spec, batches, reference_run(ref, batches, spec, lr, micro_batch_size)
