"""Distributed attention benchmark: megatron-cp vs our baselines vs PyTorch's native context parallel.

Run under torchrun (NCCL on GPUs; gloo for the CPU dry run). For every total sequence length and
mask, each implementation runs forward and backward on the same random bf16 data; per-GPU TFLOP/s
counts mask-area FLOPs (forward 4 * area * Hq * D, backward 2.5x) divided by the GPU count and by the
slowest rank's time. Also measured, per rank and without any communication: our kernel on exactly
the tiles and K/V buffer megatron-cp gives that rank ("kernel-only"), the single-GPU throughput on
the same per-GPU work that the scaling check compares against.

Implementations: ``megatron-cp`` (planner + runtime, stage count chosen by the cost model), ``ring``, ``ulysses``,
``usp`` (ulysses 2 x ring), ``head_context`` (ulysses 2 x our planned CP), ``allgather``
(megatron_cp.baselines), ``torch-sdpa-ring`` (PyTorch
``context_parallel`` over SDPA, head-tail balance; full and causal only) and ``torch-flex-allgather``
(PyTorch's FlexAttention CP: all-gather K/V, compiled flex_attention, head-tail balance; other masks).

Dynamic sparsity inside the mask's envelope (causal and packed documents only, ``SPARSE_ENVELOPES``):
``megatron-cp+xattention`` and ``megatron-cp+moba`` run ``megatron_cp.sparse.sparse_attention`` with
``XAttention()`` / ``MoBA()`` at their default thresholds (``--tiny``: the same with smaller blocks), on a
plan made with ``block=`` the selector's block and ``guest_rows="none"``, by default on q / k with
structured attention (tools/bench_sparse.py's ``structured_qk``; v random); the timed step includes the
selection and its host synchronisation (the exchange's counts). Their rows add the kept fraction (head x q
block x key block pairs kept / in the envelope) and bytes moved, beside the dense megatron-cp row's
``kv_bytes`` (the plan's K/V traffic, ``Plan.stats``): ``kv_bytes`` (K/V rows of the selected blocks
received, ``sparse_attention(stats=)``; the backward returns the same rows' dK/dV), ``envelope_kv_bytes``
(what the dense exchange of the same block layout would move) and ``selector_bytes`` (XAttention: the keys
of the whole envelope that its scoring reads; MoBA: its pooled-key all-reduce payload). Their TFLOP/s
count the envelope's FLOPs (an effective rate); the summary compares their time and bytes with the dense
envelope's megatron-cp row, and their K/V bytes with their own layout's dense exchange: a plan in whole
blocks can move more than the dense plan (packed documents at S 262144, cp 4: 3,168 K/V tokens at MoBA's block
512 and 2,320 at XAttention's 128, against 428 unaligned: each block-rounded owner change hands up to a block of
one document to the other rank), so the second ratio is what the selection itself saves.

``--nodes N`` (N divides the GPUs) emulates N nodes on one host for megatron-cp: its plan is made for
``Topology(N, GPUs / N)`` and its routes are hierarchical (a K/V row crosses the node boundary once per
destination node; the links are all NVLink, so the time shows the routes' cost, not the network's). Its rows
add ``inter_node_bytes`` (K/V bytes across the boundary, forward), ``inter_node_bytes_flat_routes`` (the same
plan with one flat all-to-all) and ``flat_plan_inter_node_bytes`` (the plan made without the topology).

    torchrun --nproc-per-node 4 tools/bench_dist.py                      # 4 GPUs, S = 128k, 256k
    torchrun --nproc-per-node 2 tools/bench_dist.py --device cpu --tiny  # CPU dry run (gloo)
    torchrun --nproc-per-node 4 tools/bench_dist.py --nodes 2            # 2 nodes of 2 GPUs emulated
    python tools/run_dist_suite.py --out DIR         # checks, calibration, this, the simulator's prediction

While it runs, rank 0 shows a progress bar on stderr naming the case (S, mask, implementation) being run
(redrawn at most every 30 s where stderr is not a terminal: tools/common.py); each case's line goes to
stderr with ``--verbose``. It ends with one table on stdout: per S and mask, each implementation's
fwd / bwd TFLOP/s per GPU and the checks (``summarize``).

Writes <--out-dir>/bench_<n>x<device>_<date>.json and .png (device, date and command inside); the default
out/ is ignored by git. Results the README quotes go to a dated folder, benchmarks/YYYY-MM-DD_<device>_<what>/,
with a README.md giving the command, indexed in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp import kernels
from megatron_cp.baselines import get_strategy, plan_for
from megatron_cp.masks import catalog
from megatron_cp.runtime import CostModel
from megatron_cp.runtime.state import states_of

# tools/ (this script's folder, first on sys.path when it runs as a script): the shared step timer and
# the profiler summary, modules of their own so that tools/sim/calibrate.py times kernels the same way
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Progress, Timer, markdown_table, profile_step, run_record, timeline_summary  # noqa: E402


def _rand_local(n, h, d, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(n, h, d, generator=g) * 0.5).to(device=device, dtype=dtype)


def bench_ours(name, mask, args, ctx):
    """megatron-cp or one of our baselines; returns (fwd_s, bwd_s)."""
    rank, cp, device, dtype, group = ctx["rank"], ctx["cp"], ctx["device"], ctx["dtype"], ctx["group"]
    if name == "megatron-cp":
        plan = mcp.plan(mask, cp, topology=ctx["topology"])  # nodes: hierarchical routes (one crossing a node)
        cost = CostModel.load(args.cost) if args.cost else None
        be = ctx["backend"] = kernels.get_backend(args.backend, device)  # one object: its state is reported
        fn = lambda q, k, v: mcp.attention(q, k, v, plan, group, backend=be, cost_model=cost)  # noqa: E731
    else:
        # usp / head_context: groups of 2 GPUs (on one machine: 2-GPU "nodes" emulated) x cp / 2
        opts = {"ulysses_degree": 2} if name in ("usp", "head_context") and cp % 2 == 0 and cp > 2 else {}
        plan = plan_for(name, mask, cp, **(opts if name == "head_context" else {}))
        # the loss uses out only, as Megatron's core attention (which asks the same: lse_grad=False)
        strat = get_strategy(name, backend=args.backend, lse_grad=False, **opts)
        fn = lambda q, k, v: strat(q, k, v, plan, group, None)  # noqa: E731
    n = plan.num_local(rank)
    q = _rand_local(n, args.heads, args.head_dim, dtype, device, 1 + rank).requires_grad_()
    k = _rand_local(n, args.kv_heads, args.head_dim, dtype, device, 100 + rank).requires_grad_()
    v = _rand_local(n, args.kv_heads, args.head_dim, dtype, device, 200 + rank).requires_grad_()
    do = torch.randn_like(q)

    def fwd():
        return fn(q, k, v)[0]

    def bwd(out):
        out.backward(do)
        q.grad = k.grad = v.grad = None

    times = ctx["timer"].run(fwd, bwd, args.warmup, args.iters, group)
    if args.profile and name == "megatron-cp":  # one more step under torch.profiler (all ranks), rank 0's written
        events, host = profile_step(fwd, bwd, ctx["timer"].sync, b2b=args.profile_b2b)
        if rank == 0:
            title = (f"{name} {ctx['mask_name']} S={ctx['seqlen']} rank {rank} of {cp} ({ctx['dev_name']})"
                     + (", right after another step (back to back)" if args.profile_b2b else ""))
            with open(args.profile, "a") as f:
                f.write(timeline_summary(events, host, title))
    return times, plan


SPARSE_IMPLS = ("megatron-cp+xattention", "megatron-cp+moba")
SPARSE_ENVELOPES = ("causal", "packed")  # the envelopes the sparse rows run on (other masks: no row)


def sparse_selector(name, tiny):
    """The selector of a sparse implementation at its default thresholds; ``tiny``: smaller blocks (the
    CPU dry run's sequences hold a few of the published 128 / 512)."""
    from megatron_cp import sparse

    if name == "megatron-cp+xattention":
        return sparse.XAttention(block=32) if tiny else sparse.XAttention()
    if name == "megatron-cp+moba":
        return sparse.MoBA(block=64) if tiny else sparse.MoBA()
    raise ValueError(f"unknown sparse implementation {name!r}: one of {SPARSE_IMPLS}")


def bench_sparse(name, mask, args, ctx):
    """megatron-cp with a dynamic sparse selector inside ``mask`` (the envelope): (times as Timer.run,
    plan, figures): figures hold the selector's block and parameters, the kept fraction and the bytes
    (module doc), summed over ranks, and the most K/V bytes one rank received."""
    rank, cp, device, dtype, group = ctx["rank"], ctx["cp"], ctx["device"], ctx["dtype"], ctx["group"]
    sel = sparse_selector(name, args.tiny)
    # whole blocks per rank and every row computed at home: what sparse_attention needs
    plan = mcp.plan(mask, cp, block=sel.block, guest_rows="none")
    be = kernels.get_backend(args.backend, device)
    n = plan.num_local(rank)
    # q / k with attention of a known shape per K/V head (tools/bench_sparse.py): i.i.d. inputs give
    # near-uniform attention, where a threshold keeps nearly every block
    from bench_sparse import structured_qk

    qf, kf = structured_qk(plan.seqlen, args.heads, args.kv_heads, args.head_dim, device)
    q = mcp.dispatch(qf.to(dtype), plan, group, seq_dim=0).requires_grad_()
    k = mcp.dispatch(kf.to(dtype), plan, group, seq_dim=0).requires_grad_()
    del qf, kf
    v = _rand_local(n, args.kv_heads, args.head_dim, dtype, device, 200 + rank).requires_grad_()
    do = torch.randn_like(q)

    def fwd():
        return mcp.sparse.sparse_attention(q, k, v, plan, group, sel, backend=be)[0]

    def bwd(out):
        out.backward(do)
        q.grad = k.grad = v.grad = None

    # the figures from one call outside the timed steps (its stats synchronise); the inputs are the timed
    # steps', so the selection is theirs
    st = {}
    with torch.no_grad():
        mcp.sparse.sparse_attention(q, k, v, plan, group, sel, backend=be, stats=st)
    times = ctx["timer"].run(fwd, bwd, args.warmup, args.iters, group)
    lay = mcp.sparse.sparse_layout(plan, rank, sel.block)
    elem = torch.empty(0, dtype=dtype).element_size()
    kv_row = 2 * args.kv_heads * args.head_dim * elem  # K and V of one token
    if cp == 1:
        sel_bytes = 0
    elif name == "megatron-cp+xattention":  # the keys of every envelope block (whole blocks) held elsewhere
        sel_bytes = int((lay.buf_owner != rank).sum()) * args.kv_heads * args.head_dim * elem
    else:  # MoBA: an all-reduce of the pooled keys [nb, Hkv, D] in float32
        sel_bytes = lay.num_blocks * args.kv_heads * args.head_dim * 4
    t = torch.tensor([st["rows_received"] * kv_row, int(lay.recv_need.sum()) * kv_row, sel_bytes,
                      st["blocks_selected"], st["blocks_envelope"]], dtype=torch.float64, device=device)
    tmax = t.clone()
    dist.all_reduce(t, group=group)
    dist.all_reduce(tmax, op=dist.ReduceOp.MAX, group=group)
    params = {f.name: getattr(sel, f.name) for f in dataclasses.fields(sel) if f.name not in ("block", "chunk_elements")}
    figures = dict(selector=sel.name, block=sel.block, selector_params=params, inputs="structured",
                   kept_fraction=float(t[3] / t[4]) if t[4] > 0 else 0.0,
                   kv_bytes=int(t[0]), max_kv_bytes_received=int(tmax[0]), envelope_kv_bytes=int(t[1]),
                   selector_bytes=int(t[2]), bytes_moved=int(t[0] + t[2]))
    return times, plan, figures


def bench_kernel_only(plan, args, ctx):
    """Our kernel alone on this rank's megatron-cp tiles and K/V buffer (and, with guest rows, the call
    over the guest tiles on its own keys): (flops, fwd_s, bwd_s, fwd back to back, bwd back to back), the
    last two the slowest rank's (None on CPU)."""
    rank, device, dtype = ctx["rank"], ctx["device"], ctx["dtype"]
    rp = plan.ranks[rank]
    be = ctx.get("backend") or kernels.get_backend(args.backend, device)  # the same backend as megatron-cp
    calls = [(rp.tiles, rp.num_tokens, max(rp.buffer_len, 1))]
    n_guest = sum(rp.guest_recv_counts())
    if len(rp.guest_tiles) and n_guest:
        calls.append((rp.guest_tiles, n_guest, rp.num_tokens))
    runs = []
    for i, (tiles, sq, sk) in enumerate(calls):
        prep = be.prepare(torch.from_numpy(tiles.astype("int32")), sq, sk)
        q = _rand_local(sq, args.heads, args.head_dim, dtype, device, 1 + 10 * i)
        k = _rand_local(sk, args.kv_heads, args.head_dim, dtype, device, 2 + 10 * i)
        v = _rand_local(sk, args.kv_heads, args.head_dim, dtype, device, 3 + 10 * i)
        out, lse = be.forward(q, k, v, prep, None)
        do = torch.randn_like(out)
        runs.append((q, k, v, prep, out, lse, do))
    t = ctx["timer"]

    # the calls as the runtime makes them: backward with delta None (the backend computes rowsum(dout *
    # out) itself, and dense pieces take cuDNN's own path without checking a given delta against it)
    def fwd():
        for q, k, v, prep, *_ in runs:
            be.forward(q, k, v, prep, None)

    def bwd():
        for q, k, v, prep, out, lse, do in runs:
            be.backward(q, k, v, out, lse, do, prep, None, None)

    for _ in range(args.warmup):
        fwd()
        bwd()
    if device.type == "cuda":
        # timed as the implementations' GPU time is (Timer.run): each phase queued behind a spin kernel
        # that holds the stream, CUDA events from its end; medians over the iterations
        times = torch.tensor([t.held(fwd, lambda _: bwd()) for _ in range(args.iters)], dtype=torch.float64)
        t_f, t_b = (float(x) for x in times.median(dim=0).values)
    else:
        t.sync()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            fwd()
        t.sync()
        t1 = time.perf_counter()
        for _ in range(args.iters):
            bwd()
        t.sync()
        t_f, t_b = (t1 - t0) / args.iters, (time.perf_counter() - t1) / args.iters
    # and back to back, as the implementations' fwd_b2b_ms: the scaling of a training step's conditions
    b2b = t.back_to_back(fwd, lambda _: bwd(), args.iters, ctx["group"])
    flops = 4.0 * rp.area * args.heads * args.head_dim  # the rank's cells, guest cells included
    return (flops, t_f, t_b) + b2b


_TORCH_CP_MODULES = (
    "torch.distributed.tensor.experimental._attention",
    "torch.distributed.tensor.experimental._context_parallel._attention",
    "torch.distributed.tensor.experimental._context_parallel._load_balancer",
    "torch.distributed.tensor.experimental._load_balancer",
    "torch.distributed.tensor.experimental",
)


def _torch_cp_attr(name):
    """A (mostly private) name of PyTorch's context-parallel package, wherever this torch keeps it."""
    import importlib

    for mod in _TORCH_CP_MODULES:
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, name):
            return getattr(m, name)
    raise ImportError(f"torch {torch.__version__} has no context-parallel name {name!r} in {_TORCH_CP_MODULES}")


def _cp_block_mask(mask_mod, s, block, mesh, lb):
    """PyTorch's CP BlockMask (Q shard x global KV). Its builder's name and signature change between
    torch releases (public create_cp_block_mask / private _create_cp_block_mask, with or without
    BLOCK_SIZE and load_balancer): pass what this version's signature names."""
    import inspect

    try:
        fn = _torch_cp_attr("create_cp_block_mask")
    except ImportError:
        fn = _torch_cp_attr("_create_cp_block_mask")
    params = inspect.signature(fn).parameters
    values = {"mask_mod": mask_mod, "B": 1, "H": 1, "Q_LEN": s, "KV_LEN": s, "BLOCK_SIZE": (block, block),
              "device_mesh": mesh, "load_balancer": lb}
    missing = [n for n, p in params.items() if n not in values and p.default is inspect.Parameter.empty]
    if missing:
        raise TypeError(f"{fn.__module__}.{fn.__name__}{inspect.signature(fn)}: cannot fill {missing}")
    return fn(**{n: v for n, v in values.items() if n in params})


def bench_torch_native(mask_name, s, args, ctx):
    """PyTorch's context parallel: SDPA ring (full/causal) or FlexAttention all-gather CP."""
    from torch.distributed.device_mesh import DeviceMesh

    cp, device, dtype, group = ctx["cp"], ctx["device"], ctx["dtype"], ctx["group"]
    mesh = ctx.get("mesh")
    if mesh is None:
        mesh = ctx["mesh"] = DeviceMesh(device.type, list(range(cp)))
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    g = torch.Generator(device="cpu").manual_seed(7)
    q = (torch.randn(1, hq, s, d, generator=g) * 0.5).to(device, dtype)
    k = (torch.randn(1, hkv, s, d, generator=g) * 0.5).to(device, dtype)
    v = (torch.randn(1, hkv, s, d, generator=g) * 0.5).to(device, dtype)
    if mask_name in ("full", "causal"):
        import torch.nn.functional as F
        from torch.distributed.tensor.experimental import context_parallel

        causal = mask_name == "causal"
        # head-tail load balancing is for causal only (the ring refuses a full mask with it on)
        opts = _torch_cp_attr("_cp_options")
        opts.enable_load_balance = causal
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
            q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
            do = torch.randn_like(q)

            def fwd():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

            def bwd(out):
                out.backward(do)
                q.grad = k.grad = v.grad = None

            return ctx["timer"].run(fwd, bwd, args.warmup, args.iters, group)
    _context_parallel_shard = _torch_cp_attr("_context_parallel_shard")
    _ContextParallel = _torch_cp_attr("_ContextParallel")
    _HeadTailLoadBalancer = _torch_cp_attr("_HeadTailLoadBalancer")
    _torch_cp_attr("_cp_options").enable_load_balance = True
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import flex_attention

    compiled = ctx.get("flex")
    if compiled is None:
        # every (mask, S) is a new mask_mod / shape: allow one compilation each instead of dynamo's 8
        import torch._dynamo as dynamo

        dynamo.config.recompile_limit = 256
        dynamo.config.accumulated_recompile_limit = 4096
        compiled = ctx["flex"] = torch.compile(flex_attention, dynamic=False)

    class Flex(torch.nn.Module):
        def forward(self, q, k, v, block_mask):
            return compiled(q, k, v, block_mask=block_mask, enable_gqa=True)

    mod = parallelize_module(Flex(), mesh, _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    lb = _HeadTailLoadBalancer(s, cp, device)
    block = 128 if not args.tiny else 16
    bm = _cp_block_mask(catalog.mask_mod(mask_name, s, device), s, block, mesh, lb)
    ql, kl, vl = _context_parallel_shard(mesh, [q, k, v], [2, 2, 2], load_balancer=lb)
    ql, kl, vl = (t.detach().contiguous().requires_grad_() for t in (ql, kl, vl))
    do = torch.randn_like(ql)

    def fwd():
        return mod(ql, kl, vl, block_mask=bm)

    def bwd(out):
        out.backward(do)
        ql.grad = kl.grad = vl.grad = None

    return ctx["timer"].run(fwd, bwd, args.warmup, args.iters, group)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU dry run")
    ap.add_argument("--seqlens", default=None, help="comma list of total S (default 131072,262144; tiny 512,1024)")
    ap.add_argument("--masks", default=",".join(catalog.DIST_MASKS))
    ap.add_argument("--impls", default="megatron-cp,megatron-cp+xattention,megatron-cp+moba,ring,ulysses,usp,"
                    "allgather,torch-native",
                    help="comma list (module doc); the sparse ones run on the causal and packed masks only")
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--cost", default=None, help="CostModel JSON (tools/sim/calibrate.py) for megatron-cp's stage choice")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--out-dir", default="out",
                    help="folder for the JSON and PNG (default out/, ignored by git); results the README quotes "
                         "go to a dated folder benchmarks/YYYY-MM-DD_<device>_<what>/ (benchmarks/RESULTS.md)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="append a GPU timeline of one profiled megatron-cp step per case (rank 0's) to FILE")
    ap.add_argument("--profile-b2b", action="store_true",
                    help="profile a step issued right after another, no sync or hold (the back-to-back timing)")
    ap.add_argument("--nodes", type=int, default=1,
                    help="megatron-cp's plan and routes as if the GPUs were this many nodes (emulated on one host); "
                         "its rows add the K/V bytes crossing the node boundary, and the flat plan's")
    ap.add_argument("--verbose", action="store_true", help="each case's line on stderr (rank 0) as it finishes")
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.nodes < 1 or world % args.nodes:
        raise SystemExit(f"--nodes {args.nodes} must be >= 1 and divide the {world} processes")
    tiny = args.tiny
    args.heads = args.heads or (4 if tiny else 32)
    args.kv_heads = args.kv_heads or (2 if tiny else 8)
    args.head_dim = args.head_dim or (16 if tiny else 128)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 2)
    args.iters = args.iters or (1 if tiny else 5)
    seqlens = [int(x) for x in (args.seqlens or ("512,1024" if tiny else "131072,262144")).split(",")]

    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))  # set by torchrun
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=10))
        dtype = torch.bfloat16
        dev_name = torch.cuda.get_device_name(device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
        dtype = torch.bfloat16
        dev_name = "cpu"
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    ctx = dict(rank=rank, cp=cp, device=device, dtype=dtype, group=group, timer=Timer(device),
               topology=mcp.Topology(args.nodes, cp // args.nodes) if args.nodes > 1 else None)
    impls = args.impls.split(",")
    results = []
    masks = args.masks.split(",")
    now = datetime.datetime.now(datetime.UTC)
    meta = run_record(dev_name, "torchrun --nproc-per-node %d %s" % (cp, " ".join(sys.argv)), num_devices=cp,
                      nodes=args.nodes, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                dtype=str(dtype), masks={m: catalog.DESCRIPTIONS[m] for m in args.masks.split(",")},
                flops="forward 4*area*Hq*D, backward 2.5x; per GPU = total / cp / slowest rank's time "
                      "(sparse rows: the envelope's area, an effective rate)",
                bytes="kv_bytes: K/V bytes received in the forward, summed over ranks (the backward returns "
                      "as many dK/dV bytes); sparse rows add selector_bytes and envelope_kv_bytes")
    stem = os.path.join(args.out_dir, f"bench_{cp}x{dev_name.replace(' ', '_')}_{now:%Y%m%d_%H%M}{args.tag}")

    def save(complete):
        """The JSON of the cases so far (rank 0, after every mask: a run cut short keeps what it measured)."""
        os.makedirs(args.out_dir, exist_ok=True)
        with open(stem + ".json", "w") as f:
            json.dump({**meta, "complete": complete, "results": results,
                       "checks": summarize(results, show=False)}, f, indent=1)

    bar = Progress(len(seqlens) * len(masks) * len(impls), "bench_dist", enabled=rank == 0, verbose=args.verbose)
    for s in seqlens:
        for mname in masks:
            mask = catalog.build(mname, s)
            flops = 4.0 * mask.area() * args.heads * args.head_dim
            base = dict(mask=mname, seqlen=s, cp=cp, density=mask.density())
            ctx.update(mask_name=mname, seqlen=s, dev_name=dev_name)
            for impl in impls:
                if impl in SPARSE_IMPLS and mname not in SPARSE_ENVELOPES:
                    bar.step()
                    continue
                if impl == "torch-native":
                    name = "torch-sdpa-ring" if mname in ("full", "causal") else "torch-flex-allgather"
                else:
                    name = impl
                rec = dict(base, impl=name)
                bar.running(f"S={s} {mname} {name}")
                try:
                    if impl == "torch-native":
                        tf, tb, wf, wb, sf, sb = bench_torch_native(mname, s, args, ctx)
                    elif impl in SPARSE_IMPLS:
                        (tf, tb, wf, wb, sf, sb), plan, figures = bench_sparse(impl, mask, args, ctx)
                        rec.update(figures)
                    else:
                        (tf, tb, wf, wb, sf, sb), plan = bench_ours(impl, mask, args, ctx)
                    rec.update(fwd_ms=tf * 1e3, bwd_ms=tb * 1e3, fwd_tflops_per_gpu=flops / cp / tf / 1e12,
                               bwd_tflops_per_gpu=2.5 * flops / cp / tb / 1e12,
                               fwd_wall_ms=wf * 1e3, bwd_wall_ms=wb * 1e3,
                               fwd_wall_tflops_per_gpu=flops / cp / wf / 1e12,
                               bwd_wall_tflops_per_gpu=2.5 * flops / cp / wb / 1e12)
                    if sf is not None:  # back-to-back steps (Timer.back_to_back)
                        rec.update(fwd_b2b_ms=sf * 1e3, bwd_b2b_ms=sb * 1e3,
                                   b2b_ranks_ms=[[x * 1e3 for x in r] for r in ctx["timer"].b2b_ranks])
                    if impl == "megatron-cp":
                        st = plan.stats()
                        rec["imbalance"] = st["imbalance"]
                        rec["max_remote_kv_tokens"] = st["max_remote_kv_tokens"]
                        rec["guest_rows"] = st["guest_rows"]
                        # K/V bytes the plan moves (received, summed over ranks; the backward returns as many)
                        kvb = plan.stats(num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype_bytes=dtype)
                        rec["kv_bytes"] = kvb["bytes_moved"]
                        rec["max_kv_bytes_received"] = kvb["max_bytes_received"]
                        if ctx["topology"] is not None:  # bytes crossing the emulated node boundary
                            flat = dataclasses.replace(mcp.plan(mask, cp), topology=ctx["topology"])
                            fl = flat.stats(num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype_bytes=dtype)
                            rec.update(inter_node_bytes=kvb["inter_node_bytes_hierarchical"],
                                       inter_node_bytes_flat_routes=kvb["inter_node_bytes"],
                                       flat_plan_inter_node_bytes=fl["inter_node_bytes"])
                        # the runtime's exchange choice (runtime.schedule.choose_schedule; 0 = single exchange)
                        rec["stages"] = [0 if st.schedule is None else st.schedule.num_stages for st in states_of(plan)]
                        be = ctx["backend"]  # families the cuDNN probe turned down (run on Triton alone)
                        rec["cudnn_off"] = ({str(key): found.reason for key, found in be.cudnn_probes.items()
                                             if found.layout is None} if isinstance(be, kernels.TritonBackend) else {})
                        kf, kt_f, kt_b, kb_f, kb_b = bench_kernel_only(plan, args, ctx)
                        t = torch.tensor([kf, kt_f, kt_b], dtype=torch.float64, device=device)
                        tmax = t.clone()
                        dist.all_reduce(t, group=group)
                        dist.all_reduce(tmax, op=dist.ReduceOp.MAX, group=group)
                        # mean over ranks (the scaling check's reference) and the slowest rank's kernel time
                        results.append(dict(base, impl="kernel-only", fwd_ms=float(t[1]) / cp * 1e3,
                                            bwd_ms=float(t[2]) / cp * 1e3,
                                            fwd_max_ms=float(tmax[1]) * 1e3, bwd_max_ms=float(tmax[2]) * 1e3,
                                            fwd_tflops_per_gpu=float(t[0]) / float(t[1]) / 1e12,
                                            bwd_tflops_per_gpu=2.5 * float(t[0]) / float(t[2]) / 1e12))
                        if kb_f is not None:  # the slowest rank's, like the implementations' back to back
                            results[-1].update(fwd_b2b_ms=kb_f * 1e3, bwd_b2b_ms=kb_b * 1e3)
                except Exception as e:  # record and go on (a failure on every rank, e.g. an API missing)
                    rec["error"] = f"{type(e).__name__}: {e}"
                    if rank == 0:
                        traceback.print_exc()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                results.append(rec)
                if "error" in rec:
                    if rank == 0:
                        bar.note(f"S={s:>7} {mname:<15}{name:<22} ERROR {rec['error'][:150]}")
                    bar.step()
                else:
                    bar.step(f"S={s:>7} {mname:<15}{name:<22} fwd {rec['fwd_tflops_per_gpu']:7.1f}  bwd "
                        f"{rec['bwd_tflops_per_gpu']:7.1f} TFLOP/s/GPU  ({rec['fwd_ms']:.2f} / {rec['bwd_ms']:.2f} ms; "
                        f"wall {rec['fwd_wall_ms']:.2f} / {rec['bwd_wall_ms']:.2f} ms"
                        + (f"; back to back {rec['fwd_b2b_ms']:.2f} / {rec['bwd_b2b_ms']:.2f} ms, ranks' GPU fwd "
                           + "|".join(f"{r[0]:.2f}" for r in rec["b2b_ranks_ms"]) + " ms, host issue "
                           + f"{max(r[2] for r in rec['b2b_ranks_ms']):.2f} / {max(r[3] for r in rec['b2b_ranks_ms']):.2f} ms"
                           if "fwd_b2b_ms" in rec else "")
                        + ")" + (f"  stages {rec['stages']}" if "stages" in rec else "")
                        + (f"  kept {rec['kept_fraction']:.3f}, K/V bytes {rec['kv_bytes']}"
                           f" (envelope {rec['envelope_kv_bytes']}), selector bytes {rec['selector_bytes']}"
                           if "kept_fraction" in rec else "")
                        + (f"  cuDNN off: {rec['cudnn_off']}" if rec.get("cudnn_off") else "")
                        + (f"  between nodes {rec['inter_node_bytes']} B (flat plan {rec['flat_plan_inter_node_bytes']} B)"
                           if "inter_node_bytes" in rec else ""))
                dist.barrier(group)
            if rank == 0:
                save(complete=False)
    bar.close()
    if rank == 0:
        save(complete=True)
        plot(results, meta, stem + ".png")
        print(f"wrote {stem}.json and {stem}.png")
        print("\n".join(summary_table(results, summarize(results, show=False))))
    dist.destroy_process_group()


def summarize(results, show=True):
    """The issue's targets: causal vs torch SDPA ring (>= 1.1x), sparse masks vs torch Flex CP
    (>= 1.5x), and megatron-cp per-GPU throughput >= 90% of kernel-only on the same work; and each sparse
    row against the dense envelope (the megatron-cp row of the same mask and S), ``sparse_vs_dense``: time
    ratios (sparse / dense GPU time, below 1 is faster), bytes ratios (K/V bytes, and all bytes with the
    selector's, over the dense row's K/V bytes; and K/V bytes over the dense exchange of the sparse plan's own
    block layout; None where the reference moves none) and the kept fraction.
    Returns the checks; ``show``: prints the summary table of ``results`` (``summary_table``) too."""
    checks = []
    get = lambda m, s, impl: next((r for r in results if r["mask"] == m and r["seqlen"] == s  # noqa: E731
                                   and r["impl"] == impl and "error" not in r), None)
    for s in sorted({r["seqlen"] for r in results}):
        for m in sorted({r["mask"] for r in results}):
            ours = get(m, s, "megatron-cp")
            if ours is None:
                continue
            ref_name = "torch-sdpa-ring" if m in ("full", "causal") else "torch-flex-allgather"
            ref = get(m, s, ref_name)
            kern = get(m, s, "kernel-only")
            c = dict(mask=m, seqlen=s)
            wall = "fwd_wall_tflops_per_gpu" in ours
            if ref is not None:
                need = 1.1 if m in ("full", "causal") else 1.5
                c.update(vs=ref_name, fwd_ratio=ours["fwd_tflops_per_gpu"] / ref["fwd_tflops_per_gpu"],
                         bwd_ratio=ours["bwd_tflops_per_gpu"] / ref["bwd_tflops_per_gpu"], need=need)
                if wall and "fwd_wall_tflops_per_gpu" in ref:
                    c.update(fwd_wall_ratio=ours["fwd_wall_tflops_per_gpu"] / ref["fwd_wall_tflops_per_gpu"],
                             bwd_wall_ratio=ours["bwd_wall_tflops_per_gpu"] / ref["bwd_wall_tflops_per_gpu"])
            if kern is not None:
                c.update(fwd_scaling=ours["fwd_tflops_per_gpu"] / kern["fwd_tflops_per_gpu"],
                         bwd_scaling=ours["bwd_tflops_per_gpu"] / kern["bwd_tflops_per_gpu"])
                if wall:
                    c.update(fwd_wall_scaling=ours["fwd_wall_tflops_per_gpu"] / kern["fwd_tflops_per_gpu"],
                             bwd_wall_scaling=ours["bwd_wall_tflops_per_gpu"] / kern["bwd_tflops_per_gpu"])
            sparse = []
            for impl in SPARSE_IMPLS:
                sp = get(m, s, impl)
                if sp is None:
                    continue
                dense_bytes = ours.get("kv_bytes") or 0
                sparse.append(dict(impl=impl, kept_fraction=sp["kept_fraction"],
                                   fwd_time_ratio=sp["fwd_ms"] / ours["fwd_ms"],
                                   bwd_time_ratio=sp["bwd_ms"] / ours["bwd_ms"],
                                   kv_bytes_ratio=sp["kv_bytes"] / dense_bytes if dense_bytes else None,
                                   bytes_ratio=sp["bytes_moved"] / dense_bytes if dense_bytes else None,
                                   # what the selection saves on its own block layout's dense exchange
                                   layout_kv_bytes_ratio=(sp["kv_bytes"] / sp["envelope_kv_bytes"]
                                                          if sp["envelope_kv_bytes"] else None)))
            if sparse:
                c["sparse_vs_dense"] = sparse
            b2b = [r for r in (ours, ref, kern) if r is not None and r.get("fwd_b2b_ms")]
            if ours in b2b and ref in b2b:  # same FLOPs: the time ratio is the throughput ratio
                c.update(fwd_b2b_ratio=ref["fwd_b2b_ms"] / ours["fwd_b2b_ms"],
                         bwd_b2b_ratio=ref["bwd_b2b_ms"] / ours["bwd_b2b_ms"])
            if ours in b2b and kern in b2b:
                c.update(fwd_b2b_scaling=kern["fwd_b2b_ms"] / ours["fwd_b2b_ms"],
                         bwd_b2b_scaling=kern["bwd_b2b_ms"] / ours["bwd_b2b_ms"])
            checks.append(c)
    if show:
        print("\n".join(summary_table(results, checks)))
    return checks


def check_text(c):
    """A check's cell of the summary table: ratios vs the torch peer (GPU time, need), scaling vs
    kernel-only, and the same for wall time and back-to-back steps where measured."""
    parts = []
    if "fwd_ratio" in c:
        parts.append(f"vs {c['vs']}: fwd {c['fwd_ratio']:.2f}x bwd {c['bwd_ratio']:.2f}x (need {c['need']}x)")
    if "fwd_scaling" in c:
        parts.append(f"scaling vs kernel-only: fwd {c['fwd_scaling']:.2f} bwd {c['bwd_scaling']:.2f}")
    for tag, label in (("wall", "wall time"), ("b2b", "back to back")):  # the other two timings
        sub = []
        if f"fwd_{tag}_ratio" in c:
            sub.append(f"{c[f'fwd_{tag}_ratio']:.2f}x / {c[f'bwd_{tag}_ratio']:.2f}x")
        if f"fwd_{tag}_scaling" in c:
            sub.append(f"scaling {c[f'fwd_{tag}_scaling']:.2f} / {c[f'bwd_{tag}_scaling']:.2f}")
        if sub:
            parts.append(f"{label}: " + ", ".join(sub))
    for x in c.get("sparse_vs_dense", ()):  # time and bytes of a sparse row over the dense envelope's
        ratio = lambda r: "-" if r is None else f"{r:.2f}x"  # noqa: E731
        parts.append(f"{x['impl']} vs dense envelope: time fwd {x['fwd_time_ratio']:.2f}x bwd "
                     f"{x['bwd_time_ratio']:.2f}x, K/V bytes {ratio(x['kv_bytes_ratio'])} (with selector "
                     f"{ratio(x['bytes_ratio'])}; of its block layout's dense exchange "
                     f"{ratio(x['layout_kv_bytes_ratio'])}), kept {x['kept_fraction']:.3f}")
    return "; ".join(parts)


def summary_table(results, checks):
    """The closing table (lines): per S and mask, each implementation's fwd / bwd TFLOP/s per GPU (GPU
    time; err: it failed) and the checks' text."""
    impls = sorted(dict.fromkeys(r["impl"] for r in results), key=lambda i: i == "kernel-only")  # it last

    def tf(x):  # CPU dry runs' tiny rates keep two digits
        return f"{x:.1f}" if x >= 1 else f"{x:.2g}"

    text = {(c["seqlen"], c["mask"]): check_text(c) for c in checks}
    rows = []
    for s, m in dict.fromkeys((r["seqlen"], r["mask"]) for r in results):
        cells = []
        for impl in impls:
            r = next((x for x in results if x["seqlen"] == s and x["mask"] == m and x["impl"] == impl), None)
            cells.append("-" if r is None else "err" if "error" in r else
                         f"{tf(r['fwd_tflops_per_gpu'])} / {tf(r['bwd_tflops_per_gpu'])}")
        rows.append([s, m, *cells, text.get((s, m), "")])
    return (["TFLOP/s per GPU as fwd / bwd (GPU time; sparse rows: the envelope's FLOPs); checks: megatron-cp "
             "vs the torch peer and vs kernel-only, the sparse rows' time and bytes vs the dense envelope"]
            + markdown_table(["S", "mask", *impls, "checks"], rows))


def plot(results, meta, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    ok = [r for r in results if "error" not in r]
    seqlens = sorted({r["seqlen"] for r in ok})
    masks = list(dict.fromkeys(r["mask"] for r in ok))
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    fig, axes = plt.subplots(len(seqlens), 2, figsize=(16, 4.5 * len(seqlens)), squeeze=False)
    w = 0.8 / max(len(impls), 1)
    for i, s in enumerate(seqlens):
        for j, key in enumerate(("fwd_tflops_per_gpu", "bwd_tflops_per_gpu")):
            ax = axes[i][j]
            for n, impl in enumerate(impls):
                ys = [next((r[key] for r in ok if r["seqlen"] == s and r["mask"] == m and r["impl"] == impl), 0)
                      for m in masks]
                ax.bar([x + n * w for x in range(len(masks))], ys, w, label=impl)
            ax.set_xticks([x + 0.4 - w / 2 for x in range(len(masks))], masks, rotation=20)
            ax.set_ylabel("TFLOP/s per GPU")
            ax.set_title(f"{'forward' if j == 0 else 'backward'}, S = {s}")
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.suptitle(f"{meta['num_devices']} x {meta['device']}, {meta['date']}\n{meta['command']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
