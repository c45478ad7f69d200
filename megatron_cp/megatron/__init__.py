"""megatron-cp as a Megatron-Core plugin.

    --context-parallel-impl megatron_cp      (arguments.add_megatron_cp_args, via extra_args_provider)
    layer spec:  specs.get_llama_layer_spec  (core_attention = CPCoreAttention bound to the run's LayerOptions)
    options:     options.MaskSpec, options.PlanOptions (the flags' values; arguments.py builds the flags from them),
                 options.LayerOptions (the run-wide part the layers bind: kernel backend, strategy, sparse)
    batch hook:  batch.prepare_batch         (replaces get_batch_on_this_cp_rank; returns CPParams)
    planning:    plan_ahead.PlanAhead        (the next micro-batches' plans, planning.plan_for_batch, in a thread)
    RoPE:        rope.install(model)         (RoPE at the dispatched positions, any device)
    loss:        loss.loss_func              (exact with uneven token counts per CP rank)

Only this sub-package imports megatron: megatron-core is the ``[megatron]`` extra (``pip install
"megatron-cp[megatron]"``); without it this import fails with that instruction and the rest of megatron_cp works.
"""

try:
    import megatron.core  # noqa: F401
except ImportError as e:  # the extra is not installed
    raise ImportError(f"megatron_cp.megatron is the Megatron-Core plugin and needs megatron-core >= 0.19: pip install "
                      f"\"megatron-cp[megatron]\" ({type(e).__name__}: {e})") from e

from .batch import CPBatch, prepare_batch, prepare_global_batch, prepare_step_batch
from .options import LayerOptions, MaskSpec, PlanOptions
from .planning import GlobalPlan, plan_for_batch, plan_global_batch, step_planner
from .core_attention import CPCoreAttention
from .loss import loss_func
from .params import CPParams
from .plan_ahead import PlanAhead, default_workers, in_turn
from .rope import PlanRotaryEmbedding, install
from .specs import get_llama_layer_spec

__all__ = [
    "CPBatch", "CPCoreAttention", "CPParams", "LayerOptions", "MaskSpec", "PlanOptions", "PlanRotaryEmbedding",
    "get_llama_layer_spec", "install", "loss_func", "prepare_batch", "prepare_global_batch", "PlanAhead",
    "plan_for_batch", "prepare_step_batch",
    # the planning thread's work on Megatron's groups, and one plan over DP x CP (--cp-balance-over-dp)
    "step_planner", "GlobalPlan", "plan_global_batch", "in_turn", "default_workers",
]
