"""GPU correctness of the distributed runtime with the production kernel paths (NCCL, torchrun).

Each rank runs megatron-cp attention (planner + staged GroupCast runtime, and the single-exchange path
``stages=0``; masks with rows keeping most keys also with those rows as guest rows, ``planner.guests``,
when ``auto`` keeps them home), and each baseline strategy of ``--strategies`` on its own plan layout,
forward and backward on its tokens of one random bf16 problem, with the Triton backend whose dense
pieces go to cuDNN (``dense_min_keys`` lowered so that pieces occur at this size), and compares its rows
of out / lse / dq and its tokens of dk / dv with a dense fp64 reference. Rule (ANCHORS.md): rms error
<= 2 x the rms error of the same dense computation run in bf16, plus 1e-6 x rms(reference); no NaN;
fully masked rows give out 0 and lse -inf. Also counts the cuDNN calls, so a run where cuDNN never ran
is visible, and records the families the backend's cuDNN probe turned down.

While it runs, rank 0 shows a progress bar on stderr naming the mask and implementation being checked
(redrawn at most every 30 s where stderr is not a terminal: tools/common.py); every rank's line per
case goes to stderr with ``--verbose``, a failing rank's always. Rank 0 ends with one table on stdout:
per mask and variant, the ranks that pass, the worst error ratio to the bf16 reference and the cuDNN
calls.

    torchrun --nproc-per-node 4 tools/gpu_dist_check.py --json out.json
    torchrun --nproc-per-node 2 tools/gpu_dist_check.py --device cpu --seqlen 512   # CPU dry run (gloo)
"""

from __future__ import annotations

import argparse
import json
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

# tools/ (this script's folder): the chunked dense reference of the kernel check
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kernel_check import chunked_reference, rms  # noqa: E402
from common import Progress, device_name, markdown_table, run_record  # noqa: E402

# cuDNN calls by kind: the backend calls these functions of megatron_cp.kernels.triton.cudnn, which main()
# wraps to count them
CUDNN_OPS = {"fwd": "forward", "bwd": "backward", "fwd_band": "forward_batched", "bwd_band": "backward_batched"}
CUDNN_CALLS = dict.fromkeys(CUDNN_OPS, 0)


def _count(name, fn):
    def wrapped(*a, **k):
        CUDNN_CALLS[name] += 1
        return fn(*a, **k)
    return wrapped


def summary_table(flat):
    """The closing table (lines) of every rank's records: per mask and variant (implementation, stages,
    guest rows), ranks passing, the worst rms error / bf16 reference's over outputs and ranks, cuDNN calls
    (fwd / bwd, all ranks)."""
    rows = []
    for key in dict.fromkeys((r["mask"], r["impl"], str(r["stages"]), r["guest_rows"] > 0) for r in flat):
        rs = [r for r in flat if (r["mask"], r["impl"], str(r["stages"]), r["guest_rows"] > 0) == key]
        worst = max(e / max(el, 1e-30) for r in rs for e, el in r["rms_err_vs_bf16_ref"].values())
        rows.append([*key[:3], max(r["guest_rows"] for r in rs), f"{sum(r['ok'] for r in rs)}/{len(rs)}",
                     f"{worst:.3f}", f"{sum(r['cudnn_calls']['fwd'] for r in rs)} / "
                     f"{sum(r['cudnn_calls']['bwd'] for r in rs)}"])
    return markdown_table(["mask", "impl", "stages", "guest rows", "ranks ok", "worst err/bf16 err",
                           "cuDNN fwd / bwd"], rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--masks", default="causal,full,packed,sliding_window,global_local")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dense-min-keys", type=int, default=2048)
    ap.add_argument("--strategies", default="ring,ulysses,usp,allgather,head_context",
                    help="baseline strategies checked the same way (each on its plan_for layout); '' for none")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a dry run of this script (gloo, reference backend, tiny --seqlen)")
    ap.add_argument("--verbose", action="store_true", help="every rank's line per case on stderr")
    args = ap.parse_args(argv)
    rank_env = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(rank_env)
        dev = torch.device("cuda", rank_env)
        dist.init_process_group("nccl")
        for key, op in CUDNN_OPS.items():
            setattr(cudnn, op, _count(key, getattr(cudnn, op)))
        backend = kernels.TritonBackend(kernels.TritonConfig(dense_min_keys=args.dense_min_keys))
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
        backend = "reference"
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    s, hq, hkv, d = args.seqlen, args.heads, args.kv_heads, args.head_dim
    scale = 1.0 / math.sqrt(d)
    results, ok_all = [], True
    masks, strategies = args.masks.split(","), [x for x in args.strategies.split(",") if x]
    # guest-row variants (2 more) are counted when a mask turns out to have them
    bar = Progress(len(masks) * (2 + len(strategies)), "gpu_dist_check", enabled=rank == 0, verbose=args.verbose)
    for name in masks:
        mask = catalog.build(name, s)
        plan = mcp.plan(mask, cp)
        gen = torch.Generator(device=dev).manual_seed(1234)
        q = torch.randn(s, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(s, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(s, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
        do = torch.randn(s, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
        keep = torch.from_numpy(mask.to_dense()).to(dev)
        ref = chunked_reference(q, k, v, do, keep, torch.float64, scale)
        low = chunked_reference(q, k, v, do, keep, torch.bfloat16, scale)
        variants = [("megatron-cp", None, plan), ("megatron-cp", 0, plan)]
        # rows keeping most keys: also run them as guest rows (planner.guests) where auto keeps them home
        cand = candidate_rows(geometry.row_area_prefix(mask.traps, s), s, cp)
        if len(cand) and not plan.has_guests:
            gplan = mcp.plan(mask, cp, guest_rows=cand)
            variants += [("megatron-cp", None, gplan), ("megatron-cp", 0, gplan)]
            bar.add(2)
        variants += [(x, None, None) for x in strategies]
        for impl, stages, vplan in variants:
            bar.running(f"{name} {impl} stages={'auto' if stages is None else stages}")
            CUDNN_CALLS.update(dict.fromkeys(CUDNN_OPS, 0))
            vplan = vplan if vplan is not None else plan_for(impl, mask, cp)
            ids = torch.from_numpy(vplan.local_ids(rank)).to(dev)
            empty = ~keep[ids].any(1)
            ql, kl, vl = (t[ids].clone().requires_grad_() for t in (q, k, v))
            if impl == "megatron-cp":
                out, lse = mcp.attention(ql, kl, vl, vplan, group, softmax_scale=scale, backend=backend, stages=stages)
            else:
                out, lse = get_strategy(impl, backend=backend)(ql, kl, vl, vplan, group, scale)
            out.backward(do[ids])
            if dev.type == "cuda":
                torch.cuda.synchronize()
            got = (out, lse, ql.grad, kl.grad, vl.grad)
            nan = any(bool(torch.isnan(x).any()) for x in got)
            empty_ok = bool((lse[empty] == float("-inf")).all()) and bool((out[empty] == 0).all())
            fin = ~empty
            errs = {}
            ok = not nan and empty_ok
            for key, x, r, lo in (("out", out, ref[0][ids], low[0][ids]), ("lse", lse[fin], ref[1][ids][fin], low[1][ids][fin]),
                                  ("dq", ql.grad, ref[2][ids], low[2][ids]), ("dk", kl.grad, ref[3][ids], low[3][ids]),
                                  ("dv", vl.grad, ref[4][ids], low[4][ids])):
                e, e_low = rms(x.detach().double() - r), rms(lo - r)
                bound = 2 * e_low + 1e-6 * rms(r)
                errs[key] = [e, e_low]
                ok = ok and e <= bound
            guest_rows = int((vplan.guest_runs[:, 1] - vplan.guest_runs[:, 0]).sum())
            rec = {"mask": name, "impl": impl, "stages": "auto" if stages is None else stages, "rank": rank, "ok": ok, "nan": nan,
                   "guest_rows": guest_rows,
                   "empty_rows_ok": empty_ok, "rms_err_vs_bf16_ref": errs, "cudnn_calls": dict(CUDNN_CALLS),
                   "cudnn_off": ({str(key): found.reason for key, found in backend.cudnn_probes.items()
                                  if found.layout is None} if isinstance(backend, kernels.TritonBackend) else {})}
            results.append(rec)
            ok_all = ok_all and ok
            line = (f"rank {rank} {name:<15} {impl:<13} stages={rec['stages']!s:<5} "
                    f"guests={guest_rows:<4} "
                    f"{'ok' if ok else 'FAIL'} cudnn={CUDNN_CALLS} "
                    + " ".join(f"{key} {e:.2e}/{el:.2e}" for key, (e, el) in errs.items()))
            if args.verbose or not ok:  # every rank's (the bar is rank 0's)
                bar.note(line)
            bar.step()
        del ref, low, keep
    bar.close()
    gathered = [None] * cp
    dist.all_gather_object(gathered, results)
    if rank == 0:
        flat = [r for rr in gathered for r in rr]
        allok = all(r["ok"] for r in flat)
        print(f"GPU distributed check: {sum(r['ok'] for r in flat)}/{len(flat)} rank-cases pass "
              f"({sum(r['guest_rows'] > 0 for r in flat)} with guest rows); "
              f"cuDNN calls fwd {sum(r['cudnn_calls']['fwd'] for r in flat)}, bwd {sum(r['cudnn_calls']['bwd'] for r in flat)}")
        print("\n".join(summary_table(flat)))
        if args.json:
            meta = run_record(device_name(dev), "torchrun --nproc-per-node %d tools/gpu_dist_check.py %s" % (
                cp, " ".join(sys.argv[1:])), num_devices=cp, S=s, Hq=hq, Hkv=hkv, D=d, all_ok=allok)
            with open(args.json, "w") as f:
                json.dump({**meta, "results": flat}, f, indent=1)
    dist.destroy_process_group()
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
