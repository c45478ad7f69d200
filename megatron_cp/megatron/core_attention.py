"""``CPCoreAttention``: Megatron's ``core_attention`` submodule backed by megatron-cp.

It takes the place of ``DotProductAttention`` / ``TEDotProductAttention`` in a layer spec.
Contract (megatron-core 0.19, ``CoreAttentionBuilder`` / ``CoreAttentionInterface`` in
``megatron/core/transformer/attention.py``): constructed with keyword arguments ``config,
layer_number, attn_mask_type, attention_type, cp_comm_type, softmax_scale, pg_collection``;
``forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
packed_seq_params=None)`` with q ``[s_local, b, Hq/tp, D]``, k/v ``[s_local, b, Hkv/tp, D]``
returning ``[s_local, b, Hq/tp * D]``.

The mask is not ``attention_mask`` (Megatron's dense mask cannot describe the CP layout): it is the
plan carried by ``packed_seq_params`` (a ``CPParams``, made by ``prepare_batch``). The batch dimension
is folded into the head dimension (batch-major), which keeps the GQA head mapping intact, so all
samples of a micro-batch share one plan; ``prepare_batch`` emits ``b = 1`` with the samples
concatenated as documents, which covers any per-sample mask.

Head gating (``CPParams.gating``, see ``gating.py``): in train mode each KV head mixes full and streaming
attention by its gate (``gating.gated_attention``), in pattern mode each KV head runs one of the two
(``gating.pattern_attention``). Gates and patterns are per model KV head; this rank takes its tensor-parallel
slice and repeats it per folded batch element.

Attention sinks (``config.softmax_type`` ``off-by-one`` / ``learnable``, as Megatron's DotProductAttention):
the parameter ``softmax_offset`` ``[Hq/tp]`` (learnable: params_dtype, ``config.init_method``, sharded over
TP ranks by head in checkpoints) is applied once per row after the CP merge (``runtime.sinks.apply_sink``),
with every strategy (baselines then return lse with its gradient) and in head-pattern mode; head gating in
train mode refuses it.

MLA (``MLASelfAttention``): built with ``k_channels`` / ``v_channels`` (q/k and v head dims differ, 192 / 128)
and called with ``[s, H, D]`` tensors when ``packed_seq_params`` is set; its rotary runs at the plan's
positions through ``mla.install_mla`` (docs/sinks_mla.md).

Cross-rank consistency: the first forward of a plan (every forward on a gloo CP group, and a later one whose values
the group never agreed on) all-reduces (with the plan digest) the head counts, head dims, dtype, batch and softmax
type; ranks that differ raise a ValueError on every rank naming the values, before any exchange
(``runtime.verify_plan``). The kernel backend, strategy and sparse selectors are the spec's (``options``).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention, make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide

import megatron_cp as mcp
from megatron_cp.gating import gated_attention, pattern_attention
from megatron_cp.runtime import apply_sink, plan_cache, resolve_backend, tell_peers
from megatron_cp.runtime.state import fingerprint, input_fields, verify_plan

from .options import LayerOptions
from .params import CPParams
from .step_log import STEP_LOG


_SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def _kernel_path(plan, backend, device) -> str:
    """What the plan's latest call ran: the kernel backend's own account where it keeps one (FA4: ``fa4`` or
    ``triton (<why not FA4>)``), else the backend's name."""
    for v in plan_cache(plan).values():
        path = getattr(getattr(v, "backend", None), "last_path", None)
        if path:
            return path
    return resolve_backend(backend, device)[1].name


@lru_cache(maxsize=16)
def _causal_plan_cp1(seqlen: int, window: int | None = None):
    return mcp.plan(mcp.masks.causal(seqlen) if window is None else mcp.masks.sliding_window(seqlen, window), 1)


class CPCoreAttention(MegatronModule):
    """Context-parallel core attention over any mask (see module docstring for shapes)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        options: LayerOptions | None = None,
    ):
        super().__init__(config=config)
        # the run-wide values, bound here (the layer spec's, ``specs.bound_core_attention``), not read per batch
        self.options = LayerOptions() if options is None else options
        if not isinstance(self.options, LayerOptions):
            raise ValueError(f"CPCoreAttention: options must be a LayerOptions, got {type(options).__name__}")
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        sparse = self.options.sparse
        self.selector = None if sparse is None else sparse.selector(self.layer_number)
        if attention_type != "self":
            raise ValueError(f"CPCoreAttention supports attention_type='self' only, got {attention_type!r}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"CPCoreAttention has no attention dropout; set --attention-dropout 0 (got {dropout})"
            )
        # windowed layers (config.window_size with window_attn_skip_freq, as Gemma or GPT-OSS mix them) run the
        # micro-batch's window plan; a window on every layer belongs in the mask itself
        self.layer_window = None
        window = getattr(config, "window_size", None)
        if window is not None:
            skip = getattr(config, "window_attn_skip_freq", None)
            if skip is None:
                raise ValueError(
                    f"config.window_size={window} on every layer is Megatron's own window; with megatron-cp "
                    "describe the window in the mask (--cp-mask sliding_window --cp-window W)"
                )
            window = tuple(window)
            if len(window) != 2 or window[1] != 0 or window[0] < 0:
                raise ValueError(f"config.window_size={window}: megatron-cp's windowed layers are causal, (W, 0) "
                                 "with W >= 0")
            if is_layer_window_attention(window, skip, self.layer_number):
                self.layer_window = int(window[0])
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type not in _SOFTMAX_TYPES:
            raise ValueError(f"CPCoreAttention: softmax_type must be one of {', '.join(_SOFTMAX_TYPES)}, got "
                             f"{softmax_type!r}")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        for name in ("tp", "cp"):
            if not hasattr(pg_collection, name):
                raise ValueError(f"CPCoreAttention: pg_collection has no {name!r} process group")
        self.pg_collection = pg_collection
        self.cp_group = pg_collection.cp
        tp = pg_collection.tp.size()
        self.tp_rank, self.tp_size = pg_collection.tp.rank(), tp
        # MLA passes its q/k head dim (qk_head_dim + qk_pos_emb_head_dim) and v head dim explicitly
        self.head_dim = k_channels if k_channels is not None else divide(
            config.kv_channels * config.num_attention_heads, config.num_attention_heads)
        self.v_head_dim = v_channels if v_channels is not None else self.head_dim
        self.heads_per_partition = divide(config.num_attention_heads, tp)
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else softmax_scale
        self.softmax_type = softmax_type
        # Attention sinks: the same tensor Megatron's DotProductAttention keeps (name ``softmax_offset``,
        # shape [heads of this TP rank], params_dtype, config.init_method), so checkpoints carry over; a
        # per-head logit added to each row's normaliser once, after the CP merge (runtime.sinks).
        self.softmax_offset = None
        if softmax_type != "vanilla":
            dev = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            t = torch.zeros(self.heads_per_partition, device=dev, dtype=config.params_dtype)
            if softmax_type == "off-by-one":
                self.softmax_offset = t
            else:
                self.softmax_offset = torch.nn.Parameter(t)
                if config.perform_initialization:
                    config.init_method(self.softmax_offset)
                # a TP shard by head (Megatron leaves it unmarked, so its grad norm counts TP rank 0's
                # shard only): marked, every shard counts and TP tools shard it like other head params
                set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        # apply_query_key_layer_scaling divides the scores by layer_number and multiplies them back
        # inside the fp32 softmax: the net scale is unchanged, so it needs nothing here.

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """q ``[s, b, Hq, D]``, k ``[s, b, Hkv, D]``, v ``[s, b, Hkv, Dv]`` (local tokens in plan order; Dv = D
        but for MLA) -> ``[s, b, Hq*Dv]``. MLA with ``CPParams`` passes ``[s, H, D]`` (its packed convention
        drops the batch dim; b = 1) and gets ``[s, 1, Hq*Dv]``. An input error raised on this rank alone is
        raised on its CP peers too, which may be in the call's exchange by then (``runtime.tell_peers``)."""
        try:
            return self._forward(query, key, value, attn_mask_type, attention_bias, packed_seq_params)
        except ValueError as e:
            group = getattr(packed_seq_params, "cp_group", None) if isinstance(packed_seq_params, CPParams) else None
            tell_peers(group if group is not None else self.cp_group, e)
            raise

    def _forward(self, query, key, value, attn_mask_type, attention_bias, packed_seq_params) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("CPCoreAttention does not support attention_bias (got a tensor)")
        if isinstance(packed_seq_params, CPParams) and query.dim() == key.dim() == value.dim() == 3:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(
                f"CPCoreAttention expects [s, b, h, d] tensors (MLA: [s, h, d] with CPParams), got q {tuple(query.shape)}, "
                f"k {tuple(key.shape)}, v {tuple(value.shape)}"
            )
        s, b, hq, d = query.shape
        hkv, dv = key.shape[2], value.shape[3]
        if key.shape[:2] != (s, b) or value.shape[:3] != key.shape[:3] or key.shape[3] != d or hq % hkv:
            raise ValueError(
                f"CPCoreAttention shape mismatch: q {tuple(query.shape)}, k {tuple(key.shape)}, "
                f"v {tuple(value.shape)} (need equal s, b, d and Hkv dividing Hq)"
            )
        if self.softmax_offset is not None and self.softmax_offset.shape[0] != hq:
            raise ValueError(f"layer {self.layer_number}: the attention sink has {self.softmax_offset.shape[0]} "
                             f"heads but q has {hq} heads")
        # the micro-batch's group: the CP group, or with one plan over DP x CP (--cp-balance-over-dp) that world
        group = getattr(packed_seq_params, "cp_group", None) if isinstance(packed_seq_params, CPParams) else None
        group = group if group is not None else self.cp_group
        cp_rank, cp_size = (0, 1) if group is None else (group.rank(), group.size())
        backend, strategy, selector = self.options.kernel_backend, self.options.strategy, self.selector
        gating = None
        if isinstance(packed_seq_params, CPParams):
            if packed_seq_params.layer is not self.options and packed_seq_params.layer != self.options:
                raise ValueError(
                    f"layer {self.layer_number} was built for {self.options} but its micro-batch was planned for "
                    f"{packed_seq_params.layer}: build the layer spec with the options the batches are planned "
                    "with (megatron_cp_layer_spec reads them from the --cp-* flags; get_llama_layer_spec(options="
                    "PlanOptions(...).layer))")
            plan = packed_seq_params.plan
            if self.layer_window is not None:
                if packed_seq_params.layer_window != self.layer_window:
                    raise ValueError(
                        f"layer {self.layer_number} is windowed (window {self.layer_window}) but its micro-batch "
                        f"was prepared with layer_window={packed_seq_params.layer_window}: prepare_batch with "
                        f"MaskSpec(layer_window={self.layer_window}) (the plugin derives it from --window-size)")
                plan = packed_seq_params.window_plan
            gating = packed_seq_params.gating
        elif packed_seq_params is None and cp_size == 1:
            # No batch hook (e.g. evaluation at CP=1): plain causal attention over the sequence.
            kind = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            if kind != AttnMaskType.causal:
                raise ValueError(f"without CPParams only causal attention is implied, got attn_mask_type={kind}")
            plan = _causal_plan_cp1(s, self.layer_window)
            strategy, selector = "megatron_cp", None  # one rank, dense: the plan is no strategy's layout
        else:
            raise ValueError(
                "CPCoreAttention needs packed_seq_params=CPParams from megatron_cp.megatron.prepare_batch "
                f"(got {type(packed_seq_params).__name__} with CP size {cp_size})"
            )
        if plan.cp_size != cp_size:
            raise ValueError(f"plan was made for cp_size={plan.cp_size} but the CP group has {cp_size} ranks")
        n_local = plan.num_local(cp_rank)  # not len(local_ids): that builds the rank's ids on every call
        if n_local != s:
            raise ValueError(
                f"CP rank {cp_rank} holds {n_local} tokens under the plan but got q with s={s}; "
                "the batch must be dispatched by the same plan (prepare_batch)"
            )
        # Fold batch into heads, batch-major: q head (i, h) maps to kv head (i, h // (hq // hkv)).
        q = query.reshape(s, b * hq, d)
        k = key.reshape(s, b * hkv, d)
        v = value.reshape(s, b * hkv, dv)
        group = group if group is not None else parallel_state.get_context_parallel_group()
        if cp_size > 1:
            # before any exchange (once per plan; every call on gloo): ranks that disagree on heads, head dims,
            # dtype or sinks
            # raise here, every one of them, instead of aborting in mismatched collectives
            fields = input_fields(q, k, v)
            fields.update({"batch": b, "softmax_type": _SOFTMAX_TYPES.index(self.softmax_type)})
            if self.options.sparse is not None:
                sp = self.options.sparse  # the same on every layer: method, parameters, sparse layers
                fields["sparse settings"] = fingerprint((sp.method, sp.params, sorted(sp.layers or ()), sp.config))
            verify_plan(plan, group, fields)
        sink = None if self.softmax_offset is None else self.softmax_offset.repeat(b)  # folded heads, batch-major
        if gating is not None:
            out = self._gated(q, k, v, b, hkv, plan, packed_seq_params.stream_plan, group, gating, backend,
                              strategy, selector, sink)
            if out is not None:
                return out.reshape(s, b, hq * dv)
        report = STEP_LOG.collecting  # an iteration Megatron logs: say which kernels ran, what sparse layers kept
        stats = {} if report and selector is not None else None
        if selector is not None:
            out, lse = mcp.sparse.sparse_attention(q, k, v, plan, group, selector, softmax_scale=self.softmax_scale,
                                                   backend=backend, stats=stats)
        elif strategy == "megatron_cp":
            out, lse = mcp.attention(q, k, v, plan, group, softmax_scale=self.softmax_scale, backend=backend)
        else:
            from megatron_cp.baselines import get_strategy

            # lse needs its gradient only under sinks: without it Ulysses' backward exchange makes no host sync
            out, lse = get_strategy(strategy, backend=backend, lse_grad=sink is not None)(q, k, v, plan, group,
                                                                                          self.softmax_scale)
        if report:
            STEP_LOG.layer(self.layer_number, _kernel_path(plan, backend, q.device), stats)
        if sink is not None:
            out, lse = apply_sink(out, lse, sink)
        return out.reshape(s, b, hq * dv)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The learnable sink sharded over TP ranks along its head axis (as Megatron's DotProductAttention)."""
        state_dict = self.state_dict(prefix="", keep_vars=True) if self.softmax_type == "learnable" else {}
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self.pg_collection.tp,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))

    def _local_heads(self, values, hkv: int, what: str):
        """This TP rank's ``hkv`` entries of a per-model-KV-head sequence (gate tensor or bool list)."""
        n = len(values)
        if n == hkv * self.tp_size:
            lo = self.tp_rank * hkv
            return values[lo:lo + hkv]
        raise ValueError(f"layer {self.layer_number}: the head {what} has {n} entries; the model has "
                         f"{hkv * self.tp_size} KV heads ({hkv} per tensor-parallel rank)")

    def _gated(self, q, k, v, b, hkv, plan, stream_plan, group, gating, backend, strategy, selector, sink):
        """Head-gated attention of the folded ``[s, b * H, d]`` tensors, or None when this layer is ungated.
        ``sink``: None or the folded heads' sink logits (pattern mode applies them per head; train mode,
        a mix of two attentions, has none)."""
        if selector is not None or strategy != "megatron_cp":
            raise ValueError("head gating runs with strategy megatron_cp and without --cp-sparse")
        if stream_plan is None:
            raise ValueError("CPParams.gating needs CPParams.stream_plan")
        if gating.mode == "train":
            gate = gating.gate(self.layer_number)
            if gate is None:
                return None
            if sink is not None:
                raise ValueError(f"head gating in train mode (--cp-head-gating) mixes two attentions and has no "
                                 f"attention sink; got softmax_type={self.softmax_type!r}")
            # batch-major folding: folded KV head i * hkv + h is sample i's head h
            gate = self._local_heads(gate, hkv, "gate").repeat(b)
            return gated_attention(q, k, v, plan, stream_plan, group, gate, self.softmax_scale,
                                              backend=backend)
        if gating.mode == "pattern":
            pattern = gating.pattern(self.layer_number)
            if pattern is None:
                return None
            full_heads = list(self._local_heads(list(pattern), hkv, "pattern")) * b
            out, lse = pattern_attention(q, k, v, plan, stream_plan, group, full_heads,
                                         self.softmax_scale, backend=backend)
            return out if sink is None else apply_sink(out, lse, sink)[0]
        raise ValueError(f"CPParams.gating.mode must be 'train' or 'pattern', got {gating.mode!r}")
