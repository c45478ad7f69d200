"""A picture of a plan (``Plan.draw``): who computes which cells, who owns which rows, which K/V travel.

Everything is counted on a block grid (``masks.draw.block_cells``: exact cells per block, at most about
1024 blocks a side), so a 1M-token plan draws in about the time it takes to plan; the numbers in titles
and the legend are the plan's exact counts (``Plan.stats``).

matplotlib is imported inside ``draw_plan`` only, so the planner never needs it.
"""

from __future__ import annotations

import numpy as np

from ..masks import draw as mask_draw
from .units import fmt_bytes


def rank_colors(cp: int) -> np.ndarray:
    """One RGB colour per rank (float [cp, 3]): tab10 / tab20 up to 20 ranks, beyond that hues spread
    by the golden ratio so neighbouring ranks differ."""
    import matplotlib

    if cp <= 10:
        return np.asarray(matplotlib.colormaps["tab10"].colors[:cp])
    if cp <= 20:
        return np.asarray(matplotlib.colormaps["tab20"].colors[:cp])
    cmap = matplotlib.colormaps["turbo"]
    return np.asarray([cmap(0.05 + 0.9 * ((r * 0.6180339887) % 1.0))[:3] for r in range(cp)])


def _owner_of(plan, pos: np.ndarray) -> np.ndarray:
    """The rank that owns each global position (int64)."""
    return plan.owner[np.searchsorted(plan.bounds, pos, side="right") - 1].astype(np.int64)


def rank_blocks(plan, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(cells, rank): cells kept per block (int64 [nb, nb]) and the rank computing most of them
    (int64 [nb, nb], -1 where empty). A row's cells go to its owner; guest rows' cells to their key
    block's owner (the owner of the block's first key)."""
    s, cp = plan.seqlen, plan.cp_size
    nb = -(-s // block)
    g = np.asarray(plan.guest_runs, dtype=np.int64).reshape(-1, 2)
    cuts = np.union1d(plan.bounds, g.reshape(-1))
    row, rb, kb, cells = mask_draw.block_cells(plan.traps, block, row_cuts=cuts)
    rank = _owner_of(plan, row)
    if len(g):
        guest = (np.searchsorted(g[:, 0], row, side="right") - 1).clip(0)
        guest = (row >= g[guest, 0]) & (row < g[guest, 1])
        rank = np.where(guest, _owner_of(plan, np.minimum(kb * block, s - 1)), rank)
    key = (rb * nb + kb) * cp + rank
    uniq, inv = np.unique(key, return_inverse=True)
    per = np.bincount(inv, weights=cells)
    blk, rk = uniq // cp, uniq % cp
    total = np.bincount(blk, weights=per, minlength=nb * nb).astype(np.int64).reshape(nb, nb)
    # the largest count per block: sort by (block, count) and keep each block's last entry
    order = np.lexsort((per, blk))
    last = np.ones(len(order), dtype=bool)
    last[:-1] = blk[order][1:] != blk[order][:-1]
    top = np.full(nb * nb, -1, dtype=np.int64)
    top[blk[order][last]] = rk[order][last]
    return total, top.reshape(nb, nb)


def row_owners(plan, block: int) -> np.ndarray:
    """The rank owning most rows of each row block (int64 [nb])."""
    s, cp = plan.seqlen, plan.cp_size
    cuts = np.union1d(plan.bounds, np.minimum(np.arange(0, s + block, block), s))
    a, b = cuts[:-1], cuts[1:]
    counts = np.bincount((a // block) * cp + _owner_of(plan, a), weights=b - a, minlength=(-(-s // block)) * cp)
    return counts.reshape(-1, cp).argmax(axis=1)


def traffic_matrix(plan) -> np.ndarray:
    """K/V tokens rank ``dst`` receives from rank ``src``: int64 [cp (src), cp (dst)]."""
    cp = plan.cp_size
    m = np.zeros((cp, cp), dtype=np.int64)
    for r in plan.ranks:
        m[:, r.rank] = r.recv_counts()
    return m


def draw_plan(plan, path, *, block: int | None = None, max_blocks: int = 1024, num_kv_heads: int = 8,
              head_dim: int = 128, dtype_bytes: int | str = 2, title: str | None = None, dpi: int = 100) -> str:
    """Save a picture of ``plan`` to ``path`` and return the path.

    Panels: (1) the mask at ``block x block`` resolution (``block``: auto, the smallest power of two giving
    at most ``max_blocks`` blocks a side), each block in the colour of the rank computing most of its
    cells, paler where the block keeps fewer of its cells; a strip left of the rows and one above the keys
    show which rank owns them, so a block whose colour differs from its column's strip computes on K/V
    that travelled. (2) the K/V traffic matrix, src -> dst, in bytes. (3) work (cells) per rank and
    (4) received K/V bytes per rank, with exact counts in the titles. Bytes are priced like
    ``Plan.stats`` (``num_kv_heads``, ``head_dim``, ``dtype_bytes``; defaults 8, 128, 2 bytes).
    """
    mask_draw.require_matplotlib("Plan.draw")
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: no backend or global figure state is touched
    import matplotlib.ticker
    from matplotlib.patches import Patch

    s, cp = plan.seqlen, plan.cp_size
    b = int(block) if block is not None else mask_draw.auto_block(s, max_blocks)
    st = plan.stats(num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
    per_tok = st["kv_bytes_per_token"]
    colors = rank_colors(cp)

    cells, top = rank_blocks(plan, b)
    sizes = mask_draw.block_sizes(s, b)
    frac = cells / np.outer(sizes, sizes)
    shade = np.where(cells > 0, 0.25 + 0.75 * frac, 0.0)[..., None]
    img = 1.0 - shade * (1.0 - colors[np.maximum(top, 0)])
    owners = colors[row_owners(plan, b)]

    fig = Figure(figsize=(16, 9.2), dpi=dpi)
    outer = fig.add_gridspec(1, 2, width_ratios=[1.0, 0.62], wspace=0.12, left=0.06, right=0.98, top=0.9, bottom=0.07)
    left = outer[0].subgridspec(2, 2, width_ratios=[0.025, 1], height_ratios=[0.025, 1], wspace=0.01, hspace=0.01)
    ax = fig.add_subplot(left[1, 1])
    ax_rows = fig.add_subplot(left[1, 0], sharey=ax)
    ax_keys = fig.add_subplot(left[0, 1], sharex=ax)
    ext = (0, s, s, 0)
    ax.imshow(img, extent=ext, aspect="auto", interpolation="antialiased")
    ax_rows.imshow(owners[:, None, :], extent=(0, 1, s, 0), aspect="auto", interpolation="nearest")
    ax_keys.imshow(owners[None, :, :], extent=(0, s, 1, 0), aspect="auto", interpolation="nearest")
    ax_rows.set_xticks([])
    ax_rows.set_ylabel("query rows (strip: owning rank)")
    ax_keys.set_yticks([])
    ax_keys.set_title("keys (strip: owning rank, whose K/V they are)", fontsize=9)
    ax.tick_params(labelleft=False, labeltop=False)
    ax_keys.tick_params(labelbottom=False)
    ax.set_xlabel(f"key; block {b} x {b} ({cells.shape[0]} blocks a side), colour: rank computing the block, "
                  "paler: fewer cells kept", fontsize=9)
    ticks = np.linspace(0, s, 9)
    for a, axis in ((ax, ax.xaxis), (ax_rows, ax_rows.yaxis)):
        axis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
        axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: mask_draw.tokens_label(v)))
    if cp <= 16:
        handles = [Patch(color=colors[r], label=f"rank {r}: {st['tokens_per_rank'][r]:,} tokens, "
                         f"{len(plan.ranks[r].segments)} runs") for r in range(cp)]
        ax.legend(handles=handles, loc="upper right", fontsize=8, framealpha=0.9)

    right = outer[1].subgridspec(3, 1, height_ratios=[1.5, 1, 1], hspace=0.45)
    ax_m = fig.add_subplot(right[0])
    mat = traffic_matrix(plan) * per_tok
    im = ax_m.imshow(mat / 2**20, cmap="Reds", interpolation="nearest", aspect="auto")
    fig.colorbar(im, ax=ax_m, fraction=0.05, pad=0.02, label="MiB")
    ax_m.set_xlabel("dst rank (receives)")
    ax_m.set_ylabel("src rank (owns the K/V)")
    ax_m.set_title(f"K/V that travel: {sum(st['remote_kv_tokens_per_rank']):,} tokens, {fmt_bytes(st['bytes_moved'])} "
                   f"({per_tok:,} B/token)", fontsize=10)
    if cp <= 16:
        ax_m.set_xticks(range(cp))
        ax_m.set_yticks(range(cp))
        hi = mat.max() if mat.max() > 0 else 1
        for i in range(cp):
            for j in range(cp):
                if mat[i, j]:
                    ax_m.text(j, i, fmt_bytes(mat[i, j]).replace(" ", "\n"), ha="center", va="center", fontsize=6.5,
                              color="white" if mat[i, j] > 0.6 * hi else "black")

    x = np.arange(cp)
    area = np.asarray(st["area_per_rank"], dtype=np.int64)
    ax_w = fig.add_subplot(right[1])
    unit, name = next((u, n) for u, n in ((1e9, "billion cells"), (1e6, "million cells"), (1, "cells"))
                      if area.max() >= u or u == 1)
    ax_w.bar(x, area / unit, color=colors, width=0.85)
    ax_w.axhline(area.mean() / unit, color="black", lw=0.8, ls="--")
    ax_w.set_title(f"work per rank: max {int(area.max()):,} cells, mean {area.mean():,.0f}; "
                   f"imbalance {st['imbalance']:.2%}", fontsize=10)
    ax_w.set_ylabel(name)
    ax_r = fig.add_subplot(right[2])
    recv = np.asarray(st["remote_kv_tokens_per_rank"], dtype=np.int64) * per_tok
    ax_r.bar(x, recv / 2**20, color=colors, width=0.85)
    ax_r.set_title(f"K/V received per rank: max {fmt_bytes(st['max_bytes_received'])} "
                   f"({st['max_remote_kv_tokens']:,} tokens)", fontsize=10)
    ax_r.set_ylabel("MiB")
    ax_r.set_xlabel("rank")
    for a in (ax_w, ax_r):
        a.set_xlim(-0.6, cp - 0.4)
        if cp <= 32:
            a.set_xticks(x)

    guests = f"; {st['guest_rows']:,} guest rows" if st["guest_rows"] else ""
    head = title if title is not None else "megatron-cp plan"
    fig.suptitle(f"{head}: S = {s:,}, cp = {cp}, solver {plan.solver}, chunk {plan.chunk_size}; "
                 f"mask {plan.mask_area:,} cells{guests}", fontsize=12)
    fig.savefig(path, dpi=dpi)
    return path
