"""GPU correctness check of a tile-list attention backend (--backend triton, fa4 or auto: get_backend's choice).

Each case runs forward (out, lse) and backward (dq, dk, dv) against a dense fp64 reference. Rule (ANCHORS.md): rms
error <= 2 x that of a plain PyTorch reference in the same low precision, plus 1e-6 x rms(reference); no NaN; rows
that keep nothing give out 0 and lse -inf; two runs of the deterministic mode bitwise identical (for FA4 counted,
not failed). The default mode runs too (for Triton where it sends pieces to cuDNN). The parts (--parts):

    matrix      every catalog.KERNEL_MASKS mask (its tiles checked against its mask_mod) at each S, head_dim 64 /
                128, bf16 / fp16, GQA 1 / 4 / 8 (a diagonal of these at S >= 16384)
    bands       sliding windows as the planner emits them, with TritonConfig(band_squares=2048)
    rank_lists  each catalog.DIST_MASKS mask planned over CP 2 and 4 at the largest S: each rank's rows against its
                key buffer, as the distributed runtime calls the backend
    sparse      causal and docs_causal at S 4096 under a random per-head BlockKeep (blocks 128, 256) with an lse
                gradient; FA4's per-call block lists built with a host synchronisation an error
Always forward_accumulate (two stages == one), float32 inputs and (on a GPU) the runtime's row kernels against
torch; --big: S = 131072 (no NaN, peak memory < 4 x the inputs). Each case records the paths its runs took (``last_path``: [forward's, backward's]).

Usage: python tools/gpu_kernel_check.py [--backend auto|triton|fa4] [--seqlens 1024 4096 16384] [--big]
       [--parts matrix,bands,rank_lists,sparse] [--out DIR]
       python tools/gpu_kernel_check.py --dry-run   # CPU, Triton's interpreter: S 256, a case per part
Writes OUT/gpu_kernel_check<tag>.json; ends with a table: per mask and S, passed, worst error ratio, paths.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import time

if "--dry-run" in sys.argv:  # Triton's interpreter runs the kernels on the CPU: on before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import megatron_cp as mcp  # noqa: E402
from megatron_cp.kernels import (  # noqa: E402
    BACKEND_CHOICES, BlockKeep, FA4Backend, KernelConfig, PhaseConfigs, TritonBackend, TritonConfig, fa4_unavailable, get_backend,
)
from megatron_cp.kernels.fa4 import measured, sparse as fa4_sparse  # noqa: E402
from megatron_cp.masks import catalog  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Progress, device_name, markdown_table, out_dir, parser, run_record, write_json  # noqa: E402

ERR_KEYS = ("out", "lse", "dq", "dk", "dv")
PARTS = ("matrix", "bands", "rank_lists", "sparse")
ROUTES = ("measured", *measured.ROUTES)


def force_route(route: str) -> None:
    """FA4's lists run ``route`` wherever they have it (``measured``: as chosen, nothing changed): FA4's route choice
    (``measured.list_route``) answers that route instead of timing, for lists whose form allows it."""
    if route == "measured":
        return
    chosen = measured.list_route

    def forced(routes, phase, q, k, v, prepared, deterministic, candidates):
        calls = prepared.calls
        has = route == "triton" or (route == "blocks" and calls.blocks is not None) or (
            route == "varlen" and len(calls.fwd if phase == "fwd" else calls.bwd) <= measured.MAX_TIMED_VARLEN_CALLS)
        if has and not (deterministic and phase == "bwd" and route == "blocks"):
            return route, ("forced by --route" if route == "triton" else None)
        return chosen(routes, phase, q, k, v, prepared, deterministic, candidates)

    measured.list_route = forced
DEV = "cuda"


def make_backend(name, overrides, **config):
    """Backend ``name`` (auto: get_backend's choice) with TritonConfig(overrides, **config) (FA4's: its fallback's);
    fa4 where FA4 cannot run exits with the reason (rather than check a matrix of Triton fallbacks)."""
    cfg = TritonConfig(overrides, **config)
    if name == "auto":
        name = getattr(get_backend("auto", "cuda"), "name", "triton")
    if name == "triton":
        return TritonBackend(cfg)
    if name != "fa4":
        raise SystemExit(f"--backend auto picked {name!r}; this check runs triton or fa4")
    why = fa4_unavailable(torch.device("cuda"))
    if why is not None:
        raise SystemExit(f"--backend fa4: FA4 cannot run here: {why}")
    return FA4Backend(cfg)


def chunked_reference(q, k, v, dout, keep, dt, scale, chunk=2048, dlse=None):
    """Dense attention in dtype ``dt`` in row chunks under bool cells ``keep`` [sq, sk] (or per head [Hq, sq, sk]),
    loss sum(out * dout) + sum(lse * dlse): out [sq, Hq, D], lse [sq, Hq], dq, dk, dv as float64."""
    (sq, hq, d), (sk, hkv) = q.shape, k.shape[:2]
    acc = torch.float64 if dt == torch.float64 else torch.float32
    out, dq = (torch.zeros(sq, hq, d, dtype=torch.float64, device=q.device) for _ in range(2))
    lse = torch.zeros(sq, hq, dtype=torch.float64, device=q.device)
    dk, dv = (torch.zeros(sk, hkv, d, dtype=acc, device=q.device) for _ in range(2))
    for h in range(hq):
        hk = h // (hq // hkv)
        K, V = k[:, hk].to(dt), v[:, hk].to(dt)
        for r0 in range(0, sq, chunk):
            r1 = min(sq, r0 + chunk)
            Q, dO = q[r0:r1, h].to(dt), dout[r0:r1, h].to(dt)
            S = ((Q @ K.T) * scale).masked_fill(~(keep[h] if keep.dim() == 3 else keep)[r0:r1], float("-inf"))
            P = torch.softmax(S, -1).nan_to_num(0.0)
            O = P @ V
            delta = (dO * O).sum(-1)
            if dlse is not None:  # d lse / d S = P: the lse gradient enters as a shift of delta
                delta = delta - dlse[r0:r1, h].to(dt)
            dS = P * (dO @ V.T - delta[:, None])
            out[r0:r1, h], lse[r0:r1, h] = O.double(), torch.logsumexp(S, -1).double()
            dq[r0:r1, h] = ((dS @ K) * scale).double()
            dk[:, hk] += ((dS.T @ Q) * scale).to(acc)
            dv[:, hk] += (P.T @ dO).to(acc)
    return out, lse, dq, dk.double(), dv.double()


def rms(x):
    return float(x.double().pow(2).mean().sqrt()) if x.numel() else 0.0


def errors(named, ref, low, fin, rel=1e-6):
    """({name: {err, lowp_err, ratio}}, ok: the rule and no NaN) of ``named`` ({name: (tensor, reference index)},
    ``rel`` x rms(reference) the floor); lse (index 1) on the rows ``fin`` that keep a cell."""
    res, ok = {}, True
    for name, (x, i) in named.items():
        r, lo = ref[i], low[i]
        if i == 1:
            r, lo, x = r[fin], lo[fin], x[fin]
        e, el = rms(x.double() - r), rms(lo - r)
        res[name] = {"err": e, "lowp_err": el, "ratio": e / max(el, 1e-30)}
        ok = ok and e <= 2 * el + rel * rms(r) and not bool(torch.isnan(x).any())
    return res, ok


def random_keep(cells, hq, block, gen, density=0.3):
    """(BlockKeep of ~``density`` of the blocks holding ``cells`` [s, s] per head, its cells [Hq, s, s], density)."""
    s, nb = cells.shape[0], -(-cells.shape[0] // block)
    pad = nb * block - s
    env = torch.nn.functional.pad(cells, (0, pad, 0, pad)).view(nb, block, nb, block).any(3).any(1)
    m = (torch.rand(hq, nb, nb, device=DEV, generator=gen) < density) & env[None]
    m[0, nb // 2] = False
    sel, idx = BlockKeep(m, block), torch.arange(s, device=DEV)
    return sel, cells[None] & sel.cells(idx, idx), float(m.sum()) / max(1.0, float(env.sum()) * hq)


def lists_sync_free(static, sel):
    """Whether FA4's per-call block lists of ``sel`` (``static``: the list's part) build with no host sync."""
    static.on(sel.mask.device)  # the static part's one host -> device copy
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for direction in ("fwd", "bwd"):
            fa4_sparse.head_lists(static, sel, direction)
        return True
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_case(be, be_det, name, tiles, keep, sq, sk, heads, seed, block=None):
    """Every run of a list of ``sq`` rows against ``sk`` keys (cells ``keep``) with ``heads`` (D, dtype, Hq / Hkv,
    Hkv) against the references; ``block``: under a random per-head BlockKeep of that block, with an lse gradient."""
    d, dtype, g, hkv = heads
    hq, scale, gen = hkv * g, 1.0 / math.sqrt(d), torch.Generator(device=DEV).manual_seed(seed)
    q, k, v, dout = (torch.randn(n, h, d, device=DEV, dtype=dtype, generator=gen)
                     for n, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
    res = {"mask": name, "S": sq, "Sk": sk, "D": d, "dtype": str(dtype).split(".")[-1], "G": g, "Hq": hq, "Hkv": hkv}
    sel = dlse = None
    if block:
        sel, keep, res["keep_density"] = random_keep(keep, hq, block, gen)
        dlse = torch.randn(sq, hq, device=DEV, generator=gen)

    def run(b, prep):  # (out, lse, dq, dk, dv), [forward's path, backward's]
        out, lse = b.forward(q, k, v, prep, scale, keep=sel)
        fwd_path = b.last_path
        delta = None if dlse is None else (dout.float() * out.float()).sum(-1) - dlse
        return (out, lse, *b.backward(q, k, v, out, lse, dout, prep, scale, delta, keep=sel)), [fwd_path, b.last_path]

    # deterministic mode: run twice, bitwise identical (must be for Triton; reported for other backends)
    triton = type(be_det) is TritonBackend
    prep = be_det.prepare(tiles, sq, sk, head_dims=(d,))
    first, paths = run(be_det, prep)
    second = run(be_det, prep)[0]
    det = all(torch.equal(a, b) for a, b in zip(first, second))
    key = "triton" if triton else f"{be_det.name}_det"  # the runs' keys, result fields too
    runs, last_path = {key: first}, {key: paths}
    if not triton:  # a second call of a prepared list replays FA4's recorded launches (kernels.fa4.replay:
        # forward and backward)
        runs[key + "_again"], last_path[key + "_again"] = second, paths
    prep_f = be.prepare(tiles, sq, sk, head_dims=(d,))
    if sel is not None and hasattr(prep_f, "sparse"):  # a layer call must not wait on the GPU
        res["lists_sync_free"] = lists_sync_free(prep_f.sparse(), sel)
    # Triton: the default mode differs only where it sends pieces to cuDNN; other backends: always run it
    if not triton or prep_f.cudnn_fwd is not None or prep_f.cudnn_bwd is not None:
        got, paths = run(be, prep_f)
        key = f"fast_{paths[0]}_{paths[1]}" if triton else f"{be.name}_default"
        runs[key], last_path[key] = got, paths
        if not triton:  # and replayed in the default (non-deterministic) mode
            runs[key + "_again"], last_path[key + "_again"] = run(be, prep_f)
    ref, low = (chunked_reference(q, k, v, dout, keep, dt, scale, dlse=dlse) for dt in (torch.float64, dtype))
    empty = ~keep.any(-1) if keep.dim() == 2 else ~keep.any(-1).t()  # [sq] or per head [sq, Hq]
    res.update(deterministic=det, empty_rows=int(empty.sum()), paths=list(runs), last_path=last_path)
    ok = (det or not triton) and res.get("lists_sync_free") is not False
    for path, outs in runs.items():
        nan = any(bool(torch.isnan(x).any()) for x in outs)
        empty_ok = bool((outs[1][empty] == float("-inf")).all()) and bool((outs[0][empty] == 0).all())
        errs, good = errors({n: (x, i) for i, (n, x) in enumerate(zip(ERR_KEYS, outs))}, ref, low, ~empty)
        res[path] = {"nan": nan, "empty_ok": empty_ok, **errs}
        ok = ok and not nan and empty_ok and good
    return {**res, "nan": any(res[p]["nan"] for p in runs), "pass": ok}


def rank_list_cases(s, cps=(2, 4)):
    """(name, rows, keys, tiles) of each rank's list (its rows against its key buffer) of each DIST_MASKS plan."""
    return [(f"{name}_cp{cp}_rank{rp.rank}", rp.num_tokens, rp.buffer_len, torch.as_tensor(rp.tiles, dtype=torch.int32))
            for name in catalog.DIST_MASKS for cp in cps for rp in mcp.plan(catalog.build(name, s), cp).ranks
            if len(rp.tiles)]


def summary_table(results, big):
    """The closing table (lines): per (mask, S) passed, deterministic, worst error ratio, paths; then ``big``."""
    rows = []
    for mask, s in dict.fromkeys((r["mask"], r["S"]) for r in results):
        rs = [r for r in results if r["mask"] == mask and r["S"] == s]
        rows.append([mask, s, f"{sum(r['pass'] for r in rs)}/{len(rs)}",
                     f"{sum(r['deterministic'] for r in rs)}/{len(rs)}",
                     f"{max(r[p][n]['ratio'] for r in rs for p in r['paths'] for n in ERR_KEYS):.3f}",
                     ", ".join(sorted({"/".join(map(str, p)) for r in rs for p in r["last_path"].values()}))])
    for r in big:  # extra_checks (errors against the fp64 reference), big_runs (no NaN, peak memory)
        worst = max((r[n]["err"] / max(r[n]["lowp_err"], 1e-30) for n in r if isinstance(r[n], dict)), default=None)
        rows.append([r.get("check") or f"big {r['mask']} (peak {r['peak_GiB']:.1f} GiB)", r.get("S", 2048),
                     f"{int(r['pass'])}/1", "-", "-" if worst is None else f"{worst:.3f}", r["last_path"]])
    return markdown_table(["mask / check", "S", "passed", "deterministic", "worst err/lowp_err", "paths"], rows)


def extra_checks(be, s, d, hq, hkv, low_dtype):
    """docs_causal's forward_accumulate (odd, even tiles as two stages == one forward) and float32 inputs (floor
    1e-5 x rms(reference): its plain reference is near exact)."""
    out, tiles = [], catalog.tiles(catalog.build("docs_causal", s))
    keep = catalog.tiles_to_dense(tiles, s, s, device=DEV)
    for dt in (low_dtype, torch.float32):
        g = torch.Generator(device=DEV).manual_seed(7)
        q, k, v, dout = (torch.randn(s, h, d, device=DEV, dtype=dt, generator=g) for h in (hq, hkv, hkv, hq))
        ref, low = (chunked_reference(q, k, v, dout, keep, t, d ** -0.5) for t in (torch.float64, dt))
        o, lse = torch.zeros(q.shape, device=DEV), torch.full((s, hq), float("-inf"), device=DEV)
        for part in (tiles[0::2], tiles[1::2]):
            be.forward_accumulate(q, k, v, be.prepare(part, s, s, head_dims=(d,)), d ** -0.5, o, lse)
        prep = be.prepare(tiles, s, s, head_dims=(d,))
        o1, l1 = be.forward(q, k, v, prep, d ** -0.5)
        grads = be.backward(q, k, v, o1, l1, dout, prep, d ** -0.5)
        named = {"acc_out": (o, 0), "acc_lse": (lse, 1), "out": (o1, 0), "lse": (l1, 1),
                 **{n: (x, i) for i, (n, x) in enumerate(zip(ERR_KEYS[2:], grads), 2)}}
        errs, ok = errors(named, ref, low, keep.any(-1), 1e-5 if dt == torch.float32 else 1e-6)
        out.append({"check": f"accumulate+{str(dt).split('.')[-1]}", "S": s, "last_path": be.last_path, **errs,
                    "pass": ok})
    return out


def row_kernel_checks(calls=4):
    """The runtime's row moves (one pair, two pairs in one launch), sums (one pair and two) and merges (kernels/rows.py,
    merge.py: a running pair's, the guest rows' sources') against torch,
    ``calls`` calls per case on tensors at aligned and unaligned offsets: exact for moves and sums, 1e-5 (relative
    and absolute: lse near 0) for the merge."""
    from megatron_cp.kernels import copy_row_pair_moves, copy_row_pairs, copy_rows, reduce_row_pairs, reduce_rows
    from megatron_cp.kernels.merge import merge_into, merge_sources
    out, g = [], torch.Generator(device=DEV).manual_seed(3)
    for dt, off, n in itertools.product((torch.bfloat16, torch.float32), (0, 1, 8), (1, 37, 4096)):
        ok, what = True, f"{str(dt).split('.')[-1]} offset {off} rows {n}"
        for i in range(calls):
            src = torch.randn(n + 64 + off, 8, 128, device=DEV, generator=g).to(dt)[off:]
            src2 = torch.randn(n + 64, 8, 64, device=DEV, generator=g).to(dt)
            si = torch.randperm(n + 64, device=DEV, generator=g)[:n]
            di = torch.randperm(n + 64, device=DEV, generator=g)[:n]
            dst, dst2 = torch.zeros_like(src), torch.zeros_like(src2)
            copy_rows(dst, src, di, si)
            copy_row_pairs(dst, src, dst2, src2, None, si)
            want, want2 = torch.zeros_like(src), torch.zeros_like(src2)
            want.index_copy_(0, di, src[si])
            want[:n], want2[:n] = src[si], src2[si]
            ok &= bool(torch.equal(dst, want)) and bool(torch.equal(dst2, want2))
            # a gather into the column halves of one send buffer (a layer call's K / V send gather)
            buf = torch.zeros(n, 8 * 128 + 8 * 64, device=DEV, dtype=dt)
            sa, sb = buf[:, :1024].unflatten(1, (8, 128)), buf[:, 1024:].unflatten(1, (8, 64))
            copy_row_pairs(sa, src, sb, src2, None, si)
            ok &= bool(torch.equal(sa, src[si])) and bool(torch.equal(sb, src2[si]))
            # two pair moves in one launch (a scatter and a gather of other lengths) == one launch each
            g1, g2, h1, h2 = (torch.zeros_like(x) for x in (src, src2, src, src2))
            copy_row_pair_moves([(g1, src, g2, src2, di, None), (h1[:n // 2], src, h2[:n // 2], src2, None,
                                                                  si[:n // 2])])
            w1, w2, x1, x2 = (torch.zeros_like(x) for x in (src, src2, src, src2))
            copy_row_pairs(w1, src, w2, src2, di, None)
            copy_row_pairs(x1[:n // 2], src, x2[:n // 2], src2, None, si[:n // 2])
            ok &= all(bool(torch.equal(a, b)) for a, b in ((g1, w1), (g2, w2), (h1, x1), (h2, x2)))
            rows = torch.arange(0, n, 2, device=DEV)
            ptr = torch.arange(0, 2 * len(rows) + 1, 2, device=DEV)
            pos = torch.randint(0, n + 64, (2 * len(rows),), device=DEV, generator=g)
            red, parts = src.clone(), src2[:, :, :64].repeat(1, 1, 2).contiguous()
            reduce_rows(red, parts, rows, ptr, pos)
            ref = src.float().clone()
            ref[rows] = (ref[rows] + parts.float()[pos[0::2]]) + parts.float()[pos[1::2]]  # the kernel's order
            ok &= bool(torch.equal(red, ref.to(dt)))
            # dK and dV in one launch (widths of their own) == one launch each
            pb, red_a, red_b = parts[:, :, :64].contiguous(), src.clone(), src[:, :, :64].clone()
            want_b = red_b.clone()
            reduce_rows(want_b, pb, rows, ptr, pos)
            reduce_row_pairs(red_a, parts, red_b, pb, rows, ptr, pos)
            ok &= bool(torch.equal(red_a, red)) and bool(torch.equal(red_b, want_b))
            acc = torch.randn(n, 8, 128, device=DEV, generator=g)
            lse, o, lo = torch.randn(n, 8, device=DEV, generator=g), src[:n], torch.randn(n, 8, device=DEV, generator=g)
            m = torch.maximum(lse, lo)
            want_l = m + torch.log(torch.exp(lse - m) + torch.exp(lo - m))
            want_a = acc * torch.exp(lse - want_l)[..., None] + o.float() * torch.exp(lo - want_l)[..., None]
            merge_into(acc, lse, o, lo)
            ok &= all(bool(torch.allclose(x, y, rtol=1e-5, atol=1e-5)) for x, y in ((acc, want_a), (lse, want_l)))
            # guest rows: 3 sources' partials merged into rows of out (dt) and a head-major lse, one launch == torch
            gp = torch.randn(3, min(n, 64), 8, 129, device=DEV, generator=g)
            gp[1, ::3, :, 128] = float("-inf")
            gp[1, ::3, :, :128] = 0
            gr = torch.randperm(n + 64, device=DEV, generator=g)[:gp.shape[1]]
            res = []
            for use in (True, False):
                go, gl = torch.zeros(n + 64, 8, 128, device=DEV, dtype=dt), torch.zeros(8, n + 64, device=DEV).t()
                merge_sources(go, gl, gr, gp, use_triton=use)
                res.append((go.float(), gl))
            ok &= bool(torch.allclose(res[0][1], res[1][1], rtol=1e-5, atol=1e-5)) and bool(
                torch.allclose(res[0][0], res[1][0], rtol=1e-2 if dt == torch.bfloat16 else 1e-5, atol=1e-5))
        out.append({"check": f"rows {what}", "S": n, "last_path": "triton rows", "pass": ok})
    return out + upload_checks()


def upload_checks(rounds=40):
    """kernels.upload / upload_all while the GPU is busy: each round queues a long kernel, then uploads arrays of
    sizes that vary round to round (pinned blocks reused once their copy has run) and overwrites the host arrays at
    once (the copy must have taken them when the call returned); every upload equal to its array after one sync."""
    import numpy as np  # noqa: PLC0415
    from megatron_cp.kernels import upload_all  # noqa: PLC0415
    from megatron_cp.kernels.upload import upload  # noqa: PLC0415

    rng, want, got = np.random.default_rng(0), [], []
    for _ in range(rounds):
        torch.cuda._sleep(200_000)  # ~0.1 ms of a busy queue ahead of the copies
        arrays = [rng.integers(-2**40, 2**40, int(rng.integers(0, 40_000))) for _ in range(3)] + [
            rng.integers(0, 2**31 - 1, (int(rng.integers(1, 90)), 3)).astype(np.int32), None]
        got.append(upload_all(arrays, "cuda") + [upload(arrays[0], "cuda")])
        want.append([None if a is None else a.copy() for a in arrays] + [arrays[0].copy()])
        for a in arrays:
            if a is not None:
                a[...] = -1
    torch.cuda.synchronize()
    ok = all((w is None and g is None) or (g is not None and g.shape == w.shape and np.array_equal(g.cpu().numpy(), w))
             for gs, ws in zip(got, want) for g, w in zip(gs, ws))
    return [{"check": "uploads under a busy queue", "S": rounds, "last_path": "pinned staging", "pass": ok}]


def big_runs(be, s=131072, hq=32, hkv=8, d=128):
    """bf16 at S = 131072: no NaN, peak memory under 4 x the inputs (no S^2 buffers)."""
    out = []
    for mask in ["causal", "docs_causal", "sliding_window_1024", "strided_512x4"]:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        q, k, v, dout = (torch.randn(s, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq))
        inputs = sum(x.numel() * x.element_size() for x in (q, k, v, dout))
        prep = be.prepare(catalog.tiles(catalog.build(mask, s)), s, s, head_dims=(d,))
        o, lse = be.forward(q, k, v, prep)
        nan = any(bool(torch.isnan(x).any()) for x in (o, lse, *be.backward(q, k, v, o, lse, dout, prep)))
        peak = torch.cuda.max_memory_allocated()
        out.append({"mask": mask, "S": s, "last_path": be.last_path, "nan": nan, "peak_GiB": peak / 2**30,
                    "inputs_GiB": inputs / 2**30, "S2_bf16_GiB_per_head": s * s * 2 / 2**30,
                    "pass": (not nan) and peak < 4 * inputs})
        del q, k, v, dout, o, lse
    return out


def main():
    global DEV
    ap = parser(__doc__, "out/kernel_check")
    ap.add_argument("--seqlens", type=int, nargs="+", default=None, help="default 1024 4096 16384 (a dry run: 256)")
    ap.add_argument("--big", action="store_true", help="add the S = 131072 runs")
    # the GPU backends (the float64 reference is what they are checked against)
    ap.add_argument("--backend", choices=[b for b in BACKEND_CHOICES if b != "reference"], default="auto",
                    help="auto: FA4 where it runs")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ", ".join(PARTS))
    ap.add_argument("--masks", nargs="+", default=None, help="the matrix part's catalog masks (default: "
                    "catalog.KERNEL_MASKS); given, the matrix runs the recipes' heads only (bf16, D 128, Hq / Hkv 4)")
    ap.add_argument("--route", choices=ROUTES, default="measured", help="FA4's lists: the route timed fastest "
                    "(default), or each list forced onto one route where it has that form (a route the timer does "
                    "not choose on this device is checked too)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    if set(parts) - set(PARTS):
        ap.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}")
    kernel_masks = tuple(args.masks or catalog.KERNEL_MASKS)
    if set(kernel_masks) - set(catalog.NAMES):
        ap.error(f"--masks: unknown {sorted(set(kernel_masks) - set(catalog.NAMES))}")
    force_route(args.route)
    overrides = {}  # the dry run's blocks
    seqlens = args.seqlens or [1024, 4096, 16384]
    # (D, dtype, Hq / Hkv, Hkv) per part, rec: the recipes' heads; at S >= 16384 a diagonal of the matrix
    bf, fp, rec = torch.bfloat16, torch.float16, (128, torch.bfloat16, 4, 2)
    heads = {"matrix": [(d, dt, g, 2) for d, dt, g in itertools.product([64, 128], [bf, fp], [1, 4, 8])],
             "matrix_16k": [rec, (64, fp, 8, 1), (128, fp, 1, 2)], "sparse": [rec],
             "rank_lists": [rec, (64, fp, 8, 1)], "bands": [rec, (128, fp, 8, 1), (64, bf, 1, 2)]}
    # bands (S, window): whole chunks, chunks and tail rows, a window wider than the band's rows
    extra, s_sparse, blocks, bands = (2048, 128, 8, 2, bf), 4096, (128, 256), ((8192, 2048), (8892, 2048), (6144, 4096))
    if args.masks:
        heads["matrix"] = heads["matrix_16k"] = [rec]
    if args.dry_run:  # fp16: the interpreter computes bf16 tl.dot wrongly; 64 x 64 blocks: fewest interpreted steps
        DEV, seqlens, overrides = "cpu", args.seqlens or [256], {32: PhaseConfigs(*[KernelConfig(64, 64, 4, 1)] * 3)}
        heads = dict.fromkeys(heads, [(32, fp, 2, 1)])
        extra, s_sparse, blocks, bands = (256, 32, 2, 1, fp), 256, (64,), ((256, 64),)
    be, be_det = make_backend(args.backend, overrides), make_backend(args.backend, overrides, deterministic=True)
    be_band = make_backend(args.backend, overrides, band_squares=2048)  # these windows are 2048 and 4096
    print(f"backend: {be.name} ({type(be).__name__})", flush=True)
    # per part: (name, rows, keys, tiles, backend, heads, the mask_mod the tiles must match, keep block)
    cases = {"matrix": [(m, s, s, catalog.tiles(catalog.build(m, s)), be, heads["matrix" + "_16k" * (s >= 16384)], m,
                         None) for s in seqlens for m in kernel_masks],
             "bands": [(f"band_w{w}_s{s}", s, s, torch.tensor([[0, w, 0, w, 1], [w, s, 0, s, 3]], dtype=torch.int32),
                        be_band, heads["bands"], None, None) for s, w in bands],  # a causal head, one BI_CAUSAL band
             "rank_lists": [(*c, be, heads["rank_lists"], None, None) for c in rank_list_cases(max(seqlens))],
             "sparse": [(f"{m}_keep{b}", s_sparse, s_sparse, catalog.tiles(catalog.build(m, s_sparse)), be,
                         heads["sparse"], None, b) for m in ("causal", "docs_causal") for b in blocks]}
    cases = [c for p in parts for c in (cases[p][:1] if args.dry_run else cases[p])]
    results, t0 = [], time.time()
    with Progress(sum(len(c[5]) for c in cases), "gpu_kernel_check", verbose=args.verbose) as bar:
        for name, sq, sk, tiles, backend, hs, mask_mod, block in cases:
            keep = catalog.tiles_to_dense(tiles, sq, sk, device=DEV)
            same = mask_mod is None or bool((keep == catalog.dense(mask_mod, sq, device=DEV)).all())
            if not same:
                bar.note(f"FAIL tile list of {name} at S={sq} differs from its mask_mod")
            for i, (d, dt, g, hkv) in enumerate(hs):
                bar.running(f"{name} {sq}x{sk} D={d} {str(dt).split('.')[-1]} G={g}")
                r = check_case(backend, be_det, name, tiles, keep, sq, sk, (d, dt, g, hkv), sq * 1000 + sk + i, block)
                if mask_mod is not None:
                    r["tiles_match_mask_mod"], r["pass"] = same, r["pass"] and same
                results.append(r)
                line = (f"{'ok  ' if r['pass'] else 'FAIL'} {name:22s} {sq}x{sk} D={d:3d} {r['dtype']:8s} G={g} "
                        f"det={r['deterministic']} nan={r['nan']} | worst err/lowp_err " + ", ".join(
                            f"{p} {max(r[p][n]['ratio'] for n in ERR_KEYS):.3f}" for p in r["paths"]))
                if not r["pass"]:
                    bar.note(line)
                bar.step(line if r["pass"] else None)
            del keep
            torch.cuda.empty_cache()
        bar.running("accumulate, float32" + (", S=131072 runs" if args.big else ""))
        big = extra_checks(be_det, *extra) + (row_kernel_checks() if DEV == "cuda" else [])
        roles = {"default": be, "deterministic": be_det, "band_squares_2048": be_band}
        if args.big:
            roles["big"] = make_backend(args.backend, overrides, dense_fast_path=False)
            big += big_runs(roles["big"])
    n, n_fail = len(results + big), sum(not r["pass"] for r in results + big)
    n_det = sum(r["deterministic"] for r in results)  # not bitwise reproducible: a failure for Triton, counted for FA4
    describe = {"describe": {k: b.describe() for k, b in roles.items()}} if hasattr(be, "describe") else {}
    # what the cuDNN probe found per (device, dtype, head_dim, Hq / Hkv) family: a layout or why not
    cudnn = {str(tuple(map(str, key))): f.layout or f.reason for b in (be, be_band)
             for key, f in getattr(b, "cudnn_probes", {}).items()}
    summary = run_record(device_name(DEV), triton=__import__("triton").__version__, cudnn=cudnn, cases=n,
                         failed=n_fail, seconds=time.time() - t0, backend={"name": be.name, **describe})
    tail = ""
    if type(be_det) is not TritonBackend:
        summary["not_bitwise_reproducible"] = len(results) - n_det
        tail = f" ({be.name}; deterministic mode bitwise reproducible in {n_det}/{len(results)} cases)"
    path = os.path.join(out_dir(args), f"gpu_kernel_check{args.tag}.json")
    write_json(path, {"summary": summary, "results": results, "big": big})
    print("wrote", path)
    print(f"gpu_kernel_check: {n - n_fail}/{n} passed{tail}")
    print("\n".join(summary_table(results, big)))
    sys.exit(1 if n_fail else 0)


if __name__ == "__main__":
    main()
