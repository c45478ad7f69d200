"""How a micro-batch's plan travels to the attention layers: ``CPParams``.

Megatron passes ``packed_seq_params`` unchanged from ``GPTModel.forward`` to every core-attention
call (also into activation-recompute closures and across pipeline schedules), so we subclass
``PackedSeqParams`` and carry the plan there. No Megatron model class is edited and no module-level
"current plan" is needed.

The micro-batch is one sequence of ``s_local`` tokens on each rank in Megatron's ordinary
``[s, b=1, h, d]`` layout (``qkv_format="sbhd"``), with RoPE applied at the per-token angles of
``PlanRotaryEmbedding``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from .options import LayerOptions


@dataclass
class CPParams(PackedSeqParams):
    """The plan of one micro-batch plus the dispatched positions.

    plan:          the megatron-cp plan over the micro-batch's tokens (one sequence, see batch.py)
    position_ids:  int64 ``[b, s_local]``, the RoPE position of each local token (per-document reset)
    cp_rank:       this rank's index in the CP group the plan was dispatched for
    layer:         the run-wide values ``plan`` was made for (``options.LayerOptions``: kernel backend, strategy,
                   sparse selectors); the layers run the ones bound in their spec and refuse a batch whose
                   ``layer`` differs (a plan made for another strategy has another layout)
    gating:        None, or a head-gating object (``gating.GateSource`` / ``PatternSource``): ``mode`` in
                   {train, pattern}, ``gate(layer_number)`` -> float [Hkv] or None, ``pattern(layer_number)``
                   -> Hkv bools or None (--cp-head-gating / --cp-head-pattern)
    stream_plan:   the streaming heads' plan (``plan_like(streaming_within(mask, sink, window), plan)``:
                   the same token layout as ``plan``); required with ``gating``
    layer_window:  the windowed layers' left window (``MaskSpec.layer_window``) or None
    window_plan:   those layers' plan (the window within the mask's documents, ``plan``'s token layout)
    """

    plan: Any = None
    position_ids: torch.Tensor = None
    cp_rank: int = 0
    layer: LayerOptions = LayerOptions()
    gating: Any = None
    stream_plan: Any = None
    layer_window: int | None = None
    window_plan: Any = None

    def __post_init__(self):
        if self.qkv_format is None:
            self.qkv_format = "sbhd"
        if self.qkv_format != "sbhd":
            raise ValueError(f"CPParams.qkv_format must be 'sbhd', got {self.qkv_format!r}")
        if self.plan is None:
            raise ValueError("CPParams needs a plan (got None)")
        if self.gating is not None:
            if getattr(self.gating, "mode", None) not in ("train", "pattern"):
                raise ValueError(f"CPParams.gating.mode must be 'train' or 'pattern', got "
                                 f"{getattr(self.gating, 'mode', None)!r}")
            if self.stream_plan is None:
                raise ValueError("CPParams with gating needs stream_plan (prepare_batch with PlanOptions.gating)")
        if (self.layer_window is None) != (self.window_plan is None):
            raise ValueError("CPParams: layer_window and window_plan go together (prepare_batch with "
                             f"MaskSpec.layer_window), got layer_window={self.layer_window}")
        # GPTModel asks packed_seq_params for the RoPE length; the full length of the sequence.
        self.max_seqlen_q = self.max_seqlen_kv = int(self.plan.seqlen)
        super().__post_init__()

    @property
    def local_len(self) -> int:
        return self.plan.num_local(self.cp_rank)
