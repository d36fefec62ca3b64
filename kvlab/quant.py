"""Quantized KV caches (chapter 5): fewer bits per cached number, and what that costs.

Asymmetric min/max quantization to ``b`` bits maps every slice of a tensor (along ``dim``) onto the
integer codes ``0 .. 2**b - 1``::

    scale      = (max - min) / (2**b - 1)          # the step between two neighbouring codes
    zero_point = min                               # the value that code 0 stands for
    q          = clamp(round((x - min) / scale), 0, 2**b - 1)    -> stored as torch.uint8
    x_hat      = q * scale + zero_point            # |x - x_hat| <= scale / 2 everywhere

(Integer libraries store an integer zero point ``z = round(-min / scale)`` instead and compute
``(q - z) * scale``; KIVI and HQQ keep a float offset like we do. Same idea, same error bound.)

``dim`` is the axis the statistics are taken *along* (reduced over, ``keepdim=True``). For a cache
tensor ``[batch, heads, tokens, head_dim]``:

* ``dim=-2``  per channel: one scale per (head, channel), over tokens   -- how KIVI stores keys;
* ``dim=-1``  per token:   one scale per (head, token), over channels   -- how KIVI stores values;
* ``dim=(1, 2, 3)`` per tensor: one scale per sequence for everything.

Codes of 4 and 2 bits are packed two and four to a byte (``pack``/``unpack``), so storage really
shrinks. :class:`QuantizedCache` puts it together (keys per channel, values per token, a residual
window of recent tokens in full precision); :class:`AbsmaxFakeInt8Cache` reproduces article A's
scheme, which saves nothing. :func:`score_through_cache` and :func:`compare` measure quality.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .cache import Cache, append_positions, tensor_bytes

SUPPORTED_BITS = (2, 4, 8)

#: What a :class:`QuantizedCache` of each width (KIVI defaults, blocks of 16) promises against the
#: full-precision cache, teacher-forced on text: at least ``agree`` top-1 agreement and at most ``kl``
#: mean KL divergence (nats). The equivalence test holds it to this. Measured on kvlab-tiny (fp32, CPU,
#: 80 positions after a 32-token prompt): 8 bits 1.000 / 1.1e-6, 4 bits 0.988 / 2.8e-4, 2 bits
#: 0.950 / 9.0e-3; the bounds leave room for another machine's rounding.
TOLERANCE = {8: dict(agree=0.99, kl=1e-4), 4: dict(agree=0.95, kl=5e-3), 2: dict(agree=0.85, kl=0.05)}


def check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS} (codes that pack evenly into a byte), "
                         f"got {bits!r}")
    return bits


# ----------------------------------------------------------------------------- quantize / dequantize

def quantize(x: torch.Tensor, bits: int, dim) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of ``x`` to ``bits`` bits along ``dim`` (an int or a tuple;
    chapter 5).

    Returns ``(q, scale, zero_point)``: ``q`` is ``torch.uint8`` with the shape of ``x`` and values in
    ``[0, 2**bits - 1]``; ``scale`` and ``zero_point`` have ``x``'s dtype and its shape with ``dim``
    reduced to 1 (``keepdim``), so they broadcast against ``q``. A NaN or inf in ``x`` is refused
    (:func:`check_finite`): it would make its whole slice NaN.
    """
    check_finite(x)
    return _minmax(x, 2 ** check_bits(bits) - 1, dim)


def _minmax(x: torch.Tensor, levels: int, dim):
    """:func:`quantize` on an already checked ``x``, onto the codes ``0 .. levels``."""
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    scale = (hi - lo) / levels
    # A constant slice (max == min) has no range: 0/0 would be NaN. Any positive step works there,
    # every code is 0 and zero_point (= min) reconstructs the constant exactly.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((x - lo) / scale).clamp_(0, levels).to(torch.uint8)   # round, never truncate
    return q, scale, lo


def check_finite(x: torch.Tensor) -> None:
    """``x`` must be a non-empty floating-point tensor of finite numbers: one NaN or inf in a slice
    makes its min/max (so its scale, so every code of the slice) NaN, silently."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"quantize expects a floating-point tensor (the keys or values), got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.numel() == 0:
        raise ValueError(f"cannot quantize an empty tensor (shape {list(x.shape)}): there is no min or max")
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        where = (~finite).nonzero()[0].tolist()
        raise ValueError(f"x holds {int((~finite).sum())} NaN/inf value(s), the first {x[tuple(where)].item()} "
                         f"at index {where}; a non-finite value would turn its whole slice to NaN. Find where "
                         "it came from (an fp16 overflow?) before quantizing")


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`quantize` (up to half a step): ``q * scale + zero_point``."""
    return q.to(scale.dtype) * scale + zero_point


def fake_quantize(x: torch.Tensor, bits: int, dim) -> torch.Tensor:
    """Quantize and immediately dequantize: the error a cache stored this way would add."""
    return dequantize(*quantize(x, bits, dim))


def quantize_groups(x: torch.Tensor, bits: int, group_size: int):
    """Per-token quantization in groups of ``group_size`` channels (the last axis).

    Returns ``(q, scale, zero_point)`` with ``q`` shaped like ``x`` and one scale per group:
    ``[..., n_channels // group_size, 1]``. Smaller groups isolate outliers, at the price of more scales.
    """
    check_finite(x)                          # on x itself, so that an index it reports is x's
    d = x.shape[-1]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or d % group_size:
        raise ValueError(f"group_size must be an int that divides the channel count {d}, got {group_size!r}")
    q, scale, zp = _minmax(x.reshape(*x.shape[:-1], d // group_size, group_size), 2 ** check_bits(bits) - 1, -1)
    return q.reshape(x.shape), scale, zp


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    g = q.shape[-1] // scale.shape[-2]
    return dequantize(q.reshape(*q.shape[:-1], -1, g), scale, zero_point).reshape(q.shape)


def absmax_per_tensor_fake_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Article A's int8 scheme, reproduced to be measured (not recommended).

    One symmetric absmax scale for the whole tensor, codes rounded to ``-127..127`` but returned in
    ``x``'s own float dtype: the "quantized" tensor takes exactly as many bytes as ``x``, and one
    outlier channel sets the step for every other channel. Dequantize with ``q * scale``.
    """
    check_finite(x)
    scale = x.abs().amax().clamp(min=torch.finfo(x.dtype).tiny) / 127
    return torch.round(x / scale).clamp(-127, 127), scale          # still float: nothing saved


# ----------------------------------------------------------------------------- packing

def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``8 // bits`` codes per byte along the last axis (8 bits: returned as is; chapter 5)."""
    per = 8 // check_bits(bits)
    _check_codes(q, "pack")
    if per == 1:
        return q
    top = int(q.max()) if q.numel() else 0
    if top > 2 ** bits - 1:
        raise ValueError(f"a {bits}-bit code is at most {2 ** bits - 1}, but q holds {top}: it would spill into "
                         f"its neighbour's bits. Pack the codes quantize(x, {bits}, dim) returns")
    if q.shape[-1] % per:
        raise ValueError(f"the last axis ({q.shape[-1]}) must be a multiple of {per} to pack {bits}-bit codes")
    q = q.reshape(*q.shape[:-1], -1, per)
    out = q[..., 0].clone()
    for i in range(1, per):                    # code i of a group goes to bits [i*bits, (i+1)*bits)
        out |= q[..., i] << (bits * i)
    return out


def unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack`: the last axis grows ``8 // bits`` times."""
    per = 8 // check_bits(bits)
    _check_codes(p, "unpack")
    if per == 1:
        return p
    mask = 2 ** bits - 1
    return torch.stack([(p >> (bits * i)) & mask for i in range(per)], dim=-1).flatten(-2)


def _check_codes(q, what: str) -> None:
    if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8:
        raise ValueError(f"{what} expects torch.uint8 codes, got {getattr(q, 'dtype', type(q).__name__)}")
    if q.dim() == 0:
        raise ValueError(f"{what} works along the last axis: give it a tensor of at least one axis, not a 0-d one")


def pack_4bit(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte: ``q[..., 2i]`` in the low nibble, ``q[..., 2i + 1]`` in the high one."""
    return pack(q, 4)


def unpack_4bit(p: torch.Tensor) -> torch.Tensor:
    return unpack(p, 4)


def pack_2bit(q: torch.Tensor) -> torch.Tensor:
    """Four 2-bit codes per byte."""
    return pack(q, 2)


def unpack_2bit(p: torch.Tensor) -> torch.Tensor:
    return unpack(p, 2)


# ----------------------------------------------------------------------------- the quantized cache

#: Statistics modes. The cache quantizes whole blocks of tokens at once, viewed as
#: [batch, heads, n_blocks, block, head_dim]; each mode names the dims reduced over.
MODES = {
    "channel": -2,          # per (head, channel) of a block: over the block's tokens (KIVI keys)
    "token": -1,            # per (head, token): over the channels (KIVI values)
    "tensor": (1, 3, 4),    # per block of a sequence: over heads, tokens and channels
}


class QuantizedCache(Cache):
    """A KV cache that stores keys and values in ``bits`` bits (KIVI-style by default).

    Tokens arrive in a full-precision *window*. Whenever the window holds at least
    ``residual + block`` tokens, its oldest whole blocks of ``block`` tokens are quantized: keys along
    ``key_mode`` (default ``"channel"``: one scale per channel, statistics over the block's tokens),
    values along ``value_mode`` (default ``"token"``: one scale per token, over the channels;
    ``group_size`` splits the channels into groups). So the ``residual`` most recent tokens (and up
    to ``block - 1`` more) are always exact; every older token is stored as packed codes plus its
    share of scales and zero points.

    ``update`` returns, for attention, the stored past (dequantized blocks, then the window) followed
    by the call's own keys/values *in full precision*: a prompt's attention at prefill is exact, and
    only what is kept for later steps is quantized (as in KIVI and transformers' ``QuantizedCache``).
    ``nbytes`` counts every tensor held: packed codes, scales, zero points and the window.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device="cpu", bits: int = 4, residual: int = 0,
                 block: int = 32, key_mode: str = "channel", value_mode: str = "token",
                 group_size: int | None = None):
        self.bits = check_bits(bits)
        for m in (key_mode, value_mode):
            if m not in MODES:
                raise ValueError(f"mode must be one of {sorted(MODES)}, got {m!r}")
        if head_dim % (8 // bits):
            raise ValueError(f"head_dim {head_dim} must be a multiple of {8 // bits} to pack {bits}-bit codes")
        if group_size is not None and (value_mode != "token" or group_size < 1 or head_dim % group_size):
            raise ValueError("group_size applies to per-token values and must divide head_dim")
        if block < 1 or residual < 0:
            raise ValueError(f"need block >= 1 and residual >= 0, got block={block}, residual={residual}")
        self.n_layer, self.batch_size, self.n_head, self.head_dim = n_layer, batch_size, n_head, head_dim
        self.max_len, self.dtype, self.device = max_len, dtype, torch.device(device)
        self.residual, self.block = residual, block
        self.key_mode, self.value_mode, self.group_size = key_mode, value_mode, group_size
        self.reset()

    @classmethod
    def from_config(cls, config, batch_size: int = 1, max_len: int | None = None, **kw):
        """Shapes from a GPT-2 config (``n_layer``, ``n_head``, ``n_embd``, ``n_positions``)."""
        return cls(config.n_layer, batch_size, config.n_head, config.n_embd // config.n_head,
                   max_len or config.n_positions, **kw)

    def reset(self) -> None:
        # per layer: (packed codes, scale, zero point) of all quantized blocks, for keys and values
        self._qk = [None] * self.n_layer
        self._qv = [None] * self.n_layer
        # per layer: the full-precision window of the newest tokens
        self._win_k = [None] * self.n_layer
        self._win_v = [None] * self.n_layer
        self._key_pos = None     # the position of every token held, [batch, seq_len]
        self._len = 0

    @property
    def quantized_len(self) -> int:
        """Tokens stored quantized (the rest are in the full-precision window)."""
        return 0 if self._qk[0] is None else self._qk[0][0].shape[2] * self.block

    # blocks [B, H, n, block, D] <-> (packed codes, scale, zero point)
    def _quantize(self, x: torch.Tensor, mode: str):
        if mode == "token" and self.group_size:
            q, s, z = quantize_groups(x, self.bits, self.group_size)
        else:
            q, s, z = quantize(x, self.bits, MODES[mode])
        return pack(q, self.bits), s, z

    def _dequantize(self, stored, mode: str) -> torch.Tensor:
        p, s, z = stored
        q = unpack(p, self.bits)
        x = dequantize_groups(q, s, z) if mode == "token" and self.group_size else dequantize(q, s, z)
        return x.flatten(2, 3)                 # [B, H, n * block, D]

    @staticmethod
    def _append(old, new):
        return new if old is None else tuple(torch.cat([a, b], dim=2) for a, b in zip(old, new))

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions):
        """Chapter 5: return the stored past (dequantized) and this call's own tokens in full precision,
        then store the new tokens: append to the window, quantize its oldest whole blocks."""
        T = self._check_update(k, v)
        if layer == 0:
            self._key_pos = append_positions(self._key_pos, positions)
        # Only what is *stored* is quantized, so a prompt attends to its own exact keys at prefill
        # (as in KIVI and transformers' QuantizedCache).
        keys, values = k, v
        if self._win_k[layer] is not None:
            keys = torch.cat([self._win_k[layer], k], dim=-2)
            values = torch.cat([self._win_v[layer], v], dim=-2)
        if self._qk[layer] is not None:
            keys = torch.cat([self._dequantize(self._qk[layer], self.key_mode).to(k.dtype), keys], dim=-2)
            values = torch.cat([self._dequantize(self._qv[layer], self.value_mode).to(v.dtype), values], dim=-2)
        self._store(layer, k, v)
        self._advance(layer, T)
        return keys, values, self._key_pos[:, None]

    def rewind(self, length: int) -> None:
        """Forget the tokens from ``length`` on. Only the full-precision window can be cut: a quantized
        block's exact values are gone, so rewinding into one is refused (keep ``residual`` at least as
        large as the rewinds you need, e.g. the drafted tokens of speculative decoding)."""
        self._check_rewind(length)
        if length < self.quantized_len:
            raise ValueError(f"cannot rewind to {length}: tokens up to {self.quantized_len} are already "
                             "quantized and their exact values are gone; rewind fewer tokens or use a larger "
                             "residual window")
        keep = length - self.quantized_len
        self._win_k = [None if t is None else t[..., :keep, :].clone() for t in self._win_k]
        self._win_v = [None if t is None else t[..., :keep, :].clone() for t in self._win_v]
        self._key_pos = self._key_pos[:, :length]
        self._len = length

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append to the window, then quantize its oldest whole blocks while ``residual`` tokens stay exact."""
        B, H, _, D = k.shape
        if self._win_k[layer] is not None:
            k = torch.cat([self._win_k[layer], k], dim=-2)
            v = torch.cat([self._win_v[layer], v], dim=-2)
        n = max(0, (k.shape[-2] - self.residual) // self.block)
        if n:
            nq = n * self.block
            kb = k[..., :nq, :].reshape(B, H, n, self.block, D)
            vb = v[..., :nq, :].reshape(B, H, n, self.block, D)
            self._qk[layer] = self._append(self._qk[layer], self._quantize(kb, self.key_mode))
            self._qv[layer] = self._append(self._qv[layer], self._quantize(vb, self.value_mode))
            k, v = k[..., nq:, :], v[..., nq:, :]
        # .clone(): keep only the window's own bytes, never a view of the model's q/k/v projection
        # or of a bigger tensor
        self._win_k[layer], self._win_v[layer] = k.clone(), v.clone()

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_breakdown().values())

    def nbytes_breakdown(self) -> dict[str, int]:
        """Bytes by kind: packed codes, scales + zero points, full-precision window."""
        codes = meta = window = 0
        for layer in range(self.n_layer):
            for stored in (self._qk[layer], self._qv[layer]):
                if stored is not None:
                    codes += tensor_bytes(stored[0])
                    meta += tensor_bytes(*stored[1:])
            window += tensor_bytes(self._win_k[layer], self._win_v[layer])
        return {"codes": codes, "scales+zero points": meta, "full-precision window": window}

    def __repr__(self) -> str:
        groups = f" (groups of {self.group_size})" if self.group_size else ""
        return (f"QuantizedCache(bits={self.bits}, keys per {self.key_mode}, values per {self.value_mode}"
                f"{groups}, block={self.block}, residual={self.residual}, seq_len={self.seq_len}, "
                f"nbytes={self.nbytes:,})")


class AbsmaxFakeInt8Cache(Cache):
    """Article A's "int8 cache", reproduced: every update's keys/values get one absmax scale for the
    whole chunk (the prompt: the whole tensor) and are stored as rounded values *in float*.

    It loses precision like int8 and saves no memory at all: ``nbytes`` is the full-precision size
    plus the scales.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        self.n_layer, self.batch_size, self.n_head, self.head_dim = n_layer, batch_size, n_head, head_dim
        self.max_len, self.dtype, self.device = max_len, dtype, torch.device(device)
        self.reset()

    from_config = classmethod(QuantizedCache.from_config.__func__)

    def reset(self) -> None:
        self._chunks = [[] for _ in range(self.n_layer)]
        self._key_pos = None
        self._len = 0

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions):
        T = self._check_update(k, v)
        if layer == 0:
            self._key_pos = append_positions(self._key_pos, positions)
        # the stored past comes back rounded, the call's own tokens exact (like QuantizedCache)
        keys = torch.cat([q * s for (q, s), _ in self._chunks[layer]] + [k], dim=-2)
        values = torch.cat([q * s for _, (q, s) in self._chunks[layer]] + [v], dim=-2)
        self._chunks[layer].append((absmax_per_tensor_fake_int8(k), absmax_per_tensor_fake_int8(v)))
        self._advance(layer, T)
        return keys, values, self._key_pos[:, None]

    def rewind(self, length: int) -> None:
        """Forget the tokens from ``length`` on: only whole update chunks can go (one scale per chunk)."""
        self._check_rewind(length)
        sizes = [q.shape[2] for (q, _), _ in self._chunks[0]]
        ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
        if length and length not in ends:
            raise ValueError(f"cannot rewind to {length}: this cache rewinds only to the end of an update "
                             f"(one scale per update), one of {ends}")
        n = ends.index(length) + 1 if length else 0
        self._chunks = [chunks[:n] for chunks in self._chunks]
        self._key_pos = self._key_pos[:, :length] if length else None
        self._len = length

    @property
    def nbytes(self) -> int:
        return sum(tensor_bytes(*kc, *vc) for chunks in self._chunks for kc, vc in chunks)


# ----------------------------------------------------------------------------- measuring outliers and quality

@torch.no_grad()
def cached_kv(gpt, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[n_layer, heads, tokens, head_dim]`` of one prompt (1-D ids), from a
    full-precision cache of the hand-built GPT-2 (:class:`kvlab.gpt2.GPT2`)."""
    cache = gpt.new_cache(1, ids.numel())
    gpt(ids[None], cache)
    return cache.keys[:, 0], cache.values[:, 0]


def channel_ratio(x: torch.Tensor) -> list[float]:
    """Per layer, the largest channel's magnitude over the median channel's (``x``: [L, H, T, D])."""
    per_channel = x.abs().amax(dim=2).flatten(1)          # [L, H * D]: max over tokens
    return (per_channel.max(1).values / per_channel.median(1).values).tolist()


def token_ratio(x: torch.Tensor) -> list[float]:
    """Per layer, the largest token's magnitude over the median token's (max over channels)."""
    per_token = x.abs().amax(dim=3).flatten(1)            # [L, H * T]
    return (per_token.max(1).values / per_token.median(1).values).tolist()


def relative_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """``||x - x_hat|| / ||x||``."""
    return ((x_hat - x).norm() / x.norm()).item()


@torch.no_grad()
def score_through_cache(forward, cache, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Teacher-forced scoring through a cache: prefill ``ids[:, :prefill]``, then feed the remaining
    tokens one at a time, as generation would. ``forward(ids, cache) -> logits [B, t, vocab]``.

    Returns log-probabilities ``[B, S, vocab]`` of the predictions for tokens ``prefill .. end``
    (``S = ids.shape[1] - prefill``), in float32.
    """
    out = [forward(ids[:, :prefill], cache)[:, -1:].float().log_softmax(-1)]
    for t in range(prefill, ids.shape[1] - 1):
        out.append(forward(ids[:, t:t + 1], cache).float().log_softmax(-1))
    return torch.cat(out, dim=1)


def compare(ref_logprobs: torch.Tensor, logprobs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Quality of ``logprobs`` against the full-precision ``ref_logprobs`` on the same ``targets``.

    ``ppl`` / ``ppl_ref``: perplexity of the true next tokens; ``ppl_change``: relative change;
    ``kl``: mean KL(full precision || quantized) of the next-token distributions, in nats;
    ``agree``: fraction of positions where both pick the same top-1 token.
    """
    nll, nll_ref = (-lp.gather(-1, targets[..., None]).mean().item() for lp in (logprobs, ref_logprobs))
    kl = F.kl_div(logprobs, ref_logprobs, log_target=True, reduction="none").sum(-1).mean().item()
    agree = (logprobs.argmax(-1) == ref_logprobs.argmax(-1)).float().mean().item()
    return {"ppl_ref": math.exp(nll_ref), "ppl": math.exp(nll), "ppl_change": math.exp(nll - nll_ref) - 1,
            "kl": max(kl, 0.0), "agree": agree}
