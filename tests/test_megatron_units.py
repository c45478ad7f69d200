"""Unit tests of the Megatron adapter on one process: batch hook, masks vs Megatron's own
``get_ltor_masks_and_position_ids``, RoPE vs Megatron's frequencies, install/remove, loss, flags, and
a whole Llama GPTModel with CPCoreAttention vs Megatron's DotProductAttention (CP=1)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from megatron_helpers import EOD, make_global_batch, rel_err

from megatron_cp.megatron import batch as B


def megatron_ltor(tokens):
    from megatron.training.utils.common_utils import get_ltor_masks_and_position_ids

    # pad_token = eod: this version ANDs the eod and pad index lists, so they must coincide
    return get_ltor_masks_and_position_ids(tokens, EOD, EOD, True, True, False, False)


# ---------------------------------------------------------------- batch hook
def test_document_bounds_and_positions_match_megatron_reset_semantics():
    tokens, _, _ = make_global_batch(3, 40, seed=3, packed=True)
    tokens[1, -1] = EOD  # EOD as last token of a sample
    spec = B.MaskSpec("packed", eod=EOD)
    cu = B.document_bounds(tokens.numpy(), spec)
    assert cu[0] == 0 and cu[-1] == 120 and {0, 40, 80, 120} <= set(cu.tolist())
    attn_mask, _, pos = megatron_ltor(tokens)
    ours = B.positions_from_bounds(cu).reshape(3, 40)
    np.testing.assert_array_equal(ours, pos.numpy())
    # the mask over the concatenation is block-diagonal with each sample's Megatron mask on the diagonal
    dense = B.build_mask(spec, cu, 3, 40).to_dense()
    for i in range(3):
        blk = dense[i * 40:(i + 1) * 40, i * 40:(i + 1) * 40]
        np.testing.assert_array_equal(blk, ~attn_mask[i, 0].numpy())
    off = dense.copy()
    for i in range(3):
        off[i * 40:(i + 1) * 40, i * 40:(i + 1) * 40] = False
    assert not off.any(), "samples of a micro-batch must not see each other"


def test_causal_ignores_eod_and_window_masks():
    tokens, _, _ = make_global_batch(2, 16, seed=1, packed=True)
    cu = B.document_bounds(tokens.numpy(), B.MaskSpec("causal"))
    np.testing.assert_array_equal(cu, [0, 16, 32])
    np.testing.assert_array_equal(B.positions_from_bounds(cu), np.r_[np.arange(16), np.arange(16)])
    d = B.build_mask(B.MaskSpec("sliding_window", window=3), cu, 2, 16).to_dense()
    i, j = np.nonzero(d[:16, :16])
    assert ((i - j) <= 3).all() and ((i - j) >= 0).all() and d[5, 2] and not d[5, 1]


def test_builder_mask_is_block_diagonal_over_samples():
    import megatron_cp as mcp

    spec = B.MaskSpec("block_causal", kwargs=(("block", 4),))
    cu = np.array([0, 16, 32])
    d = B.build_mask(spec, cu, 2, 16).to_dense()
    one = mcp.masks.block_causal(16, 4).to_dense()
    np.testing.assert_array_equal(d[:16, :16], one)
    np.testing.assert_array_equal(d[16:, 16:], one)
    assert not d[:16, 16:].any() and not d[16:, :16].any()


@pytest.mark.parametrize("kw,match", [
    (dict(name="nope"), "unknown mask 'nope'"),
    (dict(name="sliding_window"), "window"),
    (dict(name="packed"), "EOD"),
])
def test_mask_spec_errors_name_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        B.MaskSpec(**kw)


def test_prepare_batch_single_rank_keeps_everything():
    tokens, labels, lm = make_global_batch(2, 24, seed=5, packed=True)
    bt = B.prepare_batch(tokens, labels, lm, B.MaskSpec("packed", eod=EOD), None)
    assert bt.tokens.shape == (1, 48)
    assert sorted(bt.tokens[0].tolist()) == sorted(tokens.reshape(-1).tolist())
    assert bt.params.plan.cp_size == 1 and bt.params.max_seqlen_q == 48
    assert bt.params.qkv_format == "sbhd"
    with pytest.raises(ValueError, match="tokens must be"):
        B.prepare_batch(tokens[0], None, None, B.MaskSpec("causal"), None)
    with pytest.raises(ValueError, match="labels shape"):
        B.prepare_batch(tokens, labels[:, :3], None, B.MaskSpec("causal"), None)


# ---------------------------------------------------------------- RoPE
def test_plan_rope_angles_equal_megatron_frequencies():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_cp.megatron.rope import PlanRotaryEmbedding

    src = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=500000, rope_scaling=True,
                          use_cpu_initialization=True)
    ours = PlanRotaryEmbedding(src)
    pos = torch.tensor([[5, 0, 1, 2, 9, 3]])
    got = ours.angles(pos)
    freqs = src.get_freqs_non_repeated(10)  # Megatron's table (no CUDA move on this path)
    want = torch.cat([freqs, freqs], -1)[pos[0]][:, None, None, :]
    assert got.shape == (6, 1, 1, 16)
    torch.testing.assert_close(got, want)


def test_install_swaps_and_remove_restores(world1):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from tiny_llama.model import LlamaShape, transformer_config
    from megatron_cp.megatron.rope import PlanRotaryEmbedding, install
    from megatron_cp.megatron.specs import get_llama_layer_spec
    from megatron.core.models.gpt import GPTModel

    shape = LlamaShape(1, 32, 4, 2, 48, 320, 16)
    m = GPTModel(transformer_config(shape), get_llama_layer_spec("local"), 320, 16, position_embedding_type="rope")
    original = m.rotary_pos_emb
    n_hooks = len(m._forward_pre_hooks) + len(m._forward_hooks)
    h = install(m)
    assert isinstance(m.rotary_pos_emb, PlanRotaryEmbedding)
    assert "rotary_pos_emb.inv_freq" not in m.state_dict()
    with pytest.raises(RuntimeError, match="no positions"):
        m.rotary_pos_emb(16)
    h.remove()
    assert m.rotary_pos_emb is original and type(original) is RotaryEmbedding
    assert len(m._forward_pre_hooks) + len(m._forward_hooks) == n_hooks
    m2 = GPTModel(transformer_config(shape), get_llama_layer_spec("local"), 320, 16,
                  position_embedding_type="learned_absolute")
    with pytest.raises(ValueError, match="no RotaryEmbedding"):
        install(m2)


# ---------------------------------------------------------------- loss, spec, flags
def test_loss_func_sums_and_counts():
    from megatron_cp.megatron import loss_func

    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    loss, n, rep = loss_func(mask, losses)
    assert float(loss) == 8.0 and int(n) == 3 and rep["lm loss"].tolist() == [8.0, 3.0]


def test_loss_func_keeps_megatrons_nan_inf_and_spiky_checks(monkeypatch):
    from megatron_cp.megatron import loss_func

    # Megatron's rejection message names the CUDA device; this CPU test gives it one
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    mask = torch.ones(1, 3)
    for bad, what in ((float("nan"), "NaN"), (float("inf"), "Inf")):
        out = torch.tensor([[1.0, bad, 2.0]])
        with pytest.raises(RuntimeError, match=f"found {what} in local forward loss"):
            loss_func(mask, out, check_nan=True)
        loss, n, _ = loss_func(mask, out)  # checks off (--no-check-for-nan-in-loss-and-grad): no error
        assert int(n) == 3
    loss, n, _ = loss_func(mask, torch.tensor([[1.0, 2.0, 3.0]]), check_nan=True, check_spiky=True)
    assert float(loss) == 6.0


def test_packed_documents_feed_megatrons_flops_accounting(world1):
    from megatron.training.training import consume_seqlen_stats_in_iteration, num_floating_point_operations

    from megatron_cp.megatron.loss import record_documents

    class Chunk(torch.nn.Module):
        def __init__(self, vp_stage):
            super().__init__()
            self.vp_stage = vp_stage

    class Wrapper(torch.nn.Module):  # like DDP / Float16Module: the model under .module
        def __init__(self, m):
            super().__init__()
            self.module = m

    assert consume_seqlen_stats_in_iteration() == (None, None)
    record_documents(np.array([0, 10, 32, 64]), Wrapper(Chunk(None)))
    record_documents(np.array([0, 64]), Wrapper(Chunk(0)))
    record_documents(np.array([0, 64]), Chunk(1))  # a later virtual chunk: the micro-batch is counted once
    tokens, sq = consume_seqlen_stats_in_iteration()
    assert (tokens, sq) == (128.0, 10**2 + 22**2 + 32**2 + 64**2)
    from megatron.training.arguments import add_megatron_arguments

    args = add_megatron_arguments(argparse.ArgumentParser()).parse_args(
        ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64", "--swiglu"])
    args.ffn_hidden_size, args.kv_channels, args.num_query_groups, args.padded_vocab_size = 48, 8, 4, 320
    packed = num_floating_point_operations(args, 2, seqlen_squared_sum_in_batch=sq, total_real_tokens_in_batch=tokens)
    assert packed < num_floating_point_operations(args, 2)  # attention within documents costs less than 2 x 64^2


def test_layer_spec_swaps_only_core_attention():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_cp.megatron import CPCoreAttention, LayerOptions, get_llama_layer_spec
    from megatron_cp.megatron.specs import megatron_cp_layer_spec

    ours = get_llama_layer_spec("local")
    base = get_gpt_layer_local_spec(normalization="RMSNorm")
    core = ours.submodules.self_attention.submodules.core_attention
    assert core.module is CPCoreAttention and core.params == {"options": LayerOptions()}
    assert base.submodules.self_attention.submodules.core_attention is not CPCoreAttention  # not mutated
    assert repr(ours.submodules.mlp) == repr(base.submodules.mlp)
    assert ours.submodules.self_attention.submodules.linear_qkv is base.submodules.self_attention.submodules.linear_qkv
    with pytest.raises(ValueError, match="needs the model config"):
        megatron_cp_layer_spec(None)
    with pytest.raises(ValueError, match="'fast'"):
        get_llama_layer_spec("fast")


def test_layer_spec_binds_the_runs_options():
    """The run-wide values (kernel backend, strategy, sparse selectors) are bound when the spec is built: from
    the argument, else from Megatron's parsed --cp-* flags, else the defaults; a bound spec swapped again takes
    the new binding; the options are checked there, naming the value."""
    from megatron.training import global_vars

    from megatron_cp.megatron import LayerOptions, PlanOptions, get_llama_layer_spec
    from megatron_cp.megatron.arguments import specs_from_args
    from megatron_cp.megatron.specs import swap_core_attention

    def bound(spec):
        return spec.submodules.self_attention.submodules.core_attention.params["options"]

    ring = PlanOptions(strategy="ring", kernel_backend="reference").layer
    assert bound(get_llama_layer_spec("local", options=ring)) == LayerOptions("reference", "ring", None)
    assert bound(swap_core_attention(get_llama_layer_spec("local", options=ring))) == LayerOptions()
    with pytest.raises(ValueError, match="LayerOptions.*PlanOptions"):
        get_llama_layer_spec("local", options=PlanOptions())
    with pytest.raises(ValueError, match="kernel_backend='cudnn9'"):
        LayerOptions(kernel_backend="cudnn9")
    with pytest.raises(ValueError, match="strategy='zigzag'"):
        LayerOptions(strategy="zigzag")
    args = _args("--context-parallel-impl", "ulysses", "--cp-kernel-backend", "reference",
                 "--calculate-per-token-loss")
    saved = global_vars._GLOBAL_ARGS
    global_vars._GLOBAL_ARGS = args
    try:
        assert bound(get_llama_layer_spec("local")) == specs_from_args(args, eod=0)[1].layer == \
            LayerOptions("reference", "ulysses", None)
        args.context_parallel_impl = "te"  # Megatron's own CP: our spec is not in use; nothing to read
        assert bound(get_llama_layer_spec("local")) == LayerOptions()
    finally:
        global_vars._GLOBAL_ARGS = saved


def _args(*argv):
    from megatron_cp.megatron.arguments import add_megatron_cp_args

    p = argparse.ArgumentParser()
    p.add_argument("--calculate-per-token-loss", action="store_true")
    p.add_argument("--sequence-parallel", action="store_true")
    add_megatron_cp_args(p)
    return p.parse_args(list(argv))


def test_flags_default_te_and_validate():
    from megatron_cp.megatron.arguments import specs_from_args

    assert _args().context_parallel_impl == "te"
    a = _args("--context-parallel-impl", "megatron_cp", "--calculate-per-token-loss", "--cp-mask",
              "block_causal", "--cp-mask-kwargs", '{"block": 8}', "--cp-topology", "2x4", "--cp-chunk-size", "64")
    spec, opts = specs_from_args(a, eod=7)
    assert spec.name == "block_causal" and spec.kwargs == (("block", 8),) and spec.eod == 7
    assert opts.chunk_size == 64 and opts.topology.nodes == 2 and opts.topology.gpus_per_node == 4
    assert opts.strategy == "megatron_cp"
    for name in ("ring", "ulysses", "usp", "allgather"):
        _, opts = specs_from_args(_args("--context-parallel-impl", name, "--calculate-per-token-loss"), eod=7)
        assert opts.strategy == name
    with pytest.raises(SystemExit):  # argparse refuses an unknown impl
        _args("--context-parallel-impl", "zigzag")
    from megatron_cp.megatron.batch import PlanOptions

    with pytest.raises(ValueError, match="strategy='zigzag' is unknown"):
        PlanOptions(strategy="zigzag")
    bad = [
        (("--context-parallel-impl", "megatron_cp"), "calculate-per-token-loss"),
        (("--context-parallel-impl", "megatron_cp", "--calculate-per-token-loss", "--cp-mask-kwargs", "{x"), "not JSON"),
        (("--context-parallel-impl", "megatron_cp", "--calculate-per-token-loss", "--cp-topology", "8"), "'8'"),
        (("--context-parallel-impl", "megatron_cp", "--calculate-per-token-loss", "--cp-mask", "sliding_window"), "window"),
    ]
    for argv, match in bad:
        with pytest.raises(ValueError, match=match):
            specs_from_args(_args(*argv), eod=7)


def test_flags_join_megatrons_own_parser():
    import sys

    from megatron.training.arguments import parse_args

    from megatron_cp.megatron.arguments import add_megatron_cp_args

    argv = sys.argv
    try:
        sys.argv = ["x", "--context-parallel-impl", "megatron_cp", "--cp-mask", "packed", "--cp-window", "4"]
        a = parse_args(add_megatron_cp_args)
    finally:
        sys.argv = argv
    assert a.context_parallel_impl == "megatron_cp" and a.cp_mask == "packed" and a.cp_window == 4
    assert a.cp_comm_type is not None or hasattr(a, "cp_comm_type")  # Megatron's own CP flags untouched


# ---------------------------------------------------------------- whole model vs Megatron's attention


def test_llama_matches_megatron_dot_product_attention_on_packed_documents(world1, monkeypatch):
    """Same weights; Megatron's DotProductAttention with its own packed-document mask and reset
    positions (get_ltor_masks_and_position_ids) vs our batch hook + CPCoreAttention at CP=1."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron_helpers import CPUBuffer, NoRNG
    from megatron.core.models.gpt import GPTModel

    # DotProductAttention takes its score buffer from a CUDA-only global buffer and forks the CUDA
    # RNG around (zero-probability) dropout; on CPU the test gives it a CPU buffer and no fork.
    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", lambda: CPUBuffer())
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: NoRNG())
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tiny_llama.model import LlamaShape, build_llama, transformer_config
    from megatron_cp.megatron.rope import PlanRotaryEmbedding

    shape = LlamaShape(2, 32, 4, 2, 48, 320, 32)
    tokens, labels, lm = make_global_batch(2, 32, seed=11, packed=True)
    torch.manual_seed(3)
    ours = build_llama(shape)
    cfg = transformer_config(shape)
    ref = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), 320, 32,
                   position_embedding_type="rope", share_embeddings_and_output_weights=False)
    ref.load_state_dict(ours.state_dict(), strict=False)
    # Megatron's RotaryEmbedding.get_emb moves to CUDA unconditionally; give the reference the same
    # table at Megatron's own positions (the angles are checked against Megatron's table above).
    attn_mask, _, pos = megatron_ltor(tokens)
    rope = PlanRotaryEmbedding(ref.rotary_pos_emb)
    rope.set_positions(pos)
    ref.rotary_pos_emb = rope
    out_ref = ref(tokens, pos, attn_mask, labels=labels)  # [b, s] per-token loss
    loss_ref = (out_ref * lm).sum() / lm.sum()
    loss_ref.backward()

    bt = B.prepare_batch(tokens, labels, lm, B.MaskSpec("packed", eod=EOD), None)
    out = ours(bt.tokens, bt.position_ids, None, labels=bt.labels, packed_seq_params=bt.params)
    loss = (out * bt.loss_mask).sum() / bt.loss_mask.sum()
    loss.backward()
    assert abs(float(loss) - float(loss_ref)) <= 1e-5 * abs(float(loss_ref))
    g_ref = dict(ref.named_parameters())
    worst = max(rel_err(p.grad, g_ref[k].grad) for k, p in ours.named_parameters())
    assert worst <= 1e-5, worst
    # negative control: ignoring the EOD boundaries (plain causal) must change the loss
    bc = B.prepare_batch(tokens, labels, lm, B.MaskSpec("causal"), None)
    with torch.no_grad():
        out_c = ours(bc.tokens, bc.position_ids, None, labels=bc.labels, packed_seq_params=bc.params)
    assert abs(float((out_c * bc.loss_mask).sum() / bc.loss_mask.sum()) - float(loss_ref)) > 1e-4


def test_step_log_reports_kernels_and_sparse_kept_fraction(capsys):
    """At a logged iteration the step log adds what core attention reported: the kernel paths that ran and,
    over the sparse layers, the blocks kept out of the mask's (overall and the least in one layer); the
    line beside Megatron's says both, the writers get the numbers."""
    import argparse

    import megatron_cp as mcp
    from megatron_cp.megatron.step_log import FIGURES, PLANNING_FIGURES, SPARSE_FIGURES, StepLog

    log = StepLog()
    args = argparse.Namespace(curr_iteration=0, log_interval=1, num_attention_heads=4, num_query_groups=2,
                              hidden_size=64, tensor_model_parallel_size=1, bf16=True)
    plan = mcp.plan(mcp.masks.causal(256), 2)
    assert not log.collecting
    log.record(args, plan, 1.5, (4.0, 0.5))  # planned ahead in 4 ms; the step waited 0.5 ms for it
    assert log.collecting
    log.layer(1, "fa4", {"blocks_selected": 3, "blocks_envelope": 10})
    log.layer(2, "triton (fp32)", {"blocks_selected": 5, "blocks_envelope": 10})
    log.layer(3, "fa4")  # a dense layer
    args.curr_iteration = 1
    log.record(args, plan, 1.0)  # the next iteration flushes the first
    (it, figs), = log.written
    assert it == 1 and set(figs) == set(FIGURES) | set(SPARSE_FIGURES) | set(PLANNING_FIGURES)
    assert (figs["plan_ms"], figs["plan_wait_ms"]) == (4.0, 0.5)
    assert figs["sparse_kept_fraction"] == pytest.approx(0.4) and figs["sparse_kept_fraction_min_layer"] == 0.3
    assert log.kernels_written == [(1, "fa4, triton (fp32)")]
    line = capsys.readouterr().out
    assert "planning 4.00 ms ahead, step waited 0.50 ms" in line
    assert "kernels fa4, triton (fp32)" in line and "sparse kept 0.400 of the mask's blocks (least in a layer 0.300)" in line
