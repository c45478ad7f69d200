#!/usr/bin/env python3
"""The host work of megatron-cp's own code in a later layer call, on the CPU: kernels and kernel launches made no-ops.

    python tools/host_glue.py --out results/          # packed and sliding window, 8k tokens per rank, cp 4 and 8, 32:8
    python tools/host_glue.py --dry-run               # tiny sizes

Rank r of a cp N plan runs alone on a ``comm.loopback`` group (as tools/host_path.py), on the CPU, with the inputs'
real token counts and the exchange their real heads and head dim choose (``stages`` passed), but one head of dim 8
(the few copies torch still makes on the CPU then move little). The attention kernels are a backend that only
allocates its outputs; the row moves and the guest rows' merge take the GPU's branch (Triton; one-run copies joining
an indexed launch), each launch counted instead of made. What remains is what the runtime's Python and the aten ops
it calls cost the host: the part a GPU's host time per call adds to Triton's and FA4's launches, measurable on any
machine. Torch ops that compute on the CPU here (one-run slice copies, a staged exchange's index moves) still touch
their (small) data; this machine's noise stays: compare a row with itself across code versions, op counts first.

Per row (mask, tokens per rank, cp, heads): the forward call's and the backward node's host time (a new plan, then
``--calls`` calls per repeat, each on its own leaf tensors; the fastest of ``--iters`` repeats' medians, after
``--warmup``), the aten ops of one later forward call and of its backward (counted by a dispatch mode), and the
kernel launches each would make.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_cp as mcp
from megatron_cp.comm import loopback
from megatron_cp.kernels import ReferenceBackend, merge
from megatron_cp.masks import catalog
from megatron_cp.runtime import guests, rowmap
from megatron_cp.planner import Workload
from megatron_cp.runtime.attention import DEFAULT_COST
from megatron_cp.runtime.state import exchange_choice

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/
from bench_train import micro_batch_masks  # noqa: E402
from common import case_args, case_lists, heads_list, keep_row, markdown_table, out_dir, parser, run_record  # noqa: E402
from host_path import cases_alone  # noqa: E402

def _kernel_classes() -> list:
    """Triton's kernel classes (the interpreter's too, where TRITON_INTERPRET makes ``triton.jit`` use it)."""
    from triton.runtime.jit import JITFunction
    out = [JITFunction]
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction
        out.append(InterpretedFunction)
    return out


class NoKernels(ReferenceBackend):
    """Attention kernels that allocate their outputs and compute nothing."""

    name = "none"

    def prepare(self, tiles, seqlen_q, seqlen_k):
        return None

    def forward(self, q, k, v, prepared, softmax_scale=None, keep=None):
        return q.new_empty(q.shape[:2] + (v.shape[2],)), q.new_empty(q.shape[:2], dtype=torch.float32)

    def forward_accumulate(self, q, k, v, prepared, softmax_scale, out, lse):
        return None

    def backward(self, q, k, v, out, lse, dout, prepared, softmax_scale=None, delta=None, keep=None):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def backward_into(self, q, k, v, out, lse, dout, prepared, softmax_scale, delta, dq, dk, dv):
        return None


def _on_triton(f):
    """``f`` called with ``use_triton=True``, whether its callers pass use_triton by position, name or not at all."""
    at = list(inspect.signature(f).parameters).index("use_triton")

    @functools.wraps(f)
    def call(*args, **kwargs):
        kwargs["use_triton"] = True
        return f(*args[:at], **kwargs)
    return call


@contextlib.contextmanager
def gpu_branch_without_launches(counts: collections.Counter):
    """The runtime's row moves and its guest rows' merge and sum as on a GPU (``use_triton=True``), every Triton launch
    counted in ``counts`` (by kernel name) instead of made; restored on exit."""
    att = sys.modules["megatron_cp.runtime.attention"]  # the package's ``attention`` is the function
    forced = [(rowmap, n) for n in ("copy_pairs", "copy_rows", "copy_row_pairs", "copy_row_pair_moves")]
    forced += [(att, "copy_pairs"), (att, "reduce_row_pairs"), (merge, "merge_sources"), (guests, "reduce_rows")]
    saved = [(m, n, getattr(m, n)) for m, n in forced] + [(c, "__getitem__", c.__getitem__) for c in _kernel_classes()]
    try:
        for m, n, f in saved[:len(forced)]:
            setattr(m, n, _on_triton(f))
        for c in _kernel_classes():
            c.__getitem__ = lambda kernel, grid: (lambda *a, **k: counts.update([kernel.fn.__name__]))
        yield
    finally:
        for m, n, f in saved:
            setattr(m, n, f)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def run_case(name: str, tokens: int, cp: int, heads: tuple[int, int], a) -> dict:
    seqlen = tokens * cp
    mask = micro_batch_masks(seqlen, 1)[0] if name == "packed" else catalog.build(name, seqlen)
    plan, group, be = mcp.plan(mask, cp), dist.group.WORLD, NoKernels()
    n = plan.num_local(a.rank)
    real = Workload(heads[0], heads[1], a.head_dim, a.dtype.itemsize)
    sched = exchange_choice(plan, stages=None, hierarchical=True, cost=DEFAULT_COST, work=real)
    stages = 0 if sched is None else sched.num_stages
    q, k, v = (torch.empty(n, 1, 8, dtype=a.dtype).requires_grad_() for _ in range(3))
    launches: collections.Counter = collections.Counter()
    with gpu_branch_without_launches(launches):
        o, _ = mcp.attention(q, k, v, plan, group, backend=be, stages=stages)  # the first call: state, plan check
        o.backward(torch.empty_like(o))
        launches.clear()
        lq, lk, lv = (t.detach().requires_grad_() for t in (q, k, v))  # leaves of its own: gradients stored, not added
        with _Ops() as ops:
            o, _ = mcp.attention(lq, lk, lv, plan, group, backend=be, stages=stages)
        fwd_ops, fwd_launches = ops.n, sum(launches.values())
        launches.clear()
        go = torch.empty_like(o)
        with _Ops() as ops:
            torch.autograd.backward([o], [go])
        bwd_ops, bwd_launches = ops.n, sum(launches.values())
        fwd, bwd = [], []
        for rep in range(a.warmup + a.iters):
            # a leaf per call, as each layer's own q / k / v: gradients are stored, not summed into one tensor
            leaves = [tuple(t.detach().requires_grad_() for t in (q, k, v)) for _ in range(a.calls)]
            ts, outs = [], []
            for lq, lk, lv in leaves:
                t0 = time.perf_counter()
                outs.append(mcp.attention(lq, lk, lv, plan, group, backend=be, stages=stages)[0])
                ts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            torch.autograd.backward(outs, [go] * len(outs))
            if rep >= a.warmup:
                fwd.append(np.median(ts) * 1e6)
                bwd.append((time.perf_counter() - t0) / len(outs) * 1e6)
    return dict(mask=name, tokens_per_rank=tokens, cp=cp, rank=a.rank, heads=f"{heads[0]}:{heads[1]}",
                head_dim=a.head_dim, exchange="single" if sched is None else f"{stages} stages",
                fwd_host_us=min(fwd), bwd_host_us=min(bwd), fwd_host_us_median=float(np.median(fwd)),
                bwd_host_us_median=float(np.median(bwd)), fwd_aten_ops=fwd_ops, bwd_aten_ops=bwd_ops,
                fwd_launches=fwd_launches, bwd_launches=bwd_launches)


def summary(rows) -> list[str]:
    return markdown_table(
        ["mask", "tokens / rank", "cp", "heads", "exchange", "fwd call us", "bwd node us", "aten ops fwd / bwd",
         "launches fwd / bwd"],
        [[r["mask"], r["tokens_per_rank"], r["cp"], r["heads"], r["exchange"], f"{r['fwd_host_us']:.1f}",
          f"{r['bwd_host_us']:.1f}", f"{r['fwd_aten_ops']} / {r['bwd_aten_ops']}",
          f"{r['fwd_launches']} / {r['bwd_launches']}"] for r in rows])


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser(__doc__, "out/host_glue", timing=(2, 7))
    case_args(ap, "packed,sliding_window")
    ap.add_argument("--heads", default=None, help="comma list of Hq:Hkv (default 32:8; dry run 4:2)")
    ap.add_argument("--calls", type=int, default=None, help="layer calls per repeat (default 26; dry run 3)")
    a = ap.parse_args(argv)
    masks, cps, tokens = case_lists(ap, a, least_cp=2)
    heads = heads_list(a.heads, a.dry_run, "32:8")
    a.calls = a.calls or (3 if a.dry_run else 26)
    a.head_dim, a.dtype = (16, torch.float32) if a.dry_run else (128, torch.bfloat16)
    if a.dry_run:
        a.warmup, a.iters = 0, 1
    out = out_dir(a)
    meta = run_record("CPU", " ".join(["python", os.path.relpath(sys.argv[0]), *argv]), host_cpu=os.cpu_count(),
                      dtype=str(a.dtype), process_group=loopback.BACKEND)
    result = []
    for cp, name, t, h in cases_alone(a.rank, cps, masks, tokens, heads):
        keep_row(result, run_case(name, t, cp, h, a), summary, os.path.join(out, f"host_glue{a.tag}.json"), meta,
                 a.verbose, sys.stderr)
    print("\n".join(summary(result)))
    return result


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
