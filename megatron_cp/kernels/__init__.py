"""Attention kernels over tile lists.

This package depends on torch (and triton for the fast backends) only; it never imports the rest of
megatron_cp, so it can be tested and benchmarked on its own.

Tile list
---------
A tile list is an int32 tensor ``tiles[n, 5]`` with rows ``(q_start, q_end, k_start, k_end, kind)``.
Each tile covers rows ``q_start:q_end`` of ``q`` and rows ``k_start:k_end`` of ``k``/``v``. Inside a
tile, with local indices ``i = q - q_start`` in ``[0, sq)`` and ``j = k - k_start`` in ``[0, sk)``, a
cell is kept iff (MagiAttention's semantics)::

    FULL       (0): always
    CAUSAL     (1): j <= i + (sk - sq)          (bottom-right aligned)
    INV_CAUSAL (2): j >= i                      (top-left aligned)
    BI_CAUSAL  (3): i <= j <= i + (sk - sq)

Tiles of one list must be cell-disjoint (the planner emits disjoint tiles); tiles may share rows and
are then merged inside the backend by online softmax, so ``out``/``lse`` are those of the union.
Rows covered by no tile (or only by empty cells) give ``out = 0`` and ``lse = -inf``.

Backend interface
-----------------
A backend is an object with::

    name: str
    prepare(tiles: Tensor[n,5] int32 (cpu), seqlen_q: int, seqlen_k: int) -> Prepared
        Per-plan preprocessing (block schedules, transposed lists); called once per plan and cached
        by the caller, never inside the hot path.
    forward(q, k, v, prepared, softmax_scale) -> (out, lse)
        q [sq, Hq, D], k/v [sk, Hkv, D] with Hkv dividing Hq; out like q (q's dtype),
        lse [sq, Hq] float32 natural log.
    backward(q, k, v, out, lse, dout, prepared, softmax_scale, delta) -> (dq, dk, dv)
        lse is the merged (global) lse of every row; delta [sq, Hq] float32 is
        rowsum(dout * out) - dlse (dlse = gradient of lse), or None meaning rowsum(dout * out) (no lse
        gradient: a backend may then let a library recompute it); grads like their inputs.
"""

from .tiles import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL, KIND_CODES, check_tiles
from .registry import available_backends, get_backend

__all__ = [
    "FULL",
    "CAUSAL",
    "INV_CAUSAL",
    "BI_CAUSAL",
    "KIND_CODES",
    "check_tiles",
    "get_backend",
    "available_backends",
]
