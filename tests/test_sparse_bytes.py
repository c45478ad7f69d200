"""A sparse selection's K/V exchange never moves more than the dense plan's, on every catalog envelope at cp 2, 4
and 8: ``sparse.exchange.route`` (what ``sparse_attention`` calls) for each rank, with every rank's needs handed in
as its all-gather would (one process: the all-gather is replaced by the ranks' needs), for the whole envelope
selected and for random selections; the rows each rank receives against the rows the dense plan sends it."""

from __future__ import annotations

import pytest
import torch

import megatron_cp as mcp
from megatron_cp.masks import catalog
from megatron_cp.sparse import exchange

S, BLOCK = 2048, 64


def _received(plan, needs: torch.Tensor, monkeypatch) -> list[int]:
    """Rows each rank's selection route receives, given every rank's needs [cp, nb]."""
    def gather(out, x, group=None):
        out.copy_(needs.to(torch.uint8).reshape(-1))

    monkeypatch.setattr(exchange, "all_gather_single", gather)
    got = []
    for r in range(plan.cp_size):
        dev = exchange.DeviceLayout.of(mcp.sparse.sparse_layout(plan, r, BLOCK), "cpu")
        got.append(exchange.route(needs[r], dev, group=object()).rows_received)
    return got


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("name", catalog.DIST_MASKS)
def test_selection_moves_no_more_kv_than_the_dense_plan(name, cp, monkeypatch):
    plan = mcp.plan(catalog.build(name, S), cp, block=BLOCK, guest_rows="none")  # what sparse_attention needs
    dense = [rp.num_remote for rp in plan.ranks]
    nb = S // BLOCK
    envelope = torch.stack([mcp.sparse.sparse_layout(plan, r, BLOCK).envelope.bool().any(0)
                            for r in range(cp)])
    whole = _received(plan, envelope, monkeypatch)
    assert whole == dense  # the whole envelope selected: exactly the dense plan's rows
    gen = torch.Generator().manual_seed(cp)
    for _ in range(3):
        some = envelope & (torch.rand(cp, nb, generator=gen) < 0.4)
        assert all(a <= b for a, b in zip(_received(plan, some, monkeypatch), dense))
    assert sum(dense) > 0  # every envelope here exchanges rows: the comparison is not vacuous
