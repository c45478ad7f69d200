"""Llama GPTModel under (TP, CP) in {(1,2), (1,4), (2,2)} equals the (1,1) run: loss, every parameter
gradient, and two AdamW steps (fp32, relative error <= 1e-5), for causal and packed-with-EOD masks, with
micro-batches of 2 samples (folded into one sequence of 2 documents by prepare_batch). Also at CP 2: the
baseline strategies, activation recomputation on the packed mask (selective: core attention; full: every
layer, uniform and block methods; the plan travels into the recompute closures in packed_seq_params), and
(TP 2, --sequence-parallel, CP 2) with megatron_cp and with the ring baseline (more in
tests/test_megatron_sp.py).

One spawn of 4 gloo processes runs every case. The reference (1,1) model is computed on every rank
on the whole global batch; the parallel runs load the same weights sharded for TP, run on their DP
share with CP, and their gradients are gathered back over TP before the comparison. Test-only shim:
Megatron's SP mappings and recompute use CUDA device and RNG calls, mapped to the CPU
(``megatron_helpers.cuda_to_cpu_shim``).
"""

from __future__ import annotations

import pytest
import torch

from megatron_helpers import cuda_to_cpu_shim, reference_for, rel_err, tp_gather

TOL = 1e-5
CONFIGS = [(1, 2), (1, 4), (2, 2)]
BASELINES = ["ring", "ulysses", "usp", "allgather"]  # --context-parallel-impl baselines, at TP 1, CP 2
HEAD_CONTEXT = (1, 4, "head_context")  # at CP 4 as 2 emulated nodes x 2 (Ulysses degree 2)
# model variants of megatron_cp runs: name -> (tp, cp, TransformerConfig overrides, number of layers whose
# attention runs again in backward (block: the first recompute_num_layers))
VARIANTS = {
    "sp": (2, 2, dict(sequence_parallel=True), 0),
    "recompute-selective": (1, 2, dict(recompute_granularity="selective"), 2),
    "recompute-full-uniform": (1, 2, dict(recompute_granularity="full", recompute_method="uniform",
                                          recompute_num_layers=1), 2),
    "recompute-full-block": (1, 2, dict(recompute_granularity="full", recompute_method="block",
                                        recompute_num_layers=1), 1),
}
RUNS = ([(tp, cp, "megatron_cp", "") for tp, cp in CONFIGS] + [(1, 2, name, "") for name in BASELINES]
        + [HEAD_CONTEXT + ("",)] + [(tp, cp, "megatron_cp", v) for v, (tp, cp, _, _) in VARIANTS.items()]
        + [(2, 2, "ring", "sp")])  # a baseline's layout (zigzag) under the TP multiple too
MASKS = ["causal", "packed"]
# recomputation does not depend on the mask, nor does the baseline under SP: packed only
CASES = [(mask,) + run for mask in MASKS for run in RUNS
         if mask == "packed" or not (run[3].startswith("recompute") or run[2:] == ("ring", "sp"))]
S, G, MBS, STEPS = 48, 4, 2, 2
# Adam's first steps are ~lr * sign(g): elements whose gradient is at fp32 noise level may flip, so
# the weight comparison scales with lr. 1e-3 is a realistic rate; the gradients themselves are
# compared directly (TOL) and do not depend on it.
LR = 1e-3


def _build(shape, variant="", strategy="megatron_cp"):
    from megatron_cp.megatron import LayerOptions
    from tiny_llama.model import build_llama, transformer_config

    return build_llama(shape, transformer_config(shape, **VARIANTS[variant][2]) if variant else None,
                       options=LayerOptions(strategy=strategy))


def _run(model, batches, spec, steps, lr, strategy="megatron_cp", token_multiple=1):
    """``steps`` AdamW steps; returns (losses, grads of step 0 as {name: tensor})."""
    from megatron.core import parallel_state as ps

    from megatron_cp import Topology
    from megatron_cp.megatron.batch import PlanOptions
    from tiny_llama import trainer

    options = PlanOptions(strategy=strategy, topology=Topology(2, 2) if strategy == "head_context" else None,
                          token_multiple=token_multiple)
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

    from megatron_cp.megatron import CPCoreAttention
    from tiny_llama import trainer
    from tiny_llama.model import LlamaShape, load_full_state

    torch.set_num_threads(1)
    cuda_to_cpu_shim()
    shape = LlamaShape(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=48, vocab_size=320, seq_length=S)
    report = []
    for mask in MASKS:
        # reference: TP=1, CP=1 on every rank over the whole global batch (no DP reduction involved)
        spec, batches, (full_w, ref_losses, ref_g0, ref_w) = reference_for(
            mask, shape, _build, weight_seed=7, batch_seed=100, steps=STEPS, G=G, S=S, lr=LR, micro_batch_size=MBS)

        for tp, cp, strategy, variant in [c[1:] for c in CASES if c[0] == mask]:
            trainer.init_parallel(tp, cp)
            tp_group = ps.get_tensor_model_parallel_group()
            model = _build(shape, variant, strategy)
            calls = [0]  # core-attention calls: activation recompute runs each layer's attention twice
            for m in model.modules():
                if isinstance(m, CPCoreAttention):
                    m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
            load_full_state([model], full_w)
            losses, g0 = _run(model, batches, spec, STEPS, lr=LR, strategy=strategy,
                              token_multiple=tp if variant == "sp" else 1)
            named = dict(model.named_parameters())
            gerr = max(rel_err(tp_gather(k, g0[k], named[k], tp_group, True), ref_g0[k]) for k in g0)
            werr = max(rel_err(tp_gather(k, p.detach(), p, tp_group, True), ref_w[k]) for k, p in named.items())
            lerr = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            missing = set(ref_g0) - set(g0)
            report.append(dict(mask=mask, tp=tp, cp=cp, strategy=strategy, variant=variant, loss_err=lerr,
                               grad_err=gerr, weight_err=werr, missing=sorted(missing), losses=losses,
                               ref_losses=ref_losses, attn_calls=calls[0],
                               micro_batches=STEPS * G // (MBS * ps.get_data_parallel_world_size())))
            del model
        dist.barrier()
    return report


@pytest.fixture(scope="module")
def parity_report():
    from tiny_llama.trainer import spawn

    return spawn(_worker, 4)


@pytest.mark.parametrize("mask,tp,cp,strategy,variant", CASES)
def test_parity_with_tp1_cp1(parity_report, mask, tp, cp, strategy, variant):
    (r,) = [r for r in parity_report
            if (r["mask"], r["tp"], r["cp"], r["strategy"], r["variant"]) == (mask, tp, cp, strategy, variant)]
    assert not r["missing"], f"parameters missing from the parallel model: {r['missing']}"
    assert r["loss_err"] <= TOL, f"loss differs: {r['losses']} vs {r['ref_losses']}"
    assert r["grad_err"] <= TOL, f"worst parameter gradient relative error {r['grad_err']:.3e}"
    assert r["weight_err"] <= TOL, f"weights after {STEPS} AdamW steps differ: {r['weight_err']:.3e}"
    assert len(r["losses"]) == STEPS and all(x == x for x in r["losses"])
    again = VARIANTS[variant][3] if variant else 0
    assert r["attn_calls"] == (2 + again) * r["micro_batches"], "core attention calls (2 layers) per micro-batch"
