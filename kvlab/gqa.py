"""Fewer key/value heads (chapter 11): grouped-query and multi-query attention by converting a trained GPT-2.

GPT-2 gives every query head its own key and value head, so its cache holds ``n_head`` of each. With
grouped-query attention (GQA) the ``n_head`` query heads are split into ``n_kv_head`` contiguous groups
and each group shares one key/value head: the cache shrinks by ``n_head / n_kv_head``. Multi-query
attention (MQA) is the extreme, one shared head. Query head ``h`` reads key/value head
``h // group_size`` (as ``repeat_kv`` in Llama's code lays them out).

A trained model is converted by building one key and one value projection per group out of the
group's heads (:func:`convert`):

* ``"mean"``: average the heads' projection weights and biases (the GQA paper's mean-pooling);
* ``"first"``: keep the group's first head, drop the others;
* ``"pca"``: the shared head spans the directions the group's keys (values) use most on calibration
  text (the top ``head_dim`` principal directions of the heads' outputs side by side); each query
  head then gets a ``head_dim x head_dim`` map folded into its query projection (keys) and into the
  output projection (values), so it reads the shared head in its own coordinates. Mean-pooling is
  the special case where every map is the identity.

The converted model is the same :class:`kvlab.gpt2.GPT2`, with each block's attention replaced by
:class:`GroupedAttention` and a config whose :meth:`cache_dims` says ``n_kv_head``: every cache of the
book then stores ``n_kv_head`` heads only. The shared heads are expanded for the attention either
eagerly (``repeat_kv``, a copy per query head) or by the kernel (``enable_gqa=True``).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt2 import GPT2, GPTConfig, masked_attention

METHODS = ("mean", "first", "pca")


@dataclasses.dataclass
class GQAConfig(GPTConfig):
    n_kv_head: int = 1   # key/value heads; n_head query heads share them in groups of n_head // n_kv_head

    def cache_dims(self) -> tuple[int, int]:
        return self.n_kv_head, self.head_dim


def group_counts(n_head: int) -> list[int]:
    """Every number of key/value heads ``n_head`` query heads can be shared by evenly (its divisors)."""
    return [g for g in range(1, n_head + 1) if n_head % g == 0]


def check_groups(n_head: int, n_kv_head) -> int:
    """``n_kv_head`` if it divides ``n_head``, else a ValueError listing the counts that do."""
    if isinstance(n_kv_head, bool) or not isinstance(n_kv_head, int) or not 1 <= n_kv_head <= n_head \
            or n_head % n_kv_head:
        raise ValueError(f"{n_head} query heads cannot be shared evenly by n_kv_head={n_kv_head!r} key/value "
                         f"heads: pick one of {group_counts(n_head)}")
    return n_kv_head


def repeat_kv(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[B, n_kv, S, D]`` -> ``[B, n_kv * group_size, S, D]``: each shared head copied for the
    ``group_size`` consecutive query heads of its group (head ``h`` gets ``h // group_size``)."""
    if group_size == 1:
        return x
    B, n_kv, S, D = x.shape
    return x[:, :, None].expand(B, n_kv, group_size, S, D).reshape(B, n_kv * group_size, S, D)


class GroupedAttention(nn.Module):
    """Attention with ``n_kv_head`` key/value heads shared by ``n_head`` query heads. Its cache stores
    ``n_kv_head`` heads; ``expand`` says how the shared heads meet the queries: ``"repeat"`` copies
    them (:func:`repeat_kv`), ``"native"`` lets ``scaled_dot_product_attention`` index them
    (``enable_gqa=True``; only with the model's default attention function)."""

    def __init__(self, cfg: GQAConfig, expand: str = "repeat"):
        super().__init__()
        if expand not in ("repeat", "native"):
            raise ValueError(f"expand must be 'repeat' or 'native', got {expand!r}")
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.expand = expand
        self.repeat = repeat_kv          # how the shared heads are laid out for the queries (lab 11 swaps it)
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.kv_proj = nn.Linear(cfg.n_embd, 2 * cfg.n_kv_head * cfg.head_dim)   # one shared k and v per group
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x, layer: int, cache, rule, attention_fn):
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k, v = (t.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
                for t in self.kv_proj(x).split(self.n_kv_head * self.head_dim, dim=2))
        if cache is None:
            key_pos = rule.positions[:, None, :]
        else:
            k, v, key_pos = cache.update(layer, k, v, rule.positions)   # n_kv_head heads stored, no more
        mask = rule.mask(key_pos)
        if self.expand == "native" and attention_fn is masked_attention:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            group = self.n_head // self.n_kv_head
            y = attention_fn(q, self.repeat(k, group), self.repeat(v, group), mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


# ---------------------------------------------------------------------------------------------------
# Converting a trained model


def _heads(w: torch.Tensor, n: int) -> torch.Tensor:
    """A projection's rows ``[n * D, ...]`` split per head: ``[n, D, ...]``."""
    return w.view(n, w.shape[0] // n, *w.shape[1:])


def pool_heads(w: torch.Tensor, b: torch.Tensor, n_head: int, n_kv_head: int, method: str):
    """The shared key (or value) projection of each group, from the per-head one (``w`` ``[H*D, C]``,
    ``b`` ``[H*D]``), by ``"mean"`` or ``"first"``: returns ``([n_kv*D, C], [n_kv*D])``."""
    group = n_head // n_kv_head
    wh, bh = _heads(w, n_head), _heads(b, n_head)                      # [H, D, C], [H, D]
    wg, bg = wh.view(n_kv_head, group, *wh.shape[1:]), bh.view(n_kv_head, group, -1)
    if method == "mean":
        return wg.mean(1).flatten(0, 1), bg.mean(1).flatten()
    return wg[:, 0].flatten(0, 1), bg[:, 0].flatten()                   # "first": one head per group


def shared_basis(outputs: torch.Tensor, n_kv_head: int, head_dim: int) -> torch.Tensor:
    """``[n_kv, G*D, D]``: per group, the top ``D`` principal directions (uncentred) of the group's
    heads' outputs side by side (``outputs`` ``[N, H*D]`` on calibration tokens)."""
    groups = outputs.view(outputs.shape[0], n_kv_head, -1).transpose(0, 1).double()   # [n_kv, N, G*D]
    second = groups.transpose(1, 2) @ groups                                          # [n_kv, G*D, G*D]
    _, vecs = torch.linalg.eigh(second)                                               # ascending
    return vecs[..., -head_dim:].flip(-1).to(outputs.dtype)


@torch.no_grad()
def conversion_inputs(model: GPT2, method: str, methods: tuple, calibration) -> list:
    """The checks every conversion of chapter 11 makes before any work (a known ``method``, calibration
    text for ``"pca"``, an unconverted model), then each layer's calibration input (None per layer when
    ``method`` needs none). Shared by :func:`convert` here and :func:`kvlab.latent.convert`."""
    cfg = model.config
    if method not in methods:
        raise ValueError(f"method must be one of {methods}, got {method!r}")
    if method == "pca" and calibration is None:
        raise ValueError("method='pca' needs calibration token ids [B, T] (text apart from the evaluation text)")
    if cfg.cache_dims() != (cfg.n_head, cfg.head_dim):
        raise ValueError("convert() takes a GPT-2 with one key/value head per query head (an unconverted model)")
    return calibration_inputs(model, calibration) if method == "pca" else [None] * cfg.n_layer


def calibration_inputs(model: GPT2, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's normed attention input ``ln_1(x)`` ``[N, C]`` on the token ids ``ids`` ``[B, T]``
    (calibration text, kept apart from the evaluation text)."""
    seen = []
    hooks = [blk.ln_1.register_forward_hook(lambda m, i, o: seen.append(o.flatten(0, 1))) for blk in model.h]
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


@torch.no_grad()
def _convert_block(old, new: GroupedAttention, method: str, x: torch.Tensor | None) -> None:
    """Fill ``new`` (a :class:`GroupedAttention`) from GPT-2's fused attention ``old``."""
    H, n_kv, D = new.n_head, new.n_kv_head, new.head_dim
    C = H * D
    (wq, wk, wv), (bq, bk, bv) = old.c_attn.weight.split(C), old.c_attn.bias.split(C)
    wo, bo = old.c_proj.weight.clone(), old.c_proj.bias
    if method == "pca":
        shared = []
        for w, b, side in ((wk, bk, "k"), (wv, bv, "v")):
            U = shared_basis(x @ w.T + b, n_kv, D)                              # [n_kv, G*D, D]
            shared.append(((U.transpose(1, 2) @ _heads(w, n_kv)).flatten(0, 1),
                           (U.transpose(1, 2) @ _heads(b, n_kv)[..., None]).flatten()))
            per_head = U.reshape(n_kv, H // n_kv, D, D).flatten(0, 1)          # [H, D, D]: head h's map
            if side == "k":   # q_h . (U_h k_g) = (U_h^T q_h) . k_g: the map moves into the query
                wq = (per_head.transpose(1, 2) @ _heads(wq, H)).flatten(0, 1)
                bq = (per_head.transpose(1, 2) @ _heads(bq, H)[..., None]).flatten()
            else:             # out = W_o_h (U_h v_g): the map moves into the output projection
                wo = torch.einsum("chd,hde->che", wo.view(C, H, D), per_head).flatten(1)
        (wk, bk), (wv, bv) = shared
    else:
        (wk, bk), (wv, bv) = (pool_heads(w, b, H, n_kv, method) for w, b in ((wk, bk), (wv, bv)))
    new.q_proj.weight.copy_(wq), new.q_proj.bias.copy_(bq)
    new.kv_proj.weight.copy_(torch.cat([wk, wv])), new.kv_proj.bias.copy_(torch.cat([bk, bv]))
    new.c_proj.weight.copy_(wo), new.c_proj.bias.copy_(bo)


def convert(model: GPT2, n_kv_head: int, method: str = "mean", calibration: torch.Tensor | None = None,
            expand: str = "repeat") -> GPT2:
    """A copy of ``model`` with ``n_kv_head`` key/value heads, built by ``method`` (:data:`METHODS`);
    ``"pca"`` needs ``calibration`` token ids ``[B, T]``. The original is left untouched."""
    cfg = model.config
    check_groups(cfg.n_head, n_kv_head)
    xs = conversion_inputs(model, method, METHODS, calibration)
    new = copy.deepcopy(model)
    new.config = GQAConfig(**dataclasses.asdict(cfg), n_kv_head=n_kv_head)
    p = model.wte.weight
    for block, x in zip(new.h, xs):
        attn = GroupedAttention(new.config, expand).to(device=p.device, dtype=p.dtype)
        _convert_block(block.attn, attn, method, x)
        block.attn = attn
    new.kvlab_name = f"{getattr(model, 'kvlab_name', 'gpt2')} GQA {n_kv_head}kv ({method})"
    return new.eval()
