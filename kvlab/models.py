"""Every model the book uses, through one function: ``load(name) -> (model, tokenizer)``.

Three kinds of model, and the book always says which one produced a figure:

* ``real``       -- OpenAI's GPT-2 weights (``gpt2`` ... ``gpt2-xl``, or a local checkpoint folder),
                    loaded with ``from_pretrained``; needs the Hub or a local copy.
* ``tiny``       -- ``kvlab-tiny``, the project's own 4-layer GPT-2 trained on the King James Bible,
                    bundled under ``models/kvlab-tiny``; loads offline, never touches the network.
* ``shape-only`` -- ``shape:gpt2`` ... ``shape:gpt2-xl``: the official GPT-2 configs (stored as data
                    in ``models/configs``) with random, seeded weights. Right shapes, meaningless
                    text: for timing and memory only.

Notebooks call :func:`load_default`, which honours ``KVLAB_MODEL``, then tries real ``gpt2``, then
falls back to ``kvlab-tiny``, and prints which it chose and why.
"""

from __future__ import annotations

import json
import os
import platform
import socket
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
# KVLAB_TINY_DIR points "kvlab-tiny" at another folder (a model you retrained with models/train_tiny.py).
TINY_DIR = Path(os.environ.get("KVLAB_TINY_DIR") or REPO_ROOT / "models" / "kvlab-tiny")
CONFIG_DIR = REPO_ROOT / "models" / "configs"
GPT2_SIZES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
SHAPE_PREFIX = "shape:"
HUB_HOST = "huggingface.co"

_HOW_TO_GET_GPT2 = (
    "To use real GPT-2: on a machine with internet, run once "
    "`python -c \"import transformers as t; t.AutoModelForCausalLM.from_pretrained('gpt2'); "
    "t.AutoTokenizer.from_pretrained('gpt2')\"` (it fills the Hugging Face cache), or copy a "
    "checkpoint folder here and pass its path. Offline, use 'kvlab-tiny' (bundled) instead."
)


class ModelNotAvailable(RuntimeError):
    """Raised when a named model cannot be loaded here; the message says what to do instead."""


def known_names() -> list[str]:
    return ["kvlab-tiny", *GPT2_SIZES, *(SHAPE_PREFIX + s for s in GPT2_SIZES)]


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP probe, so that an offline machine fails in seconds, not a network timeout."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        with socket.create_connection((HUB_HOST, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _tag(model, name: str, kind: str):
    model.kvlab_name = name
    model.kvlab_kind = kind
    return model


def _finish(model, device, dtype):
    model = model.to(device=device or "cpu", dtype=dtype)
    model.eval()
    return model


def load(name: str, device: str | torch.device | None = None, dtype: torch.dtype = torch.float32,
         seed: int = 0):
    """Load a model the book knows by name and return ``(model, tokenizer)``; the model is in eval mode.

    ``name`` is ``"kvlab-tiny"``, one of ``"gpt2"``, ``"gpt2-medium"``, ``"gpt2-large"``, ``"gpt2-xl"``,
    ``"shape:<one of those>"`` (random weights, tokenizer ``None``), or a local checkpoint folder.
    Weights are computed in ``dtype`` (fp32 by default, whatever the checkpoint stores).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model name must be a non-empty string, got {name!r}; known: {known_names()}")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    name = name.strip()
    if name == "kvlab-tiny":
        if not (TINY_DIR / "config.json").exists():
            raise ModelNotAvailable(f"the bundled model is missing from {TINY_DIR}; "
                                    "run `python models/train_tiny.py` to rebuild it")
        # local_files_only: the bundled model never makes a network call.
        model = GPT2LMHeadModel.from_pretrained(TINY_DIR, dtype=dtype, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(TINY_DIR, local_files_only=True)
        return _finish(_tag(model, name, "tiny"), device, dtype), tok

    if name.startswith(SHAPE_PREFIX):
        size = name[len(SHAPE_PREFIX):]
        if size not in GPT2_SIZES:
            raise ModelNotAvailable(f"unknown shape-only model {name!r}; known: "
                                    f"{[SHAPE_PREFIX + s for s in GPT2_SIZES]}")
        config = GPT2Config(**json.loads((CONFIG_DIR / f"{size}.json").read_text()))
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
        return _finish(_tag(model, name, "shape-only"), device, dtype), None

    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotAvailable(f"{path} is a folder but holds no config.json; "
                                    "pass a folder written by save_pretrained")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return _finish(_tag(model, str(path), "real"), device, dtype), tok

    if name not in GPT2_SIZES:
        raise ModelNotAvailable(
            f"unknown model name {name!r}. Known names: {', '.join(known_names())}, "
            "or the path of a local checkpoint folder.")

    repo = name
    try:  # the local Hugging Face cache first: no network at all
        model = AutoModelForCausalLM.from_pretrained(repo, dtype=dtype, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(repo, local_files_only=True)
    except OSError:
        if not _hub_reachable():
            raise ModelNotAvailable(
                f"{name!r} is not in the local Hugging Face cache and huggingface.co cannot be "
                f"reached from here. {_HOW_TO_GET_GPT2}") from None
        model = AutoModelForCausalLM.from_pretrained(repo, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(repo)
    return _finish(_tag(model, name, "real"), device, dtype), tok


def gpt2_loadable() -> tuple[bool, str]:
    """Whether real ``gpt2`` can be loaded here, and why (cache, Hub, or neither). Fast when offline."""
    try:
        from huggingface_hub import try_to_load_from_cache
        hit = try_to_load_from_cache("gpt2", "config.json")
        if isinstance(hit, str):
            return True, "real gpt2 is in the local Hugging Face cache"
    except Exception:  # noqa: BLE001 - any failure here just means "not cached"
        pass
    if _hub_reachable():
        return True, "huggingface.co is reachable, so real gpt2 can be downloaded"
    return False, "real gpt2 is neither cached locally nor downloadable (no route to huggingface.co)"


def default_model_name(verbose: bool = True) -> str:
    """The model every notebook uses: ``KVLAB_MODEL`` if set, else ``gpt2`` if loadable, else ``kvlab-tiny``."""
    env = os.environ.get("KVLAB_MODEL", "").strip()
    if env:
        name, why = env, "KVLAB_MODEL is set"
    else:
        ok, reason = gpt2_loadable()
        name, why = ("gpt2", reason) if ok else ("kvlab-tiny", reason + "; using the bundled model")
    if verbose:
        print(f"model: {name}  ({why})")
    return name


def pick_device(verbose: bool = False) -> torch.device:
    """``cuda`` when a GPU is present (``KVLAB_DEVICE`` overrides), else the CPU."""
    env = os.environ.get("KVLAB_DEVICE", "").strip()
    dev = torch.device(env if env else ("cuda" if torch.cuda.is_available() else "cpu"))
    if verbose:
        print(f"device: {dev}")
    return dev


def load_default(device=None, dtype: torch.dtype = torch.float32):
    """``load(default_model_name())`` on ``pick_device()``; prints the choice. Returns ``(model, tok)``."""
    device = device or pick_device()
    return load(default_model_name(), device=device, dtype=dtype)


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {cpu} ({os.cpu_count()} logical cores, {torch.get_num_threads()} torch threads)"


def describe(model) -> str:
    """One line: name, kind and shape of a model loaded by :func:`load`."""
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    kind = getattr(model, "kvlab_kind", "unknown")
    note = {"shape-only": "RANDOM WEIGHTS: shapes only, text is meaningless",
            "tiny": "bundled, trained on the KJV Bible",
            "real": "real pretrained weights"}.get(kind, "")
    return (f"{getattr(model, 'kvlab_name', cfg.name_or_path)} [{kind}: {note}] "
            f"{cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, context {cfg.n_positions}, "
            f"{n_params / 1e6:.1f}M parameters, {next(model.parameters()).dtype}")


def banner(model, device=None) -> str:
    """Show (and return) what produced this notebook's numbers: device, model, versions.

    In a notebook: one line, the details folded under it (HTML ``<details>``); elsewhere printed."""
    import html
    import transformers

    from .tables import _in_notebook

    device = device or next(model.parameters()).device
    lines = [
        f"device       : {device_name(device)}",
        f"model        : {describe(model)}",
        f"versions     : torch {torch.__version__}, transformers {transformers.__version__}, "
        f"python {platform.python_version()}",
    ]
    text = "\n".join(lines)
    if not _in_notebook():
        print(text)
        return text
    from IPython.display import HTML, display
    summary = f"Produced by {stamp(model, device)}"
    display(HTML(f'<details class="kvlab-banner"><summary>{html.escape(summary)}</summary>'
                 f"<pre>{html.escape(text)}</pre></details>"))
    return text


@torch.no_grad()
def window_loss(model, ids, window: int = 512, batch: int = 8,
                max_windows: int | None = None) -> tuple[float, int]:
    """The book's perplexity protocol (the model card, ``models/train_tiny.py``, the tests).

    Cut a 1-D sequence of token ids into consecutive, non-overlapping windows of ``window`` tokens
    (the last partial window is dropped; ``max_windows`` keeps an evenly spaced subset), run the
    model on each (``batch`` windows at a time, in eval mode) and average the cross-entropy over
    every predicted position (``window - 1`` per window). Returns ``(mean loss in nats, windows)``;
    the perplexity is ``exp`` of the loss.
    """
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    n = ids.numel() // window
    if n == 0:
        raise ValueError(f"need at least {window} tokens, got {ids.numel()}")
    windows = ids[:n * window].view(n, window)
    if max_windows is not None and n > max_windows:
        windows = windows[torch.linspace(0, n - 1, max_windows).long()]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        x = windows[i:i + batch].to(device)
        logits = model(input_ids=x).logits.float()
        total += torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(),
                                                   reduction="sum").item()
        count += x[:, 1:].numel()
    model.train(was_training)
    return total / count, windows.shape[0]


def stamp(model, device=None) -> str:
    """A one-line provenance for a figure: device, model (and its kind), versions."""
    import transformers

    device = device or next(model.parameters()).device
    dev = device_name(device).split(" (")[0] if torch.device(device).type == "cpu" else device_name(device)
    threads = f", {torch.get_num_threads()} threads" if torch.device(device).type == "cpu" else ""
    return (f"{dev}{threads} | {getattr(model, 'kvlab_name', '?')} ({getattr(model, 'kvlab_kind', '?')}) | "
            f"torch {torch.__version__}, transformers {transformers.__version__}")


def stamp_figure(fig, model, device=None) -> None:
    """Write :func:`stamp` along the bottom of a matplotlib figure."""
    fig.text(0.005, 0.005, stamp(model, device), fontsize=7, color="0.35", ha="left", va="bottom")
    fig.subplots_adjust(bottom=max(fig.subplotpars.bottom, 0.17))
