"""kvlab.floorbench: chapter 7's plumbing. Timings are run, never asserted."""

import pytest
import torch

from kvlab import floorbench as fb
from kvlab import gpt2, roofline


@pytest.fixture(scope="module")
def ours(tiny):
    return gpt2.GPT2.from_hf(tiny[0])


def test_step_fn_repeats_the_same_step(tiny, ours):
    hf, _ = tiny
    for model in (hf, ours):
        step = fb.step_fn(model, 2, 5)
        a, b = step(), step()
        logits = lambda out: out if isinstance(out, torch.Tensor) else out.logits
        assert torch.equal(logits(a), logits(b)), type(model).__name__   # the cache was rewound
    # transformers and the hand-built model compute the same step
    ids = torch.randint(0, hf.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    cache = ours.new_cache(2, max_len=6)
    ours(ids[:, :5], cache)
    assert torch.allclose(ours(ids[:, 5:], cache, last_only=True)[:, -1], hf(ids).logits[:, -1], atol=1e-4)


def test_profile_step_splits_the_wall_time(ours):
    b = fb.profile_step(ours, 1, 8, steps=2)
    parts = sum(v for k, v in b.items() if k != "wall")
    assert b["wall"] > 0 and b["matrix products"] > 0
    assert parts == pytest.approx(b["wall"], rel=1e-6) or parts > b["wall"]   # gaps are never negative
    kind, share = fb.dominant(b)
    assert kind in b and 0 < share <= 1


def test_generators_vs_floor_rows(tiny, ours):
    rows = fb.generators_vs_floor(tiny[0], 4, 3, threads_list=(None,), repeats=1, ours=ours)
    assert [r["generator"] for r in rows] == list(fb.GENERATORS)
    for r in rows:
        assert r["ratio"] == pytest.approx(r["per_token"] / r["floor_per_token"])


def test_article_a_against_the_rtx3090_floor():
    a = fb.article_rows()[0]
    # 354,823,168 fp32 parameters read per token at 936 GB/s: about 1.5 ms; 26.1 ms measured
    assert a["floor_per_token"] == pytest.approx(1.52e-3, rel=0.02)
    assert a["ratio"] == pytest.approx(17.1, rel=0.02)


def test_tables_and_sentences():
    rows = fb.model_table(["gpt2", "Llama-3.1-8B"], 1e12, 1e14, torch.float16)
    assert rows[0]["crossover"] == 6752 and rows[1]["crossover"] == 122_533
    q = fb.quant_rows("Llama-3.1-8B", 1, 512, 1e12, 1e15)
    assert q[0]["floor"] == pytest.approx(2 * q[1]["floor"])          # fp32 reads twice the bytes of fp16
    assert "dominates" in fb.bound_sentence(roofline.step_terms(roofline.meta_model("gpt2"), 1, 0, 1e9, 1e12))
    assert fb.knee([1, 2, 4], [1.0, 1.2, 2.0]) == 4 and fb.knee([1, 2], [1.0, 1.1]) is None
    assert "later" in fb.knee_sentence(8, 4) and "earlier" in fb.knee_sentence(2, 4)
    assert "BELOW" in fb.llc_caveat([{"ratio": 0.5}], 32 * 2**20)
    assert fb.llc_caveat([{"ratio": 3.0}], 32 * 2**20) == ""
    assert fb.shape_sizes_that_fit("cpu", quick=True) == ["gpt2"]
    assert len(fb.shape_sizes_that_fit("cuda", quick=False)) == 4
