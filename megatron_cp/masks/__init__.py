"""Masks: ``AttnSlice``, ``AttnMask`` (union of slices) and builders for common patterns.

Builders: full, causal, sliding_window, varlen, block_causal, prefix_lm, strided, global_local,
star, streaming, from_block_table (EMPTY/FULL/CAUSAL), from_mask_mod (FlexAttention-style).
"""

from .builders import (
    CAUSAL,
    EMPTY,
    FULL,
    block_causal,
    causal,
    from_block_table,
    from_mask_mod,
    full,
    global_local,
    prefix_lm,
    sliding_window,
    star,
    streaming,
    strided,
    varlen,
)
from .geometry import KINDS
from .slices import AttnMask, AttnSlice

BUILDERS = (
    "full", "causal", "sliding_window", "varlen", "block_causal", "prefix_lm", "strided",
    "global_local", "star", "streaming", "from_block_table", "from_mask_mod",
)

__all__ = ["AttnMask", "AttnSlice", "KINDS", "EMPTY", "FULL", "CAUSAL", "BUILDERS", *BUILDERS]
