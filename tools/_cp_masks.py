"""Private helper of tools/bench_dist.py and tools/simulate.py: the benchmark masks, each as an
``AttnMask`` (for megatron-cp and our baselines) and as a FlexAttention ``mask_mod`` keeping the same
cells (for PyTorch's native context parallel). ``check(name, s)`` compares the two cell by cell.

Sizes scale with the sequence (``scaled=True``) so tiny dry runs keep the masks' shape.
"""

from __future__ import annotations

import numpy as np
import torch

import megatron_cp as mcp
from megatron_cp import masks as M

MASKS = ["full", "causal", "packed", "sliding_window", "block_causal", "strided", "global_local"]
DESCRIPTIONS = {
    "full": "every query sees every key",
    "causal": "k <= q",
    "packed": "packed documents, causal inside each (lognormal lengths, median 1.5k tokens, sigma 1, "
              "64 .. S/8, seed 0)",
    "sliding_window": "k <= q and q - k <= W (W = 4096, S/32 when smaller)",
    "block_causal": "blocks of B = 4096 (S/32 when smaller): k_block <= q_block",
    "strided": "blocks of 512 (S/256 when smaller), causal, q_block - k_block divisible by 4",
    "global_local": "Longformer-style: q < G or k < G or |q_block - k_block| <= 1 (blocks of G = 512)",
}


def _sizes(s: int) -> dict:
    return {
        "window": min(4096, max(4, s // 32)),
        "block": min(4096, max(2, s // 32)),
        "sblock": min(512, max(2, s // 256)),
        "gblock": min(512, max(2, s // 256)),
        "median_doc": min(1500, max(8, s // 64)),
    }


def doc_lengths(s: int, seed: int = 0) -> list[int]:
    z = _sizes(s)
    rng = np.random.default_rng(seed)
    out, tot = [], 0
    lo, hi = min(64, max(2, s // 64)), max(2, s // 8)
    while tot < s:
        n = int(np.exp(np.log(z["median_doc"]) + rng.standard_normal()))
        n = min(max(lo, min(n, hi)), s - tot)
        out.append(n)
        tot += n
    return out


def build(name: str, s: int) -> mcp.AttnMask:
    z = _sizes(s)
    if name == "full":
        return M.full(s)
    if name == "causal":
        return M.causal(s)
    if name == "packed":
        return M.varlen(np.concatenate([[0], np.cumsum(doc_lengths(s))]).tolist(), causal=True)
    if name == "sliding_window":
        return M.sliding_window(s, z["window"], 0)
    if name == "block_causal":
        return M.block_causal(s, z["block"])
    if name == "strided":
        return M.strided(s, z["sblock"], 4, local_blocks=1)
    if name == "global_local":
        return M.global_local(s, z["gblock"], 1, 1)
    raise ValueError(f"unknown benchmark mask {name!r}; choose from {', '.join(MASKS)}")


def mask_mod(name: str, s: int, device):
    """FlexAttention mask_mod(b, h, q, k) keeping exactly the cells of ``build(name, s)``."""
    z = _sizes(s)
    if name == "full":
        return lambda b, h, q, k: q >= 0
    if name == "causal":
        return lambda b, h, q, k: k <= q
    if name == "packed":
        doc = torch.repeat_interleave(torch.arange(len(doc_lengths(s)), device=device),
                                      torch.tensor(doc_lengths(s), device=device))
        return lambda b, h, q, k: (doc[q] == doc[k]) & (k <= q)
    if name == "sliding_window":
        w = z["window"]
        return lambda b, h, q, k: (k <= q) & (q - k <= w)
    if name == "block_causal":
        bl = z["block"]
        return lambda b, h, q, k: (k // bl) <= (q // bl)
    if name == "strided":
        bl = z["sblock"]
        return lambda b, h, q, k: (k <= q) & (((q // bl) - (k // bl)) % 4 == 0)
    if name == "global_local":
        g = z["gblock"]
        return lambda b, h, q, k: (q < g) | (k < g) | (((q // g) - (k // g)).abs() <= 1)
    raise ValueError(f"unknown benchmark mask {name!r}")


def check(name: str, s: int) -> None:
    """Raise unless ``mask_mod`` and ``build`` keep the same cells (small ``s`` only)."""
    want = torch.as_tensor(build(name, s).to_dense())
    q = torch.arange(s)[:, None]
    k = torch.arange(s)[None, :]
    got = mask_mod(name, s, "cpu")(0, 0, q, k)
    got = got.expand(s, s) if got.shape != (s, s) else got
    if not torch.equal(got, want):
        raise AssertionError(f"mask {name!r} at S={s}: mask_mod and AttnMask differ in {int((got != want).sum())} cells")
