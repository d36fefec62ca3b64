"""Issue 35: chapter measurements are sized by a time budget, not only a grid (timing.Budget)."""

import time

import pytest
import torch

from kvlab import timing


def test_a_sweep_stops_adding_points_when_its_budget_is_spent_and_says_so(capsys):
    budget = timing.Budget(0.3, "a test sweep")
    done = []
    for p in budget.points([1, 2, 4, 8, 16, 32]):
        time.sleep(0.04 * p)          # a point's cost grows with p, as a longer generation's does
        done.append(p)
    assert done == budget.done and done[:2] == [1, 2] and len(done) < 6
    assert budget.skipped == [1, 2, 4, 8, 16, 32][len(done):]
    budget.report()
    out = capsys.readouterr().out
    assert "a test sweep" in out and "s budget" in out
    assert "not measured: " + ", ".join(map(str, budget.skipped)) + "." in out and "[" not in out   # no Python list


def test_a_budget_overrun_says_why():
    """'2 of 3 rounds measured in 50 s of its 22.5 s budget' read as a contradiction: a run past its
    budget says why (the first `keep` always run, or the last point took longer than judged)."""
    kept = timing.Budget(1e-6, "kept", keep=2)
    for _ in kept.points([1, 2, 3]):
        time.sleep(0.01)
    assert "past its" in kept.note and "the first 2 are always measured" in kept.note, kept.note
    late = timing.Budget(0.05, "late", keep=1)
    for p in late.points([1, 1, 1, 1], size=lambda _: 1.0):
        time.sleep(0.01 if len(late.done) < 1 else 0.08)    # the second point runs far past its estimate
    assert "took longer than judged" in late.note, late.note


def test_the_first_points_are_always_measured_and_a_roomy_budget_cuts_nothing(capsys):
    budget = timing.Budget(1e-6, "tiny", keep=2)
    assert [p for p in budget.points([5, 6, 7]) if time.sleep(0.01) is None] == [5, 6]
    roomy = timing.Budget(60, "roomy")
    assert list(roomy.points([1, 2, 3])) == [1, 2, 3] and roomy.note == ""
    roomy.report()
    assert capsys.readouterr().out == ""


def test_the_estimate_uses_the_points_size(monkeypatch):
    """With a quadratic size the next point is judged 4x the last: it is not started."""
    budget = timing.Budget(0.25, "quadratic", keep=1)
    got = [p for p in budget.points([1, 2], size=lambda p: p * p) if time.sleep(0.1) is None]
    assert got == [1] and budget.skipped == [2]


@pytest.mark.parametrize("seconds, scale", [(0, "1"), (-5, "1"), (10, "0")])
def test_a_budget_that_is_no_budget_is_refused(monkeypatch, seconds, scale):
    monkeypatch.setenv("KVLAB_BUDGET_SCALE", scale)
    with pytest.raises(ValueError, match="time budget must be > 0"):
        timing.Budget(seconds)


def test_rounds_are_counted_from_one_in_the_note():
    budget = timing.Budget(0.05, "a repeated timing", keep=2)
    ran = [r for r in budget.rounds(6) if time.sleep(0.04) is None]
    assert ran == [0, 1] and budget.skipped == [2, 3, 4, 5]
    assert "2 of 6 rounds measured" in budget.note and "not measured: rounds 3 to 6" in budget.note
    assert "judged to need about" in budget.note and "was spent" not in budget.note


def test_compare_with_a_tiny_budget_keeps_its_first_rounds_for_every_variant(capsys):
    """An interleaved comparison cut by its budget: every variant has the same (first) rounds, each
    sample is a real timing of that variant, and the note says how many rounds were left out."""
    budget = timing.Budget(1e-6, "the comparison's rounds", keep=2)
    t = timing.compare({"slow": lambda: time.sleep(0.02), "fast": lambda: None}, warmup=0, repeats=5,
                       progress=False, budget=budget)
    assert [len(x.samples) for x in t.values()] == [2, 2]
    assert min(t["slow"].samples) >= 0.02 > max(t["fast"].samples)      # the ranking still stands
    budget.report()
    out = capsys.readouterr().out
    assert "the comparison's rounds" in out and "2 of 5 rounds" in out and "rounds 3 to 5" in out


def test_compare_with_a_roomy_budget_runs_every_round():
    budget = timing.Budget(60, "roomy rounds")
    t = timing.compare({"a": lambda: None}, warmup=0, repeats=4, progress=False, budget=budget)
    assert len(t["a"].samples) == 4 and budget.note == ""


def test_the_budget_scale_shrinks_every_budget(monkeypatch):
    monkeypatch.setenv("KVLAB_BUDGET_SCALE", "0.1")
    assert timing.Budget(50).seconds == pytest.approx(5)


# ---------------------------------------------------------------------------------------------------
# The chapters' sweeps, with a budget too small for more than their first points


def tiny_budget(what="a sweep", keep=2):
    """A budget spent before anything starts: only the ``keep`` points it always measures run."""
    return timing.Budget(1e-9, what, keep=keep)


@pytest.mark.parametrize("n", range(8))
def test_spread_first_puts_both_ends_first_and_keeps_every_point(n):
    from kvlab.shrinkbench import spread_first

    grid = list(range(10, 10 + n))
    order = spread_first(grid)
    assert sorted(order) == grid
    if n >= 2:
        assert order[:2] == [grid[0], grid[-1]]


@pytest.fixture(scope="module")
def shrink_text(tiny):
    from kvlab import shrinkbench as sb

    calib, train, ev = sb.split_text(tiny[1])
    return calib, train, ev


def test_the_window_grid_keeps_its_ends_with_both_sink_counts_and_the_same_numbers(ours, shrink_text):
    from kvlab import shrinkbench as sb

    _, _, ev = shrink_text
    ref = sb.quality(ours, ev, max_windows=1)
    budget = tiny_budget("the window grid")
    rows = sb.window_rows(ours, ev, ref, [8, 16, 32, 64], sinks=(0, 4), max_windows=1, budget=budget)
    assert budget.done == [8, 64] and sorted(budget.skipped) == [16, 32]
    assert [(r["sinks"], r["window"]) for r in rows] == [(0, 8), (0, 64), (4, 8), (4, 64)]
    assert rows == sb.window_rows(ours, ev, ref, [8, 64], sinks=(0, 4), max_windows=1)   # unbudgeted: same rows
    assert "the window grid" in budget.note and "not measured: 16, 32." in budget.note


def test_the_latent_ranks_keep_the_smallest_and_the_lossless_one(ours, shrink_text):
    from kvlab import shrinkbench as sb

    calib, _, ev = shrink_text
    ref = sb.quality(ours, ev, max_windows=1)
    n = ours.config.n_embd
    budget = tiny_budget("the latent ranks")
    rows = sb.latent_rows(ours, calib, ev, ref, [n // 8, n // 4, n // 2, n], max_windows=1, budget=budget)
    assert sorted({r["rank"] for r in rows}) == [n // 8, n] and sorted(budget.skipped) == [n // 4, n // 2]
    lossless = [r for r in rows if r["rank"] == n]
    assert lossless and all(abs(r["ppl change"]) < 1e-4 for r in lossless)   # exact at r = n_embd, cut or not


def test_a_cut_uptraining_trains_every_row_as_many_steps_as_the_control(ours, shrink_text):
    from kvlab import shrinkbench as sb

    calib, train, ev = shrink_text
    ref = sb.quality(ours, ev, max_windows=1)
    budget = tiny_budget("the control's uptraining steps", keep=1)
    rows = sb.uptrain_rows(ours, calib, train, ev, ref, n_kv=1, steps=5, max_windows=1, budget=budget)
    assert [r["steps"] for r in rows] == [1] * len(rows) and budget.skipped == [1, 2, 3, 4]
    assert "1 of 5 steps measured" in budget.note and "steps 2 to 5" in budget.note


def test_the_serving_timings_keep_their_first_rounds_for_every_variant(ours):
    from kvlab.servingbench import block_size_timings, mixed_step_timings
    from kvlab.servingcost import ragged_vs_contiguous

    budget = tiny_budget("the ragged-vs-contiguous rounds", keep=3)
    vs = ragged_vs_contiguous(ours, 2, 16, repeats=6, budget=budget)
    assert [len(t.samples) for t in vs.values()] == [3, 3, 3, 3] and "3 of 6 rounds" in budget.note
    budget = tiny_budget("the mixed-step rounds")
    mix = mixed_step_timings(ours, 2, 16, 8, repeats=4, budget=budget)
    assert {len(t.samples) for t in mix.values()} == {2} and "rounds 3 to 4" in budget.note
    budget = tiny_budget("the block-size rounds")
    step = block_size_timings(ours, {"block 4": (4, None, None), "block 16": (16, None, False)}, rows=2, context=16, repeats=5,
                              budget=budget)
    assert {len(t.samples) for t in step.values()} == {2} and all(min(t.samples) > 0 for t in step.values())


def test_the_decode_times_of_chapter_11_keep_their_first_rounds(ours):
    from kvlab import shrinkbench as sb

    budget = tiny_budget("the decode-step rounds", keep=3)
    t = sb.decode_times({"original": ours, "MQA": gqa_model(ours)}, 32, batch=1, repeats=7, budget=budget)
    assert {len(x.samples) for x in t.values()} == {3} and "rounds 4 to 7" in budget.note


def gqa_model(ours):
    from kvlab import gqa

    return gqa.convert(ours, 1, "mean")


@pytest.fixture(scope="module")
def spec_pair(tiny, ours):
    from kvlab import specbench

    hf, tok = tiny
    return specbench.bundled_pair("cpu", hf, tok, ours)


def test_the_acceptance_counts_stop_adding_prompts_and_count_the_first_ones_alike(spec_pair):
    from kvlab import specbench

    prompts = specbench.heldout_prompts(spec_pair["tok"], 3, 16)
    drafts = {n: spec_pair["drafts"][n] for n in ("prompt lookup", "kvlab-nano")}
    budget = tiny_budget("the acceptance counts' prompts", keep=1)
    cut = specbench.acceptance(spec_pair["target"], drafts, prompts, [1, 3], 8, budget=budget)
    assert budget.done == [1] and budget.skipped == [2, 3] and "not measured: 2, 3." in budget.note
    assert cut == specbench.acceptance(spec_pair["target"], drafts, prompts[:1], [1, 3], 8)   # the same counts
    assert list(cut) == [(n, k) for n in drafts for k in (1, 3)] and all(r["same"] for r in cut.values())


def test_the_sampling_check_cut_is_the_same_first_trials(spec_pair):
    from kvlab import specbench

    p = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], dtype=torch.float64)
    q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30], dtype=torch.float64)
    budget = tiny_budget("the sampling check's rounds")
    cut = specbench.sampling_check(p, q, 5000, seed=0, budget=budget)
    whole = specbench.sampling_check(p, q, 2000, seed=0)
    assert cut["trials"] == 2000 and torch.equal(cut["observed"], whole["observed"]) and cut["chi2"] == whole["chi2"]
    assert cut["passed"] and "rounds 3 to 5" in budget.note


def test_the_equality_check_keeps_its_first_prompt(spec_pair):
    from kvlab import specbench

    prompts = specbench.heldout_prompts(spec_pair["tok"], 2, 12)
    pair = dict(spec_pair, drafts={"prompt lookup": spec_pair["drafts"]["prompt lookup"]})
    budget = tiny_budget("the equality check's prompts", keep=1)
    rows = specbench.equality_rows(pair, prompts, 6, budget=budget)
    assert len(rows) == 4 and all(r["same tokens"] for r in rows) and budget.skipped == [2]


def test_the_quality_scoring_rounds_keep_the_first_windows_with_the_same_numbers(ours, tiny):
    from kvlab import quant_cache, quantbench

    ids = tiny[1]("And God said, Let there be light: and there was light. " * 6, return_tensors="pt").input_ids
    windows = torch.stack([ids[0, i:i + 24] for i in (0, 5, 10, 15)])
    fwd = lambda x, cache: ours(x, cache)                                   # noqa: E731
    variants = {"fp32": (fwd, lambda B: ours.new_cache(B, 24)),
                "8-bit": (fwd, lambda B: quant_cache.QuantizedKVCache.for_model(ours.config, B, 24, bits=8, block=8))}
    budget = tiny_budget("the scoring rounds", keep=1)
    cut = quantbench.score_in_rounds(variants, windows, 16, 2, budget)
    assert cut["windows"] == 2 and cut["rows"] == 2 and "2 of 2 rounds" not in budget.note and "round 2" in budget.note
    for name, (f, make) in variants.items():
        alone = quantbench.score_through_cache(f, make(2), windows[:2], 16)    # the first round as one batch
        assert torch.allclose(cut["logprobs"][name], alone, atol=1e-5)
    whole = quantbench.score_in_rounds(variants, windows, 16, 2)
    assert whole["windows"] == 4 and torch.allclose(whole["logprobs"]["fp32"][:2], cut["logprobs"]["fp32"])
