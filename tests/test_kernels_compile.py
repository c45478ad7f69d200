"""The runtime's row and merge kernels compiled for a Hopper GPU (sm90) on the CPU: Triton builds the cubin ahead of
time (its own ptxas), without a GPU. The CPU suite runs these kernels under Triton's interpreter, which accepts
code the compiler refuses (types, casts, shapes); a kernel that does not compile fails here, not on the next GPU.

The compile runs in a process of its own: this suite sets TRITON_INTERPRET=1 before Triton is imported, which makes
every ``triton.jit`` an interpreted function."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# each kernel's pointers (index arrays int64, data bf16 or fp32) and constexprs, as the runtime launches them
KERNELS = {
    "rows._copy_rows_kernel": ({"DST_IDX": "*i64", "SRC_IDX": "*i64"}, {"HAS_DST_IDX": True, "HAS_SRC_IDX": False,
                                                                       "BLOCK_R": 8, "BLOCK_W": 1024}),
    "rows._copy_row_pairs_kernel": ({"DST_IDX": "*i64", "SRC_IDX": "*i64"}, {"HAS_DST_IDX": False, "HAS_SRC_IDX": True,
                                                                             "BLOCK_R": 8, "BLOCK_W": 1024}),
    "rows._copy_two_row_pairs_kernel": ({"DI0": "*i64", "SI0": "*i64", "DI1": "*i64", "SI1": "*i64"},
                                        {"HAS_DI0": True, "HAS_SI0": False, "HAS_DI1": False, "HAS_SI1": True,
                                         "BLOCK_R": 8, "BLOCK_W": 1024}),
    "rows._reduce_rows_kernel": ({"ROWS": "*i64", "PTR": "*i64", "POS": "*i64"}, {"BLOCK_W": 1024}),
    "rows._reduce_row_pairs_kernel": ({"ROWS": "*i64", "PTR": "*i64", "POS": "*i64"}, {"BLOCK_W": 1024}),
    "merge._merge_kernel": ({"ACC": "*fp32", "LSE": "*fp32", "L": "*fp32", "L2": "*fp32"},
                            {"HEAD_DIM": 128, "BLOCK_R": 64, "REV": False, "TWO": True, "REV2": True, "FRESH": False}),
    "merge._merge_sources_kernel": ({"LSE": "*fp32", "ROWS": "*i64", "PARTS": "*fp32"},
                                    {"BLOCK_H": 16, "BLOCK_D": 128}),
}

COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_cp.kernels import merge, rows
out = {}
for name, (pointers, constexprs) in json.loads(sys.argv[1]).items():
    mod, attr = name.split(".")
    fn = getattr({"rows": rows, "merge": merge}[mod], attr)
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in pointers:
            sig[p.name] = pointers[p.name]
        else:  # data pointers (upper case) bf16; sizes and strides int32
            sig[p.name] = "*bf16" if p.name[0].isupper() else "i32"
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    out[name] = len(k.asm.get("cubin", b""))
print(json.dumps(out))
"""


def test_the_runtime_row_and_merge_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    got = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(KERNELS)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    sizes = json.loads(got.stdout.strip().splitlines()[-1])
    assert set(sizes) == set(KERNELS) and all(n > 0 for n in sizes.values()), sizes
