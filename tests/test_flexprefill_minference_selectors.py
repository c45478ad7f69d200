"""FlexPrefill and MInference selectors: against plain re-implementations (loops, float64), exactness
under simulated context parallelism (fake ranks, threads), validation, and the offline pattern search."""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest
import torch

from megatron_cp import masks
from megatron_cp.sparse.flexprefill import FlexPrefill
from megatron_cp.sparse.minference import HeadPattern, MInference
from megatron_cp.sparse.selector import Selector
from megatron_cp.sparse.view import SelectionView, envelope_blocks, single_view

S, B, HQ, HKV, D = 256, 32, 4, 2, 16
NB = S // B
MASKS = {"causal": lambda: masks.causal(S), "docs": lambda: masks.varlen([0, 40, 100, 256])}


# ----------------------------------------------------------------------------- inputs

def inputs(seed=0, dtype=torch.float64):
    """q [S, 4, D], k [S, 2, D]: kv head 0 random (diffuse attention: query-aware heads 0, 1); kv head 1
    has a few spike keys every query matches (vertical-slash heads 2, 3: pooled keys miss the spikes)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(S, HKV, D, generator=g, dtype=torch.float64)
    spikes = torch.tensor([5, 77, 150, 200, 231])
    k[spikes, 1, 0] += 12.0
    q[:, 2:, 0] += 3.0
    return q.to(dtype), k.to(dtype)


# ----------------------------------------------------------------------------- reference helpers

def dense_mask(mask):
    return torch.as_tensor(np.asarray(mask.to_dense()), dtype=torch.bool)


def env_classes(dm):
    """int [nb, nb]: 0 / 1 / 2 block classes of the dense mask."""
    out = torch.zeros(NB, NB, dtype=torch.int64)
    for a in range(NB):
        for b in range(NB):
            n = int(dm[a * B:(a + 1) * B, b * B:(b + 1) * B].sum())
            out[a, b] = 0 if n == 0 else (2 if n == B * B else 1)
    return out


def order_desc(vals):
    """Indices by descending value, ties by ascending index."""
    return sorted(range(len(vals)), key=lambda j: (-vals[j], j))


def ref_cover(vals, gamma):
    """Smallest set (descending, ties by index) reaching gamma of the total; zeros never kept."""
    order = order_desc(vals)
    total = 0.0
    for j in order:
        total += vals[j]
    keep, acc = set(), 0.0
    for j in order:
        if acc < gamma * total and vals[j] > 0:
            keep.add(j)
        acc += vals[j]
    return keep


def ref_last_rows(q, k, dm, rows):
    """Per q head: P [rows][S] envelope-masked softmax of the last rows (python lists of floats)."""
    g = HQ // HKV
    out = []
    for h in range(HQ):
        ph = []
        for r in range(rows):
            i = S - rows + r
            sc = [float(q[i, h] @ k[j, h // g]) / math.sqrt(D) if dm[i, j] else -math.inf for j in range(S)]
            m = max(sc)
            e = [math.exp(x - m) if x > -math.inf else 0.0 for x in sc]
            z = sum(e)
            ph.append([x / z for x in e])
        out.append(ph)
    return out


def ref_vertical_slash(P, rows):
    """vertical[j], slash{o: mass} (means over rows)."""
    vert = [sum(P[r][j] for r in range(rows)) / rows for j in range(S)]
    slash = {}
    for o in range(-(rows - 1), S):
        acc = 0.0
        for r in range(rows):
            j = S - rows + r - o
            if 0 <= j < S:
                acc += P[r][j]
        slash[o] = acc / rows
    return vert, slash


def pooled(x, a):
    return x[a * B:(a + 1) * B].double().mean(0)


def pair_offsets(qb, kb):
    return range((qb - kb) * B - (B - 1), (qb - kb) * B + B)


def ref_flexprefill(sel: FlexPrefill, q, k, mask):
    dm = dense_mask(mask)
    env = env_classes(dm)
    g = HQ // HKV
    P = ref_last_rows(q.double(), k.double(), dm, B)
    lo = 0 if sel.min_budget is None else -(-sel.min_budget // B)
    hi = NB if sel.max_budget is None else -(-sel.max_budget // B)
    keep = torch.zeros(HQ, NB, NB, dtype=torch.bool)
    kinds = []
    for h in range(HQ):
        vert, slash = ref_vertical_slash(P[h], B)
        true = [sum(vert[kb * B:(kb + 1) * B]) for kb in range(NB)]
        qbar = sum(q[S - B + r, h].double() for r in range(B)) / B / math.sqrt(D)
        lg = [float(qbar @ pooled(k[:, h // g], kb)) if env[NB - 1, kb] > 0 else -math.inf for kb in range(NB)]
        m = max(lg)
        e = [math.exp(x - m) if x > -math.inf else 0.0 for x in lg]
        est = [x / sum(e) for x in e]
        js = 0.0
        for p, t in zip(est, true):
            mid = (p + t) / 2
            js += 0.5 * (p * math.log(p / mid) if p > 0 else 0.0) + 0.5 * (t * math.log(t / mid) if t > 0 else 0.0)
        qa = math.sqrt(max(js, 0.0)) < sel.tau
        kinds.append(qa)
        cols = ref_cover(vert, sel.gamma)
        offs = list(slash)
        skeep = {offs[i] for i in ref_cover([slash[o] for o in offs], sel.gamma)}
        for qb in range(NB):
            envb = [kb for kb in range(NB) if env[qb, kb] > 0]
            if qa:
                qp = pooled(q[:, h], qb) / math.sqrt(D)
                lg = [float(qp @ pooled(k[:, h // g], kb)) if kb in envb else -math.inf for kb in range(NB)]
                m = max(lg)
                e = [math.exp(x - m) if x > -math.inf else 0.0 for x in lg]
                score = [x / sum(e) for x in e]
                cand = ref_cover(score, sel.gamma)
            else:
                cand, score = set(), []
                for kb in range(NB):
                    hit = any(j in cols for j in range(kb * B, (kb + 1) * B)) or \
                        any(o in skeep for o in pair_offsets(qb, kb))
                    if hit:
                        cand.add(kb)
                    score.append(sum(vert[kb * B:(kb + 1) * B]) + sum(slash.get(o, 0.0) for o in pair_offsets(qb, kb)))
            cand = {kb for kb in cand if kb in envb}
            diag = {qb} & set(envb)
            n = min(max(len(cand | diag), lo), hi, len(envb))
            n = max(n, len(diag))
            prio = {kb: (2 if kb in diag else 0) + (1 if kb in cand else 0) for kb in envb}
            ranked = sorted(envb, key=lambda kb: (-prio[kb], -score[kb], kb))
            for kb in ranked[:n]:
                keep[h, qb, kb] = True
    return keep, kinds


def ref_minference(sel: MInference, q, k, mask):
    dm = dense_mask(mask)
    env = env_classes(dm)
    g = HQ // HKV
    L = min(sel.last_q, S)
    P = ref_last_rows(q.double(), k.double(), dm, L)
    keep = torch.zeros(HQ, NB, NB, dtype=torch.bool)
    for h, p in enumerate(sel.patterns):
        scale = min(1.0, S / p.ref_len)
        if p.kind == "vertical_slash":
            vert, slash = ref_vertical_slash(P[h], L)
            nv, ns = math.ceil(p.vertical * scale), math.ceil(p.slash * scale)
            cols = set(order_desc(vert)[:nv]) | set(range(30))
            offs = list(slash)
            skeep = {offs[i] for i in order_desc([slash[o] for o in offs])[:ns]} | set(range(30))
        for qb in range(NB):
            envb = [kb for kb in range(NB) if env[qb, kb] > 0]
            chosen = {qb}
            if p.kind == "a_shape":
                for kb in envb:
                    if kb * B < p.sink or any(0 <= o < p.local for o in pair_offsets(qb, kb)):
                        chosen.add(kb)
            elif p.kind == "vertical_slash":
                for kb in envb:
                    if any(j in cols for j in range(kb * B, kb * B + B)) or \
                            any(o in skeep for o in pair_offsets(qb, kb)):
                        chosen.add(kb)
            else:
                tk = max(1, math.ceil((p.top_k if p.top_k is not None else math.ceil(6400 / B)) * scale))
                qp = pooled(q[:, h], qb) / math.sqrt(D)
                sc = [float(qp @ pooled(k[:, h // g], kb)) if kb in envb else -math.inf for kb in range(NB)]
                chosen |= {kb for kb in order_desc(sc)[:tk] if kb in envb}
            for kb in chosen:
                if kb in envb:
                    keep[h, qb, kb] = True
    return keep


# ----------------------------------------------------------------------------- fake CP group

class FakeGroup:
    """n fake ranks in threads; ``combine`` / ``combine_max`` reduce the ranks' tensors in rank order."""

    def __init__(self, n):
        self.n, self.bar, self.slots = n, threading.Barrier(n), [None] * n

    def reducer(self, rank, op):
        def f(t):
            self.slots[rank] = t.clone()
            self.bar.wait()
            out = self.slots[0].clone()
            for x in self.slots[1:]:
                out = op(out, x)
            self.bar.wait()
            return out
        return f


def split_blocks(n, seed):
    """Global blocks over n ranks: zigzag chunks, each rank's blocks in a shuffled local order."""
    g = torch.Generator().manual_seed(seed)
    per = [[] for _ in range(n)]
    for i in range(NB):
        c = i % (2 * n)
        per[c if c < n else 2 * n - 1 - c].append(i)
    return [[p[j] for j in torch.randperm(len(p), generator=g).tolist()] for p in per]


def run_cp(sel, q, k, mask, n, seed=0):
    """Selections of n fake ranks assembled into [Hq, nb, nb] (summaries, then select_from, per rank)."""
    grp = FakeGroup(n)
    parts = split_blocks(n, seed)
    traps = torch.as_tensor(np.asarray(mask.traps), dtype=torch.long)
    out = torch.zeros(HQ, NB, NB, dtype=torch.bool)
    errors = []

    def work(r):
        try:
            ids = np.array(parts[r])
            view = SelectionView(B, NB, torch.as_tensor(ids), envelope_blocks(mask.traps, S, ids, B), traps,
                                 combine=grp.reducer(r, torch.add), combine_max=grp.reducer(r, torch.maximum))
            rows = torch.as_tensor(ids)[:, None] * B + torch.arange(B)
            ql, kl = q[rows.reshape(-1)], k[rows.reshape(-1)]
            sm = sel.summaries(ql, kl, view)
            keep = sel.select_from(ql, sm, view)
            out[:, torch.as_tensor(ids)] = keep
        except BaseException as e:  # surface in the main thread
            errors.append(e)
            grp.bar.abort()

    th = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    if errors:
        raise errors[0]
    return out


# ----------------------------------------------------------------------------- FlexPrefill

FLEX = [FlexPrefill(block=B, gamma=0.5, tau=0.1, min_budget=32, max_budget=None),
        FlexPrefill(block=B, gamma=0.8, tau=0.1, min_budget=96, max_budget=128)]


@pytest.mark.parametrize("mname", list(MASKS))
@pytest.mark.parametrize("fi", range(len(FLEX)))
def test_flexprefill_matches_reference(mname, fi):
    sel = FLEX[fi]
    mask = MASKS[mname]()
    q, k = inputs()
    assert isinstance(sel, Selector)
    sel.check(HQ, HKV, D, S)
    view = single_view(mask, B)
    keep = sel.select(q, k, view)
    ref, kinds = ref_flexprefill(sel, q, k, mask)
    assert kinds == [True, True, False, False], kinds  # both patterns occur
    qa, _ = sel.head_kinds(sel.summaries(q, k, view), view)
    assert qa.tolist() == kinds
    assert keep.dtype == torch.bool and keep.shape == (HQ, NB, NB)
    assert torch.equal(keep, ref)
    assert not (keep & (view.envelope == 0)[None]).any()
    assert keep[:, torch.arange(NB), torch.arange(NB)].all()  # diagonal block
    if sel.max_budget is not None:  # the budget caps the blocks per (head, q block)
        assert keep.sum(-1).max() <= -(-sel.max_budget // B)


# ----------------------------------------------------------------------------- MInference

def mi_selector(**kw):
    return MInference([HeadPattern("a_shape", sink=20, local=40),
                       HeadPattern("block_sparse", top_k=2),
                       HeadPattern("vertical_slash", vertical=6, slash=8, ref_len=S),
                       HeadPattern("vertical_slash")], block=B, **kw)


@pytest.mark.parametrize("mname", list(MASKS))
@pytest.mark.parametrize("last_q", [64, 16])
def test_minference_matches_reference(mname, last_q):
    sel = mi_selector(last_q=last_q)
    mask = MASKS[mname]()
    q, k = inputs(1)
    sel.check(HQ, HKV, D, S)
    view = single_view(mask, B)
    keep = sel.select(q, k, view)
    assert torch.equal(keep, ref_minference(sel, q, k, mask))
    assert keep[:, torch.arange(NB), torch.arange(NB)].all()


# ----------------------------------------------------------------------------- simulated CP

@pytest.mark.parametrize("which", ["flex", "minference"])
@pytest.mark.parametrize("mname", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cp_equals_single_process(which, mname, dtype):
    sel = FLEX[1] if which == "flex" else mi_selector()
    mask = MASKS[mname]()
    q, k = inputs(2, dtype)
    one = sel.select(q, k, single_view(mask, B))
    for n in (2, 4):
        assert torch.equal(run_cp(sel, q, k, mask, n, seed=n), one), n


# ----------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kw,needle", [
    (dict(gamma=0.0), "gamma"), (dict(gamma=1.5), "1.5"), (dict(tau=-0.1), "-0.1"),
    (dict(min_budget=-3), "-3"), (dict(max_budget=0), "max_budget"), (dict(block=0), "block"),
    (dict(min_budget=512, max_budget=128), "128"),
])
def test_flexprefill_bad_hyperparameters(kw, needle):
    with pytest.raises(ValueError, match=needle):
        FlexPrefill(**kw).check(HQ, HKV, D, S)


def test_flexprefill_check_shapes():
    with pytest.raises(ValueError, match="100"):
        FlexPrefill(block=32).check(HQ, HKV, D, 100)
    with pytest.raises(ValueError, match="num_kv_heads 3"):
        FlexPrefill(block=32).check(4, 3, D, S)


def test_minference_bad_config(tmp_path):
    def cfg(heads):
        p = tmp_path / "c.json"
        p.write_text(json.dumps({"layers": [heads]}))
        return str(p)
    good = [{"kind": "a_shape", "sink": 64, "local": 64}] * HQ
    MInference.from_json(cfg(good), 0, block=B).check(HQ, HKV, D, S)
    bad = [
        (good[:3], "3 head patterns"),
        (good[:2] + [{"kind": "dilated"}] + good[:1], "head 2: unknown kind 'dilated'"),
        (good[:1] + [{"kind": "vertical_slash", "vertical": -5, "slash": 10}] + good[:2], "head 1: vertical .*-5"),
        (good[:3] + [{"kind": "block_sparse", "topk": 3}], "head 3: unknown keys .*topk"),
        (good[:3] + [{"kind": "block_sparse", "top_k": 0}], "head 3: top_k .*0"),
    ]
    for heads, needle in bad:
        with pytest.raises(ValueError, match=needle):
            MInference.from_json(cfg(heads), 0, block=B).check(HQ, HKV, D, S)
    with pytest.raises(ValueError, match="no layer 5"):
        MInference.from_json(cfg(good), 5)
    with pytest.raises(ValueError, match="layer 0 head 1"):
        MInference.from_json(cfg(good[:1] + [{"kind": "x"}] + good[:2]), 0, block=B).check(HQ, HKV, D, S)


# ----------------------------------------------------------------------------- search tool

def test_search_tool_planted_heads(tmp_path, capsys):
    from scripts import load_script

    tool = load_script("tools/minference_search.py")
    out = tmp_path / "minference.json"
    cfg = tool.main(["--dry-run", "--budget", "0.6", "--out", str(tmp_path)])  # planted heads, S 512, block 32
    table = capsys.readouterr().out
    assert "recall" in table and "sink_local" in table
    kinds = [h["kind"] for h in cfg["layers"][0]]
    assert kinds[0] == "a_shape" and kinds[1] == "vertical_slash", kinds
    sel = MInference.from_json(str(out), 0, block=32)
    sel.check(4, 4, 64, 512)
    q, k = tool.synthetic(512, 64, 32, 0)
    keep = sel.select(q, k, single_view(masks.causal(512), 32))
    assert keep.shape == (4, 16, 16)


# ----------------------------------------------------------------------------- real runtime, gloo ranks

def _runtime_rank(rank, world, tensors):
    import torch.distributed as dist

    import megatron_cp as mcp
    from megatron_cp.sparse import attention as sparse_mod

    mask = MASKS["docs"]()
    out = {}
    for name, sel in (("flex", FLEX[1]), ("mi", mi_selector())):
        plan = mcp.plan(mask, world, chunk_size=B, guest_rows="none", block=B)
        q, k = (mcp.dispatch(torch.from_numpy(tensors[n]), plan, dist.group.WORLD) for n in ("q", "k"))
        out[name] = sparse_mod.select_blocks(q, k, plan, dist.group.WORLD, sel).numpy()
        out["q_blocks"] = plan.local_ids(rank)[::B] // B
    return out


def test_runtime_select_blocks_equal_single_process():
    """Through the runtime (plan, dispatch, select_blocks: all-reduces on gloo CPU ranks)."""
    from megatron_cp.testing import run_ranks

    q, k = inputs(3, torch.float32)
    ranks = run_ranks(_runtime_rank, 2, {"q": q.numpy(), "k": k.numpy()})
    view = single_view(MASKS["docs"](), B)
    for name, sel in (("flex", FLEX[1]), ("mi", mi_selector())):
        one = sel.select(q, k, view)
        assert sum(len(r["q_blocks"]) for r in ranks) == NB
        for r in ranks:
            assert np.array_equal(r[name], one[:, r["q_blocks"]].numpy()), name


def test_the_estimation_rows_score_only_the_key_blocks_their_envelope_may_touch():
    """FlexPrefill / MInference score the last rows against the key blocks their envelope may touch (every other
    score is masked and adds exactly 0): on packed documents the last document's blocks, on causal attention all;
    the selections still match the loop references (above) and CP (above)."""
    from megatron_cp.sparse.flexprefill import estimation_blocks

    docs, causal = single_view(MASKS["docs"](), B), single_view(MASKS["causal"](), B)
    local, ids = estimation_blocks(docs, B)
    assert ids.tolist() == local.tolist() == [3, 4, 5, 6, 7]  # the last document: tokens 100-255
    assert estimation_blocks(causal, B)[1].tolist() == list(range(NB))
    assert estimation_blocks(docs, 3 * B)[1].tolist() == list(range(3, NB))
