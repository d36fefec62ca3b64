"""Diagrams of chapters 8 and 9, drawn from live objects: a static cache's buffer, block tables with
reference counts, copy-on-write and the prefix cache, and per-request timelines of a served engine."""

from __future__ import annotations

from matplotlib.patches import FancyArrowPatch, Rectangle

from .draw import EMPTY, NEW, PAD, PAST, SEEN, Drawing, canvas, grid


def static_buffer(max_len: int, position: int, batch: int = 1, name: str = "static cache",
                  prefill: int | None = None) -> Drawing:
    """A static cache's buffer of ``max_len`` slots (e.g. ``cache.max_len``) and its position pointer
    (``int(cache.position)``): slots before it hold tokens, the rest are allocated and unused. With
    ``prefill``, the slots the prefill wrote and those each decode step wrote get their own colours."""
    fig, (ax,) = canvas(min(0.3 * max_len + 1.5, 7.5), 0.45 * batch + 1.1 + (0.4 if prefill else 0))
    first = position if prefill is None else prefill
    grid(ax, [[PAST if p < first else NEW if p < position else EMPTY for p in range(max_len)] for _ in range(batch)])
    for b in range(batch):
        ax.add_patch(Rectangle((0, b), max_len, 1, fill=False, edgecolor="0.4", lw=0.6))
    ax.annotate("position", (position, batch), xytext=(position, batch + 0.9), ha="center", fontsize=8,
                arrowprops=dict(arrowstyle="-|>", lw=0.8))
    ax.set_ylim(0, batch + 1.3)
    ax.set_xlabel(f"slot (0 .. {max_len - 1}); the next token is written at slot {position}", fontsize=8)
    split = ""
    if prefill is not None:
        ax.legend(handles=[Rectangle((0, 0), 1, 1, color=PAST), Rectangle((0, 0), 1, 1, color=NEW)],
                  labels=[f"written by the prefill ({prefill} tokens)",
                          f"written by {position - prefill} decode step{'s' * (position - prefill != 1)}, one slot each"],
                  loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=2, fontsize=8, frameon=False)
        split = f" The prefill wrote slots 0 to {prefill - 1}; decode steps wrote {prefill} to {position - 1}, one each."
    alt = (f"A {name} buffer of {max_len} slots per row, allocated once; {position} are filled and "
           f"the position pointer is at slot {position}, where the next key and value will be written. "
           f"The other {max_len - position} slots hold nothing yet, and no query attends to them.{split}")
    return Drawing(fig, alt, f"A {name}: one buffer allocated once, written in place at one moving position.")


def _tables(blocks, seqs) -> dict:
    """``name -> block table`` for serving :class:`~kvlab.serving.Sequence` objects (their own
    ``block_table``) or for ids of a lab-9 ``BlockAllocator`` (``blocks.block_table(id)``)."""
    out = {}
    for s in seqs:
        if hasattr(s, "block_table") and not callable(s.block_table):
            rid = " ".join(map(str, s.rid)) if isinstance(s.rid, tuple) else f"request {s.rid}"
            out[f"{rid}: {s.num_computed} tok"] = list(s.block_table)
        else:
            out[str(s)] = [int(b) for b in blocks.block_table(s)]
    return out


def _pool_state(blocks) -> list[tuple[str, str]]:
    """Per block: (colour, label) from its reference count and, for a
    :class:`~kvlab.serving.BlockManager`, whether the prefix cache keeps it (``cached``: no holder,
    still found by its key) or knows it (``key_of``: registered, marked ``*``)."""
    cached, keyed = getattr(blocks, "cached", {}), getattr(blocks, "key_of", None)
    out = []
    for b in range(blocks.num_blocks):
        rc, star = blocks.refcount(b), "*" if keyed is not None and keyed[b] is not None else ""
        if rc:
            out.append((NEW if rc > 1 else PAST, f"{b}{star}\nrc {rc}"))
        else:
            out.append(("#cfe8cf", f"{b}{star}\ncached") if b in cached else (EMPTY, f"{b}\nfree"))
    return out


def block_tables(blocks, seqs, copies=(), title: str = "") -> Drawing:
    """Block tables pointing into the pool: ``blocks`` is a :class:`~kvlab.serving.BlockManager` (with
    ``seqs`` its :class:`~kvlab.serving.Sequence` objects) or a lab-9 ``BlockAllocator`` (with ``seqs``
    sequence ids). Every block shows its reference count; blocks the prefix cache keeps are green;
    ``copies`` (``(src, dst)`` pairs, e.g. a step's ``copy_pairs`` from the engine's trace) are drawn
    as copy-on-write arrows. Everything is read off the live objects."""
    tables, pool = _tables(blocks, seqs), _pool_state(blocks)
    n, rows = blocks.num_blocks, len(tables)
    fig, (ax,) = canvas(min(0.6 * n + 1.6, 7.5), 0.5 * rows + 1.6)
    for b, (colour, label) in enumerate(pool):
        ax.add_patch(Rectangle((b, 0), 0.9, 0.9, facecolor=colour, edgecolor="k", lw=0.5))
        ax.text(b + 0.45, 0.45, label, ha="center", va="center", fontsize=5.5)
    for r, (name, table) in enumerate(tables.items()):
        y = 1.6 + (rows - 1 - r) * 1.1
        ax.text(-0.15, y + 0.3, name, ha="right", va="center", fontsize=7, color=f"C{r}")
        for i, b in enumerate(table):
            ax.add_patch(Rectangle((i * 0.7, y), 0.6, 0.6, facecolor="white", edgecolor=f"C{r}", lw=1))
            ax.text(i * 0.7 + 0.3, y + 0.3, str(b), ha="center", va="center", fontsize=7)
            ax.add_patch(FancyArrowPatch((i * 0.7 + 0.3, y), (b + 0.45, 0.9), arrowstyle="-|>",
                                         mutation_scale=7, lw=0.6, color=f"C{r}", alpha=0.7))
    for src, dst in copies:
        ax.add_patch(FancyArrowPatch((src + 0.45, 0), (dst + 0.45, 0), connectionstyle="arc3,rad=0.35",
                                     arrowstyle="-|>", mutation_scale=8, lw=1, color="crimson"))
    ax.text(-0.15, 0.45, "pool", ha="right", va="center", fontsize=8)
    _pool_legend(fig, pool, copies)
    ax.set(xlim=(-0.2, n + 0.1), ylim=(-1.2 if copies else -0.1, 1.7 + rows * 1.1))
    ax.set_title(title or f"block tables into a pool of {n} blocks of {blocks.block_size} tokens", fontsize=9)
    ax.axis("off")
    caption = "Block tables point into one pool; a block held by several tables is counted"
    caption += (", and the first write into a shared, partly filled block copied it first (red arrows)."
                if copies else "; no block was copied at this moment.")
    return Drawing(fig, _tables_alt(blocks, tables, pool, copies), caption)


def _pool_legend(fig, pool, copies) -> None:
    """Name only the colours the pool shows, the prefix cache's mark and the copy arrows."""
    meaning = {NEW: "shared (count > 1)", PAST: "one holder", "#cfe8cf": "no holder, kept by the prefix cache",
               EMPTY: "free"}
    shown = [c for c in meaning if any(colour == c for colour, _ in pool)]
    handles = [Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="k", lw=0.5) for c in shown]
    labels = [meaning[c] for c in shown]
    if any("*" in label for _, label in pool):
        handles.append(Rectangle((0, 0), 1, 1, fill=False, lw=0))
        labels.append("*: registered in the prefix cache")
    if copies:
        handles.append(FancyArrowPatch((0, 0), (1, 0), color="crimson"))
        labels.append("copy-on-write")
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(handles), 2), fontsize=8, frameon=False)


def _tables_alt(blocks, tables, pool, copies) -> str:
    n = blocks.num_blocks
    shared = [b for b in range(n) if blocks.refcount(b) > 1]
    cached = [b for b, (_, label) in enumerate(pool) if label.endswith("cached")]
    return (f"A pool of {n} blocks of {blocks.block_size} tokens; {blocks.num_free} can be handed out. Block "
            "tables: " + "; ".join(f"{k} -> {v}" for k, v in tables.items())
            + (f". Blocks {shared} are shared (reference count above 1)" if shared else ". No block is shared")
            + (f". Copy-on-write: " + ", ".join(f"block {s} copied to {d}" for s, d in copies) if copies else "")
            + (f". Blocks {cached} have no holder but stay in the prefix cache" if cached else "") + ".")


def _spans(source) -> list[tuple]:
    """``(name, arrival, first token, last token, token times, preemptions)`` per request that got a
    token: from a served :class:`~kvlab.serving.Engine` (its sequences' ``arrival`` and its trace's
    token times) or from objects with ``rid``, ``submitted``, ``first_token``, ``finished``."""
    if hasattr(source, "trace") and hasattr(source, "seqs"):
        times = source.trace.token_times
        return [(str(s.rid), s.arrival, times[s.rid][0], times[s.rid][-1], times[s.rid], s.preemptions)
                for s in source.seqs.values() if times.get(s.rid)]
    return [(str(r.rid), r.submitted, r.first_token, r.finished, [], 0) for r in source]


def timeline(source, title: str = "") -> Drawing:
    """A per-request timeline of one serving run: each request's wait and prefill (arrival to first
    token), then its decoding (first to last token), every token a tick; a preempted request is
    marked. ``source``: a served :class:`~kvlab.serving.Engine` (or old-style request records)."""
    spans = _spans(source)
    fig, (ax,) = canvas(7.0, 0.2 * len(spans) + 1.4)
    for i, (_, arr, first, last, ticks, pre) in enumerate(spans):
        ax.barh(i, first - arr, left=arr, color=PAD, height=0.7)
        ax.barh(i, last - first, left=first, color=SEEN, height=0.7, hatch="//" if pre else None,
                edgecolor="white" if pre else None)
        ax.plot(ticks, [i] * len(ticks), "|", color="k", ms=4, mew=0.5)
        ax.plot([arr], [i], ">", color="k", ms=3)
    ax.set_yticks(range(len(spans)), [s[0] for s in spans], fontsize=6)
    ax.invert_yaxis()
    ax.set(xlabel="seconds since the run started", ylabel="request", title=title or None)
    ax.title.set_fontsize(9)
    handles = [Rectangle((0, 0), 1, 1, color=PAD), Rectangle((0, 0), 1, 1, color=SEEN)]
    labels = ["arrival (>) to first token: waiting and prefill", "first to last token (| each token)"]
    if any(s[5] for s in spans):
        handles.append(Rectangle((0, 0), 1, 1, facecolor=SEEN, hatch="//", edgecolor="white"))
        labels.append("preempted at least once")
    # two entries a row: three long ones side by side are wider than the figure and push its x label out
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(handles), 2), fontsize=8, frameon=False)
    ttft = sorted(s[2] - s[1] for s in spans)
    mid = (ttft[(len(ttft) - 1) // 2] + ttft[len(ttft) // 2]) / 2      # the median (the middle two's mean)
    pre = sum(1 for s in spans if s[5])
    alt = (f"Timeline of {len(spans)} requests over {max(s[3] for s in spans):.3g} s: each bar runs from "
           f"arrival through the first token (median time to first token in this run {mid:.3g} s, "
           f"longest {ttft[-1]:.3g} s) to the last token" + (f"; {pre} {'was' if pre == 1 else 'were'} preempted at least once." if pre else "."))
    return Drawing(fig, alt, "Each request's wait, prefill and decode, on one clock.")
