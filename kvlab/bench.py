"""The benchmark command: the book's headline speed ratios, measured in one interleaved run.

    python -m kvlab.bench                                  # kvlab-tiny, 200 new tokens
    python -m kvlab.bench --model shape:gpt2 --threads 1   # the peer comparison (124M shape, 1 thread)
    make bench                                             # the same as the first line

Before timing anything it checks that every generator produces the same tokens (a fast wrong
generator is not a result). It then prints ratios, each from one interleaved run on this machine,
with the banner that says which machine that is, and each generator's time over the floor that
this machine's measured bandwidth and matmul rate set (chapter 7). No test asserts these numbers: they are
measurements, not properties.

The compiled rows (chapter 8: a static cache and ``torch.compile`` of the decode step, CUDA graphs on a
GPU; ``--no-compile`` skips them) are compiled before the run; their compile time is printed apart,
with the number of tokens after which compiling pays off. On a CPU this needs a C++ compiler.

The hand-built GPT-2 also runs with bf16 and int8 weights (``kvlab.weights``; ``--no-formats`` skips
them), eager and compiled, in the same interleaved run: their tokens are compared with fp32's (how
many agree) rather than required to be equal, and each is held against its own format's floor.

Each generator's achieved bandwidth (the bytes of its generation, chapter 7's count, over its median
time) is printed in GB/s and as a share of the best reader's bandwidth (``probes.best_bandwidth``):
the figure to compare across machines. A row above 100% from a step larger than the last-level
cache is flagged: the probe would not be a floor.
"""

from __future__ import annotations

import argparse

import torch

from . import generators as G
from . import gpt2, harness, loading, probes, provenance, roofline, staticbench, timing, weightbench
from .cli import at_least
from .validate import check_context


class BadArguments(ValueError):
    """An argument that only the loaded model shows to be wrong (a prompt beyond its context)."""


def run(model_name: str, new_tokens: int, prompt_len: int, repeats: int, threads: int | None,
        naive: bool, compiled: bool = True, formats: bool = True) -> dict[str, float]:
    timing.set_threads(threads)
    device = loading.pick_device()
    hf, _ = loading.load(model_name, device=device)
    provenance.banner(hf, device)
    ours = gpt2.GPT2.from_hf(hf).to(device).eval()
    try:
        check_context(prompt_len + new_tokens, hf.config.n_positions,
                      f"--prompt-len {prompt_len} + --new-tokens {new_tokens} of {model_name}", "ask for fewer")
    except ValueError as e:
        raise BadArguments(str(e)) from None
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, hf.config.vocab_size, (1, prompt_len), generator=g).to(device)

    names = G.EAGER + ((G.NAIVE,) if naive else ()) + (G.COMPILED if compiled else ())
    runs, _ = G.roster(hf, ours, prompt, new_tokens, names)
    first_call = _compile(runs, device)
    try:
        harness.same_tokens(runs, G.TRANSFORMERS)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    print(f"all {len(runs)} generators give identical tokens ({new_tokens} new, prompt {prompt_len})")
    models = dict.fromkeys(runs, hf)
    eager_of = dict(G.EAGER_OF)
    if formats:                            # chapter 8's smaller weights: bytes read per step shrink
        extra = _format_runs(ours, prompt, new_tokens, compiled, runs, models, first_call, eager_of, device)
        runs = {**runs, **extra}

    res = timing.compare(runs, warmup=0, repeats=repeats)   # the correctness pass above was the warm-up
    out = _print_results(res, models, device, prompt_len, new_tokens)
    _print_compile_times(first_call, res, new_tokens, eager_of)
    return out


def _format_name(fmt: str, how: str) -> str:
    base = G.HAND_BUILT_COMPILED if how == weightbench.COMPILED else G.HAND_BUILT
    return base.replace("hand-built GPT-2", f"hand-built GPT-2, {fmt} weights")


def _format_runs(ours, prompt, new_tokens, compiled, runs, models, first_call, eager_of, device) -> dict:
    """The hand-built GPT-2 with bf16 and int8 weights (``kvlab.weights``), eager and compiled: their
    tokens cannot equal fp32's exactly, so they are compared with it (tokens before the first
    difference) instead of refused; each row's floor and bytes are its own format's. Records each
    compiled row's eager twin in ``eager_of`` (for its break-even)."""
    gens = weightbench.generators(ours, prompt, new_tokens, ("bf16", "int8"), compiled)
    want = runs[G.HAND_BUILT]()
    extra = {}
    for (fmt, how), (model, fn) in gens.items():
        name = _format_name(fmt, how)
        if how == weightbench.COMPILED:
            print(f"compiling: {name} ...", flush=True)
            first_call[name] = staticbench.time_first_call(fn, device)
            eager_of[name] = _format_name(fmt, weightbench.EAGER)
        same = weightbench.tokens_agreeing(fn(), want, prompt.shape[1], new_tokens)
        print(f"{name}: the first {same} of {new_tokens} tokens equal fp32's ({weightbench.weights.describe(model)})")
        extra[name], models[name] = fn, model
    return extra


def _print_results(res, models, device, prompt_len: int, new_tokens: int) -> dict[str, float]:
    """One line per generator: median, tokens/s, speed vs transformers, multiple of its floor, achieved
    GB/s and its share of the read probe (flagged if above it). Returns the speed ratios."""
    floors, probe = _floors(models, device, prompt_len, new_tokens)
    base = res[G.TRANSFORMERS]
    print(f"\n{'generator':58s} {'median s':>9s} {'tokens/s':>9s} {'speed vs transformers':>22s} {'x floor':>8s} "
          f"{'achieved':>10s} {'of probe':>8s}")
    out, above = {}, []
    for name, t in res.items():
        out[name] = timing.ratio(base, t)
        gbps = roofline.achieved_bandwidth(models[name], 1, prompt_len, new_tokens, t.median)
        if probes.above_probe(gbps, probe, roofline.decode_step_bytes(models[name], 1, prompt_len), device):
            above.append(name)
        print(f"{name:58s} {t.median:9.3f} {new_tokens / t.median:9.1f} {out[name]:21.2f}x "
              f"{t.median / floors[name]:7.1f}x {gbps / 1e9:6.2f} GB/s {gbps / probe:7.0%}   (spread {t.spread:.0%})")
    if above:
        print(f"\nABOVE THE PROBE: {', '.join(above)} streamed more than the best reader measured, from a step larger "
              "than the last-level cache: the probe is not this machine's limit here (a noisy run, or a faster "
              "reader the probe does not try)")
    return out


def _compile(runs, device) -> dict[str, float]:
    """Call each compiled generator of ``runs`` once; return the seconds of that first call, which
    compiles (torch.compile: inductor; CUDA graphs on a GPU)."""
    first = {}
    for name in (n for n in runs if n in G.EAGER_OF):
        print(f"compiling: {name} ...", flush=True)
        first[name] = staticbench.time_first_call(runs[name], device)
    return first


def _print_compile_times(first_call, res, new_tokens, eager_of) -> None:
    """Compile time apart from the steady state, and after how many tokens compiling pays off."""
    for name, first in first_call.items():
        eager_name = eager_of[name]
        eager, steady = res[eager_name].median, res[name].median
        compile_s = staticbench.compile_seconds(first, steady)
        n = staticbench.break_even_tokens(compile_s, eager / new_tokens, steady / new_tokens)
        pays = f"pays off after {n:,.0f} tokens" if n is not None else "never pays off here"
        print(f"{name}: first call {first:.1f} s (compilation included), steady {steady:.3f} s, so compiling "
              f"took about {compile_s:.1f} s (first call - steady); against {eager_name} it {pays}")


def _floors(models, device, prompt_len: int, new_tokens: int) -> tuple[dict[str, float], float]:
    """The least time each generation could take on this machine (chapter 7): its own model's bytes
    over the best reader's bandwidth, its FLOPs at the rate of the dtype doing its arithmetic; and
    that bandwidth."""
    m = probes.machine(device, torch.float32)
    rates = {torch.float32: m["flops"]}
    floors = {}
    for name, model in models.items():
        fmt = weightbench.weights.weight_format(model) if isinstance(model, gpt2.GPT2) else "fp32"
        dtype = weightbench.arithmetic_dtype(fmt) if fmt != "fp32" else roofline.model_dtype(model)
        if dtype not in rates:
            rates[dtype] = probes.arithmetic_rate(device, dtype)[0]
        floors[name] = roofline.generation_floor(model, 1, prompt_len, new_tokens, m["bandwidth"], rates[dtype])
    print(f"floor of the fp32 generation here: {floors[G.TRANSFORMERS]:.3f} s (max of bytes / best reader's bandwidth "
          "and FLOPs / matmul rate per step; each weight format has its own); 'x floor' = median / floor; "
          "'achieved' = bytes of the generation / median, 'of probe' = achieved / best reader's bandwidth")
    return floors, m["bandwidth"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="kvlab-tiny", help="any name kvlab.loading.load accepts")
    ap.add_argument("--new-tokens", type=at_least(1), default=200)
    ap.add_argument("--prompt-len", type=at_least(1), default=8)
    ap.add_argument("--repeats", type=at_least(1), default=5)
    ap.add_argument("--threads", type=at_least(1), default=None,
                    help="CPU threads (default: KVLAB_THREADS or all cores)")
    ap.add_argument("--no-naive", action="store_true", help="skip the (slow) uncached generator")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled generators (chapter 8)")
    ap.add_argument("--no-formats", action="store_true",
                    help="skip the hand-built GPT-2's bf16 and int8 weights (chapter 8)")
    args = ap.parse_args(argv)
    try:
        loading.pick_device()              # KVLAB_DEVICE, checked before anything is loaded
        timing.env_threads()               # KVLAB_THREADS too
    except ValueError as e:
        ap.error(str(e))
    try:
        run(args.model, args.new_tokens, args.prompt_len, args.repeats, args.threads, naive=not args.no_naive,
            compiled=not args.no_compile, formats=not args.no_formats)
    except (BadArguments, loading.ModelNotAvailable) as e:   # found when loading, before any timing
        ap.error(str(e))


if __name__ == "__main__":
    main()
