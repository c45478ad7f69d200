"""Pictures of a dynamic sparse selection (``draw_selection``): per query head, the key blocks a selector
kept, next to where dense attention puts its probability mass (``block_mass``).

    keep = megatron_cp.sparse.select_blocks(q, k, plan, None, selector)       # bool [Hq, nb, nb], CP = 1
    dense = block_mass(q, k, selector.block, heads=[0, 5], mask=mask)        # float32 [2, nb, nb]
    draw_selection(keep, "sel.png", heads=[0, 5], dense=dense, envelope=view.envelope)

The dense map is the softmax of the full scores under the envelope, summed over each key block and
averaged over (a sample of) each q block's rows: the fraction of a row's attention a block holds. Where it
is given, each head's title also says how much of that mass the selection keeps (its *recall*).

matplotlib is imported inside ``draw_selection`` only, so ``megatron_cp.sparse`` never needs it.
"""

from __future__ import annotations

import math
import textwrap

import numpy as np
import torch

from ..masks import draw as mask_draw


def _envelope_cells(traps: torch.Tensor, rows: torch.Tensor, num_keys: int) -> torch.Tensor:
    """bool [len(rows), num_keys]: which cells of the given global rows (long [n]) the mask's trapezoids
    (long [t, 6], ``AttnMask.traps``: q0, q1, lo_a, lo_s, hi_a, hi_s; key j kept on row i iff
    lo_a + lo_s i <= j < hi_a + hi_s i) keep. Only trapezoids meeting the rows' range are visited, so a
    chunk of rows costs one or two comparisons of its size, not one per document."""
    out = torch.zeros(len(rows), num_keys, dtype=torch.bool, device=rows.device)
    r0, r1 = int(rows.min()), int(rows.max()) + 1
    sel = (traps[:, 0] < r1) & (traps[:, 1] > r0)
    i = rows[:, None]
    j = torch.arange(num_keys, device=rows.device)[None]
    for q0, q1, lo_a, lo_s, hi_a, hi_s in traps[sel].tolist():
        out |= (i >= q0) & (i < q1) & (j >= lo_a + lo_s * i) & (j < hi_a + hi_s * i)
    return out


@torch.no_grad()
def block_mass(q: torch.Tensor, k: torch.Tensor, block: int, heads, mask=None, *, rows_per_block: int = 16,
               softmax_scale: float | None = None, chunk_rows: int = 2048) -> torch.Tensor:
    """Dense attention's mass per block pair: float32 [len(heads), nb, nb] (nb = S / block) on q's device.

    q [S, Hq, D], k [S, Hkv, D]: the whole sequence in global order (any float dtype; scores in float32);
    ``heads``: query head indices (q head h reads k head h // (Hq / Hkv)); ``mask``: the envelope
    (``AttnMask``; None: causal). Entry [n, i, j] is the softmax mass that rows of q block i put on key
    block j, averaged over ``rows_per_block`` rows spread evenly through the block (every row when
    ``rows_per_block >= block``): each row of the map sums to 1 where the block's rows keep some key. Work
    is len(heads) * nb * rows_per_block * S scores, in chunks of ``chunk_rows`` rows.
    """
    s, hq, d = q.shape
    if s % block:
        raise ValueError(f"sequence length {s} is not a multiple of block {block}")
    nb, g = s // block, hq // k.shape[1]
    dev = q.device
    if mask is None:
        traps = torch.tensor([[0, s, 0, 0, 1, 1]], dtype=torch.long, device=dev)  # causal: 0 <= j < i + 1
    else:
        traps = torch.as_tensor(np.asarray(mask.traps), dtype=torch.long, device=dev)
    r = min(int(rows_per_block), block)
    # r rows per block, evenly spaced, each in the middle of its stretch of block / r rows
    offs = torch.div(torch.arange(r, device=dev) * block, r, rounding_mode="floor") + block // r // 2
    rows = (torch.arange(nb, device=dev)[:, None] * block + offs[None]).reshape(-1)  # [nb * r], q block major
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    heads = [int(h) for h in heads]
    out = torch.zeros(len(heads), nb, nb, dtype=torch.float32, device=dev)
    step = max(r, chunk_rows // r * r)  # whole q blocks per chunk
    for n, h in enumerate(heads):
        kh = k[:, h // g].float()
        for a in range(0, len(rows), step):
            rw = rows[a:a + step]
            sc = (q[rw, h].float() @ kh.T) * scale
            sc.masked_fill_(~_envelope_cells(traps, rw, s), float("-inf"))
            p = torch.softmax(sc, dim=-1).nan_to_num_(0.0)  # a row with no kept key: no mass
            pooled = p.view(len(rw), nb, block).sum(-1)  # [rows, nb]: mass per key block
            out[n, a // r:(a + len(rw)) // r] = pooled.view(-1, r, nb).mean(1)
    return out


def _np(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def draw_selection(keep, path, heads=None, dense=None, *, envelope=None, title: str | None = None,
                   dpi: int = 100) -> str:
    """Save a picture of a selection to ``path`` (PNG, headless) and return the path.

    keep: bool [Hq, nq, nb] (torch or numpy): per query head, q block (rows) and key block (columns) the
    blocks computed (``select_blocks`` at CP = 1: q blocks in global order). ``heads``: the query heads
    drawn, one row of panels each (default: up to 4 spread over the heads). ``dense``: float [len(heads),
    nq, nb] or [Hq, nq, nb], dense attention's mass per block (``block_mass``), drawn beside each
    selection on a log scale and used for the recall in the title (kept mass / all mass). ``envelope``:
    int8 / bool [nq, nb], the static mask's blocks (``view.envelope``), drawn in grey under the selection
    and used for the kept fraction (else the fraction is of all block pairs).
    """
    mask_draw.require_matplotlib("draw_selection")
    import matplotlib
    from matplotlib.colors import ListedColormap, LogNorm
    from matplotlib.figure import Figure  # no pyplot: no backend or global figure state is touched

    kp = _np(keep).astype(bool)
    if kp.ndim != 3:
        raise ValueError(f"keep must be bool [Hq, nq, nb], got shape {kp.shape}")
    hq, nq, nb = kp.shape
    if heads is None:
        heads = sorted(set(np.linspace(0, hq - 1, min(4, hq)).round().astype(int).tolist()))
    heads = [int(h) for h in heads]
    if any(not 0 <= h < hq for h in heads):
        raise ValueError(f"heads {heads} out of range for {hq} query heads")
    dn = None
    if dense is not None:
        dn = _np(dense).astype(np.float64)
        if dn.shape == (hq, nq, nb) and len(heads) != hq:
            dn = dn[heads]
        if dn.shape != (len(heads), nq, nb):
            raise ValueError(f"dense must be [len(heads)={len(heads)} or Hq={hq}, {nq}, {nb}], got {dn.shape}")
    env = None if envelope is None else _np(envelope).astype(np.int64) > 0
    if env is not None and env.shape != (nq, nb):
        raise ValueError(f"envelope must be [{nq}, {nb}], got {env.shape}")

    cols = 1 if dn is None else 2
    side = 4.2
    fig = Figure(figsize=(side * cols + 0.6, side * len(heads) * nq / max(nq, nb) + 0.9), dpi=dpi)
    axes = np.asarray(fig.subplots(len(heads), cols, squeeze=False))
    # 0: outside the envelope (white), 1: envelope not selected (light grey), 2: selected (dark blue)
    sel_cmap = ListedColormap(["white", "#d9d9d9", "#08306b"])
    mass_cmap = matplotlib.colormaps["magma_r"].with_extremes(bad="white")
    for n, h in enumerate(heads):
        img = np.where(kp[h], 2, np.where(env, 1, 0) if env is not None else 0)
        ax = axes[n, 0]
        ax.imshow(img, cmap=sel_cmap, vmin=0, vmax=2, interpolation="nearest", aspect="auto")
        base = int(env.sum()) if env is not None else nq * nb
        what = f"head {h}: {int(kp[h].sum()):,} blocks kept ({kp[h].sum() / max(base, 1):.1%} of " \
               f"{'envelope' if env is not None else 'all'})"
        if dn is not None:
            tot = dn[n].sum()
            what += f", recall {(dn[n] * kp[h]).sum() / tot:.1%}" if tot > 0 else ""
        ax.set_title(what, fontsize=8)
        ax.set_ylabel("q block")
        if dn is not None:
            ax2 = axes[n, 1]
            m = np.ma.masked_less_equal(dn[n], 0.0)
            top = float(m.max()) if m.count() else 1.0
            im = ax2.imshow(m, cmap=mass_cmap, norm=LogNorm(vmin=top * 1e-4, vmax=top, clip=True),
                            interpolation="nearest", aspect="auto")
            ax2.set_title(f"head {h}: dense attention mass per block", fontsize=8)
            fig.colorbar(im, ax=ax2, fraction=0.046, pad=0.03)
    for ax in axes[-1]:
        ax.set_xlabel("key block")
    head = title if title is not None else f"selection: {hq} heads, {nq} q blocks x {nb} key blocks"
    head = textwrap.fill(head, 30 * cols + 20)  # a long title wraps instead of running off the figure
    fig.suptitle(head, fontsize=9)
    # room for the suptitle's lines above the first row's titles
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.3 + 0.15 * head.count("\n")) / fig.get_figheight()))
    fig.savefig(path, dpi=dpi)
    return path


__all__ = ["block_mass", "draw_selection"]
