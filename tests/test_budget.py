"""Issue 35: chapter measurements are sized by a time budget, not only a grid (timing.Budget)."""

import time

import pytest

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
    assert "a test sweep" in out and "time budget" in out and str(budget.skipped) in out


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
    assert "after 2 of 6 rounds" in budget.note and "not measured: rounds 3 to 6" in budget.note


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
