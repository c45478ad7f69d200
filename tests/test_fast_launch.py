"""kernels.fast_launch: its cache key separates every pair of arguments Triton specializes differently, so the
compiled kernel a key finds is the one Triton's own launch would pick; arguments bind as Triton binds them.

The launch itself needs a GPU (under Triton's CPU interpreter FastLaunch takes the generic path): there
tools/gpu_kernel_check.py --parts rows checks every kernel launched through it against torch, many calls a case."""

from __future__ import annotations

import itertools

import pytest
import torch
import triton.language as tl

triton_c = pytest.importorskip("triton._C.libtriton")
from triton.backends.compiler import BaseBackend  # noqa: E402

from megatron_cp.kernels import fast_launch  # noqa: E402
from megatron_cp.kernels.fast_launch import FastLaunch, arg_key  # noqa: E402

INTS = [0, 1, 2, 7, 15, 16, 17, 32, 48, 1000, 1024, (1 << 31) - 16, (1 << 31) - 1, 1 << 31, (1 << 31) + 16,
        -1, -16, -(1 << 31), -(1 << 31) - 1, (1 << 63) - 1, 1 << 63, (1 << 63) + 16]
FLOATS = [0.0, 1.0, 0.5, -3.25, 1e30]


def tensors():
    base = {dt: torch.zeros(256, dtype=dt) for dt in (torch.bfloat16, torch.float32, torch.int64, torch.int32)}
    return [t[o:] for t in base.values() for o in (0, 1, 2, 4, 8, 16)]


def triton_spec(v, specialize=True, align=True):
    return triton_c.native_specialize_impl(BaseBackend, v, False, specialize, align)


@pytest.mark.parametrize("plain_int, plain_ptr", [(False, False), (True, False), (False, True)])
def test_equal_keys_mean_equal_triton_specializations(plain_int, plain_ptr):
    values = INTS + FLOATS + [True, False, None] + tensors()
    groups: dict = {}
    for v in values:
        k = arg_key(v, False, plain_int, plain_ptr)
        assert k is not fast_launch._UNKNOWN
        groups.setdefault(k, []).append(v)
    for k, vs in groups.items():
        specs = {triton_spec(v, not plain_int, not plain_ptr) for v in vs}
        assert len(specs) == 1, (k, vs, specs)


def test_tensor_descriptors_key_at_least_as_finely_as_triton():
    from triton.tools.tensor_descriptor import TensorDescriptor
    descs = []
    blocks = ([16, 128], [64, 128], [64, 64])
    for dt, off, block in itertools.product((torch.bfloat16, torch.float16), (0, 1, 8), blocks):
        x = torch.zeros(300, 256, dtype=dt)[off:]
        descs.append(TensorDescriptor(x, [x.shape[0], 256], [x.stride(0), 1], block))
    groups: dict = {}
    for d in descs:
        groups.setdefault(arg_key(d, False), []).append(d)
    for k, ds in groups.items():
        assert len({triton_spec(d) for d in ds}) == 1, k
    assert len(groups) == 6  # dtype x block (row offsets of 512 bytes keep every base 16-byte aligned)


def test_constexprs_key_by_type_and_value():
    assert arg_key(True, True) != arg_key(1, True)
    assert arg_key(64, True) != arg_key(128, True) and arg_key(64, True) == arg_key(64, True)
    assert arg_key(object(), False) is fast_launch._UNKNOWN  # another kind: the generic path


def _kernel(X, Y, n, stride, FLAG: tl.constexpr, BLOCK: tl.constexpr = 64):
    pass


def test_arguments_bind_in_parameter_order_with_options_apart():
    # a JIT function made here: the suite runs Triton's interpreter, whose kernels are not JIT functions
    f = FastLaunch(fast_launch.JITFunction(_kernel))
    assert f.jit and f.const == (False, False, False, False, True, True)
    x = torch.zeros(4)
    full, opts = f._args((x, x, 5), dict(stride=16, FLAG=True, num_warps=4))
    assert full == [x, x, 5, 16, True, 64] and opts == {"num_warps": 4}  # BLOCK's default filled
    with pytest.raises(TypeError, match="FLAG"):
        f._args((x, x, 5, 16), {})
    assert f.key(full, opts) is None  # a CPU tensor never takes the fast path


def test_every_int_boundary_is_covered():
    # the key's int classes follow Triton's: ==1, %16, and the i32 / i64 / u64 ranges
    for a, b in itertools.combinations(INTS, 2):
        if arg_key(a, False) == arg_key(b, False):
            assert triton_spec(a) == triton_spec(b), (a, b)
