"""Graders for lab 4: the KV-cache memory formula.

* ``kv_cache_bytes(config, seq_len, batch_size, dtype) -> int`` is compared with the bytes that real
  ``DynamicCache`` tensors hold after running small random-weight transformers models (GPT-2, and
  Llama with grouped-query, multi-query and an explicit ``head_dim``), and with hand-worked sizes of
  real models' shapes;
* ``max_batch_size(config, seq_len, dtype, free_bytes) -> int`` is probed at the boundaries: a batch
  that fills ``free_bytes`` exactly, one byte short of it, and less than one sequence.

When an answer is wrong, the grader tests the usual mistakes against every case it ran (no factor 2,
no layer count, query heads for key/value heads, a fixed 2 bytes per element, ``hidden_size / heads``
where the config sets ``head_dim``) and names the one that explains the numbers.
"""

from __future__ import annotations

import math
import operator

import torch

from ._common import fail, grading_model, passed
from kvlab.footprint import fill_dynamic_cache, measure_config, measured_cache_bytes

NAME = "check_kv_cache_bytes"
NAME_BATCH = "check_max_batch_size"


def _llama(hidden, layers, heads, kv, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, **kw)


def _tiny_configs():
    """Small random-model configs, with every factor different from 2 where it matters, so that each
    classic mistake changes the answer by a factor no other mistake produces."""
    from transformers import GPT2Config, MixtralConfig, Qwen2Config

    small = dict(vocab_size=64, intermediate_size=48)
    gqa = dict(num_hidden_layers=2, num_key_value_heads=1, **small)
    return [
        ("GPT-2 (n_layer/n_head/n_embd names, multi-head)",
         GPT2Config(vocab_size=64, n_embd=48, n_layer=3, n_head=4, n_positions=64, bos_token_id=0,
                    eos_token_id=0)),
        ("Llama, grouped-query (6 query heads, 2 key/value heads)", _llama(48, 3, 6, 2, **small)),
        ("Llama, multi-query (4 query heads, 1 key/value head)", _llama(32, 5, 4, 1, **small)),
        ("Llama with an explicit head_dim (24, while hidden_size / heads = 8)",
         _llama(32, 3, 4, 4, head_dim=24, **small)),
        ("Qwen2-style grouped-query config with no head_dim attribute at all",
         Qwen2Config(hidden_size=40, num_attention_heads=5, **gqa)),
        ("Mixtral-style config whose head_dim is None",
         MixtralConfig(hidden_size=48, num_attention_heads=4, num_local_experts=2,
                       num_experts_per_tok=1, head_dim=None, **gqa)),
    ]


def _hand_worked():
    """Real models' shapes, with sizes worked out by hand (literal numbers, not our own formula)."""
    from transformers import Gemma2Config, GPT2Config

    return [
        # 2 x 12 layers x 12 heads x 64 x 1024 tokens x 1 x 4 bytes
        ("GPT-2 small, 1,024 tokens, fp32", GPT2Config(), 1024, 1, torch.float32, 75_497_472),
        # article B's model: 2 x 32 layers x 32 heads x 64 x 2048 x 1 x 2 bytes = 512 MiB
        ("a 32-layer model with 32 heads of 64 (article B's example), 2,048 tokens, fp16",
         _llama(2048, 32, 32, 32), 2048, 1, torch.float16, 536_870_912),
        # Llama-3.1-8B: 2 x 32 x 8 kv heads x 128 x 8192 x 4 x 2 bytes = 4 GiB
        ("Llama-3.1-8B's shape (32 layers, 32 query / 8 key-value heads), 8,192 tokens x 4, bf16",
         _llama(4096, 32, 32, 8), 8192, 4, torch.bfloat16, 4_294_967_296),
        # Gemma-2-9B: 2 x 42 x 8 x 256 (explicit; hidden 3584 / 16 heads = 224) x 2048 x 1 x 1 byte
        ("Gemma-2-9B's shape (head_dim 256 set explicitly, hidden_size/heads = 224), 2,048 tokens, "
         "int8", Gemma2Config(hidden_size=3584, num_hidden_layers=42, num_attention_heads=16,
                              num_key_value_heads=8, head_dim=256), 2048, 1, torch.int8, 352_321_536),
        ("GPT-2 small, 0 tokens", GPT2Config(), 0, 3, torch.float16, 0),
    ]


def _shape(config):
    """(layers, query heads, kv heads, head_dim, hidden/heads) read independently of kvlab.memory."""
    layers = getattr(config, "num_hidden_layers")
    heads = getattr(config, "num_attention_heads")
    kv = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size")
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return layers, heads, kv, head_dim, hidden // heads


# The usual mistakes, each as "what the wrong formula gives" from the right answer and the shape.
_MISTAKES = [
    ("no factor 2", lambda want, s, b: want // 2,
     "you count only one of the two tensors: every layer caches keys AND values, so multiply by 2"),
    ("no layer count", lambda want, s, b: want // s[0],
     "your answer is the size of ONE layer's cache (article B's formula makes this mistake): "
     "every one of the num_hidden_layers (n_layer) layers keeps its own keys and values, so "
     "multiply by the layer count"),
    ("query heads", lambda want, s, b: want // s[2] * s[1],
     "you used the number of query heads (num_attention_heads) where the key/value heads belong: "
     "with grouped-query or multi-query attention the cache holds num_key_value_heads heads "
     "(getattr(config, 'num_key_value_heads', num_attention_heads))"),
    ("fixed 2 bytes", lambda want, s, b: want // b * 2,
     "you assumed 2 bytes per element; the bytes per element depend on the dtype (4 for float32, "
     "2 for float16/bfloat16, 1 for int8): use dtype.itemsize"),
    ("hidden/heads", lambda want, s, b: want // s[3] * s[4],
     "you computed head_dim as hidden_size / num_attention_heads, but this config sets head_dim "
     "explicitly, and the model uses that value: read config.head_dim when it is set"),
]


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _call(fn, name, args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the learner's exception becomes a pointed message
        what = ", ".join(f"<{type(a).__name__}>" if hasattr(a, "model_type") else f"{a!r}"
                         for a in args)
        hint = ""
        if "finfo" in str(e) or isinstance(e, TypeError) and "int8" in what:
            hint = (" (torch.finfo only knows floating-point types; dtype.itemsize gives the "
                    "bytes per element of any dtype, int8 included)")
        raise fail(name, f"your function raised {type(e).__name__}: {e} when called with "
                         f"({what}){hint}") from e


def _as_int(value, name, what):
    if isinstance(value, (bool, float, torch.Tensor)):
        raise fail(name, f"{what}: return a Python int, got {type(value).__name__} {value!r} "
                         "(bytes and batch sizes are whole numbers: use integer arithmetic, // "
                         "not /)")
    try:
        return operator.index(value)
    except TypeError:
        raise fail(name, f"{what}: return an int, got {type(value).__name__}") from None


def _bytes_cases():
    """(label, config, seq_len, batch, dtype, bytes, how we know): measured, then hand-worked."""

    sizes = [(7, 3, torch.float32), (5, 2, torch.float16), (9, 1, torch.bfloat16),
             (6, 2, torch.float32), (4, 2, torch.float32), (3, 1, torch.bfloat16)]
    real = "measured from a real DynamicCache"
    cases = [(label, cfg, T, B, dt, measure_config(cfg, T, B, dt), real)
             for (label, cfg), (T, B, dt) in zip(_tiny_configs(), sizes)]
    label, cfg = cases[1][:2]        # the same config object again, twice the tokens: a
    cases.append((label + ", again with twice the tokens", cfg, 14, 3, torch.float32,  # remembered
                  measure_config(cfg, 14, 3, torch.float32), real))                 # answer shows
    model, _ = grading_model()       # the bundled, trained model: a real GPT-2 forward pass
    cases.append(("the bundled kvlab-tiny model", model.config, 21, 2, torch.float32,
                  measured_cache_bytes(fill_dynamic_cache(model, 21, 2, decode_steps=3)), real))
    return cases + [case + ("worked out by hand",) for case in _hand_worked()]


def _explain_bytes(cases, got_all, i) -> None:
    """Which classic mistake explains this case AND every other case? Else name the factors."""
    label, cfg, T, B, dt, want, how = cases[i]
    got = got_all[i]
    shape_b = [(_shape(c), _itemsize(d), w) for _, c, _, _, d, w, _ in cases]
    head = f"{label}, seq_len={T}, batch_size={B}, {dt}: expected {want:,} bytes ({how})"
    for _key, wrong, message in _MISTAKES:
        if wrong(want, *shape_b[i][:2]) == got and all(
                wrong(w, sh, b) == g for (sh, b, w), g in zip(shape_b, got_all)):
            raise fail(NAME, f"{head}, got {got:,}: {message}")
    layers, _, kv, head_dim, _ = _shape(cfg)
    ratio = got / want if want else float("inf")
    raise fail(NAME, f"{head} = 2 x {layers} layers x {kv} key/value heads x head_dim {head_dim} x "
                     f"{T} tokens x batch {B} x {_itemsize(dt)} bytes; you returned {got:,} "
                     f"({ratio:.4g} times that). Check each factor.")


def check_kv_cache_bytes(kv_cache_bytes) -> None:
    """Grade ``kv_cache_bytes(config, seq_len, batch_size, dtype) -> int`` against measured and
    hand-worked sizes (GPT-2, GQA, MQA, explicit / missing / None head_dim)."""
    cases = _bytes_cases()
    got_all = [_as_int(_call(kv_cache_bytes, NAME, (cfg, T, B, dt)), NAME, label)
               for label, cfg, T, B, dt, _, _ in cases]
    for i, case in enumerate(cases):
        if got_all[i] != case[5]:
            _explain_bytes(cases, got_all, i)
    passed(NAME, f"{len(cases)} configs (GPT-2, GQA, MQA, head_dim explicit/absent/None; "
                 "fp32/fp16/bf16/int8) match real DynamicCache bytes and hand-worked sizes")


def _boundaries(per, label):
    """(free_bytes, answer, what) at the fit/no-fit edges, for ``per`` bytes per unit."""
    return [(5 * per, 5, f"free_bytes holds exactly 5 {label}"),
            (5 * per - 1, 4, f"free_bytes is ONE byte short of 5 {label}"),
            (6 * per - 1, 5, f"free_bytes holds 5 {label} and almost a sixth"),
            (per - 1, 0, f"free_bytes is one byte short of a single one of the {label}"),
            (0, 0, "free_bytes is 0"),
            (1000 * per, 1000, f"free_bytes holds exactly 1000 {label}")]


def _gemma_like():
    """A config that sets head_dim explicitly (256, while hidden_size / heads = 224)."""
    from transformers import Gemma2Config

    return Gemma2Config(hidden_size=3584, num_hidden_layers=42, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=256)


def _per_unit(cfg, dt, tokens: int, batch: int, head_dim=None) -> int:
    layers, _, kv, hd, _ = _shape(cfg)
    return 2 * layers * kv * (head_dim or hd) * tokens * batch * _itemsize(dt)


def _boundary_cases(configs, per_of, labels):
    cases = []
    for label, cfg, n, dt in configs:
        per = per_of(cfg, n, dt)
        cases += [(label, cfg, n, dt, per, *b) for b in _boundaries(per, labels)]
    return cases


def _explicit_head_dim_hint(cases, answers, wrong_answer, i) -> str:
    """The hidden_size / heads mistake, named only when ``wrong_answer(case, head_dim)`` (the
    answer with that head_dim) explains every case of that config."""
    label, cfg = cases[i][:2]
    _, _, _, hd, split = _shape(cfg)
    if hd == split:
        return ""
    mine = [j for j, c in enumerate(cases) if c[0] == label]
    if len(mine) >= 2 and all(answers[j] == wrong_answer(cases[j], split) for j in mine):
        return (f": you computed head_dim as hidden_size / num_attention_heads = {split}, but this "
                f"config sets head_dim = {hd} explicitly, and the model uses that value: read "
                "config.head_dim when it is set")
    return ""


def _boundary_hint(got, want, free, per, unit="batch") -> str:
    if got == want + 1 and got == math.ceil(free / per):
        return (f": you rounded the {unit} UP. What only partly fits does not fit: round down "
                "to the whole units")
    if got == want - 1 and free % per == 0:
        return ": what fills free_bytes exactly does fit (the boundary itself counts)"
    return ": the answer is the number of whole units that fit in free_bytes"


def _grade_capacity(fn, name, cases, unit, hint_of) -> None:
    """The one loop of the two capacity graders: ``fn(config, n, dtype, free_bytes)`` on every case
    ``(label, config, n, dtype, bytes per unit, free_bytes, answer, what)``; the first wrong answer
    fails, with ``hint_of(cases, answers, i)``. ``unit``: (the argument's name, what one unit is)."""
    answers = [_as_int(_call(fn, name, (cfg, n, dt, free)), name, f"{label}, {what}")
               for label, cfg, n, dt, per, free, want, what in cases]
    for i, (label, cfg, n, dt, per, free, want, what) in enumerate(cases):
        if answers[i] != want:
            raise fail(name, f"{label}, {unit[0]}={n}, {dt}: {unit[1]} takes {per:,} bytes; {what} "
                             f"(free_bytes={free:,}), so the answer is {want}, you returned {answers[i]}"
                             + hint_of(cases, answers, i))


# (label, config, seq_len or batch_size, dtype) for each grader, built when it runs (configs are objects)
def _batch_configs():
    from transformers import GPT2Config

    return [("GPT-2 small", GPT2Config(), 1024, torch.float16),
            ("Llama-3.1-8B's shape", _llama(4096, 32, 32, 8), 8192, torch.bfloat16),
            ("a small GQA model in fp32", _llama(48, 3, 6, 2), 100, torch.float32),
            ("Gemma-2-9B's shape (head_dim 256 set explicitly; hidden_size / heads = 224)", _gemma_like(), 2048,
             torch.bfloat16)]


def _seq_configs():
    from transformers import GPT2Config, MixtralConfig

    mixtral = MixtralConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=None)
    return [("GPT-2 small (context 1,024)", GPT2Config(), 4, torch.float16),
            ("a Mixtral-style GQA config, head_dim None (context 32,768)", mixtral, 2, torch.bfloat16),
            ("Gemma-2-9B's shape, head_dim 256 set explicitly (context 8,192)", _gemma_like(), 3, torch.bfloat16)]


def _per_sequence(cfg, T, dt, hd=None):
    return _per_unit(cfg, dt, T, 1, hd)


def _per_token(cfg, B, dt, hd=None):
    return _per_unit(cfg, dt, 1, B, hd)


def check_max_batch_size(max_batch_size) -> None:
    """Grade ``max_batch_size(config, seq_len, dtype, free_bytes) -> int`` at the fit/no-fit
    boundaries, on configs with and without an explicit head_dim."""
    configs = _batch_configs()
    cases = _boundary_cases(configs, _per_sequence, "sequences' caches")

    def hint(cases, answers, i):
        wrong = lambda c, hd: c[5] // _per_sequence(c[1], c[2], c[3], hd)  # noqa: E731
        return (_explicit_head_dim_hint(cases, answers, wrong, i)
                or _boundary_hint(answers[i], cases[i][6], cases[i][5], cases[i][4]))
    _grade_capacity(max_batch_size, NAME_BATCH, cases, ("seq_len", "one sequence's cache"), hint)
    passed(NAME_BATCH, f"{len(cases)} boundary cases (exact fit, one byte short, zero fits) on "
                       f"{len(configs)} configs (one with an explicit head_dim)")


NAME_SEQ = "check_max_seq_len"


def check_max_seq_len(max_seq_len) -> None:
    """Grade ``max_seq_len(config, batch_size, dtype, free_bytes) -> int``: the longest context whose
    cache, for ``batch_size`` sequences, fits in ``free_bytes``, capped at the model's context
    (``max_position_embeddings``, which GPT-2 configs also answer to)."""
    configs = _seq_configs()
    cases = []
    for label, cfg, B, dt in configs:
        per, ctx = _per_token(cfg, B, dt), cfg.max_position_embeddings
        cases += [(label, cfg, B, dt, per, *b) for b in _boundaries(per, "tokens")[:4]]
        cases.append((label, cfg, B, dt, per, 10 * ctx * per, ctx, "free_bytes holds ten times the model's context"))

    def hint(cases, answers, i):
        if "context" in cases[i][7]:
            return ": the model cannot attend past its context; cap the answer at config.max_position_embeddings"
        wrong = lambda c, hd: min(c[5] // _per_token(c[1], c[2], c[3], hd), c[1].max_position_embeddings)  # noqa: E731
        return (_explicit_head_dim_hint(cases, answers, wrong, i)
                or _boundary_hint(answers[i], cases[i][6], cases[i][5], cases[i][4], "length"))
    _grade_capacity(max_seq_len, NAME_SEQ, cases, ("batch_size", "one token of every sequence"), hint)
    passed(NAME_SEQ, f"{len(cases)} boundary cases (exact fit, one byte short, capped at the "
                     f"context) on {len(configs)} configs (one with an explicit head_dim)")
