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
shrinks. :class:`QuantizedKVCache` puts it together (keys per channel, values per token, a residual
window of recent tokens in full precision); :class:`AbsmaxFakeInt8Cache` reproduces article A's
scheme, which saves nothing. :func:`score_through_cache` and :func:`compare` measure quality.
"""

from __future__ import annotations


import torch


SUPPORTED_BITS = (2, 4, 8)


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


# ----------------------------------------------------------------------------- the quantized cache


# ----------------------------------------------------------------------------- measuring outliers and quality


