"""Guest rows at run time (``planner.guests``): query rows computed where their keys live.

Forward: each rank sends its guest rows' q to every rank holding keys they keep (itself included: a
local copy), each rank computes the received rows over its own keys in one kernel call and returns
the partial output (as the kernel wrote it, in q's dtype) with its LSE (float32; float64 for float64 inputs),
and the owner merges the partials by LSE in source order (deterministic) into the rows, which no other tile of
the plan covers.
Backward: the owner sends dout and out (q's dtype) with lse and delta, the key owner adds the dK/dV of
its own keys to its gradients and returns the partial dq, which the owner sums in source order.

The same two calls serve the single-exchange and the staged paths. Every rank joins the exchanges when
the plan has guest rows (collectives), also with nothing to send.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..comm import all_to_all_v, device_pool
from ..kernels import accumulate_dtype, merge, reduce_rows, upload_all
from ..planner import Plan
from .rowmap import grouped


@dataclass
class GuestRuntime:
    send: torch.Tensor  # local positions of guest rows to send, destination-major (int64)
    send_counts: list
    recv_counts: list
    rows: torch.Tensor  # the rank's guest rows (sorted local positions, unique)
    merge: list  # per source with rows: (slice of the returned rows, positions in ``rows``)
    prepared: object  # guest tiles (q: received rows, k: own keys in local order); None when none
    # returned partial dq summed into the guest rows: row i's partials are the returned rows red_pos[red_ptr[i] :
    # red_ptr[i + 1]], in source order (``kernels.reduce_rows``)
    red_ptr: torch.Tensor
    red_pos: torch.Tensor
    # every source returns every guest row in ``rows`` order (global rows of global + local: each key owner
    # computes them all): the returned rows are then [sources, rows] as they arrive, merged without gathers
    whole: bool = False
    # what a rank that computes no guest row sends back every call (its empty partials, its zero dq), made once per
    # shape and dtype: only ever read (sent), and each fresh one cost the host two or three ops per call
    constants: dict = field(default_factory=dict)


@dataclass
class GuestHost:
    """A ``GuestRuntime``'s host part (``guest_host``), made anywhere (the planning helper makes a new plan's
    ahead): the index arrays, counts and the guest tile list (q: received rows, k: own keys in local order)."""

    send: np.ndarray
    send_counts: list
    recv_counts: list
    rows: np.ndarray
    merge: list  # per source with rows: (slice of the returned rows, positions in ``rows``)
    red_ptr: np.ndarray  # the returned rows of each guest row, in source order (CSR over ``rows``)
    red_pos: np.ndarray
    whole: bool
    tiles: np.ndarray | None  # int32 [n, 5]; None when the rank computes no guest row
    n_recv: int
    n_tokens: int


def guest_host(plan: Plan, rank: int) -> GuestHost:
    """``rank``'s guest rows' host part (numpy)."""
    rp = plan.ranks[rank]
    send, send_counts = rp.guest_send_index()
    recv_counts = rp.guest_recv_counts()
    rows = np.unique(send)
    merge, off, whole = [], 0, len(rows) > 0
    for c in send_counts:
        if c:
            pos = np.searchsorted(rows, send[off:off + c])
            whole = whole and c == len(rows) and bool(np.array_equal(pos, np.arange(len(rows))))
            merge.append((slice(off, off + c), pos.astype(np.int64)))
        off += c
    n_recv = sum(recv_counts)
    tiles = rp.guest_tiles.astype("int32") if len(rp.guest_tiles) and n_recv else None
    # which returned rows add to which guest row, sources in order; every guest row comes back from each rank it
    # went to, so every one has a group
    dest = np.concatenate([pos for _, pos in merge] + [np.zeros(0, np.int64)])
    _, red_ptr, order = grouped(dest, len(rows))
    red_pos = np.concatenate([np.arange(sl.start, sl.stop) for sl, _ in merge] + [np.zeros(0, np.int64)])[order]
    return GuestHost(send.astype(np.int64), send_counts, recv_counts, rows.astype(np.int64), merge, red_ptr,
                     red_pos.astype(np.int64), whole, tiles, n_recv, rp.num_tokens)


def guest_list(h: GuestHost, prepare):
    """The guest tile list through ``prepare`` (a backend's ``prepare`` or ``prepare_host``); None: no list."""
    return None if h.tiles is None else prepare(torch.from_numpy(h.tiles), h.n_recv, h.n_tokens)


def guest_runtime(h: GuestHost, device, prepared) -> GuestRuntime:
    """Index tensors of ``h`` on ``device`` with the prepared guest list (part of the rank's runtime state,
    built once)."""
    t = upload_all([h.send, h.rows, h.red_ptr, h.red_pos] + [pos for _, pos in h.merge], device)
    return GuestRuntime(send=t[0], send_counts=h.send_counts, recv_counts=h.recv_counts, rows=t[1],
                        merge=[(sl, pos) for (sl, _), pos in zip(h.merge, t[4:])], prepared=prepared, red_ptr=t[2],
                        red_pos=t[3], whole=h.whole)


def _a2a(x, send_counts, recv_counts, group, async_op=False, tag=None):
    """All-to-all-v of rows; (result, handle or None) with ``async_op``. ``tag``: receive into the
    device's scratch pool under that tag (results read before the call returns: partials and dq)."""
    if group is None:  # one rank: everything it sends is what it receives
        return (x.contiguous(), None) if async_op else x.contiguous()
    out = None
    if tag is not None:
        pool = device_pool(x.device)
        out = pool.get((sum(recv_counts),) + tuple(x.shape[1:]), x.dtype, x.device, tag)
    return all_to_all_v(x.contiguous(), send_counts, recv_counts, group, out, async_op=async_op)


@dataclass
class _Pending:
    """A guest exchange in flight: its result buffer and handle (None when already complete)."""

    buf: torch.Tensor
    handle: object
    keep: tuple = ()  # tensors the exchange reads or the caller needs later

    def wait(self) -> torch.Tensor:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        return self.buf


def start_forward(gr: GuestRuntime, backend, q, k, v, group, scale) -> _Pending:
    """Send the guest rows' q, compute the received rows over the own keys and start sending the
    partials back (in flight while the caller runs its own tiles; NCCL's kernel is launched first)."""
    acc_dt = accumulate_dtype(q.dtype)
    gq = _a2a(q.index_select(0, gr.send), gr.send_counts, gr.recv_counts, group)  # index_select: less host work
    hq, d = q.shape[1], v.shape[2]
    # the partial and its lse side by side, one buffer to send, in the accumulation dtype (the owner merges them);
    # the partial as the kernel wrote it, in q's dtype (as FA4 writes every launch's): two ops on the host, where
    # accumulating into a fresh running pair took a dozen and a merge launch (docs/measurements.md)
    if gr.prepared is not None:  # rows with no cell here give 0 / -inf
        o, l = backend.forward(gq, k, v, gr.prepared, scale)
        part = torch.cat([o.to(acc_dt), l.to(acc_dt).unsqueeze(-1)], dim=-1)
    else:  # none received: the empty partial
        part = _constant(gr, "empty partial", (gq.shape[0], hq, d + 1), acc_dt, q.device)
    back, handle = _a2a(part, gr.recv_counts, gr.send_counts, group, async_op=True, tag="guest_out")
    return _Pending(back, handle, (part, gq))


def _constant(gr: GuestRuntime, what: str, shape: tuple, dtype, device) -> torch.Tensor:
    """``gr``'s kept ``what`` of ``shape`` and ``dtype``: zeros (an empty partial: its lse column -inf), made on first
    use. Sent, never written."""
    key = (what, shape, dtype)
    t = gr.constants.get(key)
    if t is None:
        t = torch.zeros(shape, dtype=dtype, device=device)
        if what == "empty partial":
            t[..., -1] = float("-inf")
        gr.constants[key] = t
    return t


def finish_forward(gr: GuestRuntime, pend: _Pending, out, lse) -> torch.Tensor:
    """Merge the returned partials (source order: the same sum on every run) into the guest rows of
    ``out`` / ``lse`` (0 / -inf there from the other tiles) in place; returns the received guest q
    (kept for backward)."""
    back = pend.wait()
    if gr.rows.shape[0]:
        # all sources at once: one kernel whatever their count (a pairwise merge per source was ~16 small kernels
        # each on the host's critical path)
        merge.merge_sources(out, lse, gr.rows, _sources(gr, back))
    return pend.keep[1]


def _sources(gr: GuestRuntime, back: torch.Tensor) -> torch.Tensor:
    """The returned partials as [sources, guest rows, H, D + 1]: a view when every source returned every row in
    order, else gathered, with lse -inf (no cell) in the rows a source did not return."""
    n, k = gr.rows.shape[0], len(gr.merge)
    if gr.whole:
        return back.view((k, n) + tuple(back.shape[1:]))
    parts = back.new_zeros((k, n) + tuple(back.shape[1:]))
    parts[..., -1] = float("-inf")
    for i, (sl, pos) in enumerate(gr.merge):
        parts[i].index_copy_(0, pos, back[sl])
    return parts


def start_backward(gr: GuestRuntime, backend, gq, k, v, out, lse, dout, dlse, group, scale):
    """Send dout and out (q's dtype) with lse and dlse of the guest rows, compute the received rows'
    gradients over the own keys and start sending the partial dq back; returns (pending dq, dk, dv)
    with dk / dv [s_local, Hkv, D] of the own keys (None when this rank computed no guest cell)."""
    acc_dt = accumulate_dtype(out.dtype)
    hq = out.shape[1]
    sel = gr.send
    od = _a2a(torch.cat([dout.index_select(0, sel), out.index_select(0, sel).to(dout.dtype)], dim=1), gr.send_counts,
              gr.recv_counts, group)
    ls = lse.index_select(0, sel).to(acc_dt)
    ld = torch.stack([ls, dlse.index_select(0, sel).to(acc_dt) if dlse is not None else torch.zeros_like(ls)], dim=-1)
    ld = _a2a(ld, gr.send_counts, gr.recv_counts, group)
    dk = dv = None
    if gr.prepared is not None:
        g_dout, g_out = od[:, :hq], od[:, hq:]
        delta = None  # rowsum(dout * out) from the shipped rows (dense pieces may then run on cuDNN)
        if dlse is not None:
            delta = (g_dout.to(acc_dt) * g_out.to(acc_dt)).sum(-1) - ld[..., 1]
        dqp, dk, dv = backend.backward(gq, k, v, g_out, ld[..., 0], g_dout, gr.prepared, scale, delta)
        dqp = dqp.to(dout.dtype)
    else:
        dqp = _constant(gr, "zero dq", tuple(gq.shape), dout.dtype, dout.device)  # q's head dim (v's may differ: MLA)
    back, handle = _a2a(dqp, gr.recv_counts, gr.send_counts, group, async_op=True, tag="guest_dq")
    return _Pending(back, handle, (dqp,)), dk, dv


def finish_backward(gr: GuestRuntime, pend: _Pending, dq: torch.Tensor) -> None:
    """Add the returned partial dq of the guest rows into ``dq`` [s_local, Hq, D]: each row and its partials summed in
    float32 (float64 for float64) in source order, rounded once."""
    back = pend.wait()
    if gr.rows.shape[0]:  # one launch on a GPU, whatever the sources
        reduce_rows(dq, back, gr.rows, gr.red_ptr, gr.red_pos)
