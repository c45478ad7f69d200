"""Layer specs with ``core_attention=CPCoreAttention``.

We take Megatron's own GPT layer spec (local or Transformer Engine backend) and replace only the
``core_attention`` slot of ``SelfAttentionSubmodules``; everything else (RMSNorm, SwiGLU MLP, GQA
projections) stays Megatron's. Usable from ``--spec megatron_cp.megatron.specs get_llama_layer_spec``.
"""

from __future__ import annotations

import dataclasses

from megatron.core.transformer.spec_utils import ModuleSpec

from .core_attention import CPCoreAttention


def _swap_core_attention(spec: ModuleSpec) -> ModuleSpec:
    attn = spec.submodules.self_attention
    sub = dataclasses.replace(attn.submodules, core_attention=CPCoreAttention)
    attn = dataclasses.replace(attn, submodules=sub)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))


def get_llama_layer_spec(backend: str = "auto", qk_layernorm: bool = False,
                         normalization: str = "RMSNorm") -> ModuleSpec:
    """Transformer layer spec for Llama (RMSNorm, SwiGLU, GQA, RoPE) with megatron-cp attention.

    backend: "local" (Megatron-Core modules only, runs on CPU), "te" (Transformer Engine linears
    and norms) or "auto" (te when transformer_engine imports, else local). SwiGLU and GQA come from
    the TransformerConfig (``gated_linear_unit``, ``activation_func``, ``num_query_groups``).
    """
    if backend not in ("auto", "local", "te"):
        raise ValueError(f"backend must be 'auto', 'local' or 'te', got {backend!r}")
    if backend == "auto":
        from megatron.core.extensions.transformer_engine import HAVE_TE

        backend = "te" if HAVE_TE else "local"
    from megatron.core.models.gpt import gpt_layer_specs as g

    if backend == "te":
        spec = g.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    else:
        spec = g.get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    return _swap_core_attention(spec)


def megatron_cp_layer_spec(config=None, vp_stage: int | None = None) -> ModuleSpec:
    """The ``--spec megatron_cp.megatron.specs megatron_cp_layer_spec`` entry point.

    Megatron's GPT builder calls a callable spec with its ``GPTModelConfig`` (``megatron/training/
    models/gpt.py``); we read the backend (``transformer_impl``) and ``qk_layernorm`` from it and
    return Megatron's layer spec with ``core_attention=CPCoreAttention``.
    """
    tcfg = getattr(config, "transformer", config)
    impl = getattr(tcfg, "transformer_impl", "local") if tcfg is not None else "local"
    backend = "te" if impl == "transformer_engine" else "local"
    return get_llama_layer_spec(backend, qk_layernorm=bool(getattr(tcfg, "qk_layernorm", False)),
                                normalization=getattr(tcfg, "normalization", "RMSNorm") or "RMSNorm")
