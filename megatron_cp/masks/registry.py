"""Every mask builder by name, with the kind of arguments it takes: the one list that the command line
(``python -m megatron_cp --mask``), the Megatron flags (``--cp-mask``) and the tools read their choices from.

A new builder is a function in ``builders.py`` (or ``general.py``) and one line of ``BUILDERS`` here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import builders as b
from . import general as g

__all__ = ["ARG_KINDS", "Builder", "BUILDERS", "builders_taking"]

# what a builder's arguments are: a front end offers a builder where it can supply that kind
ARG_KINDS = {
    "lengths": "(seqlen_q, seqlen_k=None): a whole pattern over the query and key lengths",
    "sizes": "(seqlen, **sizes): one sequence and integer (or true / false) sizes by keyword",
    "documents": "(cu_seqlens, causal=True, window=None): packed documents",
    "table": "(table, block_size, seqlen_q=None, seqlen_k=None): a block table of Block entries",
    "predicate": "(mask_mod, seqlen_q, seqlen_k=None, block=128): a FlexAttention-style mask_mod",
}


@dataclass(frozen=True)
class Builder:
    """A mask builder: ``fn`` returns an ``AttnMask``; ``args`` is a key of ``ARG_KINDS``."""

    fn: Callable
    args: str

    def __post_init__(self):
        if self.args not in ARG_KINDS:
            raise ValueError(f"builder argument kind {self.args!r} is unknown; choose from {', '.join(ARG_KINDS)}")


BUILDERS = {
    "full": Builder(b.full, "lengths"),
    "causal": Builder(b.causal, "lengths"),
    "sliding_window": Builder(b.sliding_window, "sizes"),
    "varlen": Builder(b.varlen, "documents"),
    "block_causal": Builder(b.block_causal, "sizes"),
    "prefix_lm": Builder(b.prefix_lm, "sizes"),
    "strided": Builder(b.strided, "sizes"),
    "global_local": Builder(b.global_local, "sizes"),
    "star": Builder(b.star, "sizes"),
    "streaming": Builder(b.streaming, "sizes"),
    "from_block_table": Builder(g.from_block_table, "table"),
    "from_mask_mod": Builder(g.from_mask_mod, "predicate"),
}


def builders_taking(kind: str) -> tuple[str, ...]:
    """The names of the builders whose arguments are of ``kind`` (a key of ``ARG_KINDS``), in registry order."""
    if kind not in ARG_KINDS:
        raise ValueError(f"builder argument kind {kind!r} is unknown; choose from {', '.join(ARG_KINDS)}")
    return tuple(name for name, builder in BUILDERS.items() if builder.args == kind)
