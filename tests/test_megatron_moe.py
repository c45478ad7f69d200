"""MoE layers beside megatron-cp attention: a tiny MoE GPTModel (4 experts, top-2) built with our spec
(``megatron_cp_layer_spec``: Megatron's own MoE block spec, core attention swapped) trains at CP 2 exactly
like at CP 1 (fp32: loss and every gradient within 1e-5), for causal and packed-with-EOD masks, without
and with Megatron's load-balancing aux loss.

Routing is per token, so the CP layout does not change which experts a token reaches (dropless: no
capacity factor). The aux loss counts tokens per expert over the TP x CP group, and its gradient is
scaled on each rank by ``local tokens * cp size`` (``Router.attach_and_log_load_balancing_loss``): exact
when every CP rank holds the same number of tokens. Our plans do (they balance attention work over
equal token shares; Megatron requires ``--seq-length`` to be a multiple of ``2 * cp``), which the
test checks, so the aux-loss gradients match too.

One spawn of 2 gloo processes runs every case.
"""

from __future__ import annotations

import pytest
import torch

from megatron_helpers import EOD, make_global_batch, rel_err

TOL = 1e-5
S, G, MBS = 48, 2, 2
MASKS = ["causal", "packed"]
AUX = 1e-2


def _config(aux: float):
    from tiny_llama.model import LlamaShape, transformer_config

    shape = LlamaShape(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=48, vocab_size=320, seq_length=S)
    cfg = transformer_config(shape, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                             moe_aux_loss_coeff=aux, transformer_impl="local")
    return shape, cfg


def _build(aux: float):
    from megatron.core.models.gpt import GPTModel

    from megatron_cp.megatron import rope
    from megatron_cp.megatron.specs import megatron_cp_layer_spec

    shape, cfg = _config(aux)
    model = GPTModel(cfg, megatron_cp_layer_spec(cfg), vocab_size=shape.vocab_size, max_sequence_length=S,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    model._megatron_cp_rope = rope.install(model)
    return model


def _step(model, batch, spec, dp_rank=0, dp_size=1):
    """One forward/backward; returns (global token-mean loss, every parameter gradient scaled by the global count)."""
    from megatron_cp.megatron.batch import PlanOptions
    from tiny_llama import trainer

    model.zero_grad(set_to_none=True)
    s, n = trainer.forward_backward(model, trainer.dp_shard(batch, dp_rank, dp_size, MBS), spec, PlanOptions())
    # the CP 1 reference runs the whole batch on every rank (DP 2 of identical shares): the DP sum and
    # the doubled token count cancel
    loss = trainer.reduce_and_scale(model, s, n).loss
    return loss, {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _worker(rank, world):
    from megatron_cp.megatron.batch import MaskSpec, prepare_batch
    from tiny_llama import trainer

    torch.set_num_threads(1)
    # Megatron's router moves its weight to torch.cuda.current_device() on its first call (router.py,
    # TopKRouter.gating); this CPU-only worker points that at the CPU
    torch.cuda.current_device = lambda: "cpu"
    report, no_aux = [], {}
    for aux in (0.0, AUX):
        for mask in MASKS:
            spec = MaskSpec(mask, eod=EOD if mask == "packed" else None)
            batch = make_global_batch(G, S, seed=11, packed=mask == "packed")
            trainer.init_parallel(1, 1)
            torch.manual_seed(5)
            ref = _build(aux)
            weights = {k: p.detach().clone() for k, p in ref.named_parameters()}
            from megatron.core import parallel_state as ps

            ref_loss, ref_g = _step(ref, batch, spec)
            router_g = {k: v for k, v in ref_g.items() if "router" in k}
            kinds = sorted({type(m).__name__ for m in ref.modules()})
            del ref
            trainer.init_parallel(1, world)
            model = _build(aux)
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p.copy_(weights[k])
            loss, g = _step(model, batch, spec, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
            router = {k: rel_err(g[k], ref_g[k]) for k in g if "router" in k}
            others = max(rel_err(g[k], ref_g[k]) for k in g if "router" not in k)
            ids = prepare_batch(*batch, spec, ps.get_context_parallel_group()).tokens.numel()
            counts = [None] * world
            torch.distributed.all_gather_object(counts, ids)
            if aux == 0.0:
                no_aux[mask] = router_g
            effect = max(rel_err(router_g[k], no_aux[mask][k]) for k in router_g)
            report.append(dict(aux=aux, mask=mask, local_tokens=counts, aux_effect=effect, loss_err=abs(loss - ref_loss) / abs(ref_loss), others=others,
                               router=max(router.values()), kinds=kinds, missing=sorted(set(ref_g) ^ set(g))))
    return report


@pytest.fixture(scope="module")
def moe_report():
    from tiny_llama.trainer import spawn

    return spawn(_worker, 2)


@pytest.mark.parametrize("mask", MASKS)
def test_moe_cp2_matches_cp1(moe_report, mask):
    (r,) = [r for r in moe_report if r["aux"] == 0.0 and r["mask"] == mask]
    assert "MoELayer" in r["kinds"] and "CPCoreAttention" in r["kinds"], r["kinds"]
    assert not r["missing"], r["missing"]
    assert r["loss_err"] <= TOL, r
    assert r["others"] <= TOL and r["router"] <= TOL, r


@pytest.mark.parametrize("mask", MASKS)
def test_moe_aux_loss_cp2_matches_cp1(moe_report, mask):
    (r,) = [r for r in moe_report if r["aux"] == AUX and r["mask"] == mask]
    assert len(set(r["local_tokens"])) == 1, f"CP ranks hold {r['local_tokens']} tokens: the aux-loss scaling needs equal"
    assert r["aux_effect"] > 1e-3, "the aux loss did not change the router's gradient: nothing was tested"
    assert r["loss_err"] <= TOL and r["others"] <= TOL and r["router"] <= TOL, r

