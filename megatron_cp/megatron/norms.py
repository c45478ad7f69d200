"""Megatron's torch norm, made to run under sequence parallelism.

Megatron-Core's local layer spec takes torch's norm (``WrappedTorchNorm``) when neither Transformer Engine nor
Apex is installed, and that norm refuses ``--sequence-parallel`` when the model is built. The norm itself is per
token, so it runs unchanged on a rank's shard of the sequence; what sequence parallelism needs from it is that
its parameters say so (``param.sequence_parallel``), which makes Megatron all-reduce their gradients over the
tensor-parallel ranks, whose shards hold different tokens. Transformer Engine's and Apex's norms do the same.
"""

from __future__ import annotations

import torch


class SequenceParallelTorchNorm:
    """``WrappedTorchNorm``'s module (``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` by ``config.normalization``,
    the same parameter names) with its parameters marked ``sequence_parallel`` as the config says; the other
    options ``WrappedTorchNorm`` refuses are refused here too."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, flag, False):
                raise ValueError(f"{flag} is not supported by torch's norm (Megatron's local modules without Apex or "
                                 "Transformer Engine)")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"normalization {config.normalization!r}: torch's norm does LayerNorm and RMSNorm")
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm
