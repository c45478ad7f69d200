"""``--cp-sparse moba`` / ``--cp-sparse xattention`` in the tiny Llama: the flags parse into a SparseSpec,
and training at CP = 2 gives the losses of CP = 1 with the same flags (fp32, relative 1e-5), on causal
and packed-document envelopes; bad sparse flags fail at start-up naming the value."""

from __future__ import annotations

import argparse

import pytest

from megatron_helpers import EOD, make_global_batch

TOL = 1e-5
S, G, MBS, STEPS = 64, 4, 2, 3
FLAGS = {
    "moba": ["--cp-sparse", "moba", "--cp-sparse-block", "16", "--cp-moba-top-k", "2"],
    "xattention": ["--cp-sparse", "xattention", "--cp-sparse-block", "16", "--cp-xattn-stride", "4",
                   "--cp-xattn-threshold", "0.6"],
}


def _args(extra, **over):
    from megatron_cp.megatron.arguments import add_megatron_cp_args

    p = add_megatron_cp_args(argparse.ArgumentParser())
    a = p.parse_args(["--context-parallel-impl", "megatron_cp", *extra])
    a.calculate_per_token_loss = True
    a.num_attention_heads, a.num_query_groups, a.hidden_size, a.num_layers, a.seq_length = 4, 2, 32, 2, S
    for k, v in over.items():
        setattr(a, k, v)
    return a


def _train(model, batches, spec, options):
    import torch

    from tiny_llama import trainer

    from megatron.core import parallel_state as ps

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        mbs = trainer.dp_shard(batches[step], ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), MBS)
        s, n = trainer.forward_backward(model, mbs, spec, options)
        res = trainer.reduce_and_scale(model, s, n)
        opt.step()
        losses.append(res.loss)
    return losses


def _worker(rank, world):
    import torch

    from megatron_cp.megatron.arguments import specs_from_args
    from tiny_llama import trainer
    from tiny_llama.model import LlamaShape, build_llama

    torch.set_num_threads(1)
    shape = LlamaShape(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=48, vocab_size=320, seq_length=S)
    report = []
    for method, flags in FLAGS.items():
        for mask in ("causal", "packed"):
            spec, options = specs_from_args(_args(flags + ["--cp-mask", mask]), eod=EOD)
            batches = [make_global_batch(G, S, seed=300 + i, packed=mask == "packed") for i in range(STEPS)]
            losses = {}
            for cp in (1, 2):
                trainer.init_parallel(1, cp)
                torch.manual_seed(11)
                losses[cp] = _train(build_llama(shape, options=options), batches, spec, options)
            report.append(dict(method=method, mask=mask, losses=losses))
    return report


@pytest.fixture(scope="module")
def sparse_report():
    from tiny_llama.trainer import spawn

    return spawn(_worker, 2)


@pytest.mark.parametrize("mask", ["causal", "packed"])
@pytest.mark.parametrize("method", list(FLAGS))
def test_cp2_losses_equal_cp1_with_the_same_sparse_flags(sparse_report, method, mask):
    (r,) = [r for r in sparse_report if (r["method"], r["mask"]) == (method, mask)]
    one, two = r["losses"][1], r["losses"][2]
    assert len(one) == STEPS and all(x == x for x in one)
    err = max(abs(a - b) / abs(b) for a, b in zip(two, one))
    assert err <= TOL, f"{method} {mask}: CP=2 losses {two} vs CP=1 {one}"


def test_sparse_flags_build_selectors_per_layer():
    from megatron_cp.megatron.arguments import specs_from_args

    _, options = specs_from_args(_args(FLAGS["moba"] + ["--cp-sparse-layers", "2"]))
    sp = options.sparse
    assert sp.method == "moba" and sp.block == 16 and sp.selector(1) is None
    assert sp.selector(2).top_k == 2 and sp.selector(2) is sp.selector(2)


@pytest.mark.parametrize("extra,needle", [
    (["--cp-sparse", "moba", "--cp-sparse-block", "16", "--cp-moba-top-k", "0"], "0"),
    (["--cp-sparse", "xattention", "--cp-sparse-block", "16", "--cp-xattn-threshold", "1.5"], "1.5"),
    (["--cp-sparse", "xattention", "--cp-sparse-block", "16", "--cp-xattn-threshold", "high"], "high"),
    (["--cp-sparse", "moba", "--cp-sparse-block", "48"], "48"),
    (["--cp-sparse", "moba", "--cp-sparse-block", "16", "--cp-sparse-layers", "3-1"], "3-1"),
    (["--cp-sparse", "minference"], "--cp-minference-config"),
    # given and then ignored before: a method's flag without --cp-sparse or with another method, layers past
    # the model's, a negative EOD id
    (["--cp-moba-top-k", "3"], "--cp-moba-top-k 3 acts only with --cp-sparse moba, got --cp-sparse none"),
    (["--cp-sparse-block", "16"], r"--cp-sparse-block 16 acts only with --cp-sparse \(any method\)"),
    (["--cp-sparse", "moba", "--cp-sparse-block", "16", "--cp-xattn-threshold", "0.5"],
     "--cp-xattn-threshold 0.5 acts only with --cp-sparse xattention, got --cp-sparse moba"),
    (["--cp-sparse", "moba", "--cp-sparse-block", "16", "--cp-sparse-layers", "2-9"],
     r"--cp-sparse-layers 2-9 names layer 9; the model has 2 \(--num-layers\)"),
    (["--cp-eod-token", "-1"], "--cp-eod-token must be a token id >= 0, got -1"),
])
def test_bad_sparse_flags_fail_at_start_up(extra, needle):
    from megatron_cp.megatron.arguments import specs_from_args

    with pytest.raises(ValueError, match=needle):
        specs_from_args(_args(extra))
