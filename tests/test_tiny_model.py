"""Tests for the bundled ``kvlab-tiny`` model (models/kvlab-tiny) and its training script.

The perplexity protocol is the one the training script uses, ``kvlab.quality.window_loss``:
heldout.txt is tokenized as one string, the ids are cut into consecutive non-overlapping
512-token windows (the last partial one dropped), the model runs in fp32, and the cross-entropy
is averaged over the 511 predicted positions of every window.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

import transformers  # noqa: E402

from kvlab.quality import window_loss

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "models" / "kvlab-tiny"
SCRIPT = REPO / "models" / "train_tiny.py"
PROMPTS = ["In the beginning", "And the LORD said unto Moses,", "Blessed are the"]
CTX = 512



@pytest.fixture(scope="module")
def metrics() -> dict:
    return json.loads((MODEL_DIR / "metrics.json").read_text())


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = transformers.GPT2LMHeadModel.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    return model, tokenizer


def test_folder_contents(metrics):
    names = {p.name for p in MODEL_DIR.iterdir()}
    for required in ["config.json", "model.safetensors", "tokenizer.json", "heldout.txt", "metrics.json", "README.md"]:
        assert required in names, required
    size = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert size < 15e6, f"folder is {size / 1e6:.1f} MB"
    held = (MODEL_DIR / "heldout.txt").read_bytes()
    assert hashlib.sha256(held).hexdigest() == metrics["corpus"]["sha256_heldout"]
    assert metrics["smoke"] is False


def test_config_and_tokenizer(tiny):
    model, tokenizer = tiny
    cfg = model.config
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.n_positions, cfg.vocab_size) == (4, 4, 256, 512, 4096)
    assert cfg.tie_word_embeddings and cfg.activation_function == "gelu_new"
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert model.dtype == torch.float32
    assert len(tokenizer) == 4096 and tokenizer.model_max_length == 512
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == 0
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == tokenizer.pad_token_id == 0
    text = "In the beginning God created the heaven and the earth.\n<|endoftext|>\nThe"
    ids = tokenizer(text)["input_ids"]
    assert 0 in ids  # the marker in the text is one special token ...
    assert ids[0] != 0  # ... and nothing (no bos) is added
    assert tokenizer.decode(ids) == text


def test_offline_load_in_subprocess():
    """A fresh interpreter with HF_HUB_OFFLINE=1 loads the folder by path and generates."""
    code = f"""
import torch, transformers
m = transformers.GPT2LMHeadModel.from_pretrained({str(MODEL_DIR)!r}, dtype=torch.float32)
t = transformers.AutoTokenizer.from_pretrained({str(MODEL_DIR)!r})
assert m.dtype == torch.float32
enc = t("In the beginning", return_tensors="pt")
out = m.generate(**enc, max_new_tokens=5, do_sample=False, pad_token_id=0)
print("OK", out.shape[1] - enc["input_ids"].shape[1])
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "OK 5" in res.stdout


def test_kvlab_loader_matches_transformers(tiny):
    """The book's own loader gives the same model as plain transformers."""
    from kvlab.loading import load

    model, tokenizer = tiny
    ids = tokenizer("And God said, Let there be light", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    loaded = load("kvlab-tiny")
    other = loaded[0] if isinstance(loaded, tuple) else getattr(loaded, "model", loaded)
    with torch.no_grad():
        got = other(input_ids=ids).logits.float()
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_same_with_and_without_cache(tiny, prompt):
    model, tokenizer = tiny
    enc = tokenizer(prompt, return_tensors="pt")
    kw = dict(
        input_ids=enc["input_ids"],
        attention_mask=enc["attention_mask"],
        max_new_tokens=40,
        min_new_tokens=40,
        do_sample=False,
        pad_token_id=0,
    )
    with torch.no_grad():
        cached = model.generate(use_cache=True, **kw)
        uncached = model.generate(use_cache=False, **kw)
    assert cached.shape[1] == enc["input_ids"].shape[1] + 40
    assert cached.tolist() == uncached.tolist()


def heldout_perplexity(model, tokenizer, text: str, ctx: int = CTX, batch: int = 8) -> tuple[float, int]:
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    loss, n = window_loss(model, ids, ctx, batch)
    return math.exp(loss), n


def test_heldout_perplexity_matches_metrics(tiny, metrics):
    model, tokenizer = tiny
    text = (MODEL_DIR / "heldout.txt").read_text(encoding="utf-8")
    ppl, n = heldout_perplexity(model, tokenizer, text)
    expected = metrics["fp16_saved_loaded_as_fp32"]["val_ppl"]
    assert n == metrics["fp32"]["val_windows"]
    assert abs(ppl - expected) / expected < 0.05, (ppl, expected)
    assert ppl < 60  # a trained model, not a random one (ln 4096 -> ppl 4096)


def _toy_bible(path: Path) -> None:
    """A small corpus in the `bible` program's output format (no network needed)."""
    words = "and the lord said unto moses behold i will send a light upon the waters of the earth".split()
    lines = []
    for book in ["Ge", "Exo", "Mat"]:
        for chapter in range(1, 9):
            for verse in range(1, 13):
                k = chapter * 31 + verse * 7 + len(book)
                text = " ".join(words[(k + j * 5) % len(words)] for j in range(8 + verse % 6))
                lines.append(f"{book}{chapter}:{verse} {text.capitalize()}.")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_smoke_training_run(tmp_path):
    corpus, out = tmp_path / "toy.txt", tmp_path / "out"
    _toy_bible(corpus)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--corpus", str(corpus), "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    m = json.loads((out / "metrics.json").read_text())
    assert m["smoke"] and m["steps"] == 5
    assert all(m["greedy_fp16_vs_fp32_identical"].values())
    model = transformers.GPT2LMHeadModel.from_pretrained(out, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    enc = tokenizer("And the lord", return_tensors="pt")
    gen = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert gen.shape[1] == enc["input_ids"].shape[1] + 4
    assert (out / "heldout.txt").stat().st_size > 0
