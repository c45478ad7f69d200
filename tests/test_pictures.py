"""Pictures and text of what the planner did (issue #30): ``Plan.describe``, ``Plan.stats`` priced for the
caller's shapes, ``AttnMask.draw`` / ``Plan.draw`` and the exact block counts behind the pictures.

The block counts are checked cell by cell against ``to_dense`` (and the rank of every cell against the
plan's owners at block 1); the pictures are checked to be real PNGs of the expected size, drawn fast.
"""

from __future__ import annotations

import re
import struct
import time

import numpy as np
import pytest

import megatron_cp as mcp
from megatron_cp import masks as M
from megatron_cp.masks import AttnMask, AttnSlice
from megatron_cp.masks.draw import auto_block, block_grid, tokens_label
from megatron_cp.planner.draw import rank_blocks, row_owners, traffic_matrix


def _packed(s: int, seed: int = 0) -> AttnMask:
    rng = np.random.default_rng(seed)
    lens = []
    while sum(lens) < s:
        lens.append(int(np.clip(rng.lognormal(np.log(s / 64), 1.0), 16, s // 8)))
    lens[-1] -= sum(lens) - s
    return M.varlen(np.concatenate([[0], np.cumsum([n for n in lens if n > 0])]).tolist(), causal=True)


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


# --------------------------------------------------------------------------------------------------
# describe() and stats()


def _rows(text: str) -> dict[int, list[str]]:
    return {int(m.group(1)): m.group(2).split() for m in re.finditer(r"^\s*(\d+) (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("mask, cp, kw", [(_packed(8192), 4, {}), (M.global_local(8192, 256, 1, 2), 4, dict(guest_rows=[[0, 256]])),
                                         (M.causal(4096), 8, {})])
def test_describe_lists_every_rank_with_the_plans_numbers(mask, cp, kw):
    p = mcp.plan(mask, cp, **kw)
    text = p.describe()
    rows = _rows(text)
    assert sorted(rows) == list(range(cp)), text
    area = np.array([r.area for r in p.ranks])
    for r in p.ranks:
        tokens, runs, work, share, recv, _, _, tiles, g_in, g_out = rows[r.rank]
        assert int(tokens.replace(",", "")) == r.num_tokens
        assert int(runs) == len(r.segments)
        assert int(work.replace(",", "")) == r.area
        assert float(share.rstrip("%")) == pytest.approx(100 * (r.area / area.mean() - 1), abs=0.006)
        assert int(recv.replace(",", "")) == r.num_remote == sum(r.recv_counts())
        assert int(tiles) == len(r.tiles)
        assert int(g_in) == sum(c for s, c in enumerate(r.guest_recv_counts()) if s != r.rank)
        out = {i for d, x in enumerate(r.guest_send_runs) if d != r.rank for a, b in x.tolist() for i in range(a, b)}
        assert int(g_out) == len(out)  # own rows computed elsewhere, each once however many ranks take it
    total = re.search(r"^\s*all (.*)$", text, flags=re.M).group(1).split()
    assert int(total[0].replace(",", "")) == p.seqlen
    assert int(total[2].replace(",", "")) == sum(r.area for r in p.ranks)
    imb = float(re.search(r"imbalance ([\d.]+)%", text).group(1))
    assert imb == pytest.approx(100 * p.stats()["imbalance"], abs=0.006)
    if kw:
        assert p.has_guests and "256 rows computed by their keys' owners" in text
        assert sum(int(rows[r][8]) for r in rows) == 3 * 256  # every other rank computes them
        assert sum(int(rows[r][9]) for r in rows) == 256


def test_stats_bytes_scale_with_the_shapes_given():
    p = mcp.plan(_packed(16384), 4)
    base = p.stats(num_kv_heads=8, head_dim=128, dtype_bytes=2)
    remote = sum(base["remote_kv_tokens_per_rank"])
    assert remote > 0
    assert base["kv_bytes_per_token"] == 2 * 8 * 128 * 2 and base["bytes_moved"] == remote * 4096
    assert p.stats() == base  # the documented defaults: 8 K/V heads, head dim 128, 2-byte elements
    for kw, factor in [(dict(dtype_bytes=4), 2), (dict(dtype_bytes="float32"), 2), (dict(dtype_bytes="torch.float8_e4m3fn"), 0.5),
                       (dict(dtype_bytes=np.dtype(np.float64)), 4), (dict(num_kv_heads=1), 1 / 8),
                       (dict(num_kv_heads=2, head_dim=64, dtype_bytes="bf16"), 1 / 8)]:
        st = p.stats(**kw)
        for key in ("bytes_moved", "max_bytes_received", "kv_bytes_per_token"):
            assert st[key] == base[key] * factor, (kw, key)
        assert st["remote_kv_tokens_per_rank"] == base["remote_kv_tokens_per_rank"]  # tokens do not change
    # describe prices the same way
    assert "4,096 bytes per token" in p.describe() and "512 bytes per token" in p.describe(num_kv_heads=1)
    for bad in (dict(dtype_bytes="int4x"), dict(dtype_bytes=0), dict(num_kv_heads=0), dict(head_dim=1.5)):
        with pytest.raises(ValueError):
            p.stats(**bad)
    with pytest.raises(TypeError):  # keyword-only: a positional 8 can no longer be mistaken for bytes
        p.stats(8, 128, 2)


# --------------------------------------------------------------------------------------------------
# block counts behind the pictures


def _random_masks():
    rng = np.random.default_rng(3)
    out = []
    for _ in range(12):
        sl = []
        for _ in range(4):
            q0, q1 = sorted(rng.choice(190, 2, replace=False))
            k0, k1 = sorted(rng.choice(190, 2, replace=False))
            sl.append(AttnSlice((q0, q1), (k0, k1), M.KINDS[rng.integers(4)]))
        out.append(AttnMask(sl, 190, 190))
    return out


@pytest.mark.parametrize("mask", [M.causal(300), M.sliding_window(257, 17, 5), M.strided(256, 16, 4), _packed(300),
                                  M.global_local(256, 16, 1, 2), M.streaming(300, 4, 40), *_random_masks()])
def test_block_counts_are_exact(mask):
    d = mask.to_dense()
    for b in (1, 3, 16, 64):
        g = block_grid(mask.traps, mask.seqlen_q, mask.seqlen_k, b)
        nq, nk = g.shape
        pad = np.zeros((nq * b, nk * b), dtype=np.int64)
        pad[: d.shape[0], : d.shape[1]] = d
        assert np.array_equal(g, pad.reshape(nq, b, nk, b).sum(axis=(1, 3))), b


@pytest.mark.parametrize("mask, kw", [(_packed(512), {}), (M.global_local(512, 32, 1, 2), dict(guest_rows=[[0, 32]])),
                                      (M.causal(512), dict(solver="zigzag"))])
def test_plan_blocks_show_the_rank_computing_each_cell(mask, kw):
    p = mcp.plan(mask, 4, chunk_size=16, **kw)
    cells, top = rank_blocks(p, 1)
    d = mask.to_dense()
    assert np.array_equal(cells, d.astype(np.int64))
    owner = np.repeat(p.owner, np.diff(p.bounds)).astype(np.int64)
    want = np.broadcast_to(owner[:, None], d.shape).copy()
    for a, b in p.guest_runs.tolist():  # guest cells: computed by the key's owner
        want[a:b] = owner[None, :]
    assert np.array_equal(np.where(d, want, -1), top)
    assert np.array_equal(row_owners(p, 1), owner)
    m = traffic_matrix(p)
    assert m.sum(axis=0).tolist() == p.stats()["remote_kv_tokens_per_rank"] and np.trace(m) == 0


def test_block_choice_and_labels():
    assert auto_block(131072) == 128 and auto_block(1 << 20) == 1024 and auto_block(1000) == 1 and auto_block(1025) == 2
    assert [tokens_label(v) for v in (0, 1000, 1536, 131072, 1 << 20, 3 << 19)] == ["0", "1000", "1.5k", "128k", "1M", "1.5M"]


# --------------------------------------------------------------------------------------------------
# the pictures


def test_draw_small_mask_and_plan(tmp_path):
    mask = M.sliding_window(2048, 100, 0)
    assert mask.draw(tmp_path / "mask.png") == tmp_path / "mask.png"
    w, h = _png_size(tmp_path / "mask.png")
    assert w >= 600 and h >= 600 and (tmp_path / "mask.png").stat().st_size > 10_000
    p = mcp.plan(M.global_local(2048, 64, 1, 2), 4, guest_rows=[[0, 64]])
    assert p.has_guests
    p.draw(tmp_path / "plan.png", num_kv_heads=4, dtype_bytes="float32", title="global + local")
    w, h = _png_size(tmp_path / "plan.png")
    assert (w, h) == (1600, 920) and (tmp_path / "plan.png").stat().st_size > 30_000
    # cp beyond the legend / annotation limits draws too
    mcp.plan(_packed(4096), 32).draw(tmp_path / "plan32.png", dpi=60)
    assert _png_size(tmp_path / "plan32.png") == (960, 552)


def test_draw_at_128k_is_fast(tmp_path):
    mask = _packed(131072)
    p = mcp.plan(mask, 8)
    mask.draw(tmp_path / "warm.png", max_blocks=64)  # matplotlib's import is not the drawing's cost
    t0 = time.perf_counter()
    mask.draw(tmp_path / "mask.png")
    t1 = time.perf_counter()
    p.draw(tmp_path / "plan.png")
    t2 = time.perf_counter()
    assert (tmp_path / "mask.png").stat().st_size > 10_000 and (tmp_path / "plan.png").stat().st_size > 30_000
    assert t1 - t0 < 5.0 and t2 - t1 < 8.0, (t1 - t0, t2 - t1)


def test_matplotlib_only_in_the_draw_modules_and_lazily():
    """Only the draw modules import matplotlib, and only inside their functions, so every package
    imports without it (docs/layers.md)."""
    import ast
    import pathlib

    root = pathlib.Path(mcp.__file__).resolve().parent
    draw = {root / "masks" / "draw.py", root / "planner" / "draw.py", root / "sparse" / "draw.py"}
    seen = set()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
        for n in ast.walk(tree):
            mods = [a.name for a in n.names] if isinstance(n, ast.Import) else (
                [n.module or ""] if isinstance(n, ast.ImportFrom) else [])
            if any(m.split(".")[0] == "matplotlib" for m in mods):
                assert path in draw, f"{path}:{n.lineno} imports matplotlib"
                assert id(n) in nested, f"{path}:{n.lineno} imports matplotlib at module level"
                seen.add(path)
    assert seen == draw


def test_draw_without_matplotlib_says_what_is_missing(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(ImportError, match="Plan.draw needs matplotlib"):
        mcp.plan(M.causal(256), 2).draw(tmp_path / "x.png")
    with pytest.raises(ImportError, match="AttnMask.draw needs matplotlib"):
        M.causal(256).draw(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
