"""Staged, optionally hierarchical GroupCast / GroupReduce over precomputed routes.

A route (``runtime.schedule.Route``: its host part ``RouteIndex``, on a device ``DeviceRoute``) is one or two
all-to-all-v phases:
phase A (any rank to any rank; across nodes only to the rail-aligned relay) and, when hierarchical,
phase B (relays forward inside their node). ``cast_steps`` / ``reduce_steps`` are generators: each
``next()`` issues the next collective asynchronously and yields; the caller computes in between, so
communication of one stage overlaps computation of another. On CUDA, NCCL runs async collectives on
its own stream and ``wait()`` only orders the current stream after them; on CPU (gloo) the same code
runs with real async work handles.

All collectives are issued in the same order on every rank (the routes are the same on all ranks),
and a stage whose route moves nothing on any rank issues no collective anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .collectives import all_to_all_v


class BufferPool:
    """Reusable scratch storage keyed by (dtype, device, tag): bounded, no per-call allocation.

    ``get`` returns a view of one flat buffer per key, grown only when a larger shape is asked for,
    so the pool holds at most the largest request per tag. A tag must not be in use twice at once
    (the runtime tags by stage slot and phase; layers reuse the same buffers).
    """

    def __init__(self):
        self._bufs: dict = {}
        self._views: dict = {}  # key -> ((shape, parts), what get returned): every layer asks for the same

    def get(self, shape, dtype, device, tag, parts=None):
        """A [shape] view of the key's buffer. ``parts``: ((heads, dim), ...) of a [rows, sum(heads * dim)]
        buffer (``kv_rows``' layout): then (buffer, *its column blocks as [rows, heads, dim] views). What a key
        returned is returned again while the same shape and parts are asked for (every layer of a micro-batch asks
        for the same): a view op costs the host microseconds, and a layer call asks for several."""
        key = (dtype, str(device), tag)
        ask = (tuple(shape), parts)
        hit = self._views.get(key)
        if hit is not None and hit[0] == ask:
            return hit[1]
        n = 1
        for d in shape:
            n *= int(d)
        t = self._bufs.get(key)
        if t is None or t.numel() < n:
            t = torch.empty(max(n, 1), dtype=dtype, device=device)
            self._bufs[key] = t
        out = t[:n].view(ask[0])
        if parts is not None:
            out = (out, *column_blocks(out, parts))
        self._views[key] = (ask, out)
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._bufs.values())

    def clear(self) -> None:
        self._bufs.clear()
        self._views.clear()


def column_blocks(buf: torch.Tensor, parts) -> list:
    """The column blocks of ``buf`` [rows, sum(heads * dim)] as [rows, heads, dim] views, one per (heads, dim) of
    ``parts`` in order (K and V side by side in one row: ``runtime.attention.kv_rows``)."""
    views, c = [], 0
    for h, d in parts:
        views.append(buf[:, c:c + h * d].unflatten(1, (h, d)))
        c += h * d
    return views


_POOLS: dict = {}


def device_pool(device) -> BufferPool:
    """The communication scratch pool of ``device``: one per device, shared by every layer and plan
    (bounded by the largest request per tag)."""
    key = str(device)
    if key not in _POOLS:
        _POOLS[key] = BufferPool()
    return _POOLS[key]


@dataclass(frozen=True)
class RouteIndex:
    """A ``DeviceRoute``'s host part: its index arrays and counts (numpy), made anywhere (the planning helper
    process makes a new plan's ahead). ``b_send_idx`` / ``out_idx`` index ``cat[recvA, recvB]`` already."""

    n_local: int
    a_send_idx: np.ndarray
    a_send_counts: list
    a_recv_counts: list
    b_send_idx: np.ndarray | None
    b_send_counts: list | None
    b_recv_counts: list | None
    out_idx: np.ndarray
    out_identity: bool
    out_inv: np.ndarray | None

    @classmethod
    def of(cls, r) -> "RouteIndex":
        """Of a planned route ``r`` (``runtime.schedule.Route``)."""
        out = np.asarray(r.out_idx, dtype=np.int64) - r.n_local
        n_cat = int(sum(r.a_recv_counts)) + (int(sum(r.b_recv_counts)) if r.b_recv_counts is not None else 0)
        identity = len(out) == n_cat and bool(np.array_equal(out, np.arange(n_cat)))
        inv = None
        # a permutation: every place in range and taken once (a count per place: O(n), where np.unique's hashing
        # took milliseconds of a new plan's first call at tens of thousands of rows)
        if (not identity and len(out) == n_cat and n_cat and out.min() >= 0 and out.max() < n_cat
                and bool((np.bincount(out, minlength=n_cat) == 1).all())):
            inv = np.empty(n_cat, dtype=np.int64)
            inv[out] = np.arange(n_cat)
        return cls(
            n_local=r.n_local,
            a_send_idx=np.asarray(r.a_send_idx),
            a_send_counts=list(r.a_send_counts),
            a_recv_counts=list(r.a_recv_counts),
            b_send_idx=None if r.b_send_idx is None else r.b_send_idx - r.n_local,
            b_send_counts=None if r.b_send_counts is None else list(r.b_send_counts),
            b_recv_counts=None if r.b_recv_counts is None else list(r.b_recv_counts),
            out_idx=out,
            out_identity=identity,
            out_inv=inv,
        )


@dataclass
class DeviceRoute:
    """Index tensors of one route on one device (built once per plan). A remote stage never needs
    the rank's own rows, so ``b_send_idx``/``out_idx`` index ``cat[recvA, recvB]`` here."""

    n_local: int
    a_send_idx: torch.Tensor
    a_send_counts: list
    a_recv_counts: list
    b_send_idx: torch.Tensor | None
    b_send_counts: list | None
    b_recv_counts: list | None
    out_idx: torch.Tensor
    # the stage buffer is the received rows as they arrive (out_idx = arange): cast receives into it and
    # reduce sends from a gradient accumulated in it (``grad_buffer``), no gather and no scatter
    out_identity: bool = False
    # out_idx is a permutation (every received row placed once): the inverse permutation, with which
    # reduce gathers a gradient into arrival order instead of scattering it by index_add
    out_inv: torch.Tensor | None = None

    @classmethod
    def on(cls, h: "RouteIndex", device, upload_all) -> "DeviceRoute":
        """The route of ``h`` (a ``RouteIndex`` made elsewhere) on ``device``: its index arrays through
        ``upload_all(arrays, device)`` (the runtime passes ``kernels.upload_all``: one pinned block, one copy, no
        host synchronisation with the queued kernels)."""
        a_send, b_send, out, inv = upload_all([h.a_send_idx, h.b_send_idx, h.out_idx, h.out_inv], device)
        return cls(n_local=h.n_local, a_send_idx=a_send, a_send_counts=h.a_send_counts,
                   a_recv_counts=h.a_recv_counts, b_send_idx=b_send, b_send_counts=h.b_send_counts,
                   b_recv_counts=h.b_recv_counts, out_idx=out, out_identity=h.out_identity, out_inv=inv)

    @property
    def n_a(self) -> int:
        return sum(self.a_recv_counts)

    @property
    def n_b(self) -> int:
        return sum(self.b_recv_counts) if self.b_recv_counts is not None else 0


def _a2a_async(out, x, send_counts, recv_counts, group):
    return all_to_all_v(x, send_counts, recv_counts, group, out, async_op=True)[1]


# microseconds the compute stream waits after a collective is issued and before the kernel that is to
# overlap it (``comm_lead``; ``megatron_cp.attention(..., comm_lead_us=)``, 0 turns it off)
COMM_LEAD_US = 20.0


def comm_lead(device: torch.device, us: float = COMM_LEAD_US) -> None:
    """Give a collective just issued on NCCL's stream a head start over the kernel queued next on the
    compute stream: a spin of ``us`` microseconds on the compute stream (about 2 GHz assumed). Both become
    ready when the send buffer's gather completes; without the spin the attention kernel takes every
    multiprocessor first and NCCL's kernel, which needs a few, waits for its last wave: in back-to-back
    steps the staged causal forward's all-to-all started at the end of the first stage's
    14 ms cuDNN piece instead of beside it (over a high-priority NCCL stream too: that kernel's CTAs
    do not retire early), 1.2-12 ms exposed (docs/design.md). A no-op off CUDA."""
    spin = getattr(torch.cuda, "_sleep", None)  # torch's spin kernel (a testing hook; skipped if ever gone)
    if device.type == "cuda" and us > 0 and spin is not None:
        spin(int(us * 2000))


def cast_steps(x_local: torch.Tensor, route: DeviceRoute, group, out: torch.Tensor, pool: BufferPool | None, tag):
    """GroupCast generator: fills ``out`` ([buf_len, ...]) with the stage's rows, in stage order.

    x_local: [n_local, ...] contiguous. Yields after issuing each phase; finished when exhausted.
    """
    tail = tuple(x_local.shape[1:])
    get = _get(pool, x_local, x_local.dtype, tag)
    send = get((len(route.a_send_idx),) + tail, "a_send")
    torch.index_select(x_local, 0, route.a_send_idx, out=send)
    # rows arriving in stage order land in ``out`` itself
    cat = out if route.out_identity else get((route.n_a + route.n_b,) + tail, "cat")
    recv_a = cat[: route.n_a]
    work = _a2a_async(recv_a, send, route.a_send_counts, route.a_recv_counts, group)
    yield
    work.wait()
    if route.b_send_idx is not None:
        send_b = get((len(route.b_send_idx),) + tail, "b_send")
        torch.index_select(cat, 0, route.b_send_idx, out=send_b)
        work = _a2a_async(cat[route.n_a :], send_b, route.b_send_counts, route.b_recv_counts, group)
        yield
        work.wait()
    if not route.out_identity:
        torch.index_select(cat, 0, route.out_idx, out=out)


def _get(pool: BufferPool | None, like: torch.Tensor, dtype, tag):
    return (lambda shape, t: pool.get(shape, dtype, like.device, (tag, t))) if pool else (
        lambda shape, t: like.new_empty(shape, dtype=dtype))


def grad_buffer(route: DeviceRoute, tail: tuple, dtype, device, pool: BufferPool | None, tag) -> torch.Tensor:
    """A zeroed [buf_len, *tail] buffer of ``dtype`` to accumulate a stage's gradient rows in (stage order)
    before ``reduce_steps(buffer, route, ..., tag)``: with ``out_identity`` that call's own send buffer
    (the same pool slot), so the reduce sends it as it is."""
    n = len(route.out_idx)
    if route.out_identity and pool is not None:
        buf = pool.get((n,) + tuple(tail), dtype, device, (tag, "g_cat"))
    elif pool is not None:
        buf = pool.get((n,) + tuple(tail), dtype, device, (tag, "grad"))
    else:
        buf = torch.empty((n,) + tuple(tail), dtype=dtype, device=device)
    return buf.zero_()


def reduce_steps(grad: torch.Tensor, route: DeviceRoute, group, d_local: torch.Tensor, pool: BufferPool | None, tag):
    """GroupReduce generator (adjoint of ``cast_steps``): adds the stage's gradient rows ``grad``
    ([buf_len, ...], stage order) into their owners' ``d_local`` ([n_local, ...], accumulated in place,
    any float dtype). Relays pre-reduce their node's rows before they cross nodes. ``grad`` from
    ``grad_buffer`` with ``d_local``'s dtype is sent without a copy when the stage order is the arrival
    order, and gathered into arrival order when it is a permutation of it; otherwise scattered by adds."""
    tail = tuple(grad.shape[1:])
    acc = d_local.dtype
    get = _get(pool, grad, acc, tag)
    g_cat = get((route.n_a + route.n_b,) + tail, "g_cat")
    if route.out_identity and grad.data_ptr() == g_cat.data_ptr() and grad.dtype == acc:
        pass  # accumulated in the send buffer itself
    elif route.out_identity:
        g_cat.copy_(grad)
    elif route.out_inv is not None:
        torch.index_select(grad.to(acc), 0, route.out_inv, out=g_cat)
    else:
        g_cat.zero_()
        g_cat.index_add_(0, route.out_idx, grad.to(acc))
    na = route.n_a
    if route.b_send_idx is not None:
        back_b = get((len(route.b_send_idx),) + tail, "b_back")
        work = _a2a_async(back_b, g_cat[na:], route.b_recv_counts, route.b_send_counts, group)
        yield
        work.wait()
        g_cat.index_add_(0, route.b_send_idx, back_b)  # pre-reduce on the relay
    back_a = get((len(route.a_send_idx),) + tail, "a_back")
    work = _a2a_async(back_a, g_cat[:na], route.a_recv_counts, route.a_send_counts, group)
    yield
    work.wait()
    d_local.index_add_(0, route.a_send_idx, back_a)
