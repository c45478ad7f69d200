"""Distributed attention benchmark: megatron-cp vs our baselines vs PyTorch's native context parallel.

    torchrun --nproc-per-node 4 tools/bench_dist.py                      # 4 GPUs, S = 128k, 256k
    torchrun --nproc-per-node 2 tools/bench_dist.py --dry-run            # CPU (gloo), tiny sizes
    torchrun --nproc-per-node 4 tools/bench_dist.py --nodes 2            # 2 nodes of 2 GPUs emulated

Per S and mask, each implementation (IMPLS) runs forward and backward on the same random data, timed by Timer.run
(GPU time, the headline; wall; back to back); TFLOP/s per GPU = mask-area FLOPs / GPUs / the slowest rank's time.
torch-native is PyTorch's CP (SDPA ring on full / causal, else FlexAttention all-gather); kernel-only our kernel
alone on megatron-cp's tiles (the scaling reference); sparse rows select inside causal / packed masks on structured
q / k. Writes OUT/bench_dist<tag>.json (after every mask), .png and with --profile _profile.txt; ends with a table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib
import inspect
import itertools
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.attention.flex_attention import flex_attention

import megatron_cp as mcp
from megatron_cp import kernels
from megatron_cp.baselines import STRATEGIES, get_strategy, plan_for
from megatron_cp.comm import shared_gpu
from megatron_cp.masks import catalog
from megatron_cp.runtime import CostModel
from megatron_cp.runtime.state import states_of

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/
from common import (OURS, Progress, Timer, bar_panels, device_name, impl_list, impl_name,  # noqa: E402
                    local_rank_and_world, markdown_table, out_dir, parser, profile_step, run_record, timeline_summary,
                    write_json)

SPARSE_IMPLS = (f"{OURS}+xattention", f"{OURS}+moba")  # on the causal and packed masks only
# by default every baseline but head_context, which on one node (no --nodes) is Ulysses over every rank
IMPLS = ",".join((OURS, *SPARSE_IMPLS, *(s for s in STRATEGIES if s != "head_context"), "torch-native"))


def start_ranks(dry, share_gpu=False):
    """This rank's device, the process group up: CPU and gloo for a dry run, else its GPU and NCCL, or with
    ``share_gpu`` (correctness tools only) the ranks spread over the visible GPUs on gloo through host copies
    (``megatron_cp.comm.shared_gpu``). Ranks outnumbering the GPUs without ``share_gpu``: a ValueError first."""
    dev = torch.device("cpu") if dry else shared_gpu.rank_device(*local_rank_and_world(), share_gpu)
    if not dry:
        torch.cuda.set_device(dev)
    if not dist.is_initialized():  # bench_train's dry run: run_ranks's gloo processes
        backend = shared_gpu.backend_for(dev, share_gpu)
        dist.init_process_group(backend, device_id=dev if backend == "nccl" else None,
                                timeout=datetime.timedelta(minutes=10))
    return dev


def torchrun_record(dev, **extra):
    """run_record of this torchrun command on this rank's ``dev`` (num_devices: the ranks)."""
    cmd = f"torchrun --nproc-per-node {dist.get_world_size()} {os.path.relpath(sys.argv[0])} {' '.join(sys.argv[1:])}"
    return run_record(device_name(dev), cmd.strip(), num_devices=dist.get_world_size(), **extra)


def _rand(n, h, a, seed, grad=True):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(n, h, a.head_dim, generator=g) * 0.5).to(a.device, a.dtype).requires_grad_(grad)


def _sum_max(values, a):  # (sum, max) over the ranks
    t, tmax = (torch.tensor(values, dtype=torch.float64, device=a.device) for _ in range(2))
    dist.all_reduce(t, group=a.group)
    dist.all_reduce(tmax, op=dist.ReduceOp.MAX, group=a.group)
    return t.tolist(), tmax.tolist()


def timed(fn, q, k, v, a, profile=False):
    """Timer.run's times of ``fn(q, k, v)`` and its backward; ``profile``: one more step profiled (rank 0's kept)."""
    do = torch.randn_like(q)
    fwd = lambda: fn(q, k, v)  # noqa: E731

    def bwd(out):
        out.backward(do)
        q.grad = k.grad = v.grad = None

    times = a.timer.run(fwd, bwd, a.warmup, a.iters, a.group)
    if profile:
        events, host = profile_step(fwd, bwd, a.timer.sync, b2b=True)
        if a.rank == 0:
            with open(a.profile_path, "a") as f:
                f.write(timeline_summary(events, host, a.profile_title + " (back to back)"))
    return times


def bench_ours(name, mask, a):
    if name == OURS:
        plan = mcp.plan(mask, a.cp, topology=a.topology)  # nodes: hierarchical routes (one crossing a node)
        be = a.backend = kernels.get_backend("auto", a.device)  # one object: its state is reported
        fn = lambda q, k, v: mcp.attention(q, k, v, plan, a.group, backend=be, cost_model=a.cost_model)[0]  # noqa
    else:  # usp / head_context: groups of 2 GPUs (on one machine: 2-GPU "nodes" emulated) x cp / 2
        opts = {"ulysses_degree": 2} if name in ("usp", "head_context") and a.cp % 2 == 0 and a.cp > 2 else {}
        plan = plan_for(name, mask, a.cp, **(opts if name == "head_context" else {}))
        # the loss uses out only, as Megatron's core attention (which asks the same: lse_grad=False)
        strat = get_strategy(name, backend="auto", lse_grad=False, **opts)
        fn = lambda q, k, v: strat(q, k, v, plan, a.group, None)[0]  # noqa: E731
    qkv = (_rand(plan.num_local(a.rank), h, a, seed + a.rank) for h, seed in ((a.heads, 1), (a.kv_heads, 100),
                                                                              (a.kv_heads, 200)))
    return timed(fn, *qkv, a, profile=a.profile and name == OURS), plan


def bench_sparse(name, mask, a):
    """megatron-cp with a dynamic sparse selector inside ``mask``: (Timer.run's times, plan, the row's figures)."""
    from bench_sparse import structured_qk  # i.i.d. q / k give near-uniform attention: nearly every block kept

    xa, elem = name == SPARSE_IMPLS[0], a.dtype.itemsize
    # the dry run's sequences hold a few blocks of the published 128 / 512
    sel = (mcp.sparse.XAttention if xa else mcp.sparse.MoBA)(**({"block": 32 if xa else 64} if a.dry_run else {}))
    plan = mcp.plan(mask, a.cp, block=sel.block, guest_rows="none")  # what sparse_attention needs
    qk = structured_qk(plan.seqlen, a.heads, a.kv_heads, a.head_dim, a.device)
    q, k = (mcp.dispatch(t.to(a.dtype), plan, a.group, seq_dim=0).requires_grad_() for t in qk)
    del qk  # the full sequences: GBs at 256k
    v = _rand(plan.num_local(a.rank), a.kv_heads, a, 200 + a.rank)
    attend = functools.partial(mcp.sparse.sparse_attention, plan=plan, group=a.group, selector=sel,
                               backend=kernels.get_backend("auto", a.device))
    st = {}  # the figures from one call outside the timed steps (its stats synchronise), on their inputs
    with torch.no_grad():
        attend(q, k, v, stats=st)
    times = timed(lambda q, k, v: attend(q, k, v)[0], q, k, v, a)
    lay, hd = mcp.sparse.sparse_layout(plan, a.rank, sel.block), a.kv_heads * a.head_dim
    # XAttention reads the keys of every envelope block held elsewhere; MoBA all-reduces pooled keys (float32)
    sel_bytes = 0 if a.cp == 1 else hd * (int((lay.buf_owner != a.rank).sum()) * elem if xa else lay.num_blocks * 4)
    (got, need, sel_b, kept, env), (got_max, *_) = _sum_max(
        [st["rows_received"] * 2 * hd * elem, int(lay.recv_need.sum()) * 2 * hd * elem, sel_bytes,
         st["blocks_selected"], st["blocks_envelope"]], a)
    p = {f.name: getattr(sel, f.name) for f in dataclasses.fields(sel) if f.name not in ("block", "chunk_elements")}
    return times, plan, dict(selector=sel.name, block=sel.block, selector_params=p, inputs="structured",
                             kept_fraction=kept / env if env > 0 else 0.0, kv_bytes=int(got),
                             max_kv_bytes_received=int(got_max), envelope_kv_bytes=int(need),
                             selector_bytes=int(sel_b), bytes_moved=int(got + sel_b))


def kernel_only(base, plan, a):
    """Our backend alone on each rank's tiles (and guest tiles): the ranks' mean (scaling reference) and max."""
    rp, be, runs = plan.ranks[a.rank], a.backend, []
    calls = [(rp.tiles, rp.num_tokens, max(rp.buffer_len, 1))]
    if len(rp.guest_tiles) and sum(rp.guest_recv_counts()):
        calls.append((rp.guest_tiles, sum(rp.guest_recv_counts()), rp.num_tokens))
    for i, (tiles, sq, sk) in enumerate(calls):
        prep = be.prepare(torch.from_numpy(tiles.astype("int32")), sq, sk)
        q, k, v = (_rand(n, h, a, seed + 10 * i, grad=False)
                   for n, h, seed in ((sq, a.heads, 1), (sk, a.kv_heads, 2), (sk, a.kv_heads, 3)))
        out, lse = be.forward(q, k, v, prep, None)
        runs.append((q, k, v, prep, out, lse, torch.randn_like(out)))

    def fwd():
        for q, k, v, prep, *_ in runs:
            be.forward(q, k, v, prep, None)

    def bwd(_):  # as the runtime calls it: delta None (dense pieces take cuDNN's own path, unchecked against one)
        for q, k, v, prep, out, lse, do in runs:
            be.backward(q, k, v, out, lse, do, prep, None, None)

    (f_ms, b_ms), b2b = a.timer.medians(fwd, bwd, a.warmup, a.iters), a.timer.back_to_back(fwd, bwd, a.iters, a.group)
    (flops, f, b), (_, f_max, b_max) = _sum_max([4.0 * rp.area * a.heads * a.head_dim, f_ms, b_ms], a)
    row = dict(base, impl="kernel-only", fwd_ms=f / a.cp, bwd_ms=b / a.cp, fwd_max_ms=f_max, bwd_max_ms=b_max,
               fwd_tflops_per_gpu=flops / f / 1e9, bwd_tflops_per_gpu=2.5 * flops / b / 1e9)
    return row if b2b[0] is None else dict(row, fwd_b2b_ms=b2b[0] * 1e3, bwd_b2b_ms=b2b[1] * 1e3)


def _torch_cp(*names):
    """The first of ``names`` that PyTorch's CP package has, wherever this torch keeps it."""
    pkg = "torch.distributed.tensor.experimental"
    for name, mod in itertools.product(names, ("._attention", "._context_parallel._attention",
                                               "._context_parallel._load_balancer", "._load_balancer", "")):
        with contextlib.suppress(ImportError, AttributeError):
            return getattr(importlib.import_module(pkg + mod), name)
    raise ImportError(f"torch {torch.__version__} has none of {names} in {pkg}")


def bench_torch_native(mask_name, s, a):
    """PyTorch's context parallel: SDPA ring (full / causal) or FlexAttention all-gather CP."""
    mesh = a.mesh = getattr(a, "mesh", None) or DeviceMesh(a.device.type, list(range(a.cp)))
    g = torch.Generator(device="cpu").manual_seed(7)
    q, k, v = ((torch.randn(1, h, s, a.head_dim, generator=g) * 0.5).to(a.device, a.dtype)
               for h in (a.heads, a.kv_heads, a.kv_heads))
    if mask_name in ("full", "causal"):  # head-tail balance on causal only (the ring refuses it on full)
        _torch_cp("_cp_options").enable_load_balance = causal = mask_name == "causal"
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
            sdpa = functools.partial(F.scaled_dot_product_attention, is_causal=causal, enable_gqa=True)
            return timed(sdpa, q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), a)
    CP = _torch_cp("_ContextParallel")
    _torch_cp("_cp_options").enable_load_balance = True
    if not hasattr(a, "flex"):  # every (mask, S) is a new mask_mod / shape: one compilation each, not dynamo's 8
        import torch._dynamo as dynamo
        dynamo.config.recompile_limit, dynamo.config.accumulated_recompile_limit = 256, 4096
        a.flex = torch.compile(flex_attention, dynamic=False)

    class Flex(torch.nn.Module):
        def forward(self, q, k, v, block_mask):
            return a.flex(q, k, v, block_mask=block_mask, enable_gqa=True)

    mod = parallelize_module(Flex(), mesh, CP(seq_dim=2, attention_type=CP.AttentionType.FLEX))
    lb = _torch_cp("_HeadTailLoadBalancer")(s, a.cp, a.device)
    # the CP BlockMask (Q shard x global KV): the builder's name and signature change between torch releases
    make, block = _torch_cp("create_cp_block_mask", "_create_cp_block_mask"), 16 if a.dry_run else 128
    values = {"mask_mod": catalog.mask_mod(mask_name, s, a.device), "B": 1, "H": 1, "Q_LEN": s, "KV_LEN": s,
              "BLOCK_SIZE": (block, block), "device_mesh": mesh, "load_balancer": lb}
    bm = make(**{n: v for n, v in values.items() if n in inspect.signature(make).parameters})
    local = _torch_cp("_context_parallel_shard")(mesh, [q, k, v], [2, 2, 2], load_balancer=lb)
    ql, kl, vl = (t.detach().contiguous().requires_grad_() for t in local)
    return timed(lambda q, k, v: mod(q, k, v, block_mask=bm), ql, kl, vl, a)


def run_case(impl, mask, base, a):
    """The rows of one implementation on one mask (an error recorded, not raised; megatron-cp: and kernel-only)."""
    s, mname, cp = base["seqlen"], base["mask"], a.cp
    rec = dict(base, impl=impl if impl != "torch-native" else
               "torch-sdpa-ring" if mname in ("full", "causal") else "torch-flex-allgather")
    a.profile_title = f"{rec['impl']} {mname} S={s} rank {a.rank} of {cp} ({a.dev_name}), right after another step"
    try:
        if impl == "torch-native":
            times = bench_torch_native(mname, s, a)
        elif impl in SPARSE_IMPLS:
            times, plan, figures = bench_sparse(impl, mask, a)
            rec.update(figures)
        else:
            times, plan = bench_ours(impl, mask, a)
        flops = 4.0 * mask.area() * a.heads * a.head_dim / cp / 1e12  # forward TFLOP per GPU
        for p, gpu, wall, b2b, x in (("fwd", *times[0::2], 1.0), ("bwd", *times[1::2], 2.5)):  # Timer.run's order
            rec.update({f"{p}_ms": gpu * 1e3, f"{p}_tflops_per_gpu": x * flops / gpu, f"{p}_wall_ms": wall * 1e3,
                        f"{p}_wall_tflops_per_gpu": x * flops / wall})
            if b2b is not None:  # back to back: each rank's GPU and host issue times too
                rec.update({f"{p}_b2b_ms": b2b * 1e3}, b2b_ranks_ms=[[y * 1e3 for y in r] for r in a.timer.b2b_ranks])
        if impl != OURS:
            return [rec]
        stats = lambda p: p.stats(num_kv_heads=a.kv_heads, head_dim=a.head_dim, dtype_bytes=a.dtype)  # noqa: E731
        st = stats(plan)
        rec.update({k: st[k] for k in ("imbalance", "max_remote_kv_tokens", "guest_rows")}, kv_bytes=st["bytes_moved"],
                   max_kv_bytes_received=st["max_bytes_received"],  # stages 0: a single exchange
                   stages=[0 if x.schedule is None else x.schedule.num_stages for x in states_of(plan)],
                   cudnn_off={str(key): found.reason for key, found in getattr(a.backend, "cudnn_probes", {}).items()
                              if found.layout is None})  # families the cuDNN probe turned down: Triton alone
        if a.topology is not None:  # bytes across the emulated nodes, with flat routes and with the flat plan
            flat = dataclasses.replace(mcp.plan(mask, cp), topology=a.topology)
            rec.update(inter_node_bytes=st["inter_node_bytes_hierarchical"],
                       inter_node_bytes_flat_routes=st["inter_node_bytes"],
                       flat_plan_inter_node_bytes=stats(flat)["inter_node_bytes"])
        return [kernel_only(base, plan, a), rec]
    except Exception as e:  # record and go on (a failure on every rank, e.g. an API missing)
        rec["error"] = f"{type(e).__name__}: {e}"
        if a.rank == 0:
            traceback.print_exc()
        torch.cuda.empty_cache()  # a no-op without CUDA
        return [rec]


def case_line(r):
    skip = ("mask", "seqlen", "impl", "cp", "density", "b2b_ranks_ms", "selector_params")
    return f"S={r['seqlen']:>7} {r['mask']:<15}{r['impl']:<22} " + "  ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items() if k not in skip)


def main(argv=None):
    ap = parser(__doc__, "out", timing=(2, 5))
    ap.add_argument("--seqlens", default=None, help="comma list of total S (default 131072,262144; dry run 256)")
    ap.add_argument("--masks", default=",".join(catalog.DIST_MASKS))
    ap.add_argument("--impls", default=IMPLS, help="comma list (module doc); the sparse ones run on causal and packed")
    ap.add_argument("--heads", type=int, default=None, help="query heads (default 32; dry run 4)")
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default 8; dry run 2)")
    ap.add_argument("--cost", default=None, help="CostModel JSON (tools/sim/calibrate.py) for megatron-cp's stages")
    ap.add_argument("--profile", action="store_true", help="profile one more megatron-cp step per case, back to back")
    ap.add_argument("--nodes", type=int, default=1, help="plan megatron-cp as if the GPUs were this many nodes")
    a = ap.parse_args(argv)
    world, dry = int(os.environ.get("WORLD_SIZE", 1)), a.dry_run
    if a.nodes < 1 or world % a.nodes:
        raise SystemExit(f"--nodes {a.nodes} must be >= 1 and divide the {world} processes")
    a.heads, a.kv_heads, a.head_dim = a.heads or (4 if dry else 32), a.kv_heads or (2 if dry else 8), 16 if dry else 128
    a.warmup, a.iters = (min(a.warmup, 1), min(a.iters, 1)) if dry else (a.warmup, a.iters)  # dry: times mean nothing
    seqlens, masks = [int(x) for x in (a.seqlens or ("256" if dry else "131072,262144")).split(",")], a.masks.split(",")
    a.device = start_ranks(dry)
    vars(a).update(rank=dist.get_rank(), cp=dist.get_world_size(), group=dist.group.WORLD, dtype=torch.bfloat16,
                   timer=Timer(a.device), dev_name=device_name(a.device),
                   cost_model=CostModel.load(a.cost) if a.cost else None)
    a.topology = mcp.Topology(a.nodes, a.cp // a.nodes) if a.nodes > 1 else None
    stem = os.path.join(out_dir(a), f"bench_dist{a.tag}") if a.rank == 0 else None
    a.profile_path = f"{stem}_profile.txt"
    meta = torchrun_record(a.device, nodes=a.nodes, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
                           dtype=str(a.dtype), masks={m: catalog.DESCRIPTIONS[m] for m in masks},
                           flops="forward 4*area*Hq*D, backward 2.5x; per GPU: / cp / the slowest rank's time",
                           bytes="kv_bytes: forward K/V bytes received, summed over ranks")
    results, impls = [], impl_list(a.impls)
    bar = Progress(len(seqlens) * len(masks) * len(impls), "bench_dist", enabled=a.rank == 0, verbose=a.verbose)
    for s, mname in itertools.product(seqlens, masks):
        mask = catalog.build(mname, s)
        for impl in impls:
            if impl in SPARSE_IMPLS and mname not in ("causal", "packed"):
                bar.step()
                continue
            bar.running(f"S={s} {mname} {impl}")
            results += run_case(impl, mask, dict(mask=mname, seqlen=s, cp=a.cp, density=mask.density()), a)
            if (err := "error" in results[-1]) and a.rank == 0:
                bar.note(case_line(results[-1]))
            bar.step(None if err else case_line(results[-1]))
            dist.barrier(a.group)
        if a.rank == 0:  # after every mask: a run cut short keeps what it measured
            write_json(stem + ".json", {**meta, "complete": (s, mname) == (seqlens[-1], masks[-1]), "results": results,
                                        "checks": summarize(results, False)})
    bar.close()
    if a.rank == 0:
        plot(results, meta, stem + ".png")
        print(f"wrote {stem}.json\n" + "\n".join(summary_table(results, summarize(results, False))))
    dist.destroy_process_group()


def summarize(results, show=True):
    """The checks per S and mask (``show``: printed): megatron-cp vs the torch peer and vs kernel-only in each
    timing; each sparse row's time and bytes vs the dense envelope's."""
    checks = []
    ok = {(r["mask"], r["seqlen"], impl_name(r["impl"])): r for r in results if "error" not in r}
    for s, m in itertools.product(sorted({r["seqlen"] for r in results}), sorted({r["mask"] for r in results})):
        if (ours := ok.get((m, s, OURS))) is not None:
            ref_name = "torch-sdpa-ring" if m in ("full", "causal") else "torch-flex-allgather"
            ref, kern, c = ok.get((m, s, ref_name)), ok.get((m, s, "kernel-only")), dict(mask=m, seqlen=s)
            if ref is not None:
                c.update(vs=ref_name, need=1.1 if m in ("full", "causal") else 1.5)
            for (other, kind), p in itertools.product(((ref, "ratio"), (kern, "scaling")), ("fwd", "bwd")):
                if other is None:
                    continue
                tput, wall, b2b = f"{p}_tflops_per_gpu", f"{p}_wall_tflops_per_gpu", f"{p}_b2b_ms"
                c[f"{p}_{kind}"] = ours[tput] / other[tput]
                wall_ref = wall if kind == "ratio" else tput  # kernel-only: GPU time only
                if wall in ours and wall_ref in other:
                    c[f"{p}_wall_{kind}"] = ours[wall] / other[wall_ref]
                if ours.get(b2b) and other.get(b2b):  # same FLOPs: the time ratio is the throughput ratio
                    c[f"{p}_b2b_{kind}"] = other[b2b] / ours[b2b]
            dense = ours.get("kv_bytes") or 0
            div = lambda a, b: a / b if b else None  # noqa: E731
            sparse = [dict(impl=i, kept_fraction=sp["kept_fraction"], fwd_time_ratio=sp["fwd_ms"] / ours["fwd_ms"],
                           bwd_time_ratio=sp["bwd_ms"] / ours["bwd_ms"], kv_bytes_ratio=div(sp["kv_bytes"], dense),
                           bytes_ratio=div(sp["bytes_moved"], dense),
                           layout_kv_bytes_ratio=div(sp["kv_bytes"], sp["envelope_kv_bytes"]))
                      for i in SPARSE_IMPLS if (sp := ok.get((m, s, i))) is not None]
            if sparse:
                c["sparse_vs_dense"] = sparse
            checks.append(c)
    if show:
        print("\n".join(summary_table(results, checks)))
    return checks


def check_text(c):
    """A check's cell of the summary table."""
    parts = ([f"vs {c['vs']}: fwd {c['fwd_ratio']:.2f}x bwd {c['bwd_ratio']:.2f}x (need {c['need']}x)"]
             if "vs" in c else [])
    if "fwd_scaling" in c:
        parts.append(f"scaling vs kernel-only: fwd {c['fwd_scaling']:.2f} bwd {c['bwd_scaling']:.2f}")
    for tag, label in (("wall", "wall time"), ("b2b", "back to back")):  # the other two timings
        sub = [f"{pre}{c[f'fwd_{tag}_{k}']:.2f}{x} / {c[f'bwd_{tag}_{k}']:.2f}{x}"
               for k, pre, x in (("ratio", "", "x"), ("scaling", "scaling ", "")) if f"fwd_{tag}_{k}" in c]
        if sub:
            parts.append(f"{label}: " + ", ".join(sub))
    ratio = lambda r: "-" if r is None else f"{r:.2f}x"  # noqa: E731
    parts += [f"{x['impl']} vs dense envelope: time fwd {x['fwd_time_ratio']:.2f}x bwd {x['bwd_time_ratio']:.2f}x, "
              f"K/V bytes {ratio(x['kv_bytes_ratio'])} (with selector {ratio(x['bytes_ratio'])}; of its block "
              f"layout's dense exchange {ratio(x['layout_kv_bytes_ratio'])}), kept {x['kept_fraction']:.3f}"
              for x in c.get("sparse_vs_dense", ())]
    return "; ".join(parts)


def summary_table(results, checks):
    """The closing table (lines): per S and mask, each implementation's fwd / bwd TFLOP/s and the checks' text."""
    impls = sorted(dict.fromkeys(r["impl"] for r in results), key=lambda i: i == "kernel-only")  # it last
    tf = lambda x: f"{x:.1f}" if x >= 1 else f"{x:.2g}"  # noqa: E731  (the dry run's tiny rates: two digits)
    text = {(c["seqlen"], c["mask"]): check_text(c) for c in checks}
    got = {(r["seqlen"], r["mask"], r["impl"]): r for r in results}
    cell = lambda r: ("-" if r is None else "err" if "error" in r  # noqa: E731
                      else f"{tf(r['fwd_tflops_per_gpu'])} / {tf(r['bwd_tflops_per_gpu'])}")
    rows = [[s, m, *(cell(got.get((s, m, i))) for i in impls), text.get((s, m), "")]
            for s, m in dict.fromkeys((r["seqlen"], r["mask"]) for r in results)]
    return (["TFLOP/s per GPU as fwd / bwd (GPU time; sparse rows: the envelope's FLOPs); checks: megatron-cp "
             "vs the torch peer and vs kernel-only, the sparse rows' time and bytes vs the dense envelope"]
            + markdown_table(["S", "mask", *impls, "checks"], rows))


def plot(results, meta, path):
    """TFLOP/s per GPU, one panel per S and phase, a bar per mask and implementation."""
    if not (ok := [r for r in results if "error" not in r]):
        return
    masks, impls = list(dict.fromkeys(r["mask"] for r in ok)), list(dict.fromkeys(r["impl"] for r in ok))
    val = {(r["seqlen"], r["mask"], r["impl"], p): r[f"{p}_tflops_per_gpu"] for r in ok for p in ("fwd", "bwd")}
    panels = [dict(labels=masks, ylabel="TFLOP/s per GPU", title=f"{title}, S = {s}",
                   series={i: [val.get((s, m, i, p), 0) for m in masks] for i in impls})
              for s in sorted({r["seqlen"] for r in ok}) for p, title in (("fwd", "forward"), ("bwd", "backward"))]
    bar_panels(path, panels, f"{meta['num_devices']} x {meta['device']}, {meta['date']}\n{meta['command']}", cols=2)


if __name__ == "__main__":
    main()
