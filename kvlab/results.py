"""Recorded results: the files ``python -m kvlab.report`` writes, read back as tables and plots.

The book's results page (``book/results.md``) renders every committed ``results/*.json`` with
these functions, grouped by machine, each labelled with where and when it was recorded; the
report's ``--figure`` option draws the same panels into a PNG.

    recorded = read_all()                  # every results/*.json, validated
    for machine, runs in by_machine(recorded).items():
        for r in runs:
            show_run(r)                        # caption, one table per section, the figure
"""

from __future__ import annotations

import json
from pathlib import Path

from .paths import REPO_ROOT

RESULTS_DIR = REPO_ROOT / "results"
SCHEMA = 1

# Column headers of the tables, by row key (a key missing here is shown as it is).
HEADERS = {
    "model": "model", "n": "new tokens N", "naive_s": "naive (s)", "cached_s": "cached (s)",
    "speedup": "speed-up", "position": "position p", "naive_ms": "naive (ms/token)",
    "cached_ms": "cached (ms/token)", "ratio": "ratio", "generator": "generator",
    "new_tokens": "new tokens", "median_s": "median (s)", "tokens_per_s": "tokens/s",
    "vs_transformers": "speed vs transformers", "identical_tokens": "same tokens",
    "first_difference": "first different token", "batch": "batch B", "vs_batch1": "vs B=1",
    "seq_len": "cached positions S", "measured_ms": "measured (ms/step)", "floor_ms": "floor (ms/step)",
    "vs_floor": "measured / floor", "bound": "floor set by", "bandwidth_GBps": "bandwidth (GB/s)",
    "matmul_GFLOPs": "matmul (GFLOP/s)", "prompt_len": "prompt length", "variant": "variant",
    "vs_eager": "speed vs eager", "compile_s": "first call, compiling (s)",
    "achieved_GBps": "achieved (GB/s)", "of_read_probe": "share of the read probe's bandwidth",
    "copy_GBps": "copy bandwidth (GB/s)", "bandwidth_probe": "bandwidth measured by",
    "dtype": "dtype", "backend": "compile backend", "mode": "compile mode",
    "weights": "weights", "same_as_fp32": "tokens equal to fp32's",
    "prompt_tokens": "prompt tokens N", "compute_bound_from": "compute-bound from N =",
}
# Keys whose values are shares, printed as percentages like the rest of the book.
PERCENT = {"of_read_probe"}
# Values that need words: what a compile backend name means.
WORDS = {"backend": {
    "eager": "eager, i.e. TorchDynamo only: torch.compile(backend='eager') captures the step as one graph and runs "
             "it op by op, without Inductor's generated kernels",
    "inductor": "inductor, torch.compile's default: TorchDynamo's graph compiled by Inductor into generated kernels"}}
TITLES = {
    "speedup": "Naive vs cached generation: total time against N (chapter 2)",
    "per_position": "Time per generated token against position (chapters 1-2)",
    "ours_vs_transformers": "The hand-built GPT-2 and our loop against transformers' generate (chapter 3)",
    "batch_throughput": "Throughput against batch size (chapter 6)",
    "floor": "Decode steps against the bandwidth and FLOP floor (chapter 7)",
    "compiled": "Compiled vs eager decode (chapter 8)",
    "compiled_batches": "The compiled decode at several batch sizes, one graph each (chapter 8)",
    "weights": "fp32, bf16 and int8 weights against their floors (chapter 8)",
    "prefill": "The floor of a prefill of N tokens (chapter 7)",
}
# How to plot a section: x key, y keys, the keys that split rows into lines, axis labels, log-2 x axis.
PLOTS = {
    "speedup": ("n", ["speedup"], ["model"], "new tokens N", "speed-up (naive / cached)", False),
    "per_position": ("position", ["naive_ms", "cached_ms"], ["model"], "position p",
                     "ms per generated token", False),
    "batch_throughput": ("batch", ["tokens_per_s"], ["model"], "batch size B", "new tokens / s", True),
    "floor": ("batch", ["vs_floor"], ["model", "seq_len"], "batch size B", "measured / floor", True),
}


# ---------------------------------------------------------------------------------------------------
# Reading


def read_run(path) -> dict:
    """One result file, checked: a malformed file is a ``ValueError`` that names it and the fix."""
    path = Path(path)
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); rewrite it with python -m kvlab.report") from None
    fix = "write it with python -m kvlab.report, or remove it from results/"
    if not isinstance(result, dict) or result.get("kind") != "kvlab.report":
        raise ValueError(f"{path} is not a kvlab.report result; {fix}")
    if result.get("schema") != SCHEMA:
        raise ValueError(f"{path} has schema {result.get('schema')!r}, this kvlab reads {SCHEMA}; {fix}")
    prov = result.get("provenance", {})
    for keys in (("device", "name"), ("git", "commit"), ("date",), ("versions", "torch")):
        node = prov
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        if node in (None, ""):
            raise ValueError(f"{path} lacks provenance.{'.'.join(keys)}; {fix}")
    if not isinstance(result.get("sections"), dict):
        raise ValueError(f"{path} has no sections; {fix}")
    result["_path"] = str(path)
    return result


def read_all(folder=RESULTS_DIR) -> list[dict]:
    """Every ``*.json`` under ``folder``, by machine then date."""
    found = [read_run(p) for p in sorted(Path(folder).glob("*.json"))]
    return sorted(found, key=lambda r: (machine(r), r["provenance"]["date"]))


def machine(result) -> str:
    """The machine a result was recorded on: device name and memory."""
    d = result["provenance"]["device"]
    mem = d.get("memory_bytes")
    return f"{d['name']}" + (f", {mem / 2**30:.0f} GiB" if mem else "")


def by_machine(results) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in results:
        out.setdefault(machine(r), []).append(r)
    return out


def caption(result, fresh: bool = False) -> str:
    """Where and when these numbers come from; recorded ones say they were not re-run."""
    p = result["provenance"]
    commit = p["git"]["commit"][:12] + (" (with uncommitted changes)" if p["git"].get("dirty") else "")
    date = p["date"].replace("T", " ").replace("+00:00", " UTC")
    mode = "quick grids" if result.get("quick") else "full grids"
    if fresh:
        return f"measured on {p['device']['name']} by this build, at {commit} on {date} ({mode})"
    return f"recorded on {p['device']['name']} at {commit} on {date} ({mode}), not re-run by this build"


def details(result) -> str:
    """One line of provenance: versions, threads, CUDA and driver, models."""
    p, d = result["provenance"], result["provenance"]["device"]
    parts = [f"torch {p['versions']['torch']}", f"transformers {p['versions']['transformers']}",
             f"python {p['versions']['python']}"]
    if d.get("cuda"):
        parts.append(f"CUDA {d['cuda']}, driver {d.get('driver') or '?'}, capability {d.get('capability')}")
    parts.append(f"{d.get('torch_threads')} torch threads of {d.get('cpu_cores')} cores")
    loads = [d.get("load_average_start"), d.get("load_average_end")]
    if all(loads):      # the 1-minute load average when the run started and ended
        busy = max(loads[0][0], loads[1][0]) > (d.get("cpu_cores") or 1)
        parts.append(f"host load average {loads[0][0]:g} at the start, {loads[1][0]:g} at the end"
                     + (" (more than its cores: other work shared them, so the timings are noisy)"
                        if busy else ""))
    kinds = ", ".join(f"{k} ({v['kind']})" for k, v in p.get("models", {}).items())
    return "; ".join(parts) + (f"; models: {kinds}" if kinds else "")


# ---------------------------------------------------------------------------------------------------
# Tables


def _cell(v, key: str | None = None) -> str:
    if key in PERCENT and isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v:.1%}"
    if key in WORDS and v in WORDS[key]:
        return WORDS[key][v]
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def table(rows: list[dict]) -> str:
    """A Markdown table of flat dicts (columns: the union of their keys, in order)."""
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    head = "| " + " | ".join(HEADERS.get(c, c.replace("_", " ")) for c in cols) + " |"
    rule = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(_cell(r.get(c), c) for c in cols) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def section_markdown(name: str, sec: dict) -> str:
    title = f"**{TITLES.get(name, name)}**"
    status = sec.get("status")
    if status == "skipped":
        return f"{title}: not measured ({sec.get('reason')})."
    if status == "error":
        return f"{title}: failed with `{sec.get('error')}`."
    extra = {k: v for k, v in sec.items() if k not in ("rows", "status", "seconds")
             and not isinstance(v, (dict, list))}
    note = "; ".join(f"{HEADERS.get(k, k.replace('_', ' '))} {_cell(v, k)}" for k, v in extra.items())
    cut = " The time budget ran out: the grid stops early." if status == "truncated" else ""
    head = f"{title} ({note + '; ' if note else ''}{sec.get('seconds')} s).{cut}"
    return head + "\n\n" + (table(sec["rows"]) if sec.get("rows") else "No rows.")


def markdown(result, fresh: bool = False) -> str:
    """Caption, provenance line and one table per section."""
    parts = [f"*{caption(result, fresh)}.*", details(result) + "."]
    if not result.get("complete", True):
        parts.append(f"**This run was cut off after {len(result['sections'])} section(s)** "
                     f"({result.get('elapsed_s')} s): the sections below are all it recorded.")
    parts += [section_markdown(k, v) for k, v in result["sections"].items()]
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------------------------
# Figures


def _plottable(result) -> list[str]:
    return [k for k in PLOTS if result["sections"].get(k, {}).get("rows")]


def run_figure(result, fresh: bool = False):
    """One panel per plottable section, the caption along the bottom; ``None`` if nothing to plot."""
    import matplotlib.pyplot as plt

    names = _plottable(result)
    if not names:
        return None
    ncols = min(2, len(names))                 # two panels a row: legible in the book's column
    nrows = -(-len(names) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat[len(names):]:
        fig.delaxes(ax)
    for ax, name in zip(axes.flat, names):
        x, ys, split, xlabel, ylabel, log2 = PLOTS[name]
        rows = result["sections"][name]["rows"]
        groups: dict[tuple, list] = {}
        for r in rows:
            groups.setdefault(tuple(r[k] for k in split), []).append(r)
        for g, grows in groups.items():
            for y in ys:
                what = f" {HEADERS.get(y, y).split(' (')[0]}" if len(ys) > 1 else ""
                label = " ".join(map(str, g)) + what
                ax.plot([r[x] for r in grows], [r[y] for r in grows], "o-", ms=4, label=label)
        if log2:
            ax.set_xscale("log", base=2)
            ticks = sorted({r[x] for r in rows})
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
        ax.set(xlabel=xlabel, ylabel=ylabel, title=TITLES[name].split(" (")[0].split(":")[0])
        ax.title.set_fontsize(9)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.text(0.005, 0.005, caption(result, fresh), fontsize=7, color="0.35", ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.06 / nrows, 1, 1))
    return fig


def save_figure(result, path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig = run_figure(result)
    if fig is None:
        return
    fig.savefig(path, dpi=100)
    plt.close(fig)


def show_run(result, fresh: bool = False) -> None:
    """In a notebook: the tables as Markdown, then the figure."""
    import matplotlib.pyplot as plt
    from IPython.display import Markdown, display

    display(Markdown(markdown(result, fresh)))
    fig = run_figure(result, fresh)
    if fig is not None:
        display(fig)
        plt.close(fig)
