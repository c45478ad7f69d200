"""The options of megatron-cp in Megatron: which mask each micro-batch gets (``MaskSpec``) and how it is planned and
run (``PlanOptions``). Their fields that a flag sets carry the flag (``flag``), from which ``arguments.py`` builds the
parser; choices come from the registries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import megatron_cp as mcp
from megatron_cp.baselines import STRATEGIES, STRATEGY_NAMES
from megatron_cp.kernels import BACKEND_CHOICES

__all__ = ["BOUNDARY_MASKS", "BUILDER_MASKS", "MASKS", "IMPLS", "LayerOptions", "MaskSpec", "PlanOptions", "flag"]

# masks built from each micro-batch's sample and document boundaries; the others are the builders of
# megatron_cp.masks that take (seqlen, sizes), called per sample (sliding_window is the boundary mask's)
BOUNDARY_MASKS = ("causal", "packed", "sliding_window", "packed_sliding_window")
BUILDER_MASKS = tuple(n for n in mcp.masks.builders_taking("sizes") if n not in BOUNDARY_MASKS)
MASKS = BOUNDARY_MASKS + BUILDER_MASKS
IMPLS = ("te", *STRATEGY_NAMES)  # --context-parallel-impl: Megatron's own CP, or a strategy of megatron-cp's adapter


def flag(name: str, help: str, **kwargs) -> dict:
    """The metadata of a field that the command-line flag ``name`` sets: its help and ``add_argument``'s other
    arguments (``default``: the field's own unless given here). ``arguments.add_megatron_cp_args`` reads it."""
    return {"flag": (name, help, kwargs)}



@dataclass(frozen=True)
class MaskSpec:
    """Which mask each micro-batch gets.

    name:    causal (per sample) | packed (causal per EOD-separated document) |
             sliding_window (causal, ``window`` keys back, per sample) |
             packed_sliding_window (the same per document) | a builder of ``megatron_cp.masks``
             called as ``builder(S, **kwargs)`` per sample
    window:  left window for the sliding variants (keys ``j`` with ``i - window <= j <= i``)
    eod:     EOD token id (needed by the packed variants)
    kwargs:  keyword arguments of a builder, as sorted (name, value) pairs
    layer_window: the windowed layers' left window (Megatron's ``--window-size W,0`` with
             ``--window-attn-skip-freq``: those layers keep keys ``i - W .. i`` inside the mask's samples or
             documents, the others the whole mask); ``causal`` and ``packed`` only
    """

    name: str = field(default="causal", metadata=flag(
        "--cp-mask", "causal per sample; packed: causal per EOD-separated document; sliding_window / "
        "packed_sliding_window with --cp-window; or a megatron_cp.masks builder by name (per sample, arguments in "
        "--cp-mask-kwargs)", choices=MASKS))
    window: int | None = field(default=None, metadata=flag("--cp-window", "left window W of the sliding masks",
                                                            type=int))
    eod: int | None = field(default=None, metadata=flag(
        "--cp-eod-token", "EOD token id for the packed masks (default: the tokenizer's eod)", type=int))
    kwargs: tuple = field(default=(), metadata=flag(
        "--cp-mask-kwargs", 'JSON keyword arguments of a builder mask, e.g. \'{"block": 64}\'', type=str,
        default="{}"))
    layer_window: int | None = None  # from Megatron's --window-size with --window-attn-skip-freq

    def __post_init__(self):
        if self.name not in MASKS:
            raise ValueError(f"unknown mask {self.name!r}; choose from {', '.join(MASKS)}")
        if "sliding" in self.name and (self.window is None or int(self.window) < 0):
            raise ValueError(f"mask {self.name!r} needs window >= 0, got window={self.window}")
        if self.layer_window is not None and (self.name not in ("causal", "packed") or int(self.layer_window) < 0):
            raise ValueError(f"layer_window={self.layer_window} (windowed layers) needs the causal or packed mask and "
                             f"a window >= 0, got mask {self.name!r}")
        if self.name.startswith("packed") and self.eod is None:
            raise ValueError(f"mask {self.name!r} needs the EOD token id, got eod=None")

    @property
    def packed(self) -> bool:
        return self.name.startswith("packed")


@dataclass(frozen=True)
class LayerOptions:
    """What every attention layer runs for the whole run, bound when the layer spec is built
    (``specs.megatron_cp_layer_spec`` / ``get_llama_layer_spec``): the kernel backend (a name of
    ``kernels.BACKEND_CHOICES``), the strategy (a name of ``baselines.STRATEGY_NAMES``) and the sparse selectors
    (a ``SparseSpec`` or None). Each micro-batch's ``CPParams.layer`` says which of these its plan was made for
    (``PlanOptions.layer``); a layer refuses a micro-batch planned for other ones."""

    kernel_backend: str = "auto"
    strategy: str = "megatron_cp"
    sparse: object = None

    def __post_init__(self):
        if self.kernel_backend not in BACKEND_CHOICES:
            raise ValueError(f"kernel_backend={self.kernel_backend!r} is unknown; choose from "
                             f"{', '.join(BACKEND_CHOICES)}")
        if self.strategy not in STRATEGY_NAMES:
            raise ValueError(f"strategy={self.strategy!r} is unknown; choose from {', '.join(STRATEGY_NAMES)}")


@dataclass(frozen=True)
class PlanOptions:
    """Arguments passed through to ``megatron_cp.plan`` (chunk_size, topology, solver) and to
    ``megatron_cp.attention`` (kernel_backend: a name of ``kernels.BACKEND_CHOICES``). ``strategy``: a name of
    ``baselines.STRATEGY_NAMES``: ``megatron_cp``, or a baseline, which then also chooses the plan's layout
    (``baselines.plan_for``; ``solver`` is not used)."""

    chunk_size: int | None = field(default=None, metadata=flag("--cp-chunk-size", "planner chunk size (default: auto)",
                                                                type=int))
    topology: object = field(default=None, metadata=flag(
        "--cp-topology", "NODESxGPUS_PER_NODE of the CP group, e.g. 2x8 (default: none)", type=str))
    solver: str = field(default="auto", metadata=flag("--cp-solver", "planner solver (default: auto)", type=str))
    kernel_backend: str = field(default="auto", metadata=flag(
        "--cp-kernel-backend", "attention kernels: auto (FlashAttention-4 where flash-attn-4 is installed on sm90 / "
        "sm100, else Triton on GPUs, PyTorch reference otherwise)", choices=BACKEND_CHOICES))
    strategy: str = field(default="megatron_cp", metadata=flag(
        "--context-parallel-impl", "te: Megatron's own CP (Transformer Engine). megatron_cp: megatron-cp attention for "
        f"any mask, with its batch hook, RoPE and loss. {' / '.join(s for s in STRATEGIES if s != 'head_context')}: "
        "megatron-cp's baseline strategies through the same adapter. head_context: Ulysses all-to-all over heads "
        "inside each node x megatron-cp across nodes (node size from --cp-topology; without it one node).",
        choices=IMPLS, default="te"))
    sparse: object = None  # a SparseSpec (--cp-sparse): plans in whole blocks, selectors per layer
    gating: object = None  # a gating.GatingSpec (--cp-head-gating / --cp-head-pattern): adds a streaming plan
    # every rank's token count a multiple of this: the TP size under --sequence-parallel, whose regions
    # (norms, residual, dropout) split a rank's local tokens evenly over its TP ranks
    token_multiple: int = 1
    # the attention inputs' shape per sequence (query heads, key/value heads, head_dim, bytes per element: a
    # planner Workload): where known, planning ahead also chooses each plan's exchange (runtime.prebuild)
    workload: object = None
    # megatron-cp's plans (and exchange choices) made in the planning helper process (runtime.plan_in_helper),
    # not beside the step in this interpreter: what the plugin sets where the step runs on a GPU
    helper_process: bool = False
    # with helper_process: this process's rank in the plans' CP group, whose first-call host work (index arrays, row
    # maps, tile lists for kernel_backend) the helper then makes with each plan (runtime.plan_in_helper's rank=)
    plan_rank: int | None = None
    # one plan per micro-batch over the whole DP x CP world (--cp-balance-over-dp, prepare_global_batch)
    over_dp: bool = field(default=False, metadata=flag(
        "--cp-balance-over-dp", "one plan per micro-batch over the whole DP x CP world: every DP group's micro-batch "
        "is gathered and its documents balanced over all DP x CP ranks (docs/design.md, 'One plan over DP x CP'); "
        "megatron_cp at TP 1 and PP 1, dense attention", action="store_true"))

    @property
    def layer(self) -> LayerOptions:
        """The run-wide values the attention layers bind (the layer spec's), as this run plans for them."""
        return LayerOptions(self.kernel_backend, self.strategy, self.sparse)

    @property
    def block(self) -> int:
        """Every chunk cut of the plan a multiple of this: lcm of the sparse block and ``token_multiple``."""
        return math.lcm(1 if self.sparse is None else int(self.sparse.block), int(self.token_multiple))

    def __post_init__(self):
        if isinstance(self.token_multiple, bool) or not isinstance(self.token_multiple, int) or self.token_multiple < 1:
            raise ValueError(f"token_multiple must be a positive int (the TP size under --sequence-parallel), "
                             f"got {self.token_multiple!r}")
        if self.token_multiple > 1 and self.strategy == "head_context":
            raise ValueError("--sequence-parallel does not combine with --context-parallel-impl head_context: its "
                             "Ulysses pieces split a group's tokens in equal parts that need not divide by the TP "
                             "size; use megatron_cp, ring, ulysses, usp or allgather")
        if self.gating is not None:
            if self.strategy != "megatron_cp":
                raise ValueError(f"head gating runs with strategy megatron_cp, not {self.strategy!r}")
            if self.sparse is not None:
                raise ValueError("head gating and dynamic sparse attention (--cp-sparse) do not combine")
        if self.over_dp and (self.strategy != "megatron_cp" or self.sparse is not None or self.gating is not None
                             or self.token_multiple != 1):
            raise ValueError("one plan over DP x CP (--cp-balance-over-dp) runs megatron_cp's dense attention: no "
                             "baseline strategy, --cp-sparse, head gating or --sequence-parallel")
        if self.strategy != "megatron_cp":
            if self.strategy not in STRATEGIES:
                raise ValueError(f"strategy={self.strategy!r} is unknown; choose megatron_cp or one of "
                                 f"{', '.join(STRATEGIES)}")
