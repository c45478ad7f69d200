"""Dynamic block-sparse attention under context parallelism (docs/sparse.md).

    keep = selector.select(q_local, k_local, view)          # per head, q block: key blocks to compute
    out, lse = megatron_cp.sparse.sparse_attention(q, k, v, plan, group, selector)
"""

from .attention import sparse_attention, select_blocks
from .flexprefill import FlexPrefill
from .minference import HeadPattern, MInference
from .moba import MoBA
from .xattention import XAttention
from .layout import SparseLayout, sparse_layout
from .selector import Selector
from .view import SelectionView, single_view

# the dynamic sparse selectors by name (each class's ``name``): the one list --cp-sparse and the tools read; a new
# selector is a module implementing ``Selector`` and one entry here
SELECTORS = {cls.name: cls for cls in (MoBA, XAttention, FlexPrefill, MInference)}

__all__ = ["SELECTORS", "MoBA", "XAttention", "FlexPrefill", "MInference", "HeadPattern", "Selector", "SelectionView", "SparseLayout", "single_view", "sparse_attention", "select_blocks",
           "sparse_layout"]
__shared__ = []  # the adapter above uses the user API only
