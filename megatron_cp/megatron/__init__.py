"""megatron-cp as a Megatron-Core plugin.

    --context-parallel-impl megatron_cp      (arguments.add_megatron_cp_args, via extra_args_provider)
    layer spec:  specs.get_llama_layer_spec  (core_attention = CPCoreAttention)
    batch hook:  batch.prepare_batch         (replaces get_batch_on_this_cp_rank; returns CPParams)
    RoPE:        rope.install(model)         (RoPE at the dispatched positions, any device)
    loss:        loss.loss_func              (exact with uneven token counts per CP rank)

Only this sub-package imports megatron.
"""

from .batch import CPBatch, MaskSpec, PlanOptions, prepare_batch
from .core_attention import CPCoreAttention
from .loss import loss_func
from .params import CPParams
from .rope import PlanRotaryEmbedding, install
from .specs import get_llama_layer_spec

__all__ = [
    "CPBatch", "CPCoreAttention", "CPParams", "MaskSpec", "PlanOptions", "PlanRotaryEmbedding",
    "get_llama_layer_spec", "install", "loss_func", "prepare_batch",
]
