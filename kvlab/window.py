"""A sliding window with attention sinks, applied to every query (chapter 11).

Chapter 3's :class:`kvlab.cache.SlidingWindowKVCache` windows what it *keeps*: a decode step sees the
last ``window`` tokens before it, but a chunk of several tokens (a prefill, drafted tokens being
verified) sees the whole chunk. :class:`SinkWindowKVCache` windows what each *query* sees, the way a
model trained with a window (Mistral, Gemma 2's local layers) attends, plus StreamingLLM's sinks:

    the query at position p sees the keys at positions  0 .. sinks-1   (the sinks)
                                               and  p-window+1 .. p    (its window, itself included)

Between passes the cache keeps the sinks and the last ``window - 1`` tokens: exactly what the next
query needs. A chunk of ``k`` tokens needs more: its first query reaches ``window - 1`` tokens back,
its last one is ``k - 1`` tokens later, so the pass attends over ``sinks + window - 1 + k`` keys and
each query's own window is marked in the key positions the cache returns (``EMPTY`` where that query
must not look): the model's one rule, :func:`kvlab.cache.visible`, does the rest.

GPT-2's positions are learned and absolute: a key carries its position from the input embedding, in
every layer, so unlike a rotary model (StreamingLLM re-numbers the positions inside its cache) the
positions here are the tokens' true ones, and the text still ends at ``n_positions``.
"""

from __future__ import annotations

import torch

from .cache import EMPTY, Cache, append_positions, tensor_bytes


def window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """True where a key (``key_pos`` ``[B, S]``) is in the sinks or in the window of a query
    (``query_pos`` ``[B, T]``): ``[B, T, S]``. Keys after the query are left to :func:`visible`."""
    k, q = key_pos[:, None, :], query_pos[:, :, None]
    return (k >= 0) & ((k < sinks) | (k > q - window))


def needed(length: int, window: int, sinks: int) -> range:
    """Positions the token at ``length`` needs from the past, besides the sinks ``0 .. sinks-1``."""
    return range(max(sinks, length - window + 1), length)


class SinkWindowKVCache(Cache):
    """Keeps the first ``sinks`` tokens and the last ``window - 1`` of every layer; each query sees the
    sinks and the ``window`` positions ending at its own (``sinks=0``: a plain sliding window).

    ``seq_len`` counts every token seen (the next position), not the ones held. Every row of a batch
    must have the same positions (the cache keeps the same slots for all rows; no left padding).
    ``context``, if given, is refused when ``sinks + window`` exceeds it (checked again against the
    model on first use).
    """

    bookkeeping = ("_key_pos", "_pass_pos", "_keep", "_next_key_pos")   # positions, not keys or values

    def __init__(self, n_layer: int, window: int, sinks: int = 0, context: int | None = None):
        for value, what, low in ((n_layer, "n_layer", 1), (window, "window", 1), (sinks, "sinks", 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{what} must be an int >= {low}, got {value!r}")
        self.n_layer, self.window, self.sinks = n_layer, window, sinks
        if context is not None:
            self._check_context(context)
        self.reset()

    @classmethod
    def for_model(cls, model, window: int, sinks: int = 0) -> "SinkWindowKVCache":
        """A cache for ``model`` (its layers; its context checked against ``sinks + window`` at once)."""
        return cls(model.config.n_layer, window, sinks, context=model.config.n_positions)

    def _check_context(self, context: int) -> None:
        if self.sinks + self.window > context:
            raise ValueError(f"sinks + window = {self.sinks} + {self.window} = {self.sinks + self.window} is "
                             f"larger than the model's context of {context} positions: such a window never "
                             "drops anything; use sinks + window <= the context")

    def check_model(self, config, dtype, device) -> None:
        self._check_context(config.n_positions)

    def reset(self):
        self.keys: list[torch.Tensor | None] = [None] * self.n_layer
        self.values: list[torch.Tensor | None] = [None] * self.n_layer
        self._key_pos = self._pass_pos = self._keep = None
        self._len = 0

    def _plan(self, positions: torch.Tensor) -> None:
        """At layer 0: this pass's key positions per query, and which slots stay afterwards."""
        if positions.shape[0] > 1 and not bool((positions == positions[:1]).all()):
            raise ValueError("every row of a batch must have the same positions for a SinkWindowKVCache "
                             "(it keeps the same slots for all rows): no left padding; run such rows apart")
        if bool((positions < 0).any()):
            raise ValueError("a SinkWindowKVCache takes no pads (EMPTY positions): every row starts at the same place")
        pos = append_positions(self._key_pos, positions)                        # [B, S]
        seen = window_mask(positions, pos, self.window, self.sinks)             # [B, T, S]
        self._pass_pos = torch.where(seen, pos[:, None, :], EMPTY)              # out of a query's window: hidden
        last = int(positions[0, -1])
        self._keep = (pos[0] < self.sinks) | (pos[0] > last + 1 - self.window)  # what the next token needs
        self._next_key_pos = pos[:, self._keep]

    def store(self, layer, k, v, positions):
        if layer == 0:
            self._plan(positions)
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k[:, :, self._keep], v[:, :, self._keep]   # copies: the rest is gone
        if layer == self.n_layer - 1:
            self._key_pos = self._next_key_pos
        self._advance(layer, positions.shape[1])
        return k, v, self._pass_pos

    def rewind(self, length: int) -> None:
        """Forget the tokens from position ``length`` on. Possible only while every token the next one
        (at ``length``) needs is still held; a ValueError names the evicted ones otherwise."""
        self._check_rewind(length)
        if self._key_pos is None or length == self._len:
            self._len = length
            return
        held = set(self._key_pos[0].tolist())
        want = [p for p in [*range(min(self.sinks, length)), *needed(length, self.window, self.sinks)]
                if p not in held]
        if want:
            raise ValueError(f"cannot rewind to {length}: positions {want[0]}..{want[-1]} that the token at "
                             f"{length} needs were evicted from the window (it holds the sinks and the last "
                             f"{self.window - 1}); rewind fewer tokens, or use a larger window")
        pos = self._key_pos[0]
        keep = (pos < length) & ((pos < self.sinks) | (pos > length - self.window))
        self.keys = [t[:, :, keep] for t in self.keys]
        self.values = [t[:, :, keep] for t in self.values]
        self._key_pos, self._len = self._key_pos[:, keep], length

    @property
    def batch_size(self):
        return None if self._key_pos is None else self._key_pos.shape[0]

    @property
    def held(self) -> int:
        """Tokens held per row and layer right now."""
        return 0 if self._key_pos is None else self._key_pos.shape[1]

    @property
    def nbytes(self):
        return tensor_bytes(*self.keys, *self.values)
