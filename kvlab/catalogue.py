"""The models the book prices: GPT-2's sizes and the open models of ``models/configs``.

Data only (configs as dicts), no model is loaded: chapter 4's calculator and chapter 7's roofline read
the same catalogue.
"""

from __future__ import annotations
import json
from .memory import parameter_count
from .paths import CONFIG_DIR


GPT2_SIZES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# Chapter 10's draft for the real GPT-2 sizes (same tokenizer), from the Hub.
HUB_DRAFTS = ("distilgpt2",)


OPEN_MODELS_PATH = CONFIG_DIR / "open-models.json"


def load_open_models() -> dict[str, dict]:
    """``models/configs/open-models.json``: name -> attention shape, parameters and sources."""
    data = json.loads(OPEN_MODELS_PATH.read_text())
    return {m["name"]: m for m in data["models"]}


def gpt2_models() -> dict[str, dict]:
    """The four GPT-2 sizes (``models/configs/gpt2*.json``) in the same form as :func:`load_open_models`."""

    out = {}
    for size in GPT2_SIZES:
        cfg = json.loads((CONFIG_DIR / f"{size}.json").read_text())
        entry = {"name": size, "hf_repo": f"openai-community/{size}", **cfg,
                 "source": f"openai-community/{size} config.json on the Hugging Face Hub (models/configs/{size}.json); "
                           "parameters counted by transformers on the meta device"}
        entry["parameters"] = parameter_count({k: v for k, v in cfg.items()})
        entry["attention"] = "MHA"
        out[size] = entry
    return out


def all_models() -> dict[str, dict]:
    """GPT-2's four sizes, then the open models: the rows of the chapter's tables."""
    return {**gpt2_models(), **load_open_models()}
