"""KV caches for the hand-built GPT-2 (chapter 3 onwards), all behind one small interface.

Like transformers' ``cache_utils``, a cache is an object the model hands each layer's new keys and
values to, and gets back every key and value so far::

    keys, values = cache.update(layer, k, v)   # k, v: [batch, heads, new_tokens, head_dim]
    cache.seq_len                              # tokens held (the next token's position)
    cache.reset()                              # forget everything: a new prompt starts here
    cache.nbytes                               # bytes the cache really holds

``seq_len`` advances when the *last* layer has been updated, so during a forward pass every layer
sees the same ``seq_len`` (the position offset of the new tokens). Implementations: the preallocated
cache (chapter 3), the quantized cache (chapter 5, ``kvlab.quant``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Cache(ABC):
    """The interface every kvlab cache implements."""

    n_layer: int

    @abstractmethod
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` of ``layer`` after what it holds; return all keys and values of that layer."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every stored token (keep the memory, if preallocated)."""

    @property
    @abstractmethod
    def seq_len(self) -> int:
        """Number of tokens stored (equal in every layer between forward passes)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of tensor storage the cache holds right now (allocated, not just used)."""
