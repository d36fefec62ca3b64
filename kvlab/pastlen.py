"""Lab 3's cache contract inside the one interface: ``update(layer, k, v) -> (keys, values)``.

A learner's cache written to that contract (no positions: the new tokens continue the cache) runs in
the model through :class:`PastLenCache`; :func:`as_cache` wraps such a cache and passes a kvlab one
through.
"""

from __future__ import annotations

import functools
import inspect

import torch

from .cache import Cache


class PastLenCache(Cache):
    """Lab 3's contract in the one forward: a learner's cache with ``update(layer, k, v) -> (keys,
    values)`` (every key so far, the new ones last), ``seq_len`` and ``reset()``.

    Such a cache says nothing about positions, so, as chapter 3 first did, they follow from what it
    returns: the ``S`` keys end with the ``T`` new tokens and sit just before them.
    """

    def __init__(self, inner):
        self.inner = inner
        self.n_layer = getattr(inner, "n_layer", None)

    def store(self, layer, k, v, positions):
        keys, values = self.inner.update(layer, k, v)
        S, T = keys.shape[2], k.shape[2]
        key_pos = positions[:, :1, None] - (S - T) + torch.arange(S, device=positions.device)
        return keys, values, key_pos                  # [B, 1, S]

    def next_positions(self, batch, T, device=None):
        start = self.inner.seq_len
        return torch.arange(start, start + T, device=device).expand(batch, T)

    def reset(self):
        self.inner.reset()

    def rewind(self, length):
        raise ValueError("a lab-3 cache has no rewind(length): use the library's PreallocatedCache")

    @property
    def seq_len(self):
        return self.inner.seq_len

    @property
    def nbytes(self):
        return self.inner.nbytes


@functools.lru_cache(maxsize=None)
def _takes_positions(update) -> bool:
    params = list(inspect.signature(update).parameters.values())
    return len(params) >= 5 or any(p.kind == p.VAR_POSITIONAL for p in params)


def as_cache(cache):
    """A cache of the one interface: kvlab's as they are; a learner's lab-3 cache (``update(layer, k, v)``,
    also a kvlab cache subclassed with that ``update``) wrapped in :class:`PastLenCache`."""
    if cache is None or isinstance(cache, PastLenCache):
        return cache
    if isinstance(cache, Cache) and _takes_positions(type(cache).update):
        return cache
    return PastLenCache(cache)
