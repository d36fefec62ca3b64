"""What :meth:`kvlab.gpt2.GPT2.forward` checks at its entry, before any work (chapter 3): the cache
fits the model and the batch, and explicit positions are a valid continuation of what it holds."""

from __future__ import annotations

import torch

from .cache import EMPTY
from .pastlen import PastLenCache
from .validate import check_context


def check_forward(model, input_ids, cache, positions) -> None:
    """Bad input to :meth:`GPT2.forward`, refused before any work with an error naming the fix.
    Positions the cache computes itself (``positions=None``) are checked against its length only:
    no value is read back from the device on a decode step."""
    bound = None if cache is None else check_cache_for(model, cache, input_ids.shape[0])
    _check_positions(model, input_ids, cache, positions)
    if bound is not None:
        cache._checked_model = bound      # only once every check passed: a failed call leaves nothing


def _check_positions(model, input_ids, cache, positions) -> None:
    B, T = input_ids.shape
    limit = model.config.n_positions
    if positions is None:
        if cache is not None:
            cache.check_room(T, limit)
        else:
            check_context(T, limit, "the input's tokens", "shorten the prompt or generate less")
        return
    if not isinstance(positions, torch.Tensor) or positions.shape != (B, T) or positions.dtype != torch.long:
        got = list(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"positions must be a LongTensor [batch, T] = {[B, T]} like input_ids, got {got}")
    if T:
        check_context(int(positions.max()) + 1, limit, f"position {int(positions.max())} + 1",
                      "shorten the prompt or generate less")
    if T and int(positions.min()) < EMPTY:
        raise ValueError(f"positions must be >= 0 (or EMPTY = {EMPTY} for a pad), got {int(positions.min())}")
    before = positions.cummax(dim=1).values[:, :-1]         # the largest position so far in the row
    later = positions[:, 1:]
    if T > 1 and bool(((later == EMPTY) & (before != EMPTY)).any()):
        raise ValueError("a pad (EMPTY) follows a real token: pad on the left, pads first in every row")
    if T > 1 and bool(((later != EMPTY) & (later <= before)).any()):
        raise ValueError("positions run backwards (or repeat) within a row: each row's real tokens must have "
                         "increasing positions")
    if cache is not None:
        check_after_cache(cache, positions, limit)


def check_cache_for(model, cache, B):
    """The cache must fit the model and the batch. The cache remembers what it was last checked
    against (the model's layers, heads, head size, dtype and device): every use by a model that
    differs in any of them is checked again, whatever happened in between (a reset included).
    Returns what to remember once the whole call is checked (None: nothing new)."""
    bound = None
    if not isinstance(cache, PastLenCache):
        p, cfg = model.ln_f.weight, model.config     # the compute dtype (int8 weights compute in it too)
        bound = (cfg.n_layer, cfg.n_head, cfg.n_embd, p.dtype, p.device)
        if getattr(cache, "_checked_model", None) == bound:
            bound = None
        else:
            cache.check_model(cfg, p.dtype, p.device)
    rows = cache.batch_size
    if rows is not None and rows != B:
        raise ValueError(f"the cache holds {rows} row(s) but the batch has {B}: one cache row per prompt "
                         f"(build it with model.new_cache({B}), or reset and reuse one of that size)")
    return bound


def check_after_cache(cache, positions, limit) -> None:
    """Explicit positions must come after every position the cache holds in that row."""
    last = cache.last_positions()
    if last is None or last.shape[0] != positions.shape[0]:
        return
    first = positions.masked_fill(positions == EMPTY, limit).amin(dim=1)
    if bool((first <= last).any()):
        row = int((first <= last).nonzero()[0])
        raise ValueError(f"row {row}: position {int(first[row])} is not after position {int(last[row])} that the "
                         "cache already holds (positions run backwards): rewind the cache first, or reset it "
                         "for a new prompt")
