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

    model = GPT2.from_hf(hf_model)
    logits = model(input_ids)                          # [B, T, vocab], no cache
    out = generate(model, input_ids, max_new_tokens)   # greedy, preallocated cache
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .cache import PreallocatedCache
from .generate import check_inputs


@dataclass
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024   # the context: GPT-2 has one position embedding per position, no more
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5

    @classmethod
    def from_hf(cls, hf_config) -> "GPT2Config":
        return cls(**{f: getattr(hf_config, f) for f in cls.__dataclass_fields__})

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# ---------------------------------------------------------------------------------------------------
# Attention for queries that sit after `past_len` cached positions


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


# ---------------------------------------------------------------------------------------------------
# The model


class CausalSelfAttention(nn.Module):
    """GPT-2's attention with a KV cache (chapter 3): the new tokens' keys and values go through the cache."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)   # q, k and v in one matmul, as GPT-2 stores them
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x, layer: int, cache, attention_fn):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # [B, T, C] -> [B, H, T, D]: each head attends on its own slice of the width
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = cache.update(layer, k, v)      # now every key and value so far: [B, H, S, D]
        past_len = k.shape[2] - T                 # taken from what the cache returned, not assumed
        y = attention_fn(q, k, v, past_len)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    """GPT-2's feed-forward block (chapter 3), with the tanh GELU the checkpoint was trained with."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.act = nn.GELU(approximate="tanh")    # GPT-2's "gelu_new"; the exact erf GELU is a bug here
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x, layer, cache, attention_fn):
        x = x + self.attn(self.ln_1(x), layer, cache, attention_fn)   # pre-norm residual blocks
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2 (the LM-head model). ``attention_fn(q, k, v, past_len)`` and ``cache_cls`` are pluggable,
    so the lab can run this model with a learner's attention and cache."""

    def __init__(self, cfg: GPT2Config, attention_fn: Callable | None = None, cache_cls=None):
        super().__init__()
        self.config = cfg
        self.attention_fn = attention_fn or sdpa_attention
        self.cache_cls = cache_cls or PreallocatedCache
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)

    def forward(self, input_ids, cache=None, last_only: bool = False):
        """Logits ``[B, T, vocab]`` for ``input_ids [B, T]`` that follow the ``cache.seq_len`` cached
        tokens (``[B, 1, vocab]`` with ``last_only``: all that generation needs). Chapter 3."""
        B, T = input_ids.shape
        past_len = cache.seq_len if cache is not None else 0
        if past_len + T > self.config.n_positions:
            raise ValueError(f"{past_len} cached + {T} new tokens = {past_len + T} exceeds GPT-2's context "
                             f"of n_positions={self.config.n_positions}: there is no position embedding "
                             "beyond it")
        # the new tokens continue the sequence: their positions start where the cache ends
        pos = torch.arange(past_len, past_len + T, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for i, block in enumerate(self.h):
            x = block(x, i, cache, self.attention_fn)
        if last_only:
            x = x[:, -1:]
        return self.ln_f(x) @ self.wte.weight.T   # the LM head is the token embedding, transposed (tied)

    def new_cache(self, batch_size: int = 1, max_len: int | None = None, dtype=None, device=None):
        """An empty cache for this model (``cache_cls``, a :class:`PreallocatedCache` by default);
        ``max_len`` defaults to the whole context, ``n_positions``."""
        cfg, p = self.config, self.wte.weight
        return self.cache_cls(cfg.n_layer, batch_size, cfg.n_head, cfg.head_dim,
                              max_len or cfg.n_positions, dtype or p.dtype, device or p.device)

    @classmethod
    @torch.no_grad()
    def from_hf(cls, hf_model, attention_fn: Callable | None = None, cache_cls=None) -> "GPT2":
        """Copy the weights of a transformers ``GPT2LMHeadModel`` (same dtype and device; chapter 3)."""
        cfg = GPT2Config.from_hf(hf_model.config)
        p = next(hf_model.parameters())
        model = cls(cfg, attention_fn, cache_cls).to(device=p.device, dtype=p.dtype)
        sd = hf_model.state_dict()
        # Conv1D layers store their weight as [in, out]; nn.Linear wants [out, in]
        conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        for name, param in model.named_parameters():
            src = sd["transformer." + name]
            param.copy_(src.t() if name.endswith(conv1d) else src)
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
