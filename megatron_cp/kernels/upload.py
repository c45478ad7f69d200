"""Host arrays to the device without a host synchronisation.

``torch.from_numpy(a).to(cuda)`` copies from pageable memory and then synchronises the stream: the host
waits until every kernel queued before it has run. The runtime uploads a new plan's index tensors and
kernel metadata (tens of small arrays per plan and rank) while the previous micro-batch's kernels are still
queued, so each such copy would drain the GPU's queue. ``upload`` stages the array in pinned memory (blocks kept by
this module, each reused once the copy out of it has run) and copies asynchronously on the current stream: later
work on that stream sees the data; the host does not wait. ``upload_all`` does that for
several arrays at once: one pinned block, one copy, and views of one device buffer (a new plan's first call
uploads a dozen or more small arrays, each a few dispatcher calls otherwise).
"""

from __future__ import annotations

import threading

import numpy as np
import torch


def upload(a, device) -> torch.Tensor:
    """``a`` (numpy array or tensor) as a tensor on ``device``: from the host to CUDA without a host
    synchronisation (pinned staging, ``non_blocking``); otherwise ``.to(device)`` (no copy where it is)."""
    t = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return _STAGING.copy(raw.nbytes, lambda blob: blob.__setitem__(slice(None), raw), device).view(t.dtype).view(
        t.shape)


class _Staging:
    """Pinned host blocks for uploads, each reused once the copy out of it has run (an event per block).

    Why not a ``torch.empty(..., pin_memory=True)`` per upload, filled by ``copy_`` from a packed array: on a GPU
    host that cost a new plan's first call over twice the time of these blocks, filled in place by numpy
    (docs/measurements.md); a block is pinned once per size (powers of two) the process meets."""

    def __init__(self):
        self.lock = threading.Lock()
        self.blocks: dict = {}  # device -> [[pinned uint8 tensor, its numpy view, event of its last copy or None]]

    def copy(self, n: int, fill, device: torch.device) -> torch.Tensor:
        """``n`` bytes that ``fill(block)`` writes into a pinned uint8 array of that length, as a new uint8 tensor on
        ``device``, copied asynchronously on that device's current stream."""
        stream = torch.cuda.current_stream(device)
        with self.lock:
            blocks = self.blocks.setdefault(stream.device, [])
            for b in blocks:  # smallest first: the smallest free block that fits
                if b[1].nbytes >= n and (b[2] is None or b[2].query()):
                    break
            else:
                size = max(1 << max(n - 1, 0).bit_length(), 1 << 16)  # powers of two: a few sizes serve any plan
                pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                b = [pinned, pinned.numpy(), None]
                blocks.append(b)
                blocks.sort(key=lambda x: x[1].nbytes)
            fill(b[1][:n])
            out = torch.empty(n, dtype=torch.uint8, device=device)
            out.copy_(b[0][:n], non_blocking=True)
            if b[2] is None:
                b[2] = torch.cuda.Event()
            b[2].record(stream)
        return out


_STAGING = _Staging()


ALIGN = 16  # bytes: each array of a packed upload starts at such an offset (what vector loads and FA4 assume)


def _layout(arrays) -> tuple[list, list, int]:
    """The arrays as contiguous numpy arrays (None kept), their spans (offset, dtype, shape) at ``ALIGN``-byte
    offsets and the bytes they take together."""
    spans, off, seen = [], 0, {}
    arrs = [None if a is None else np.ascontiguousarray(a.numpy() if isinstance(a, torch.Tensor) else a)
            for a in arrays]
    for i, a in enumerate(arrs):
        if a is None:
            spans.append(None)
            continue
        if id(a) in seen:  # one array passed twice (a map's rows and its inverse's): copied once, two views
            spans.append(spans[seen[id(a)]])
            arrs[i] = None
            continue
        seen[id(a)] = i
        spans.append((off, a.dtype, a.shape))
        off += -(-a.nbytes // ALIGN) * ALIGN
    return arrs, spans, max(off, ALIGN)


def _fill(blob: np.ndarray, arrs: list, spans: list) -> None:
    """Each array of ``_layout`` into ``blob`` at its span."""
    for a, sp in zip(arrs, spans):
        if a is not None and a.nbytes:
            blob[sp[0]:sp[0] + a.nbytes] = a.reshape(-1).view(np.uint8)


def pack(arrays) -> tuple[np.ndarray, list]:
    """``arrays`` (numpy arrays or None) in one uint8 buffer, each at an ``ALIGN``-byte offset; with the spans
    (offset, dtype, shape) ``unpack`` takes them back out by (None for None)."""
    arrs, spans, size = _layout(arrays)
    blob = np.zeros(size, dtype=np.uint8)
    _fill(blob, arrs, spans)
    return blob, spans


def unpack(buf: torch.Tensor, spans: list) -> list:
    """The tensors ``pack``'s spans describe, as views of ``buf`` (its uint8 copy, on any device): one view of the
    buffer per dtype, one slice per array (a new plan's first call unpacks tens of arrays; each view op costs the
    host microseconds)."""
    out, whole = [], {}
    for sp in spans:
        if sp is None:
            out.append(None)
            continue
        off, dtype, shape = sp
        full = whole.get(dtype)
        if full is None:
            full = whole[dtype] = buf.view(_TORCH_DTYPES.get(dtype) or torch.from_numpy(np.zeros(0, dtype)).dtype)
        n = 1
        for s in shape:
            n *= s
        i = off // dtype.itemsize
        t = full[i:i + n]
        out.append(t if len(shape) == 1 else t.view(shape))
    return out


_TORCH_DTYPES = {np.dtype(d): torch.from_numpy(np.zeros(0, d)).dtype
                 for d in (np.bool_, np.int8, np.uint8, np.int16, np.int32, np.int64, np.float16, np.float32,
                           np.float64)}


def upload_all(arrays, device) -> list:
    """Each of ``arrays`` (numpy arrays or None) as a tensor on ``device``: to CUDA packed into one pinned block
    and one copy, each a view of one device buffer at an ``ALIGN``-byte offset; elsewhere as ``upload``."""
    if torch.device(device).type != "cuda":
        return [None if a is None else upload(a, device) for a in arrays]
    arrs, spans, size = _layout(arrays)  # packed straight into the pinned block
    return unpack(_STAGING.copy(size, lambda blob: _fill(blob, arrs, spans), torch.device(device)), spans)
