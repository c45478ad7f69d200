"""Dynamic block-sparse attention under context parallelism (docs/sparse.md)."""

from .selector import Selector
from .view import SelectionView, single_view

__all__ = ["Selector", "SelectionView", "single_view"]
