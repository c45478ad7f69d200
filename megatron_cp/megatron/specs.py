"""Layer specs with ``core_attention=CPCoreAttention``.

``megatron_cp_layer_spec`` (the ``--spec megatron_cp.megatron.specs megatron_cp_layer_spec`` entry point)
asks Megatron for the spec of the user's configuration - ``megatron.training.models.gpt.default_layer_spec``,
the function ``GPTModelBuilder`` calls when no ``--spec`` is given: MoE block specs, qk-layernorm,
Transformer Engine or local modules, heterogeneous layers - and replaces only the ``core_attention``
slot of every layer's self-attention. Nothing else of the model changes: an MoE model keeps its
``MoELayer``s, a dense one its MLP, and the parameter count equals Megatron's own spec's.

``get_llama_layer_spec`` is the same swap over Megatron's plain dense GPT layer (no config needed), used by
the tiny examples. Under ``--sequence-parallel`` on Megatron's local modules without Apex, the spec also takes
``norms.SequenceParallelTorchNorm`` for Megatron's torch norm, which refuses sequence parallelism
(``sequence_parallel_norms``).
"""

from __future__ import annotations

import dataclasses

from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from .core_attention import CPCoreAttention
from .options import LayerOptions


@dataclasses.dataclass
class BoundCoreAttention(ModuleSpec):
    """``CPCoreAttention`` with the run-wide values bound (``params={"options": LayerOptions}``): a ``ModuleSpec``
    for Megatron's ``build_module`` (MLA builds its core attention so) that is also callable as a class, the way
    ``SelfAttention`` builds its own (``submodules.core_attention(config=..., ...)``)."""

    def __call__(self, *args, **kwargs):
        return build_module(self, *args, **kwargs)


def bound_core_attention(options: LayerOptions | None = None) -> BoundCoreAttention:
    """The core attention slot of a layer spec: ``CPCoreAttention`` bound to ``options`` (None: the options of
    Megatron's parsed megatron-cp flags where Megatron has parsed them, else ``LayerOptions()``)."""
    if options is None:
        options = _options_from_args()
    if not isinstance(options, LayerOptions):
        raise ValueError(f"the layer spec's options must be a LayerOptions (PlanOptions(...).layer), got "
                         f"{type(options).__name__}")
    return BoundCoreAttention(module=CPCoreAttention, params={"options": options})


def _options_from_args() -> LayerOptions:
    """The run's ``LayerOptions`` from Megatron's parsed arguments (the plugin's flags), or the defaults where no
    arguments were parsed (a model built by hand)."""
    try:
        from megatron.training.global_vars import get_args

        args = get_args()
    except (ImportError, AssertionError):
        return LayerOptions()
    from .arguments import OURS

    if args is None or getattr(args, "context_parallel_impl", None) not in OURS:
        return LayerOptions()
    from .plugin import plan_specs

    return plan_specs(args, eod=0)[1].layer


def _replaceable():
    """The core attentions our attention may stand in for (same inputs, same math, no parameters)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    kinds = [DotProductAttention]
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE, TEDotProductAttention

        if HAVE_TE:
            kinds.append(TEDotProductAttention)
    except ImportError:
        pass
    return tuple(kinds)


def _swap_layer(spec: ModuleSpec, kinds, bound: BoundCoreAttention) -> tuple[ModuleSpec, int]:
    """One transformer layer spec with its self-attention's core attention swapped -> (spec, 1), or
    (spec, 0) when the layer has no self-attention (heterogeneous no-op layers)."""
    sub = getattr(spec, "submodules", None)
    attn = getattr(sub, "self_attention", None)
    attn_sub = getattr(attn, "submodules", None)
    if attn_sub is None or not hasattr(attn_sub, "core_attention"):
        return spec, 0
    core = attn_sub.core_attention
    core_cls = core.module if isinstance(core, ModuleSpec) else core
    if not (isinstance(core_cls, type) and issubclass(core_cls, (CPCoreAttention, *kinds))):
        raise ValueError(f"the layer spec's core attention is {getattr(core_cls, '__name__', core_cls)!r}; megatron-cp "
                         f"replaces only {', '.join(k.__name__ for k in kinds)}")
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn_sub, core_attention=bound))
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, self_attention=attn)), 1


def swap_core_attention(spec, options: LayerOptions | None = None):
    """A copy of a layer spec (``ModuleSpec`` of a ``TransformerLayer``) or block spec
    (``TransformerBlockSubmodules``) whose self-attention core attention is ``CPCoreAttention`` bound to
    ``options`` (``bound_core_attention``; one already ours is bound anew); every other submodule is Megatron's,
    untouched (the input spec is not mutated)."""
    kinds, bound = _replaceable(), bound_core_attention(options)
    if hasattr(spec, "layer_specs"):
        layers = [_swap_layer(s, kinds, bound) for s in spec.layer_specs]
        if spec.layer_specs and not sum(n for _, n in layers):
            raise ValueError("no layer of the block spec has a self-attention core attention to replace")
        return dataclasses.replace(spec, layer_specs=[s for s, _ in layers])
    out, n = _swap_layer(spec, kinds, bound)
    if not n:
        raise ValueError(f"the layer spec {spec!r} has no self-attention core attention to replace")
    return out


def get_llama_layer_spec(backend: str = "auto", qk_layernorm: bool = False,
                         normalization: str = "RMSNorm", options: LayerOptions | None = None) -> ModuleSpec:
    """Dense GPT layer spec (Llama: RMSNorm, SwiGLU, GQA, RoPE from the TransformerConfig) with
    megatron-cp attention. For a model with MoE or other options use ``megatron_cp_layer_spec(config)``.

    backend: "local" (Megatron-Core modules only, runs on CPU), "te" (Transformer Engine linears
    and norms) or "auto" (te when transformer_engine imports, else local). options: the run-wide values the
    attention binds (``PlanOptions(...).layer``; see ``bound_core_attention``).
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
    return swap_core_attention(spec, options)


def megatron_layer_spec(config, vp_stage: int | None = None):
    """Megatron's own spec for ``config`` (a ``GPTModelConfig``, or a ``TransformerConfig`` which is
    wrapped in one): exactly what ``GPTModelBuilder`` builds when no ``--spec`` is given."""
    from megatron.training.models.gpt import GPTModelConfig, default_layer_spec

    if not hasattr(config, "transformer"):
        config = GPTModelConfig(transformer=config)
    return default_layer_spec(config, vp_stage)


def sequence_parallel_norms(spec, config, vp_stage: int | None = None):
    """``spec`` (a layer ``ModuleSpec`` or a block spec) with Megatron's torch norm (``WrappedTorchNorm``, which
    refuses sequence parallelism) replaced by ``norms.SequenceParallelTorchNorm`` everywhere, the block's final
    norm included, when ``config.sequence_parallel``; ``spec`` itself otherwise, or when it has no torch norm
    (Transformer Engine's and Apex's norms run under sequence parallelism as they are). A layer spec becomes the
    block spec Megatron would make of it (``get_num_layers_to_build`` layers), with the final norm swapped too."""
    if not getattr(config, "sequence_parallel", False):
        return spec
    from megatron.core.transformer import transformer_block as tb
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from .norms import SequenceParallelTorchNorm

    found = []

    def swap(x):
        if x is WrappedTorchNorm:
            found.append(x)
            return SequenceParallelTorchNorm
        if isinstance(x, ModuleSpec):
            mod = swap(x.module)
            sub = swap(x.submodules) if x.submodules is not None else None
            return x if (mod is x.module and sub is x.submodules) else dataclasses.replace(x, module=mod, submodules=sub)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            new = {f.name: swap(getattr(x, f.name)) for f in dataclasses.fields(x)}
            changed = {k: v for k, v in new.items() if v is not getattr(x, k)}
            return dataclasses.replace(x, **changed) if changed else x
        if isinstance(x, list):
            out = [swap(v) for v in x]
            return out if any(a is not b for a, b in zip(out, x)) else x
        return x

    out = swap(spec)
    if isinstance(out, ModuleSpec) and tb.LayerNormImpl is WrappedTorchNorm:  # the final norm Megatron would add
        found.append(WrappedTorchNorm)
        out = tb.TransformerBlockSubmodules(layer_specs=[out] * tb.get_num_layers_to_build(config, vp_stage),
                                            layer_norm=SequenceParallelTorchNorm)
    return out if found else spec


def megatron_cp_layer_spec(config, vp_stage: int | None = None, options: LayerOptions | None = None):
    """The ``--spec megatron_cp.megatron.specs megatron_cp_layer_spec`` entry point.

    config: the ``GPTModelConfig`` Megatron's GPT builder passes to a callable spec (or a
    ``TransformerConfig``). Returns Megatron's own spec for it (``megatron_layer_spec``: a layer
    ``ModuleSpec`` or, for MoE models, a ``TransformerBlockSubmodules``) with only the core attention
    replaced by ``CPCoreAttention``, bound to ``options`` (None: the run's --cp-* flags, ``bound_core_attention``).
    """
    if config is None:
        raise ValueError("megatron_cp_layer_spec needs the model config (GPTModelConfig or TransformerConfig)")
    spec = swap_core_attention(megatron_layer_spec(config, vp_stage), options)
    return sequence_parallel_norms(spec, getattr(config, "transformer", config), vp_stage)
