"""AttnSlice / AttnMask: semantics, exact union geometry, validation."""

import numpy as np
import pytest

from megatron_cp import masks as mcp_masks
from megatron_cp.masks import KINDS, AttnMask, AttnSlice
from megatron_cp.masks import geometry as g


def _random_mask(rng, max_len=40, max_slices=8):
    sq, sk = (int(x) for x in rng.integers(1, max_len, 2))
    slices = []
    for _ in range(int(rng.integers(1, max_slices))):
        q0 = int(rng.integers(0, sq)); q1 = int(rng.integers(q0 + 1, sq + 1))
        k0 = int(rng.integers(0, sk)); k1 = int(rng.integers(k0 + 1, sk + 1))
        slices.append(AttnSlice((q0, q1), (k0, k1), KINDS[int(rng.integers(0, 4))]))
    return AttnMask(slices, sq, sk)


def test_kind_semantics_match_anchors_table():
    # one slice of each kind on a 3x5 rectangle (sk - sq = 2), written out by hand
    expect = {
        "full": ["11111", "11111", "11111"],
        "causal": ["11100", "11110", "11111"],
        "inv_causal": ["11111", "01111", "00111"],
        "bi_causal": ["11100", "01110", "00111"],
    }
    for kind, rows in expect.items():
        d = AttnMask([AttnSlice((0, 3), (0, 5), kind)], 3, 5).to_dense()
        assert ["".join("1" if c else "0" for c in r) for r in d] == rows, kind
    # causal with more queries than keys: leading rows keep nothing
    d = AttnMask([AttnSlice((0, 4), (0, 2), "causal")], 4, 2).to_dense()
    assert d.sum(1).tolist() == [0, 0, 1, 2]
    assert AttnMask([AttnSlice((0, 4), (0, 2), "bi_causal")], 4, 2).area() == 0


@pytest.mark.parametrize("seed", range(4))
def test_union_is_exact_and_disjoint(seed):
    rng = np.random.default_rng(seed)
    for _ in range(300):
        m = _random_mask(rng)
        d = m.to_dense()  # built slice by slice from the definition, independent of geometry
        t = m.traps
        assert np.array_equal(g.traps_to_dense(t, m.seqlen_q, m.seqlen_k), d)
        per_trap = sum(int(g.traps_to_dense(t[i : i + 1], m.seqlen_q, m.seqlen_k).sum()) for i in range(len(t)))
        assert per_trap == d.sum(), "normalised trapezoids overlap"
        assert m.area() == d.sum()
        assert np.array_equal(m.normalized().to_dense(), d)
        assert np.array_equal(np.diff(g.row_area_prefix(t, m.seqlen_q)), d.sum(1))


def test_clip_is_exact():
    rng = np.random.default_rng(7)
    for _ in range(500):
        m = _random_mask(rng)
        d = m.to_dense()
        a = int(rng.integers(0, m.seqlen_q)); b = int(rng.integers(a + 1, m.seqlen_q + 1))
        c = int(rng.integers(0, m.seqlen_k)); e = int(rng.integers(c + 1, m.seqlen_k + 1))
        clipped = np.asarray(g.clip(m.traps, a, b, c, e), dtype=np.int64).reshape(-1, 6)
        ref = np.zeros_like(d)
        ref[a:b, c:e] = d[a:b, c:e]
        assert np.array_equal(g.traps_to_dense(clipped, m.seqlen_q, m.seqlen_k), ref)


def test_overlapping_slices_count_once():
    s = 64
    m = AttnMask([AttnSlice((0, s), (0, s), "causal")] * 3 + [AttnSlice((0, s), (0, 10), "full")], s, s)
    assert m.area() == s * (s + 1) // 2 + sum(max(0, 10 - (i + 1)) for i in range(s))
    assert m.area() == m.to_dense().sum()


def test_area_without_materialising_large_mask():
    s = 1 << 20
    m = AttnMask([AttnSlice((0, s), (0, s), "causal"), AttnSlice((0, s), (0, 4096), "full")], s, s)
    assert m.area() == s * (s + 1) // 2 + 4095 * 4096 // 2
    with pytest.raises(ValueError, match="too large"):
        m.to_dense()


@pytest.mark.parametrize(
    "args, match",
    [
        (((5, 5), (0, 3), "full"), r"q_range=\(5, 5\)"),
        (((0, 3), (4, 2), "full"), r"k_range=\(4, 2\)"),
        (((-1, 3), (0, 2), "full"), r"q_range=\(-1, 3\)"),
        (((0, 3), (0, 2), "diagonal"), "kind='diagonal'"),
    ],
)
def test_slice_validation(args, match):
    with pytest.raises(ValueError, match=match):
        AttnSlice(*args)


def test_mask_validation_names_bad_slice():
    with pytest.raises(ValueError, match=r"slice 1 .* outside"):
        AttnMask([AttnSlice((0, 4), (0, 4)), AttnSlice((2, 9), (0, 4))], 8, 8)
    with pytest.raises(ValueError, match="positive"):
        AttnMask([], 0, 4)
    with pytest.raises(TypeError, match="slice 0"):
        AttnMask([((0, 1), (0, 1), "full")], 4, 4)


def _tile_cells(tiles, sq, sk):
    cnt = np.zeros((sq, sk), dtype=np.int32)
    for t in np.asarray(tiles).tolist():
        tr = g.slice_to_trap(*t)
        if tr is not None:
            cnt += g.traps_to_dense(np.array([tr]), sq, sk)
    return cnt


@pytest.mark.parametrize("seed", range(6))
def test_merge_tiles_keeps_cells(seed):
    """merge_tiles on a cell-disjoint list (the union of random slices, cut in random row and key runs
    as a plan's tiles are): the same cells, each once, in no more tiles."""
    rng = np.random.default_rng(seed)
    s = 48
    kinds = list(range(4))
    traps = [t for t in (g.slice_to_trap(*sorted(rng.choice(s + 1, 2, replace=False)),
                                         *sorted(rng.choice(s + 1, 2, replace=False)), int(rng.choice(kinds)))
                         for _ in range(6)) if t is not None]
    disjoint = g.union(traps)
    cuts = np.unique(np.concatenate([[0, s], rng.integers(0, s, 5)]))
    tiles = [g.trap_to_slice(c) for a, b in zip(cuts[:-1], cuts[1:]) for c in g.clip(disjoint, 0, s, int(a), int(b))]
    merged = g.merge_tiles(tiles)
    assert len(merged) <= len(tiles)
    want = _tile_cells(tiles, s, s)
    assert want.max() <= 1 and np.array_equal(_tile_cells(merged, s, s), want)


def test_merge_tiles_joins_block_rows_into_one_causal_tile():
    """Block rows of full key blocks followed by a causal diagonal block (a strided mask's residue class
    laid out contiguously) join into one causal tile; touching full tiles of the same keys join too."""
    b, n = 4, 5
    tiles = [(i * b, (i + 1) * b, j * b, (j + 1) * b, 0) for i in range(n) for j in range(i)]
    tiles += [(i * b, (i + 1) * b, i * b, (i + 1) * b, 1) for i in range(n)]
    assert g.merge_tiles(tiles).tolist() == [[0, n * b, 0, n * b, 1]]
    assert g.merge_tiles([(0, 4, 0, 8, 0), (4, 9, 0, 8, 0), (0, 9, 8, 10, 0)]).tolist() == [[0, 9, 0, 10, 0]]
    # a causal tile whose first rows keep nothing does not swallow the full keys before it
    assert len(g.merge_tiles([(0, 4, 0, 3, 0), (0, 4, 3, 5, 1)])) == 2


def test_block_diagonal_places_each_mask_on_the_diagonal():
    a, b = mcp_masks.varlen([0, 3, 8]), mcp_masks.sliding_window(6, 2)
    dense = np.zeros((14, 14), bool)
    dense[:8, :8], dense[8:, 8:] = a.to_dense(), b.to_dense()
    g = mcp_masks.block_diagonal([a, b])
    assert (g.seqlen_q, g.seqlen_k) == (14, 14) and np.array_equal(g.to_dense(), dense)
    assert g.area() == a.area() + b.area()
    with pytest.raises(ValueError, match="mask 1 is \\[4, 6\\], not square"):
        mcp_masks.block_diagonal([a, mcp_masks.full(4, 6)])
    with pytest.raises(ValueError, match="at least one mask"):
        mcp_masks.block_diagonal([])
