"""Sequence parallelism with TP: Llama GPTModel at (TP 2, --sequence-parallel, CP 4) equals the
(TP 1, CP 1) run: the loss and every parameter gradient (fp32, relative error <= 1e-5) of two global
batches, for causal and packed-with-EOD masks, micro-batches of 2 samples of 50 tokens (planned without
the TP multiple, every one of them would leave some CP rank an odd token count). (TP 2, SP, CP 2) runs in
tests/test_megatron_parity.py's spawn, AdamW steps included. No optimizer step here: the packed batch
has a gradient element of true size ~3e-10 (fp64) that fp32 rounds to 0 in one run and 1e-9 in the
other, and Adam's first step (lr * g / (|g| + eps)) turns that into a 1e-4 difference of that weight.

Under SP Megatron scatters the embedding output over the TP ranks along the sequence, all-gathers it
before each column-parallel linear and reduce-scatters after each row-parallel one: core attention sees
the rank's whole local sequence, so the plan gives every CP rank a token count divisible by the TP size
(``PlanOptions.token_multiple``, set by ``plugin.plan_specs`` from ``--sequence-parallel``). Megatron's
CPU norm refuses SP, so the model uses ``megatron_cp.megatron.norms.SequenceParallelTorchNorm`` (torch's norm with
its weight marked ``sequence_parallel``, as Transformer Engine's norms are) and the loop sums those
gradients over TP (``trainer.reduce_and_scale``, as Megatron's ``finalize_model_grads``).

One spawn of 8 gloo processes (TP 2 x CP 4). Test-only shim: Megatron's SP mappings allocate on
``torch.cuda.current_device()`` and its embedding forks the CUDA RNG; the workers map both to the CPU
(``megatron_helpers.cuda_to_cpu_shim``).
"""

from __future__ import annotations

import pytest
import torch

from megatron_helpers import EOD, cuda_to_cpu_shim, make_global_batch, rel_err, tp_gather

TOL = 1e-5
CONFIGS = [(2, 4)]
MASKS = ["causal", "packed"]
S, G, MBS, BATCHES = 50, 4, 2, 2
WORLD = 8


def _shape():
    from tiny_llama.model import LlamaShape

    return LlamaShape(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=48, vocab_size=320, seq_length=S)


def _grads(model, batches, spec, options, dp_rank, dp_size):
    """Forward and backward of each global batch from the same weights -> (losses, gradients, local token
    counts of every micro-batch)."""
    from megatron_cp.megatron import prepare_batch
    from megatron.core import parallel_state as ps
    from tiny_llama import trainer

    losses, grads, counts = [], [], []
    cp = ps.get_context_parallel_group() if ps.get_context_parallel_world_size() > 1 else None
    for batch in batches:
        model.zero_grad(set_to_none=True)
        mbs = trainer.dp_shard(batch, dp_rank, dp_size, MBS)
        counts += [prepare_batch(*mb, spec, cp, options).tokens.shape[1] for mb in mbs]
        s, n = trainer.forward_backward(model, mbs, spec, options)
        losses.append(trainer.reduce_and_scale(model, s, n).loss)
        grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
    return losses, grads, counts


def _worker(rank, world):
    from megatron.core import parallel_state as ps

    import megatron_cp as mcp
    from megatron_cp.megatron.batch import MaskSpec, PlanOptions, build_mask, document_bounds
    from tiny_llama import trainer
    from tiny_llama.model import build_llama, load_full_state, transformer_config

    torch.set_num_threads(1)
    cuda_to_cpu_shim()
    shape = _shape()
    report = []
    for mask in MASKS:
        spec = MaskSpec(mask, eod=EOD if mask == "packed" else None)
        batches = [make_global_batch(G, S, seed=300 + i, packed=mask == "packed") for i in range(BATCHES)]
        trainer.init_parallel(1, 1)
        torch.manual_seed(7)
        ref = build_llama(shape)
        full_w = {k: p.detach().clone() for k, p in ref.named_parameters()}
        ref_losses, ref_grads, _ = _grads(ref, batches, spec, PlanOptions(), 0, 1)
        del ref
        for tp, cp in CONFIGS:
            trainer.init_parallel(tp, cp)
            tp_group = ps.get_tensor_model_parallel_group()
            model = build_llama(shape, transformer_config(shape, sequence_parallel=True))
            load_full_state([model], full_w)
            options = PlanOptions(token_multiple=tp)
            losses, grads, counts = _grads(model, batches, spec, options, ps.get_data_parallel_rank(),
                                           ps.get_data_parallel_world_size())
            named = dict(model.named_parameters())
            gerr = max(rel_err(tp_gather(k, g[k], named[k], tp_group, True), ref_g[k])
                       for g, ref_g in zip(grads, ref_grads) for k in g)
            lerr = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            # the same micro-batches planned without the TP multiple: some rank would get an odd count
            odd = 0
            for step in range(BATCHES):
                for i in range(0, G, MBS):
                    tokens = batches[step][0][i:i + MBS].numpy()
                    m = build_mask(spec, document_bounds(tokens, spec), MBS, S)
                    p = mcp.plan(m, cp)
                    odd += sum(len(p.local_ids(r)) % tp != 0 for r in range(cp))
            sp_norms = sorted(k for k, p in named.items() if getattr(p, "sequence_parallel", False))
            report.append(dict(mask=mask, tp=tp, cp=cp, loss_err=lerr, grad_err=gerr,
                               missing=sorted(set(ref_grads[0]) - set(grads[0])), counts=counts, odd_without=odd,
                               sp_norms=len(sp_norms), losses=losses, ref_losses=ref_losses))
            del model
    return report


@pytest.fixture(scope="module")
def sp_report():
    from tiny_llama.trainer import spawn

    return spawn(_worker, WORLD)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("tp,cp", CONFIGS)
def test_sequence_parallel_parity(sp_report, mask, tp, cp):
    (r,) = [r for r in sp_report if (r["mask"], r["tp"], r["cp"]) == (mask, tp, cp)]
    assert not r["missing"], f"parameters missing from the parallel model: {r['missing']}"
    assert r["sp_norms"] == 2 * 2 + 1, "every RMSNorm weight (2 per layer + final) is sequence_parallel"
    assert all(c % tp == 0 for c in r["counts"]), f"local token counts {r['counts']} not divisible by TP {tp}"
    assert r["loss_err"] <= TOL, f"loss differs: {r['losses']} vs {r['ref_losses']}"
    assert r["grad_err"] <= TOL, f"worst parameter gradient relative error (both steps) {r['grad_err']:.3e}"


def test_plans_without_the_multiple_would_split_unevenly(sp_report):
    """The cases are meaningful: planned without ``token_multiple`` some rank holds an odd token count."""
    assert all(r["odd_without"] for r in sp_report)


def test_token_multiple_checks():
    from megatron_cp.megatron.batch import PlanOptions

    assert PlanOptions(token_multiple=2).block == 2
    with pytest.raises(ValueError, match="token_multiple"):
        PlanOptions(token_multiple=0)
    with pytest.raises(ValueError, match="--sequence-parallel.*head_context"):
        PlanOptions(token_multiple=2, strategy="head_context")


def test_sequence_parallel_flags():
    """``plan_specs`` takes the TP size under --sequence-parallel; head_context is refused when parsed."""
    import sys

    from megatron.training.arguments import parse_args

    from megatron_cp.megatron import plugin
    from megatron_cp.megatron.arguments import add_megatron_cp_args

    def parsed(*argv):
        saved = sys.argv
        try:
            sys.argv = ["pretrain_gpt.py", "--calculate-per-token-loss", "--position-embedding-type", "rope",
                        "--attention-dropout", "0", "--seq-length", "64", "--micro-batch-size", "2",
                        "--context-parallel-size", "2", "--tensor-model-parallel-size", "2", *argv]
            return parse_args(add_megatron_cp_args)
        finally:
            sys.argv = saved

    a = parsed("--context-parallel-impl", "megatron_cp", "--sequence-parallel")
    plugin.validate_args(a)
    assert plugin.plan_specs(a, eod=0)[1].token_multiple == 2
    assert plugin.plan_specs(parsed("--context-parallel-impl", "megatron_cp"), eod=0)[1].token_multiple == 1
    with pytest.raises(ValueError, match="--sequence-parallel does not combine"):
        plugin.validate_args(parsed("--context-parallel-impl", "head_context", "--sequence-parallel"))
    # Megatron's local modules without Apex take torch's norm, which refuses SP when the model is built: our spec
    # swaps it for one that marks its parameters sequence-parallel, so the flags validate
    plugin.validate_args(parsed("--context-parallel-impl", "megatron_cp", "--sequence-parallel",
                                "--transformer-impl", "local"))


def test_sequence_parallel_spec_swaps_the_torch_norm(world1):
    """Under --sequence-parallel, ``megatron_cp_layer_spec`` gives a block spec whose every norm (the layers' and
    the final one) is ``SequenceParallelTorchNorm`` where Megatron's spec had its torch norm; the norm it builds
    has Megatron's parameter names, marked sequence_parallel. Without SP the spec keeps Megatron's norm."""
    import dataclasses

    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_cp.megatron.norms import SequenceParallelTorchNorm
    from megatron_cp.megatron.specs import megatron_cp_layer_spec

    def config(sp):
        return TransformerConfig(num_layers=3, hidden_size=64, num_attention_heads=4, normalization="RMSNorm",
                                 add_bias_linear=False, transformer_impl="local", sequence_parallel=sp,
                                 tensor_model_parallel_size=2 if sp else 1)

    def classes(x, out):
        if isinstance(x, type):
            out.append(x)
        elif dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                classes(getattr(x, f.name), out)
        elif isinstance(x, list):
            for v in x:
                classes(v, out)
        return out

    plain = megatron_cp_layer_spec(config(False))
    if WrappedTorchNorm not in classes(plain, []):
        pytest.skip("Megatron's spec takes Apex's or Transformer Engine's norm here (they run under SP as they are)")
    sp = megatron_cp_layer_spec(config(True))
    assert isinstance(sp, TransformerBlockSubmodules) and len(sp.layer_specs) == 3
    found = classes(sp, [])
    assert WrappedTorchNorm not in found and sp.layer_norm is SequenceParallelTorchNorm
    assert found.count(SequenceParallelTorchNorm) == 3 * 2 + 1  # input and pre-MLP norm per layer, the final one
    norm = SequenceParallelTorchNorm(config(True), 64, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and [n for n, _ in norm.named_parameters()] == ["weight"]
    assert norm.weight.sequence_parallel is True
    with pytest.raises(ValueError, match="layernorm_zero_centered_gamma is not supported by torch's norm"):
        SequenceParallelTorchNorm(dataclasses.replace(config(True), layernorm_zero_centered_gamma=True), 64)
