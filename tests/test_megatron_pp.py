"""Pipeline parallelism with megatron-cp: a 4-layer Llama GPTModel at (PP 2, CP 2) under Megatron's 1F1B
schedule and at (PP 2, virtual stages 2, CP 2) under its interleaved 1F1B schedule
(``megatron.core.pipeline_parallel.get_forward_backward_func``) equals the same model at (PP 1, CP 1):
loss, every parameter gradient and two AdamW steps (fp32, relative error <= 1e-5), for causal and
packed-with-EOD masks, 4 micro-batches of 2 samples per step.

Every stage and virtual chunk reads the micro-batches from its own iterator and builds the same plan from
the tokens (``trainer.forward_step``); ranks hold plan-dependent token counts, so stages exchange
activation shapes (``variable_seq_lengths``). The (PP 2, VPP 2, CP 2) packed case also runs Megatron's
interleaved schedule with ``plugin.forward_step`` itself (the ``pretrain_gpt.py`` hook, on Megatron's
parsed and validated-by-us arguments) for one step's gradients.

Test-only shim: Megatron's p2p code allocates on ``torch.cuda.current_device()`` and its schedules make
``device="cuda"`` token counters; the CPU workers map both to the CPU (``megatron_helpers.cuda_to_cpu_shim``).
One spawn of 4 gloo processes runs every case.
"""

from __future__ import annotations

import pytest
import torch

from megatron_helpers import EOD, cuda_to_cpu_shim, full_param_name, reference_for, rel_err

TOL = 1e-5
MASKS = ["causal", "packed"]
LAYOUTS = [(2, None), (2, 2)]  # (pipeline stages, virtual stages per pipeline rank)
CP = 2
S, G, MBS, STEPS, LR = 48, 8, 2, 2, 1e-3


def _plugin_grads(chunks, batch, named):
    """One step of Megatron's schedule with ``plugin.forward_step`` on ``chunks`` -> {full name: grad}."""
    import megatron.training.global_vars as gv
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_cp.megatron import plugin
    from tiny_llama import trainer

    args = _parsed("--pipeline-model-parallel-size", "2", "--cp-mask", "packed", "--cp-eod-token", str(EOD),
                   seq_length=S, micro_batch_size=MBS)
    args.variable_seq_lengths = False  # as Megatron's validate_args leaves it
    plugin.validate_args(args)
    gv.set_args(args)
    tokens, labels, loss_mask = batch
    data = [dict(tokens=tokens[i:i + MBS], labels=labels[i:i + MBS], loss_mask=loss_mask[i:i + MBS])
            for i in range(0, G, MBS)]
    for c in chunks:
        c.zero_grad(set_to_none=True)
    reports = get_forward_backward_func()(
        forward_step_func=plugin.forward_step, data_iterator=[iter(data) for _ in chunks], model=chunks,
        num_microbatches=len(data), seq_length=S, micro_batch_size=MBS, forward_only=False)
    total = torch.zeros(2, dtype=torch.float64)
    for r in reports:
        total += r["lm loss"].to(torch.float64)
    trainer.reduce_and_scale(chunks, total[0], total[1])
    return {k: p.grad.detach().clone() for k, p in named.items()}


def _worker(rank, world):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from tiny_llama import trainer
    from tiny_llama.model import LlamaShape, build_llama, build_pipeline_stage, load_full_state

    torch.set_num_threads(1)
    cuda_to_cpu_shim(schedules=True)
    shape = LlamaShape(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=48, vocab_size=320, seq_length=S)
    report = []
    for mask in MASKS:
        spec, batches, (full_w, ref_losses, ref_g0, ref_w) = reference_for(
            mask, shape, build_llama, weight_seed=11, batch_seed=500, steps=STEPS, G=G, S=S, lr=LR,
            micro_batch_size=MBS)

        for pp, vpp in LAYOUTS:
            trainer.init_parallel(1, CP, pp=pp, vpp=vpp)
            chunks = build_pipeline_stage(shape)
            named = {full_param_name(c, k): p for c in chunks for k, p in c.named_parameters()}
            load_full_state(chunks, full_w)
            params = [p for c in chunks for p in c.parameters()]
            opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
            losses, gerr = [], 0.0
            for step in range(STEPS):
                opt.zero_grad(set_to_none=True)
                mbs = trainer.dp_shard(batches[step], ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                                       MBS)
                s, n = trainer.pipeline_forward_backward(chunks, mbs, spec)
                res = trainer.reduce_and_scale(chunks, s, n)
                if step == 0:
                    gerr = max(rel_err(p.grad, ref_g0[k]) for k, p in named.items())
                opt.step()
                losses.append(res.loss)
            werr = max(rel_err(p.detach(), ref_w[k]) for k, p in named.items())
            plugin_err = None
            if vpp and mask == "packed":
                load_full_state(chunks, full_w)
                g = _plugin_grads(chunks, batches[0], named)
                plugin_err = max(rel_err(g[k], ref_g0[k]) for k in g)
            lerr = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            mine = dict(names=sorted(named), grad_err=gerr, weight_err=werr, loss_err=lerr, losses=losses,
                        chunks=len(chunks), plugin_err=plugin_err)
            every = [None] * world
            dist.all_gather_object(every, mine)
            report.append(dict(mask=mask, pp=pp, vpp=vpp, ref_names=sorted(ref_w), ref_losses=ref_losses,
                               names=sorted({n for r in every for n in r["names"]}),
                               grad_err=max(r["grad_err"] for r in every),
                               weight_err=max(r["weight_err"] for r in every),
                               loss_err=max(r["loss_err"] for r in every), losses=mine["losses"],
                               chunks=[r["chunks"] for r in every],
                               plugin_err=None if plugin_err is None else max(r["plugin_err"] for r in every)))
            del chunks, named, params, opt
    return report


@pytest.fixture(scope="module")
def pp_report():
    from tiny_llama.trainer import spawn

    return spawn(_worker, 4)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("pp,vpp", LAYOUTS)
def test_pipeline_parity_with_pp1_cp1(pp_report, mask, pp, vpp):
    (r,) = [r for r in pp_report if (r["mask"], r["pp"], r["vpp"]) == (mask, pp, vpp)]
    assert r["names"] == r["ref_names"], "the stages' parameters together are not the whole model"
    assert r["chunks"] == [vpp or 1] * 4
    assert r["loss_err"] <= TOL, f"loss differs: {r['losses']} vs {r['ref_losses']}"
    assert r["grad_err"] <= TOL, f"worst parameter gradient relative error {r['grad_err']:.3e}"
    assert r["weight_err"] <= TOL, f"weights after {STEPS} AdamW steps differ: {r['weight_err']:.3e}"
    if vpp and mask == "packed":
        assert r["plugin_err"] is not None and r["plugin_err"] <= TOL, f"plugin.forward_step: {r['plugin_err']}"


def _parsed(*argv, seq_length=64, micro_batch_size=2):
    """Megatron's own parser with our flags (no Megatron validation: that one reads CUDA at CP > 1)."""
    import sys

    from megatron.training.arguments import parse_args

    from megatron_cp.megatron.arguments import add_megatron_cp_args

    saved = sys.argv
    try:
        sys.argv = ["pretrain_gpt.py", "--context-parallel-impl", "megatron_cp", "--calculate-per-token-loss",
                    "--position-embedding-type", "rope", "--attention-dropout", "0", "--seq-length",
                    str(seq_length), "--micro-batch-size", str(micro_batch_size), "--context-parallel-size", "2",
                    *argv]
        return parse_args(add_megatron_cp_args)
    finally:
        sys.argv = saved


def test_validate_args_sets_variable_shapes_for_pipelines():
    from megatron_cp.megatron import plugin

    a = _parsed("--pipeline-model-parallel-size", "2")
    a.variable_seq_lengths = False  # as Megatron's validate_args leaves it
    plugin.validate_args(a)
    assert a.variable_seq_lengths is True and a.moe_token_dispatcher_type == "alltoall"
    a = _parsed()
    a.variable_seq_lengths = False
    plugin.validate_args(a)
    assert a.variable_seq_lengths is False and a.moe_token_dispatcher_type == "allgather"
    a = _parsed("--pipeline-model-parallel-size", "2", "--num-experts", "4")
    with pytest.raises(ValueError, match="--moe-token-dispatcher-type alltoall"):
        plugin.validate_args(a)


def test_install_into_builds_the_data_on_every_stage(monkeypatch):
    import argparse

    import megatron.training as mt
    from megatron.core import parallel_state as ps

    from megatron_cp.megatron import plugin

    ns = dict(parse_and_validate_args=lambda **kw: None, forward_step=lambda it, m: None,
              is_dataset_built_on_rank=lambda vp_stage=None, is_packed_sequence=False: "first or last stage")
    original = ns["is_dataset_built_on_rank"]
    plugin.install_into(ns)
    for tp_rank in (0, 1):
        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda r=tp_rank: r)
        monkeypatch.setattr(mt, "get_args", lambda: argparse.Namespace(context_parallel_impl="megatron_cp"))
        assert ns["is_dataset_built_on_rank"](vp_stage=1) is (tp_rank == 0)
        monkeypatch.setattr(mt, "get_args", lambda: argparse.Namespace(context_parallel_impl="te"))
        assert ns["is_dataset_built_on_rank"](vp_stage=1) == "first or last stage"
    plugin.uninstall_from(ns)
    assert ns["is_dataset_built_on_rank"] is original


def test_a_stage_without_data_raises(monkeypatch):
    import argparse

    from megatron.core import parallel_state as ps

    from megatron_cp.megatron import plugin

    for name, value in (("get_tensor_model_parallel_group", None), ("get_tensor_model_parallel_src_rank", 0),
                        ("get_tensor_model_parallel_rank", 0), ("get_tensor_model_parallel_world_size", 1),
                        ("get_pipeline_model_parallel_rank", 1)):
        monkeypatch.setattr(ps, name, lambda v=value: v)
    args = argparse.Namespace(micro_batch_size=2, seq_length=8)
    with pytest.raises(ValueError, match="pipeline stage 1 has no data iterator"):
        plugin._broadcast_batch(None, args)
    data = dict(tokens=torch.arange(16).view(2, 8), labels=torch.arange(16).view(2, 8), loss_mask=torch.ones(2, 8))
    tokens, labels, loss_mask, host = plugin._broadcast_batch(iter([data]), args)
    assert tokens.equal(data["tokens"]) and loss_mask.dtype == torch.float32
    assert (host == data["tokens"].numpy()).all()  # TP 1: the loader's host copy, what the plan is read from
