"""The collectives under GroupCast / GroupReduce: all-to-all-v and all-gather of rows, and a
cross-rank consistency check.

GroupCast sends selected rows of every rank's local tensor to the ranks that need them (each row to a
rank at most once) as one all-to-all-v; GroupReduce is its adjoint: partial gradients of those rows
travel back to their owner and are summed there (``routes``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# newer torch names the one-buffer all-gather all_gather_single and warns on all_gather_into_tensor; the GPU
# machines' torch 2.11 has only the old name
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def wire(t: torch.Tensor) -> torch.Tensor:
    """gloo lacks 16-bit dtypes: a pure data move on CPU travels as bytes (a view, no copy)."""
    if t.is_cpu and t.dtype in (torch.bfloat16, torch.float16):  # is_cpu: no device object made, every exchange
        return t.view(torch.uint8)
    return t


def all_to_all_v(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group,
                 out: torch.Tensor | None = None, async_op: bool = False):
    """Rows ``x[sum(send_counts[:d]) : ...]`` go to rank d; returns rows from each source in rank order.

    x: [sum(send_counts), ...]; result: [sum(recv_counts), ...] of x's dtype, written into ``out`` (contiguous,
    that shape) when given. ``async_op``: returns (result, handle); the result may be read, and ``x`` written, only
    after ``handle.wait()`` (on GPUs a stream wait, not a host block).
    """
    rows = sum(recv_counts)
    if out is None:
        out = x.new_empty((rows,) + tuple(x.shape[1:]))
    elif out.shape[0] != rows or out.shape[1:] != x.shape[1:] or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {(rows,) + tuple(x.shape[1:])}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if not x.is_contiguous():
        x = x.contiguous()
    work = dist.all_to_all_single(wire(out), wire(x), output_split_sizes=_ints(recv_counts),
                                  input_split_sizes=_ints(send_counts), group=group, async_op=async_op)
    return (out, work) if async_op else out


def _ints(counts) -> list:
    return counts if type(counts) is list else [int(c) for c in counts]


def all_gather_rows(x: torch.Tensor, counts: list[int], group) -> torch.Tensor:
    """Every rank's ``x`` ([counts[rank], ...]) concatenated in rank order: [sum(counts), ...], gathered
    into one buffer (no per-rank parts to concatenate); rows are compacted only when counts differ."""
    pad, cp = max(counts), len(counts)
    buf = x if x.shape[0] == pad else torch.cat([x, x.new_zeros((pad - x.shape[0],) + tuple(x.shape[1:]))])
    out = x.new_empty((cp * pad,) + tuple(x.shape[1:]))
    all_gather_single(wire(out), wire(buf.contiguous()), group=group)
    if all(c == pad for c in counts):
        return out
    return torch.cat([out[i * pad: i * pad + c] for i, c in enumerate(counts)])


def check_same_on_all_ranks(value: int, group, device, what: str) -> None:
    """Raise on every rank unless all ranks of ``group`` passed the same int ``value``."""
    t = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    hi, lo = int(t[0]), -int(t[1])
    if hi != lo:
        raise RuntimeError(
            f"{what} differs across ranks (this rank: {value}, seen range [{lo}, {hi}]): every rank "
            "must build the same plan from the same mask, cp size and options"
        )
