"""Cluster topology: nodes x GPUs per node and link bandwidths (used by stats and, later, placement)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """``nodes`` x ``gpus_per_node`` ranks, rank r on node r // gpus_per_node.

    Bandwidths are per GPU, in GB/s (defaults: NVLink-class inside a node, 400 Gb/s between nodes).
    """

    nodes: int
    gpus_per_node: int
    intra_node_gbps: float = 300.0
    inter_node_gbps: float = 50.0

    def __post_init__(self):
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"Topology needs nodes >= 1 and gpus_per_node >= 1, got {self}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node
