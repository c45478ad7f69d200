"""Masks: ``AttnSlice``, ``AttnMask`` (union of slices) and builders for common patterns.

Builders: full, causal, sliding_window, varlen, block_causal, prefix_lm, strided, global_local,
star, streaming, from_block_table (``Block.EMPTY`` / ``FULL`` / ``CAUSAL`` entries), from_mask_mod
(FlexAttention-style).

``megatron_cp.masks.catalog``: the named benchmark masks (AttnMask, mask_mod and kernel tile list of
each), loaded on first use because it needs torch.
"""

from .builders import (
    Block,
    block_causal,
    block_diagonal,
    causal,
    from_block_table,
    from_mask_mod,
    full,
    global_local,
    prefix_lm,
    sliding_window,
    star,
    streaming,
    streaming_within,
    strided,
    varlen,
)
from .geometry import KINDS
from .slices import AttnMask, AttnSlice

BUILDERS = (
    "full", "causal", "sliding_window", "varlen", "block_causal", "prefix_lm", "strided",
    "global_local", "star", "streaming", "from_block_table", "from_mask_mod",
)

# public modules beside the names: geometry (trapezoid arithmetic), catalog (named masks, needs torch), draw
__all__ = ["AttnMask", "AttnSlice", "KINDS", "Block", "BUILDERS", "streaming_within", "block_diagonal", *BUILDERS,
           "geometry", "catalog", "draw"]


def __getattr__(name):  # ``masks.catalog`` on first use: the rest of the package stays free of torch
    if name == "catalog":
        import importlib

        return importlib.import_module(f"{__name__}.catalog")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
