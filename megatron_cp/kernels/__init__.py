"""Attention kernels over tile lists.

The backend protocol - the tile list, the layouts, what each method takes and returns - is specified in
``megatron_cp/kernels/protocol.py`` (``Backend``); every backend implements all of it, one subpackage or module
each: ``triton/`` (``TritonBackend``: Triton kernels, dense pieces on cuDNN), ``fa4/`` (``FA4Backend``:
FlashAttention-4 varlen, window and block-sparse calls when flash-attn-4 is installed; Triton where FA4 cannot
run) and ``reference.py`` (``ReferenceBackend``: blockwise PyTorch, float64-capable). Shared beside them: the
Triton kernels' configuration (``config.py``: ``TritonConfig`` and block shapes, read by both GPU backends), the
Triton fallback FA4 hands calls to (``fallback.py``; ``fa4/`` imports nothing of ``triton/``), how a
tile list splits into kernel pieces (``pieces.py``, the one owner of those rules), tile checks (``tiles.py``),
the LSE merge (``merge.py``), row copies and reductions (``rows.py``), per-head block selections
(``block_keep.py``), host-to-device uploads (``upload.py``) and ``get_backend`` (``registry.py``); and
XAttention's block masses in one Triton kernel (``triton/antidiagonal.py``), and the block means and block pairs'
dot products of the sparse selections' pooled estimates (``triton/pooling.py``).

This package depends on torch and triton only (flash-attn-4 optionally, imported on first use) and on
``megatron_cp.kinds`` (the kind codes); it never imports the rest of megatron_cp, so it can be tested and
benchmarked on its own.
"""

from ..kinds import Kind
from . import merge, pieces
from .block_keep import BlockKeep, block_classes
from .fa4.backend import FA4Backend, fa4_unavailable
from .protocol import Backend, accumulate_dtype, refuse_double_backward
from .reference import ReferenceBackend
from .registry import BACKEND_CHOICES, BACKENDS, available_backends, get_backend
from .rows import copy_row_pair_moves, copy_row_pairs, copy_rows, reduce_row_pairs, reduce_rows
from .tiles import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL, KIND_CODES, check_tiles
from .triton.antidiagonal import antidiagonal_mass, fused_mass_supported
from .triton.pooling import block_means_f32, pair_dots
from .config import DEFAULT_CONFIGS, KernelConfig, PhaseConfigs, TritonConfig, configs_from_json
from .triton.backend import TritonBackend
from .pieces import kept_area
from .upload import upload, upload_all

# the user API: the backends by name and their configuration, the tile list and its checks, per-head block selections
__all__ = [
    "Backend",
    "BlockKeep",
    "Kind",
    "FULL",
    "CAUSAL",
    "INV_CAUSAL",
    "BI_CAUSAL",
    "KIND_CODES",
    "check_tiles",
    "kept_area",
    "get_backend",
    "available_backends",
    "BACKENDS",
    "BACKEND_CHOICES",
    "ReferenceBackend",
    "TritonBackend",
    "FA4Backend",
    "fa4_unavailable",
    "TritonConfig",
    "KernelConfig",
    "PhaseConfigs",
    "DEFAULT_CONFIGS",
    "configs_from_json",
]
# shared with the layers above (runtime, baselines, sparse, gating), not the user API: the LSE merge, how tiles split
# into pieces, row moves, uploads, dtype and autograd rules, XAttention's block masses and the selections' pooling
__shared__ = [
    "block_classes", "accumulate_dtype", "refuse_double_backward",
    "copy_rows", "copy_row_pairs", "copy_row_pair_moves", "reduce_rows", "reduce_row_pairs",
    "merge", "pieces", "upload", "upload_all",
    "antidiagonal_mass", "fused_mass_supported", "block_means_f32", "pair_dots",
]
