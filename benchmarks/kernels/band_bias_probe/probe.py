"""Probe: can one sliding-window band (one rank's BI_CAUSAL tile: row i keeps keys [i, i + W]) run faster
on cuDNN as chunks of C rows x (W + C) keys with one shared additive band bias (batched, overlapping K/V
views, dK/dV folded afterwards) than on our Triton kernel? FlexAttention and plain cuDNN (no bias) on
the same shapes for scale. bf16, Hq 32, Hkv 8, D 128, one GPU.

    python benchmarks/kernels/band_bias_probe/probe.py --out DIR
"""

import argparse
import datetime
import json
import os
import sys

import torch

from megatron_cp.kernels import triton_backend as tb
from megatron_cp.kernels.dense_fast_path import band_view

aten = torch.ops.aten


def timed(fn, iters=10, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) for a, b in ev)
    return t[len(t) // 2]


def _b(x):
    return x.permute(0, 2, 1, 3)


def fold(dkb, c, sk):
    """dkb [n, m*c, H, D] (chunk b covers keys [b c, b c + m c)) -> [sk, H, D] fp32, one pass: anti-diagonal
    sum through a zero-padded strided view."""
    n, L, h, d = dkb.shape
    m = L // c
    e = c * h * d
    flat = torch.zeros((n + 2 * (m - 1)) * m * e, dtype=dkb.dtype, device=dkb.device)
    flat[(m - 1) * m * e:(m - 1 + n) * m * e] = dkb.reshape(-1)
    # output block o, j' = m-1-j: element T[o - j, j] at row (o - j + m - 1) of the padded [., m] matrix
    # flat row index r*m + j = (o + m - 1 - j)*m + j = o*m + (m-1)*m - j*(m-1); j = m-1-j':
    # = o*m + (m-1) + j'*(m-1)
    nout = n + m - 1
    v = flat.as_strided((nout, m, e), (m * e, (m - 1) * e, 1), (m - 1) * e)
    out = v.sum(1, dtype=torch.float32).reshape(nout * c, h, d)
    return out[:sk]


def band_bias(c, w, device):
    i = torch.arange(c, device=device)[:, None]
    j = torch.arange(w + c, device=device)[None, :]
    keep = (j >= i) & (j <= i + w)
    return torch.where(keep, 0.0, float("-inf")).to(torch.bfloat16)


def write_result(out_dir, name, sq, sk, w, rows):
    """out_dir/name: the rows with device, date, versions and the command (both probes)."""
    if not out_dir:
        return
    res = dict(device=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               torch=torch.__version__, cudnn=torch.backends.cudnn.version(), command=" ".join(sys.argv),
               sq=sq, sk=sk, window=w, rows=rows)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(res, f, indent=1)


def band_inputs(sq, sk, hq, hkv, d, dev):
    """q, k, v (x 0.5) and dout, bf16, seed 0 (both probes)."""
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(sq, hq, d, device=dev, dtype=torch.bfloat16, generator=g) * 0.5
    k = torch.randn(sk, hkv, d, device=dev, dtype=torch.bfloat16, generator=g) * 0.5
    v = torch.randn(sk, hkv, d, device=dev, dtype=torch.bfloat16, generator=g) * 0.5
    return q, k, v, torch.randn(sq, hq, d, device=dev, dtype=torch.bfloat16, generator=g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sq", type=int, default=32768)
    ap.add_argument("--w", type=int, default=4096)
    ap.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    hq, hkv, d, sq, w = 32, 8, 128, a.sq, a.w
    sk = sq + w
    scale = d ** -0.5
    q, k, v, do = band_inputs(sq, sk, hq, hkv, d, dev)
    area = sq * (w + 1)
    fl = 4.0 * area * hq * d
    rows = []

    def rec(name, tf, tb_ms, **kw):
        r = dict(name=name, fwd_ms=tf, bwd_ms=tb_ms, fwd_tflops=fl / tf / 1e9 if tf else None,
                 bwd_tflops=2.5 * fl / tb_ms / 1e9 if tb_ms else None, **kw)
        rows.append(r)
        print(name, {x: (round(y, 3) if isinstance(y, float) else y) for x, y in r.items() if x != "name"}, flush=True)

    # ours: Triton over one BI_CAUSAL tile
    be = tb.TritonBackend(tb.TritonConfig(band_squares=0))  # the band on Triton
    tiles = torch.tensor([[0, sq, 0, sk, 3]], dtype=torch.int32)
    prep = be.prepare(tiles, sq, sk)
    out, lse = be.forward(q, k, v, prep)
    delta = (do.float() * out.float()).sum(-1)
    dq, dk, dv = be.backward(q, k, v, out, lse, do, prep, None, delta)
    ref = dict(out=out.float(), lse=lse, dq=dq.float(), dk=dk.float(), dv=dv.float())
    rec("triton", timed(lambda: be.forward(q, k, v, prep)),
        timed(lambda: be.backward(q, k, v, out, lse, do, prep, None, delta)), path=be.last_path)

    for c in a.chunks:
        n = sq // c
        qb, ob_do = band_view(q, 0, n, c, c), band_view(do, 0, n, c, c)
        kb, vb = band_view(k, 0, n, c, w + c), band_view(v, 0, n, c, w + c)
        bias = band_bias(c, w, dev)
        for bname, bb in (("expand", bias[None, None].expand(n, hq, c, w + c)),
                          ("b11", bias[None, None])):
            try:
                def fwd():
                    return aten._scaled_dot_product_cudnn_attention(_b(qb), _b(kb), _b(vb), bb, True, 0.0, False,
                                                                    False, scale=scale)
                res = fwd()
                o4, l4 = res[0], res[1]
                o_c = o4.permute(0, 2, 1, 3).reshape(sq, hq, d)
                l_c = l4.reshape(n, hq, c).permute(0, 2, 1).reshape(sq, hq).float()
                err_o = float((o_c.float() - ref["out"]).abs().max())
                err_l = float((l_c - ref["lse"]).abs().max())
                tf = timed(fwd)
                seed = torch.zeros((), dtype=torch.int64, device=dev)
                lse_b = l4.reshape(n, hq, c, 1)

                def bwd():
                    return aten._scaled_dot_product_cudnn_attention_backward(
                        _b(ob_do), _b(qb), _b(kb), _b(vb), o4, lse_b, seed, seed, bb, None, None, c, w + c,
                        0.0, False, scale=scale)

                gq, gk, gv = bwd()
                gkb, gvb = gk.permute(0, 2, 1, 3), gv.permute(0, 2, 1, 3)
                dk_c, dv_c = fold(gkb, c, sk), fold(gvb, c, sk)
                dq_c = gq.permute(0, 2, 1, 3).reshape(sq, hq, d)
                errs = dict(dq=float((dq_c.float() - ref["dq"]).abs().max()),
                            dk=float((dk_c - ref["dk"]).abs().max()), dv=float((dv_c - ref["dv"]).abs().max()),
                            ref_dk_max=float(ref["dk"].abs().max()))
                tb_k = timed(bwd)
                tfold = timed(lambda: (fold(gkb, c, sk), fold(gvb, c, sk)))
                rec(f"cudnn_bias c{c} {bname}", tf, tb_k + tfold, bwd_kernel_ms=tb_k, fold_ms=tfold, err_out=err_o,
                    err_lse=err_l, gk_shape=list(gk.shape), **errs)
                break
            except Exception as e:  # noqa: BLE001
                print(f"cudnn_bias c{c} {bname}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        # same batched shape, no bias: what the bias costs
        try:
            def fwd0():
                return aten._scaled_dot_product_cudnn_attention(_b(qb), _b(kb), _b(vb), None, True, 0.0, False,
                                                                False, scale=scale)
            r0 = fwd0()
            seed = torch.zeros((), dtype=torch.int64, device=dev)
            l0 = r0[1].reshape(n, hq, c, 1)

            def bwd0():
                return aten._scaled_dot_product_cudnn_attention_backward(
                    _b(ob_do), _b(qb), _b(kb), _b(vb), r0[0], l0, seed, seed, None, None, None, c, w + c,
                    0.0, False, scale=scale)
            bwd0()
            rec(f"cudnn_nobias c{c} (computes {c}x{w + c} per chunk)", timed(fwd0), timed(bwd0),
                computed_area_fraction=(w + c) / (w + 1))
        except Exception as e:  # noqa: BLE001
            print(f"cudnn_nobias c{c}: {type(e).__name__}: {str(e)[:300]}", flush=True)

    # cuDNN full square (ceiling) on sq x sq
    try:
        qf, kf, vf, dof = q[None], k[None, :sq], v[None, :sq], do[None]
        r = aten._scaled_dot_product_cudnn_attention(_b(qf), _b(kf), _b(vf), None, True, 0.0, False, False, scale=scale)
        seed = torch.zeros((), dtype=torch.int64, device=dev)
        lf = r[1].reshape(1, hq, sq, 1)
        ffl = 4.0 * sq * sq * hq * d
        tf = timed(lambda: aten._scaled_dot_product_cudnn_attention(_b(qf), _b(kf), _b(vf), None, True, 0.0, False,
                                                                    False, scale=scale), iters=5)
        tbk = timed(lambda: aten._scaled_dot_product_cudnn_attention_backward(
            _b(dof), _b(qf), _b(kf), _b(vf), r[0], lf, seed, seed, None, None, None, sq, sq, 0.0, False,
            scale=scale), iters=5)
        rows.append(dict(name=f"cudnn full {sq}x{sq}", fwd_ms=tf, bwd_ms=tbk, fwd_tflops=ffl / tf / 1e9,
                         bwd_tflops=2.5 * ffl / tbk / 1e9))
        print(rows[-1], flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"cudnn full: {type(e).__name__}: {str(e)[:300]}", flush=True)

    # FlexAttention, same band
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        fa = torch.compile(flex_attention)

        def mm(b, h, qi, ki):
            return (ki >= qi) & (ki <= qi + w)
        bm = create_block_mask(mm, 1, 1, sq, sk, device=dev)
        q4 = q.permute(1, 0, 2)[None].contiguous().requires_grad_()
        k4 = k.permute(1, 0, 2)[None].contiguous().requires_grad_()
        v4 = v.permute(1, 0, 2)[None].contiguous().requires_grad_()
        do4 = do.permute(1, 0, 2)[None].contiguous()
        o4 = fa(q4, k4, v4, block_mask=bm, enable_gqa=True, scale=scale)
        err = float((o4[0].permute(1, 0, 2).float() - ref["out"]).abs().max())
        tf = timed(lambda: fa(q4, k4, v4, block_mask=bm, enable_gqa=True, scale=scale))

        def fb():
            o = fa(q4, k4, v4, block_mask=bm, enable_gqa=True, scale=scale)
            torch.autograd.grad(o, (q4, k4, v4), do4)
        tfb = timed(fb)
        rec("flex", tf, tfb - tf, err_out=err)
    except Exception as e:  # noqa: BLE001
        print(f"flex: {type(e).__name__}: {str(e)[:300]}", flush=True)

    write_result(a.out, "probe.json", sq, sk, w, rows)


if __name__ == "__main__":
    main()
