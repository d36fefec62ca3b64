"""A ragged step's attention (kvlab.ragged): the exact split scores the visible pairs and nothing else,
and every path (decode batches, a masked chunk, the exact split) equals the readable per-sequence
reference. Tolerance: fp32 on the CPU, 2e-5 absolute on attention outputs of order 1 (a log-sum-exp
merge sums in another order than one softmax; nothing else differs)."""

import pytest
import torch
import torch.nn.functional as F

from kvlab.cache import visible
from kvlab.gpt2 import masked_attention
from kvlab.ragged import causal_chunk, merge_into, partial_attention
from kvlab.servingbench import prepared_steps

ATOL = 2e-5


def _masked(q, k, v, start):
    n = q.shape[-2]
    seen = visible(torch.arange(start, start + n)[None], torch.arange(start + n)[None, None])[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 48, 64])
@pytest.mark.parametrize("start", [0, 1, 7, 100])
def test_causal_chunk_scores_the_visible_pairs_and_equals_one_masked_call(n, start):
    g = torch.Generator().manual_seed(n * 1000 + start)
    q, k, v = (torch.randn(1, 4, m, 16, generator=g) for m in (n, start + n, start + n))
    tally = [0]
    got = causal_chunk(q, k, v, start, tally)
    assert tally[0] == n * start + n * (n + 1) // 2          # the one rule's count, and no more
    assert (got - _masked(q, k, v, start)).abs().max() < ATOL


def test_merge_of_two_parts_is_attention_over_both():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 3, 11, 8, generator=g), torch.randn(2, 3, 11, 8, generator=g)
    q = q / 8 ** 0.5
    out, lse = partial_attention(q, k[..., :4, :], v[..., :4, :])
    merge_into(out, lse, *partial_attention(q, k[..., 4:, :], v[..., 4:, :]))
    assert (out - F.scaled_dot_product_attention(q * 8 ** 0.5, k, v)).abs().max() < ATOL


def test_causal_chunk_in_half_precision_keeps_its_dtype():
    q, k, v = (torch.randn(1, 2, m, 8).to(torch.bfloat16) for m in (6, 10, 10))
    got = causal_chunk(q, k, v, 4)
    assert got.dtype == torch.bfloat16
    assert (got.float() - _masked(q.float(), k.float(), v.float(), 4)).abs().max() < 2e-2


def _pools_after(runner, work):
    """Run the step once (its keys into the pool), then return its segments and layer 0's pools."""
    runner.run(work)
    _, view, _ = runner.prepare(work)
    return view.segments, runner.keys[0], runner.values[0]


@pytest.mark.parametrize("exact,paged", [(True, False), (False, False), (True, True)],
                         ids=["exact", "masked-chunk", "exact-paged-decode"])
def test_mixed_step_with_a_cached_prefix_equals_the_reference(ours, exact, paged):
    """7 decode rows at 128 cached tokens and a 48-token chunk after a 32-token
    cached prefix: the fast path equals the per-sequence reference; with ``exact`` the step scores
    exactly the pairs the one rule lets through, counted as the step runs, in every layer."""
    runner, decode, prefill = prepared_steps(ours, 7, 128, 48, cached=32, exact=exact, paged=paged)
    work = decode + prefill
    segs, K, V = _pools_after(runner, work)
    q = torch.randn(1, ours.config.n_head, segs.n_tokens, ours.config.head_dim, generator=torch.Generator().manual_seed(1))
    fast = segs.attend(q, K, V, masked_attention, True)
    ref = segs.reference(q, K, V, masked_attention, True)
    assert (fast - ref).abs().max() < ATOL
    visible_pairs = 7 * 129 + 48 * 32 + 48 * 49 // 2
    scored = visible_pairs if exact else visible_pairs + 48 * 47 // 2
    assert segs.pairs() == (scored, visible_pairs)
    assert segs.scored[0] == scored                           # counted while attend ran, one layer
    segs.scored[0] = 0
    ids, view, rows = runner.prepare(work)
    with torch.no_grad():
        ours(ids, cache=view, select=rows)
    assert view.segments.scored[0] == ours.config.n_layer * scored


def test_exact_and_masked_runners_give_the_same_tokens(ours):
    runs = {}
    for exact in (False, True):
        runner, decode, prefill = prepared_steps(ours, 5, 40, 23, cached=9, exact=exact)
        runs[exact] = runner.run(decode + prefill)
    assert runs[False] == runs[True]


def test_a_decode_row_of_its_own_length_and_a_lone_chunk(ours):
    """Decode rows of three lengths (three batches) and a chunk without a prefix: each equals the reference."""
    runner, decode, prefill = prepared_steps(ours, 3, 20, 5, exact=True)
    decode[1][0].num_computed -= 1          # row 1 now runs its last two tokens: a chunk of 2 at position 19
    decode[1] = (decode[1][0], 2)
    segs, K, V = _pools_after(runner, decode + prefill)
    q = torch.randn(1, ours.config.n_head, segs.n_tokens, ours.config.head_dim)
    assert (segs.attend(q, K, V, masked_attention, True) - segs.reference(q, K, V, masked_attention, True)).abs().max() < ATOL
    assert segs.pairs()[0] == segs.pairs()[1]


def test_paged_decode_reads_the_blocks_in_place_and_equals_the_gather(ours):
    """Decode rows of two lengths through the compiled kernel that reads keys through the block table
    (no copy): the same outputs as the gather + the model's attention, the same tokens from a whole
    step, and exactly the visible pairs scored. Then the kernel's fallback: a compile failure is warned
    once and the kernel's eager twin answers; later steps use the gather."""
    import warnings

    from kvlab import ragged
    if not ragged.PAGED_DECODE.usable("cpu"):
        pytest.skip("no C++ compiler here: the fallback test below still runs")
    runs = {}
    for paged in (False, True):
        runner, decode, prefill = prepared_steps(ours, 6, 37, 9, cached=3, paged=paged)
        decode[2][0].num_computed -= 1          # one row runs two tokens: three groups in all
        decode[2] = (decode[2][0], 2)
        runs[paged] = runner.run(decode + prefill)
        segs, K, V = _pools_after(runner, decode + prefill)
        q = torch.randn(1, ours.config.n_head, segs.n_tokens, ours.config.head_dim,
                        generator=torch.Generator().manual_seed(3))
        assert (segs.attend(q, K, V, masked_attention, True) - segs.reference(q, K, V, masked_attention, True)).abs().max() < ATOL
    assert runs[False] == runs[True]


def test_paged_decode_falls_back_and_warns_when_compile_fails(monkeypatch):
    from kvlab import ragged

    from torch._inductor.exc import CppCompileError

    def broken(*a):                          # what inductor raises on a machine whose g++ fails
        raise CppCompileError(["g++", "kernel.cpp"], "g++: fatal error: no input files")

    from kvlab import pagedkernel
    monkeypatch.setattr(pagedkernel, "usable", lambda q, pool: False)   # inductor's path is the one tested here
    kernel = ragged.PagedDecode()
    kernel.fn = broken
    g = torch.Generator().manual_seed(0)
    pool_k, pool_v = torch.randn(6, 2, 4, 8, generator=g), torch.randn(6, 2, 4, 8, generator=g)
    q, tables = torch.randn(2, 2, 1, 8, generator=g), torch.tensor([[4, 1], [0, 5]])
    with pytest.warns(UserWarning, match="could not build the paged decode kernel"):
        got = kernel(q, pool_k, pool_v, tables, 7)
    k = pool_k[tables].transpose(1, 2).reshape(2, 2, 8, 8)[:, :, :7]
    v = pool_v[tables].transpose(1, 2).reshape(2, 2, 8, 8)[:, :, :7]
    assert (got - F.scaled_dot_product_attention(q, k, v)).abs().max() < ATOL
    assert not kernel.usable("cpu")             # from now on the caller gathers

    def other(*a):
        raise KeyError("a real bug")            # not a compile failure: never swallowed
    fresh = ragged.PagedDecode()
    fresh.fn = other
    with pytest.raises(KeyError):
        fresh(q, pool_k, pool_v, tables, 7)

    class CompileLookalike(RuntimeError):   # a name that contains "Compile" is not a compile failure
        pass

    def lookalike(*a):
        raise CompileLookalike("a bug of ours")
    third = ragged.PagedDecode()
    third.fn = lookalike
    with pytest.raises(CompileLookalike):
        third(q, pool_k, pool_v, tables, 7)
    assert third.broken is None



@pytest.mark.parametrize("b, H, bs, D, length", [(2, 2, 4, 8, 7), (3, 4, 16, 64, 257), (1, 1, 4, 8, 1),
                                                 (5, 3, 8, 16, 16), (4, 2, 16, 32, 33)])
def test_the_cpp_kernel_reads_in_place_what_the_gather_reads(b, H, bs, D, length):
    """kvlab.pagedkernel against the gather and the model's attention: tables out of id order, a last
    block partly used, one key, a length at a block boundary; float32 within the gathered path's ATOL."""
    from kvlab import pagedkernel

    g = torch.Generator().manual_seed(b * 100 + length)
    width = -(-length // bs)
    nb = b * width + 2
    pool_k, pool_v = torch.randn(nb, H, bs, D, generator=g), torch.randn(nb, H, bs, D, generator=g)
    tables = torch.randperm(nb, generator=g)[:b * width].view(b, width)
    q = torch.randn(b, H, 1, D, generator=g)
    if not pagedkernel.usable(q, pool_k):
        pytest.skip("no C++ compiler here: the kernel is not used either")
    got = pagedkernel.paged_decode(q, pool_k, pool_v, tables, length)
    k = pool_k[tables].transpose(1, 2).reshape(b, H, width * bs, D)[:, :, :length]
    v = pool_v[tables].transpose(1, 2).reshape(b, H, width * bs, D)[:, :, :length]
    assert got.shape == (b, H, 1, D) and (got - F.scaled_dot_product_attention(q, k, v)).abs().max() < ATOL


def test_the_cpp_kernel_is_used_only_where_it_can_run_and_a_failed_build_falls_back(monkeypatch):
    from kvlab import pagedkernel, ragged

    q, pool = torch.randn(1, 1, 1, 8), torch.randn(2, 1, 4, 8)
    assert not pagedkernel.usable(q.double(), pool.double())          # float32 only
    assert not pagedkernel.usable(q.bfloat16(), pool.bfloat16())
    with pytest.raises(ValueError, match="one query per row"):
        pagedkernel.paged_decode(torch.randn(1, 1, 2, 8), pool, pool, torch.tensor([[0, 1]]), 5)
    with pytest.raises(ValueError, match="at most width x block_size = 8"):
        pagedkernel.paged_decode(q, pool, pool, torch.tensor([[0, 1]]), 9)
    with pytest.raises(ValueError, match="float32 tensors on the CPU; got q torch.float64"):
        pagedkernel.paged_decode(q.double(), pool.double(), pool.double(), torch.tensor([[0, 1]]), 5)
    with pytest.raises(ValueError, match="must agree"):
        pagedkernel.paged_decode(torch.randn(1, 2, 1, 8), pool, pool, torch.tensor([[0, 1]]), 5)

    def no_compiler():
        raise RuntimeError("Error building extension 'kvlab_paged_decode'")
    monkeypatch.setattr(pagedkernel, "_module", no_compiler)
    monkeypatch.setitem(pagedkernel._BUILT, "failed", None)
    monkeypatch.setitem(pagedkernel._BUILT, "compiler", True)
    g = torch.Generator().manual_seed(3)
    pool_k, pool_v = torch.randn(6, 2, 4, 8, generator=g), torch.randn(6, 2, 4, 8, generator=g)
    q, tables = torch.randn(2, 2, 1, 8, generator=g), torch.tensor([[4, 1], [0, 5]])
    kernel = ragged.PagedDecode()
    kernel.fn = ragged.paged_decode                                    # eager: no compile in this test
    with pytest.warns(UserWarning, match="C\\+\\+ paged decode kernel could not be built"):
        got = kernel(q, pool_k, pool_v, tables, 7)
    k = pool_k[tables].transpose(1, 2).reshape(2, 2, 8, 8)[:, :, :7]
    v = pool_v[tables].transpose(1, 2).reshape(2, 2, 8, 8)[:, :, :7]
    assert (got - F.scaled_dot_product_attention(q, k, v)).abs().max() < ATOL
    assert not pagedkernel.usable(q, pool_k)                         # never tried again in this process


def test_the_default_reads_in_place_where_the_cpp_kernel_runs_and_a_learners_gather_is_kept(ours, monkeypatch):
    """paged=None (the engine's default): decode rows go through kvlab.pagedkernel on a float32 CPU
    model with a compiler; paged=False and a learner's gather never do; the tokens are the same."""
    from kvlab import pagedkernel
    from kvlab.paged import paged_gather
    from kvlab.serving import EngineConfig

    if not pagedkernel.usable(torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.float32)):
        pytest.skip("no C++ compiler here: the default gathers, as paged=False does")
    calls, real = [], pagedkernel.paged_decode
    monkeypatch.setattr(pagedkernel, "paged_decode", lambda *a: calls.append(a[4]) or real(*a))
    tokens = {}
    for name, kw in {"default": {}, "gather": {"paged": False}, "learner": {"gather": paged_gather}}.items():
        calls.clear()
        runner, decode, _ = prepared_steps(ours, 3, 21, 1, block_size=4, **kw)
        tokens[name] = runner.run(decode)
        assert (len(calls) == ours.config.n_layer) == (name == "default"), (name, calls)
    assert tokens["default"] == tokens["gather"] == tokens["learner"]
    with pytest.raises(ValueError, match="paged_attention must be True, False or None"):
        EngineConfig(8, paged_attention="yes")
