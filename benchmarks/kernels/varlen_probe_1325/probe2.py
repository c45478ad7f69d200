import sys, json, os, traceback, itertools
import torch, triton
sys.path.insert(0, "tools"); sys.path.insert(0, ".")
import _kernel_masks as M
from kernels.triton_backend import TritonBackend
HQ, HKV, D = 32, 8, 128
dt = torch.bfloat16
print(torch.__version__, torch.backends.cudnn.version())
def bench(fn): return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
def tf(area, ms, bwd=False): return 4 * area * HQ * D * (2.5 if bwd else 1) / ms / 1e9
try:
    import torch.nn.attention.varlen as VL; print("varlen module:", dir(VL))
except Exception as e: print("no varlen", e)
res = {}
for s in (16384, 65536):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = [torch.randn(s, h, D, device="cuda", dtype=dt, generator=g) for h in (HQ, HKV, HKV, HQ)]
    lens = M.doc_lengths(s); area = sum(n * (n + 1) // 2 for n in lens)
    tiles = M.tiles_for("docs_causal", s)
    be = TritonBackend(); prep = be.prepare(tiles, s, s, head_dims=(D,))
    o_ref, lse_ref = be.forward(q, k, v, prep)
    dq_ref, dk_ref, dv_ref = be.backward(q, k, v, o_ref, lse_ref, do, prep)[:3]
    for variant in ("gqa", "expand", "expand_i64"):
        info = {}
        try:
            kk, vv = (k, v) if variant == "gqa" else (k.repeat_interleave(4, 1).contiguous(), v.repeat_interleave(4, 1).contiguous())
            cu = torch.tensor([0] + list(itertools.accumulate(lens)), device="cuda", dtype=torch.int64 if variant.endswith("i64") else torch.int32)
            mx = max(lens)
            f = lambda: torch.ops.aten._cudnn_attention_forward(q, kk, vv, None, cu, cu, mx, mx, True, 0.0, True, False, scale=D**-0.5)
            r = f(); o, lse = r[0], r[1]
            info.update(out=list(o.shape), lse=list(lse.shape), lse_stride=list(lse.stride()))
            L = lse.reshape(s, HQ) if lse.shape[0] == s else lse.reshape(HQ, s).t()
            info["out_err"] = float((o.float() - o_ref.float()).abs().max()); info["lse_err"] = float((L - lse_ref).abs().max())
            info["fwd_tflops"] = tf(area, bench(f))
            b = lambda: torch.ops.aten._cudnn_attention_backward(do, q, kk, vv, o, lse, r[6], r[7], torch.empty(0, device="cuda"), cu, cu, mx, mx, 0.0, True, scale=D**-0.5)
            gr = b()
            dk = gr[1] if gr[1].shape[1] == HKV else gr[1].view(s, HKV, 4, D).sum(2)
            info["dq_err"] = float((gr[0].float() - dq_ref.float()).abs().max()); info["dk_err"] = float((dk.float() - dk_ref.float()).abs().max())
            info["bwd_tflops"] = tf(area, bench(b), True)
        except Exception as e:
            info["error"] = traceback.format_exc()[-1500:]
        print(s, variant, info, flush=True); res[f"{s}_{variant}"] = info
json.dump(res, open(os.environ.get("OUT", ".") + "/probe2.json", "w"), indent=1)
