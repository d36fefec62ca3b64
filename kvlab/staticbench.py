"""Chapter 8's measurements: eager and compiled generators against chapter 7's floor.

    graphs_compiled(model, prompt, steps, how)   # torch's own count of graphs for a decode loop
    measure(hf, prompt_len, new_tokens, ...)     # eager / compiled x transformers / ours, vs the floor
    print_rows(rows), plot_rows(rows, ax)        # the table and the figure
    remains_sentences(rows, model)               # what is left above the floor, and in what
    step_breakdown(row), print_breakdown(parts)  # torch.profiler: a compiled step's parts vs their floors
    verdicts: small functions that turn the measured rows into the chapter's sentences

Compiled variants are timed after their first call, whose cost (compilation, and on a GPU the
recording of the CUDA graph) is measured on its own with :func:`kvlab.static.time_first_call`.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from . import floorbench, gpt2, harness, plots, probes, roofline, static, timing, verdicts
from .generate import hf_greedy
from .models import device_name
from .tables import show

# The four generators, and for each compiled one the eager one it replaces.
EAGER_HF, COMPILED_HF = "transformers, eager", "transformers, static + compiled"
EAGER_OURS, COMPILED_OURS = "ours, eager", "ours, static + compiled"
VARIANTS = (EAGER_HF, COMPILED_HF, EAGER_OURS, COMPILED_OURS)
TWIN = {COMPILED_HF: EAGER_HF, COMPILED_OURS: EAGER_OURS}


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


def _generators(hf, ours, prompt, new_tokens, device):
    config = static.hf_compile_config(device)
    dec = static.StaticDecoder(ours, max_len=prompt.shape[1] + new_tokens).compile()
    return dec, dict(zip(VARIANTS, (lambda: hf_greedy(hf, prompt, new_tokens),
                               lambda: static.hf_static_generate(hf, prompt, new_tokens, config),
                               lambda: gpt2.generate(ours, prompt, new_tokens),
                               lambda: dec.generate(prompt, new_tokens))))


def _check_tokens(runs, hf, prompt_len, new_tokens) -> None:
    harness.same_tokens(runs, EAGER_HF)    # a fast wrong generator is not a result
    print(f"{getattr(hf, 'kvlab_name', '?')}: all {len(runs)} generators give transformers' greedy "
          f"tokens ({new_tokens} new after a prompt of {prompt_len})")


def _rows(hf, res, first, matvec, m, prompt_len, new_tokens, dec) -> list[dict]:
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
                 achieved=roofline.achieved_bandwidth(hf, 1, prompt_len, n, t.median))
        if name == COMPILED_OURS:     # kept for step_breakdown: the profile reuses this compilation
            r.update(decoder=dec, part_floors=part_floors(hf, 1, prompt_len + n, bw, fl))
        if name in TWIN:
            r["compile_s"] = compile_seconds(first[name], t.median)
            r["break_even"] = static.break_even_tokens(r["compile_s"], res[TWIN[name]].median / n,
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
    ours = ours or gpt2.GPT2.from_hf(hf)
    torch._dynamo.reset()                  # compile from scratch: the first calls below pay for it
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, hf.config.vocab_size, (1, prompt_len), generator=g).to(device)
    dec, runs = _generators(hf, ours, prompt, new_tokens, device)
    first = {name: static.time_first_call(runs[name], device) for name in TWIN}
    _check_tokens(runs, hf, prompt_len, new_tokens)
    m = probes.machine(device, roofline.model_dtype(hf), verbose=False)
    products = matvec_fn(ours)             # timed with the generators, under the same conditions
    res = timing.compare({**runs, "matvec": lambda: [products() for _ in range(new_tokens)]}, warmup=0,
                         repeats=repeats, progress=progress)
    matvec = res.pop("matvec").median / new_tokens
    return _rows(hf, res, first, matvec, m, prompt_len, new_tokens, dec)


def print_rows(rows: list[dict]) -> None:
    """The generators against the floor, with achieved bandwidth and what compiling cost, as a table
    that fits the page (:func:`kvlab.tables.show`)."""
    def pays(r):
        return ("-" if r["compile_s"] is None else "never" if r["break_even"] is None
                else f"{r['break_even']:,.0f} tokens")
    show([{"model": r["model"], "threads": r["threads"], "generator": r["generator"],
           "ms/token": f"{r['per_token'] * 1e3:.3f}", "floor ms": f"{r['floor_per_token'] * 1e3:.3f}",
           "x floor": f"{r['ratio']:.2f}x", "achieved GB/s": f"{r['achieved'] / 1e9:.2f}",
           "of read probe": f"{r['achieved'] / r['bandwidth']:.0%}", "read probe GB/s": f"{r['bandwidth'] / 1e9:.1f}",
           "compile s": "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}", "pays off after": pays(r)}
          for r in rows])


def plot_rows(rows: list[dict], ax) -> None:
    """Measured ms per token (bars) and the floor (black ticks), one group per model."""
    plots.bars_against_floor(ax, rows, lambda r: (r["model"], r["threads"]), "generator", VARIANTS,
                             lambda g: f"{g[0]}\n{g[1]} thread{'s' * (g[1] > 1)}",
                             "eager and compiled, against the floor", hatched=set(TWIN))


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


def row(rows, model, generator, threads=None) -> dict:
    return next(r for r in rows if r["model"] == model and r["generator"] == generator
                and (threads is None or r["threads"] == threads))


def fastest_sentence(rows, model) -> str:
    mine = [r for r in rows if r["model"] == model]
    best = min(mine, key=lambda r: r["per_token"])
    base = row(mine, model, EAGER_HF)
    where = f"{best['threads']} thread{'s' * (best['threads'] > 1)}, {best['device']}"
    rival = min((r for r in mine if r is not best), key=lambda r: r["per_token"])
    told = verdicts.told_apart(best["timing"], rival["timing"])
    lead = (f"the fastest is '{best['generator']}'" if told else
            f"'{best['generator']}' and '{rival['generator']}' are the two fastest, not told apart by "
            f"the noise test (kvlab.verdicts), with '{best['generator']}' the lower median")
    return (f"On {model} ({where}) {lead}: {best['per_token'] * 1e3:.3f} ms per token, "
            f"{base['per_token'] / best['per_token']:.2f}x transformers' eager generate and "
            f"{best['ratio']:.2f}x the floor.")


def compile_sentence(rows, model) -> str:
    parts = []
    for name, twin in TWIN.items():
        r, e = row(rows, model, name), row(rows, model, twin)
        speed = e["per_token"] / r["per_token"]
        when = (f"pays for its {r['compile_s']:.1f} s of compilation after about "
                f"{r['break_even']:,.0f} tokens" if r["break_even"] is not None else
                f"never pays for its {r['compile_s']:.1f} s of compilation here (it is not faster)")
        parts.append(f"'{name}' runs at {speed:.2f}x '{twin}' and {when}")
    return f"On {model}: " + "; ".join(parts) + "."


def compile_seconds(first_call: float, steady: float) -> float:
    """The one definition of "compile s" (chapter 8, ``make bench``, the report): the first call's
    seconds minus the steady-state median of the same call (which includes the run itself), so it
    is the compilation (and on a GPU the CUDA-graph recording) alone; 0 if within the noise."""
    return max(first_call - steady, 0.0)


def question_sentences(rows, tiny="kvlab-tiny", big="shape:gpt2") -> list[str]:
    """The chapter's two questions, answered from this run (reported, never asserted): how much of
    the small model's overhead compiling removes, and how close the compiled step of a GPT-2-sized
    model on one thread comes to the read probe's bandwidth."""
    out = []
    if any(r["model"] == tiny for r in rows):
        e, c = row(rows, tiny, EAGER_HF), row(rows, tiny, COMPILED_OURS)
        out.append(f"How much faster than transformers' eager generate is the compiled hand-built decode of "
                   f"{tiny}? " + verdicts.faster(c["timing"], e["timing"], c["device"], COMPILED_OURS, EAGER_HF) + ".")
    if any(r["model"] == big and r["threads"] == 1 for r in rows):
        r = row(rows, big, COMPILED_OURS, threads=1)
        out.append(f"How close does the compiled decode of {big} on one thread come to what memory can "
                   f"stream? {r['achieved'] / 1e9:.1f} GB/s, {r['achieved'] / r['bandwidth']:.0%} of the read "
                   f"probe, {r['ratio']:.2f}x the floor.")
    return out


def achieved_lines(rows) -> list[str]:
    """Achieved bandwidth of every generator: bytes of the generation / its measured time, in GB/s
    and as a share of the read probe (the number to compare across machines)."""
    return [f"{r['model']:13} {r['threads']:3d} thr  {r['generator']:32} {r['achieved'] / 1e9:7.2f} GB/s "
            f"{r['achieved'] / r['bandwidth']:6.0%} of the read probe ({r['bandwidth'] / 1e9:.1f} GB/s)"
            for r in rows]


def remains_sentences(rows, model) -> list[str]:
    """What the compiled hand-built step of ``model`` spends above the floor, from the measured rows."""
    r = row(rows, model, COMPILED_OURS)
    step, mv, rest = r["per_token"], r["matvec_per_token"], max(r["per_token"] - r["matvec_per_token"], 0)
    slots = r["prompt_len"] + r["new_tokens"]
    return [
        f"{model}, {r['threads']} thread(s): compiled step {step * 1e3:.3f} ms, floor "
        f"{r['floor_per_token'] * 1e3:.3f} ms ({r['ratio']:.2f}x)",
        f"  matrix products alone: {mv * 1e3:.3f} ms, {mv / r['weight_s']:.2f}x the time to read the weights "
        f"once at the read probe's bandwidth; {min(mv / step, 1):.0%} of the compiled step",
        f"  floor if attention reads all {slots} slots of the static buffers: "
        f"{r['static_floor'] * 1e3:.3f} ms, "
        f"{r['static_floor'] / r['floor_per_token'] - 1:+.1%} on the floor of the filled cache",
        f"  the rest (attention, norms, embeddings, argmax, the loop and its guards): {rest * 1e3:.3f} ms, "
        f"{rest / step:.0%} of the step",
    ]


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
_ATTENTION_OPS = floorbench._CATEGORIES["attention"] | {"bmm", "baddbmm", "_safe_softmax"}
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

    if not getattr(dec, "compiled", False) or not isinstance(dec.cache, static.StaticCache):
        raise ValueError("profile_compiled_step needs a StaticDecoder with its own StaticCache, compiled "
                         "and run once: StaticDecoder(model, max_len=...).compile(), then .generate(...)")
    cuda, last = dec.ids.device.type == "cuda", dec.max_len - 1
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    samples = {p: [] for p in (*PARTS, "wall", "fused", "unprofiled")}
    _unprofiled(dec, 1, last, cuda)                  # one step first: nothing one-off lands in a sample
    for _ in range(rounds):
        samples["unprofiled"].append(_unprofiled(dec, steps, last, cuda))
        with floorbench._quiet_fd2(), profile(activities=acts) as prof:
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


def print_breakdown(parts: list[dict]) -> None:
    """The profiled parts of a compiled step against their floors (:func:`kvlab.tables.show`). Each
    part is the median over the profiled rounds; "share" is of the three medians' sum (medians do not
    add up to the median wall time)."""
    total = {m: sum(b["seconds"] for b in parts if b["model"] == m) for m in {b["model"] for b in parts}}
    show([{"model": b["model"], "threads": b["threads"], "part": b["part"], "ms/step": f"{b['seconds'] * 1e3:.3f}",
           "share": f"{b['seconds'] / total[b['model']]:.0%}" if total[b["model"]] else "-",
           "floor ms": f"{b['floor'] * 1e3:.4f}",
           "x floor": f"{b['seconds'] / b['floor']:.1f}x" if b["floor"] else "-",
           "above floor ms": f"{(b['seconds'] - b['floor']) * 1e3:.3f}"} for b in parts],
         caption=f"torch {torch.__version__} profiler, medians of " + "; ".join(dict.fromkeys(
             f"{b['model']}: {b['profiled']}, max_len {b['max_len']}, {b['where']}" for b in parts)))


def plot_breakdown(parts: list[dict], ax) -> None:
    """Each part's profiled ms per step (bars) and its floor (black ticks), log scale."""
    rows = [dict(b, per_token=b["seconds"], floor_per_token=b["floor"], what="compiled step, profiled")
            for b in parts]
    plots.bars_against_floor(ax, rows, lambda r: (r["model"], r["part"]), "what", ("compiled step, profiled",),
                             lambda g: f"{g[0]}\n{g[1]}", "a compiled step's parts, against each one's floor")


def breakdown_sentence(parts: list[dict]) -> str:
    """Which part of the profiled compiled step is farthest above its floor (seconds above it), and
    whether the noise test (:mod:`kvlab.verdicts`) tells it from the next one."""
    b = parts[0]
    if not any(x["seconds"] for x in parts if x["part"] != "everything else"):   # nothing was named
        why = ("no kernel of the replayed CUDA graph was recorded" if b["device"] == "cuda" else
               "their operators go by names this attribution does not know")
        return (f"On {b['model']} ({b['where']}) the profiler named no matrix product and no attention in "
                f"the compiled step ({why}), so its {b['wall'] * 1e3:.3f} ms are not split into parts here.")
    first, second = sorted(parts, key=lambda b: -b["excess"].median)[:2]
    b, nxt = first, second["excess"].median
    told = nxt <= 0 < b["excess"].median or verdicts.told_apart(first["excess"], second["excess"])
    return (f"On {b['model']} ({b['where']}), the part of the profiled compiled step farthest above its floor "
            f"is {b['part']}: {b['seconds'] * 1e3:.3f} ms against a floor of {b['floor'] * 1e3:.4f} ms, "
            f"{b['excess'].median * 1e3:.3f} ms of the {sum(x['excess'].median for x in parts) * 1e3:.3f} ms "
            f"the three parts spend above theirs; "
            + (f"the next, {second['part']}, is {nxt * 1e3:.3f} ms above its own." if told else
               f"{second['part']} ({nxt * 1e3:.3f} ms above its floor) is not told apart from it by the "
               "noise test (kvlab.verdicts)."))


def profiler_sentence(parts: list[dict]) -> str:
    """What the profile itself says about "everything else": how much of it the profiler's own events
    cost (profiled against unprofiled steps) and how much ran inside inductor's generated code."""
    b = parts[0]
    cost = b["wall"] - b["unprofiled"]
    gen = ("on a GPU, the device time of inductor's Triton kernels" if b["device"] == "cuda" else
           "inside inductor's generated code (its fused C++ kernels and the Python that calls them)")
    paid = (f"so about {cost * 1e3:.3f} ms of 'everything else' is the profiler's own cost"
            if cost > 0 and verdicts.told_apart(b["wall_timing"], b["unprofiled_timing"]) else
            "not told apart by the noise test (kvlab.verdicts): the profiler's own cost is within this "
            "run's noise")
    return (f"{b['model']}: the profiled step took {b['wall'] * 1e3:.3f} ms, the same steps without the "
            f"profiler {b['unprofiled'] * 1e3:.3f} ms, {paid}; {b['fused'] * 1e3:.3f} ms of the step ran {gen}.")
