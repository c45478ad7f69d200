"""tools/bench_sparse.py on the CPU (its --dry-run: reference kernels, tiny sizes) and the selection
picture (megatron_cp/sparse/draw.py). No test here asserts a timing."""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

import pytest
import torch

import megatron_cp as mcp
from megatron_cp.sparse.draw import block_mass, draw_selection
from scripts import load_script

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"
METHODS = ("moba", "xattention", "flexprefill", "minference")
FIELDS = ("kept_blocks", "kept_cells", "select_ms", "fwd_ms", "bwd_ms", "attn_fwd_ms", "kernel_fwd_ms", "kernel_bwd_ms",
          "dense_fwd_ms", "dense_bwd_ms", "speedup_fwd", "speedup_bwd", "kernel_tflops_fwd", "kernel_tflops_bwd",
          "dense_tflops_fwd", "dense_tflops_bwd", "tflops_ratio_fwd", "tflops_ratio_bwd", "out_rel_err")


def _tool():
    return load_script(TOOLS / "bench_sparse.py")


def _table(out: str) -> list[str]:
    """The markdown table at the end of ``out``: header, rule, rows."""
    lines = out.rstrip("\n").splitlines()
    n = len(lines)
    while n and lines[n - 1].startswith("|"):
        n -= 1
    return lines[n:]


def test_dry_run_end_to_end(tmp_path):
    """The documented CPU dry run, with the selection pictures: a table row per method, the JSON's meta
    (device, date, command) and every field of each row, the summary PNG and one selection PNG per method."""
    p = subprocess.run([sys.executable, str(TOOLS / "bench_sparse.py"), "--dry-run", "--png", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    table = _table(p.stdout)
    assert len(table) == 2 + len(METHODS), p.stdout
    assert table[0].startswith("| method | S | kept blocks % |") and "out rel. err" in table[0]
    assert [row.split("|")[1].strip() for row in table[2:]] == list(METHODS)
    res = json.loads((tmp_path / "bench_sparse.json").read_text())
    meta = res["meta"]
    assert {"device", "date", "command", "backend", "Hq", "Hkv", "D", "dtype"} <= meta.keys()
    assert meta["backend"]["name"] == "reference" and "--dry-run" in meta["command"]
    assert (meta["Hq"], meta["Hkv"], meta["D"], meta["dtype"]) == (4, 2, 32, "fp32")
    assert (tmp_path / "bench_sparse.png").stat().st_size > 0
    for r in res["results"]:
        assert r["S"] == 1024 and "error" not in r, r
        assert all(f in r for f in FIELDS), sorted(set(FIELDS) - r.keys())
        assert 0 < r["kept_blocks"] <= 1 and 0 < r["kept_cells"] <= 1
        assert r["blocks_selected"] <= r["blocks_envelope"] and r["cells_kept"] <= r["cells_envelope"]
        assert r["out_rel_err"] >= 0 and set(r["recall"]) == {"0", "2"}  # default heads: one per K/V head
        png = tmp_path / f"selection_{r['method']}_S1024.png"
        assert png.stat().st_size > 0 and meta["selection_png"][r["method"]] == str(png)


def test_kept_fraction_and_error_of_a_full_selection():
    """Selecting every envelope block is dense attention: kept fractions 1, output error ~0 (fp32)."""
    bs = _tool()

    class All:
        name, block = "all", 64

        def check(self, *a):
            pass

        def select(self, q, k, view):
            return (view.envelope > 0)[None].expand(q.shape[1], -1, -1).clone()

    bs.make_selector = lambda *a: All()
    rows = bs.main(["--dry-run", "--methods", "moba", "--envelope", "packed"])
    (r,) = rows
    assert r["kept_blocks"] == 1 and r["kept_cells"] == 1 and r["out_rel_err"] < 1e-5, r


def test_structured_inputs_put_mass_where_their_kind_says():
    """structured_qk: the a-shape head puts most of its mass on the sink block and the diagonal band; the
    vertical-slash head on the slash distances (multiples of P = 256 tokens here); block_mass rows sum to 1."""
    bs = _tool()
    s, blk = 2048, 64
    q, k = bs.structured_qk(s, 4, 2, 64, "cpu")
    assert bs.structure_kinds(2) == ["a-shape", "vertical-slash"]
    m = block_mass(q, k, blk, [0, 2], rows_per_block=8)  # q head 0: K/V head 0; q head 2: K/V head 1
    torch.testing.assert_close(m.sum(-1), torch.ones(2, s // blk), rtol=1e-4, atol=1e-4)
    nb = s // blk
    i = torch.arange(nb)
    sink_band = m[0][:, 0] + m[0][i, i] + torch.cat([torch.zeros(1), m[0][i[1:], i[1:] - 1]])
    assert sink_band[4:].mean() > 0.5
    d = i[:, None] - i[None]  # block distance; slashes at multiples of 256 tokens = 4 blocks
    on_slash = ((d >= 0) & (d % 4 == 0)) | ((d >= 0) & (d % 4 == 3))
    assert (m[1] * on_slash).sum(-1)[8:].mean() > 0.6


def test_block_mass_matches_dense_softmax():
    """block_mass with every row is the block-pooled softmax of the envelope's scores (packed documents)."""
    s, blk = 256, 32
    mask = mcp.masks.varlen([0, 70, 200, 256], causal=True)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(s, 4, 8, generator=g), torch.randn(s, 2, 8, generator=g)
    got = block_mass(q, k, blk, [1, 3], mask, rows_per_block=blk, chunk_rows=64)
    keep = torch.from_numpy(mask.to_dense())
    for n, h in enumerate((1, 3)):
        sc = (q[:, h] @ k[:, h // 2].T) / 8 ** 0.5
        p = torch.softmax(sc.masked_fill(~keep, float("-inf")), -1)
        want = p.view(s // blk, blk, s // blk, blk).sum(-1).mean(1)
        torch.testing.assert_close(got[n], want, rtol=1e-5, atol=1e-6)


def test_draw_selection_writes_a_png(tmp_path):
    """draw_selection: selection only, and beside dense mass (given for the drawn heads or for all heads);
    bad shapes raise ValueError."""
    hq, nb = 4, 8
    keep = torch.tril(torch.ones(nb, nb, dtype=torch.bool))[None].repeat(hq, 1, 1)
    keep[:, 4:, 1:3] = False
    env = torch.tril(torch.ones(nb, nb, dtype=torch.int8)) * 2
    dense = torch.rand(hq, nb, nb) * env
    for i, kw in enumerate(({}, {"dense": dense, "envelope": env}, {"dense": dense[[1, 2]], "heads": [1, 2]})):
        path = draw_selection(keep, tmp_path / f"sel{i}.png", **kw)
        assert pathlib.Path(path).stat().st_size > 0
    with pytest.raises(ValueError, match="dense must be"):
        draw_selection(keep, tmp_path / "bad.png", heads=[0], dense=dense[:2])
    with pytest.raises(ValueError, match="out of range"):
        draw_selection(keep, tmp_path / "bad.png", heads=[4])


def test_selectors_at_published_defaults(tmp_path):
    """Each method runs at its published defaults (the dry run: DRY_RUN_BLOCK); MInference reads
    --minference-config at --minference-layer, else one pattern per q head fitting its K/V head's structure kind."""
    bs = _tool()
    a = argparse.Namespace(dry_run=False, minference_config=None, minference_layer=0)
    assert (bs.make_selector("moba", a, 32, 8).top_k, bs.make_selector("moba", a, 32, 8).block) == (3, 512)
    x = bs.make_selector("xattention", a, 32, 8)
    assert (x.stride, x.threshold, x.block) == (8, 0.9, 128)
    f = bs.make_selector("flexprefill", a, 32, 8)
    assert (f.gamma, f.tau, f.min_budget, f.max_budget) == (0.9, 0.1, 512, None)
    m = bs.make_selector("minference", a, 8, 4)
    assert [p.kind for p in m.patterns] == ["a_shape"] * 2 + ["vertical_slash"] * 2 + ["a_shape"] * 2 + \
        ["block_sparse"] * 2
    cfg = tmp_path / "patterns.json"
    cfg.write_text(json.dumps({"layers": [[{"kind": "a_shape"}] * 4, [{"kind": "block_sparse", "top_k": 3}] * 4]}))
    a = argparse.Namespace(dry_run=True, minference_config=str(cfg), minference_layer=1)
    m = bs.make_selector("minference", a, 4, 2)
    assert m.block == 64 and [p.top_k for p in m.patterns] == [3] * 4
    assert bs.make_selector("moba", a, 4, 2).block == 128
