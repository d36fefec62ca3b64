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
from dataclasses import dataclass, field
from statistics import median
from typing import Callable

import torch
import torch.utils.benchmark as benchmark

from .progress import bar   # no frozen bar in a page built unwatched


#: ``KVLAB_QUICK=1`` (set by ``make test``) shrinks every measurement grid so the whole test suite
#: fits its budget; the published book (``make book``) is built with the full sizes.
QUICK = os.environ.get("KVLAB_QUICK", "0") not in ("0", "", "false", "False")


def pick(full, quick):
    """``quick`` under ``KVLAB_QUICK=1`` (the test suite's smaller sizes), else ``full``."""
    return quick if QUICK else full


def set_threads(n: int | None = None, verbose: bool = True) -> int:
    """Fix torch's CPU thread count (``KVLAB_THREADS``, else the standard ``OMP_NUM_THREADS``, else
    every core, at most 8) and report it. ``OMP_WAIT_POLICY=PASSIVE`` only works if set before torch
    is imported: the labs' setup cells set it first, and the grading instructions show it."""
    if n is None:
        env = (os.environ.get("KVLAB_THREADS", "") or os.environ.get("OMP_NUM_THREADS", "")).strip()
        n = int(env) if env else min(os.cpu_count() or 1, 8)
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
    return Timing(label, [_one_run(fn, threads) for _ in range(repeats)])


def compare(fns: dict[str, Callable[[], object]], warmup: int = 1, repeats: int = 5,
            threads: int | None = None, progress: bool = True) -> dict[str, Timing]:
    """Time several variants interleaved (A, B, C, A, B, C, ...) in one run; medians per variant."""
    threads = threads or torch.get_num_threads()
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    out = {k: Timing(k) for k in fns}
    rounds = range(repeats)
    for _ in bar(rounds, desc="timing rounds", leave=False) if progress else rounds:
        for k, fn in fns.items():
            out[k].samples.append(_one_run(fn, threads))
    return out


def ratio(a: Timing, b: Timing) -> float:
    """How many times slower ``a`` is than ``b`` (median over median)."""
    return a.median / b.median
