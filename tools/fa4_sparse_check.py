"""GPU self-check of FA4Backend with a BlockKeep (per-head block-sparse FA4 calls, kernels/fa4/sparse.py).

For a causal list and packed documents (catalog ``docs_causal``) at --seqlen (default 4096), Hq 8, Hkv 2,
D 128, bf16, and a random per-head keep at ~30% density inside the list's blocks (keep.block 128 and 256):
forward (out, lse) and backward with an lse gradient (dq, dk, dv) against a dense reference of the tile
list AND the per-head block mask, computed per head in float64. Rule (as tools/gpu_kernel_check.py):
rms error <= 2 x the rms error of the same reference run in bf16, plus 1e-6 x rms(reference); no NaN; rows
that keep nothing give out 0 and lse -inf. The per-call list building runs under
``torch.cuda.set_sync_debug_mode("error")`` (a host synchronisation there raises). Prints one line per case
with the path FA4Backend took (``last_path``, forward / backward) and the errors; exit status 1 on a failure.

Usage: python tools/fa4_sparse_check.py [--seqlen 4096]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from megatron_cp.kernels import BlockKeep, FA4Backend
from megatron_cp.kernels.fa4 import sparse as fa4_sparse
from megatron_cp.masks import catalog


def reference(q, k, v, dout, dlse, cells, scale, dt):
    """Dense attention per query head in dtype ``dt`` under bool cells [Hq, sq, sk]: (out, lse, dq, dk, dv)
    as float64, the loss sum(out * dout) + sum(lse * dlse)."""
    sq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros(sq, hq, d, dtype=torch.float64, device=q.device)
    lse = torch.zeros(sq, hq, dtype=torch.float64, device=q.device)
    dq = torch.zeros_like(out)
    dk = torch.zeros(k.shape, dtype=torch.float64, device=q.device)
    dv = torch.zeros_like(dk)
    for h in range(hq):
        K, V = k[:, h // g].to(dt), v[:, h // g].to(dt)
        Q, dO = q[:, h].to(dt), dout[:, h].to(dt)
        S = ((Q @ K.T) * scale).masked_fill(~cells[h], float("-inf"))
        L = torch.logsumexp(S.float() if dt != torch.float64 else S, -1)
        P = torch.exp(S - torch.where(torch.isinf(L), 0.0, L).to(S.dtype)[:, None])
        O = P @ V
        delta = (dO * O).sum(-1).to(L.dtype) - torch.where(torch.isinf(L), 0.0, dlse[:, h].to(L.dtype))
        dS = P * ((dO @ V.T) - delta.to(dt)[:, None])
        out[:, h], lse[:, h] = O.double(), L.double()
        dq[:, h] = ((dS @ K) * scale).double()
        dk[:, h // g] += ((dS.T @ Q) * scale).double()
        dv[:, h // g] += (P.T @ dO).double()
    return out, lse, dq, dk, dv


def rms(x):
    return float(x.double().pow(2).mean().sqrt()) if x.numel() else 0.0


def random_keep(tiles, s, hq, block, density, gen):
    """A per-head keep at ~``density`` of the list's (block x block) pairs that hold a kept cell."""
    env = catalog.tiles_to_dense(tiles, s, s, device="cuda")
    nb = -(-s // block)
    pad = nb * block - s
    env_b = torch.nn.functional.pad(env, (0, pad, 0, pad)).view(nb, block, nb, block).any(3).any(1)
    m = (torch.rand(hq, nb, nb, device="cuda", generator=gen) < density) & env_b[None]
    m[0, nb // 2] = False  # a q block of head 0 with nothing selected
    return BlockKeep(m, block), env, env_b


def check(name, tiles, s, block, hq=8, hkv=2, d=128, dtype=torch.bfloat16, seed=0) -> bool:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(s, hq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(s, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(s, hkv, d, device="cuda", dtype=dtype, generator=gen)
    dout = torch.randn(s, hq, d, device="cuda", dtype=dtype, generator=gen)
    dlse = torch.randn(s, hq, device="cuda", dtype=torch.float32, generator=gen)
    keep, env, env_b = random_keep(tiles, s, hq, block, 0.3, gen)
    scale = 1.0 / math.sqrt(d)
    be = FA4Backend()
    prep = be.prepare(tiles, s, s, head_dims=(d,))
    static = prep.sparse()
    static.on(q.device)  # the static part's one host -> device copy; then the per-call lists must not sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for direction in ("fwd", "bwd"):
            fa4_sparse.head_lists(static, keep, direction)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out, lse = be.forward(q, k, v, prep, scale, keep=keep)
    fwd_path = be.last_path
    delta = (dout.float() * out.float()).sum(-1) - dlse
    dq, dk, dv = be.backward(q, k, v, out, lse, dout, prep, scale, delta, keep=keep)
    bwd_path = be.last_path
    torch.cuda.synchronize()
    cells = env[None] & keep.cells(torch.arange(s, device="cuda"), torch.arange(s, device="cuda"))
    ref = reference(q, k, v, dout, dlse, cells, scale, torch.float64)
    low = reference(q, k, v, dout, dlse, cells, scale, dtype)
    empty = ~cells.any(-1).t()
    ok = bool((out[empty] == 0).all()) and bool((lse[empty] == float("-inf")).all())
    nan = any(bool(torch.isnan(x).any()) for x in (out, lse, dq, dk, dv))
    ok = ok and not nan
    errs = []
    for i, (nm, o) in enumerate((("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv))):
        r, lo = ref[i], low[i]
        if nm == "lse":
            r, lo, o = r[~empty], lo[~empty], o[~empty]
        e, el = rms(o.double() - r), rms(lo - r)
        good = e <= 2 * el + 1e-6 * rms(r)
        ok = ok and good
        errs.append(f"{nm} {e:.2e}/{el:.2e}{'' if good else ' FAIL'} max {float((o.double() - r).abs().max()):.2e}")
    density = float(keep.mask.sum()) / max(1, float(env_b.sum()) * hq)  # of the list's blocks
    print(f"{'PASS' if ok else 'FAIL'} {name} S={s} block={block} keep density {density:.2f} empty (row, head) pairs "
          f"{int(empty.sum())} nan={nan} | fwd: {fwd_path} | bwd: {bwd_path} | rms err/bf16-ref err: "
          + "; ".join(errs), flush=True)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlen", type=int, default=4096)
    a = ap.parse_args(argv)
    s = a.seqlen
    ok = True
    for name in ("causal", "docs_causal"):
        tiles = catalog.tiles(catalog.build(name, s))
        for block in (128, 256):
            ok = check(name, tiles, s, block, seed=block) and ok
    be = FA4Backend()
    print("describe:", be.describe())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
