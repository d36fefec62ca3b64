"""Chapter 9's measurements of the serving engine (:mod:`kvlab.serving`): interleaved runs of the
batching policies, timings of one batched decode step on paged memory, and the occupancy plot. The
engine itself computes and never prints; tables go through :func:`kvlab.harness.print_table`."""

from __future__ import annotations

import torch

from .paged import PagedKVCache, blocks_for, ragged_forward
from .serving import Engine, serve


def compare_policies(model, workload, repeats: int = 1, policies=("continuous", "static"), **kwargs):
    """Serve ``workload`` under each policy, ``repeats`` times, interleaved (A, B, A, B, ...)."""
    from tqdm.auto import tqdm

    runs = {p: [] for p in policies}
    for _ in tqdm(range(repeats), desc="rounds", leave=False):
        for p in policies:
            runs[p].append(serve(model, workload, policy=p, **kwargs))
    return runs


def median_run(engines: list[Engine]) -> Engine:
    """The run whose total time is the median one (its trace is the one we plot)."""
    return sorted(engines, key=lambda e: e.trace[-1]["time"])[len(engines) // 2]


def decode_step_timings(model, variants: dict, batch: int, context: int, repeats: int = 5):
    """Median seconds of one batched decode step of ``batch`` rows holding ``context`` tokens each, per
    variant ``name -> (block_size, gather)`` (``gather=None``: the batched gather), interleaved."""
    from .timing import compare

    g = torch.Generator().manual_seed(0)
    vocab, fns = model.config.vocab_size, {}
    for name, (bs, gather) in variants.items():
        cache = PagedKVCache.for_model(model, batch * blocks_for(context + 4 * repeats + 8, bs), bs, gather=gather)
        rows = list(range(batch))
        ragged_forward(model, cache, rows, torch.randint(1, vocab, (batch, context), generator=g).tolist())
        token = [[7]] * batch
        fns[name] = lambda cache=cache, rows=rows: ragged_forward(model, cache, rows, token)
    return compare(fns, warmup=1, repeats=repeats, progress=False)


def plot_occupancy(runs: dict[str, Engine], ax) -> None:
    """Rows in each step's forward pass over time, one line per policy (a step plot)."""
    for name, eng in runs.items():
        t = [0.0] + [s["time"] for s in eng.trace]
        rows = [s["rows"] for s in eng.trace]
        ax.stairs(rows, t, label=name, linewidth=1.5)
    ax.axhline(next(iter(runs.values())).max_batch, color="0.6", linestyle=":", label="max_batch")
    ax.set(xlabel="seconds since the first request", ylabel="rows in the step",
           title="Batch occupancy over time")
    ax.legend()
