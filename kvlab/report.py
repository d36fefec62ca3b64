"""The book's headline measurements on any device, recorded as one JSON file with its provenance.

    python -m kvlab.report --quick --out results/cpu-quick.json          # this CPU, about 20 s
    python -m kvlab.report --device cuda --out /tmp/h200.json --figure /tmp/h200.png

The book is built by a CPU, so a GPU's numbers can only appear in it as a *recorded* run: this
command measures what the chapters measure (through the library, no Jupyter needed), and writes
every number next to what produced it: device, memory, driver and CUDA, versions, threads, the git
commit (``KVLAB_COMMIT`` overrides it where the copy has no ``.git``), the date and the models and
their kinds. ``book/results.md`` renders every file under ``results/``.

Sections, each measured with ``kvlab.timing`` (warm-up, medians, variants interleaved):

* ``speedup``               naive vs cached generation, total time, against the new tokens N
* ``per_position``          the cost of one generation step at position p, naive and cached
* ``ours_vs_transformers``  transformers' ``generate``, our DynamicCache loop, the hand-built GPT-2
* ``batch_throughput``      new tokens per second against batch size
* ``floor``                 measured decode step against the bandwidth/FLOP floor (``kvlab.roofline``)
* ``compiled``              compiled vs eager decode of the hand-built GPT-2 (``kvlab.static``)

A time budget (``--budget``) bounds the run: each section gets a share of what is left, and a grid
that runs out of time stops early and is marked ``truncated``. The file is rewritten (atomically)
after every section, so a run killed from outside still leaves what it finished (``complete`` is
false until the end). A section that fails records its error and the others still run (the exit
status is then 1).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from . import progress

from . import gpt2, harness, loading, paths, provenance, rooflinebench, staticbench, timing
from .cli import at_least, check_writable, positive_seconds
from .batching import generate_batch
from .reference import cached_generate, hf_greedy, naive_generate
from . import probes, roofline
from .static import StaticDecoder
from . import __version__
from . import results

SCHEMA = 1
SECTIONS = ("speedup", "per_position", "ours_vs_transformers", "batch_throughput", "floor", "compiled")
# The sections that need a later chapter's module; skipped (and said so) while it is absent.
NEEDS = {"floor": "kvlab.roofline", "compiled": "kvlab.static"}


# ---------------------------------------------------------------------------------------------------
# What to measure: one grid per kind of run


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


# ---------------------------------------------------------------------------------------------------
# The run: models loaded once, a deadline per section, progress


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


def _num(x: float, digits: int = 5) -> float:
    """A float rounded to ``digits`` significant digits: the JSON stays small and readable."""
    return float(f"{x:.{digits}g}")


# ---------------------------------------------------------------------------------------------------
# The sections. Each returns a dict with ``rows`` (a list of flat dicts) and whatever else it knows.


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
            rows.append(dict(model=name, n=n, naive_s=_num(t["naive"].median),
                             cached_s=_num(t["cached"].median),
                             speedup=_num(timing.ratio(t["naive"], t["cached"]), 4)))
    return dict(prompt_len=8, rows=rows)


def _new_tokens(run: Run, model) -> int:
    """The plan's new tokens, at most 50 for a GPT-2-sized model on a CPU."""
    big_on_cpu = run.device.type == "cpu" and model.config.n_embd > 512
    return min(run.plan["new_tokens"], 50) if big_on_cpu else run.plan["new_tokens"]


def _naive_step(hf, ids):
    return lambda: hf(ids, use_cache=False).logits[:, -1].argmax(-1)


@torch.no_grad()
def per_position(run: Run) -> dict:
    """Chapters 1-2: milliseconds per generated token at position p, without and with the cache."""
    rows = []
    for name in run.each_model():
        hf, _ = run.model(name)
        ids = run.prompt(name, hf.config.n_positions)
        for p in run.points(_fit(hf, run.device, run.plan["positions"], 256), f"per position {name}"):
            t = run.compare({"naive": _naive_step(hf, ids[:, :p + 1]),
                             "cached": rooflinebench.step_fn(hf, 1, p)})     # chapter 7's step, rewound
            rows.append(dict(model=name, position=p, naive_ms=_num(t["naive"].median * 1e3),
                             cached_ms=_num(t["cached"].median * 1e3),
                             ratio=_num(timing.ratio(t["naive"], t["cached"]), 4)))
    return dict(rows=rows)


def ours_vs_transformers(run: Run) -> dict:
    """Chapter 3: transformers' generate, our DynamicCache loop and the hand-built GPT-2, same tokens?"""
    rows = []
    for name in run.each_model():
        hf, ours = run.model(name)
        n_new = _new_tokens(run, hf)
        prompt = run.prompt(name, 8)
        fns = {"transformers generate": lambda: hf_greedy(hf, prompt, n_new),
               "kvlab cached_generate": lambda: cached_generate(hf, prompt, n_new),
               "kvlab hand-built GPT-2": lambda: gpt2.generate(ours, prompt, n_new)}
        # A fast wrong generator is not a result: record whether each gives transformers' tokens.
        first_diff = harness.token_check(fns, "transformers generate")
        t = run.compare(fns, warmup=0)      # the correctness pass above was the warm-up
        base = t["transformers generate"]
        for k, tk in t.items():
            rows.append(dict(model=name, generator=k, new_tokens=n_new, median_s=_num(tk.median),
                             tokens_per_s=_num(n_new / tk.median, 4),
                             vs_transformers=_num(timing.ratio(base, tk), 4),
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
            rows.append(dict(model=name, batch=b, median_s=_num(t.median), tokens_per_s=_num(tps, 4),
                             vs_batch1=_num(tps / base, 4)))
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
    probe = run.plan.get("probe", {})              # fewer repeats and a smaller matmul in quick mode
    reps = probe.get("repeats", 7)                 # the bandwidth buffer is always sized from the LLC
    bw = probes.measure_bandwidth(run.device, repeats=reps, verbose=False, kind="read")
    copy = probes.measure_bandwidth(run.device, repeats=reps, verbose=False, kind="copy")
    fl = probes.measure_matmul_flops(run.device, dtype, n=probe.get("n"), repeats=reps, verbose=False)
    rows = []
    for name in run.each_model():
        _, ours = run.model(name)
        for b, s in run.points(_floor_grid(run, ours), f"floor {name}"):
            t = run.compare({"step": _our_step(ours, run.prompt(name, 1, b), s)})["step"]
            terms = roofline.step_terms(ours, b, s, bw, fl)
            achieved = roofline.decode_step_bytes(ours, b, s) / t.median
            rows.append(dict(model=name, batch=b, seq_len=s, measured_ms=_num(t.median * 1e3),
                             floor_ms=_num(terms["floor"] * 1e3), vs_floor=_num(t.median / terms["floor"], 4),
                             bound=terms["bound"], achieved_GBps=_num(achieved / 1e9, 4),
                             of_read_probe=_num(achieved / bw, 4)))
    return dict(generator="hand-built GPT-2, preallocated cache", dtype=str(dtype).removeprefix("torch."),
                bandwidth_GBps=_num(bw / 1e9, 4), copy_GBps=_num(copy / 1e9, 4),
                bandwidth_probe="read-only reduction over 4x the last-level cache",
                matmul_GFLOPs=_num(fl / 1e9, 4), rows=rows)


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
        t0 = time.perf_counter()
        comp.generate(prompt, n_new)                      # the first call compiles
        compile_s = time.perf_counter() - t0             # the first call; compile_seconds() below
        fns = {"eager, preallocated cache": lambda: gpt2.generate(ours, prompt, n_new),
               "static cache, eager": lambda: static.generate(prompt, n_new),
               "static cache, compiled": lambda: comp.generate(prompt, n_new)}
        first_diff = harness.token_check(fns, "eager, preallocated cache")
        t = run.compare(fns, warmup=0)                    # the correctness pass was the warm-up
        base = t["eager, preallocated cache"]
        compile_s = staticbench.compile_seconds(compile_s, t["static cache, compiled"].median)
        for k, tk in t.items():
            rows.append(dict(model=name, variant=k, new_tokens=n_new, median_s=_num(tk.median),
                             tokens_per_s=_num(n_new / tk.median, 4),
                             vs_eager=_num(timing.ratio(base, tk), 4),
                             identical_tokens=first_diff[k] is None, first_difference=first_diff[k],
                             compile_s=_num(compile_s, 3) if k.endswith("compiled") else None))
    return dict(backend=backend, mode=mode, prompt_len=8, rows=rows)


# ---------------------------------------------------------------------------------------------------
# Provenance


def _git_commit() -> dict:
    env = os.environ.get("KVLAB_COMMIT", "").strip()
    if env:
        return dict(commit=env, source="KVLAB_COMMIT")
    if not (paths.REPO_ROOT / ".git").exists():
        return dict(commit="unknown", source="no .git and no KVLAB_COMMIT")
    try:
        git = ["git", "-C", str(paths.REPO_ROOT)]
        commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
        return dict(commit=commit, source="git", dirty=dirty)
    except (OSError, subprocess.SubprocessError) as e:
        return dict(commit="unknown", source=f"git failed: {e}")


def _memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _load_average() -> list[float] | None:
    """The host's 1/5/15-minute load: on a shared machine, how much else was running (noise)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def device_info(device: torch.device) -> dict:
    """What the numbers were measured on: the device's name and memory, the host, the drivers."""
    info = dict(device=str(device), name=provenance.device_name(device).split(" (")[0],
                host_memory_bytes=_memory_bytes(), cpu_cores=os.cpu_count(),
                torch_threads=torch.get_num_threads(), platform=platform.platform(),
                load_average_start=_load_average())
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, memory_bytes=p.total_memory, capability=f"{p.major}.{p.minor}",
                    multiprocessors=p.multi_processor_count, cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), driver=_nvidia_driver())
    else:
        info.update(memory_bytes=info["host_memory_bytes"])
    return info


def run_provenance(device: torch.device, run: Run | None = None) -> dict:
    import numpy
    import transformers


    loaded = run._models if run else {}
    return dict(
        device=device_info(device),
        versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                      python=platform.python_version(), numpy=numpy.__version__, kvlab=__version__),
        git=_git_commit(),
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        models={name: dict(kind=hf.kvlab_kind, description=provenance.describe(hf))
                for name, (hf, _) in loaded.items()},
        env={k: os.environ.get(k) for k in ("KVLAB_QUICK", "KVLAB_THREADS", "OMP_WAIT_POLICY")},
        command=" ".join(["python -m kvlab.report", *sys.argv[1:]]) if sys.argv else "",
    )


# ---------------------------------------------------------------------------------------------------
# Running everything, writing the file


def _section(fn, run: Run, share: float) -> dict:
    name = fn.__name__
    needed = NEEDS.get(name)
    if needed and importlib.util.find_spec(needed) is None:
        return dict(status="skipped", reason=f"{needed} is not in this build of kvlab", seconds=0.0)
    if run.left() <= 0:
        return dict(status="skipped", reason="the time budget was spent before this section", seconds=0.0)
    run.deadline, run.model_deadline, run.truncated = time.perf_counter() + share, None, False
    t0 = time.perf_counter()
    try:
        out = fn(run)
        out["status"] = "truncated" if run.truncated else "ok"
    except Exception as e:  # noqa: BLE001 - one failing section must not lose the others
        out = dict(status="error", error=f"{type(e).__name__}: {e}",
                   traceback=traceback.format_exc(limit=6)[-3000:])
    out["seconds"] = _num(time.perf_counter() - t0, 3)
    return out


def run(device=None, quick: bool | None = None, budget: float | None = None,
        sections=SECTIONS, model_names=None, threads: int | None = None, checkpoint=None) -> dict:
    """Measure every section on ``device`` within ``budget`` seconds; return the result dict.

    ``checkpoint(result)`` is called after every section with the result so far (``complete`` is
    False until the end): the command writes the file each time, so a run killed from outside (a
    device call's time limit) still leaves every finished section on disk.
    """
    quick = timing.QUICK if quick is None else quick
    device = torch.device(device) if device is not None else loading.pick_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA GPU here; "
                         "use --device cpu or install a CUDA build of torch")
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    timing.set_threads(threads)
    p = plan(device, quick)
    if model_names:
        p["models"] = list(model_names)
    r = Run(device, p, float(budget if budget is not None else p["budget"]))
    for name in progress.bar(p["models"], desc="loading models", leave=False):
        r.model(name)                  # before the sections' clocks start; fails early on a bad name
    fns = {name: globals()[name] for name in sections}
    out = dict(schema=SCHEMA, kind="kvlab.report", complete=False, quick=quick, budget_s=r.budget,
               elapsed_s=0.0, plan=p, provenance=run_provenance(device, r), sections={})
    for i, (name, fn) in enumerate(progress.bar(fns.items(), desc="kvlab.report", leave=False)):
        share = max(r.left(), 0) / (len(fns) - i)          # unused time rolls over to later sections
        out["sections"][name] = sec = _section(fn, r, share)
        out["elapsed_s"] = _num(time.perf_counter() - r.start, 4)
        print(f"{name}: {sec['status']} in {sec['seconds']} s")
        if checkpoint and i < len(fns) - 1:
            checkpoint(out)
    out["provenance"]["device"]["load_average_end"] = _load_average()
    out["complete"] = True
    return out


def write_json(obj: dict, path) -> Path:
    """Write ``obj`` to ``path`` atomically: a reader sees the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)               # mkstemp makes it private; a results file is for reading
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _check_args(ap, args):
    """Everything the arguments can be checked for before the first measurement (argparse's exit
    status 2 and one line): where the files go, the device, the sections, the model names."""
    args.out = str(Path(args.out).expanduser())
    args.figure = args.figure and str(Path(args.figure).expanduser())
    for flag, path, suffix in (("--out", args.out, ".json"), ("--figure", args.figure, ".png")):
        problem = path is not None and check_writable(path, suffix)
        if problem:
            ap.error(f"{flag}: {problem}")
    try:
        device = loading.check_device(args.device) if args.device is not None else loading.pick_device()
    except ValueError as e:
        ap.error(f"--device: {e}")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if not sections or unknown:
        ap.error(f"--sections: choose one or more of {', '.join(SECTIONS)}, got {args.sections!r}")
    names = [m.strip() for m in args.models.split(",")] if args.models else None
    if names is not None and not all(names):
        ap.error(f"--models: an empty name in {args.models!r}; separate names with single commas")
    return device, sections, names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON file to write (atomically)")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: KVLAB_DEVICE, else "
                                                   "cuda when present, else cpu)")
    ap.add_argument("--quick", action="store_true", default=None,
                    help="the small grids of the test suite (default: on when KVLAB_QUICK=1)")
    ap.add_argument("--budget", type=positive_seconds, default=None,
                    help="seconds for the whole run (default: 40 quick, 240 on a GPU, 600 on a CPU)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma-separated subset of " + ", ".join(SECTIONS))
    ap.add_argument("--models", default=None, help="comma-separated model names (default: the plan's)")
    ap.add_argument("--threads", type=at_least(1), default=None,
                    help="CPU threads (default: KVLAB_THREADS or all cores, at most 8)")
    ap.add_argument("--figure", default=None, help="also draw the result's panels into this PNG")
    args = ap.parse_args(argv)
    device, sections, names = _check_args(ap, args)
    try:
        result = run(device, args.quick, args.budget, sections, names, args.threads,
                     checkpoint=lambda partial: write_json(partial, args.out))
    except (ValueError, loading.ModelNotAvailable) as e:
        ap.error(str(e))
    write_json(result, args.out)
    print(f"wrote {args.out}")
    if args.figure:
        results.save_figure(result, args.figure)
        print(f"wrote {args.figure}")
    failed = [k for k, v in result["sections"].items() if v["status"] == "error"]
    for k in failed:
        print(f"section {k} failed: {result['sections'][k]['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
