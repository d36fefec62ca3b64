"""Graders for lab 7: the bytes of a decode step and the floor they set.

* ``decode_step_bytes(model, batch_size, seq_len) -> int`` against exact counts: the bundled model,
  small random GPT-2 and grouped-query Llama models (tied and untied heads), and shape-only models on
  the ``meta`` device (GPT-2 medium, Llama-3.1-8B), in fp32, fp16 and bf16;
* ``step_time_floor(model, batch_size, seq_len, bandwidth, flops) -> float`` seconds, on machines
  chosen so that some cases are memory-bound and others compute-bound.

A wrong answer is tested against a table of named mistakes over every case at once; the mistake
that explains all the numbers is the one the message names.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from .. import roofline
from ._common import fail, grading_model, passed

NAME_BYTES = "check_decode_step_bytes"
NAME_FLOOR = "check_step_time_floor"


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
    return [
        ("kvlab-tiny (fp32, tied LM head)", grading_model()[0]),
        ("a random GPT-2 (fp16, 3 layers, 4 heads of 8, tied LM head)",
         _random(GPT2Config(vocab_size=80, n_positions=40, n_embd=32, n_layer=3, n_head=4,
                            bos_token_id=0, eos_token_id=0), torch.float16)),
        ("a random grouped-query Llama (bf16, 6 query / 2 key-value heads, untied head)",
         _random(LlamaConfig(**llama, tie_word_embeddings=False), torch.bfloat16)),
        ("a random grouped-query Llama (fp32, 6 query / 2 key-value heads, tied head)",
         _random(LlamaConfig(**llama, tie_word_embeddings=True), torch.float32)),
        ("shape-only gpt2-medium on the meta device (fp16)",
         roofline.meta_model("gpt2-medium", torch.float16)),
        ("shape-only Llama-3.1-8B on the meta device (bf16, 32 query / 8 key-value heads)",
         roofline.meta_model("Llama-3.1-8B", torch.bfloat16)),
    ]


# (batch_size, seq_len) per model: several rows, a context the learner has not seen
_SIZES = [(3, 21), (2, 13), (5, 9), (4, 0), (7, 700), (3, 4096)]


def _case(label, model, batch, seq):
    """Everything a mistake needs: the right parts of the answer, computed by kvlab.roofline."""
    cfg = model.config
    n_head = getattr(cfg, "num_attention_heads")
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_head
    head = roofline._lm_head(model)
    tied = any(p is head for p in model.get_input_embeddings().parameters())
    weights, cache = roofline.weight_bytes(model), roofline.cache_read_bytes(model, batch, seq)
    return dict(label=label, model=model, B=batch, S=seq, W=weights, C=cache, item=head.element_size(),
                head=head.numel() * head.element_size() if tied else 0, q_per_kv=n_head // n_kv,
                meta=next(model.parameters()).device.type == "meta", want=weights + cache)


# Named mistakes: what each wrong formula returns, from the parts of the right answer.
_MISTAKES = [
    ("weights once per row", lambda c: c["W"] * c["B"] + c["C"],
     "you counted the weights once per row of the batch. A step reads every weight ONCE and applies "
     "it to all rows: that is why batching is cheap. Only the cache grows with the batch"),
    ("cache left out", lambda c: c["W"],
     "you left the KV cache out: a decode step also reads the cached keys and values of every "
     "position of every row (chapter 4's formula)"),
    ("cache for one row", lambda c: c["W"] + c["C"] // c["B"],
     "you counted the cache of ONE row: every row of the batch has its own keys and values, so "
     "multiply the cache by batch_size"),
    ("tied head twice", lambda c: c["W"] + c["head"] + c["C"],
     "you counted the tied LM head twice: its weight IS the token-embedding matrix, one tensor read "
     "once. model.parameters() lists it once (state_dict() and named_parameters(remove_duplicate="
     "False) list it twice)"),
    ("parameters, not bytes", lambda c: (c["W"] + c["C"]) // c["item"],
     "you counted parameters and cached elements, not bytes: multiply each by its element size "
     "(p.element_size(), or dtype.itemsize)"),
    ("weights as parameters", lambda c: c["W"] // c["item"] + c["C"],
     "you counted the weights as a number of parameters, not bytes: multiply each by p.element_size()"),
    ("4 bytes assumed", lambda c: (c["W"] + c["C"]) * 4 // c["item"],
     "you assumed 4 bytes per element (fp32) whatever the model's dtype: read it from the tensors "
     "(p.element_size(), or the model's dtype.itemsize for the cache)"),
    ("query heads for key/value heads", lambda c: c["W"] + c["C"] * c["q_per_kv"],
     "you sized the cache with the number of QUERY heads: with grouped-query attention the cache holds "
     "num_key_value_heads heads (getattr(config, 'num_key_value_heads', num_attention_heads))"),
]


def _call(fn, name, model_label, args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the learner's exception becomes a pointed message
        names = ("batch_size", "seq_len", "bandwidth", "flops")
        shown = ", ".join(f"{k}={a!r}" for k, a in zip(names, args[1:]))
        raise fail(name, f"your function raised {type(e).__name__}: {e} when called with "
                         f"(<{model_label}>, {shown})") from e


def _as_int(value, label):
    if isinstance(value, (bool, float, torch.Tensor)):
        raise fail(NAME_BYTES, f"{label}: return a Python int, got {type(value).__name__} {value!r} "
                               "(bytes are whole numbers: .numel() * .element_size(), integer arithmetic)")
    try:
        return int(value.__index__())
    except (AttributeError, TypeError):
        raise fail(NAME_BYTES, f"{label}: return an int, got {type(value).__name__}") from None


def _explain_bytes(case, got, cases, got_all) -> str:
    for _, wrong, message in _MISTAKES:
        if wrong(case) == got and all(wrong(c) == g for c, g in zip(cases, got_all)):
            return message
    if case["meta"] and got < case["W"]:
        return ("on the meta device every tensor's data_ptr() is 0, so deduplicating by data_ptr keeps "
                "one tensor: deduplicate by identity (model.parameters() already does)")
    return (f"expected weights {case['W']:,} + cache {case['C']:,} bytes; you are off by "
            f"{got - case['want']:+,}. Check each term")


def check_decode_step_bytes(decode_step_bytes) -> None:
    """Grade ``decode_step_bytes(model, batch_size, seq_len) -> int`` against exact byte counts."""
    cases = [_case(label, m, B, S) for (label, m), (B, S) in zip(_models(), _SIZES)]
    got_all = []
    for c in cases:
        where = f"{c['label']}, batch_size={c['B']}, seq_len={c['S']}"
        got_all.append(_as_int(_call(decode_step_bytes, NAME_BYTES, c["label"], (c["model"], c["B"], c["S"])),
                               where))
    for c, got in zip(cases, got_all):
        if got != c["want"]:
            why = _explain_bytes(c, got, cases, got_all)
            raise fail(NAME_BYTES, f"{c['label']}, batch_size={c['B']}, seq_len={c['S']}: expected "
                                   f"{c['want']:,} bytes, got {got:,}: {why}")
    passed(NAME_BYTES, f"{len(cases)} models (GPT-2 and grouped-query, tied and untied heads, "
                       "fp32/fp16/bf16, real and meta-device shapes) give their exact bytes per decode step")


# ---------------------------------------------------------------------------------------------------
# The floor

# Floor mistakes: the wrong time from the memory time m and the compute time f (and the cache's share).
_FLOOR_MISTAKES = [
    ("min", lambda m, f, c: min(m, f),
     "you took the SMALLER of the two times: the step must do both, so it takes at least the larger "
     "(max(bytes / bandwidth, flops_needed / flops))"),
    ("sum", lambda m, f, c: m + f,
     "you added the memory and compute times: a machine overlaps them, so the floor is the larger one"),
    ("memory only", lambda m, f, c: m,
     "you returned bytes / bandwidth only: at large batches the FLOPs take longer; return the larger "
     "of the two times"),
    ("compute only", lambda m, f, c: f,
     "you returned the compute time only: a decode step at small batch is bound by the bytes it reads"),
    ("milliseconds", lambda m, f, c: max(m, f) * 1e3, "return seconds, not milliseconds"),
    ("no cache", lambda m, f, c: max(m - c, f),
     "your memory time leaves the cache out: use decode_step_bytes (weights AND cache)"),
]


def _floor_cases():
    model = grading_model()[0]
    meta = roofline.meta_model("Llama-3.1-8B", torch.bfloat16)
    return [  # (label, model, batch, seq, bandwidth, flops)
        ("kvlab-tiny, a CPU-like machine", model, 2, 30, 20e9, 100e9),
        ("kvlab-tiny, batch 64 on a machine with little compute", model, 64, 5, 500e9, 20e9),
        ("Llama-3.1-8B (meta), one row on an H100-like machine", meta, 1, 4000, 3.35e12, 700e12),
        ("Llama-3.1-8B (meta), batch 512 on an H100-like machine", meta, 512, 100, 3.35e12, 700e12),
    ]


def _as_seconds(value, label) -> float:
    if isinstance(value, bool) or isinstance(value, torch.Tensor) or not isinstance(value, numbers.Real):
        raise fail(NAME_FLOOR, f"{label}: return a float number of seconds, "
                               f"got {type(value).__name__} {value!r}")
    return float(value)


def check_step_time_floor(step_time_floor) -> None:
    """Grade ``step_time_floor(model, batch_size, seq_len, bandwidth, flops) -> seconds``."""
    n = 0
    for label, model, B, S, bw, fl in _floor_cases():
        args = (model, B, S, bw, fl)
        where = f"{label} (batch_size={B}, seq_len={S}, bandwidth={bw:.3g} B/s, flops={fl:.3g} FLOP/s)"
        got = _as_seconds(_call(step_time_floor, NAME_FLOOR, label, args), where)
        m = roofline.decode_step_bytes(model, B, S) / bw
        f = roofline.decode_step_flops(model, B, S) / fl
        want, n = max(m, f), n + 1
        if math.isclose(got, want, rel_tol=1e-6):
            continue
        c = roofline.cache_read_bytes(model, B, S) / bw
        why = next((msg for _, wrong, msg in _FLOOR_MISTAKES
                    if math.isclose(got, wrong(m, f, c), rel_tol=1e-6)),
                   "check decode_step_bytes first (check_decode_step_bytes), then return "
                   "max(decode_step_bytes(...) / bandwidth, decode_step_flops(...) / flops)")
        raise fail(NAME_FLOOR, f"{where}: moving the bytes takes {m:.4g} s, the FLOPs {f:.4g} s, so the "
                               f"floor is {want:.4g} s; you returned {got:.4g}: {why}")
    passed(NAME_FLOOR, f"{n} cases, memory-bound and compute-bound, real and meta-device models")
