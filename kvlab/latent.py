"""A latent instead of keys and values (chapter 11): multi-head latent attention, MLA-style, on GPT-2.

DeepSeek-V2 caches one small vector per token and layer, a latent ``c = W_down x`` of ``r`` numbers,
and rebuilds every head's key and value from it with up-projections (``k = W_uk c``, ``v = W_uv c``),
or never rebuilds them: ``q . (W_uk c) = (W_uk^T q) . c``, so ``W_uk`` moves into the query side, and
the weighted sum of values ``W_uv (sum a c)`` lets ``W_uv`` move into the output projection (the
"absorption"). The cache then holds ``r`` numbers per token and layer instead of ``2 x n_embd``.

For GPT-2 the keys and values of a layer are linear in the SAME input, the normed ``ln_1(x)`` of
``n_embd`` numbers: ``[k; v] = W_kv x + b`` with ``W_kv`` of shape ``[2 n_embd, n_embd]``. Its rank is at
most ``n_embd``, so a latent of ``r = n_embd`` numbers loses nothing (half the cache, exactly the same
model): :data:`lossless_rank`. Below it the latent is a low-rank approximation of ``W_kv``, chosen by
an SVD of the weight alone (``"svd"``) or of the keys and values on calibration text (``"pca"``).
The key bias never matters: ``q . b_k`` is the same for every key of a query, and softmax ignores it.

GPT-2's position is added to the token embedding before the first layer, so ``x`` already carries it
and a single latent serves keys and values. DeepSeek's rotary keys are rotated by their position
after projection, which does not commute with absorbing ``W_uk`` into the query: it caches a separate
small rotary key (64 numbers per token) beside the 512-number latent.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
import torch.nn as nn

from .cache import PreallocatedCache, tensor_bytes
from .gpt2 import GPT2, GPTConfig
from .gqa import conversion_inputs

METHODS = ("svd", "pca")


@dataclasses.dataclass
class LatentConfig(GPTConfig):
    kv_rank: int = 1   # numbers cached per token and layer

    def cache_dims(self) -> tuple[int, int]:
        return 1, self.kv_rank   # one "head" of kv_rank numbers: the latent


def lossless_rank(cfg: GPTConfig) -> int:
    """The smallest latent that is exact for ANY GPT-2 weights: ``n_embd`` (K and V are linear in one
    ``n_embd``-dim input). A given checkpoint may need fewer: ``torch.linalg.matrix_rank`` of ``W_kv``."""
    return cfg.n_embd


def check_rank(cfg: GPTConfig, rank) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= lossless_rank(cfg):
        raise ValueError(f"rank must be an int from 1 to n_embd={cfg.n_embd}, got {rank!r}: the keys and values "
                         f"of a layer are linear in its {cfg.n_embd}-dim input, so a larger latent cannot hold "
                         "more (r = n_embd is already exact)")
    return rank


class LatentKVCache(PreallocatedCache):
    """Chapter 3's preallocated cache holding one latent per token and layer, ``[n_layer, B, 1, max_len, r]``.
    ``update(layer, c, c, positions)``: the latent goes in as both keys and values (one tensor, stored once)."""

    def __init__(self, n_layer, batch_size, n_head, head_dim, max_len, dtype=torch.float32, device="cpu"):
        super().__init__(n_layer, batch_size, n_head, head_dim, max_len, dtype, device)
        self.values = self.keys   # the latent is both: one buffer

    def store(self, layer, k, v, positions):
        if v is not k:
            raise ValueError("a LatentKVCache stores one latent per token: pass it as both k and v")
        return super().store(layer, k, k, positions)

    @property
    def nbytes(self):
        return tensor_bytes(self.keys)


class LatentAttention(nn.Module):
    """GPT-2's attention with a cached latent. ``absorb=False``: keys and values rebuilt from the
    latent (``up``) for every step; ``absorb=True``: the up-projections folded into the query and output
    projections, attention computed over the latents themselves (each head's query has ``r`` numbers)."""

    def __init__(self, cfg: LatentConfig, absorb: bool = False):
        super().__init__()
        C, r = cfg.n_embd, cfg.kv_rank
        self.n_head, self.head_dim, self.rank, self.absorb = cfg.n_head, cfg.head_dim, r, absorb
        self.q_proj = nn.Linear(C, C)
        self.down = nn.Linear(C, r, bias=False)   # the latent: what the cache holds
        self.up = nn.Linear(r, 2 * C)             # [k; v] rebuilt from it (with GPT-2's biases)
        self.c_proj = nn.Linear(C, C)

    def forward(self, x, layer: int, cache, rule, attention_fn):
        B, T, C = x.shape
        c = self.down(x)[:, None]                                   # [B, 1, T, r]
        if cache is None:
            key_pos = rule.positions[:, None, :]
        else:
            c, _, key_pos = cache.update(layer, c, c, rule.positions)
        mask = rule.mask(key_pos)
        if self.absorb:
            return self._absorbed(x, c, mask, attention_fn)
        S, H, D = c.shape[2], self.n_head, self.head_dim
        k, v = (t.view(B, S, H, D).transpose(1, 2) for t in self.up(c[:, 0]).split(C, dim=2))
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)
        y = attention_fn(q, k, v, mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))

    def _absorbed(self, x, c, mask, attention_fn):
        """Scores ``(W_uk,h^T q_h) . c``, outputs ``W_o,h W_uv,h (sum a c) + ...``: no key or value is built."""
        B, T, C = x.shape
        H, D, r = self.n_head, self.head_dim, self.rank
        w_uk, w_uv = (w.view(H, D, r) for w in self.up.weight.split(C))        # [H, D, r] each
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)
        # attention_fn scales by 1/sqrt(r), the model by 1/sqrt(D): fix the scale in the query
        q_lat = torch.einsum("bhtd,hdr->bhtr", q, w_uk) * math.sqrt(r / D)
        lat = c.expand(B, H, *c.shape[2:])
        o = attention_fn(q_lat, lat, lat, mask)                                # [B, H, T, r]
        y = torch.einsum("bhtr,hdr->bthd", o, w_uv) + self.up.bias[C:].view(H, D)   # softmax rows sum to 1
        return self.c_proj(y.reshape(B, T, C))


# ---------------------------------------------------------------------------------------------------
# Converting a trained model


@torch.no_grad()
def factors(w_kv: torch.Tensor, rank: int, x: torch.Tensor | None = None):
    """``(down [r, C], up [2C, r])`` with ``up @ down`` the best rank-``r`` stand-in for ``w_kv`` ``[2C, C]``:
    for the weight alone (``x`` None: its SVD), or for its outputs on calibration inputs ``x`` ``[N, C]``
    (the top ``r`` principal directions of ``x @ w_kv.T``)."""
    w = w_kv.double()
    if x is None:
        U, S, Vh = torch.linalg.svd(w, full_matrices=False)
        up, down = U[:, :rank], S[:rank, None] * Vh[:rank]
    else:
        y = x.double() @ w.T                                    # [N, 2C]: keys and values, no bias
        _, vecs = torch.linalg.eigh(y.T @ y)
        up = vecs[:, -rank:].flip(-1)                           # [2C, r], orthonormal columns
        down = up.T @ w
    return down.to(w_kv.dtype), up.to(w_kv.dtype)


def convert(model: GPT2, rank: int, method: str = "svd", calibration: torch.Tensor | None = None,
            absorb: bool = False) -> GPT2:
    """A copy of ``model`` whose cache holds an ``rank``-number latent per token and layer; ``"pca"``
    needs ``calibration`` token ids ``[B, T]`` (apart from the evaluation text)."""
    cfg = model.config
    check_rank(cfg, rank)
    xs = conversion_inputs(model, method, METHODS, calibration)
    new = copy.deepcopy(model)
    new.config = LatentConfig(**dataclasses.asdict(cfg), kv_rank=rank)
    new.cache_cls = LatentKVCache
    p = model.wte.weight
    with torch.no_grad():
        for block, x in zip(new.h, xs):
            C = cfg.n_embd
            attn = LatentAttention(new.config, absorb).to(device=p.device, dtype=p.dtype)
            w, b = block.attn.c_attn.weight, block.attn.c_attn.bias
            attn.down.weight[:], attn.up.weight[:] = factors(w[C:], rank, x)
            attn.up.bias.copy_(b[C:])
            attn.q_proj.weight.copy_(w[:C]), attn.q_proj.bias.copy_(b[:C])
            attn.c_proj.load_state_dict(block.attn.c_proj.state_dict())
            block.attn = attn
    new.kvlab_name = f"{getattr(model, 'kvlab_name', 'gpt2')} latent r={rank} ({method})"
    return new.eval()
