"""Where the repository's files are: the one definition of each path the library reads."""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
# KVLAB_TINY_DIR points "kvlab-tiny" at another folder (a model you retrained with models/train_tiny.py).
TINY_DIR = Path(os.environ.get("KVLAB_TINY_DIR") or MODELS_DIR / "kvlab-tiny")
CONFIG_DIR = MODELS_DIR / "configs"
# Chapter 10's draft for kvlab-tiny (same tokenizer), trained by models/train_tiny.py.
NANO_DIR = MODELS_DIR / "kvlab-nano"
RESULTS_DIR = REPO_ROOT / "results"
