"""Sentences computed from measurements, never typed: which variant wins, by how much, on what.

A chapter that writes "A is several times faster than B" is only true on the machine its author
used. These helpers turn the numbers of the run that builds the page into the sentence, and name
the device in it, so the page stays true when it is rebuilt on a GPU. Two timings whose medians
differ by less than ``NOISE``, or by less than their samples' spread, are reported as *not told
apart*, and the sentence says which of the two held: on a shared CPU a 10% difference is within the
noise of one run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median

import torch

from .provenance import device_name
from .timing import Timing

#: Medians closer than this (relative) are not told apart, whatever their samples say.
NOISE = 0.10

#: How many median absolute deviations (MAD) of its samples a median may be off by. One MAD is about
#: 0.67 standard deviations of normal noise, so 3 MADs is about 2 standard deviations.
SPREAD = 3.0


def on(device) -> str:
    """``"on <device>"``, short: the CPU's model name and thread count, or the GPU's name."""
    name = device_name(device)
    if torch.device(device).type == "cpu":
        n = torch.get_num_threads()
        return f"on this CPU with {n} torch thread{'' if n == 1 else 's'}"
    return f"on {name}"


def mad(samples) -> float:
    """Median absolute deviation from the median: a spread that one outlier cannot inflate."""
    m = median(samples)
    return median(abs(x - m) for x in samples)


@dataclass(frozen=True)
class Comparison:
    """Two timings compared: the ratio of medians ``a / b``, a robust interval around it, the verdict.

    ``reason`` names the condition that decided: ``"apart"`` (the interval lies outside the noise
    band), ``"close"`` (the medians differ by less than ``noise``) or ``"spread"`` (the medians
    differ, but the samples' spread reaches into the noise band).
    """

    ratio: float
    low: float
    high: float
    apart: bool
    reason: str
    n: int


def compare_timings(a: Timing, b: Timing, noise: float = NOISE, spread: float = SPREAD) -> Comparison:
    """Ratio of medians ``a / b`` and whether the two are told apart.

    Each median may be off by ``spread`` times its samples' MAD; the interval of the ratio is the
    worst case of both, ``[(ma - sa) / (mb + sb), (ma + sa) / (mb - sb)]``. They are told apart when
    the ratio is outside ``1 +- noise`` and the whole interval is too. Medians and MADs ignore one
    outlier among three samples or more, so one descheduled run cannot hide a real difference (the
    ranges of the samples could: one slow run makes them overlap). A bootstrap would not help with
    the three to five runs a page can afford: a third to a quarter of its resamples would take the
    outlier as their median.
    """
    if not a.samples or not b.samples:
        raise ValueError(f"both timings need samples, got {len(a.samples)} and {len(b.samples)}")
    ma, mb = a.median, b.median
    sa, sb = spread * mad(a.samples), spread * mad(b.samples)
    r = ma / mb
    low = max(ma - sa, 0.0) / (mb + sb)
    high = (ma + sa) / (mb - sb) if mb > sb else math.inf
    band = (1 / (1 + noise), 1 + noise)
    if band[0] < r < band[1]:
        reason = "close"
    elif low >= band[1] or high <= band[0]:
        reason = "apart"
    else:
        reason = "spread"
    return Comparison(r, low, high, reason == "apart", reason, min(len(a.samples), len(b.samples)))


def told_apart(a: Timing, b: Timing, noise: float = NOISE) -> bool:
    """True when the medians differ by more than ``noise``, beyond the samples' spread (:func:`compare_timings`)."""
    return compare_timings(a, b, noise).apart


def faster(a: Timing, b: Timing, device, name_a: str | None = None, name_b: str | None = None,
           noise: float = NOISE) -> str:
    """``"A is 2.3x faster than B on DEVICE"``, or that the two were not told apart, and why."""
    name_a, name_b = name_a or a.label, name_b or b.label
    c = compare_timings(a, b, noise)
    how = f"medians of {c.n} interleaved run{'s' if c.n != 1 else ''} {on(device)}"
    interval = f"time ratio {c.ratio:.2f}, {c.low:.2f} to {c.high:.2f} within the runs' spread"
    if c.reason == "close":
        return (f"{name_a} and {name_b} were not told apart: their medians differ by less than "
                f"{noise:.0%} (time ratio {c.ratio:.2f}; {how})")
    if c.reason == "spread":
        return (f"{name_a} and {name_b} were not told apart: their medians differ ({interval}), but "
                f"the runs' spread reaches within {noise:.0%} of equal ({how})")
    win, lose = (name_a, name_b) if c.ratio < 1 else (name_b, name_a)
    r = max(c.ratio, 1 / c.ratio)
    return f"{win} is {r:.2f}x faster than {lose} ({interval}; {how})"


def ratio_word(r: float, noise: float = NOISE) -> str:
    """A measured ratio in words: ``"2.3x more"``, ``"2.5x less"``, ``"about the same (1.04x)"``."""
    if abs(r - 1) < noise:
        return f"about the same ({r:.2f}x)"
    return f"{r:.1f}x more" if r > 1 else f"{1 / r:.1f}x less"


def compare_amounts(x: float, y: float, name_x: str, name_y: str, what: str, device,
                    noise: float = NOISE) -> str:
    """``"<what> of X: 3.1x that of Y, on DEVICE"``, for measured amounts (bytes, counts)."""
    r = x / y
    if abs(r - 1) < noise:
        rel = f"about the same as that of {name_y} ({r:.2f}x)"
    elif r > 1:
        rel = f"{r:.1f}x that of {name_y}"
    else:
        rel = f"{1 / r:.1f}x less than that of {name_y}"
    return f"{what} of {name_x}: {rel}, {on(device)}"


def trend(xs, ys, xname: str, yname: str, device, unit: str = "x") -> str:
    """How a measured series moves: ``"<yname> rises from 1.4x at N=16 to 4.1x at N=128 on DEVICE"``."""
    xs, ys = list(xs), list(ys)
    if len(ys) < 2:
        return f"{yname} is {ys[0]:.2f}{unit} at {xname}={xs[0]} {on(device)}"
    first, last = ys[0], ys[-1]
    verb = ("rises" if last > first * (1 + NOISE) else "falls" if last < first * (1 - NOISE)
            else "stays level")
    return (f"{yname} {verb} from {first:.2f}{unit} at {xname}={xs[0]} to {last:.2f}{unit} at "
            f"{xname}={xs[-1]} {on(device)}")




def quantization(rows: dict, kivi: str, tensor: str, token: str, resid: str, device) -> str:
    """Chapter 5's comparisons from its rows (``{(name, bits): {"kl", "agree", "ppl_change", "frac"}}``)."""
    def kl_ratio(name, bits):
        return ratio_word(rows[name, bits]["kl"] / max(rows[kivi, bits]["kl"], 1e-12))

    lines = [f"measured {on(device)}, against full precision:"]
    for bits in sorted({b for n, b in rows if n == kivi}, reverse=True):
        k, r = rows[kivi, bits], rows[resid, bits]
        lines.append(f"{bits} bits: KIVI KL {k['kl']:.1e}, top-1 {k['agree']:.1%}, ppl {k['ppl_change']:+.2%}, "
                     f"{k['frac']:.0%} of the fp32 bytes; KL of per tensor: {kl_ratio(tensor, bits)}, "
                     f"of per-token keys: {kl_ratio(token, bits)} than KIVI's; + residual: KL "
                     f"{r['kl']:.1e}, ppl {r['ppl_change']:+.2%}, {r['frac']:.0%} of the bytes")
    for (name, bits), r in rows.items():
        if name.startswith(("transformers", "article")):
            lines.append(f"{name}, {bits} bits: KL {r['kl']:.1e}, top-1 {r['agree']:.1%}, "
                         f"{r['frac']:.0%} of the fp32 bytes (KIVI at {bits} bits: KL "
                         f"{rows[kivi, bits]['kl']:.1e}, {rows[kivi, bits]['frac']:.0%})")
    return "\n".join(lines)
