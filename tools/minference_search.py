"""Offline MInference pattern search: per layer and query head, the pattern (a_shape, vertical_slash,
block_sparse) whose selected blocks recover the most attention mass under one block budget; writes the
config JSON that ``megatron_cp.sparse.minference.MInference.from_json`` loads.

    python tools/minference_search.py --input qk.pt --out minference.json [--block 128 --budget 0.3]
    python tools/minference_search.py --synthetic --seqlen 512 --block 32 --out minference.json

``--input``: a ``torch.save`` of ``{"layers": [{"q": [S, Hq, D], "k": [S, Hkv, D]}, ...]}`` (or the list
itself), causal attention. ``--synthetic``: one layer with planted heads, in order: sink + local window,
vertical lines (a few key tokens every query attends to), a diagonal (fixed offset), block-local
clusters (blocks of one random cluster attend to each other).

Method (after MInference's offline search, Jiang et al. 2024, which scores each pattern's recall of the
dense attention): the dense causal attention of the last ``--sample`` queries (to stay cheap) is the
reference; each candidate (a grid of sizes per kind) is selected by the real selector at block
granularity; candidates keeping more than ``--budget`` of the causal block pairs (per head) are
discarded; recall = mean over the sampled rows of the attention mass inside the kept blocks. The best
recall wins; within ``--tol`` of it the order a_shape, block_sparse, vertical_slash is preferred (no or
cheaper estimation), then fewer blocks. Sizes are written with ``ref_len`` = the searched length, so
the runtime scales them proportionally at other lengths. Prints one table: layer, head, pattern,
recall, blocks.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_cp import masks  # noqa: E402
from megatron_cp.sparse.minference import HeadPattern, MInference  # noqa: E402
from megatron_cp.sparse.view import single_view  # noqa: E402

PLANTED = ("sink_local", "vertical", "diagonal", "block_local")
PREFER = {"a_shape": 0, "block_sparse": 1, "vertical_slash": 2}


def _ar(s: int, d: int, rho: float, g: torch.Generator) -> torch.Tensor:
    """[s, d] stationary AR(1) process, unit variance: x_i . x_j ~ d * rho^|i - j| (locality)."""
    eps = torch.randn(s, d, generator=g)
    x = torch.empty(s, d)
    x[0] = eps[0]
    c = math.sqrt(1 - rho * rho)
    for i in range(1, s):
        x[i] = rho * x[i - 1] + c * eps[i]
    return x


def synthetic(seqlen: int = 512, head_dim: int = 64, block: int = 32, seed: int = 0):
    """(q, k) float32 [S, 4, D] with the ``PLANTED`` heads in order (Hkv = Hq = 4); D >= 48."""
    s, d = seqlen, head_dim
    if d < 48:
        raise ValueError(f"--dim must be >= 48 for the synthetic heads, got {d}")
    g = torch.Generator().manual_seed(seed)
    q = torch.zeros(s, 4, d)
    k = torch.zeros(s, 4, d)
    u = 40  # a dimension outside the positional features (0:32)
    nb = s // block
    # sink + local: AR features give a local window; the first 4 keys share a direction every query has
    x = _ar(s, 32, 0.9, g)
    q[:, 0, :32], k[:, 0, :32] = 2 * x, x
    q[:, 0, u], k[:4, 0, u] = 4.0, 20.0
    # vertical lines: a few key tokens after the first block; block-constant offsets so that pooled
    # block scores do not find them
    cols = torch.randperm(s - 2 * block, generator=g)[:3] + block
    q[:, 1, u], k[cols, 1, u] = 4.0, 20.0
    off_q = torch.randn(nb, 32, generator=g).repeat_interleave(block, 0)
    off_k = torch.randn(nb, 32, generator=g).repeat_interleave(block, 0)
    q[:, 1, :32], k[:, 1, :32] = off_q, off_k
    # diagonal: query i matches key i - off
    off = 3 * block + 5
    x = _ar(s + off, 32, 0.7, g)
    q[:, 2, :32], k[:, 2, :32] = 3 * x[:s], x[off:]
    # block-local clusters
    cl = torch.randint(0, 4, (nb,), generator=g).repeat_interleave(block)
    e = torch.nn.functional.one_hot(cl, 4).float()
    q[:, 3, 48:52], k[:, 3, 48:52] = 6 * e, 6 * e
    q[:, 3, :32] += 0.3 * torch.randn(s, 32, generator=g)
    k[:, 3, :32] += 0.3 * torch.randn(s, 32, generator=g)
    return q, k


def candidates(s: int, block: int) -> list[HeadPattern]:
    nb = s // block
    out = []
    for sink in (0, block, 2 * block):
        for w in range(1, nb + 1):
            out.append(HeadPattern("a_shape", sink=sink, local=w * block))
    sizes = [0] + [2 ** e for e in range(1, 14) if 2 ** e <= s]
    for v in sizes:
        for sl in sizes:
            out.append(HeadPattern("vertical_slash", vertical=v, slash=sl, ref_len=s))
    for t in range(1, nb + 1):
        out.append(HeadPattern("block_sparse", top_k=t, ref_len=s))
    return out


def dense_rows(q: torch.Tensor, k: torch.Tensor, rows: int) -> torch.Tensor:
    """float64 [Hq, R, S]: causal softmax of the last ``rows`` queries (GQA grouping h // G)."""
    s, hq, d = q.shape
    g = hq // k.shape[1]
    kk = k.double().repeat_interleave(g, 1)
    qq = q[s - rows:].double()
    sc = torch.einsum("rhd,jhd->hrj", qq, kk) / math.sqrt(d)
    i = torch.arange(s - rows, s)[:, None]
    sc = sc.masked_fill(torch.arange(s)[None, :] > i, float("-inf"))
    return torch.softmax(sc, -1)


def search_layer(q: torch.Tensor, k: torch.Tensor, block: int, budget: float, sample: int, tol: float):
    """Per head: (HeadPattern, recall, blocks) for one layer's q [S, Hq, D], k [S, Hkv, D]."""
    s, hq, d = q.shape
    mi = MInference([HeadPattern("vertical_slash"), HeadPattern("block_sparse")] * ((hq + 1) // 2),
                    block=block)
    mi = MInference(mi.patterns[:hq], block=block)
    mi.check(hq, k.shape[1], d, s)
    view = single_view(masks.causal(s), block)
    sm = mi.summaries(q, k, view)
    rows = min(sample, s)
    p = dense_rows(q, k, rows)  # [Hq, R, S]
    rb = (torch.arange(s - rows, s) // block)
    env = (view.envelope > 0).sum().item()
    limit = budget * env
    best = [None] * hq
    for c in candidates(s, block):
        sel = MInference([c] * hq, block=block)
        keep = sel.select_from(q, sm, view)  # [Hq, nb, nb]
        blocks = keep.sum((1, 2)).tolist()
        cellkeep = keep[:, rb].repeat_interleave(block, -1).double()  # [Hq, R, S]
        recall = (p * cellkeep).sum(-1).mean(-1).tolist()
        for h in range(hq):
            if blocks[h] > limit:
                continue
            best[h] = best[h] or []
            best[h].append((recall[h], c, blocks[h]))
    out = []
    for h in range(hq):
        if not best[h]:
            raise SystemExit(f"head {h}: no candidate fits --budget {budget}; raise it")
        top = max(r for r, _, _ in best[h])
        near = [t for t in best[h] if t[0] >= top - tol]
        r, c, nblk = min(near, key=lambda t: (PREFER[t[1].kind], t[2], -t[0]))
        out.append((c, r, nblk))
    return out


def describe(c: HeadPattern) -> str:
    if c.kind == "a_shape":
        return f"a_shape(sink={c.sink}, local={c.local})"
    if c.kind == "vertical_slash":
        return f"vertical_slash(vertical={c.vertical}, slash={c.slash})"
    return f"block_sparse(top_k={c.top_k})"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help=".pt file with per-layer q [S, Hq, D], k [S, Hkv, D]")
    src.add_argument("--synthetic", action="store_true", help="planted heads: " + ", ".join(PLANTED))
    ap.add_argument("--out", required=True, help="config JSON to write")
    ap.add_argument("--block", type=int, default=128, help="selector block (tokens)")
    ap.add_argument("--budget", type=float, default=0.4, help="max fraction of causal block pairs per head")
    ap.add_argument("--sample", type=int, default=256, help="last queries for the dense reference")
    ap.add_argument("--tol", type=float, default=0.01, help="recall tolerance for preferring simpler kinds")
    ap.add_argument("--seqlen", type=int, default=512, help="synthetic sequence length")
    ap.add_argument("--dim", type=int, default=64, help="synthetic head dim")
    ap.add_argument("--seed", type=int, default=0, help="synthetic seed")
    a = ap.parse_args(argv)
    if not 0 < a.budget <= 1:
        raise SystemExit(f"--budget must be in (0, 1], got {a.budget}")
    if a.synthetic:
        layers = [synthetic(a.seqlen, a.dim, a.block, a.seed)]
    else:
        obj = torch.load(a.input, map_location="cpu")
        obj = obj["layers"] if isinstance(obj, dict) else obj
        layers = [(x["q"], x["k"]) for x in obj]
    cfg = {"layers": []}
    print(f"{'layer':>5} {'head':>4}  {'pattern':<44} {'recall':>7} {'blocks':>6}")
    for li, (q, k) in enumerate(layers):
        res = search_layer(q.float(), k.float(), a.block, a.budget, a.sample, a.tol)
        cfg["layers"].append([c.to_dict() for c, _, _ in res])
        for h, (c, r, nblk) in enumerate(res):
            name = describe(c) + (f" [{PLANTED[h]}]" if a.synthetic else "")
            print(f"{li:>5} {h:>4}  {name:<44} {r:>7.4f} {nblk:>6}")
    Path(a.out).write_text(json.dumps(cfg, indent=1))
    return cfg


if __name__ == "__main__":
    main()
