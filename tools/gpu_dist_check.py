"""GPU correctness of the distributed runtime with the production kernel paths (NCCL, torchrun).

    torchrun --nproc-per-node 4 tools/gpu_dist_check.py --out out
    torchrun --nproc-per-node 2 tools/gpu_dist_check.py --dry-run     # CPU (gloo, reference backend), S 512

Each rank runs megatron-cp (staged, single exchange, and with guest rows where ``auto`` keeps them home) and each
baseline, forward and backward on its tokens of one random bf16 problem on Triton with cuDNN's dense pieces
(``dense_min_keys`` lowered to have some), against a dense fp64 reference (ANCHORS.md: rms error <= 2 x bf16's +
1e-6 x rms(reference); no NaN; fully masked rows: out 0, lse -inf), counting the cuDNN calls. Writes
OUT/gpu_dist_check<tag>.json (every rank's records); ends with one table; exits 1 where a case fails.
"""

from __future__ import annotations

import functools
import math
import os
import sys

import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp import kernels
from megatron_cp.baselines import get_strategy, plan_for
from megatron_cp.kernels.triton import cudnn
from megatron_cp.masks import catalog, geometry
from megatron_cp.planner.guests import candidate_rows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/
from gpu_kernel_check import chunked_reference, rms  # noqa: E402
from bench_dist import start_ranks, torchrun_record  # noqa: E402
from common import Progress, markdown_table, out_dir, parser, write_json  # noqa: E402

MASKS = ("causal", "full", "packed", "sliding_window", "global_local")
STRATEGIES = ("ring", "ulysses", "usp", "allgather", "head_context")
# cuDNN calls by kind: the backend calls these functions of megatron_cp.kernels.triton.cudnn, which main() wraps
CUDNN_OPS = {"fwd": "forward", "bwd": "backward", "fwd_band": "forward_batched", "bwd_band": "backward_batched"}
CUDNN_CALLS = dict.fromkeys(CUDNN_OPS, 0)


def _counted(kind, fn, *a, **k):
    CUDNN_CALLS[kind] += 1
    return fn(*a, **k)


def summary_table(flat):
    """The closing table (lines) of every rank's records: a row per mask and variant (impl, stages, guest rows)."""
    rows = []
    for key in dict.fromkeys((r["mask"], r["impl"], str(r["stages"]), r["guest_rows"] > 0) for r in flat):
        rs = [r for r in flat if (r["mask"], r["impl"], str(r["stages"]), r["guest_rows"] > 0) == key]
        worst = max(e / max(el, 1e-30) for r in rs for e, el in r["rms_err_vs_bf16_ref"].values())
        rows.append([*key[:3], max(r["guest_rows"] for r in rs), f"{sum(r['ok'] for r in rs)}/{len(rs)}",
                     f"{worst:.3f}", f"{sum(r['cudnn_calls']['fwd'] for r in rs)} / "
                     f"{sum(r['cudnn_calls']['bwd'] for r in rs)}"])
    return markdown_table(["mask", "impl", "stages", "guest rows", "ranks ok", "worst err/bf16 err",
                           "cuDNN fwd / bwd"], rows)


def check(impl, stages, plan, data, backend):
    """This rank's outputs and gradients of one variant against the references (``data``: q, k, v, do, keep, the
    fp64 and bf16 references' out, lse, dq, dk, dv): the record's figures."""
    q, k, v, do, keep, ref, low = data
    CUDNN_CALLS.update(dict.fromkeys(CUDNN_OPS, 0))
    ids = torch.from_numpy(plan.local_ids(dist.get_rank())).to(q.device)
    ql, kl, vl = (t[ids].clone().requires_grad_() for t in (q, k, v))
    scale, group = 1.0 / math.sqrt(q.shape[-1]), dist.group.WORLD
    if impl == "megatron-cp":
        out, lse = mcp.attention(ql, kl, vl, plan, group, softmax_scale=scale, backend=backend, stages=stages)
    else:
        out, lse = get_strategy(impl, backend=backend)(ql, kl, vl, plan, group, scale)
    out.backward(do[ids])
    got, empty = (out, lse, ql.grad, kl.grad, vl.grad), ~keep[ids].any(1)
    nan = any(bool(torch.isnan(x).any()) for x in got)
    empty_ok = bool((lse[empty] == float("-inf")).all()) and bool((out[empty] == 0).all())
    errs, ok = {}, not nan and empty_ok
    for i, (key, x) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), got)):
        r, lo = ref[i][ids], low[i][ids]
        if key == "lse":  # on the rows that keep a cell
            x, r, lo = x[~empty], r[~empty], lo[~empty]
        errs[key] = [rms(x.detach().double() - r), rms(lo - r)]
        ok = ok and errs[key][0] <= 2 * errs[key][1] + 1e-6 * rms(r)
    return dict(ok=ok, nan=nan, guest_rows=int((plan.guest_runs[:, 1] - plan.guest_runs[:, 0]).sum()),
                empty_rows_ok=empty_ok, rms_err_vs_bf16_ref=errs, cudnn_calls=dict(CUDNN_CALLS),
                cudnn_off={str(key): found.reason for key, found in getattr(backend, "cudnn_probes", {}).items()
                           if found.layout is None})


def main(argv=None):
    args = parser(__doc__, "out").parse_args(argv)
    dev, backend = start_ranks(args.dry_run), "reference"
    if not args.dry_run:
        for key, op in CUDNN_OPS.items():
            setattr(cudnn, op, functools.partial(_counted, key, getattr(cudnn, op)))
        backend = kernels.TritonBackend(kernels.TritonConfig(dense_min_keys=2048))
    rank, cp = dist.get_rank(), dist.get_world_size()
    s, hq, hkv, d = 512 if args.dry_run else 16384, 8, 2, 128
    results = []
    # guest-row variants (2 more) are counted when a mask turns out to have them
    bar = Progress(len(MASKS) * (2 + len(STRATEGIES)), "gpu_dist_check", enabled=rank == 0, verbose=args.verbose)
    for name in MASKS:
        mask = catalog.build(name, s)
        plan = mcp.plan(mask, cp)
        g = torch.Generator(device=dev).manual_seed(1234)
        q, k, v, do = (torch.randn(s, h, d, device=dev, dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv, hq))
        keep = torch.from_numpy(mask.to_dense()).to(dev)
        data = (q, k, v, do, keep, *(chunked_reference(q, k, v, do, keep, dt, 1.0 / math.sqrt(d))
                                     for dt in (torch.float64, torch.bfloat16)))
        variants = [("megatron-cp", None, plan), ("megatron-cp", 0, plan)]
        # rows keeping most keys: also run them as guest rows (planner.guests) where auto keeps them home
        cand = candidate_rows(geometry.row_area_prefix(mask.traps, s), s, cp)
        if len(cand) and not plan.has_guests:
            gplan = mcp.plan(mask, cp, guest_rows=cand)
            variants += [("megatron-cp", None, gplan), ("megatron-cp", 0, gplan)]
            bar.add(2)
        for impl, stages, vplan in variants + [(x, None, None) for x in STRATEGIES]:
            bar.running(f"{name} {impl} stages={'auto' if stages is None else stages}")
            rec = dict(mask=name, impl=impl, stages="auto" if stages is None else stages, rank=rank,
                       **check(impl, stages, vplan or plan_for(impl, mask, cp), data, backend))
            results.append(rec)
            if args.verbose or not rec["ok"]:  # every rank's (the bar is rank 0's)
                bar.note(f"rank {rank} {name} {impl} stages={rec['stages']} guests={rec['guest_rows']} ok={rec['ok']} "
                         f"cudnn={rec['cudnn_calls']} err, bf16 err={rec['rms_err_vs_bf16_ref']}")
            bar.step()
        del data
    bar.close()
    gathered = [None] * cp
    dist.all_gather_object(gathered, results)
    flat = [r for rr in gathered for r in rr]
    if rank == 0:
        print("\n".join(summary_table(flat)))
        meta = torchrun_record(dev, S=s, Hq=hq, Hkv=hkv, D=d, all_ok=all(r["ok"] for r in flat))
        write_json(os.path.join(out_dir(args), f"gpu_dist_check{args.tag}.json"), {**meta, "results": flat})
    dist.destroy_process_group()
    return 0 if all(r["ok"] for r in flat) else 1


if __name__ == "__main__":
    sys.exit(main())
