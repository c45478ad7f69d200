"""megatron_cp.masks.catalog: each benchmark mask's AttnMask, mask_mod and kernel tile list keep the same
cells, and each name means one mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_cp import masks as M
from megatron_cp.kinds import Kind
from megatron_cp.masks import catalog


@pytest.mark.parametrize("name", catalog.NAMES)
@pytest.mark.parametrize("s", [1, 5, 200, 1031, 2304])
def test_attn_mask_equals_mask_mod_cell_by_cell(name, s):
    mask = catalog.build(name, s)
    assert (mask.seqlen_q, mask.seqlen_k) == (s, s)
    want = catalog.dense(name, s).numpy()
    np.testing.assert_array_equal(mask.to_dense(), want)
    np.testing.assert_array_equal(catalog.tiles_to_dense(catalog.tiles(mask), s, s).numpy(), want)


def test_check_compares_the_forms(monkeypatch):
    catalog.check("streaming_1024", 1100)
    monkeypatch.setattr(catalog, "mask_mod", lambda name, s, device="cpu": lambda b, h, q, k: (k <= q) & (q - k < 1024))
    with pytest.raises(AssertionError, match="differ in 76 cells"):
        catalog.check("sliding_window_1024", 1100)


def test_names_are_unique_and_described():
    assert len(set(catalog.NAMES)) == len(catalog.NAMES)
    assert set(catalog.DIST_MASKS) | set(catalog.KERNEL_MASKS) == set(catalog.NAMES)
    assert len(set(catalog.DIST_MASKS)) == len(catalog.DIST_MASKS) == 7
    assert len(set(catalog.KERNEL_MASKS)) == len(catalog.KERNEL_MASKS) == 8
    assert set(catalog.DESCRIPTIONS) == set(catalog.NAMES) and all(catalog.DESCRIPTIONS.values())
    with pytest.raises(ValueError, match="unknown benchmark mask 'nope'"):
        catalog.build("nope", 64)


def test_each_name_is_one_mask():
    """The two tables' former homonyms are distinct masks: at 16k the kernel table's window is 1024 and the
    distributed one 16384 / 32 = 512; at 128k and beyond the scaled sizes are nominal (4096, 512)."""
    s = 16384
    assert catalog.build("sliding_window_1024", s) == M.sliding_window(s, 1024, 0)
    assert catalog.build("sliding_window", s) == M.sliding_window(s, 512, 0)
    assert catalog.build("sliding_window", 1 << 18) == M.sliding_window(1 << 18, 4096, 0)
    assert catalog.build("block_causal_2048", s) == M.block_causal(s, 2048)
    assert catalog.build("block_causal", 1 << 17) == M.block_causal(1 << 17, 4096)
    assert catalog.build("strided", 1 << 17) == catalog.build("strided_512x4", 1 << 17)
    assert catalog.build("strided", s) != catalog.build("strided_512x4", s)
    assert catalog.build("global_local", s) != catalog.build("global_local_512", s)
    assert catalog.build("packed", s) != catalog.build("docs_causal", s)
    for name in ("packed", "docs_causal"):
        lens = catalog.doc_lengths(name, s)
        assert sum(lens) == s and min(lens) >= 1 and lens == catalog.doc_lengths(name, s)  # deterministic


def test_tiles_are_the_disjoint_slices_in_kernel_form():
    mask = M.AttnMask([M.AttnSlice((0, 8), (0, 8), "causal"), M.AttnSlice((4, 8), (0, 6), "full")], 8)
    t = catalog.tiles(mask)
    assert t.dtype == torch.int32 and t.shape[1] == 5
    assert set(t[:, 4].tolist()) <= {int(k) for k in Kind}
    np.testing.assert_array_equal(catalog.tiles_to_dense(t, 8, 8).numpy(), mask.to_dense())
    # disjoint: the cells add up to the area
    assert int(catalog.tiles_to_dense(t, 8, 8).sum()) == mask.area()
    assert catalog.tiles(catalog.build("causal", 64)).tolist() == [[0, 64, 0, 64, int(Kind.CAUSAL)]]


def test_tiles_to_dense_rejects_overlapping_tiles():
    t = torch.tensor([[0, 4, 0, 4, int(Kind.FULL)], [2, 4, 0, 2, int(Kind.FULL)]], dtype=torch.int32)
    with pytest.raises(ValueError, match="overlaps"):
        catalog.tiles_to_dense(t, 4, 4)


def test_sdpa_is_causal_only_for_the_dense_masks():
    assert catalog.sdpa_is_causal("full") is False and catalog.sdpa_is_causal("causal") is True
    assert all(catalog.sdpa_is_causal(n) is None for n in catalog.NAMES if n not in ("full", "causal"))


def test_masks_package_exports_catalog():
    assert M.catalog is catalog
