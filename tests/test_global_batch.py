"""One plan over the DP x CP world (runtime.global_batch): a two-layer model (causal documents, then a sliding
window within documents) on DP 2 x CP 2 gloo ranks, trained one step on the same global batch under the fixed
layout (each DP group plans its own micro-batch over its CP pair) and under one plan of the concatenated
micro-batches over all four ranks: loss and every gradient equal within 1e-5 in fp32, and the global plan's
work imbalance over the four ranks is a fraction of the fixed layout's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp.planner import plan_like
from megatron_cp.testing import run_ranks

DP, CP, L, VOCAB, HID, HQ, HKV, D, WINDOW = 2, 2, 256, 37, 16, 2, 1, 8, 24
# DP rank 0: one long document and a few short ones; DP rank 1: many short ones (its attention work is a
# fraction of rank 0's: the fixed layout waits for rank 0's CP pair)
DOCS = ([200, 20, 16, 20], [24, 40, 16, 32, 8, 40, 24, 16, 32, 24])
assert all(sum(d) == L for d in DOCS)


def _masks(docs):
    cu = np.concatenate([[0], np.cumsum(docs)])
    return mcp.masks.varlen(cu), mcp.masks.varlen(cu, window=WINDOW)


def _weights():
    g = torch.Generator().manual_seed(0)
    shapes = {"emb": (VOCAB, HID)} | {f"{n}{i}": s for i in range(2) for n, s in
                                      (("wq", (HID, HQ * D)), ("wk", (HID, HKV * D)), ("wv", (HID, HKV * D)),
                                       ("wo", (HQ * D, HID)))}
    return {n: (torch.randn(s, generator=g, dtype=torch.float64) * 0.3).float().requires_grad_() for n, s in shapes.items()}


def _batch(d):
    g = torch.Generator().manual_seed(10 + d)
    tokens = torch.randint(0, VOCAB, (L,), generator=g)
    labels = torch.randint(0, VOCAB, (L,), generator=g)
    loss_mask = (torch.rand(L, generator=g) > 0.2).float()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


def _loss_sum(w, b, plans, group):
    """Sum over this rank's tokens of the masked cross-entropy of a two-layer attention model."""
    h = w["emb"][b["tokens"]]
    for i, p in enumerate(plans):
        q, k, v = ((h @ w[f"w{n}{i}"]).view(-1, hh, D) for n, hh in (("q", HQ), ("k", HKV), ("v", HKV)))
        out, _ = mcp.attention(q, k, v, p, group)
        h = h + out.reshape(-1, HQ * D) @ w[f"wo{i}"]
    logp = torch.log_softmax(h @ w["emb"].T, dim=-1)
    return -(logp.gather(1, b["labels"][:, None])[:, 0] * b["loss_mask"]).sum()


def _rank(rank, world, layout):
    dp_rank, cp_rank = divmod(rank, CP)
    world_group = dist.group.WORLD
    pairs = [dist.new_group([d * CP + c for c in range(CP)]) for d in range(DP)]
    w = _weights()
    batch = _batch(dp_rank)
    count = sum(float(_batch(d)["loss_mask"].sum()) for d in range(DP))  # the global batch's tokens in the loss
    if layout == "fixed":
        m0, m1 = _masks(DOCS[dp_rank])
        p0 = mcp.plan(m0, CP)
        plans, group = (p0, plan_like(m1, p0)), pairs[dp_rank]
        ids = torch.from_numpy(p0.local_ids(cp_rank))
        local = {n: t[ids] for n, t in batch.items()}
    else:
        m0, m1 = (mcp.masks.block_diagonal(ms) for ms in zip(*(_masks(d) for d in DOCS)))
        p0 = mcp.plan(m0, world)
        plans, group = (p0, plan_like(m1, p0)), world_group
        local = mcp.gather_global_batch(batch, p0, group, dp_rank=dp_rank, cp_rank=cp_rank, cp_size=CP)
    loss = _loss_sum(w, local, plans, group) / count
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)  # the global batch's loss
    grads = {}
    for n, t in w.items():  # Megatron reduces gradients over DP x CP
        dist.all_reduce(t.grad)
        grads[n] = t.grad.numpy()
    area = int(p0.ranks[rank - dp_rank * CP if layout == "fixed" else rank].area)
    return {"loss": float(total), "grads": grads, "area": area, "tokens": int(local["tokens"].numel())}


@pytest.fixture(scope="module")
def runs():
    return {layout: run_ranks(_rank, DP * CP, layout) for layout in ("fixed", "global")}


def test_loss_and_every_gradient_equal_the_fixed_layout(runs):
    fixed, glob = runs["fixed"], runs["global"]
    assert abs(glob[0]["loss"] - fixed[0]["loss"]) <= 1e-5 * abs(fixed[0]["loss"])
    for n, g in fixed[0]["grads"].items():
        err = np.abs(glob[0]["grads"][n] - g).max() / np.abs(g).max()
        assert err <= 1e-5, (n, err)
    # every rank holds the same reduced values
    assert all(r["loss"] == glob[0]["loss"] for r in glob)


def test_the_global_plan_balances_the_work_the_fixed_layout_cannot(runs):
    def imbalance(rs):
        a = np.array([r["area"] for r in rs], dtype=float)
        return a.max() / a.mean() - 1
    fixed, glob = imbalance(runs["fixed"]), imbalance(runs["global"])
    assert fixed > 0.5 and glob < 0.1, (fixed, glob)
    assert sum(r["tokens"] for r in runs["global"]) == DP * L


def _bad(rank, world, case):
    dp_rank, cp_rank = divmod(rank, CP)
    p = mcp.plan(mcp.masks.block_diagonal([_masks(d)[0] for d in DOCS]), world)
    b = _batch(dp_rank)
    kw = dict(dp_rank=dp_rank, cp_rank=cp_rank, cp_size=CP)
    if case == "short":
        b["tokens"] = b["tokens"][:100]
    elif case == "all short":
        b = {n: t[:128] for n, t in b.items()}
    elif case == "cp":
        kw["cp_size"] = 3
    elif case == "place":
        kw["dp_rank"] = 0  # two ranks claim (0, cp_rank): found after the places' all-gather, on every rank
    try:
        mcp.gather_global_batch(b, p, dist.group.WORLD, **kw)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case, match", [("short", "lengths along dim 0 differ: {'labels': 256, 'loss_mask': 256, "
                                                   "'tokens': 100}"),
                                         ("all short", "(128,), expected the micro-batch's 256 tokens along dim 0 (the plan's 512 tokens over DP 2)"),
                                         ("cp", "cp_size=3 must be a positive int dividing the group's 4"),
                                         ("place", "disagree")])
def test_bad_input_raises_a_clear_error_on_every_rank(case, match):
    msgs = run_ranks(_bad, DP * CP, case)
    assert all(m is not None and match in m for m in msgs), msgs
