"""The two numbers of a machine that chapter 7's floor divides by, measured (chapter 7).

``kvlab.roofline`` is arithmetic: the bytes and FLOPs a step must move, and the floor they set for a
given bandwidth and arithmetic rate. This module measures those two rates on the machine at hand and
says, in one printed line each, what it timed: the fastest of several read-only kernels over buffers
several times the last-level cache (a reduction in fp32 and bf16, inductor's compiled reduction, a
matrix-vector product; on CUDA the device-to-device copy too), the copy beside it, and the
matrix-product rate of the dtype that does the arithmetic.

    m = probes.machine("cpu")            # {"bandwidth": ..., "flops": ..., "ridge": ..., ...}
    roofline.step_time_floor(model, 1, 128, m["bandwidth"], m["flops"])

:func:`machine` measures once per (device, dtype, threads) and process, and, where the environment
variable ``KVLAB_PROBE_FILE`` names a file (the Makefile's book builds set one), once per build: every
page of a built book then divides by the same figures, whoever measured them first. On a machine
shared with other work a probe moves from one measurement to the next (up to 2x on a small VM), and
two pages of one book should not disagree on what the machine can stream.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch
import torch.utils.benchmark as benchmark

from .configs import as_dtype
from .loading import check_device
from .provenance import device_name, threads_text
from .timing import QUICK
from .validate import check_int


# ---------------------------------------------------------------------------------------------------
# The two numbers of the machine


def _threads(device, threads: int | None) -> int:
    if torch.device(device).type != "cpu":
        return torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def median_seconds(fn, device, repeats: int = 7, warmup: int = 2, threads: int | None = None) -> float:
    """Median seconds per call of ``fn``: CUDA events on a GPU, torch.utils.benchmark on a CPU."""
    repeats, warmup = check_int(repeats, "repeats", 1), check_int(warmup, "warmup", 0)
    for _ in range(warmup):
        fn()
    if torch.device(device).type == "cuda":
        samples = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end) / 1e3)
        return statistics.median(samples)
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads or torch.get_num_threads())
    return statistics.median(timer.timeit(1).median for _ in range(repeats))


def _default_probe_mib(device) -> int:
    """Four times the last-level cache (at least 64 MiB): a probe that fits in the cache measures
    the cache. On a GPU, four times its L2 and at least 1 GiB."""
    device = torch.device(device)
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
        return max(1024, 4 * l2 // 2**20)
    llc = cpu_cache_bytes() or 256 * 2**20           # unknown: assume a large one
    return max(64, 4 * llc // 2**20)


_PROBES = {   # kind -> (bytes moved per byte of the buffer, dtype of the buffer, what is timed)
    "read": (1, torch.float32, "sum of"), "read bf16": (1, torch.bfloat16, "bf16 sum of"),
    "compiled read": (1, torch.float32, "compiled (inductor) sum of"),
    "gemv": (1, torch.float32, "matrix-vector product over"),
    "compiled gemv": (1, torch.float32, "compiled row-dot (inductor) over"), "copy": (2, torch.float32, "copy of"),
}

#: The readers :func:`best_bandwidth` tries: a decode step only reads, so the floor's bandwidth is what
#: the fastest of them streams. On CUDA the device-to-device copy (a DMA engine) joins them.
READERS = ("read", "read bf16", "compiled read", "gemv", "compiled gemv")

_COMPILED = {}


def _compiled(kind: str, device, fn):
    """One compiled function per (kind, device type), reused by every probe of that kind."""
    key = (kind, torch.device(device).type)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, dynamic=False)
    return _COMPILED[key]


def _probe_fn(kind: str, src: torch.Tensor):
    if kind in ("read", "read bf16"):
        return lambda: src.sum()                       # reads every byte once, writes one number
    if kind == "compiled read":
        fn = _compiled(kind, src.device, lambda t: t.sum())
        return lambda: fn(src)
    if kind == "copy":
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)                  # read + write (plus, on a CPU without streaming
    mat = src.view(-1, 4096)                           # stores, a read-for-ownership of dst)
    vec = torch.ones(4096, dtype=src.dtype, device=src.device)
    if kind == "compiled gemv":                        # kvlab.matvec's reduction, one row per output
        fn = _compiled(kind, src.device, lambda m, v: (m * v).sum(-1))
        return lambda: fn(mat, vec)
    return lambda: mat @ vec


def measure_bandwidth(device="cpu", size_mib: int | None = None, threads: int | None = None,
                      repeats: int = 7, verbose: bool = True, kind: str = "read") -> float:
    """Bytes/s streamed over a buffer several times the last-level cache, median of ``repeats``.

    ``kind="read"``: a float32 reduction, which only reads, as a decode step reads its weights and
    cache; ``"read bf16"`` the same over bf16; ``"compiled read"`` inductor's own reduction kernel;
    ``"gemv"``: a float32 matrix-vector product, the BLAS kernel a batch-1 step runs; ``"compiled
    gemv"``: the same product as one reduction per row, compiled (``kvlab.matvec``). ``"copy"``: a
    tensor copy, read and write bytes both counted; on a CPU the write also costs a read-for-ownership
    the count leaves out, so it understates what a read-only step can stream. The floor uses the best
    of the readers (:func:`best_bandwidth`). On a CPU the thread count is fixed (``threads``, else
    torch's current one) and printed.
    """
    if kind not in _PROBES:
        raise ValueError(f"kind must be one of {sorted(_PROBES)}, got {kind!r}")
    device = check_device(device)
    size_mib = None if size_mib is None else check_int(size_mib, "size_mib", 1)
    threads, repeats = None if threads is None else check_int(threads, "threads", 1), check_int(repeats, "repeats", 1)
    threads = _threads(device, threads)
    mib = size_mib or _default_probe_mib(device)
    moved, dtype, what = _PROBES[kind]
    per = torch.tensor([], dtype=dtype).element_size()
    src = torch.ones(mib * 2**20 // per // 4096 * 4096, dtype=dtype, device=device)
    seconds = median_seconds(_probe_fn(kind, src), device, repeats=repeats, threads=threads)
    bw = moved * src.numel() * src.element_size() / seconds
    if verbose:
        where = threads_text(threads) if device.type == "cpu" else str(device)
        llc = cpu_cache_bytes() if device.type == "cpu" else None
        note = " - fits in the last-level cache!" if llc and mib * 2**20 <= llc else ""
        print(f"bandwidth ({kind}): {bw / 1e9:.1f} GB/s  ({what} {mib} MiB, {where}{note})")
    return bw


def best_bandwidth(device="cpu", threads: int | None = None, repeats: int = 7, verbose: bool = True,
                   sizes: tuple[int, ...] = (1, 2)) -> tuple[float, str]:
    """The floor's bandwidth: the fastest of :data:`READERS` (and, on CUDA, the device-to-device copy)
    over buffers of ``sizes`` x the default probe size (four times the last-level cache). Returns
    ``(bytes/s, "kind, N MiB")`` of the winner. A generator that streams faster than this shows the
    probe is not yet the machine's limit (:func:`above_probe`)."""
    device = check_device(device)
    base = _default_probe_mib(device)
    kinds = READERS + (("copy",) if device.type == "cuda" else ())
    results = {(k, base * f): measure_bandwidth(device, base * f, threads, repeats, verbose=False, kind=k)
               for k in kinds for f in sizes}
    (kind, mib), bw = max(results.items(), key=lambda kv: kv[1])
    if verbose:
        tried = ", ".join(f"{k} {m} MiB {b / 1e9:.1f}" for (k, m), b in results.items())
        where = threads_text(torch.get_num_threads()) if device.type == "cpu" else str(device)
        print(f"bandwidth (best reader): {bw / 1e9:.1f} GB/s  ({kind}, {mib} MiB, {where}; tried: {tried} GB/s)")
    return bw, f"{kind}, {mib} MiB"


def above_probe(achieved: float, probe: float, step_bytes: int, device="cpu", slack: float = 1.05) -> bool:
    """True when a generator streamed more than ``slack`` x the probe's bandwidth while its step read
    more bytes than the last-level cache holds (below that, the step may be served from the cache,
    which no DRAM probe bounds): then the probe is not a floor, and the book says so."""
    device = torch.device(device)
    cache = (cpu_cache_bytes() if device.type == "cpu"
             else getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
    return step_bytes > (cache or 0) and achieved > slack * probe


def _square_pair(n: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(n, n, generator=g).to(device=device, dtype=dtype) for _ in range(2))


#: One probe product should take about this long on a CPU: long enough to time, short enough that a
#: dtype the CPU only emulates (fp16 without native arithmetic: seconds per 1024 x 1024 product) does
#: not cost the page minutes.
MATMUL_PROBE_S = 0.02


def _matmul_size(device, dtype, threads: int) -> int:
    """The probe's matrix size: 8192 on a GPU; on a CPU the smallest of 256, 512, 1024 (512 at most
    under KVLAB_QUICK) whose product takes at least ``MATMUL_PROBE_S``, sized by timing it."""
    if device.type == "cuda":
        return 8192
    n, cap = 256, 512 if QUICK else 1024
    while n < cap:
        a, b = _square_pair(n, device, dtype)
        if median_seconds(lambda: a @ b, device, repeats=1, warmup=1, threads=threads) >= MATMUL_PROBE_S:
            break
        n *= 2
    return n


#: Matmul rates measured at the size picked by time, by (device, dtype, threads): one figure per
#: dtype in a process, so a page that needs a rate twice never prints two (see :func:`machine`).
_RATES: dict = {}


def measure_matmul_flops(device="cpu", dtype=torch.float32, n: int | None = None,
                         threads: int | None = None, repeats: int = 5, verbose: bool = True,
                         fresh: bool = False) -> float:
    """FLOP/s an ``n x n`` by ``n x n`` matrix product achieves (``2 n^3`` FLOPs), median of ``repeats``.
    Without ``n``, the size is picked by time (see :func:`_matmul_size`), the rate is kept for the
    process (later calls return it, and say so; ``fresh`` measures again) and printed."""

    device, dtype = check_device(device), as_dtype(dtype)
    n = None if n is None else check_int(n, "n (the matrix size)", 1)
    threads, repeats = None if threads is None else check_int(threads, "threads", 1), check_int(repeats, "repeats", 1)
    threads = _threads(device, threads)
    where = threads_text(threads) if device.type == "cpu" else str(device)
    key = (device_name(device), str(dtype), threads) if n is None else None
    if key in _RATES and not fresh:
        rate, size = _RATES[key]
        if verbose:
            print(f"matmul: {rate / 1e9:.1f} GFLOP/s  ({size}x{size} {str(dtype).removeprefix('torch.')}, {where}; "
                  "measured earlier in this process)")
        return rate
    size = _matmul_size(device, dtype, threads) if n is None else n
    a, b = _square_pair(size, device, dtype)
    seconds = median_seconds(lambda: a @ b, device, repeats=repeats, threads=threads)
    rate = 2 * size ** 3 / seconds
    if key is not None:
        _RATES[key] = (rate, size)
    if verbose:
        print(f"matmul: {rate / 1e9:.1f} GFLOP/s  ({size}x{size} {str(dtype).removeprefix('torch.')}, {where})")
    return rate


HALF = (torch.float16, torch.bfloat16)


def arithmetic_rate(device="cpu", dtype=torch.float32, threads: int | None = None,
                    verbose: bool = True, fresh: bool = False) -> tuple[float, torch.dtype]:
    """(FLOP/s, dtype) of the matrix products of a model stored in ``dtype``: that dtype's rate for
    float32; for a half-precision model the fastest of fp16, bf16 and fp32 on this device (a CPU
    without native fp16 arithmetic multiplies in bf16 or fp32 instead; a GPU's tensor cores in the
    half format). The dtype that does the arithmetic is returned and printed."""
    dtype = as_dtype(dtype)
    candidates = [dtype] if dtype not in HALF else [dtype, *(d for d in HALF if d != dtype), torch.float32]
    rates = {d: measure_matmul_flops(device, d, threads=threads, verbose=verbose, fresh=fresh) for d in candidates}
    best = max(rates, key=rates.get)
    if verbose and len(rates) > 1:
        print(f"  a {str(dtype).removeprefix('torch.')} model's arithmetic is priced at the "
              f"{str(best).removeprefix('torch.')} rate, the fastest here")
    return rates[best], best


#: Measurements of this process, by key (see :func:`machine`).
_MEASURED: dict = {}

#: A shared measurement older than this is measured again (a build takes well under it).
SHARED_MAX_AGE_S = 6 * 3600


def _shared_file() -> str | None:
    return os.environ.get("KVLAB_PROBE_FILE") or None


def _table() -> dict:
    """The build's probe file as a dict: empty without one, or for a missing, half-written or foreign
    file (then the caller measures, and the next write replaces it)."""
    path = _shared_file()
    if not path:
        return {}
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _read_shared(key: str) -> dict | None:
    entry = _table().get(key)
    if not entry or time.time() - entry.get("measured_at", 0) > SHARED_MAX_AGE_S:
        return None
    return dict(entry, flops_dtype=as_dtype(entry["flops_dtype"]))


def _write_shared(key: str, m: dict) -> None:
    path = _shared_file()
    if not path:
        return
    table = _table()
    table[key] = dict(m, flops_dtype=str(m["flops_dtype"]).removeprefix("torch."))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
    os.replace(tmp, path)               # whole or not at all: a reader never sees half a file


def machine(device="cpu", dtype=torch.float32, threads: int | None = None, verbose: bool = True,
            fresh: bool = False) -> dict:
    """The machine's numbers at once: the best reader's bandwidth (the floor's, :func:`best_bandwidth`),
    the copy's beside it, the matmul rate of the dtype doing the arithmetic (:func:`arithmetic_rate`)
    and the ridge point; ``measured_at`` (seconds since the epoch) and ``shared`` (True when another
    page of this build measured them: ``KVLAB_PROBE_FILE``). Measured once per device, dtype, thread
    count, machine and torch version, in a process and in a build (module docstring); ``fresh``
    measures again (and becomes the figure later calls get)."""
    device, dtype = check_device(device), as_dtype(dtype)     # before the first measurement
    n = _threads(device, threads)
    key = " | ".join((platform.node(), device_name(device), str(dtype).removeprefix("torch."), f"{n} threads",
                      torch.__version__))
    known = None if fresh else _MEASURED.get(key) or _read_shared(key)
    if known is not None:
        _MEASURED.setdefault(key, known)
        if verbose:
            print(f"bandwidth (best reader): {known['bandwidth'] / 1e9:.1f} GB/s ({known['reader']}), copy "
                  f"{known['copy_bandwidth'] / 1e9:.1f} GB/s, matmul {known['flops'] / 1e9:.1f} GFLOP/s: "
                  f"{measured_when(known)}")
        return dict(known)
    bw, reader = best_bandwidth(device, verbose=verbose)
    copy = measure_bandwidth(device, verbose=verbose, kind="copy")
    fl, used = arithmetic_rate(device, dtype, verbose=verbose, fresh=fresh)
    m = {"bandwidth": bw, "reader": reader, "copy_bandwidth": copy, "flops": fl, "flops_dtype": used,
         "ridge": fl / bw, "threads": torch.get_num_threads(), "measured_at": time.time(), "shared": False}
    _MEASURED[key] = m
    _write_shared(key, dict(m, shared=True))
    return dict(m)


def measured_when(m: dict) -> str:
    """``"measured at 12:03 UTC by an earlier page of this build"`` or ``"... by this page"``: when
    and by whom the figures of :func:`machine` were measured, for the sentence that uses them."""
    at = time.strftime("%H:%M UTC", time.gmtime(m.get("measured_at", time.time())))
    return f"measured at {at} " + ("by an earlier page of this build, shared by its pages" if m.get("shared")
                                   else "by this page")


def cpu_cache_bytes() -> int | None:
    """Size of the largest CPU cache level (bytes) as Linux reports it, or None if unknown."""
    best = None
    for index in range(8):
        path = f"/sys/devices/system/cpu/cpu0/cache/index{index}/size"
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        mult = {"K": 1024, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        size = int(text.rstrip("KMG")) * mult
        best = max(best or 0, size)
    return best
