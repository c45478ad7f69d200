"""Head gating (DuoAttention, PruLong): per KV head, full attention or a streaming window (sinks + recent keys).

``gates``: the learned gates (``DuoGates``, ``HardConcreteGates`` with ``LagrangianSparsity``), ``discretize`` and
the head pattern file (``save_pattern`` / ``load_pattern``); pure torch. ``attention``: the gated mixture for
training (``gated_attention``) and the discretised pattern (``pattern_attention``) on the CP runtime, over a full
and a streaming plan sharing one token layout (``streaming_plans``). docs/sparse.md has the figures.
"""

from .attention import gated_attention, pattern_attention, streaming_plans
from .gates import (LOG_ALPHA_MEAN, DuoGates, HardConcreteGates, LagrangianSparsity, discretize, load_pattern,
                    pattern_sparsity, save_pattern)

# how the gates are learned, by name: DuoAttention's gates in [0, 1] (distillation + L1) or PruLong's hard-concrete
# L0 gates with a Lagrangian sparsity target; the one list --cp-head-gating and the examples read
METHODS = {"duo": DuoGates, "prulong": HardConcreteGates}

__all__ = ["METHODS", "gated_attention", "pattern_attention", "streaming_plans", "DuoGates", "HardConcreteGates",
           "LagrangianSparsity", "discretize", "save_pattern", "load_pattern", "pattern_sparsity", "LOG_ALPHA_MEAN",
           "gates", "attention"]
__shared__ = []  # the adapter above uses the user API only
