"""Probe: cuDNN varlen and flash varlen/window through PyTorch ops on the docs/sliding masks."""
import math, sys, os, json, time
import torch, triton
sys.path.insert(0, "tools"); sys.path.insert(0, ".")
import _kernel_masks as M
from kernels.triton_backend import TritonBackend
HQ, HKV, D = 32, 8, 128
dt = torch.bfloat16
def bench(fn): return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
def inputs(s):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(s, h, D, device="cuda", dtype=dt, generator=g) for h in (HQ, HKV, HKV, HQ)]
res = {"torch": torch.__version__, "dev": torch.cuda.get_device_name()}
def tf(area, ms, bwd=False): return 4 * area * HQ * D * (2.5 if bwd else 1) / ms / 1e9
for s in (16384, 65536):
    q, k, v, do = inputs(s)
    tiles = M.tiles_for("docs_causal", s)
    lens = M.doc_lengths(s)
    area = sum(n * (n + 1) // 2 for n in lens)
    cu = torch.tensor([0] + list(__import__("itertools").accumulate(lens)), device="cuda", dtype=torch.int32)
    mx = max(lens)
    be = TritonBackend(); prep = be.prepare(tiles, s, s, head_dims=(D,))
    o_ref, lse_ref = be.forward(q, k, v, prep)
    for name in ("cudnn", "flash"):
        try:
            if name == "cudnn":
                f = lambda: torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, mx, mx, True, 0.0, True, False, scale=D**-0.5)
            else:
                f = lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0, True, False, scale=D**-0.5)
            r = f()
            o, lse = r[0], r[1]
            info = {"out": list(o.shape), "lse": list(lse.shape), "lse_stride": list(lse.stride()), "lse_dtype": str(lse.dtype)}
            lse2 = lse.reshape(-1)
            # guess layout
            if lse.dim() == 2 and lse.shape[0] == HQ: L = lse.t()
            elif lse.dim() == 3 and lse.shape[-1] == 1: L = lse[..., 0]
            else: L = lse.reshape(s, HQ) if lse.numel() == s * HQ else None
            info["out_err"] = float((o.float() - o_ref.float()).abs().max())
            info["lse_err"] = None if L is None else float((L.float() - lse_ref.float()).abs().max())
            info["fwd_tflops"] = tf(area, bench(f))
            # backward
            if name == "cudnn":
                seed = torch.zeros((), dtype=torch.int64, device="cuda")
                b = lambda: torch.ops.aten._cudnn_attention_backward(do, q, k, v, o, lse, r[6], r[7], torch.empty(0, device="cuda"), cu, cu, mx, mx, 0.0, True, scale=D**-0.5)
            else:
                b = lambda: torch.ops.aten._flash_attention_backward(do, q, k, v, o, lse, cu, cu, mx, mx, 0.0, True, r[2], r[3], scale=D**-0.5)
            g = b()
            dq_ref, dk_ref, dv_ref = be.backward(q, k, v, o_ref, lse_ref, do, prep)[:3]
            info["dq_err"] = float((g[0].float() - dq_ref.float()).abs().max())
            info["dk_err"] = float((g[1].float() - dk_ref.float()).abs().max())
            info["dk_shape"] = list(g[1].shape)
            info["bwd_tflops"] = tf(area, bench(b), True)
        except Exception as e:
            info = {"error": repr(e)[:600]}
        res[f"docs{s}_{name}"] = info
        print(name, s, info, flush=True)
    res[f"docs{s}_triton"] = {"fwd_tflops": tf(area, bench(lambda: be.forward(q, k, v, prep))),
                              "bwd_tflops": tf(area, bench(lambda: be.backward(q, k, v, o_ref, lse_ref, do, prep)), True)}
    print("triton", res[f"docs{s}_triton"], flush=True)
# sliding window via flash window (dense, one sequence)
s = 16384
q, k, v, do = inputs(s)
tiles = M.tiles_for("sliding_window", s)
be = TritonBackend(); prep = be.prepare(tiles, s, s, head_dims=(D,))
o_ref, lse_ref = be.forward(q, k, v, prep)
area = sum(min(i, 1024) + 1 for i in range(s))
cu = torch.tensor([0, s], device="cuda", dtype=torch.int32)
try:
    f = lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, s, s, 0.0, True, False, scale=D**-0.5, window_size_left=1024, window_size_right=0)
    r = f(); o = r[0]
    info = {"out_err": float((o.float() - o_ref.float()).abs().max()), "lse": list(r[1].shape), "fwd_tflops": tf(area, bench(f))}
    b = lambda: torch.ops.aten._flash_attention_backward(do, q, k, v, o, r[1], cu, cu, s, s, 0.0, True, r[2], r[3], scale=D**-0.5, window_size_left=1024, window_size_right=0)
    g = b(); dq_ref = be.backward(q, k, v, o_ref, lse_ref, do, prep)[0]
    info["dq_err"] = float((g[0].float() - dq_ref.float()).abs().max())
    info["bwd_tflops"] = tf(area, bench(b), True)
except Exception as e:
    info = {"error": repr(e)[:600]}
print("flash window", info, flush=True)
res["sliding16k_flash"] = info
json.dump(res, open(os.environ.get("OUT", ".") + "/probe.json", "w"), indent=1)
