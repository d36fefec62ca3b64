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
