"""The sections of ``kvlab.report``: each measures one of the book's headline figures on a device.

Every section takes the :class:`Run` (device, plan, models, time budget) and returns a dict of numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import generators as G
from . import gpt2, harness, loading, probes, progress, roofline, rooflinebench, staticbench, timing, weightbench
from .batching import generate_batch
from .reference import cached_generate, naive_generate, naive_step
from .static import StaticDecoder


def plan(device: torch.device, quick: bool) -> dict:
    """The grids: small for the test suite, longer on a GPU (where steps are cheap) than on a CPU.

    Quick mode compiles with the ``eager`` backend (TorchDynamo captures the whole decode step as one
    graph, which is what breaks when shapes or positions are not static, and runs it without code
    generation): the inductor compiler alone takes longer on a CPU than the test suite's budget.
    """
    if quick:
        return dict(models=["kvlab-tiny"], Ns=[8, 16], positions=[8, 128], new_tokens=8,
                    batch_sizes=[1, 4], batch_new=6, floor_batches=[1, 4], floor_seq=[64],
                    compiled_models=["kvlab-tiny"], compile_backend="eager", repeats=2, budget=40,
                    probe=dict(n=256, repeats=3))
    if device.type == "cuda":
        return dict(models=["kvlab-tiny", "shape:gpt2", "shape:gpt2-medium"],
                    Ns=[16, 64, 128, 256, 512], positions=[16, 128, 256, 512, 768, 1000],
                    new_tokens=200, batch_sizes=[1, 2, 4, 8, 16, 32, 64, 128], batch_new=64,
                    floor_batches=[1, 4, 16, 64, 256], floor_seq=[128, 1000],
                    compiled_models=["shape:gpt2", "kvlab-tiny"], compile_backend="inductor", repeats=5,
                    budget=240)
    return dict(models=["kvlab-tiny", "shape:gpt2"], Ns=[16, 64, 128, 256],
                positions=[8, 64, 128, 256, 384], new_tokens=100, batch_sizes=[1, 2, 4, 8, 16],
                batch_new=24, floor_batches=[1, 4, 16], floor_seq=[128], compiled_models=["kvlab-tiny"],
                compile_backend="inductor", repeats=3, budget=600)


def _fit(model, device, grid: list[int], cap_cpu: int) -> list[int]:
    """A grid clipped to the model's context, and to ``cap_cpu`` for a GPT-2-sized model on a CPU."""
    ctx = model.config.n_positions
    big_on_cpu = device.type == "cpu" and model.config.n_embd > 512
    return [g for g in grid if g < ctx - 8 and (not big_on_cpu or g <= cap_cpu)]


@dataclass
class Run:
    device: torch.device
    plan: dict
    budget: float
    start: float = field(default_factory=time.perf_counter)
    deadline: float = 0.0                 # this section's
    model_deadline: float | None = None   # this model's, within the section (see each_model)
    truncated: bool = False
    _models: dict = field(default_factory=dict)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def model(self, name: str):
        """``(hf_model, hand_built_gpt2)`` for ``name``, loaded once, on the run's device."""
        if name not in self._models:
            hf, _ = loading.load(name, device=self.device)
            self._models[name] = (hf, gpt2.GPT2.from_hf(hf).to(self.device).eval())
        return self._models[name]

    def prompt(self, name: str, length: int, batch: int = 1) -> torch.Tensor:
        """Seeded random token ids: timing needs the shapes, not the text."""
        vocab = self.model(name)[0].config.vocab_size
        g = torch.Generator().manual_seed(length * 1000 + batch)
        return torch.randint(0, vocab, (batch, length), generator=g).to(self.device)

    def each_model(self, names=None):
        """Yield model names, giving each an equal share of the section's time left (so the first
        model's grid cannot starve the others); a model the deadline has passed is skipped."""
        names = list(names or self.plan["models"])
        for i, name in enumerate(names):
            now = time.perf_counter()
            if i > 0 and now > self.deadline:
                self.truncated = True
                break
            self.model_deadline = now + max(self.deadline - now, 0) / (len(names) - i)
            yield name
        self.model_deadline = None

    def points(self, items, desc: str):
        """Yield ``items`` until the model's (else the section's) deadline, with a progress bar; flag a
        cut grid. The first point always runs, so every grid has at least one. The grids grow (longer
        N, later positions, bigger batches), so a point costs at least what the one before it did:
        one that would end past the deadline on that estimate is not started."""
        items, last = list(items), 0.0
        for i, item in enumerate(progress.bar(items, desc=desc, leave=False)):
            if i > 0 and time.perf_counter() + last > (self.model_deadline or self.deadline):
                self.truncated = True
                return
            t0 = time.perf_counter()
            yield item
            last = time.perf_counter() - t0

    def compare(self, fns: dict, warmup: int = 1) -> dict:
        return timing.compare(fns, warmup=warmup, repeats=self.plan["repeats"], progress=False)


def rounded(x: float, digits: int = 5) -> float:
    """A float rounded to ``digits`` significant digits: the JSON stays small and readable."""
    return float(f"{x:.{digits}g}")


def speedup(run: Run) -> dict:
    """Chapter 2's headline: naive over cached total time for N new tokens from an 8-token prompt."""
    rows = []
    for name in run.each_model():
        hf, _ = run.model(name)
        prompt = run.prompt(name, 8)
        naive_generate(hf, prompt, 4), cached_generate(hf, prompt, 4)           # warm-up
        for n in run.points(_fit(hf, run.device, run.plan["Ns"], 64), f"speedup {name}"):
            t = run.compare({"naive": lambda: naive_generate(hf, prompt, n),
                             "cached": lambda: cached_generate(hf, prompt, n)}, warmup=0)
            rows.append(dict(model=name, n=n, naive_s=rounded(t["naive"].median),
                             cached_s=rounded(t["cached"].median),
                             speedup=rounded(timing.ratio(t["naive"], t["cached"]), 4)))
    return dict(prompt_len=8, rows=rows)


def _new_tokens(run: Run, model) -> int:
    """The plan's new tokens, at most 50 for a GPT-2-sized model on a CPU."""
    big_on_cpu = run.device.type == "cpu" and model.config.n_embd > 512
    return min(run.plan["new_tokens"], 50) if big_on_cpu else run.plan["new_tokens"]


@torch.no_grad()
def per_position(run: Run) -> dict:
    """Chapters 1-2: milliseconds per generated token at position p, without and with the cache."""
    rows = []
    for name in run.each_model():
        hf, _ = run.model(name)
        ids = run.prompt(name, hf.config.n_positions)
        for p in run.points(_fit(hf, run.device, run.plan["positions"], 256), f"per position {name}"):
            t = run.compare({"naive": naive_step(hf, ids[:, :p + 1]),
                             "cached": rooflinebench.step_fn(hf, 1, p)})     # chapter 7's step, rewound
            rows.append(dict(model=name, position=p, naive_ms=rounded(t["naive"].median * 1e3),
                             cached_ms=rounded(t["cached"].median * 1e3),
                             ratio=rounded(timing.ratio(t["naive"], t["cached"]), 4)))
    return dict(rows=rows)


def ours_vs_transformers(run: Run) -> dict:
    """Chapter 3: transformers' generate, our DynamicCache loop and the hand-built GPT-2, same tokens?"""
    rows = []
    for name in run.each_model():
        hf, ours = run.model(name)
        n_new = _new_tokens(run, hf)
        prompt = run.prompt(name, 8)
        fns, _ = G.roster(hf, ours, prompt, n_new)
        # A fast wrong generator is not a result: record whether each gives transformers' tokens.
        first_diff = harness.token_check(fns, G.TRANSFORMERS)
        t = run.compare(fns, warmup=0)      # the correctness pass above was the warm-up
        base = t[G.TRANSFORMERS]
        for k, tk in t.items():
            rows.append(dict(model=name, generator=k, new_tokens=n_new, median_s=rounded(tk.median),
                             tokens_per_s=rounded(n_new / tk.median, 4),
                             vs_transformers=rounded(timing.ratio(base, tk), 4),
                             identical_tokens=first_diff[k] is None, first_difference=first_diff[k]))
    return dict(prompt_len=8, rows=rows)


def batch_throughput(run: Run) -> dict:
    """Chapter 6: new tokens per second of ``generate_batch`` for B equal-length prompts."""
    rows = []
    n_new, prompt_len = run.plan["batch_new"], 16
    for name in run.each_model():
        hf, _ = run.model(name)
        sizes = [b for b in run.plan["batch_sizes"]
                 if not (run.device.type == "cpu" and hf.config.n_embd > 512 and b > 8)]
        base = None
        for b in run.points(sizes, f"batch {name}"):
            ids = run.prompt(name, prompt_len, b)
            mask = torch.ones_like(ids)
            t = run.compare({"batch": lambda: generate_batch(hf, ids, mask, n_new)})["batch"]
            tps = b * n_new / t.median
            base = base or tps
            rows.append(dict(model=name, batch=b, median_s=rounded(t.median), tokens_per_s=rounded(tps, 4),
                             vs_batch1=rounded(tps / base, 4)))
    return dict(prompt_len=prompt_len, new_tokens=n_new, rows=rows)


def _our_step(ours, ids: torch.Tensor, seq_len: int):
    """One decode step of the hand-built GPT-2 for a batch whose cache holds ``seq_len`` positions.

    The cache is never filled by a prefill: a step's time depends on how many positions it attends
    over, not on their values, so zeros written straight into the cache time the same (and a long
    prefill of a big batch would cost more than the whole grid). Each call writes position ``seq_len`` and
    then sets the length back, so every call times the same step.
    """
    cache = ours.new_cache(ids.shape[0], max_len=seq_len + 1)
    if seq_len:                   # seq_len positions of zeros, written straight into the cache
        zeros = torch.zeros(ids.shape[0], ours.config.n_head, seq_len, ours.config.head_dim,
                            dtype=cache.keys.dtype, device=cache.keys.device)
        for layer in range(ours.config.n_layer):
            cache.update(layer, zeros, zeros)
    return harness.rewinding_step(ours, cache, ids[:, :1], seq_len)   # every call times the same step


@torch.no_grad()
def floor(run: Run) -> dict:
    """Chapter 7: each decode step's time against its floor from measured bandwidth and FLOP/s."""

    dtype = next(run.model(run.plan["models"][0])[1].parameters()).dtype
    # the machine's one measurement (kvlab.probes.machine): the figures the other sections and, in a
    # book build, every chapter use, so no two tables of one page divide by different bandwidths
    m = probes.machine(run.device, dtype, verbose=False)
    bw, reader, copy, fl = m["bandwidth"], m["reader"], m["copy_bandwidth"], m["flops"]
    rows = []
    for name in run.each_model():
        _, ours = run.model(name)
        for b, s in run.points(_floor_grid(run, ours), f"floor {name}"):
            t = run.compare({"step": _our_step(ours, run.prompt(name, 1, b), s)})["step"]
            terms = roofline.step_terms(ours, b, s, bw, fl)
            achieved = roofline.decode_step_bytes(ours, b, s) / t.median
            rows.append(dict(model=name, batch=b, seq_len=s, measured_ms=rounded(t.median * 1e3),
                             floor_ms=rounded(terms["floor"] * 1e3), vs_floor=rounded(t.median / terms["floor"], 4),
                             bound=terms["bound"], achieved_GBps=rounded(achieved / 1e9, 4),
                             of_read_probe=rounded(achieved / bw, 4)))
    return dict(generator="hand-built GPT-2, preallocated cache", dtype=str(dtype).removeprefix("torch."),
                bandwidth_GBps=rounded(bw / 1e9, 4), copy_GBps=rounded(copy / 1e9, 4),
                bandwidth_probe=f"the best of several read-only kernels ({reader}) over 4x and 8x the last-level cache",
                matmul_GFLOPs=rounded(fl / 1e9, 4), rows=rows)


def _floor_grid(run: Run, ours) -> list[tuple[int, int]]:
    """(batch, positions) points of the floor section that fit this device's budget."""

    cache_limit = 16 * 2**30 if run.device.type == "cuda" else 2**30     # skip what would not fit well
    ctx, big_on_cpu = ours.config.n_positions, run.device.type == "cpu" and ours.config.n_embd > 512
    return [(b, s) for s in run.plan["floor_seq"] if s < ctx for b in run.plan["floor_batches"]
            if not (big_on_cpu and b > 16) and roofline.cache_read_bytes(ours, b, s + 1) <= cache_limit]


def compiled(run: Run) -> dict:
    """Chapter 8: the hand-built GPT-2 eager, with a static cache, and with its decode step compiled."""

    backend = run.plan["compile_backend"]
    mode = "reduce-overhead" if run.device.type == "cuda" and backend == "inductor" else "default"
    rows = []
    for name in run.each_model(run.plan["compiled_models"]):
        _, ours = run.model(name)
        n_new = _new_tokens(run, ours)
        prompt = run.prompt(name, 8)
        static = StaticDecoder(ours, max_len=8 + n_new)
        comp = StaticDecoder(ours, max_len=8 + n_new).compile(backend=backend)
        # the first call compiles; timed with the device synchronised before and after it
        compile_s = staticbench.time_first_call(lambda: comp.generate(prompt, n_new), run.device)
        fns = {"eager, preallocated cache": lambda: gpt2.generate(ours, prompt, n_new),
               "static cache, eager": lambda: static.generate(prompt, n_new),
               "static cache, compiled": lambda: comp.generate(prompt, n_new)}
        first_diff = harness.token_check(fns, "eager, preallocated cache")
        t = run.compare(fns, warmup=0)                    # the correctness pass was the warm-up
        base = t["eager, preallocated cache"]
        compile_s = staticbench.compile_seconds(compile_s, t["static cache, compiled"].median)
        for k, tk in t.items():
            rows.append(dict(model=name, variant=k, new_tokens=n_new, median_s=rounded(tk.median),
                             tokens_per_s=rounded(n_new / tk.median, 4),
                             vs_eager=rounded(timing.ratio(base, tk), 4),
                             identical_tokens=first_diff[k] is None, first_difference=first_diff[k],
                             compile_s=rounded(compile_s, 3) if k.endswith("compiled") else None))
    return dict(backend=backend, mode=mode, prompt_len=8, rows=rows)


def weights(run: Run) -> dict:
    """Chapter 8: the hand-built GPT-2 with fp32, bf16 and int8 weights, eager and compiled, in one
    interleaved run, each against its own floor (``kvlab.weightbench``)."""
    m = probes.machine(run.device, verbose=False)
    rows = []
    for name in run.each_model(run.plan["compiled_models"]):
        _, ours = run.model(name)
        n_new = _new_tokens(run, ours)
        compiled = run.plan["compile_backend"] == "inductor"   # quick mode: eager only (no inductor build)
        for r in weightbench.measure(ours, 8, n_new, repeats=run.plan["repeats"], compiled=compiled,
                                     machine=m, progress=False):
            rows.append(dict(model=name, weights=r["weights"], variant=r["generator"],   # 9 columns: fits the page
                             measured_ms=rounded(r["per_token"] * 1e3), floor_ms=rounded(r["floor_per_token"] * 1e3),
                             vs_floor=rounded(r["x_floor"], 4), achieved_GBps=rounded(r["achieved"] / 1e9, 4),
                             of_read_probe=rounded(r["of_probe"], 4), same_as_fp32=f"{r['same_as_fp32']} of {n_new}"))
    return dict(bandwidth_GBps=rounded(m["bandwidth"] / 1e9, 4), bandwidth_probe=f"best reader ({m['reader']})",
                prompt_len=8, rows=rows)


def prefill(run: Run) -> dict:
    """Chapter 7: the floor of a prefill of N prompt tokens (``roofline.forward_floor``), computed from
    this device's measured rates, and the token count from which a forward is compute-bound."""
    m = probes.machine(run.device, verbose=False)
    rows = []
    for name in run.each_model():
        _, ours = run.model(name)
        ridge = rooflinebench.prefill_ridge(ours, m["bandwidth"], m["flops"])
        for r in rooflinebench.prefill_rows(ours, (1, 16, 64, 256, 1024), m["bandwidth"], m["flops"]):
            rows.append(dict(model=name, prompt_tokens=r["tokens"], floor_ms=rounded(r["floor"] * 1e3),
                             bound=r["bound"], compute_bound_from=ridge))
    return dict(bandwidth_GBps=rounded(m["bandwidth"] / 1e9, 4), matmul_GFLOPs=rounded(m["flops"] / 1e9, 4),
                rows=rows)


def compiled_batches(run: Run) -> dict:
    """Chapter 8: the compiled decode at several batch sizes, one decoder (one graph) per captured
    size, as engines capture one CUDA graph per batch size; per-token time and achieved bandwidth."""
    backend = run.plan["compile_backend"]
    rows = []
    for name in run.each_model(run.plan["compiled_models"]):
        _, ours = run.model(name)
        n_new = min(_new_tokens(run, ours), 32)
        for b in run.points(run.plan["batch_sizes"][:4], f"compiled batches {name}"):
            prompt = run.prompt(name, 8, b)
            dec = StaticDecoder(ours, batch_size=b, max_len=8 + n_new).compile(backend=backend)
            staticbench.time_first_call(lambda: dec.generate(prompt, n_new), run.device)
            t = run.compare({"step": lambda: dec.generate(prompt, n_new)}, warmup=0)["step"]
            achieved = roofline.achieved_bandwidth(ours, b, 8, n_new, t.median)
            rows.append(dict(model=name, batch=b, new_tokens=n_new, median_s=rounded(t.median),
                             tokens_per_s=rounded(b * n_new / t.median, 4), achieved_GBps=rounded(achieved / 1e9, 4),
                             variant=f"matvec={dec.matvec}"))
    return dict(backend=backend, rows=rows)
