"""KV caches for the hand-built GPT-2 (chapter 3 onwards), all behind one small interface.

Like transformers' ``cache_utils``, a cache is an object the model hands each layer's new keys and
values to, and gets back every key and value so far::

    keys, values = cache.update(layer, k, v)   # k, v: [batch, heads, new_tokens, head_dim]
    cache.seq_len                              # tokens held (the next token's position)
    cache.reset()                              # forget everything: a new prompt starts here
    cache.nbytes                               # bytes the cache really holds

``seq_len`` advances when the *last* layer has been updated, so during a forward pass every layer
sees the same ``seq_len`` (the position offset of the new tokens). Implementations: chapter 3's
``PreallocatedCache`` (allocated once, written in place), ``ConcatCache`` (grows with ``torch.cat``,
for comparison) and ``SlidingWindowCache`` (an aside); the quantized cache of chapter 5 (``kvlab.quant``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Cache(ABC):
    """The interface every kvlab cache implements."""

    n_layer: int
    _len: int = 0   # tokens stored in every layer (the caches that count rather than measure)

    @abstractmethod
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` of ``layer`` after what it holds; return all keys and values of that layer."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every stored token (keep the memory, if preallocated)."""

    @property
    def seq_len(self) -> int:
        """Number of tokens stored (equal in every layer between forward passes)."""
        return self._len

    def _advance(self, layer: int, new_tokens: int) -> None:
        """Count ``new_tokens`` once the *last* layer has stored them: during a forward pass every
        layer must read the same ``seq_len`` (the position offset of the new tokens)."""
        if layer == self.n_layer - 1:
            self._len += new_tokens

    def _set_sizes(self, n_layer: int, batch_size: int, n_head: int, head_dim: int, max_len: int) -> None:
        """For caches sized up front: check and keep the five sizes their buffers are made of."""
        if min(n_layer, batch_size, n_head, head_dim, max_len) < 1:
            raise ValueError("n_layer, batch_size, n_head, head_dim and max_len must all be >= 1")
        self.n_layer, self.batch_size, self.n_head, self.head_dim, self.max_len = (
            n_layer, batch_size, n_head, head_dim, max_len)

    def _check_update(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """For caches sized up front (``batch_size``, ``n_head``, ``head_dim``, ``max_len``): refuse keys
        and values of another shape, or more tokens than fit; return the number of new tokens."""
        B, H, T, D = k.shape
        if (B, H, D) != (self.batch_size, self.n_head, self.head_dim) or v.shape != k.shape:
            raise ValueError(
                f"cache holds [batch={self.batch_size}, heads={self.n_head}, seq, head_dim={self.head_dim}] "
                f"but got keys {list(k.shape)} and values {list(v.shape)}")
        if self._len + T > self.max_len:
            raise ValueError(
                f"cannot store {T} more token(s) after the {self._len} already cached: that is "
                f"{self._len + T} tokens, past the cache's max_len of {self.max_len}. GPT-2's context "
                "(n_positions) is the real limit: it has no position embedding beyond it, so shorten the "
                "prompt or generate less")
        return T

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of tensor storage the cache holds right now (allocated, not just used)."""


def tensor_bytes(*tensors) -> int:
    """Bytes of the elements of ``tensors`` (``None`` entries, an empty layer, count 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class PreallocatedCache(Cache):
    """Chapter 3's cache: every layer's keys and values in buffers allocated once, written in place.

    One tensor holds the keys of all layers, ``[n_layer, batch, heads, max_len, head_dim]``, another
    the values. A forward pass over ``T`` new tokens writes positions ``seq_len .. seq_len+T-1`` of
    each layer and gets back a *view* of positions ``0 .. seq_len+T-1``: no copy of the past, no
    ``torch.cat``, no allocation per step.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self._set_sizes(n_layer, batch_size, n_head, head_dim, max_len)
        shape = (n_layer, batch_size, n_head, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._len = 0   # tokens stored in every layer, i.e. where the next write starts

    def update(self, layer, k, v):
        T = self._check_update(k, v)                   # the cache's shape, and room for T more tokens
        start, end = self._len, self._len + T
        self.keys[layer, :, :, start:end] = k          # in place: the past is never copied
        self.values[layer, :, :, start:end] = v
        self._advance(layer, T)                        # after the last layer: every layer has them
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def reset(self):
        self._len = 0  # the buffers stay allocated; stale entries are simply never read again

    def truncate(self, length: int) -> None:
        """Forget every token from position ``length`` on (a pointer move: nothing is copied)."""
        if not 0 <= length <= self._len:
            raise ValueError(f"length must be between 0 and the {self._len} tokens held, got {length}")
        self._len = length

    @property
    def nbytes(self):
        return tensor_bytes(self.keys, self.values)


class ConcatCache(Cache):
    """Chapter 3's first cache: append each step's keys and values with ``torch.cat`` (what transformers'
    ``DynamicCache`` does). Every step allocates a new tensor one token longer and copies the whole
    past into it, so a step at position ``p`` moves ``O(p)`` bytes just to remember them."""

    def __init__(self, n_layer: int):
        self.n_layer = n_layer
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer

    def update(self, layer, k, v):
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)      # copies the whole past
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]

    def reset(self):
        self.keys = [None] * self.n_layer
        self.values = [None] * self.n_layer

    @property
    def seq_len(self):
        last = self.keys[-1]   # the last layer is updated last: this advances after a whole pass
        return 0 if last is None else last.shape[2]

    @property
    def nbytes(self):
        return tensor_bytes(*self.keys, *self.values)


class SlidingWindowCache(Cache):
    """Keep only the last ``window`` tokens of every layer (an aside of chapter 3).

    Memory stays bounded, but two things change. ``seq_len`` counts every token seen, not the ones
    held, because *positions keep increasing*: the 700th token still gets position embedding 699.
    And the model no longer sees its whole context, so its output differs from full attention once
    the text is longer than the window. GPT-2 was never trained like this; here it is a way to see
    what a window costs, not a recipe (models such as Mistral are trained with one).

    ``update`` returns the held tokens followed by the new ones, so a decode step attends to the
    ``window`` tokens before it plus itself. The window applies to what is *kept*, not to a chunk's
    own attention: a prompt longer than the window is prefilled with full causal attention over the
    whole prompt, and only its last ``window`` tokens are kept for the decode steps. The model takes
    ``past_len`` from the keys it gets back.
    """

    def __init__(self, n_layer: int, window: int):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.n_layer, self.window = n_layer, window
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer
        self._len = 0   # every token seen, held or dropped

    def update(self, layer, k, v):
        """Chapter 3's aside: append, attend over held + new tokens, keep only the last ``window``."""
        new = k.shape[2]
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        # keep a copy of the last `window` tokens only; what falls out is forgotten for good
        self.keys[layer] = k[:, :, -self.window:].clone()
        self.values[layer] = v[:, :, -self.window:].clone()
        self._advance(layer, new)   # positions count every token, held or dropped
        return k, v

    def reset(self):
        self.keys = [None] * self.n_layer
        self.values = [None] * self.n_layer
        self._len = 0

    @property
    def nbytes(self):
        return tensor_bytes(*self.keys, *self.values)
