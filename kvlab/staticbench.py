"""Chapter 8's measurements: eager and compiled generators against chapter 7's floor.

    graphs_compiled(model, prompt, steps, how)   # torch's own count of graphs for a decode loop
    measure(hf, prompt_len, new_tokens, ...)     # eager / compiled x transformers / ours, vs the floor
    print_rows(rows), plot_rows(rows, ax)        # the table and the figure
    remains_sentences(rows, model)               # what is left above the floor, and in what
    step_breakdown(row), print_breakdown(parts)  # torch.profiler: a compiled step's parts vs their floors
    verdicts: small functions that turn the measured rows into the chapter's sentences

Compiled variants are timed after their first call, whose cost (compilation, and on a GPU the
recording of the CUDA graph) is measured on its own with :func:`time_first_call`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from . import generators as G
from . import gpt2, harness, probes, roofline, rooflinebench, static, timing
from .provenance import device_name

# The four generators, and for each compiled one the eager one it replaces.
# Chapter 8's four generators (kvlab.generators' names), each compiled one beside the eager one it replaces.
VARIANTS = (G.TRANSFORMERS, G.TRANSFORMERS_COMPILED, G.HAND_BUILT, G.HAND_BUILT_COMPILED_BLAS, G.HAND_BUILT_COMPILED)


# ---------------------------------------------------------------------------------------------------
# How many graphs does a decode loop compile? (cheap: the aot_eager backend generates no code)


@torch.no_grad()
def graphs_compiled(model: gpt2.GPT2, prompt, steps: int, how: str) -> dict:
    """Run ``steps`` greedy decode steps of the hand-built GPT-2 with a compiled forward and return
    torch's counts: graphs compiled (``CompileCounter``) and graph breaks (dynamo's counters).

    ``how``: ``"growing, dynamic=False"`` (chapter 3's cache, every shape specialised),
    ``"growing, dynamic=None"`` (chapter 3's cache, torch's default: recompile once with symbolic
    sizes), or ``"static"`` (:class:`kvlab.static.StaticDecoder`)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    breaks = sum(counters["graph_break"].values())
    T = prompt.shape[1]
    with torch._dynamo.config.patch(recompile_limit=steps + 2):
        if how == "static":
            dec = static.StaticDecoder(model, max_len=T + steps + 1).compile(backend=counter)
            dec.generate(prompt, steps + 1)
        else:
            dynamic = None if how.endswith("None") else False
            cache = model.new_cache(1, max_len=T + steps + 1)
            fwd = torch.compile(lambda ids: model(ids, cache, last_only=True), backend=counter,
                                dynamic=dynamic)
            nxt = model(prompt, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
            for _ in range(steps):
                nxt = fwd(nxt)[:, -1].argmax(-1, keepdim=True)
    return {"how": how, "steps": steps, "graphs": counter.frame_count,
            "breaks": sum(counters["graph_break"].values()) - breaks}


# ---------------------------------------------------------------------------------------------------
# The four generators against the floor




def _check_tokens(runs, hf, prompt_len, new_tokens) -> None:
    harness.same_tokens(runs, G.TRANSFORMERS)    # a fast wrong generator is not a result
    print(f"{getattr(hf, 'kvlab_name', '?')}: all {len(runs)} generators give transformers' greedy "
          f"tokens ({new_tokens} new after a prompt of {prompt_len})")


def _rows(hf, res, first, matvec, m, prompt_len, new_tokens, decoders) -> list[dict]:
    device = next(hf.parameters()).device
    n, bw, fl = new_tokens, m["bandwidth"], m["flops"]
    floor = roofline.generation_floor(hf, 1, prompt_len, n, bw, fl) / n
    rows = []
    for name, t in res.items():
        r = dict(model=getattr(hf, "kvlab_name", "?"), threads=m["threads"], device=device.type,
                 generator=name, per_token=t.median / n, floor_per_token=floor,
                 ratio=t.median / n / floor, new_tokens=n, prompt_len=prompt_len, compile_s=None,
                 break_even=None, matvec_per_token=matvec, weight_s=roofline.weight_read_bytes(hf, 1) / bw,
                 static_floor=static_floor(hf, prompt_len + n, bw, fl), timing=t, bandwidth=bw,
                 probe_when=probes.measured_when(m),
                 achieved=roofline.achieved_bandwidth(hf, 1, prompt_len, n, t.median))
        if name in decoders:     # kept for step_breakdown: the profile reuses this compilation
            r.update(decoder=decoders[name], matvec=decoders[name].matvec,
                     part_floors=part_floors(hf, 1, prompt_len + n, bw, fl))
        if name in G.EAGER_OF:
            r["compile_s"] = compile_seconds(first[name], t.median)
            r["break_even"] = break_even_tokens(r["compile_s"], res[G.EAGER_OF[name]].median / n,
                                                       t.median / n)
        rows.append(r)
    return rows


def measure(hf, prompt_len: int, new_tokens: int, threads: int | None = None, repeats: int = 3,
            ours=None, progress: bool = True) -> list[dict]:
    """Time the four generators on ``hf`` (interleaved, medians) after compiling the two compiled
    ones (their first call timed apart), check they all give transformers' greedy tokens, measure
    the machine (chapter 7) and return one row per generator: seconds per token, the floor's,
    their ratio, the compile time and, for a compiled one, the tokens after which it pays off."""
    device = next(hf.parameters()).device
    if device.type == "cpu" and threads:
        torch.set_num_threads(threads)     # before compiling: inductor's C++ uses this many threads
    from . import compilecount

    ours = ours or gpt2.GPT2.from_hf(hf)
    # the machine first: its read probes compile kernels of their own, which are not the generators' graphs
    m = probes.machine(device, roofline.model_dtype(hf), verbose=False)
    torch._dynamo.reset()                  # compile from scratch: the first calls below pay for it
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, hf.config.vocab_size, (1, prompt_len), generator=g).to(device)
    with compilecount.counting() as counts:    # what torch counts for the generators alone, timing included
        runs, decoders = G.roster(hf, ours, prompt, new_tokens, VARIANTS)
        first = {name: time_first_call(runs[name], device) for name in G.COMPILED}
        _check_tokens(runs, hf, prompt_len, new_tokens)
        products = matvec_fn(ours)             # timed with the generators, under the same conditions
        res = timing.compare({**runs, "matvec": lambda: [products() for _ in range(new_tokens)]}, warmup=0,
                             repeats=repeats, progress=progress)
    matvec = res.pop("matvec").median / new_tokens
    rows = _rows(hf, res, first, matvec, m, prompt_len, new_tokens, decoders)
    for r in rows:
        r["torch_counts"] = counts             # the same dict for every row of this model
    return rows


# ---------------------------------------------------------------------------------------------------
# What remains above the floor


def matvec_fn(ours: gpt2.GPT2):
    """A function running only the matrix products of one batch-1 decode step (every Linear of every
    block, then the LM head), each on one vector: the part of a step that reads the weights."""
    device = ours.wte.weight.device
    mats = [(m.weight, m.bias) for m in ours.modules() if isinstance(m, torch.nn.Linear)]
    mats.append((ours.wte.weight, None))
    xs = {w.shape[1]: torch.randn(1, w.shape[1], device=device, dtype=w.dtype) for w, _ in mats}

    @torch.no_grad()
    def products():
        for w, b in mats:
            F.linear(xs[w.shape[1]], w, b)
    return products


def static_floor(hf, max_len: int, bandwidth: float, flops: float) -> float:
    """Floor of a static-cache decode step whose attention reads all ``max_len`` slots (the masked
    ones too): what a compiled static step really has to move."""
    return roofline.step_time_floor(hf, 1, max_len, bandwidth, flops)


# ---------------------------------------------------------------------------------------------------
# Verdicts: sentences computed from the rows


def compile_seconds(first_call: float, steady: float) -> float:
    """The one definition of "compile s" (chapter 8, ``make bench``, the report): the first call's
    seconds minus the steady-state median of the same call (which includes the run itself), so it
    is the compilation (and on a GPU the CUDA-graph recording) alone; 0 if within the noise."""
    return max(first_call - steady, 0.0)




# ---------------------------------------------------------------------------------------------------
# Where a compiled step's time goes: torch.profiler, each part against its own floor
#
# inductor fuses the step's elementwise work (layer norms, GELU, residual adds, the cache write, the
# mask, the argmax) into generated kernels (C++ on a CPU, Triton on a GPU) that the profiler does not
# name on a CPU, and calls a library for the matrix products (``extern_kernels.mm / addmm``: aten
# operators the profiler does name) and, unless it decomposed it, for attention. Those two are
# attributed by name; "everything else" is the rest of the step's wall time.

PARTS = ("matrix products", "attention", "everything else")
_STEP = "kvlab::compiled_step"
_GENERATED = "## Call CompiledFxGraph"    # inductor's generated code on a CPU: its fused kernels, their caller
_MATMUL_OPS = {"mm", "addmm", "addmv", "mv", "linear", "_mkl_linear", "_linear_pointwise"}
_ATTENTION_OPS = rooflinebench._CATEGORIES["attention"] | {"bmm", "baddbmm", "_safe_softmax"}
# GPU kernel names, by substring (lower case); attention first: "fmha_cutlassF" is attention, not a GEMM
_ATTENTION_KERNELS = ("flash", "fmha", "attention", "attn", "sdpa", "softmax")
_MATMUL_KERNELS = ("gemm", "gemv", "cutlass", "xmma", "splitk", "dot_kernel", "triton_tem_fused_mm",
                   "triton_tem_fused_addmm")


def part_of(name: str, kernel: bool = False) -> str:
    """The part of :data:`PARTS` a profiler event belongs to: an operator's name (``aten::addmm``),
    or with ``kernel=True`` a GPU kernel's. A batched product (``bmm``) is attention's (queries times
    cached keys, weights times values): no weight matrix of GPT-2 is batched."""
    low = name.lower()
    if kernel:
        hit = next((p for p, subs in (("attention", _ATTENTION_KERNELS), ("matrix products", _MATMUL_KERNELS))
                    if any(s in low for s in subs)), None)
        return hit or "everything else"
    op = name.split("::")[-1]
    return ("matrix products" if op in _MATMUL_OPS else "attention" if op in _ATTENTION_OPS
            else "everything else")


def _attribute(events, steps: int, cuda: bool) -> dict[str, float]:
    """Seconds per step in each part from one profile's ``key_averages()``: operators' self CPU time on
    a CPU, kernels' device time on a GPU (not the device-side spans of annotated ranges); "everything
    else" is the step's wall time minus the two."""
    from torch.autograd import DeviceType

    out, wall, fused = dict.fromkeys(PARTS, 0.0), 0.0, 0.0
    for ev in events:
        if ev.key == _STEP:      # on a GPU the step's range also has a device-side twin: not a kernel
            wall = ev.cpu_time_total / 1e6 / steps if ev.device_type == DeviceType.CPU else wall
        elif cuda and ev.device_type == DeviceType.CUDA and not getattr(ev, "is_user_annotation", False):
            out[part_of(ev.key, kernel=True)] += ev.self_device_time_total / 1e6 / steps
            fused += ev.self_device_time_total / 1e6 / steps * ev.key.startswith("triton_")
        elif not cuda and ev.device_type == DeviceType.CPU:
            out[part_of(ev.key)] += ev.self_cpu_time_total / 1e6 / steps
            fused += ev.self_cpu_time_total / 1e6 / steps * ev.key.startswith(_GENERATED)
    named = out["matrix products"] + out["attention"]
    out["everything else"] = max(wall - named, 0.0)
    out.update(wall=max(wall, named), fused=fused)
    return out


def _unprofiled(dec, steps: int, last: int, cuda: bool) -> float:
    """Seconds per step of the same loop without the profiler (its own events cost time)."""
    start = time.perf_counter()
    for _ in range(steps):
        dec.cache.position.fill_(last)
        dec.step(dec.ids)
    if cuda:
        torch.cuda.synchronize(dec.ids.device)
    return (time.perf_counter() - start) / steps


@torch.no_grad()
def profile_compiled_step(dec, steps: int = 5, rounds: int = 3) -> dict[str, timing.Timing]:
    """Seconds per step in each part of a compiled :class:`kvlab.static.StaticDecoder`'s decode step,
    the profiled step's wall time, the part of it inside inductor's generated code ("fused") and the
    same steps timed without the profiler ("unprofiled"): one sample per round of ``steps`` steps. Reuses the
    decoder's compilation; every step writes the last slot of its cache (the position is put back
    in place), so it runs as often as needed and reads all ``max_len`` slots like any other step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    if not getattr(dec, "compiled", False) or not isinstance(dec.cache, static.StaticKVCache):
        raise ValueError("profile_compiled_step needs a StaticDecoder with its own StaticKVCache, compiled "
                         "and run once: StaticDecoder(model, max_len=...).compile(), then .generate(...)")
    cuda, last = dec.ids.device.type == "cuda", dec.max_len - 1
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    samples = {p: [] for p in (*PARTS, "wall", "fused", "unprofiled")}
    _unprofiled(dec, 1, last, cuda)                  # one step first: nothing one-off lands in a sample
    for _ in range(rounds):
        samples["unprofiled"].append(_unprofiled(dec, steps, last, cuda))
        with rooflinebench.quiet_stderr(), profile(activities=acts) as prof:
            for _ in range(steps):
                dec.cache.position.fill_(last)
                with record_function(_STEP):
                    dec.step(dec.ids)
                    if cuda:
                        torch.cuda.synchronize(dec.ids.device)
        for p, v in _attribute(prof.key_averages(), steps, cuda).items():
            samples[p].append(v)
    return {p: timing.Timing(p, s) for p, s in samples.items()}


def part_floors(model, batch_size: int, max_len: int, bandwidth: float, flops: float) -> dict[str, float]:
    """Floor of each part of a static-cache decode step (seconds): the larger of the bytes it must
    read over ``bandwidth`` and its FLOPs over ``flops``. Matrix products: every matmul weight once,
    the LM head included; attention: the static buffers' keys and values, all ``max_len`` slots;
    everything else: the rest of the step's bytes (biases, norms, the embedding rows)."""
    element = roofline.model_dtype(model).itemsize
    mm = roofline.matmul_weights(model) * element
    att = roofline.cache_read_bytes(model, batch_size, max_len)
    rest = roofline.decode_step_bytes(model, batch_size, max_len) - mm - att
    return {"matrix products": max(mm / bandwidth, roofline.step_flops(model, batch_size, batch_size, 0) / flops),
            "attention": max(att / bandwidth, roofline.step_flops(model, 0, 0, batch_size * max_len) / flops),
            "everything else": max(rest, 0) / bandwidth}


def step_breakdown(r: dict, steps: int = 10, rounds: int = 5) -> list[dict]:
    """Profile the compiled step of a row of :func:`measure` (its decoder, already compiled) and set
    each part against its floor: one dict per part, with the profile's samples for the noise test."""
    saved = torch.get_num_threads()
    if r["device"] == "cpu":
        torch.set_num_threads(r["threads"])      # the thread count the row was measured (and compiled) at
    try:
        prof, where = profile_compiled_step(r["decoder"], steps, rounds), device_name(torch.device(r["device"]))
    finally:
        torch.set_num_threads(saved)
    out = []
    for p in PARTS:
        t, floor = prof[p], r["part_floors"][p]
        out.append(dict(model=r["model"], threads=r["threads"], device=r["device"], part=p, seconds=t.median,
                        floor=floor, wall=prof["wall"].median, unprofiled=prof["unprofiled"].median,
                        fused=prof["fused"].median, where=where, timing=t, wall_timing=prof["wall"],
                        unprofiled_timing=prof["unprofiled"], profiled=f"{rounds} x {steps} steps",
                        max_len=r["decoder"].max_len,
                        excess=timing.Timing(p, [s - floor for s in t.samples])))
    return out


def cpu_compiler() -> str:
    """The C++ compiler inductor builds its CPU kernels with (``$CXX``, else ``g++``; ``clang++`` on
    macOS) and its version. ``torch.compile`` on a CPU writes C++ and needs one: without it, say so."""
    cxx = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"torch.compile on a CPU needs a C++ compiler and '{cxx}' is not installed: "
                           "install g++ (Debian/Ubuntu: apt-get install g++) or point CXX at another one")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()
    return f"{cxx} ({version[0] if version else 'unknown version'})"


def time_first_call(fn, device) -> float:
    """Seconds of ONE call of ``fn``, the one that compiles. ``torch.utils.benchmark`` cannot time it: it
    warms up before measuring, and the warm-up is exactly the compilation. So: a wall clock around a
    single call, the device synchronised before and after (CUDA runs asynchronously)."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def break_even_tokens(compile_seconds: float, eager_per_token: float, compiled_per_token: float):
    """After how many generated tokens compiling has paid for itself (``None``: it never does)."""
    gain = eager_per_token - compiled_per_token
    return compile_seconds / gain if gain > 0 else None


def batch_rows(ours, batches, prompt_len: int, new_tokens: int, repeats: int = 3) -> list[dict]:
    """The compiled decode at several batch sizes, one :class:`kvlab.static.StaticDecoder` (one graph)
    per size, as engines capture one CUDA graph per batch size from a set: per size, torch's count of
    graphs, the first call apart, then every size timed interleaved; tokens checked against eager."""
    from . import compilecount

    device = ours.ln_f.weight.device
    torch._dynamo.reset()      # every decoder compiles StaticDecoder._step: start under torch's recompile limit
    g = torch.Generator().manual_seed(2)
    decs, runs, counts = {}, {}, {}
    for b in batches:
        prompt = torch.randint(0, ours.config.vocab_size, (b, prompt_len), generator=g).to(device)
        decs[b] = static.StaticDecoder(ours, batch_size=b, max_len=prompt_len + new_tokens).compile()
        runs[b] = (lambda d, p: lambda: d.generate(p, new_tokens))(decs[b], prompt)
        with compilecount.counting() as counts[b]:
            time_first_call(runs[b], device)
        if not torch.equal(runs[b](), gpt2.generate(ours, prompt, new_tokens)):
            raise RuntimeError(f"the compiled decoder at batch {b} does not give eager's tokens: not timing it")
    res = timing.compare(runs, warmup=0, repeats=repeats, progress=False)
    return [dict(batch=b, graphs=counts[b]["graphs"], matvec=decs[b].matvec, per_step=t.median / new_tokens,
                 tokens_per_s=b * new_tokens / t.median, timing=t,
                 achieved=roofline.achieved_bandwidth(ours, b, prompt_len, new_tokens, t.median))
            for b, t in res.items()]
