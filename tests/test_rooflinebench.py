"""kvlab.rooflinebench: chapter 7's plumbing. Timings are run, never asserted."""

import pytest
import torch

from kvlab import generators as G
from kvlab import rooflinebench as fb, rooflineview as fv
from kvlab import roofline


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
    kind, share = fv.dominant(b)
    assert kind in b and 0 < share <= 1


def test_generators_vs_floor_rows(tiny, ours):
    rows = fb.generators_vs_floor(tiny[0], 4, 3, threads_list=(None,), repeats=1, ours=ours)
    assert [r["generator"] for r in rows] == list(G.EAGER)
    for r in rows:
        assert r["ratio"] == pytest.approx(r["per_token"] / r["floor_per_token"])


def test_article_a_against_the_rtx3090_floor():
    a = fb.article_rows()[0]
    # 354,823,168 fp32 parameters read per token at 936 GB/s: about 1.5 ms; 26.1 ms measured
    assert a["floor_per_token"] == pytest.approx(1.52e-3, rel=0.02)
    assert a["ratio"] == pytest.approx(17.1, rel=0.02)


def test_tables_and_sentences():
    rows = fb.model_table(["gpt2", "Llama-3.1-8B"], 1e12, 1e14, torch.float16)
    # weights read at batch 1 (one row of wpe / of embed_tokens) over the cache of one position
    assert rows[0]["crossover"] == 6709 and rows[1]["crossover"] == 114_517
    assert rows[0]["critical"][0] == roofline.critical_batch(roofline.meta_model("gpt2", torch.float16), 0, 1e12, 1e14)
    assert 1000 in rows[0]["critical"] and 2048 not in rows[0]["critical"] and rows[1]["critical"][32768] is None      # GPT-2's context is 1024
    assert rows[1]["attention"] == 4.0 and rows[1]["lookup"] == pytest.approx(0.0654, abs=5e-4)
    q = fb.quant_rows("Llama-3.1-8B", 1, 512, 1e12, 1e15)
    assert q[0]["floor"] == pytest.approx(2 * q[1]["floor"])          # fp32 reads twice the bytes of fp16
    slow = fb.quant_rows("Llama-3.1-8B", 16, 8192, 20e9, 89e9, 89e9)
    assert all(r["bound"] == "compute" for r in slow[1:]) and "reads 1.00" in fv.quant_sentence(slow)
    fast = fb.quant_rows("Llama-3.1-8B", 16, 8192, 4.3e12, 55e12, 989e12)   # priced at the half rate
    assert all(r["bound"] != "compute" for r in fast[1:]) and "bound by memory" in fv.quant_sentence(fast)
    assert fast[0]["rate"] == 55e12 and fast[1]["rate"] == 989e12
    assert "dominates" in fv.bound_sentence(roofline.step_terms(roofline.meta_model("gpt2"), 1, 0, 1e9, 1e12))
    assert fb.knee([1, 2, 4], [1.0, 1.2, 2.0]) == 4 and fb.knee([1, 2], [1.0, 1.1]) is None
    assert "later" in fv.knee_sentence(8, 4) and "earlier" in fv.knee_sentence(2, 4)
    text = fv.llc_caveat([{"ratio": 0.5}], "cpu")
    assert "BELOW" in text and "CPU's last-level cache" in text and "L2" not in text
    assert fv.llc_caveat([{"ratio": 3.0}], "cpu") == ""
    assert fb.shape_sizes_that_fit("cpu", quick=True) == ["gpt2"]
    assert len(fb.shape_sizes_that_fit("cuda", quick=False)) == 4


def test_roofline_plot_bf16_rows_and_throughput(ours):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [dict(batch=b, seq=8, measured=1e-3 * (1 + b / 8), floor=1e-4 * (1 + b / 16)) for b in (1, 4, 16)]
    pts = fb.roofline_points(rows, ours)
    assert pts[0]["x"] == pytest.approx(roofline.arithmetic_intensity(ours, 1, 8))
    assert pts[1]["y"] == pytest.approx(roofline.decode_step_flops(ours, 4, 8) / rows[1]["measured"])
    fig, ax = plt.subplots()
    fv.plot_roofline(ax, 10e9, 100e9, {"short": pts}, "t")
    plt.close(fig)
    assert "6.0x that of batch 1 (38% of proportional" in fv.throughput_sentence(rows)
    d = fb.dtype_rows(["gpt2"], fb.H200["bandwidth"], {torch.float32: fb.H200["fp32"], torch.bfloat16: fb.H200["bf16"]})
    assert d[1]["ridge"] / d[0]["ridge"] == pytest.approx(989 / 67)
    assert d[1]["critical"][0] > 10 * d[0]["critical"][0] / 2       # bf16: the critical batch moves far out
    assert 2048 not in d[0]["critical"] and 512 in d[0]["critical"]  # GPT-2's context is 1,024
    assert fv.critical_cell(d[0]["critical"], 2048) == "-"
    assert "moves it out" in fv.bf16_sentence(d, "H200")
    slow = fb.dtype_rows(["gpt2"], 20e9, {torch.float32: 100e9, torch.bfloat16: 50e9})   # a CPU without bf16 units
    assert "moves it in" in fv.bf16_sentence(slow, "a CPU")


def test_compile_counts_come_from_torch():
    from kvlab import compilecount

    f = torch.compile(lambda x: (x * 2).sin(), backend="aot_eager", dynamic=False)
    with compilecount.counting() as counts:
        for n in (3, 4, 5):
            f(torch.ones(n))              # a new shape each time: one graph each
    assert counts["graphs"] == 3 and counts["graph breaks"] == 0 and counts["guard failures"] >= 2
    line = compilecount.counts_sentence(counts, "cpu", compiled_functions=1)
    assert "3 graph(s) for 1 compiled function(s) (2 more" in line and "no CUDA graph" in line
    assert "CUDA graphs: 0 skip(s)" in compilecount.counts_sentence(counts, "cuda", compiled_functions=1)


def test_compile_counts_name_two_instances_of_one_code_as_expected():
    """Two instances of one class compiled apart share a code object: the second's first call fails
    the first's guards (torch counts a guard failure) and compiles its own graph, not a recompilation."""
    from kvlab import compilecount

    class Step(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4) if scale else torch.nn.Identity()

        def forward(self, x):
            return self.lin(x) * 2

    torch._dynamo.reset()
    a, b = (torch.compile(Step(s), backend="aot_eager", dynamic=False) for s in (1, 0))
    with compilecount.counting() as counts:
        for _ in range(3):
            a(torch.ones(2, 4)), b(torch.ones(2, 4))
    assert counts["graphs"] == 2 and counts["guard failures"] >= 1
    line = compilecount.counts_sentence(counts, "cpu", compiled_functions=2, same_code=1)
    assert "(0 more than one each" in line and "1 expected" in line and "same Python code" in line
    assert "expected" not in compilecount.counts_sentence(counts, "cpu", compiled_functions=2)


def test_one_compile_seconds_definition():
    from kvlab import staticbench

    assert staticbench.compile_seconds(12.5, 2.5) == 10.0
    assert staticbench.compile_seconds(2.0, 2.4) == 0.0          # within the noise: not negative


def test_model_table_defines_its_columns(capsys):
    """Every header of chapter 7's model table is a term the page has defined, or its caption defines
    (the editor's "rows-only" was neither)."""
    rows = fb.model_table(["gpt2"], 1e10, 1e11, torch.float32)
    fv.print_model_table(rows, caption="fp32")
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip("| ").startswith("model"))
    assert "rows-only" not in out and "look-up tables (rows read)" in header
    for term in ("look-up tables (rows read):", "floor, B=1:", "FLOP/B:", "critical batch at S:"):
        assert term in fv.MODEL_TABLE_TERMS and term in out, term
    assert out.index("fp32") < out.index("look-up tables (rows read):")


def test_quant_sentence_agrees_in_number():
    rows = [{"format": f, "bound": b, "rate": 3e11} for f, b in
            (("fp32", "compute"), ("fp16", "cache"), ("int8 cache", "weights"), ("int4", "compute"))]
    one = fv.quant_sentence(rows)
    assert "1 of the 3 half-precision rows is bound by compute" in one and "sets its floor" in one
    rows[2]["bound"] = "compute"
    two = fv.quant_sentence(rows)
    assert "2 of the 3 half-precision rows are bound by compute" in two and "sets their floor" in two
