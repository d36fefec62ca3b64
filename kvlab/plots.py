"""One place for the book's figures: size, labels, and a provenance stamp on every one.

Chapter cells keep the data work; the drawing conventions live here. Every figure ends with
:func:`finish`, which writes along its bottom the device (and CPU thread count), the model and its
kind, and the versions of torch and transformers that produced it, then renders it (inline).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import PercentFormatter

from .provenance import MIN_FONT, stamp_figure


def figure(ncols: int = 1, nrows: int = 1, size=(7, 4), **kw):
    """``plt.subplots`` with the book's default size; returns ``(fig, ax)``."""
    return plt.subplots(nrows, ncols, figsize=size, **kw)


def finish(fig, model, device, legend=(), fontsize: float = MIN_FONT, show: bool = True) -> None:
    """Legends on the axes in ``legend``, then the provenance stamp (which brings the text to reading
    size and lays the figure out), then render."""
    for ax in legend:
        ax.legend(fontsize=max(fontsize, MIN_FONT))
    stamp_figure(fig, model, device)
    if show:
        plt.show()


def series(ax, xs, named: dict, xlabel: str, ylabel: str, title: str = "", marks: str = "os^v<>dp",
           lw: float = 1.5, **set_kw) -> None:
    """One line per entry of ``named`` (label -> y values over ``xs``); ``marks=""`` draws no markers."""
    for i, (label, ys) in enumerate(named.items()):
        m = marks[i % len(marks)] if marks else ""
        ax.plot(xs, ys, f"{m}-", label=label, lw=lw)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, **set_kw)


def published(ax, points: dict) -> None:
    """Figures quoted from a source, drawn distinctly: label -> (xs, ys)."""
    for (label, (xs, ys)), m, c in zip(points.items(), "^v", ("C3", "C4")):
        ax.plot(xs, ys, f"{m}--", ms=9, color=c, label=label)


def barh(ax, values: dict, xlabel: str, title: str = "", colors=None) -> None:
    """Horizontal bars, first entry on top."""
    ax.barh(list(values), list(values.values()), color=colors)
    ax.set(xlabel=xlabel, title=title)
    ax.invert_yaxis()


def share_axis(ax, ticks=(0.15, 0.2, 0.3, 0.5, 1.0), label: str = "") -> None:
    """A log x axis of shares (fractions drawn as percentages)."""
    ax.set_xscale("log")
    ax.set_xticks(list(ticks))
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_xlabel(label)


def bars_against_floor(ax, rows: list[dict], group_key, variant_key: str, variants, group_label,
                       title: str, hatched=()) -> None:
    """Measured ms per token as bars, one group per ``group_key(row)``, one bar per variant, and
    each group's floor as a black tick (chapters 7 and 8). Rows hold ``per_token`` and
    ``floor_per_token`` in seconds."""
    groups = list(dict.fromkeys(group_key(r) for r in rows))
    width = 0.8 / len(variants)
    shift = (len(variants) - 1) / 2
    for j, variant in enumerate(variants):
        ys = [next(r["per_token"] for r in rows if group_key(r) == g and r[variant_key] == variant)
              for g in groups]
        ax.bar([i + (j - shift) * width for i in range(len(groups))], [y * 1e3 for y in ys], width,
               label=variant, hatch="//" if variant in hatched else None)
    for i, g in enumerate(groups):
        floor = next(r["floor_per_token"] for r in rows if group_key(r) == g)
        ax.hlines(floor * 1e3, i - 0.45, i + 0.45, color="k", lw=2, label="floor" if i == 0 else None)
    ax.set_xticks(range(len(groups)), [group_label(g) for g in groups], fontsize=MIN_FONT)
    ax.set(yscale="log", ylabel="ms per token (log)", title=title)
    # beside the axes, not over the bars: the tallest bars reach the top-right corner
    ax.legend(fontsize=MIN_FONT, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
