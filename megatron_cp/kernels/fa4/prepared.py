"""An FA4 tile list's launches, prepared on the host: ``prepare_list`` turns a rank's tiles into FA4 calls
(``calls.fa4_calls``) and ``Fa4Prepared`` keeps them with the device metadata built per (device, direction,
route) on first use.

``prepare_list`` is host work only, a module function with a picklable result, so a new plan's lists can be
prepared ahead in the planning helper process (``runtime.plan_in_helper``): ``FA4Backend.prepare_host`` is a
``HostPrepare`` of it, which in a process that has run lists on the Triton fallback also prepares each list's Triton
form there (with its block schedules), rather than on the step's thread when a list first routes to Triton.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from . import sparse as fa4_sparse
from .calls import BLOCK, Fa4Calls, fa4_calls
from ..tiles import check_tiles
from ..upload import upload_all

DEFAULT_HEAD_DIMS = ()  # the Triton fallback's schedules built on first use, per block shape


@dataclass(frozen=True)
class Run:
    """One FA4 launch: ``dense`` (batch layout, no cu_seqlens) or varlen, its keyword arguments (device
    tensors included) and the rows / keys it writes."""

    dense: bool
    kw: dict
    row_spans: tuple
    key_spans: tuple
    # the forward's compiled kernel and arguments per input signature (replay.launch): every layer of a
    # micro-batch calls the run on tensors of the same shapes
    replays: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    bwd_replays: dict = field(default_factory=dict, compare=False, hash=False, repr=False)  # replay.launch_bwd's
    # the forward recorded as a program where its one-kernel record cannot serve (replay.launch_program)
    fwd_programs: dict = field(default_factory=dict, compare=False, hash=False, repr=False)


@dataclass
class Fa4Prepared:
    calls: Fa4Calls
    tiles: torch.Tensor
    head_dims: tuple
    _device: dict = field(default_factory=dict)  # (device, direction) -> [Run]
    _triton: object = None  # the Triton fallback's prepared list, built on first fallback
    _sparse: object = None  # fa4_sparse.SparseStatic, built on the first call with a BlockKeep
    _routes: dict = field(default_factory=dict)  # input signature -> (route, reason): measured.list_route

    # pickled (the planning helper's answers) with the tiles as an array: a tensor unpickles an order of magnitude
    # slower, in the planning thread, holding the GIL the step needs
    def __getstate__(self) -> dict:
        return dict(self.__dict__, tiles=self.tiles.numpy())

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d, tiles=torch.from_numpy(d["tiles"]))

    def sparse(self) -> "fa4_sparse.SparseStatic":
        """The list's per-head block-sparse static part (host, built once)."""
        if self._sparse is None:
            self._sparse = fa4_sparse.sparse_static(self.tiles.numpy(), self.seqlen_q, self.seqlen_k)
        return self._sparse

    @property
    def seqlen_q(self) -> int:
        return self.calls.seqlen_q

    @property
    def seqlen_k(self) -> int:
        return self.calls.seqlen_k

    def runs(self, direction: str, device, fns, route: str) -> list[Run]:
        """The direction's launches by ``route`` ("varlen" / "blocks"), built once per (device, direction, route)."""
        key = (str(device), direction, route)
        got = self._device.get(key)
        if got is not None:
            return got
        c = self.calls
        if route == "blocks":
            b = c.blocks
            lists = b.fwd if direction == "fwd" else b.bwd
            mask_key, aux = b.mask(direction)
            *t, aux = upload_all(list(lists) + [aux], device)
            t = [a[None, None] for a in t]  # heads and batch broadcast
            kw = {"block_sparse_tensors": fns.block_sparse(*t, block_size=(BLOCK, BLOCK))}
            if b.band is not None:
                kw["mask_mod"] = fns.band_mask(*b.band)
            else:
                kw.update(mask_mod=fns.interval_masks[mask_key], aux_tensors=[aux])
            got = [Run(True, kw, ((0, c.seqlen_q),), ((0, c.seqlen_k),))]
        else:
            got = []
            calls = c.fwd if direction == "fwd" else c.bwd
            arrays = [{} if call.dense else call.arrays() for call in calls]
            dev = iter(upload_all([a for d in arrays for a in d.values()], device))  # every call's arrays, one copy
            for call, names in zip(calls, arrays):
                kw = {"causal": call.causal, "window_size_left": None if call.causal else call.left,
                      "window_size_right": None if call.causal else call.right}
                if not call.dense:
                    kw.update({n: next(dev) for n in names})
                    kw.update(max_seqlen_q=call.max_q, max_seqlen_k=call.max_k)
                got.append(Run(call.dense, kw, tuple(call.row_spans()), tuple(call.key_spans())))
        self._device[key] = got
        return got


def prepare_list(tiles, seqlen_q: int, seqlen_k: int, head_dims=DEFAULT_HEAD_DIMS) -> Fa4Prepared:
    """tiles int [n, 5] (tensor or array, host) -> the list's FA4 calls (``fa4_calls``); the Triton fallback's
    schedules are built on its first use. What ``FA4Backend.prepare`` returns, made anywhere."""
    tiles = torch.from_numpy(np.ascontiguousarray(tiles)) if isinstance(tiles, np.ndarray) else tiles
    check_tiles(tiles, seqlen_q, seqlen_k)
    tiles = tiles.to("cpu", torch.int32).contiguous()
    calls = fa4_calls(tiles.numpy(), seqlen_q, seqlen_k)
    for c in (*calls.fwd, *calls.bwd):
        c.area  # noqa: B018  (cached: made wherever the list is, e.g. the helper, not on a first call's thread)
    return Fa4Prepared(calls, tiles, tuple(head_dims))


@dataclass(frozen=True)
class HostPrepare:
    """``FA4Backend.prepare_host``: ``prepare_list`` as a picklable callable ``(tiles, seqlen_q, seqlen_k)``. With
    ``triton`` (the Triton fallback's own ``prepare_host``; given where this process has routed some list to Triton)
    each list's Triton form is prepared too, which the fallback then takes instead of preparing it on first use. Its
    ``name`` is ``prepare_list``'s: the lists are the same with or without the Triton form, a cache of it."""

    triton: object = None

    @property
    def name(self) -> str:
        return f"{prepare_list.__module__}.{prepare_list.__qualname__}"

    def with_head_dims(self, head_dims) -> "HostPrepare":
        """The same, the Triton form's block schedules built for ``head_dims`` (the calls')."""
        return self if self.triton is None else dataclasses.replace(self, triton=self.triton.with_head_dims(head_dims))

    def __call__(self, tiles, seqlen_q: int, seqlen_k: int) -> Fa4Prepared:
        prep = prepare_list(tiles, seqlen_q, seqlen_k)
        if self.triton is not None:
            prep._triton = self.triton(prep.tiles, seqlen_q, seqlen_k)
        return prep
