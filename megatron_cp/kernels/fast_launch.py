"""Triton launches that cost the host the launch alone.

``kernel[grid](...)`` runs Triton's generic path on every call: bind the arguments, work out each one's
specialization (dtype, 16-byte alignment, ints equal to 1 or divisible by 16), build a cache key from them and the
options, look the compiled kernel up, then launch. The runtime's row moves and merges make several such small
launches per layer call with arguments of the same kinds every time, so that generic path is a large part of a
layer call's host time. ``FastLaunch`` keys its own cache on exactly the properties Triton specializes on, in
one pass over the arguments, and launches the compiled kernel Triton returned for the first call of that key
(``CompiledKernel[grid](...)``): what Triton would have launched, without its front end.

What Triton specializes on (``native_specialize_impl``; tests/test_fast_launch.py checks the key against it):
a tensor's dtype and whether its address is a multiple of 16; an int's type (i32 / i64 / u64 by range), whether
it equals 1 (it becomes a constant) and whether it is a multiple of 16; a constexpr's value; floats, bools and
None by type or value; a tensor descriptor's dtype and block shape (its base's alignment too: a key may be more
specific than Triton's, never less). An argument of any other kind, a CPU tensor, or Triton's interpreter: the
generic path.
"""

from __future__ import annotations

import inspect

import torch
import triton
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

# from Triton 3.3 a compiled kernel's launcher takes every parameter, constexprs included, in order (before: the
# others only); earlier versions take the generic path
_ALL_ARGS = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 3)

_I32 = (-(1 << 31), 1 << 31)
_I64 = (-(1 << 63), 1 << 63)


def _int_key(v: int):
    kind = 0 if _I32[0] <= v < _I32[1] else 1 if _I64[0] <= v < _I64[1] else 2
    return (kind, v == 1, v % 16 == 0)


_UNKNOWN = object()


def arg_key(v, const: bool, plain_int: bool = False, plain_ptr: bool = False):
    """One argument's part of the key: equal keys, equal Triton specializations (``_UNKNOWN``: a kind not
    handled here)."""
    if const:
        return ("c", type(v), v)
    if isinstance(v, torch.Tensor):
        return (v.dtype, None if plain_ptr else v.data_ptr() % 16 == 0)
    if isinstance(v, bool) or v is None:
        return ("v", v)
    if isinstance(v, int):
        return _int_key(v)[:1] if plain_int else _int_key(v)
    if isinstance(v, float):
        return float
    if isinstance(v, TensorDescriptor):  # Triton: its dtype and block shape (the base's alignment: more specific)
        return ("td", v.base.dtype, tuple(v.block_shape), v.base.data_ptr() % 16 == 0,
                getattr(v, "padding", None), getattr(v, "round_f32_to_tf32", None))
    return _UNKNOWN


class FastLaunch:
    """``FastLaunch(kernel)[grid](*args, **kwargs)`` launches like ``kernel[grid](*args, **kwargs)``.

    ``grid``: a tuple of ints (no callable). Keyword arguments are the kernel's parameters not given
    positionally and Triton's launch options (``num_warps``, ``num_stages``)."""

    def __init__(self, fn):
        self.fn = fn
        self.jit = _ALL_ARGS and isinstance(fn, JITFunction)
        params = fn.params if self.jit else ()
        self.names = tuple(p.name for p in params)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.const = tuple(p.is_constexpr for p in params)
        self.plain_int = tuple(p.do_not_specialize for p in params)
        self.plain_ptr = tuple(p.do_not_specialize_on_alignment for p in params)
        self.defaults = tuple(p.default for p in params)
        self.compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _args(self, args, kwargs):
        """All parameters in order (defaults filled), and the launch options."""
        if len(args) == len(self.names) and not kwargs:
            return list(args), {}
        full = list(args) + [None] * (len(self.names) - len(args))
        given = [True] * len(args) + [False] * (len(self.names) - len(args))
        opts = {}
        for name, val in kwargs.items():
            i = self.index.get(name)
            if i is None:
                opts[name] = val
            else:
                full[i], given[i] = val, True
        for i, g in enumerate(given):
            if not g:
                d = self.defaults[i]
                if d is inspect.Parameter.empty:
                    raise TypeError(f"{self.fn}: missing argument {self.names[i]!r}")
                full[i] = d
        return full, opts

    def key(self, full: list, opts: dict):
        """What Triton's specialization of these arguments depends on, or None (an argument this does not
        know, or a CPU tensor): the generic path then."""
        out = []
        for i, v in enumerate(full):
            if isinstance(v, torch.Tensor) and not v.is_cuda or isinstance(v, TensorDescriptor) and not v.base.is_cuda:
                return None
            k = arg_key(v, self.const[i], self.plain_int[i], self.plain_ptr[i])
            if k is _UNKNOWN:
                return None
            out.append(k)
        return (torch.cuda.current_device(), tuple(sorted(opts.items())), tuple(out))

    def launch(self, grid, args, kwargs) -> None:
        key = None
        if self.jit:
            full, opts = self._args(args, kwargs)
            key = self.key(full, opts)
        if key is None:
            self.fn[grid](*args, **kwargs)
            return
        k = self.compiled.get(key)
        if k is None:  # Triton's own path compiles (or finds) and launches it; later calls of the key reuse it
            k = self.fn.run(*full, grid=grid, warmup=False, **opts)
            if k is not None:
                self.compiled[key] = k
            return
        k[tuple(grid) + (1,) * (3 - len(grid))](*full)
