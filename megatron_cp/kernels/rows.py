"""Indexed row moves for the communication runtime: a row copy and a fixed-order row reduce.

The runtime places received K/V rows into the key buffer and adds returned partial dK/dV rows into
the owners' gradients. PyTorch's ``index_put_`` / ``index_add_`` do that far below the memory bandwidth
for rows of a few KB (docs/measurements.md), because they address every element separately. These kernels move whole rows with
vector loads, and the reduce sums each destination row's partials in one pass, in a fixed order
(deterministic), in fp32, rounding once.

Tensors are ``[rows, ...]`` whose trailing dims form one dense block per row, with any row stride (e.g. the K
half of a ``[rows, 2 * Hkv * D]`` receive buffer, viewed as [rows, Hkv, D]): a kernel reads a row as ``width``
contiguous elements. CPU tensors use torch index ops
(same results), except under ``TRITON_INTERPRET=1`` when ``use_triton=True`` is asked for (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 8


@triton.jit
def _row_block(DST_IDX, SRC_IDX, n, HAS_DST_IDX: tl.constexpr, HAS_SRC_IDX: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's BLOCK_R rows: (destination rows, source rows, in range), each through its index or itself."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < n
    if HAS_DST_IDX:
        dr = tl.load(DST_IDX + r, mask=ok, other=0).to(tl.int64)
    else:
        dr = r.to(tl.int64)
    if HAS_SRC_IDX:
        sr = tl.load(SRC_IDX + r, mask=ok, other=0).to(tl.int64)
    else:
        sr = r.to(tl.int64)
    return dr, sr, ok


@triton.jit
def _move_rows(DST, SRC, dr, sr, ok, width, stride_d, stride_s, BLOCK_W: tl.constexpr):
    for w0 in range(0, width, BLOCK_W):
        c = w0 + tl.arange(0, BLOCK_W)
        m = ok[:, None] & (c < width)[None, :]
        x = tl.load(SRC + sr[:, None] * stride_s + c[None, :], mask=m)
        tl.store(DST + dr[:, None] * stride_d + c[None, :], x.to(DST.dtype.element_ty), mask=m)


@triton.jit
def _copy_rows_kernel(DST, SRC, DST_IDX, SRC_IDX, n, width, stride_d, stride_s, HAS_DST_IDX: tl.constexpr,
                      HAS_SRC_IDX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    dr, sr, ok = _row_block(DST_IDX, SRC_IDX, n, HAS_DST_IDX, HAS_SRC_IDX, BLOCK_R)
    _move_rows(DST, SRC, dr, sr, ok, width, stride_d, stride_s, BLOCK_W)


@triton.jit
def _copy_row_pairs_kernel(DA, SA, DB, SB, DST_IDX, SRC_IDX, n, width_a, width_b, stride_da, stride_sa, stride_db,
                           stride_sb, HAS_DST_IDX: tl.constexpr, HAS_SRC_IDX: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_W: tl.constexpr):
    # program_id(1) picks the pair: K and V (or dK and dV) through the same row indices in one launch
    dr, sr, ok = _row_block(DST_IDX, SRC_IDX, n, HAS_DST_IDX, HAS_SRC_IDX, BLOCK_R)
    if tl.program_id(1) == 0:
        _move_rows(DA, SA, dr, sr, ok, width_a, stride_da, stride_sa, BLOCK_W)
    else:
        _move_rows(DB, SB, dr, sr, ok, width_b, stride_db, stride_sb, BLOCK_W)


@triton.jit
def _copy_two_row_pairs_kernel(DA0, SA0, DB0, SB0, DI0, SI0, n0, wa0, wb0, sda0, ssa0, sdb0, ssb0,
                               DA1, SA1, DB1, SB1, DI1, SI1, n1, wa1, wb1, sda1, ssa1, sdb1, ssb1,
                               HAS_DI0: tl.constexpr, HAS_SI0: tl.constexpr, HAS_DI1: tl.constexpr,
                               HAS_SI1: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    # program_id(1): 0 / 1 the first move's pair (K, V), 2 / 3 the second's; rows past a move's n are masked
    p = tl.program_id(1)
    if p < 2:
        dr, sr, ok = _row_block(DI0, SI0, n0, HAS_DI0, HAS_SI0, BLOCK_R)
        if p == 0:
            _move_rows(DA0, SA0, dr, sr, ok, wa0, sda0, ssa0, BLOCK_W)
        else:
            _move_rows(DB0, SB0, dr, sr, ok, wb0, sdb0, ssb0, BLOCK_W)
    else:
        dr, sr, ok = _row_block(DI1, SI1, n1, HAS_DI1, HAS_SI1, BLOCK_R)
        if p == 2:
            _move_rows(DA1, SA1, dr, sr, ok, wa1, sda1, ssa1, BLOCK_W)
        else:
            _move_rows(DB1, SB1, dr, sr, ok, wb1, sdb1, ssb1, BLOCK_W)


@triton.jit
def _reduce_row(DST, PARTS, ROWS, PTR, POS, i, width, stride_d, stride_p, BLOCK_W: tl.constexpr):
    row = tl.load(ROWS + i).to(tl.int64)
    p0 = tl.load(PTR + i)
    p1 = tl.load(PTR + i + 1)
    for w0 in range(0, width, BLOCK_W):
        c = w0 + tl.arange(0, BLOCK_W)
        m = c < width
        acc = tl.load(DST + row * stride_d + c, mask=m, other=0.0).to(tl.float32)
        for j in range(p0, p1):
            pr = tl.load(POS + j).to(tl.int64)
            acc += tl.load(PARTS + pr * stride_p + c, mask=m, other=0.0).to(tl.float32)
        tl.store(DST + row * stride_d + c, acc.to(DST.dtype.element_ty), mask=m)


@triton.jit
def _reduce_rows_kernel(DST, PARTS, ROWS, PTR, POS, n, width, stride_d, stride_p,
                        BLOCK_W: tl.constexpr):
    _reduce_row(DST, PARTS, ROWS, PTR, POS, tl.program_id(0), width, stride_d, stride_p, BLOCK_W)


@triton.jit
def _reduce_row_pairs_kernel(DA, PA, DB, PB, ROWS, PTR, POS, n, width_a, width_b, stride_da, stride_pa, stride_db,
                             stride_pb, BLOCK_W: tl.constexpr):
    # program_id(1) picks the pair: dK and dV through the same rows in one launch
    if tl.program_id(1) == 0:
        _reduce_row(DA, PA, ROWS, PTR, POS, tl.program_id(0), width_a, stride_da, stride_pa, BLOCK_W)
    else:
        _reduce_row(DB, PB, ROWS, PTR, POS, tl.program_id(0), width_b, stride_db, stride_pb, BLOCK_W)


def _row_geom(t: torch.Tensor):
    """(width, row stride) where ``t`` ([rows, ...]) has its trailing dims as one dense block per row, else None.
    The kernels take ``t`` itself and address row r's element c at r * row stride + c: no 2-D view is made (a view
    op costs the host microseconds, several per launch)."""
    shape, stride = t.shape, t.stride()
    if len(shape) == 3:  # [rows, heads, dim], every layer call's tensors: without the loop
        h, d = shape[1], shape[2]
        if (d > 1 and stride[2] != 1) or (h > 1 and stride[1] != d):
            return None
        return h * d, stride[0]
    width = 1
    for i in range(len(shape) - 1, 0, -1):
        if shape[i] > 1 and stride[i] != width:
            return None
        width *= shape[i]
    return width, stride[0]


def _geoms(dst: torch.Tensor, src: torch.Tensor, name: str = "src") -> tuple[torch.Tensor, int, int, int]:
    """(src, common width, dst's row stride, src's row stride), src made dense first where its rows are not dense
    blocks (e.g. K or V split off Megatron's fused QKV projection: each token's heads lie apart within its row, which
    a row's one stride cannot address)."""
    gs = _row_geom(src)
    if gs is None:
        src = src.contiguous()
        gs = _row_geom(src)
    gd = _row_geom(dst)
    if gd is None or gs is None:
        t, what = (dst, "dst") if gd is None else (src, name)
        raise ValueError(f"rows must be dense blocks: {what} shape {tuple(t.shape)}, strides {t.stride()}")
    if gd[0] != gs[0]:
        raise ValueError(f"row widths differ: dst {gd[0]}, {name} {gs[0]}")
    return src, gd[0], gd[1], gs[1]


def _pair(dst: torch.Tensor, other: torch.Tensor, name: str) -> tuple[int, int, int]:
    """(common width, dst's row stride, the other operand's row stride)."""
    gd, go = _row_geom(dst), _row_geom(other)
    for t, g, what in ((dst, gd, "dst"), (other, go, name)):
        if g is None:
            raise ValueError(f"rows must be dense blocks: {what} shape {tuple(t.shape)}, strides {t.stride()}")
    if gd[0] != go[0]:
        raise ValueError(f"row widths differ: dst {gd[0]}, {name} {go[0]}")
    return gd[0], gd[1], go[1]


def _triton_ok(t: torch.Tensor, use_triton) -> bool:
    return t.is_cuda if use_triton is None else bool(use_triton)


def cdiv(n: int, d: int) -> int:
    """``triton.cdiv`` of positive ints in plain arithmetic: newer Triton makes that a ``constexpr_function``, whose
    call costs the host a microsecond or more, and every launch here asks for one or two."""
    return -(-n // d)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` of an int >= 1, in plain arithmetic (as ``cdiv``)."""
    return 1 << (n - 1).bit_length()


def _block_w(width: int) -> int:
    return min(1024, next_power_of_2(max(width, 16)))


def copy_rows(dst: torch.Tensor, src: torch.Tensor, dst_idx: torch.Tensor | None = None,
              src_idx: torch.Tensor | None = None, use_triton=None) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` (dtype converted) for i < n; a None index is arange(n).
    n = len of whichever index is given (or rows of src). Indices int64 on dst's device."""
    n = dst_idx.shape[0] if dst_idx is not None else src_idx.shape[0] if src_idx is not None else src.shape[0]
    if n == 0:
        return
    if not _triton_ok(dst, use_triton):
        rows = src[:n] if src_idx is None else src.index_select(0, src_idx)
        if dst_idx is None:
            dst[:n].copy_(rows)
        else:
            dst.index_copy_(0, dst_idx, rows.to(dst.dtype))
        return
    src, width, sd, ss = _geoms(dst, src)
    _copy_rows_kernel[(cdiv(n, BLOCK_R),)](
        dst, src, dst_idx if dst_idx is not None else dst, src_idx if src_idx is not None else src, n, width, sd, ss,
        HAS_DST_IDX=dst_idx is not None, HAS_SRC_IDX=src_idx is not None, BLOCK_R=BLOCK_R, BLOCK_W=_block_w(width),
        num_warps=4)


def copy_row_pairs(dst_a: torch.Tensor, src_a: torch.Tensor, dst_b: torch.Tensor, src_b: torch.Tensor,
                   dst_idx: torch.Tensor | None = None, src_idx: torch.Tensor | None = None, use_triton=None) -> None:
    """``copy_rows`` of two pairs through the same indices (K and V, dK and dV; their widths may differ, as MLA's)
    in one launch on a GPU: each launch costs the host tens of microseconds, and a layer call makes several."""
    if not _triton_ok(dst_a, use_triton) or dst_a.dtype != dst_b.dtype or src_a.dtype != src_b.dtype:
        copy_rows(dst_a, src_a, dst_idx, src_idx, use_triton)
        copy_rows(dst_b, src_b, dst_idx, src_idx, use_triton)
        return
    n = dst_idx.shape[0] if dst_idx is not None else src_idx.shape[0] if src_idx is not None else src_a.shape[0]
    if n == 0:
        return
    src_a, wa, sda, ssa = _geoms(dst_a, src_a)
    src_b, wb, sdb, ssb = _geoms(dst_b, src_b)
    _copy_row_pairs_kernel[(cdiv(n, BLOCK_R), 2)](
        dst_a, src_a, dst_b, src_b, dst_idx if dst_idx is not None else dst_a,
        src_idx if src_idx is not None else src_a, n, wa, wb, sda, ssa, sdb, ssb, HAS_DST_IDX=dst_idx is not None,
        HAS_SRC_IDX=src_idx is not None, BLOCK_R=BLOCK_R, BLOCK_W=_block_w(max(wa, wb)), num_warps=4)


def copy_row_pair_moves(moves, use_triton=None) -> None:
    """``copy_row_pairs(*move)`` for each of ``moves`` (tuples dst_a, src_a, dst_b, src_b, dst_idx, src_idx), two
    moves in one launch on a GPU: a layer call's own-rows placement and send gather read the same K / V, and its
    backward's gathers the same dK / dV."""
    moves = [m for m in moves if _move_len(m)]
    while len(moves) > 2:
        copy_row_pair_moves(moves[:2], use_triton)
        moves = moves[2:]
    if len(moves) < 2 or not _triton_ok(moves[0][0], use_triton) or _mixed(moves[0]) or _mixed(moves[1]):
        for m in moves:
            copy_row_pairs(*m, use_triton=use_triton)
        return
    # the two moves unpacked by name, not looped over into argument lists: a layer call makes this launch every
    # forward and backward, and the host's Python around it counts as much as the launch
    (da0, sa0, db0, sb0, di0, si0), (da1, sa1, db1, sb1, di1, si1) = moves
    n0, n1 = _move_len(moves[0]), _move_len(moves[1])
    sa0, wa0, sda0, ssa0 = _geoms(da0, sa0)
    sb0, wb0, sdb0, ssb0 = _geoms(db0, sb0)
    sa1, wa1, sda1, ssa1 = _geoms(da1, sa1)
    sb1, wb1, sdb1, ssb1 = _geoms(db1, sb1)
    _copy_two_row_pairs_kernel[(cdiv(max(n0, n1), BLOCK_R), 4)](
        da0, sa0, db0, sb0, da0 if di0 is None else di0, sa0 if si0 is None else si0, n0, wa0, wb0, sda0, ssa0, sdb0,
        ssb0, da1, sa1, db1, sb1, da1 if di1 is None else di1, sa1 if si1 is None else si1, n1, wa1, wb1, sda1, ssa1,
        sdb1, ssb1, HAS_DI0=di0 is not None, HAS_SI0=si0 is not None, HAS_DI1=di1 is not None,
        HAS_SI1=si1 is not None, BLOCK_R=BLOCK_R, BLOCK_W=_block_w(max(wa0, wb0, wa1, wb1)), num_warps=4)


def _mixed(m) -> bool:
    """A move whose two pairs differ in dtype (destinations or sources): it goes alone (``copy_row_pairs``)."""
    return m[0].dtype != m[2].dtype or m[1].dtype != m[3].dtype


def _move_len(m) -> int:
    """Rows a ``copy_row_pair_moves`` move copies (as ``copy_row_pairs`` counts them)."""
    return m[4].shape[0] if m[4] is not None else m[5].shape[0] if m[5] is not None else m[1].shape[0]


def reduce_rows(dst: torch.Tensor, parts: torch.Tensor, rows: torch.Tensor, ptr: torch.Tensor,
                pos: torch.Tensor, use_triton=None) -> None:
    """In place: ``dst[rows[i]] += sum(parts[pos[j]] for j in ptr[i] .. ptr[i+1])``, summed in fp32
    (fp64 for fp64 ``dst``) in that order and rounded once. rows/pos int64, ptr int64 [len(rows) + 1]."""
    if rows.shape[0] == 0:
        return
    if not _triton_ok(dst, use_triton) or dst.dtype == torch.float64:
        cdt = torch.float64 if dst.dtype == torch.float64 else torch.float32
        acc = dst.index_select(0, rows).to(cdt)
        counts = ptr[1:] - ptr[:-1]
        seg = torch.repeat_interleave(torch.arange(len(rows), device=dst.device), counts)
        acc.index_add_(0, seg, parts.index_select(0, pos).to(cdt))
        dst.index_copy_(0, rows, acc.to(dst.dtype))
        return
    width, sd, sp = _pair(dst, parts, "parts")
    n = rows.shape[0]
    _reduce_rows_kernel[(n,)](dst, parts, rows, ptr, pos, n, width, sd, sp, BLOCK_W=_block_w(width), num_warps=4)


def reduce_row_pairs(dst_a: torch.Tensor, parts_a: torch.Tensor, dst_b: torch.Tensor, parts_b: torch.Tensor,
                     rows: torch.Tensor, ptr: torch.Tensor, pos: torch.Tensor, use_triton=None) -> None:
    """``reduce_rows`` of two pairs through the same rows (dK and dV; their widths may differ, as MLA's) in one
    launch on a GPU, as ``copy_row_pairs``."""
    if rows.shape[0] == 0:
        return
    if (not _triton_ok(dst_a, use_triton) or dst_a.dtype == torch.float64 or dst_a.dtype != dst_b.dtype
            or parts_a.dtype != parts_b.dtype):
        reduce_rows(dst_a, parts_a, rows, ptr, pos, use_triton)
        reduce_rows(dst_b, parts_b, rows, ptr, pos, use_triton)
        return
    wa, sda, spa = _pair(dst_a, parts_a, "parts")
    wb, sdb, spb = _pair(dst_b, parts_b, "parts")
    n = rows.shape[0]
    _reduce_row_pairs_kernel[(n, 2)](dst_a, parts_a, dst_b, parts_b, rows, ptr, pos, n, wa, wb, sda, spa, sdb, spb,
                                     BLOCK_W=_block_w(max(wa, wb)), num_warps=4)
