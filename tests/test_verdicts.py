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
    assert "faster in the median, runs overlap (a faster in 2 of 3 rounds" in verdicts.faster(a, b, CPU)


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
    assert close.startswith("a and b: time ratio 0.95") and "no difference measured (medians within 10%)" in close
    noisy_a, noisy_b = Timing("a", [1.0, 1.6, 0.6, 1.5, 0.7]), Timing("b", [1.3, 1.32, 1.28, 1.31, 1.29])
    c = verdicts.compare_timings(noisy_a, noisy_b)
    assert c.reason == "spread" and not c.apart and c.ratio < 1 / 1.1
    spread = verdicts.faster(noisy_a, noisy_b, CPU)
    assert spread.startswith("a is 1.30x faster than b (time ratio 0.77")
    assert "faster in the median, runs overlap (a faster in 3 of 5 rounds" in spread
    clear = verdicts.faster(Timing("a", [1.0, 1.0, 1.1]), Timing("b", [2.0, 2.1, 1.9]), CPU)
    assert "within the runs' spread): faster in every one of the 3 rounds" in clear


def test_the_verdict_follows_the_numbers_on_random_timings():
    """Whatever the samples, a sentence never calls a variant faster while its median is slower, and
    never calls medians within 10% apart."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(1, 7, (1,), generator=g))
        a = Timing("a", (torch.rand(n, generator=g) * 3 + 0.1).tolist())
        b = Timing("b", (torch.rand(n, generator=g) * 3 + 0.1).tolist())
        c, text = verdicts.compare_timings(a, b), verdicts.faster(a, b, CPU)
        if c.verdict != "none":
            assert text.startswith("a is" if a.median < b.median else "b is")
            assert abs(c.ratio - 1) > 0.09
            assert (("every one" in text or "one round" in text) == (c.wins == c.rounds)) and "no difference" not in text
        else:
            assert "no difference measured" in text and " is " not in text.split(":")[0]
        if c.apart:
            assert c.verdict != "none"


def test_a_single_run_each_is_judged_on_its_medians_alone():
    text = verdicts.faster(Timing("a", [1.0]), Timing("b", [3.0]), CPU)
    assert text.startswith("a is 3.00x faster than b") and "1 round of one interleaved run " in text
    assert "faster in the one round measured" in text
    with pytest.raises(ValueError, match="need samples"):
        verdicts.compare_timings(Timing("a", []), Timing("b", [1.0]))


def test_clear_winner_named_with_ratio_and_device():
    slow, fast = Timing("slow", [3.0, 3.1, 2.9]), Timing("fast", [1.0, 1.1, 0.9])
    text = verdicts.faster(slow, fast, CPU)
    assert text.startswith("fast is 3.00x faster than slow")
    assert "this CPU" in text and "3 rounds of one interleaved run" in text
    assert verdicts.faster(fast, slow, CPU).startswith("fast is 3.00x faster")


@pytest.mark.parametrize("r, words", [(1.04, "about the same (1.04x)"), (2.5, "2.5x larger"),
                                      (0.25, "4.0x smaller (75% less)")])
def test_ratio_word(r, words):
    assert verdicts.ratio_word(r) == words


def test_a_smaller_amount_is_said_as_a_reduction():
    text = verdicts.compare_amounts(55.0, 100.0, "x", "y", "peak", CPU)
    assert "1.8x smaller than that of y (45% less)" in text and "x less" not in text
    assert "2.0x that of y" in verdicts.compare_amounts(200.0, 100.0, "x", "y", "peak", CPU)


def test_trend_direction():
    assert verdicts.trend([1, 4], [1.0, 3.0], "N", "s", CPU).startswith("s starts at 1.00x at N=1, then rises to 3.00x at N=4")
    assert "stays within 10% of its first value" in verdicts.trend([1, 4], [1.0, 1.05], "N", "s", CPU)
    assert "falls to 1.00x at N=4" in verdicts.trend([1, 4], [2.0, 1.0], "N", "s", CPU)
    assert verdicts.trend([1, 4], [2.0, 1.0], "N", "s", CPU).endswith("on this CPU with " + verdicts.on(CPU).split(" with ")[1])


def test_series_reads_every_point_not_its_ends():
    """First against last said "rises from 12 to 215" for a series whose peak, 399, was inside it (chapter
    3's cache work), and "stays level" for one that doubled in the middle and came back."""
    text = verdicts.series([16, 64, 256, 512], [12.0, 12.5, 399.0, 215.0], "p", "work", " µs", 1)
    assert text == ("work stays within 10% of 12.0 µs from p=16 to p=64, then rises to 215.0 µs at p=512; "
                    "its maximum, 399.0 µs, is at p=256")
    hump = verdicts.series([1, 2, 3], [1.0, 2.0, 1.02], "B", "t")
    assert "ends within 10% of where it started" in hump and "its maximum, 2.00x, is at B=2" in hump
    dip = verdicts.series([1, 2, 3, 4], [1.0, 0.5, 2.0, 3.0], "B", "t")
    assert "rises to 3.00x at B=4 (its maximum)" in dip and "its minimum, 0.50x, is at B=2" in dip
    assert verdicts.series([8], [3.0], "B", "t") == "t is 3.00x at B=8"
    with pytest.raises(ValueError, match="one y per x"):
        verdicts.series([1, 2], [1.0], "B", "t")


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


# ---------------------------------------------------------------------------------------------------
# Issue 37: the four sentences that contradicted the number beside them, as data. Each case gives
# samples whose medians have the printed ratio and whose spread made the old noise test say "not told
# apart" (reason "spread"); the sentence must now lead with that ratio and name the winner.

CONTRADICTIONS = [
    # chapter 2: cached against naive at the largest N, a 6.5x speed-up printed as "not told apart (0.15)"
    ("chapter 2", Timing("cached", [0.10, 0.15, 0.40, 0.12, 0.60]), Timing("naive", [1.0, 0.3, 1.6, 0.5, 1.4]),
     "cached is 6.67x faster than naive (time ratio 0.15", "faster in every one of the 5 rounds"),
    # chapter 8: the compiled hand-built step against transformers' eager generate, "not told apart (0.48)"
    ("chapter 8", Timing("hand-built GPT-2, compiled", [0.48, 0.3, 0.9, 0.4, 1.6]),
     Timing("transformers", [1.0, 0.4, 1.8, 0.6, 1.5]),
     "hand-built GPT-2, compiled is 2.08x faster than transformers (time ratio 0.48",
     "faster in the median, runs overlap (hand-built GPT-2, compiled faster in 4 of 5 rounds"),
    # chapter 9 (best_of, "not told apart (ratio 5.97)") and chapter 8's share: tests below
]


@pytest.mark.parametrize("where, a, b, lead, verdict", CONTRADICTIONS, ids=[c[0] for c in CONTRADICTIONS])
def test_a_large_gap_with_noisy_runs_is_reported_as_measured(where, a, b, lead, verdict):
    c = verdicts.compare_timings(a, b)
    assert c.reason == "spread" and not c.apart       # the old test's outcome: "not told apart"
    text = verdicts.faster(a, b, CPU)
    assert text.startswith(lead), text
    assert verdict in text and "not told apart" not in text and "no difference" not in text


def test_the_time_ratio_is_the_faster_over_the_slower_whatever_the_order():
    """Issue 37 reread: "b is 1.30x faster than a (time ratio 1.30" read as b taking 1.3x a's time."""
    a, b = Timing("a", [1.3, 1.31, 1.29, 1.3, 1.3]), Timing("b", [1.0, 1.01, 0.99, 1.0, 1.0])
    one, other = verdicts.faster(a, b, CPU), verdicts.faster(b, a, CPU)
    assert one.startswith("b is 1.30x faster than a (time ratio 0.77"), one
    assert other.startswith("b is 1.30x faster than a (time ratio 0.77"), other
    low, high = (float(x) for x in one.split("time ratio 0.77, ")[1].split(" within")[0].split(" to "))
    assert low <= 0.77 <= high < 1


def test_chapter_9s_best_of_leads_with_the_ratio():
    from kvlab.servingbench import best_of
    text = best_of({"continuous": [1.0, 1.0, 5.0], "reservation": [5.97, 6.1, 1.2]}, "p90 wait", CPU)
    assert text.startswith("p90 wait: continuous 5.97x better than reservation, better in the median, runs overlap")
    assert "not told apart" not in text
    same = best_of({"a": [1.0, 1.0], "b": [1.05, 1.04], "c": [2.0, 2.1]}, "x", CPU)
    assert "no difference measured" in same and same.startswith("x: the best two, 'a' and 'b', ratio 1.0"), same


def test_chapter_8s_part_never_exceeds_its_whole():
    """"3.955 ms of the 0.770 ms the three parts spend above theirs": one part was under its floor
    (negative), so the old sum was smaller than the largest part."""
    parts = [3.955e-3, -3.940e-3, 0.755e-3]
    text = verdicts.share(parts[0], parts)
    assert text.startswith("3.955 ms, 84% of the 4.710 ms the parts spend above their floors")
    assert "(1 part ran 3.940 ms under its floor)" in text
    assert "of the 0.770" not in text
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        xs = (torch.randn(3, generator=g)).tolist()
        pos = sum(x for x in xs if x > 0)
        for x in xs:
            pct = verdicts.share(x, xs).split(", ")[1].split("%")[0]
            assert pct.startswith("none") or (x > 0 and 0 <= x / pos <= 1 + 1e-9)


def test_throughput_that_grows_more_than_the_floors_is_explained():
    """"Measured 20.2x ... the roofline allows 19.2x" read as beating the limit: the sentence now
    says each step stayed above its floor and why the ratio may still exceed the floor's."""
    from kvlab import rooflineview as fv
    rows = [dict(batch=1, measured=10e-3, floor=1e-3), dict(batch=32, measured=15.84e-3, floor=1.667e-3)]
    text = fv.throughput_sentence(rows)
    assert "was 20.2x that of batch 1" in text and "grows 19.2x" in text
    assert "not faster than the roofline allows" in text and "batch 1: 10.0x the floor" in text
    assert "batch 32: 9.5x" in text
    below = [dict(batch=1, measured=2e-3, floor=1e-3), dict(batch=8, measured=4e-3, floor=1.5e-3)]
    assert "not faster than" not in fv.throughput_sentence(below)


def test_chapter_8s_fastest_sentence_words_the_runner_up_by_the_verdict():
    from kvlab import generators as G, staticview as sv
    def r(name, samples, ratio):
        t = Timing(name, samples)
        return dict(model="m", generator=name, per_token=t.median, threads=1, device="cpu", ratio=ratio, timing=t)
    rows = [r(G.TRANSFORMERS, [3.0, 3.1, 2.9], 7.0), r(G.HAND_BUILT, [1.09, 1.1, 1.08], 4.8),
            r(G.HAND_BUILT_COMPILED, [1.0, 1.01, 0.99], 4.4)]
    text = sv.fastest_sentence(rows, "m")
    assert f"lowest median time per token is that of '{G.HAND_BUILT_COMPILED}': 1000.000 ms" in text
    assert "3.00x transformers' eager generate" in text
    assert "takes 1.09x as long: no difference measured (medians within 10%)." in text
    rows[1] = r(G.HAND_BUILT, [2.0, 2.1, 1.9], 8.8)
    assert "takes 2.00x as long: faster in every one of the 3 rounds." in sv.fastest_sentence(rows, "m")


def _spec_run(spec_samples, base_samples):
    """The least of a kvlab.specbench result that summary_sentence and rows read: one draft at k=2."""
    return {"picks": {"bigram": 2}, "device": "cpu", "alpha": {"bigram": 0.6},
            "costs": {"c": {"bigram": 0.05}, "V": {2: 1.1, 3: 1.2}}, "v_floor": {},
            "sizes": {"prompts": 2},
            "acceptance": {("bigram", 2): {"alpha": 0.6, "tokens_per_step": 1.9, "same": True, "steps": 10,
                                           "tried": 15, "accepted": 9, "empty": 0},
                           ("bigram", 3): {"alpha": 0.55, "tokens_per_step": 2.1, "same": True, "steps": 10,
                                           "tried": 20, "accepted": 11, "empty": 2}},
            "e2e": {"plain greedy": Timing("plain", base_samples), ("bigram", 2): Timing("spec", spec_samples)}}


def test_chapter_10s_summary_is_worded_by_the_verdict():
    """Issue 37 reread: a draft that won every round was listed as "not told apart from plain greedy"
    (the sentence sorted by the strict MAD test, not by the verdict)."""
    from kvlab import specreport
    won = _spec_run([0.5, 0.9, 0.3, 0.8, 0.45], [1.0, 1.4, 0.6, 1.5, 0.9])
    assert verdicts.compare_timings(won["e2e"]["bigram", 2], won["e2e"]["plain greedy"]).reason == "spread"
    text = specreport.summary_sentence(won)
    assert "paid: bigram (k=2, 2.00x, in every round)" in text and "no difference measured" in text
    assert text.endswith("no difference measured (medians within 10%): none"), text
    overlap = specreport.summary_sentence(_spec_run([0.5, 1.2, 0.45, 0.7, 0.5], [1.0, 1.0, 1.1, 0.95, 1.5]))
    assert "paid: bigram (k=2, 2.00x, in the median; runs overlap, 4 of 5 rounds)" in overlap
    slow = specreport.summary_sentence(_spec_run([2.0, 2.1, 1.9, 2.0, 2.0], [1.0, 1.0, 1.1, 0.95, 1.0]))
    assert "did not pay: bigram (k=2, 0.50x, in every round): a step's drafting" in slow
    even = specreport.summary_sentence(_spec_run([1.0, 1.02, 0.98, 1.0, 1.0], [1.0, 1.01, 0.99, 1.0, 1.0]))
    assert "paid: none" in even and even.endswith("(medians within 10%): bigram (k=2, 1.00x)")


def test_chapter_10s_alpha_and_tokens_per_step_come_from_the_same_counts():
    """Issue 37 reread: prompt lookup at k=1 showed alpha 0.48 beside 1.28 tokens/step, where a reader
    expects 1 + alpha; steps that draft nothing are why, and the page must say so."""
    from kvlab import specbench, specreport
    from kvlab.speculative import SpecStats

    st = SpecStats(drafted=[1, 0, 1, 1, 0], accepted=[1, 0, 0, 1, 0])     # two steps found nothing to draft
    assert st.alpha == 2 / 3 and st.tokens_per_step == 1 + st.alpha * st.tried / st.steps == 1.4
    run = _spec_run([0.5] * 3, [1.0] * 3)
    lines = specreport.relation_sentences(run)
    assert lines == ["bigram: k=2: 9 of 15 judged drafts accepted, alpha = 9/15 = 0.60; 10 steps, tokens/step = "
                     "(10 + 9)/10 = 1.90 = 1 + alpha x 15/10; k=3: 11 of 20 judged drafts accepted, alpha = 11/20 = "
                     "0.55; 10 steps, tokens/step = (10 + 11)/10 = 2.10 = 1 + alpha x 20/10; 2 steps (20%) drafted "
                     "nothing (a run's last step, with no room left to draft: at most 2, one a run)"], lines
    for row in specreport.rows(run) + specreport.closing_rows(run):
        assert row["tokens/step"] == pytest.approx(1 + row["alpha"] * row["judged/step"])
    assert specbench.acceptance.__doc__.count("empty")


def test_chapter_10s_untimed_cells_are_blank_not_nan():
    from kvlab import specreport
    rows = specreport.rows(_spec_run([0.5] * 3, [1.0] * 3))
    untimed = next(r for r in rows if r["k"] == 3)
    assert untimed["measured"] is None and untimed["step cost (clock)"] is None and untimed["V floor"] is None
    from kvlab.tables import _cell
    assert _cell(untimed["measured"], ".2f") == ""


def test_chapter_10s_floor_sentence_says_what_sets_the_floor_and_reads_the_clock_against_it():
    """Issue 37 reread: V(6) = 1.37 against a floor of 2.88 was read as "extra rows ride along almost
    free, as on an accelerator", under "the weights are read once" while arithmetic set that floor."""
    from kvlab import specbench, specreport
    from kvlab.course.checks._common import grading_model
    from kvlab.gpt2 import GPT2
    target = GPT2.from_hf(grading_model()[0])
    slow_flops = {"bandwidth": 50e9, "flops": 20e9}          # 7 rows' FLOPs take longer than the bytes
    fast_flops = {"bandwidth": 50e9, "flops": 1e15}
    assert specbench.v_floor_bound(target, 6, 40, slow_flops) == "arithmetic"
    assert specbench.v_floor_bound(target, 6, 40, fast_flops) == "bytes"
    vf = specbench.v_floor(target, [6], 40, slow_flops)[6]
    assert vf > 1.5
    # the cache is read once for all k + 1 queries: at a long context the bytes floor grows with k by the new rows only
    assert specbench.v_floor(target, [6], 400, fast_flops)[6] < 1.01

    def run(v):
        head = Timing("h", [1e-4] * 3)
        return {"v_floor": {6: vf}, "sizes": {"ks": [6]}, "costs": {"V": {6: v}, "timings": {"head 1": head, "head 7": head}},
                "target": target, "device": "cpu", "cached": 40}
    below = specreport.floor_sentences(run(1.37), slow_flops)[0]
    assert "FLOPs, at the probe's 20 GFLOP/s, take longer than the bytes" in below
    assert "below the floor's ratio" in below and "almost free" not in below
    assert "almost free" in specreport.floor_sentences(run(1.05), slow_flops)[0]
    assert "more than the floor predicts" in specreport.floor_sentences(run(vf * 1.5), slow_flops)[0]


def test_floor_change_never_says_one_times_lower():
    from kvlab.rooflineview import floor_change

    base = {"floor": 2.0, "bound": "compute"}
    same = floor_change(base, {"floor": 2.0, "bound": "compute"}, "an int8 cache")
    assert "the floor stays where it was" in same and "bound by compute" in same and "lower" not in same
    assert "1.002x lower" in floor_change(base, {"floor": 2.0 / 1.002, "bound": "memory"}, "x")
    assert "2.00x lower" in floor_change(base, {"floor": 1.0, "bound": "memory"}, "x")
    assert "stays where it was (1.000x)" in floor_change(base, {"floor": 2.0, "bound": "memory"}, "x")


def test_faster_names_the_threads_the_samples_ran_with():
    """A timing measured on 1 thread is stated as such even when torch now runs with more."""
    from kvlab import timing

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        t = timing.compare({"a": lambda: sum(range(2000)), "b": lambda: sum(range(20000))}, warmup=0,
                           repeats=3, progress=False)
        assert t["a"].threads == 1
        torch.set_num_threads(2)
        assert "with 1 torch thread" in verdicts.faster(t["a"], t["b"], "cpu")
        untagged = verdicts.faster(Timing("a", t["a"].samples), Timing("b", t["b"].samples), "cpu")
        assert "with 2 torch threads" in untagged          # not recorded: torch's current count
    finally:
        torch.set_num_threads(before)


def test_every_round_beside_a_spread_past_one_is_explained():
    """Chapters 8-11: a variant that won each paired round while both drifted together has a spread
    interval that crosses 1.00; the sentence says why both are true, and only then."""
    drift = [1.0, 1.6, 1.1, 2.0, 1.2]
    a = Timing("a", [x * 0.8 for x in drift])
    b = Timing("b", drift)
    said = verdicts.faster(a, b, "cpu")
    assert "faster in every one of the 5 rounds" in said and "reaches past 1.00" in said, said
    steady = verdicts.faster(Timing("a", [0.50, 0.51, 0.50, 0.52, 0.50]), Timing("b", [1.0, 1.01, 1.0, 1.02, 1.0]), "cpu")
    assert "faster in every one of the 5 rounds" in steady and "reaches past" not in steady, steady


def test_chapter_8s_table_claims_no_break_even_where_the_sentence_claims_none(capsys):
    """The 'pays off after' column and compile_sentence agree: no speed-up measured, no break-even."""
    from kvlab import generators as G, staticview as sv
    twin = next(iter(G.EAGER_OF))

    def r(name, samples, compile_s=None, break_even=None):
        t = Timing(name, samples)
        return dict(model="m", generator=name, per_token=t.median / 10, floor_per_token=0.01, ratio=2.0, threads=1,
                    device="cpu", timing=t, compile_s=compile_s, break_even=break_even, achieved=1e9, bandwidth=2e9)
    rows = [r(G.EAGER_OF[twin], [1.0, 1.02, 0.99]), r(twin, [0.97, 0.98, 0.99], 1.4, 1901)]
    sv.print_rows(rows)
    out = capsys.readouterr().out
    assert "not claimed" in out and "1,901 tokens" not in out
    assert "no break-even is claimed" in sv.compile_sentence(rows, "m")
    rows[1] = r(twin, [0.5, 0.51, 0.49], 1.4, 1901)
    sv.print_rows(rows)
    assert "1,901 tokens" in capsys.readouterr().out
