"""GPT-2 from scratch, in the spirit of nanoGPT, with a KV cache (chapter 3).

One readable module that loads the weights of any transformers ``GPT2LMHeadModel`` (``kvlab-tiny``,
real ``gpt2``, the shape-only sizes) and reproduces its logits. What it must get right to do so:

* GPT-2 stores q, k and v as one fused projection ``c_attn`` (width ``3 * n_embd``), and its linear
  layers are ``Conv1D`` modules whose weight is ``[in, out]``, the transpose of ``nn.Linear``'s
  ``[out, in]``: loading means transposing every one of them;
* the MLP uses the tanh approximation of GELU (``gelu_new``), not the exact erf GELU;
* with a cache, the ``T`` new tokens sit at positions ``past_len .. past_len+T-1``: their position
  embeddings start at ``past_len``, and the causal mask lets the query at position ``p`` see keys
  ``0 .. p``, not ``0 .. i`` for its row index ``i``;
* the LM head is tied to the token embedding ``wte``.

The model never changes; only the cache does. :meth:`GPT2.forward` is the ONE forward pass of the
library: every cache of the book (``kvlab.cache``, ``quant``, ``static``, ``paged``) goes through it,
and what a query may see is one rule, :func:`kvlab.cache.visible`, applied to the positions the
cache returns with its keys.

    model = GPT2.from_hf(hf_model)
    logits = model(input_ids)                          # [B, T, vocab], no cache
    logits = model(input_ids, cache, positions)        # positions [B, T]; None: continue the cache
    out = generate(model, input_ids, max_new_tokens)   # greedy, preallocated cache
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .cache import EMPTY, PreallocatedCache, visible
from .pastlen import PastLenCache, as_cache
from .ragged import Segments
from .validate import check_inputs, check_max_len, check_model_input
from .forwardcheck import check_forward


@dataclass
class GPTConfig:
    vocab_size: int = 50257
    n_positions: int = 1024   # the context: GPT-2 has one position embedding per position, no more
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5

    @classmethod
    def from_hf(cls, hf_config) -> "GPTConfig":
        return cls(**{f: getattr(hf_config, f) for f in cls.__dataclass_fields__})

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def cache_dims(self) -> tuple[int, int]:
        """``(heads, head_dim)`` of what the cache stores per token and layer (chapter 11 shrinks it)."""
        return self.n_head, self.head_dim


# ---------------------------------------------------------------------------------------------------
# Attention


def attention(q, k, v, past_len: int):
    """Causal attention of ``T`` new queries over all ``S = past_len + T`` keys, written out (chapter 3).

    ``q``: ``[B, H, T, D]``; ``k``, ``v``: ``[B, H, S, D]``. Query ``i`` is the token at position
    ``past_len + i``, so it may attend to keys ``0 .. past_len + i`` (everything cached, plus the new
    tokens up to itself). Returns ``[B, H, T, D]``.
    """
    T, S = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])          # [B, H, T, S]
    query_pos = torch.arange(past_len, past_len + T, device=q.device)[:, None]
    key_pos = torch.arange(S, device=q.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))   # no peeking at the future
    return torch.softmax(scores, dim=-1) @ v


def sdpa_attention(q, k, v, past_len: int):
    """:func:`attention` through PyTorch's fused ``scaled_dot_product_attention`` (chapter 3).

    Careful with ``is_causal=True``: it aligns the mask to the *top-left* corner (query ``i`` sees
    keys ``0 .. i``), which is right only when there is no past. With ``past_len > 0`` and ``T > 1``
    we build the mask ourselves; for one new token (the decode step) every key is visible.
    """
    T, S = q.shape[-2], k.shape[-2]
    if T == 1:
        return F.scaled_dot_product_attention(q, k, v)
    if past_len == 0 and S == T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    query_pos = torch.arange(past_len, past_len + T, device=q.device)[:, None]
    mask = torch.arange(S, device=q.device)[None, :] <= query_pos       # True = may attend
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def masked_attention(q, k, v, mask):
    """The model's attention: ``q`` ``[B, H, T, D]`` over ``k``, ``v`` ``[B, H, S, D]``, where ``mask``
    is :func:`kvlab.cache.visible` as an additive bias, broadcastable to ``[B, H, T, S]``: 0 where the
    key is visible, -inf where it is hidden. (Handed a bool mask, ``scaled_dot_product_attention``
    would convert it to this in every layer; the model converts it once per forward pass.)"""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


masked_attention.takes_mask = "additive"   # other attention functions marked takes_mask get the bool mask


class PastLenAttention:
    """Lab 3's contract in the one forward: ``attention(q, k, v, past_len)`` builds its own causal mask
    from ``past_len``, which is ``S - T`` for a cache that returns every key so far (lab 3's)."""

    takes_mask = True

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, q, k, v, mask):
        return self.fn(q, k, v, k.shape[-2] - q.shape[-2])


def as_mask_attention(fn: Callable | None) -> Callable:
    """``fn`` if it takes a mask (marked ``takes_mask``), else lab 3's form wrapped in :class:`PastLenAttention`."""
    if fn is None:
        return masked_attention
    return fn if getattr(fn, "takes_mask", False) else PastLenAttention(fn)


# ---------------------------------------------------------------------------------------------------
# The model


class CausalSelfAttention(nn.Module):
    """GPT-2's attention with a KV cache (chapter 3): the new tokens' keys and values go through the
    cache, which returns every key the queries may need and its position; one rule makes the mask."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)   # q, k and v in one matmul, as GPT-2 stores them
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x, layer: int, cache, rule: "Visibility", attention_fn):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # [B, T, C] -> [B, H, T, D]: each head attends on its own slice of the width
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if cache is None:
            key_pos = rule.positions[:, None, :]   # no past: the keys are the new tokens themselves
        else:
            k, v, key_pos = cache.update(layer, k, v, rule.positions)   # every key the queries may need
        if isinstance(key_pos, Segments):   # a ragged step: each sequence's queries see its keys only
            y = key_pos.attend(q, k, v, attention_fn, rule.additive)
        else:
            y = attention_fn(q, k, v, rule.mask(key_pos))               # [B, 1, T, S]: the one rule
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Visibility:
    """The one rule (:func:`kvlab.cache.visible`) for one forward pass: the queries' positions, and the
    mask for the key positions the cache returns. Those are the same in every layer of a pass (the
    cache records a token's position once), so the mask is computed once, at the first layer."""

    def __init__(self, positions: torch.Tensor, additive: bool = False, dtype=torch.float32):
        self.positions, self.additive, self.dtype, self._mask = positions, additive, dtype, None

    def mask(self, key_pos: torch.Tensor) -> torch.Tensor:
        """``[B, 1, T, S]``: bool (True = may attend), or as an additive bias (0 / -inf) if asked."""
        if self._mask is None:
            seen = visible(self.positions, key_pos)[:, None]
            self._mask = (torch.zeros(seen.shape, dtype=self.dtype, device=seen.device)
                          .masked_fill_(~seen, float("-inf")) if self.additive else seen)
        return self._mask


class MLP(nn.Module):
    """GPT-2's feed-forward block (chapter 3), with the tanh GELU the checkpoint was trained with."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.act = nn.GELU(approximate="tanh")    # GPT-2's "gelu_new"; the exact erf GELU is a bug here
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x, layer, cache, rule, attention_fn):
        x = x + self.attn(self.ln_1(x), layer, cache, rule, attention_fn)   # pre-norm residual blocks
        return x + self.mlp(self.ln_2(x))


class TokenEmbedding(nn.Embedding):
    """GPT-2's token embedding, which is also its LM head (the two are tied): a row per token to look
    up at the input, and the whole table, transposed, to turn the last hidden state into logits.
    (Chapter 8's int8 weights replace it with :class:`kvlab.weights.Int8TokenEmbedding`.)"""

    def head(self, h):
        return h @ self.weight.T


class GPT2(nn.Module):
    """GPT-2 (the LM-head model): ONE forward pass, whatever the cache. ``attention_fn`` and
    ``cache_cls`` are pluggable, so the labs can run this model with a learner's attention and cache
    (lab 3's forms are wrapped: :class:`PastLenAttention`, :class:`kvlab.cache.PastLenCache`)."""

    def __init__(self, cfg: GPTConfig, attention_fn: Callable | None = None, cache_cls=None):
        super().__init__()
        self.config = cfg
        self.attention_fn = attention_fn
        self.cache_cls = cache_cls or PreallocatedCache
        self.wte = TokenEmbedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)

    @property
    def attention_fn(self) -> Callable:
        return self._attention_fn

    @attention_fn.setter
    def attention_fn(self, fn):
        self._attention_fn = as_mask_attention(fn)
        self._additive_mask = getattr(self._attention_fn, "takes_mask", None) == "additive"

    def forward(self, input_ids, cache=None, positions=None, last_only: bool = False, select=None):
        """Logits ``[B, T, vocab]`` for ``input_ids [B, T]`` at ``positions [B, T]`` (chapter 3).

        ``positions=None`` continues the cache (``cache.next_positions``), or counts from 0 without
        one; a position of ``kvlab.cache.EMPTY`` marks a pad, which no query sees. ``last_only``
        keeps the last column (``[B, 1, vocab]``: all that generation needs); ``select`` (a
        LongTensor of column indices) keeps those columns, e.g. each sequence's last token of a
        ragged paged batch.
        """
        if not torch.compiler.is_compiling():   # a compiled step gets a cache of the one interface
            check_model_input(self, input_ids, positions, select)
            cache = as_cache(cache)
            check_forward(self, input_ids, cache, positions)   # at the boundary, before any work
        B, T = input_ids.shape
        if positions is None:        # continue the cache (no pads): embed the positions as they are
            positions = (torch.arange(T, device=input_ids.device).expand(B, T) if cache is None
                         else cache.next_positions(B, T, input_ids.device))
            x = self.wte(input_ids) + self.wpe(positions)
        else:
            x = self.wte(input_ids) + self.wpe(positions.clamp(min=0))   # a pad is embedded at position 0
        rule = Visibility(positions, self._additive_mask, x.dtype)
        for layer, block in enumerate(self.h):
            x = block(x, layer, cache, rule, self.attention_fn)
        if select is not None:
            x = x[:, select]
        elif last_only:
            x = x[:, -1:]
        return self.wte.head(self.ln_f(x))   # the LM head is the token embedding, transposed (tied)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes and caches in: its layer norms' (with int8 weights, chapter 8,
        the weight matrices are not in it)."""
        return self.ln_f.weight.dtype

    def new_cache(self, batch_size: int = 1, max_len: int | None = None, dtype=None, device=None):
        """An empty cache for this model (``cache_cls``, a :class:`PreallocatedCache` by default);
        ``max_len`` defaults to the whole context, ``n_positions``."""
        cfg, p = self.config, self.ln_f.weight
        return self.cache_cls(cfg.n_layer, batch_size, *cfg.cache_dims(),
                              check_max_len(max_len, cfg.n_positions), dtype or p.dtype, device or p.device)

    @classmethod
    @torch.no_grad()
    def from_hf(cls, hf_model, attention_fn: Callable | None = None, cache_cls=None) -> "GPT2":
        """Copy the weights of a transformers ``GPT2LMHeadModel`` (same dtype and device; chapter 3).
        Every shape is checked before it is copied; a mismatch names the weight and both shapes."""
        cfg = GPTConfig.from_hf(hf_model.config)
        p = next(hf_model.parameters())
        model = cls(cfg, attention_fn, cache_cls).to(device=p.device, dtype=p.dtype)
        sd = hf_model.state_dict()
        # Conv1D layers store their weight as [in, out]; nn.Linear wants [out, in]
        conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        for name, param in model.named_parameters():
            key = "transformer." + name
            if key not in sd:
                raise ValueError(f"the checkpoint has no weight {key!r}: is it a GPT2LMHeadModel?")
            src = sd[key].t() if name.endswith(conv1d) else sd[key]
            if src.shape != param.shape:
                raise ValueError(f"weight {key!r}: the checkpoint's is {list(sd[key].shape)}"
                                 f"{' (transposed: ' + str(list(src.shape)) + ')' if name.endswith(conv1d) else ''}"
                                 f", the model expects {list(param.shape)}")
            param.copy_(src)
        model.kvlab_name = getattr(hf_model, "kvlab_name", "custom")
        model.kvlab_kind = getattr(hf_model, "kvlab_kind", "?")
        return model.eval()


# ---------------------------------------------------------------------------------------------------
# Greedy generation


@torch.no_grad()
def generate(model: GPT2, input_ids, max_new_tokens: int, cache=None) -> torch.Tensor:
    """Greedy decoding with a cache (chapter 3): prefill the prompt once, then one token per step.

    ``cache`` is reset first (a new prompt must not see the previous one's keys); without one, a
    :meth:`GPT2.new_cache` just big enough is made. Returns ``[B, T + max_new_tokens]``.
    """
    ids = check_inputs(model, input_ids, max_new_tokens, batched=True)
    B, T = ids.shape
    if max_new_tokens == 0:
        return ids
    if cache is None:
        cache = model.new_cache(B, max_len=T + max_new_tokens)
    cache.reset()
    out = torch.empty(B, T + max_new_tokens, dtype=torch.long, device=ids.device)
    out[:, :T] = ids
    logits = model(ids, cache, last_only=True)             # prefill: the whole prompt, once
    for t in range(T, T + max_new_tokens):
        out[:, t] = logits[:, -1].argmax(dim=-1)
        if t + 1 < T + max_new_tokens:
            logits = model(out[:, t:t + 1], cache, last_only=True)   # decode: one new position
    return out


@torch.no_grad()
def generate_uncached(model: GPT2, input_ids, max_new_tokens: int) -> torch.Tensor:
    """Step (a) of chapter 3: no cache, the whole sequence through the model at every step."""
    ids = check_inputs(model, input_ids, max_new_tokens, batched=True)
    for _ in range(max_new_tokens):
        next_id = model(ids, last_only=True)[:, -1].argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
    return ids
