"""Graders for lab 7: the bytes of a decode step, the floor they set, and predictions from them.

* ``decode_step_bytes(model, batch_size, seq_len) -> int`` against exact counts in chapter 7's
  convention (every tensor once; of a look-up table, the input embedding or a position table, the
  ``batch_size`` rows a step reads; the LM head whole; a tied head is the token table, read whole
  once; plus the cache of every row): GPT-2 and grouped-query Llama models, tied and untied heads, an
  explicit ``head_dim`` that is not ``hidden_size / num_attention_heads``, real and ``meta``-device
  models, fp32 / fp16 / bf16;
* ``step_time_floor(model, batch_size, seq_len, bandwidth, flops) -> float`` seconds, on machines
  chosen so that some cases are bound by memory and others by compute;
* ``bound_and_critical(model, batch_size, seq_len, bandwidth, flops) -> (bound, critical)``: which
  term bounds the step (``"weights"``, ``"cache"`` or ``"compute"``) and the smallest batch whose
  step is bound by compute at that context (``None`` if no batch is);
* ``check_sweep_plan`` (a sweep that reaches past the predicted critical batch) and
  ``overhead_fit(floors, measured) -> (overhead_s, k)`` (the measurement set against the prediction).

Every grader calls the learner's function on each case, then on all of them again in another order
(a memoised or stale answer is named), refuses the library's own functions (:mod:`kvlab.roofline`),
and names a mistake only when its formula explains every case AND differs from the right answer on
at least two of them; otherwise it says what differs, and where.
"""

from __future__ import annotations

import functools
import math
import numbers
from contextlib import contextmanager

import torch

from kvlab import roofline
from ._common import GraderFailure, fail, grading_model, passed, place

NAME_BYTES = "check_decode_step_bytes"
NAME_FLOOR = "check_step_time_floor"
NAME_CRIT = "check_bound_and_critical"
NAME_SWEEP = "check_sweep_plan"
NAME_FIT = "check_overhead_fit"

# ---------------------------------------------------------------------------------------------------
# Guards shared by the graders

class _TooSlow(Exception):
    pass


@contextmanager
def _deadline(seconds: float):
    """Stop a call that runs longer than ``seconds`` (a loop that never ends), where signals allow."""
    import signal
    import threading

    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise _TooSlow()
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


TIME_LIMIT_S = 20.0      # per call: generous for any direct computation, a stop for an endless loop


_ENDLESS = ("A loop over batch sizes never ends when no batch is compute-bound: decide that first, from what one "
            "more row adds to the bytes and to the FLOPs")


def _guarded(check, thunk, where: str, too_slow: str = "", hint: str = ""):
    """Run one of the learner's calls (``thunk()``); their exceptions, library calls and endless loops
    become failures that name the call (``where``), what a call past the time limit most likely did
    (``too_slow``) and, for an exception, what to handle (``hint``)."""
    try:
        with _deadline(TIME_LIMIT_S):
            return thunk()
    except _TooSlow:
        raise fail(check, f"{where} did not return within {TIME_LIMIT_S:.0f} s" + (f". {too_slow}" if too_slow else "")) from None
    except (GraderFailure, NotImplementedError):
        raise
    except Exception as e:  # noqa: BLE001 - the learner's exception becomes a pointed message
        raise fail(check, f"{where} raised {type(e).__name__}: {e}{hint}") from None


def _call(check, fn, label, args, too_slow: str = _ENDLESS):
    """The learner's function on one case (``args``: the model, then the numbers), through :func:`_guarded`."""
    names = ("batch_size", "seq_len", "bandwidth", "flops")
    shown = ", ".join(f"{k}={a!r}" for k, a in zip(names, args[1:]))
    return _guarded(check, lambda: fn(*args), f"your function called with (<{label}>, {shown})", too_slow)


def _reference_bytes(model, batch_size, seq_len):
    """Exercise 1's answer, put in place of the learner's while exercises 2 and 3 are graded. At batch 0
    (outside exercise 1's contract, but what "bytes = shared + batch x row" invites calling) it is the
    line through batches 1 and 2, the weights read once, LM head included, so a learner who reads the
    shared part off batch 0 gets the same answer as one who reads it off batches 1 and 2."""
    if batch_size == 0:
        one, two = (roofline.decode_step_bytes(model, b, seq_len) for b in (1, 2))
        return 2 * one - two
    return roofline.decode_step_bytes(model, batch_size, seq_len)


def _reference_floor(model, batch_size, seq_len, bandwidth, flops):
    """Exercise 2's answer, put in place of the learner's while exercise 3 is graded."""
    return roofline.step_time_floor(model, batch_size, seq_len, bandwidth, flops)


def _fast_references():
    """The references above, as fast as arithmetic: bytes and FLOPs are exactly linear in the batch
    (integers), so each (model, seq_len) is read off the model once and every later call is a
    multiply-add giving the very same numbers. A search that walks batch by batch into the thousands
    (correct, if slow) then runs in the grader as fast as in the notebook. Anything outside the plain
    contract (batch 0, a bool, a float) goes to the reference itself, errors included. The memo keeps
    each model alive, so an id cannot be reused while it lives (one grading run)."""
    memo = {}

    def plain(B, S):
        return all(type(x) is int for x in (B, S)) and B >= 1 and S >= 0

    def lines(model, S):
        key = (id(model), S)
        if key not in memo:
            b1, f1 = roofline.decode_step_bytes(model, 1, S), roofline.decode_step_flops(model, 1, S)
            memo[key] = (model, b1, roofline.decode_step_bytes(model, 2, S) - b1,
                         f1, roofline.decode_step_flops(model, 2, S) - f1)
        return memo[key][1:]

    def step_bytes(model, batch_size, seq_len):
        if not plain(batch_size, seq_len):
            return _reference_bytes(model, batch_size, seq_len)
        b1, db, _, _ = lines(model, seq_len)
        return b1 + (batch_size - 1) * db

    def step_flops(model, batch_size, seq_len):
        if not plain(batch_size, seq_len):
            return roofline.decode_step_flops(model, batch_size, seq_len)
        _, _, f1, df = lines(model, seq_len)
        return f1 + (batch_size - 1) * df

    def floor(model, batch_size, seq_len, bandwidth, flops):
        rates = all(type(r) in (int, float) and 0 < r < math.inf for r in (bandwidth, flops))
        if not (rates and plain(batch_size, seq_len)):
            return _reference_floor(model, batch_size, seq_len, bandwidth, flops)
        b1, db, f1, df = lines(model, seq_len)
        return max((b1 + (batch_size - 1) * db) / float(bandwidth), (f1 + (batch_size - 1) * df) / float(flops))

    return {"decode_step_bytes": step_bytes, "step_time_floor": floor, "decode_step_flops": step_flops}


@contextmanager
def _on_references(fn, names):
    """Grade one exercise on its own: while it runs, the learner's answers to the earlier ones that
    ``fn`` calls by name (``decode_step_bytes``, ``step_time_floor`` in the notebook) are replaced by
    the right ones, so a mistake there is not reported here. Yields the names replaced."""
    import inspect

    g = getattr(inspect.unwrap(fn), "__globals__", {})
    saved = {n: g[n] for n in names if callable(g.get(n)) and hasattr(g[n], "__code__")
             and place(g[n].__code__.co_filename) == "learner"}
    fast = _fast_references()
    # the FLOPs counter the lab hands out, where the notebook holds it under its own name: the same
    # numbers, without walking the model's modules at every call of a batch-by-batch search
    lent = {"decode_step_flops": g["decode_step_flops"]} if g.get("decode_step_flops") is roofline.decode_step_flops else {}
    g.update({n: fast[n] for n in [*saved, *lent]})
    try:
        yield sorted(saved)
    finally:
        g.update({**saved, **lent})


def _on_own(replaced) -> str:
    return (f" (graded on its own: the right {' and '.join(replaced)} stood in for yours, which "
            f"{'has its' if len(replaced) == 1 else 'have their'} own check)" if replaced else "")


def _shape(model):
    return [(p.shape, p.dtype, p.device) for p in model.parameters()]


def _too_slow(c) -> str:
    """Why a call on case ``c`` ran past the limit: no critical batch (a loop that never ends), or one
    far out (a walk one batch at a time, which the stand-in counters make fast, still too long)."""
    if "crit" not in c:                     # not a critical-batch case
        return _ENDLESS
    crit = c["crit"]
    if crit is None:
        return _ENDLESS + " (here no batch is: this case has no critical batch)"
    return (f"Here a critical batch exists, {crit:,}: a search that walks one batch at a time takes that many "
            "steps. Find it without walking: bytes and FLOPs are both straight lines in the batch, so solve where "
            "they cross and settle the integer, or double the batch until the step is compute-bound and bisect")


def _run_all(check, fn, cases, args_of):
    """Call ``fn`` on every case, then again in reverse order: the same arguments must give the same
    answer, and the model must come back unchanged."""
    first = []
    for c in cases:
        before = _shape(c["model"])
        first.append(_call(check, fn, c["label"], args_of(c), _too_slow(c)))
        if _shape(c["model"]) != before:
            raise fail(check, f"{c['label']}: your function changed the model (its parameters' shapes, dtypes "
                              "or device): only read it")
    for i in reversed(range(len(cases))):
        again = _call(check, fn, cases[i]["label"], args_of(cases[i]), _too_slow(cases[i]))
        if not _same(again, first[i]):
            raise fail(check, f"{cases[i]['label']}: called twice with the same arguments, your function "
                              f"returned {first[i]!r}, then {again!r}: it must depend on its arguments only "
                              "(a cache keyed on part of them, or state kept between calls?)")
    return first


def _same(a, b) -> bool:
    try:
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isclose(a, b))
    except Exception:  # noqa: BLE001 - tensors and the like: compare their reprs
        return repr(a) == repr(b)


def _explain(cases, got, mistakes, right, close=None):
    """The first named mistake whose formula gives every answer and differs from the right one on
    at least two cases (a coincidence on one case names nothing); else None."""
    eq = close or (lambda a, b: a == b)
    for name, wrong, message in mistakes:
        values = [wrong(c) for c in cases]
        if all(eq(g, v) for g, v in zip(got, values)) and \
                sum(not eq(v, right(c)) for c, v in zip(cases, values)) >= 2:
            return message
    return None


def _public(fn):
    """A failure is shown from the check's own line, not from the grader's tables inside it."""
    @functools.wraps(fn)
    def check(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GraderFailure as failure:
            raise failure.with_traceback(None) from None
    return check


# ---------------------------------------------------------------------------------------------------
# The graded models


def _random(cfg, dtype):
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


@functools.lru_cache(maxsize=1)
def _models():
    """(label, model): real tensors first, then shape-only ones on the meta device."""
    from transformers import GPT2Config, LlamaConfig

    llama = dict(vocab_size=96, hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
                 num_key_value_heads=2, intermediate_size=40)
    wide = dict(vocab_size=72, hidden_size=32, num_hidden_layers=2, intermediate_size=24)
    return [
        ("kvlab-tiny (fp32, tied LM head, learned positions)", grading_model()[0]),
        ("a random GPT-2 (fp16, 3 layers, 4 heads of 8, tied LM head)",
         _random(GPT2Config(vocab_size=80, n_positions=40, n_embd=32, n_layer=3, n_head=4,
                            bos_token_id=0, eos_token_id=0), torch.float16)),
        ("a random grouped-query Llama (bf16, 6 query / 2 key-value heads, untied head)",
         _random(LlamaConfig(**llama, tie_word_embeddings=False), torch.bfloat16)),
        ("a random grouped-query Llama (fp32, 6 query / 2 key-value heads, tied head)",
         _random(LlamaConfig(**llama, tie_word_embeddings=True), torch.float32)),
        ("a random Llama with head_dim=16, not hidden_size / heads = 8 (fp32, 4 query / 2 key-value heads, "
         "untied)", _random(LlamaConfig(**wide, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        tie_word_embeddings=False), torch.float32)),
        ("a random Llama with head_dim=12, not hidden_size / heads = 8 (fp16, 4 heads, tied)",
         _random(LlamaConfig(**wide, num_attention_heads=4, num_key_value_heads=4, head_dim=12,
                             tie_word_embeddings=True), torch.float16)),
        ("shape-only gpt2-medium on the meta device (fp16)", roofline.meta_model("gpt2-medium", torch.float16)),
        ("shape-only Llama-3.1-8B on the meta device (bf16, 32 query / 8 key-value heads)",
         roofline.meta_model("Llama-3.1-8B", torch.bfloat16)),
    ]


# (model index, batch_size, seq_len): several rows, contexts the learner has not seen, and the same
# model at two sizes (a stale answer for one of them is named)
_BYTE_CASES = [(0, 3, 21), (1, 2, 13), (2, 5, 9), (3, 4, 0), (4, 3, 11), (5, 6, 7), (6, 7, 700),
               (7, 3, 4096), (0, 9, 2), (7, 1, 100),
               # pairs that differ in exactly one argument (a memo keyed on the other two is named):
               (0, 3, 22), (0, 4, 21), (2, 2, 13)]


def _case(label, model, batch, seq):
    """Everything a mistake needs: the parts of the right answer, from kvlab.roofline."""
    cfg = model.config
    n_head = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_head
    head = roofline.lm_head(model)
    tied = any(p is head for p in model.get_input_embeddings().parameters())
    row = sum(t[0].numel() * t.element_size() for t in roofline.lookup_tables(model))
    dim = roofline.kv_dims(cfg)[2]
    return dict(label=label, model=model, B=batch, S=seq, W=roofline.weight_bytes(model),
                L=roofline.lookup_bytes(model), row=row, C=roofline.cache_read_bytes(model, batch, seq),
                item=head.element_size(), head=head.numel() * head.element_size() if tied else 0,
                head_row=head[0].numel() * head.element_size() if tied else 0, q_per_kv=n_head // n_kv,
                dim_ratio=(cfg.hidden_size // n_head) / dim, meta=next(model.parameters()).device.type == "meta",
                want=roofline.decode_step_bytes(model, batch, seq))


def _read(c):
    """The weights the convention says a step reads."""
    return c["W"] - c["L"] + c["B"] * c["row"]


# Named mistakes: what each wrong formula returns, from the parts of the right answer.
_MISTAKES = [
    ("tables whole", lambda c: c["W"] + c["C"],
     "you counted the look-up tables (input embedding, position table) whole: a step reads only the "
     "batch_size rows it looks up, one per row of the batch. The LM head is read whole: every row of it "
     "makes a logit"),
    ("one row of each table", lambda c: c["W"] - c["L"] + c["row"] + c["C"],
     "you read ONE row of each look-up table: every row of the batch looks up its own, so batch_size rows"),
    ("no table rows", lambda c: c["W"] - c["L"] + c["C"],
     "you left out the rows the look-up tables give: a step reads batch_size rows of each"),
    ("tied head as rows", lambda c: _read(c) - c["head"] + c["B"] * c["head_row"] + c["C"],
     "you counted the tied token embedding as a look-up table read by rows, but it IS the LM head, and "
     "the LM head reads all of it to make the logits: count it whole, once"),
    ("weights once per row", lambda c: _read(c) * c["B"] + c["C"],
     "you counted the weights once per row of the batch. A step reads every weight ONCE and applies it "
     "to all rows: that is why batching is cheap. Only the cache (and the looked-up rows) grow with it"),
    ("cache left out", lambda c: _read(c),
     "you left the KV cache out: a decode step also reads the cached keys and values of every position "
     "of every row (chapter 4's formula)"),
    ("cache for one row", lambda c: _read(c) + c["C"] // c["B"],
     "you counted the cache of ONE row: every row of the batch has its own keys and values, so multiply "
     "the cache by batch_size"),
    ("tied head twice", lambda c: c["want"] + c["head"],
     "you counted the tied LM head twice: its weight IS the token-embedding matrix, one tensor read "
     "once. model.parameters() lists it once (state_dict() and named_parameters(remove_duplicate=False) "
     "list it twice)"),
    ("state_dict() summed", lambda c: c["W"] + c["head"] + c["C"],
     "you summed state_dict() (or named_parameters(remove_duplicate=False)): it lists the tied LM head a "
     "second time, under its own name, and keeps every look-up table whole. Count each tensor once "
     "(model.parameters()) and, of a look-up table, the batch_size rows a step reads"),
    ("parameters, not bytes", lambda c: c["want"] // c["item"],
     "you counted parameters and cached elements, not bytes: multiply each by its element size "
     "(p.element_size(), or dtype.itemsize)"),
    ("4 bytes assumed", lambda c: c["want"] * 4 // c["item"],
     "you assumed 4 bytes per element (fp32) whatever the model's dtype: read it from the tensors "
     "(p.element_size(), or the model's dtype.itemsize for the cache)"),
    ("query heads for key/value heads", lambda c: _read(c) + c["C"] * c["q_per_kv"],
     "you sized the cache with the number of QUERY heads: with grouped-query attention the cache holds "
     "num_key_value_heads heads (a config without it has as many as query heads)"),
    ("head_dim from the width", lambda c: _read(c) + round(c["C"] * c["dim_ratio"]),
     "you took head_dim as the width over the heads; a config may set head_dim explicitly, and then "
     "that is the size of a head"),
]


# Two mistakes at once: one in the weights a step reads, one in the cache, and maybe the element size
# (each named by its row of _MISTAKES). A learner's answer made of two of them is named as both.
_WEIGHT_TERMS = {
    "tables whole": lambda c: c["W"],
    "one row of each table": lambda c: c["W"] - c["L"] + c["row"],
    "no table rows": lambda c: c["W"] - c["L"],
    "tied head as rows": lambda c: _read(c) - c["head"] + c["B"] * c["head_row"],
    "weights once per row": lambda c: _read(c) * c["B"],
    "tied head twice": lambda c: _read(c) + c["head"],
    "state_dict() summed": lambda c: c["W"] + c["head"],
}
_CACHE_TERMS = {
    "cache left out": lambda c: 0,
    "cache for one row": lambda c: c["C"] // c["B"],
    "query heads for key/value heads": lambda c: c["C"] * c["q_per_kv"],
    "head_dim from the width": lambda c: round(c["C"] * c["dim_ratio"]),
}
_UNIT_TERMS = {
    "parameters, not bytes": lambda c, n: n // c["item"],
    "4 bytes assumed": lambda c, n: n * 4 // c["item"],
}


def _explain_combined(cases, got) -> str | None:
    """Two or three of the named mistakes together (a weights one, a cache one, an element size) that
    give every answer and differ from the right one on at least two cases; else None."""
    messages = {name: message for name, _, message in _MISTAKES}
    weights = [(None, _read)] + list(_WEIGHT_TERMS.items())
    caches = [(None, lambda c: c["C"])] + list(_CACHE_TERMS.items())
    units = [(None, lambda c, n: n)] + list(_UNIT_TERMS.items())
    for wname, w in weights:
        for cname, k in caches:
            for uname, u in units:
                names = [n for n in (wname, cname, uname) if n is not None]
                if len(names) < 2:
                    continue
                values = [u(c, w(c) + k(c)) for c in cases]
                if values == got and sum(v != c["want"] for c, v in zip(cases, values)) >= 2:
                    return (f"{len(names)} mistakes at once (each alone gives other answers; together they give "
                            "every one of yours): " + "; AND ".join(f"({i + 1}) {messages[n]}"
                                                                    for i, n in enumerate(names)))
    return None


def _as_int(value, label):
    if isinstance(value, (bool, float, torch.Tensor)):
        raise fail(NAME_BYTES, f"{label}: return a Python int, got {type(value).__name__} {value!r} "
                               "(bytes are whole numbers: count them in integer arithmetic)")
    try:
        return int(value.__index__())
    except (AttributeError, TypeError):
        raise fail(NAME_BYTES, f"{label}: return an int, got {type(value).__name__}") from None


_ARGS = ("model", "B", "S", "bw", "fl")


def _one_apart(a, b) -> bool:
    """Two cases whose arguments differ in exactly one (the model compared by identity)."""
    return sum((a.get(k) is not b.get(k)) if k == "model" else a.get(k) != b.get(k) for k in _ARGS) == 1


def _stale(cases, got, i, key="want", eq=lambda a, b: a == b):
    """An answer that is right for a case whose arguments differ from this one's in exactly one: a result
    kept from another call, keyed on part of the arguments. Returns that case's index, or None."""
    return next((j for j, c in enumerate(cases) if j != i and _one_apart(c, cases[i]) and eq(got[i], c[key])
                 and eq(got[i], got[j]) and not eq(c[key], cases[i][key])), None)


def _stale_message(cases, got, key="want", eq=lambda a, b: a == b) -> str | None:
    for i, c in enumerate(cases):
        j = _stale(cases, got, i, key, eq)
        if j is not None:
            differs = next(k for k in _ARGS if (c.get(k) is not cases[j].get(k) if k == "model"
                                                  else c.get(k) != cases[j].get(k)))
            return (f"<{c['label']}>: you returned {got[i]!r}, the answer for <{cases[j]['label']}>, whose arguments "
                    f"differ from these in {_ARG_NAMES[differs]} only: a result kept from another call (a cache "
                    "keyed on part of the arguments?). Compute from every argument, every time")
    return None


_ARG_NAMES = dict(model="the model", B="batch_size", S="seq_len", bw="bandwidth", fl="flops")


def _where_bytes(cases, got) -> str:
    wrong = [(c, g) for c, g in zip(cases, got) if g != c["want"]]
    right = [c["label"] for c, g in zip(cases, got) if g == c["want"]]
    lines = "; ".join(f"{c['label']} (batch_size={c['B']}, seq_len={c['S']}): expected {c['want']:,} = weights "
                      f"read {_read(c):,} + cache {c['C']:,}, got {g:,} ({g - c['want']:+,})" for c, g in wrong[:3])
    return (f"no single known mistake explains all your answers. Wrong on {len(wrong)} of {len(cases)} cases: "
            f"{lines}" + (f". Right on: {', '.join(right)}" if right else ""))


def _grade_bytes(decode_step_bytes) -> None:
    cases = [_case(*_models()[m], B, S) for m, B, S in _BYTE_CASES]
    raw = _run_all(NAME_BYTES, decode_step_bytes, cases, lambda c: (c["model"], c["B"], c["S"]))
    got = [_as_int(v, f"{c['label']}, batch_size={c['B']}, seq_len={c['S']}") for c, v in zip(cases, raw)]
    if all(g == c["want"] for c, g in zip(cases, got)):
        return passed(NAME_BYTES, f"{len(cases)} cases on {len(_models())} models (GPT-2 and grouped-query, "
                                  "tied and untied heads, an explicit head_dim, fp32/fp16/bf16, real and "
                                  "meta-device shapes) give their exact bytes per decode step")
    stale = _stale_message(cases, got)
    if stale:
        raise fail(NAME_BYTES, stale)
    why = _explain(cases, got, _MISTAKES, lambda c: c["want"]) or _explain_combined(cases, got)
    if why is None and all(g < c["W"] - c["L"] for c, g in zip(cases, got) if c["meta"] and g != c["want"]) \
            and any(c["meta"] and g != c["want"] for c, g in zip(cases, got)):
        why = ("on the meta device every tensor's data_ptr() is 0, so deduplicating by data_ptr keeps one "
               "tensor: deduplicate by identity (model.parameters() already does)")
    raise fail(NAME_BYTES, why or _where_bytes(cases, got))


check_decode_step_bytes = _public(_grade_bytes)
check_decode_step_bytes.__doc__ = ("Grade ``decode_step_bytes(model, batch_size, seq_len) -> int`` against "
                                   "exact byte counts in chapter 7's convention.")


# ---------------------------------------------------------------------------------------------------
# The floor


# Every case of the floor and of the bound/critical-batch graders: (label, model: its index in
# _models(), batch_size, seq_len, bandwidth in B/s, flops in FLOP/s). One table per grader, one loop.
_TINY, _HEAD_DIM_16, _GPT2_MEDIUM, _LLAMA_8B = 0, 4, 6, 7

_FLOOR_CASES = [   # three bound by memory, three by compute
    ("kvlab-tiny, a CPU-like machine", _TINY, 2, 30, 20e9, 100e9),
    ("the head_dim=16 Llama, long context on a CPU-like machine", _HEAD_DIM_16, 3, 500, 20e9, 100e9),
    ("Llama-3.1-8B (meta), one row on an H100-like machine", _LLAMA_8B, 1, 4000, 3.35e12, 700e12),
    ("kvlab-tiny, batch 64 on a machine with little compute", _TINY, 64, 5, 500e9, 20e9),
    ("the head_dim=16 Llama, batch 40 on a machine with little compute", _HEAD_DIM_16, 40, 3, 400e9, 10e9),
    ("Llama-3.1-8B (meta), batch 512 on an H100-like machine", _LLAMA_8B, 512, 100, 3.35e12, 700e12),
    # pairs that differ in exactly one argument (a memo keyed on the others is named)
    # (rates changed by factors no named mistake makes: 1.35x, 0.65x)
    ("kvlab-tiny, a CPU-like machine with more bandwidth", _TINY, 2, 30, 27e9, 100e9),
    ("kvlab-tiny, batch 64 on a machine with even less compute", _TINY, 64, 5, 500e9, 13e9),
    ("kvlab-tiny, a CPU-like machine, 31 positions", _TINY, 2, 31, 20e9, 100e9),
    ("kvlab-tiny, a CPU-like machine, batch 3", _TINY, 3, 30, 20e9, 100e9),
]


def _machine_cases(table, parts):
    """The rows of ``table`` as dicts, each with what ``parts(model, B, S, bw, fl)`` adds: the right
    answer and the pieces its mistakes are made of, from kvlab.roofline."""
    models = _models()
    return [dict(label=label, model=models[i][1], B=B, S=S, bw=bw, fl=fl, **parts(models[i][1], B, S, bw, fl))
            for label, i, B, S, bw, fl in table]


def _floor_parts(model, B, S, bw, fl):
    m, f = roofline.decode_step_bytes(model, B, S) / bw, roofline.decode_step_flops(model, B, S) / fl
    return dict(m=m, f=f, want=max(m, f), c=roofline.cache_read_bytes(model, B, S) / bw, mem=m >= f)


_FLOOR_MISTAKES = [
    ("min", lambda c: min(c["m"], c["f"]),
     "you took the SMALLER of the two times: the step must do both, so it takes at least the larger "
     "of the memory time and the compute time"),
    ("sum", lambda c: c["m"] + c["f"],
     "you added the memory and compute times: a machine overlaps them, so the floor is the larger one"),
    ("memory only", lambda c: c["m"],
     "your answers equal bytes / bandwidth everywhere, so your compute time never counts: it is left out, "
     "or too small (flops is in FLOP/s: no unit scaling). Where the FLOPs take longer (large batches) the "
     "floor is theirs: return the larger of the two times"),
    ("compute only", lambda c: c["f"],
     "your answers equal the compute time everywhere, so your memory time never counts: it is left out, or "
     "too small (bandwidth is in bytes/s: no GB scaling). A decode step at small batch is bound by the "
     "bytes it reads"),
    ("milliseconds", lambda c: c["want"] * 1e3, "return seconds, not milliseconds"),
    ("swapped rates", lambda c: max(c["m"] * c["bw"] / c["fl"], c["f"] * c["fl"] / c["bw"]),
     "you divided the bytes by flops and the FLOPs by bandwidth: bytes go with bandwidth (bytes/s), "
     "FLOPs with flops (FLOP/s)"),
    ("no cache", lambda c: max(c["m"] - c["c"], c["f"]),
     "your memory time leaves the cache out: use your decode_step_bytes (weights AND cache)"),
]


def _as_seconds(value, label) -> float:
    if isinstance(value, bool) or isinstance(value, torch.Tensor) or not isinstance(value, numbers.Real):
        raise fail(NAME_FLOOR, f"{label}: return a float number of seconds, got {type(value).__name__} {value!r}")
    return float(value)


def _close(a, b):
    return math.isclose(a, b, rel_tol=1e-6)


def _which_term(cases, got) -> str | None:
    """Right wherever one term binds and wrong wherever the other does: name that term."""
    ok = [_close(g, c["want"]) for c, g in zip(cases, got)]
    mem_ok = all(o for o, c in zip(ok, cases) if c["mem"])
    comp_ok = all(o for o, c in zip(ok, cases) if not c["mem"])
    if mem_ok and not comp_ok:
        return ("your answers are right wherever the bytes bound the step and wrong wherever the FLOPs do: "
                "check the compute term (the step's FLOPs at the machine's FLOP/s) and which of the two times you keep")
    if comp_ok and not mem_ok:
        return ("your answers are right wherever the FLOPs bound the step and wrong wherever the bytes do: "
                "check the memory term (is it your decode_step_bytes, graded above, over bandwidth?)")
    ratios = {round(math.log10(g / c["want"]), 6) for c, g in zip(cases, got) if g > 0}
    if len(ratios) == 1 and (r := ratios.pop()) == round(r) and r != 0:
        return (f"every answer is off by a factor 1e{int(r)}: a unit. bandwidth is in bytes/s, flops in "
                "FLOP/s, and the answer in seconds")
    return None


def _grade_floor(step_time_floor) -> None:
    cases = _machine_cases(_FLOOR_CASES, _floor_parts)
    with _on_references(step_time_floor, ("decode_step_bytes",)) as replaced:
        raw = _run_all(NAME_FLOOR, step_time_floor, cases, lambda c: (c["model"], c["B"], c["S"], c["bw"], c["fl"]))
    got = [_as_seconds(v, c["label"]) for c, v in zip(cases, raw)]
    bad = [(c, g) for c, g in zip(cases, got) if not _close(g, c["want"])]
    if not bad:
        return passed(NAME_FLOOR, f"{len(cases)} cases, bound by memory and by compute, real and meta-device "
                                  "models, an explicit head_dim" + _on_own(replaced))
    why = _explain(cases, got, _FLOOR_MISTAKES, lambda c: c["want"], _close)
    stale = None if why else _stale_message(cases, got, eq=_close)
    if stale:
        raise fail(NAME_FLOOR, stale)
    why = why or _which_term(cases, got)
    c, g = bad[0]
    where = (f"{c['label']} (batch_size={c['B']}, seq_len={c['S']}, bandwidth={c['bw']:.3g} B/s, "
             f"flops={c['fl']:.3g} FLOP/s): moving the bytes takes {c['m']:.4g} s, the FLOPs {c['f']:.4g} s, so "
             f"the floor is {c['want']:.4g} s; you returned {g:.4g}")
    raise fail(NAME_FLOOR, f"{where}: " + (why or f"wrong on {len(bad)} of {len(cases)} cases and no single "
                                                   "known mistake explains them all; check each term"))


check_step_time_floor = _public(_grade_floor)
check_step_time_floor.__doc__ = "Grade ``step_time_floor(model, batch_size, seq_len, bandwidth, flops) -> seconds``."


# ---------------------------------------------------------------------------------------------------
# Predictions: which term bounds a step, and the critical batch at its context

BOUNDS = ("weights", "cache", "compute")


_CRIT_CASES = [   # every bound, a critical batch of 1, contexts at which no batch is compute-bound
    ("kvlab-tiny, short context, a CPU-like machine", _TINY, 1, 8, 20e9, 200e9),
    ("kvlab-tiny, 300 positions, batch 16, a CPU-like machine", _TINY, 16, 300, 20e9, 200e9),
    ("kvlab-tiny, 50 positions, batch 24, a CPU-like machine", _TINY, 24, 50, 20e9, 200e9),
    ("kvlab-tiny, 200 positions, batch 32, a CPU-like machine", _TINY, 32, 200, 20e9, 200e9),
    ("the head_dim=16 Llama, a machine with little compute", _HEAD_DIM_16, 2, 10, 400e9, 4e9),
    ("gpt2-medium (meta, fp16), zero context, an H100-like machine", _GPT2_MEDIUM, 8, 0, 3.35e12, 990e12),
    ("gpt2-medium (meta, fp16), 900 positions, an H100-like machine", _GPT2_MEDIUM, 8, 900, 3.35e12, 990e12),
    ("Llama-3.1-8B (meta, bf16), 512 positions, an H100-like machine", _LLAMA_8B, 64, 512, 3.35e12, 990e12),
    ("Llama-3.1-8B (meta, bf16), 32k positions, a fp32-rate machine", _LLAMA_8B, 4, 32768, 3.35e12, 60e12),
    ("Llama-3.1-8B (meta, bf16), 1,000 positions, a fp32-rate machine", _LLAMA_8B, 200, 1000, 3.35e12, 60e12),
    # pairs that differ in exactly one argument: the machine's rates, then the context
    ("kvlab-tiny, short context, more bandwidth", _TINY, 1, 8, 31e9, 200e9),
    ("kvlab-tiny, short context, 8.5 times the compute", _TINY, 1, 8, 20e9, 1700e9),
    ("kvlab-tiny, 9 positions", _TINY, 1, 9, 20e9, 200e9),
    # critical batches in the thousands, as real ones reach (a loop capped below them is named)
    ("Llama-3.1-8B (meta, bf16), 16 positions, a machine with 5,000 TFLOP/s per TB/s", _LLAMA_8B, 1, 16, 1e12,
     5000e12),
    ("gpt2-medium (meta, fp16), zero context, a machine with 5,000 TFLOP/s per TB/s", _GPT2_MEDIUM, 1, 0, 1e12,
     5000e12),
    # exact ties (integer counts over power-of-two rates, so every way of computing the times agrees):
    # a tie between compute and all the bytes is not compute-bound; a tie of the byte terms is "weights"
    ("the bf16 grouped-query Llama, 2 positions, FLOPs time equal to bytes time", 2, 1, 2, 2.0**40, 2.0**40),
    ("the head_dim=16 Llama, batch 5, 14 positions, FLOPs time equal to bytes time", _HEAD_DIM_16, 5, 14, 2.0**40,
     2.0**41),
    ("the bf16 grouped-query Llama, 424 positions, cache bytes equal to weight bytes", 2, 1, 424, 2.0**40, 2.0**50),
    ("the head_dim=16 Llama, batch 11, 14 positions, cache bytes equal to weight bytes", _HEAD_DIM_16, 11, 14,
     2.0**40, 2.0**50),
]


def _crit_parts(model, B, S, bw, fl):
    t = roofline.step_terms(model, B, S, bw, fl)
    return dict(bound=t["bound"], terms=t, crit=roofline.critical_batch(model, S, bw, fl),
                crit0=roofline.critical_batch(model, 0, bw, fl), shared=_all_shared(model, S, bw, fl))


def _all_shared(model, S, bw, fl):
    """The critical batch if every byte were shared by the batch (no cache, no looked-up rows)."""
    w = roofline.decode_step_bytes(model, 1, S) / bw
    f = roofline.decode_step_flops(model, 1, S) / fl
    return math.floor(w / f) + 1


_CRIT_MISTAKES = [
    ("zero context", lambda c: c["crit0"],
     "your critical batch is the one at ZERO context whatever seq_len is: each row's cache adds bytes "
     "that grow with the context, so the batch at which compute catches up moves out (or vanishes)"),
    ("every byte shared", lambda c: c["shared"],
     "you treated every byte of the step as shared by the batch: the weights are, but each row reads "
     "its own cache (and its own embedding rows), which grow with the batch as the FLOPs do"),
    ("one too many", lambda c: None if c["crit"] is None else c["crit"] + 1,
     "off by one, too large: the critical batch is the SMALLEST batch whose compute time exceeds its "
     "memory time"),
    ("one too few", lambda c: None if c["crit"] is None else max(c["crit"] - 1, 1),
     "off by one, too small: at that batch the compute time does not exceed the memory time yet"),
]


def _check_pair(c, out):
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise fail(NAME_CRIT, f"{c['label']}: return a pair (bound, critical_batch), got {out!r}")
    bound, crit = out
    if bound not in BOUNDS:
        hint = " (name WHICH memory term: 'weights' or 'cache')" if str(bound).lower() in ("memory", "bytes") else ""
        raise fail(NAME_CRIT, f"{c['label']}: the bound must be one of {BOUNDS}, got {bound!r}{hint}")
    if isinstance(crit, numbers.Real) and not isinstance(crit, bool) and crit < 1 and c["crit"] is None:
        raise fail(NAME_CRIT, f"{c['label']}: you returned {crit!r}, a batch below 1: at this context each added row "
                              "brings more bytes (its cache) than its FLOPs can cover at this machine's rates, so "
                              "the linear solve has no positive answer and NO batch is compute-bound: check the "
                              "per-row terms first and return None")
    if crit is not None and (isinstance(crit, bool) or not isinstance(crit, numbers.Integral) or crit < 1):
        raise fail(NAME_CRIT, f"{c['label']}: the critical batch must be a positive int or None, got {crit!r}")
    return bound, None if crit is None else int(crit)


def _bound_message(c, bound):
    t = c["terms"]
    if bound == "compute" and t["compute"] == t["memory"]:
        return (f"{c['label']} (batch_size={c['B']}, seq_len={c['S']}): the FLOPs take exactly as long as all the "
                f"bytes here ({t['compute']!r} s each), and you said 'compute': a tie is not compute-bound (the "
                f"FLOPs must take strictly longer); the step is bound by {c['bound']!r}")
    if bound == "cache" and c["bound"] == "weights" and t["cache"] == t["weights"]:
        return (f"{c['label']} (batch_size={c['B']}, seq_len={c['S']}): the cache and the weights are the same "
                f"number of bytes here ({t['cache_bytes']} each), and you said 'cache': the lab's rule gives a tie "
                "between the two byte terms to 'weights' (and the weights term is everything but the cache: the "
                "looked-up embedding rows belong to it, not to the cache)")
    return (f"{c['label']} (batch_size={c['B']}, seq_len={c['S']}): reading the weights takes {t['weights']:.3g} s, "
            f"the cache {t['cache']:.3g} s, the FLOPs {t['compute']:.3g} s; you said {bound!r}, the step is bound "
            f"by {c['bound']!r}: compute if the FLOPs take longer than ALL the bytes (weights + cache), else the "
            "larger of the two byte terms")


def _crit_message(cases, crits):
    why = _explain(cases, crits, _CRIT_MISTAKES, lambda c: c["crit"])
    c, got = next((c, g) for c, g in zip(cases, crits) if g != c["crit"])
    where = f"{c['label']} (seq_len={c['S']}): the critical batch is {c['crit']}, you said {got}"
    if why:
        return f"{where}: {why}"
    if c["crit"] is None:
        return (f"{where}: at this context each added row brings more bytes (its cache) than its FLOPs can "
                "cover at this machine's rates, so NO batch is compute-bound: return None")
    capped = _cap_message(cases, crits)
    if capped:
        return f"{where}: {capped}"
    if got is None:
        return (f"{where}: a batch of {c['crit']} is compute-bound here; None is only for contexts where "
                "each row's own bytes take longer than its FLOPs")
    if got < c["crit"]:
        t = roofline.step_terms(c["model"], got, c["S"], c["bw"], c["fl"])
        if t["compute"] == t["memory"]:
            return (f"{where}: at batch {got} the FLOPs take exactly as long as the bytes ({t['compute']!r} s each), "
                    "a tie, and a tie is not compute-bound: the critical batch is the smallest batch whose compute "
                    "time is STRICTLY greater than its memory time")
    below = [c["crit"] - 1] if c["crit"] > 1 else []
    return where + ": " + "; ".join(_times_at(c, b) for b in below + [c["crit"]]) + ". The critical batch is the smallest " \
        "batch whose compute time is strictly greater than its memory time"


def _cap_message(cases, crits) -> str | None:
    """A search with a ceiling: right on every case whose critical batch is at most some batch, wrong
    (None, or a batch that is still memory-bound) on every one above it."""
    wrong = [(c, g) for c, g in zip(cases, crits) if g != c["crit"]]
    if not wrong or any(c["crit"] is None for c, _ in wrong):
        return None
    right = [c["crit"] for c, g in zip(cases, crits) if g == c["crit"] and c["crit"] is not None]
    top = max(right, default=0)
    if not right or any(c["crit"] <= top for c, _ in wrong):
        return None
    stops = [g for _, g in wrong if g is not None]
    if any(g >= c["crit"] for c, g in wrong if g is not None):
        return None
    at = (f"; where it did return a batch ({', '.join(str(g) for g in sorted(set(stops)))}), the step there is still "
          "memory-bound" if stops else "")
    above = ", ".join(str(c["crit"]) for c, _ in wrong)
    return (f"your search is right on every case whose critical batch is at most {top} and wrong on every one "
            f"above (here {above}): it looks "
            f"capped, a loop over a fixed range of batches that gives up (None) before it gets there{at}. Real critical "
            "batches reach the thousands: search without a ceiling (double the batch until the step is compute-bound, "
            "then bisect) or solve the two straight lines for where they cross")


def _times_at(c, batch) -> str:
    t = roofline.step_terms(c["model"], batch, c["S"], c["bw"], c["fl"])
    return (f"at batch {batch} the FLOPs take {t['compute']:.6g} s and the bytes {t['memory']:.6g} s "
            f"({'compute' if t['compute'] > t['memory'] else 'memory'}-bound)")


def _grade_crit(bound_and_critical) -> None:
    cases = _machine_cases(_CRIT_CASES, _crit_parts)
    with _on_references(bound_and_critical, ("decode_step_bytes", "step_time_floor")) as replaced:
        raw = _run_all(NAME_CRIT, bound_and_critical, cases,
                       lambda c: (c["model"], c["B"], c["S"], c["bw"], c["fl"]))
    pairs = [_check_pair(c, out) for c, out in zip(cases, raw)]
    for c, (bound, _) in zip(cases, pairs):
        if bound != c["bound"]:
            raise fail(NAME_CRIT, _bound_message(c, bound))
    crits = [crit for _, crit in pairs]
    stale = None if _explain(cases, crits, _CRIT_MISTAKES, lambda c: c["crit"]) else \
        _stale_message(cases, crits, key="crit")
    if stale:
        raise fail(NAME_CRIT, stale)
    if any(g != c["crit"] for c, g in zip(cases, crits)):
        raise fail(NAME_CRIT, _crit_message(cases, crits))
    passed(NAME_CRIT, f"{len(cases)} cases: every bound, critical batches from 1 up, contexts with none, an "
                      "explicit head_dim, GPT-2 and grouped-query models" + _on_own(replaced))


check_bound_and_critical = _public(_grade_crit)
check_bound_and_critical.__doc__ = ("Grade ``bound_and_critical(model, batch_size, seq_len, bandwidth, flops) "
                                    "-> (bound, critical_batch)``.")


# ---------------------------------------------------------------------------------------------------
# The measurement: a sweep past the predicted bend, and the measurement set against the prediction


def _as_batches(batches, what: str = "BATCHES") -> list[int]:
    """A list, tuple, range or numpy array of positive ints (numpy's too), growing strictly."""
    try:
        out = list(batches.tolist() if hasattr(batches, "tolist") else batches)
    except TypeError:
        out = None
    if not out or any(isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1 for b in out):
        raise fail(NAME_SWEEP, f"{what} must be a list of positive ints, got {batches!r}")
    if out != sorted(set(out)):
        raise fail(NAME_SWEEP, f"{what} must grow strictly, got {out}")
    return [int(b) for b in out]


def _largest_fitting(model, seq_len, budget_bytes) -> int:
    per_row = roofline.cache_read_bytes(model, 1, seq_len)
    return max(1, int(budget_bytes // per_row)) if per_row else 1 << 30


def _sweep_problem(batches: list[int], critical: int | None, fits: int) -> str | None:
    """What the sweep ``batches`` lacks for a critical batch ``critical`` (None: no batch is
    compute-bound) when at most ``fits`` rows' cache fits the budget; None if it lacks nothing.
    With a critical batch ``c`` whose twice fits: at least min(2, c - 1) batches below ``c``, two above,
    the largest at least ``2c``. Else: at least min(4, fits) batches spanning a factor of 8 (or up to
    ``fits``), and past ``c`` when ``c`` itself fits."""
    if batches[-1] > fits:
        return f"batch {batches[-1]} is beyond the largest batch whose cache fits the budget ({fits})"
    if critical is not None and 2 * critical <= fits:
        below, above = [b for b in batches if b < critical], [b for b in batches if b > critical]
        need_below = min(2, critical - 1)              # a critical batch of 1 or 2 leaves less room below
        need_above = min(2, fits - critical)         # with CRIT=1 and 2 rows fitting, only batch 2 is above
        short = []
        if len(below) < need_below:
            short.append(f"{len(below)} below it ({below or 'none'}), {need_below} needed")
        if len(above) < need_above:
            short.append(f"{len(above)} above it ({above or 'none'}; {critical} itself is neither), "
                         f"{need_above} needed")
        if batches[-1] < 2 * critical:
            short.append(f"the largest is {batches[-1]}, below {2 * critical}")
        return (f"with a critical batch of {critical} (twice it fits: at most {fits} rows), measure at least "
                f"{need_below} batch(es) below it and {need_above} above, the largest at least {2 * critical}, so that "
                "the bend can be seen; " + "; ".join(short)) if short else None
    why = ("no batch is compute-bound" if critical is None else
           f"twice the critical batch {critical} would not fit (at most {fits} rows)")
    reach = critical if critical is not None and critical <= fits else 1
    need, span = min(4, fits), min(8 * batches[0], fits)
    if len(batches) < need or batches[-1] < span or batches[-1] < reach:
        return (f"{why}: there is no bend to reach, so measure how the step grows: at least {need} batches "
                f"spanning a factor of 8 or more (or up to {fits}, the most that fits)"
                + (f", past the critical batch {critical}" if reach > 1 else "") + f", within {fits} rows")
    return None


def _plan_cases(critical, fits):
    """(label, crit, fits) a plan is called on: this run's first, then the edges of the contract (no
    critical batch, one of 1 and 2, one in the thousands, twice it just fitting and just not, one
    that does not fit at all, a budget of a few rows), in pairs that differ in one argument."""
    return [(f"this run (CRIT={critical}, {fits} rows fit)", critical, fits),
            ("no critical batch, 4096 rows fit", None, 4096), ("no critical batch, 5 rows fit", None, 5),
            ("CRIT=1", 1, 4096), ("CRIT=1, 2 rows fit", 1, 2), ("CRIT=2", 2, 4096), ("CRIT=3", 3, 4096), ("CRIT=39", 39, 4096),
            ("CRIT=189", 189, 4096), ("CRIT=3000 (in the thousands), 100000 rows fit", 3000, 100_000),
            ("CRIT=7, exactly 14 rows fit (twice it just fits)", 7, 14),
            ("CRIT=7, 13 rows fit (twice it does not)", 7, 13),
            ("CRIT=600, 1000 rows fit (CRIT fits, twice it does not)", 600, 1000),
            ("CRIT=5000, 1000 rows fit (CRIT itself does not)", 5000, 1000)]


def _grade_plan(plan, critical, fits) -> list[int]:
    """Call ``plan(crit, fits)`` on this run's numbers and on unseen ones; every answer must meet the
    rules. Returns this run's plan."""
    answers = []
    for label, crit, rows in _plan_cases(critical, fits):
        out = _guarded(NAME_SWEEP, lambda: plan(crit, rows), f"plan_batches({crit!r}, {rows!r}) <{label}>",
                       hint=" (CRIT is None when no batch is compute-bound: handle it)" if crit is None else "")
        batches = _as_batches(out, f"what plan_batches({crit!r}, {rows!r}) <{label}> returns")
        answers.append(batches)
        problem = _sweep_problem(batches, crit, rows)
        if problem:
            typed = len(answers) > 1 and all(a == answers[0] for a in answers)
            raise fail(NAME_SWEEP, (f"plan_batches returned {batches} for every case so far, whatever crit and "
                                    "fits: numbers typed in fit one run only. Compute the plan from its "
                                    "arguments. Here: " if typed else "")
                       + f"plan_batches({crit!r}, {rows!r}) <{label}> returned {batches}: {problem}")
    return answers[0]


def _grade_sweep(batches, model, seq_len: int, bandwidth: float, flops: float,
                 budget_bytes: float = 2 * 2**30) -> None:
    """The sweep the lab asks for (see :func:`_sweep_problem`), its cache within ``budget_bytes`` at
    every batch. ``batches`` is the learner's ``plan_batches(crit, fits)`` (called on this machine's
    critical batch and on unseen ones) or the list it planned."""
    critical = roofline.critical_batch(model, seq_len, bandwidth, flops)
    fits = _largest_fitting(model, seq_len, budget_bytes)
    planned = callable(batches)
    batches = _grade_plan(batches, critical, fits) if planned else _as_batches(batches)
    if batches[-1] > fits:
        raise fail(NAME_SWEEP, f"at batch {batches[-1]} the cache of {seq_len} positions takes "
                               f"{roofline.cache_read_bytes(model, batches[-1], seq_len) / 2**30:.2f} GiB, beyond the "
                               f"lab's budget of {budget_bytes / 2**30:.1f} GiB: the largest batch that fits is {fits}")
    problem = _sweep_problem(batches, critical, fits)
    if problem:
        raise fail(NAME_SWEEP, f"on this machine at {seq_len} positions, {problem}; BATCHES is {batches}. (The "
                               "grader predicts the critical batch from the reference byte and FLOP counts: if your "
                               "CRIT printed another number, fix exercises 1-3 first)")
    cases = f" and on {len(_plan_cases(critical, fits)) - 1} other critical batches and budgets" if planned else ""
    if critical is not None and 2 * critical <= fits:
        return passed(NAME_SWEEP, f"the sweep {batches} reaches past the predicted critical batch {critical}{cases}")
    why = (f"no batch is compute-bound at {seq_len} positions on this machine" if critical is None else
           f"twice the critical batch ({2 * critical}) would not fit the budget (at most {fits} rows)")
    passed(NAME_SWEEP, f"{why}; the sweep {batches} shows how the step grows{cases}: say so beside your plot")


check_sweep_plan = _public(_grade_sweep)


def _fit_cases():
    """(floors, measured, overhead, k): an exact line, then two with the noise a real run has (a few per
    cent of each step: timings on a shared machine), one with its floors unsorted. On noise-free data
    every line-fitting method agrees; on these only least squares of measured on floor gives the answer."""
    g = torch.Generator().manual_seed(7)
    noise = lambda: 1 + 0.04 * float(torch.randn(1, generator=g))      # noqa: E731
    f1 = [1e-4, 2e-4, 4e-4, 8e-4]
    f2 = [3e-3, 3.1e-3, 3.5e-3, 5e-3, 9e-3]
    f3 = [2e-5, 9e-5, 4e-5, 1.6e-4, 3e-4, 6e-5]
    f4 = [1e-3, 2e-3, 4e-3, 8e-3]
    out = [(f1, [5e-3 + 1.5 * f for f in f1]), (f2, [(2e-3 + 1.7 * f) * noise() for f in f2]),
           (f3, [(2e-4 + 3.0 * f) * noise() for f in f3]),
           # a run whose line has a NEGATIVE intercept (measured/floor grows with the batch, as lab 7's
           # closing cell meets): the fit reports it as it is; a clamped one would hide that it does not fit
           (f4, [(-5e-4 + 1.4 * f) * noise() for f in f4]),
           (f2, [(-1.2e-3 + 1.9 * f) * noise() for f in f2])]   # a second one: a diagnosis is confirmed twice
    return [(f, m, *_lstsq(f, m)) for f, m in out]


def _off(got, want) -> str:
    return f"{(got - want) / abs(want):+.2%}" if want else f"{got - want:+.3g}"


def _inverted(line):
    a, b = line                                 # floor = a + b x measured  ->  measured = -a / b + floor / b
    return -a / b, 1 / b


def _two_points(floors, measured):
    (f0, m0), (f1, m1) = min(zip(floors, measured)), max(zip(floors, measured))
    k = (m1 - m0) / (f1 - f0)
    return m0 - k * f0, k


def _lstsq(floors, measured):
    n = len(floors)
    mf, mm = sum(floors) / n, sum(measured) / n
    k = sum((f - mf) * (m - mm) for f, m in zip(floors, measured)) / sum((f - mf) ** 2 for f in floors)
    return mm - k * mf, k


_FIT_MISTAKES = [
    ("through the origin", lambda c: (0.0, sum(f * m for f, m in zip(c[0], c[1])) / sum(f * f for f in c[0])),
     "you fitted measured = k x floor through the origin: the fixed cost per step (Python, dispatch, "
     "launches) is what the intercept measures; fit measured = overhead + k x floor"),
    ("swapped", lambda c: _lstsq(c[1], c[0]),
     "you fitted the floor against the measurement: fit measured (y) against the floor (x)"),
    ("swapped and inverted", lambda c: _inverted(_lstsq(c[1], c[0])),
     "you fitted the floor against the measurement and inverted the line: with noise in the measurement that "
     "is another line (least squares minimises the errors of y, here the measured times): fit measured (y) "
     "against the floor (x)"),
    ("through the end points", lambda c: _two_points(c[0], c[1]),
     "you drew the line through the smallest and the largest floor's points: least squares uses every point"),
    ("pair reversed", lambda c: _lstsq(c[0], c[1])[::-1],
     "you returned (k, overhead): the pair is (overhead_seconds, k), intercept first (np.polyfit returns the "
     "slope first)"),
    ("clamped", lambda c: (max(_lstsq(c[0], c[1])[0], 0.0), _lstsq(c[0], c[1])[1]),
     "you clamped the overhead at zero: a negative intercept is what the least-squares line says about this "
     "run, and hiding it hides that the line does not fit; return the fit as it is"),
    ("ratio", lambda c: (0.0, sum(m / f for f, m in zip(c[0], c[1])) / len(c[0])),
     "you averaged measured / floor: that mixes the fixed overhead into k; fit a line with an intercept"),
]


def _grade_fit(overhead_fit) -> None:
    cases = [dict(label=f"fit case {i + 1}", model=torch.nn.Linear(1, 1), f=f, m=m, want=(a, k))
             for i, (f, m, a, k) in enumerate(_fit_cases())]
    raw = _run_all(NAME_FIT, lambda model, f, m: overhead_fit(list(f), list(m)), cases,
                   lambda c: (c["model"], c["f"], c["m"]))
    got = []
    for c, out in zip(cases, raw):
        if not isinstance(out, (tuple, list)) or len(out) != 2 or not all(isinstance(v, numbers.Real) for v in out):
            raise fail(NAME_FIT, f"{c['label']}: return a pair of numbers (overhead_seconds, k), got {out!r}")
        got.append(tuple(float(v) for v in out))
    close = lambda a, b: all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-9) for x, y in zip(a, b))
    if all(close(g, c["want"]) for c, g in zip(cases, got)):
        return passed(NAME_FIT, f"{len(cases)} sets of (floor, measured) give the least-squares overhead and k")
    why = _explain([(c["f"], c["m"]) for c in cases], got, _FIT_MISTAKES,
                   lambda c: _lstsq(c[0], c[1]), close)
    c, g = next((c, g) for c, g in zip(cases, got) if not close(g, c["want"]))
    raise fail(NAME_FIT, f"floors {c['f']}, measured {[round(m, 7) for m in c['m']]}: the least-squares line is "
                         f"overhead {c['want'][0]:.6g} s, k {c['want'][1]:.6g}; you returned {g[0]:.6g}, {g[1]:.6g} (off by "
                         f"{_off(g[0], c['want'][0])}, {_off(g[1], c['want'][1])})"
                         + (f": {why}" if why else ""))


check_overhead_fit = _public(_grade_fit)
check_overhead_fit.__doc__ = "Grade ``overhead_fit(floors, measured) -> (overhead_seconds, k)`` (least squares)."
