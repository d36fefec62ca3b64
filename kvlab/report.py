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
* ``compiled_batches``      the compiled decode at several batch sizes, one graph per captured size
* ``weights``               fp32, bf16 and int8 weights, eager and compiled, each against its floor
* ``prefill``               the floor of a prefill of N tokens and where a forward turns compute-bound

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
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from . import __version__, loading, progress, provenance, report_sections, results, timing
from .cli import at_least, check_writable, positive_seconds
from .machine import device_info, git_commit, load_average
from .report_sections import Run, rounded, plan

SCHEMA = 1
SECTIONS = ("speedup", "per_position", "ours_vs_transformers", "batch_throughput", "floor", "compiled",
            "compiled_batches", "weights", "prefill")
# The sections that need a later chapter's module; skipped (and said so) while it is absent.
NEEDS = {"floor": "kvlab.roofline", "compiled": "kvlab.static", "compiled_batches": "kvlab.static",
         "weights": "kvlab.weights", "prefill": "kvlab.roofline"}


# ---------------------------------------------------------------------------------------------------
# What to measure: one grid per kind of run


# ---------------------------------------------------------------------------------------------------
# The run: models loaded once, a deadline per section, progress


# ---------------------------------------------------------------------------------------------------
# The sections. Each returns a dict with ``rows`` (a list of flat dicts) and whatever else it knows.


# ---------------------------------------------------------------------------------------------------
# Provenance


def run_provenance(device: torch.device, run: Run | None = None) -> dict:
    import numpy
    import transformers


    loaded = run._models if run else {}
    return dict(
        device=device_info(device),
        versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                      python=platform.python_version(), numpy=numpy.__version__, kvlab=__version__),
        git=git_commit(),
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
    out["seconds"] = rounded(time.perf_counter() - t0, 3)
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
    fns = {name: getattr(report_sections, name) for name in sections}
    out = dict(schema=SCHEMA, kind="kvlab.report", complete=False, quick=quick, budget_s=r.budget,
               elapsed_s=0.0, plan=p, provenance=run_provenance(device, r), sections={})
    for i, (name, fn) in enumerate(progress.bar(fns.items(), desc="kvlab.report", leave=False)):
        share = max(r.left(), 0) / (len(fns) - i)          # unused time rolls over to later sections
        out["sections"][name] = sec = _section(fn, r, share)
        out["elapsed_s"] = rounded(time.perf_counter() - r.start, 4)
        print(f"{name}: {sec['status']} in {sec['seconds']} s")
        if checkpoint and i < len(fns) - 1:
            checkpoint(out)
    out["provenance"]["device"]["load_average_end"] = load_average()
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
