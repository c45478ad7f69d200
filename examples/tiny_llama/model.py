"""Build a Llama-style ``GPTModel`` with megatron-cp attention (used by the demo and the Megatron tests).

Llama = RMSNorm, SwiGLU (gated linear unit with SiLU), RoPE, GQA, no biases, untied embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_cp.megatron import get_llama_layer_spec, rope


@dataclass(frozen=True)
class LlamaShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    rotary_base: int = 10000

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} not divisible by heads={self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_query_groups={self.num_query_groups} must divide num_attention_heads={self.num_attention_heads}"
            )


TINY = LlamaShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=176, vocab_size=320, seq_length=256)


def transformer_config(shape: LlamaShape, dtype=torch.float32, cpu_init: bool = True, **overrides):
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=cpu_init, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, calculate_per_token_loss=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_llama(shape: LlamaShape, config=None, backend: str = "local", pre_process=True, post_process=True):
    """GPTModel with ``get_llama_layer_spec`` and megatron-cp RoPE installed (``rope.install``)."""
    from megatron.core.models.gpt import GPTModel

    config = config or transformer_config(shape)
    model = GPTModel(
        config, get_llama_layer_spec(backend), vocab_size=shape.vocab_size,
        max_sequence_length=shape.seq_length, pre_process=pre_process, post_process=post_process,
        position_embedding_type="rope", rotary_base=shape.rotary_base,
        share_embeddings_and_output_weights=False,
    )
    model._megatron_cp_rope = rope.install(model)
    return model
