"""Quick start: context-parallel attention on packed documents, forward and backward, checked against
dense attention. Runs on CPU (gloo):

    torchrun --nproc-per-node 2 examples/quickstart.py

Every rank builds the same mask and plan, makes the same q/k/v for the whole sequence, keeps its own
tokens (``dispatch``), runs megatron-cp attention forward and backward, and gathers the output
(``undispatch``). Rank 0 compares out, dq, dk and dv with plain softmax attention in float64 on one
process, then shows what a loss on ``undispatch`` output computed on every rank does to the gradients.
"""

import torch
import torch.distributed as dist

import megatron_cp as mcp


def dense_attention(q, k, v, keep, scale):
    """Plain softmax attention on one process: q [S, Hq, D], k/v [S, Hkv, D], keep bool [S, S] -> [S, Hq, D]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)  # every row here keeps a key
    return torch.einsum("hqk,khd->qhd", p, v)


def main():
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD

    # packed documents: causal attention inside each document
    mask = mcp.masks.varlen([0, 1000, 1300, 2048], causal=True)
    plan = mcp.plan(mask, cp_size=dist.get_world_size())  # pure: every rank computes the same plan

    # the whole sequence, identical on every rank (same seed): q [S, Hq, D], k/v [S, Hkv, D]
    S, Hq, Hkv, D = mask.seqlen_q, 4, 2, 32
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, h, D, generator=gen).requires_grad_() for h in (Hq, Hkv, Hkv))
    dout = torch.randn(S, Hq, D, generator=gen)  # the loss is sum(out * dout): its gradient in out is dout

    q_local = mcp.dispatch(q, plan, group)  # [S, Hq, D] -> [s_local, Hq, D]
    k_local = mcp.dispatch(k, plan, group)
    v_local = mcp.dispatch(v, plan, group)
    out, lse = mcp.attention(q_local, k_local, v_local, plan, group)  # out like q_local; lse [s_local, Hq] fp32

    # The loss of this rank's own tokens: the ranks' losses sum to the whole sequence's loss, so backward
    # gives the CP=1 gradients. A loss of undispatch(out) computed on every rank would give cp x the
    # gradients (every rank sums the full loss): divide it by cp, or compute it on one rank only (the
    # others still call backward, on their loss times 0: undispatch's backward is a collective).
    loss = (out * mcp.dispatch(dout, plan, group)).sum()
    loss.backward()  # q.grad, k.grad, v.grad: [S, ...], the whole gradient on every rank
    out_full = mcp.undispatch(out.detach(), plan, group)  # [S, Hq, D], only where the whole sequence is needed

    if rank == 0:  # the check: plain softmax attention in float64 on the whole sequence, on one process
        ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
        out_ref = dense_attention(*ref, torch.from_numpy(mask.to_dense()), D ** -0.5)
        (out_ref * dout.double()).sum().backward()
        diffs = {name: (a.double() - b).abs().max().item()
                 for name, a, b in [("out", out_full, out_ref.detach()), ("dq", q.grad, ref[0].grad),
                                    ("dk", k.grad, ref[1].grad), ("dv", v.grad, ref[2].grad)]}
        print(f"plan: {plan.stats(num_kv_heads=Hkv, head_dim=D, dtype_bytes=4)}")
        print(f"cp={cp} S={S} Hq={Hq} Hkv={Hkv} D={D}, float32 vs dense float64: "
              + " ".join(f"{n} {e:.2e}" for n, e in diffs.items()))
        print(f"max difference: {max(diffs.values()):.3e}")

    # The pitfall, shown: the same loss written on undispatch(out), on every rank, counts it cp times.
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out2, _ = mcp.attention(*(mcp.dispatch(t, plan, group) for t in (q, k, v)), plan, group)
    (mcp.undispatch(out2, plan, group) * dout).sum().backward()
    dev = max((t.grad - cp * g).abs().max().item() / g.abs().max().item() for t, g in zip((q, k, v), grads))
    if rank == 0:
        print(f"loss of undispatch(out) on every rank: gradients = {cp} x the above (max relative deviation "
              f"{dev:.1e}); divide that loss by cp or compute it on one rank")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
