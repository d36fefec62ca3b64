"""The measurement harness: what bench, the report and every chapter share to check and time generators.

The domain modules (``gpt2``, ``cache``, ``static``, ``paged``, ``serving``, ``quant``) compute; they print,
plot and tabulate nothing. What turns their results into evidence lives here, once:

* :func:`same_tokens` (and :func:`token_check`, which records rather than refuses): a fast wrong
  generator is not a result, so every timed generator must first give the reference's tokens;
* :func:`rewinding_step`: one decode step that rewinds its cache afterwards, so every call times the
  same step (``cache.rewind``, part of every cache's interface);
* :func:`rewind_and_regenerate`: generate, rewind, regenerate (what speculative decoding relies on).

Tables go through :func:`kvlab.tables.show`, the one table printer.
"""

from __future__ import annotations

import torch
from .gpt2 import GPT2, generate
from .reference import first_difference


def token_check(runs: dict, reference: str | None = None) -> dict:
    """Run every generator of ``runs`` (name -> fn() returning token ids) once; for each, where its
    tokens first differ from ``reference``'s (default: the first generator), None when they do not."""
    want = runs[reference or next(iter(runs))]()
    return {name: first_difference(fn(), want) for name, fn in runs.items()}


def same_tokens(runs: dict, reference: str | None = None) -> None:
    """A fast wrong generator is not a result: every generator of ``runs`` must give ``reference``'s
    tokens (default: the first one's), else a RuntimeError names the first that does not."""
    reference = reference or next(iter(runs))
    for name, at in token_check(runs, reference).items():
        if at is not None:
            raise RuntimeError(f"{name} does not reproduce {reference}'s greedy tokens (first difference at "
                               f"token {at}): not timing it")


def rewinding_step(model, cache, tokens: torch.Tensor, length: int):
    """A function that runs ONE forward of ``tokens`` ``[B, T]`` after the ``length`` tokens ``cache``
    holds and then rewinds the cache to ``length``, so every call measures the same step.

    The one "decode a step, then rewind" timer of the book: the hand-built GPT-2 with any kvlab cache
    (``rewind``), or a transformers model with its ``DynamicCache`` (``crop``). Returns the last
    position's logits."""
    ours = isinstance(model, GPT2)

    def step():
        with torch.no_grad():
            if ours:
                out = model(tokens, cache, last_only=True)
                cache.rewind(length)
                return out[:, -1]
            out = model(tokens, cache=cache, use_cache=True, logits_to_keep=1).logits
            cache.crop(-tokens.shape[1])       # back to `length` (crop takes a negative count to drop)
            return out[:, -1]
    return step


@torch.no_grad()
def rewind_and_regenerate(model, cache, input_ids: torch.Tensor, max_new_tokens: int, back: int):
    """Greedy ``max_new_tokens`` through ``cache`` (the hand-built GPT-2's ``generate``), then rewind the
    cache ``back`` tokens and decode them again. Returns ``(first, again)``, the last ``back`` new
    tokens of both passes: a cache that rewinds correctly gives the same."""

    out = generate(model, input_ids, max_new_tokens, cache=cache)
    length = cache.seq_len - back                    # the cache holds every token but the last
    cache.rewind(length)
    last, again = out[:, length:length + 1], []
    for _ in range(back):
        last = model(last, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
        again.append(last)
    return out[:, length + 1:], torch.cat(again, dim=1)
