"""Chapter 8's last measurement: the hand-built GPT-2 with fp32, bf16 and int8 weights (``kvlab.weights``),
eager and compiled, in one interleaved run, each against its own floor.

    rows = measure(ours, prompt_len, new_tokens)     # one row per (format, eager/compiled)
    quality(ours, tok)                               # held-out perplexity and greedy agreement per format
    crossover_rows(ours, batches)                    # the context at which the cache outweighs the weights

A format's floor is chapter 7's for the bytes that format's step reads (``kvlab.roofline`` counts each
tensor at its own dtype: int8 matrices at one byte a weight, their scales and biases at four), over
the read probe's bandwidth; its FLOPs are priced at the rate of the dtype doing the arithmetic (bf16
for the bf16 model, and for int8 on a CPU, whose int8 kernel multiplies in bf16).
"""

from __future__ import annotations

import torch

from . import gpt2, probes, roofline, timing, weights
from .configs import bytes_per_element
from .memory import kv_cache_bytes
from .paths import TINY_DIR
from .quality import describe, perplexity
from .reference import first_difference
from .static import StaticDecoder
from .staticbench import compile_seconds, time_first_call

EAGER, COMPILED = "eager", "compiled"


def arithmetic_dtype(fmt: str) -> torch.dtype:
    """The dtype whose matmul rate prices a format's FLOPs (int8's CPU kernel multiplies in bf16)."""
    return torch.float32 if fmt == "fp32" else torch.bfloat16


def tokens_agreeing(out, want, prompt_len: int, new_tokens: int) -> int:
    """How many of the ``new_tokens`` generated after a prompt of ``prompt_len`` equal ``want``'s, up to
    the first difference (all of them when the two are identical)."""
    at = first_difference(out, want)
    return new_tokens if at is None else max(at - prompt_len, 0)


def generators(ours, prompt, new_tokens: int, formats=weights.FORMATS, compiled: bool = True) -> dict:
    """``{(fmt, how): (model, fn)}``: the hand-built GPT-2 in each format, eager (chapter 3's
    preallocated cache) and compiled (chapter 8's static decoder, not yet compiled: its first call does)."""
    out = {}
    for fmt in formats:
        model = ours if fmt == "fp32" else weights.convert(ours, fmt)
        out[fmt, EAGER] = (model, lambda m=model: gpt2.generate(m, prompt, new_tokens))
        if compiled:
            dec = StaticDecoder(model, max_len=prompt.shape[1] + new_tokens).compile()
            out[fmt, COMPILED] = (model, lambda d=dec: d.generate(prompt, new_tokens))
    return out


def measure(ours, prompt_len: int, new_tokens: int, formats=weights.FORMATS, repeats: int = 5,
            compiled: bool = True, machine: dict | None = None, progress: bool = True) -> list[dict]:
    """Every format, eager and compiled, timed interleaved on one random prompt after the compiled
    ones' first call (timed apart); tokens compared with fp32 eager's. One row each: seconds per
    token, bytes per step, the floor, x floor, achieved GB/s and its share of the read probe."""
    device = ours.ln_f.weight.device
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, ours.config.vocab_size, (1, prompt_len), generator=g).to(device)
    torch._dynamo.reset()      # every decoder compiles StaticDecoder._step: start under torch's recompile limit
    gens = generators(ours, prompt, new_tokens, formats, compiled)
    first = {k: time_first_call(fn, device) for k, (_, fn) in gens.items() if k[1] == COMPILED}
    want = gens["fp32", EAGER][1]() if ("fp32", EAGER) in gens else gpt2.generate(ours, prompt, new_tokens)
    agree = {k: tokens_agreeing(fn(), want, prompt_len, new_tokens) for k, (_, fn) in gens.items()}
    m = machine or probes.machine(device, verbose=False)
    rates = {m["flops_dtype"]: m["flops"]}          # the machine's own rate, measured once
    rates.update({d: probes.measure_matmul_flops(device, d, verbose=False)
                  for d in dict.fromkeys(arithmetic_dtype(f) for f in formats) if d not in rates})
    res = timing.compare({k: fn for k, (_, fn) in gens.items()}, warmup=0, repeats=repeats, progress=progress)
    rows = []
    for (fmt, how), t in res.items():
        model = gens[fmt, how][0]
        rate = rates[arithmetic_dtype(fmt)]
        floor = roofline.generation_floor(model, 1, prompt_len, new_tokens, m["bandwidth"], rate) / new_tokens
        # the bytes alone (arithmetic free): where the floor is above it, the dtype's arithmetic sets it
        bytes_floor = roofline.generation_bytes(model, 1, prompt_len, new_tokens) / m["bandwidth"] / new_tokens
        achieved = roofline.achieved_bandwidth(model, 1, prompt_len, new_tokens, t.median)
        rows.append(dict(weights=fmt, generator=how, per_token=t.median / new_tokens, floor_per_token=floor,
                         bytes_floor_per_token=bytes_floor, flops_rate=rate, flops_dtype=arithmetic_dtype(fmt),
                         x_floor=t.median / new_tokens / floor, achieved=achieved,
                         of_probe=achieved / m["bandwidth"], timing=t,
                         step_bytes=roofline.decode_step_bytes(model, 1, prompt_len + new_tokens // 2),
                         weight_bytes=roofline.weight_read_bytes(model, 1),
                         same_as_fp32=agree[fmt, how],
                         new_tokens=new_tokens, prompt_len=prompt_len, bandwidth=m["bandwidth"],
                         compile_s=compile_seconds(first[fmt, how], t.median) if how == COMPILED else None,
                         model=getattr(ours, "kvlab_name", "?"), device=device.type,
                         threads=torch.get_num_threads()))
    return rows


@torch.no_grad()
def quality(ours, tok, formats=weights.FORMATS, quick: bool = False, prompts: int = 4,
            new_tokens: int = 48) -> list[dict]:
    """Per format: the book's perplexity (:func:`kvlab.quality.perplexity`, the one measurement every
    page quotes; ``ppl_text`` says what it scored) and greedy agreement with fp32 (mean tokens
    generated before the first difference, over ``prompts`` held-out prompts of 16 tokens)."""
    # the whole text, longer than any context (verbose=False: no "indexing errors" warning); cut below
    ids = tok((TINY_DIR / "heldout.txt").read_text(), return_tensors="pt", verbose=False).input_ids[0]
    starts = torch.linspace(0, ids.numel() - 17, prompts).long().tolist()
    ps = [ids[s:s + 16][None].to(ours.ln_f.weight.device) for s in starts]
    refs = [gpt2.generate(ours, p, new_tokens) for p in ps]
    rows = []
    for fmt in formats:
        model = ours if fmt == "fp32" else weights.convert(ours, fmt)
        ppl = perplexity(model, tok, quick)
        same = [tokens_agreeing(gpt2.generate(model, p, new_tokens), ref, p.shape[1], new_tokens)
                for p, ref in zip(ps, refs)]
        rows.append(dict(weights=fmt, weight_mb=roofline.weight_bytes(model) / 1e6,
                         perplexity=ppl["ppl"], windows=ppl["windows"], ppl_text=describe(ppl),
                         same_tokens=sum(same) / len(same), of_tokens=new_tokens,
                         describe=weights.describe(model)))
    return rows


def crossover_rows(ours, batches=(1, 8, 64), formats=weights.FORMATS, cache_formats=None) -> list[dict]:
    """Computed: for each weight format (and the cache's dtype: the model's own, or chapter 5's
    formats given as bytes per element), the cached tokens a step must read, summed over its rows, for
    the cache to outweigh the weights, and that as a context per row at each batch (``None``: beyond
    the model's context, the weights stay the larger part)."""
    cfg, rows = ours.config, []
    for fmt in formats:
        model = ours if fmt == "fp32" else weights.convert(ours, fmt)
        own = "fp32" if model.dtype == torch.float32 else "bf16"
        for cache_name, per in {own: bytes_per_element(model.dtype), **(cache_formats or {})}.items():
            per_token = kv_cache_bytes(cfg, 1, 1, model.dtype) / bytes_per_element(model.dtype) * per
            for B in batches:
                w = roofline.weight_read_bytes(model, B)
                context = -(-w // (B * per_token))       # ceil: the first context where cache >= weights
                rows.append(dict(weights=fmt, cache=cache_name, batch=B, weight_mb=w / 1e6,
                                 cache_kb_per_token=per_token / 1e3, tokens=int(B * context),
                                 context=int(context) if context <= cfg.n_positions else None))
    return rows


def context_sweep(ours, batch: int, contexts, formats=("fp32", "int8"), repeats: int = 5) -> list[dict]:
    """Measured: one eager decode step of ``batch`` rows at each context, for each weight format,
    interleaved (``kvlab.rooflinebench.step_fn``), beside the predicted share of the step's bytes
    that is cache. The measured crossover is where the step takes twice its shortest-context time:
    there, if both terms stream at one bandwidth, reading the cache costs what reading the weights does."""
    from .rooflinebench import step_fn

    models = {f: ours if f == "fp32" else weights.convert(ours, f) for f in formats}
    fns = {(f, s): step_fn(m, batch, s) for f, m in models.items() for s in contexts}
    res = timing.compare(fns, warmup=1, repeats=repeats, progress=False)
    rows = []
    for (f, s), t in res.items():
        m = models[f]
        cache = roofline.cache_read_bytes(m, batch, s)
        rows.append(dict(weights=f, batch=batch, context=s, ms=t.median * 1e3, timing=t, device=ours.ln_f.weight.device,
                        
                         cache_share=cache / roofline.decode_step_bytes(m, batch, s)))
    return rows


def measured_crossover(rows, fmt: str) -> int | None:
    """The first context of a :func:`context_sweep` at which the ``fmt`` step took at least twice its
    shortest-context time (``None``: not within the sweep)."""
    mine = sorted((r for r in rows if r["weights"] == fmt), key=lambda r: r["context"])
    return next((r["context"] for r in mine if r["ms"] >= 2 * mine[0]["ms"]), None)
