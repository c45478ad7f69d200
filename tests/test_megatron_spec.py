"""Our ``--spec`` keeps the user's model: Megatron's ``GPTModelBuilder`` with ``megatron_cp_layer_spec``
builds the same modules and parameters as with Megatron's own spec (no ``--spec``), for dense, MoE,
mixed MoE/dense and qk-layernorm configurations; only the self-attention core attention differs
(``CPCoreAttention`` in place of ``DotProductAttention``)."""

from __future__ import annotations

import pytest
import torch



CASES = {
    "dense": {},
    "moe": dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48),
    "moe_every_other_layer": dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_layer_freq=[1, 0]),
    "moe_shared_expert_qk_norm": dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                                      moe_shared_expert_intermediate_size=32, qk_layernorm=True),
}


def _build(overrides, ours: bool):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig

    from megatron_cp.megatron.specs import megatron_cp_layer_spec
    from tiny_llama.model import LlamaShape, transformer_config

    shape = LlamaShape(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=48, vocab_size=320, seq_length=48)
    cfg = transformer_config(shape, transformer_impl="local", **overrides)
    mcfg = GPTModelConfig(transformer=cfg, vocab_size=shape.vocab_size, seq_length=shape.seq_length,
                          position_embedding_type="rope",
                          transformer_layer_spec=megatron_cp_layer_spec if ours else None)
    torch.manual_seed(0)
    return GPTModelBuilder(mcfg).build_model(ProcessGroupCollection.use_mpu_process_groups(), True, True)


def _modules(model):
    """{name: class name} of every module, without the core attention's own children (Megatron's
    DotProductAttention has a softmax and a dropout module; ours has none)."""
    return {name: type(m).__name__ for name, m in model.named_modules() if ".core_attention." not in name}


@pytest.mark.parametrize("case", sorted(CASES))
def test_our_spec_builds_megatrons_model_with_only_core_attention_swapped(world1, case):
    import megatron_helpers  # noqa: F401  (examples/ on sys.path)

    ours, theirs = _build(CASES[case], True), _build(CASES[case], False)
    params = lambda m: {k: tuple(p.shape) for k, p in m.named_parameters()}  # noqa: E731
    assert params(ours) == params(theirs)
    n = sum(p.numel() for p in ours.parameters())
    assert n == sum(p.numel() for p in theirs.parameters())
    mo, mt = _modules(ours), _modules(theirs)
    assert mo.keys() == mt.keys()
    diff = {k: (mt[k], mo[k]) for k in mo if mo[k] != mt[k]}
    assert diff == {f"decoder.layers.{i}.self_attention.core_attention": ("DotProductAttention", "CPCoreAttention")
                    for i in range(2)}, diff
    if "moe" in case:
        mlps = [type(layer.mlp).__name__ for layer in ours.decoder.layers]
        assert mlps == (["MoELayer", "MLP"] if "every_other" in case else ["MoELayer", "MoELayer"])
        dense = sum(p.numel() for p in _build({}, True).parameters())
        assert n > dense  # the experts are there: an MoE model is not silently made dense


def test_spec_does_not_mutate_megatrons_and_refuses_unknown_core_attention():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_cp.megatron import CPCoreAttention
    from megatron_cp.megatron.specs import swap_core_attention

    base = get_gpt_layer_local_spec(normalization="RMSNorm")
    core = base.submodules.self_attention.submodules.core_attention
    ours = swap_core_attention(base)
    assert ours.submodules.self_attention.submodules.core_attention.module is CPCoreAttention
    assert base.submodules.self_attention.submodules.core_attention is core
    base.submodules.self_attention.submodules.core_attention = IdentityOp
    with pytest.raises(ValueError, match="IdentityOp"):
        swap_core_attention(base)
