"""The attention backend protocol: what every backend implements and what a caller may rely on.

This module doc is the specification; ``Backend`` restates it as a ``typing.Protocol`` (runtime
checkable, so ``isinstance(obj, Backend)`` tells whether an object has every member).

Tile list
---------
A tile list is an int32 tensor ``tiles[n, 5]`` on the CPU with rows ``(q_start, q_end, k_start, k_end,
kind)``. A tile covers rows ``q_start:q_end`` of ``q`` and rows ``k_start:k_end`` of ``k``/``v``. Inside a
tile, with local indices ``i = q - q_start`` in ``[0, sq)`` and ``j = k - k_start`` in ``[0, sk)``, a
cell is kept iff (``megatron_cp.kinds.Kind``, MagiAttention's semantics)::

    FULL       (0): always
    CAUSAL     (1): j <= i + (sk - sq)          (bottom-right aligned)
    INV_CAUSAL (2): j >= i                      (top-left aligned)
    BI_CAUSAL  (3): i <= j <= i + (sk - sq)     (a band: a sliding window)

Tiles of one list are cell-disjoint; tiles may share rows, and a backend then merges them by online
softmax, so ``out``/``lse`` are those of the union of the tiles' cells. A row no kept cell meets gives
``out = 0`` and ``lse = -inf``.

Layouts
-------
``q [sq, Hq, D]``, ``k [sk, Hkv, D]``, ``v [sk, Hkv, Dv]`` (``Dv = D`` unless ``supports`` accepted
another v head dim; ``out``, ``dout`` and running outputs have ``Dv``) with ``Hkv`` dividing ``Hq`` (GQA / MQA: q head ``h`` reads
k/v head ``h // (Hq // Hkv)``); k and v may be strided views (e.g. the two halves of a ``[sk, 2*Hkv, D]``
buffer). ``lse`` is the natural-log sum of exp of the scaled scores of a row, ``[sq, Hq]`` of
``accumulate_dtype(q.dtype)``: float32, float64 for float64 inputs (which stay float64 end to end).
``softmax_scale`` None means ``1 / sqrt(D)``. Running sums (``forward_accumulate``, ``backward_into``)
are of ``accumulate_dtype(q.dtype)``: float64 for float64 inputs, float32 otherwise.

Members
-------
``name: str``
    What ``get_backend`` calls it.
``supports(device, dtype, head_dim, head_dim_v=None) -> str | None``
    None when the backend can run inputs of this device, dtype and head_dim (q and k), else the reason in
    words. ``head_dim_v``: v's head dim when it differs from q/k's (MLA: 192 / 128; out and dout then have
    it too); callers pass it only then. Callers ask before their first collective and raise
    ``ValueError`` with the reason.
``prepare(tiles, seqlen_q, seqlen_k) -> prepared``
    Once per tile list (per plan and stage), cached by the caller, never on the hot path. Every choice
    of how the list runs (which pieces go to which library) is made here, or once per backend and shape
    family (device, dtype, head_dim, Hq / Hkv) on first use; never by catching an exception per call.
``forward(q, k, v, prepared, softmax_scale, keep=None) -> (out, lse)``
    ``out [sq, Hq, D]`` of q's dtype, ``lse [sq, Hq]`` of ``accumulate_dtype(q.dtype)``. ``keep``: None, or a
    ``kernels.BlockKeep`` narrowing the list per query head (dynamic sparse attention,
    ``kernels/block_keep.py``): cell (i, j) of head h is computed iff a tile keeps it and
    ``keep.mask[h, i // keep.block, j // keep.block]``; read on the device, no host synchronisation.
``forward_accumulate(q, k, v, prepared, softmax_scale, out, lse) -> None``
    Adds this list's attention into the running ``(out [sq, Hq, D], lse [sq, Hq])`` of
    ``accumulate_dtype(q.dtype)`` in place, by LSE merge: ``L = log(exp(lse) + exp(l))``,
    ``out = exp(lse - L) out + exp(l - L) o``. A row whose running lse is -inf holds nothing (its out is
    ignored); rows the list does not cover are left untouched.
``backward(q, k, v, out, lse, dout, prepared, softmax_scale, delta, keep=None) -> (dq, dk, dv)``
    ``out``/``lse`` are the merged (global) results of every row, ``delta [sq, Hq]`` (accumulate dtype) is
    ``rowsum(dout * out) - dlse`` (dlse the gradient of lse), or None meaning ``rowsum(dout * out)`` (no
    lse gradient: a backend may then let a library recompute it). Gradients have the dtypes and shapes
    of q, k, v. ``keep``: as in ``forward`` (the same selection the forward used).
``backward_into(q, k, v, out, lse, dout, prepared, softmax_scale, delta, dq, dk, dv) -> None``
    ``backward``'s gradients added into running sums ``dq [sq, Hq, D]``, ``dk``/``dv [sk, Hkv, D]`` of
    ``accumulate_dtype(q.dtype)`` (dk/dv may be strided views of one ``[sk, 2*Hkv, D]`` buffer), without
    rounding them to q's dtype first.
``prepare_host`` (optional)
    A picklable callable ``(tiles, seqlen_q, seqlen_k) -> prepared`` giving what ``prepare`` gives (host work
    only, a picklable result), so that the runtime can prepare a new plan's lists in its planning helper process
    (``runtime.plan_in_helper``) instead of on the step's thread: a module-level function, or an object with a
    ``name`` saying which lists it makes (lists are taken only from a ``prepare_host`` of the same name) and
    optionally ``with_head_dims(dims)``, the same callable doing the calls' head dims' part too. None or absent:
    ``prepare`` runs in the first call.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of running outputs, lse and gradient sums for inputs of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def refuse_double_backward(what: str) -> None:
    """Call first in an attention ``autograd.Function``'s backward: under ``create_graph=True`` (double backward,
    ``gradgradcheck``) a RuntimeError saying so, instead of first derivatives whose own graph would be cut at the
    kernels and exchanges (silently wrong second derivatives)."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{what} is differentiable once: its backward cannot build a graph for a second "
                           f"derivative (create_graph=True, torch.autograd.gradgradcheck). Take second derivatives "
                           f"through a dense PyTorch attention, or call backward without create_graph")


@runtime_checkable
class Backend(Protocol):
    """An attention backend over tile lists; the module doc is the specification."""

    name: str

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int,
                 head_dim_v: int | None = None) -> str | None: ...

    def prepare(self, tiles: torch.Tensor, seqlen_q: int, seqlen_k: int) -> Any: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prepared: Any,
                softmax_scale: float | None, keep: Any = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward_accumulate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prepared: Any,
                           softmax_scale: float | None, out: torch.Tensor, lse: torch.Tensor) -> None: ...

    def backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 dout: torch.Tensor, prepared: Any, softmax_scale: float | None,
                 delta: torch.Tensor | None, keep: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def backward_into(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, dout: torch.Tensor, prepared: Any, softmax_scale: float | None,
                      delta: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None: ...


def check_running(name: str, acc: torch.Tensor, like: torch.Tensor, shape: tuple) -> None:
    """Raise ValueError unless running sum ``acc`` has ``shape`` and ``accumulate_dtype(like.dtype)``."""
    want = accumulate_dtype(like.dtype)
    if tuple(acc.shape) != tuple(shape) or acc.dtype != want:
        raise ValueError(f"{name} must be a {str(want).removeprefix('torch.')} tensor of shape {tuple(shape)} "
                         f"(accumulate_dtype of {like.dtype}), got {acc.dtype} {tuple(acc.shape)}")
