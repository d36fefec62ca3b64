"""Chapter 10's measurement: does speculation pay here, and does the theory say why?

One interleaved run on one device, per draft and per k:

* ``alpha``, the per-token acceptance rate (:attr:`kvlab.speculative.SpecStats.alpha`), and the tokens
  each target step yields, counted over held-out prompts (counts, not timings: no noise);
* ``V(k)``: the time of a target forward over ``k + 1`` tokens (the pending one and ``k`` drafts,
  with the rewind) over that of a one-token decode step; on a memory-bound accelerator it stays near
  1 until the step stops being memory-bound; chapter 7's floor (:func:`v_floor`) says what it should be;
* ``c``: the draft's cost per drafted token over the target's decode step;
* the speed-up: plain greedy time over speculative time, same prompts, same tokens (checked).

Beside them, the theory (Leviathan et al., 2023, with ``V(k)`` in place of their 1):

    tokens per step  E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)
    speed-up         S = E(alpha, k) / (k * c + V(k))

:func:`run` sizes everything by a time budget (``KVLAB_QUICK=1`` shrinks it) and returns plain data;
:mod:`kvlab.specreport` turns it into tables, a plot and computed sentences.
"""

from __future__ import annotations

import logging
import time

import torch

from . import loading, paths, roofline, timing
from .drafts import ModelDraft, PromptLookupDraft, SelfDraft
from .gpt2 import GPT2
from .reference import first_difference
from .speculative import SpecStats, check_same_tokenizer, greedy_reference, speculative_generate

# ---------------------------------------------------------------------------------------------------
# The theory


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one target step yields when each draft is accepted with probability ``alpha``."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, c: float, v: float) -> float:
    """Plain-greedy time over speculative time: ``E(alpha, k)`` tokens for ``k`` draft tokens at ``c``
    target steps each plus one verify pass of ``v`` target steps."""
    return expected_tokens(alpha, k) / (k * c + v)


def best_k(alpha: float, c: float, v_of_k: dict[int, float]) -> int:
    """The ``k`` the theory picks from measured ``alpha``, ``c`` and ``V(k)``."""
    return max(v_of_k, key=lambda k: predicted_speedup(alpha, k, c, v_of_k[k]))


def v_floor(model, ks, cached: int, machine: dict) -> dict[int, float]:
    """Chapter 7's floor of ``V(k)``: the floor of a forward over ``k + 1`` tokens of ONE sequence (every
    row through the LM head; the sequence's ``cached`` positions read once, each of the ``k + 1``
    queries scoring them and the new keys before it) over that of a one-token step
    (:func:`kvlab.roofline.forward_floor`)."""
    def floor(t):
        return roofline.forward_floor(model, t, t, cached, cached * t + t * (t + 1) // 2,
                                      machine["bandwidth"], machine["flops"])
    one = floor(1)
    return {k: floor(k + 1) / one for k in ks}


def v_floor_bound(model, k: int, cached: int, machine: dict) -> str:
    """What sets the floor of the ``k + 1``-token verify pass: ``"bytes"`` or ``"arithmetic"``."""
    t = k + 1
    reading = roofline.step_bytes(model, t, t, cached) / machine["bandwidth"]
    doing = roofline.step_flops(model, t, t, cached * t + t * (t + 1) // 2) / machine["flops"]
    return "arithmetic" if doing > reading else "bytes"


def draft_bytes(target, drafts: dict) -> dict[str, dict]:
    """Weight bytes a draft reads per token, as a share of the target's, and how much of that is the
    token embedding / LM head it cannot shrink without changing the vocabulary."""
    full = roofline.weight_read_bytes(target, 1)
    out = {}
    for name, d in drafts.items():
        model = getattr(d, "model", None)
        if model is None:
            out[name] = {"share": 0.0, "head_share": float("nan")}
            continue
        mine = roofline.weight_read_bytes(model, 1)
        head = model.wte.weight.numel() * model.wte.weight.element_size()
        out[name] = {"share": mine / full, "head_share": head / mine}
    return out


# ---------------------------------------------------------------------------------------------------
# The models and the prompts


def bundled_pair(device="cpu", hf=None, tok=None, target=None):
    """kvlab-tiny (the target, hand-built and transformers'), its drafts, its tokenizer. A notebook
    passes the target it already loaded (``hf``, ``tok`` and the hand-built ``target``)."""
    if hf is None or tok is None:
        hf, tok = loading.load("kvlab-tiny", device=device)
    nano_hf, nano_tok = loading.load("kvlab-nano", device=device)
    check_same_tokenizer(tok, nano_tok)
    target = target if target is not None else GPT2.from_hf(hf)
    drafts = {"prompt lookup": PromptLookupDraft(), "kvlab-nano": ModelDraft(GPT2.from_hf(nano_hf), "kvlab-nano"),
              "self-draft (1 layer)": SelfDraft(target, 1), "self-draft (2 layers)": SelfDraft(target, 2)}
    return {"target": target, "hf": hf, "hf_draft": nano_hf, "drafts": drafts, "tok": tok,
            "label": "kvlab-tiny verified, drafts: prompt lookup, kvlab-nano, its own first layers"}


def hub_pair(device="cpu"):
    """distilgpt2 drafting for gpt2-medium, the papers' kind of pair; a sentence saying why not, offline."""
    try:
        hf, tok = loading.load("gpt2-medium", device=device)
        small, small_tok = loading.load("distilgpt2", device=device)
    except loading.ModelNotAvailable as err:
        return f"the Hub pair (distilgpt2 drafting for gpt2-medium) could not be loaded: {err}"
    check_same_tokenizer(tok, small_tok)
    target = GPT2.from_hf(hf)
    drafts = {"prompt lookup": PromptLookupDraft(), "distilgpt2": ModelDraft(GPT2.from_hf(small), "distilgpt2"),
              "self-draft (6 layers)": SelfDraft(target, 6)}
    return {"target": target, "hf": hf, "hf_draft": small, "drafts": drafts, "tok": tok,
            "label": "gpt2-medium verified, drafts: prompt lookup, distilgpt2, its own first 6 layers"}


def heldout_prompts(tok, n: int, length: int) -> list[torch.Tensor]:
    """``n`` prompts of ``length`` tokens from kvlab-tiny's held-out chapters (text no model trained on),
    evenly spaced through it."""
    # the whole text at once, longer than any model's context: verbose=False, no "indexing errors" warning
    # (it is cut into prompts of ``length`` tokens below)
    ids = tok((paths.TINY_DIR / "heldout.txt").read_text(), return_tensors="pt", verbose=False).input_ids[0]
    step = (len(ids) - length) // max(n, 1)
    return [ids[i * step:i * step + length][None] for i in range(n)]


# ---------------------------------------------------------------------------------------------------
# Counting and timing


def acceptance(target, drafts: dict, prompts, ks, new_tokens: int, budget: timing.Budget | None = None) -> dict:
    """``{(draft, k): {alpha, tokens_per_step, same}}`` over the prompts (pooled counts: ``steps``,
    drafts ``tried`` (judged) and ``accepted``, ``empty`` steps that drafted nothing); ``same`` is
    whether every run gave plain greedy's tokens, and ``first_diff`` where one did not. One prompt at
    a time, every (draft, k) on it: a ``budget`` (:class:`kvlab.timing.Budget`, over the prompts'
    numbers, from 1) may stop before the last prompts; ``budget.done`` numbers the prompts counted."""
    counts = {(name, k): ([], [], []) for name in drafts for k in ks}      # drafted, accepted, diffs
    numbers = range(1, len(prompts) + 1)
    for i in (numbers if budget is None else budget.points(numbers, size=lambda _: 1.0)):
        ref = greedy_reference(target, prompts[i - 1], new_tokens)
        for (name, k), (drafted, accepted, diffs) in counts.items():
            out, st = speculative_generate(target, prompts[i - 1], new_tokens, drafts[name], k)
            drafted += st.drafted
            accepted += st.accepted
            diffs.append(first_difference(out, ref))
    rows = {}
    for key, (drafted, accepted, diffs) in counts.items():
        st = SpecStats(drafted, accepted)
        rows[key] = {"alpha": st.alpha, "tokens_per_step": st.tokens_per_step, "steps": st.steps,
                     "accepted": sum(accepted), "tried": st.tried, "empty": sum(d == 0 for d in drafted),
                     "same": all(d is None for d in diffs), "first_diff": diffs}
    return rows


def cost_fns(target, drafts: dict, ks, cached: int) -> dict:
    """The functions whose times give ``V(k)`` and ``c``: one target decode step, a target forward of
    ``k + 1`` tokens, one drafted token of each draft (at ``cached`` positions; each call rewinds)."""
    dev = target.wte.weight.device
    ids = torch.randint(1, target.config.vocab_size, (1, cached + max(ks) + 1), generator=torch.Generator().manual_seed(0)).to(dev)
    cache = target.new_cache(1, cached + max(ks) + 1)
    target(ids[:, :cached], cache)
    fns = {"target step": verify_fn(target, cache, ids[:, cached:cached + 1], cached)}   # = verify 0
    for k in ks:
        fns[f"verify {k}"] = verify_fn(target, cache, ids[:, cached:cached + k + 1], cached)
    tokens = ids[0, :cached + 1].tolist()
    for name, d in drafts.items():
        fns[f"draft {name}"] = draft_token_fn(d, tokens, cache)
    hidden = torch.randn(1, max(ks) + 1, target.config.n_embd, device=dev, dtype=target.wte.weight.dtype)
    for rows in (1, max(ks) + 1):      # the LM head alone: the same bytes for any number of rows
        fns[f"head {rows}"] = (lambda x: lambda: x @ target.wte.weight.T)(hidden[:, :rows])
    return fns


def verify_fn(model, cache, x, length):
    """A verify pass: ``k + 1`` tokens through the model, every row's logits, then the rewind."""
    def step():
        with torch.no_grad():
            out = model(x, cache).argmax(-1)
            cache.rewind(length)
            return out
    return step


def draft_token_fn(draft, tokens, target_cache, k: int = 4):
    """One call drafts ``k`` tokens from the same state (then rewinds): its time / ``k`` is per token."""
    draft.start(tokens[:-1], len(tokens) + k + 1, target_cache)

    def step():
        with torch.no_grad():
            out = draft.propose(tokens, k)
            draft.accept(tokens)
            return out
    step.per_call = k
    return step


def costs(target, drafts, ks, cached: int, budget_s: float) -> dict:
    """``{"V": {k: V(k)}, "c": {draft: c}, "step_s": seconds, "timings": ...}``, all from one interleaved
    run whose repeats fill ``budget_s`` (these calls take milliseconds: many repeats are cheap)."""
    fns = cost_fns(target, drafts, ks, cached)
    start = time.perf_counter()
    for fn in fns.values():        # one round, untimed: the warm-up, and the size of a round
        fn()
    round_s = time.perf_counter() - start
    t = timing.compare(fns, warmup=1, repeats=_repeats(round_s * 1.5, budget_s, 5, 41), progress=False)
    step = t["target step"].median
    c = {n: t[f"draft {n}"].median / fns[f"draft {n}"].per_call / step for n in drafts}
    return {"V": {k: t[f"verify {k}"].median / step for k in ks}, "c": c, "step_s": step, "timings": t}


def end_to_end(target, drafts: dict, plan, prompts, new_tokens: int, repeats: int,
               budget: timing.Budget | None = None) -> dict:
    """Plain greedy and each ``(draft, k)`` of ``plan`` over every prompt, interleaved, up to
    ``repeats`` rounds (fewer once ``budget`` is spent); the same tokens first (a run that differs is
    not timed: it raises)."""
    refs = [greedy_reference(target, p, new_tokens) for p in prompts]     # also plain greedy's warm-up
    fns = {"plain greedy": lambda: [greedy_reference(target, p, new_tokens) for p in prompts]}
    for name, k in plan:
        fn = (lambda d, k: lambda: [speculative_generate(target, p, new_tokens, d, k)[0] for p in prompts])(
            drafts[name], k)
        at = [first_difference(o, r) for o, r in zip(fn(), refs)]
        if any(a is not None for a in at):
            raise RuntimeError(f"{name} at k={k} differs from plain greedy (first differences {at}): not timing it")
        fns[(name, k)] = fn
    return timing.compare(fns, warmup=0, repeats=repeats, progress=False, budget=budget)   # each ran once above: warm


def hf_comparison(hf, hf_draft, prompt, new_tokens: int, k: int, repeats: int,
                  budget: timing.Budget | None = None) -> dict:
    """transformers' own: ``generate`` plain, with ``assistant_model`` (k drafted tokens, constant
    schedule) and with ``prompt_lookup_num_tokens=k``; same tokens checked, timed interleaved (up to
    ``repeats`` rounds, fewer once ``budget`` is spent)."""
    hf_draft.generation_config.num_assistant_tokens = k
    hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
    common = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=0, eos_token_id=None)
    fns = {"transformers greedy": lambda: hf.generate(prompt, **common),
           "transformers assistant_model": lambda: hf.generate(prompt, assistant_model=hf_draft, **common),
           "transformers prompt lookup": lambda: hf.generate(prompt, prompt_lookup_num_tokens=k, **common)}
    # transformers' assisted generation calls the draft's generate with a generation_config AND arguments
    # of its own, and warns about it (generation/utils.py, "Passing `generation_config` together with
    # ..."): its internals, not this call's; that one logger is quiet while these run
    log = logging.getLogger("transformers.generation.utils")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with torch.no_grad():
            outs = {n: f() for n, f in fns.items()}
        same = {n: torch.equal(o, outs["transformers greedy"]) for n, o in outs.items()}
        timings = timing.compare(fns, warmup=0, repeats=repeats, progress=False, budget=budget)
    finally:
        log.setLevel(level)
    return {"same": same, "timings": timings}


# ---------------------------------------------------------------------------------------------------
# The whole run, sized by a budget


def plan_sizes(budget_s: float | None = None) -> dict:
    """Sizes for the run: the full book's, or ``KVLAB_QUICK``'s."""
    return timing.pick(
        {"budget_s": budget_s or 45, "ks": [1, 2, 3, 4, 6], "prompts": 4, "prompt_len": 48, "new": 48},
        {"budget_s": budget_s or 30, "ks": [1, 3], "prompts": 2, "prompt_len": 32, "new": 24})


#: each stage's share of :func:`run`'s time budget (the component costs take at most a sixth, fewer
#: repeats being enough for calls of milliseconds). The end-to-end rounds are the costly stage (every
#: planned (draft, k) over every counted prompt, three times), so they get half; a cut stage says so in
#: the run's ``"cuts"``, which the chapter prints.
SHARES = {"counts": 0.3, "e2e": 0.5, "hf": 0.05}


def _repeats(fn_seconds: float, budget_s: float, lo: int = 3, hi: int = 9) -> int:
    return int(min(hi, max(lo, budget_s // max(fn_seconds, 1e-6))))


@torch.no_grad()
def run(pair: dict, budget_s: float | None = None, machine: dict | None = None, progress=None) -> dict:
    """Everything chapter 10 shows for one target and its drafts, sized to ``budget_s`` seconds, shared
    out as time budgets (:class:`kvlab.timing.Budget`): the counts stop adding prompts, the timings
    stop adding rounds when theirs is spent (the first prompt and two rounds always run); ``"cuts"``
    says what each left out. ``machine``: ``kvlab.probes.machine()`` (for the floor of ``V(k)``);
    ``progress``: a callable told each stage's name."""
    sizes, note = plan_sizes(budget_s), progress or (lambda s: None)
    target, drafts, ks, total = pair["target"], pair["drafts"], sizes["ks"], sizes["budget_s"]
    prompts = heldout_prompts(pair["tok"], sizes["prompts"], sizes["prompt_len"])
    budgets = {"counts": timing.Budget(SHARES["counts"] * total, "the acceptance counts' prompts (numbered from 1)", keep=1),
               "e2e": timing.Budget(SHARES["e2e"] * total, "the end-to-end timing's rounds", keep=2),
               "hf": timing.Budget(SHARES["hf"] * total, "transformers' comparison's rounds", keep=2)}
    note(f"acceptance (counts over up to {len(prompts)} prompts)")
    acc = acceptance(target, drafts, prompts, ks, sizes["new"], budget=budgets["counts"])
    prompts = [prompts[i - 1] for i in budgets["counts"].done]   # the end-to-end timing uses the same ones
    sizes = dict(sizes, prompts=len(prompts))
    note("component costs: V(k), c")
    cached = sizes["prompt_len"] + sizes["new"] // 2
    cost = costs(target, drafts, ks, cached, total / 6)
    alpha = {n: pooled_alpha(acc, n, ks) for n in drafts}
    picks = {n: best_k(alpha[n], cost["c"][n], cost["V"]) for n in drafts}
    plan = [(n, k) for n in drafts for k in sorted({picks[n]} | timing.pick({1, max(ks)}, set()))]
    note("end to end, interleaved")
    e2e = end_to_end(target, drafts, plan, prompts, sizes["new"], 3, budget=budgets["e2e"])
    note("transformers' own")
    k_hf = picks.get("kvlab-nano", picks.get("distilgpt2", 3))
    hf = hf_comparison(pair["hf"], pair["hf_draft"], prompts[0], timing.pick(32, 12), k_hf, 3, budget=budgets["hf"])
    floor = v_floor(target, ks, cached, machine) if machine else None
    return {"sizes": sizes, "acceptance": acc, "costs": cost, "alpha": alpha, "picks": picks, "plan": plan,
            "e2e": e2e, "hf": hf, "k_hf": k_hf, "v_floor": floor, "cached": cached, "bytes": draft_bytes(target, drafts),
            "device": target.wte.weight.device, "label": pair["label"], "target": target,
            "cuts": [b.note for b in budgets.values() if b.note]}


def pooled_alpha(acc: dict, name: str, ks) -> float:
    """One alpha per draft, pooled over every k: drafts accepted over drafts tried (they estimate one number)."""
    tried = sum(acc[name, k]["tried"] for k in ks)
    return sum(acc[name, k]["accepted"] for k in ks) / tried if tried else float("nan")


# ---------------------------------------------------------------------------------------------------
# The chapter's checks: same tokens everywhere, the sampling rule's distribution


def equality_rows(pair: dict, prompts, new_tokens: int, ks=(1, 4), budget: timing.Budget | None = None) -> list[dict]:
    """Every draft on every cache kind it can rewind, at each k: the same tokens as plain greedy? One
    prompt at a time; a ``budget`` may stop before the last prompts (its note numbers them from 1)."""
    from .paged_cache import PagedCache
    from .speculative import HFCache
    from .static import StaticKVCache

    target, hf, out = pair["target"], pair["hf"], []
    cfg = target.config
    numbers = range(1, len(prompts) + 1)
    for i in (numbers if budget is None else budget.points(numbers, size=lambda _: 1.0)):
        p = prompts[i - 1]
        ref = greedy_reference(target, p, new_tokens)
        n = p.shape[1] + new_tokens
        sizes = (cfg.n_layer, 1, cfg.n_head, cfg.head_dim, n)
        runs = {"preallocated": lambda: (target, None), "static": lambda: (target, StaticKVCache(*sizes)),
                "paged (block 4)": lambda: (target, PagedCache(*sizes, block_size=4)),
                "transformers DynamicCache": lambda: (hf, HFCache(hf.config))}
        for name, draft in pair["drafts"].items():
            for cache_name, make in runs.items():
                model, cache = make()
                same = all(torch.equal(speculative_generate(model, p, new_tokens, draft, k, cache=cache)[0], ref)
                           for k in ks)
                out.append({"prompt": i, "draft": name, "cache": cache_name, "k": ", ".join(map(str, ks)),
                            "same tokens": same})
    return out


#: chi-square critical value at p = 0.001 for 5 degrees of freedom (6 bins)
CHI2_5DF_P001 = 20.515


def sampling_check(p: torch.Tensor, q: torch.Tensor, trials: int, seed: int = 0,
                   budget: timing.Budget | None = None) -> dict:
    """Speculative sampling's first emitted token against the target's distribution ``p``: draft one
    token from ``q``, apply :func:`kvlab.speculative.accept_or_resample`, ``trials`` times (seeded).
    Bins: the 5 likeliest tokens of ``p`` and the rest; chi-square against ``trials x p``. The trials
    run in rounds of 1,000; a ``budget`` may stop after fewer rounds (``"trials"`` says how many ran:
    the same first trials as an uncut run, since one seeded generator draws them in order)."""
    from .speculative import accept_or_resample

    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1], dtype=torch.float64)
    accepted, done, per_round = 0, 0, 1000
    rounds = -(-trials // per_round)
    for r in (range(rounds) if budget is None else budget.rounds(rounds)):
        for _ in range(min(per_round, trials - r * per_round)):
            d = int(torch.multinomial(q, 1, generator=g))
            out = accept_or_resample(torch.stack([p, p]), q[None], [d], g)
            counts[out[0]] += 1
            accepted += len(out) == 2
            done += 1
    trials = done
    top = p.argsort(descending=True)[:5]
    observed = torch.cat([counts[top], (trials - counts[top].sum())[None]])
    expected = trials * torch.cat([p[top], (1 - p[top].sum())[None]])
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    return {"chi2": chi2, "critical": CHI2_5DF_P001, "passed": chi2 < CHI2_5DF_P001, "trials": trials,
            "accept_rate": accepted / trials, "expected_accept": float(torch.minimum(p, q).sum()),
            "observed": observed, "expected": expected}
