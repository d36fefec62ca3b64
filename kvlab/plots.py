"""One place for the book's figures: size, labels, and a provenance stamp on every one.

Chapter cells keep the data work; the drawing conventions live here. Every figure ends with
:func:`finish`, which writes along its bottom the device (and CPU thread count), the model and its
kind, and the versions of torch and transformers that produced it, then renders it (inline).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import PercentFormatter

from .models import stamp_figure


def figure(ncols: int = 1, nrows: int = 1, size=(7, 4), **kw):
    """``plt.subplots`` with the book's default size; returns ``(fig, ax)``."""
    return plt.subplots(nrows, ncols, figsize=size, **kw)


def finish(fig, model, device, legend=(), fontsize: int = 8, show: bool = True) -> None:
    """Legends on the axes in ``legend``, tight layout, the provenance stamp, then render."""
    for ax in legend:
        ax.legend(fontsize=fontsize)
    fig.tight_layout()
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
