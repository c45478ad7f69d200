"""MLA and large heads: a v head dim of its own (DeepSeek MLA: q/k 192, v 128) and head dim 256 through
megatron-cp's runtime (K/V exchanged side by side with their own head dims, partials merged at v's) on the
reference and Triton backends (CPU interpreter, small stand-in dims: 48/32 exercises the padded q/k dim
like 192/128), against a dense fp64 reference (``reference.dense_attention``), forward and backward,
CP 1 and 2 (gloo, spawned ranks, one spawn per world size); strategies that cannot refuse by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp import masks as M
from megatron_cp.testing import run_ranks

from _dist import assert_errors_within
from reference import dense_attention

S = 37


def mla_case(rank, world, mask, dk, dv, backend, dtype, hq=4, hkv=2, stages=None, sink=False, plan=None):
    """Max abs errors of this rank's out, lse, dq, dk, dv (and the summed dsink) against fp64."""
    gen = torch.Generator().manual_seed(11 + dk + dv)
    q = torch.randn(S, hq, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(S, hkv, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(S, hkv, dv, generator=gen, dtype=torch.float64)
    do = torch.randn(S, hq, dv, generator=gen, dtype=torch.float64)
    sk = torch.randn(hq, generator=gen, dtype=torch.float64) if sink else None
    scale = 0.2
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sk.clone().requires_grad_()] if sink else [])
    ro, rl = dense_attention(*leaves[:3], torch.as_tensor(mask.to_dense()), scale, leaves[3] if sink else None)
    (ro * do).sum().backward()
    plan = plan if plan is not None else mcp.plan(mask, world)
    group = dist.group.WORLD if world > 1 else None
    ids = torch.from_numpy(plan.local_ids(rank))
    ls = [mcp.dispatch(t.to(dtype), plan, group).detach().requires_grad_() for t in (q, k, v)]
    o, l = mcp.attention(*ls, plan, group, softmax_scale=scale, backend=backend, stages=stages)
    s_t = None
    if sink:
        s_t = sk.to(dtype).requires_grad_()
        o, l = mcp.apply_sink(o, l, s_t)
    assert o.shape == (len(ids), hq, dv) and o.dtype == dtype
    (o.double() * do[ids]).sum().backward()
    fin = torch.isfinite(rl[ids])
    errs = {"out": float((o.detach().double() - ro.detach()[ids]).abs().max()),
            "lse": float((l.detach().double()[fin] - rl.detach()[ids][fin]).abs().max())}
    for n, a, ref in zip(("dq", "dk", "dv"), ls, leaves):
        errs[n] = float((a.grad.double() - ref.grad[ids]).abs().max())
    if sink:
        g = s_t.grad.double()
        if group is not None:
            dist.all_reduce(g, group=group)
        errs["dsink"] = float((g - leaves[3].grad).abs().max())
    return errs


def _cases(rank, world):
    """Runtime cases at CP 1 (in every process, no group) and CP = world."""
    torch.set_num_threads(1)
    masks = {"causal": M.causal(S), "packed": M.varlen([0, 6, 19, 20, S], causal=True)}
    res = {}
    for cp in (1, world):
        r = rank if cp > 1 else 0
        for name, mask in masks.items():
            res[(cp, name, "reference")] = mla_case(r, cp, mask, 24, 16, "reference", torch.float64)
        res[(cp, "packed", "reference", "sink")] = mla_case(r, cp, masks["packed"], 24, 16, "reference",
                                                            torch.float64, sink=True)
    res[("packed", "staged")] = mla_case(rank, world, masks["packed"], 24, 16, "reference", torch.float64, stages=1)
    res[("packed", "single")] = mla_case(rank, world, masks["packed"], 24, 16, "reference", torch.float64, stages=0)
    plan = mcp.plan(masks["causal"], world, guest_rows=[[S - 5, S]])
    res[("causal", "guests")] = mla_case(rank, world, masks["causal"], 24, 16, "reference", torch.float64, plan=plan)
    # Triton (CPU interpreter), staged: q/k 48 padded to a 64 block beside v 32 (MLA's 192 / 128 in
    # miniature), K/V as strided views of the exchanged rows
    res[("causal", "triton", "staged")] = mla_case(rank, world, masks["causal"], 48, 32, "triton", torch.float32,
                                                   stages=1)
    return res


def test_fa4_backend_value_head_dim_emulated():
    """FA4Backend's calls with q/k 48 and v 32 through the emulated FA4 (tests/fa4_semantics.py, FA4's call
    semantics in fp64 on the CPU): forward, forward_accumulate, backward with an lse gradient and
    backward_into against fp64 autograd; and the head-dim pairs FA4 itself cannot run go to Triton with
    the reason (sm100 runs (192, 128) only)."""
    import fa4_semantics

    from megatron_cp.kernels import CAUSAL, FULL
    from megatron_cp.kernels.fa4.backend import FA4Backend, Fa4Functions, fa4_head_dims_reason
    from megatron_cp.masks.catalog import tiles_to_dense

    be = FA4Backend(functions=Fa4Functions(fa4_semantics.fwd, fa4_semantics.bwd, "reference", (torch.float64,)))
    tiles = torch.tensor([[0, 13, 0, 13, CAUSAL], [14, 40, 14, 40, CAUSAL], [14, 40, 0, 5, FULL]], dtype=torch.int32)
    prep = be.prepare(tiles, 40, 40)
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(40, 4, 48, generator=gen, dtype=torch.float64), torch.randn(40, 2, 48, generator=gen, dtype=torch.float64)
    v, do = torch.randn(40, 2, 32, generator=gen, dtype=torch.float64), torch.randn(40, 4, 32, generator=gen, dtype=torch.float64)
    dl = torch.randn(40, 4, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ro, rl = dense_attention(*leaves, tiles_to_dense(tiles, 40, 40), 0.3)
    fin = torch.isfinite(rl)
    ((ro * do).sum() + (torch.where(fin, rl, 0) * dl).sum()).backward()
    out, lse = be.forward(q, k, v, prep, 0.3)
    assert be.last_path == "fa4" and out.shape == (40, 4, 32)
    assert (out - ro.detach()).abs().max() < 1e-10 and (lse[fin] - rl.detach()[fin]).abs().max() < 1e-6
    acc, run = torch.zeros(40, 4, 32, dtype=torch.float64), torch.full((40, 4), float("-inf"), dtype=torch.float64)
    be.forward_accumulate(q, k, v, prep, 0.3, acc, run)
    assert (acc - ro.detach()).abs().max() < 1e-10
    delta = (do * out).sum(-1) - torch.where(fin, dl, 0)
    grads = be.backward(q, k, v, out, lse, do, prep, 0.3, delta)
    sums = [torch.zeros_like(t) for t in (q, k, v)]
    be.backward_into(q, k, v, out, lse, do, prep, 0.3, delta, *sums)
    for g, s, r in zip(grads, sums, leaves):
        assert be.last_path == "fa4" and (g - r.grad).abs().max() < 1e-6 and (s - r.grad).abs().max() < 1e-6
    assert fa4_head_dims_reason(192, 128, 10) is None and fa4_head_dims_reason(192, 128, 9) is None
    assert "sm100" in fa4_head_dims_reason(256, 128, 10) and "v head_dim" in fa4_head_dims_reason(192, 12, 9)
    # measured on an H100: FA4's sm90 backward asserts head_dim == head_dim_v under GQA
    assert "GQA" in fa4_head_dims_reason(192, 128, 9, phase="bwd", gqa=True)
    assert fa4_head_dims_reason(192, 128, 9, phase="bwd", gqa=False) is None


# -- Megatron's MLASelfAttention with CPCoreAttention in its core_attention slot ----------------------------
def _mla_module(rope: str, pg_collection=None, seed=0):
    """A tiny MLASelfAttention (4 heads, q/k head dim 32 + 16 rotary = 48, v head dim 16: MLA's 192 / 128 in
    miniature) with local linear layers and CPCoreAttention; YaRN with scaling 4 when ``rope == 'yarn'``."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_cp.megatron import CPCoreAttention

    yarn = rope == "yarn"
    cfg = MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32,
                               qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=16, rope_type=rope,
                               use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
                               rotary_scaling_factor=4.0 if yarn else 1.0, original_max_position_embeddings=16,
                               mscale=1.0, mscale_all_dim=1.0 if yarn else 0.0,
                               context_parallel_size=pg_collection.cp.size() if pg_collection is not None else 1)
    sub = MLASelfAttentionSubmodules(linear_q_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear,
                                     linear_kv_up_proj=ColumnParallelLinear, core_attention=CPCoreAttention,
                                     linear_proj=RowParallelLinear, q_layernorm=IdentityOp, kv_layernorm=IdentityOp)
    torch.manual_seed(seed)
    return MLASelfAttention(cfg, sub, layer_number=1, attn_mask_type=AttnMaskType.causal, pg_collection=pg_collection)


@pytest.fixture
def megatron_world1(monkeypatch):
    """Megatron parallel state on a one-rank gloo group; Megatron's own rotary tables land on the CPU."""
    from megatron.core import parallel_state as ps

    from megatron_cp.testing import free_port

    was = dist.is_initialized()
    if not was:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, context_parallel_size=1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    yield
    ps.destroy_model_parallel()
    if not was:
        dist.destroy_process_group()


@pytest.mark.parametrize("rope", ["rope", "yarn"])
def test_mla_with_cp_core_attention_matches_megatrons_own_rotary(rope, megatron_world1):
    """CP = 1, one causal sequence: MLASelfAttention with CPParams (our angles at the plan's positions,
    install_mla, MLA's packed [s, H, D] path) equals the same module without (Megatron's own rotary and
    YaRN mscale, the [s, b, H, D] path); other relative positions change it (the angles are in play)."""
    from megatron_cp.megatron import CPParams
    from megatron_cp.megatron.mla import PlanMLARotary, install_mla

    m = _mla_module(rope)
    x = torch.randn(24, 1, 64, generator=torch.Generator().manual_seed(1))
    ref, _ = m(x, None)
    handle = install_mla(m)
    assert isinstance(m.rotary_pos_emb, PlanMLARotary) and m.core_attention.v_head_dim == 16
    plan = mcp.plan(M.causal(24), 1)
    out, _ = m(x, None, packed_seq_params=CPParams(plan=plan, position_ids=torch.arange(24)[None], cp_rank=0))
    scale = float(ref.detach().abs().max())  # tiny-init outputs (~1e-2): errors relative to it
    assert out.shape == ref.shape and float((out - ref).detach().abs().max()) <= 1e-6 * scale
    spread, _ = m(x, None, packed_seq_params=CPParams(plan=plan, position_ids=torch.arange(24)[None] * 2, cp_rank=0))
    assert float((spread - ref).detach().abs().max()) > 1e-3 * scale
    handle.remove()
    assert not isinstance(m.rotary_pos_emb, PlanMLARotary)


def _mla_cp_cases(rank, world):
    """MLASelfAttention at CP = world against the same module at CP = 1 (a one-rank CP group) on packed
    documents (positions restart per document): outputs of the local rows, input gradients and every
    parameter's gradient (summed over CP ranks) within 1e-5, for rope and YaRN."""
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_cp.megatron import CPParams
    from megatron_cp.megatron.mla import install_mla

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, context_parallel_size=world)
    torch.cuda.current_device = lambda: "cpu"  # this spawned process only
    # YaRN's constructor caches Megatron's own CP-sliced table, slicing with an index made on CUDA;
    # install_mla's angles never read that cache
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

    yarn.get_pos_emb_on_this_cp_rank = lambda emb, seq_dim, cp_group: emb
    singles = [dist.new_group([r]) for r in range(world)]
    cp_pg = ProcessGroupCollection.use_mpu_process_groups()
    one_pg = ProcessGroupCollection.use_mpu_process_groups()
    one_pg.cp = singles[rank]
    S = 40
    cu = np.array([0, 9, 26, S])
    mask = M.varlen(cu, causal=True)
    pos = torch.from_numpy(np.concatenate([np.arange(b - a) for a, b in zip(cu[:-1], cu[1:])]))
    x = torch.randn(S, 1, 64, generator=torch.Generator().manual_seed(2))
    dout = torch.randn(S, 1, 64, generator=torch.Generator().manual_seed(3))
    res = {}
    for rope in ("rope", "yarn"):
        got = []
        for pg, w in ((cp_pg, world), (one_pg, 1)):
            m = _mla_module(rope, pg)
            install_mla(m)
            plan = mcp.plan(mask, w)
            ids = torch.from_numpy(plan.local_ids(rank if w > 1 else 0))
            xl = x[ids].clone().requires_grad_()
            out, _ = m(xl, None, packed_seq_params=CPParams(plan=plan, position_ids=pos[ids][None], cp_rank=rank if w > 1 else 0))
            (out * dout[ids]).sum().backward()
            # (linear_proj's bias is returned apart, skip_bias_add: not in this loss)
            grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
            if w > 1:
                for g in grads.values():
                    dist.all_reduce(g, group=pg.cp)
            got.append((ids, out.detach(), xl.grad, grads))
        (ids, o, gx, g), (_, o1, gx1, g1) = got
        rel = lambda a, b: float((a - b).abs().max()) / float(b.abs().max())  # noqa: E731  (tiny-init scales)
        errs = {"out": rel(o, o1[ids]), "dx": rel(gx, gx1[ids])}
        errs.update({n: rel(g[n], g1[n]) for n in g1})
        assert len(g1) >= 4 and all(float(t.abs().max()) > 0 for t in g1.values())
        res[rope] = errs
    return res


def _gpt_mla_cases(rank, world, softmax_type):
    """A 2-layer GPTModel with MLA (YaRN) from Megatron's local spec with core attention swapped
    (specs.swap_core_attention) and install_mla, packed documents through prepare_batch: CP = world against
    the same model at CP = 1 in every process (loss and every parameter gradient, summed over CP ranks)."""
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_helpers import EOD, make_global_batch
    from megatron_cp.megatron import batch as B
    from megatron_cp.megatron.mla import install_mla
    from megatron_cp.megatron.specs import swap_core_attention

    torch.cuda.current_device = lambda: "cpu"  # this spawned process only (see _mla_cp_cases)
    yarn.get_pos_emb_on_this_cp_rank = lambda emb, seq_dim, cp_group: emb
    tokens, labels, lm = make_global_batch(1, 48, seed=4, packed=True)
    res = {}
    for cp in (world, 1):
        ps.destroy_model_parallel()
        # CP = 1 inside a world of `world` ranks: data parallel over the rest (each rank the whole batch)
        ps.initialize_model_parallel(1, 1, context_parallel_size=cp)
        cfg = MLATransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, q_lora_rank=None,
                                   kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=16,
                                   rope_type="yarn", rotary_scaling_factor=4.0, original_max_position_embeddings=16,
                                   mscale=1.0, mscale_all_dim=1.0, ffn_hidden_size=128, normalization="RMSNorm",
                                   use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
                                   context_parallel_size=cp, softmax_type=softmax_type)
        spec = swap_core_attention(get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm"))
        torch.manual_seed(5)
        model = GPTModel(cfg, spec, vocab_size=320, max_sequence_length=48, position_embedding_type="rope")
        install_mla(model)
        group = ps.get_context_parallel_group() if cp > 1 else None
        bt = B.prepare_batch(tokens, labels, lm, B.MaskSpec("packed", eod=EOD), group)
        out = model(bt.tokens, bt.position_ids, None, labels=bt.labels, packed_seq_params=bt.params)
        num, den = (out * bt.loss_mask).sum(), bt.loss_mask.sum()
        if group is not None:  # the CP ranks' partial sums make the micro-batch's loss
            pair = torch.stack([num.detach(), den.detach()])
            dist.all_reduce(pair, group=group)
            loss_value = float(pair[0] / pair[1])
            (num / pair[1]).backward()
        else:
            loss_value = float(num / den)
            (num / den).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if group is not None:
            for g in grads.values():
                dist.all_reduce(g, group=group)
        res[cp] = (loss_value, grads)
    (loss, g), (loss1, g1) = res[world], res[1]
    rel = {n: float((g[n] - g1[n]).abs().max()) / float(g1[n].abs().max()) for n in g1}
    return {"loss": abs(loss - loss1) / abs(loss1), "n_grads": len(g1), "worst": max(rel.values()),
            "where": max(rel, key=rel.get)}


def _all_cp_cases(rank, world):
    return {"runtime": _cases(rank, world), "module": _mla_cp_cases(rank, world),
            "gpt": _gpt_mla_cases(rank, world, "learnable")}


def test_mla_cp2_equals_cp1_and_fp64():
    """One spawn of 2 gloo ranks: the runtime with a v head dim of its own at CP 1 and 2 against fp64
    (reference and Triton backends, both exchange paths, guest rows, a sink); MLASelfAttention at CP 2 against
    CP 1 (rope, YaRN); a 2-layer GPTModel with MLA and learnable sinks at CP 2 against CP 1 (loss and every
    parameter gradient; MLA without sinks: the module cases)."""
    for r in run_ranks(_all_cp_cases, 2):
        assert_errors_within([r["runtime"]])
        for rope, errs in r["module"].items():
            bad = {n: e for n, e in errs.items() if e > 1e-5}
            assert not bad, (rope, bad)
        g = r["gpt"]
        assert g["n_grads"] >= 10 and g["loss"] <= 1e-6 and g["worst"] <= 1e-5, g
