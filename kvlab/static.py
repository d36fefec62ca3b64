"""A static KV cache and a compiled decode step for the hand-built GPT-2 (chapter 8).

Chapter 3's cache returns a view that grows by one position per step, and the position of the new
token is a Python int. Both are poison for ``torch.compile``: a new shape or a new constant every
step means a new graph (or a guard that fails) every step. Production engines fix both:

* the cache is a buffer of ``max_len`` positions per layer, written *in place* at a position held in
  a 0-d ``torch.long`` tensor, and ``update`` always returns the *whole* buffer (same shape, same
  storage, every step);
* attention runs over all ``max_len`` key slots, with a mask that hides every slot after the query's
  own position (slots not yet written hold zeros or a previous prompt's keys: both must be hidden);
* one decode step, ``(token ids [B, 1], position tensor) -> next token ids [B]``, is then the same
  computation on the same shapes every time: compiled once, replayed for every token. On a GPU,
  ``mode="reduce-overhead"`` records it as a CUDA graph, so a step is one launch instead of hundreds.

    dec = StaticDecoder(model, max_len=256)                 # model: kvlab.gpt2.GPT2
    dec.compile()                                           # torch.compile of the decode step
    out = dec.generate(prompt_ids, 100)                     # == kvlab.gpt2.generate(model, ...)
"""

from __future__ import annotations

import copy
import math
from typing import Callable

import torch
import torch.nn.functional as F

from .cache import EMPTY, Cache
from .matvec import as_reductions
from .validate import check_inputs, check_max_len


class StaticKVCache(Cache):
    """Chapter 3's cache interface, with fixed shapes and a position held in a tensor (chapter 8).

    Per layer, keys and values live in buffers ``[batch, heads, max_len, head_dim]`` allocated once,
    and one more buffer holds each slot's position (``EMPTY`` until written). ``position`` is a 0-d
    long tensor, the ONLY count of the tokens held: where the next write starts, advanced in place
    after the last layer. ``update`` writes the ``T`` new tokens at slots ``position .. position+T-1``
    with ``index_copy_`` (the index is a tensor, so no Python number is ever read back from the
    device) and returns the *whole* buffers, the same tensors at every step: the slots not written
    yet hold ``EMPTY`` (or, after a rewind, positions later than any query's), so the one rule of
    :func:`kvlab.cache.visible` hides them. ``seq_len`` reads ``position`` back as an int, for code
    outside the compiled step.
    """

    bookkeeping = ("slot_pos", "position")

    def __init__(self, n_layer: int, batch_size: int, n_head: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self._set_sizes(n_layer, batch_size, n_head, head_dim, max_len)
        shape = (batch_size, n_head, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.slot_pos = torch.full((batch_size, max_len), EMPTY, dtype=torch.long, device=device)
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.dtype, self.device = dtype, self.position.device
        mark_static(self.keys + self.values + [self.slot_pos, self.position])

    def update(self, layer, k, v, positions=None):
        """Write at slots ``position ..``; return the whole buffers and every slot's position. Also
        answers lab 3's form (no positions) and lab 8's (``positions`` a 0-d tensor: the first new
        token's slot and position; returns ``(keys, values)``)."""
        if positions is not None and positions.dim() == 0:
            slots = positions + torch.arange(k.shape[2], device=k.device)
            return self._write(layer, k, v, positions, slots)[:2]
        return super().update(layer, k, v, positions)

    def store(self, layer, k, v, positions):
        return self._write(layer, k, v, self.position, positions)

    def _write(self, layer, k, v, start, positions):
        """Chapter 8: write the ``T`` new tokens at slots ``start ..`` (``start`` a 0-d tensor), record
        their positions, advance ``position`` after the last layer; return the whole buffers."""
        T = k.shape[2]
        if k.shape[:2] != (self.batch_size, self.n_head) or k.shape[3] != self.head_dim or v.shape != k.shape:
            raise ValueError(
                f"cache holds [batch={self.batch_size}, heads={self.n_head}, max_len, "
                f"head_dim={self.head_dim}] but got keys {list(k.shape)} and values {list(v.shape)}")
        if T > self.max_len:
            raise ValueError(f"{T} new tokens do not fit a cache of max_len={self.max_len}")
        # Where the new tokens go, as a tensor: reading the position back as an int would break the
        # graph. A write past max_len is refused by index_copy_ before it writes anything; eagerly we
        # say so in the cache's terms (the compiled decoder checks the whole run's length up front).
        slots = start + torch.arange(T, device=k.device)
        if torch.compiler.is_compiling():
            self.keys[layer].index_copy_(2, slots, k)
        else:
            try:
                self.keys[layer].index_copy_(2, slots, k)
            except IndexError:
                raise ValueError(f"cannot write {T} token(s) at slot {int(start)}: past the static cache's "
                                 f"max_len of {self.max_len}; make the cache with a larger max_len or "
                                 "reset() it") from None
        self.values[layer].index_copy_(2, slots, v)
        if layer == 0:
            self.slot_pos.index_copy_(1, slots, positions.expand(self.batch_size, T))
        if layer == self.n_layer - 1:
            self.position.copy_(start + T)
        return self.keys[layer], self.values[layer], self.slot_pos[:, None]

    def next_positions(self, batch, T, device=None):
        """``position .. position+T-1`` as a tensor (no read back: this runs inside the compiled step)."""
        return (self.position + torch.arange(T, device=self.position.device)).expand(batch, T)

    def check_room(self, T: int, limit: int) -> None:
        """Nothing read back here (that would be a sync per step): :class:`StaticDecoder` checks the budget."""

    def last_positions(self):
        return self.slot_pos[:, :self.seq_len].amax(dim=1) if self.seq_len else None

    def reset(self):
        # In place: a compiled step (and a CUDA graph) holds these very buffers. Zeroing the keys is
        # not needed for correctness (the positions hide stale slots) but makes "empty" mean empty.
        for t in self.keys + self.values:
            t.zero_()
        self.slot_pos.fill_(EMPTY)
        self.position.zero_()

    def rewind(self, length: int) -> None:
        """Forget every token from slot ``length`` on: the next write goes there, and the slots after
        it are marked ``EMPTY`` again (in place: a compiled step holds these buffers)."""
        self._check_rewind(length)
        self.slot_pos[:, length:] = EMPTY
        self.position.fill_(length)

    @property
    def seq_len(self):
        return int(self.position)

    @property
    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def mark_static(tensors) -> None:
    """Tell ``torch.compile`` these tensors keep their address (CUDA graphs then write into them in
    place rather than refusing a step that mutates an input). Only needed, and only done, on CUDA."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            torch._dynamo.mark_static_address(t)


def static_attention(q, k, v, pos):
    """Attention of ``T`` new queries over a static cache's full buffers (lab 8's contract).

    ``q``: ``[B, H, T, D]``; ``k``, ``v``: ``[B, H, max_len, D]``; ``pos``: 0-d long tensor, the
    position of the first query. Query ``i`` sits at ``pos + i`` and may see key slots
    ``0 .. pos + i``; every later slot is hidden, whether it holds an old key, zeros or a newer one.
    """
    T, S = q.shape[-2], k.shape[-2]
    query_pos = pos + torch.arange(T, device=q.device)[:, None]           # [T, 1], a tensor
    allowed = torch.arange(S, device=q.device)[None, :] <= query_pos      # [T, S]: True = may attend
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def static_attention_explicit(q, k, v, pos):
    """:func:`static_attention` written out (scores, mask, softmax), for reading and for checks."""
    T, S = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])              # [B, H, T, max_len]
    query_pos = pos + torch.arange(T, device=q.device)[:, None]
    hidden = torch.arange(S, device=q.device)[None, :] > query_pos
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ v


# ---------------------------------------------------------------------------------------------------
# Lab 8's contract in the one forward


class Lab8Cache(Cache):
    """A learner's lab-8 cache, ``update(layer, k, v, pos) -> (keys, values)`` (the full buffers, written
    at slots ``pos .. pos+T-1``, ``pos`` a 0-d tensor), in the one interface. The adapter owns the one
    position counter (a 0-d tensor, like :class:`StaticKVCache`); slot ``j`` holds position ``j``."""

    bookkeeping = ("slot_pos", "position")

    def __init__(self, inner, n_layer: int, max_len: int, device):
        self.inner, self.n_layer, self.max_len = inner, n_layer, max_len
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.slot_pos = torch.arange(max_len, device=device)[None, None]   # [1, 1, max_len]
        mark_static([self.position, self.slot_pos])

    def store(self, layer, k, v, positions):
        keys, values = self.inner.update(layer, k, v, self.position)
        if layer == self.n_layer - 1:
            self.position.add_(k.shape[2])
        return keys, values, self.slot_pos

    next_positions = StaticKVCache.next_positions
    check_room = StaticKVCache.check_room

    def reset(self):
        self.inner.reset()
        self.position.zero_()

    def rewind(self, length):
        self._check_rewind(length)
        self.position.fill_(length)

    seq_len = StaticKVCache.seq_len

    @property
    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in _tensors_of(self.inner))


class Lab8Attention:
    """A learner's ``static_attention(q, k, v, pos)`` in the one forward. With :class:`Lab8Cache`'s
    positions (slot ``j`` at position ``j``), the first query's position is the number of slots it may
    see, minus one: read from the mask as a tensor, so nothing leaves the graph."""

    takes_mask = True

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, q, k, v, mask):
        return self.fn(q, k, v, mask[0, 0, 0].sum() - 1)


class StaticDecoder:
    """Greedy generation for the hand-built GPT-2 with a static cache and one (compiled) decode step.

    The prompt (prefill) runs eagerly: its length varies between prompts, and compiling it would
    mean a graph per prompt length. Every decode step is ``model(ids [B, 1], cache)``, the model's one
    forward, with the same shapes, and the position comes from the cache's 0-d tensor: :meth:`compile`
    makes one graph that serves every step and every prompt. ``cache_cls`` and ``attention_fn`` take
    lab 8's contracts (a learner's pieces): ``cache_cls(n_layer, batch_size, n_head, head_dim, max_len,
    dtype, device)`` with ``update(layer, k, v, pos) -> (keys, values)`` and ``reset()``;
    ``attention_fn(q, k, v, pos)``. They run through :class:`Lab8Cache` and :class:`Lab8Attention`.
    """

    def __init__(self, model, batch_size: int = 1, max_len: int | None = None, cache_cls=None,
                 attention_fn: Callable | None = None):
        cfg, p = model.config, model.ln_f.weight   # the compute dtype and device
        self.batch_size = batch_size
        self.max_len = check_max_len(max_len, cfg.n_positions)   # 0 is an error, not "the whole context"
        sizes = (cfg.n_layer, batch_size, cfg.n_head, cfg.head_dim, self.max_len, p.dtype, p.device)
        if cache_cls is None or cache_cls is StaticKVCache:
            self.cache = StaticKVCache(*sizes)
        else:
            inner = cache_cls(*sizes)
            mark_static(list(_tensors_of(inner)))
            self.cache = Lab8Cache(inner, cfg.n_layer, self.max_len, p.device)
        self.model = model
        if attention_fn is not None:    # the same modules and weights, with the learner's attention
            self.model = copy.copy(model)
            self.model.attention_fn = Lab8Attention(attention_fn)
        self.ids = torch.zeros(batch_size, 1, dtype=torch.long, device=p.device)   # the step's input
        mark_static([self.ids])
        self.step_model = self.model     # what the decode step runs (compile may give it reductions)
        self.step = self._step
        self.compiled = False
        self.cuda_graphs = False
        self.matvec = "blas"

    def _step(self, ids):
        """One decode step (chapter 8): ids ``[B, 1]`` at the cache's position -> the greedy next ids
        ``[B]``, through the model's one forward."""
        return self.step_model(ids, self.cache, last_only=True)[:, -1].argmax(dim=-1)

    def compile(self, backend="inductor", mode: str | None = None, fullgraph: bool = True,
                matvec: str = "auto", **kwargs):
        """``torch.compile`` the decode step (``dynamic=False``: every step has the same shapes).

        ``mode=None`` picks ``"reduce-overhead"`` on CUDA (CUDA graphs) and ``"default"`` elsewhere
        (on a CPU, inductor generates C++/OpenMP kernels; there are no graphs to replay).
        ``matvec``: ``"blas"`` keeps every product a library call; ``"reduction"`` writes batch 1's
        matrix-vector products as reductions inductor compiles itself (:mod:`kvlab.matvec`);
        ``"auto"`` picks ``"reduction"`` for inductor on a CPU at batch 1 (chapter 8 measures both).
        """
        on_cuda = self.ids.device.type == "cuda"
        if matvec not in ("auto", "blas", "reduction"):
            raise ValueError(f"matvec must be 'auto', 'blas' or 'reduction', got {matvec!r}")
        if matvec == "auto":
            matvec = "reduction" if (backend == "inductor" and not on_cuda and self.batch_size == 1) else "blas"
        if matvec == "reduction" and self.batch_size != 1:
            raise ValueError(f"matvec='reduction' is for batch 1 (it reads each matrix once per row); this "
                             f"decoder has batch_size={self.batch_size}: use matvec='blas'")
        if mode is None and backend == "inductor":
            mode = "reduce-overhead" if on_cuda else "default"
        opts = dict(backend=backend, fullgraph=fullgraph, dynamic=False, **kwargs)
        if mode is not None:
            opts["mode"] = mode
        self.matvec = matvec
        self.step_model = as_reductions(self.model) if matvec == "reduction" else self.model
        self.step = self._refusing_past_max_len(torch.compile(self._step, **opts))
        self.compiled = True
        self.cuda_graphs = mode == "reduce-overhead" and on_cuda
        return self

    def _refusing_past_max_len(self, compiled):
        """``compiled`` with its raw index error (``index_copy_`` under the eager backends, inductor's
        generated C++ "index out of bounds") turned into a ValueError that names the fix when the cache
        is full. Nothing is checked before a step (no read-back, no sync): only a failing step pays.
        On CUDA an out-of-bounds write is a device-side assert that cannot be caught; there
        :meth:`generate` checks the whole run's length up front."""
        def step(ids):
            try:
                return compiled(ids)
            except (IndexError, RuntimeError) as err:
                if "out of bounds" not in str(err) or self.cache.position.device.type == "cuda":
                    raise
                at = int(self.cache.position)
                if at < self.max_len:
                    raise
                raise ValueError(f"the compiled decode step was asked to write at position {at}, but the static "
                                 f"cache holds max_len={self.max_len} tokens (positions 0..{self.max_len - 1}): "
                                 "make the decoder with a larger max_len, or reset() or rewind() its cache "
                                 "before stepping again") from None
        return step

    def _check(self, input_ids, max_new_tokens):
        ids = check_inputs(self.model, input_ids, max_new_tokens, batched=True)
        B, T = ids.shape
        if B != self.batch_size:
            raise ValueError(f"this decoder's cache was made for batch_size={self.batch_size}, "
                             f"got {B} prompts")
        if T + max_new_tokens > self.max_len:
            raise ValueError(f"prompt {T} + {max_new_tokens} new tokens exceeds the static cache's "
                             f"max_len={self.max_len}: make the decoder with a larger max_len")
        return ids

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int) -> torch.Tensor:
        """Greedy tokens ``[B, T + max_new_tokens]``, equal to ``kvlab.gpt2.generate``'s (chapter 8)."""
        ids = self._check(input_ids, max_new_tokens)
        B, T = ids.shape
        out = torch.empty(B, T + max_new_tokens, dtype=torch.long, device=ids.device)
        out[:, :T] = ids
        if max_new_tokens == 0:
            return out
        self.cache.reset()
        nxt = self.model(ids, self.cache, last_only=True)[:, -1].argmax(dim=-1)   # prefill, eager
        for t in range(T, T + max_new_tokens):
            out[:, t] = nxt
            if t + 1 < T + max_new_tokens:
                if self.cuda_graphs:   # a new step: the graph may reuse its previous output's memory
                    torch.compiler.cudagraph_mark_step_begin()
                self.ids.copy_(nxt[:, None])            # inputs at fixed addresses: nothing to copy in
                nxt = self.step(self.ids)               # the same graph for every step
        return out


def _tensors_of(obj):
    """Every tensor an object holds directly or in a list, tuple or dict attribute (to mark them static)."""
    for value in vars(obj).values():
        items = list(value.values()) if isinstance(value, dict) else value
        items = items if isinstance(items, (list, tuple)) else [items]
        yield from (t for t in items if isinstance(t, torch.Tensor))


# ---------------------------------------------------------------------------------------------------
# transformers' way: StaticKVCache + torch.compile inside generate


