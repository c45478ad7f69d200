"""A small reference of FlashAttention-4's call semantics (``_flash_attn_fwd`` / ``_flash_attn_bwd`` of
flash_attn.cute.interface, 4.0.0b36), for running the FA4 backend's calls on the CPU.

What it models, and asserts where FA4 would be silently wrong:
- dense calls (q [B, S, H, D]) and varlen calls (q [total, H, D] with int32 ``cu_seqlens_*`` of shape
  [B + 1] and ``seqused_*`` [B]: sequence b is rows ``cu_q[b] : cu_q[b] + used_q[b]``); the q segments of
  a call increase and are disjoint (FA4 writes out / lse / dq per sequence); in the backward the k
  segments too (dK / dV and FA4's padded accumulators are laid out per sequence, in order);
- windows bottom-right aligned per sequence: row i keeps key j iff
  ``i + sk - sq - left <= j <= i + sk - sq + right`` (None unbounded), ``causal`` = (None, 0);
- lse natural log, float32, head-major ([H, total] varlen, [B, H, S] dense); rows keeping no key give
  out 0 and lse -inf; ``out`` / ``lse`` / ``dq`` / ``dk`` / ``dv`` given are written in place;
- the backward uses the given (merged) out and lse: P = exp(s - lse), D = rowsum(dO O) - dlse.

- block-sparse calls (dense layout, batch 1): ``block_sparse_tensors`` (mask_cnt [1, H, R], mask_idx
  [1, H, R, C], full_cnt, full_idx, block_size) list per q-block (forward) or, transposed, per k-block
  (backward) the blocks to compute; ``H`` is 1 (broadcast over heads) or the number of QUERY heads (per-head
  lists; GQA: query head h reads K/V head h // (Hq // Hkv), as FA4's block_sparsity normalisation takes
  ``num_head = q.shape[-2]``); full ones keep every cell, partial ones the cells ``mask_mod`` keeps (here
  ``interval_mask``: the row's key intervals in ``aux_tensors[0]``, or ``band_mask``).

Stricter than FA4 on one point: rows and keys outside the call's sequences are overwritten with NaN in
every output buffer, so a caller that reads what a call does not own fails.
Computes in float64.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_cp.kernels.fa4.cells import periodic_cells


def _segments(n_total, cu, used, name, strict):
    b = cu.shape[0] - 1
    assert cu.dtype == torch.int32 and cu.dim() == 1, f"{name}: cu_seqlens must be int32 [B + 1]"
    assert used is None or (used.dtype == torch.int32 and used.shape == (b,)), f"{name}: seqused int32 [B]"
    starts = cu[:-1].tolist()
    lens = used.tolist() if used is not None else (cu[1:] - cu[:-1]).tolist()
    segs = list(zip(starts, lens))
    for i, (a, n) in enumerate(segs):
        assert n >= 0 and a >= 0 and a + n <= n_total, f"{name}: sequence {i} [{a}, {a + n}) out of [0, {n_total})"
        if strict and i:
            pa, pn = segs[i - 1]
            assert pa + pn <= a, f"{name}: sequences {i - 1} and {i} overlap or are out of order"
        if strict:
            assert cu[i + 1] >= a + n, f"{name}: cu_seqlens[{i + 1}] < end of sequence {i}"
    return segs


class Lists(NamedTuple):
    mask_cnt: torch.Tensor
    mask_idx: torch.Tensor
    full_cnt: torch.Tensor
    full_idx: torch.Tensor
    block_size: tuple


def block_sparse(mask_cnt, mask_idx, full_cnt, full_idx, block_size):
    return Lists(mask_cnt, mask_idx, full_cnt, full_idx, block_size)


def interval_masks() -> dict:
    """The backend's mask_mods by intervals per row (each asserts the width of the bounds it reads), and the bitmap
    ones: bit ``c & 31`` of word ``[r, c >> 5]`` ("bitmap"), bit ``r & 31`` of word ``[c, r >> 5]`` ("bitmap_t")."""
    def make(n):
        def mask(rows, cols, aux_tensors):
            assert aux_tensors[0].shape[1] == 2 * n, f"{n}-interval mask_mod given {aux_tensors[0].shape[1]} bounds"
            return interval_mask(rows, cols, aux_tensors)
        return mask

    def bitmap(rows, cols, aux_tensors):
        words = aux_tensors[0][rows][:, cols // 32].long() & 0xFFFFFFFF
        return ((words >> (cols % 32)[None, :]) & 1).bool()
    def bitmap_t(rows, cols, aux_tensors):
        words = aux_tensors[0][cols][:, rows // 32].long() & 0xFFFFFFFF  # [cols, rows]
        return ((words >> (rows % 32)[None, :]) & 1).bool().t()
    def by_key(n):
        def mask(rows, cols, aux_tensors):
            assert aux_tensors[0].shape[1] == 2 * n, f"{n}-interval mask_mod by key given {aux_tensors[0].shape[1]} bounds"
            return interval_mask(cols, rows, aux_tensors).t()
        return mask
    return {1: make(1), 2: make(2), "bitmap": bitmap, "bitmap_t": bitmap_t, "by_key_1": by_key(1), "by_key_2": by_key(2)}


def band_mask(sink, dlo, dhi, group=0, period=0, local=0):
    """The backend's band mask_mod: key - row <= dhi and (key < sink or key - row >= dlo), with ``group`` only the
    cells whose group offset row // group - key // group is below ``local`` or a multiple of ``period``; no aux
    tensors."""
    def mask(rows, cols, aux_tensors):
        assert aux_tensors is None, "the band mask_mod reads no aux tensor"
        if group:  # the expression the kernel's mask_mod runs (dlo is below every cell there: not compared)
            assert sink == 0, "a periodic band has no sink keys"
            return periodic_cells(rows[:, None], cols[None, :], dhi, group, period, local)
        d = cols[None, :] - rows[:, None]
        return (d <= dhi) & ((cols[None, :] < sink) | (d >= dlo))
    return mask


def interval_mask(rows, cols, aux_tensors):
    """Key in one of the row's intervals: bool [len(rows), len(cols)]."""
    b = aux_tensors[0][rows].long()
    c = cols[None, :]
    keep = torch.zeros(len(rows), len(cols), dtype=torch.bool)
    for i in range(0, b.shape[1], 2):
        keep |= (c >= b[:, i:i + 1]) & (c < b[:, i + 1:i + 2])
    return keep


def _block_keep(lists, mask_mod, aux, sq, sk, heads, transposed):
    """Kept cells [H, sq, sk] of block-sparse lists (per q-block, or per k-block when ``transposed``); H is
    the lists' head axis: 1 (broadcast) or ``heads`` (the query heads)."""
    bq, bk = lists.block_size
    hb = lists.mask_cnt.shape[1]
    assert hb in (1, heads), f"lists' head axis {hb} is neither 1 nor the {heads} query heads"
    for t in (lists.mask_cnt, lists.mask_idx, lists.full_cnt, lists.full_idx):
        assert t.dtype == torch.int32 and t.shape[:2] == (1, hb), "lists are int32 [1, H, ...], one H for all"
    n_rows = -(-(sk if transposed else sq) // (bk if transposed else bq))
    n_cols = -(-(sq if transposed else sk) // (bq if transposed else bk))
    assert lists.mask_cnt.shape[2] == n_rows and lists.mask_idx.shape[2:] == (n_rows, n_cols)
    assert lists.full_cnt.shape[2] == n_rows and lists.full_idx.shape[2:] == (n_rows, n_cols)
    keep = torch.zeros(hb, sq, sk, dtype=torch.bool)
    rows_all, cols_all = torch.arange(sq), torch.arange(sk)
    for h in range(hb):
        for full, (cnt, idx) in ((True, (lists.full_cnt, lists.full_idx)), (False, (lists.mask_cnt, lists.mask_idx))):
            for i in range(n_rows):
                c_i = int(cnt[0, h, i])
                assert 0 <= c_i <= n_cols, f"count {c_i} out of [0, {n_cols}]"
                js = idx[0, h, i, :c_i].tolist()
                assert js == sorted(set(js)) and all(0 <= j < n_cols for j in js), "block indices ascend, no repeats"
                for j in js:
                    m, n = (j, i) if transposed else (i, j)
                    r, c = rows_all[m * bq:(m + 1) * bq], cols_all[n * bk:(n + 1) * bk]
                    assert not keep[h, r[0]:r[-1] + 1, c[0]:c[-1] + 1].any(), "block listed twice"
                    keep[h, r[0]:r[-1] + 1, c[0]:c[-1] + 1] = True if full else mask_mod(r, c, aux)
    return keep


def _window(causal, left, right):
    if causal:
        assert left is None and right is None, "causal with a window"
        return None, 0
    return left, right


def _keep(sq, sk, left, right):
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    d = i + sk - sq
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left is not None:
        keep &= j >= d - left
    if right is not None:
        keep &= j <= d + right
    return keep


def _as_varlen(q, k, v, cu_q, cu_k, used_q, used_k):
    """(q, k, v as [total, H, D], q segments, k segments, dense batch or None)."""
    if cu_q is None:
        assert q.dim() == 4 and k.dim() == 4 and cu_k is None and used_q is None and used_k is None
        bsz, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        segs_q = [(b * sq, sq) for b in range(bsz)]
        segs_k = [(b * sk, sk) for b in range(bsz)]
        return q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), segs_q, segs_k, bsz
    assert q.dim() == 3 and k.dim() == 3 and cu_k is not None
    return q, k, v, None, None, None


def _owned(n, segs):
    m = torch.zeros(n, dtype=torch.bool)
    for a, ln in segs:
        m[a:a + ln] = True
    return m


def fwd(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None,
        max_seqlen_k=None, softmax_scale=None, causal=False, window_size_left=None, window_size_right=None,
        return_lse=False, out=None, lse=None, block_sparse_tensors=None, mask_mod=None, aux_tensors=None):
    dense = cu_seqlens_q is None
    blocks = None
    if block_sparse_tensors is not None:
        assert dense and q.shape[0] == 1 and not causal and window_size_left is None and window_size_right is None
        blocks = _block_keep(block_sparse_tensors, mask_mod, aux_tensors, q.shape[1], k.shape[1], q.shape[2], False)
    qf, kf, vf, segs_q, segs_k, bsz = _as_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    if not dense:
        segs_q = _segments(qf.shape[0], cu_seqlens_q, seqused_q, "q", strict=True)
        segs_k = _segments(kf.shape[0], cu_seqlens_k, seqused_k, "k", strict=False)
        assert max_seqlen_q is None or max_seqlen_q >= max(n for _, n in segs_q)
        assert max_seqlen_k is None or max_seqlen_k >= max(n for _, n in segs_k)
    total, h, d = qf.shape
    hkv = kf.shape[1]
    g = h // hkv
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    left, right = _window(causal, window_size_left, window_size_right)
    o = torch.zeros(total, h, vf.shape[-1], dtype=torch.float64)  # v's head dim (MLA: 192 / 128)
    l = torch.full((h, total), float("-inf"), dtype=torch.float64)
    for (qa, sq), (ka, sk) in zip(segs_q, segs_k):
        if sq == 0:
            continue
        qs = qf[qa:qa + sq].double()
        ks = kf[ka:ka + sk].double().repeat_interleave(g, 1)
        vs = vf[ka:ka + sk].double().repeat_interleave(g, 1)
        s = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        s = s.masked_fill(~(_keep(sq, sk, left, right)[None] if blocks is None else blocks), float("-inf"))
        ls = torch.logsumexp(s, -1)
        p = torch.where(torch.isfinite(ls)[..., None], torch.exp(s - ls[..., None]), torch.zeros_like(s))
        o[qa:qa + sq] = torch.einsum("hij,jhd->ihd", p, vs)
        l[:, qa:qa + sq] = ls
    owned = _owned(total, segs_q)
    o[~owned] = float("nan")
    l[:, ~owned] = float("nan")
    if out is None:
        out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
    if lse is None and return_lse:
        lse = torch.empty((bsz, h, q.shape[1]) if dense else (h, total), dtype=torch.float32)
    out_flat = out.flatten(0, 1) if dense else out
    out_flat.copy_(o.to(out.dtype))
    if lse is not None:
        if dense:
            lse.copy_(l.view(h, bsz, -1).transpose(0, 1).to(lse.dtype))
        else:
            assert lse.shape == (h, total), f"varlen lse must be [H, total], got {tuple(lse.shape)}"
            lse.copy_(l.to(lse.dtype))
    return out, lse, None, None, None


def bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
        window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
        max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None, dlse=None,
        block_sparse_tensors=None, mask_mod=None, aux_tensors=None):
    dense = cu_seqlens_q is None
    blocks = None
    if block_sparse_tensors is not None:
        assert dense and q.shape[0] == 1 and not causal and window_size_left is None and window_size_right is None
        assert not deterministic, "FA4's sm90 block-sparse backward is not deterministic"
        blocks = _block_keep(block_sparse_tensors, mask_mod, aux_tensors, q.shape[1], k.shape[1], q.shape[2], True)
    qf, kf, vf, segs_q, segs_k, bsz = _as_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    of, dof = (out.flatten(0, 1), dout.flatten(0, 1)) if dense else (out, dout)
    if dense:
        lf = lse.transpose(0, 1).reshape(lse.shape[1], -1)
        dlf = None if dlse is None else dlse.transpose(0, 1).reshape(dlse.shape[1], -1)
    else:
        segs_q = _segments(qf.shape[0], cu_seqlens_q, seqused_q, "q", strict=True)
        segs_k = _segments(kf.shape[0], cu_seqlens_k, seqused_k, "k", strict=True)
        assert lse.shape == (q.shape[1], q.shape[0]), "varlen lse must be [H, total]"
        lf, dlf = lse, dlse
    total, h, d = qf.shape
    hkv = kf.shape[1]
    g = h // hkv
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    left, right = _window(causal, window_size_left, window_size_right)
    gq = torch.zeros(total, h, d, dtype=torch.float64)
    gk = torch.zeros(kf.shape, dtype=torch.float64)
    gv = torch.zeros(vf.shape, dtype=torch.float64)
    for (qa, sq), (ka, sk) in zip(segs_q, segs_k):
        if sq == 0 or sk == 0:
            continue
        qs = qf[qa:qa + sq].double()
        ks = kf[ka:ka + sk].double().repeat_interleave(g, 1)
        vs = vf[ka:ka + sk].double().repeat_interleave(g, 1)
        os_, dos = of[qa:qa + sq].double(), dof[qa:qa + sq].double()
        ls = lf[:, qa:qa + sq].double()
        s = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        keep = _keep(sq, sk, left, right)[None] if blocks is None else blocks
        p = torch.where(keep & torch.isfinite(ls)[..., None], torch.exp(s - ls[..., None]), torch.zeros_like(s))
        dp = torch.einsum("ihd,jhd->hij", dos, vs)
        dd = (dos * os_).sum(-1).t()
        if dlf is not None:
            dd = dd - dlf[:, qa:qa + sq].double()
        ds = p * (dp - dd[..., None])
        gq[qa:qa + sq] = torch.einsum("hij,jhd->ihd", ds, ks) * scale
        gk[ka:ka + sk] = torch.einsum("hij,ihd->jhd", ds, qs).reshape(sk, hkv, g, d).sum(2) * scale
        gv[ka:ka + sk] = torch.einsum("hij,ihd->jhd", p, dos).reshape(sk, hkv, g, -1).sum(2)
    gq[~_owned(total, segs_q)] = float("nan")
    nk = _owned(kf.shape[0], segs_k)
    gk[~nk] = float("nan")
    gv[~nk] = float("nan")
    res = []
    for buf, like, val in ((dq, q, gq), (dk, k, gk), (dv, v, gv)):
        if buf is None:
            buf = torch.empty(like.shape, dtype=like.dtype)
        (buf.flatten(0, 1) if dense else buf).copy_(val.to(buf.dtype))
        res.append(buf)
    return tuple(res)
