"""The memory calculator of chapter 4: open models' configs, and what fits on which GPU.

    all_models()                                   # GPT-2's sizes + models/configs/open-models.json
    calculator(config, seq_len, batch, dtype)      # cache, weights, fits / largest batch per GPU
    calculator_text(...), plot_calculator(...)     # the same result as text and as a bar chart
    calculator_widget(all_models())                # an ipywidgets front end for a live notebook

The arithmetic is ``kvlab.memory``; this module only reads the table and presents its numbers.
"""

from __future__ import annotations

import html

import torch

from .memory import GIB, bytes_per_token, kv_cache_bytes, max_batch_size, weights_bytes
from .configs import as_dtype, context_length
from .catalogue import all_models


#: Nominal memory of three common GPUs (24 GB: RTX 3090/4090, 80 GB: A100/H100, 141 GB: H200), taken
#: as GiB (2**30 bytes). What a program can really use is a little less (CUDA context, allocator).
GPU_SIZES_GB = (24, 80, 141)


def human_bytes(n: float, binary: bool = True) -> str:
    """``16777216 -> '16.0 MiB'`` (binary, powers of 1024) or ``'16.8 MB'`` (decimal, powers of 1000)."""
    base, units = (1024, ["B", "KiB", "MiB", "GiB", "TiB"]) if binary else (1000, ["B", "kB", "MB", "GB", "TB"])
    if isinstance(n, bool) or not isinstance(n, (int, float)):
        raise ValueError(f"human_bytes takes a number of bytes, got {n!r}")
    x, i = float(n), 0
    while abs(x) >= base and i < len(units) - 1:
        x /= base
        i += 1
    return f"{int(x)} B" if i == 0 else f"{x:.1f} {units[i]}"


def calculator(config, seq_len: int, batch_size: int, dtype, weights_dtype=torch.float16,
               gpus_gb=GPU_SIZES_GB) -> dict:
    """Everything the chapter's calculator shows for one setting, as plain numbers.

    Returns ``cache_bytes``, ``weights_bytes`` (in ``weights_dtype``), ``total_bytes``, and per GPU
    size (GiB): whether it fits and the largest batch at this ``seq_len`` after the weights.
    ``config`` may also be a name of :func:`all_models` (``"gpt2"``, ``"Llama-3.1-8B"``...).
    """
    config, dtype, weights_dtype = _check_setting(config, seq_len, batch_size, dtype, weights_dtype, gpus_gb)
    cache = kv_cache_bytes(config, seq_len, batch_size, dtype)
    weights = weights_bytes(config, weights_dtype)
    gpus = {}
    for gb in gpus_gb:
        free = gb * GIB - weights
        gpus[gb] = {"fits": cache + weights <= gb * GIB,
                    "max_batch": max_batch_size(config, seq_len, dtype, max(free, 0)) if seq_len else None}
    ctx = context_length(config)
    return {"cache_bytes": cache, "weights_bytes": weights, "total_bytes": cache + weights,
            "per_token_bytes": bytes_per_token(config, dtype), "gpus": gpus,
            "beyond_context": bool(ctx and seq_len > ctx), "context": ctx,
            "weights_dtype": str(as_dtype(weights_dtype)).replace("torch.", "")}


def _check_setting(config, seq_len, batch_size, dtype, weights_dtype, gpus_gb):
    """Refuse what the arithmetic would otherwise take silently (True as a batch, a 0 GiB GPU)."""
    if isinstance(config, str):
        table = all_models()
        if config not in table:
            raise ValueError(f"unknown model {config!r}; pass a config, or a name of all_models(): {sorted(table)}")
        config = table[config]
    for value, what in ((seq_len, "seq_len"), (batch_size, "batch_size")):
        if isinstance(value, bool):
            raise ValueError(f"{what} must be an int >= 0, got {value!r}")
    if isinstance(gpus_gb, (int, float)):
        raise ValueError(f"gpus_gb is a list of GPU sizes in GiB, got the single number {gpus_gb}; "
                         f"pass [{gpus_gb}]")
    bad = [g for g in gpus_gb if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g < float("inf")]
    if bad:
        raise ValueError(f"gpus_gb lists GPU memory sizes in GiB, each a number > 0; got {bad[0]!r} "
                         f"in {list(gpus_gb)}")
    return config, as_dtype(dtype), as_dtype(weights_dtype)


def plot_calculator(result: dict, ax, title: str = "") -> None:
    """Bar chart of a :func:`calculator` result: weights + cache against each GPU's memory."""
    gb = [g for g in result["gpus"]]
    w, c = result["weights_bytes"] / GIB, result["cache_bytes"] / GIB
    ax.bar(["weights + cache"], [w], color="0.6", label="weights")
    ax.bar(["weights + cache"], [c], bottom=[w], color="tab:orange", label="KV cache")
    for g, style in zip(gb, ("--", "-.", ":")):
        ax.axhline(g, color="tab:blue", ls=style, lw=1, label=f"{g} GiB GPU")
    ax.set(ylabel="GiB", title=title)
    ax.set_ylim(0, max(w + c, max(gb)) * 1.1)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))


def _chart_png(r: dict, title: str) -> bytes:
    """The calculator's bar chart as PNG bytes, rendered off-screen (never ``plt.show()`` inside an
    Output widget: captured display messages once left a headless run waiting for a finished kernel)."""
    import io

    from matplotlib.figure import Figure

    from .provenance import readable

    fig = Figure(figsize=(5, 3))
    plot_calculator(r, fig.add_subplot(), title=title)
    readable(fig)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")   # the legend sits right of the axes
    return buf.getvalue()


def _with_fallback(w, text, image):
    """A ``VBox`` class whose page rendering, where no widget manager runs (the built book, nbviewer,
    GitHub), is a static fallback: the current numbers and chart."""
    import base64

    class Calculator(w.VBox):
        def _repr_mimebundle_(self, **kwargs):
            bundle = super()._repr_mimebundle_(**kwargs)
            png = base64.b64encode(image.value).decode()
            bundle["text/html"] = (f'<div class="kvlab-widget-fallback">{text.value}'
                                   f'<img alt="KV cache and weights against GPU memory" '
                                   f'src="data:image/png;base64,{png}"/></div>')
            return bundle

    return Calculator


def calculator_widget(configs: dict, default: str | None = None):
    """An ipywidgets calculator over ``configs`` (name -> config): model, context, batch, dtype.

    Returns the widget box (display it in a live notebook). The logic lives in :func:`calculator`;
    where no widget manager runs (the built book) it displays as its static numbers and chart.
    """
    import ipywidgets as w

    names = list(configs)
    model = w.Dropdown(options=names, value=default or names[0], description="model")
    ctx = w.IntSlider(value=8192, min=256, max=131072, step=256, description="context", continuous_update=False)
    batch = w.IntText(value=1, description="batch")
    dtype = w.Dropdown(options=["fp32", "fp16", "bf16", "int8"], value="fp16", description="cache dtype")
    text = w.HTML()          # the numbers (a widget value: testable without a kernel)
    image = w.Image(format="png")   # the bar chart, as PNG bytes

    def redraw(*_):
        try:
            r = calculator(configs[model.value], ctx.value, batch.value, dtype.value)   # a bad batch: said so
        except ValueError as e:
            text.value = f"<pre>error: {html.escape(str(e))}</pre>"
            return
        box.result = r
        text.value = "<pre>" + html.escape(calculator_text(model.value, ctx.value, batch.value,
                                                           dtype.value, r)) + "</pre>"
        image.value = _chart_png(r, f"{model.value}, {ctx.value:,} tokens x {batch.value}")

    box = _with_fallback(w, text, image)([w.HBox([model, dtype]), w.HBox([ctx, batch]), text, image])
    box.text, box.image, box.redraw = text, image, redraw   # handles for tests and for a manual refresh
    for control in (model, ctx, batch, dtype):
        control.observe(redraw, names="value")
    redraw()
    return box


def calculator_text(name: str, seq_len: int, batch_size: int, dtype, r: dict) -> str:
    """A :func:`calculator` result ``r`` as a few lines of text (used by chapter 4 and the widget)."""
    lines = [f"{name}: {seq_len:,} tokens x batch {batch_size} in {dtype}: KV cache "
             f"{human_bytes(r['cache_bytes'])} ({r['per_token_bytes']:,} bytes per token), "
             f"weights ({r['weights_dtype']}) {human_bytes(r['weights_bytes'])}"]
    if r["beyond_context"]:
        lines.append(f"  (hypothetical: the model's context is {r['context']:,} tokens)")
    for gb, g in r["gpus"].items():
        lines.append(f"  {gb:>3} GiB GPU: {'fits' if g['fits'] else 'does NOT fit'}; "
                     f"largest batch at this context after the weights: {g['max_batch']}")
    return "\n".join(lines)
