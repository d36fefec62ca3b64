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

from .provenance import readable

# one colour per role, the same in every diagram
PAST, NEW, EMPTY, PAD, SEEN, HIDDEN = "#b8cde0", "#e8893a", "#f4f4f4", "#d9d9d9", "#4c78a8", "#f4f4f4"


@dataclass
class Drawing:
    """A figure with its alt text (what a reader who cannot see it should know) and caption."""

    figure: Figure
    alt: str
    caption: str = ""

    def png(self, dpi: int = 110) -> bytes:
        readable(self.figure)          # no text under the book's minimum size (kvlab.provenance)
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


def canvas(width: float, height: float, ncols: int = 1, nrows: int = 1, **kw):
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, [ax for row in axes for ax in row]


def grid(ax, colours, labels=None, fontsize: float = 7):
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
    fig, (ax,) = canvas(min(0.32 * S + 2.5, 7.5), 0.42 * len(steps) + 0.9)
    colours, labels = [], []
    for s in steps:
        row = [PAST if p < s["before"] else NEW if p < s["after"] else EMPTY for p in range(S)]
        words = [tokenizer.decode([t]).strip()[:4] if tokenizer else "" for t in s["tokens"]]
        labels.append([""] * s["before"] + words + [""] * (S - s["after"]))
        colours.append(row)
    grid(ax, colours, labels, fontsize=5.5)
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
    fig, axes = canvas(7.0, 0.16 * S + 1.8, ncols=3, gridspec_kw=dict(width_ratios=[dims, dims, 7]))
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
    fig, axes = canvas(min(0.35 * S * 2 + 1.5, 7.5), 0.35 * T + 1.4, ncols=2)
    for ax, m, title in zip(axes, (ours, top_left), ("what the model applies", "is_causal=True")):
        colours = [[SEEN if m[i, j] else HIDDEN for j in range(S)] for i in range(T)]
        grid(ax, colours, [["" for _ in range(S)] for _ in range(T)])
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
    fig, axes = canvas(7.0, 2.6 if gqa else 1.4, nrows=2 if gqa else 1)
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
    fig, axes = canvas(7.0, 3.2, ncols=3)
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
    fig, (ax,) = canvas(min(0.62 * T + 1.0, 7.5), 0.55 * B + 0.9)
    grid(ax, [[SEEN if real[b][t] else PAD for t in range(T)] for b in range(B)],
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
    fig, (ax,) = canvas(6.5, 3.8)
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




def step_bytes(model, batch: int, seq_lens) -> Drawing:
    """What one decode step of ``model`` reads, per context length: the layers' weights, the LM head,
    the rows of the look-up tables and the cached keys and values, all counted by :mod:`kvlab.roofline`
    on the live model (the bytes chapter 7's floor divides by the bandwidth)."""
    from . import roofline as rf

    head = rf.lm_head(model)
    head_b = head.numel() * head.element_size()
    rows_b = rf.weight_read_bytes(model, batch) - (rf.weight_bytes(model) - rf.lookup_bytes(model))
    layers_b = rf.weight_bytes(model) - rf.lookup_bytes(model) - head_b
    parts = [("layers' weights", layers_b, PAST), ("LM head", head_b, SEEN), ("look-up rows", rows_b, PAD)]
    fig, (ax,) = canvas(7.0, 0.55 * len(seq_lens) + 1.3)
    for i, s in enumerate(seq_lens):
        left = 0
        for name, b, colour in parts + [("KV cache", rf.cache_read_bytes(model, batch, s), NEW)]:
            ax.barh(i, b / 1e6, left=left / 1e6, color=colour, label=name if i == 0 else None, edgecolor="white")
            left += b
        ax.text(left / 1e6, i, f" {left / 1e6:,.1f} MB", va="center", fontsize=8)
    ax.set_yticks(range(len(seq_lens)), [f"{s:,} cached" for s in seq_lens])
    ax.invert_yaxis()
    ax.set_xlim(0, ax.get_xlim()[1] * 1.15)
    ax.set(xlabel=f"MB one decode step reads (batch {batch})")
    fig.legend(loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    total = [rf.decode_step_bytes(model, batch, s) for s in seq_lens]
    alt = (f"One decode step of {getattr(model, 'kvlab_name', 'the model')} at batch {batch} reads "
           f"{(layers_b + head_b) / 1e6:,.1f} MB of weights whatever the context, plus the cache: "
           + "; ".join(f"{s} cached positions: {t / 1e6:,.1f} MB in all" for s, t in zip(seq_lens, total)) + ".")
    return Drawing(fig, alt, "The bytes a decode step must read: every weight once, the rows it looks up, "
                             "and every cached key and value; the cache's share grows with the context.")
