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

from . import generators as G
from . import gpt2, harness, probes, progress, roofline, timing
from .catalogue import GPT2_SIZES
from .configs import context_length

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
    else:
        cache = DynamicCache(config=model.config)
        if seq_len:
            model(ids[:, :seq_len], cache=cache, use_cache=True)
    return harness.rewinding_step(model, cache, ids[:, seq_len:], seq_len)   # every call: the same step


def step_time(model, batch_size: int, seq_len: int, repeats: int = 5) -> float:
    """Median seconds of one decode step (CUDA events on a GPU, torch.utils.benchmark on a CPU)."""
    return probes.median_seconds(step_fn(model, batch_size, seq_len), _device(model), repeats=repeats)


# ---------------------------------------------------------------------------------------------------
# Whole generators against the floor

def generators_vs_floor(hf, prompt_len: int, new_tokens: int, threads_list=(None,), repeats: int = 3,
                        ours=None) -> list[dict]:
    """Time the book's three greedy generators on ``hf`` at each CPU thread count (``None``: leave
    it), measure the machine at that thread count, and return one row per generator with the
    measured seconds per token and the floor's (``roofline.generation_floor``)."""
    device = _device(hf)
    ours = ours or gpt2.GPT2.from_hf(hf)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, hf.config.vocab_size, (1, prompt_len), generator=g).to(device)
    runs, _ = G.roster(hf, ours, prompt, new_tokens)
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
def quiet_stderr():
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
    with quiet_stderr(), profile(activities=acts) as prof:
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


# ---------------------------------------------------------------------------------------------------
# Sweeps


def sweep(model, points, bandwidth: float, flops: float, vary: str = "batch", fixed: int = 64,
          repeats: int = 5, budget: timing.Budget | None = None) -> list[dict]:
    """Measured step time and the floor's terms along ``points`` batch sizes (``vary="batch"``,
    at ``fixed`` cached positions) or positions (``vary="seq"``, at batch ``fixed``); with a
    ``budget`` the sweep stops adding points when it is spent (``budget.note`` says which)."""
    rows, points = [], list(points)
    at = lambda p: (p, fixed) if vary == "batch" else (fixed, p)   # noqa: E731
    floor = lambda p: roofline.step_terms(model, *at(p), bandwidth, flops)["floor"]   # noqa: E731  the cost's shape
    grid = budget.points(points, size=floor) if budget is not None else points
    for p in progress.bar(grid, total=len(points), desc=f"{vary} sweep", leave=False):
        B, S = at(p)
        t = roofline.step_terms(model, B, S, bandwidth, flops)
        rows.append(dict(batch=B, seq=S, measured=step_time(model, B, S, repeats), **t))
    return rows


def knee(xs, ys, factor: float = 1.5):
    """The first x at which y reaches ``factor`` times its first value (None if it never does)."""
    return next((x for x, y in zip(xs, ys) if y >= factor * ys[0]), None)


# ---------------------------------------------------------------------------------------------------
# Verdicts: sentences computed from the numbers (never typed)


# ---------------------------------------------------------------------------------------------------
# Tables the chapter prints (shape-only models on the meta device: free to evaluate)


def shape_sizes_that_fit(device, quick: bool) -> list[str]:
    """GPT-2 sizes whose timing fits this device and the build's time budget: all four on a GPU (the
    smallest only in quick mode), GPT-2 small on a CPU (medium alone, three generators at two thread
    counts, took over ten minutes on the project's shared 2-core build machine)."""

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


def roofline_points(rows: list[dict], model) -> list[dict]:
    """Measured sweep rows (:func:`sweep`) as roofline points: intensity (FLOPs per byte of the
    step) and achieved FLOP/s (FLOPs / measured seconds)."""
    out = []
    for r in rows:
        f = roofline.decode_step_flops(model, r["batch"], r["seq"])
        out.append(dict(batch=r["batch"], seq=r["seq"], x=f / roofline.decode_step_bytes(model, r["batch"], r["seq"]),
                        y=f / r["measured"]))
    return out


# Published figures (NVIDIA's H200 SXM datasheet): memory bandwidth, dense fp32 and dense bf16
# tensor-core rates. Stated, not measured: the book's builds never ran on one.
H200 = {"name": "H200 (published figures)", "bandwidth": 4.8e12, "fp32": 67e12, "bf16": 989e12}


def dtype_rows(names, bandwidth: float, rates: dict, contexts=(0, 512, 2048)) -> list[dict]:
    """Ridge and critical batch per model when the same machine computes in each dtype of ``rates``
    ({dtype: FLOP/s}, the model stored in that dtype): computed from the same functions. A context
    beyond the model's own is left out of ``critical`` (no step of it exists)."""
    rows = []
    for dtype, rate in rates.items():
        for name in names:
            m = roofline.meta_model(name, dtype)
            fits = [c for c in contexts if c <= context_length(m)]
            rows.append(dict(name=name, dtype=str(dtype).removeprefix("torch."), ridge=rate / bandwidth,
                             critical=dict(zip(fits, roofline.critical_batch_curve(m, fits, bandwidth, rate)))))
    return rows




def prefill_rows(model, token_counts, bandwidth: float, flops: float) -> list[dict]:
    """Chapter 7's floor of a forward of ``N`` prompt tokens from an empty cache (one logit row), for
    each ``N`` of ``token_counts`` within the model's context (:func:`kvlab.roofline.forward_floor`):
    the floor, per token, and which term bounds it."""
    rows = []
    for n in (n for n in token_counts if n <= context_length(model)):
        attended = n * (n - 1) // 2
        b = roofline.step_bytes(model, n, 1, 0) / bandwidth
        f = roofline.step_flops(model, n, 1, attended) / flops
        rows.append(dict(tokens=n, floor=max(b, f), per_token=max(b, f) / n, memory=b, compute=f,
                         bound="compute" if f > b else "memory"))
    return rows


def prefill_ridge(model, bandwidth: float, flops: float) -> int | None:
    """The fewest prompt tokens whose forward is bound by compute (``None``: none within the context):
    below it a forward costs about the same whatever its token count, above it each token costs its
    FLOPs. Chapter 9's token budget per step is a choice about where to sit on this curve."""
    rows = prefill_rows(model, range(1, context_length(model) + 1), bandwidth, flops)
    return next((r["tokens"] for r in rows if r["bound"] == "compute"), None)


def chunk_floor(model, decode_rows: int, context: int, chunk: int, done: int, bandwidth: float,
                flops: float) -> float:
    """Floor of one mixed step (chapter 9): ``decode_rows`` sequences decoding at ``context`` cached
    positions each, plus a chunk of ``chunk`` prompt tokens after ``done`` of its prompt's tokens
    are cached (the chunk gives no logit row unless it ends the prompt: counted as one here)."""
    tokens = decode_rows + chunk
    cached = decode_rows * context + done
    attended = decode_rows * context + chunk * done + chunk * (chunk - 1) // 2
    return roofline.forward_floor(model, tokens, decode_rows + 1, cached, attended, bandwidth, flops)
