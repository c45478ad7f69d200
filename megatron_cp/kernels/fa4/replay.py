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
and process. A forward the single-kernel record cannot serve (the interface made more than one compiled call, e.g.
FA4's tile-count prefix sum for more than 256 varlen sequences, or handed the kernel views of the given tensors) is
recorded as a program instead, as a backward is (``launch_program``).
"""

from __future__ import annotations

import sys

import torch

SLOTS = 5  # q, k, v, out, lse lead the compiled kernel's argument list
_CHECKED: dict = {}  # id(compiled kernel) (forward) or a program's shape (backward) -> whether its replay gave the
# interface's result (kernels live on in the interface's compile caches, so ids are not reused)
# (interface function, why) -> launch records that keep the interface on every call for that reason: each such call
# costs the host the interface's front (hundreds of us), so the backend's describe() shows them
REFUSED: dict = {}


def _refuse(fn, why: str) -> None:
    key = (getattr(fn, "__qualname__", type(fn).__name__), why)
    REFUSED[key] = REFUSED.get(key, 0) + 1


def refusals() -> list[dict]:
    """The launches this process keeps on FA4's interface on every call, by function and reason, with how many
    records (run and input signature) each reason took."""
    return [{"function": f, "why": w, "records": n} for (f, w), n in sorted(REFUSED.items())]


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


FWD_SLOTS = ("q", "k", "v", "out", "lse")


def launch(fn, tensors, replays: dict, scale: float, call, programs: dict, constants) -> None:
    """Run one launch on ``tensors`` (q, k, v, out, lse as the interface takes them): replayed where ``replays``
    (the run's, keyed by ``signature``) holds this signature's kernel, else through ``call(out, lse)`` (the
    interface, writing those), recording the kernel for the next time when ``fn`` (the interface function) has a
    compile cache. Where that record could not serve, ``programs`` (the run's) holds the launch recorded as a program
    (``launch_program``; ``constants`` as there)."""
    sig = signature(tensors, scale)
    got = replays.get(sig)
    if got is not None and _CHECKED.get(id(got[0]), True):
        kernel, rest = got
        kernel(*(t.detach() for t in tensors), *rest)
        if id(kernel) not in _CHECKED:  # its first replay in this process: against the interface's result
            out, lse = (t.detach().clone() for t in tensors[3:])
            call(out, lse)
            _CHECKED[id(kernel)] = _agree(tensors[3], out, True) and _agree(tensors[4], lse, True)
            if not _CHECKED[id(kernel)]:  # later calls take the program path (below), or the interface
                tensors[3].copy_(out)
                tensors[4].copy_(lse)
        return
    cache = getattr(fn, "compile_cache", None)
    # the one-kernel record could not serve, or its first replay differed from the interface's result (a kernel
    # reading a buffer its front allocates per call, e.g. a zero-filled counter: a program allocates it again)
    if sig in replays and (got is None or not _CHECKED.get(id(got[0]), True)):
        launch_program(fn, dict(zip(FWD_SLOTS, (t.detach() for t in tensors))), ("out", "lse"), programs, (scale,),
                       constants, call, exact=True)
        return
    if cache is None:  # no cache to record from (a stand-in)
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


# ---------------------------------------------------------------------------------------------- backward

# Every layer's backward makes the same compiled calls too (FA4's ``_flash_attn_bwd``: a preprocess, the main kernel,
# one to three postprocess conversions), through a longer front (~200 us of Python). Its calls also take buffers
# the front allocates per call (dq / dk / dv accumulators, dpsum, lse in log2, semaphores), some zero-filled. A
# backward launch is replayed as its recorded program: each argument that is a given tensor (or a view of one) is
# the same view of the next layer's tensor; each buffer the front allocated is allocated again (zero-filled where the
# front zero-filled it: accumulators), so that a program holds no memory between layers; tensors of the run itself
# (cu_seqlens, block lists) stay. A call whose arguments hold any other tensor (something the front computed from
# the inputs) is not replayed.

BWD_SLOTS = ("q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv", "dlse")


class _Allocations:
    """Stands in for ``torch`` in the interface's module during one recorded call: the tensors it allocates, and
    which of them it zero-filled."""

    def __init__(self, torch_module):
        self._torch, self.made = torch_module, []  # (tensor, zero-filled)

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def _keep(self, t, zero: bool):
        self.made.append((t, zero))
        return t

    def empty(self, *a, **k):
        return self._keep(self._torch.empty(*a, **k), False)

    def empty_like(self, *a, **k):
        return self._keep(self._torch.empty_like(*a, **k), False)

    def zeros(self, *a, **k):
        return self._keep(self._torch.zeros(*a, **k), True)

    def zeros_like(self, *a, **k):
        return self._keep(self._torch.zeros_like(*a, **k), True)


def _tensors(x):
    """The tensors inside ``x`` (nested tuples, lists, dicts, objects with tensor fields)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)
    elif hasattr(x, "__dict__") and not callable(x):
        for y in vars(x).values():
            if isinstance(y, (torch.Tensor, tuple, list, dict)):
                yield from _tensors(y)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _place(t: torch.Tensor, given: dict, made: list, constants: set):
    """Where a tensor argument comes from on a replay: ("slot", name, view) for a given tensor or a view starting
    where one starts; ("buf", index, view) for a view of the front's index-th allocation; ("keep", t) for the run's
    own tensors; None where it cannot be placed (inside a given tensor elsewhere, or computed by the front)."""
    view = (tuple(t.shape), t.stride())
    hits = [n for n, g in given.items() if g.data_ptr() == t.data_ptr()]
    if len(hits) > 1:  # two given tensors starting at one address: the one of the same shape and strides
        hits = [n for n in hits if (tuple(given[n].shape), given[n].stride()) == view]
    if len(hits) == 1:
        return ("slot", hits[0], view, t.storage_offset() - given[hits[0]].storage_offset())
    if hits or any(_storage(g) == _storage(t) for g in given.values()):
        return None
    for i, (b, _) in enumerate(made):
        if _storage(b) == _storage(t):
            return ("buf", i, view, t.storage_offset() - b.storage_offset())
    return ("keep", t) if _storage(t) in constants else None


def _program(calls, given: dict, made: list, constants):
    """(program, None): the recorded calls as a program, or (None, why) where one argument cannot be placed. Each
    step is the compiled function, its argument list with the run's own values in place, and the places to fill on a
    replay: (position, "slot" name or buffer index, view or None where the argument is the tensor itself)."""
    const = {_storage(t) for t in _tensors(constants)}
    steps, shape = [], []
    for j, (fn, args) in enumerate(calls):
        template, fills, kinds = [], [], []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                p = _place(a, given, made, const)
                if p is None:
                    return None, (f"argument {i} of compiled call {j + 1} of {len(calls)}: a tensor the interface "
                                  f"computed ({tuple(a.shape)} {a.dtype}), not a given tensor, a buffer it allocated "
                                  "or the run's own")
                kinds.append(p[:2] if p[0] != "keep" else ("keep",))
                if p[0] == "keep":
                    template.append(a)
                    continue
                base = given[p[1]] if p[0] == "slot" else made[p[1]][0]
                same = p[3] == 0 and p[2] == (tuple(base.shape), base.stride())
                template.append(None)
                fills.append((i, p[1], None if same else (p[2][0], p[2][1], p[3])))
            elif any(_place(t, given, made, const) != ("keep", t) for t in _tensors(a)):  # not rebuilt here
                return None, (f"argument {i} of compiled call {j + 1} of {len(calls)}: a {type(a).__name__} holding "
                              "tensors made per call")
            else:
                template.append(a)
                kinds.append(("keep",))
        steps.append((fn, template, tuple(fills)))
        shape.append((id(fn), tuple(kinds)))
    bufs = tuple((tuple(b.shape), b.stride(), b.dtype, b.device, zero) for b, zero in made)
    # what the first-replay check is kept by: the compiled kernels (they live on in the interface's caches) and how
    # each argument is placed
    return (tuple(steps), bufs, tuple(shape)), None


def _run(program, given: dict) -> None:
    steps, bufs, _ = program
    made = []
    for shape, stride, dtype, device, zero in bufs:
        b = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        made.append(b.zero_() if zero else b)
    for fn, template, fills in steps:
        args = list(template)
        for i, src, view in fills:
            t = given[src] if isinstance(src, str) else made[src]
            args[i] = t if view is None else t.as_strided(view[0], view[1], t.storage_offset() + view[2])
        fn(*args)


def _record(fn, call):
    """Run ``call()`` with every compile cache of ``fn``'s module recorded and its allocations seen: (calls, made),
    or None where the module has no compile caches (a stand-in without them)."""
    mod = sys.modules.get(getattr(fn, "__module__", None) or "")
    caches = [(o, o.compile_cache) for o in list(vars(mod).values())
              if getattr(o, "compile_cache", None) is not None] if mod is not None else []
    if not caches or getattr(mod, "torch", None) is not torch:
        call()
        return None
    calls, allocs = [], _Allocations(torch)
    for o, cache in caches:
        rec = Recorder(cache)
        rec.calls = calls  # one list: the calls in the order they ran, whichever cache served them
        o.compile_cache = rec
    mod.torch = allocs
    try:
        call()
    finally:
        mod.torch = torch
        for o, cache in caches:
            o.compile_cache = cache
    return calls, allocs.made


_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _agree(got: torch.Tensor, ref: torch.Tensor, exact: bool) -> bool:
    """The replay's output against the interface's, both written over the same prior contents: equal bits (cells
    no launch writes keep those contents, NaN included: an output's rows or keys outside the list are filled
    after the launch) or NaN in both (what the interface wrote there, the replay did too), and where they differ
    (``exact`` False: FA4's atomic dQ sums) finite and within their spread (units in the last place; a misplaced
    or stale argument is off by the whole magnitude)."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    if not got.numel():
        return True
    it = _INT_OF[got.element_size()]
    off = got.view(it) != ref.view(it)
    if got.is_floating_point():  # NaN in the same cell of both: a NaN's sign or payload bits may differ
        off &= ~(got.isnan() & ref.isnan())
    if not bool(off.any()):
        return True
    if exact:
        return False
    g, r = got[off].float(), ref[off].float()
    if not (bool(torch.isfinite(g).all()) and bool(torch.isfinite(r).all())):
        return False
    scale = ref.float().abs().nan_to_num(0.0, 0.0, 0.0).max()
    return float((g - r).abs().max()) <= 2.0 ** -5 * float(scale)


def launch_program(fn, given: dict, outputs: tuple, replays: dict, key: tuple, constants, call, exact: bool) -> None:
    """One launch on ``given`` ({slot name: tensor}; the ``outputs`` slots written): replayed where ``replays`` (the
    run's) holds a program for this signature, else through ``call(*outputs' tensors)`` (the interface), recording
    the program for the next time. ``constants``: the run's own arguments (a dict or list holding its cu_seqlens,
    block lists), whose tensors a program may keep (read only when recording). The first replay of each program shape
    in a process is checked against the interface (``exact``: bit for bit), and programs of that shape are used from
    then on only where they agreed."""
    sig = key + tuple((n, tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
                      for n, t in given.items())
    prog = replays.get(sig)
    if prog is not None and _CHECKED.get(prog[2], True):
        _run(prog, given)
        if prog[2] not in _CHECKED:
            ref = {n: given[n].clone() for n in outputs}
            call(*(ref[n] for n in outputs))
            _CHECKED[prog[2]] = all(_agree(given[n], ref[n], exact) for n in outputs)
            if not _CHECKED[prog[2]]:
                _refuse(fn, "the program's first replay differed from the interface's result")
                for n in outputs:
                    given[n].copy_(ref[n])
        return
    if sig in replays:  # recorded and not replayable, or its check failed
        call(*(given[n] for n in outputs))
        return
    got = _record(fn, lambda: call(*(given[n] for n in outputs)))
    if got is None or not got[0]:
        why = "no compile caches in the interface's module" if got is None else "no compiled call recorded"
        prog = None
    else:
        prog, why = _program(got[0], given, got[1], constants)
    if prog is None:
        _refuse(fn, why)
    replays[sig] = prog


def launch_bwd(fn, given: dict, replays: dict, key: tuple, constants, call, exact: bool) -> None:
    """One backward launch on ``given`` ({BWD_SLOTS name: tensor}; dq, dk, dv written): ``launch_program`` with
    ``call(dq, dk, dv)`` the interface."""
    launch_program(fn, given, ("dq", "dk", "dv"), replays, key, constants, call, exact)
