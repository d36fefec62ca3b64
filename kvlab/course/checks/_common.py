"""Shared pieces of the graders: the grading model, fresh prompts, messages, and the guards every
generation grader uses (a private copy of the model, a record of every forward call, a refused
``model.generate``, a learner's exception wrapped with the call that raised it).

THE RULE of what a learner's code may run of kvlab (every lab states it in its first cell): a learner
writes each exercise with Python, torch and transformers. Of kvlab, their code may run only (a) the
tools, :data:`TOOL_MODULES` (loading, provenance, paths, timing, plots, progress, validate) and the
cache interface ``kvlab.cache.Cache`` (a base class a learner's cache may take), and (b) what the
exercise hands over: the objects a grader passes in (the model, the engine's scheduler and block
manager, a compiled step) and the functions a lab names as given. Nothing else of kvlab may run on
behalf of their code: not the library's answer, not its other functions or classes, however reached
(a lambda's attribute chain, a default argument, a class forwarding to the library's, a subclass
inheriting its method, the pieces assembled in an end-to-end check). It is enforced by what RUNS
(:class:`LibraryWatch`, a profiler over the whole check), not by names; every grader declares its
``given`` (and, where the exercise is to extend a library class, the ``graded`` methods the learner
must define) in ``checks/__init__.py``'s ``_RULES``. A new grader adds its line there; its tests show
the library one step removed refused and a learner's own copy of the library's code
(``tests/utils.own_copy``) accepted."""

from __future__ import annotations

import contextlib
import io
import copy
import functools
import inspect
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from kvlab.loading import load
from kvlab.reference import hf_greedy

# Prompts a learner has not seen in the notebooks (graders must not be passable by memorising).
GRADER_TEXTS = [
    "And the LORD spake unto Moses in the wilderness, saying,",
    "Behold, the days come",
    "Now when the king heard these words, he rent his clothes, and",
    "Blessed",
    "For the wages of sin is death; but the gift",
    "And it came to pass after these things, that the men of the city gathered together at the "
    "gate and said unto him, Where are they which came in to thee this night?",
]


class GraderFailure(AssertionError):
    """A grader's verdict (as opposed to an assert inside the learner's own code)."""


@functools.lru_cache(maxsize=2)
def grading_model(name: str = "kvlab-tiny"):
    """The model graders run on: the bundled one (offline, fast, deterministic), fp32, CPU."""

    torch.manual_seed(0)
    return load(name, device="cpu", dtype=torch.float32)


def fresh_prompts(tok, lengths=None) -> list[torch.Tensor]:
    """Grader prompts of several lengths, each ``[1, T]`` (lengths ``T`` from 1 up)."""
    prompts = [tok(t, return_tensors="pt").input_ids for t in GRADER_TEXTS]
    if lengths is not None:
        # plus synthetic prompts of the given lengths (token ids spread over the vocabulary)
        prompts += [synthetic(n, tok.vocab_size) for n in lengths]
    return prompts


def synthetic(n: int, vocab: int, salt: int = 11) -> torch.Tensor:
    """A ``[1, n]`` prompt of token ids spread over the vocabulary."""
    return torch.tensor([[(37 * i + salt + n) % vocab for i in range(n)]])


_REFERENCE: dict = {}


def reference_greedy(model, prompt: torch.Tensor, n: int, use_cache: bool = True) -> torch.Tensor:
    """transformers' greedy tokens for ``prompt``, memoised (graders ask for the same ones often)."""

    key = (id(model), tuple(prompt[0].tolist()), n, use_cache)
    if key not in _REFERENCE:
        _REFERENCE[key] = hf_greedy(model, prompt, n, use_cache=use_cache)
    return _REFERENCE[key]


def passed(check: str, detail: str) -> None:
    print(f"PASSED {check}: {detail}")


def fail(check: str, message: str) -> GraderFailure:
    return GraderFailure(f"{check} FAILED: {message}")


def learner_call(check: str, what: str, fn, *args, **kwargs):
    """Call the learner's ``fn``; any exception of theirs (or one raised inside transformers on their
    behalf) becomes a failure that names the call. A stub's NotImplementedError passes through."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        if not _raised_by_torch(e):
            raise                                          # a stub not filled in yet: shown as it is
        raise fail(check, f"{what} raised NotImplementedError inside torch, not your stub: {str(e)[:300]}. An "
                          "operation your code called is not available for these tensors (on the meta device "
                          "an operation that reads values, like .item() or nonzero(), cannot run): compute "
                          "with shapes and tensor operations only") from e
    except GraderFailure:
        raise
    except Exception as e:  # noqa: BLE001 - the learner's error, explained
        raise fail(check, f"{what} raised {type(e).__name__}: {e}") from e


def _raised_by_torch(e: BaseException) -> bool:
    """True when the innermost Python frame of ``e`` is torch's (or Python's), not the learner's."""
    tb, last = e.__traceback__, None
    while tb is not None:
        last, tb = tb.tb_frame, tb.tb_next
    return last is not None and os.path.abspath(last.f_code.co_filename).startswith(_THIRD)


def expect_value_error(check: str, what: str, fn, *args) -> None:
    """The contract says ``ValueError`` for this input: any other outcome is a named failure."""
    try:
        fn(*args)
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001
        raise fail(check, f"{what}: the contract asks for a ValueError naming the problem; you "
                          f"raised {type(e).__name__}: {e}") from None
    raise fail(check, f"{what} must raise ValueError (the contract), but your function returned "
                      "normally")


def check_generated_ids(check: str, out, prompt: torch.Tensor, before: torch.Tensor, n: int) -> None:
    """The shape contract of every single-prompt generator: a LongTensor ``[1, T + n]`` that starts
    with the prompt, which must not have been modified. Raises with a pointed message otherwise."""
    T = prompt.shape[1]
    if not isinstance(out, torch.Tensor):
        raise fail(check, f"return a torch.Tensor of token ids, got {type(out).__name__}")
    if not torch.equal(prompt, before):
        raise fail(check, "your function modified input_ids in place; build a new tensor instead")
    if out.dtype != torch.long:
        raise fail(check, f"token ids must be torch.long, got {out.dtype}")
    if out.dim() != 2 or out.shape[0] != 1:
        raise fail(check, f"return shape [1, T + max_new_tokens]; got {list(out.shape)}")
    L = out.shape[1]
    if L != T + n:
        head = f"prompt of {T} tokens, max_new_tokens={n}: expected {T + n} tokens, got {L}"
        if n == 0:
            raise fail(check, head + ": max_new_tokens=0 asks for no new token, return the prompt "
                                     "as it is")
        if L == n:
            raise fail(check, head + ": only the new ones. Return the prompt followed by them")
        if L in (T + n - 1, T + n + 1):
            raise fail(check, f"{head} (you generated {L - T} new tokens: an off-by-one in your "
                              "loop)")
        raise fail(check, head)
    if not torch.equal(out[:, :T].cpu(), prompt):
        raise fail(check, "the result must start with the prompt, unchanged")


def stopped_early(check: str, out, T: int, n: int, eos: int) -> None:
    """Name a generator that stops at the end-of-text id although the contract asks for exactly
    ``n`` new tokens (the grader sets a grading-only eos id that the model really predicts)."""
    if isinstance(out, torch.Tensor) and out.dim() == 2 and T < out.shape[1] < T + n \
            and int(out[0, -1]) == eos:
        raise fail(check, f"you stopped after {out.shape[1] - T} new tokens, at token {eos}, "
                          "which this model's config calls end-of-text (eos_token_id). The "
                          f"contract is exactly max_new_tokens={n} new tokens: do not stop at "
                          "end-of-text")


# ------------------------------------------------------------------------- the model a learner gets

def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               for m in model.modules())


def _config_state(model) -> dict:
    cfg, gen = model.config, getattr(model, "generation_config", None)
    return {"config.eos_token_id": cfg.eos_token_id, "config.pad_token_id": cfg.pad_token_id,
            "config.use_cache": getattr(cfg, "use_cache", None),
            "generation_config.eos_token_id": getattr(gen, "eos_token_id", None)}


def model_changes(model, reference, state: dict) -> list[str]:
    """What the learner changed on their copy ``model`` (``reference``: the untouched original;
    ``state``: the copy's config/hooks/mode as handed over)."""
    changes = []
    p, r = next(model.parameters()), next(reference.parameters())
    if p.dtype != r.dtype:
        changes.append(f"its parameters were cast from {r.dtype} to {p.dtype} (a "
                       ".half()/.to(dtype))")
    if p.device != r.device:
        changes.append(f"it was moved from {r.device} to {p.device}")
    if not changes:
        edited = [n for (n, a), b in zip(model.named_parameters(), reference.parameters())
                  if not torch.equal(a, b)]
        if edited:
            changes.append(f"weights were edited in place ({', '.join(edited[:3])})")
    if _hooks(model) != state["hooks"]:
        changes.append(f"{_hooks(model) - state['hooks']} hook(s) were left registered on it")
    if model.training != state["training"]:
        changes.append("it was switched to training mode (model.train())")
    for key, value in _config_state(model).items():
        if state["config"][key] != value:
            changes.append(f"{key} was changed from {state['config'][key]!r} to {value!r}")
    return changes


@dataclass
class Call:
    """One forward call of the learner's code, as bound to ``forward``'s signature."""

    ids: torch.Tensor | None
    mask: torch.Tensor | None
    pos: torch.Tensor | None
    cache: object
    cache_len: int | None       # get_seq_length() before the call (None: no cache passed)
    use_cache: object
    autocast: str | None = None     # the dtype torch.autocast imposed on the call, if any
    ran_in: torch.dtype | None = None   # the dtype of the logits it returned


def _autocast() -> str | None:
    """The autocast dtype in force right now (CPU or CUDA), or None."""
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            return str(torch.get_autocast_dtype(device)).replace("torch.", "")
    return None


def _cache_len(cache):
    return int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else None


class Recorder:
    """Replaces ``forward`` on the learner's copy (so ``model(...)`` and ``model.forward(...)`` are
    both seen) and records each call; ``on_call(call, k)`` may raise at the first bad one."""

    def __init__(self, model, on_call=None):
        self.inner, self.on_call = model.forward, on_call
        self.sig = inspect.signature(self.inner)
        self.calls: list[Call] = []

    def __call__(self, *args, **kwargs):
        a = self.sig.bind_partial(*args, **kwargs).arguments
        extra = a.get("kwargs", {})
        cache = next((c for c in (a.get("cache"), extra.get("past_key_values"),
                                  a.get("past_key_values")) if c is not None), None)
        take = lambda t: None if t is None else t.detach().cpu().clone()  # noqa: E731
        call = Call(take(a.get("input_ids")), take(a.get("attention_mask")),
                    take(a.get("position_ids")),
                    cache, _cache_len(cache), a.get("use_cache", extra.get("use_cache")),
                    _autocast())
        self.calls.append(call)
        if self.on_call is not None:
            self.on_call(call, len(self.calls))
        out = self.inner(*args, **kwargs)
        logits = getattr(out, "logits", None)
        call.ran_in = logits.dtype if isinstance(logits, torch.Tensor) else None
        return out


def _refuse_generate(check):
    def generate(*args, **kwargs):
        raise fail(check, "do not call model.generate: the exercise is to write the generation "
                          "loop yourself (prefill, then one forward call per step)")
    return generate


class LearnerModel:
    """A private copy of ``model`` for the learner, made once per check: ``model.generate`` refused,
    every forward call recorded, and after each case a failure that names anything the learner
    changed on it. ``case(eos_token_id)`` sets a grading-only end-of-text id for one case."""

    def __init__(self, check: str, model):
        self.check, self.reference = check, model
        self.model = copy.deepcopy(model)
        self.record = Recorder(self.model)
        self.model.forward = self.record
        self.model.generate = _refuse_generate(check)
        self.eos = model.config.eos_token_id

    @contextmanager
    def case(self, eos_token_id=None, on_call=None):
        m = self.model
        eos = self.eos if eos_token_id is None else eos_token_id
        m.config.eos_token_id = m.generation_config.eos_token_id = eos
        self.record.calls, self.record.on_call = [], on_call
        state = {"hooks": _hooks(m), "training": m.training, "config": _config_state(m)}
        yield m
        changes = model_changes(m, self.reference, state)
        if changes:
            raise fail(self.check, "your function changed the model it was given: "
                                   + "; ".join(changes)
                                   + ". Leave the model as it is (work on your own tensors)")
        dtype = next(self.reference.parameters()).dtype
        for k, c in enumerate(self.record.calls, start=1):
            if c.autocast is not None or c.ran_in not in (None, dtype):
                how = (f"under torch.autocast({c.autocast})" if c.autocast is not None else
                       f"in {c.ran_in} (its logits came back in {c.ran_in})")
                raise fail(self.check, f"forward call #{k} ran {how}: the model was given to you "
                                       f"in {dtype} and must compute in {dtype}. In lower "
                                       "precision the argmax can change (it happened not to on "
                                       "these prompts); drop the autocast / the cast")

    @property
    def calls(self):
        return self.record.calls


def grading_tokenizer(tok, eos_token_id=None):
    """A private copy of the tokenizer, optionally with a grading-only end-of-text token (so that
    the pad id and the eos id differ, and the eos id is one the model really predicts)."""
    tok = copy.deepcopy(tok)
    if eos_token_id is not None:
        tok.eos_token = tok.convert_ids_to_tokens(eos_token_id)
    return tok


def run_cases(cases, grade) -> int:
    """The one loop of every table-driven grader: ``grade(case)`` for each case, in order."""
    for case in cases:
        grade(case)
    return len(cases)


# ------------------------------------------------------------------ what every check does around it

_CHECKS_DIR = os.path.dirname(os.path.abspath(__file__))
_KVLAB_DIR = os.path.dirname(_CHECKS_DIR)


def _in_kvlab(module: str | None) -> bool:
    return bool(module) and (module == "kvlab" or module.startswith("kvlab."))


def library_origin(obj) -> str | None:
    """``"kvlab.x.name"`` when ``obj`` is (or hands straight on to) the library's own code: a kvlab
    function, class or callable object; a bound method, ``functools.partial`` or ``functools.wraps``
    wrapper of one; a class that inherits a concrete kvlab class. ``None``: the learner's own."""
    for _ in range(8):                     # peel wrappers: partial, bound method, functools.wraps
        inner = (getattr(obj, "func", None) if isinstance(obj, functools.partial)
                 else getattr(obj, "__func__", None) or getattr(obj, "__wrapped__", None))
        if inner is None:
            break
        obj = inner
    if inspect.isclass(obj):
        for klass in obj.__mro__:
            if _in_kvlab(klass.__module__) and not inspect.isabstract(klass):
                return f"{klass.__module__}.{klass.__qualname__}"
        return None
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        code = getattr(obj, "__code__", None)
        from_file = code is not None and os.path.abspath(code.co_filename).startswith(_KVLAB_DIR)
        if _in_kvlab(getattr(obj, "__module__", None)) or from_file:
            return f"{obj.__module__}.{obj.__qualname__}"
        return None
    if callable(obj) and _in_kvlab(type(obj).__module__):
        return f"{type(obj).__module__}.{type(obj).__qualname__}"
    return None


def _codes(code):
    """A code object and every function, lambda or class body defined inside it."""
    yield code
    for const in code.co_consts:
        if inspect.iscode(const):
            yield from _codes(const)


def _grader_frame(tb) -> bool:
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_CHECKS_DIR)


def _learner_frames(tb):
    """A traceback without its leading grader frames (what is left: the learner's code, and the
    library or torch code it called)."""
    while tb is not None and _grader_frame(tb):
        tb = tb.tb_next
    return tb


def _trimmed(failure: BaseException) -> BaseException:
    """``failure`` with the grader's frames cut: a learner reads their own mistake and the message,
    not the grader's source (its table of mistakes, the answer's formula). Its cause, if any, is
    the learner's own exception, trimmed to the learner's frames (and dropped if none is left)."""
    cause, seen = failure.__cause__, {id(failure)}
    while isinstance(cause, GraderFailure) and id(cause) not in seen:   # a verdict explained again
        seen.add(id(cause))
        cause = cause.__cause__
    if cause is not None:
        cause.__traceback__ = _learner_frames(cause.__traceback__)
        cause.__context__, cause.__cause__ = None, None
        if cause.__traceback__ is None:
            cause = None
    failure.__cause__, failure.__context__ = cause, None
    failure.__suppress_context__ = True
    if not isinstance(failure, GraderFailure):          # a stub's NotImplementedError: their frames
        failure.__traceback__ = _learner_frames(failure.__traceback__)
    else:
        failure.__traceback__ = None
    return failure


def grader(check=None, *, given=(), graded=None):
    """Decorate a ``check_*``: it enforces THE RULE (:class:`LibraryWatch`: of kvlab, the learner's
    code may run only the tools and ``given``; ``graded``: see :func:`refuse_handed_in`) and, when it
    fails, raises its verdict without the grader's frames in the traceback."""
    def wrap(check):
        @functools.wraps(check)
        def run(*args, **kwargs):
            __tracebackhide__ = True  # noqa: F841 - pytest and IPython hide this frame
            watch, printed = LibraryWatch(given), io.StringIO()
            try:
                refuse_handed_in(check.__name__, list(args) + list(kwargs.values()), graded)
                # what the check prints (its PASSED line) is held back until the watch has ruled:
                # a check that passes on library code it then refuses must not say PASSED first
                with watch, contextlib.redirect_stdout(printed):
                    out = check(*args, **kwargs)
                verdict = watch.verdict(check.__name__)
                if verdict is None:
                    sys.stdout.write(printed.getvalue())
                    return out
            except (GraderFailure, NotImplementedError) as e:
                # the library's code run by the learner's is the root cause of any other failure
                verdict = watch.verdict(check.__name__) or e
            except Exception as e:  # noqa: BLE001 - what was handed in broke the grading itself
                broke = fail(check.__name__, f"grading stopped on {type(e).__name__}: {e}. What "
                                             "you handed in does not follow the contract the "
                                             "exercise describes (a missing method or "
                                             "attribute, another return type?)")
                broke.__cause__ = e
                verdict = watch.verdict(check.__name__) or broke
            # The check failed: what it printed before, but its PASSED lines, is shown (your own
            # prints included). Its message, below, names the mistake and the fix; the grader's
            # own frames are cut from this traceback (what is left above is your code).
            sys.stdout.write("".join(line for line in printed.getvalue().splitlines(keepends=True)
                                     if not line.startswith("PASSED")))
            raise _trimmed(verdict)
        return run
    return wrap if check is None else wrap(check)


# ---------------------------------------------------------------- inputs, devices, values read back

def _tensor_items(args, kwargs, names):
    for i, a in enumerate(args):
        yield (names[i] if i < len(names) else f"argument #{i + 1}"), a
    yield from kwargs.items()


def call_unmodified(check: str, what: str, fn, *args, **kwargs):
    """:func:`learner_call`, then a failure naming any tensor argument the call modified in place
    (a position tensor as much as q, k, v: the caller still uses it)."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = []
    before = [(n, t, t.clone()) for n, t in _tensor_items(args, kwargs, names)
              if isinstance(t, torch.Tensor)]
    out = learner_call(check, what, fn, *args, **kwargs)
    for name, t, saved in before:
        same = (t.shape == saved.shape and t.dtype == saved.dtype) if t.device.type == "meta" \
            else t.shape == saved.shape and t.dtype == saved.dtype and torch.equal(t, saved)
        if not same:
            raise fail(check, f"{what} modified its argument {name} in place; the caller still "
                              "uses it. Compute new tensors (x + 1, not x += 1 or x.add_(1))")
    return out


def held_tensors(obj, depth: int = 2):
    """Every tensor an object holds in its attributes (directly, or in lists/tuples/dicts, nested
    ``depth`` deep), as (name, tensor)."""
    def walk(name, v, d):
        if isinstance(v, torch.Tensor):
            yield name, v
        elif d > 0 and isinstance(v, dict):
            for k, x in v.items():
                yield from walk(f"{name}[{k!r}]", x, d - 1)
        elif d > 0 and isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                yield from walk(f"{name}[{i}]", x, d - 1)
    for k, v in getattr(obj, "__dict__", {}).items():
        yield from walk(k, v, depth)


def misplaced(tensors, device: str, dtype=None) -> list[str]:
    """Names of the ``(name, tensor)`` pairs not on ``device`` (or, floating point, not ``dtype``)."""
    bad = []
    for name, t in tensors:
        if t.device.type != torch.device(device).type:
            bad.append(f"{name} on {t.device}")
        elif dtype is not None and t.is_floating_point() and t.dtype != dtype:
            bad.append(f"{name} in {t.dtype}")
    return bad


class ValueReads:
    """Counts every read of a tensor's value back into Python inside a ``with`` block: ``.item()``,
    ``int()``/``float()``/``bool()``/indexing with a tensor (the aten op ``_local_scalar_dense``),
    ``.tolist()``, ``.numpy()``, iterating over a tensor. Eager code does not mind; under
    ``torch.compile`` each is a graph break, or the value becomes a constant of the graph.
    ``what`` lists them, e.g. ``['.tolist()', 'int(tensor)']``."""

    _METHODS = {"tolist": ".tolist()", "numpy": ".numpy()", "__iter__": "iterating over a tensor",
                "item": ".item()", "__int__": "int(tensor)", "__float__": "float(tensor)",
                "__bool__": "an if on a tensor", "__index__": "slicing or indexing with a tensor"}
    _DISPATCH = "a value read back (.item(), or slicing/indexing with a tensor)"

    def __init__(self):
        self.what: list[str] = []

    def __enter__(self):
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        reads = self

        class _Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in ValueReads._METHODS:
                    reads.what.append(ValueReads._METHODS[name])
                return func(*args, **(kwargs or {}))

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    reads.what.append(ValueReads._DISPATCH)
                return func(*args, **(kwargs or {}))

        self._modes = [_Functions(), _Dispatch()]
        for m in self._modes:
            m.__enter__()
        # iterating reads no value by itself, but hands out 0-d tensors, and indexing with those
        # makes torch.compile stop (a data-dependent index): watch it too
        self._iter = torch.Tensor.__iter__

        def iterate(tensor):
            reads.what.append("iterating over a tensor")
            return self._iter(tensor)
        torch.Tensor.__iter__ = iterate
        return self

    def __exit__(self, *exc):
        torch.Tensor.__iter__ = self._iter
        for m in reversed(self._modes):
            m.__exit__(*exc)
        return False

    @property
    def count(self) -> int:
        return len(self.what)

    def named(self) -> str:
        """The ways seen, e.g. ``"int(tensor), .tolist()"`` (a read inside an op only when nothing
        more precise was seen)."""
        precise = [w for w in dict.fromkeys(self.what) if w != self._DISPATCH]
        return ", ".join(precise or list(dict.fromkeys(self.what)))


# ------------------------------------------------------------------------ diagnoses, confirmed

def confirmed(hypotheses, probes):
    """The first ``(explains, message)`` whose ``explains(probe)`` holds on EVERY probe (two or more
    inputs: one coincidence must not name a mistake), else ``None``."""
    if len(probes) < 2:
        raise ValueError("confirm a diagnosis on two or more inputs")
    for explains, message in hypotheses:
        if all(explains(p) for p in probes):
            return message
    return None


# --------------------------------------------------- the rule: what a learner's code may run of kvlab

_PACKAGE_DIR = os.path.dirname(_KVLAB_DIR)          # kvlab/ (the library); _KVLAB_DIR is kvlab/course
_PARENT_DIR = os.path.dirname(_PACKAGE_DIR)

# Modules that are tools, not answers: any learner's code may run them (loading a model, a banner,
# timing, plots, a progress bar, input checks). The graders themselves (kvlab/course) count as tools.
TOOL_MODULES = ("kvlab.loading", "kvlab.provenance", "kvlab.paths", "kvlab.timing", "kvlab.plots",
                "kvlab.progress", "kvlab.validate", "kvlab.course")


def _module_of(filename: str) -> str | None:
    path = os.path.abspath(filename)
    if not path.startswith(_PACKAGE_DIR + os.sep):
        return None
    name = os.path.relpath(path, _PARENT_DIR)[:-3].replace(os.sep, ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def _third_party_dirs() -> tuple:
    import sysconfig
    paths = sysconfig.get_paths()
    dirs = {os.path.abspath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    import tempfile
    dirs.add(os.path.join(tempfile.gettempdir(), "torchinductor_"))   # code torch generates
    return tuple(sorted(dirs))


_THIRD = _third_party_dirs()


@functools.lru_cache(maxsize=4096)
def place(filename: str) -> str:
    """Whose code a file holds: ``"library"`` (kvlab's answers), ``"tool"`` (kvlab's tools and the
    graders), ``"third"`` (Python, torch, transformers, code they generate) or ``"learner"``."""
    module = _module_of(filename)
    if module is not None:
        return "tool" if module.startswith(TOOL_MODULES) else "library"
    if filename.startswith("<"):
        return "learner" if filename.startswith(("<own copy", "<ipython")) else "third"
    return "third" if os.path.abspath(filename).startswith(_THIRD) else "learner"


# Code compiled from a string by Python's own tools, whatever namespace it runs in.
_GENERATED_THIRD = ("<timeit-src>", "<frozen ", "<eval_with_key")


def frame_place(frame) -> str:
    """Whose code a running frame holds: :func:`place` of its file, except for code compiled from a
    string (``exec``, ``eval``, what dataclasses and namedtuple generate), which has no file: that
    code belongs to the module it runs in. ``exec`` in a notebook's namespace (or in a fresh dict) is
    the learner's code, and what it calls is watched like any other line of theirs; ``exec`` in a
    kvlab module's namespace is that module's code."""
    filename = frame.f_code.co_filename
    if not filename.startswith("<") or filename.startswith(("<own copy", "<ipython") + _GENERATED_THIRD):
        return place(filename)
    module = frame.f_globals.get("__name__")
    if module is None or module == "__main__":
        return "learner"
    if _in_kvlab(module):
        return "tool" if module.startswith(TOOL_MODULES) else "library"
    file = getattr(sys.modules.get(module), "__file__", None)     # a module of the learner's, or torch's
    return place(file) if file else "third"


def _given_codes(given) -> set:
    """The code objects of ``given``: functions, classes (every method of theirs and of their kvlab
    bases), or ``(class, names)`` (every method but ``names``: the ones the exercise asks for)."""
    codes = set()
    for item in given:
        cls, minus = item if isinstance(item, tuple) else (item, ())
        if not inspect.isclass(cls):
            codes.update(_codes(inspect.unwrap(cls).__code__))
            continue
        for klass in cls.__mro__:
            if not _in_kvlab(klass.__module__):
                continue
            for name, value in vars(klass).items():
                if name in minus:
                    continue
                for f in (getattr(value, "fget", None), getattr(value, "fset", None),
                          getattr(value, "__func__", value)):
                    if inspect.isfunction(f):
                        codes.update(_codes(f.__code__))
    return codes


def _name_of(frame) -> str:
    module = _module_of(frame.f_code.co_filename) or frame.f_globals.get("__name__") or "?"
    return f"{module}.{getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)}"


class LibraryWatch:
    """THE RULE (every lab): a learner's code may run, of
    kvlab, only (a) the tools (:data:`TOOL_MODULES`), (b) what the exercise hands over (the model,
    the engine's objects, a function the lab names as given) and (c) nothing else: not the library's
    answer to the exercise, nor any other kvlab function or class. It is enforced by what RUNS, not
    by names: while active, every entry into kvlab's code is recorded when the nearest frame above
    it that is not Python's, torch's or transformers' is the learner's (a lambda, a default
    argument, a class forwarding to the library's, a call through torch), or when it runs as a
    method of an object of the learner's class (a subclass that inherits the library's method).
    ``given``: see :func:`_given_codes`."""

    def __init__(self, given=()):
        from kvlab.cache import Cache       # the one cache interface: a learner's cache may take it as a base
        self.given = _given_codes(tuple(given) + (Cache,))
        self.ran: list[tuple[str, str]] = []        # (library function, the learner's line that ran it)

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if frame_place(frame) != "library" or code in self.given:
            return
        caller = frame.f_back
        while caller is not None and frame_place(caller) == "third":
            caller = caller.f_back
        if caller is not None and frame_place(caller) == "learner":
            where = f"{caller.f_code.co_name} (line {caller.f_lineno})"
        elif code.co_argcount and code.co_varnames[0] in ("self", "cls"):
            obj = frame.f_locals.get(code.co_varnames[0])
            klass = obj if inspect.isclass(obj) else type(obj)
            if _in_kvlab(klass.__module__) or klass.__module__ in ("builtins", None):
                return
            where = f"your class {klass.__qualname__} (it inherits this method)"
        else:
            return
        if len(self.ran) < 8 and (_name_of(frame), where) not in self.ran:
            self.ran.append((_name_of(frame), where))

    def __enter__(self):
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._previous)
        return False

    def verdict(self, check: str) -> GraderFailure | None:
        if not self.ran:
            return None
        name, where = self.ran[0]
        return fail(check, f"your code ran {name}, the library's own code, from {where}. The rule of "
                           "these labs: write it yourself with Python, torch and transformers; "
                           "of kvlab, use only what the exercise hands you and the tools (loading, "
                           "provenance, timing, plots, progress, validate) -- not the library's answer, "
                           "not its other functions or classes, not through a wrapper, a subclass or a "
                           "default argument")


def refuse_handed_in(check: str, args, graded=None) -> None:
    """A kvlab function handed in (or a partial, bound method, wraps of one, a callable kvlab object)
    is refused; so is a class handed in that inherits a concrete kvlab class, except a subclass of the
    class an exercise says to extend (``graded``: {library class: names the learner must write}),
    which must define every one of those names itself."""
    graded = graded or {}
    for a in args:
        if not inspect.isclass(a):
            if callable(a) and library_origin(a) is not None:     # a function, partial, method, object
                raise fail(check, f"you handed in {library_origin(a)}, the library's own code. "
                                  "The exercise is to write it yourself")
            continue
        for base, names in graded.items():
            if issubclass(a, base):
                missing = [n for n in names if getattr(a, n, None) is getattr(base, n, None)]
                if missing:
                    raise fail(check, f"your class {a.__qualname__} does not define {', '.join(missing)} "
                                      f"itself: it inherits {base.__module__}.{base.__qualname__}'s. The "
                                      "exercise is to write it yourself")
                break
        else:
            where = library_origin(a)
            if where is not None:
                raise fail(check, f"you handed in {a.__qualname__}, built on {where}, the library's own "
                                  "class. The exercise is to write it yourself (Python and torch)")
