"""GroupCast / GroupReduce as one all-to-all-v each.

GroupCast sends selected rows of every rank's local tensor to the ranks that need them (each row
to a rank at most once); GroupReduce is its adjoint: partial gradients of those rows travel back to
their owner and are summed there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# gloo has no all-to-all for some low-precision dtypes; a pure data move may travel bit-cast.
_BITCAST = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def all_to_all_v(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """Rows ``x[sum(send_counts[:d]) : ...]`` go to rank d; returns rows from each source in rank order.

    x: [sum(send_counts), ...] contiguous; result: [sum(recv_counts), ...] of x's dtype.
    """
    out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
    send = x.contiguous()
    if send.dtype in _BITCAST and send.device.type == "cpu":
        send, view = send.view(_BITCAST[send.dtype]), out.view(_BITCAST[send.dtype])
    else:
        view = out
    dist.all_to_all_single(view, send, output_split_sizes=list(recv_counts), input_split_sizes=list(send_counts), group=group)
    return out


def group_cast(x_local, send_index, send_counts, recv_counts, group) -> torch.Tensor:
    """Gather ``x_local[send_index]`` (destination-major) and exchange; returns received rows."""
    return all_to_all_v(x_local.index_select(0, send_index), send_counts, recv_counts, group)


def group_reduce(grad_recv, d_local, send_index, send_counts, recv_counts, group) -> torch.Tensor:
    """Adjoint of ``group_cast``: return partial grads to their owners and add them into ``d_local``
    (in place, also returned). ``grad_recv`` rows are in receive order (source-major)."""
    back = all_to_all_v(grad_recv, recv_counts, send_counts, group)
    return d_local.index_add_(0, send_index, back.to(d_local.dtype))


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
