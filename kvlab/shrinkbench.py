"""Chapter 11's measurements: what each cache-shrinking design saves, and what it costs this model.

Quality is the book's perplexity protocol (:func:`kvlab.quality.window_loss`: non-overlapping
windows of the evaluation part of the held-out text, the book's perplexity text) and the top-1 agreement of the next-token prediction with the
original model on the same positions. The held-out text is split once: its first part calibrates
conversions (and uptrains them), the rest evaluates, and never the other way round.

    split_text(tok)                                   -> calibration windows, training ids, evaluation ids
    quality(model, eval_ids, ref_top1, cache_factory) -> {"ppl", "agree"}
    attention_mass(model, windows, first)             -> per layer, the share of attention on positions < first
    uptrain(model, train_ids, steps)                  -> losses (trains the model in place)
    decode_times(models, context, ...)                -> {name: Timing}, interleaved
    published_rows(), headline_checks()               -> the designs of chapter 4's table, priced

Everything returns rows of numbers; the chapter shows them (``kvlab.tables``, ``kvlab.plots``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import designs
from .configs import context_length
from .quality import CALIBRATION_SHARE, heldout_split, window_loss  # noqa: F401 (the share, re-exported)
from .progress import bar
from .timing import Budget, compare

def split_text(tok, window: int = 512, path=None):
    """``(calibration [n, window], training ids, evaluation ids)`` from the bundled held-out text
    (:func:`kvlab.quality.heldout_split`): the first :data:`CALIBRATION_SHARE` of it calibrates and
    trains, the rest, the book's perplexity text, evaluates."""
    train, evaluation = heldout_split(tok, path)
    n = min(8, train.numel() // window)
    return train[:n * window].view(n, window), train, evaluation


class Scored(nn.Module):
    """A kvlab GPT-2 in the shape ``window_loss`` expects (``model(input_ids=x).logits``), optionally
    through a fresh cache per batch, recording each position's top-1 prediction."""

    def __init__(self, model, cache_factory=None):
        super().__init__()
        self.model, self.cache_factory, self.top1 = model, cache_factory, []
        self.config = model.config

    def forward(self, input_ids):
        cache = None if self.cache_factory is None else self.cache_factory(input_ids.shape[0])
        logits = self.model(input_ids, cache)
        self.top1.append(logits.argmax(-1))
        return SimpleNamespace(logits=logits)


@torch.no_grad()
def quality(model, eval_ids, ref_top1=None, cache_factory=None, max_windows=None) -> dict:
    """Perplexity over ``eval_ids`` (the book's protocol) and, given the original's ``top1`` from the
    same call, the share of positions where this model predicts the same next token."""
    scored = Scored(model, cache_factory)
    loss, windows = window_loss(scored, eval_ids, window=model.config.n_positions, max_windows=max_windows)
    top1 = torch.cat(scored.top1)
    agree = float("nan") if ref_top1 is None else (top1 == ref_top1).float().mean().item()
    return {"ppl": math.exp(loss), "loss": loss, "agree": agree, "windows": windows, "top1": top1}


# ---------------------------------------------------------------------------------------------------
# Attention sinks


def attention_weights(model, windows: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's attention weights ``[B, H, T, S]`` on the token ids ``windows`` ``[B, T]``."""
    seen = []

    def recording(q, k, v, mask):
        w = torch.softmax((q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf")), -1)
        seen.append(w)
        return w @ v
    recording.takes_mask = True

    saved = model.attention_fn
    model.attention_fn = recording
    try:
        with torch.no_grad():
            model(windows)
    finally:
        model.attention_fn = saved
    return seen


def attention_mass(model, windows: torch.Tensor, first: int = 4, skip: int = 32) -> torch.Tensor:
    """``[n_layer, n_head]``: the mean attention weight that queries at positions >= ``skip`` put on the
    keys at positions < ``first`` (a head with a sink puts much more there than ``first / position``)."""
    return torch.stack([w[..., skip:, :first].sum(-1).mean(dim=(0, 2)) for w in attention_weights(model, windows)])


def attention_beyond(model, windows: torch.Tensor, grid, first: int = 4) -> torch.Tensor:
    """``[n_layer, len(grid)]``: per layer, the mean share of attention (over heads and every query) on
    keys a window of ``w`` drops: ``w`` or more positions back, and not among the ``first`` (which
    sinks would keep)."""
    out = []
    for w in attention_weights(model, windows):
        T = w.shape[-1]
        key = torch.arange(T, device=w.device)
        dist = key[:, None] - key[None, :]
        far = [((dist >= g) & (key[None, :] >= first)).to(w.dtype) for g in grid]
        out.append(torch.stack([(w * f).sum(-1).mean() for f in far]))
    return torch.stack(out)


def uniform_mass(length: int, first: int = 4, skip: int = 32) -> float:
    """What :func:`attention_mass` would be if every query spread its weight evenly over its keys."""
    return sum(first / (p + 1) for p in range(skip, length)) / (length - skip)


# ---------------------------------------------------------------------------------------------------
# Uptraining


def uptrain(model, train_ids: torch.Tensor, steps: int, teacher=None, batch: int = 4, seq: int = 256,
            lr: float = 1e-4, seed: int = 0, budget: Budget | None = None) -> list[float]:
    """Train ``model`` in place for ``steps`` steps of ``batch`` random ``seq``-token crops of ``train_ids``
    (AdamW, constant ``lr``, clip 1.0); returns the losses. Without a ``teacher``: the language-model
    loss, as the GQA paper continues pre-training. With one (the original model): the KL divergence
    from the teacher's next-token distributions, which restores the original rather than fitting the
    training text (a few thousand tokens here, where the paper has 5% of pre-training). A ``budget``
    (:class:`kvlab.timing.Budget`) may stop it before ``steps``: ``len(losses)`` steps were taken."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    losses = []
    for _ in bar(range(steps) if budget is None else budget.rounds(steps, "steps"), desc="uptraining", leave=False):
        starts = torch.randint(0, train_ids.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([train_ids[s:s + seq + 1] for s in starts.tolist()])
        logits = model(x[:, :-1])
        if teacher is None:
            loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        else:
            with torch.no_grad():
                target = F.log_softmax(teacher(x[:, :-1]), -1)
            loss = F.kl_div(F.log_softmax(logits, -1), target, log_target=True, reduction="batchmean") / seq
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


# ---------------------------------------------------------------------------------------------------
# Decode time


def decode_step_fn(model, context: int, batch: int = 1, cache=None):
    """One decode step at ``context`` cached tokens, repeatable: prefill once, then each call rewinds to
    ``context`` and decodes one token (a window cache, which cannot rewind, steps on instead)."""
    ids = torch.randint(1, model.config.vocab_size, (batch, context + 1), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.wte.weight.device)
    cache = cache if cache is not None else model.new_cache(batch)
    with torch.no_grad():
        model(ids[:, :context], cache)
    rewinds = not hasattr(cache, "window")
    tok = ids[:, context:]

    @torch.no_grad()
    def step():
        if rewinds:
            cache.rewind(context)
        model(tok, cache, last_only=True)
    return step


def decode_times(models: dict, context: int, batch: int = 1, repeats: int = 5, caches: dict | None = None,
                 budget: Budget | None = None) -> dict:
    """``{name: Timing}`` of one decode step of each model at ``context`` tokens, interleaved in one run
    (fewer than ``repeats`` rounds once ``budget`` is spent)."""
    caches = caches or {}
    fns = {name: decode_step_fn(m, context, batch, caches.get(name)) for name, m in models.items()}
    return compare(fns, warmup=2, repeats=repeats, budget=budget)


# ---------------------------------------------------------------------------------------------------
# The published designs


def published_rows(names, seq_len: int = 32768, bits: float = 16) -> list[dict]:
    """One row per model: its design, numbers cached per token and layer, bytes per token, the cache
    and a batch-1 decode step's bytes (chapter 7's floor) at ``seq_len``, against the same model with
    a key and a value head per query head and no window (its MHA baseline)."""
    table, rows = designs.load_designs(), []
    for name in names:
        c = table[name]
        per_layer = designs.numbers_per_token(c)
        n_layer = len(designs.layer_windows(c))
        mha = {**c, "num_key_value_heads": c.get("num_attention_heads", c.get("n_head")), "sliding_window": None}
        mha_cache = sum(designs.held_tokens(mha, seq_len)) * designs.mha_numbers_per_token(c) * bits / 8
        cache = designs.cache_bytes(c, seq_len, 1, bits)
        rows.append({"model": name, "design": design_name(c), "numbers/token/layer": per_layer,
                     "KiB/token": n_layer * per_layer * bits / 8 / 1024,
                     "cache GiB": cache / 2 ** 30, "of MHA": cache / mha_cache,
                     "step GiB": designs.step_bytes(c, seq_len, 1, bits) / 2 ** 30,
                     "step of MHA": designs.step_bytes(c, seq_len, 1, bits) /
                     (designs.weight_read_bytes(c) + mha_cache),
                     # the config's context; Falcon-7B's Hub config states none, the catalogue has its card's 2,048
                     "context": context_length(c)})
    return rows


def design_name(c) -> str:
    if designs.is_latent(c):
        return f"MLA (latent {c['kv_lora_rank']} + rotary {c.get('qk_rope_head_dim', 0)})"
    windows = designs.layer_windows(c)
    kind = c.get("attention", "MHA")
    local = sum(w is not None for w in windows)
    if local == len(windows):
        return f"{kind}, window {windows[0]} in every layer"
    if local:
        return f"{kind}, window {next(w for w in windows if w)} in {local} of {len(windows)} layers"
    return kind


def headline_checks() -> list[dict]:
    """Each paper's cache-size headline recomputed from the configs: ours, theirs, against what."""
    t = designs.load_designs()
    v2, d67 = t["DeepSeek-V2"], t["DeepSeek-LLM-67B"]
    v2_numbers = designs.numbers_per_token(v2) * 60
    d67_numbers = designs.numbers_per_token(d67) * 95
    mis, gem, llama = t["Mistral-7B-v0.1"], t["Gemma-2-9B"], t["Llama-3.1-8B"]
    return [
        {"claim": "DeepSeek-V2: KV cache 93.3% smaller than DeepSeek 67B's", "paper": 0.933,
         "ours": 1 - v2_numbers * 6 / (d67_numbers * 16),
         "against": "DeepSeek-LLM-67B (GQA, 8 kv heads, 95 layers) at 16 bits; V2 at its deployed 6 bits a number"},
        {"claim": "the same, without V2's 6-bit cache", "paper": float("nan"), "ours": 1 - v2_numbers / d67_numbers,
         "against": "both at 16 bits: the architecture's share of the 93.3%"},
        {"claim": "DeepSeek-V2: MLA's cache equals GQA with 2.25 groups", "paper": 2.25,
         "ours": v2_numbers / (2 * 128 * 60), "against": "kv heads of 128 numbers each, 60 layers"},
        {"claim": "Mistral 7B: an 8x smaller cache at 32k tokens", "paper": 8.0,
         "ours": designs.cache_bytes({**mis, "sliding_window": None}, 32768) / designs.cache_bytes(mis, 32768),
         "against": "the same model attending over the whole 32k context"},
        {"claim": "Gemma 2 (local/global): cache at its 8k context, share of global-only", "paper": float("nan"),
         "ours": designs.cache_bytes(gem, 8192) / designs.cache_bytes({**gem, "sliding_window": None}, 8192),
         "against": "every layer global"},
        {"claim": "Llama 3.1 8B (GQA, 8 of 32): a 4x smaller cache than MHA's", "paper": 4.0,
         "ours": designs.mha_numbers_per_token(llama) / designs.numbers_per_token(llama),
         "against": "32 kv heads"},
    ]


# ---------------------------------------------------------------------------------------------------
# The chapter's grids: one row per variant


def _row(q: dict, ref: dict, **fields) -> dict:
    return {**fields, "ppl": q["ppl"], "ppl change": q["ppl"] / ref["ppl"] - 1, "top-1 agree": q["agree"]}


def spread_first(grid) -> list:
    """``grid`` (sorted) reordered so that every prefix spans it: both ends first, then the middle of
    the widest gap left, and so on. A budget that stops a sweep early then leaves out points between
    measured ones, not one end of the range."""
    grid = list(grid)
    if len(grid) <= 2:
        return grid
    order, gaps = [0, len(grid) - 1], [(0, len(grid) - 1)]
    while gaps:
        lo, hi = max(gaps, key=lambda g: (g[1] - g[0], -g[0]))
        gaps.remove((lo, hi))
        if hi - lo > 1:
            mid = (lo + hi) // 2
            order.append(mid)
            gaps += [(lo, mid), (mid, hi)]
    return [grid[i] for i in order]


def _grid(points, budget: Budget | None, size=lambda _: 1.0):
    """``points`` in order, cut by ``budget`` when one is given (its note names what it left out)."""
    return points if budget is None else budget.points(points, size=size)


def gqa_rows(model, calibration, eval_ids, ref, max_windows=None, budget: Budget | None = None) -> list[dict]:
    """Every group count below ``n_head`` (fewest heads first, so multi-query is always measured; a
    ``budget`` may leave the largest counts out) x every conversion: quality and cache bytes per token."""
    from . import gqa

    rows = []
    counts = sorted(g for g in gqa.group_counts(model.config.n_head) if g < model.config.n_head)
    for n_kv in bar(_grid(counts, budget), desc="group counts", leave=False):
        for method in gqa.METHODS:
            conv = gqa.convert(model, n_kv, method, calibration)
            q = quality(conv, eval_ids, ref["top1"], max_windows=max_windows)
            rows.append(_row(q, ref, kv_heads=n_kv, method=method,
                             **{"bytes/token": conv.new_cache(1, 64).nbytes / 64, "of MHA bytes": n_kv / model.config.n_head}))
    return rows


def window_rows(model, eval_ids, ref, windows, sinks=(0, 4), max_windows=None, budget: Budget | None = None) -> list[dict]:
    """Perplexity of the whole held-out text through a :class:`kvlab.window.SinkWindowKVCache` per
    (window, sinks): every query sees its sinks and its window only. The smallest and largest window
    first, then the middle ones (:func:`spread_first`), each with every sink count, so a ``budget``
    that leaves windows out still leaves the range and its pairs to compare; rows sorted by sinks,
    then window."""
    from .window import SinkWindowKVCache

    rows = []
    ctx = model.config.n_positions
    for w in bar(_grid(spread_first(sorted(windows)), budget), desc="windows", leave=False):
        for s in sinks:
            if w + s <= ctx:
                q = quality(model, eval_ids, ref["top1"], lambda B: SinkWindowKVCache.for_model(model, w, s), max_windows)
                rows.append(_row(q, ref, window=w, sinks=s, **{"keys held": s + w - 1}))
    return sorted(rows, key=lambda r: (r["sinks"], r["window"]))


def latent_rows(model, calibration, eval_ids, ref, ranks, max_windows=None, budget: Budget | None = None) -> list[dict]:
    """Quality and bytes per token of the latent cache for each rank, by SVD of the weights and by PCA
    of the calibration text's keys and values. The smallest and the largest rank (the lossless
    ``n_embd`` when asked for) first, then the middle ones (:func:`spread_first`): a ``budget`` leaves
    middle ranks out. Rows sorted by rank."""
    from . import latent

    rows, full = [], model.new_cache(1, 64).nbytes / 64
    for r in bar(_grid(spread_first(sorted(ranks)), budget), desc="latent ranks", leave=False):
        for method in latent.METHODS:
            conv = latent.convert(model, r, method, calibration)
            q = quality(conv, eval_ids, ref["top1"], max_windows=max_windows)
            b = conv.new_cache(1, 64).nbytes / 64
            rows.append(_row(q, ref, rank=r, method=method, **{"bytes/token": b, "of MHA bytes": b / full}))
    return sorted(rows, key=lambda row: row["rank"])


def uptrain_rows(model, calibration, train_ids, eval_ids, ref, n_kv: int, steps: int, max_windows=None,
                 budget: Budget | None = None) -> list[dict]:
    """Each conversion to ``n_kv`` heads uptrained ``steps`` steps by distillation from the original on
    the training split: perplexity before and after, and the share of the conversion's perplexity gap
    to the original closed. The control: the original itself trained as many steps with the
    language-model loss on the same split (what the text alone does to it). It trains first, under
    ``budget`` when one is given: if the budget stops it early, every conversion trains the same
    number of steps it took (each row's ``steps`` says how many)."""
    import copy

    from . import gqa

    control = copy.deepcopy(model)
    steps = len(uptrain(control, train_ids, steps, budget=budget))
    rows = [{"model": "original, language-model loss (control)", "steps": steps, "before": ref["ppl"],
             "after": quality(control, eval_ids, ref["top1"], max_windows=max_windows)["ppl"], "gap closed": float("nan")}]
    for method in gqa.METHODS:
        conv = gqa.convert(model, n_kv, method, calibration)
        before = quality(conv, eval_ids, ref["top1"], max_windows=max_windows)["ppl"]
        uptrain(conv, train_ids, steps, teacher=model)
        q = quality(conv, eval_ids, ref["top1"], max_windows=max_windows)
        gap = before - ref["ppl"]
        rows.append({"model": f"{n_kv} kv head{'' if n_kv == 1 else 's'}, {method}, distilled", "steps": steps, "before": before, "after": q["ppl"],
                     "top-1 agree after": q["agree"],
                     "gap closed": 1 - (q["ppl"] - ref["ppl"]) / gap if gap > 0.01 * ref["ppl"] else float("nan")})
    return rows


def smallest_within(rows, key: str, tolerance: float, **where):
    """The row with the smallest ``key`` among those matching ``where`` whose perplexity change is
    within ``tolerance`` (None if none is)."""
    ok = [r for r in rows if all(r[k] == v for k, v in where.items()) and r["ppl change"] <= tolerance]
    return min(ok, key=lambda r: r[key]) if ok else None
