"""Speculative decoding (chapter 10): token for token equal to plain greedy decoding, every edge.

Near-tied logits: a verify pass computes k+1 rows in one matrix product and plain decoding one row at a
time, so in fp32 two near-tied logits could swap. These tests run both in float64, and
``test_no_near_tie_in_the_reference_runs`` checks that the closest top-two gap of the reference runs is
far above float64's rounding, so equality here is exact and any difference is a bug; the fp32 runs are
in tests/test_equivalence.py against transformers' generate.
"""

import math

import pytest
import torch

from kvlab import loading, paths
from kvlab.cache import ConcatCache, PreallocatedCache, SlidingWindowKVCache
from kvlab.pastlen import PastLenCache
from kvlab.gpt2 import GPT2, GPTConfig
from kvlab.paged_cache import PagedCache
from kvlab.specbatch import batched_speculative_generate
from kvlab.speculative import (
    HFCache, ModelDraft, PromptLookupDraft, SelfDraft, SpecStats, accept_or_resample, check_same_tokenizer,
    greedy_reference, speculative_generate, speculative_sample, verify,
)
from kvlab.static import StaticKVCache

N = 24
TEXTS = ["And God said, Let there be light: and there was light.", "In the beginning",
         "Blessed are the poor in spirit: for theirs is the kingdom of heaven."]


@pytest.fixture(scope="module")
def pair(tiny):
    """(target, nano draft, tokenizer), both hand-built, float64."""
    hf, tok = tiny
    nano = loading.load("kvlab-nano", device="cpu")[0]
    return GPT2.from_hf(hf).double(), GPT2.from_hf(nano).double(), tok


@pytest.fixture(scope="module")
def prompts(pair):
    return [pair[2](t, return_tensors="pt").input_ids for t in TEXTS]


class Scripted:
    """A draft that proposes what ``script(tokens, k)`` says (tests: all right, all wrong, ...)."""

    vocab_size = context = None

    def __init__(self, script):
        self.script, self.calls = script, []

    def start(self, tokens, max_len, target_cache=None):
        pass

    def propose(self, tokens, k, temperature=0.0, generator=None):
        self.calls.append(k)
        return self.script(tokens, k), None

    def accept(self, tokens):
        pass


def oracle(ref):
    """Proposes the reference's next k tokens: every draft accepted."""
    full = ref[0].tolist()
    return Scripted(lambda tokens, k: full[len(tokens):len(tokens) + k])


def contrarian(ref, vocab):
    """Proposes tokens the reference never takes there: every draft rejected."""
    full = ref[0].tolist() + [0] * 64
    return Scripted(lambda tokens, k: [(full[len(tokens) + i] + 1) % vocab for i in range(k)])


def caches(model, n):
    sizes = (model.config.n_layer, 1, model.config.n_head, model.config.head_dim, n)
    return {"preallocated": PreallocatedCache(*sizes, dtype=torch.float64),
            "static": StaticKVCache(*sizes, dtype=torch.float64),
            "paged": PagedCache(*sizes, dtype=torch.float64, block_size=4),
            "concat": ConcatCache(model.config.n_layer)}


def drafts(target, nano):
    return {"prompt lookup": PromptLookupDraft(), "kvlab-nano": ModelDraft(nano),
            "self 1 layer": SelfDraft(target, 1), "self 3 layers, own cache": SelfDraft(target, 3, share=False)}


@pytest.mark.parametrize("k", [1, 4])
def test_equal_to_greedy_every_draft_every_cache(pair, prompts, k):
    target, nano, _ = pair
    for ids in prompts[:2]:
        ref = greedy_reference(target, ids, N)
        for dname, draft in drafts(target, nano).items():
            for cname, cache in caches(target, ids.shape[1] + N).items():
                out, stats = speculative_generate(target, ids, N, draft, k, cache=cache)
                assert torch.equal(out, ref), (dname, cname, k)
                assert cache.seq_len == out.shape[1] - 1, "the target's cache holds all but the pending token"
                assert sum(stats.accepted) + stats.steps + 1 == N


def test_no_near_tie_in_the_reference_runs(pair, prompts):
    """The float64 equality above is exact only if no step's top two logits are within rounding of
    each other: the smallest gap over every greedy step of these runs must be far above 1e-12."""
    target, _, _ = pair
    gaps = []
    with torch.no_grad():
        for ids in prompts:
            ref = greedy_reference(target, ids, N)
            logits = target(ref[:, :-1])[0, ids.shape[1] - 1:]       # the logits behind every new token
            top2 = logits.topk(2, dim=-1).values
            gaps.append(float((top2[:, 0] - top2[:, 1]).min()))
    assert min(gaps) > 1e-9, f"a near tie in the reference runs: top-two gap {min(gaps):.2e}"


def test_transformers_target_with_dynamic_cache(tiny, pair, prompts):
    hf, _ = tiny
    hf64 = type(hf).from_pretrained(paths.TINY_DIR, dtype=torch.float64).eval()
    target, nano, _ = pair
    for ids in prompts:
        ref = greedy_reference(target, ids, N)
        for k in (1, 4):
            out, _ = speculative_generate(hf64, ids, N, ModelDraft(nano), k, cache=HFCache(hf64.config))
            assert torch.equal(out, ref), k


def test_every_draft_rejected_and_every_draft_accepted(pair, prompts):
    target, _, _ = pair
    ids = prompts[0]
    ref = greedy_reference(target, ids, N)
    out, stats = speculative_generate(target, ids, N, contrarian(ref, target.config.vocab_size), 4)
    assert torch.equal(out, ref)
    assert stats.accepted == [0] * (N - 1) and stats.alpha == 0 and stats.tokens_per_step == 1
    for k in (1, 3, 4, 7):
        out, stats = speculative_generate(target, ids, N, oracle(ref), k)
        assert torch.equal(out, ref), k
        assert stats.steps == math.ceil((N - 1) / (k + 1)), k      # k accepted + the bonus, every step
        assert all(a == d for a, d in zip(stats.accepted, stats.drafted)) and stats.alpha == 1


def test_eos_inside_a_draft(pair, prompts):
    """The reference stops after EOS; a draft that runs past it must not emit what follows."""
    target, nano, _ = pair
    ids = prompts[1]
    ref = greedy_reference(target, ids, N)[0].tolist()
    T = ids.shape[1]
    eos = ref[T + 5]                                   # a token the continuation really emits
    stop = ref.index(eos, T) + 1
    want = torch.tensor([ref[:stop]])
    assert torch.equal(greedy_reference(target, ids, N, eos_token_id=eos), want)
    for draft in (oracle(torch.tensor([ref])), ModelDraft(nano), PromptLookupDraft()):
        cache = target.new_cache(1, T + N)
        out, _ = speculative_generate(target, ids, N, draft, 6, cache=cache, eos_token_id=eos)
        assert torch.equal(out, want)
        assert cache.seq_len == out.shape[1] - 1, "drafts after EOS left in the cache"


def test_context_fills_mid_draft(pair):
    """Prompt + new tokens = the whole context: the last steps draft fewer than k, none past it."""
    target, nano, _ = pair
    ctx = target.config.n_positions
    ids = torch.randint(1, 4096, (1, ctx - 9), generator=torch.Generator().manual_seed(3))
    ref = greedy_reference(target, ids, 9)
    for draft in (oracle(ref), ModelDraft(nano), SelfDraft(target, 2)):
        out, stats = speculative_generate(target, ids, 9, draft, 6)
        assert torch.equal(out, ref)
    assert max(stats.drafted) <= 6
    cache = target.new_cache(1, ctx)
    target(ids, cache)
    with pytest.raises(ValueError, match="context"):
        verify(target, cache, ids[0].tolist() + [5], list(range(1, 10)))


def test_self_draft_shares_the_targets_cache(pair, prompts):
    target, _, _ = pair
    ids = prompts[0]
    cache = target.new_cache(1, ids.shape[1] + N)
    draft = SelfDraft(target, 2)
    out, _ = speculative_generate(target, ids, N, draft, 3, cache=cache)
    assert draft.shared and draft.cache.keys.data_ptr() == cache.keys.data_ptr()
    assert draft.cache.n_layer == 2 and draft.model.h[0] is target.h[0]
    own = SelfDraft(target, 2, share=False)
    assert torch.equal(speculative_generate(target, ids, N, own, 3)[0], out) and not own.shared


def test_the_draft_cache_never_runs_ahead(pair, prompts):
    target, nano, _ = pair
    ids, seen = prompts[2], []

    class Watched(ModelDraft):
        def accept(self, tokens):
            super().accept(tokens)
            seen.append(self.cache.seq_len <= len(tokens) - 1)

    speculative_generate(target, ids, N, Watched(nano), 4)
    assert seen and all(seen)


def test_prompt_lookup_finds_the_last_match():
    d = PromptLookupDraft(max_ngram=2)
    assert d.propose([5, 6, 7, 8, 5, 6, 9, 1, 5, 6], 3)[0] == [9, 1, 5]    # the most recent "5 6"
    assert d.propose([1, 2, 3], 3)[0] == []
    with pytest.raises(ValueError):
        PromptLookupDraft(max_ngram=0)


def test_bad_input_is_refused_before_any_work(pair, prompts, tiny):
    target, nano, tok = pair
    ids = prompts[1]
    for k in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="k"):
            speculative_generate(target, ids, 5, PromptLookupDraft(), k)
    other = GPT2(GPTConfig(vocab_size=100, n_positions=64, n_embd=32, n_layer=1, n_head=2)).double()
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(target, ids, 5, ModelDraft(other), 2)
    short = GPT2(GPTConfig(vocab_size=4096, n_positions=8, n_embd=32, n_layer=1, n_head=2)).double()
    with pytest.raises(ValueError, match="context"):
        speculative_generate(target, ids, 10, ModelDraft(short), 2)
    L = target.config.n_layer
    for cache in (SlidingWindowKVCache(L, 16), PastLenCache(ConcatCache(L))):
        with pytest.raises(ValueError, match="rewind"):
            speculative_generate(target, ids, 5, PromptLookupDraft(), 2, cache=cache)
    class Shuffled:                      # same size, two ids swapped: another tokenizer all the same
        def get_vocab(self):
            v = dict(tok.get_vocab())
            a, b = list(v)[:2]
            v[a], v[b] = v[b], v[a]
            return v

    check_same_tokenizer(tok, tok)
    with pytest.raises(ValueError, match="tokenizer"):
        check_same_tokenizer(tok, Shuffled())
    with pytest.raises(ValueError, match="temperature"):
        speculative_sample(target, ids, 5, PromptLookupDraft(), 2, temperature=0)


def test_hf_cache_rewinds_with_a_negative_count(tiny):
    hf, tok = tiny
    cache = HFCache(hf.config)
    hf(input_ids=tok("In the beginning God", return_tensors="pt").input_ids, cache=cache.inner, use_cache=True)
    n = cache.seq_len
    cache.rewind(n)                     # drop nothing: must not call crop(0), which would keep nothing
    assert cache.seq_len == n
    cache.rewind(n - 2)
    assert cache.seq_len == n - 2
    with pytest.raises(ValueError):
        cache.rewind(n)


# ---------------------------------------------------------------------------------------------------
# Speculative sampling: the output distribution is the target's

CHI2_DF5_P001 = 20.515     # chi-square critical value, 5 degrees of freedom, p = 0.001


def chi2(counts, probs):
    n = counts.sum()
    return float(((counts - n * probs) ** 2 / (n * probs)).sum())


def first_tokens(p, q, trials, seed, rule=accept_or_resample):
    """Draft from q, apply ``rule``, keep the first emitted token: its counts over ``trials`` runs."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1], dtype=torch.float64)
    for _ in range(trials):
        d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(q.shape[0])]
        counts[rule(p, q, d, g)[0]] += 1
    return counts


def broken_rule(p, q, drafted, generator=None):
    """A classic mistake: on rejection, resample from p instead of norm(max(0, p - q))."""
    for i, d in enumerate(drafted):
        if float(torch.rand((), generator=generator, dtype=p.dtype)) >= min(1.0, float(p[i, d] / q[i, d])):
            return drafted[:i] + [int(torch.multinomial(p[i], 1, generator=generator))]
    return list(drafted) + [int(torch.multinomial(p[len(drafted)], 1, generator=generator))]


def test_speculative_sampling_matches_the_target_distribution():
    """Seeded, so not flaky: 10,000 runs of the rule on a 6-token toy; the first emitted token's counts
    against the target's p by a chi-square test at p = 0.001. The same test rejects the broken rule."""
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04]] * 3, dtype=torch.float64)
    q = torch.tensor([[0.05, 0.10, 0.15, 0.20, 0.20, 0.30]] * 2, dtype=torch.float64)
    counts = first_tokens(p, q, 10000, seed=0)
    assert chi2(counts, p[0]) < CHI2_DF5_P001
    bad = first_tokens(p, q, 10000, seed=0, rule=broken_rule)
    assert chi2(bad, p[0]) > CHI2_DF5_P001 * 5


def test_speculative_sampling_with_the_real_models(pair, prompts):
    """p and q from kvlab-tiny and kvlab-nano after a real prompt (temperature 1): the first emitted
    token's counts, binned as the target's 7 likeliest tokens + the rest, against p (chi-square, 7 df)."""
    target, nano, _ = pair
    ids = prompts[0]
    with torch.no_grad():
        p0, q0 = torch.softmax(target(ids)[0, -1], -1), torch.softmax(nano(ids)[0, -1], -1)
    p, q = p0.expand(2, -1), q0[None]
    counts = first_tokens(p, q, 6000, seed=1)
    top = p0.argsort(descending=True)[:7]
    binned = torch.cat([counts[top], (counts.sum() - counts[top].sum())[None]])
    probs = torch.cat([p0[top], (1 - p0[top].sum())[None]])
    assert chi2(binned, probs) < 24.32      # 7 df, p = 0.001


def test_speculative_sample_runs_and_is_seeded(pair, prompts):
    target, nano, _ = pair
    ids = prompts[0]
    runs = [speculative_sample(target, ids, N, ModelDraft(nano), 3, 1.0, torch.Generator().manual_seed(7))
            for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][0].shape == (1, ids.shape[1] + N)
    assert isinstance(runs[0][1], SpecStats) and 0 <= runs[0][1].alpha <= 1
    out, _ = speculative_sample(target, ids, N, PromptLookupDraft(), 3, 0.7, torch.Generator().manual_seed(7))
    assert out.shape == (1, ids.shape[1] + N)


# ---------------------------------------------------------------------------------------------------
# Batched: rows accept different counts, each rewinds its own blocks


def test_batched_speculation_on_the_paged_cache(pair, prompts):
    target, nano, _ = pair
    ps = [p[0].tolist() for p in prompts]
    for make in (lambda: ModelDraft(nano), PromptLookupDraft):
        outs, log = batched_speculative_generate(target, ps, N, make, k=3, block_size=4)
        for p, o in zip(ps, outs):
            assert o == greedy_reference(target, torch.tensor([p]), N)[0].tolist()
    assert any(len(set(step.values())) > 1 for step in log), "rows never accepted different counts"
