"""Host arrays to the device without a host synchronisation.

``torch.from_numpy(a).to(cuda)`` copies from pageable memory and then synchronises the stream: the host
waits until every kernel queued before it has run. The runtime uploads a new plan's index tensors and
kernel metadata (tens of small arrays per plan and rank) while the previous micro-batch's kernels are still
queued, so each such copy would drain the GPU's queue. ``upload`` stages the array in pinned memory (torch's
caching host allocator, which keeps the block until the copy has run) and copies asynchronously on the
current stream: later work on that stream sees the data; the host does not wait. ``upload_all`` does that for
several arrays at once: one pinned block, one copy, and views of one device buffer (a new plan's first call
uploads a dozen or more small arrays, each a few dispatcher calls otherwise).
"""

from __future__ import annotations

import numpy as np
import torch


def upload(a, device) -> torch.Tensor:
    """``a`` (numpy array or tensor) as a tensor on ``device``: from the host to CUDA without a host
    synchronisation (pinned staging, ``non_blocking``); otherwise ``.to(device)`` (no copy where it is)."""
    t = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    # a pinned block of the caching host allocator filled here: Tensor.pin_memory() asks the driver first whether
    # the source is pinned (cudaPointerGetAttributes), a cost per array that a new plan's tens of uploads add up
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    staged.copy_(t)
    return staged.to(device, non_blocking=True)


ALIGN = 16  # bytes: each array of a packed upload starts at such an offset (what vector loads and FA4 assume)


def pack(arrays) -> tuple[np.ndarray, list]:
    """``arrays`` (numpy arrays or None) in one uint8 buffer, each at an ``ALIGN``-byte offset; with the spans
    (offset, dtype, shape) ``unpack`` takes them back out by (None for None)."""
    spans, off = [], 0
    arrs = [None if a is None else np.ascontiguousarray(a.numpy() if isinstance(a, torch.Tensor) else a)
            for a in arrays]
    for a in arrs:
        if a is None:
            spans.append(None)
            continue
        spans.append((off, a.dtype, a.shape))
        off += -(-a.nbytes // ALIGN) * ALIGN
    blob = np.zeros(max(off, ALIGN), dtype=np.uint8)
    for a, sp in zip(arrs, spans):
        if a is not None and a.nbytes:
            blob[sp[0]:sp[0] + a.nbytes] = a.reshape(-1).view(np.uint8)
    return blob, spans


def unpack(buf: torch.Tensor, spans: list) -> list:
    """The tensors ``pack``'s spans describe, as views of ``buf`` (its uint8 copy, on any device)."""
    out = []
    for sp in spans:
        if sp is None:
            out.append(None)
            continue
        off, dtype, shape = sp
        n = int(np.prod(shape, dtype=np.int64))
        tdt = torch.from_numpy(np.zeros(0, dtype=dtype)).dtype
        out.append(buf[off:off + n * dtype.itemsize].view(tdt).view(shape))
    return out


def upload_all(arrays, device) -> list:
    """Each of ``arrays`` (numpy arrays or None) as a tensor on ``device``: to CUDA in one pinned block and one
    copy (``upload``), each a view of one device buffer at an ``ALIGN``-byte offset; elsewhere as ``upload``."""
    if torch.device(device).type != "cuda":
        return [None if a is None else upload(a, device) for a in arrays]
    blob, spans = pack(arrays)
    return unpack(upload(blob, device), spans)
