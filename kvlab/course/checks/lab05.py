"""Grader for lab 5: ``quantize(x, bits, dim) -> (q, scale, zero_point)`` and
``dequantize(q, scale, zero_point) -> Tensor``, asymmetric min/max quantization along ``dim``.

The reference is float64 arithmetic on the same inputs: the step of each slice must be
``(max - min) / (2**bits - 1)``, and every reconstructed value must lie within half of the
candidate's own step of the original.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import expect_value_error, fail, learner_call, passed

NAME = "check_quantize"
BITS = (8, 4, 2)


def _inputs() -> list[tuple[torch.Tensor, tuple]]:
    """Fresh tensors shaped like a cache ``[batch, heads, tokens, head_dim]`` (every size different,
    so a wrong axis shows in the shapes) with an outlier channel and an offset token, like real
    keys."""
    g = torch.Generator().manual_seed(20250505)
    x4 = torch.randn(2, 3, 24, 16, generator=g)
    x4[..., 5] = x4[..., 5] * 12 + 4          # an outlier channel
    x4[:, :, 7, :] += 3                       # a token shifted upwards
    x2 = torch.rand(10, 6, generator=g) * 5 - 1
    return [(x4, (-1, -2, 1, 3, 0)), (x2, (0, -1))]


def _reduced_shape(shape, dim) -> tuple:
    dim = dim % len(shape)
    return tuple(1 if i == dim else s for i, s in enumerate(shape))


def _which_dims(shape, scale_shape) -> str:
    """Describe which axes a wrongly shaped scale was reduced over."""
    if len(scale_shape) != len(shape):
        return f"a scale of shape {list(scale_shape)} (did you forget keepdim=True?)"
    reduced = [i for i, (a, b) in enumerate(zip(shape, scale_shape)) if b == 1 and a != 1]
    return f"statistics taken along dim(s) {reduced}"


def _call_quantize(quantize, x, bits, dim):
    xin = x.clone()
    out = learner_call(NAME, f"quantize(<x {list(x.shape)} {x.dtype}>, bits={bits}, dim={dim})",
                       quantize, xin, bits, dim)
    if not torch.equal(xin, x):
        raise fail(NAME, "quantize modified its input x in place; compute new tensors instead")
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise fail(NAME, "quantize must return a tuple (q, scale, zero_point); got "
                         f"{type(out).__name__}")
    q, scale, zp = out
    for name, t in (("q", q), ("scale", scale), ("zero_point", zp)):
        if not isinstance(t, torch.Tensor):
            raise fail(NAME, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return q, scale, zp


@dataclass
class _Q:
    """One quantize call as the grader sees it (``step``/``ref`` in float64)."""

    x: torch.Tensor
    bits: int
    dim: int
    q: torch.Tensor
    scale: torch.Tensor
    zp: torch.Tensor
    want: tuple          # the statistics' shape: x's with dim reduced to 1

    @property
    def levels(self):
        return 2 ** self.bits - 1

    def range(self):
        xd = self.x.double()
        return xd.amin(dim=self.dim, keepdim=True), xd.amax(dim=self.dim, keepdim=True)


def _close(a, b):
    return torch.allclose(a, b.expand_as(a), rtol=1e-4, atol=1e-7)


# Codes and statistics: (test, message). The first test that holds names the mistake.
_CODES = [
    (lambda c: c.q.dtype.is_floating_point,
     "q is {qdt}: you store the rounded codes as floats, which is article A's mistake (as many "
     "bytes as the original, no memory saved). The contract stores the rounded, clamped codes "
     "as integers, one torch.uint8 each"),
    (lambda c: c.q.dtype != torch.uint8,
     "q is {qdt}; store codes as torch.uint8, one byte each (codes 0 .. 2**bits - 1 always fit)"),
    (lambda c: tuple(c.q.shape) != tuple(c.x.shape),
     "q must have the shape of x, {xs}; got {qs}"),
    (lambda c: c.scale.numel() == 1 or all(n == 1 for n in c.scale.shape),
     "you use one scale for the whole tensor (scale has {sn} element). Take min and max along dim "
     "only, keeping that dimension: one scale per slice, shape {want}"),
    (lambda c: tuple(c.scale.shape) != c.want,
     "statistics along the wrong axis: scale should have shape {want} (min/max reduced along "
     "dim={dim}, keepdim=True), but yours has {ss}: {which}. dim is the axis to reduce over"),
    (lambda c: tuple(c.zp.shape) != c.want,
     "zero_point should have the shape of scale, {want}; got {zs}"),
    (lambda c: not (torch.isfinite(c.scale).all() and torch.isfinite(c.zp).all()),
     "scale or zero_point contains NaN or inf"),
    (lambda c: _close(c.scale.double(), (c.range()[1] - c.range()[0]) / 2 ** c.bits),
     "scale is (max - min) / 2**bits. {bits} bits give 2**bits codes, 0 .. {levels}, so the range "
     "is split into 2**bits - 1 = {levels} steps: scale = (max - min) / (2**bits - 1)"),
    (lambda c: _close(c.scale.double(), (c.x.double().max() - c.x.double().min()) / c.levels)
     and not _close(c.scale.double(), (c.range()[1] - c.range()[0]) / c.levels),
     "every slice has the same scale, the whole tensor's range: one scale for the whole tensor, "
     "expanded. Take min and max of each slice (x.amin / x.amax with dim=dim, keepdim=True)"),
    (lambda c: not _close(c.scale.double(), (c.range()[1] - c.range()[0]) / c.levels),
     "scale should be the step of each slice, (max - min) / (2**bits - 1) with min/max taken along "
     "dim; yours is off by up to {off:.3g} (relative)"),
    (lambda c: int(c.q.max()) > c.levels,
     "a code is {qmax}, but {bits} bits hold only 0 .. {levels}: clamp the codes to "
     "[0, 2**bits - 1]"),
]


def _format(c: _Q) -> dict:
    lo, hi = c.range()
    ref = (hi - lo) / c.levels
    same = c.scale.shape == ref.shape
    off = float("nan")
    if same:
        off = ((c.scale.double() - ref).abs() / ref.clamp(min=1e-12)).max().item()
    return dict(qdt=c.q.dtype, xs=list(c.x.shape), qs=list(c.q.shape), sn=c.scale.numel(),
                want=list(c.want), dim=c.dim, ss=list(c.scale.shape), zs=list(c.zp.shape),
                which=_which_dims(c.x.shape, c.scale.shape), bits=c.bits, levels=c.levels, off=off,
                qmax=int(c.q.max()) if c.q.numel() else 0)


def _check_round_trip(c: _Q, xhat, where) -> None:
    if not isinstance(xhat, torch.Tensor) or not xhat.dtype.is_floating_point:
        raise fail(NAME, f"{where}: dequantize must return a floating-point tensor, got "
                         f"{getattr(xhat, 'dtype', type(xhat).__name__)}")
    if tuple(xhat.shape) != tuple(c.x.shape) or not torch.isfinite(xhat).all():
        raise fail(NAME, f"{where}: dequantize returned shape {list(xhat.shape)} (expected "
                         f"{list(c.x.shape)}) or NaN/inf values")
    xd, step = c.x.double(), c.scale.double()
    err = (xhat.double() - xd).abs()
    # half a step, plus float32 rounding slack (a few ulps of the values involved)
    tol = step / 2 * (1 + 1e-4) + 4e-7 * (1 + xd.abs() + c.zp.double().abs())
    if not (err > tol).any():
        return
    worst = (err / step).max().item()
    if worst <= 1.0 + 1e-3 and ((xhat.double() - xd) / step).mean().item() < -0.25:
        raise fail(NAME, f"{where}: reconstruction is off by up to {worst:.2f} of a step and lies "
                         "below x on average: you truncate (floor, int(), or .to(torch.uint8) "
                         "alone) instead of rounding to the nearest code, as the contract "
                         "asks")
    raise fail(NAME, f"{where}: dequantize(quantize(x)) is off by up to {worst:.2f} steps; at most "
                     "half a step is allowed. x_hat = q * scale + zero_point (zero_point = min), "
                     "with q = round((x - min) / scale)")


def _check_one(quantize, dequantize, x: torch.Tensor, bits: int, dim) -> None:
    where = f"x of shape {list(x.shape)}, bits={bits}, dim={dim}"
    q, scale, zp = _call_quantize(quantize, x, bits, dim)
    c = _Q(x, bits, dim, q, scale, zp, _reduced_shape(x.shape, dim))
    for broken, message in _CODES:
        if broken(c):
            raise fail(NAME, f"{where}: " + message.format(**_format(c)))
    xhat = learner_call(NAME, f"{where}: dequantize(q, scale, zero_point)", dequantize, q, scale, zp)
    _check_round_trip(c, xhat, where)


def _check_constant(quantize, dequantize, bits: int) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 2, 12, 8, generator=g)
    cases = []
    xc = x.clone()
    xc[..., 3] = 0.37                          # a constant channel: constant along tokens (dim=-2)
    xc[..., 6] = 0.0
    cases.append((xc, -2, (..., slice(None), 3)))
    xt = x.clone()
    xt[:, :, 4, :] = -1.25                     # a constant token: constant along channels (dim=-1)
    cases.append((xt, -1, (slice(None), slice(None), 4, slice(None))))
    for xin, dim, idx in cases:
        where = f"bits={bits}, dim={dim}, a slice with max == min"
        q, scale, zp = _call_quantize(quantize, xin, bits, dim)
        xhat = dequantize(q, scale, zp)
        if not all(torch.isfinite(t).all() for t in (scale, zp, xhat)):
            raise fail(NAME, f"{where}: NaN or inf on a constant slice. There max - min = 0, so "
                             "scale = 0 and (x - min) / scale = 0/0. The contract replaces a zero "
                             "scale by a positive number: every code is then 0 and zero_point = min "
                             "gives the constant back exactly")
        if (scale <= 0).any():
            raise fail(NAME, f"{where}: scale is 0 on a constant slice, so (x - min) / scale is "
                             "0/0 = NaN before the cast to uint8 (which hides it: casting NaN "
                             "gives an arbitrary code, 0 here, something else elsewhere). The "
                             "contract replaces a zero scale by a positive number")
        c = xin[idx]
        if not torch.allclose(xhat[idx].double(), c.double(), rtol=1e-6, atol=1e-6):
            raise fail(NAME, f"{where}: a constant slice must come back exactly (it has no range "
                             f"to lose); got errors up to {(xhat[idx] - c).abs().max().item():.3g}")


def _check_dtypes(quantize, dequantize) -> None:
    """Half-precision inputs: the statistics keep the input's dtype, the round trip stays close."""
    g = torch.Generator().manual_seed(5)
    for dt in (torch.float16, torch.bfloat16):
        x = (torch.randn(2, 3, 8, 16, generator=g) * 3).to(dt)
        q, scale, zp = _call_quantize(quantize, x, 4, -1)
        for name, t in (("scale", scale), ("zero_point", zp)):
            if t.dtype != dt:
                raise fail(NAME, f"x in {dt}: {name} is {t.dtype}; the statistics keep the "
                                 "input's dtype (compute them from x itself, no .float())")
        xhat = learner_call(NAME, f"dequantize of a {dt} input", dequantize, q, scale, zp)
        err = (xhat.double() - x.double()).abs() / scale.double()
        if not xhat.dtype.is_floating_point or err.max() > 1.0:   # half a step + rounding in dt
            raise fail(NAME, f"x in {dt}: dequantize returned {xhat.dtype} with errors up to "
                             f"{err.max().item():.3g} steps (at most half a step, plus {dt} "
                             "rounding)")


def _on_meta(fn, *args):
    """``fn(*args)`` on meta tensors: the result, or None when the code needs the values (an if on
    a tensor, boolean indexing: fine on a real device, impossible on meta, so nothing to judge)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - sorted below
        text = str(e)
        if "expected device" in text or "same device" in text:
            raise fail(NAME, f"on device='meta' inputs (shapes only) your code mixes devices: "
                             f"{text.splitlines()[0]}. On a GPU the same happens: a tensor your "
                             "code creates must be created on x's device") from e
        if "meta" in text or isinstance(e, NotImplementedError):
            return None
        raise fail(NAME, f"on device='meta' inputs your code raised {type(e).__name__}: "
                         f"{text.splitlines()[0] if text else ''}") from e


def _check_meta(quantize, dequantize) -> str:
    """Every tensor returned lives on the input's device (checked on meta: no GPU needed)."""
    x = torch.empty(2, 3, 8, 16, device="meta")
    out = _on_meta(quantize, x, 4, -1)
    if out is None:
        return "meta not judged (your quantize reads values)"
    names = ("q", "scale", "zero_point")
    bad = [f"{n} on {t.device}" for n, t in zip(names, out) if isinstance(t, torch.Tensor)
           and t.device.type != "meta"]
    xhat = _on_meta(dequantize, *out) if not bad else None
    if isinstance(xhat, torch.Tensor) and xhat.device.type != "meta":
        bad.append(f"dequantize's result on {xhat.device}")
    if bad:
        raise fail(NAME, f"x on device='meta': {', '.join(bad)}. Every tensor you return must be "
                         "on x's device, not on the default one")
    return "meta inputs give meta outputs"


def check_quantize(quantize, dequantize) -> None:
    """Grade asymmetric min/max ``quantize`` / ``dequantize`` against float64 arithmetic."""
    n = 0
    for bits in BITS:
        for x, dims in _inputs():
            for dim in dims:
                _check_one(quantize, dequantize, x, bits, dim)
                n += 1
        _check_constant(quantize, dequantize, bits)
    x = _inputs()[0][0]
    _check_one(quantize, dequantize, -0.5 * x + 1, 4, -1)    # a shape seen before, other values
    n += 1
    for bad in (0, 1, 3, 5, 6, 7, 16):
        expect_value_error(NAME, f"bits={bad}: bits must be one of (2, 4, 8), so this", quantize,
                           x.clone(), bad, -1)
    _check_dtypes(quantize, dequantize)
    meta = _check_meta(quantize, dequantize)
    passed(NAME, f"{n} tensors/bits/dims round-trip within half a step (float64 reference), uint8 "
                 "codes, constant slices exact, fp16/bf16 statistics keep their dtype, "
                 f"unsupported bits (odd and even) rejected; {meta}")


# ------------------------------------------------------------------ an integer zero point

NAME_INT = "check_quantize_int"


def _int_reference(x, bits, dim, scale):
    """float64 reference of the integer-zero-point scheme, given the learner's own scale."""
    xd, levels = x.double(), 2 ** bits - 1
    lo = xd.amin(dim=dim, keepdim=True).clamp(max=0)
    hi = xd.amax(dim=dim, keepdim=True).clamp(min=0)
    z = torch.round(-lo / scale.double()).clamp(0, levels)
    return lo, hi, z


def _check_int_case(quantize_int, dequantize_int, x, bits, dim) -> None:
    where = f"x of shape {list(x.shape)}, bits={bits}, dim={dim}"
    out = learner_call(NAME_INT, f"quantize_int(<x>, {bits}, {dim})", quantize_int, x.clone(), bits,
                       dim)
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise fail(NAME_INT, f"{where}: return a tuple (q, scale, zero_point)")
    q, scale, z = out
    if z.dtype.is_floating_point:
        raise fail(NAME_INT, f"{where}: zero_point is {z.dtype}: this scheme stores it as an "
                             "INTEGER code, z = round(-min / scale), e.g. torch.uint8 or "
                             "torch.int32")
    lo, hi, z_ref = _int_reference(x, bits, dim, scale)
    if not torch.allclose(scale.double(), (hi - lo) / (2 ** bits - 1), rtol=1e-4, atol=1e-7):
        raise fail(NAME_INT, f"{where}: scale should be (max - min) / (2**bits - 1) over a range "
                             "that INCLUDES 0 (min clamped to <= 0, max to >= 0), so that 0 is a "
                             "code")
    if not torch.equal(z.long(), z_ref.long()):
        raise fail(NAME_INT, f"{where}: zero_point should be round(-min / scale), clamped to "
                             f"[0, {2 ** bits - 1}]")
    xhat = learner_call(NAME_INT, f"{where}: dequantize_int(q, scale, zero_point)", dequantize_int,
                        q, scale, z)
    err = (xhat.double() - x.double()).abs()
    if (err > scale.double() / 2 * (1 + 1e-4) + 1e-6).any():
        raise fail(NAME_INT, f"{where}: the round trip is off by up to {(err / scale).max():.3g} "
                             "steps (at most half a step): x_hat = (q - zero_point) * scale, with "
                             "q = clamp(round(x / scale) + zero_point, 0, 2**bits - 1)")
    zeros = learner_call(NAME_INT, "dequantize_int of an exact 0", dequantize_int,
                         z.to(q.dtype).expand_as(scale).clone(), scale, z)
    if (zeros != 0).any():
        raise fail(NAME_INT, f"{where}: the code zero_point must give back exactly 0.0")


def check_quantize_int(quantize_int, dequantize_int) -> None:
    """Grade min/max quantization with an integer zero point (0.0 represented exactly)."""
    g = torch.Generator().manual_seed(8080)
    x = torch.randn(2, 3, 10, 8, generator=g)
    x[0, 0] += 5                                           # slices with only positive values
    x[1, 2] -= 5                                           # ... and only negative ones
    cases = [(x, bits, dim) for bits in (8, 4, 2) for dim in (-1, -2)]
    for case in cases:
        _check_int_case(quantize_int, dequantize_int, *case)
    expect_value_error(NAME_INT, "bits=3: bits must be one of (2, 4, 8), so this", quantize_int,
                       x.clone(), 3, -1)
    passed(NAME_INT, f"{len(cases)} tensors/bits/dims: integer zero points, 0.0 exact, within "
                     "half a step, also on all-positive and all-negative slices")
