"""Llama GPTModel under (TP, CP) in {(1,2), (1,4), (2,2)} equals the (1,1) run: loss, every parameter
gradient, and two AdamW steps (fp32, relative error <= 1e-5), for causal and packed-with-EOD masks.

One spawn of 4 gloo processes runs every case. The reference (1,1) model is computed on every rank
on the whole global batch; the parallel runs load the same weights sharded for TP, run on their DP
share with CP, and their gradients are gathered back over TP before the comparison.
"""

from __future__ import annotations

import pytest
import torch

from megatron_helpers import EOD, make_global_batch, rel_err, tp_gather, tp_shard

TOL = 1e-5
CONFIGS = [(1, 2), (1, 4), (2, 2)]
BASELINES = ["ring", "ulysses", "usp", "allgather"]  # --context-parallel-impl baselines, at TP 1, CP 2
HEAD_CONTEXT = (1, 4, "head_context")  # at CP 4 as 2 emulated nodes x 2 (Ulysses degree 2)
MASKS = ["causal", "packed"]
S, G, MBS, STEPS = 48, 4, 2, 2
# Adam's first steps are ~lr * sign(g): elements whose gradient is at fp32 noise level may flip, so
# the weight comparison scales with lr. 1e-3 is a realistic rate; the gradients themselves are
# compared directly (TOL) and do not depend on it.
LR = 1e-3


def _build(shape):
    from tiny_llama.model import build_llama

    return build_llama(shape)


def _run(model, batches, spec, steps, lr, strategy="megatron_cp"):
    """``steps`` AdamW steps; returns (losses, grads of step 0 as {name: tensor})."""
    from megatron.core import parallel_state as ps

    from megatron_cp import Topology
    from megatron_cp.megatron.batch import PlanOptions
    from tiny_llama import trainer

    options = PlanOptions(strategy=strategy, topology=Topology(2, 2) if strategy == "head_context" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses, grads0 = [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        mbs = trainer.dp_shard(batches[step], ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), MBS)
        s, n = trainer.forward_backward(model, mbs, spec, options)
        res = trainer.reduce_and_scale(model, s, n)
        if step == 0:
            grads0 = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        opt.step()
        losses.append(res.loss)
    return losses, grads0


def _worker(rank, world):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_cp.megatron.batch import MaskSpec
    from tiny_llama import trainer
    from tiny_llama.model import LlamaShape

    torch.set_num_threads(1)
    shape = LlamaShape(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=48, vocab_size=320, seq_length=S)
    report = []
    for mask in MASKS:
        spec = MaskSpec(mask, eod=EOD if mask == "packed" else None)
        batches = [make_global_batch(G, S, seed=100 + i, packed=mask == "packed") for i in range(STEPS)]
        # reference: TP=1, CP=1 on every rank over the whole global batch (DP groups of size 1 via dp=world,
        # but each rank uses the full batch so no DP reduction is involved)
        trainer.init_parallel(1, 1)
        torch.manual_seed(7)
        ref = _build(shape)
        full_w = {k: p.detach().clone() for k, p in ref.named_parameters()}
        from tiny_llama import trainer as T

        opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
        ref_losses, ref_g0 = [], None
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            s, n = T.forward_backward(ref, T.dp_shard(batches[step], 0, 1, MBS), spec)
            for p in ref.parameters():
                p.grad.div_(float(n))
            if step == 0:
                ref_g0 = {k: p.grad.detach().clone() for k, p in ref.named_parameters()}
            opt.step()
            ref_losses.append(float(s) / float(n))
        ref_w = {k: p.detach().clone() for k, p in ref.named_parameters()}
        del ref

        runs = [(tp, cp, "megatron_cp") for tp, cp in CONFIGS]
        runs += [(1, 2, name) for name in BASELINES] + [HEAD_CONTEXT]
        for tp, cp, strategy in runs:
            trainer.init_parallel(tp, cp)
            tp_rank, tp_group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
            model = _build(shape)
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p.copy_(tp_shard(k, full_w[k], p, tp_rank, tp, glu=True))
            losses, g0 = _run(model, batches, spec, STEPS, lr=LR, strategy=strategy)
            named = dict(model.named_parameters())
            gerr = max(rel_err(tp_gather(k, g0[k], named[k], tp_group, True), ref_g0[k]) for k in g0)
            werr = max(rel_err(tp_gather(k, p.detach(), p, tp_group, True), ref_w[k]) for k, p in named.items())
            lerr = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            missing = set(ref_g0) - set(g0)
            report.append(dict(mask=mask, tp=tp, cp=cp, strategy=strategy, loss_err=lerr, grad_err=gerr, weight_err=werr,
                               missing=sorted(missing), losses=losses, ref_losses=ref_losses))
            del model
        dist.barrier()
    return report


@pytest.fixture(scope="module")
def parity_report():
    from tiny_llama.trainer import spawn

    return spawn(_worker, 4)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize(
    "tp,cp,strategy",
    [(tp, cp, "megatron_cp") for tp, cp in CONFIGS] + [(1, 2, name) for name in BASELINES] + [HEAD_CONTEXT],
)
def test_parity_with_tp1_cp1(parity_report, mask, tp, cp, strategy):
    (r,) = [r for r in parity_report if (r["mask"], r["tp"], r["cp"], r["strategy"]) == (mask, tp, cp, strategy)]
    assert not r["missing"], f"parameters missing from the parallel model: {r['missing']}"
    assert r["loss_err"] <= TOL, f"loss differs: {r['losses']} vs {r['ref_losses']}"
    assert r["grad_err"] <= TOL, f"worst parameter gradient relative error {r['grad_err']:.3e}"
    assert r["weight_err"] <= TOL, f"weights after {STEPS} AdamW steps differ: {r['weight_err']:.3e}"
    assert len(r["losses"]) == STEPS and all(x == x for x in r["losses"])
