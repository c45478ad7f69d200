"""The megatron.training path of examples/llama/pretrain_llama.py, as far as it runs without CUDA.

``megatron.training.pretrain`` itself asserts CUDA; this test drives the same pieces in 2 gloo
processes at CP=2: Megatron's argument parsing + validation with our extra_args_provider and the
tiny config, plugin.validate_args (selects our --spec), Megatron's GPTModelBuilder, Megatron's
pretraining data loader over the stdlib dataset, plugin.forward_step and its loss function.
"""

from __future__ import annotations

import sys

from megatron_helpers import EXAMPLES  # also puts examples/ on sys.path (tiny_llama)

LLAMA = EXAMPLES / "llama"
S = 64


def _worker(rank, world):
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(LLAMA))
    import pretrain_llama as PL
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_cp.megatron import CPCoreAttention, PlanRotaryEmbedding, plugin
    from megatron_cp.megatron.arguments import add_megatron_cp_args
    from tiny_llama import trainer

    sys.argv = ["pretrain_llama.py"] + PL.expand_argv(
        ["--config", "tiny", "--use-cpu-initialization", "--seq-length", str(S), "--max-position-embeddings", str(S)])
    args = parse_and_validate_args(extra_args_provider=add_megatron_cp_args)
    # Megatron's own CP>1 validation reads the CUDA architecture, so validate at CP=1, then set CP
    args.context_parallel_size = world
    args.num_workers = 0
    plugin.validate_args(args)
    assert args.spec == plugin.SPEC
    trainer.init_parallel(1, world)
    torch.manual_seed(0)
    model = GPTModelBuilder(gpt_config_from_args(args)).build_model(
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(), pre_process=True, post_process=True)
    kinds = {type(layer.self_attention.core_attention) for layer in model.decoder.layers}
    ds, _, _ = PL.datasets_provider([4, 0, 0])
    it = iter(build_pretraining_data_loader(ds, 0))
    out, loss_fn = plugin.forward_step(it, model)
    loss, n, report = loss_fn(out)
    loss.backward()
    stats = torch.tensor([float(loss), float(n)], dtype=torch.float64)
    dist.all_reduce(stats)
    no_grad = [k for k, p in model.named_parameters() if p.grad is None]
    return dict(kinds=kinds, rope=type(model.rotary_pos_emb), local_tokens=int(n), report=report["lm loss"].tolist(),
                global_tokens=int(stats[1]), mean=float(stats[0] / stats[1]), no_grad=no_grad)


def test_megatron_training_pieces_run_at_cp2():
    from megatron_cp.megatron import CPCoreAttention, PlanRotaryEmbedding
    from tiny_llama.trainer import spawn

    r = spawn(_worker, 2)
    assert r["kinds"] == {CPCoreAttention}
    assert r["rope"] is PlanRotaryEmbedding  # installed lazily by forward_step
    assert r["global_tokens"] == S  # micro-batch 1 x S tokens, split over the 2 CP ranks
    assert 0 < r["local_tokens"] < S
    assert r["report"][1] == r["local_tokens"]
    assert 4.0 < r["mean"] < 7.0  # ~ln(320) at initialisation
    assert not r["no_grad"], r["no_grad"]
