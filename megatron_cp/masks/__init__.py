"""Masks: ``AttnSlice``, ``AttnMask`` (union of slices) and builders for common patterns.

Builders: ``BUILDERS`` (registry.py) names each with the kind of its arguments (``ARG_KINDS``):
full, causal, sliding_window, varlen, block_causal, prefix_lm, strided, global_local, star, streaming,
from_block_table (``Block.EMPTY`` / ``FULL`` / ``CAUSAL`` entries), from_mask_mod (FlexAttention-style).
``streaming_within`` and ``block_diagonal`` make a mask from masks.

``megatron_cp.masks.catalog``: the named benchmark masks (AttnMask, mask_mod and kernel tile list of
each), loaded on first use because it needs torch.
"""

from .builders import (
    block_causal,
    block_diagonal,
    causal,
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
from .general import Block, from_block_table, from_mask_mod
from .geometry import KINDS
from .registry import ARG_KINDS, BUILDERS, builders_taking
from .slices import AttnMask, AttnSlice

# the user API; public modules beside the names: catalog (named masks, needs torch), draw
__all__ = ["AttnMask", "AttnSlice", "Block", "streaming_within", "block_diagonal", *BUILDERS,
           # the registry of builders by name, with the kind of their arguments (registry.py)
           "BUILDERS", "ARG_KINDS", "builders_taking",
           "catalog", "draw"]
# shared with the layers above (planner, runtime, ...), not the user API: the trapezoid arithmetic and kind names
__shared__ = ["KINDS", "geometry"]


def __getattr__(name):  # ``masks.catalog`` on first use: the rest of the package stays free of torch
    if name == "catalog":
        import importlib

        return importlib.import_module(f"{__name__}.catalog")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
