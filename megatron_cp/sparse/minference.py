"""MInference: a static pattern per query head, its blocks chosen at run time (Jiang et al.,
"MInference 1.0: Accelerating Pre-filling for Long-Context LLMs via Dynamic Sparse Attention",
NeurIPS 2024; github.com/microsoft/MInference).

Patterns (``HeadPattern.kind``), all intersected with the envelope, the diagonal block always kept:

- ``a_shape`` (published "stream_llm"/A-shape; ``sink=128``, ``local=3968`` tokens as
  ``minference/models_patch.py``): key blocks holding a token ``j < sink``, and block pairs holding a
  cell with ``0 <= i - j < local``. Static: no estimation.
- ``vertical_slash`` (published default ``vertical=1000``, ``slash=6096``): the attention of the last
  ``last_q = 64`` queries of the sequence over all keys (envelope-masked softmax; for packed documents
  those are the last document's queries); the ``vertical`` columns and ``slash`` diagonals (offset
  ``i - j``) of most mass, plus the first 30 columns and the 30 diagonals of offset 0..29 (forced, as
  published); a block pair is kept when it holds a kept column or a cell of a kept diagonal.
- ``block_sparse`` (published ``topk=100`` blocks of 64 tokens, i.e. 6400 tokens): per q block, the
  ``top_k`` envelope key blocks by pooled q . pooled k (mean pooling, 1/sqrt(D) scale).
  ``top_k=None`` means ``ceil(6400 / block)`` blocks.

Sequence-length scaling: the published sizes were fitted at 128K tokens. ``vertical``, ``slash`` and
``top_k`` are scaled by ``min(1, S / ref_len)`` (``ref_len`` per head, default 131072; the search tool
writes the length it searched at), ``top_k`` at least 1. ``sink`` and ``local`` are absolute.

Config JSON (``MInference.from_json(path, layer)``, written by ``tools/minference_search.py``)::

    {"layers": [[{"kind": "vertical_slash", "vertical": 1000, "slash": 6096}, ...one per q head],
                ...one list per layer]}

Entry keys: ``kind`` and that kind's sizes (``sink``, ``local`` | ``vertical``, ``slash`` | ``top_k``),
optional ``ref_len``. Bad entries (unknown kind or key, negative size, wrong head count) raise
ValueError in ``check`` naming the layer, head and value.

Deviations from the published method: the forced columns / diagonals come on top of ``vertical`` /
``slash`` (published: inside the top-k, with floors ``vertical >= 30``, ``slash >= 50``): at block
granularity they cost at most one sink block and two block diagonals per row, while the published
floors would make every vertical-slash head near-dense at short lengths; block granularity (the
kernels compute whole blocks of the selection; MInference's vertical-slash kernel works per token
column / diagonal); the diagonal block is always kept (so that no row is left without keys);
block-sparse uses the selector's block, not 64.

Context parallelism: ``select = select_from(q, summaries(q, k, view), view)``; ``summaries`` runs the
collectives only for the kinds present in the layer (static): vertical-slash heads need the last-rows
statistics (``flexprefill.last_rows_summaries``: combine, combine_max, combine, combine), block-sparse
heads the pooled keys (one combine, merged into the first round). Exactness as in docs/sparse.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from ..kernels import accumulate_dtype, upload_all
from .flexprefill import (NEG, block_masks, combine_parts, derived, last_rows_summaries, pooled_keys, pooled_scores,
                          top_n, vertical_slash_blocks)
from .moba import block_means
from .selector import check_block, check_heads
from .view import SelectionView

KINDS = ("a_shape", "vertical_slash", "block_sparse")
PARAMS = {"a_shape": ("sink", "local"), "vertical_slash": ("vertical", "slash"), "block_sparse": ("top_k",)}
REF_LEN = 131072
FORCED_COLUMNS = 30
FORCED_DIAGONALS = 30
BLOCK_SPARSE_TOKENS = 6400  # published: top 100 blocks of 64 tokens


@dataclass(frozen=True)
class HeadPattern:
    """One q head's pattern: ``kind`` in a_shape | vertical_slash | block_sparse and its sizes (tokens:
    sink, local; counts: vertical columns, slash diagonals; top_k key blocks, None = 6400 tokens'
    worth). ``ref_len``: the sequence length the sizes were chosen for. Validated by ``MInference.check``
    (construction accepts anything so that the error can name the layer and head)."""

    kind: str
    sink: int = 128
    local: int = 3968
    vertical: int = 1000
    slash: int = 6096
    top_k: int | None = None
    ref_len: int = REF_LEN

    extra: tuple = ()  # unknown keys of a config entry, reported by ``check``

    @classmethod
    def from_dict(cls, d) -> "HeadPattern":
        """From a config entry ``{"kind": ..., <sizes>}``; unknown keys are kept for ``check`` to name."""
        if not isinstance(d, dict):
            return cls(kind=d, extra=(("entry", repr(d)),))
        known = {k: v for k, v in d.items() if k in _FIELDS}
        unknown = tuple(sorted((str(k), repr(v)) for k, v in d.items() if k != "kind" and k not in _FIELDS))
        return cls(kind=d.get("kind"), extra=unknown, **known)

    def to_dict(self) -> dict:
        out = {"kind": self.kind}
        for p in PARAMS.get(self.kind, ()):
            out[p] = getattr(self, p)
        if self.ref_len != REF_LEN:
            out["ref_len"] = self.ref_len
        return out

    def problem(self) -> str | None:
        """None, or what is wrong with this entry."""
        if self.extra:
            return f"unknown keys in entry {dict(self.extra)} (kind {self.kind!r})"
        if self.kind not in KINDS:
            return f"unknown kind {self.kind!r} (expected one of {', '.join(KINDS)})"
        for p in PARAMS[self.kind] + ("ref_len",):
            v = getattr(self, p)
            if p == "top_k" and v is None:
                continue
            low = 1 if p in ("top_k", "ref_len") else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                return f"{p} must be an int >= {low}, got {v!r}"
        return None


_FIELDS = {"sink", "local", "vertical", "slash", "top_k", "ref_len"}


@dataclass(frozen=True)
class MInference:
    """MInference selector for one layer (see the module doc).

    patterns: one ``HeadPattern`` per query head (a list is stored as a tuple); block: tokens per block
    (128); last_q: estimation queries of vertical-slash heads (64, as published); layer: the config
    layer (only for error messages).
    """

    name: ClassVar[str] = "minference"
    patterns: tuple = ()
    block: int = 128
    last_q: int = 64
    layer: int | None = field(default=None, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "patterns", tuple(self.patterns))

    @classmethod
    def from_json(cls, path: str, layer: int, block: int = 128, last_q: int = 64) -> "MInference":
        """The selector of config layer ``layer`` (0-based) of the JSON file ``path`` (module doc)."""
        try:
            with open(path) as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"minference: config {path!r} is not a readable JSON file ({e})") from None
        layers = cfg.get("layers") if isinstance(cfg, dict) else None
        if not isinstance(layers, list):
            raise ValueError(f"minference: config {path!r} needs a top-level 'layers' list")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(layers):
            raise ValueError(f"minference: config {path!r} has {len(layers)} layers, no layer {layer!r}")
        heads = layers[layer]
        if not isinstance(heads, list):
            raise ValueError(f"minference: config {path!r} layer {layer} must be a list of head entries, "
                             f"got {heads!r}")
        return cls(tuple(HeadPattern.from_dict(h) for h in heads), block, last_q, layer)

    def _where(self, h: int) -> str:
        return f"{self.name}: " + (f"layer {self.layer} " if self.layer is not None else "") + f"head {h}"

    def check(self, num_q_heads: int, num_kv_heads: int, head_dim: int, seqlen: int) -> None:
        """ValueError naming the bad entry / value (no collective)."""
        check_block(self.name, self.block, seqlen)
        check_heads(self.name, num_q_heads, num_kv_heads, head_dim)
        if isinstance(self.last_q, bool) or not isinstance(self.last_q, int) or self.last_q < 1:
            raise ValueError(f"{self.name}: last_q must be a positive int, got {self.last_q!r}")
        if len(self.patterns) != num_q_heads:
            where = f"layer {self.layer} " if self.layer is not None else ""
            raise ValueError(f"{self.name}: {where}has {len(self.patterns)} head patterns, the model has "
                             f"{num_q_heads} query heads (per tensor-parallel rank)")
        for h, p in enumerate(self.patterns):
            if not isinstance(p, HeadPattern):
                raise ValueError(f"{self._where(h)}: not a HeadPattern: {p!r}")
            why = p.problem()
            if why is not None:
                raise ValueError(f"{self._where(h)}: {why}")

    # sizes at this sequence length
    def _scaled(self, p: HeadPattern, v: int, floor: int, s: int) -> int:
        return max(floor, math.ceil(v * min(1.0, s / p.ref_len)))

    def summaries(self, q: torch.Tensor, k: torch.Tensor, view: SelectionView) -> dict:
        """Owner-side step (collectives only for the kinds present). q [nq*B, Hq, D], k [nq*B, Hkv, D].
        Returns ``vertical`` [Hq, S], ``slash`` [Hq, S + L - 1] (vertical-slash heads present),
        ``kp`` [nb, Hkv, D] pooled keys (block-sparse heads present); ``rows`` L."""
        kinds = {p.kind for p in self.patterns}
        dt = accumulate_dtype(q.dtype)
        out = {"rows": min(self.last_q, view.seqlen)}
        extra = [pooled_keys(k, view, dt)] if "block_sparse" in kinds else []
        if "vertical_slash" in kinds:
            r = last_rows_summaries(q, k, view, out["rows"], dt, extra)
            out.update(vertical=r["vertical"], slash=r["slash"])
            extra = r["extra"]
        elif extra:
            extra = combine_parts(view.combine, extra)
        if extra:
            out["kp"] = extra[0]
        return out

    def _heads(self, view: SelectionView) -> dict:
        """Static per (layout, patterns), kept in ``view.cache``: per kind present, its heads (a slice when they
        are consecutive, else a long tensor) then its sizes at this length as long tensors (vertical-slash: the
        column and diagonal counts; block-sparse: top_k); ``runs``: [kind, key, heads] for each run of
        consecutive heads of one kind (key: the a-shape's (sink, local), else the run's first index among the
        kind's heads), in head order."""
        def make():
            s, pats = view.seqlen, self.patterns
            by_kind, runs = {}, []
            for h, p in enumerate(pats):
                hs = by_kind.setdefault(p.kind, [])
                key = (p.sink, p.local) if p.kind == "a_shape" else len(hs)
                if runs and runs[-1][0] == p.kind and (p.kind != "a_shape" or runs[-1][1] == key):
                    runs[-1][2] += 1
                else:
                    runs.append([p.kind, key, 1])
                hs.append(h)
            out = {"runs": runs}
            for kind, hs in by_kind.items():
                ps = [pats[h] for h in hs]
                top = -(-BLOCK_SPARSE_TOKENS // view.block)
                sizes = {"vertical_slash": [[self._scaled(p, p.vertical, 0, s) for p in ps],
                                            [self._scaled(p, p.slash, 0, s) for p in ps]],
                         "block_sparse": [[self._scaled(p, top if p.top_k is None else p.top_k, 1, s) for p in ps]],
                         }.get(kind, [])
                consecutive = hs == list(range(hs[0], hs[0] + len(hs)))
                up = upload_all([np.asarray(x, dtype=np.int64) for x in sizes + ([] if consecutive else [hs])],
                                view.device)
                out[kind] = (slice(hs[0], hs[0] + len(hs)) if consecutive else up[-1], *up[:len(sizes)])
            return out
        return derived(view, ("minference heads", self.patterns), make)

    @staticmethod
    def _a_shape(view: SelectionView, sink: int, local: int) -> torch.Tensor:
        """bool [nq, nb], static (``view.cache``): key blocks holding a token j < sink, and block pairs holding a
        cell with 0 <= i - j < local."""
        def make():
            b, dev = view.block, view.device
            kb = torch.arange(view.num_blocks, device=dev)
            delta = (view.q_blocks[:, None] - kb[None, :]) * b  # [nq, nb] offset of the blocks' corners
            win = (delta + b - 1 >= 0) & (delta - b + 1 <= local - 1)
            return ((kb * b) < sink)[None, :] | (win & (local > 0))
        return derived(view, ("minference a_shape", sink, local), make)

    def select_from(self, q: torch.Tensor, sm: dict, view: SelectionView) -> torch.Tensor:
        """Local step: keep bool [Hq, nq, nb] from this rank's q [nq*B, Hq, D] and ``summaries``."""
        b, nb = view.block, view.num_blocks
        nq = q.shape[0] // b
        d = q.shape[2]
        masks = block_masks(view)
        heads = self._heads(view)
        got = {}
        if "vertical_slash" in heads:
            hs, vcount, scount = heads["vertical_slash"]
            L = sm["rows"]
            colkeep = top_n(sm["vertical"][hs], None, vcount)
            slashkeep = top_n(sm["slash"][hs], None, scount)
            colkeep[:, :FORCED_COLUMNS].fill_(True)  # always: the first 30 columns and offsets 0..29
            slashkeep[:, L - 1: L - 1 + FORCED_DIAGONALS].fill_(True)
            got["vertical_slash"] = vertical_slash_blocks(colkeep, slashkeep, view, L)
        if "block_sparse" in heads:
            hs, topk = heads["block_sparse"]
            dt = sm["kp"].dtype
            lg = pooled_scores(block_means(q, b, dt), sm["kp"], math.sqrt(d))[hs].masked_fill(masks["off"], NEG)
            n = topk.shape[0]
            got["block_sparse"] = top_n(lg, masks["env_i32"].expand(n, nq, nb), topk[:, None].expand(n, nq))
        parts = []
        for kind, key, n in heads["runs"]:
            if kind == "a_shape":
                parts.append(self._a_shape(view, *key).expand(n, nq, nb))
            elif kind in got:
                parts.append(got[kind][key:key + n])
            else:  # not a kind (``check`` refuses it): the diagonal block only
                parts.append(masks["env"].new_zeros(n, nq, nb))
        keep = torch.cat(parts) if len(parts) > 1 else parts[0]
        return (keep | masks["diag"]) & masks["env"]

    def select(self, q: torch.Tensor, k: torch.Tensor, view: SelectionView) -> torch.Tensor:
        """keep bool [Hq, nq, nb] (docs/sparse.md); ``select_from(q, summaries(q, k, view), view)``."""
        return self.select_from(q, self.summaries(q, k, view), view)
