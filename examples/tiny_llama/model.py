"""Build a Llama-style ``GPTModel`` with megatron-cp attention (used by the demo and the Megatron tests).

Llama = RMSNorm, SwiGLU (gated linear unit with SiLU), RoPE, GQA, no biases, untied embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_cp.megatron import get_llama_layer_spec, rope
from megatron_cp.megatron.specs import sequence_parallel_norms


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
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp > 1:
        # a rank's token count follows the micro-batch's plan: stages send activation shapes with the data;
        # Megatron refuses that beside its default MoE dispatcher (allgather), unused by this dense model
        kw.update(pipeline_model_parallel_size=pp, pipeline_dtype=dtype, variable_seq_lengths=True,
                  moe_token_dispatcher_type="alltoall")
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is not None:
        # interleaved 1F1B sends both ways between the same two ranks at pp 2: Megatron then needs
        # unbatched, overlapped p2p (megatron.training asserts the same)
        kw.update(virtual_pipeline_model_parallel_size=vpp, overlap_p2p_comm=True, batch_p2p_comm=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _layer_spec(config, backend: str, vp_stage, options):
    # under sequence parallelism Megatron's torch norm (the local modules' without Apex) is swapped for one
    # that runs on a rank's shard of the sequence (megatron_cp.megatron.specs.sequence_parallel_norms)
    return sequence_parallel_norms(get_llama_layer_spec(backend, options=options), config, vp_stage)


def build_llama(shape: LlamaShape, config=None, backend: str = "local", pre_process=True, post_process=True,
                vp_stage: int | None = None, options=None):
    """GPTModel with ``get_llama_layer_spec`` and megatron-cp RoPE installed (``rope.install``).

    ``pre_process`` / ``post_process`` / ``vp_stage``: the pipeline stage's (virtual) model chunk, as
    Megatron's ``get_model`` builds it. With ``config.sequence_parallel`` on the local backend the norms are
    ``megatron_cp.megatron.norms.SequenceParallelTorchNorm``. ``options``: the run's ``PlanOptions`` (or their
    ``LayerOptions``), whose kernel backend, strategy and sparse selectors the attention layers bind.
    """
    options = getattr(options, "layer", options)
    from megatron.core.models.gpt import GPTModel

    config = config or transformer_config(shape)
    model = GPTModel(
        config, _layer_spec(config, backend, vp_stage, options), vocab_size=shape.vocab_size,
        max_sequence_length=shape.seq_length, pre_process=pre_process, post_process=post_process,
        position_embedding_type="rope", rotary_base=shape.rotary_base,
        share_embeddings_and_output_weights=False, vp_stage=vp_stage,
    )
    model._megatron_cp_rope = rope.install(model)
    # every parameter in the training dtype, as Megatron's Float16Module casts the model under --bf16 (its local
    # norms build fp32 weights, which then meet bf16 activations: an unfused rms_norm and a warning per call);
    # parameters only: the plan RoPE's frequencies stay fp32
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != config.params_dtype:
            p.data = p.data.to(config.params_dtype)
    return model


def build_pipeline_stage(shape: LlamaShape, config=None, backend: str = "local", options=None) -> list:
    """This pipeline rank's model chunks, as Megatron's ``get_model`` builds them: one chunk, or one per
    virtual stage (``virtual_pipeline_model_parallel_size`` of the process groups); the first chunk of the
    first stage embeds, the last chunk of the last stage has the output layer. Each chunk's layers carry
    their global ``layer_number``. ``options``: as ``build_llama``'s."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    config = config or transformer_config(shape)
    chunks = []
    for v in range(vpp or 1):
        vp = None if vpp is None else v
        chunks.append(build_llama(shape, config, backend,
                                  pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                                  post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                                  vp_stage=vp, options=options))
    return chunks


def full_param_name(chunk, name: str) -> str:
    """A chunk's parameter name in the whole (PP = 1) model: layers renumbered by their global
    ``layer_number``, which a pipeline stage's chunk keeps while indexing its layers from 0."""
    if not name.startswith("decoder.layers."):
        return name
    _, _, j, rest = name.split(".", 3)
    return f"decoder.layers.{chunk.decoder.layers[int(j)].layer_number - 1}.{rest}"


def tp_shard(name: str, full: torch.Tensor, param, tp_rank: int, tp_size: int, glu: bool):
    """The TP shard of a full (TP = 1) tensor for the parameter ``param`` of a TP model."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if glu and name.endswith("mlp.linear_fc1.weight"):
        # Megatron's SwiGLU: each TP rank holds [gate_r; up_r] of its slice of the FFN
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], 0)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def tp_gather(name: str, local: torch.Tensor, param, tp_group, glu: bool):
    """Inverse of ``tp_shard``: the full tensor from every TP rank's shard."""
    import torch.distributed as dist

    tp_size = dist.get_world_size(tp_group)
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return local
    parts = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(parts, local.contiguous(), group=tp_group)
    if glu and name.endswith("mlp.linear_fc1.weight"):
        gates = [p.chunk(2, 0)[0] for p in parts]
        ups = [p.chunk(2, 0)[1] for p in parts]
        return torch.cat(gates + ups, 0)
    return torch.cat(parts, dim=param.partition_dim)


def load_full_state(chunks, full: dict) -> None:
    """Copy a whole-model state (``{name: tensor}`` of the TP = 1, PP = 1 model) into this rank's chunks:
    each parameter gets its pipeline stage's layer and its TP shard, cast to the parameter's dtype."""
    from megatron.core import parallel_state as ps

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for c in chunks:
            for k, p in c.named_parameters():
                name = full_param_name(c, k)
                if name not in full:
                    raise KeyError(f"parameter {name!r} is not in the whole-model state")
                p.copy_(tp_shard(name, full[name], p, tp_rank, tp_size, glu=c.config.gated_linear_unit))
