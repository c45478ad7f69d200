"""Probe 2: one rank's sliding-window band (row i keeps keys [i, i + W]) as chunks of W rows, each two W x W
squares: keys [bW + W, bW + 2W) a top-left causal square (cuDNN as it is) and keys [bW, bW + W) an
inverse-causal square (j >= i), which is a top-left causal square of the row- and key-reversed problem
(cuDNN on flipped copies, results flipped back). Two batched cuDNN calls, one LSE merge (fwd), one add
per gradient (bwd); flips timed in. Against our Triton kernel on the same tile. bf16, Hq 32, Hkv 8, D 128.

    python benchmarks/kernels/band_bias_probe/probe_squares.py --out DIR
"""

import argparse
import os
import sys

import torch

from megatron_cp.kernels import triton_backend as tb
from megatron_cp.kernels.dense_fast_path import band_view, cudnn_backward_batched, cudnn_forward_batched
from megatron_cp.kernels.merge import merge_into

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe import band_inputs, timed, write_result  # noqa: E402


def fwd_squares(q, k, v, w, scale):
    sq, hq, d = q.shape
    n = sq // w
    o1, l1 = cudnn_forward_batched(band_view(q, 0, n, w, w), band_view(k, w, n, w, w), band_view(v, w, n, w, w),
                                   scale, True)
    qr, kr, vr = q.flip(0), k.flip(0), v.flip(0)
    o2, l2 = cudnn_forward_batched(band_view(qr, 0, n, w, w), band_view(kr, w, n, w, w),
                                   band_view(vr, w, n, w, w), scale, True)
    acc = o1.reshape(sq, hq, d).float()
    lse = l1.reshape(sq, hq).contiguous()
    merge_into(acc, lse, o2.reshape(sq, hq, d).flip(0).contiguous(), l2.reshape(sq, hq).flip(0).contiguous())
    return acc, lse


def bwd_squares(q, k, v, out, lse, do, w, scale):
    sq, hq, d = q.shape
    n = sq // w
    bv = band_view
    g1 = cudnn_backward_batched(bv(q, 0, n, w, w), bv(k, w, n, w, w), bv(v, w, n, w, w), bv(out, 0, n, w, w),
                                lse.view(n, w, hq), bv(do, 0, n, w, w), scale, True)
    qr, kr, vr, orr, dor = q.flip(0), k.flip(0), v.flip(0), out.flip(0), do.flip(0)
    lr = lse.flip(0).contiguous()
    g2 = cudnn_backward_batched(bv(qr, 0, n, w, w), bv(kr, w, n, w, w), bv(vr, w, n, w, w), bv(orr, 0, n, w, w),
                                lr.view(n, w, hq), bv(dor, 0, n, w, w), scale, True)
    dq = g1[0].reshape(sq, hq, d).float() + g2[0].reshape(sq, hq, d).flip(0)
    sk = k.shape[0]
    dk = torch.zeros(k.shape, device=q.device, dtype=torch.float32)
    dv = torch.zeros_like(dk)
    dk[w:].add_(g1[1].reshape(sq, *k.shape[1:]))
    dv[w:].add_(g1[2].reshape(sq, *k.shape[1:]))
    # reversed keys [w, sk) are original keys [0, sk - w)
    dk[:sk - w].add_(g2[1].reshape(sq, *k.shape[1:]).flip(0))
    dv[:sk - w].add_(g2[2].reshape(sq, *k.shape[1:]).flip(0))
    return dq, dk, dv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sq", type=int, default=32768)
    ap.add_argument("--w", type=int, default=4096)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    hq, hkv, d, sq, w = 32, 8, 128, a.sq, a.w
    sk = sq + w
    scale = d ** -0.5
    q, k, v, do = band_inputs(sq, sk, hq, hkv, d, dev)
    fl = 4.0 * sq * (w + 1) * hq * d
    be = tb.TritonBackend(tb.TritonConfig(band_squares=0))  # the band on Triton
    tiles = torch.tensor([[0, sq, 0, sk, 3]], dtype=torch.int32)
    prep = be.prepare(tiles, sq, sk)
    out, lse = be.forward(q, k, v, prep)
    delta = (do.float() * out.float()).sum(-1)
    dq, dk, dv = be.backward(q, k, v, out, lse, do, prep, None, delta)
    rows = []
    t_f = timed(lambda: be.forward(q, k, v, prep))
    t_b = timed(lambda: be.backward(q, k, v, out, lse, do, prep, None, delta))
    rows.append(dict(name="triton", fwd_ms=t_f, bwd_ms=t_b, fwd_tflops=fl / t_f / 1e9, bwd_tflops=2.5 * fl / t_b / 1e9))
    print(rows[-1], flush=True)
    acc, l2 = fwd_squares(q, k, v, w, scale)
    o2 = acc.to(q.dtype)
    gq, gk, gv = bwd_squares(q, k, v, out, lse, do, w, scale)
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    errs = dict(out=rel(o2, out), lse=float((l2 - lse).abs().max()), dq=rel(gq, dq), dk=rel(gk, dk), dv=rel(gv, dv))
    t_f = timed(lambda: fwd_squares(q, k, v, w, scale))
    t_b = timed(lambda: bwd_squares(q, k, v, out, lse, do, w, scale))
    n = sq // w
    bv = band_view
    t_f1 = timed(lambda: cudnn_forward_batched(bv(q, 0, n, w, w), bv(k, w, n, w, w), bv(v, w, n, w, w), scale, True))
    t_b1 = timed(lambda: cudnn_backward_batched(bv(q, 0, n, w, w), bv(k, w, n, w, w), bv(v, w, n, w, w),
                                                bv(out, 0, n, w, w), lse.view(n, w, hq), bv(do, 0, n, w, w), scale,
                                                True))
    rows.append(dict(name=f"squares w{w}", fwd_ms=t_f, bwd_ms=t_b, fwd_tflops=fl / t_f / 1e9,
                     bwd_tflops=2.5 * fl / t_b / 1e9, one_causal_call_fwd_ms=t_f1, one_causal_call_bwd_ms=t_b1,
                     rel_err_vs_triton=errs))
    print(rows[-1], flush=True)
    write_result(a.out, "probe_squares.json", sq, sk, w, rows)


if __name__ == "__main__":
    main()
