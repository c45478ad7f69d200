"""Megatron's multi-latent attention (``MLASelfAttention``, DeepSeek MLA) under megatron-cp.

MLA keeps its own rotary module per layer (``RotaryEmbedding`` for ``rope_type='rope'``,
``YarnRotaryEmbedding`` for ``'yarn'``) and applies it inside the attention module to the decoupled
positional part of q and k (``qk_pos_emb_head_dim``). Megatron builds that table for positions
``0 .. s-1`` and slices it for its own CP layout; under megatron-cp a rank holds the plan's tokens, and
packed documents restart their positions. ``install_mla(model)`` swaps each MLA layer's rotary module for
``PlanMLARotary``, which returns the angles of exactly the local tokens (``CPParams.position_ids``, set by
a forward pre-hook on the attention module and cleared after it), with YaRN's frequencies and its
``mscale`` taken from the source module.

Layout: given a ``packed_seq_params`` MLA drops the batch dimension (``[s, 1, ...] -> [s, ...]``, its THD
convention) and keeps the bshd RoPE code (``CPParams.qkv_format`` is ``sbhd``), so the angles come as
``[s_local, 1, rot_dim]`` and ``CPCoreAttention`` receives q ``[s, Hq, Dqk]``, k ``[s, Hq, Dqk]``, v ``[s, Hq,
Dv]`` (batch 1, as ``prepare_batch`` emits) and returns ``[s, 1, Hq * Dv]``.
"""

from __future__ import annotations

import torch
from torch import nn

from .rope import Installed, swap_rotary


def _yarn_frequencies(source) -> tuple[torch.Tensor, float]:
    """(inv_freq [rot_dim / 2] float32, mscale) of a ``YarnRotaryEmbedding``, by Megatron's own YaRN helpers
    (the blend of interpolated and extrapolated frequencies its ``get_emb`` uses)."""
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as y

    low, high = y._yarn_find_correction_range(source.beta_fast, source.beta_slow, source.dim, source.rotary_base,
                                               source.original_max_position_embeddings,
                                               source.correction_range_round_to_int)
    extra = source.inv_freq_extra.detach().float().cpu()
    inter = source.inv_freq_inter.detach().float().cpu()
    keep_extra = 1.0 - y._yarn_linear_ramp_mask(low, high, source.dim // 2, device=extra.device).to(torch.float32)
    inv_freq = inter * (1 - keep_extra) + extra * keep_extra
    return inv_freq, float(y._yarn_get_concentration_factor(source.scaling_factor, source.mscale,
                                                             source.mscale_all_dim))


class PlanMLARotary(nn.Module):
    """Drop-in for an MLA layer's ``RotaryEmbedding`` / ``YarnRotaryEmbedding``: angles at the local tokens'
    positions, float32 ``[s_local, 1, rot_dim]``; YaRN returns ``(angles, mscale)`` as Megatron's does. The
    frequencies are a non-persistent buffer (they follow ``.to(device)``, never enter checkpoints)."""

    def __init__(self, source: nn.Module):
        super().__init__()
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

        self.yarn = isinstance(source, YarnRotaryEmbedding)
        if self.yarn:
            inv_freq, self.mscale = _yarn_frequencies(source)
            self.interpolation = None
        else:
            inv_freq, self.mscale = source.inv_freq.detach().float(), None
            self.interpolation = getattr(source, "seq_len_interpolation_factor", None)
        self.register_buffer("inv_freq", inv_freq.clone(), persistent=False)
        self.rotary_interleaved = bool(getattr(source, "rotary_interleaved", False))
        self._positions: torch.Tensor | None = None

    def set_positions(self, position_ids: torch.Tensor | None) -> None:
        self._positions = position_ids

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return 0  # MLA passes it back to forward, which ignores it

    def forward(self, max_seq_len: int = 0, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if packed_seq or offset:
            raise ValueError("PlanMLARotary: Megatron's THD layout and RoPE offsets are not supported; megatron-cp "
                             "runs the sbhd layout (prepare_batch)")
        pos = self._positions
        if pos is None:
            raise RuntimeError("PlanMLARotary has no positions: call the model with packed_seq_params=CPParams "
                               "(from megatron_cp.megatron.prepare_batch)")
        if pos.dim() != 2 or pos.shape[0] != 1:
            raise ValueError(f"MLA under megatron-cp runs batch 1 (prepare_batch), got position_ids {tuple(pos.shape)}")
        p = pos[0].to(torch.float32)
        if self.interpolation is not None:
            p = p / self.interpolation
        freqs = p[:, None] * self.inv_freq.to(p.device)  # [s, rot_dim / 2]
        if self.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        emb = emb[:, None, :]  # [s, 1, rot_dim]: MLA's q / k here are [s, heads, dim]
        return (emb, self.mscale) if self.yarn else emb


def install_mla(model: nn.Module) -> Installed:
    """Swap the rotary module of every multi-latent attention layer under ``model`` for ``PlanMLARotary``;
    returns ``rope.Installed`` (``remove()`` restores them). Raises ValueError for what it cannot run:
    ``apply_rope_fusion`` (MLA's fused RoPE reads Megatron's cached tables) and latent caching."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    handle = Installed()
    for owner in [m for m in model.modules() if isinstance(m, MultiLatentAttention)]:
        cfg = owner.config
        if getattr(cfg, "apply_rope_fusion", False):
            raise ValueError("MLA under megatron-cp applies RoPE at the plan's positions without fusion; "
                             "drop --apply-rope-fusion (config.apply_rope_fusion)")
        if getattr(cfg, "cache_mla_latents", False):
            raise ValueError("MLA latent caching (config.cache_mla_latents) is an inference path; megatron-cp "
                             "runs training")
        swap_rotary(handle, owner, PlanMLARotary(owner.rotary_pos_emb))
    if not handle.swaps:
        raise ValueError(f"install_mla(): no multi-latent attention layer under {type(model).__name__}")
    return handle
