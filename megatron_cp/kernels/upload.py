"""Host arrays to the device without a host synchronisation.

``torch.from_numpy(a).to(cuda)`` copies from pageable memory and then synchronises the stream: the host
waits until every kernel queued before it has run. The runtime uploads a new plan's index tensors and
kernel metadata (tens of small arrays per plan and rank) while the previous micro-batch's kernels are still
queued, so each such copy would drain the GPU's queue. ``upload`` stages the array in pinned memory (torch's
caching host allocator, which keeps the block until the copy has run) and copies asynchronously on the
current stream: later work on that stream sees the data; the host does not wait.
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
