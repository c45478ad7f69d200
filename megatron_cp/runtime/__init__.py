"""Runtime: dispatch tokens by a plan and run distributed attention over it.

``attention`` / ``dispatch`` / ``undispatch`` are the user API (``apply_sink`` adds attention sinks to any
strategy's merged ``(out, lse)``, ``runtime.sinks``; ``prebuild`` chooses a plan's exchange ahead of its
first call, e.g. in a planning thread; ``plan_in_helper`` makes a plan and that choice in a helper process, off
the training loop's GIL; ``gather_global_batch`` / ``all_micro_batches``: every data-parallel
group's micro-batch under one plan of the DP x CP world, ``runtime.global_batch``); ``check_inputs``, ``plan_rank``,
``resolve_backend`` and ``plan_cache`` (state derived from a plan, kept weakly by it)
are what other strategies (``megatron_cp.baselines``) share with it (``__shared__``, with the plan checks and the
gloo twins of a group: not the user API); ``CostModel`` (``runtime.cost``)
prices the exchange choice (a step's prediction: ``runtime.predict``) and is what ``tools/sim`` calibrates.
"""

from .attention import attention, check_inputs, prebuild, resolve_backend
from .cost import CostModel
from .dispatch import dispatch, undispatch
from .faults import RanksDisagreeError, tell_peers
from .global_batch import HostCost, all_micro_batches, gather_global_batch, plan_over_dp, predict_layer
from .groups import host_group, plan_rank, planning_group
from .plan_process import plan_in_helper, start_planning_helpers
from .sinks import apply_sink
from .state import accept_plan_check, check_plan_ahead, fingerprint, input_fields, plan_cache, verify_plan

# the user API
__all__ = ["attention", "prebuild", "plan_in_helper", "start_planning_helpers", "apply_sink", "dispatch", "undispatch",
           "CostModel",
           # every DP group's micro-batch under one plan of the DP x CP world
           "gather_global_batch", "all_micro_batches",
           # which layout of a global micro-batch: balanced over every rank or each DP group's own (predicted)
           "plan_over_dp", "predict_layer", "HostCost"]
# shared with the layers above (baselines, sparse, gating, megatron), not the user API
__shared__ = ["check_inputs", "resolve_backend", "plan_rank", "plan_cache",
              # the gloo twins of a group the host work and a planning thread run on
              "host_group", "planning_group",
              # the cross-rank plan check and the per-call input record, for the sparse and Megatron entry points
              "verify_plan", "input_fields", "fingerprint",
              # what a rank's error alone on a call raises on its peers too, and its type
              "tell_peers", "RanksDisagreeError",
              # the same check of a plan made ahead, by its planning thread, and the step taking its result
              "check_plan_ahead", "accept_plan_check"]
