"""--cp-balance-over-dp through Megatron's own pieces (argument parsing and validation, GPTModelBuilder, its
pretraining data loader over the stdlib data, plugin.forward_step and its loss), on DP 2 x CP 2 gloo ranks, fp32:
the same global batch (the loader gives each DP rank its own packed micro-batch) planned per DP group over its CP
pair (the fixed layout) and as one plan over all four ranks give the same loss and gradients (within 1e-5), and
its limits are refused by name at parse time (tests/test_megatron_args.py). The global plan is made ahead by the
planning thread, which gathers the DP groups' tokens itself."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from megatron_helpers import EXAMPLES  # also puts examples/ on sys.path (tiny_llama)

LLAMA = EXAMPLES / "llama"
S, DP, CP = 128, 2, 2


def _parse(extra):
    sys.path.insert(0, str(LLAMA))
    import pretrain_llama as PL
    from megatron.training.arguments import parse_and_validate_args

    from megatron_cp.megatron.arguments import add_megatron_cp_args

    sys.argv = ["pretrain_llama.py"] + PL.expand_argv(
        ["--config", "tiny", "--use-cpu-initialization", "--seq-length", str(S), "--max-position-embeddings", str(S),
         *extra])
    return PL, parse_and_validate_args(extra_args_provider=add_megatron_cp_args)


class SkewedDataset:
    """Megatron GPT samples of S tokens: even samples one document (byte tokens, no EOD), odd ones documents of 8
    tokens (EOD 256 after every 7 bytes). DP rank 0 reads the even ones, DP rank 1 the odd ones, so DP 0's causal
    attention work is ~16x DP 1's: one plan over DP x CP must move DP 0's tokens onto DP 1's ranks."""

    def __init__(self, n):
        import torch

        g = torch.Generator().manual_seed(3)
        self.samples = []
        for i in range(n):
            s = torch.randint(0, 256, (S + 1,), generator=g)
            if i % 2:
                s[7::8] = 256
            self.samples.append(s)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        import torch

        s = self.samples[i]
        return {"tokens": s[:-1], "labels": s[1:], "loss_mask": torch.ones(S), "position_ids": torch.arange(S)}


def _worker(rank, world, extra=()):
    import torch
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_cp.megatron import plugin
    from tiny_llama import trainer

    PL, args = _parse(list(extra))
    args.context_parallel_size = CP  # Megatron's CP > 1 validation reads the CUDA architecture: set after it
    args.num_workers = 0
    trainer.init_parallel(1, CP)  # DP = world / CP
    batches, ahead = [], []  # each micro-batch's CPBatch as forward_step prepared it; whether planned ahead

    def keep(*a, _f=plugin.prepare_step_batch, **k):
        batches.append(_f(*a, **k))
        ahead.append(k.get("planned") is not None)
        return batches[-1]
    plugin.prepare_step_batch = keep
    out = {}
    for balance in (False, True):
        args.cp_balance_over_dp = balance
        plugin.validate_args(args)
        torch.manual_seed(0)
        model = GPTModelBuilder(gpt_config_from_args(args)).build_model(
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(), pre_process=True, post_process=True)
        it = iter(build_pretraining_data_loader(SkewedDataset(8), 0))
        output, loss_fn = plugin.forward_step(it, model)
        loss, n, _ = loss_fn(output)
        loss.backward()
        stats = torch.tensor([float(loss), float(n)], dtype=torch.float64)
        dist.all_reduce(stats)  # Megatron reduces the per-token loss and the token count over DP x CP
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.detach().clone()
            dist.all_reduce(g)  # and the gradients
            grads[name] = g.numpy()
        plan = batches[-1].params.plan
        # DP groups whose micro-batch this rank holds tokens of (the global plan may give it another group's)
        held = sorted({int(i) // S for i in plan.local_ids(batches[-1].params.cp_rank)}) if balance else [rank // CP]
        out[balance] = dict(loss=float(stats[0]), tokens=int(stats[1]), grads=grads, plan_ranks=plan.cp_size,
                            plan_tokens=plan.seqlen, held=held, ahead=ahead[-1],
                            window_plan=batches[-1].params.window_plan is not None)
    return out


@pytest.mark.parametrize("extra", [(), ("--window-size", "8,0", "--window-attn-skip-freq", "2")],
                         ids=["full layers", "windowed and full layers"])
def test_one_plan_over_dp_x_cp_trains_like_the_fixed_layout(extra):
    """Also with Megatron's windowed layers among full ones: the global plan's window plan on the same layout."""
    from megatron_cp.testing import run_ranks

    r_all = run_ranks(_worker, DP * CP, extra)
    fixed, glob = r_all[0][False], r_all[0][True]
    assert fixed["tokens"] == glob["tokens"] == DP * S  # the global batch: one sample of S tokens per DP rank
    # the fixed layout plans each DP group's S tokens over its CP pair; the global plan all DP x S over 4 ranks
    assert (fixed["plan_ranks"], fixed["plan_tokens"]) == (CP, S) and (glob["plan_ranks"], glob["plan_tokens"]) == (DP * CP, DP * S)
    assert abs(glob["loss"] - fixed["loss"]) <= 1e-5 * abs(fixed["loss"]), (glob["loss"], fixed["loss"])
    # windowed layers ran their own plan in both layouts
    assert all(x[b]["window_plan"] == bool(extra) for x in r_all for b in (False, True))
    # the global plan was made ahead by the planning thread (its tokens gathered there), on every rank; the fixed
    # layout's plans were made and checked across the CP pair there too (the step accepts the check)
    assert all(x[b]["ahead"] for x in r_all for b in (False, True)), [(x[False]["ahead"], x[True]["ahead"]) for x in r_all]
    assert 4.0 < fixed["loss"] / fixed["tokens"] < 7.0  # ~ln(320) at initialisation
    # DP 1's ranks also run part of DP 0's long document (the fixed layout keeps each group's tokens home)
    assert any(0 in x[True]["held"] for x in r_all[CP:]), [x[True]["held"] for x in r_all]
    assert fixed["grads"].keys() == glob["grads"].keys()
    for name, g in fixed["grads"].items():
        scale = np.abs(g).max()
        assert scale > 0, name
        assert np.abs(glob["grads"][name] - g).max() <= 1e-5 * scale, name
