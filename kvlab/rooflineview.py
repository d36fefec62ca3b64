"""Chapter 7's tables, figures and computed sentences, from the rows :mod:`kvlab.rooflinebench` measures.

Presentation only: nothing here times or runs a model.
"""

from __future__ import annotations
import torch

from . import probes, plots
from .generators import EAGER as GENERATORS
from .tables import show
from . import verdicts
from . import results


def print_rows(rows: list[dict]) -> None:
    """The generators against the floor, as a table that fits the page (:func:`kvlab.tables.show`)."""
    show([{"model": r["model"], "where": r["where"], "generator": r["generator"],
           "ms/token": f"{r['per_token'] * 1e3:.3f}", "floor ms": f"{r['floor_per_token'] * 1e3:.3f}",
           "measured/floor": f"{r['ratio']:.1f}x", "achieved GB/s": f"{r['achieved'] / 1e9:.1f}",
           "of read probe": f"{r['achieved'] / r['bandwidth']:.0%}",
           "probes: read, copy GB/s; GFLOP/s": f"{r['bandwidth'] / 1e9:.1f}, {r['copy_bandwidth'] / 1e9:.1f}; "
                                               f"{r['flops'] / 1e9:.0f}"} for r in rows])


def closest_sentence(rows: list[dict], model: str, device) -> str:
    """Which generator ran closest to the floor on ``model``, and whether the noise test (see
    :mod:`kvlab.verdicts`) tells it from the runner-up at the same thread count."""

    mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["ratio"])
    best = mine[0]
    line = (f"{model}: measured/floor from {best['ratio']:.1f}x to {mine[-1]['ratio']:.1f}x; "
            f"closest to the floor: {best['generator']} at {best['where']}, {best['ratio']:.1f}x, "
            f"streaming {best['achieved'] / 1e9:.1f} GB/s ({best['achieved'] / best['bandwidth']:.0%} of "
            "the read probe)")
    rival = next((r for r in mine[1:] if r["where"] == best["where"]), None)
    if rival is None:
        return line + "."
    return line + "; against " + rival["generator"] + ": " + verdicts.faster(
        best["timing"], rival["timing"], device, best["generator"], rival["generator"]) + "."


def plot_rows(rows: list[dict], ax) -> None:
    """Measured ms per token (bars) and the floor (black ticks), one group per model and thread count."""
    plots.bars_against_floor(ax, rows, lambda r: (r["model"], r["where"]), "generator", GENERATORS,
                             lambda g: f"{g[0]}\n{g[1]}", "measured time per token against the floor")


def plot_profile(breakdowns: dict[str, dict], ax) -> None:
    """One horizontal stacked bar per model: the share of each kind of time in a step."""
    kinds = [k for k in next(iter(breakdowns.values())) if k != "wall"]
    for i, (name, b) in enumerate(breakdowns.items()):
        left = 0.0
        for j, k in enumerate(kinds):
            share = b[k] / b["wall"] if b["wall"] else 0.0
            ax.barh(i, share, left=left, color=f"C{j}", label=k if i == 0 else None)
            left += share
    ax.set_yticks(range(len(breakdowns)), list(breakdowns), fontsize=8)
    ax.set(xlabel="share of one decode step's wall time (profiled)", xlim=(0, 1))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))


def plot_batch_sweep(rows: list[dict], axes) -> None:
    B = [r["batch"] for r in rows]
    ax1, ax2 = axes
    ax1.plot(B, [r["measured"] * 1e3 for r in rows], "o-", label="measured")
    ax1.plot(B, [r["floor"] * 1e3 for r in rows], "k-", lw=2, label="floor = max(memory, compute)")
    ax1.plot(B, [r["memory"] * 1e3 for r in rows], "--", color="tab:blue", label="bytes / bandwidth")
    ax1.plot(B, [r["compute"] * 1e3 for r in rows], ":", color="tab:red", label="FLOPs / matmul rate")
    ax1.set(xscale="log", yscale="log", xlabel="batch size", ylabel="ms per decode step", title="step time")
    ax2.plot(B, [b / r["measured"] for b, r in zip(B, rows)], "o-", label="measured")
    ax2.plot(B, [b / r["floor"] for b, r in zip(B, rows)], "k-", lw=2, label="roofline (B / floor)")
    ax2.set(xscale="log", yscale="log", xlabel="batch size", ylabel="tokens / s", title="throughput")
    for ax in axes:
        ax.legend(fontsize=7)


def plot_context_sweep(rows: list[dict], ax) -> None:
    S = [r["seq"] for r in rows]
    ax.plot(S, [r["measured"] * 1e3 for r in rows], "o-", label="measured step")
    ax.plot(S, [r["floor"] * 1e3 for r in rows], "k-", lw=2, label="floor")
    ax.plot(S, [r["weights"] * 1e3 for r in rows], "--", color="0.5", label="weights term")
    ax.plot(S, [r["cache"] * 1e3 for r in rows], "--", color="tab:orange", label="cache term")
    ax.set(xlabel="cached positions per row", ylabel="ms per decode step", ylim=(0, None),
           title=f"step time against position (batch {rows[0]['batch']})")
    ax.legend(fontsize=7)


def bound_sentence(terms: dict) -> str:
    """Which term bounds a step, and by how much, from :func:`roofline.step_terms`."""
    parts = {"reading the weights": terms["weights"], "reading the cache": terms["cache"],
             "the arithmetic": terms["compute"]}
    (first, a), (second, b) = sorted(parts.items(), key=lambda kv: -kv[1])[:2]
    return f"{first} ({a * 1e3:.3g} ms) dominates, {a / b:.3g} times {second} ({b * 1e3:.3g} ms)"


def dominant(breakdown: dict) -> tuple[str, float]:
    """The largest share of a profiled step and that share (0..1)."""
    kinds = {k: v for k, v in breakdown.items() if k != "wall"}
    k = max(kinds, key=kinds.get)
    return k, kinds[k] / breakdown["wall"]


def llc_caveat(rows, device) -> str:
    """A caveat when a measured step beat the DRAM floor: the weights may sit in the device's
    largest cache (a CPU's last-level cache, as Linux reports it; a GPU's L2)."""
    below = [r for r in rows if r.get("ratio", 2) < 1 or r.get("measured", 2) < r.get("floor", 0)]
    if not below:
        return ""
    device = torch.device(device)
    if device.type == "cuda":
        size, what = torch.cuda.get_device_properties(device).L2_cache_size, "this GPU's L2 cache"
    else:
        size, what = probes.cpu_cache_bytes() or 0, "this CPU's last-level cache (as Linux reports it)"
    return ("Some measured times are BELOW the floor computed from the measured DRAM bandwidth: the "
            f"working set fits in {what}, {size / 2**20:.0f} MiB, which is faster than DRAM, so the DRAM "
            "floor does not bind there.")


def critical_cell(critical: dict, context: int) -> str:
    """A critical batch for a table: the batch, "never" (no batch is compute-bound) or "-" (the
    context is beyond the model's own)."""
    if context not in critical:
        return "-"
    return f"{critical[context]:,}" if critical[context] else "never"


def bf16_sentence(rows, where: str) -> str:
    """Which way bf16 moves the ridge and GPT-2's critical batch on one machine, computed."""
    r32 = next(r for r in rows if r["dtype"] == "float32")
    r16 = next(r for r in rows if r["dtype"] == "bfloat16" and r["name"] == r32["name"])
    way = "out" if r16["ridge"] > r32["ridge"] else "in"
    text = (f"{where}: in bf16 the ridge is {r16['ridge'] / r32['ridge']:.2f}x the fp32 one, so bf16 moves it "
            f"{way}")
    c32, c16 = r32["critical"].get(0), r16["critical"].get(0)
    if c32 and c16:
        text += f", and {r32['name']}'s critical batch at zero context moves {c16 / c32:.2f}x ({c32:,} -> {c16:,})"
    return text + " (computed from the rates above)."


#: What each column of :func:`print_model_table` holds, for its caption (a header is defined where it is read).
MODEL_TABLE_TERMS = (
    "look-up tables (rows read): the share of the weights held in tables a step only indexes (an untied "
    "input embedding, a learned position table), of which it reads just the B rows it looks up; "
    "floor, B=1: the least time of one step at batch 1 with nothing cached; FLOP/B: FLOPs per byte read "
    "(arithmetic intensity), of that step and of attention over the cache (per row, at any batch); "
    "critical batch at S: the batch from which a step with S cached positions per row is bound by "
    "arithmetic ('never': no batch is; '-': S is beyond the model's context)")


def print_model_table(rows, contexts=(0, 512, 1000, 4096, 32768), caption: str = "") -> None:
    """The table, with the critical batch at a few context lengths ('never': no batch is
    compute-bound there; '-': beyond the model's context); its caption defines every column
    (:data:`MODEL_TABLE_TERMS`) after ``caption``."""
    show([{"model": r["name"], "weights": f"{r['weights'] / 1e9:.2f} GB",
           "look-up tables (rows read)": f"{r['lookup']:.1%}",
           "floor, B=1": f"{r['floor'] * 1e3:.2f} ms", "FLOP/B, B=1": f"{r['intensity']:.2f}",
           "attention FLOP/B": f"{r['attention']:.2f}"}
          | {f"critical batch at {c:,}": _crit_cell(r, c) for c in contexts} for r in rows],
         caption=(caption + ". " if caption else "") + MODEL_TABLE_TERMS)


def _crit_cell(row, context) -> str:
    if context not in row["critical"]:
        return "-"
    b = row["critical"][context]
    return f"{b:,}" if b else "never"


def plot_critical_batch(rows, ax, ridge: float) -> None:
    """The critical batch against the context, one curve per model of :func:`model_table`; a curve
    ends where no batch is compute-bound any more."""
    for r in rows:
        pts = [(c, b) for c, b in r["critical"].items() if b]
        if pts:
            ax.plot([max(c, 1) for c, _ in pts], [b for _, b in pts], "o-", ms=3, label=r["name"])
    ax.set(xscale="log", yscale="log", xlabel="cached positions per row (0 drawn at 1)",
           ylabel="critical batch", title=f"batch at which a step turns compute-bound (ridge {ridge:.1f})")
    ax.legend(fontsize=7)


def floor_change(base: dict, row: dict, what: str) -> str:
    """``what`` (a format) against ``base``'s floor, in words that never say "1.00x lower": a floor
    that did not move is named as such, with the bound that kept it."""
    r = base["floor"] / row["floor"]
    if r < 1.0005:
        return (f"with {what} the floor stays where it was ({r:.3f}x: the step is bound by {row['bound']} on "
                "this machine, and the format shrinks only bytes)" if row["bound"] == "compute" else
                f"with {what} the floor stays where it was ({r:.3f}x)")
    return f"with {what} the floor is {r:.2f}x lower" if r >= 1.01 else f"with {what} the floor is {r:.3f}x lower"


def quant_sentence(rows: list[dict]) -> str:
    """What the formats change on this machine, computed: which rows are bound by compute, and why
    their ratios read 1.00 when they are."""
    compute = [r["format"] for r in rows[1:] if r["bound"] == "compute"]
    if not compute:
        return ("Every half-precision row is bound by memory on this machine: each byte a format saves "
                "comes off the floor.")
    why = ""
    if rows[1]["bound"] == "compute":
        why = (" The fp16 row is itself bound by compute, and the FLOPs are the same in every format, "
               "so every compute-bound row has the fp16 row's floor: its 'x vs fp16' reads 1.00.")
    one = len(compute) == 1
    return (f"{len(compute)} of the {len(rows) - 1} half-precision rows {'is' if one else 'are'} bound by compute here "
            f"({'; '.join(compute)}): this machine's arithmetic at {rows[1]['rate'] / 1e9:.0f} GFLOP/s, "
            f"not its memory, sets {'its' if one else 'their'} floor, so fewer bytes no longer lower it." + why)


def plot_roofline(ax, bandwidth: float, flops: float, series: dict, title: str) -> None:
    """The roofline of the measured machine (min(intensity x bandwidth, flops)), its ridge, and the
    measured steps: ``series`` maps a label to :func:`roofline_points` (each point marked by batch)."""
    xs = [p["x"] for pts in series.values() for p in pts] + [flops / bandwidth]
    lo, hi = min(xs) / 2, max(xs) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(x * bandwidth, flops) for x in grid], "k-", lw=2, label="roofline (read probe, matmul)")
    ax.axvline(flops / bandwidth, color="0.6", ls=":", label=f"ridge {flops / bandwidth:.1f} FLOP/byte")
    for k, (label, pts) in enumerate(series.items()):
        line, = ax.plot([p["x"] for p in pts], [p["y"] for p in pts], "o-", ms=4, label=label)
        for p in _spaced(pts):       # labels far enough apart not to overlap; series alternate sides
            ax.annotate(f"B={p['batch']}", (p["x"], p["y"]), fontsize=8, color=line.get_color(),
                        xytext=(3, -11) if k % 2 == 0 else (-3, 5), ha="left" if k % 2 == 0 else "right",
                        textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOPs per byte of the step)",
           ylabel="FLOP/s (measured steps: FLOPs / time)", title=title)
    # room under the lowest point for the label written below it (it sat on the axis)
    ax.set_ylim(bottom=min(p["y"] for pts in series.values() for p in pts) / 1.8)
    ax.legend(fontsize=7, loc="lower right")


def _spaced(pts: list[dict], gap: float = 0.15) -> list[dict]:
    """The points to label on a log-x axis: each at least ``gap`` decades from the last labelled one
    (at 8 points a label "B=32" is about that wide on the chapter's figure), the last point always."""
    import math

    out = []
    for p in sorted(pts, key=lambda p: p["x"]):
        if not out or math.log10(p["x"] / out[-1]["x"]) >= gap:
            out.append(p)
    last = max(pts, key=lambda p: p["x"])
    if out[-1] is not last:
        out[-1] = last
    return out


def throughput_sentence(rows: list[dict]) -> str:
    """How throughput grew from the first to the last batch of a sweep, against proportional growth
    and against what the roofline allows: computed, never typed."""
    first, last = rows[0], rows[-1]
    gain = last["batch"] / last["measured"] * first["measured"] / first["batch"]
    allowed = last["batch"] / last["floor"] * first["floor"] / first["batch"]
    ideal = last["batch"] / first["batch"]
    line = (f"Measured throughput at batch {last['batch']} was {gain:.1f}x that of batch {first['batch']} "
            f"({gain / ideal:.0%} of proportional growth, {ideal:g}x); the floor's throughput grows {allowed:.1f}x.")
    if gain <= allowed:
        return line
    # The roofline bounds each step's time, not the ratio of two steps: a batch-1 step far above its
    # floor (fixed costs the batch then shares) lets measured throughput grow more than the floor's.
    return line + (f" That is not faster than the roofline allows: each measured step stays above its floor "
                   f"(batch {first['batch']}: {first['measured'] / first['floor']:.1f}x the floor, batch "
                   f"{last['batch']}: {last['measured'] / last['floor']:.1f}x); the batch-{first['batch']} step "
                   f"carries fixed costs the larger batch shares, so its throughput ratio can exceed the floor's.")


def knee_sentence(measured, floor) -> str:
    """Compare where the measured step and the floor start to grow with the batch (see :func:`knee`)."""
    if measured is None and floor is None:
        return "Neither the measured step nor the floor reached 1.5x its batch-1 time in this sweep."
    if measured is None or floor is None:
        which = "measured step" if measured is None else "floor"
        return (f"The {which} never reached 1.5x its batch-1 time in this sweep; the other did at "
                f"batch {measured or floor}.")
    if measured == floor:
        return f"Both reach 1.5x their batch-1 time at batch {measured}."
    order = "later" if measured > floor else "earlier"
    return (f"The measured step reaches 1.5x its batch-1 time at batch {measured}, {order} than the floor "
            f"(batch {floor}).")


def recorded_sentence(what: str = "Recorded runs on GPUs") -> str:
    """Whether any GPU run is committed under ``results/``, in words: the chapters point at the
    results page only for what is really there."""

    gpus = sorted({results.machine(r) for r in results.read_all()
                   if r["provenance"]["device"].get("device") == "cuda"})
    if not gpus:
        return (f"{what}: none is committed yet. The results page will render each one once it is "
                "(python -m kvlab.report --device cuda); until then every number here comes from the "
                "machine that built this page.")
    return f"{what} ({', '.join(gpus)}) are on the results page, each labelled with its device and date."


def fit_sentence(overhead: float, k: float, measured, predicted) -> str:
    """Lab 7's fit ``measured = overhead + k x floor``, read honestly: a fit whose overhead is negative,
    larger than the whole step of the smallest batch swept, or whose ``k`` is below 1 (faster than the
    floor) does not describe the run, and the sentence says which and why: timings out of order (a
    larger batch timed faster than a smaller one: noise) or measured/floor moving in a way one constant
    and one factor cannot follow."""
    ratios = [m / p for m, p in zip(measured, predicted)]
    if overhead < 0:
        why = f"its overhead came out negative ({overhead * 1e3:.3f} ms)"
    elif overhead > measured[0]:
        why = (f"its overhead ({overhead * 1e3:.3f} ms) is larger than the whole step of the smallest batch "
               f"swept ({measured[0] * 1e3:.3f} ms)")
    elif k < 1:
        why = f"its factor k = {k:.2f} would run the bytes faster than the floor allows"
    else:
        return (f"fixed overhead per step: {overhead * 1e3:.3f} ms, {overhead / measured[0]:.0%} of the smallest "
                f"batch's step; the rest runs at {k:.2f}x the floor")
    out_of_order = [(i, i + 1) for i in range(len(measured) - 1) if measured[i + 1] < measured[i]]
    if out_of_order:
        i, j = out_of_order[0]
        cause = (f"the timings are out of order (the sweep's batch no. {j + 1} ran in {measured[j] * 1e3:.3f} ms, "
                 f"faster than no. {i + 1} at {measured[i] * 1e3:.3f} ms: noise of a busy machine); measure again")
    else:
        cause = (f"measured/floor {'grows' if ratios[-1] > ratios[0] else 'falls'} with the batch (from "
                 f"{ratios[0]:.1f}x to {ratios[-1]:.1f}x) in a way no constant overhead plus one factor k times "
                 "the floor follows")
    return f"the fit does not fit this run: {why}, because {cause}"
