"""What produced a number: the device, the model and the library versions, as a banner or a stamp.

Presentation: every figure and table of the book is stamped with these; `kvlab.report` adds the
machine's details for a recorded run.
"""

from __future__ import annotations
from pathlib import Path
import os
import platform
import warnings
import torch
from .tables import in_notebook


def threads_text(n: int, noun: str = "thread") -> str:
    """``"1 thread"``, ``"2 threads"`` (``noun="torch thread"``: ``"2 torch threads"``): a CPU thread
    count in words, as every output of the book prints it."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {cpu} ({os.cpu_count()} logical cores, {threads_text(torch.get_num_threads(), 'torch thread')})"


def describe(model) -> str:
    """One line: name, kind and shape of a model loaded by :func:`load`."""
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    kind = getattr(model, "kvlab_kind", "unknown")
    note = {"shape-only": "RANDOM WEIGHTS: shapes only, text is meaningless",
            "tiny": "bundled, trained on the KJV Bible",
            "real": "real pretrained weights"}.get(kind, "")
    return (f"{getattr(model, 'kvlab_name', cfg.name_or_path)} [{kind}: {note}] "
            f"{cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, context {cfg.n_positions}, "
            f"{n_params / 1e6:.1f}M parameters, {next(model.parameters()).dtype}")


def banner(model, device=None) -> str:
    """Show (and return) what produced this notebook's numbers: device, model, versions.

    In a notebook: one line, the details folded under it (HTML ``<details>``); elsewhere printed."""
    import html
    import transformers


    device = device or next(model.parameters()).device
    lines = [
        f"device       : {device_name(device)}",
        f"model        : {describe(model)}"
        + (f"\nchosen       : {model.kvlab_why}" if getattr(model, "kvlab_why", None) else ""),
        f"versions     : torch {torch.__version__}, transformers {transformers.__version__}, "
        f"python {platform.python_version()}",
    ]
    text = "\n".join(lines)
    if not in_notebook():
        print(text)
        return text
    from IPython.display import HTML, display
    summary = f"Produced by {stamp(model, device)}"
    display(HTML(f'<details class="kvlab-banner"><summary>{html.escape(summary)}</summary>'
                 f"<pre>{html.escape(text)}</pre></details>"))
    return text


def stamp(model, device=None) -> str:
    """A one-line provenance for a figure: device, model (and its kind), versions."""
    import transformers

    device = device or next(model.parameters()).device
    dev = device_name(device).split(" (")[0] if torch.device(device).type == "cpu" else device_name(device)
    threads = f", {threads_text(torch.get_num_threads())}" if torch.device(device).type == "cpu" else ""
    return (f"{dev}{threads} | {getattr(model, 'kvlab_name', '?')} ({getattr(model, 'kvlab_kind', '?')}) | "
            f"torch {torch.__version__}, transformers {transformers.__version__}")


#: The smallest font, in points, a reader meets in a figure shown at most ``COLUMN_IN`` inches wide
#: (the page's column). A wider figure is scaled down on the page, so its text needs more points.
MIN_FONT = 8.0
COLUMN_IN = 8.0


def min_font(fig) -> float:
    """The least font size (points) any text of ``fig`` may have: :data:`MIN_FONT`, scaled up by how
    much wider than the page's column the figure is (the page shrinks it to fit)."""
    return MIN_FONT * max(1.0, fig.get_figwidth() / COLUMN_IN)


def small_texts(fig) -> list[tuple[str, float]]:
    """Every visible, non-empty text of ``fig`` (labels, ticks, legends, annotations, the stamp) set
    smaller than :func:`min_font`, as ``(text, size)``: what a test or :func:`readable` looks at."""
    from matplotlib.text import Text

    least = min_font(fig) - 1e-6
    return [(t.get_text(), t.get_fontsize()) for t in fig.findobj(Text)
            if t.get_visible() and t.get_text().strip() and t.get_fontsize() < least]


def readable(fig):
    """Raise every text of ``fig`` smaller than :func:`min_font` to it (returns ``fig``). Called on
    every figure the book shows (:func:`stamp_figure`, ``kvlab.draw.Drawing``), so a label set at 6
    points in some helper cannot reach the page unreadable."""
    from matplotlib.text import Text

    least = min_font(fig)
    for t in fig.findobj(Text):
        if t.get_fontsize() < least:
            t.set_fontsize(least)
    return fig


def plain_log_labels(fig):
    """Tick labels of every log axis of ``fig`` as plain numbers ("0.5", "2", "20", "1000"), not
    matplotlib's "2x10^0" and "10^1" (returns ``fig``). Minor ticks are labelled at 2 and 5 of each
    decade when the axis spans two decades or less, else left unlabelled; a formatter a chapter set
    itself (a percentage axis) is kept."""
    import math

    from matplotlib.ticker import FuncFormatter, LogFormatterSciNotation, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")

    def minor(v, _):
        lead = v / 10 ** math.floor(math.log10(v) + 1e-9) if v > 0 else 0
        return f"{v:g}" if round(lead, 6) in (2.0, 5.0) else ""

    for ax in fig.axes:
        for axis, scale, lim in ((ax.xaxis, ax.get_xscale(), ax.get_xlim()), (ax.yaxis, ax.get_yscale(), ax.get_ylim())):
            if scale != "log" or not isinstance(axis.get_major_formatter(), LogFormatterSciNotation):
                continue
            axis.set_major_formatter(plain)
            lo, hi = sorted(lim)
            narrow = lo > 0 and math.log10(hi / lo) <= 2
            axis.set_minor_formatter(FuncFormatter(minor) if narrow else NullFormatter())
    return fig


def stamp_figure(fig, model, device=None) -> None:
    """Write :func:`stamp` along the bottom of a matplotlib figure, make all its text
    :func:`readable` and its log axes' labels plain numbers (:func:`plain_log_labels`)."""
    plain_log_labels(fig)
    readable(fig)                       # final sizes first, so the layout is made for them
    if fig.get_layout_engine() is None:
        # lay the axes out first (a y label into its neighbour's ticks, slanted tick labels), as
        # plots.finish does; a figure with a layout engine of its own keeps it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fig.tight_layout()
    text = fig.text(0.005, 0.005, stamp(model, device), fontsize=min_font(fig), color="0.35", ha="left", va="bottom")
    _clear_the_stamp(fig, text)


def _clear_the_stamp(fig, text) -> None:
    """Raise the axes until nothing they draw (rotated tick labels above all) reaches into the
    stamp's line: a fixed margin left chapter 9's slanted bar labels written over it."""
    renderer = fig.canvas.get_renderer()
    top = text.get_window_extent(renderer).y1 / fig.bbox.height           # the stamp's top, figure fraction
    low = min((ax.get_tightbbox(renderer).y0 / fig.bbox.height for ax in fig.axes if ax.get_visible()),
              default=1.0)
    gap = 0.4 * text.get_fontsize() / 72 / fig.get_figheight()          # a little air between them
    if low < top + gap:
        fig.subplots_adjust(bottom=min(fig.subplotpars.bottom + top + gap - low, 0.6))
