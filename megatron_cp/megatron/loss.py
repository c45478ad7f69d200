"""Loss that stays exact when CP ranks hold different numbers of tokens, with Megatron's loss checks and
its FLOPs accounting of packed documents.

Megatron's schedule accepts a 3-tuple ``(loss_sum, num_tokens, report)`` from the loss function;
with ``calculate_per_token_loss=True`` it sums ``num_tokens`` over micro-batches and
``finalize_model_grads`` all-reduces it over the DP x CP group and scales the gradients by
``1 / total_tokens``. That is the exact global token mean whatever the per-rank counts are; the
default path (dividing by the local count, averaging over ranks) is not, so the adapter requires it.

The checks are those of Megatron-LM's ``pretrain_gpt.py`` loss function, through Megatron's rerun
state machine: NaN and Inf in this rank's loss (``--check-for-nan-in-loss-and-grad``, fatal) and a loss
far above the ones seen so far (``--check-for-spiky-loss``, logged; Megatron's factor 10).
"""

from __future__ import annotations

from functools import partial

import torch

SPIKY_LOSS_FACTOR = 10  # the factor of Megatron-LM's pretrain_gpt.py


def check_loss(loss: torch.Tensor, check_nan: bool, check_spiky: bool) -> None:
    """Megatron's per-rank loss checks on ``loss`` (a 0-dim float tensor) via its rerun state machine."""
    if not (check_nan or check_spiky):
        return
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    rsm = get_rerun_state_machine()
    if check_nan:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rsm.validate_result(result=loss, rejection_func=reject, message=f"found {what} in local forward loss calculation",
                                tolerance=0.0, fatal=True)  # the forward pass is deterministic
    if check_spiky:
        rsm.validate_result(result=loss, rejection_func=partial(rsm.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                                                                context="loss"),
                            message="Spiky loss", tolerance=0.0, fatal=False)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None, *, check_nan: bool = False,
              check_spiky: bool = False):
    """output_tensor: per-token losses ``[b, s_local]``; loss_mask: same shape (0/1).

    check_nan / check_spiky: Megatron's ``--check-for-nan-in-loss-and-grad`` / ``--check-for-spiky-loss``
    (``check_loss``). Returns ``(sum of masked losses, number of kept tokens (int), {'lm loss': [sum, count]})``.
    """
    losses = output_tensor.reshape(-1).float()
    mask = loss_mask.reshape(-1).float()
    if losses.shape != mask.shape:
        raise ValueError(f"loss {tuple(output_tensor.shape)} and loss_mask {tuple(loss_mask.shape)} differ")
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1).to(loss.dtype)])}
    check_loss(loss, check_nan, check_spiky)
    return loss, num_tokens, report


def record_documents(cu_seqlens, model) -> None:
    """Feed one micro-batch's document lengths to Megatron's FLOPs accounting (``num_floating_point_operations``
    counts causal attention as ``sum(L_i ** 2)`` over documents when told them, else ``b * S ** 2``).

    cu_seqlens: int ``[n_docs + 1]`` over the micro-batch's ``b * S`` tokens (``CPBatch.cu_seqlens``), the
    same on every rank of the model-parallel group. Megatron divides the sum over all ranks by TP x CP x PP,
    so each rank records each micro-batch once: on its first virtual pipeline chunk only.
    """
    from megatron.training.training import update_seqlen_stats_from_cu_seqlens

    while hasattr(model, "module"):  # DDP / Float16Module wrappers
        model = model.module
    if getattr(model, "vp_stage", None) not in (None, 0):
        return
    update_seqlen_stats_from_cu_seqlens(torch.as_tensor(cu_seqlens, dtype=torch.int64))
