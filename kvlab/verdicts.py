"""Sentences computed from measurements, never typed: which variant wins, by how much, on what.

A chapter that writes "A is several times faster than B" is only true on the machine its author
used. These helpers turn the numbers of the run that builds the page into the sentence, and name
the device in it, so the page stays true when it is rebuilt on a GPU.

The wording convention (chapters and their helpers follow it; see also
``/work/notes/chapter-conventions.md`` and the chapters' "What to take away" sections):

* **Lead with the measured ratio, then its spread.** "ours is 6.50x faster than transformers (time
  ratio 0.15, 0.12 to 0.18 within the runs' spread): ..." The number comes first; the words after it
  say how far the runs let a reader trust it. A sentence never contradicts the ratio printed in it.
* **Then one of three verdicts**, decided by :func:`compare_timings` (``Comparison.verdict``):

  - ``"every round"`` -- *faster in every round*: the medians differ by more than ``NOISE`` and the
    faster variant won each interleaved round (pairwise; sample ranges when the counts differ);
  - ``"median"`` -- *faster in the median, runs overlap*: the medians differ by more than ``NOISE``
    but some round went the other way; the sentence says in how many rounds each won, and the
    difference is stated as measured, not as established;
  - ``"none"`` -- *no difference measured*: the medians differ by less than ``NOISE``.

  Never "not told apart" for a 6x gap: a large gap with overlapping noisy runs is "faster in the
  median, runs overlap".
* ``Comparison.apart`` (and :func:`told_apart`) keeps the stricter robust test: the interval of the
  ratio, each median moved by ``SPREAD`` MADs of its samples, lies outside the noise band. Callers
  that must *choose* (a best variant) use it; callers that *describe* use :func:`relation`.
* **Shares of a whole** whose parts can be negative (a part measured under its floor) are worded
  by :func:`share`: the denominator is the sum of the positive parts, and the negative ones are named
  apart, so a part never exceeds its whole.
* **Name the device** (:func:`on`) in every sentence that compares timings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median

import torch

from .provenance import device_name, threads_text
from .timing import Timing

#: Medians closer than this (relative) count as no difference measured, whatever their samples say.
NOISE = 0.10

#: How many median absolute deviations (MAD) of its samples a median may be off by. One MAD is about
#: 0.67 standard deviations of normal noise, so 3 MADs is about 2 standard deviations.
SPREAD = 3.0

#: The three verdicts, in the words the sentences use.
WORDS = {"every round": "faster in every round", "median": "faster in the median, runs overlap",
         "none": "no difference measured"}


def on(device, threads: int | None = None) -> str:
    """``"on <device>"``, short: the CPU's model name and thread count (``threads``, the count the
    measurement ran with, else torch's current one), or the GPU's name."""
    name = device_name(device)
    if torch.device(device).type == "cpu":
        n = threads or torch.get_num_threads()
        return f"on this CPU with {threads_text(n, 'torch thread')}"
    return f"on {name}"


def mad(samples) -> float:
    """Median absolute deviation from the median: a spread that one outlier cannot inflate."""
    m = median(samples)
    return median(abs(x - m) for x in samples)


@dataclass(frozen=True)
class Comparison:
    """Two timings compared: the ratio of medians ``a / b``, a robust interval around it, the verdict.

    ``verdict`` is one of :data:`WORDS` (see the module docstring); ``wins`` counts the rounds in
    which the variant with the lower median was faster, out of ``rounds``. ``apart`` is the stricter
    robust test (the whole MAD interval outside the noise band); ``reason`` names the condition that
    decided it: ``"apart"``, ``"close"`` (medians within ``noise``) or ``"spread"`` (the medians
    differ, but the samples' spread reaches into the noise band).
    """

    ratio: float
    low: float
    high: float
    apart: bool
    reason: str
    n: int
    verdict: str = "none"
    wins: int = 0
    rounds: int = 0


def _rounds(a: list[float], b: list[float], a_faster: bool) -> tuple[int, int]:
    """How many rounds the lower-median variant won: pairwise when the runs were interleaved one
    for one, else by ranges (every sample of one below every sample of the other, or none)."""
    fast, slow = (a, b) if a_faster else (b, a)
    if len(fast) == len(slow):
        return sum(f < s for f, s in zip(fast, slow)), len(fast)
    n = min(len(fast), len(slow))
    return (n if max(fast) < min(slow) else 0), n


def compare_timings(a: Timing, b: Timing, noise: float = NOISE, spread: float = SPREAD) -> Comparison:
    """Ratio of medians ``a / b``, its robust interval, and the verdict (module docstring).

    Each median may be off by ``spread`` times its samples' MAD; the interval of the ratio is the
    worst case of both, ``[(ma - sa) / (mb + sb), (ma + sa) / (mb - sb)]``. Medians and MADs ignore
    one outlier among three samples or more, so one descheduled run cannot hide a real difference.
    A bootstrap would not help with the three to five runs a page can afford.
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
    wins, rounds = _rounds(a.samples, b.samples, r <= 1)
    verdict = "none" if reason == "close" else "every round" if wins == rounds else "median"
    return Comparison(r, low, high, reason == "apart", reason, min(len(a.samples), len(b.samples)),
                      verdict, wins, rounds)


def told_apart(a: Timing, b: Timing, noise: float = NOISE) -> bool:
    """True when the medians differ by more than ``noise``, beyond the samples' spread (:func:`compare_timings`)."""
    return compare_timings(a, b, noise).apart


def relation(c: Comparison, win: str, lose: str, better: str = "faster", noise: float = NOISE) -> str:
    """The verdict's words for a comparison whose lower-median side is ``win``: ``"faster in every
    one of the 5 rounds"``, ``"faster in the median, runs overlap (win faster in 3 of 5 rounds)"``,
    ``"no difference measured (medians within 10%)"``."""
    if c.verdict == "none":
        return f"no difference measured (medians within {noise:.0%})"
    if c.verdict == "every round":
        return (f"{better} in the one round measured" if c.rounds == 1 else
                f"{better} in every one of the {c.rounds} rounds")
    return (f"{better} in the median, runs overlap ({win} {better} in {c.wins} of {c.rounds} rounds, "
            f"{lose} in the others)" if c.wins else
            f"{better} in the median, runs overlap (the sample ranges of {win} and {lose} overlap)")


def faster(a: Timing, b: Timing, device, name_a: str | None = None, name_b: str | None = None,
           noise: float = NOISE) -> str:
    """``"A is 2.30x faster than B (time ratio 0.43, 0.40 to 0.47 within the runs' spread): faster in
    every one of the 5 rounds; medians of 5 rounds of one interleaved run on DEVICE"``; the ratio leads, the
    verdict (:func:`relation`) follows and never contradicts it."""
    name_a, name_b = name_a or a.label, name_b or b.label
    c = compare_timings(a, b, noise)
    # the threads the samples ran with, where both recorded the same count (else torch's current one)
    threads = a.threads if a.threads == b.threads else None
    how = f"medians of {c.n} round{'s' if c.n != 1 else ''} of one interleaved run {on(device, threads)}"
    if c.verdict == "none":
        return (f"{name_a} and {name_b}: time ratio {c.ratio:.2f} ({c.low:.2f} to {_num(c.high)} within the runs' "
                f"spread), {relation(c, name_a, name_b, noise=noise)}; {how}")
    # the time ratio is always the faster one's over the slower one's (below 1), whatever the argument order
    win, lose = (name_a, name_b) if c.ratio < 1 else (name_b, name_a)
    ratio, low, high = ((c.ratio, c.low, c.high) if c.ratio < 1 else
                        (1 / c.ratio, 1 / c.high if c.high else math.inf, 1 / c.low if c.low else math.inf))
    interval = f"time ratio {ratio:.2f}, {low:.2f} to {_num(high)} within the runs' spread"
    said = relation(c, win, lose, noise=noise)
    if c.verdict == "every round" and c.rounds > 1 and high >= 1:
        # won every paired round, yet the interval of the medians reaches past 1: say why both hold
        said += (f" (the spread reaches past 1.00 because the machine's speed moved from round to round and "
                 f"moved both; timed back to back within each round, {win} was the faster every time)")
    return f"{win} is {1 / ratio:.2f}x faster than {lose} ({interval}): {said}; {how}"


def _num(x: float) -> str:
    return "unbounded" if math.isinf(x) else f"{x:.2f}"


def share(part: float, parts, unit: str = "ms", scale: float = 1e3, what: str = "above their floors",
          label: str = "") -> str:
    """``part`` as a share of the positive ``parts``: ``"3.955 ms, 84% of the 4.710 ms the parts
    spend above their floors (one part ran 3.940 ms under its floor)"``. A part measured under its
    floor is negative; summing it in would make a part exceed its whole, so it is named apart.
    ``label`` follows the part's value (``" above it"``)."""
    parts = list(parts)
    pos = sum(p for p in parts if p > 0)
    neg = [p for p in parts if p < 0]
    if part <= 0 or pos <= 0:
        head = f"{part * scale:.3f} {unit}{label}, none of the {pos * scale:.3f} {unit} the parts spend {what}"
    else:
        head = f"{part * scale:.3f} {unit}{label}, {part / pos:.0%} of the {pos * scale:.3f} {unit} the parts spend {what}"
    if not neg:
        return head
    under = " and ".join(f"{-p * scale:.3f} {unit}" for p in neg)
    return head + f" ({len(neg)} part{'s' * (len(neg) > 1)} ran {under} under {'their' if len(neg) > 1 else 'its'} floor)"


def ratio_word(r: float, noise: float = NOISE) -> str:
    """A measured ratio in words: ``"2.5x larger"``, ``"4.0x smaller (75% less)"``, ``"about the
    same (1.04x)"``. Never "4.0x less": a ratio under 1 reads as a division and a share."""
    if abs(r - 1) < noise:
        return f"about the same ({r:.2f}x)"
    return f"{r:.1f}x larger" if r > 1 else f"{1 / r:.1f}x smaller ({1 - r:.0%} less)"


def compare_amounts(x: float, y: float, name_x: str, name_y: str, what: str, device,
                    noise: float = NOISE) -> str:
    """``"<what> of X: 3.1x that of Y, on DEVICE"``, for measured amounts (bytes, counts); a smaller
    amount reads ``"1.8x smaller than that of Y (45% less)"``."""
    r = x / y
    if abs(r - 1) < noise:
        rel = f"about the same as that of {name_y} ({r:.2f}x)"
    elif r > 1:
        rel = f"{r:.1f}x that of {name_y}"
    else:
        rel = f"{1 / r:.1f}x smaller than that of {name_y} ({1 - r:.0%} less)"
    return f"{what} of {name_x}: {rel}, {on(device)}"


def series(xs, ys, xname: str, yname: str, unit: str = "x", digits: int = 2) -> str:
    """How a measured series moves, read from every point, not its ends alone (first against last
    hides a peak inside the sweep or a jump at its last point): how long it stays within ``NOISE``
    of its first value, where it ends, and its maximum and minimum where they lie inside the sweep.
    ``"cat's work stays within 10% of 12.0 µs from p=16 to p=64, then rises to 399.0 µs at p=512
    (its maximum)"``."""
    xs, ys = list(xs), [float(y) for y in ys]
    if len(xs) != len(ys) or not ys:
        raise ValueError(f"series needs one y per x and at least one point, got {len(xs)} x and {len(ys)} y")
    v = lambda y: f"{y:.{digits}f}{unit}"
    if len(ys) == 1:
        return f"{yname} is {v(ys[0])} at {xname}={xs[0]}"
    band = f"within {NOISE:.0%} of"
    near = [abs(y / ys[0] - 1) <= NOISE if ys[0] else y == 0 for y in ys]
    if all(near):
        return (f"{yname} stays {band} its first value from {xname}={xs[0]} to {xname}={xs[-1]} "
                f"({v(min(ys))} to {v(max(ys))})")
    k, last = near.index(False), len(ys) - 1      # the first point out of the band; the last point
    text = (f"{yname} stays {band} {v(ys[0])} from {xname}={xs[0]} to {xname}={xs[k - 1]}, then " if k > 1
            else f"{yname} starts at {v(ys[0])} at {xname}={xs[0]}, then ")
    if near[last]:
        text += f"ends {band} where it started, at {v(ys[last])} at {xname}={xs[last]}"
    else:
        text += f"{'rises' if ys[last] > ys[0] else 'falls'} to {v(ys[last])} at {xname}={xs[last]}"
    top = max(range(len(ys)), key=ys.__getitem__)
    low = min(range(len(ys)), key=ys.__getitem__)
    inner = [f"its {w}, {v(ys[i])}, is at {xname}={xs[i]}" for w, i in (("maximum", top), ("minimum", low))
             if 0 < i < last and not near[i]]
    at_end = [w for w, i in (("maximum", top), ("minimum", low)) if i == last and not near[last]]
    return text + (f" (its {at_end[0]})" if at_end else "") + "".join("; " + e for e in inner)


def trend(xs, ys, xname: str, yname: str, device, unit: str = "x", digits: int = 2) -> str:
    """:func:`series` with the device it was measured on: ``"... rises to 3.00x at N=4 on DEVICE"``."""
    return f"{series(xs, ys, xname, yname, unit, digits)} {on(device)}"


def quantization(rows: dict, kivi: str, device) -> tuple[list[dict], str]:
    """Chapter 5's comparisons from its rows (``{(name, bits): {"kl", "agree", "ppl_change", "frac"}}``),
    as table rows (one per scheme and bit width, most bits first) and their caption: each scheme's KL
    divergence and bytes, and its KL against KIVI's at the same bits in words (:func:`ratio_word`),
    so no comparison is typed. A table, not a block of sentences: fifteen lines of prose hid it."""
    out = []
    for (name, bits), r in sorted(rows.items(), key=lambda kv: (-kv[0][1], kv[0][0] != kivi)):
        k = rows.get((kivi, bits))
        against = "-" if name == kivi or k is None else ratio_word(r["kl"] / max(k["kl"], 1e-12))
        out.append({"scheme": name, "bits": bits, "KL (nats)": f"{r['kl']:.1e}", "bytes of fp32": f"{r['frac']:.0%}",
                    "KL against KIVI's at these bits": against})
    return out, (f"each scheme's KL divergence from full precision against KIVI's at the same bits, measured "
                 f"{on(device)} (the full rows are in the table above)")
