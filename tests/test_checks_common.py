"""What every grader does around its checks (issue 24): the verdict without the grader's source,
the library's own code refused, inputs that must come back unmodified, values read back into
Python, and diagnoses confirmed on more than one input."""

import traceback

import pytest
import torch

from kvlab.course.checks import check_attention, check_kv_cache
from kvlab.course.checks._common import (GraderFailure, ValueReads, call_unmodified, confirmed,
                                  held_tensors, library_origin, misplaced)

from utils import attention_without_mask as no_mask, own_copy


def raises_inside(q, k, v, past_len):
    return q @ v[0, 0, :3]                                           # a shape error of the learner's


def _printed(check, impl) -> str:
    with pytest.raises(AssertionError) as err:
        check(impl)
    return "".join(traceback.format_exception(err.value))


def test_a_verdict_shows_no_grader_source():
    text = _printed(check_attention, no_mask)
    assert "no causal mask" in text
    # the table of mistakes, the reference formula, the grader's own functions: none of them
    for secret in ("_MISTAKES", "reference_attention", "_explain_attention", "lab03.py"):
        assert secret not in text, secret


def test_a_learner_error_keeps_their_frames_only():
    text = _printed(check_attention, raises_inside)
    assert "return q @ v[0, 0, :3]" in text                           # their line is shown
    assert "lab03.py" not in text and "learner_call" not in text


def test_a_broken_object_is_a_verdict_not_a_grader_crash():
    class NoSeqLen:
        def __init__(self, *args):
            pass

        def update(self, layer, k, v):
            return k, v

        def reset(self):
            pass

    with pytest.raises(GraderFailure) as err:
        check_kv_cache(NoSeqLen)
    assert "seq_len" in str(err.value)
    assert "lab03.py" not in "".join(traceback.format_exception(err.value))


def test_library_origin():
    from kvlab import cache, gpt2

    class Mine:
        pass

    assert library_origin(gpt2.attention) == "kvlab.gpt2.attention"
    assert library_origin(cache.PreallocatedCache).endswith("PreallocatedCache")
    assert library_origin(type("Sub", (cache.PreallocatedCache,), {})) is not None
    assert library_origin(__import__("functools").partial(gpt2.attention)) is not None
    assert library_origin(cache.Cache) is None                       # an abstract interface
    assert library_origin(type("Mine2", (cache.Cache,), {})) is None
    assert library_origin(Mine) is None and library_origin(no_mask) is None
    assert library_origin(own_copy(gpt2.attention)) is None


def test_call_unmodified_names_the_argument():
    def bumps_pos(x, pos):
        pos += 1
        return x

    with pytest.raises(GraderFailure, match="modified its argument pos"):
        call_unmodified("check_x", "f(x, pos)", bumps_pos, torch.ones(2), torch.tensor(3))
    assert call_unmodified("check_x", "f", lambda x, pos: x + pos, torch.ones(2), torch.tensor(3)) \
        .tolist() == [4.0, 4.0]


@pytest.mark.parametrize("read, named", [
    (lambda p: p.tolist(), ".tolist()"),
    (lambda p: p.numpy(), ".numpy()"),
    (lambda p: p.item(), ".item()"),
    (lambda p: int(p), "int(tensor)"),
    (lambda p: [s for s in p + torch.arange(2)], "iterating"),
    (lambda p: torch.zeros(8)[p:p + 2], "slicing"),
    (lambda p: 1 if p > 2 else 0, "an if on a tensor"),
])
def test_value_reads_sees_every_way_back_to_python(read, named):
    with ValueReads() as reads:
        read(torch.tensor(3))
    assert named in reads.named()


def test_value_reads_lets_tensor_code_through():
    pos = torch.tensor(3)
    with ValueReads() as reads:
        slots = pos + torch.arange(2)
        torch.zeros(8).index_copy_(0, slots, torch.ones(2))
        _ = torch.arange(8) <= slots[:, None]
    assert reads.count == 0
    assert torch.Tensor.__iter__ is not None and list(torch.arange(2)) == [0, 1]   # restored


def test_confirmed_needs_every_probe():
    hyps = [(lambda p: p > 0, "positive"), (lambda p: p % 2 == 0, "even")]
    assert confirmed(hyps, [2, 4]) == "positive"
    assert confirmed(hyps, [-2, 4]) == "even"
    assert confirmed(hyps, [-3, 5]) is None
    with pytest.raises(ValueError):
        confirmed(hyps, [2])


def test_held_tensors_and_misplaced():
    class C:
        def __init__(self):
            self.k = torch.zeros(2)
            self.layers = [[torch.zeros(1, dtype=torch.float16), torch.zeros(1)]]
            self.n = 3

    names = [n for n, _ in held_tensors(C())]
    assert names == ["k", "layers[0][0]", "layers[0][1]"]
    assert misplaced(held_tensors(C()), "cpu", torch.float32) == ["layers[0][0] in torch.float16"]
    assert misplaced(held_tensors(C()), "meta") == ["k on cpu", "layers[0][0] on cpu",
                                                    "layers[0][1] on cpu"]


def test_an_unfilled_stub_says_so():
    """A lab's stub raises NotImplementedError: every check lets it through as it is (no grader
    message dressed around it, no grader frames)."""
    from kvlab.course.checks import check_cache_bytes_prediction, check_static_cache

    class Stub:
        def __init__(self, *args):
            raise NotImplementedError("Exercise: write Stub.__init__")

    for check in (check_kv_cache, check_static_cache, lambda c: check_cache_bytes_prediction(c, 1)):
        with pytest.raises(NotImplementedError, match="Exercise: write Stub.__init__") as err:
            check(Stub)
        text = "".join(traceback.format_exception(err.value))
        assert "lab03.py" not in text and "lab08.py" not in text     # only the (hidden) wrapper


from kvlab import gpt2 as _library_gpt2  # noqa: E402
from kvlab.gpt2 import attention as _library_attention  # noqa: E402


def wraps_by_module(q, k, v, past_len):
    return _library_gpt2.attention(q, k, v, past_len)


def wraps_by_name(q, k, v, past_len):
    return (lambda: _library_attention(q, k, v, past_len))()          # even inside a lambda


class CacheWrappingTheLibrary:
    """Every method hands on to the library's cache."""

    def __init__(self, *args):
        from kvlab import cache
        self.inner = cache.PreallocatedCache(*args)

    def update(self, layer, k, v):
        return self.inner.update(layer, k, v)


def uses_an_attribute_named_like_the_library(q, k, v, past_len):
    """`.attention` as an attribute name (not the library's function) must not count."""
    holder = type("H", (), {"attention": staticmethod(no_mask)})
    return holder.attention(q, k, v, past_len)


def test_a_wrapper_around_the_library_is_refused():
    """Lab 3 keeps the rule by what runs: wrappers that name the library are refused by what they ran,
    a cache that imports it inside its code too; an attribute merely named like it is not the library."""
    assert _ran(wraps_by_module, *_QKV) == ["kvlab.gpt2.attention"]
    assert _ran(wraps_by_name, *_QKV) == ["kvlab.gpt2.attention"]
    assert _ran(uses_an_attribute_named_like_the_library, *_QKV) == []
    assert _ran(CacheWrappingTheLibrary, 1, 1, 1, 4, 2) == ["kvlab.cache.PreallocatedCache.__init__"]
    with pytest.raises(GraderFailure, match="ran kvlab.gpt2.attention, the library's own code, from wraps_by_module"):
        check_attention(wraps_by_module)


_QKV = (torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), 1)


def test_every_check_states_its_rule_and_every_lab_says_it():
    """The rule is one for every lab: each check has its line in ``_RULES`` (what the exercise hands
    over), and each lab's first cell tells the learner what their code may run of kvlab."""
    import json

    from kvlab.course import checks
    from kvlab.paths import REPO_ROOT

    assert set(checks._RULES) == set(checks.__all__)
    for path in sorted((REPO_ROOT / "solutions").glob("lab*.ipynb")):
        first = "".join(json.load(open(path))["cells"][0]["source"])
        assert "**What your code may run of kvlab (the rule of every lab).**" in first, path.name
        assert "The graders watch what runs, not names" in first, path.name


# ------------------------------------------- issue 34: the rule, enforced by what runs (LibraryWatch)

def _ran(fn, *args, given=()):
    from kvlab.course.checks._common import LibraryWatch
    with LibraryWatch(given) as watch:
        fn(*args)
    return [name for name, _ in watch.ran]


def test_the_watch_sees_the_library_one_step_removed():
    """Kind 1: a lambda's attribute chain, a default argument, composition, a subclass that inherits the
    library's method, a call through torch: each is named by what ran, whatever the names say."""
    import kvlab.paged
    from kvlab.paged import BlockAllocator, blocks_for

    pool, table = torch.randn(4, 1, 2, 3), [2, 0]
    lam = lambda: kvlab.paged.paged_gather(pool, table, 3)              # noqa: E731
    def default_arg(_g=kvlab.paged.paged_gather):
        return _g(pool, table, 3)

    class Composed:
        def __init__(self):
            self.inner = BlockAllocator(4, 2)

    class Sub(BlockAllocator):
        def num_free(self):                                         # one trivial method of its own
            return len(self.free_list) if hasattr(self, "free_list") else 0

    assert _ran(lam) == ["kvlab.paged.paged_gather"]
    assert _ran(default_arg) == ["kvlab.paged.paged_gather"]
    assert _ran(Composed)[0] == "kvlab.paged.BlockAllocator.__init__"
    sub = Sub(4, 2)                                                 # built outside the watch
    assert "kvlab.paged.BlockAllocator.allocate" in _ran(lambda: sub.allocate("s", 3))
    # through Python's own code: the library called back by contextlib on the learner's behalf
    def through_stdlib():
        import contextlib
        with contextlib.ExitStack() as stack:
            stack.callback(blocks_for, 5, 2)
    assert _ran(through_stdlib) == ["kvlab.paged.blocks_for"]


def test_the_watch_sees_code_compiled_from_a_string():
    """Kind 1, through exec: code with no file (exec, eval, what dataclasses generate) belongs to the
    namespace it runs in. exec in the learner's namespace (a notebook's __main__, a fresh dict) is the
    learner's code and its calls of the library are seen; exec in a kvlab module's namespace is that
    module's code; a dataclass of the learner's own, and one of the library's made by the grader, are
    not the learner running the library."""
    import dataclasses
    import kvlab.paged

    pool, table = torch.randn(4, 1, 2, 3), [2, 0]
    src = "def gather(pool, table, n):\n    return kvlab.paged.paged_gather(pool, table, n)\n"
    for namespace in ({"kvlab": kvlab}, {"kvlab": kvlab, "__name__": "__main__"}):
        exec(compile(src, "<string>", "exec"), namespace)  # noqa: S102 - the learner's exec
        assert _ran(lambda: namespace["gather"](pool, table, 3)) == ["kvlab.paged.paged_gather"]
    in_library = dict(vars(kvlab.paged))                 # the library's namespace: its own code
    exec(compile("def peek(pool, table, n):\n    return paged_gather(pool, table, n)\n", "<string>", "exec"),
         in_library)  # noqa: S102
    assert "kvlab.paged.peek" in _ran(lambda: in_library["peek"](pool, table, 3))
    mine = dataclasses.make_dataclass("Mine", [("n", int)])   # __init__ compiled from a string
    assert _ran(lambda: mine(3)) == []


def test_the_watch_lets_tools_given_things_and_the_graders_own_calls_through():
    """Unusual but allowed: a tool (validate, timing), what the exercise gives, a learner's own copy of the
    library's code, and the library called by the grader itself (not by the learner's code)."""
    from kvlab import validate
    from kvlab.course.checks import lab07
    from kvlab.roofline import decode_step_flops, meta_model

    model = meta_model("gpt2", torch.float32)
    assert _ran(lambda: validate.check_int(3, "n")) == []
    assert _ran(lambda: decode_step_flops(model, 2, 8), given=(decode_step_flops,)) == []
    assert _ran(lambda: own_copy(decode_step_flops)(model, 2, 8)) == []
    assert _ran(lambda: lab07._case("m", model, 2, 8)) == []       # the grader's own use of kvlab.roofline


def test_a_check_refuses_what_runs_and_names_the_line():
    """The wrapper: a refusal names the library function and the learner's function it ran from; it
    outranks any other failure the library's code caused (the root cause first)."""
    import kvlab.paged
    from kvlab.course.checks import check_paged_gather

    def sneaky(pool, block_table, seq_len):
        return getattr(kvlab.paged, "paged" + "_gather")(pool, block_table, seq_len)   # no name to read

    with pytest.raises(GraderFailure) as err:
        check_paged_gather(sneaky)
    assert "ran kvlab.paged.paged_gather" in str(err.value) and "from sneaky (line" in str(err.value)


def test_torchs_own_not_implemented_is_named_a_stubs_passes():
    """Issue 34: torch's meta-device NotImplementedError is a named failure, not passed on as a stub."""
    from kvlab.course.checks._common import learner_call

    with pytest.raises(GraderFailure, match="inside torch, not your stub"):
        learner_call("check_x", "f", lambda x: x.nonzero(), torch.ones(3, device="meta"))
    with pytest.raises(GraderFailure, match="inside torch, not your stub"):      # a second input
        learner_call("check_x", "f", lambda x: torch.unique(x), torch.ones(4, device="meta"))

    def stub(x):
        raise NotImplementedError("Exercise: write f")
    with pytest.raises(NotImplementedError, match="Exercise: write f"):
        learner_call("check_x", "f", stub, 1)


# Mentions that describe what ran (the grader's seeding, an autocast the learner's call ran under, the
# part of the handed-over block manager a mistake left behind), not a fix.
_DESCRIBES = {"torch.manual_seed(", "torch.autocast(", "self.key_of", "self.block_of", "self.preempt"}


def _grader_strings(path):
    """Every string a grader module writes into a message (docstrings aside), as (line, text)."""
    import ast

    tree = ast.parse(path.read_text())
    skip = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        parts = node.values if isinstance(node, ast.JoinedStr) else [node]
        for part in parts:
            if isinstance(part, ast.Constant) and isinstance(part.value, str) and id(part) not in skip:
                skip.add(id(part))
                yield node.lineno, part.value


def test_no_grader_message_hands_over_the_fixing_line():
    """Issue 34: a message names the mistake and the rule, not the line of code that fixes it (a slice,
    a torch call, a method of the learner's own object, index arithmetic): read from every grader."""
    from kvlab.paths import REPO_ROOT
    from utils import hands_over_code

    found = [f"{path.name}:{line}: {code} in {text[:80]!r}"
             for path in sorted((REPO_ROOT / "kvlab" / "course" / "checks").glob("*.py"))
             for line, text in _grader_strings(path) if " " in text
             for code in set(hands_over_code(text)) - _DESCRIBES]
    assert not found, "\n".join(found)
    assert hands_over_code("preempt the newest (reversed(self.running))") and hands_over_code("tokens[:-1]")
