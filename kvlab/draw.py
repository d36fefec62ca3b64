"""Diagrams of the book's ideas, drawn from the objects the code really builds.

Every function here takes a live object (a cache after real forward passes, a mask an attention
function really applied, a batch from :mod:`kvlab.batching`, a lab-9 allocator, the serving engine's
block manager and sequences, a served engine's trace) or numbers read off one, so a diagram cannot disagree with the code. Each returns a :class:`Drawing`:
a matplotlib ``Figure`` made off-screen (no pyplot, so nothing is shown twice and nothing is drawn
inside a widget) with its alt text and caption. In a notebook a ``Drawing`` shows itself as an
``<img>`` with that alt text; ``drawing.figure`` is the figure.
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass

import torch
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

# one colour per role, the same in every diagram
PAST, NEW, EMPTY, PAD, SEEN, HIDDEN = "#b8cde0", "#e8893a", "#f4f4f4", "#d9d9d9", "#4c78a8", "#f4f4f4"


@dataclass
class Drawing:
    """A figure with its alt text (what a reader who cannot see it should know) and caption."""

    figure: Figure
    alt: str
    caption: str = ""

    def png(self, dpi: int = 110) -> bytes:
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
        return buf.getvalue()

    def _repr_mimebundle_(self, include=None, exclude=None):
        data = base64.b64encode(self.png()).decode()
        cap = f"<figcaption>{html.escape(self.caption)}</figcaption>" if self.caption else ""
        img = (f'<img src="data:image/png;base64,{data}" alt="{html.escape(self.alt, quote=True)}" '
               'style="max-width:100%;height:auto">')
        return {"text/html": f'<figure class="kvlab-diagram">{img}{cap}</figure>',
                "image/png": data, "text/plain": self.alt}

    def __repr__(self) -> str:
        return f"Drawing({self.alt!r})"


def _figure(width: float, height: float, ncols: int = 1, nrows: int = 1, **kw):
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, [ax for row in axes for ax in row]


def _grid(ax, colours, labels=None, fontsize: float = 7):
    """Draw a table of coloured cells (rows x cols of colour strings), optionally with text."""
    rows, cols = len(colours), len(colours[0])
    for i in range(rows):
        for j in range(cols):
            ax.add_patch(Rectangle((j, rows - 1 - i), 1, 1, facecolor=colours[i][j], edgecolor="white", lw=1.5))
            if labels is not None and labels[i][j] != "":
                ax.text(j + 0.5, rows - 0.5 - i, labels[i][j], ha="center", va="center", fontsize=fontsize)
    ax.set(xlim=(0, cols), ylim=(0, rows), aspect="equal")
    ax.set_xticks([]), ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)


# --------------------------------------------------------------------------------------- chapters 1-2

@torch.no_grad()
def record_steps(model, input_ids, new_tokens: int) -> list[dict]:
    """Greedy decoding with a transformers ``DynamicCache``; what each forward call fed and what the
    cache held after it (read off the cache itself). The last step also keeps layer 0's query,
    keys and values, for :func:`query_against_cache`."""
    from transformers import DynamicCache

    cache, ids, steps, seen = DynamicCache(), input_ids, [], {}
    attn = model.transformer.h[0].attn
    hook = attn.c_attn.register_forward_hook(lambda mod, inp, out: seen.update(qkv=out.detach()))
    try:
        for _ in range(new_tokens + 1):
            before = cache.get_seq_length()
            out = model(input_ids=ids, cache=cache, use_cache=True)
            layer = cache.layers[0]
            steps.append(dict(tokens=ids[0].tolist(), before=before, after=cache.get_seq_length(),
                              key_shape=tuple(layer.keys.shape)))
            ids = out.logits[:, -1:].argmax(-1)
    finally:
        hook.remove()
    H, E = model.config.n_head, model.config.n_embd
    q = seen["qkv"][0, -1, :E].view(H, E // H)                      # the last token's query, per head
    steps[-1].update(q=q.float().cpu(), keys=layer.keys[0].float().cpu(), values=layer.values[0].float().cpu())
    return steps


def cache_growth(steps: list[dict], tokenizer=None) -> Drawing:
    """One row per forward call: the positions read from the cache and the positions computed (and
    stored) by this call, from :func:`record_steps`. Prefill is the first row, decode the others."""
    S = steps[-1]["after"]
    fig, (ax,) = _figure(min(0.32 * S + 2.5, 7.5), 0.42 * len(steps) + 0.9)
    colours, labels = [], []
    for s in steps:
        row = [PAST if p < s["before"] else NEW if p < s["after"] else EMPTY for p in range(S)]
        words = [tokenizer.decode([t]).strip()[:4] if tokenizer else "" for t in s["tokens"]]
        labels.append([""] * s["before"] + words + [""] * (S - s["after"]))
        colours.append(row)
    _grid(ax, colours, labels, fontsize=5.5)
    names = ["prefill" if i == 0 else f"decode {i}" for i in range(len(steps))]
    ax.set_yticks([len(steps) - 0.5 - i for i in range(len(steps))],
                  [f"{n}: {len(s['tokens'])} in, cache {s['after']}" for n, s in zip(names, steps)], fontsize=7)
    ax.set_title("position in the sequence ->", fontsize=8)
    ax.legend(handles=[Rectangle((0, 0), 1, 1, color=PAST), Rectangle((0, 0), 1, 1, color=NEW)],
              labels=["keys/values read from the cache", "computed by this call, then stored"],
              loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2, fontsize=7, frameon=False)
    d = steps[1]["key_shape"] if len(steps) > 1 else steps[0]["key_shape"]
    alt = (f"Grid of {len(steps)} forward calls over {S} positions. The prefill computes all "
           f"{len(steps[0]['tokens'])} prompt positions; each decode call computes one new position and "
           f"reads the {steps[1]['before'] if len(steps) > 1 else 0} or more before it from the cache, "
           f"whose layer-0 keys grow to shape {list(steps[-1]['key_shape'])} (after the first decode: {list(d)}).")
    return Drawing(fig, alt, "The cache growing: prefill fills it with the prompt, each decode step "
                             "adds one position and reads every earlier one back.")


def query_against_cache(step: dict, head: int = 0, dims: int = 16) -> Drawing:
    """The last decode step of :func:`record_steps`, for one head: the new query against every
    stored key (dot product, softmax) and the weighted sum of the stored values."""
    q, K, V = step["q"][head], step["keys"][head], step["values"][head]
    S, D = K.shape
    w = torch.softmax(K @ q / math.sqrt(D), dim=0).numpy()
    K, V = K[:, :dims].numpy(), V[:, :dims].numpy()
    fig, axes = _figure(7.0, 0.16 * S + 1.8, ncols=3, gridspec_kw=dict(width_ratios=[dims, dims, 7]))
    lim = float(max(abs(K).max(), abs(V).max(), abs(q[:dims]).max()))
    qk = torch.full((S + 2, dims), float("nan"))
    qk[0], qk[2:] = q[:dims], torch.from_numpy(K)
    axes[0].imshow(qk.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
    axes[0].set_yticks([0] + list(range(2, S + 2)), ["new query"] + [str(p) for p in range(S)], fontsize=7)
    axes[0].set_title(f"query and stored keys\n(first {dims} of {D} channels)", fontsize=8)
    vv = torch.full((S + 2, dims), float("nan"))
    vv[2:] = torch.from_numpy(V)
    axes[1].imshow(vv.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
    axes[1].set_title(f"stored values\n[{S} positions x {D}]", fontsize=8)
    axes[2].barh(range(2, S + 2), w, color=SEEN)
    axes[2].set_ylim(S + 1.5, -0.5)
    axes[2].set_title("softmax(q . k / sqrt(d)):\nweight of each value", fontsize=8)
    axes[1].set_yticks([])
    axes[2].set_yticks([])
    for ax in axes[:2]:
        ax.set_xticks([])
    top = int(w.argmax())
    alt = (f"The new query of head {head} is scored against all {S} stored keys (first {dims} of {D} "
           f"dimensions shown); the softmax weights, largest at position {top} ({float(w[top]):.2f}), mix "
           f"the {S} stored values into the output. No key or value of an earlier position is recomputed.")
    return Drawing(fig, alt, "The newest position's query scored against every stored key, and the "
                             "stored values mixed by those weights.")


# ------------------------------------------------------------------------------------------ chapter 3

def probe_mask(attention_fn, past_len: int, T: int) -> torch.Tensor:
    """Which keys each of ``T`` new queries may see, read off ``attention_fn(q, k, v, past_len)``
    itself, the function the model calls, so the drawing cannot disagree with it: equal scores and
    one-hot values make each output row a uniform average of the visible keys. Returns a bool
    ``[T, past_len + T]``. :func:`masks` takes any such tensor; a mask rule that returns one
    directly (a function of query and key positions) needs no probe."""
    S = past_len + T
    q, k = torch.zeros(1, 1, T, S), torch.zeros(1, 1, S, S)
    v = torch.eye(S)[None, None]
    return attention_fn(q, k, v, past_len)[0, 0] > 0


def masks(ours: torch.Tensor, top_left: torch.Tensor, past_len: int) -> Drawing:
    """Two masks of ``T`` queries over ``S`` keys side by side: the one the model applies (the
    diagonal ends bottom-right: query ``i`` is position ``past_len + i``) and ``is_causal``'s."""
    T, S = ours.shape
    fig, axes = _figure(min(0.35 * S * 2 + 1.5, 7.5), 0.35 * T + 1.4, ncols=2)
    for ax, m, title in zip(axes, (ours, top_left), ("what the model applies", "is_causal=True")):
        colours = [[SEEN if m[i, j] else HIDDEN for j in range(S)] for i in range(T)]
        _grid(ax, colours, [["" for _ in range(S)] for _ in range(T)])
        ax.axvline(past_len, color="k", lw=1, ls="--")
        ax.set_title(title, fontsize=9)
        ax.set_xticks([j + 0.5 for j in range(S)], [str(j) for j in range(S)], fontsize=6)
        ax.set_yticks([T - 0.5 - i for i in range(T)], [str(past_len + i) for i in range(T)], fontsize=6)
        ax.set_xlabel("key position (left of the dashes: cached)", fontsize=7)
    axes[0].set_ylabel("query position", fontsize=8)
    wrong = int((ours != top_left).sum())
    alt = (f"Two {T} by {S} grids of which keys each query may see, {past_len} keys cached. The model's "
           f"mask ends its staircase in the bottom-right corner, so the last query sees all {S} keys; "
           f"is_causal aligns it top-left, so the first query sees only key 0: {wrong} cells differ.")
    return Drawing(fig, alt, "With a past, the causal mask must be aligned bottom-right; is_causal "
                             "aligns it top-left, which is only right without a past.")


# ------------------------------------------------------------------------------------------ chapter 4

def cache_layout(shape, names=("layer", "batch", "head", "position", "head dim"), n_kv_heads=None,
                 n_heads=None, kv_head_of=None) -> Drawing:
    """The cache tensor's axes (``shape`` read off a real cache, e.g. ``cache.keys.shape``) and, if
    given, which key/value head each query head reads (``kv_head_of[h]``: e.g. from transformers'
    ``repeat_kv`` applied to the kv-head numbers)."""
    gqa = kv_head_of is not None
    fig, axes = _figure(7.0, 2.6 if gqa else 1.4, nrows=2 if gqa else 1)
    ax = axes[0]
    for i, (n, s) in enumerate(zip(names, shape)):
        ax.add_patch(Rectangle((i * 1.4, 0), 1.25, 0.8, facecolor=PAST, edgecolor="k", lw=0.6))
        ax.text(i * 1.4 + 0.62, 0.5, str(s), ha="center", fontsize=10, weight="bold")
        ax.text(i * 1.4 + 0.62, 0.18, n, ha="center", fontsize=7)
    ax.set(xlim=(-0.1, 1.4 * len(shape)), ylim=(-0.1, 0.9), aspect="equal")
    ax.axis("off")
    ax.set_title(f"one tensor for the keys, one for the values: {' x '.join(map(str, shape))} numbers each", fontsize=8)
    alt = f"The cache tensor has shape {list(shape)}: {', '.join(f'{n} {s}' for n, s in zip(names, shape))}."
    if gqa:
        _gqa(axes[1], list(kv_head_of), n_kv_heads)
        alt += (f" Below, {len(kv_head_of)} query heads share {n_kv_heads} key/value heads, "
                f"{len(kv_head_of) // n_kv_heads} each, so the cache stores {n_kv_heads} heads instead of {len(kv_head_of)}.")
    return Drawing(fig, alt, "Where the cache's bytes go: every layer, sequence, head, position and "
                             "channel." + (" With grouped-query attention, query heads share key/value heads." if gqa else ""))


def _gqa(ax, kv_head_of, n_kv):
    H = len(kv_head_of)
    for h, g in enumerate(kv_head_of):
        ax.add_patch(Rectangle((h, 1.2), 0.8, 0.5, facecolor=SEEN, edgecolor="k", lw=0.5))
        ax.text(h + 0.4, 1.45, f"q{h}", ha="center", va="center", fontsize=7, color="white")
        x = (g + 0.5) * H / n_kv - 0.4
        ax.add_patch(FancyArrowPatch((h + 0.4, 1.2), (x + 0.4, 0.5), arrowstyle="-|>", mutation_scale=7, lw=0.6))
    for g in range(n_kv):
        x = (g + 0.5) * H / n_kv - 0.4
        ax.add_patch(Rectangle((x, 0), 0.8, 0.5, facecolor=NEW, edgecolor="k", lw=0.5))
        ax.text(x + 0.4, 0.25, f"kv{g}", ha="center", va="center", fontsize=7)
    ax.set(xlim=(-0.2, H), ylim=(-0.1, 1.8))
    ax.axis("off")
    ax.set_title("grouped-query attention: which key/value head each query head reads", fontsize=8)


# ------------------------------------------------------------------------------------------ chapter 5

def quant_axes(x: torch.Tensor, bits: int, quantize) -> Drawing:
    """A real key matrix ``x [positions, channels]`` quantized two ways by ``quantize(x, bits, dim)``
    (``kvlab.quant.quantize``): one scale per token (``dim=-1``) and one per channel (``dim=0``);
    the scales' shapes are read off the returned tensors, next to each error."""
    x = x.detach().float().cpu()
    fig, axes = _figure(7.0, 3.2, ncols=3)
    lim = float(x.abs().max())
    axes[0].imshow(x.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
    axes[0].set(title="keys", xlabel="channel", ylabel="position")
    errs, maps = {}, {}
    for dim, name in ((-1, "per token"), (0, "per channel")):
        q, scale, zero = quantize(x, bits, dim)
        maps[name] = (q.float() * scale + zero - x).abs()
        errs[name] = (tuple(scale.shape), float(maps[name].mean()))
    top = float(max(m.max() for m in maps.values()))          # one colour scale for both errors
    for ax, name in zip(axes[1:], maps):
        ax.imshow(maps[name].numpy(), cmap="Reds", vmin=0, vmax=top, aspect="auto")
        ax.set(title=f"{name}: scales {list(errs[name][0])}\nmean |error| {errs[name][1]:.3f}", xlabel="channel")
        ax.set_yticks([])
        ax.title.set_fontsize(8)
    axes[0].title.set_fontsize(8)
    (tok_shape, tok_err), (ch_shape, ch_err) = errs["per token"], errs["per channel"]
    alt = (f"A {x.shape[0]} by {x.shape[1]} key matrix and its {bits}-bit quantization error. One scale per "
           f"token (scales {list(tok_shape)}) gives a mean error of {tok_err:.3f}; one scale per channel "
           f"(scales {list(ch_shape)}) gives {ch_err:.3f}. Darker red is a larger error, on one scale for both.")
    return Drawing(fig, alt, "Which axis gets a scale: a whole row (token) or a whole column (channel) "
                             "shares one step size.")


# ------------------------------------------------------------------------------------------ chapter 6

def padded_batch(input_ids, attention_mask, position_ids=None, tokenizer=None, title: str = "") -> Drawing:
    """A padded batch as :func:`kvlab.batching.make_batch` (or a tokenizer) built it: one cell per
    token, grey for a pad (attention mask 0), the token and (if given) its position id in each cell."""
    B, T = input_ids.shape
    real = [[bool(attention_mask[b, t]) for t in range(T)] for b in range(B)]

    def label(b, t):
        tok_id = int(input_ids[b, t])
        word = "pad" if not real[b][t] else tokenizer.decode([tok_id]).strip()[:6] if tokenizer else str(tok_id)
        return word + (f"\n{int(position_ids[b, t])}" if position_ids is not None else "")
    fig, (ax,) = _figure(min(0.62 * T + 1.0, 7.5), 0.55 * B + 0.9)
    _grid(ax, [[SEEN if real[b][t] else PAD for t in range(T)] for b in range(B)],
          [[label(b, t) for t in range(T)] for b in range(B)], fontsize=8)
    for text, (b, t) in zip(ax.texts, [(b, t) for b in range(B) for t in range(T)]):
        text.set_color("white" if real[b][t] else "black")
    ax.set_yticks([B - 0.5 - b for b in range(B)], [f"row {b}" for b in range(B)], fontsize=8)
    ax.set_title(title or ("token / position id; " if position_ids is not None else "") + "grey: pad (attention mask 0)",
                 fontsize=9)
    pads = [int((attention_mask[b] == 0).sum()) for b in range(B)]
    side = "left" if all(real[b][-1] for b in range(B)) else "right"
    alt = (f"A batch of {B} prompts padded on the {side} to {T} tokens; pads per row: {pads}. Pads have "
           f"attention mask 0" + ("; each row's real tokens have position ids 0, 1, 2, ... from its first real "
                                  "token" if position_ids is not None else "")
           + (", and the last column holds every row's newest token." if side == "left"
              else ", and the last column of a padded row is a pad."))
    caption = ("Left padding: every row ends in the same column" + (", and position ids count only the real "
               "tokens." if position_ids is not None else ".") if side == "left"
               else "Right padding: a short row's last column is a pad.")
    return Drawing(fig, alt, caption)


# ------------------------------------------------------------------------------- chapters 7, 8 and 9

def roofline(peak_flops: float, bandwidth: float, points: dict, what: str = "") -> Drawing:
    """The classic roofline: attainable FLOP/s = min(peak, intensity x bandwidth) on log-log axes,
    its ridge (where the two limits meet) marked, and measured ``points`` (label -> (FLOPs per byte,
    achieved FLOP/s)). ``peak_flops`` and ``bandwidth`` are the measured limits of ``what``."""
    ridge = peak_flops / bandwidth
    xs = [v[0] for v in points.values()] + [ridge]
    lo, hi = min(xs) / 4, max(xs) * 4
    fig, (ax,) = _figure(6.5, 3.8)
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(peak_flops, x * bandwidth) for x in grid], "k-", lw=1.5)
    ax.axvline(ridge, color="0.5", ls="--", lw=0.8)
    ax.annotate(f"ridge: {ridge:.3g} FLOP/byte", (ridge, peak_flops), textcoords="offset points",
                xytext=(4, -12), fontsize=7)
    for (label, (x, y)), m in zip(points.items(), "os^vD<>p"):
        ax.plot([x], [y], m, ms=6, label=f"{label}: {y / min(peak_flops, x * bandwidth):.0%} of its roof")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOPs per byte moved)",
           ylabel="FLOP/s", title=f"roofline{' of ' + what if what else ''}")
    ax.legend(fontsize=7)
    bound = {k: "memory-bound" if v[0] < ridge else "compute-bound" for k, v in points.items()}
    alt = (f"Roofline{' of ' + what if what else ''}: a bandwidth slope of {bandwidth / 1e9:.3g} GB/s meets the "
           f"peak of {peak_flops / 1e12:.3g} TFLOP/s at {ridge:.3g} FLOPs per byte. Points: "
           + "; ".join(f"{k} at {v[0]:.3g} FLOP/byte, {v[1] / 1e9:.3g} GFLOP/s ({bound[k]})" for k, v in points.items()))
    return Drawing(fig, alt, "Left of the ridge a kernel waits for memory; right of it, for arithmetic.")


def static_buffer(max_len: int, position: int, batch: int = 1, name: str = "static cache") -> Drawing:
    """A static cache's buffer of ``max_len`` slots (e.g. ``cache.max_len``) and its position pointer
    (``int(cache.position)``): slots before it hold tokens, the rest are allocated and unused."""
    fig, (ax,) = _figure(min(0.3 * max_len + 1.5, 7.5), 0.45 * batch + 1.1)
    _grid(ax, [[PAST if p < position else EMPTY for p in range(max_len)] for _ in range(batch)])
    for b in range(batch):
        ax.add_patch(Rectangle((0, b), max_len, 1, fill=False, edgecolor="0.4", lw=0.6))
    ax.annotate("position", (position, batch), xytext=(position, batch + 0.9), ha="center", fontsize=8,
                arrowprops=dict(arrowstyle="-|>", lw=0.8))
    ax.set_ylim(0, batch + 1.3)
    ax.set_xlabel(f"slot (0 .. {max_len - 1}); the next token is written at slot {position}", fontsize=8)
    alt = (f"A {name} buffer of {max_len} slots per row, allocated once; {position} are filled and "
           f"the position pointer is at slot {position}, where the next key and value will be written. "
           f"The other {max_len - position} slots hold nothing yet, and no query attends to them.")
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
    fig, (ax,) = _figure(min(0.6 * n + 1.6, 7.5), 0.5 * rows + 1.6)
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
    return Drawing(fig, _tables_alt(blocks, tables, pool, copies),
                   "Block tables point into one pool; a block held by several tables is counted, and the "
                   "first write into a shared, partly filled block copies it first (red arrows).")


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
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(handles), 3), fontsize=7, frameon=False)


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
    fig, (ax,) = _figure(7.0, 0.2 * len(spans) + 1.4)
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
    fig.legend(handles, labels, loc="outside lower center", ncol=len(handles), fontsize=7, frameon=False)
    ttft = sorted(s[2] - s[1] for s in spans)
    pre = sum(1 for s in spans if s[5])
    alt = (f"Timeline of {len(spans)} requests over {max(s[3] for s in spans):.3g} s: each bar runs from "
           f"arrival through the first token (median time to first token {ttft[len(ttft) // 2]:.3g} s, longest "
           f"{ttft[-1]:.3g} s) to the last token" + (f"; {pre} were preempted at least once." if pre else "."))
    return Drawing(fig, alt, "Each request's wait, prefill and decode, on one clock.")
