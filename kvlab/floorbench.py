"""Chapter 7's measurements, set against the floor of :mod:`kvlab.roofline`.

    step_fn(model, batch_size, seq_len)        # one decode step at a given position, repeatable
    step_time(model, batch_size, seq_len)      # its median seconds
    generators_vs_floor(hf, ...)               # transformers generate / cached loop / hand-built GPT-2
    profile_step(model, batch_size, seq_len)   # torch.profiler: where one step's time goes
    batch_sweep(...), context_sweep(...)       # step time against batch size / position, with the floor
    verdicts: small functions that turn the measured numbers into the chapter's sentences

Timings follow :mod:`kvlab.timing`: warm-up, medians, variants interleaved; CUDA events on a GPU.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from .progress import bar as tqdm   # no frozen bar in a page built unwatched

from . import gpt2, harness, plots, probes, roofline, timing
from .generate import cached_generate, hf_greedy
from .tables import show

# ---------------------------------------------------------------------------------------------------
# One decode step, repeatable at a fixed position


def _device(model):
    return next(model.parameters()).device


@torch.no_grad()
def step_fn(model, batch_size: int, seq_len: int, seed: int = 0):
    """A function that runs ONE decode step of ``batch_size`` rows after ``seq_len`` cached positions
    and then rewinds the cache, so that every call measures the same step. Works for the hand-built
    :class:`kvlab.gpt2.GPT2` (its preallocated cache) and transformers models (``DynamicCache``)."""
    from transformers import DynamicCache

    device = _device(model)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g).to(device)
    if isinstance(model, gpt2.GPT2):
        cache = model.new_cache(batch_size, max_len=seq_len + 1)
        if seq_len:
            model(ids[:, :seq_len], cache, last_only=True)        # prefill once

        return harness.rewinding_step(model, cache, ids[:, seq_len:], seq_len)   # every call: the same step
    cache = DynamicCache(config=model.config)
    if seq_len:
        model(ids[:, :seq_len], cache=cache, use_cache=True)

    def step():
        with torch.no_grad():
            out = model(ids[:, seq_len:], cache=cache, use_cache=True, logits_to_keep=1)
            cache.crop(-1)                     # drop the position this step appended
            return out
    return step


def step_time(model, batch_size: int, seq_len: int, repeats: int = 5) -> float:
    """Median seconds of one decode step (CUDA events on a GPU, torch.utils.benchmark on a CPU)."""
    return probes.median_seconds(step_fn(model, batch_size, seq_len), _device(model), repeats=repeats)


# ---------------------------------------------------------------------------------------------------
# Whole generators against the floor

GENERATORS = ("transformers generate", "kvlab cached_generate", "hand-built GPT-2")


def generators_vs_floor(hf, prompt_len: int, new_tokens: int, threads_list=(None,), repeats: int = 3,
                        ours=None) -> list[dict]:
    """Time the book's three greedy generators on ``hf`` at each CPU thread count (``None``: leave
    it), measure the machine at that thread count, and return one row per generator with the
    measured seconds per token and the floor's (``roofline.generation_floor``)."""
    device = _device(hf)
    ours = ours or gpt2.GPT2.from_hf(hf)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, hf.config.vocab_size, (1, prompt_len), generator=g).to(device)
    runs = dict(zip(GENERATORS, (lambda: hf_greedy(hf, prompt, new_tokens),
                                 lambda: cached_generate(hf, prompt, new_tokens),
                                 lambda: gpt2.generate(ours, prompt, new_tokens))))
    harness.same_tokens(runs)                   # a fast wrong generator is not a result
    rows = []
    for threads in threads_list:
        if device.type == "cpu" and threads:
            torch.set_num_threads(threads)
        m = probes.machine(device, roofline.model_dtype(hf), verbose=False)
        floor = roofline.generation_floor(hf, 1, prompt_len, new_tokens, m["bandwidth"], m["flops"])
        res = timing.compare(runs, warmup=0, repeats=repeats, progress=False)
        for name, t in res.items():
            n = m["threads"]
            where = f"{n} thread{'s' * (n > 1)}" if device.type == "cpu" else device.type
            rows.append(dict(model=getattr(hf, "kvlab_name", "?"), threads=n, where=where, generator=name,
                             per_token=t.median / new_tokens, floor_per_token=floor / new_tokens,
                             ratio=t.median / floor, bandwidth=m["bandwidth"], flops=m["flops"],
                             copy_bandwidth=m["copy_bandwidth"], timing=t,
                             achieved=roofline.achieved_bandwidth(hf, 1, prompt_len, new_tokens, t.median)))
    return rows


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
    from . import verdicts

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


# ---------------------------------------------------------------------------------------------------
# Where one step's time goes: torch.profiler

_CATEGORIES = {
    "matrix products": {"addmm", "mm", "bmm", "matmul", "linear", "baddbmm", "addmv", "mv"},
    "attention": {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_cudnn_attention", "softmax", "_softmax", "masked_fill"},
    "cache update and copies": {"cat", "copy_", "index_copy_", "slice_scatter", "index_put_", "_to_copy",
                                "clone", "contiguous"},
    "norms": {"layer_norm", "native_layer_norm", "rms_norm"},
}


@contextlib.contextmanager
def _quiet_fd2():
    """Silence file descriptor 2 for a moment: kineto writes a 'profiler_start/stop' line straight to
    it from C++ at every profile, which Python's sys.stderr cannot intercept."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _category(op: str) -> str:
    name = op.split("::")[-1]
    return next((cat for cat, names in _CATEGORIES.items() if name in names), "other operators")


@torch.no_grad()
def profile_step(model, batch_size: int, seq_len: int, steps: int = 5) -> dict[str, float]:
    """Seconds per step in each kind of operator (self time, so nothing is counted twice), and the
    rest of the step's wall time: the gaps between operators (Python, dispatch, kernel launches)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    device = _device(model)
    fn = step_fn(model, batch_size, seq_len)
    for _ in range(2):
        fn()
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _quiet_fd2(), profile(activities=acts) as prof:
        for _ in range(steps):
            with record_function("kvlab::decode_step"):
                fn()
                if cuda:
                    torch.cuda.synchronize(device)
    out = dict.fromkeys([*_CATEGORIES, "other operators"], 0.0)
    wall = 0.0
    for ev in prof.key_averages():
        if ev.key == "kvlab::decode_step":
            wall = ev.cpu_time_total / 1e6 / steps
        elif ev.key.startswith("aten::"):
            us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
            out[_category(ev.key)] += us / 1e6 / steps
    out["between operators"] = max(wall - sum(out.values()), 0.0)
    out["wall"] = wall
    return out


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


# ---------------------------------------------------------------------------------------------------
# Sweeps


def sweep(model, points, bandwidth: float, flops: float, vary: str = "batch", fixed: int = 64,
          repeats: int = 5) -> list[dict]:
    """Measured step time and the floor's terms along ``points`` batch sizes (``vary="batch"``,
    at ``fixed`` cached positions) or positions (``vary="seq"``, at batch ``fixed``)."""
    rows = []
    for p in tqdm(points, desc=f"{vary} sweep", leave=False):
        B, S = (p, fixed) if vary == "batch" else (fixed, p)
        t = roofline.step_terms(model, B, S, bandwidth, flops)
        rows.append(dict(batch=B, seq=S, measured=step_time(model, B, S, repeats), **t))
    return rows


def knee(xs, ys, factor: float = 1.5):
    """The first x at which y reaches ``factor`` times its first value (None if it never does)."""
    return next((x for x, y in zip(xs, ys) if y >= factor * ys[0]), None)


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


# ---------------------------------------------------------------------------------------------------
# Verdicts: sentences computed from the numbers (never typed)


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


def llc_caveat(rows, cache_bytes) -> str:
    """A caveat when a measured step beat the DRAM floor: the weights may sit in the CPU's cache."""
    below = [r for r in rows if r.get("ratio", 2) < 1 or r.get("measured", 2) < r.get("floor", 0)]
    if not below:
        return ""
    return ("Some measured times are BELOW the floor computed from the measured DRAM bandwidth: the "
            f"working set fits in this CPU's last-level cache ({cache_bytes / 2**20:.0f} MiB as Linux "
            "reports it), which is faster than DRAM, so the DRAM floor does not bind there.")


# ---------------------------------------------------------------------------------------------------
# Tables the chapter prints (shape-only models on the meta device: free to evaluate)


def shape_sizes_that_fit(device, quick: bool) -> list[str]:
    """GPT-2 sizes whose timing fits this device and the build's time budget: all four on a GPU (the
    smallest only in quick mode), GPT-2 small on a CPU (medium alone, three generators at two thread
    counts, took over ten minutes on the project's shared 2-core build machine)."""
    from .models import GPT2_SIZES

    if torch.device(device).type == "cuda":
        return ["gpt2"] if quick else list(GPT2_SIZES)
    return ["gpt2"]


CONTEXTS = (0, 128, 256, 512, 1000, 2048, 4096, 8192, 32768)


def model_table(names, bandwidth: float, flops: float, dtype=torch.float32,
                contexts=CONTEXTS) -> list[dict]:
    """Per model: weight bytes, the share of them a step reads only rows of, the batch-1 floor at
    zero context and what bounds it, the critical batch at each of ``contexts`` (positions per row;
    ``None``: never compute-bound there), the per-row attention intensity, and the context at which
    one row's cache outweighs the weights."""
    from .memory import context_length

    rows = []
    for name in names:
        m = roofline.meta_model(name, dtype)
        t = roofline.step_terms(m, 1, 0, bandwidth, flops)
        n_ctx = context_length(m.config)
        fits = [c for c in contexts if not n_ctx or c < n_ctx]
        rows.append(dict(name=name, weights=roofline.weight_bytes(m), lookup=roofline.lookup_share(m),
                         floor=t["floor"], bound=t["bound"], intensity=roofline.arithmetic_intensity(m, 1, 0),
                         critical=dict(zip(fits, roofline.critical_batch_curve(m, fits, bandwidth, flops))),
                         attention=roofline.attention_intensity(m), crossover=roofline.crossover_length(m),
                         context=n_ctx, kv=roofline.cache_read_bytes(m, 1, 1)))
    return rows


def _crit_cell(row, context) -> str:
    if context not in row["critical"]:
        return "-"
    b = row["critical"][context]
    return f"{b:,}" if b else "never"


def print_model_table(rows, contexts=(0, 512, 1000, 4096, 32768)) -> None:
    """The table, with the critical batch at a few context lengths ('never': no batch is
    compute-bound there; '-': beyond the model's context)."""
    show([{"model": r["name"], "weights": f"{r['weights'] / 1e9:.2f} GB", "rows-only": f"{r['lookup']:.1%}",
           "floor, B=1": f"{r['floor'] * 1e3:.2f} ms", "FLOP/B, B=1": f"{r['intensity']:.2f}",
           "attn FLOP/B": f"{r['attention']:.2f}"}
          | {f"critical batch at {c:,}": _crit_cell(r, c) for c in contexts} for r in rows])


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


# Published figures of the articles' GPU (NVIDIA's RTX 3090 specifications): memory bandwidth and
# peak dense fp32 arithmetic. The book measures neither: it never had that card.
RTX3090 = {"bandwidth": 936e9, "flops": 35.6e12}

# What the articles report (source-claims.md): model, new tokens, seconds with the cache.
ARTICLE_RUNS = [
    ("A", "gpt2-medium", 100, 2.61),
    ("C", "gpt2", 128, 0.12),
    ("C", "gpt2", 256, 0.31),
    ("C", "gpt2", 512, 0.89),
]


def article_rows(prompt_len: int = 8) -> list[dict]:
    """Each article's cached-generation time against the fp32 floor of an RTX 3090 (the prompt
    length is not reported: a short one is assumed; it barely moves the floor)."""
    rows = []
    for art, name, n, secs in ARTICLE_RUNS:
        m = roofline.meta_model(name, torch.float32)
        floor = roofline.generation_floor(m, 1, prompt_len, n, RTX3090["bandwidth"], RTX3090["flops"])
        rows.append(dict(article=art, model=name, tokens=n, seconds=secs, per_token=secs / n,
                         floor_per_token=floor / n, ratio=secs / floor))
    return rows


def quant_rows(name: str, batch_size: int, seq_len: int, bandwidth: float, flops: float,
               half_flops: float | None = None) -> list[dict]:
    """The floor of one step under weight and cache formats (bytes per element; int4 = 0.5), without
    the scales a real quantized format stores beside the values (a few percent). The fp32 row
    computes at ``flops`` (the fp32 rate); every other row dequantizes to half precision and
    computes at ``half_flops`` (the rate :func:`kvlab.probes.arithmetic_rate` measured for it)."""
    m = roofline.meta_model(name, torch.float16)
    formats = [("fp32 weights, fp32 cache", 4, 4), ("fp16 weights, fp16 cache", 2, 2),
               ("fp16 weights, int8 cache", 2, 1), ("fp16 weights, int4 cache", 2, 0.5),
               ("int8 weights, int8 cache", 1, 1), ("int4 weights, int4 cache", 0.5, 0.5)]
    rows = []
    for label, w, c in formats:
        rate = flops if w == 4 else (half_flops or flops)
        t = roofline.step_terms(m, batch_size, seq_len, bandwidth, rate, cache_dtype=c, weights_dtype=w)
        rows.append(dict(format=label, rate=rate, **t))
    return rows


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
    return (f"{len(compute)} of the {len(rows) - 1} half-precision rows are bound by compute here "
            f"({'; '.join(compute)}): this machine's arithmetic at {rows[1]['rate'] / 1e9:.0f} GFLOP/s, "
            "not its memory, sets their floor, so fewer bytes no longer lower it." + why)


def roofline_points(rows: list[dict], model) -> list[dict]:
    """Measured sweep rows (:func:`sweep`) as roofline points: intensity (FLOPs per byte of the
    step) and achieved FLOP/s (FLOPs / measured seconds)."""
    out = []
    for r in rows:
        f = roofline.decode_step_flops(model, r["batch"], r["seq"])
        out.append(dict(batch=r["batch"], seq=r["seq"], x=f / roofline.decode_step_bytes(model, r["batch"], r["seq"]),
                        y=f / r["measured"]))
    return out


def plot_roofline(ax, bandwidth: float, flops: float, series: dict, title: str) -> None:
    """The roofline of the measured machine (min(intensity x bandwidth, flops)), its ridge, and the
    measured steps: ``series`` maps a label to :func:`roofline_points` (each point marked by batch)."""
    xs = [p["x"] for pts in series.values() for p in pts] + [flops / bandwidth]
    lo, hi = min(xs) / 2, max(xs) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(x * bandwidth, flops) for x in grid], "k-", lw=2, label="roofline (read probe, matmul)")
    ax.axvline(flops / bandwidth, color="0.6", ls=":", label=f"ridge {flops / bandwidth:.1f} FLOP/byte")
    for label, pts in series.items():
        line, = ax.plot([p["x"] for p in pts], [p["y"] for p in pts], "o-", ms=4, label=label)
        for p in pts:
            ax.annotate(f"B={p['batch']}", (p["x"], p["y"]), fontsize=6, color=line.get_color(),
                        xytext=(2, -8), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOPs per byte of the step)",
           ylabel="FLOP/s (measured steps: FLOPs / time)", title=title)
    ax.legend(fontsize=7, loc="lower right")


def throughput_sentence(rows: list[dict]) -> str:
    """How throughput grew from the first to the last batch of a sweep, against proportional growth
    and against what the roofline allows: computed, never typed."""
    first, last = rows[0], rows[-1]
    gain = last["batch"] / last["measured"] * first["measured"] / first["batch"]
    allowed = last["batch"] / last["floor"] * first["floor"] / first["batch"]
    ideal = last["batch"] / first["batch"]
    return (f"Measured throughput at batch {last['batch']} was {gain:.1f}x that of batch {first['batch']} "
            f"({gain / ideal:.0%} of proportional growth, {ideal:g}x); the roofline allows {allowed:.1f}x.")


# Published figures (NVIDIA's H200 SXM datasheet): memory bandwidth, dense fp32 and dense bf16
# tensor-core rates. Stated, not measured: the book's builds never ran on one.
H200 = {"name": "H200 (published figures)", "bandwidth": 4.8e12, "fp32": 67e12, "bf16": 989e12}


def dtype_rows(names, bandwidth: float, rates: dict, contexts=(0, 512, 2048)) -> list[dict]:
    """Ridge and critical batch per model when the same machine computes in each dtype of ``rates``
    ({dtype: FLOP/s}, the model stored in that dtype): computed from the same functions."""
    rows = []
    for dtype, rate in rates.items():
        for name in names:
            m = roofline.meta_model(name, dtype)
            rows.append(dict(name=name, dtype=str(dtype).removeprefix("torch."), ridge=rate / bandwidth,
                             critical=dict(zip(contexts, roofline.critical_batch_curve(m, contexts, bandwidth, rate)))))
    return rows


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
    from . import results

    gpus = sorted({results.machine(r) for r in results.load_all()
                   if r["provenance"]["device"].get("device") == "cuda"})
    if not gpus:
        return (f"{what}: none is committed yet. The results page will render each one once it is "
                "(python -m kvlab.report --device cuda); until then every number here comes from the "
                "machine that built this page.")
    return f"{what} ({', '.join(gpus)}) are on the results page, each labelled with its device and date."
