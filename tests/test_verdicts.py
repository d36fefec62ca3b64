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


def test_preallocated_cache_truncate():
    c = PreallocatedCache(2, 1, 2, 4, 10)
    k = torch.randn(1, 2, 6, 4)
    for layer in range(2):
        c.update(layer, k, k)
    c.truncate(3)
    assert c.seq_len == 3
    keys, _ = c.update(0, k[:, :, :1], k[:, :, :1])
    assert keys.shape[2] == 4 and torch.equal(keys[:, :, :3], k[:, :, :3])
    with pytest.raises(ValueError, match="between 0 and"):
        c.truncate(7)
