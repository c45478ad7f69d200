"""Head-gated hybrid attention (megatron_cp.gating.attention) against the fp64 dense reference of
alpha * full + (1 - alpha) * streaming, forward and every gradient (q, k, v, gate), CP = 1 / 2 / 4 on
packed documents; a discretised pattern against the per-head mask reference; the streaming plan's
received K/V tokens (window-sized)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp.gating.attention import gated_attention, pattern_attention, streaming_plans
from megatron_cp.testing import reference_attention, run_ranks

S, HQ, HKV, D = 256, 4, 2, 8
SINK, WINDOW = 4, 24
CU = [0, 50, 130, 200, 256]


def _mask():
    return mcp.masks.varlen(CU, causal=True)


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"q": r(S, HQ, D), "k": r(S, HKV, D), "v": r(S, HKV, D), "dout": r(S, HQ, D),
            "gate": torch.tensor([0.3, 0.85], dtype=torch.float64)}


def _reference(t):
    mask, smask = _mask(), mcp.masks.streaming_within(_mask(), SINK, WINDOW)
    a = t["gate"].repeat_interleave(HQ // HKV)[None, :, None]
    f = reference_attention(t["q"], t["k"], t["v"], mask, dout=t["dout"] * a)
    s = reference_attention(t["q"], t["k"], t["v"], smask, dout=t["dout"] * (1 - a))
    dgate = (t["dout"] * (f.out - s.out)).sum((0, 2)).view(HKV, -1).sum(1)
    return {"out": a * f.out + (1 - a) * s.out, "dq": f.dq + s.dq, "dk": f.dk + s.dk, "dv": f.dv + s.dv,
            "dgate": dgate}


def _rank(rank, world, tensors):
    group = dist.group.WORLD if world > 1 else None
    full, stream = streaming_plans(_mask(), world, SINK, WINDOW)
    t = {n: torch.from_numpy(a) for n, a in tensors.items()}
    ids = torch.from_numpy(full.local_ids(rank))
    q, k, v = (mcp.dispatch(t[n], full, group).detach().requires_grad_() for n in ("q", "k", "v"))
    gate = t["gate"].clone().requires_grad_()
    out = gated_attention(q, k, v, full, stream, group, gate, backend="reference")
    (out * t["dout"][ids]).sum().backward()
    dgate = gate.grad.clone()
    if group is not None:
        dist.all_reduce(dgate, group=group)  # the gate is shared: its gradient sums over the ranks' tokens
    pat, _ = pattern_attention(q.detach(), k.detach(), v.detach(), full, stream, group, [False, True],
                               backend="reference")
    return {"ids": ids.numpy(), "out": out.detach().numpy(), "dq": q.grad.numpy(), "dk": k.grad.numpy(),
            "dv": v.grad.numpy(), "dgate": dgate.numpy(), "pattern": pat.numpy(),
            "recv_full": full.ranks[rank].num_remote, "recv_stream": stream.ranks[rank].num_remote,
            "runs": len(full.ranks[rank].segments)}


def _gather(ranks, name, shape):
    full = np.zeros(shape)
    for r in ranks:
        full[r["ids"]] = r[name]
    return torch.from_numpy(full)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gated_attention_and_gradients_against_fp64_reference(world):
    t = _tensors()
    ref = _reference(t)
    ranks = run_ranks(_rank, world, {n: a.numpy() for n, a in t.items()}) if world > 1 else \
        [_rank(0, 1, {n: a.numpy() for n, a in t.items()})]
    torch.testing.assert_close(_gather(ranks, "out", (S, HQ, D)), ref["out"], rtol=1e-10, atol=1e-10)
    # the backward recomputes probabilities from lse, float64 for float64 inputs
    for name, shape in (("dq", (S, HQ, D)), ("dk", (S, HKV, D)), ("dv", (S, HKV, D))):
        torch.testing.assert_close(_gather(ranks, name, shape), ref[name], rtol=1e-10, atol=1e-10, msg=name)
    for r in ranks:
        torch.testing.assert_close(torch.from_numpy(r["dgate"]), ref["dgate"], rtol=1e-10, atol=1e-10)
    # discretised: KV head 0 streaming, KV head 1 full = the per-head mask reference
    heads = torch.stack([torch.from_numpy(mcp.masks.streaming_within(_mask(), SINK, WINDOW).to_dense())] * 2
                        + [torch.from_numpy(_mask().to_dense())] * 2)
    want = reference_attention(t["q"], t["k"], t["v"], heads).out
    torch.testing.assert_close(_gather(ranks, "pattern", (S, HQ, D)), want, rtol=1e-10, atol=1e-10)
    # streaming heads move a window's worth: per run of local tokens at most the window before it, plus
    # the sinks of every document
    for r in ranks:
        assert r["recv_stream"] <= WINDOW * r["runs"] + SINK * (len(CU) - 1)
        assert r["recv_stream"] <= r["recv_full"]
    if world > 1:
        assert sum(r["recv_stream"] for r in ranks) < sum(r["recv_full"] for r in ranks)


def test_streaming_traffic_is_window_sized_at_length():
    mask = mcp.masks.varlen([0, 20000, 52000, 65536])
    full, stream = streaming_plans(mask, 8, 64, 256)
    recv = [r.num_remote for r in stream.ranks]
    assert all(n <= 256 * len(r.segments) + 64 * 3 for n, r in zip(recv, full.ranks)), recv
    # the layout is balanced for the full mask (runs of chunks): still over 10x less than the full heads move
    assert max(r.num_remote for r in full.ranks) > 10 * max(recv)


def test_bad_input_names_the_value():
    full, stream = streaming_plans(_mask(), 1, SINK, WINDOW)
    other = mcp.plan(mcp.masks.causal(S), 1, chunk_size=32)
    t = _tensors()
    with pytest.raises(ValueError, match="one value per KV head"):
        gated_attention(t["q"], t["k"], t["v"], full, stream, None, torch.ones(3), backend="reference")
    with pytest.raises(ValueError, match="one token layout"):
        gated_attention(t["q"], t["k"], t["v"], mcp.plan(_mask(), 2), stream, None, t["gate"], backend="reference")
    with pytest.raises(ValueError, match="expected one per KV head"):
        pattern_attention(t["q"], t["k"], t["v"], full, stream, None, [True], backend="reference")
    assert other.cp_size == 1


def test_intersection_and_streaming_within_match_dense():
    masks = [mcp.masks.causal(48), mcp.masks.varlen([0, 7, 19, 48]), mcp.masks.sliding_window(48, 5),
             mcp.masks.streaming(48, 3, 6), mcp.masks.full(48), mcp.masks.prefix_lm(48, 10),
             mcp.masks.strided(48, 8, 2), mcp.masks.global_local(48, 8, 1, 2, causal=True),
             mcp.masks.varlen([0, 13, 48], causal=False, window=(3, 2))]
    for a in masks:
        for b in masks:
            assert np.array_equal((a & b).to_dense(), a.to_dense() & b.to_dense()), (a, b)
    for n, s, w in ((40, 3, 6), (64, 0, 5), (64, 4, 1)):
        assert np.array_equal(mcp.masks.streaming_within(mcp.masks.causal(n), s, w).to_dense(),
                              mcp.masks.streaming(n, s, w).to_dense())
    m = mcp.masks.varlen([0, 10, 25, 40])
    i, j = np.indices((40, 40))
    start = np.array([0, 10, 25])[np.searchsorted([10, 25, 40], np.arange(40), side="right")]
    want = m.to_dense() & ((j - start[i] < 2) | (i - j < 4))
    assert np.array_equal(mcp.masks.streaming_within(m, 2, 4).to_dense(), want)


def test_bench_heads_dry_run(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "tools" / "bench_heads.py"), "--dry-run", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-5].startswith("| sparsity") and len(lines[-3:]) == 3
    rows = json.loads((tmp_path / "bench_heads.json").read_text())["rows"]
    assert [x["streaming_kv_heads"] for x in rows] == [0, 2, 3]
    assert (tmp_path / "bench_heads.png").stat().st_size > 0
