"""FA4 launches replayed: the compiled kernel and its arguments of one launch, recorded once per run and input
signature, called again with the next layer's tensors.

flash_attn.cute's ``_flash_attn_fwd`` spends a few hundred microseconds of Python per call (argument checks, the
kernel's compile key, scheduling metadata) before it calls the compiled kernel with a flat argument list. Every
layer of a micro-batch calls the same launches (the plan's runs) on tensors of the same shapes, strides and dtype,
so after the first call the list is known but for the first five places: q, k, v, out and lse. ``Recorder`` catches
the list on a normal call (the interface's compile cache, wrapped for that call); a launch is replayed only when
exactly one compiled call was made and its first five arguments were views of exactly the tensors passed in (FA4
did not copy, reshape or split them), else the signature keeps the normal path. The other arguments (cu_seqlens,
windows, block-sparse lists, scheduling metadata) depend on the run alone and stay as recorded.

The first replay of each compiled kernel in a process is checked: the launch runs both ways, into the caller's
out / lse and into scratch copies, and the kernel is replayed from then on only where the two agree bit for bit
(FA4's forward is deterministic); else that kernel always takes the interface. One host synchronisation per kernel
and process.
"""

from __future__ import annotations

import torch

SLOTS = 5  # q, k, v, out, lse lead the compiled kernel's argument list
_CHECKED: dict = {}  # id(compiled kernel) -> whether its replay gave the interface's result (kernels live on in
# the interface's compile cache, so ids are not reused)


class Recorder:
    """Stands in for the interface's compile cache during one call, recording each compiled call made."""

    def __init__(self, cache):
        self.cache, self.calls = cache, []

    def __contains__(self, key):
        return key in self.cache

    def __setitem__(self, key, value):
        self.cache[key] = value

    def __getitem__(self, key):
        fn = self.cache[key]

        def call(*args):
            self.calls.append((fn, args))
            return fn(*args)

        return call

    def __getattr__(self, name):
        return getattr(self.cache, name)


def signature(tensors, scale) -> tuple:
    """What must match for a recorded launch to serve: each tensor's shape, strides, dtype, device and 16-byte
    alignment (what FA4 compiled for), and the softmax scale."""
    return (scale,) + tuple((tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) for t in tensors)


def _same(a, b: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape \
        and a.stride() == b.stride() and a.dtype == b.dtype


def launch(fn, tensors, replays: dict, scale: float, call) -> None:
    """Run one launch on ``tensors`` (q, k, v, out, lse as the interface takes them): replayed where ``replays``
    (the run's, keyed by ``signature``) holds this signature's kernel, else through ``call(out, lse)`` (the
    interface, writing those), recording the kernel for the next time when ``fn`` (the interface function) has a
    compile cache."""
    sig = signature(tensors, scale)
    got = replays.get(sig)
    if got is not None and _CHECKED.get(id(got[0]), True):
        kernel, rest = got
        kernel(*(t.detach() for t in tensors), *rest)
        if id(kernel) not in _CHECKED:  # its first replay in this process: against the interface's result
            out, lse = (t.detach().clone() for t in tensors[3:])
            call(out, lse)
            _CHECKED[id(kernel)] = torch.equal(out, tensors[3]) and torch.equal(lse, tensors[4])
            if not _CHECKED[id(kernel)]:
                tensors[3].copy_(out)
                tensors[4].copy_(lse)
        return
    cache = getattr(fn, "compile_cache", None)
    if cache is None or sig in replays:  # no cache to record from (a stand-in), or not replayable
        call(tensors[3], tensors[4])
        return
    rec = Recorder(cache)
    fn.compile_cache = rec
    try:
        call(tensors[3], tensors[4])
    finally:
        fn.compile_cache = cache
    ok = len(rec.calls) == 1 and len(rec.calls[0][1]) > SLOTS and all(
        _same(a, t) for a, t in zip(rec.calls[0][1][:SLOTS], tensors))
    # the tensors' places are left empty: the record must not keep the first layer's tensors alive
    replays[sig] = (rec.calls[0][0], rec.calls[0][1][SLOTS:]) if ok else None
