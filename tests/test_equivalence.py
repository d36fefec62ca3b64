"""One equivalence test for the whole book: every generator, the same prompts, the same greedy tokens.

The reference is transformers' own ``generate`` (chapter 2). Every other generator of the book must give
exactly its tokens: the naive loop (chapter 1), the DynamicCache loop (2), the hand-built GPT-2 with each
cache of chapter 3 (concat, preallocated, a window wider than the text, paged memory), the static cache
eager and compiled (8), the paged cache inside the serving engine (9), and each batched generator on a
left-padded batch (6). Edges: a 1-token prompt, a cache filled to exactly max_len (and the whole
context), a prompt that ends exactly on a block boundary, a sequence that crosses one during decode.
Quantized caches are held to their stated tolerance (``kvlab.quant_cache.TOLERANCE``). Every cache kind is
rewound: generate, rewind, regenerate, same tokens. Speculative greedy decoding (chapter 10) with each
draft (prompt lookup, kvlab-nano, the target's first layers) on each cache kind it rewinds
(preallocated, static, paged, transformers' DynamicCache through ``crop``) gives the same tokens too.
"""

import pytest
import torch

from kvlab.batching import batched_generate, generate_padded, make_batch, one_by_one
from kvlab.cache import ConcatCache, PreallocatedCache, SlidingWindowKVCache
from kvlab.reference import cached_generate, hf_greedy, naive_generate
from kvlab.gpt2 import GPT2, generate, generate_uncached
from kvlab.harness import rewind_and_regenerate, rewinding_step
from kvlab.paged_cache import PagedCache
from kvlab.quant_cache import TOLERANCE, AbsmaxFakeInt8Cache, QuantizedKVCache
from kvlab.quantbench import agreement, score_through_cache
from kvlab.serving import BlockManager, Engine, Runner, Sequence
from kvlab.serving.reference import reference_tokens
from kvlab.static import StaticKVCache, StaticDecoder

N = 14   # new tokens per prompt

TEXTS = ["And God said, Let there be light: and there was light.",
         "The LORD is my shepherd; I shall not want.",
         "In the beginning"]


@pytest.fixture(scope="module")
def setup(tiny, ours):
    return (*tiny, ours)


@pytest.fixture(scope="module")
def prompts(setup):
    """(name, ids [1, T]) for three texts, a 1-token prompt, and prompts of 8 and 6 tokens (block size 4:
    one ends on a block boundary, the other crosses one during decode)."""
    _, tok, _ = setup
    ids = [tok(t, return_tensors="pt").input_ids for t in TEXTS]
    return [("text0", ids[0]), ("text1", ids[1]), ("text2", ids[2]), ("1 token", ids[0][:, :1]),
            ("8 tokens: on a block boundary", ids[1][:, :8]), ("6 tokens: crosses a block", ids[0][:, :6])]


@pytest.fixture(scope="module")
def want(setup, prompts):
    hf = setup[0]
    return {name: hf_greedy(hf, ids, N) for name, ids in prompts}


def _sizes(model, batch, max_len):
    cfg = model.config
    return cfg.n_layer, batch, cfg.n_head, cfg.head_dim, max_len


def single_prompt_generators(hf, ours):
    """name -> fn(ids [1, T], n) for every single-prompt generator of the book (caches built exactly:
    max_len = prompt + new tokens, so every prompt fills its cache to exactly max_len)."""
    L = hf.config.n_layer
    exact = lambda ids, n: _sizes(ours, 1, ids.shape[1] + n)   # noqa: E731
    return {
        "chapter 1: naive": lambda ids, n: naive_generate(hf, ids, n),
        "chapter 2: DynamicCache loop": lambda ids, n: cached_generate(hf, ids, n),
        "chapter 3: no cache": lambda ids, n: generate_uncached(ours, ids, n),
        "chapter 3: preallocated": lambda ids, n: generate(ours, ids, n, cache=PreallocatedCache(*exact(ids, n))),
        "chapter 3: concat": lambda ids, n: generate(ours, ids, n, cache=ConcatCache(L)),
        "chapter 3: window wider than the text": lambda ids, n: generate(ours, ids, n, cache=SlidingWindowKVCache(L, 512)),
        "chapter 3: sinks + window wider than the text": lambda ids, n: generate(
            ours, ids, n, cache=SlidingWindowKVCache(L, 256, sinks=4)),
        "chapter 8: static, eager": lambda ids, n: StaticDecoder(ours, max_len=ids.shape[1] + n).generate(ids, n),
        "chapter 9: paged (block 4)": lambda ids, n: generate(ours, ids, n, cache=PagedCache(*exact(ids, n), block_size=4)),
        "chapter 9: paged (block 1)": lambda ids, n: generate(ours, ids, n, cache=PagedCache(*exact(ids, n), block_size=1)),
    }


def test_every_single_prompt_generator_gives_the_reference_tokens(setup, prompts, want):
    hf, _, ours = setup
    wrong = []
    for gen_name, gen in single_prompt_generators(hf, ours).items():
        for name, ids in prompts:
            if not torch.equal(gen(ids, N), want[name]):
                wrong.append(f"{gen_name} on {name}")
    assert not wrong, f"different greedy tokens: {wrong}"


def test_static_compiled_one_graph_same_tokens(setup, prompts, want):
    """Chapter 8 compiled (aot_eager: no C++ compiler needed), one decoder for every prompt."""
    from torch._dynamo.testing import CompileCounterWithBackend

    _, _, ours = setup
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    dec = StaticDecoder(ours, max_len=64).compile(backend=counter)
    for name, ids in prompts:
        assert torch.equal(dec.generate(ids, N), want[name]), name
    assert counter.frame_count == 1


def test_the_whole_context(setup):
    """A prompt + new tokens that fill GPT-2's context exactly (n_positions), through the hand-built
    model's preallocated, static and paged caches."""
    hf, _, ours = setup
    ctx = hf.config.n_positions
    ids = torch.randint(1, hf.config.vocab_size, (1, ctx - 6), generator=torch.Generator().manual_seed(5))
    ref = hf_greedy(hf, ids, 6)
    assert torch.equal(generate(ours, ids, 6), ref)
    assert torch.equal(StaticDecoder(ours, max_len=ctx).generate(ids, 6), ref)
    assert torch.equal(generate(ours, ids, 6, cache=PagedCache(*_sizes(ours, 1, ctx), block_size=16)), ref)
    with pytest.raises(ValueError, match="context"):
        generate(ours, ids, 7)


@pytest.mark.parametrize("exact,paged", [(False, False), (True, False), (False, True), (False, None)],
                         ids=["masked-chunks", "exact-split", "paged-decode", "engine-default"])
def test_serving_engine_gives_each_prompt_its_own_tokens(setup, prompts, want, exact, paged):
    """Chapter 9: every prompt inside the engine (ragged steps, requests joining mid-run, a shared prefix
    forked), tokens equal to the prompt alone; blocks of 4 (boundaries crossed and hit); prompt chunks
    through one masked call, or through the exact split that scores the visible pairs only; decode rows
    through the gather, read in place by the paged kernel, or the engine's default (in place where the
    C++ kernel runs, gathered elsewhere)."""
    _, _, ours = setup
    eng = Engine(ours, num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=8, exact_attention=exact,
                 paged_attention=paged)
    eng.add_prefix(prompts[0][1][0, :5].tolist())      # text0 and the 6-token prompt share it
    reqs = {name: eng.submit(ids[0].tolist(), N, arrival=0.001 * i) for i, (name, ids) in enumerate(prompts)}
    eng.run()
    eng.close()
    for name, r in reqs.items():
        assert r.output == want[name][0, -N:].tolist(), name
    assert eng.blocks.num_free == 64 and eng.split_steps == 0


def test_ragged_step_by_hand(setup, prompts, want):
    """The runner alone, one ragged step at a time: two prefills in one step, then both decode, each
    query scoring its own sequence's keys only (kvlab.ragged.Segments)."""
    _, _, ours = setup
    (a_name, a), (b_name, b) = prompts[0], prompts[5]
    blocks, runner = BlockManager(32, 4, prefix_caching=False), Runner(ours, 32, 4)
    seqs = [Sequence(name, tuple(x[0].tolist()), N) for name, x in (("a", a), ("b", b))]
    for _ in range(N):
        work = []
        for s in seqs:
            runner.copy_blocks(blocks.allocate(s, s.num_tokens))
            work.append((s, s.to_compute))
        for (s, n), t in zip(work, runner.run(work)):
            s.num_computed += n
            s.append(t)
    assert [s.output for s in seqs] == [want[a_name][0, -N:].tolist(), want[b_name][0, -N:].tolist()]


def test_left_padded_batches(setup):
    """Chapter 6: transformers' batched generator, and the hand-built GPT-2 on the same left-padded batch
    through every dense cache, equal to each prompt alone."""
    hf, tok, ours = setup
    alone = one_by_one(hf, tok, TEXTS + ["In"], N)
    assert batched_generate(hf, tok, TEXTS + ["In"], N) == alone
    ids, mask, _ = make_batch(tok, TEXTS + ["In"])
    B, T = ids.shape
    L = hf.config.n_layer
    for cache in (None, ConcatCache(L), SlidingWindowKVCache(L, 512), StaticKVCache(*_sizes(ours, B, T + N)),
                  PreallocatedCache(*_sizes(ours, B, T + N))):
        assert generate_padded(ours, ids, mask, N, cache=cache).tolist() == alone, type(cache).__name__


@pytest.mark.parametrize("bits", sorted(TOLERANCE))
def test_quantized_caches_within_their_stated_tolerance(setup, bits):
    """Teacher-forced through a quantized cache against the full-precision one: top-1 agreement and KL
    within ``kvlab.quant_cache.TOLERANCE[bits]``; a residual window as long as the text is exact."""
    hf, tok, ours = setup
    ids = tok(" ".join(TEXTS * 4), return_tensors="pt").input_ids[:, :160]
    sizes = _sizes(ours, 1, ids.shape[1])
    ref = score_through_cache(ours, PreallocatedCache(*sizes), ids, 32)
    got = score_through_cache(ours, QuantizedKVCache(*sizes, bits=bits, block=16), ids, 32)
    q = agreement(ref, got, ids[:, 32:])
    tol = TOLERANCE[bits]
    assert q["agree"] >= tol["agree"] and q["kl"] <= tol["kl"], (bits, q)
    exact = QuantizedKVCache(*sizes, bits=bits, residual=ids.shape[1])   # nothing ever quantized
    assert torch.equal(generate(ours, ids[:, :20], N, cache=exact), hf_greedy(hf, ids[:, :20], N))


def rewindable_caches(model, max_len):
    """name -> a fresh cache of every kind, batch 1 (the kinds speculative decoding must rewind)."""
    L, sizes = model.config.n_layer, _sizes(model, 1, max_len)
    return {
        "preallocated": PreallocatedCache(*sizes), "concat": ConcatCache(L),
        "sliding window": SlidingWindowKVCache(L, 64), "window + sinks": SlidingWindowKVCache(L, 40, sinks=4),
        "static": StaticKVCache(*sizes), "paged (block 4)": PagedCache(*sizes, block_size=4),
        "quantized 4-bit, residual 16": QuantizedKVCache(*sizes, bits=4, block=8, residual=16),
        "absmax fake int8": AbsmaxFakeInt8Cache(*sizes),
    }


def test_rewind_every_cache_kind(setup, prompts):
    """Generate, rewind k tokens, regenerate: the same tokens again, for every cache kind."""
    _, _, ours = setup
    ids = prompts[1][1]
    for name, cache in rewindable_caches(ours, ids.shape[1] + N).items():
        first, second = rewind_and_regenerate(ours, cache, ids, N, back=4)
        assert torch.equal(first, second), name
        assert cache.seq_len == ids.shape[1] + N - 1, name


def test_rewinding_step_times_the_same_step_on_both_kinds_of_cache(setup, prompts):
    """The decode-then-rewind timer: each call is the step after the cached prefix (the last logits of
    a full forward) and leaves the cache as it found it, on a kvlab cache and on transformers'."""
    from transformers import DynamicCache

    hf, _, ours = setup
    ids, p = prompts[0][1], 8
    with torch.no_grad():
        want = hf(ids[:, :p + 1]).logits[:, -1]
        dynamic = DynamicCache(config=hf.config)
        hf(ids[:, :p], cache=dynamic, use_cache=True)
        mine = ours.new_cache(1, p + 1)
        ours(ids[:, :p], mine)
    for model, cache, length in ((hf, dynamic, dynamic.get_seq_length), (ours, mine, lambda: mine.seq_len)):
        step = rewinding_step(model, cache, ids[:, p:p + 1], p)
        first, again = step(), step()
        assert length() == p and torch.equal(first, again)
        assert torch.allclose(first, want, atol=1e-4)


def test_rewind_refuses_what_is_gone(setup, prompts):
    """A window that has dropped tokens, or quantized blocks, cannot be rewound exactly: a clear error."""
    _, _, ours = setup
    ids = prompts[0][1]
    L, sizes = ours.config.n_layer, _sizes(ours, 1, ids.shape[1] + N)
    narrow = SlidingWindowKVCache(L, 4)
    generate(ours, ids, N, cache=narrow)
    with pytest.raises(ValueError, match="dropped"):
        narrow.rewind(narrow.seq_len - 2)
    quant = QuantizedKVCache(*sizes, bits=4, block=4)
    generate(ours, ids, N, cache=quant)
    with pytest.raises(ValueError, match="quantized"):
        quant.rewind(2)
    with pytest.raises(ValueError, match="between 0 and"):
        PreallocatedCache(*sizes).rewind(3)


def test_reference_tokens_is_chapter_3(setup, prompts, want):
    _, _, ours = setup
    for name, ids in prompts:
        assert reference_tokens(ours, ids[0].tolist(), N) == want[name][0, -N:].tolist()


def test_serving_features_sampling_stop_n_and_preemption_with_prefix_caching(setup, prompts):
    """Chapter 9's engine, with what servers offer: per-request sampling with a seed (the same tokens as the
    uncached sampler with the same generator), stop tokens, n > 1 samples forked from the prompt's blocks
    (copy-on-write), and preemption with prefix caching on (the recompute finds the victim's own blocks)."""
    from kvlab.serving import SamplingParams
    from kvlab.serving.reference import reference_tokens, sampled_reference
    _, _, ours = setup
    eng = Engine(ours, num_blocks=14, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    hot = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7, n=3)
    text0 = prompts[0][1][0].tolist()
    multi = eng.submit(text0, 10, sampling=hot)
    greedy = [eng.submit(ids[0].tolist(), N) for _, ids in prompts[1:4]]
    first = reference_tokens(ours, prompts[4][1][0].tolist(), N)
    stop = eng.submit(prompts[4][1][0].tolist(), N, sampling=SamplingParams(stop=(first[3],)))
    eng.run()
    samples = [multi] + [eng.seqs[(multi.rid, i)] for i in (1, 2)]
    for i, s in enumerate(samples):
        assert s.output == sampled_reference(ours, text0, 10, hot, offset=i), i
    assert len({tuple(s.output) for s in samples}) > 1                 # three samples, not one copied
    for (_, ids), s in zip(prompts[1:4], greedy):
        assert s.output == reference_tokens(ours, ids[0].tolist(), N)
    assert stop.output == first[:first.index(first[3]) + 1]            # ends on its stop token
    assert eng.blocks.copies >= 1 and eng.scheduler.preemptions >= 1
    assert any(s.preemptions and s.cached_tokens for s in eng.seqs.values())   # a recompute found its blocks


def speculative_drafts(hf_ours):
    from kvlab import loading
    from kvlab.speculative import ModelDraft, PromptLookupDraft, SelfDraft

    nano = GPT2.from_hf(loading.load("kvlab-nano", device="cpu")[0])
    return {"prompt lookup": PromptLookupDraft(), "kvlab-nano": ModelDraft(nano),
            "self-draft (2 layers)": SelfDraft(hf_ours, 2)}


@pytest.mark.parametrize("k", [1, 4])
def test_speculative_greedy_every_draft_every_cache(setup, prompts, want, k):
    """Chapter 10: draft k, verify in one forward, rewind every cache: the reference's tokens, for each
    draft and each cache kind (the hand-built model's three, and transformers' own model with its
    DynamicCache, rewound by ``crop(-count)``)."""
    from kvlab.speculative import HFCache, speculative_generate

    hf, _, ours = setup
    wrong = []
    for draft_name, draft in speculative_drafts(ours).items():
        for name, ids in prompts:
            n = ids.shape[1] + N
            runs = {"preallocated": (ours, None), "static": (ours, StaticKVCache(*_sizes(ours, 1, n))),
                    "paged (block 4)": (ours, PagedCache(*_sizes(ours, 1, n), block_size=4)),
                    "transformers DynamicCache": (hf, HFCache(hf.config))}
            for cache_name, (model, cache) in runs.items():
                out, _ = speculative_generate(model, ids, N, draft, k, cache=cache)
                if not torch.equal(out, want[name]):
                    wrong.append(f"{draft_name} on {cache_name}, {name}")
    assert not wrong, f"different greedy tokens (k={k}): {wrong}"


# ---------------------------------------------------------------------------------------------------
# Chapter 11: caches shrunk by design. Each variant is a different model, so its reference is itself
# without a cache (the window: the same model with a banded mask over the whole text).


def band_attention(window, sinks):
    """The uncached reference of a window with sinks: every query of an unpadded text (positions =
    indices) sees the sinks and the ``window`` positions ending at its own."""
    import torch.nn.functional as F

    def fn(q, k, v, mask):
        i, j = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask & ((j > i - window) | (j < sinks)))
    fn.takes_mask = True
    return fn


def test_gqa_every_group_count_and_method_cached_equals_uncached(setup, prompts):
    """Every group count x every conversion: the preallocated cache (n_kv heads stored) gives the
    uncached tokens; both expansions of the shared heads, and a paged cache, on the smallest count."""
    from kvlab import gqa

    hf, tok, ours = setup
    calib = tok(" ".join(TEXTS * 6), return_tensors="pt").input_ids
    chosen = [prompts[0], prompts[3], prompts[5]]                 # a text, 1 token, a block crossed
    for n_kv in gqa.group_counts(ours.config.n_head):
        for method in gqa.METHODS:
            model = gqa.convert(ours, n_kv, method, calib)
            for name, ids in chosen:
                want = generate_uncached(model, ids, N)
                assert torch.equal(generate(model, ids, N), want), (n_kv, method, name)
                if n_kv == 1 and method == "pca":
                    native = gqa.convert(ours, n_kv, method, calib, expand="native")
                    assert torch.equal(generate(native, ids, N), want), (n_kv, method, name, "native")
                    paged = PagedCache(ours.config.n_layer, 1, n_kv, ours.config.head_dim, ids.shape[1] + N, block_size=4)
                    assert torch.equal(generate(model, ids, N, cache=paged), want), (n_kv, method, name, "paged")


@pytest.mark.parametrize("window,sinks", [(1, 0), (1, 1), (5, 0), (5, 3), (12, 4), (64, 2)])
def test_sink_window_cached_equals_banded_uncached(setup, window, sinks):
    """Decode steps and chunks of every size (a chunk needs window - 1 + k keys) give the banded model's logits."""
    from kvlab.window import SinkWindowKVCache

    hf, tok, ours = setup
    ids = tok(" ".join(TEXTS * 2), return_tensors="pt").input_ids[:, :48]
    banded = GPT2.from_hf(hf, attention_fn=band_attention(window, sinks))
    ref = banded(ids)
    for chunk in (1, 2, 5, window, 48):
        cache = SinkWindowKVCache(ours.config.n_layer, window, sinks)
        got = torch.cat([ours(ids[:, i:i + chunk], cache) for i in range(0, 48, chunk)], dim=1)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=f"chunk {chunk}")
        assert cache.held == min(48, sinks + window - 1) and cache.seq_len == 48
    for _, prompt in [("short", ids[:, :3]), ("long", ids[:, :30])]:
        assert torch.equal(generate(ours, prompt, N, cache=SinkWindowKVCache(ours.config.n_layer, window, sinks)),
                           generate_uncached(banded, prompt, N))


def test_latent_every_rank_cached_equals_uncached_both_forms(setup, prompts):
    from kvlab import latent

    hf, tok, ours = setup
    calib = tok(" ".join(TEXTS * 6), return_tensors="pt").input_ids
    C = ours.config.n_embd
    for rank in (1, C // 4, C // 2, C):
        for method in latent.METHODS:
            rebuilt = latent.convert(ours, rank, method, calib)
            absorbed = latent.convert(ours, rank, method, calib, absorb=True)
            for name, ids in (prompts[0], prompts[3]):
                want = generate_uncached(rebuilt, ids, N)
                assert torch.equal(generate(rebuilt, ids, N), want), (rank, method, name)
                assert torch.equal(generate(absorbed, ids, N), want), (rank, method, name, "absorbed")
