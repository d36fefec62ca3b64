"""Measuring the serving engine (chapter 9): workloads, Poisson arrivals, serving metrics, the floor,
sweeps, computed sentences and the plot. The engine (:mod:`kvlab.serving`) prints and measures
nothing; this does (tables go through :func:`kvlab.tables.show`).

Metrics, from the engine's trace (times on its :class:`~kvlab.serving.clock.Clock`, idle gaps skipped):

* TTFT, time to first token: first token - arrival; TPOT, time per output token after the first:
  (last token - first token) / (tokens - 1); end-to-end latency: last token - arrival;
* decode stall: the longest gap between two consecutive tokens of one request;
* throughput: output tokens / the run's duration; goodput: requests that met both a TTFT and a TPOT
  target, per second (vLLM bench's *request goodput*); DistServe's goodput, the highest arrival rate
  at which a given share of requests meets them, is :func:`slo_goodput` over a sweep of rates;
* used/reserved: tokens held by running sequences / the slots reserved for them, averaged over steps.
"""

from __future__ import annotations

import math
import random

import torch

from .progress import bar
from .serving.reference import References
from .paged import BlockAllocator, blocks_for
from .roofline import forward_floor
from .serving import BlockManager, Engine, Runner, Sequence, Status
from .timing import Budget, Timing, compare
from .verdicts import compare_timings, on, relation
from .validate import check_int

# ---------------------------------------------------------------------------------------------------
# Workloads and the reference


def random_workload(n: int, vocab_size: int, prompt_len=(4, 48), new_tokens=(4, 64), seed: int = 0,
                    prefix: list[int] | None = None) -> list[tuple[list[int], int]]:
    """``n`` requests ``(prompt, max_new_tokens)`` with lengths drawn uniformly from the ranges."""
    check_int(n, "n (requests)", 1)
    check_int(vocab_size, "vocab_size", 2, fix="the prompts draw ids from 1 to vocab_size - 1")
    for what, (lo, hi) in (("prompt_len", prompt_len), ("new_tokens", new_tokens)):
        check_int(hi, f"{what}'s upper end", check_int(lo, f"{what}'s lower end", 1,
                                                         fix="a request has one token at least"))
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        P = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=g))
        M = int(torch.randint(new_tokens[0], new_tokens[1] + 1, (1,), generator=g))
        prompt = torch.randint(1, vocab_size, (P,), generator=g).tolist()
        out.append(((prefix or []) + prompt, M))
    return out


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds) of ``n`` requests arriving at ``rate`` per second on average (a Poisson
    process: exponential gaps), seeded; the first arrives at 0."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"rate must be a finite number of requests per second > 0, got {rate!r}")
    n = check_int(n, "n (requests)", 1)
    rng, t, out = random.Random(seed), 0.0, [0.0]
    for _ in range(n - 1):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def serve(model, workload, arrivals=None, eos_token_id=None, prefix=None, **engine_kw) -> Engine:
    """Serve ``workload`` (``(prompt, max_new_tokens)`` pairs) arriving at ``arrivals`` (default: all
    at 0) through a fresh :class:`~kvlab.serving.Engine`; returns the engine after the run."""
    eng = Engine(model, **engine_kw)
    if prefix:
        eng.add_prefix(prefix)
    for i, (prompt, m) in enumerate(workload):
        eng.submit(prompt, m, eos_token_id, arrival=arrivals[i] if arrivals else 0.0)
    eng.run()
    return eng


# ---------------------------------------------------------------------------------------------------
# Metrics


def percentile(xs, q: float) -> float:
    """The ``q``-quantile (0..1) with linear interpolation; nan for no data."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = q * (len(xs) - 1)
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def request_metrics(eng: Engine) -> list[dict]:
    """Per finished request: ttft, tpot (nan for one token), e2e, stall (longest gap between tokens)."""
    rows = []
    for s in eng.seqs.values():
        t = eng.trace.token_times.get(s.rid, [])
        if s.status is not Status.FINISHED or not t:
            continue
        gaps = [b - a for a, b in zip(t, t[1:])]
        rows.append(dict(rid=s.rid, arrival=s.arrival, ttft=t[0] - s.arrival, e2e=t[-1] - s.arrival,
                         tpot=(t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else float("nan"),
                         stall=max(gaps, default=0.0), tokens=len(t), preemptions=s.preemptions))
    return rows


def summarize(eng: Engine, ttft_target: float | None = None, tpot_target: float | None = None) -> dict:
    """One run in numbers: latencies (median, p90), throughput, goodput, memory, preemptions, cache."""
    rows, steps = request_metrics(eng), eng.trace.steps
    duration = steps[-1]["time"] if steps else float("nan")
    good = [r for r in rows if (ttft_target is None or r["ttft"] <= ttft_target)
            and (tpot_target is None or math.isnan(r["tpot"]) or r["tpot"] <= tpot_target)]
    out = dict(requests=len(eng.seqs), finished=len(rows), steps=len(steps), seconds=duration,
               tokens=sum(r["tokens"] for r in rows), goodput=len(good) / duration, met=len(good) / max(len(rows), 1),
               preemptions=eng.scheduler.preemptions, peak_blocks=max((t["blocks_used"] for t in steps), default=0),
               mean_running=sum(t["running"] for t in steps) / max(len(steps), 1),
               max_running=max((t["running"] for t in steps), default=0), used_share=used_share(eng),
               hits=eng.blocks.hits, hit_tokens=eng.blocks.hit_tokens, evictions=eng.blocks.evictions,
               copies=eng.blocks.copies)
    out["tokens_per_s"] = out["tokens"] / duration
    for k in ("ttft", "tpot", "e2e", "stall"):
        vals = [r[k] for r in rows if not math.isnan(r[k])]
        out[f"{k}_p50"], out[f"{k}_p90"] = percentile(vals, 0.5), percentile(vals, 0.9)
    out["max_stall"] = max((r["stall"] for r in rows), default=float("nan"))
    return out


def used_share(eng: Engine) -> float:
    """Tokens held by running sequences / token slots reserved for them, averaged over the steps that
    held any (a reserving policy counts its promises, on-demand the blocks it holds)."""
    bs = eng.blocks.block_size
    shares = [t["held"] / (t["reserved"] * bs) for t in eng.trace.steps if t["reserved"]]
    return sum(shares) / len(shares) if shares else float("nan")


# ---------------------------------------------------------------------------------------------------
# The floor of a run


def step_floor(model, tokens: int, logit_rows: int, keys: int, pairs: int, bandwidth: float, flops: float) -> float:
    """The least time one ragged step could take: chapter 7's :func:`kvlab.roofline.forward_floor` of
    ``tokens`` new tokens (the LM head only for the ``logit_rows`` rows that get logits), reading the
    ``keys - tokens`` keys already cached for the step's sequences and scoring ``pairs`` (query, key) pairs."""
    return forward_floor(model, tokens, logit_rows, max(keys - tokens, 0), pairs, bandwidth, flops)


def run_floor(eng: Engine, bandwidth: float, flops: float) -> float:
    """Chapter 7's floor for a whole run: the sum of its steps' floors (:func:`step_floor`)."""
    return sum(step_floor(eng.model, t["tokens"], t["logit_rows"], t["context"] + t["tokens"], t["pairs"],
                          bandwidth, flops) for t in eng.trace.steps)


# ---------------------------------------------------------------------------------------------------
# Experiments


def _random_tokens(rng, n, vocab):
    return tuple(rng.randrange(1, vocab) for _ in range(n))


def prepared_steps(model, rows: int, context: int, prompt_len: int, block_size: int = 16, gather=None,
                   cached: int = 0, exact: bool = False, paged: bool | None = None):
    """A runner with ``rows`` sequences of ``context`` cached tokens, each due one decode token, and
    one prompt of ``cached + prompt_len`` tokens whose first ``cached`` are in its blocks already (a
    chunk after a cached prefix): ``(runner, decode work, prefill work)``. Running a step does not
    advance anything (the engine does), so the same step can be timed again and again."""

    nb = rows * blocks_for(context + 1, block_size) + blocks_for(cached + prompt_len, block_size)
    bm = BlockManager(nb, block_size, prefix_caching=False)
    runner, rng, vocab = Runner(model, nb, block_size, gather, exact, paged), random.Random(0), \
        model.config.vocab_size
    decode = []
    for i in range(rows):
        s = Sequence(("decode", i), _random_tokens(rng, context + 1, vocab), 1)
        bm.allocate(s, context + 1)
        runner.run([(s, context)])            # its first `context` tokens into the cache
        s.num_computed = context
        decode.append((s, 1))
    p = Sequence("prompt", _random_tokens(rng, cached + prompt_len, vocab), 1)
    bm.allocate(p, cached + prompt_len)
    if cached:
        runner.run([(p, cached)])             # the prefix into the cache
        p.num_computed = cached
    return runner, decode, [(p, prompt_len)]


def mixed_step_timings(model, rows: int, context: int, prompt_len: int, repeats: int = 5,
                       budget: Budget | None = None) -> dict:
    """Interleaved timings of: the decode step of ``rows`` sequences alone, a ``prompt_len``-token
    prefill alone, both in ONE ragged step, and a padded step (``rows + 1`` rows x ``prompt_len``
    tokens through the same model, no cache: what padding every row to the prompt computes at least).
    ``budget`` (a :class:`kvlab.timing.Budget`) may cut the rounds; its note says how many."""

    runner, decode, prefill = prepared_steps(model, rows, context, prompt_len)
    padded = torch.randint(1, model.config.vocab_size, (rows + 1, prompt_len), device=runner.device)
    fns = {"decode rows alone": lambda: runner.run(decode), "prefill alone": lambda: runner.run(prefill),
           "one ragged step (both)": lambda: runner.run(decode + prefill),
           "padded to the prompt": lambda: torch.no_grad()(model)(padded)}
    return compare(fns, warmup=1, repeats=repeats, progress=False, budget=budget)


def mixed_vs_parts(mix: dict) -> dict:
    """Per interleaved round, the sum and the larger of the two parts' times (decode rows alone, prefill
    alone), as Timings beside the merged step's: the roofline's question is which one it tracks."""
    d, p = mix["decode rows alone"].samples, mix["prefill alone"].samples
    return {"sum of the parts": Timing("sum of the parts", [a + b for a, b in zip(d, p)]),
            "larger part": Timing("larger part", [max(a, b) for a, b in zip(d, p)])}


def mixed_floors(model, rows: int, context: int, prompt_len: int, bandwidth: float, flops: float) -> dict:
    """Chapter 7's floor (:func:`kvlab.roofline.forward_floor`) of the decode rows, of the prefill and of
    both in one step: a memory-bound merged step costs about its larger part (the weights are read once)."""
    dec = forward_floor(model, rows, rows, rows * context, rows * context, bandwidth, flops)
    pre = forward_floor(model, prompt_len, 1, 0, prompt_len * (prompt_len - 1) // 2, bandwidth, flops)
    both = forward_floor(model, rows + prompt_len, rows + 1, rows * context,
                         rows * context + prompt_len * (prompt_len - 1) // 2, bandwidth, flops)
    return dict(decode=dec, prefill=pre, merged=both)


def block_size_timings(model, variants: dict, rows: int, context: int, repeats: int = 5,
                       budget: Budget | None = None) -> dict:
    """Median seconds of one decode step of ``rows`` sequences holding ``context`` tokens each, per
    variant ``name -> (block_size, gather, paged)`` (``gather``: lab 9's one-sequence contract, or None;
    ``paged``: the runner's, None reading keys in place where the C++ kernel runs); ``budget`` may cut
    the rounds."""

    fns = {}
    for name, (bs, gather, paged) in variants.items():
        runner, decode, _ = prepared_steps(model, rows, context, 1, bs, gather, paged=paged)
        fns[name] = lambda runner=runner, decode=decode: runner.run(decode)
    return compare(fns, warmup=1, repeats=repeats, progress=False, budget=budget)


def reserved_vs_used(lengths: list[int], max_len: int, batch_size: int, block_sizes) -> list[dict]:
    """Token slots reserved vs used to hold sequences of the given final ``lengths``, per scheme:
    ``max_len`` per sequence (chapter 3's cache); a growing cache per static batch of ``batch_size``
    (every row as long as its batch's longest); paged blocks of each size, counted by running lab 9's
    :class:`~kvlab.paged.BlockAllocator` one token at a time."""

    used = sum(lengths)
    rows = [dict(scheme=f"reserve max_len={max_len} per sequence", reserved=len(lengths) * max_len)]
    padded = sum(len(lengths[i:i + batch_size]) * max(lengths[i:i + batch_size])
                 for i in range(0, len(lengths), batch_size))
    rows.append(dict(scheme=f"growing cache, static batches of {batch_size}", reserved=padded))
    for bs in block_sizes:
        alloc = BlockAllocator(sum(blocks_for(n, bs) for n in lengths), bs)
        for i, n in enumerate(lengths):
            alloc.allocate(i, 1)
            for _ in range(n - 1):      # grow one token at a time, as decoding does
                alloc.append_slot(i)
        rows.append(dict(scheme=f"paged, block_size={bs}", reserved=(alloc.num_blocks - alloc.num_free) * bs))
    for r in rows:
        r["used"], r["waste"] = used, 1 - used / r["reserved"]
    return rows


def chunk_sweep(model, budgets, decoders: int = 4, decode_len: int = 24, long_prompt: int = 160,
                block_size: int = 16, repeats: int = 1, seed: int = 0, time_budget: Budget | None = None) -> list[dict]:
    """Decode stall against the step's token budget: ``decoders`` requests decode while a
    ``long_prompt``-token prompt arrives; per budget (None: no chunking, the prompt in one step), the
    longest gap between two tokens of a decoding request and the long prompt's TTFT, per repeat
    (up to ``repeats`` rounds, fewer if ``time_budget`` runs out: its note says how many)."""
    rng, vocab = random.Random(seed), model.config.vocab_size
    shorts = [(list(_random_tokens(rng, 8, vocab)), decode_len) for _ in range(decoders)]
    big = list(_random_tokens(rng, long_prompt, vocab))
    rows = {b: dict(budget=b, stall=[], ttft=[], chunks=[], widest=[]) for b in budgets}
    for _ in _rounds(repeats, time_budget):
        for b in budgets:                     # interleaved: every budget once per round
            eng = Engine(model, num_blocks=(decoders + 1) * 64, block_size=block_size,
                         max_num_batched_tokens=b or long_prompt + decoders, chunked_prefill=b is not None)
            for p, m in shorts:
                eng.submit(p, m)
            for _ in range(3):                # the decoders are running when the long prompt arrives
                eng.step()
            late = eng.submit(big, 1, arrival=eng.clock.now())
            eng.run()
            gaps = [max(b2 - a for a, b2 in zip(t, t[1:])) for r, t in eng.trace.token_times.items() if r != late.rid]
            rows[b]["stall"].append(max(gaps))
            rows[b]["ttft"].append(eng.trace.token_times[late.rid][0] - late.arrival)
            during = [t for t in eng.trace.steps if t["prefill_tokens"] and t["time"] > late.arrival]
            rows[b]["chunks"].append(len(during))
            rows[b]["widest"].append(max(t["tokens"] for t in during))   # tokens a decoder waited behind
    return list(rows.values())


def _rounds(repeats: int, time_budget: Budget | None):
    """Round numbers ``0 .. repeats - 1``, cut short by ``time_budget`` (a :class:`kvlab.timing.Budget`)."""
    return range(repeats) if time_budget is None else time_budget.rounds(repeats)


def interleaved_runs(model, workload, policies: dict, repeats: int = 1, arrivals=None, progress: bool = True,
                     time_budget: Budget | None = None, **common) -> dict:
    """Serve ``workload`` under every policy (``name -> engine kwargs``), up to ``repeats`` rounds
    interleaved (fewer if ``time_budget`` runs out); returns ``name -> [Engine]``."""

    runs = {name: [] for name in policies}
    for _ in bar(_rounds(repeats, time_budget), desc="rounds", leave=False, disable=not progress):
        for name, kw in policies.items():
            runs[name].append(serve(model, workload, arrivals=arrivals, **(common | kw)))
    return runs


def median_of(summaries: list[dict], key: str) -> float:
    """The median over the rounds, as every sentence of the chapter takes it (the mean of the middle
    two for an even count)."""
    return percentile([s[key] for s in summaries], 0.5)


def poisson_sweep(model, workload, rates, policies: dict, repeats: int = 1, seed: int = 0, targets=(None, None),
                  refs: References | None = None, time_budget: Budget | None = None, **common) -> list[dict]:
    """Every policy at every arrival rate (requests/s), up to ``repeats`` rounds interleaved (fewer if
    ``time_budget`` runs out); one row per (rate, policy) with the median summary and each round's
    summary (``runs``). Checks the invariant on every run."""

    rows = {(r, p): dict(rate=r, policy=p, runs=[]) for r in rates for p in policies}
    for rep in bar(_rounds(repeats, time_budget), desc="sweep rounds", leave=False):
        for r in rates:
            arrivals = poisson_arrivals(len(workload), r, seed)
            for p, kw in policies.items():
                eng = serve(model, workload, arrivals=arrivals, **(common | kw))
                if refs is not None and refs.mismatches(eng):
                    raise AssertionError(f"{p} at {r}/s: requests {refs.mismatches(eng)} differ from their prompt alone")
                rows[r, p]["runs"].append(summarize(eng, *targets))
    for row in rows.values():
        row.update({k: median_of(row["runs"], k) for k in row["runs"][0]})
    return list(rows.values())


def slo_goodput(rows: list[dict], policy: str, attainment: float = 0.9) -> float | None:
    """DistServe's goodput: the highest arrival rate of the sweep at which at least ``attainment`` of the
    requests met both latency targets (median over rounds); None if no rate did. (The ``goodput`` column
    of :func:`summarize` is vLLM bench's request goodput: requests meeting the targets per second.)"""
    ok = [r["rate"] for r in rows if r["policy"] == policy and r["met"] >= attainment]
    return max(ok) if ok else None


# ---------------------------------------------------------------------------------------------------
# Sentences, tables and plots


def best_of(samples: dict[str, list[float]], what: str, device, lower_is_better: bool = True) -> str:
    """Which variant is best on a measured quantity, by how much (the ratio of medians leads), and
    whether it was better in every round, in the median only, or not at all (the verdict words of
    :mod:`kvlab.verdicts`), as a sentence."""

    ranked = sorted(samples, key=lambda k: percentile(samples[k], 0.5), reverse=not lower_is_better)
    best, second = ranked[:2]
    cost = lambda xs: [x if lower_is_better else (1 / x if x > 0 else math.inf) for x in xs]  # noqa: E731
    a, b = Timing(best, cost(samples[best])), Timing(second, cost(samples[second]))
    n, where = min(len(a.samples), len(b.samples)), on(device)
    if math.isinf(a.median):
        return f"{what}: none of {', '.join(ranked)} had any ({n} round(s) {where})"
    if math.isinf(b.median):
        return f"{what}: {best} is best; {second}, the runner-up, had none in most rounds ({n} round(s) {where})"
    c = compare_timings(a, b)
    if c.verdict == "none":
        return (f"{what}: the best two, '{best}' and '{second}', ratio {b.median / a.median:.2f}: {relation(c, best, second)}; "
                f"{n} round{'s' * (n != 1)} {where}")
    return f"{what}: {best} {b.median / a.median:.2f}x better than {second}, {relation(c, best, second, 'better')} {where}"


def plot_latency_throughput(rows: list[dict], ax, latency: str = "e2e_p90") -> None:
    """Latency against throughput, one line per policy, one point per arrival rate. Each rate is
    labelled once, by the policy's point with the highest latency at that rate, and only where the
    label has room: at saturation several rates land on one spot, and their labels would overlap."""
    for p in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r for r in rows if r["policy"] == p), key=lambda r: r["rate"])
        ax.plot([r["tokens_per_s"] for r in pts], [r[latency] for r in pts], "o-", label=p)
    ax.set(xlabel="throughput (output tokens/s)", ylabel=f"{latency.replace('_', ' ')} latency (s)",
           yscale="log", title="Latency against throughput; labels: arrival rate (requests/s)")
    ax.autoscale_view()
    placed = []                                    # display boxes (x0, y0, x1, y1) of the labels so far
    for rate in sorted(dict.fromkeys(r["rate"] for r in rows)):
        top = max((r for r in rows if r["rate"] == rate and r[latency] > 0), key=lambda r: r[latency], default=None)
        if top is None:
            continue
        x, y = ax.transData.transform((top["tokens_per_s"], top[latency]))
        text = f"{rate:.2g}/s"
        w, h = 7 * len(text), 12                   # about a label of 8-9 points, in pixels at 100 dpi
        for dx, dy in ((4, 4), (4, -h - 4), (-w - 4, 4)):
            box = (x + dx, y + dy, x + dx + w, y + dy + h)
            if all(box[2] < b[0] or box[0] > b[2] or box[3] < b[1] or box[1] > b[3] for b in placed):
                placed.append(box)
                ax.annotate(text, (top["tokens_per_s"], top[latency]), fontsize=8, color="0.25",
                            textcoords="offset points", xytext=(dx * 0.72, dy * 0.72))
                break
    ax.legend()
