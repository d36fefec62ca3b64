"""Chapter 8's weight formats as tables, a figure and computed sentences, from :mod:`kvlab.weightbench`'s rows.

Presentation only: nothing here times or runs a model.
"""

from __future__ import annotations

from . import verdicts
from .tables import show, signed_pct
from .weightbench import measured_crossover


def print_rows(rows: list[dict]) -> None:
    """Each format, eager and compiled, against its own floor (one table per model)."""
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        show([{"weights": r["weights"], "run": r["generator"], "MB a step": f"{r['step_bytes'] / 1e6:.1f}",
               "ms/token": f"{r['per_token'] * 1e3:.3f}", "floor ms": f"{r['floor_per_token'] * 1e3:.3f}",
               "x floor": f"{r['x_floor']:.2f}x", "achieved GB/s": f"{r['achieved'] / 1e9:.2f}",
               "of read probe": f"{r['of_probe']:.0%}",
               "tokens equal to fp32's": f"{r['same_as_fp32']} of {r['new_tokens']}"} for r in mine],
             caption=f"{model}, {mine[0]['threads']} thread(s), {mine[0]['device']}, prompt {mine[0]['prompt_len']} + "
                     f"{mine[0]['new_tokens']} new tokens; read probe {mine[0]['bandwidth'] / 1e9:.1f} GB/s; each floor "
                     "its bytes over the probe or its FLOPs at its dtype's measured matmul rate, whichever is longer. "
                     "Tokens equal to fp32's: up to the first difference, on this run's prompt of random tokens, "
                     "where the model is unsure and a rounding flips an argmax sooner than on the held-out text "
                     "of the quality table")


def quality_sentence(rows: list[dict]) -> str:
    """How far each format's perplexity (the book's one measurement, ``kvlab.quality.perplexity``) is
    from fp32's, from the quality rows."""
    base = next(r for r in rows if r["weights"] == "fp32")
    parts = [f"{r['weights']} {r['perplexity']:.2f} ({signed_pct(r['perplexity'] / base['perplexity'] - 1, 2)})"
             for r in rows if r is not base]
    sizes = ", ".join(f"{r['weight_mb']:.1f}" for r in rows)
    return f"Perplexity on the book's perplexity text ({base['windows']} windows): fp32 {base['perplexity']:.2f}; " + "; ".join(parts) + f", at {sizes} MB of weights."


def _row(rows, model, fmt, how):
    return next(r for r in rows if r["model"] == model and r["weights"] == fmt and r["generator"] == how)


def format_sentences(rows: list[dict]) -> list[str]:
    """Per model: each smaller format against fp32, same run (eager against eager, compiled against
    compiled), worded by the noise test; what its bytes alone predict beside what was measured."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        first = next(r for r in rows if r["model"] == model)
        dev = verdicts.on(first["device"], first["threads"])
        for how in dict.fromkeys(r["generator"] for r in rows if r["model"] == model):
            base = _row(rows, model, "fp32", how)
            for r in (x for x in rows if x["model"] == model and x["generator"] == how and x is not base):
                speed = base["per_token"] / r["per_token"]
                c = verdicts.compare_timings(r["timing"], base["timing"])
                win, lose = (r["weights"], "fp32") if r["per_token"] <= base["per_token"] else ("fp32", r["weights"])
                said = verdicts.relation(c, win, lose)
                out.append(f"{model}, {how}, {dev}: {r['weights']} weights run at {speed:.2f}x the speed of fp32 "
                           f"({floor_words(r, base)}), {r['x_floor']:.2f}x their own floor at "
                           f"{r['of_probe']:.0%} of the read probe; "
                           + (said if c.verdict == "none" else f"{win} {said}") + ".")
    return out


def _bound(r: dict) -> str:
    """What sets a row's floor: its bytes, or the arithmetic at its dtype's measured matmul rate."""
    if r["floor_per_token"] > r["bytes_floor_per_token"] * (1 + 1e-9):
        return f"{str(r['flops_dtype']).replace('torch.', '')} arithmetic at {r['flops_rate'] / 1e9:.0f} GFLOP/s measured"
    return "the bytes read"


def floor_words(r: dict, base: dict) -> str:
    """A format's floor against fp32's, in the right direction, and what sets each: "their floor is
    1.92x lower, set by the bytes read", or "8.27x higher: set by bf16 arithmetic at 12 GFLOP/s measured,
    where fp32's is set by its bytes" (a device whose bf16 matmuls are slow)."""
    ratio = base["floor_per_token"] / r["floor_per_token"]
    if abs(ratio - 1) < 1e-3:
        return f"the same floor as fp32's, set by {_bound(r)}"
    if ratio > 1:
        return f"their floor is {ratio:.2f}x lower, set by {_bound(r)}"
    return (f"their floor is {1 / ratio:.2f}x HIGHER than fp32's: set by {_bound(r)}, where fp32's is set by "
            f"{_bound(base)}; by bytes alone it would be {base['bytes_floor_per_token'] / r['bytes_floor_per_token']:.2f}x lower")


def formats_takeaway(rows: list[dict], how: str = "compiled") -> str:
    """One line per smaller format of the run: its floor against fp32's (which way, and what sets it)
    and the speed the ``how`` generator measured against fp32's, on the device of the run."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and r["generator"] == how]
        base = next((r for r in mine if r["weights"] == "fp32"), None)
        if base is None:
            continue
        dev = verdicts.on(base["device"], base["threads"])
        for r in (x for x in mine if x is not base):
            c = verdicts.compare_timings(r["timing"], base["timing"])
            said = ("no difference measured" if c.verdict == "none" else
                    f"{'faster' if c.ratio < 1 else 'slower'} than fp32, {verdicts.WORDS[c.verdict].split(' ', 1)[1]}")
            lines.append(f"{model}, {r['weights']}: {floor_words(r, base)}; measured {base['per_token'] / r['per_token']:.2f}x "
                         f"fp32's speed ({said}), {dev}")
    return "\n".join(lines) or f"no {how} rows were measured in this run"


def print_crossover(rows: list[dict], name: str) -> None:
    """The context per row at which the cache a step reads outweighs its weights, per format and batch."""
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    table = {}
    for r in rows:
        key = (r["weights"], r["cache"])
        table.setdefault(key, {"weights": r["weights"], "cache": r["cache"],
                               "weights MB": f"{r['weight_mb']:.1f}", "cache KB/token": f"{r['cache_kb_per_token']:.1f}",
                               "cached tokens (batch 1)": f"{r['tokens']:,}"})
        table[key][f"context at batch {r['batch']}"] = "-" if r["context"] is None else f"{r['context']:,}"
    show(list(table.values()), caption=f"{name}: where the cache outweighs the weights (batches {batches})")


def plot_sweep(rows: list[dict], ax) -> None:
    """Measured step time against the context, one line per weight format."""
    for fmt in dict.fromkeys(r["weights"] for r in rows):
        mine = sorted((r for r in rows if r["weights"] == fmt), key=lambda r: r["context"])
        ax.plot([r["context"] for r in mine], [r["ms"] for r in mine], marker="o", label=f"{fmt} weights")
    ax.set_xlabel("cached positions per row")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"one decode step at batch {rows[0]['batch']}, measured")
    ax.legend(fontsize=9)


def sweep_sentence(rows: list[dict], computed: list[dict]) -> str:
    """The measured doubling context per format beside the computed crossover (same batch)."""
    parts = []
    for fmt in dict.fromkeys(r["weights"] for r in rows):
        pred = next((c["context"] for c in computed if c["weights"] == fmt and c["batch"] == rows[0]["batch"]), None)
        meas = measured_crossover(rows, fmt)
        mine = sorted((r for r in rows if r["weights"] == fmt), key=lambda r: r["context"])
        grow = mine[-1]["ms"] / mine[0]["ms"]
        parts.append(f"{fmt} weights: computed crossover at "
                     + (f"{pred:,} positions" if pred else "none within the context")
                     + "; measured: " + (f"the step took twice its {mine[0]['context']}-position time from {meas:,}"
                                        if meas else f"the step grew {grow:.2f}x from {mine[0]['context']} to "
                                                     f"{mine[-1]['context']} positions, never doubling")
                     + f" (cache {mine[-1]['cache_share']:.0%} of the bytes at {mine[-1]['context']})")
    return (f"Batch {rows[0]['batch']}, {verdicts.on(rows[0]['device'])}: " + "; ".join(parts) + ". A measured "
            "doubling far from the computed crossover means the two terms did not stream at one bandwidth on this "
            "device (weights or cache served from a cache of the processor, or attention bound by its arithmetic).")
