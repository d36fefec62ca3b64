"""The lab-5 grader accepts the reference quantizer and rejects each known mistake with a pointed message."""

import pytest
import torch

from kvlab.course.checks import check_quantize
from kvlab.quant import dequantize, quantize

from utils import expect_rejected, hands_over_code, one_step_removed, own_copy

quantize, dequantize = own_copy(quantize), own_copy(dequantize)   # not the library's own


def test_accepts_reference(capsys):
    check_quantize(quantize, dequantize)
    assert "PASSED check_quantize" in capsys.readouterr().out


def _validate(bits):
    if bits not in (2, 4, 8):
        raise ValueError("bits must be one of (2, 4, 8)")


def integer_zero_point(x, bits, dim):
    """Also correct: the integer-library convention x_hat = (q - z) * scale with a float z."""
    _validate(bits)
    levels = 2 ** bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    z = -lo / scale
    return torch.round(x / scale + z).clamp(0, levels).to(torch.uint8), scale, z


def integer_dequantize(q, scale, z):
    return (q.float() - z) * scale


def test_accepts_integer_zero_point_convention(capsys):
    check_quantize(integer_zero_point, integer_dequantize)
    assert "PASSED" in capsys.readouterr().out


def one_scale_for_whole_tensor(x, bits, dim):
    _validate(bits)
    levels = 2 ** bits - 1
    lo, hi = x.min(), x.max()
    scale = (hi - lo) / levels
    return torch.round((x - lo) / scale).clamp(0, levels).to(torch.uint8), scale, lo


def whole_tensor_scale_expanded(x, bits, dim):
    q, scale, lo = one_scale_for_whole_tensor(x, bits, dim)
    shape = [1 if i == dim % x.dim() else s for i, s in enumerate(x.shape)]
    return q, scale.expand(shape), lo.expand(shape)


def wrong_axis(x, bits, dim):
    return quantize(x, bits, -1)             # ignores dim: always per last axis


def other_axes(x, bits, dim):
    """Keeps dim and reduces every other axis (the opposite reading of 'along dim')."""
    _validate(bits)
    levels = 2 ** bits - 1
    others = tuple(i for i in range(x.dim()) if i != dim % x.dim())
    lo, hi = x.amin(others, keepdim=True), x.amax(others, keepdim=True)
    scale = (hi - lo) / levels
    return torch.round((x - lo) / scale).clamp(0, levels).to(torch.uint8), scale, lo


def floats_stored(x, bits, dim):
    """Article A: the rounded codes kept in the float dtype."""
    q, scale, lo = quantize(x, bits, dim)
    return q.to(x.dtype), scale, lo


def int32_codes(x, bits, dim):
    q, scale, lo = quantize(x, bits, dim)
    return q.to(torch.int32), scale, lo


def truncation(x, bits, dim):
    _validate(bits)
    levels = 2 ** bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((x - lo) / scale).clamp(0, levels).to(torch.uint8), scale, lo     # .to(uint8) truncates


def two_pow_bits_levels(x, bits, dim):
    _validate(bits)
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo) / 2 ** bits
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round((x - lo) / scale).clamp(0, 2 ** bits - 1).to(torch.uint8), scale, lo


def nan_on_constant(x, bits, dim):
    _validate(bits)
    levels = 2 ** bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo) / levels                                       # 0 on a constant slice
    return torch.round((x - lo) / scale).clamp(0, levels).to(torch.uint8), scale, lo


def any_bits(x, bits, dim):
    levels = 2 ** bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = torch.where(hi > lo, (hi - lo) / levels, torch.ones_like(lo))
    return torch.round((x - lo) / scale).clamp(0, levels).to(torch.uint8), scale, lo


def wrong_error_type(x, bits, dim):
    if bits not in (2, 4, 8):
        raise TypeError("bad bits")
    return quantize(x, bits, dim)


def dequantize_forgets_zero_point(q, scale, zero_point):
    return q.to(scale.dtype) * scale


def in_place(x, bits, dim):
    out = quantize(x, bits, dim)
    x.mul_(2)
    return out


@pytest.mark.parametrize("impl, needles", [
    (one_scale_for_whole_tensor, ["one scale for the whole tensor"]),
    (whole_tensor_scale_expanded, ["one scale for the whole tensor"]),
    (wrong_axis, ["wrong axis"]),
    (other_axes, ["wrong axis"]),
    (floats_stored, ["article a", "uint8"]),
    (int32_codes, ["torch.uint8"]),
    (truncation, ["truncate", "rounding to the nearest code"]),
    (two_pow_bits_levels, ["2**bits - 1"]),
    (nan_on_constant, ["constant slice", "nan"]),
    (any_bits, ["valueerror", "(2, 4, 8)"]),
    (wrong_error_type, ["valueerror", "typeerror"]),
    (in_place, ["in place"]),
])
def test_rejects(impl, needles):
    message = expect_rejected(lambda f: check_quantize(f, dequantize), impl, *needles)
    assert not hands_over_code(message), message        # the mistake and the contract, not a line of code


def test_rejects_dequantize_without_zero_point():
    expect_rejected(lambda f: check_quantize(quantize, f), dequantize_forgets_zero_point, "zero_point")


# ------------------------------------------------ issue 18: dtypes, bits, integer zero point

from kvlab.course.checks import check_quantize_int  # noqa: E402


def stats_in_float32(x, bits, dim):
    q, scale, zp = quantize(x.float(), bits, dim)
    return q, scale, zp


def even_bits_only(x, bits, dim):
    if bits % 2 or not 2 <= bits <= 8:
        raise ValueError("bits")
    return quantize(x, 8 if bits == 6 else bits, dim)


@pytest.mark.parametrize("impl, needles", [
    (stats_in_float32, ["float16", "keep the input's dtype"]),
    (even_bits_only, ["bits=6", "ValueError"]),
])
def test_rejects_hardened(impl, needles):
    expect_rejected(lambda f: check_quantize(f, dequantize), impl, *needles)


def quantize_int(x, bits, dim, include_zero=True, int_zp=True):
    if bits not in (2, 4, 8):
        raise ValueError("bits")
    levels = 2 ** bits - 1
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    if include_zero:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scale = (hi - lo) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    z = torch.round(-lo / scale).clamp(0, levels)
    z = z.to(torch.uint8) if int_zp else z
    return (torch.round(x / scale) + z).clamp(0, levels).to(torch.uint8), scale, z


def dequantize_int(q, scale, z):
    return (q.to(scale.dtype) - z.to(scale.dtype)) * scale


def test_quantize_int():
    check_quantize_int(quantize_int, dequantize_int)
    check = lambda f: check_quantize_int(f, dequantize_int)  # noqa: E731
    expect_rejected(check, lambda x, b, d: quantize_int(x, b, d, int_zp=False), "INTEGER")
    expect_rejected(check, lambda x, b, d: quantize_int(x, b, d, include_zero=False), "INCLUDES 0")


# ------------------------------------------------ issue 24: devices, stale answers, the library

def codes_on_cpu(x, bits, dim):
    """Reads no value (so meta can judge it), but builds the codes with no device=: right on a CPU only."""
    _validate(bits)
    levels = 2 ** bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((x - lo) / scale).clamp(0, levels)
    return torch.zeros(x.shape, dtype=torch.uint8) + codes.to("cpu", torch.uint8) \
        if x.device.type != "meta" else torch.zeros(x.shape, dtype=torch.uint8), scale, lo


_FIRST: dict = {}


def remembers_by_shape(x, bits, dim):
    key = (tuple(x.shape), bits, dim, x.dtype, x.device)
    if key not in _FIRST:
        _FIRST[key] = quantize(x, bits, dim)
    return _FIRST[key]


def reads_values(x, bits, dim):
    """Correct, but reads values (a boolean index): nothing to judge on meta, and that is fine."""
    q, scale, zp = quantize(x, bits, dim)
    if (scale == 0).any():
        scale[scale == 0] = 1.0
    return q, scale, zp


@pytest.mark.parametrize("impl, needles", [
    (codes_on_cpu, ["meta", "q on cpu"]),
    (remembers_by_shape, ["x of shape [2, 3, 24, 16], bits=4, dim=-1"]),
])
def test_rejects_issue_24(impl, needles):
    _FIRST.clear()
    expect_rejected(lambda q: check_quantize(q, dequantize), impl, *needles)


def test_accepts_code_that_reads_values(capsys):
    check_quantize(reads_values, dequantize)
    assert "meta not judged" in capsys.readouterr().out


def test_library_refused():
    from kvlab import quant

    expect_rejected(lambda pair: check_quantize(*pair), (quant.quantize, dequantize),
                    "kvlab.quant.quantize")


def test_the_library_one_step_removed_is_refused_by_what_runs():
    """Issue 34, kind 1, in lab 5: the library's quantizer without its name (next to the learner's own
    dequantize) is refused, naming what ran."""
    from kvlab import quant

    for how, impl in one_step_removed(quant.quantize).items():
        expect_rejected(lambda q: check_quantize(q, dequantize), impl, "ran kvlab.quant.quantize", "write it yourself")
