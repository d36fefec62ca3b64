"""kvlab's core: model loading, reference generators, input validation, timing."""

import os
import subprocess
import sys
import time

import pytest
import torch

from kvlab import flops, loading, provenance, reference, timing
from kvlab.paths import REPO_ROOT


# ---- models ---------------------------------------------------------------------------------------

def test_unknown_name_is_a_clear_error():
    with pytest.raises(loading.ModelNotAvailable, match="unknown model name 'gtp2'.*kvlab-tiny"):
        loading.load("gtp2")
    with pytest.raises(ValueError, match="non-empty"):
        loading.load("")
    with pytest.raises(loading.ModelNotAvailable, match="shape:gpt2-medium"):
        loading.load("shape:gpt3")


def test_gpt2_offline_fails_fast_and_names_kvlab_tiny(tmp_path):
    """Without a cached copy and without network, gpt2 fails in seconds with a pointed message."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path), KVLAB_MODEL="")
    code = ("from kvlab import loading\n"
            "try:\n    loading.load('gpt2')\nexcept loading.ModelNotAvailable as e:\n    print('ERR', e)\n")
    start = time.perf_counter()  # wall-clock of a subprocess, not a benchmark
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert "ERR" in r.stdout, r.stdout + r.stderr
    assert "kvlab-tiny" in r.stdout and "from_pretrained('gpt2')" in r.stdout
    assert elapsed < 60, f"took {elapsed:.0f}s to fail"


def test_default_chooser(monkeypatch, capsys):
    monkeypatch.setenv("KVLAB_MODEL", "shape:gpt2")
    assert loading.default_model() == ("shape:gpt2", "KVLAB_MODEL is set")
    monkeypatch.setenv("KVLAB_MODEL", "")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(loading, "gpt2_loadable", lambda: (False, "no gpt2 here"))
    name, why = loading.default_model()
    assert name == "kvlab-tiny" and "no gpt2 here" in why
    assert capsys.readouterr().out == ""            # the library chooses; the banner says why
    monkeypatch.setattr(loading, "gpt2_loadable", lambda: (True, "cached"))
    assert loading.default_model()[0] == "gpt2"


def test_shape_only_models_are_marked():
    model, tok = loading.load("shape:gpt2")
    assert tok is None and model.kvlab_kind == "shape-only"
    cfg = model.config
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.n_positions, cfg.vocab_size) == (12, 12, 768, 1024, 50257)
    assert "RANDOM WEIGHTS" in provenance.describe(model)
    assert sum(p.numel() for p in model.parameters()) == 124_439_808  # GPT-2 small, tied embeddings
    again, _ = loading.load("shape:gpt2")
    assert torch.equal(model.lm_head.weight, again.lm_head.weight), "shape-only weights must be seeded"


@pytest.mark.parametrize("size, layers, heads, width", [("gpt2-medium", 24, 16, 1024),
                                                         ("gpt2-large", 36, 20, 1280),
                                                         ("gpt2-xl", 48, 25, 1600)])
def test_shape_only_configs(size, layers, heads, width):
    import json
    cfg = json.loads((REPO_ROOT / "models" / "configs" / f"{size}.json").read_text())
    assert (cfg["n_layer"], cfg["n_head"], cfg["n_embd"]) == (layers, heads, width)


def test_local_checkpoint_folder(tmp_path, tiny):
    """The path readers with a downloaded gpt2 use: a save_pretrained folder loads by its path."""
    model, tok = tiny
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again, tok2 = loading.load(str(tmp_path))
    assert again.kvlab_kind == "real" and tok2.vocab_size == tok.vocab_size
    ids = tok("In the beginning", return_tensors="pt").input_ids
    assert torch.equal(reference.naive_generate(again, ids, 8), reference.naive_generate(model, ids, 8))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(loading.ModelNotAvailable, match="config.json"):
        loading.load(str(empty))


def test_banner_names_device_model_versions(tiny, capsys):
    model, _ = tiny
    text = provenance.banner(model, "cpu")
    assert "CPU" in text and "kvlab-tiny" in text and "tiny" in text and torch.__version__ in text
    assert "transformers" in provenance.stamp(model)


# ---- generators -----------------------------------------------------------------------------------

def test_naive_cached_and_transformers_agree(tiny):
    model, tok = tiny
    for text in ["And", "Thou shalt love thy neighbour as thyself", "Then said Jesus unto his disciples,"]:
        ids = tok(text, return_tensors="pt").input_ids
        a = reference.naive_generate(model, ids, 25)
        b = reference.cached_generate(model, ids, 25)
        c = reference.hf_greedy(model, ids, 25, use_cache=False)
        assert a.shape == (1, ids.shape[1] + 25)
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(reference.cached_generate(model, ids, 0), ids)


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(1, 0, dtype=torch.long), "empty"),
    (torch.zeros(2, 3, dtype=torch.long), r"shape \[1, T\]"),
    (torch.zeros(1, 3), "LongTensor"),
])
def test_bad_prompts_are_clear_errors(tiny, bad, match):
    model, _ = tiny
    for fn in (reference.naive_generate, reference.cached_generate):
        with pytest.raises(ValueError, match=match):
            fn(model, bad, 3)


def test_context_overflow_is_an_error_not_a_truncation(tiny):
    model, _ = tiny
    n = model.config.n_positions
    ids = torch.zeros(1, n - 2, dtype=torch.long)
    with pytest.raises(ValueError, match=f"exceeds the model's context of {n}"):
        reference.naive_generate(model, ids, 3)
    assert reference.cached_generate(model, ids, 2).shape[1] == n  # exactly full is fine


def test_work_counts():
    assert flops.positions_processed_naive(10, 4) == 10 + 11 + 12 + 13
    assert flops.positions_processed_cached(10, 4) == 13
    assert flops.positions_processed_cached(10, 0) == 0


def test_forward_flops_matches_hand_count():
    from transformers import GPT2Config
    cfg = GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=10)
    # one position, nothing cached: per layer 24*64 + 4*1*1*8; head 2*8*10
    assert flops.forward_flops(cfg, 1, 0) == 2 * (24 * 64 + 32) + 160
    # naive step over t positions costs more than t cached steps (the t^2 attention term)
    t = 50
    assert flops.forward_flops(cfg, t, 0) > flops.forward_flops(cfg, 1, t - 1)


# ---- timing ---------------------------------------------------------------------------------------

def test_measure_and_compare():
    x = torch.randn(256, 256)
    t = timing.measure(lambda: x @ x, repeats=3)
    assert len(t.samples) == 3 and t.median > 0
    res = timing.compare({"small": lambda: x[:64] @ x, "big": lambda: x @ x @ x}, repeats=3, progress=False)
    assert set(res) == {"small", "big"} and all(len(v.samples) == 3 for v in res.values())
    assert timing.ratio(res["big"], res["small"]) > 0


def test_set_threads_reports(capsys, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("KVLAB_THREADS", "1")
    assert timing.set_threads() == 1 and torch.get_num_threads() == 1
    assert "torch threads: 1" in capsys.readouterr().out
    torch.set_num_threads(before)


def test_bench_command_checks_tokens_then_times(capsys):
    from kvlab import bench
    from kvlab import generators as G
    ratios = bench.run("kvlab-tiny", new_tokens=6, prompt_len=4, repeats=1, threads=None, naive=True)
    formats = {bench._format_name(f, how) for f in ("bf16", "int8") for how in ("eager", "compiled")}
    assert set(ratios) == {G.TRANSFORMERS, G.CACHED_LOOP, G.HAND_BUILT, G.NAIVE,
                           *G.COMPILED} | formats                        # chapter 8's rows, its weight formats
    assert ratios[G.TRANSFORMERS] == 1.0
    out = capsys.readouterr().out
    assert "identical tokens" in out
    assert "first call" in out and "compilation included" in out          # compile time apart
    assert "x floor" in out and "floor of the fp32 generation here" in out   # chapter 7's ratio, printed
    assert "int8 weights" in out and "tokens equal fp32's" in out and "GB/s" in out


def test_init_lists_every_module():
    """kvlab/__init__.py names every module of the library (issue 21: a reader's map of it)."""
    import pathlib

    import kvlab

    modules = {p.stem for p in pathlib.Path(kvlab.__file__).parent.glob("*.py")} - {"__init__"}
    missing = sorted(m for m in modules if f"``{m}``" not in kvlab.__doc__)
    assert not missing, f"kvlab/__init__.py does not mention {missing}"


def test_domain_modules_print_plot_and_tabulate_nothing():
    """Measurement lives in the measurement layer: the domain modules never print or plot (issue 21)."""
    import pathlib
    import re

    import kvlab

    root = pathlib.Path(kvlab.__file__).parent
    for name in ("gpt2", "cache", "static", "paged", "serving", "quant", "roofline", "memory", "batching",
                 "speculative", "drafts", "specbatch",
                 "gqa", "window", "latent", "designs"):
        files = [root / f"{name}.py"] if (root / f"{name}.py").exists() else sorted((root / name).glob("*.py"))
        assert files, f"kvlab/{name} not found"
        src = "\n".join(f.read_text() for f in files)
        assert not re.search(r"\bprint\(|\bplt\.|\bax\.|matplotlib", src), f"kvlab/{name}.py prints or plots"
