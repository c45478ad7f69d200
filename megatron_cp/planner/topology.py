"""Cluster topology: nodes x GPUs per node, and the link figures (``Links``) the planner and the cost model
share."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Links:
    """Achieved per-GPU link figures of one collective: bandwidth inside a node and between nodes (GB/s)
    and the fixed cost of a collective (us). ``LINKS``, one calibration of an NVLink node (all-to-all; 400 Gb/s
    NIC per GPU between nodes; docs/cost-model.md), is the one place their defaults live: ``Topology`` weighs the
    planner's bytes with them and ``runtime.CostModel`` starts from them until a calibration replaces them."""

    intra_gbps: float = 335.0
    inter_gbps: float = 45.0
    latency_us: float = 40.0


LINKS = Links()


@dataclass(frozen=True)
class Topology:
    """``nodes`` x ``gpus_per_node`` ranks, rank r on node r // gpus_per_node.

    Bandwidths are per GPU, in GB/s (defaults ``LINKS``: NVLink inside a node, 400 Gb/s between nodes);
    the planner weighs a byte crossing nodes by their ratio.
    """

    nodes: int
    gpus_per_node: int
    intra_node_gbps: float = LINKS.intra_gbps
    inter_node_gbps: float = LINKS.inter_gbps

    def __post_init__(self):
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"Topology needs nodes >= 1 and gpus_per_node >= 1, got {self}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node
