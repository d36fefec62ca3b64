"""The serving engine on the hand-built GPT-2: every request equals its prompt served alone, under
every policy, with preemption, prefix hits, a shared prefix and chunked prefill; each step is ONE
forward call; the run's floor prices the LM head once per row that gets logits."""

import pytest
import torch

from kvlab.paged import paged_gather
from kvlab.serving.reference import References, reference_tokens
from kvlab.servingbench import (poisson_arrivals, random_workload, reserved_vs_used, run_floor, serve, step_floor, summarize)
from kvlab.serving import Engine, Status


@pytest.fixture(scope="module")
def refs(ours):
    return References(ours)


PREFIX = [11, 22, 33, 44, 55, 66, 77]   # 7 tokens: not a whole number of blocks of 4, so copy-on-write


class CountingModel(torch.nn.Module):
    """The model, counting its forward calls."""

    def __init__(self, model):
        super().__init__()
        self.m, self.config, self.calls = model, model.config, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.m(*args, **kwargs)


@pytest.mark.parametrize("policy", [dict(), dict(admission="reserve", batching="static"),
                                    dict(admission="contiguous", max_len=40)], ids=["on-demand", "static", "contiguous"])
@pytest.mark.parametrize("gather", [None, paged_gather], ids=["one-gather", "lab-gather"])
def test_every_request_equals_its_prompt_alone(ours, refs, policy, gather):
    wl = random_workload(7, 4096, (2, 12), (1, 12), seed=3) + random_workload(4, 4096, (1, 5), (2, 9), seed=4,
                                                                              prefix=PREFIX)
    counting = CountingModel(ours)
    eng = serve(counting, wl, prefix=PREFIX, num_blocks=14, block_size=4, max_num_batched_tokens=12,
                max_num_seqs=4, gather=gather, **policy)
    assert refs.mismatches(eng) == []
    assert counting.calls == len(eng.trace.steps) + 1               # one forward per step (+ the prefix's)
    assert eng.split_steps == 0 and eng.blocks.copies > 0           # the prefix's partial block was copied
    assert max(t["tokens"] for t in eng.trace.steps) <= 12
    if not policy:
        assert eng.scheduler.preemptions > 0 and max(t["blocks_used"] for t in eng.trace.steps) == 14
    eng.close()
    assert eng.blocks.num_free == 14                                 # nothing leaked


def test_poisson_arrivals_prefix_hits_and_eos(ours, refs):
    wl = random_workload(6, 4096, (3, 9), (6, 10), seed=5, prefix=PREFIX * 2)
    eos = reference_tokens(ours, wl[0][0], 8)[3]
    eng = serve(ours, wl, arrivals=poisson_arrivals(len(wl), 50.0, seed=1), eos_token_id=eos, num_blocks=24,
                block_size=4, max_num_batched_tokens=16)
    assert refs.mismatches(eng) == []
    first = eng.seqs[0]
    assert first.output[-1] == eos and len(first.output) <= 4
    assert eng.blocks.hits > 0
    s = summarize(eng, ttft_target=10.0, tpot_target=10.0)
    assert s["finished"] == 6 and s["met"] == 1.0 and s["ttft_p50"] <= s["e2e_p50"]


def test_bad_request_inside_a_batch_costs_no_one_else(ours, refs):
    eng = Engine(ours, num_blocks=16, block_size=4)
    good = [eng.submit(p, m) for p, m in random_workload(3, 4096, (2, 6), (3, 6), seed=6)]
    with pytest.raises(ValueError, match="prompt token"):
        eng.submit([1, 4096], 3)
    with pytest.raises(ValueError, match="context"):
        eng.submit([1] * 500, 20)
    eng.run()
    assert all(s.status is Status.FINISHED for s in good) and refs.mismatches(eng) == []


def test_floor_prices_the_lm_head_per_logit_row(ours):
    one = step_floor(ours, tokens=200, logit_rows=1, keys=200, pairs=200 * 201 // 2, bandwidth=1e12, flops=1e9)
    every = step_floor(ours, tokens=200, logit_rows=200, keys=200, pairs=200 * 201 // 2, bandwidth=1e12, flops=1e9)
    head = 2 * 199 * ours.wte.weight.numel() / 1e9
    assert every - one == pytest.approx(head, rel=1e-6)
    eng = serve(ours, random_workload(3, 4096, (2, 6), (2, 4), seed=7), num_blocks=16, block_size=4)
    assert run_floor(eng, bandwidth=1e10, flops=1e11) > 0


def test_reserved_vs_used():
    rows = reserved_vs_used([5, 17, 3, 40, 9], max_len=64, batch_size=2, block_sizes=[1, 4, 16])
    used = 5 + 17 + 3 + 40 + 9
    assert rows[0]["reserved"] == 5 * 64 and rows[1]["reserved"] == 2 * 17 + 2 * 40 + 9
    assert rows[2]["reserved"] == used and rows[2]["waste"] == 0
    assert all(r["reserved"] - used < 5 * bs for r, bs in zip(rows[2:], [1, 4, 16]))


def test_reference_equals_the_naive_generator(ours):
    from kvlab.gpt2 import generate_uncached

    for prompt, m in random_workload(3, 4096, (1, 9), (1, 12), seed=8):
        naive = generate_uncached(ours, torch.tensor([prompt]), m)[0, len(prompt):].tolist()
        assert reference_tokens(ours, prompt, m) == naive


def test_rate_must_be_positive():
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="rate"):
            poisson_arrivals(4, bad)


def _counting_attention(tally):
    """The model's attention (SDPA), tallying the (query, key) pairs it scores and those its mask shows."""
    def attend(q, k, v, mask):
        b, _, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        tally["scored"] += b * T * S
        tally["visible"] += b * T * S if mask is None else int((mask == 0).expand(b, 1, T, S).sum())
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    attend.takes_mask = "additive"
    return attend


@pytest.mark.parametrize("prompt_len", [0, 48])
def test_ragged_step_scores_only_visible_pairs(ours, prompt_len):
    """The issue's mixed step: 7 decode rows at 128 cached tokens (+ a 48-token prompt). Each query scores
    its own sequence's keys only: decode rows exactly the visible pairs; a prompt chunk adds only the
    future half of its own n x n square (masked; a causal kernel's diagonal tiles compute it too). The
    old step (every query over every key of the step) scored 55 x 951 = 52,305 pairs for 2,079 visible."""
    from kvlab.servingbench import prepared_steps
    runner, decode, prefill = prepared_steps(ours, 7, 128, max(prompt_len, 1))
    work = decode + (prefill if prompt_len else [])
    tally = {"scored": 0, "visible": 0}
    want = runner.run(work)
    ours.attention_fn = _counting_attention(tally)
    try:
        assert runner.run(work) == want                       # the same tokens through the counter
    finally:
        ours.attention_fn = None
    layers = ours.config.n_layer
    visible = 7 * 129 + prompt_len * (prompt_len + 1) // 2
    assert tally["visible"] == layers * visible
    assert tally["scored"] == layers * (visible + prompt_len * (prompt_len - 1) // 2)
    ids, view, rows = runner.prepare(work)
    assert view.segments.pairs() == (visible + prompt_len * (prompt_len - 1) // 2, visible)
