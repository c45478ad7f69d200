"""Offline MInference pattern search (after Jiang et al. 2024): per layer and query head, among the patterns
(a_shape, vertical_slash, block_sparse; a grid of sizes per kind, selected by the real selector) that keep at most
--budget of the causal block pairs, the one keeping the most dense causal attention mass of the last SAMPLE
queries; within TOL of the best, PREFER's order (cheaper estimation), then fewer blocks. Sizes have ref_len = the
searched length (the runtime scales them). --input: a torch.save of {"layers": [{"q": [S, Hq, D], "k": [S, Hkv,
D]}, ...]} (or the list); --dry-run: one layer of PLANTED (synthetic) heads, S 512, D 64, block 32. Writes
OUT/minference.json (MInference.from_json reads it: bench_sparse --minference-config, --cp-minference-config).

    python tools/minference_search.py --input qk.pt --out DIR [--block 128 --budget 0.3]
    python tools/minference_search.py --dry-run --budget 0.6
"""

from __future__ import annotations

import math
import os
import sys

import torch

from megatron_cp import masks
from megatron_cp.sparse import HeadPattern, MInference, single_view

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/: common
from common import Progress, markdown_table, out_dir, parser, run_record, write_json  # noqa: E402

PLANTED = ("sink_local", "vertical", "diagonal", "block_local")
PREFER = {"a_shape": 0, "block_sparse": 1, "vertical_slash": 2}
SAMPLE, TOL = 256, 0.01  # reference rows (the last queries: cheap); recall within TOL prefers the simpler kind


def _ar(s: int, d: int, rho: float, g: torch.Generator) -> torch.Tensor:
    """[s, d] stationary AR(1) process, unit variance: x_i . x_j ~ d * rho^|i - j| (locality)."""
    x = torch.randn(s, d, generator=g)  # row i: noise until step i turns it into the process's value
    for i in range(1, s):
        x[i] = rho * x[i - 1] + math.sqrt(1 - rho * rho) * x[i]
    return x


def synthetic(seqlen: int = 512, head_dim: int = 64, block: int = 32, seed: int = 0):
    """(q, k) float32 [S, 4, D] with the ``PLANTED`` heads in order (Hkv = Hq = 4); D >= 48."""
    s, d = seqlen, head_dim
    g = torch.Generator().manual_seed(seed)
    q, k = torch.zeros(s, 4, d), torch.zeros(s, 4, d)
    u = 40  # a dimension outside the positional features (0:32)
    nb = s // block
    # sink + local: AR features give a local window; the first 4 keys share a direction every query has
    x = _ar(s, 32, 0.9, g)
    q[:, 0, :32], k[:, 0, :32] = 2 * x, x
    q[:, 0, u], k[:4, 0, u] = 4.0, 20.0
    # vertical lines: 3 keys after the first block; block-constant offsets hide them from pooled block scores
    cols = torch.randperm(s - 2 * block, generator=g)[:3] + block
    q[:, 1, u], k[cols, 1, u] = 4.0, 20.0
    q[:, 1, :32] = torch.randn(nb, 32, generator=g).repeat_interleave(block, 0)
    k[:, 1, :32] = torch.randn(nb, 32, generator=g).repeat_interleave(block, 0)
    # diagonal: query i matches key i - off
    off = 3 * block + 5
    x = _ar(s + off, 32, 0.7, g)
    q[:, 2, :32], k[:, 2, :32] = 3 * x[:s], x[off:]
    # block-local clusters
    e = torch.nn.functional.one_hot(torch.randint(0, 4, (nb,), generator=g).repeat_interleave(block), 4).float()
    q[:, 3, 48:52], k[:, 3, 48:52] = 6 * e, 6 * e
    q[:, 3, :32] += 0.3 * torch.randn(s, 32, generator=g)
    k[:, 3, :32] += 0.3 * torch.randn(s, 32, generator=g)
    return q, k


def candidates(s: int, block: int) -> list[HeadPattern]:
    sizes = [0] + [2 ** e for e in range(1, 14) if 2 ** e <= s]
    return ([HeadPattern("a_shape", sink=sink, local=w * block) for sink in (0, block, 2 * block)
             for w in range(1, s // block + 1)]
            + [HeadPattern("vertical_slash", vertical=v, slash=sl, ref_len=s) for v in sizes for sl in sizes]
            + [HeadPattern("block_sparse", top_k=t, ref_len=s) for t in range(1, s // block + 1)])


def dense_rows(q: torch.Tensor, k: torch.Tensor, rows: int) -> torch.Tensor:
    """float64 [Hq, R, S]: causal softmax of the last ``rows`` queries (GQA grouping h // G)."""
    s, hq, d = q.shape
    kk = k.double().repeat_interleave(hq // k.shape[1], 1)
    sc = torch.einsum("rhd,jhd->hrj", q[s - rows:].double(), kk) / math.sqrt(d)
    sc = sc.masked_fill(torch.arange(s)[None, :] > torch.arange(s - rows, s)[:, None], float("-inf"))
    return torch.softmax(sc, -1)


def search_layer(q: torch.Tensor, k: torch.Tensor, block: int, budget: float):
    """Per head: (recall, HeadPattern, blocks) for one layer's q [S, Hq, D], k [S, Hkv, D]."""
    s, hq, d = q.shape
    mi = MInference(([HeadPattern("vertical_slash"), HeadPattern("block_sparse")] * hq)[:hq], block=block)
    mi.check(hq, k.shape[1], d, s)
    view = single_view(masks.causal(s), block)
    sm = mi.summaries(q, k, view)  # every kind's summaries: each candidate selects from them
    rows = min(SAMPLE, s)
    p = dense_rows(q, k, rows)  # [Hq, R, S]
    rb = torch.arange(s - rows, s) // block
    limit = budget * (view.envelope > 0).sum().item()
    fits = [[] for _ in range(hq)]  # per head: (recall, candidate, blocks) within the budget
    for c in candidates(s, block):
        keep = MInference([c] * hq, block=block).select_from(q, sm, view)  # [Hq, nb, nb]
        blocks = keep.sum((1, 2)).tolist()
        recall = (p * keep[:, rb].repeat_interleave(block, -1).double()).sum(-1).mean(-1).tolist()
        for h in range(hq):
            if blocks[h] <= limit:
                fits[h].append((recall[h], c, blocks[h]))
    out = []
    for h in range(hq):
        if not fits[h]:
            raise SystemExit(f"head {h}: no candidate fits --budget {budget}; raise it")
        top = max(r for r, _, _ in fits[h])
        out.append(min((t for t in fits[h] if t[0] >= top - TOL), key=lambda t: (PREFER[t[1].kind], t[2], -t[0])))
    return out


def describe(c: HeadPattern) -> str:
    """e.g. a_shape(sink=32, local=96)."""
    return c.kind + "(" + ", ".join(f"{n}={v}" for n, v in c.to_dict().items() if n not in ("kind", "ref_len")) + ")"


def main(argv=None) -> dict:
    ap = parser(__doc__, os.path.join("out", "minference"))
    ap.add_argument("--input", help=".pt file with per-layer q [S, Hq, D], k [S, Hkv, D]")
    ap.add_argument("--block", type=int, default=128, help="selector block (tokens; the dry run: 32)")
    ap.add_argument("--budget", type=float, default=0.4, help="max fraction of causal block pairs per head")
    a = ap.parse_args(argv)
    if not 0 < a.budget <= 1:
        ap.error(f"--budget must be in (0, 1], got {a.budget}")
    if a.dry_run == bool(a.input):
        ap.error("give --input FILE or --dry-run (planted heads)")
    if a.dry_run:
        a.block = 32
        layers = [synthetic(512, 64, a.block)]
    else:
        obj = torch.load(a.input, map_location="cpu")
        layers = [(x["q"], x["k"]) for x in (obj["layers"] if isinstance(obj, dict) else obj)]
    cfg, table = {"meta": run_record("cpu", block=a.block, budget=a.budget), "layers": []}, []
    with Progress(len(layers), "minference_search", verbose=a.verbose) as bar:
        for li, (q, k) in enumerate(layers):
            res = search_layer(q.float(), k.float(), a.block, a.budget)
            cfg["layers"].append([c.to_dict() for _, c, _ in res])
            table += [[li, h, describe(c) + (f" [{PLANTED[h]}]" if a.dry_run else ""), f"{r:.4f}", nblk]
                      for h, (r, c, nblk) in enumerate(res)]
            bar.step(f"layer {li}")
    write_json(os.path.join(out_dir(a), f"minference{a.tag}.json"), cfg)
    print("\n".join(markdown_table(["layer", "head", "pattern", "recall", "blocks"], table)))
    return cfg


if __name__ == "__main__":
    main()
