"""kvlab.draw: each diagram is drawn from a live object and says in its alt text what that object holds."""

import matplotlib.pyplot as plt
import pytest
import torch
import torch.nn.functional as F

from kvlab import batching, draw, draw_engine, gpt2, provenance, quant
from kvlab.configs import kv_dims
from kvlab.paged import BlockAllocator


def _is_drawing(d):
    assert isinstance(d, draw.Drawing) and d.alt and d.caption
    png = d.png()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    bundle = d._repr_mimebundle_()
    assert 'alt="' in bundle["text/html"] and bundle["text/plain"] == d.alt
    assert not plt.get_fignums()          # off-screen: pyplot never saw the figure
    assert provenance.small_texts(d.figure) == []     # every text of the saved figure at reading size
    return d


def test_cache_growth_and_query_from_a_real_dynamic_cache(tiny):
    model, tok = tiny
    ids = tok("In the beginning God", return_tensors="pt").input_ids
    steps = draw.record_steps(model, ids, 3)
    assert [s["after"] for s in steps] == [ids.shape[1] + i for i in range(4)]
    assert [len(s["tokens"]) for s in steps] == [ids.shape[1], 1, 1, 1]
    H, D = model.config.n_head, kv_dims(model.config)[2]
    assert steps[-1]["keys"].shape == (H, ids.shape[1] + 3, D) and steps[-1]["q"].shape == (H, D)
    d = _is_drawing(draw.cache_growth(steps, tok))
    assert f"{len(steps)} forward calls over {ids.shape[1] + 3} positions" in d.alt
    _is_drawing(draw.query_against_cache(steps[-1]))


def test_the_mask_is_read_off_the_attention_function():
    ours = draw.probe_mask(gpt2.attention, past_len=3, T=2)
    assert ours.tolist() == [[True] * 4 + [False], [True] * 5]                      # bottom-right
    top_left = draw.probe_mask(lambda q, k, v, p: F.scaled_dot_product_attention(q, k, v, is_causal=True), 3, 2)
    assert top_left.tolist() == [[True] + [False] * 4, [True, True] + [False] * 3]
    assert torch.equal(draw.probe_mask(gpt2.sdpa_attention, 3, 2), ours)
    d = _is_drawing(draw.masks(ours, top_left, 3))
    assert "6 cells differ" in d.alt


def test_layout_gqa_quant_and_batch(tiny):
    from transformers.models.llama.modeling_llama import repeat_kv
    kv_of = repeat_kv(torch.arange(2.0).view(1, 2, 1, 1), 4).flatten().long().tolist()
    d = _is_drawing(draw.cache_layout((12, 1, 12, 1024, 64), n_kv_heads=2, kv_head_of=kv_of))
    assert "8 query heads share 2 key/value heads, 4 each" in d.alt
    x = torch.randn(16, 8)
    x[:, 3] *= 20                                                      # an outlier channel
    d = _is_drawing(draw.quant_axes(x, 4, quant.quantize))
    assert "scales [16, 1]" in d.alt and "scales [1, 8]" in d.alt
    _, tok = tiny
    ids, mask, pos = batching.make_batch(tok, ["And God said", "In the beginning God created"])
    d = _is_drawing(draw.padded_batch(ids, mask, pos, tok))
    assert f"pads per row: {[int((mask[b] == 0).sum()) for b in range(2)]}" in d.alt
    assert "padded on the left" in d.alt and "last column holds every row's newest token" in d.alt
    right_ids, right_mask = ids.flip(-1), mask.flip(-1)            # the same rows, padded on the right
    d = _is_drawing(draw.padded_batch(right_ids, right_mask, title="padding_side='right'"))
    assert "padded on the right" in d.alt and "last column of a padded row is a pad" in d.alt


def test_generic_diagrams_for_chapters_7_to_9():
    d = _is_drawing(draw.roofline(1e12, 1e11, {"decode": (1.0, 5e10), "prefill": (50.0, 8e11)}, "a test device"))
    assert "ridge" in d.caption.lower() or "10 FLOPs per byte" in d.alt
    assert "decode at 1 FLOP/byte, 50 GFLOP/s (memory-bound)" in d.alt and "(compute-bound)" in d.alt
    d = _is_drawing(draw_engine.static_buffer(16, 5))
    assert "5 are filled" in d.alt and "11 slots" in d.alt
    d = _is_drawing(draw_engine.static_buffer(32, 13, prefill=10))        # chapter 3: the text names the split
    assert "prefill wrote slots 0 to 9; decode steps wrote 10 to 12" in d.alt
    assert ["written by the prefill (10 tokens)", "written by 3 decode steps, one slot each"] == [
        t.get_text() for t in d.figure.axes[0].get_legend().get_texts()]
    a = BlockAllocator(6, 4)
    a.allocate("a", 6)
    a.fork("a", "b")
    d = _is_drawing(draw_engine.block_tables(a, ["a", "b"]))
    assert "a -> [0, 1]; b -> [0, 1]" in d.alt and "[0, 1] are shared" in d.alt
    a.append_slot("b")                                                  # copy on write of block 1
    assert "b -> [0, 2]" in _is_drawing(draw_engine.block_tables(a, ["a", "b"])).alt


def test_block_tables_of_the_serving_engine_with_copy_on_write_and_prefix_cache():
    from kvlab.course.checks._fake import FakeLM
    from kvlab.serving import Engine
    eng = Engine(FakeLM(vocab=97), num_blocks=12, block_size=4, max_num_batched_tokens=64)
    prefix = eng.add_prefix(list(range(1, 7)))                          # 6 tokens: block 0 full, block 1 half
    a, b = (eng.submit(list(range(1, 7)) + [20 + i, 30 + i], 3) for i in range(2))
    assert eng.step() and eng.trace.steps[-1]["copy_pairs"] == [(1, 2), (1, 3)]   # each copies the half block
    d = _is_drawing(draw_engine.block_tables(eng.blocks, [prefix, a, b], copies=eng.trace.steps[-1]["copy_pairs"]))
    assert "prefix 0: 6 tok -> [0, 1]" in d.alt and "request 0: 8 tok -> [0, 2]" in d.alt and "request 1: 8 tok -> [0, 3]" in d.alt
    assert "Blocks [0] are shared" in d.alt and "block 1 copied to 2, block 1 copied to 3" in d.alt
    assert "0*\nrc 3" in [t.get_text() for t in d.figure.axes[0].texts]        # registered in the prefix cache
    eng.run()
    d = _is_drawing(draw_engine.block_tables(eng.blocks, [prefix]))
    cached = sorted(eng.blocks.cached)
    assert cached and f"Blocks {cached} have no holder but stay in the prefix cache" in d.alt
    assert "No block is shared" in d.alt and "Copy-on-write" not in d.alt


def test_timeline_of_a_served_engine():
    from kvlab.course.checks._fake import FakeLM
    from kvlab.serving import Engine
    eng = Engine(FakeLM(vocab=97), num_blocks=6, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    for i in range(5):
        eng.submit([3 + i] * (4 + i), 6)                              # all at 0: the same schedule every run
    eng.run()
    times = eng.trace.token_times
    d = _is_drawing(draw_engine.timeline(eng, title="a test run"))
    ttft = sorted(times[s.rid][0] - s.arrival for s in eng.seqs.values())
    assert d.alt.startswith("Timeline of 5 requests over") and f"longest {ttft[-1]:.3g} s" in d.alt
    pre = sum(1 for s in eng.seqs.values() if s.preemptions)
    assert pre and f"{pre} {'was' if pre == 1 else 'were'} preempted at least once" in d.alt     # the pool of 6 blocks binds
    ticks = sum(len(line.get_xdata()) for line in d.figure.axes[0].lines) - 5    # minus one arrival mark each
    assert ticks == sum(len(t) for t in times.values())                # one tick per token


def test_timeline_of_requests():
    class R:
        def __init__(self, rid, s, f, e):
            self.rid, self.submitted, self.first_token, self.finished = rid, s, f, e
    d = _is_drawing(draw_engine.timeline([R(0, 0.0, 0.1, 1.0), R(1, 0.0, 0.3, 1.5), R(2, 0.5, 0.6, 2.0)]))
    assert "3 requests over 2 s" in d.alt and "median time to first token in this run 0.1 s" in d.alt


# ---------------------------------------------------------------------------------------------------
# Issue 37: text at reading size in every saved figure (diagrams above, plots and the stamp here)

def _saved_sizes(fig) -> list[float]:
    """Font sizes of the texts as the saved figure has them (saving draws the figure)."""
    import io
    from matplotlib.text import Text
    fig.savefig(io.BytesIO(), format="png")
    return [t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def test_the_font_check_can_fail_and_readable_repairs_it():
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6, 3))
    ax = fig.add_subplot()
    ax.plot([1, 2], [1, 2], label="a line")
    ax.legend(fontsize=5)
    ax.annotate("B=8", (1, 1), fontsize=6)
    small = provenance.small_texts(fig)
    assert ("B=8", 6) in small and ("a line", 5) in small            # the check sees what is too small
    provenance.readable(fig)
    assert provenance.small_texts(fig) == [] and min(_saved_sizes(fig)) >= provenance.MIN_FONT
    wide = Figure(figsize=(2 * provenance.COLUMN_IN, 3))              # shown at half size on the page
    wide.text(0.1, 0.1, "stamp", fontsize=provenance.MIN_FONT)
    assert provenance.small_texts(wide) and provenance.min_font(wide) == 2 * provenance.MIN_FONT
    provenance.readable(wide)
    assert min(_saved_sizes(wide)) == 2 * provenance.MIN_FONT


def test_plots_and_their_stamp_are_readable(tiny):
    from kvlab import plots, rooflineview
    model, _ = tiny
    fig, ax = plots.figure(size=(9, 3.8))
    ax.plot([1, 2, 3], [3, 1, 2], label="x")
    ax.set_xticks([1, 2, 3], ["a", "b", "c"], fontsize=6)
    plots.finish(fig, model, "cpu", legend=[ax], fontsize=6, show=False)
    assert min(_saved_sizes(fig)) >= provenance.min_font(fig) > provenance.MIN_FONT
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    pts = [dict(x=0.1 * 1.1 ** i, y=1e9 * i + 1, batch=2 ** i) for i in range(8)]   # crowded on log x
    rooflineview.plot_roofline(ax, 1e10, 1e11, {"short": pts, "long": pts}, "t")
    provenance.stamp_figure(fig, model, "cpu")
    labels = [t for t in ax.texts if t.get_text().startswith("B=")]
    assert min(_saved_sizes(fig)) >= provenance.MIN_FONT
    xs = sorted({t.xy[0] for t in labels})
    assert all(b / a >= 10 ** 0.15 - 1e-9 for a, b in zip(xs, xs[1:]))   # no two labels on top of each other
    assert pts[-1]["x"] in xs                                             # the last batch always named
    plt.close(fig)


def test_the_stamp_clears_slanted_tick_labels(tiny):
    """Issue 37 full-build reread: chapter 9's block-size bars, labelled at 30 degrees with no tight
    layout, had their labels written over the provenance stamp."""
    model, _ = tiny
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.4))
    a1.plot([1, 2], [1, 2])
    a2.bar([f"block {b}, plain gather" for b in (1, 4, 16, 64)], [1, 2, 3, 4])
    a2.tick_params(axis="x", rotation=30)
    provenance.stamp_figure(fig, model, "cpu")
    r = fig.canvas.get_renderer()
    stamp = next(t for t in fig.texts if "torch" in t.get_text()).get_window_extent(r)
    assert all(ax.get_tightbbox(r).y0 >= stamp.y1 for ax in fig.axes)
    plt.close(fig)


def test_the_bytes_of_a_decode_step_are_drawn_from_the_roofline_count(tiny):
    from kvlab import roofline
    model, _ = tiny
    d = _is_drawing(draw.step_bytes(model, 2, [8, 64]))
    bars = d.figure.axes[0].patches
    assert len(bars) == 8                                           # four parts, two context lengths
    for i, s in enumerate((8, 64)):
        total = sum(b.get_width() for b in bars if abs(b.get_y() + b.get_height() / 2 - i) < 1e-6)
        assert total * 1e6 == pytest.approx(roofline.decode_step_bytes(model, 2, s), rel=1e-9)
    assert "plus the cache" in d.alt


def test_log_axes_are_labelled_with_plain_numbers():
    """Issue 37 reread: log axes read "4x10^0" and "10^1"; the stamp makes them "4" and "10"."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter
    from kvlab.provenance import plain_log_labels

    fig, (a, b, c) = plt.subplots(1, 3)
    a.plot([1, 2, 4, 8], [0.5, 2, 5, 20]); a.set(xscale="log", yscale="log")
    b.plot([1, 1e6], [1, 2]); b.set_xscale("log")
    c.plot([0.15, 1.0], [1, 2]); c.set_xscale("log"); c.xaxis.set_major_formatter(PercentFormatter(1.0))
    plain_log_labels(fig)
    fig.canvas.draw()
    ymaj = [t.get_text() for t in a.yaxis.get_majorticklabels() if t.get_text()]
    ymin = [t.get_text() for t in a.yaxis.get_minorticklabels() if t.get_text()]
    assert "1" in ymaj and "10" in ymaj and not any("\\times" in t or "^" in t for t in ymaj + ymin), (ymaj, ymin)
    assert "2" in ymin and "5" in ymin and "3" not in ymin
    assert not [t.get_text() for t in b.xaxis.get_minorticklabels() if t.get_text()]   # six decades: no minor labels
    assert "1000" in [t.get_text() for t in b.xaxis.get_majorticklabels()]
    assert isinstance(c.xaxis.get_major_formatter(), PercentFormatter)                 # a chapter's own kept
    plt.close(fig)


def test_latency_throughput_labels_never_overlap():
    """Issue 37 reread: chapter 9's "5/s" and "15/s" overlapped where saturated rates share a spot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from kvlab.servingbench import plot_latency_throughput

    rows = [dict(policy=p, rate=r, tokens_per_s=min(r, 4) * 100 + k, e2e_p90=(1 + k) * (1 if r < 4 else r))
            for k, p in enumerate(("static", "continuous", "reservation")) for r in (0.5, 1, 2, 5, 15, 15.5)]
    fig, ax = plt.subplots(figsize=(7, 4))
    plot_latency_throughput(rows, ax)
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in ax.texts]
    assert 2 <= len(boxes) <= 6
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert {t.get_text() for t in ax.texts} <= {"0.5/s", "1/s", "2/s", "5/s", "15/s", "16/s"}
    plt.close(fig)
