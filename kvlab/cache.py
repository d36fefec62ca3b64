"""KV caches for the hand-built GPT-2 (chapter 3 onwards), all behind one small interface.

The model never changes; only the cache does. Like transformers' ``cache_utils``, a cache is an object
the model hands each layer's new keys and values to, with the positions of the new tokens, and gets
back every key and value the queries may need, and the position of each of them::

    keys, values, key_pos = cache.update(layer, k, v, positions)
    # k, v: [batch, heads, T, head_dim] new; positions: [batch, T] (EMPTY = -1 for a pad)
    # keys, values: [batch, heads, S, head_dim]; key_pos: broadcastable to [batch, T, S]
    cache.next_positions(batch, T)      # where new tokens continue the cache: [batch, T]
    cache.seq_len                       # tokens held (slots written; the next token's position)
    cache.rewind(length)                # forget every token from slot `length` on
    cache.reset()                       # forget everything: a new prompt starts here
    cache.nbytes                        # bytes the cache really holds

What a query may see is ONE rule, :func:`visible`: a key is visible when its slot is real
(``key_pos >= 0``) and its position is not after the query's. Everything else is data the cache
returns: unfilled slots of a static buffer, a sliding window and its sinks (only the slots kept are
returned), left padding (pads are stored at position ``EMPTY``), another sequence's slots in a ragged
paged batch (``EMPTY`` for that query).

``seq_len`` advances when the *last* layer has been updated, so during a forward pass every layer
sees the same ``seq_len``. Implementations: chapter 3's ``PreallocatedCache`` (allocated once,
written in place), ``ConcatCache`` (grows with ``torch.cat``, for comparison) and
``SlidingWindowKVCache`` (an aside; keeps the first ``sinks`` and the last ``window`` tokens); the
quantized caches of chapter 5 (``kvlab.quant``), the static cache of chapter 8 (``kvlab.static``),
the paged caches of chapter 9 (``kvlab.paged_cache``).

Lab 3's form, ``update(layer, k, v) -> (keys, values)`` (no positions: the new tokens continue the
cache), is still answered by every cache here, and a learner's cache written to that contract runs
in the model through :class:`kvlab.pastlen.PastLenCache`. A cache implements :meth:`Cache.store`; ``update`` is
the one entry point and answers both forms.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from .configs import kv_dims
from .validate import check_context

#: The position of a slot no query may see: a pad, an empty slot, another sequence's slot.
EMPTY = -1


def visible(positions: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """The one attention rule of the library (chapter 3): ``[B, T, S]``, True where query ``t`` may see key ``s``.

    ``positions`` ``[B, T]``: each query's position; ``key_pos`` broadcastable to ``[B, T, S]``: each
    key slot's position as seen by that query (``EMPTY`` for a slot that is not real). A key is
    visible when it is real and not after the query. A pad query (position ``EMPTY``) is treated as
    position 0, so it sees its row's first token: its output is never read, but it must not be NaN
    (an all-hidden row would be), since its keys are computed from it at the next layer.
    """
    query = positions.clamp(min=0)[..., None]
    return (key_pos >= 0) & (key_pos <= query)


class Cache(ABC):
    """The interface every kvlab cache implements."""

    n_layer: int
    batch_size: int | None = None   # rows the cache holds (None: set by the first update)
    _len: int = 0                   # slots written in every layer (the caches that count)
    #: attributes that hold positions, not cached keys/values (a byte count skips them); each cache
    #: class lists its own
    bookkeeping: tuple[str, ...] = ()

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None):
        """Store ``k``/``v`` of ``layer``, the tokens at ``positions``; return ``(keys, values, key_pos)``
        (see :meth:`store`). Without ``positions`` (lab 3's form) the new tokens continue the cache and
        only ``(keys, values)`` come back."""
        if positions is None:
            positions = self.next_positions(k.shape[0], k.shape[2], k.device)
            return self.store(layer, k, v, positions)[:2]
        return self.store(layer, k, v, positions)

    @abstractmethod
    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """What each cache implements: keep ``k``, ``v`` ``[B, H, T, D]`` of ``layer`` (the tokens at
        ``positions [B, T]``) and return every key and value the queries may need, ``[B, H, S, D]``,
        with ``key_pos`` broadcastable to ``[B, T, S]`` (``EMPTY`` for a slot that is not real). The
        key positions are the same in every layer of a forward pass (the model makes one mask of them)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every stored token (keep the memory, if preallocated)."""

    @abstractmethod
    def rewind(self, length: int) -> None:
        """Forget every token from slot ``length`` on (speculative decoding drops rejected tokens)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of tensor storage the cache holds right now (allocated, not just used)."""

    @property
    def seq_len(self) -> int:
        """Number of slots written (equal in every layer between forward passes)."""
        return self._len

    def next_positions(self, batch: int, T: int, device=None) -> torch.Tensor:
        """Positions ``[batch, T]`` of ``T`` tokens that continue the cache: ``seq_len .. seq_len+T-1``."""
        return torch.arange(self.seq_len, self.seq_len + T, device=device).expand(batch, T)

    def check_room(self, T: int, limit: int) -> None:
        """Refuse ``T`` more tokens that would go past the model's context of ``limit`` positions."""
        check_context(self.seq_len + T, limit, f"{self.seq_len} cached + {T} new tokens",
                      "shorten the prompt or generate less")

    def last_positions(self) -> torch.Tensor | None:
        """The last position held per row, ``[B]`` (``EMPTY`` for an empty row); None if not known."""
        kp = getattr(self, "_key_pos", None)
        if kp is None or kp.shape[-1] == 0:
            return None
        return kp.amax(dim=-1)

    def check_model(self, config, dtype, device) -> None:
        """Called by the model on first use: refuse a cache built for another model (ValueError)."""
        dims = (config.n_layer, *config.cache_dims()) if hasattr(config, "cache_dims") else kv_dims(config)
        want = dict(zip(("n_layer", "n_head", "head_dim"), dims))   # what this cache must store per token
        for name, value in want.items():
            have = getattr(self, name, None)
            if have is not None and have != value:
                raise ValueError(f"the cache was built for {name}={have} but the model has {name}={value}: "
                                 "build the cache with model.new_cache(...)")
        have_dtype, have_device = getattr(self, "dtype", None), getattr(self, "device", None)
        if have_dtype is not None and have_dtype != dtype:
            raise ValueError(f"the cache holds {have_dtype} but the model computes in {dtype}: "
                             "build the cache with the model's dtype (model.new_cache does)")
        if have_device is not None and torch.device(have_device).type != torch.device(device).type:
            raise ValueError(f"the cache lives on {have_device} but the model on {device}: "
                             "build the cache on the model's device (model.new_cache does)")

    def _advance(self, layer: int, new_tokens: int) -> None:
        """Count ``new_tokens`` once the *last* layer has stored them (every layer reads one ``seq_len``)."""
        if layer == self.n_layer - 1:
            self._len += new_tokens

    def _check_rewind(self, length: int) -> None:
        if not isinstance(length, int) or not 0 <= length <= self.seq_len:
            raise ValueError(f"rewind length must be an int between 0 and the {self.seq_len} tokens held, "
                             f"got {length!r}")

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


def tensor_bytes(*tensors) -> int:
    """Bytes of the elements of ``tensors`` (``None`` entries, an empty layer, count 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def append_positions(held: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
    """The key positions of a growing cache after ``positions`` ``[B, T]`` are appended."""
    return positions.clone() if held is None else torch.cat([held, positions], dim=1)


class PreallocatedCache(Cache):
    """Chapter 3's cache: every layer's keys and values in buffers allocated once, written in place.

    One tensor holds the keys of all layers, ``[n_layer, batch, heads, max_len, head_dim]``, another
    the values, and a third the position of every slot, ``[batch, max_len]``. A forward pass over
    ``T`` new tokens writes slots ``seq_len .. seq_len+T-1`` of each layer and gets back a *view* of
    slots ``0 .. seq_len+T-1``: no copy of the past, no ``torch.cat``, no allocation per step.
    """

    bookkeeping = ("slot_pos", "_key_pos_view")

    def __init__(self, n_layer: int, batch_size: int, n_head: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self._set_sizes(n_layer, batch_size, n_head, head_dim, max_len)
        shape = (n_layer, batch_size, n_head, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.slot_pos = torch.full((batch_size, max_len), EMPTY, dtype=torch.long, device=device)
        self.dtype, self.device = dtype, self.keys.device
        self._len = 0   # slots written in every layer, i.e. where the next write starts
        self._key_pos_view = self.slot_pos[:, None, :0]

    def store(self, layer, k, v, positions):
        T = self._check_update(k, v)                   # the cache's shape, and room for T more tokens
        start, end = self._len, self._len + T
        self.keys[layer, :, :, start:end] = k          # in place: the past is never copied
        self.values[layer, :, :, start:end] = v
        if layer == 0:
            self.slot_pos[:, start:end] = positions
            self._key_pos_view = self.slot_pos[:, None, :end]   # the same for every layer of this pass
        self._advance(layer, T)                        # after the last layer: every layer has them
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end], self._key_pos_view

    @property
    def _key_pos(self):
        return self.slot_pos[:, :self._len]

    def reset(self):
        self._len = 0  # the buffers stay allocated; stale entries are simply never read again

    def rewind(self, length: int) -> None:
        """Forget every token from slot ``length`` on (a pointer move: nothing is copied)."""
        self._check_rewind(length)
        self._len = length


    @property
    def nbytes(self):
        return tensor_bytes(self.keys, self.values)


class ConcatCache(Cache):
    """Chapter 3's first cache: append each step's keys and values with ``torch.cat`` (what transformers'
    ``DynamicCache`` does). Every step allocates a new tensor one token longer and copies the whole
    past into it, so a step at position ``p`` moves ``O(p)`` bytes just to remember them."""

    bookkeeping = ("_key_pos",)

    def __init__(self, n_layer: int):
        self.n_layer = n_layer
        self.reset()

    def store(self, layer, k, v, positions):
        if layer == 0:
            self._key_pos = append_positions(self._key_pos, positions)
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)      # copies the whole past
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer], self._key_pos[:, None]

    def reset(self):
        self.keys: list[torch.Tensor | None] = [None] * self.n_layer
        self.values: list[torch.Tensor | None] = [None] * self.n_layer
        self._key_pos = None

    def rewind(self, length: int) -> None:
        self._check_rewind(length)
        self.keys = [None if t is None else t[:, :, :length] for t in self.keys]
        self.values = [None if t is None else t[:, :, :length] for t in self.values]
        self._key_pos = None if self._key_pos is None else self._key_pos[:, :length]

    @property
    def batch_size(self):
        return None if self._key_pos is None else self._key_pos.shape[0]

    @property
    def seq_len(self):
        last = self.keys[-1]   # the last layer is updated last: this advances after a whole pass
        return 0 if last is None else last.shape[2]

    @property
    def nbytes(self):
        return tensor_bytes(*self.keys, *self.values)


class SlidingWindowKVCache(Cache):
    """Keep only the first ``sinks`` and the last ``window`` tokens of every layer (an aside of chapter 3).

    Memory stays bounded, but two things change. ``seq_len`` counts every token seen, not the ones
    held, because *positions keep increasing*: the 700th token still gets position embedding 699.
    And the model no longer sees its whole context, so its output differs from full attention once
    the text is longer than the window. GPT-2 was never trained like this; here it is a way to see
    what a window costs, not a recipe (models such as Mistral are trained with one; StreamingLLM
    keeps a few first tokens, the attention *sinks*, as well).

    ``update`` returns the held tokens followed by the new ones, with their true positions, so a
    decode step attends to the tokens kept plus itself: the window is data, not a mask of its own.
    The window applies to what is *kept*, not to a chunk's own attention: a prompt longer than the
    window is prefilled with full causal attention over the whole prompt.
    """

    bookkeeping = ("_key_pos", "_pass_pos")

    def __init__(self, n_layer: int, window: int, sinks: int = 0):
        if window < 1 or sinks < 0:
            raise ValueError(f"window must be >= 1 and sinks >= 0, got window={window}, sinks={sinks}")
        self.n_layer, self.window, self.sinks = n_layer, window, sinks
        self.reset()

    def _kept(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The first ``sinks`` and the last ``window`` entries of ``x`` along ``dim`` (a copy)."""
        n = x.shape[dim]
        if n <= self.sinks + self.window:
            return x.clone()
        return torch.cat([x.narrow(dim, 0, self.sinks), x.narrow(dim, n - self.window, self.window)], dim)

    def store(self, layer, k, v, positions):
        """Chapter 3's aside: attend over held + new tokens, then keep only the sinks and the window."""
        if layer == 0:   # the positions of this pass's keys, and of what stays afterwards
            self._pass_pos = append_positions(self._key_pos, positions)
            self._key_pos = self._kept(self._pass_pos, 1)
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        # keep copies of the sinks and the window only; what falls out is forgotten for good
        self.keys[layer], self.values[layer] = self._kept(k, 2), self._kept(v, 2)
        self._advance(layer, positions.shape[1])   # positions count every token, held or dropped
        return k, v, self._pass_pos[:, None]

    def reset(self):
        self.keys: list[torch.Tensor | None] = [None] * self.n_layer
        self.values: list[torch.Tensor | None] = [None] * self.n_layer
        self._key_pos = self._pass_pos = None
        self._len = 0

    def rewind(self, length: int) -> None:
        """Forget the tokens from position ``length`` on: possible only while the window still holds
        every token it held at ``length`` (nothing dropped since), else a ValueError."""
        self._check_rewind(length)
        if self._key_pos is None or length == self._len:
            self._len = length
            return
        keep = self._key_pos[0] < length
        held = int(keep.sum())
        if held < min(length, self.sinks + self.window):
            raise ValueError(f"cannot rewind to {length}: the window has dropped tokens it held then "
                             f"(it holds {held} of them, needs {min(length, self.sinks + self.window)}); "
                             "rewind fewer tokens or use a larger window")
        self.keys = [t[:, :, keep] for t in self.keys]
        self.values = [t[:, :, keep] for t in self.values]
        self._key_pos, self._len = self._key_pos[:, keep], length

    @property
    def batch_size(self):
        return None if self._key_pos is None else self._key_pos.shape[0]

    @property
    def nbytes(self):
        return tensor_bytes(*self.keys, *self.values)


