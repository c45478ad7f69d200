"""Benchmark: dynamic block-sparse attention (megatron_cp.sparse) against dense attention, one GPU.

For each method (--methods: moba, xattention, flexprefill, minference) and sequence length (--seqlens), on
one envelope (--envelope causal | packed: megatron_cp.masks.catalog's docs_causal documents), bf16,
Hq=32, Hkv=8, D=128 (--heads, --kv-heads, --head-dim), batch 1, CP = 1:

    plan = megatron_cp.plan(envelope, 1, guest_rows="none", block=selector.block)
    out, lse = megatron_cp.sparse.sparse_attention(q, k, v, plan, None, selector, backend=be)

and on the same envelope dense ``megatron_cp.attention(q, k, v, mcp.plan(envelope, 1), backend=be)``; ``be``
is one backend object for both (--backend; auto: FA4 where flash-attn-4 imports on sm90 / sm100, else
Triton). Each JSON row (one per method and S) holds:

    kept_blocks          selected (head, q block, key block) pairs / the envelope's pairs (x Hq)
    kept_cells           cells of the selected pairs that the envelope keeps / the envelope's cells (x Hq)
    select_ms            the selection alone: selector.select on the one-process view (single_view; what
                         select_blocks runs at CP = 1), forward only
    fwd_ms, bwd_ms       sparse_attention: selection + block gather + kernel; backward = autograd through it
    attn_fwd_ms          fwd_ms - select_ms: the attention part of the call
    kernel_fwd_ms/_bwd   the backend's forward / backward with the run's BlockKeep on the layout's prepared
                         tiles: the block-sparse kernel alone (its path in kernel_path)
    dense_*              the same for dense attention (mcp.attention; dense_kernel_*: be.forward / backward
                         on the envelope's tile list, keep=None)
    speedup_fwd/_bwd     dense_fwd_ms / fwd_ms and dense_bwd_ms / bwd_ms (> 1: sparse is faster)
    kernel_tflops_*      FLOPs on kept cells / kernel time: forward 4 * D * (kept cells summed over heads),
                         backward 2.5x that (tools/bench_kernels.py's convention)
    dense_tflops_*       the dense kernel on the envelope's cells (4 * Hq * D * cells, bwd 2.5x)
    tflops_ratio_*       kernel_tflops / dense_tflops: how well the block-sparse kernel keeps the dense
                         kernel's rate on the work it does (target >= 0.85)
    out_rel_err          relative RMS of out over rows: sqrt(mean over (token, head) rows of
                         |out_sparse - out_dense|^2 / |out_dense|^2), fp32; also out_rel_rms (all entries
                         at once) and out_row_rel_p99 (99th percentile of the per-row relative error)
    recall               (--png only) per drawn head, the dense attention mass the selection keeps

Times are medians over --iters steps after --warmup: on the GPU each phase is issued while the stream is
held (tools/common.py's Timer.held: CUDA events time the GPU work, not the host's issue; a host
synchronisation inside a call, or a host issue longer than the hold (~10 ms), shows as GPU idle time);
on the CPU dry run wall clock.

Inputs (--inputs): random (i.i.d. normal q, k, v: attention nearly uniform, selection has nothing to find),
structured (the default: synthetic q / k with known structure per K/V head, cycling through: sink tokens
+ local band ("a-shape"), vertical lines + slashes ("vertical-slash"), local band, random; meta.structure
names each head's kind; see structured_qk), model (q / k / v captured from a trained checkpoint, q and k
after the rotary embedding, as attention sees them: --qkv FILE, a torch.save'd dict {"q", "k", "v"} of
[S, H, D] tensors (a leading batch dimension of 1 is dropped), or a list / dict of such per layer,
--layer picking one; the run's S must not exceed the file's, longer files are cut to S).
Capturing q / k / v from the example Llama is not part of this tool.

Output: one markdown table on stdout (the last lines), a progress bar on stderr (each case's line with
--verbose), OUT/bench_sparse.json (meta: device, date, command, versions, sizes, backend) and
OUT/bench_sparse.png (speedups, TFLOP/s against dense, kept fraction). --png also draws each method's
selection at the first S beside dense attention's mass per block (megatron_cp.sparse.draw), as
OUT/selection_<method>_S<S>.png. OUT is --out (default out/sparse, ignored by git), or with --dated
benchmarks/<date>_1x<GPU>_sparse/ (results the README quotes); the dry run writes to a temporary folder
unless --out is given.

Usage (one GPU; FA4 is used where flash-attn-4 is installed, e.g. pip install -e '.[fa4]'):
    python tools/bench_sparse.py --inputs structured --png --dated
    python tools/bench_sparse.py --methods moba xattention --seqlens 65536 --envelope packed
    python tools/bench_sparse.py --inputs model --qkv qkv.pt --layer 3 --minference-config patterns.json
    python tools/bench_sparse.py --dry-run        # CPU: S 1024, Hq 4, Hkv 2, D 32, fp32, reference kernels
    python tools/bench_sparse.py --dry-run --backend triton   # CPU: Triton's interpreter, S 512, D 64, fp16
The dry run checks that the whole pipeline runs; its times mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import sys
import tempfile
import time
import traceback
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/: the progress bar, table, timer


def _interpret_on_cpu():
    """--dry-run --backend triton runs the Triton kernels in Triton's interpreter, which must be on before
    triton is imported (as tools/bench_kernels.py --device cpu)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--backend", default="auto")
    known = ap.parse_known_args()[0]
    if known.dry_run and known.backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"


if __name__ == "__main__":
    _interpret_on_cpu()

from common import Progress, markdown_table  # noqa: E402
from common import Timer, run_record  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import megatron_cp as mcp  # noqa: E402
from megatron_cp import kernels  # noqa: E402
from megatron_cp.kernels.block_keep import BlockKeep  # noqa: E402
from megatron_cp.masks import catalog  # noqa: E402
from megatron_cp.masks.draw import block_grid  # noqa: E402
from megatron_cp.sparse import single_view, sparse_attention, sparse_layout  # noqa: E402
from megatron_cp.sparse.draw import block_mass, draw_selection  # noqa: E402
from megatron_cp.sparse.flexprefill import FlexPrefill  # noqa: E402
from megatron_cp.sparse.minference import HeadPattern, MInference  # noqa: E402
from megatron_cp.sparse.moba import MoBA  # noqa: E402
from megatron_cp.sparse.xattention import XAttention  # noqa: E402

METHODS = ("moba", "xattention", "flexprefill", "minference")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
RATIO_TARGET = 0.85  # the block-sparse kernel's TFLOP/s on kept cells over dense FA4's, fwd and bwd
DRY_RUN_BLOCK = {"moba": 128, "xattention": 64, "flexprefill": 64, "minference": 64}  # S 1024: 8 / 16 blocks
STRUCTURE_KINDS = ("a-shape", "vertical-slash", "local", "random")  # per K/V head, cyclic


# --------------------------------------------------------------------------------------------------
# selectors


def make_selector(method: str, args, hq: int, hkv: int):
    """The selector of ``method`` with this run's hyperparameters (``--block`` replaces each method's own
    block). MInference: --minference-config's patterns for --layer, else ``default_patterns``."""
    block = args.block if args.block is not None else (DRY_RUN_BLOCK[method] if args.dry_run else None)
    kw = {} if block is None else {"block": block}
    if method == "moba":
        return MoBA(top_k=args.moba_top_k, **kw)
    if method == "xattention":
        return XAttention(stride=args.xattn_stride, threshold=args.xattn_threshold, **kw)
    if method == "flexprefill":
        for n in ("min_budget", "max_budget"):  # unset: the selector's defaults (512 / None, as published)
            if getattr(args, f"flexprefill_{n}") is not None:
                kw[n] = getattr(args, f"flexprefill_{n}")
        return FlexPrefill(gamma=args.flexprefill_gamma, tau=args.flexprefill_tau, **kw)
    if method == "minference":
        if args.minference_config:
            return MInference.from_json(args.minference_config, args.layer, block=block or 128)
        return MInference(patterns=default_patterns(hq, hkv), **kw)
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def selector_label(sel) -> str:
    """A short name of a selector and its hyperparameters (MInference: its kinds counted, not every head)."""
    pats = getattr(sel, "patterns", None)
    if pats:
        kinds = {}
        for p in pats:
            kinds[p.kind] = kinds.get(p.kind, 0) + 1
        return f"{type(sel).__name__}(block={sel.block}, " + ", ".join(f"{k} x{n}" for k, n in kinds.items()) + ")"
    return repr(sel)


def default_patterns(hq: int, hkv: int) -> list:
    """MInference's per-head patterns without a searched config (tools/minference_search.py): per K/V head,
    the kind that fits ``structured_qk``'s structure of that head (a-shape and local -> a_shape,
    vertical-slash -> vertical_slash, random -> block_sparse), with the published sizes (sink 128, local
    3968; vertical 1000, slash 6096; top 6400 tokens' worth of blocks; scaled to S by the selector). On
    other inputs it is just that cycle over the heads: a stand-in that runs every kind's path, not a
    model's searched config (pass one with --minference-config)."""
    kind = {"a-shape": "a_shape", "vertical-slash": "vertical_slash", "local": "a_shape", "random": "block_sparse"}
    per_kv = [HeadPattern(kind=kind[k]) for k in structure_kinds(hkv)]
    return [per_kv[h // (hq // hkv)] for h in range(hq)]


# --------------------------------------------------------------------------------------------------
# envelopes and inputs


def make_envelope(name: str, seqlen: int):
    """The static mask: causal, or packed documents (catalog's docs_causal: lognormal lengths around 1500)."""
    if name == "causal":
        return mcp.masks.causal(seqlen)
    return catalog.build("docs_causal", seqlen)


def structured_qk(s: int, hq: int, hkv: int, d: int, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic q [S, Hq, D], k [S, Hkv, D] (float32) whose attention has a known shape per K/V head
    (``STRUCTURE_KINDS[h % 4]``; the q heads of a group share their K/V head's kind):

    a-shape          sink tokens (the first 64 keys share a direction with every query: +10 logits)
                     and a local band (below)
    vertical-slash   vertical lines (32 random key positions share a direction with every query: +8
                     logits) and slashes (keys at distances that are multiples of P = max(S / 16, 256)
                     from the query: a periodic kernel of M harmonics, peaks P / M wide: +10 logits)
    local            a local band: +10 logits at distance 0, falling to ~0 by distance ~2S / M
                     (the first M harmonics of period 2S, so it does not wrap within the sequence)
    random           nothing but the noise

    Every head also has i.i.d. normal noise (std 0.5 per entry). A kernel of harmonics
    sum_m cos(w_m (i - j)) / M is q_i . k_j for q_i, k_j = c (cos w_m i, sin w_m i)_m: positions enter like
    a rotary embedding, so the band / slashes are exact functions of i - j. The structure takes the first
    dims: 8 for a direction, 2 M for harmonics (M = min(24, (D - 8) / 4)).
    """
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)  # on the device: 128k x 32 x 128 is slow on a CPU core
    q = torch.randn(s, hq, d, generator=g, device=dev) * 0.5
    k = torch.randn(s, hkv, d, generator=g, device=dev) * 0.5
    grp = hq // hkv
    nd = min(8, d // 4)  # direction dims
    m = max(1, min(24, (d - nd) // 4))  # harmonics
    pos = torch.arange(s, dtype=torch.float64, device=dev)
    root = math.sqrt(math.sqrt(d))  # logits are q.k / sqrt(D): a +L logit shift is (sqrt(L) root)^2 / sqrt(D)

    def direction(logits):
        u = torch.randn(nd, generator=g, dtype=torch.float64, device=dev)
        return (u / u.norm() * math.sqrt(logits) * root).float()

    def harmonics(period, logits):
        w = 2 * math.pi * torch.arange(1, m + 1, dtype=torch.float64, device=dev) / period
        ang = pos[:, None] * w[None]  # float64: positions up to 1M keep their phase
        c = math.sqrt(logits / m) * root
        return (torch.stack([ang.cos(), ang.sin()], -1).reshape(s, 2 * m) * c).float()

    hd = slice(nd, nd + 2 * m)
    for h, kind in enumerate(structure_kinds(hkv)):
        qs = slice(h * grp, (h + 1) * grp)
        if kind in ("a-shape", "vertical-slash"):
            u = direction(10.0 if kind == "a-shape" else 8.0)
            keys = (torch.arange(min(64, s), device=dev) if kind == "a-shape"
                    else torch.randperm(s, generator=g, device=dev)[:32])
            q[:, qs, :nd] += u
            k[keys, h, :nd] += u
        if kind in ("a-shape", "local", "vertical-slash"):
            period = max(s // 16, 256) if kind == "vertical-slash" else 2 * s
            f = harmonics(period, 10.0)
            q[:, qs, hd] += f[:, None]
            k[:, h, hd] += f
    return q, k


def structure_kinds(hkv: int) -> list:
    """The kind of each K/V head's structure in ``structured_qk``."""
    return [STRUCTURE_KINDS[h % len(STRUCTURE_KINDS)] for h in range(hkv)]


def load_qkv(path: str, layer: int) -> dict:
    """{"q" [S, Hq, D], "k" [S, Hkv, D], "v" [S, Hkv, D]} from a torch.save'd file: such a dict, or a
    list / dict of them per layer (``layer`` picks one; dict keys may be ints or strings). A leading batch
    dimension of 1 ([1, S, H, D]) or Megatron's [S, 1, H, D] is dropped. ValueError on anything else."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if not (isinstance(obj, dict) and {"q", "k", "v"} <= obj.keys()):
        if isinstance(obj, dict) and "layers" in obj:
            obj = obj["layers"]
        try:
            obj = obj[layer] if not isinstance(obj, dict) or layer in obj else obj[str(layer)]
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"{path}: no layer {layer!r} (a dict with q, k, v, or a list / dict of them per "
                             f"layer)") from None
    if not (isinstance(obj, dict) and {"q", "k", "v"} <= obj.keys()):
        raise ValueError(f"{path} layer {layer}: expected a dict with q, k, v tensors, got {type(obj).__name__}")
    out = {}
    for n in ("q", "k", "v"):
        x = obj[n]
        if x.dim() == 4 and x.shape[0] == 1:
            x = x[0]
        elif x.dim() == 4 and x.shape[1] == 1:
            x = x[:, 0]
        if x.dim() != 3:
            raise ValueError(f"{path}: {n} must be [S, H, D] (or with a batch of 1), got {tuple(obj[n].shape)}")
        out[n] = x
    sq, (_, hq, d), (sk, hkv, dk) = out["q"].shape[0], out["q"].shape, out["k"].shape
    if sq != sk or out["v"].shape != out["k"].shape or d != dk or hq % hkv:
        raise ValueError(f"{path}: shapes do not fit q [S, Hq, D], k / v [S, Hkv, D] with Hkv | Hq: "
                         f"{[tuple(out[n].shape) for n in 'qkv']}")
    return out


def make_inputs(args, s: int, device, dtype, seed: int = 0) -> dict:
    """q [S, Hq, D], k / v [S, Hkv, D], dout [S, Hq, D] of ``dtype`` on ``device`` (global order)."""
    g = torch.Generator(device=device).manual_seed(seed + 1)
    randn = lambda *shape: torch.randn(*shape, generator=g, device=device)  # noqa: E731
    if args.inputs == "model":
        t = load_qkv(args.qkv, args.layer)
        if t["q"].shape[0] < s:
            raise ValueError(f"--qkv {args.qkv} holds {t['q'].shape[0]} tokens, fewer than S = {s}")
        q, k, v = (t[n][:s].to(device=device, dtype=dtype) for n in ("q", "k", "v"))
    else:
        hq, hkv, d = args.heads, args.kv_heads, args.head_dim
        if args.inputs == "structured":
            q, k = structured_qk(s, hq, hkv, d, device, seed)
        else:
            q, k = randn(s, hq, d), randn(s, hkv, d)
        v = randn(s, hkv, d)
        q, k, v = (x.to(device=device, dtype=dtype) for x in (q, k, v))
    do = randn(*q.shape).to(dtype)
    return {"q": q, "k": k, "v": v, "do": do}


# --------------------------------------------------------------------------------------------------
# timing


def _grad_leaves(t: dict):
    return tuple(t[n].detach().requires_grad_(True) for n in ("q", "k", "v"))


def _backward(do):
    def bwd(res):
        out = res[0]
        torch.autograd.backward(out, do)  # the leaves' .grad accumulate: the same work every step
    return bwd


def time_api(fn, t: dict, clock):
    """(fwd ms, bwd ms, out) of fn(q, k, v) -> (out, lse), the backward by autograd from out with dout."""
    q, k, v = _grad_leaves(t)
    f, b = clock(lambda: fn(q, k, v), _backward(t["do"]))
    with torch.no_grad():
        out = fn(q, k, v)[0]
    return f, b, out


def time_kernel(be, prepared, t: dict, k, v, scale, keep, clock):
    """(fwd ms, bwd ms, path) of the backend's forward / backward on ``prepared`` with ``keep`` (a BlockKeep
    or None): the kernels alone, without the selection, gather or autograd around them."""
    q, do = t["q"], t["do"]
    out, lse = be.forward(q, k, v, prepared, scale, keep=keep)
    f, _ = clock(lambda: be.forward(q, k, v, prepared, scale, keep=keep))
    fwd_path = getattr(be, "last_path", None)
    _, b = clock(lambda: None, lambda _: be.backward(q, k, v, out, lse, do, prepared, scale, None, keep=keep))
    return f, b, {"fwd": fwd_path, "bwd": getattr(be, "last_path", None)}


# --------------------------------------------------------------------------------------------------
# one case


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Relative errors of out against ref ([S, H, D]) over rows (one row = one token and head), fp32."""
    o, r = out.float(), ref.float()
    num = (o - r).square().sum(-1)
    den = r.square().sum(-1)
    rel = (num / den.clamp_min(1e-30)).flatten()
    return {"out_rel_err": float(rel.mean().sqrt()), "out_rel_rms": float((num.sum() / den.sum()).sqrt()),
            "out_row_rel_p99": float(torch.kthvalue(rel.sqrt().cpu(), max(1, math.ceil(0.99 * rel.numel()))).values)}


def kept_cells(keep: torch.Tensor, grid: torch.Tensor) -> int:
    """Cells of the selected block pairs the envelope keeps, summed over heads: keep bool [Hq, nb, nb],
    grid int64 [nb, nb] (the envelope's cells per block pair)."""
    return int((keep.to(torch.int64) * grid[None]).sum())


def dense_case(mask, t: dict, be, clock) -> dict:
    """Dense attention on the envelope: mcp.attention and the backend's kernel on the tile list."""
    s, hq, d = t["q"].shape
    plan = mcp.plan(mask, 1)
    scale = 1.0 / math.sqrt(d)
    f, b, out = time_api(lambda q, k, v: mcp.attention(q, k, v, plan, None, backend=be), t, clock)
    tiles = catalog.tiles(mask)  # one GPU's tile list of the envelope (bench_kernels' lists)
    prep = be.prepare(tiles, s, s)
    kf, kb, path = time_kernel(be, prep, t, t["k"], t["v"], scale, None, clock)
    cells = int(kernels.kept_area(tiles))
    flops = 4.0 * hq * d * cells
    return {"fwd_ms": f, "bwd_ms": b, "kernel_fwd_ms": kf, "kernel_bwd_ms": kb, "kernel_path": path,
            "cells": cells, "tflops_fwd": flops / kf / 1e9, "tflops_bwd": 2.5 * flops / kb / 1e9, "out": out}


def sparse_plan(mask, block: int, cache: dict):
    """The one-rank sparse plan of ``mask`` at ``block``, one per (mask, block) in ``cache``: the sparse
    runtime keeps its layout and prepared tiles with the plan object, so methods of one block share them."""
    key = (id(mask), block)
    if key not in cache:
        plan = mcp.plan(mask, 1, guest_rows="none", block=block)
        if not np.array_equal(plan.local_ids(0), np.arange(plan.seqlen)):  # CP = 1 keeps global order
            raise RuntimeError("a one-rank plan reordered the tokens")
        cache[key] = (mask, plan)  # the mask held too: its id stays unique while cached
    return cache[key][1]


def runtime_layout(plan, block: int, be):
    """(SparseLayout, prepared tiles) of rank 0, as sparse_attention builds them (a layout costs well under a
    second at 128k)."""
    lay = sparse_layout(plan, 0, block)
    return lay, be.prepare(lay.tiles, lay.nq * block, lay.ne * block)


def sparse_case(method, sel, mask, t: dict, be, clock, dense: dict, args, plans: dict) -> dict:
    """One method at one S: selection, the sparse call, its kernel alone, against ``dense``."""
    s, hq, d = t["q"].shape
    B = sel.block
    plan = sparse_plan(mask, B, plans)
    scale = 1.0 / math.sqrt(d)
    q, k = t["q"], t["k"]
    # the selection alone: what select_blocks runs at CP = 1 (the selector on the one-process view; the
    # view is static and built once, outside the timing)
    sel.check(hq, k.shape[1], d, s)
    view = single_view(mask, B, k)
    env = view.envelope > 0
    with torch.no_grad():
        keep = sel.select(q, k, view) & env[None]  # [Hq, nb, nb]: q blocks in global order at CP = 1
        select_ms, _ = clock(lambda: sel.select(q, k, view))
    stats = {}
    with torch.no_grad():
        sparse_attention(q, k, t["v"], plan, None, sel, backend=be, stats=stats)
    if stats["blocks_selected"] != int(keep.sum()):  # the runtime selected what the view gave
        raise RuntimeError(f"sparse_attention selected {stats['blocks_selected']} blocks, the selector on "
                           f"single_view {int(keep.sum())}")
    f, b, out = time_api(lambda q_, k_, v_: sparse_attention(q_, k_, v_, plan, None, sel, backend=be), t, clock)

    # the kernel alone: the layout's tile list over (rows, key buffer) narrowed by this selection; at CP = 1
    # the buffer holds the envelope's key blocks in ascending order (all of them for causal and documents)
    lay, prep = runtime_layout(plan, B, be)
    ids = torch.as_tensor(lay.env_ids, dtype=torch.long, device=q.device)
    kbuf, vbuf = t["k"], t["v"]
    if lay.ne != s // B:
        rows = (ids[:, None] * B + torch.arange(B, device=q.device)).reshape(-1)
        kbuf, vbuf = kbuf[rows], vbuf[rows]
    bk = BlockKeep(keep[:, :, ids].contiguous(), B)
    kf, kb, path = time_kernel(be, prep, t, kbuf, vbuf, scale, bk, clock)

    grid = torch.as_tensor(block_grid(mask.traps, s, s, B), device=q.device)
    kc = kept_cells(keep, grid)
    flops = 4.0 * d * kc
    r = {"method": method, "S": s, "block": B, "selector": selector_label(sel), "selector_repr": repr(sel),
         "blocks_selected": stats["blocks_selected"], "blocks_envelope": stats["blocks_envelope"],
         "kept_blocks": stats["blocks_selected"] / stats["blocks_envelope"],
         "cells_kept": kc, "cells_envelope": hq * dense["cells"], "kept_cells": kc / (hq * dense["cells"]),
         "select_ms": select_ms, "fwd_ms": f, "bwd_ms": b, "attn_fwd_ms": f - select_ms,
         "kernel_fwd_ms": kf, "kernel_bwd_ms": kb, "kernel_path": path,
         "dense_fwd_ms": dense["fwd_ms"], "dense_bwd_ms": dense["bwd_ms"],
         "dense_kernel_fwd_ms": dense["kernel_fwd_ms"], "dense_kernel_bwd_ms": dense["kernel_bwd_ms"],
         "dense_kernel_path": dense["kernel_path"],
         "speedup_fwd": dense["fwd_ms"] / f, "speedup_bwd": dense["bwd_ms"] / b,
         "kernel_speedup_fwd": dense["kernel_fwd_ms"] / kf, "kernel_speedup_bwd": dense["kernel_bwd_ms"] / kb,
         "kernel_tflops_fwd": flops / kf / 1e9, "kernel_tflops_bwd": 2.5 * flops / kb / 1e9,
         "dense_tflops_fwd": dense["tflops_fwd"], "dense_tflops_bwd": dense["tflops_bwd"]}
    r["tflops_ratio_fwd"] = r["kernel_tflops_fwd"] / r["dense_tflops_fwd"]
    r["tflops_ratio_bwd"] = r["kernel_tflops_bwd"] / r["dense_tflops_bwd"]
    r["tflops_ratio_ok"] = min(r["tflops_ratio_fwd"], r["tflops_ratio_bwd"]) >= RATIO_TARGET
    r.update(row_errors(out, dense["out"]))
    if args.png and args.png_done.get(method) is None:
        r["recall"] = draw_case(method, sel, mask, t, keep, env, args)
    return r


def draw_case(method, sel, mask, t: dict, keep, env, args) -> dict:
    """selection_<method>_S<S>.png: the selection of --png-heads beside dense attention's block mass;
    returns {head: recall} (the dense mass the selection keeps)."""
    s, hq = t["q"].shape[:2]
    hkv = t["k"].shape[1]
    # default: the first q head of each of the first K/V heads, one per structure kind
    heads = [h for h in (args.png_heads or [j * (hq // hkv) for j in range(min(len(STRUCTURE_KINDS), hkv))]) if h < hq]
    dense = block_mass(t["q"], t["k"], sel.block, heads, mask, rows_per_block=args.png_rows)
    path = os.path.join(args.out, f"selection_{method}_S{s}.png")
    draw_selection(keep, path, heads=heads, dense=dense, envelope=env,
                   title=f"{selector_label(sel)}  S={s}  {args.envelope} envelope, {args.inputs} inputs")
    args.png_done[method] = path
    kp = keep[heads].float()
    return {int(h): float((dense[n] * kp[n]).sum() / dense[n].sum().clamp_min(1e-30)) for n, h in enumerate(heads)}


# --------------------------------------------------------------------------------------------------
# the table and the picture


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def _tf(x):
    """TFLOP/s: whole numbers on a GPU, 3 significant digits below 10 (the CPU dry run)."""
    return f"{x:.0f}" if x >= 10 else f"{x:.3g}"


def table(rows: list) -> list:
    """The closing markdown table: a row per (method, S); err where the case failed."""
    head = ["method", "S", "kept blocks %", "kept cells %", "select ms", "fwd ms", "bwd ms", "dense fwd / bwd ms",
            "speedup fwd / bwd", "TFLOP/s kept fwd / bwd", "dense TFLOP/s fwd / bwd",
            f"TFLOP/s ratio fwd / bwd (* < {RATIO_TARGET})",
            "out rel. err"]
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([r["method"], r["S"], "err"] + ["-"] * (len(head) - 4) + [r["error"][:80]])
            continue
        cells.append([r["method"], r["S"], f"{100 * r['kept_blocks']:.1f}", f"{100 * r['kept_cells']:.1f}",
                      _f(r["select_ms"]), _f(r["fwd_ms"]), _f(r["bwd_ms"]),
                      f"{_f(r['dense_fwd_ms'])} / {_f(r['dense_bwd_ms'])}",
                      f"{_f(r['speedup_fwd'])} / {_f(r['speedup_bwd'])}",
                      f"{_tf(r['kernel_tflops_fwd'])} / {_tf(r['kernel_tflops_bwd'])}",
                      f"{_tf(r['dense_tflops_fwd'])} / {_tf(r['dense_tflops_bwd'])}",
                      " / ".join(_f(r[f"tflops_ratio_{p}"]) + ("*" if r[f"tflops_ratio_{p}"] < RATIO_TARGET else "")
                                 for p in ("fwd", "bwd")),
                      f"{r['out_rel_err']:.2e}"])
    return markdown_table(head, cells)


def plot(meta: dict, rows: list, path: str) -> None:
    """Speedup (API time), TFLOP/s of the sparse kernel on kept cells against dense, kept fraction."""
    try:
        from matplotlib.figure import Figure  # no pyplot: headless, no global figure state
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    ok = [r for r in rows if "error" not in r]
    fig = Figure(figsize=(max(8.0, 1.2 * len(ok) + 2), 10))
    axes = fig.subplots(3, 1)
    labels = [f"{r['method']}\nS={r['S'] // 1024}k" if r["S"] >= 1024 else f"{r['method']}\nS={r['S']}" for r in ok]
    x = np.arange(len(ok))
    panels = ((("speedup_fwd", "fwd"), ("speedup_bwd", "bwd")), "speedup vs dense (x)"), \
             ((("kernel_tflops_fwd", "sparse fwd"), ("dense_tflops_fwd", "dense fwd"),
               ("kernel_tflops_bwd", "sparse bwd"), ("dense_tflops_bwd", "dense bwd")), "kernel TFLOP/s"), \
             ((("kept_blocks", "blocks"), ("kept_cells", "cells")), "kept fraction of envelope")
    for ax, (series, ylabel) in zip(axes, panels):
        w = 0.8 / len(series)
        for j, (key, name) in enumerate(series):
            ax.bar(x + (j - (len(series) - 1) / 2) * w, [r[key] for r in ok], width=w, label=name)
        if ylabel.startswith("speedup"):
            ax.axhline(1.0, color="k", lw=0.6)
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle(f"{meta['device']}  {meta['date']}  {meta['dtype']} Hq={meta['Hq']} Hkv={meta['Hkv']} "
                 f"D={meta['D']}  {meta['envelope']} envelope, {meta['inputs']} inputs, backend "
                 f"{meta['backend']['name']}\n{meta['command']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


# --------------------------------------------------------------------------------------------------


def save(path: str, meta: dict, rows: list) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1, default=str)  # describe() may hold dtypes


def fa4_version():
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--seqlens", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--envelope", choices=("causal", "packed"), default="causal",
                    help="the static mask: causal, or packed documents (catalog docs_causal)")
    ap.add_argument("--inputs", choices=("random", "structured", "model"), default="structured")
    ap.add_argument("--qkv", default=None, help="--inputs model: a .pt file of {q, k, v} (per layer)")
    ap.add_argument("--layer", type=int, default=0, help="layer in --qkv and --minference-config (0-based)")
    ap.add_argument("--backend", default="auto", choices=("auto", "fa4", "triton", "reference"),
                    help="kernels for sparse and dense alike (auto: FA4 where flash-attn-4 runs, else Triton)")
    ap.add_argument("--block", type=int, default=None, help="every selector's block (default: each method's)")
    ap.add_argument("--moba-top-k", type=int, default=3)
    ap.add_argument("--xattn-stride", type=int, default=8)
    ap.add_argument("--xattn-threshold", type=float, default=0.9)
    ap.add_argument("--flexprefill-gamma", type=float, default=0.9)
    ap.add_argument("--flexprefill-tau", type=float, default=0.1)
    ap.add_argument("--flexprefill-min-budget", type=int, default=None, help="tokens (default: FlexPrefill's)")
    ap.add_argument("--flexprefill-max-budget", type=int, default=None, help="tokens (default: FlexPrefill's)")
    ap.add_argument("--minference-config", default=None,
                    help="MInference pattern JSON (tools/minference_search.py); default: bench_sparse's stand-in")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per measurement (FA4 compiles on the first)")
    ap.add_argument("--iters", type=int, default=5, help="timed steps per measurement (medians)")
    ap.add_argument("--png", action="store_true",
                    help="also draw each method's selection at the first S beside dense attention's mass")
    ap.add_argument("--png-heads", type=int, nargs="+", default=None,
                    help="query heads drawn (default: the first q head of each structure kind)")
    ap.add_argument("--png-rows", type=int, default=16, help="rows per q block sampled for the dense mass")
    ap.add_argument("--out", default=None, help="output folder (default out/sparse; the dry run: a temp folder)")
    ap.add_argument("--dated", action="store_true", help="write to benchmarks/<date>_1x<GPU>_sparse/")
    ap.add_argument("--tag", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: S 1024, Hq 4, Hkv 2, D 32, fp32, reference kernels, blocks 64 (MoBA 128); with "
                         "--backend triton: Triton's interpreter, S 512, D 64, fp16")
    ap.add_argument("--verbose", action="store_true", help="each case's line on stderr as it finishes")
    args = ap.parse_args(argv)
    if args.inputs == "model" and not args.qkv:
        ap.error("--inputs model needs --qkv FILE")
    if args.dry_run:
        interp = args.backend == "triton"  # Triton's interpreter (_interpret_on_cpu): slow, so smaller
        if args.seqlens == ap.get_default("seqlens"):
            args.seqlens = [512 if interp else 1024]
        # fp16 in the interpreter: it computes bf16 tl.dot wrongly (tools/bench_kernels.py); D 64: a head
        # size the Triton backend prepares by default
        args.heads, args.kv_heads = 4, 2
        args.head_dim, args.dtype = (64, "fp16") if interp else (32, "fp32")
        args.backend = "triton" if interp else "reference"
        args.warmup, args.iters = 1, 1
    return ap, args


def main(argv=None):
    ap, args = parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: run on a GPU, or --dry-run on the CPU")
    dtype = DTYPES[args.dtype]
    dev_name = (torch.cuda.get_device_name() if device.type == "cuda" else
                "cpu (Triton interpreter)" if args.backend == "triton" else "cpu (reference kernels)")
    if args.out is None:
        if args.dated:
            short = dev_name.replace("NVIDIA ", "").split()[0] if device.type == "cuda" else "CPU"
            args.out = os.path.join("benchmarks", f"{time.strftime('%Y-%m-%d', time.gmtime())}_1x{short}_sparse")
        else:
            args.out = tempfile.mkdtemp(prefix="bench_sparse_") if args.dry_run else os.path.join("out", "sparse")
    os.makedirs(args.out, exist_ok=True)
    args.png_done = {}
    be = kernels.get_backend(args.backend, device)  # one object: its prepared tiles are cached per object
    meta = run_record(dev_name, "python " + " ".join([sys.argv[0] if argv is None else "tools/bench_sparse.py"]
                                                     + (sys.argv[1:] if argv is None else list(argv))), **{
            "flash_attn_4": fa4_version(), "dtype": args.dtype,
            "Hq": args.heads, "Hkv": args.kv_heads, "D": args.head_dim, "envelope": args.envelope,
            "inputs": args.inputs, "warmup": args.warmup, "iters": args.iters,
            "timing": "medians; CUDA: Timer.held (GPU time behind a held stream); CPU: wall clock",
            "flops": "fwd 4*D*kept cells (sum over heads), bwd 2.5x; dense: 4*Hq*D*envelope cells",
            "backend": {"name": getattr(be, "name", type(be).__name__)},
            "selection_png": args.png_done})  # filled as the pictures are drawn
    if args.inputs == "model":
        meta.update(qkv=args.qkv, layer=args.layer)
    rows = []
    path = os.path.join(args.out, f"bench_sparse{args.tag}.json")
    bar = Progress(len(args.seqlens) * (1 + len(args.methods)), "bench_sparse", verbose=args.verbose)
    # clock(fwd, bwd=None) -> medians of (fwd ms, bwd ms) at this run's warm-up and iterations
    clock = partial(Timer(device).medians, warmup=args.warmup, iters=args.iters)
    for s in args.seqlens:
        t = make_inputs(args, s, device, dtype, args.seed)
        if args.inputs == "structured":
            meta["structure"] = {"kv_heads": structure_kinds(args.kv_heads),
                                 "q_heads_per_kv_head": args.heads // args.kv_heads}
        meta.update(Hq=t["q"].shape[1], Hkv=t["k"].shape[1], D=t["q"].shape[2])
        mask = make_envelope(args.envelope, s)
        plans = {}
        bar.running(f"S={s} dense")
        try:
            dense = dense_case(mask, t, be, clock)
            bar.step(f"S={s:7d} dense  fwd {dense['fwd_ms']:.2f} ms bwd {dense['bwd_ms']:.2f} ms "
                     f"kernel {dense['tflops_fwd']:.0f} / {dense['tflops_bwd']:.0f} TFLOP/s")
        except Exception as e:  # noqa: BLE001  (record, go on with the next length)
            bar.note(f"S={s} dense: {type(e).__name__}: {e}")
            rows += [{"method": m, "S": s, "error": f"dense: {type(e).__name__}: {str(e)[:200]}",
                      "traceback": traceback.format_exc()[-3000:]} for m in args.methods]
            save(path, meta, rows)
            bar.step(n=1 + len(args.methods))
            continue
        for method in args.methods:
            bar.running(f"S={s} {method}")
            try:
                sel = make_selector(method, args, t["q"].shape[1], t["k"].shape[1])
                r = sparse_case(method, sel, mask, t, be, clock, dense, args, plans)
                line = (f"S={s:7d} {method:11s} kept {100 * r['kept_blocks']:5.1f}% fwd {r['fwd_ms']:.2f} ms "
                        f"(x{r['speedup_fwd']:.2f}) bwd {r['bwd_ms']:.2f} ms (x{r['speedup_bwd']:.2f}) "
                        f"TFLOP/s ratio {r['tflops_ratio_fwd']:.2f} / {r['tflops_ratio_bwd']:.2f} "
                        f"err {r['out_rel_err']:.2e} kernel {r['kernel_path']}")
            except Exception as e:  # noqa: BLE001  (record, keep going: e.g. out of memory)
                r = {"method": method, "S": s, "error": f"{type(e).__name__}: {str(e)[:200]}",
                     "traceback": traceback.format_exc()[-3000:]}
                line = f"S={s:7d} {method:11s} ERR {r['error']}"
                bar.note(line)
            rows.append(r)
            save(path, meta, rows)  # after every case: a run cut short keeps what it measured
            bar.step(line)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del t, dense, plans
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    if hasattr(be, "describe"):
        meta["backend"]["describe"] = be.describe()  # after the runs: the fallbacks it took
    save(path, meta, rows)
    print("wrote", path)
    plot(meta, rows, os.path.join(args.out, f"bench_sparse{args.tag}.png"))
    for p in args.png_done.values():
        print("wrote", p)
    print()
    print("\n".join(table(rows)))  # the summary: the last lines of stdout
    return rows


if __name__ == "__main__":
    main()
