"""What torch itself counts while something compiles (chapter 8): graphs, frames, graph breaks and,
on CUDA, CUDA-graph skips and re-recordings. Read from TorchDynamo's own counters
(``torch._dynamo.utils.counters``), before and after, so nothing is inferred from ``mode=``.

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
    ("frames compiled", "frames", "ok"),
    ("graph breaks", "graph_break", None),
    ("cudagraph skips", "inductor", "cudagraph_skips"),
    ("cudagraph re-recordings", "inductor", "cudagraph_recorded_non_static_inputs"),
]


def _read() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {label: sum(counters[group].values()) if name is None else counters[group][name]
            for label, group, name in _COUNTERS}


@contextmanager
def counting():
    """Yield a dict filled, on exit, with how much each of torch's counters grew inside the block."""
    before, out = _read(), {}
    try:
        yield out
    finally:
        after = _read()
        out.update({k: after[k] - before[k] for k in after})


def counts_sentence(counts: dict, device, compiled_functions: int) -> str:
    """The counts in words. ``compiled_functions``: how many functions the block compiled; frames
    beyond one each are recompilations."""
    recompiles = max(counts["frames compiled"] - compiled_functions, 0)
    line = (f"torch counted {counts['graphs']} graph(s) over {counts['frames compiled']} compiled frame(s) "
            f"for {compiled_functions} compiled function(s) ({recompiles} recompilation(s)) and "
            f"{counts['graph breaks']} graph break(s)")
    if torch.device(device).type == "cuda":
        return (line + f"; CUDA graphs: {counts['cudagraph skips']} skip(s), "
                f"{counts['cudagraph re-recordings']} re-recording(s) for inputs whose address changed.")
    return line + "; on a CPU inductor emits C++ kernels and no CUDA graph is used."
