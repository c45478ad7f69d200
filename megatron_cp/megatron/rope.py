"""RoPE at the dispatched positions, on any device.

Megatron's ``RotaryEmbedding.forward(max_seq_len, ...)`` builds the table for positions
``0..max_seq_len-1``, slices it for the zigzag CP layout (``get_pos_emb_on_this_cp_rank``) and moves
``inv_freq`` to CUDA unconditionally in ``get_emb``. Under megatron-cp a rank holds arbitrary tokens
and packed documents restart their positions, so ``install(model)`` swaps the model's
``rotary_pos_emb`` attribute (the one ``GPTModel._preprocess`` reads) for ``PlanRotaryEmbedding``,
which returns the angles of exactly the local tokens: ``[s_local, b, 1, rot_dim]`` float32. Megatron's
attention then applies them with its usual ``[s, b, h, d]`` RoPE code (bshd path).

Where the positions come from: a forward pre-hook on the model reads the ``CPParams`` passed as
``packed_seq_params`` to that very forward call and hands its ``position_ids`` to the rotary module;
a post-hook clears them, so stale positions never leak into a later call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .params import CPParams


class PlanRotaryEmbedding(nn.Module):
    """Drop-in for ``RotaryEmbedding`` returning angles at explicit positions.

    Keeps the source module's ``inv_freq`` (so rotary_percent, rotary_base, Llama-3 rope scaling are
    honoured) as a non-persistent buffer: it follows ``model.to(device)`` and never enters checkpoints.
    """

    def __init__(self, source: nn.Module):
        super().__init__()
        self.register_buffer("inv_freq", source.inv_freq.detach().clone().float(), persistent=False)
        self.rotary_interleaved = bool(getattr(source, "rotary_interleaved", False))
        self.seq_len_interpolation_factor = getattr(source, "seq_len_interpolation_factor", None)
        self._positions: torch.Tensor | None = None

    def set_positions(self, position_ids: torch.Tensor | None) -> None:
        self._positions = position_ids

    def angles(self, position_ids: torch.Tensor) -> torch.Tensor:
        """position_ids int ``[b, s]`` -> float32 ``[s, b, 1, rot_dim]`` (Megatron's bshd layout)."""
        pos = position_ids.to(torch.float32).transpose(0, 1)  # [s, b]
        if self.seq_len_interpolation_factor is not None:
            pos = pos / self.seq_len_interpolation_factor
        inv = self.inv_freq.to(pos.device)
        freqs = pos[..., None] * inv  # [s, b, rot_dim/2]
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        return emb[:, :, None, :]

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        # GPTModel passes the result to forward(); our forward ignores it.
        return 0

    def forward(self, max_seq_len: int = 0, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if packed_seq:
            raise ValueError("PlanRotaryEmbedding: Megatron's packed (THD) layout is not supported; "
                             "megatron-cp runs the sbhd layout (prepare_batch)")
        if offset:
            raise ValueError(f"PlanRotaryEmbedding: RoPE offset is not supported (got offset={offset})")
        if self._positions is None:
            raise RuntimeError(
                "PlanRotaryEmbedding has no positions: call the model with "
                "packed_seq_params=CPParams (from megatron_cp.megatron.prepare_batch)"
            )
        return self.angles(self._positions)


@dataclass
class Installed:
    """What ``install`` changed, so ``remove()`` can put it back exactly."""

    swaps: list = field(default_factory=list)  # (owner module, original rotary module)
    hooks: list = field(default_factory=list)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        for owner, original in self.swaps:
            owner.rotary_pos_emb = original
        self.hooks.clear()
        self.swaps.clear()


def _find_rope_owners(model: nn.Module):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    for m in model.modules():
        rpe = getattr(m, "rotary_pos_emb", None)
        if isinstance(rpe, RotaryEmbedding) and type(rpe) is RotaryEmbedding:
            yield m


def swap_rotary(handle: Installed, owner: nn.Module, plan_rope: nn.Module) -> None:
    """Put ``plan_rope`` in ``owner.rotary_pos_emb`` and feed it each call's ``CPParams.position_ids``
    (a forward pre-hook on ``owner``; cleared after the call); recorded in ``handle`` for ``remove()``."""
    original = owner.rotary_pos_emb
    owner.rotary_pos_emb = plan_rope

    def pre(mod, args, kwargs):
        p = kwargs.get("packed_seq_params")
        plan_rope.set_positions(p.position_ids if isinstance(p, CPParams) else None)

    def post(mod, args, kwargs, out):
        plan_rope.set_positions(None)

    handle.hooks.append(owner.register_forward_pre_hook(pre, with_kwargs=True))
    handle.hooks.append(owner.register_forward_hook(post, with_kwargs=True))
    handle.swaps.append((owner, original))


def install(model: nn.Module) -> Installed:
    """Swap every plain ``RotaryEmbedding`` under ``model`` for ``PlanRotaryEmbedding``.

    Returns an ``Installed`` handle whose ``remove()`` restores the originals. Raises if the model
    has no RoPE module of that type (e.g. MLA or YaRN: not supported yet).
    """
    handle = Installed()
    for owner in list(_find_rope_owners(model)):
        swap_rotary(handle, owner, PlanRotaryEmbedding(owner.rotary_pos_emb))
    if not handle.swaps:
        raise ValueError(
            f"install(): no RotaryEmbedding found under {type(model).__name__}; megatron-cp's RoPE "
            "path needs position_embedding_type='rope' (MLA / YaRN / mRoPE are not supported)"
        )
    return handle
