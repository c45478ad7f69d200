"""FlashAttention-4 backend: tile lists as FA4 varlen window calls (flash-attn-4, ``flash_attn.cute``).

How the tiles become calls is ``fa4_calls.py`` (pure, tested on the CPU). Here the calls run:

- forward: one call writes ``out`` / ``lse`` directly (rows no tile covers are set to 0 / -inf); with
  several calls (segments sharing rows) each call's result is LSE-merged in float32 on the rows it
  covers (``merge.merge_into``), rounded to q's dtype once at the end. ``forward_accumulate`` merges
  every call into the caller's running pair.
- backward: FA4's backward takes the merged (global) ``out`` and ``lse``, so each call's gradients are
  the exact partial gradients of its cells; one call writes dq / dk / dv directly, several are summed in
  float32 on the rows and keys they cover. A given ``delta`` (an lse gradient) reaches FA4 as
  ``dlse = rowsum(dout * out) - delta``.

FA4 runs float16 / bfloat16 on sm90 / sm100 with head_dim <= 192 in the backward (sm90), and a v head dim
of its own (MLA's 192 / 128: any pair of multiples of 8 up to 256 on sm90, (192, 128) on sm100). Whatever FA4
cannot run goes to the Triton backend per phase, with the reason kept in ``describe()`` and
``last_path`` - never silently: the reasons are decided from (device, dtype, head_dim) up front.
The per-list device metadata (cu_seqlens, seqused) is built once per (list, device) and cached in the
prepared object; no call synchronises with the host.

With a ``BlockKeep`` (``keep``, dynamic sparse attention) each direction is ONE FA4 block-sparse call with
per-query-head lists built on the device per call (``fa4_sparse.py``); what that call cannot run (fp32,
keep blocks not multiples of 128, lists with no block-sparse form (``fa4_calls.block_lists``), head_dim > 128
in the backward, the deterministic backward) goes to the Triton backend's ``keep`` path, with the reason.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch

from . import measured, replay
from . import sparse as fa4_sparse
from .calls import MASK_INTERVALS
from .cells import periodic_cells
from .prepared import DEFAULT_HEAD_DIMS, Fa4Prepared, HostPrepare, Run, prepare_list
from ..config import TritonConfig
from ..fallback import fallback_backend
from ..merge import merge_into
from ..pieces import uncovered_rows
from ..protocol import accumulate_dtype, check_running

FA4_BWD_MAX_HEAD_DIM = 192  # FA4's sm90 backward (flash_bwd_sm90) supports head_dim <= 192
FA4_ARCHS = (9, 10)  # sm90 (Hopper), sm100 (Blackwell)


def _fa4_module():
    """flash_attn.cute.interface, or the ImportError's text."""
    try:
        from flash_attn.cute import interface  # noqa: PLC0415  (optional accelerator)
    except Exception as e:  # noqa: BLE001  (any failure to import means: not installed / not usable)
        return f"flash-attn-4 does not import ({type(e).__name__}: {e})"
    return interface


def fa4_unavailable(device="cuda") -> str | None:
    """None when FA4 can run on ``device``, else why not (in words)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"FA4 runs on CUDA GPUs, not {device}"
    if not torch.cuda.is_available():
        return "FA4 runs on CUDA GPUs and none is visible here"
    major = torch.cuda.get_device_capability(device)[0]
    if major not in FA4_ARCHS:
        return f"FA4 runs on sm90 / sm100, not sm{major}x"
    mod = _fa4_module()
    return mod if isinstance(mod, str) else None


@dataclass
class Fa4Functions:
    """The FA4 entry points the backend uses (``_flash_attn_fwd`` / ``_flash_attn_bwd``, the block-sparse
    tensor type and the interval ``mask_mod``), swappable so that the CPU tests run the same code
    against a reference of their semantics (tests/fa4_semantics.py)."""

    fwd: Callable
    bwd: Callable
    version: str = "?"
    dtypes: tuple = (torch.float16, torch.bfloat16)
    block_sparse: Callable | None = None  # (mask_cnt, mask_idx, full_cnt, full_idx, block_size) -> tensors
    interval_masks: dict | None = None  # BlockLists.mask_key -> mask_mod: key in one of the row's intervals
    band_mask: Callable | None = None  # BlockLists.band -> mask_mod of fa4_calls.band_keep


def _default_functions() -> Fa4Functions:
    mod = _fa4_module()
    if isinstance(mod, str):
        raise RuntimeError(mod)
    try:
        from importlib.metadata import version  # noqa: PLC0415

        ver = version("flash-attn-4")
    except Exception:  # noqa: BLE001
        ver = "?"
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # noqa: PLC0415

    def block_sparse(mask_cnt, mask_idx, full_cnt, full_idx, block_size):
        return BlockSparseTensorsTorch(mask_cnt, mask_idx, full_cnt, full_idx, block_size=block_size)

    return Fa4Functions(mod._flash_attn_fwd, mod._flash_attn_bwd, ver, block_sparse=block_sparse,
                        interval_masks=_interval_mask_mods(), band_mask=functools.lru_cache(maxsize=None)(_band_mask_mod))


def _band_mask_mod(sink: int, dlo: int, dhi: int, group: int = 0, period: int = 0, local: int = 0):
    """The CuTe DSL mask_mod ``key - row <= dhi and (key < sink or key - row >= dlo)`` (fa4_calls.band_keep), with
    ``group`` the periodic band's (sink 0, dlo below every cell: not compared): those cells whose group offset
    ``row // group - key // group`` is below ``local`` or a multiple of ``period`` (``cells.periodic_cells``); the
    bounds are compile-time constants (FA4 keys its compile cache on a mask_mod's code and captured values: one
    kernel per band). Cached per band, so a list's calls reuse one function object."""
    import cutlass  # noqa: PLC0415
    import cutlass.cute as cute  # noqa: PLC0415
    from flash_attn.cute import utils  # noqa: PLC0415

    if group and sink:
        raise ValueError(f"a periodic band has no sink keys, got sink {sink}")

    def int32(x):
        return utils.scalar_to_ssa(x, cutlass.Int32)

    @cute.jit
    def band(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        if cutlass.const_expr(group > 0):  # the arithmetic shared with the tests (cells.periodic_cells)
            return periodic_cells(m_idx, n_idx, dhi, group, period, local, int32)
        d = n_idx - m_idx
        upper = d <= utils.scalar_to_ssa(dhi, cutlass.Int32)
        if cutlass.const_expr(sink == 0):
            return upper & (d >= utils.scalar_to_ssa(dlo, cutlass.Int32))
        return upper & ((n_idx < utils.scalar_to_ssa(sink, cutlass.Int32)) | (d >= utils.scalar_to_ssa(dlo, cutlass.Int32)))

    # FA4 keys its compile cache (on disk too) on a mask_mod's own source and captured values: the arithmetic in
    # periodic_cells, called from here, must be in the key, or an edit to it would meet kernels compiled before
    band.__cute_hash__ = _cache_key((_band_mask_mod, periodic_cells), (sink, dlo, dhi, group, period, local))
    return band


def _cache_key(functions, values) -> str:
    """A mask_mod's FA4 compile-cache key (``__cute_hash__``): the source of every function its arithmetic lives in,
    and the values it specialises on."""
    def source(f):
        try:
            return inspect.getsource(f)
        except (OSError, TypeError):  # no source shipped: the bytecode
            return f.__code__.co_code.hex()
    return hashlib.sha256(repr(([source(f) for f in functions], values)).encode()).hexdigest()


def _interval_mask_mods() -> dict:
    """The CuTe DSL mask_mods of block-sparse calls, by ``BlockLists.mask_key``: row r keeps key c iff c lies in one
    of the row's intervals, read from aux tensor 0 (int32 [sq, 2 * intervals]), or iff bit ``c & 31`` of word
    ``[r, c >> 5]`` is set ("bitmap", int32 [sq, 4 * N]; the backward's "bitmap_t" the same bits by key, bit r & 31
    of word [c, r >> 5], int32 [sk, 4 * M]; "by_key_1" / "by_key_2", the backward's intervals by key: key c kept by
    the rows of one of its intervals, int32 [sk, 2 * intervals]). FA4 evaluates them on partial blocks only, per element:
    the one-interval form reads half as much (faster on strided masks: docs/measurements.md), the bitmap one word."""
    import cutlass  # noqa: PLC0415
    import cutlass.cute as cute  # noqa: PLC0415
    from flash_attn.cute import utils  # noqa: PLC0415

    assert MASK_INTERVALS == 2

    def int32(x):
        return utils.scalar_to_ssa(x, cutlass.Int32)

    # one reading each, by row (forward: m_idx's row, keys n_idx) or by key (backward: n_idx's key, rows m_idx)
    def within(bounds, at, x, count):  # x in one of the first ``count`` intervals [lo, hi) of bounds[at]
        keep = (x >= int32(bounds[at, 0])) & (x < int32(bounds[at, 1]))
        for i in range(1, count):
            keep = keep | ((x >= int32(bounds[at, 2 * i])) & (x < int32(bounds[at, 2 * i + 1])))
        return keep

    def bit(bits, at, x):  # bit x & 31 of word [at, x >> 5] (x one index: the row's / key's other coordinate)
        c = x[0]
        return int32((bits[at, c >> 5] >> (c & 31)) & 1) == int32(1)

    def reading(read, by_key: bool):  # the mask_mod reading by row (m_idx's) or by key (n_idx's)
        @cute.jit
        def mod(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
            if cutlass.const_expr(by_key):
                return read(aux_tensors[0], n_idx[0], m_idx)
            return read(aux_tensors[0], m_idx[0], n_idx)
        return mod

    one, two = functools.partial(within, count=1), functools.partial(within, count=2)
    mods = {1: reading(one, False), 2: reading(two, False), "by_key_1": reading(one, True),
            "by_key_2": reading(two, True), "bitmap": reading(bit, False), "bitmap_t": reading(bit, True)}
    for key, mod in mods.items():  # FA4's compile-cache key: this whole function's source (the helpers are in it)
        mod.__cute_hash__ = _cache_key((_interval_mask_mods,), key)
    return mods


class FA4Backend:
    """Tile lists on FlashAttention-4 (see the module doc), Triton where FA4 cannot run.

    last_path: what the latest call ran: "fa4" or "triton (<reason>)".
    last_configs: the Triton fallback's kernel configs of its latest calls (empty while FA4 runs).
    routes: the list classes timed on FA4 and Triton and which ran faster (``measured.py``); ``timer``: how
    (default: CUDA events on CUDA tensors).
    """

    name = "fa4"

    @property
    def prepare_host(self) -> HostPrepare:
        """The lists of a new plan prepared in the planning helper (protocol): with their Triton form too once this
        process has run some list on the Triton fallback (a measured route, a rule of ``calls.py``, a dtype)."""
        return HostPrepare(self.triton.prepare_host if self.fallbacks else None)

    def __init__(self, config: TritonConfig | None = None, functions: Fa4Functions | None = None, timer=None):
        self.config = config or TritonConfig()
        self.routes = measured.RouteTimes(timer)
        self.triton = fallback_backend(self.config)
        self._functions = functions
        self.last_path: str | None = None
        self.fallbacks: dict[str, str] = {}  # phase/family -> reason, every fallback seen

    @property
    def last_configs(self):
        return self.triton.last_configs

    @property
    def functions(self) -> Fa4Functions:
        if self._functions is None:
            self._functions = _default_functions()
        return self._functions

    def describe(self) -> dict:
        """FA4 version, the device's arch, every fallback to Triton met so far with its reason, the routes timed, and
        the launches kept on FA4's interface on every call (not replayed) with why (``replay.refusals``)."""
        arch = None
        if torch.cuda.is_available():
            arch = "sm%d%d" % torch.cuda.get_device_capability()
        ver = self._functions.version if self._functions is not None else None
        return {"backend": "fa4", "flash_attn_4": ver, "arch": arch, "deterministic": self.config.deterministic,
                "fallbacks": dict(self.fallbacks), "routes": self.routes.describe(),
                "not_replayed": replay.refusals()}

    def supports(self, device, dtype: torch.dtype, head_dim: int, head_dim_v: int | None = None) -> str | None:
        """FA4 itself or the Triton fallback must run it; on a device without FA4 this backend does not."""
        if self._functions is None:
            why = fa4_unavailable(device)
            if why is not None:
                return why
        if head_dim_v is None:
            if dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256:
                return None
            return self.triton.supports(device, dtype, head_dim)
        # a v head dim of its own: wherever FA4 cannot run the pair, the Triton fallback must
        return self.triton.supports(device, dtype, head_dim, head_dim_v)

    def _route(self, phase: str, q, k, v, prepared: Fa4Prepared, candidates=None) -> str:
        """How ``phase`` ("fwd" / "bwd") of inputs like ``q``, ``k``, ``v`` runs: "triton" (the reason in
        ``last_path``), or FA4's "varlen" / "blocks". ``candidates``: makes this call's runs of given routes, to
        time the list's class (``measured.list_route``)."""
        why, route = None, "triton"
        d, dv = q.shape[-1], v.shape[-1]
        dtypes = self._functions.dtypes if self._functions is not None else (torch.float16, torch.bfloat16)
        if q.dtype not in dtypes:
            why = f"{q.dtype}: FA4 runs float16 / bfloat16"
        elif d % 8 or d > 256:
            why = f"head_dim {d}: FA4 runs multiples of 8 up to 256"
        elif phase == "bwd" and d > FA4_BWD_MAX_HEAD_DIM:
            why = f"head_dim {d}: FA4's sm90 backward runs head_dim <= {FA4_BWD_MAX_HEAD_DIM}"
        elif dv != d:
            why = fa4_head_dims_reason(d, dv, _arch_major(q.device), phase=phase, gqa=q.shape[1] != v.shape[1])
        if why is None:
            route, why = measured.list_route(self.routes, phase, q, k, v, prepared, self.config.deterministic,
                                             candidates)
        if why is not None:
            tag = f"{phase} {q.dtype} d{d}" + (f"/{dv}" if dv != d else "")
            self.fallbacks[tag if "head_dim" in why or "float" in why else f"{phase} list"] = why
            self.last_path = f"triton ({why})"
        else:
            self.last_path = "fa4"
        return route

    def _triton_prepared(self, prepared: Fa4Prepared):
        if prepared._triton is None:
            prepared._triton = self.triton.prepare(prepared.tiles, prepared.seqlen_q, prepared.seqlen_k,
                                                   head_dims=prepared.head_dims)
        return prepared._triton

    @staticmethod
    def _scale(softmax_scale, q):
        return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])

    # -- per list ---------------------------------------------------------------------------------
    def prepare(self, tiles: torch.Tensor, seqlen_q: int, seqlen_k: int, head_dims=DEFAULT_HEAD_DIMS) -> Fa4Prepared:
        """tiles int [n, 5] (cpu) -> the list's FA4 calls (``prepared.prepare_list``)."""
        return prepare_list(tiles, seqlen_q, seqlen_k, head_dims)

    def _runs(self, prepared: Fa4Prepared, direction: str, device, route: str) -> list[Run]:
        return prepared.runs(direction, device, self.functions, route)

    def _candidates(self, names, q, k, v, prepared: Fa4Prepared, scale, grads=None) -> dict | None:
        """{route: run} of the forward (``grads`` None) or the backward (grads: out, lse, dout, delta) by each of
        ``names``, on fresh outputs: what ``measured`` times; None where Triton cannot run these inputs."""
        if self.triton.supports(q.device, q.dtype, q.shape[-1], v.shape[-1]) is not None:
            return None
        def run(r):
            if r == "triton":
                tp = self._triton_prepared(prepared)
                return (self.triton.forward(q, k, v, tp, scale) if grads is None else
                        self.triton.backward(q, k, v, *grads[:3], tp, scale, grads[3]))
            return (self._fa4_forward(q, k, v, prepared, scale, r) if grads is None else
                    self._fa4_backward(q, k, v, *grads[:3], prepared, scale, grads[3], r))
        return {r: functools.partial(run, r) for r in names}

    # -- forward ----------------------------------------------------------------------------------
    def _run_fwd(self, q, k, v, run: Run, scale: float, out, lse_hm):
        """One FA4 forward launch writing its rows of ``out`` [sq, Hq, D] and ``lse_hm`` [Hq, sq]."""
        f = self.functions.fwd
        t = (q, k, v, out, lse_hm)
        if run.dense:
            t = tuple(x.unsqueeze(0) for x in t)
        replay.launch(f, t, run.replays, scale, lambda o, lse: f(*t[:3], softmax_scale=scale, return_lse=True,
                                                                out=o, lse=lse, **run.kw), run.fwd_programs, run.kw)

    def forward(self, q, k, v, prepared: Fa4Prepared, softmax_scale=None, keep=None):
        """q [sq, Hq, D], k/v [sk, Hkv, D] -> out [sq, Hq, D] (q's dtype), lse [sq, Hq] float32 (a head-major view).
        keep: None or a BlockKeep (per-head block selection): one per-head block-sparse FA4 call."""
        if keep is not None:
            return self._sparse_forward(q, k, v, prepared, softmax_scale, keep)
        route = self._route("fwd", q, k, v, prepared, lambda n: self._candidates(n, q, k, v, prepared, softmax_scale))
        if route == "triton":
            return self.triton.forward(q, k, v, self._triton_prepared(prepared), softmax_scale)
        return self._fa4_forward(q, k, v, prepared, softmax_scale, route)

    def _fa4_forward(self, q, k, v, prepared: Fa4Prepared, softmax_scale, route: str):
        _check_call(q, k, v, prepared)
        scale = self._scale(softmax_scale, q)
        runs = self._runs(prepared, "fwd", q.device, route)
        sq, hq, _ = q.shape
        cdt = accumulate_dtype(q.dtype)
        if len(runs) > 1:
            out = torch.zeros(_out_shape(q, v), device=q.device, dtype=cdt)
            lse = torch.full((sq, hq), float("-inf"), device=q.device, dtype=cdt)
            self._accumulate(q, k, v, runs, scale, out, lse)
            return out.to(q.dtype), lse
        out = torch.empty(_out_shape(q, v), device=q.device, dtype=q.dtype)
        lse_hm = torch.empty(hq, sq, device=q.device, dtype=cdt)
        if runs:
            self._run_fwd(q, k, v, runs[0], scale, out, lse_hm)
        for a, b in prepared.calls.row_gaps:  # after the launch: FA4 owns only the rows it covers
            out[a:b] = 0
            lse_hm[:, a:b] = float("-inf")
        return out, lse_hm.t()  # FA4's head-major lse as a view: the backward takes it back without a copy

    def forward_accumulate(self, q, k, v, prepared: Fa4Prepared, softmax_scale, out, lse) -> None:
        """Merge the list into the running (out [sq, Hq, D], lse [sq, Hq]) in place (protocol)."""
        route = self._route("fwd", q, k, v, prepared, lambda n: self._candidates(n, q, k, v, prepared, softmax_scale))
        if route == "triton":
            self.triton.forward_accumulate(q, k, v, self._triton_prepared(prepared), softmax_scale, out, lse)
            return
        _check_call(q, k, v, prepared)
        check_running("out", out, q, _out_shape(q, v))
        check_running("lse", lse, q, tuple(q.shape[:2]))
        runs = self._runs(prepared, "fwd", q.device, route)
        self._accumulate(q, k, v, runs, self._scale(softmax_scale, q), out, lse, prepared.calls.row_gaps)

    def _accumulate(self, q, k, v, runs: list[Run], scale, out, lse, gaps=()) -> None:
        """LSE-merge each launch into (out, lse) on the rows it writes (rows in ``gaps`` keep no cell)."""
        if not runs:
            return
        sq, hq, _ = q.shape
        o_t = torch.empty(_out_shape(q, v), device=q.device, dtype=q.dtype)
        l_t = torch.empty(hq, sq, device=q.device, dtype=accumulate_dtype(q.dtype))
        flat = out.is_contiguous() and lse.is_contiguous()
        for run in runs:
            self._run_fwd(q, k, v, run, scale, o_t, l_t)
            for a, b in run.row_spans:
                for a, b in _minus((a, b), gaps):
                    if flat:
                        merge_into(out[a:b], lse[a:b], o_t[a:b], l_t[:, a:b].t().contiguous())
                        continue
                    acc, run_l = out[a:b].contiguous(), lse[a:b].contiguous()
                    merge_into(acc, run_l, o_t[a:b], l_t[:, a:b].t().contiguous())
                    out[a:b] = acc
                    lse[a:b] = run_l

    # -- backward ---------------------------------------------------------------------------------
    def _run_bwd(self, q, k, v, out, dout, lse_hm, dlse_hm, run: Run, scale, dq, dk, dv):
        """One FA4 backward launch writing dq, dk, dv (replayed from the run's recorded program after its first)."""
        f = self.functions.bwd
        det = self.config.deterministic
        given = dict(zip(replay.BWD_SLOTS, (q, k, v, out, dout, lse_hm, dq, dk, dv, dlse_hm)))
        given = {n: t.unsqueeze(0) if run.dense else t for n, t in given.items() if t is not None}

        def call(gq, gk, gv):
            t = given
            f(t["q"], t["k"], t["v"], t["out"], t["dout"], t["lse"], scale, deterministic=det, dq=gq, dk=gk, dv=gv,
              dlse=t.get("dlse"), **run.kw)

        replay.launch_bwd(f, given, run.bwd_replays, (scale, det), run.kw, call, exact=det)

    @staticmethod
    def _head_major(lse, out, dout, delta):
        cdt = accumulate_dtype(out.dtype)  # float32 wherever FA4 itself runs
        lse_hm = lse.to(cdt).t().contiguous()
        dlse_hm = None
        if delta is not None:
            dlse_hm = ((dout.to(cdt) * out.to(cdt)).sum(-1) - delta.to(cdt)).t().contiguous()
        return lse_hm, dlse_hm

    def backward(self, q, k, v, out, lse, dout, prepared: Fa4Prepared, softmax_scale=None, delta=None, keep=None):
        """Gradients (dq like q, dk/dv like k) from the merged out / lse [sq, Hq] (and delta, protocol).
        keep: as in ``forward`` (the same selection)."""
        if keep is not None:
            return self._sparse_backward(q, k, v, out, lse, dout, prepared, softmax_scale, delta, keep)
        grads = (out, lse, dout, delta)
        route = self._route("bwd", q, k, v, prepared, lambda n: self._candidates(n, q, k, v, prepared, softmax_scale,
                                                                                  grads))
        if route == "triton":
            return self.triton.backward(q, k, v, out, lse, dout, self._triton_prepared(prepared), softmax_scale, delta)
        return self._fa4_backward(q, k, v, out, lse, dout, prepared, softmax_scale, delta, route)

    def _fa4_backward(self, q, k, v, out, lse, dout, prepared: Fa4Prepared, softmax_scale, delta, route: str):
        _check_call(q, k, v, prepared)
        runs = self._runs(prepared, "bwd", q.device, route)
        scale = self._scale(softmax_scale, q)
        calls = prepared.calls
        if len(runs) > 1:
            cdt = accumulate_dtype(q.dtype)
            dq = torch.zeros(q.shape, device=q.device, dtype=cdt)
            dk = torch.zeros(k.shape, device=q.device, dtype=cdt)
            dv = torch.zeros(v.shape, device=q.device, dtype=cdt)
            self._backward_sum(q, k, v, out, lse, dout, runs, scale, delta, dq, dk, dv)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        dk = torch.empty(k.shape, device=q.device, dtype=k.dtype)
        dv = torch.empty(v.shape, device=q.device, dtype=v.dtype)
        if runs:
            lse_hm, dlse_hm = self._head_major(lse, out, dout, delta)
            self._run_bwd(q, k, v, out.contiguous(), dout.contiguous(), lse_hm, dlse_hm, runs[0], scale, dq, dk, dv)
        for a, b in calls.row_gaps:  # after the launch: FA4 owns only the rows and keys it covers
            dq[a:b] = 0
        for a, b in calls.key_gaps:
            dk[a:b] = 0
            dv[a:b] = 0
        return dq, dk, dv

    def backward_into(self, q, k, v, out, lse, dout, prepared: Fa4Prepared, softmax_scale, delta, dq, dk, dv) -> None:
        """``backward``'s gradients added into float32 running sums (any strides), unrounded (protocol)."""
        grads = (out, lse, dout, delta)
        route = self._route("bwd", q, k, v, prepared, lambda n: self._candidates(n, q, k, v, prepared, softmax_scale,
                                                                                  grads))
        if route == "triton":
            self.triton.backward_into(q, k, v, out, lse, dout, self._triton_prepared(prepared), softmax_scale,
                                      delta, dq, dk, dv)
            return
        _check_call(q, k, v, prepared)
        for name, acc, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
            check_running(name, acc, q, tuple(like.shape))
        runs = self._runs(prepared, "bwd", q.device, route)
        self._backward_sum(q, k, v, out, lse, dout, runs, self._scale(softmax_scale, q), delta, dq, dk, dv,
                           prepared.calls.row_gaps, prepared.calls.key_gaps)

    def _backward_sum(self, q, k, v, out, lse, dout, runs, scale, delta, dq, dk, dv, row_gaps=(), key_gaps=()):
        """Add each launch's gradients into (dq, dk, dv) on the rows / keys it writes (minus the gaps:
        rows and keys no cell touches)."""
        if not runs:
            return
        lse_hm, dlse_hm = self._head_major(lse, out, dout, delta)
        gq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        gk = torch.empty(k.shape, device=q.device, dtype=k.dtype)
        gv = torch.empty(v.shape, device=q.device, dtype=v.dtype)
        out, dout = out.contiguous(), dout.contiguous()
        for run in runs:
            self._run_bwd(q, k, v, out, dout, lse_hm, dlse_hm, run, scale, gq, gk, gv)
            for span in run.row_spans:
                for a, b in _minus(span, row_gaps):
                    dq[a:b] += gq[a:b]
            for span in run.key_spans:
                for a, b in _minus(span, key_gaps):
                    dk[a:b] += gk[a:b]
                    dv[a:b] += gv[a:b]

    # -- per-head block-sparse (BlockKeep) ------------------------------------------------------------
    def _sparse_fallback(self, phase: str, q, k, v, prepared: Fa4Prepared, keep) -> str | None:
        """Check the call and ``keep``; why ``phase`` with ``keep`` runs on Triton (recorded), or None."""
        _check_call(q, k, v, prepared)
        keep.check(q, k)
        dtypes = self._functions.dtypes if self._functions is not None else (torch.float16, torch.bfloat16)
        why = fa4_sparse.input_reason(phase, q, keep, dtypes, self.config.deterministic)
        if why is None and v.shape[-1] != q.shape[-1]:
            why = f"v head_dim {v.shape[-1]} differs from q/k's {q.shape[-1]}: the block-sparse calls run one head dim"
        what = f"{q.dtype} d{q.shape[-1]} block {keep.block}"
        if why is None:  # the inputs suit FA4: the list's static part decides
            why, what = prepared.sparse().reason, "list"
        if why is None:
            self.last_path = "fa4 (per-head block-sparse)"
            return None
        self.fallbacks[f"{phase} keep {what}"] = why
        self.last_path = f"triton ({why})"
        return why

    def _sparse_forward(self, q, k, v, prepared: Fa4Prepared, softmax_scale, keep):
        if self._sparse_fallback("fwd", q, k, v, prepared, keep) is not None:
            return self.triton.forward(q, k, v, self._triton_prepared(prepared), softmax_scale, keep=keep)
        static = prepared.sparse()
        sq, hq, _ = q.shape
        cdt = accumulate_dtype(q.dtype)
        if static.empty:  # no tile keeps a cell
            return torch.zeros(_out_shape(q, v), device=q.device, dtype=q.dtype), torch.full(
                (sq, hq), float("-inf"), device=q.device, dtype=cdt)
        run = Run(True, fa4_sparse.call_kwargs(static, keep, "fwd", self.functions), ((0, sq),), ((0, k.shape[0]),))
        # the block-sparse call is dense-layout: FA4 writes every row (out 0 / lse -inf where nothing is kept)
        out = torch.empty(_out_shape(q, v), device=q.device, dtype=q.dtype)
        lse_hm = torch.empty(hq, sq, device=q.device, dtype=cdt)
        self._run_fwd(q, k, v, run, self._scale(softmax_scale, q), out, lse_hm)
        return out, lse_hm.t()

    def _sparse_backward(self, q, k, v, out, lse, dout, prepared: Fa4Prepared, softmax_scale, delta, keep):
        if self._sparse_fallback("bwd", q, k, v, prepared, keep) is not None:
            return self.triton.backward(q, k, v, out, lse, dout, self._triton_prepared(prepared), softmax_scale,
                                        delta, keep=keep)
        static = prepared.sparse()
        if static.empty:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        run = Run(True, fa4_sparse.call_kwargs(static, keep, "bwd", self.functions), ((0, q.shape[0]),),
                  ((0, k.shape[0]),))
        dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        dk = torch.empty(k.shape, device=q.device, dtype=k.dtype)
        dv = torch.empty(v.shape, device=q.device, dtype=v.dtype)
        lse_hm, dlse_hm = self._head_major(lse, out, dout, delta)
        # FA4 writes every row and key (zeros for k blocks no q block of a head reaches)
        self._run_bwd(q, k, v, out.contiguous(), dout.contiguous(), lse_hm, dlse_hm, run,
                      self._scale(softmax_scale, q), dq, dk, dv)
        return dq, dk, dv


def _minus(span, gaps):
    """[a, b) minus the ``gaps``, as a list of spans (the rows of [0, b) neither [0, a) nor a gap covers)."""
    a, b = span
    return uncovered_rows([(0, a), *((g0, min(g1, b)) for g0, g1 in gaps if g0 < b)], b)


def _check_call(q, k, v, prepared: Fa4Prepared) -> None:
    if q.shape[0] != prepared.seqlen_q or k.shape[0] != prepared.seqlen_k or v.shape[0] != prepared.seqlen_k:
        raise ValueError(f"q/k/v rows {q.shape[0]}/{k.shape[0]}/{v.shape[0]} do not match the prepared list's "
                         f"seqlen_q={prepared.seqlen_q}, seqlen_k={prepared.seqlen_k}")
    if q.dim() != 3 or k.dim() != 3 or q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2] or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"need q [sq, Hq, D], k [sk, Hkv, D] and v [sk, Hkv, Dv] with Hkv dividing Hq, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}")


def _out_shape(q, v) -> tuple:
    """out [sq, Hq, Dv]: q's rows and heads, v's head dim."""
    return tuple(q.shape[:2]) + (v.shape[-1],)


def _arch_major(device) -> int | None:
    device = torch.device(device)
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None


def fa4_head_dims_reason(d: int, dv: int, arch_major: int | None, phase: str = "fwd",
                         gqa: bool = False) -> str | None:
    """Why FA4 (flash_attn.cute, its head-dim validation) cannot run ``phase`` ("fwd" / "bwd") with q/k head
    dim ``d`` and a different v head dim ``dv``, or None: sm90 runs both in 8..256 (multiples of 8; the
    backward's q/k limit is checked apart) but its backward only without GQA (``gqa``: fewer K/V heads than q
    heads; flash-attn-4 4.0.0b36 asserts it on sm90), sm100 the DeepSeek pair (192, 128) or both <= 128."""
    if dv % 8 or not 8 <= dv <= 256:
        return f"v head_dim {dv}: FA4 runs multiples of 8 up to 256"
    if arch_major == 9 and phase == "bwd" and gqa:
        return f"head dims ({d}, {dv}) with GQA: FA4's sm90 backward needs head_dim == head_dim_v"
    if arch_major == 10 and not ((d, dv) == (192, 128) or (d <= 128 and dv <= 128)):
        return f"head dims ({d}, {dv}): FA4 on sm100 runs (192, 128) or both <= 128"
    return None
