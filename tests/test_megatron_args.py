"""Every megatron-cp flag, and every Megatron option megatron-cp does not honour, is checked when the
arguments are parsed: Megatron's own parser (``add_megatron_arguments``, built once) with our flags
reads a tiny config, and ``plugin.validate_args`` (what ``wrap_parse`` runs right
after Megatron's ``parse_and_validate_args``) raises ValueError naming the flag. Megatron's document and
window flags map onto our masks. No process is spawned, no model built."""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np
import pytest

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--position-embedding-type", "rope",
        "--calculate-per-token-loss", "--context-parallel-size", "2", "--context-parallel-impl", "megatron_cp"]
NO_DROPOUT = ["--attention-dropout", "0"]


@functools.lru_cache(maxsize=1)
def _parser():
    """Megatron's parser (``add_megatron_arguments``, what ``parse_args`` builds) plus our flags, built once."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron_cp.megatron.arguments import add_megatron_cp_args

    return add_megatron_cp_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))


def _parse(argv, dropout=True):
    return _parser().parse_args(BASE + (NO_DROPOUT if dropout else []) + list(argv))


def _validate(argv, dropout=True):
    from megatron_cp.megatron import plugin

    args = _parse(argv, dropout)
    plugin.validate_args(args)
    return args


REFUSED = {
    "balance over dp, a baseline": (["--cp-balance-over-dp", "--context-parallel-impl", "ring"],
                                    r"--cp-balance-over-dp runs with --context-parallel-impl megatron_cp, not ring"),
    "balance over dp, TP": (["--cp-balance-over-dp", "--tensor-model-parallel-size", "2"],
                            r"--cp-balance-over-dp does not combine with --tensor-model-parallel-size 2"),
    "balance over dp, PP": (["--cp-balance-over-dp", "--pipeline-model-parallel-size", "2"],
                            r"--cp-balance-over-dp does not combine with --pipeline-model-parallel-size 2"),
    "balance over dp, sparse": (["--cp-balance-over-dp", "--cp-sparse", "moba", "--cp-sparse-block", "32"],
                                r"runs dense attention: drop --cp-sparse"),
    "solver typo": (["--cp-solver", "zigzagg"], r"--cp-solver 'zigzagg' is unknown"),
    "mask kwargs typo": (["--cp-mask", "block_causal", "--cp-mask-kwargs", '{"blok": 8}'], r"--cp-mask-kwargs .*blok"),
    "mask kwargs missing": (["--cp-mask", "block_causal"], r"--cp-mask block_causal --cp-mask-kwargs \{\}.*block"),
    "mask kwargs bad value": (["--cp-mask", "block_causal", "--cp-mask-kwargs", '{"block": 0}'], r"--cp-mask-kwargs"),
    "mask kwargs not json": (["--cp-mask", "block_causal", "--cp-mask-kwargs", "{x"], r"--cp-mask-kwargs is not JSON"),
    "topology size": (["--cp-topology", "2x2"], r"--cp-topology 2x2 has 4 GPUs; --context-parallel-size is 2"),
    "topology shape": (["--cp-topology", "0x2"], r"--cp-topology must look like NODESxGPUS"),
    "chunk size": (["--cp-chunk-size", "0"], r"--cp-chunk-size must be >= 1"),
    "chunk size too big": (["--cp-chunk-size", "1000"], r"--cp-chunk-size 1000.*chunk_size=1000"),
    "sliding window without W": (["--cp-mask", "sliding_window"],
                                 r"--cp-mask sliding_window needs --cp-window W >= 0 .*got no --cp-window"),
    "packed sliding window without W": (["--cp-mask", "packed_sliding_window"],
                                        r"--cp-mask packed_sliding_window needs --cp-window W >= 0 .*got no --cp-window"),
    "negative window": (["--cp-mask", "sliding_window", "--cp-window", "-5"],
                        r"--cp-window must be >= 0 .*got --cp-window -5"),
    "eod outside the vocabulary": (["--cp-mask", "packed", "--cp-eod-token", "999", "--vocab-size", "320"],
                                   r"--cp-eod-token 999 is outside the vocabulary \(--vocab-size 320\).*leave the flag out"),
    "attention dropout default": ([], r"--attention-dropout 0\.1.*pass --attention-dropout 0"),
    "cp comm type": (["--cp-comm-type", "a2a"], r"--cp-comm-type \['a2a'\]"),
    "hierarchical cp": (["--hierarchical-context-parallel-sizes", "1", "2"], r"--hierarchical-context-parallel-sizes"),
    "window right reach": (["--window-size", "8,4"], r"--window-size \(8, 4\).*right reach must be 0"),
    "window and cp-window": (["--window-size", "8,0", "--cp-window", "4"], r"--window-size \(8, 0\) and --cp-window 4"),
    "window and builder": (["--window-size", "8,0", "--cp-mask", "prefix_lm", "--cp-mask-kwargs", '{"prefix": 8}'],
                           r"--window-size .* conflicts with --cp-mask prefix_lm"),
    "cp-window without a sliding mask": (["--cp-window", "8"], r"--cp-window 8 acts only with --cp-mask sliding_window"),
    "mask kwargs with a document mask": (["--cp-mask", "packed", "--cp-mask-kwargs", '{"block": 8}'],
                                         r"--cp-mask-kwargs .* acts only with a builder mask"),
    "fa4 without a GPU": (["--cp-kernel-backend", "fa4"],
                          r"--cp-kernel-backend fa4: FA4 runs on CUDA GPUs and none is visible here; use auto"),
    "cuda graphs": (["--cuda-graph-impl", "local"], r"--cuda-graph-impl local"),
    "cuda graphs (old flag)": (["--enable-cuda-graph"], r"--enable-cuda-graph"),
    "window skip without a window": (["--window-attn-skip-freq", "2"],
                                     r"--window-attn-skip-freq 2 needs --window-size W,0 with W >= 0"),
    "window skip, a baseline": (["--window-size", "8,0", "--window-attn-skip-freq", "2", "--context-parallel-impl",
                                 "ring"], r"--window-attn-skip-freq 2 runs with --context-parallel-impl megatron_cp"),
    "window skip, a sliding mask": (["--window-size", "8,0", "--window-attn-skip-freq", "2", "--cp-mask",
                                     "sliding_window", "--cp-window", "4"],
                                    r"windows some layers of the causal or packed mask; got --cp-mask sliding_window"),
    "window skip, sparse": (["--window-size", "8,0", "--window-attn-skip-freq", "2", "--cp-sparse", "moba",
                             "--cp-sparse-block", "32"], r"\(windowed layers\) does not combine with --cp-sparse"),
    "reset mask and builder": (["--reset-attention-mask", "--cp-mask", "prefix_lm", "--cp-mask-kwargs",
                                '{"prefix": 8}'], r"--reset-attention-mask conflicts with --cp-mask prefix_lm"),
    "reset positions alone": (["--reset-position-ids"], r"--reset-position-ids with --cp-mask causal"),
    "mtp": (["--mtp-num-layers", "1"], r"--mtp-num-layers 1"),
    "mla": (["--multi-latent-attention"], r"--multi-latent-attention"),
    "attention variant": (["--experimental-attention-variant", "dsa"], r"--experimental-attention-variant dsa"),
    "moe overlap": (["--overlap-moe-expert-parallel-comm"], r"--overlap-moe-expert-parallel-comm"),
    "thd loader": (["--dataloader-inter-document-masking"], r"--dataloader-inter-document-masking"),
    "sft": (["--sft"], r"--sft"),
    "inference impl": (["--transformer-impl", "inference_optimized"], r"--transformer-impl inference_optimized"),
    "foreign spec": (["--spec", "local"], r"--spec local builds Megatron's own core attention"),
    "local backend": (["--attention-backend", "local"], r"--attention-backend"),
    "no rope": (["--position-embedding-type", "learned_absolute"], r"--position-embedding-type rope"),
    "per-token loss": (["--context-parallel-impl", "megatron_cp"], None),  # placeholder, replaced below
    "our flags under te": (["--context-parallel-impl", "te", "--cp-mask", "packed"],
                           r"--cp-mask act only with --context-parallel-impl megatron_cp"),
}
del REFUSED["per-token loss"]  # BASE passes --calculate-per-token-loss; its refusal is tested in test_megatron_units


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_at_parse_time_naming_the_flag(case, monkeypatch):
    argv, pattern = REFUSED[case]
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # the CPU machine these messages describe
    with pytest.raises(ValueError, match=pattern):
        _validate(argv, dropout=case != "attention dropout default")


@pytest.mark.parametrize("argv,mask,window", [
    ([], "causal", None),
    (["--reset-attention-mask", "--reset-position-ids"], "packed", None),
    (["--reset-attention-mask"], "packed", None),
    (["--cp-mask", "packed", "--reset-position-ids"], "packed", None),
    (["--reset-attention-mask", "--cp-mask", "sliding_window", "--cp-window", "8"], "packed_sliding_window", 8),
    (["--window-size", "8,0"], "sliding_window", 8),
    (["--window-size", "(8,0)", "--reset-attention-mask", "--reset-position-ids"], "packed_sliding_window", 8),
    (["--window-size", "8,0", "--cp-window", "8"], "sliding_window", 8),
    (["--window-size=-1,0"], "causal", None),
    (["--cp-mask", "block_causal", "--cp-mask-kwargs", '{"block": 8}'], "block_causal", None),
])
def test_megatron_document_and_window_flags_map_onto_our_masks(argv, mask, window):
    args = _validate(argv)
    assert (args.cp_mask, args.cp_window, args.window_size) == (mask, window, None)
    from megatron_cp.megatron.plugin import validate_args

    validate_args(args)  # idempotent: pretrain_llama.py validates after wrap_parse-style parsing too
    assert (args.cp_mask, args.cp_window) == (mask, window)


def test_window_skip_frequency_keeps_the_mask_and_windows_some_layers():
    """--window-size W,0 with --window-attn-skip-freq: the mask stays the documents' (packed), Megatron's window
    flags stay for each layer's core attention to read, and the spec carries the windowed layers' window."""
    from megatron_cp.megatron.plugin import plan_specs

    args = _validate(["--window-size", "8,0", "--window-attn-skip-freq", "2", "--reset-attention-mask"])
    assert (args.cp_mask, args.cp_window, tuple(args.window_size), args.window_attn_skip_freq) == ("packed", None,
                                                                                                 (8, 0), 2)
    spec, _ = plan_specs(args, eod=0)
    assert (spec.name, spec.layer_window) == ("packed", 8)


def test_window_size_semantics_equal_megatrons():
    """Transformer Engine's ``window_size=(L, 0)`` lets query i see keys i-L..i; the mapped mask keeps exactly those."""
    from megatron_cp.megatron.batch import MaskSpec, build_mask

    args = _validate(["--window-size", "5,0", "--reset-attention-mask"])
    cu = np.array([0, 20, 32], dtype=np.int64)  # two documents
    got = build_mask(MaskSpec(args.cp_mask, window=args.cp_window, eod=0), cu, 1, 32).to_dense()
    i, j = np.meshgrid(np.arange(32), np.arange(32), indexing="ij")
    doc = np.searchsorted(cu, np.arange(32), side="right")
    want = (j <= i) & (j >= i - 5) & (doc[i] == doc[j])
    assert np.array_equal(np.asarray(got, dtype=bool), want)


def test_wrap_parse_raises_before_returning_args():
    """``wrap_parse`` (what ``install_into`` puts in pretrain_gpt.py) runs the checks right after Megatron's parser."""
    from megatron_cp.megatron import plugin

    seen = []

    def megatron_parse(extra_args_provider=None, **kw):  # stands for parse_and_validate_args (parser only)
        from megatron.training.arguments import parse_args

        saved = sys.argv
        try:
            sys.argv = ["pretrain_gpt.py"] + BASE + NO_DROPOUT + ["--cp-solver", "zigzagg"]
            args = parse_args(extra_args_provider)
        finally:
            sys.argv = saved
        seen.append(args)
        return args

    with pytest.raises(ValueError, match="--cp-solver 'zigzagg'"):
        plugin.wrap_parse(megatron_parse)()
    assert len(seen) == 1 and seen[0].cp_solver == "zigzagg"


@pytest.mark.parametrize("eod,flags,error", [
    (None, [], "tokenizer has none; pass --cp-eod-token"),
    ("raise", [], "the tokenizer gives none .*pass --cp-eod-token"),
    (7, [], None),
    (None, ["--cp-eod-token", "3"], None),
    (None, ["--cp-eod-token", "320"], r"--cp-eod-token 320 is outside the tokenizer's vocabulary \(ids 0 \.\. 319\)"),
])
def test_packed_mask_needs_an_eod_at_parse_time(monkeypatch, eod, flags, error):
    """After Megatron's parser has built the tokenizer, ``wrap_parse`` checks a packed mask has an EOD id."""
    import megatron.training

    from megatron_cp.megatron import plugin

    class Tokenizer:
        vocab_size = 320

        @property
        def eod(self):
            if eod == "raise":
                raise NotImplementedError("no eod")
            return eod

    monkeypatch.setattr(megatron.training, "get_tokenizer", lambda: Tokenizer())
    parse = plugin.wrap_parse(lambda extra_args_provider=None, **kw: _parse(["--reset-attention-mask", *flags]))
    if error is None:
        assert parse().cp_mask == "packed"
    else:
        with pytest.raises(ValueError, match=error):
            parse()


def test_help_prints_with_megatrons_own_flags():
    """``pretrain_gpt.py --help`` with our flags: megatron-core 0.19.2 has a help string with a bare ``%``
    (``--moe-paged-stash-buffer-size-factor-cuda``: "10%)."), on which argparse's --help raised."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from megatron_cp.megatron.arguments import add_megatron_cp_args

    text = add_megatron_cp_args(add_megatron_arguments(argparse.ArgumentParser())).format_help()
    assert "--context-parallel-impl" in text and "--cp-moba-top-k" in text
    if "--moe-paged-stash-buffer-size-factor-cuda" in text:
        assert "10%)" in " ".join(text.split())


@pytest.mark.parametrize("cuda", [True, False])
def test_parsing_starts_the_planning_helpers_on_a_gpu(monkeypatch, cuda):
    """On a GPU machine ``wrap_parse`` starts two planning helpers once the flags check out (their imports take
    seconds: they run while the model is built, not in the first micro-batches' plans); on the CPU none."""
    import megatron.training

    from megatron_cp.megatron import plugin

    class Tokenizer:
        vocab_size, eod = 320, 7

    started = []
    monkeypatch.setattr(megatron.training, "get_tokenizer", lambda: Tokenizer())
    monkeypatch.setattr(plugin, "start_planning_helpers", started.append)
    parse = plugin.wrap_parse(lambda extra_args_provider=None, **kw: _parse(["--reset-attention-mask"]))
    with monkeypatch.context() as m:
        m.setattr(plugin.torch.cuda, "is_available", lambda: cuda)
        args = parse()
    assert args.context_parallel_impl == "megatron_cp" and started == ([2] if cuda else [])
