"""Timing that survives a noisy machine: torch.utils.benchmark, warm-up, medians, interleaving.

Rules the book follows (and this module enforces):

* never ``time.time()``: every figure comes from ``torch.utils.benchmark.Timer``, which synchronises
  CUDA around each run, so the same code measures CPU and GPU correctly;
* warm up before measuring (the first call pays for allocation and kernel selection);
* report medians, not means (one descheduled run on a shared host would drag a mean);
* on the CPU, fix the thread count and report it; set ``OMP_WAIT_POLICY=PASSIVE`` *before* torch is
  imported (the Makefile does), or idle OpenMP threads spin and steal the other core;
* compare variants interleaved in one run (A, B, A, B, ...), so slow drift hits both alike, and
  report their ratio.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from statistics import median
from typing import Callable

import torch
import torch.utils.benchmark as benchmark

from . import validate
from .progress import bar   # no frozen bar in a page built unwatched


#: ``KVLAB_QUICK=1`` (set by ``make test``) shrinks every measurement grid so the whole test suite
#: fits its budget; the published book (``make book``) is built with the full sizes.
QUICK = os.environ.get("KVLAB_QUICK", "0") not in ("0", "", "false", "False")


def pick(full, quick):
    """``quick`` under ``KVLAB_QUICK=1`` (the test suite's smaller sizes), else ``full``."""
    return quick if QUICK else full


def env_threads() -> int | None:
    """The CPU thread count the environment asks for: ``KVLAB_THREADS``, else ``OMP_NUM_THREADS``
    (None when neither is set); a ValueError naming the variable and the fix for 0, -1 or ``abc``."""
    name = "KVLAB_THREADS" if os.environ.get("KVLAB_THREADS", "").strip() else "OMP_NUM_THREADS"
    env = os.environ.get(name, "").strip()
    if not env:
        return None
    return validate.int_from_text(env, name, 1, fix=f"set {name} to a number of CPU threads, e.g. {name}=2, "
                                  "or unset it for every core (at most 8)")


def set_threads(n: int | None = None, verbose: bool = True) -> int:
    """Fix torch's CPU thread count (``KVLAB_THREADS``, else the standard ``OMP_NUM_THREADS``, else
    every core, at most 8) and report it. ``OMP_WAIT_POLICY=PASSIVE`` only works if set before torch
    is imported: the labs' setup cells set it first, and the grading instructions show it."""
    if n is None:
        n = env_threads() or min(os.cpu_count() or 1, 8)
    else:
        n = validate.check_int(n, "threads (CPU threads)", 1)
    torch.set_num_threads(n)
    if verbose:
        policy = os.environ.get("OMP_WAIT_POLICY", "(unset)")
        mode = "   (KVLAB_QUICK: reduced sizes for the test suite)" if QUICK else ""
        print(f"torch threads: {n}   OMP_WAIT_POLICY={policy}{mode}")
    return n


@dataclass
class Timing:
    """Seconds per call of one measured function: every sample and their median."""

    label: str
    samples: list[float] = field(default_factory=list)
    threads: int | None = None       # torch threads the samples ran with (None: not recorded)

    @property
    def median(self) -> float:
        return median(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the samples were."""
        return (max(self.samples) - min(self.samples)) / self.median if self.samples else float("nan")

    def __repr__(self) -> str:
        return f"Timing({self.label!r}: median {self.median * 1e3:.3f} ms over {len(self.samples)} runs)"


def _one_run(fn: Callable[[], object], threads: int) -> float:
    """Time exactly one call of ``fn`` with torch.utils.benchmark (CUDA synchronised)."""
    t = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    return t.timeit(number=1).median


def measure(fn: Callable[[], object], label: str = "", warmup: int = 1, repeats: int = 5,
            threads: int | None = None) -> Timing:
    """Median seconds per call of ``fn`` after ``warmup`` untimed calls."""
    threads = threads or torch.get_num_threads()
    for _ in range(warmup):
        fn()
    return Timing(label, [_one_run(fn, threads) for _ in range(repeats)], threads)


def compare(fns: dict[str, Callable[[], object]], warmup: int = 1, repeats: int = 5,
            threads: int | None = None, progress: bool = True, budget: "Budget | None" = None) -> dict[str, Timing]:
    """Time several variants interleaved (A, B, C, A, B, C, ...) in one run; medians per variant.
    With a ``budget`` (:class:`Budget`) fewer than ``repeats`` rounds run once it is spent (at least its
    ``keep``); every variant gets the same number of samples, and ``budget.note`` says how many."""
    threads = threads or torch.get_num_threads()
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    out = {k: Timing(k, threads=threads) for k in fns}
    rounds = range(repeats) if budget is None else budget.rounds(repeats)
    for _ in bar(rounds, desc="timing rounds", leave=False) if progress else rounds:
        for k, fn in fns.items():
            out[k].samples.append(_one_run(fn, threads))
    return out


def ratio(a: Timing, b: Timing) -> float:
    """How many times slower ``a`` is than ``b`` (median over median)."""
    return a.median / b.median


class Budget:
    """The seconds one chapter measurement may take: a slow or busy machine measures fewer points
    instead of failing the build (the per-cell timeout is only a guard against a hang).

        budget = timing.Budget(timing.pick(120, 40), "the speed-up sweep")
        runs = {n: measure_one(n) for n in budget.points(Ns, size=lambda n: n * n)}
        budget.report()        # says which points the budget left out, if any

    ``points`` yields the grid in its order (cheapest first) and stops before a point that, judged
    by the last point's time scaled by ``size`` (the point's expected cost; the point itself by
    default), would end past the budget. The first ``keep`` points are always measured, so a
    comparison or a trend always has something to stand on. ``KVLAB_BUDGET_SCALE`` multiplies every
    budget (0.1 to see the cuts on a fast machine, 10 for a patient one)."""

    def __init__(self, seconds: float, what: str = "this measurement", keep: int = 2):
        try:
            scale = float(os.environ.get("KVLAB_BUDGET_SCALE", "1") or 1)
        except ValueError:
            raise ValueError(f"KVLAB_BUDGET_SCALE must be a number (a factor on every time budget), got "
                             f"{os.environ['KVLAB_BUDGET_SCALE']!r}; unset it or set e.g. KVLAB_BUDGET_SCALE=2") from None
        if not (seconds > 0 and scale > 0):
            raise ValueError(f"a time budget must be > 0 seconds, got {seconds} (KVLAB_BUDGET_SCALE={scale})")
        self.seconds, self.what = seconds * scale, what
        self.keep = validate.check_int(keep, "keep (points always measured)", 1)
        self.done: list = []
        self.skipped: list = []
        self.elapsed = 0.0
        self.predicted = 0.0       # the seconds the first point left out was judged to need
        self.unit = "points"

    def points(self, grid, size: Callable[[object], float] = float, _unit: str = "points"):
        grid, self.done, self.skipped, self.unit = list(grid), [], [], _unit
        start, last = time.perf_counter(), None
        for i, p in enumerate(grid):
            self.elapsed = time.perf_counter() - start
            if i >= self.keep and last is not None:
                t, s = last
                if self.elapsed + t * max(size(p) / s, 1.0) > self.seconds:
                    self.skipped, self.predicted = grid[i:], t * max(size(p) / s, 1.0)
                    return
            t0 = time.perf_counter()
            yield p
            last = (time.perf_counter() - t0, max(float(size(p)), 1e-9))
            self.done.append(p)
        self.elapsed = time.perf_counter() - start

    def rounds(self, n: int, unit: str = "rounds"):
        """Rounds ``0 .. n - 1`` of a repeated measurement, each judged as long as the one before: the
        first ``keep`` always run, the rest while the budget lasts (the note counts them from 1, as
        ``unit``: "rounds", "steps", ...)."""
        return self.points(range(validate.check_int(n, unit, 0)), size=lambda _: 1.0, _unit=unit)

    @property
    def note(self) -> str:
        """A sentence for the output: which points (or rounds) the budget left out ("" when none)."""
        if not self.skipped:
            return ""
        n = len(self.done) + len(self.skipped)
        left = (f"{self.unit} {len(self.done) + 1} to {n}" if len(self.skipped) > 1 else f"{self.unit.removesuffix('s')} {n}") \
            if self.unit != "points" else ", ".join(str(x) for x in self.skipped)
        them = "them" if len(self.skipped) > 1 else "it"
        spent = (f"in {self.elapsed:.3g} s of its {self.seconds:.3g} s budget" if self.elapsed <= self.seconds else
                 f"in {self.elapsed:.3g} s, past its {self.seconds:.3g} s budget (" +
                 (f"the first {self.keep} are always measured)" if len(self.done) <= self.keep else
                  "the last one measured took longer than judged, and a point once begun is finished)"))
        return (f"{self.what}: {len(self.done)} of {n} {self.unit} measured {spent}; the next was judged to need about {self.predicted:.3g} s more (the "
                f"last one's time, scaled by its size), past the budget, so not measured: {left}. A machine "
                f"that runs these faster measures {them}, as does KVLAB_BUDGET_SCALE=2.")

    def report(self) -> None:
        if self.note:
            print(self.note)
