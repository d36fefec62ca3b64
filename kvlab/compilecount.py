"""What torch itself counts while something compiles (chapter 8): graphs, guard failures (each
is a cached graph that could not be reused), graph breaks and, on CUDA, CUDA-graph skips and re-recordings. Read
from TorchDynamo's own records (``torch._dynamo.utils.counters`` and its table of guard failures),
before and after, so nothing is inferred from ``mode=``.

    with counting() as counts:
        run_something_compiled()
    print(counts_sentence(counts, device))
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

# (what the chapter calls it, torch's counter group, name; None: the group's total)
_COUNTERS = [
    ("graphs", "stats", "unique_graphs"),
    ("graph breaks", "graph_break", None),
    ("cudagraph skips", "inductor", "cudagraph_skips"),
    ("cudagraph re-recordings", "inductor", "cudagraph_recorded_non_static_inputs"),
]


def _read() -> dict[str, int]:
    from torch._dynamo import guard_failures
    from torch._dynamo.utils import counters

    out = {label: sum(counters[group].values()) if name is None else counters[group][name]
           for label, group, name in _COUNTERS}
    out["guard failures"] = sum(len(reasons) for reasons in guard_failures.values())
    return out


@contextmanager
def counting():
    """Yield a dict filled, on exit, with how much each of torch's counters grew inside the block."""
    before, out = _read(), {}
    try:
        yield out
    finally:
        after = _read()
        out.update({k: after[k] - before[k] for k in after})
        if out["guard failures"] < 0:          # torch._dynamo.reset() inside the block cleared the table
            out["guard failures"] = after["guard failures"]


def counts_sentence(counts: dict, device, compiled_functions: int, same_code: int = 0) -> str:
    """The counts in words. ``compiled_functions``: how many functions the block compiled (one graph
    each, when nothing recompiles or breaks). ``same_code``: how many of them run the same Python
    code as another one (two instances of one decoder class): TorchDynamo keys its graphs by code
    object, so such a function's first call fails the other's guards (a guard failure) and compiles
    its own graph, which is its first graph, not a recompilation."""
    recompiles = max(counts["graphs"] - compiled_functions - counts["graph breaks"], 0)
    failures = counts["guard failures"]
    line = (f"torch counted {counts['graphs']} graph(s) for {compiled_functions} compiled function(s) "
            f"({recompiles} more than one each without a break: recompilations), {counts['graph breaks']} "
            f"graph break(s) and {failures} guard failure(s)")
    if same_code and failures:
        line += (f" ({min(same_code, failures)} expected: {same_code} of the compiled functions "
                 f"{'runs' if same_code == 1 else 'run'} the same Python code as another, so its first call "
                 "fails the other's guards and compiles a graph of its own, its first one)")
    if torch.device(device).type == "cuda":
        return (line + f"; CUDA graphs: {counts['cudagraph skips']} skip(s), "
                f"{counts['cudagraph re-recordings']} re-recording(s) for inputs whose address changed.")
    return line + "; on a CPU inductor emits C++ kernels and no CUDA graph is used."
