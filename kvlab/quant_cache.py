"""Quantized KV caches (chapter 5): keys and values stored in a few bits, dequantized when read.

Built on the maths of ``kvlab.quant``; each cache implements the one cache interface of ``kvlab.cache``.
"""

from __future__ import annotations
import torch
from .cache import Cache, append_positions, tensor_bytes
from .quant import absmax_per_tensor_fake_int8, check_bits, dequantize, dequantize_groups, pack, quantize, quantize_groups, unpack
from .configs import context_length, kv_dims
from .configs import config_of


#: Statistics modes. The cache quantizes whole blocks of tokens at once, viewed as
#: [batch, heads, n_blocks, block, head_dim]; each mode names the dims reduced over.
MODES = {
    "channel": -2,          # per (head, channel) of a block: over the block's tokens (KIVI keys)
    "token": -1,            # per (head, token): over the channels (KIVI values)
    "tensor": (1, 3, 4),    # per block of a sequence: over heads, tokens and channels
}


class QuantizedKVCache(Cache):
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
    only what is kept for later steps is quantized (as in KIVI and transformers' ``QuantizedKVCache``).
    ``nbytes`` counts every tensor held: packed codes, scales, zero points and the window.
    """

    bookkeeping = ("_key_pos",)

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
    def for_model(cls, model, batch_size: int = 1, max_len: int | None = None, **kw):
        """A cache sized for ``model`` (or its config: GPT-2's or any other, :func:`kvlab.configs.kv_dims`);
        ``max_len`` defaults to the whole context. (Every kvlab cache class has ``for_model``.)"""
        config = config_of(model)
        n_layer, kv_heads, head_dim = kv_dims(config)
        return cls(n_layer, batch_size, kv_heads, head_dim, max_len or context_length(config), **kw)

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
        # (as in KIVI and transformers' QuantizedKVCache).
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
        return (f"QuantizedKVCache(bits={self.bits}, keys per {self.key_mode}, values per {self.value_mode}"
                f"{groups}, block={self.block}, residual={self.residual}, seq_len={self.seq_len}, "
                f"nbytes={self.nbytes:,})")


class AbsmaxFakeInt8Cache(Cache):
    """Article A's "int8 cache", reproduced: every update's keys/values get one absmax scale for the
    whole chunk (the prompt: the whole tensor) and are stored as rounded values *in float*.

    It loses precision like int8 and saves no memory at all: ``nbytes`` is the full-precision size
    plus the scales.
    """

    bookkeeping = ("_key_pos",)

    def __init__(self, n_layer: int, batch_size: int, n_head: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        self.n_layer, self.batch_size, self.n_head, self.head_dim = n_layer, batch_size, n_head, head_dim
        self.max_len, self.dtype, self.device = max_len, dtype, torch.device(device)
        self.reset()

    for_model = classmethod(QuantizedKVCache.for_model.__func__)

    def reset(self) -> None:
        self._chunks = [[] for _ in range(self.n_layer)]
        self._key_pos = None
        self._len = 0

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions):
        T = self._check_update(k, v)
        if layer == 0:
            self._key_pos = append_positions(self._key_pos, positions)
        # the stored past comes back rounded, the call's own tokens exact (like QuantizedKVCache)
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


#: What a :class:`QuantizedKVCache` of each width (KIVI defaults, blocks of 16) promises against the
#: full-precision cache, teacher-forced on text: at least ``agree`` top-1 agreement and at most ``kl``
#: mean KL divergence (nats). The equivalence test holds it to this. Measured on kvlab-tiny (fp32, CPU,
#: 80 positions after a 32-token prompt): 8 bits 1.000 / 1.1e-6, 4 bits 0.988 / 2.8e-4, 2 bits
#: 0.950 / 9.0e-3; the bounds leave room for another machine's rounding.
TOLERANCE = {8: dict(agree=0.99, kl=1e-4), 4: dict(agree=0.95, kl=5e-3), 2: dict(agree=0.85, kl=0.05)}
