"""``Workload``: the attention shapes that turn tokens into bytes and cells into FLOPs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """Shapes that turn tokens into bytes and cells into FLOPs."""

    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def fwd_flops(self, area: float) -> float:
        return 4.0 * area * self.num_heads * self.head_dim
