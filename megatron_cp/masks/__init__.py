"""Masks: ``AttnSlice``, ``AttnMask`` (union of slices) and builders for common patterns."""

from .slices import AttnMask, AttnSlice
from .geometry import KINDS

__all__ = ["AttnMask", "AttnSlice", "KINDS"]
