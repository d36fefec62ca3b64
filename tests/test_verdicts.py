"""kvlab.verdicts: sentences follow the numbers, name the device, and refuse to call noise a win."""

import pytest
import torch

from kvlab import verdicts
from kvlab.cache import PreallocatedCache
from kvlab.timing import Timing

CPU = torch.device("cpu")


def test_overlapping_timings_are_not_told_apart():
    a, b = Timing("a", [1.0, 1.3, 1.1]), Timing("b", [1.2, 1.25, 1.22])
    assert not verdicts.told_apart(a, b)
    assert "not told apart" in verdicts.faster(a, b, CPU)


def test_close_medians_are_not_told_apart_even_without_overlap():
    a, b = Timing("a", [1.00, 1.01, 1.02]), Timing("b", [1.05, 1.06, 1.07])
    assert not verdicts.told_apart(a, b)


def test_one_outlier_cannot_hide_a_threefold_difference():
    """The contradictory case of issue 27: medians 3x apart, one slow run of the faster variant
    made the sample ranges overlap, and the old sentence said "differ by less than 10%"."""
    ours = Timing("ours", [0.34, 0.35, 0.33, 0.36, 1.20])
    theirs = Timing("theirs", [1.00, 1.02, 0.99, 1.01, 1.03])
    assert verdicts.told_apart(ours, theirs) and verdicts.told_apart(theirs, ours)
    text = verdicts.faster(ours, theirs, CPU)
    assert text.startswith("ours is 2.89x faster than theirs")
    assert "less than 10%" not in text
    c = verdicts.compare_timings(ours, theirs)
    assert c.reason == "apart" and c.low <= c.ratio <= c.high < 1 / 1.1


@pytest.mark.parametrize("outlier", [3.0, 100.0])
def test_one_outlier_among_three_runs_either_side(outlier):
    fast, slow = Timing("fast", [1.0, 1.02, outlier]), Timing("slow", [2.0, 2.1, 1.95])
    assert verdicts.faster(fast, slow, CPU).startswith("fast is 1.96x faster than slow")
    fast, slow = Timing("fast", [1.0, 1.02, 1.01]), Timing("slow", [2.0, 2.1, 1 / outlier])
    assert verdicts.faster(fast, slow, CPU).startswith("fast is 1.98x faster than slow")


def test_the_sentence_names_the_condition_that_held():
    close = verdicts.faster(Timing("a", [1.0, 1.01, 1.02]), Timing("b", [1.05, 1.06, 1.07]), CPU)
    assert "medians differ by less than 10% (time ratio 0.95" in close
    noisy_a, noisy_b = Timing("a", [1.0, 1.6, 0.6, 1.5, 0.7]), Timing("b", [1.3, 1.32, 1.28, 1.31, 1.29])
    c = verdicts.compare_timings(noisy_a, noisy_b)
    assert c.reason == "spread" and not c.apart and c.ratio < 1 / 1.1
    spread = verdicts.faster(noisy_a, noisy_b, CPU)
    assert "not told apart" in spread and "spread reaches within 10%" in spread
    assert "less than 10%" not in spread
    clear = verdicts.faster(Timing("a", [1.0, 1.0, 1.1]), Timing("b", [2.0, 2.1, 1.9]), CPU)
    assert "within the runs' spread" in clear and "faster" in clear


def test_the_verdict_follows_the_numbers_on_random_timings():
    """Whatever the samples, a sentence never calls a variant faster while its median is slower, and
    never calls medians within 10% apart."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(1, 7, (1,), generator=g))
        a = Timing("a", (torch.rand(n, generator=g) * 3 + 0.1).tolist())
        b = Timing("b", (torch.rand(n, generator=g) * 3 + 0.1).tolist())
        c, text = verdicts.compare_timings(a, b), verdicts.faster(a, b, CPU)
        if c.apart:
            assert text.startswith("a is" if a.median < b.median else "b is")
            assert abs(c.ratio - 1) > 0.09
        else:
            assert "not told apart" in text


def test_a_single_run_each_is_judged_on_its_medians_alone():
    text = verdicts.faster(Timing("a", [1.0]), Timing("b", [3.0]), CPU)
    assert text.startswith("a is 3.00x faster than b") and "1 interleaved run " in text
    with pytest.raises(ValueError, match="need samples"):
        verdicts.compare_timings(Timing("a", []), Timing("b", [1.0]))


def test_clear_winner_named_with_ratio_and_device():
    slow, fast = Timing("slow", [3.0, 3.1, 2.9]), Timing("fast", [1.0, 1.1, 0.9])
    text = verdicts.faster(slow, fast, CPU)
    assert text.startswith("fast is 3.00x faster than slow")
    assert "this CPU" in text and "3 interleaved runs" in text
    assert verdicts.faster(fast, slow, CPU).startswith("fast is 3.00x faster")


@pytest.mark.parametrize("r, words", [(1.04, "about the same"), (2.5, "2.5x more"), (0.25, "4.0x less")])
def test_ratio_word(r, words):
    assert verdicts.ratio_word(r).startswith(words)


def test_trend_direction():
    assert " rises from 1.00x at N=1 to 3.00x at N=4 " in verdicts.trend([1, 4], [1.0, 3.0], "N", "s", CPU)
    assert "stays level" in verdicts.trend([1, 4], [1.0, 1.05], "N", "s", CPU)
    assert "falls" in verdicts.trend([1, 4], [2.0, 1.0], "N", "s", CPU)


def test_preallocated_cache_rewind():
    c = PreallocatedCache(2, 1, 2, 4, 10)
    k = torch.randn(1, 2, 6, 4)
    for layer in range(2):
        c.update(layer, k, k)
    c.rewind(3)
    assert c.seq_len == 3
    keys, _ = c.update(0, k[:, :, :1], k[:, :, :1])
    assert keys.shape[2] == 4 and torch.equal(keys[:, :, :3], k[:, :, :3])
    with pytest.raises(ValueError, match="between 0 and"):
        c.rewind(7)
