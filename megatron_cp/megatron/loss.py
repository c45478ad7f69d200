"""Loss that stays exact when CP ranks hold different numbers of tokens.

Megatron's schedule accepts a 3-tuple ``(loss_sum, num_tokens, report)`` from the loss function;
with ``calculate_per_token_loss=True`` it sums ``num_tokens`` over micro-batches and
``finalize_model_grads`` all-reduces it over the DP x CP group and scales the gradients by
``1 / total_tokens``. That is the exact global token mean whatever the per-rank counts are; the
default path (dividing by the local count, averaging over ranks) is not, so the adapter requires it.
"""

from __future__ import annotations

import torch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """output_tensor: per-token losses ``[b, s_local]``; loss_mask: same shape (0/1).

    Returns ``(sum of masked losses, number of kept tokens (int), {'lm loss': [sum, count]})``.
    """
    losses = output_tensor.reshape(-1).float()
    mask = loss_mask.reshape(-1).float()
    if losses.shape != mask.shape:
        raise ValueError(f"loss {tuple(output_tensor.shape)} and loss_mask {tuple(loss_mask.shape)} differ")
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1).to(loss.dtype)])}
    return loss, num_tokens, report
