"""Ranks sharing a GPU (megatron_cp.comm.shared_gpu) on CPU: the rank -> device mapping and the backend choice,
every collective of the shared-GPU process group against gloo's, CP attention over it, the timing tools' refusal,
and Megatron layouts (TP x CP + SP, PP x CP) trained over it. CUDA tensors' host staging runs on the GPU machines
(tools/gpu_dist_check.py --share-gpu); here the group carries CPU tensors through the same code."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp.comm import shared_gpu
from megatron_cp.testing import reference_attention, run_ranks


def test_rank_device_maps_ranks_onto_gpus_or_refuses_before_any_group():
    with mock.patch.object(torch.cuda, "device_count", lambda: 2):
        assert [shared_gpu.rank_device(r, 4, share_gpu=True).index for r in range(4)] == [0, 1, 0, 1]
        assert shared_gpu.rank_device(1, 2).index == 1  # a GPU each
        with pytest.raises(ValueError, match=r"4 ranks on this host but 2 GPU\(s\) visible.*share_gpu=True"):
            shared_gpu.rank_device(0, 4)
        with pytest.raises(ValueError, match="local rank 4 is outside the 4 ranks"):
            shared_gpu.rank_device(4, 4, share_gpu=True)
    with mock.patch.object(torch.cuda, "device_count", lambda: 0):
        with pytest.raises(ValueError, match="needs a GPU and none is visible"):
            shared_gpu.rank_device(0, 2, share_gpu=True)
    assert shared_gpu.backend_for("cpu", share_gpu=True) == "gloo"
    assert shared_gpu.backend_for("cuda:0") == "nccl"
    assert shared_gpu.backend_for("cuda:0", share_gpu=True) == shared_gpu.BACKEND
    assert not shared_gpu.ranks_share_gpu()  # no process group here


def test_timing_tools_refuse_ranks_that_outnumber_gpus(monkeypatch):
    """bench_dist and bench_train start ranks through bench_dist.start_ranks, calibrate through rank_device, both with
    torchrun's local rank and size read by tools/common.py (the library reads no environment): ranks that would share
    a GPU are refused before any process group (times there would mean nothing)."""
    from test_tools import _tool

    bench = _tool("bench_dist")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"4 ranks on this host but 1 GPU\(s\) visible"):
        bench.start_ranks(False)
    assert not dist.is_initialized()


def _collectives(rank, world):
    """Every collective on the shared-GPU group and on gloo's world group, results side by side."""
    shared = dist.new_group(list(range(world)), backend=shared_gpu.BACKEND)
    assert dist.get_backend(shared) == shared_gpu.BACKEND
    out = {}
    for name, group in (("shared", shared), ("gloo", dist.group.WORLD)):
        got = []
        for dt in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
            x = torch.arange(6, dtype=dt).reshape(2, 3) + 10 * rank
            a = x.clone()
            dist.all_reduce(a, group=group)
            m = x.clone()
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            g = torch.empty(2 * world, 3, dtype=dt)
            dist.all_gather_into_tensor(g, x, group=group)
            gl = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(gl, x, group=group)
            rs = torch.empty(1, 3, dtype=dt)
            full = torch.arange(3 * world, dtype=dt).reshape(world, 3) * (rank + 1)
            dist.reduce_scatter_tensor(rs, full, group=group)
            b = x.clone()
            dist.broadcast(b, src=world - 1, group=group)
            counts = [(rank + d) % 3 for d in range(world)]  # rows to rank d
            recv = [(s + rank) % 3 for s in range(world)]
            send = torch.arange(sum(counts) * 2, dtype=dt).reshape(-1, 2) + 100 * rank
            a2a = torch.empty(sum(recv), 2, dtype=dt)
            dist.all_to_all_single(a2a, send, recv, counts, group=group)
            ga = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
            dist.gather(x, ga, dst=0, group=group)
            sc = torch.empty_like(x)
            parts = [x * (d + 1) for d in range(world)] if rank == world - 1 else None
            dist.scatter(sc, parts, src=world - 1, group=group)
            p = torch.empty(2, dtype=dt)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x[0, :2].contiguous(), (rank + 1) % world, group),
                                           dist.P2POp(dist.irecv, p, (rank - 1) % world, group)])
            for r in reqs:
                r.wait()
            got.append([t.double().numpy() for t in (a, m, g, *gl, rs, b, *(ga or []), sc, a2a, p)])
        if group is shared:
            with dist._coalescing_manager(group, async_ops=True) as cm:  # Megatron's DDP gradient sync
                c1, c2 = torch.ones(3) * rank, torch.ones(2)
                dist.all_reduce(c1, group=group)
                dist.all_reduce(c2, group=group)
            cm.wait()
            got.append([c1.numpy(), c2.numpy()])
        objs = [None] * world
        dist.all_gather_object(objs, {"rank": rank}, group=group)
        got.append([o["rank"] for o in objs])
        dist.barrier(group=group)
        out[name] = got
    try:
        shared_gpu.refuse_timing("a timing tool", shared)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    shared_gpu.refuse_timing("a timing tool")  # gloo's world: no refusal
    return out, refused


def test_every_collective_of_the_shared_group_equals_gloos():
    world = 3
    for out, refused in run_ranks(_collectives, world):
        sh, gl = out["shared"], out["gloo"]
        for per_dtype_sh, per_dtype_gl in zip(sh[:4], gl[:4]):
            for a, b in zip(per_dtype_sh, per_dtype_gl):
                np.testing.assert_array_equal(a, b)
        assert [v.tolist() for v in sh[4]] == [[float(sum(range(world)))] * 3, [float(world)] * 2]
        assert sh[5] == gl[4] == list(range(world))
        assert refused is not None and "times that mean nothing" in refused


def _attention_over(rank, world, mask, q, k, v, do, backend):
    group = dist.group.WORLD if backend == "gloo" else dist.new_group(list(range(world)), backend=backend)
    plan = mcp.plan(mask, world)
    ql, kl, vl = (mcp.dispatch(t, plan, group).detach().requires_grad_() for t in (q, k, v))
    out, lse = mcp.attention(ql, kl, vl, plan, group)
    out.backward(mcp.dispatch(do, plan, group))
    return {name: mcp.undispatch(t.detach(), plan, group).numpy()
            for name, t in (("out", out), ("lse", lse), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad))}


def test_cp_attention_over_the_shared_group_is_exact():
    """Forward and backward at cp 3 on a packed mask over the shared-GPU group: equal to the same run over gloo
    (the same kernels and exchanges), and to the fp64 dense reference."""
    mask = mcp.masks.varlen([0, 40, 41, 130, 192], causal=True)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(192, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    shared = run_ranks(_attention_over, 3, mask, q, k, v, do, shared_gpu.BACKEND)[0]
    gloo = run_ranks(_attention_over, 3, mask, q, k, v, do, "gloo")[0]
    ref = reference_attention(q, k, v, mask, dout=do, dtype=torch.float64)
    for name in ("out", "lse", "dq", "dk", "dv"):
        np.testing.assert_array_equal(shared[name], gloo[name])
    for name in ("out", "dq", "dk", "dv"):
        np.testing.assert_allclose(shared[name], getattr(ref, name).numpy(), atol=1e-6, rtol=0)
    np.testing.assert_allclose(shared["lse"], ref.lse.numpy(), atol=1e-6, rtol=0)


def test_megatron_layouts_train_over_the_shared_group():
    """The recipes' trainer with its process group made by ``spawn_jobs(..., share_gpu=True)`` (CPU ranks here):
    TP 2 x CP 2 + SP (all-gathers, reduce-scatters) and PP 2 x CP 2 (point-to-point) equal CP 1 within the fp32
    bound, and the runs carry no time (tokens/s None)."""
    from test_recipes import load_runner
    from tiny_llama.convergence import Layout, Run, spawn_jobs, tokens_per_s_per_gpu

    runner = load_runner()
    job = runner.jobs_for("tp2cp2_sp", "tiny", 4)[1]  # the fp32 check
    assert job.train.dtype == "fp32"
    job.runs = [Run("cp1", Layout()), Run("tp2xcp2+sp", Layout(tp=2, cp=2, sp=True)), Run("cp2xpp2", Layout(cp=2, pp=2))]
    runs = spawn_jobs([job], 4, "cpu", verbose=False, share_gpu=True)[0]["runs"]
    assert set(runs) == {"cp1", "tp2xcp2+sp", "cp2xpp2"}
    ref = runs["cp1"]["losses"]
    for name, r in runs.items():
        assert r["ranks_share_gpu"] and tokens_per_s_per_gpu(r) is None
        assert len(r["losses"]) == job.train.steps
        assert max(abs(a - b) / a for a, b in zip(ref, r["losses"])) <= runner.FP32_STEP, (name, r["losses"], ref)
