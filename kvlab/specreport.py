"""Chapter 10's tables, figure and computed sentences, from one :func:`kvlab.specbench.run` result.

Nothing here is typed in advance: whether speculation pays, which draft and which k do best, why
``V(k)`` is what it is, all come from the run's numbers and name the device they were measured on.
"""

from __future__ import annotations

from . import plots, verdicts
from .specbench import expected_tokens, predicted_speedup, v_floor_bound
from .tables import show


def rows(r: dict) -> list[dict]:
    """One row per (draft, k): the counts, the component costs, the theory's and the clock's speed-ups."""
    base, out = r["e2e"]["plain greedy"].median, []
    for (name, k), a in r["acceptance"].items():
        alpha, c, v = r["alpha"][name], r["costs"]["c"][name], r["costs"]["V"][k]
        timed = r["e2e"].get((name, k))
        out.append({"draft": name, "k": k, "alpha": a["alpha"], "judged/step": a["tried"] / a["steps"],
                    "no draft": a["empty"] / a["steps"], "tokens/step": a["tokens_per_step"],
                    "E(alpha,k)": expected_tokens(alpha, k), "c": c, "V(k)": v,
                    "V floor": r["v_floor"][k] if r["v_floor"] else None,        # None: a blank cell
                    "k*c+V(k)": k * c + v, "predicted": predicted_speedup(alpha, k, c, v),
                    "measured": base / timed.median if timed else None,
                    "step cost (clock)": a["tokens_per_step"] * timed.median / base if timed else None,
                    "same tokens": a["same"]})
    return out


def table(r: dict) -> None:
    formats = {"alpha": ".2f", "judged/step": ".2f", "no draft": ".0%", "tokens/step": ".2f", "E(alpha,k)": ".2f",
               "c": ".3f", "V(k)": ".2f", "V floor": ".2f", "k*c+V(k)": ".2f", "predicted": ".2f", "measured": ".2f",
               "step cost (clock)": ".2f"}
    rs = rows(r)
    accept = ["draft", "k", "alpha", "judged/step", "no draft", "tokens/step", "E(alpha,k)", "same tokens"]
    cost = ["draft", "k", "c", "V(k)", "V floor", "k*c+V(k)", "predicted", "measured", "step cost (clock)"]
    show(rs, columns={c: c for c in accept}, formats=formats, caption=(
        f"Acceptance. {r['label']}; {verdicts.on(r['device'])}; counts over {prompts_x_new(r)}. alpha: drafts accepted / drafts the target judged (a step "
        "stops judging at its first rejection); judged/step: drafts judged per target step; no draft: the share "
        "of steps that drafted nothing; tokens/step: tokens emitted per target step, the bonus plus the accepted "
        "drafts, so tokens/step = 1 + alpha x judged/step; E(alpha,k): the theory's tokens per step, from the "
        "draft's alpha pooled over every k, for steps that all draft k tokens."))
    show(rs, columns={c: c for c in cost}, formats=formats, caption=(
        "Cost and speed-up, same run. 'predicted' uses the pooled alpha with the measured c and V(k); "
        "'measured': plain greedy time / speculative time, medians over the rounds of one interleaved run (blank: not "
        "timed); 'step cost (clock)': what a target step really cost in decode steps (tokens/step x "
        "measured time ratio; prefill and the loop's own bookkeeping included), beside k*c + V(k)."))


def prompts_x_new(r: dict) -> str:
    """``"2 held-out prompts x 24 new tokens"``, singular where one prompt was counted."""
    n = r["sizes"]["prompts"]
    return f"{n} held-out prompt{'' if n == 1 else 's'} x {r['sizes']['new']} new tokens"


def relation_sentences(r: dict) -> list[str]:
    """Per draft, from the counts: alpha and tokens/step, and why tokens/step is 1 + alpha x judged/step
    (not 1 + alpha at k=1) when some steps drafted nothing."""
    out, per_run = [], r["sizes"]["prompts"]
    for name in r["alpha"]:
        parts = []
        for (n, k), a in r["acceptance"].items():
            if n != name:
                continue
            s, t, acc, e = a["steps"], a["tried"], a["accepted"], a["empty"]
            part = (f"k={k}: {acc} of {t} judged drafts accepted, alpha = {acc}/{t} = {a['alpha']:.2f}; "
                    f"{s} steps, tokens/step = ({s} + {acc})/{s} = {a['tokens_per_step']:.2f} = 1 + alpha x {t}/{s}")
            if e:
                why = "no earlier match to copy, or " if name.startswith("prompt lookup") else ""
                part += (f"; {e} step{'' if e == 1 else 's'} ({e / s:.0%}) drafted nothing ({why}a run's last step, "
                         f"with no room left to draft: at most {per_run}, one a run)")
            parts.append(part)
        out.append(f"{name}: " + "; ".join(parts))
    return out


def plot(r: dict, model) -> None:
    """Predicted speed-up against k for each draft (lines), the measured ones as points."""
    fig, ax = plots.figure(size=(7, 4))
    ks = r["sizes"]["ks"]
    base = r["e2e"]["plain greedy"].median
    for i, name in enumerate(r["alpha"]):
        pred = [predicted_speedup(r["alpha"][name], k, r["costs"]["c"][name], r["costs"]["V"][k]) for k in ks]
        ax.plot(ks, pred, "-", color=f"C{i}", label=f"{name}: theory")
        timed = [(k, base / r["e2e"][name, k].median) for k in ks if (name, k) in r["e2e"]]
        ax.plot([k for k, _ in timed], [s for _, s in timed], "o", color=f"C{i}", ms=7)
    ax.axhline(1.0, color="0.4", lw=1, ls="--")
    ax.set(xlabel="k (tokens drafted per target step)", ylabel="speed-up over plain greedy",
           title="Speculative decoding: theory (lines) and clock (points)")
    # beside the axes: inside, "best" still covered a theory line where the drafts' lines spread out
    ax.legend(fontsize=plots.MIN_FONT, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    plots.finish(fig, model, r["device"])


def pays_sentences(r: dict) -> list[str]:
    """Per draft, at the k the theory picked: faster or slower than plain greedy, or no difference measured."""
    out = []
    for name, k in r["picks"].items():
        if (name, k) in r["e2e"]:
            out.append(verdicts.faster(r["e2e"][name, k], r["e2e"]["plain greedy"], r["device"],
                                       f"speculation with {name} (k={k})", "plain greedy decoding"))
    return out


def why_sentences(r: dict) -> list[str]:
    """The theory's account of each draft at its best k: what a step costs against what it yields."""
    out = []
    for name, k in r["picks"].items():
        a, c, v = r["alpha"][name], r["costs"]["c"][name], r["costs"]["V"][k]
        e, cost = expected_tokens(a, k), k * c + v
        verdict = "pays" if e > cost * (1 + verdicts.NOISE) else ("does not pay" if e * (1 + verdicts.NOISE) < cost
                                                                   else "is about even")
        got = r["acceptance"][name, k]["tokens_per_step"]
        out.append(f"{name}, k={k}: in theory a step yields E = {e:.2f} tokens (pooled alpha {a:.2f}; counted: "
                   f"{got:.2f}) and costs k*c + V(k) = {k} x {c:.3f} + {v:.2f} = {cost:.2f} decode steps, so in "
                   f"theory it {verdict} (predicted speed-up {e / cost:.2f}x), {verdicts.on(r['device'])}")
    return out


def best_k_sentences(r: dict) -> list[str]:
    """The theory's best k beside the clock's best among the k that were timed."""
    out, base = [], r["e2e"]["plain greedy"].median
    for name, k in r["picks"].items():
        timed = {key[1]: base / t.median for key, t in r["e2e"].items() if key[0] == name}
        clock = max(timed, key=timed.get)
        agree = "the same k" if clock == k else f"k={clock} ({timed[clock]:.2f}x)"
        ks = ", ".join(str(x) for x in sorted(timed))
        clock_words = (f"only k={clock} was timed, so the clock picks nothing" if len(timed) == 1 else
                       f"of the k timed ({ks}), the clock's best is {agree}")
        out.append(f"{name}: the theory picks k={k} (predicted {predicted_speedup(r['alpha'][name], k, r['costs']['c'][name], r['costs']['V'][k]):.2f}x); "
                   f"{clock_words} {verdicts.on(r['device'])}")
    return out


def floor_sentences(r: dict, machine: dict) -> list[str]:
    """Why V(k) is what it is: chapter 7's floor of the verify pass against the clock, and the LM head
    alone at 1 and k+1 rows (the same bytes, so the floor is the same) to show where the time goes."""
    if not r["v_floor"]:
        return []
    k, t, dev = max(r["sizes"]["ks"]), r["costs"]["timings"], r["device"]
    v, vf = r["costs"]["V"][k], r["v_floor"][k]
    head = r["target"].wte.weight
    h1, hk = t["head 1"].median, t[f"head {k + 1}"].median
    floor = head.numel() * head.element_size() / machine["bandwidth"]
    rate = 2 * (k + 1) * head.numel() / hk
    bound = v_floor_bound(r["target"], k, r["cached"], machine)
    why = (f"the weights are read once for all {k + 1} rows, and the bytes set the floor" if bound == "bytes" else
           f"at {k + 1} rows the FLOPs, at the probe's {machine['flops'] / 1e9:.0f} GFLOP/s, take longer than the bytes")
    if v <= 1 + verdicts.NOISE:
        clock = "extra rows ride along almost free"
    elif v < vf / (1 + verdicts.NOISE):
        clock = ("below the floor's ratio: the one-row step runs far above its own floor (fixed costs that all "
                 f"{k + 1} rows share), so extra rows cost less than the floor predicts, but not nothing")
    elif v <= vf * (1 + verdicts.NOISE):
        clock = "about what the floor predicts"
    else:
        clock = "more than the floor predicts: extra rows cost time of their own"
    return [f"chapter 7's floor puts V({k}) at {vf:.2f} ({why}; bandwidth {machine['bandwidth'] / 1e9:.1f} GB/s "
            f"measured); the clock says {v:.2f}, {clock}, {verdicts.on(dev)}",
            f"the LM head alone ({head.numel() * head.element_size() / 1e6:.1f} MB of weights, memory floor "
            f"{floor * 1e3:.2f} ms for any number of rows): {h1 * 1e3:.2f} ms for 1 row, {hk * 1e3:.2f} ms for "
            f"{k + 1} rows ({hk / h1:.2f}x), the {k + 1}-row product at {rate / 1e9:.1f} GFLOP/s (the probe: "
            f"{machine['flops'] / 1e9:.0f} GFLOP/s on large matrices) {verdicts.on(dev)}" + head_reason(h1, hk, floor, dev)]


def head_reason(h1: float, hk: float, floor: float, device="cpu") -> str:
    """What the LM head's timings say about the floor: weights served from the CPU's cache (faster
    than the memory floor), rows that cost time of their own, or rows that ride along."""
    from .probes import cpu_cache_bytes

    cpu = str(device).startswith("cpu")
    cache = f"the CPU's own cache ({cpu_cache_bytes() / 2**20:.0f} MiB here)" if cpu and cpu_cache_bytes() else "on-chip cache"
    where = (f"; one row ran {floor / h1:.1f}x faster than reading the head from memory allows: these weights "
             f"are served from {cache}, so the memory floor does not bind and the step's arithmetic and "
             "overheads do" if h1 < floor / (1 + verdicts.NOISE) else "")
    rows = ("; each extra row adds time of its own" if hk > h1 * (1 + verdicts.NOISE)
            else "; extra rows ride along at no measurable cost")
    return where + rows


def bytes_sentences(r: dict) -> list[str]:
    """What each model draft reads per token, against the target, and how much of it is the head."""
    out = []
    for name, b in r["bytes"].items():
        if b["share"]:
            out.append(f"{name} reads {b['share']:.0%} of the target's weight bytes per token; "
                       f"{b['head_share']:.0%} of its own is the token embedding / LM head it shares the "
                       "vocabulary through")
    return out


def hf_sentences(r: dict) -> list[str]:
    h, k = r["hf"], r["k_hf"]
    t = h["timings"]
    same = "the same tokens" if all(h["same"].values()) else f"NOT the same tokens: {h['same']}"
    return [f"transformers' own generate gives {same} with assistant_model and with prompt lookup (k={k})",
            verdicts.faster(t["transformers assistant_model"], t["transformers greedy"], r["device"],
                            "transformers with assistant_model", "its plain greedy generate"),
            verdicts.faster(t["transformers prompt lookup"], t["transformers greedy"], r["device"],
                            "transformers with prompt_lookup_num_tokens", "its plain greedy generate")]


def closing_rows(r: dict) -> list[dict]:
    """Per draft, at its picked k: the closing note's numbers."""
    base, out = r["e2e"]["plain greedy"].median, []
    for name, k in r["picks"].items():
        a, c, v = r["alpha"][name], r["costs"]["c"][name], r["costs"]["V"][k]
        n = r["acceptance"][name, k]
        out.append({"draft": name, "k": k, "alpha": n["alpha"], "judged/step": n["tried"] / n["steps"],
                    "tokens/step": n["tokens_per_step"], "pooled alpha": a, "c": c, "V(k)": v,
                    "predicted": predicted_speedup(a, k, c, v), "measured": base / r["e2e"][name, k].median})
    return out


def step_trace(model, ids, new_tokens: int, draft, k: int, tok) -> list[dict]:
    """Each target step of one run: what was drafted, what the target chose, what was kept."""
    from .speculative import speculative_generate, verify

    trace = []

    def watched(m, cache, tokens, drafted):
        before = cache.seq_len
        new = verify(m, cache, tokens, drafted)
        trace.append({"cache before": before, "drafted": tok.decode(drafted) if drafted else "",
                      "accepted": len(new) - 1, "bonus": tok.decode(new[-1:]), "cache after": cache.seq_len})
        return new
    speculative_generate(model, ids, new_tokens, draft, k, step=watched)
    return trace


def summary_sentence(r: dict) -> str:
    """Where speculation paid, where it did not, and where no difference was measured, at each draft's
    picked k (worded by the verdict of :func:`kvlab.verdicts.compare_timings`: in every round, or in the
    median with overlapping runs), with the part of the step that costs most when it did not pay."""
    won, lost, even = [], [], []
    for name, k in r["picks"].items():
        c = verdicts.compare_timings(r["e2e"][name, k], r["e2e"]["plain greedy"])
        how = ("in every round" if c.verdict == "every round" else
               f"in the median; runs overlap, {c.wins} of {c.rounds} rounds")
        if c.verdict == "none":
            even.append(f"{name} (k={k}, {1 / c.ratio:.2f}x)")
        elif c.ratio < 1:
            won.append(f"{name} (k={k}, {1 / c.ratio:.2f}x, {how})")
        else:
            draft, verify = k * r["costs"]["c"][name], r["costs"]["V"][k]
            got = r["acceptance"][name, k]["tokens_per_step"]
            what = (f"a step's drafting ({draft:.2f} decode steps) and verifying ({verify:.2f}) cost more than the "
                    f"{got:.2f} tokens a step yielded" if draft + verify > got else
                    f"a step's drafting ({draft:.2f} decode steps) and verifying ({verify:.2f}) cost less than the "
                    f"{got:.2f} tokens a step yielded: the rest of the step (the loop, the rewinds) made the difference")
            lost.append(f"{name} (k={k}, {1 / c.ratio:.2f}x, {how}): {what}")
    parts = [f"paid: {', '.join(won) or 'none'}", f"did not pay: {'; '.join(lost) or 'none'}",
             f"no difference measured (medians within {verdicts.NOISE:.0%}): {', '.join(even) or 'none'}"]
    return f"{verdicts.on(r['device'])}, against plain greedy decoding, speculation " + "; ".join(parts)
