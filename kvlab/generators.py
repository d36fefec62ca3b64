"""The book's greedy generators under one name each, built for one prompt: the roster every comparison
(chapters 3, 7 and 8, ``kvlab.bench``, ``kvlab.report``) times.

Each entry of :func:`roster` is a function of no arguments returning the token ids ``[1, T + n]``;
every one of them must give transformers' tokens (``kvlab.harness.same_tokens``) before it is timed.
``EAGER_OF`` pairs each compiled generator with the eager one it replaces (chapter 8's break-even).
"""

from __future__ import annotations

from . import gpt2, reference
from .static import StaticDecoder

TRANSFORMERS = "transformers generate"                                # DynamicCache
CACHED_LOOP = "kvlab cached_generate"                                 # chapter 2's loop, DynamicCache
HAND_BUILT = "hand-built GPT-2"                                       # chapter 3, preallocated cache
NAIVE = "naive (no cache)"                                            # chapter 1
TRANSFORMERS_COMPILED = "transformers generate, static cache, compiled"
HAND_BUILT_COMPILED = "hand-built GPT-2, static cache, compiled"      # chapter 8 (matvec="auto")
HAND_BUILT_COMPILED_BLAS = "hand-built GPT-2, static cache, compiled, library products"   # matvec="blas"

EAGER = (TRANSFORMERS, CACHED_LOOP, HAND_BUILT)
COMPILED = (TRANSFORMERS_COMPILED, HAND_BUILT_COMPILED, HAND_BUILT_COMPILED_BLAS)
EAGER_OF = {TRANSFORMERS_COMPILED: TRANSFORMERS, HAND_BUILT_COMPILED: HAND_BUILT, HAND_BUILT_COMPILED_BLAS: HAND_BUILT}


def roster(hf, ours, prompt, new_tokens: int, names=EAGER, compile_backend: str = "inductor"):
    """``{name: fn}`` for the generators ``names`` (in that order) on ``prompt``; the compiled ones are
    built (not yet compiled: their first call compiles). Also returns the hand-built compiled
    generators' :class:`kvlab.static.StaticDecoder` s ``{name: decoder}`` (those asked for), which a
    profile reuses. ``HAND_BUILT_COMPILED`` lets the decoder choose its products (``matvec="auto"``:
    reductions on a CPU at batch 1), ``HAND_BUILT_COMPILED_BLAS`` keeps them library calls."""
    dec = blas = None
    if HAND_BUILT_COMPILED in names:
        dec = StaticDecoder(ours, max_len=prompt.shape[1] + new_tokens).compile(backend=compile_backend)
    if HAND_BUILT_COMPILED_BLAS in names:
        blas = StaticDecoder(ours, max_len=prompt.shape[1] + new_tokens).compile(backend=compile_backend,
                                                                                 matvec="blas")
    config = reference.hf_compile_config(prompt.device) if TRANSFORMERS_COMPILED in names else None
    every = {
        TRANSFORMERS: lambda: reference.hf_greedy(hf, prompt, new_tokens),
        CACHED_LOOP: lambda: reference.cached_generate(hf, prompt, new_tokens),
        HAND_BUILT: lambda: gpt2.generate(ours, prompt, new_tokens),
        NAIVE: lambda: reference.naive_generate(hf, prompt, new_tokens),
        TRANSFORMERS_COMPILED: lambda: reference.hf_static_generate(hf, prompt, new_tokens, config),
        HAND_BUILT_COMPILED: lambda: dec.generate(prompt, new_tokens),
        HAND_BUILT_COMPILED_BLAS: lambda: blas.generate(prompt, new_tokens),
    }
    unknown = [n for n in names if n not in every]
    if unknown:
        raise ValueError(f"unknown generator(s) {unknown}; the roster is {list(every)}")
    decoders = {n: d for n, d in ((HAND_BUILT_COMPILED, dec), (HAND_BUILT_COMPILED_BLAS, blas)) if d is not None}
    return {n: every[n] for n in names}, decoders
