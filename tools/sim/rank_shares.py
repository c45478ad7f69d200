#!/usr/bin/env python3
"""Each rank's share of a simulated step, run alone on one GPU, against the step model's per-rank prediction
(tools/sim/step_model.py).

For one measured setting, step and layout (``--setting b --layout global --cp 2 --step 0``: the 2026-11-28 run's
own documents, planned as the simulator plans them), every global micro-batch's every rank r runs alone on the GPU
as rank r of the plan's world (tools/host_path.py's ``comm.loopback`` group: collectives return at once, nothing
moves), ``layers`` attention calls forward then their backward, bf16 at the model's heads; the GPU's busy time per
phase (profiled, kernels and copies) is set beside the simulator's FA4 prediction for that rank's tiles. What a rank
runs beyond attention (the linear layers: the DP 4 profile's time per token) is not run here.

    python tools/sim/rank_shares.py --setting b --layout global --cp 2 --step 0 --out DIR   # one GPU
    python tools/sim/rank_shares.py --dry-run                                             # CPU, tiny sizes

Writes OUT/rank_shares<tag>.json (every rank's predicted and measured ms, forward and backward, and their ratio)
and prints one table; "within 15%" counts ranks whose forward and backward both are.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import megatron_cp as mcp
from megatron_cp.planner import Workload

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # step_model
sys.path.insert(0, os.path.dirname(HERE))  # tools/: common, host_path
import step_model as T  # noqa: E402
from common import device_name, markdown_table, out_dir, parser, run_record, write_json  # noqa: E402
from host_path import busy_ms, start_rank_alone  # noqa: E402


def shares(setting, step: int, layout: str, cp: int) -> list:
    """(micro-batch index, plan) of every global micro-batch of ``layout`` ("global": one plan over every rank;
    "fixed": each DP group's micro-batches over its own CP ranks, as plans of that group) at Megatron CP ``cp``."""
    cus, dp = T.sequences(setting, step), setting.world // cp
    per = len(cus) // dp
    if layout == "global":
        return [(i, mcp.plan(T._mask([cus[d * per + i] for d in range(dp)]), setting.world)) for i in range(per)]
    return [(i, mcp.plan(T._mask([c]), cp)) for i, c in enumerate(cus)]


def run_rank(plan, rank: int, work: Workload, layers: int, device, dtype) -> tuple[float, float]:
    """GPU busy ms of rank ``rank`` of ``plan`` alone: ``layers`` calls forward, then their backward (the second of
    two runs: the first compiles and builds the plan's state)."""
    start_rank_alone(rank, plan.cp_size)
    n = plan.num_local(rank)
    g = torch.Generator(device=device).manual_seed(rank)
    base = [tuple(torch.randn(n, h, work.head_dim, generator=g, device=device, dtype=dtype)
                  for h in (work.num_heads, work.num_kv_heads, work.num_kv_heads)) for _ in range(layers)]
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for _ in range(2):
        with profile(activities=acts) as prof:
            leaves = [tuple(t.detach().requires_grad_() for t in lay) for lay in base]
            outs = [mcp.attention(q, k, v, plan, torch.distributed.group.WORLD)[0] for q, k, v in leaves]
            if cuda:
                torch.cuda.synchronize(device)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            if cuda:
                torch.cuda.synchronize(device)
    if not cuda:
        return 0.0, 0.0
    dev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    back = [e.time_range.start for e in prof.events() if "AttentionBackward" in e.name]
    cut = min(back) if back else float("inf")  # the phases' boundary: the backward's first node
    return busy_ms(dev, 0.0, cut), busy_ms(dev, cut, float("inf"))


def main(argv=None) -> list[dict]:
    ap = parser(__doc__, "out/rank_shares")
    ap.add_argument("--setting", default="b", choices=sorted(T.MEASURED), help="a measured setting (default b)")
    ap.add_argument("--layout", default="global", choices=("global", "fixed"))
    ap.add_argument("--cp", type=int, default=2, help="Megatron's CP size of the layout (default 2)")
    ap.add_argument("--step", type=int, default=0, help="which step's documents (default 0: the profiled one)")
    a = ap.parse_args(argv)
    if not a.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: --dry-run runs on the CPU")
    setting = T.MEASURED[a.setting]
    model = T.MODELS[setting.model]
    if a.dry_run:  # tiny documents, reference kernels: checks the pipeline, times mean nothing
        setting = T.Setting(setting.model, 4, 512, 4, (16, 512, 64, 1.0), 512, steps=(0,))
    layers = 2 if a.dry_run else model.layers
    work = Workload(model.heads, model.kv_heads, 16 if a.dry_run else model.head_dim, 2)
    device = torch.device("cpu") if a.dry_run else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if a.dry_run else torch.bfloat16
    cal = T.calibrate()
    rows = []
    for i, plan in shares(setting, a.step, a.layout, a.cp):
        for r in plan.ranks:
            pf = layers * cal.kernels.time(r.tiles, r.num_tokens, r.buffer_len, work) * 1e3
            pb = layers * cal.kernels.time(r.tiles, r.num_tokens, r.buffer_len, work, True) * 1e3
            mf, mb = run_rank(plan, r.rank, work, layers, device, dtype)
            rows.append(dict(micro_batch=i, rank=r.rank, tokens=r.num_tokens, pred_fwd_ms=pf, pred_bwd_ms=pb,
                             meas_fwd_ms=mf, meas_bwd_ms=mb, fwd_ratio=pf / mf if mf else None,
                             bwd_ratio=pb / mb if mb else None))
    torch.distributed.destroy_process_group()
    ok = sum(x["fwd_ratio"] is not None and abs(x["fwd_ratio"] - 1) <= 0.15 and abs(x["bwd_ratio"] - 1) <= 0.15
             for x in rows)
    write_json(os.path.join(out_dir(a), f"rank_shares{a.tag}.json"),
               dict(run_record(device_name(device)), setting=a.setting, layout=a.layout, cp=a.cp, step=a.step,
                    layers=layers, within_15=ok, rows=rows))
    f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    print(f"{ok}/{len(rows)} ranks within 15% (forward and backward): predicted / measured GPU ms of {layers} calls")
    print("\n".join(markdown_table(
        ["micro-batch", "rank", "tokens", "fwd pred / meas ms", "bwd pred / meas ms", "ratio fwd, bwd"],
        [[x["micro_batch"], x["rank"], x["tokens"], f"{x['pred_fwd_ms']:.1f} / {x['meas_fwd_ms']:.1f}",
          f"{x['pred_bwd_ms']:.1f} / {x['meas_bwd_ms']:.1f}", f"{f(x['fwd_ratio'])}, {f(x['bwd_ratio'])}"]
         for x in rows])))
    return rows


if __name__ == "__main__":
    main()
