"""Chapter 8's tables, figures and computed sentences, from the rows :mod:`kvlab.staticbench` measures.

Presentation only: nothing here times or runs a model.
"""

from __future__ import annotations
import torch
from . import plots, verdicts
from .cache import EMPTY, visible
from . import generators as G
from .staticbench import VARIANTS
from .tables import show, signed_pct


def print_static_mask(pos: int, T: int, max_len: int, stale_from: int) -> None:
    """Which of ``max_len`` static slots ``T`` new queries at positions ``pos ..`` may see, by the
    model's one rule (:func:`kvlab.cache.visible`) on the positions the slots hold: slots before
    ``pos`` hold the prompt so far, ``pos .. pos+T-1`` the new tokens, ``stale_from ..`` a previous
    prompt's later positions. ``x`` may attend, ``.`` hidden, ``s`` a hidden stale slot."""
    slot_pos = torch.arange(max_len)
    slot_pos[stale_from:] += max_len            # a previous prompt's keys sit at later positions
    slot_pos[pos + T:stale_from] = EMPTY        # never written
    queries = pos + torch.arange(T)
    seen = visible(queries[None], slot_pos[None, None])[0]
    for i, row in enumerate(seen.tolist()):
        marks = ["x" if ok else "s" if j >= stale_from else "." for j, ok in enumerate(row)]
        print(f"query at position {pos + i}: " + " ".join(marks))


def print_rows(rows: list[dict]) -> None:
    """The generators against the floor, with achieved bandwidth and what compiling cost, as a table
    that fits the page (:func:`kvlab.tables.show`)."""
    def pays(r):
        if r["compile_s"] is None:
            return "-"
        twin = G.EAGER_OF.get(r["generator"])
        twins = [e for e in rows if e["model"] == r["model"] and e["generator"] == twin and e["threads"] == r["threads"]]
        if twins and verdicts.compare_timings(r["timing"], twins[0]["timing"]).verdict == "none":
            return "not claimed"     # as compile_sentence words it: no speed-up measured, so no break-even
        return "never" if r["break_even"] is None else f"{r['break_even']:,.0f} tokens"
    show([{"model": r["model"], "threads": r["threads"], "generator": r["generator"],
           "ms/token": f"{r['per_token'] * 1e3:.3f}", "floor ms": f"{r['floor_per_token'] * 1e3:.3f}",
           "x floor": f"{r['ratio']:.2f}x", "achieved GB/s": f"{r['achieved'] / 1e9:.2f}",
           "of read probe": f"{r['achieved'] / r['bandwidth']:.0%}",
           "compile s": "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}", "pays off after": pays(r)}
          for r in rows],
         caption="pays off after: the tokens after which the time a compiled generator saves over its eager twin "
                 "covers its compilation; 'not claimed' where the two were within the noise (no speed-up measured), "
                 "'never' where the compiled one was slower; of read probe: achieved GB/s over the read probe "
                 "of the row's thread count (below)")
    # the probe's figure per thread count, under the table: a column of it made the table wider than the page
    for threads, bw, when in dict.fromkeys((r["threads"], r["bandwidth"], r.get("probe_when")) for r in rows):
        print(f"read probe with {threads} thread{'s' * (threads != 1)}: {bw / 1e9:.1f} GB/s" + (f", {when}" if when else ""))


def plot_rows(rows: list[dict], ax) -> None:
    """Measured ms per token (bars) and the floor (black ticks), one group per model."""
    plots.bars_against_floor(ax, rows, lambda r: (r["model"], r["threads"]), "generator", VARIANTS,
                             lambda g: f"{g[0]}\n{g[1]} thread{'s' * (g[1] > 1)}",
                             "eager and compiled, against the floor", hatched=set(G.COMPILED))


def row(rows, model, generator, threads=None) -> dict:
    return next(r for r in rows if r["model"] == model and r["generator"] == generator
                and (threads is None or r["threads"] == threads))


def fastest_sentence(rows, model) -> str:
    mine = [r for r in rows if r["model"] == model]
    best = min(mine, key=lambda r: r["per_token"])
    base = row(mine, model, G.TRANSFORMERS)
    where = f"{best['threads']} thread{'s' * (best['threads'] > 1)}, {best['device']}"
    rival = min((r for r in mine if r is not best), key=lambda r: r["per_token"])
    c = verdicts.compare_timings(best["timing"], rival["timing"])
    return (f"On {model} ({where}) the lowest median time per token is that of '{best['generator']}': "
            f"{best['per_token'] * 1e3:.3f} ms per token, {base['per_token'] / best['per_token']:.2f}x transformers' "
            f"eager generate and {best['ratio']:.2f}x the floor; the runner-up, '{rival['generator']}', takes "
            f"{rival['per_token'] / best['per_token']:.2f}x as long: "
            + verdicts.relation(c, f"'{best['generator']}'", f"'{rival['generator']}'") + ".")


def _who(a: dict, b: dict, name_a: str, name_b: str) -> str:
    """"<the faster one> faster in ...": the noise test's words, with the lower median named first."""
    c = verdicts.compare_timings(a["timing"], b["timing"])
    if c.verdict == "none":
        return verdicts.relation(c, name_a, name_b)
    win, lose = (name_a, name_b) if a["timing"].median <= b["timing"].median else (name_b, name_a)
    return f"{win} " + verdicts.relation(c, win, lose)


def compile_sentence(rows, model) -> str:
    """Each compiled generator against the eager one it replaces, and when compiling pays off: a
    break-even is claimed only when the noise test measured a difference (``kvlab.verdicts``)."""
    parts = []
    for name, twin in G.EAGER_OF.items():
        if not any(r["model"] == model and r["generator"] == name for r in rows):
            continue
        r, e = row(rows, model, name), row(rows, model, twin)
        speed = e["per_token"] / r["per_token"]
        c = verdicts.compare_timings(r["timing"], e["timing"])
        said = _who(r, e, "compiled", "eager")
        if c.verdict == "none":
            when = (f"{said}, so no break-even is claimed for its {r['compile_s']:.1f} s of compilation")
        elif r["break_even"] is not None:
            when = f"pays for its {r['compile_s']:.1f} s of compilation after about {r['break_even']:,.0f} tokens ({said})"
        else:
            when = f"never pays for its {r['compile_s']:.1f} s of compilation here ({said})"
        parts.append(f"'{name}' runs at {speed:.2f}x the speed of '{twin}' and {when}")
    return f"On {model}: " + "; ".join(parts) + "."


def question_sentences(rows, tiny="kvlab-tiny", big="shape:gpt2") -> list[str]:
    """The chapter's two questions, answered from this run (reported, never asserted): how much of
    the small model's overhead compiling removes, and how close the compiled step of a GPT-2-sized
    model on one thread comes to the read probe's bandwidth."""
    out = []
    if any(r["model"] == tiny for r in rows):
        e, c = row(rows, tiny, G.TRANSFORMERS), row(rows, tiny, G.HAND_BUILT_COMPILED)
        out.append(f"How much faster than transformers' eager generate is the compiled hand-built decode of "
                   f"{tiny}? " + verdicts.faster(c["timing"], e["timing"], c["device"], G.HAND_BUILT_COMPILED, G.TRANSFORMERS) + ".")
    if any(r["model"] == big and r["threads"] == 1 for r in rows):
        r = row(rows, big, G.HAND_BUILT_COMPILED, threads=1)
        out.append(f"How close does the compiled decode of {big} on one thread come to what memory can "
                   f"stream? {r['achieved'] / 1e9:.1f} GB/s, {r['achieved'] / r['bandwidth']:.0%} of the read "
                   f"probe, {r['ratio']:.2f}x the floor.")
    return out


def remains_sentences(rows, model) -> list[str]:
    """What the compiled hand-built step of ``model`` spends above the floor, from the measured rows:
    the step with library products against those products timed alone (on a CPU; on a GPU an eager
    loop of products would time kernel launches, so the profiler's device time below stands in), then
    the step whose products are reductions (``kvlab.matvec``), as measured."""
    r, auto = row(rows, model, G.HAND_BUILT_COMPILED_BLAS), row(rows, model, G.HAND_BUILT_COMPILED)
    step, mv = r["per_token"], r["matvec_per_token"]
    slots = r["prompt_len"] + r["new_tokens"]
    out = [f"{model}, {r['threads']} thread(s): compiled step with library products {step * 1e3:.3f} ms, floor "
           f"{r['floor_per_token'] * 1e3:.3f} ms ({r['ratio']:.2f}x)"]
    if r["device"] == "cuda":
        out.append("  matrix products alone: not split here (an eager loop of products on a GPU times its kernel "
                   "launches, not the products inside the CUDA graph); the profiler's device time below splits it")
    else:
        rest = step - mv
        out.append(f"  matrix products alone (the same library calls, one vector each): {mv * 1e3:.3f} ms, "
                   f"{mv / r['weight_s']:.2f}x the time to read the weights once at the read probe's bandwidth; "
                   + (f"{mv / step:.0%} of the step, the rest (attention, norms, embeddings, argmax, the loop and "
                      f"its guards) {rest * 1e3:.3f} ms" if rest >= 0 else
                      f"longer than the whole compiled step by {-rest * 1e3:.3f} ms (timed apart, in eager calls)"))
    out.append(f"  floor if attention reads all {slots} slots of the static buffers (dense attention with a mask): "
               f"{r['static_floor'] * 1e3:.3f} ms, {signed_pct(r['static_floor'] / r['floor_per_token'] - 1, 1)} on the floor "
               "of the filled cache")
    if auto.get("matvec") == "reduction":
        out.append(f"  the same step with its products as reductions compiled by inductor: {auto['per_token'] * 1e3:.3f} "
                   f"ms, {r['per_token'] / auto['per_token']:.2f}x the speed of library products, {auto['ratio']:.2f}x "
                   f"the floor, {auto['achieved'] / auto['bandwidth']:.0%} of the read probe; "
                   + _who(auto, r, "reductions", "library products"))
    else:
        out.append(f"  '{G.HAND_BUILT_COMPILED}' chose library products on this device (matvec='auto'), so it is "
                   "the step above")
    return out


def print_breakdown(parts: list[dict]) -> None:
    """The profiled parts of a compiled step against their floors (:func:`kvlab.tables.show`). Each
    part is the median over the profiled rounds; "share" is of the three medians' sum (medians do not
    add up to the median wall time)."""
    total = {m: sum(b["seconds"] for b in parts if b["model"] == m) for m in {b["model"] for b in parts}}
    show([{"model": b["model"], "threads": b["threads"], "part": b["part"], "ms/step": f"{b['seconds'] * 1e3:.3f}",
           "share": f"{b['seconds'] / total[b['model']]:.0%}" if total[b["model"]] else "-",
           "floor ms": f"{b['floor'] * 1e3:.4f}",
           "x floor": f"{b['seconds'] / b['floor']:.1f}x" if b["floor"] else "-",
           "above floor ms": f"{(b['seconds'] - b['floor']) * 1e3:.3f}"} for b in parts],
         caption=f"torch {torch.__version__} profiler, medians of " + "; ".join(dict.fromkeys(
             f"{b['model']}: {b['profiled']}, max_len {b['max_len']}, {b['where']}" for b in parts)))


def plot_breakdown(parts: list[dict], ax) -> None:
    """Each part's profiled ms per step (bars) and its floor (black ticks), log scale."""
    rows = [dict(b, per_token=b["seconds"], floor_per_token=b["floor"], what="compiled step, profiled")
            for b in parts]
    plots.bars_against_floor(ax, rows, lambda r: (r["model"], r["part"]), "what", ("compiled step, profiled",),
                             lambda g: f"{g[0]}\n{g[1]}", "a compiled step's parts, against each one's floor")


def breakdown_sentence(parts: list[dict]) -> str:
    """Which part of the profiled compiled step is farthest above its floor (seconds above it), and
    whether the noise test (:mod:`kvlab.verdicts`) tells it from the next one."""
    b = parts[0]
    if not any(x["seconds"] for x in parts if x["part"] != "everything else"):   # nothing was named
        why = ("no kernel of the replayed CUDA graph was recorded" if b["device"] == "cuda" else
               "their operators go by names this attribution does not know")
        return (f"On {b['model']} ({b['where']}) the profiler named no matrix product and no attention in "
                f"the compiled step ({why}), so its {b['wall'] * 1e3:.3f} ms are not split into parts here.")
    first, second = sorted(parts, key=lambda b: -b["excess"].median)[:2]
    b, nxt = first, second["excess"].median
    c = verdicts.compare_timings(first["excess"], second["excess"]) if nxt > 0 else None
    then = (f"the next, {second['part']}, is {nxt * 1e3:.3f} ms above its own" if c is None or c.verdict != "none"
            else f"the next, {second['part']}, {nxt * 1e3:.3f} ms above its own, is as far: "
                 + verdicts.relation(c, b["part"], second["part"]))
    return (f"On {b['model']} ({b['where']}), the part of the profiled compiled step farthest above its floor "
            f"is {b['part']}: {b['seconds'] * 1e3:.3f} ms against a floor of {b['floor'] * 1e3:.4f} ms, "
            f"{verdicts.share(b['excess'].median, [x['excess'].median for x in parts], label=' above it')}; {then}.")


def profiler_sentence(parts: list[dict]) -> str:
    """What the profile itself says about "everything else": how much of it the profiler's own events
    cost (profiled against unprofiled steps) and how much ran inside inductor's generated code."""
    b = parts[0]
    cost = b["wall"] - b["unprofiled"]
    gen = ("on a GPU, the device time of inductor's Triton kernels" if b["device"] == "cuda" else
           "inside inductor's generated code (its fused C++ kernels and the Python that calls them)")
    c = verdicts.compare_timings(b["wall_timing"], b["unprofiled_timing"])
    paid = (f"so about {cost * 1e3:.3f} ms of 'everything else' is the profiler's own cost "
            f"({verdicts.relation(c, 'the unprofiled step', 'the profiled one', 'faster')})"
            if cost > 0 and c.verdict != "none" else
            f"{verdicts.relation(c, 'the unprofiled step', 'the profiled one')}: the profiler's own cost is "
            "within this run's noise")
    return (f"{b['model']}: the profiled step took {b['wall'] * 1e3:.3f} ms, the same steps without the "
            f"profiler {b['unprofiled'] * 1e3:.3f} ms, {paid}; {b['fused'] * 1e3:.3f} ms of the step ran {gen}.")
