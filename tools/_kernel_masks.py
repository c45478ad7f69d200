"""Private helper of tools/bench_kernels.py and tools/gpu_kernel_check.py: benchmark masks as tile
lists (for our kernels) and as FlexAttention mask_mods (same cells), built from simple descriptions.

Independent of megatron_cp.masks / planner on purpose (those are in flux); the GPU check verifies
that every tile list here equals its mask_mod cell by cell.
"""

from __future__ import annotations

import math

import torch

FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = 0, 1, 2, 3

MASKS = ["full", "causal", "docs_causal", "sliding_window", "block_causal", "strided", "global_local",
         "streaming"]
DESCRIPTIONS = {
    "full": "every query sees every key",
    "causal": "k <= q",
    "docs_causal": "packed documents (lognormal lengths, median 1.5k, at most S/4, seed 0), causal inside each",
    "sliding_window": "k <= q and q - k <= 1024",
    "block_causal": "blocks of 2048: k_block <= q_block (bidirectional inside a block)",
    "strided": "blocks of 512, causal, q_block - k_block divisible by 4",
    "global_local": "Longformer-style, bidirectional: q < 512 or k < 512 or |q - k| <= 512",
    "streaming": "StreamingLLM: k <= q and (k < 4 sink tokens or q - k <= 1024)",
}
WINDOW = 1024
BLOCK_CAUSAL = 2048
STRIDE_BLOCK, STRIDE = 512, 4
GL_G = GL_W = 512
SINKS = 4


def doc_lengths(s: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    out, tot = [], 0
    while tot < s:
        n = int(math.exp(math.log(1500) + 1.0 * float(torch.randn(1, generator=g))))
        n = min(max(64, min(n, s // 4)), s - tot)  # at least 4 documents
        out.append(n)
        tot += n
    return out


def _window_rows(q0: int, q1: int, w: int, lo_key: int):
    """Tiles of rows [q0, q1) (q1 - q0 <= w, q0 - w >= lo_key) keeping q - w <= k <= q."""
    return [[q0, q1, q0, q1, CAUSAL], [q0, q1, q0 - w, q0 - w + (q1 - q0), INV_CAUSAL]] + (
        [] if q1 - q0 == w else [[q0, q1, q0 - w + (q1 - q0), q0, FULL]])


def tiles_for(name: str, s: int) -> torch.Tensor:
    t = []
    if name == "full":
        t = [[0, s, 0, s, FULL]]
    elif name == "causal":
        t = [[0, s, 0, s, CAUSAL]]
    elif name == "docs_causal":
        a = 0
        for n in doc_lengths(s):
            t.append([a, a + n, a, a + n, CAUSAL])
            a += n
    elif name == "sliding_window":
        w = WINDOW
        t.append([0, min(w, s), 0, min(w, s), CAUSAL])
        for q0 in range(w, s, w):
            t += _window_rows(q0, min(q0 + w, s), w, 0)
    elif name == "block_causal":
        b = BLOCK_CAUSAL
        for q0 in range(0, s, b):
            t.append([q0, min(q0 + b, s), 0, min(q0 + b, s), FULL])
    elif name == "strided":
        b = STRIDE_BLOCK
        nb = (s + b - 1) // b
        for i in range(nb):
            q0, q1 = i * b, min((i + 1) * b, s)
            t.append([q0, q1, q0, q1, CAUSAL])
            for j in range(i - STRIDE, -1, -STRIDE):
                t.append([q0, q1, j * b, (j + 1) * b, FULL])
    elif name == "global_local":
        g, w = GL_G, GL_W
        assert s % w == 0 and g == w
        t.append([0, g, 0, s, FULL])  # global rows see everything
        for q0 in range(g, s, w):
            q1 = q0 + w
            t.append([q0, q1, 0, g, FULL])  # global keys
            if q0 - w >= g:
                t.append([q0, q1, q0 - w, q0, INV_CAUSAL])  # k >= q - w
            t.append([q0, q1, q0, q1, FULL])
            if q1 < s:
                t.append([q0, q1, q1, q1 + w, CAUSAL])  # k <= q + w
    elif name == "streaming":
        w, g = WINDOW, SINKS
        t.append([0, min(w, s), 0, min(w, s), CAUSAL])
        if s > w:
            q0, q1 = w, min(2 * w, s)
            t.append([q0, q1, q0, q1, CAUSAL])
            t.append([q0, q1, 0, q1 - w, INV_CAUSAL])  # k >= q - w (square)
            if q1 < 2 * w:
                t.append([q0, q1, q1 - w, w, FULL])  # q - w < k < w <= q
            # sinks below the band: k < g and k < q - w
            t.append([w + 1, min(w + g, q1), 0, min(w + g, q1) - w - 1, CAUSAL])
            if q1 > w + g:
                t.append([w + g, q1, 0, g, FULL])
            for q0 in range(2 * w, s, w):
                q1 = min(q0 + w, s)
                t += _window_rows(q0, q1, w, g)
                t.append([q0, q1, 0, g, FULL])
    else:
        raise ValueError(f"unknown mask {name!r}; choose from {MASKS}")
    return torch.tensor(t, dtype=torch.int32).reshape(-1, 5)


def mask_mod_for(name: str, s: int, device):
    """FlexAttention mask_mod (b, h, q_idx, kv_idx) -> bool, or None for the full mask."""
    if name == "full":
        return None
    if name == "causal":
        return lambda b, h, q, k: q >= k
    if name == "docs_causal":
        doc = torch.repeat_interleave(torch.arange(len(doc_lengths(s))), torch.tensor(doc_lengths(s))).to(device)
        return lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k)
    if name == "sliding_window":
        return lambda b, h, q, k: (q >= k) & (q - k <= WINDOW)
    if name == "block_causal":
        return lambda b, h, q, k: (k // BLOCK_CAUSAL) <= (q // BLOCK_CAUSAL)
    if name == "strided":
        return lambda b, h, q, k: (q >= k) & (((q // STRIDE_BLOCK) - (k // STRIDE_BLOCK)) % STRIDE == 0)
    if name == "global_local":
        return lambda b, h, q, k: (q < GL_G) | (k < GL_G) | ((q - k <= GL_W) & (k - q <= GL_W))
    if name == "streaming":
        return lambda b, h, q, k: (q >= k) & ((k < SINKS) | (q - k <= WINDOW))
    raise ValueError(name)


def dense_kind(name: str):
    """SDPA's is_causal for masks cuDNN can run densely, else None."""
    return {"full": False, "causal": True}.get(name)


def dense_mask_from_tiles(tiles: torch.Tensor, sq: int, sk: int, device="cpu") -> torch.Tensor:
    """Bool [sq, sk]; raises if two tiles share a cell."""
    keep = torch.zeros(sq, sk, dtype=torch.bool, device=device)
    for qs, qe, ks, ke, kind in tiles.tolist():
        i = torch.arange(qe - qs, device=device)[:, None]
        j = torch.arange(ke - ks, device=device)[None, :]
        d = (ke - ks) - (qe - qs)
        m = {FULL: (i >= 0) & (j >= 0), CAUSAL: j <= i + d, INV_CAUSAL: j >= i,
             BI_CAUSAL: (j >= i) & (j <= i + d)}[kind]
        if (keep[qs:qe, ks:ke] & m).any():
            raise ValueError(f"tile {[qs, qe, ks, ke, kind]} overlaps an earlier tile")
        keep[qs:qe, ks:ke] |= m
    return keep


def dense_mask_from_mod(name: str, s: int, device="cpu") -> torch.Tensor:
    mod = mask_mod_for(name, s, device)
    q = torch.arange(s, device=device)[:, None]
    k = torch.arange(s, device=device)[None, :]
    if mod is None:
        return torch.ones(s, s, dtype=torch.bool, device=device)
    return mod(0, 0, q, k)
