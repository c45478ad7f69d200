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

    # the planner's figures through Megatron's writers at its log interval: iterations 0..5 of one micro-batch
    # each, --log-interval 2, so Megatron logs iterations 2, 4 and 6 (each written when the next one starts)
    import megatron.training.global_vars as gv

    class Writer:  # stands in for TensorBoard's SummaryWriter (add_scalar) and W&B's run (log)
        def __init__(self):
            self.scalars, self.logs = [], []

        def add_scalar(self, name, value, step):
            self.scalars.append((name, float(value), int(step)))

        def log(self, values, step):
            self.logs.append((dict(values), int(step)))

    tb, wb = Writer(), Writer()
    gv._GLOBAL_TENSORBOARD_WRITER, gv._GLOBAL_WANDB_WRITER = tb, wb
    args.log_interval = 2
    it = iter(build_pretraining_data_loader(PL.datasets_provider([16, 0, 0])[0], 0))
    for i in range(6):
        args.curr_iteration = i
        plugin.forward_step(it, model)
    model.eval()  # evaluation's micro-batches are left out
    plugin.forward_step(it, model)
    held = len(plugin.STEP_LOG.rows)
    return dict(kinds=kinds, rope=type(model.rotary_pos_emb), local_tokens=int(n), report=report["lm loss"].tolist(),
                global_tokens=int(stats[1]), mean=float(stats[0] / stats[1]), no_grad=no_grad,
                scalars=tb.scalars, logs=wb.logs, written=plugin.STEP_LOG.written, held=held,
                kernels=plugin.STEP_LOG.kernels_written)


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
    # megatron-cp's figures reached Megatron's writers at the logged iterations, read back from them
    from megatron_cp.megatron.step_log import FIGURES, PLANNING_FIGURES

    assert [it for it, _ in r["written"]] == [2, 4]
    assert sorted({s for _, _, s in r["scalars"]}) == [2, 4] and [s for _, s in r["logs"]] == [2, 4]
    for it, figs in r["written"]:
        assert {(f"megatron-cp/{k}", v, it) for k, v in figs.items()} <= set(r["scalars"])
        assert next(v for v, s in r["logs"] if s == it) == {f"megatron-cp/{k}": v for k, v in figs.items()}
        assert set(figs) == set(FIGURES) | set(PLANNING_FIGURES)  # forward_step plans in a thread
        assert figs["plan_ms"] > 0 and figs["plan_wait_ms"] >= 0
        # CP 2 over one causal sequence of 64 tokens: a rank receives K/V of the other's tokens
        assert 0 <= figs["plan_imbalance_max"] < 0.5 and figs["kv_bytes_per_microbatch"] > 0
        assert 0 < figs["max_kv_bytes_received"] <= figs["kv_bytes_per_microbatch"] and figs["prepare_batch_ms"] > 0
    assert r["held"] == 1  # iteration 6's own micro-batch (written when the next starts), not evaluation's
    # the kernel path core attention ran, per logged iteration (CPU: the reference kernels)
    assert r["kernels"] == [(2, "reference"), (4, "reference")]
