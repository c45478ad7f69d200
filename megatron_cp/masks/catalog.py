"""Named benchmark masks: the one table every benchmark and GPU check under tools/ draws from.

Each name means exactly one mask at a given sequence length ``S``; each mask comes in three forms
that keep the same cells:

    build(name, S)       AttnMask, for megatron-cp, the baselines and the planner tools
    mask_mod(name, S)    FlexAttention-style predicate ``(b, h, q_idx, kv_idx) -> bool``, for the peers
    tiles(build(...))    int32 ``[n, 5]`` kernel tile list of one GPU (the mask's disjoint slices)

``check(name, S)`` compares them cell by cell (small ``S``).

Two sets, one name space (see ``DESCRIPTIONS`` for every mask's exact rule):

- ``DIST_MASKS``, the distributed benchmarks' set (tools/bench_dist.py, simulate, calibrate --check, ...):
  ``full``, ``causal``, ``packed``, ``sliding_window``, ``block_causal``, ``strided``, ``global_local``.
  Their sizes scale with ``S`` by one rule, so that tiny CPU dry runs keep the masks' shape: a size
  is ``min(nominal, S // divisor)`` (with a floor of a few tokens) and is nominal by ``S = 128Ki``:
  windows and blocks of 4096 are ``min(4096, S/32)``, blocks of 512 ``min(512, S/256)``, the median
  document ``min(1500, S/64)``. The names keep their meaning across S: ``sliding_window`` is always
  this scaled window, never the kernel table's fixed 1024 one.
- ``KERNEL_MASKS``, the single-GPU kernel table's set (tools/bench_kernels.py, gpu_kernel_check):
  ``full``, ``causal``, ``docs_causal``, ``sliding_window_1024``, ``block_causal_2048``,
  ``strided_512x4``, ``global_local_512``, ``streaming_1024``. Fixed sizes, given in the name
  (``docs_causal``'s length distribution in its description).

Pure: numpy and torch tensors only (torch for the mask_mods and tile lists).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np
import torch

from ..kinds import KIND_NAMES, Kind
from . import builders as B
from .slices import AttnMask, AttnSlice

DIST_MASKS = ("full", "causal", "packed", "sliding_window", "block_causal", "strided", "global_local")
DOCUMENT_MASKS = ("packed", "docs_causal")  # masks of drawn document lengths (doc_lengths)
KERNEL_MASKS = ("full", "causal", "docs_causal", "sliding_window_1024", "block_causal_2048", "strided_512x4",
                "global_local_512", "streaming_1024")


# --------------------------------------------------------------------------------------------------
# sizes and document lengths


def _scaled(s: int) -> dict:
    """The distributed set's sizes at sequence length ``s`` (nominal from ``s = 128Ki`` on)."""
    return {
        "window": min(4096, max(4, s // 32)),
        "block": min(4096, max(2, s // 32)),
        "sblock": min(512, max(2, s // 256)),
        "gblock": min(512, max(2, s // 256)),
        "median_doc": min(1500, max(8, s // 64)),
    }


def doc_lengths(name: str, seqlen: int) -> list[int]:
    """Document lengths of ``packed`` or ``docs_causal`` at ``seqlen`` (they sum to ``seqlen``)."""
    s = int(seqlen)
    out, tot = [], 0
    if name == "packed":  # numpy, lognormal (sigma 1) around the scaled median, clipped to [lo, S/8]
        rng = np.random.default_rng(0)
        median = _scaled(s)["median_doc"]
        lo, hi = min(64, max(2, s // 64)), max(2, s // 8)
        while tot < s:
            n = int(np.exp(np.log(median) + rng.standard_normal()))
            n = min(max(lo, min(n, hi)), s - tot)
            out.append(n)
            tot += n
    elif name == "docs_causal":  # torch, lognormal (sigma 1) around 1500, clipped to [64, S/4]
        g = torch.Generator().manual_seed(0)
        while tot < s:
            n = int(math.exp(math.log(1500) + 1.0 * float(torch.randn(1, generator=g))))
            n = min(max(64, min(n, s // 4)), s - tot)
            out.append(n)
            tot += n
    else:
        raise ValueError(f"doc_lengths: {name!r} is not a document mask; choose {' or '.join(DOCUMENT_MASKS)}")
    return out


def _doc_ids(name: str, s: int, device) -> torch.Tensor:
    lens = doc_lengths(name, s)
    return torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))


# --------------------------------------------------------------------------------------------------
# the table: name -> (description, AttnMask builder, mask_mod factory)


class _Entry(NamedTuple):
    description: str
    build: Callable[[int], AttnMask]
    mask_mod: Callable[[int, object], Callable]


def _packed(name: str, s: int) -> AttnMask:
    return B.varlen(np.concatenate([[0], np.cumsum(doc_lengths(name, s))]).tolist(), causal=True)


def _global_local_band(s: int, g: int, w: int) -> AttnMask:
    """q < g or k < g or |q - k| <= w: the global rows and columns plus a symmetric band (a union)."""
    g = min(g, s)
    slices = [AttnSlice((0, g), (0, s), "full")]
    if g < s:
        slices.append(AttnSlice((g, s), (0, g), "full"))
    return AttnMask(slices + list(B.sliding_window(s, w, w).slices), s, s)


def _docs_mod(name: str):
    def factory(s, device):
        doc = _doc_ids(name, s, device)
        return lambda b, h, q, k: (doc[q] == doc[k]) & (k <= q)
    return factory


_TABLE: dict[str, _Entry] = {
    # both sets
    "full": _Entry("every query sees every key", B.full, lambda s, d: lambda b, h, q, k: (q >= 0) & (k >= 0)),
    "causal": _Entry("k <= q", B.causal, lambda s, d: lambda b, h, q, k: k <= q),
    # the distributed set, sizes scaled with S
    "packed": _Entry(
        "packed documents, causal inside each (lognormal lengths, median min(1500, S/64), sigma 1, "
        "min(64, S/64) .. S/8, numpy seed 0)",
        lambda s: _packed("packed", s), _docs_mod("packed")),
    "sliding_window": _Entry(
        "k <= q and q - k <= W (W = 4096, S/32 when smaller)",
        lambda s: B.sliding_window(s, _scaled(s)["window"], 0),
        lambda s, d: (lambda w: lambda b, h, q, k: (k <= q) & (q - k <= w))(_scaled(s)["window"])),
    "block_causal": _Entry(
        "blocks of B = 4096 (S/32 when smaller): k_block <= q_block",
        lambda s: B.block_causal(s, _scaled(s)["block"]),
        lambda s, d: (lambda bl: lambda b, h, q, k: (k // bl) <= (q // bl))(_scaled(s)["block"])),
    "strided": _Entry(
        "blocks of 512 (S/256 when smaller), causal, q_block - k_block divisible by 4",
        lambda s: B.strided(s, _scaled(s)["sblock"], 4, local_blocks=1),
        lambda s, d: (lambda bl: lambda b, h, q, k: (k <= q) & (((q // bl) - (k // bl)) % 4 == 0))(
            _scaled(s)["sblock"])),
    "global_local": _Entry(
        "Longformer-style at block level: q < G or k < G or |q_block - k_block| <= 1 (blocks of G = 512, "
        "S/256 when smaller)",
        lambda s: B.global_local(s, _scaled(s)["gblock"], 1, 1),
        lambda s, d: (lambda g: lambda b, h, q, k: (q < g) | (k < g) | (((q // g) - (k // g)).abs() <= 1))(
            _scaled(s)["gblock"])),
    # the kernel table's set, fixed sizes
    "docs_causal": _Entry(
        "packed documents, causal inside each (lognormal lengths, median 1500, sigma 1, 64 .. S/4, torch seed 0)",
        lambda s: _packed("docs_causal", s), _docs_mod("docs_causal")),
    "sliding_window_1024": _Entry(
        "k <= q and q - k <= 1024",
        lambda s: B.sliding_window(s, 1024, 0),
        lambda s, d: lambda b, h, q, k: (k <= q) & (q - k <= 1024)),
    "block_causal_2048": _Entry(
        "blocks of 2048: k_block <= q_block (bidirectional inside a block)",
        lambda s: B.block_causal(s, 2048),
        lambda s, d: lambda b, h, q, k: (k // 2048) <= (q // 2048)),
    "strided_512x4": _Entry(
        "blocks of 512, causal, q_block - k_block divisible by 4",
        lambda s: B.strided(s, 512, 4, local_blocks=1),
        lambda s, d: lambda b, h, q, k: (k <= q) & (((q // 512) - (k // 512)) % 4 == 0)),
    "global_local_512": _Entry(
        "Longformer-style at token level, bidirectional: q < 512 or k < 512 or |q - k| <= 512",
        lambda s: _global_local_band(s, 512, 512),
        lambda s, d: lambda b, h, q, k: (q < 512) | (k < 512) | ((q - k <= 512) & (k - q <= 512))),
    "streaming_1024": _Entry(
        "StreamingLLM: k <= q and (k < 4 sink tokens or q - k <= 1024)",
        lambda s: B.streaming(s, 4, 1025),  # streaming()'s window counts the query itself
        lambda s, d: lambda b, h, q, k: (k <= q) & ((k < 4) | (q - k <= 1024))),
}

NAMES = tuple(_TABLE)
DESCRIPTIONS = {name: e.description for name, e in _TABLE.items()}


def _entry(name: str) -> _Entry:
    try:
        return _TABLE[name]
    except KeyError:
        raise ValueError(f"unknown benchmark mask {name!r}; choose from {', '.join(NAMES)}") from None


# --------------------------------------------------------------------------------------------------
# the three forms and their comparison


def build(name: str, seqlen: int) -> AttnMask:
    """The mask ``name`` over ``[seqlen, seqlen]`` as an ``AttnMask``."""
    return _entry(name).build(int(seqlen))


def mask_mod(name: str, seqlen: int, device="cpu") -> Callable:
    """FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` keeping exactly the cells of ``build(name, seqlen)``.

    ``q_idx`` / ``kv_idx`` are int64 tensors (broadcastable); ``device`` holds the mask's lookup
    tables (the document ids of ``packed`` / ``docs_causal``) and must be where the indices are.
    """
    return _entry(name).mask_mod(int(seqlen), device)


def sdpa_is_causal(name: str) -> bool | None:
    """SDPA's ``is_causal`` for the masks a dense kernel runs as such (full: False, causal: True), else None."""
    _entry(name)
    return {"full": False, "causal": True}.get(name)


def tiles(mask: AttnMask) -> torch.Tensor:
    """One GPU's kernel tile list of ``mask``: its disjoint slices as int32 ``[n, 5]`` rows
    ``(q_start, q_end, k_start, k_end, kind)`` with ``kind`` a ``megatron_cp.kinds.Kind`` code (CPU tensor).

    Not pre-cut: the kernels split tiles into their own pieces (a sliding window is two tiles here; the
    kernel table's earlier hand-cut lists of 1024-row squares ran no faster).
    """
    rows = [(*s.q_range, *s.k_range, int(s.code)) for s in mask.normalized().slices]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)


def tiles_to_dense(tile_list: torch.Tensor, seqlen_q: int, seqlen_k: int, device="cpu") -> torch.Tensor:
    """Bool ``[seqlen_q, seqlen_k]`` picture of a tile list (int ``[n, 5]``, kinds as in ``tiles``).

    Raises ValueError if two tiles share a cell (a kernel would count it twice).
    """
    keep = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    for q0, q1, k0, k1, kind in torch.as_tensor(tile_list).reshape(-1, 5).tolist():
        i = torch.arange(q1 - q0, device=device)[:, None]
        j = torch.arange(k1 - k0, device=device)[None, :]
        d = (k1 - k0) - (q1 - q0)
        m = {Kind.FULL: (i >= 0) & (j >= 0), Kind.CAUSAL: j <= i + d, Kind.INV_CAUSAL: j >= i,
             Kind.BI_CAUSAL: (j >= i) & (j <= i + d)}[Kind(kind)]
        if (keep[q0:q1, k0:k1] & m).any():
            raise ValueError(f"tile {[q0, q1, k0, k1, KIND_NAMES[kind]]} overlaps an earlier tile")
        keep[q0:q1, k0:k1] |= m
    return keep


def dense(name: str, seqlen: int, device="cpu") -> torch.Tensor:
    """Bool ``[seqlen, seqlen]``: ``mask_mod(name, seqlen)`` evaluated on every cell (small sizes)."""
    s = int(seqlen)
    q = torch.arange(s, device=device)[:, None]
    k = torch.arange(s, device=device)[None, :]
    return torch.broadcast_to(mask_mod(name, s, device)(0, 0, q, k), (s, s))


def check(name: str, seqlen: int) -> None:
    """Raise AssertionError unless ``build``, ``mask_mod`` and ``tiles`` keep the same cells (small ``seqlen``)."""
    mask = build(name, seqlen)
    want = dense(name, seqlen)
    for form, got in (("AttnMask", torch.from_numpy(mask.to_dense())),
                      ("tile list", tiles_to_dense(tiles(mask), seqlen, seqlen))):
        if not torch.equal(got, want):
            raise AssertionError(f"mask {name!r} at S={seqlen}: mask_mod and its {form} differ in "
                                 f"{int((got != want).sum())} cells")
