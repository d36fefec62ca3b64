"""Continuous and static batching on the paged cache: every request equals its prompt served alone."""

import pytest
import torch

from kvlab.gpt2 import GPT2
from kvlab.paged import paged_gather
from kvlab.serving import (Engine, random_workload, reference_tokens, reserved_vs_used, run_floor, serve,
                           summary)


@pytest.fixture(scope="module")
def model(tiny):
    return GPT2.from_hf(tiny[0])


PREFIX = [11, 22, 33, 44, 55, 66, 77]   # 7 tokens: not a whole number of blocks of 4, so copy-on-write


def _check_all(model, eng):
    for r in eng.finished:
        assert r.tokens == reference_tokens(model, r.prompt, r.max_new_tokens, r.eos_token_id), r.rid


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("gather", [None, paged_gather], ids=["batched", "plain"])
def test_every_request_equals_its_prompt_alone(model, policy, gather):
    wl = random_workload(7, 4096, (2, 12), (1, 12), seed=3) + random_workload(4, 4096, (1, 5), (2, 9), seed=4,
                                                                              prefix=PREFIX)
    eng = serve(model, wl, num_blocks=30, block_size=4, policy=policy, max_batch=4, prefix=PREFIX, gather=gather)
    assert len(eng.finished) == len(wl)
    _check_all(model, eng)
    assert eng.cache.copies > 0                                   # the prefix's partial block was copied
    assert max(t["blocks_used"] for t in eng.trace) <= 30
    assert max(t["rows"] for t in eng.trace) <= 4
    eng.close()
    assert eng.cache.blocks_used == 0                             # nothing leaked


def test_requests_joining_mid_run_and_eos(model):
    eng = Engine(model, num_blocks=16, block_size=2, max_batch=3)
    first = [eng.submit(p, m) for p, m in random_workload(3, 4096, (3, 9), (6, 10), seed=5)]
    for _ in range(4):
        eng.step()
    prompt = first[0].prompt
    eos = reference_tokens(model, prompt, 8)[4]                   # a token the model will produce
    late = eng.submit(prompt, 8, eos_token_id=eos)
    eng.run()
    assert late.tokens[-1] == eos and len(late.tokens) <= 5
    _check_all(model, eng)
    assert any(t["queued"] for t in eng.trace) or len(eng.finished) == 4
    assert eng.cache.blocks_used == 0


def test_continuous_keeps_the_batch_fuller_than_static(model):
    wl = random_workload(8, 4096, (2, 6), (1, 16), seed=6)
    runs = {p: serve(model, wl, num_blocks=64, block_size=4, policy=p, max_batch=4) for p in ("continuous", "static")}
    s = {p: summary(e) for p, e in runs.items()}
    assert s["continuous"]["steps"] < s["static"]["steps"]       # step counts are deterministic
    assert s["continuous"]["mean_occupancy"] > s["static"]["mean_occupancy"]
    assert run_floor(runs["static"], bandwidth=1e10, flops=1e11) > 0


def test_prefix_sharing_uses_fewer_blocks(model):
    wl = random_workload(4, 4096, (1, 4), (2, 4), seed=7, prefix=PREFIX * 3)
    peak = {}
    for share in (True, False):
        eng = serve(model, wl, num_blocks=60, block_size=4, max_batch=4, prefix=PREFIX * 3, prefix_sharing=share)
        _check_all(model, eng)
        peak[share] = max(t["blocks_used"] for t in eng.trace)
    assert peak[True] < peak[False]


def test_bad_requests_are_refused(model):
    eng = Engine(model, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="add blocks"):
        eng.submit([1, 2, 3], 20)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.submit([1], 0)
    with pytest.raises(ValueError, match="policy"):
        Engine(model, 4, 4, policy="fifo")


def test_reserved_vs_used():
    rows = reserved_vs_used([5, 17, 3, 40, 9], max_len=64, batch_size=2, block_sizes=[1, 4, 16])
    used = 5 + 17 + 3 + 40 + 9
    assert rows[0]["reserved"] == 5 * 64 and rows[1]["reserved"] == 2 * 17 + 2 * 40 + 9
    assert rows[2]["reserved"] == used and rows[2]["waste"] == 0
    assert all(r["reserved"] - used < 5 * bs for r, bs in zip(rows[2:], [1, 4, 16]))


def test_reference_equals_the_naive_generator(model):
    from kvlab.gpt2 import generate_uncached

    for prompt, m in random_workload(3, 4096, (1, 9), (1, 12), seed=8):
        naive = generate_uncached(model, torch.tensor([prompt]), m)[0, len(prompt):].tolist()
        assert reference_tokens(model, prompt, m) == naive
