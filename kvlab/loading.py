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

import difflib
import json
import os
import socket
from pathlib import Path

import torch
from .catalogue import GPT2_SIZES, HUB_DRAFTS
from .paths import CONFIG_DIR, NANO_DIR, TINY_DIR
from .configs import as_dtype

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
    return ["kvlab-tiny", "kvlab-nano", *GPT2_SIZES, *HUB_DRAFTS, *(SHAPE_PREFIX + s for s in GPT2_SIZES)]


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
    Weights are computed in ``dtype`` (fp32 by default, whatever the checkpoint stores; a name such
    as ``"fp16"`` works too). A name or folder that cannot be loaded raises :class:`ModelNotAvailable`
    saying what was looked for, where, and what to do; a bad ``device`` or ``dtype`` a ``ValueError``.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model name must be a non-empty string, got {name!r}; known: {known_names()}")
    device = check_device(device) if device is not None else None
    dtype = _float_dtype(dtype)
    name = name.strip()
    if name == "kvlab-tiny":
        if not (TINY_DIR / "config.json").exists():
            raise ModelNotAvailable(f"the bundled model is missing from {TINY_DIR}; "
                                    "run `python models/train_tiny.py` to rebuild it")
        model, tok = _load_folder(TINY_DIR, dtype)     # local files only: never a network call
        return _finish(_tag(model, name, "tiny"), device, dtype), tok
    if name == "kvlab-nano":
        model, tok = _load_folder(NANO_DIR, dtype)     # chapter 10's draft for kvlab-tiny; local files only
        return _finish(_tag(model, name, "tiny"), device, dtype), tok
    if name.startswith(SHAPE_PREFIX):
        return _finish(_tag(_shape_only(name, seed), name, "shape-only"), device, dtype), None
    path = Path(name).expanduser()
    if path.exists() or name not in GPT2_SIZES + HUB_DRAFTS:
        model, tok = _load_folder(_checkpoint_folder(name, path), dtype)
        label, kind = _folder_label(path)
        return _finish(_tag(model, label, kind), device, dtype), tok
    model, tok = _load_hub(name, dtype)
    return _finish(_tag(model, name, "real"), device, dtype), tok


def _shape_only(name: str, seed: int):
    """``shape:<size>``: GPT-2's config for that size with random weights seeded by ``seed``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    size = name[len(SHAPE_PREFIX):]
    if size not in GPT2_SIZES:
        raise ModelNotAvailable(f"unknown shape-only model {name!r}; known: "
                                f"{[SHAPE_PREFIX + s for s in GPT2_SIZES]}")
    config = GPT2Config(**json.loads((CONFIG_DIR / f"{size}.json").read_text()))
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def _load_hub(repo: str, dtype):
    """Real GPT-2 from the local Hugging Face cache, else downloaded when huggingface.co answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:  # the local Hugging Face cache first: no network at all
        model = AutoModelForCausalLM.from_pretrained(repo, dtype=dtype, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(repo, local_files_only=True)
    except OSError:
        if not _hub_reachable():
            raise ModelNotAvailable(
                f"{repo!r} is not in the local Hugging Face cache and huggingface.co cannot be "
                f"reached from here. {_HOW_TO_GET_GPT2}") from None
        model = AutoModelForCausalLM.from_pretrained(repo, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(repo)
    return model, tok


def _float_dtype(dtype) -> torch.dtype:
    """``dtype`` as a floating-point ``torch.dtype`` (names such as ``"fp16"`` accepted)."""

    dtype = as_dtype(dtype)
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype for the weights (torch.float32, "
                         f"torch.float16 or torch.bfloat16), got {dtype}")
    return dtype


def _checkpoint_folder(name: str, path: Path) -> Path:
    """``path`` if it is a folder; otherwise raise, saying what was looked for, where, and what to do."""
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotAvailable(f"{path} is a file, not a checkpoint folder; pass the folder that holds "
                                f"it and its config.json (here {path.parent})")
    looks_like_path = "/" in name or os.sep in name or name.startswith(("~", "."))
    guess = difflib.get_close_matches(name, known_names(), n=1, cutoff=0.6)
    if not looks_like_path and guess:
        hint = f"did you mean {guess[0]!r}? Known names: {', '.join(known_names())}"
    else:
        near = _near_folders(path)
        hint = (f"did you mean {near}? " if near else "") + (
            "Check the spelling of the path, or pass one of the known names: " + ", ".join(known_names()))
    where = f" (expanded from {name!r})" if name.startswith("~") else ""
    if looks_like_path:
        raise ModelNotAvailable(f"no checkpoint folder at {path.resolve()}{where}: it does not exist. {hint}")
    raise ModelNotAvailable(f"unknown model name {name!r} (nor is there a folder {path.resolve()}); {hint}")


def _near_folders(path: Path) -> str:
    """A sibling folder whose name is close to ``path``'s (a typo), as a string, or ``''``."""
    parent = path.parent if path.parent.is_dir() else None
    if parent is None:
        return ""
    names = [p.name for p in parent.iterdir() if p.is_dir()]
    guess = difflib.get_close_matches(path.name, names, n=1, cutoff=0.7)
    return str(parent / guess[0]) if guess else ""


def _folder_label(path: Path) -> tuple[str, str]:
    """Name and kind of a model loaded from a folder: kvlab-tiny (the bundled one, or one retrained
    with models/train_tiny.py, whose metrics.json says so) is ``tiny``, anything else ``real``."""
    if path.resolve() == TINY_DIR.resolve():
        return "kvlab-tiny", "tiny"
    try:
        trained = json.loads((path / "metrics.json").read_text()).get("model") == "kvlab-tiny"
    except (OSError, ValueError, AttributeError):
        trained = False
    return str(path), ("tiny" if trained else "real")


def _load_folder(path: Path, dtype):
    """Model and tokenizer of a ``save_pretrained`` folder, from local files only; each missing or
    damaged file is named with its path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").exists():
        raise ModelNotAvailable(f"{path} is a folder but holds no config.json; "
                                "pass a folder written by save_pretrained")
    _check_weights(path)
    tokenizer_files = [f for f in _TOKENIZER_FILES if all((path / g).exists() for g in f)]
    if not tokenizer_files:
        raise ModelNotAvailable(
            f"{path} holds a model but no tokenizer (looked for tokenizer.json, or vocab.json with "
            "merges.txt): copy the tokenizer files from where the checkpoint came from "
            "(tokenizer.save_pretrained(folder) writes them)")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises, say which folder it was
        raise ModelNotAvailable(f"could not load the checkpoint in {path}: {type(e).__name__}: {e}. "
                                "Copy the folder again from a save_pretrained output") from e
    if len(tok) > model.config.vocab_size:   # ids past the embedding would fail (or worse) mid-generation
        raise ModelNotAvailable(f"the tokenizer in {path} has {len(tok)} tokens but the model's vocabulary "
                                f"has {model.config.vocab_size}: the tokenizer files belong to another model; "
                                "copy the ones saved with this checkpoint")
    return model, tok


_TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def _check_weights(path: Path) -> None:
    """The folder has a weights file, and a single safetensors file is complete (an interrupted copy
    otherwise surfaces as a header error without its path)."""
    if not any((path / f).exists() for f in _WEIGHT_FILES):
        raise ModelNotAvailable(f"{path} holds a config.json but no weights (looked for "
                                f"{', '.join(_WEIGHT_FILES)}): copy the checkpoint's weights file there")
    file = path / "model.safetensors"
    if not file.exists():
        return
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        header = f.read(n) if 0 < n <= size - 8 else b""
    if head.startswith(b"version "):
        problem = "is a Git LFS pointer, not the weights: run `git lfs pull`"
    elif size == 0:
        problem = "is empty (0 bytes)"
    else:
        try:
            ends = [t["data_offsets"][1] for k, t in json.loads(header).items() if k != "__metadata__"]
            expected = 8 + n + max(ends, default=0)
        except (ValueError, TypeError, KeyError):
            expected = None
        if expected == size:
            return
        problem = ("is truncated or corrupt: its header cannot be read" if expected is None else
                   f"is truncated: its header describes {expected:,} bytes but the file has {size:,}")
    raise ModelNotAvailable(f"{file} {problem}; the copy or download did not finish: copy the file again")


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


def default_model() -> tuple[str, str]:
    """The model every notebook uses and why: ``KVLAB_MODEL`` if set, else ``gpt2`` if loadable, else
    ``kvlab-tiny``. Returns ``(name, reason)``; nothing is printed (the banner shows the reason)."""
    env = os.environ.get("KVLAB_MODEL", "").strip()
    if env:
        return env, "KVLAB_MODEL is set"
    ok, reason = gpt2_loadable()
    return ("gpt2", reason) if ok else ("kvlab-tiny", reason + "; using the bundled model")


def pick_device() -> torch.device:
    """``cuda`` when a GPU is present, else the CPU; ``KVLAB_DEVICE`` overrides (checked: a device this
    machine does not have is an error here, not a failure later inside torch)."""
    env = os.environ.get("KVLAB_DEVICE", "").strip()
    if env:
        dev = check_device(env, source=f"KVLAB_DEVICE={env!r}")
    else:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return dev


_DEVICE_ALIASES = {"gpu": "cuda", "nvidia": "cuda", "cpu": "cpu", "cuda": "cuda", "mps": "mps"}


def check_device(device, source: str | None = None) -> torch.device:
    """``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or a ``torch.device``) as a
    ``torch.device`` this machine has; otherwise a ``ValueError`` that says what to use instead."""
    what = source or f"device {device!r}"
    fix = "unset KVLAB_DEVICE (kvlab then picks cuda when present, else cpu) or set it to cpu" \
        if source else "pass device='cpu' (or 'cuda' on a machine with an NVIDIA GPU)"
    if isinstance(device, str):
        kind, _, index = device.strip().lower().partition(":")
        if kind not in _DEVICE_ALIASES or (index and not index.isdigit()):
            raise ValueError(f"{what} is not a device kvlab runs on (cpu, cuda, cuda:N, mps); "
                             f"{'use cuda for an NVIDIA GPU; ' if kind in ('gpu', 'nvidia') else ''}{fix}")
        device = torch.device(_DEVICE_ALIASES[kind] + (f":{index}" if index else ""))
    if not isinstance(device, torch.device):
        raise ValueError(f"{what}: expected a device name such as 'cpu' or 'cuda', got "
                         f"{type(device).__name__}; {fix}")
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"{what} asks for CUDA, but torch sees no CUDA GPU here (torch "
                             f"{torch.__version__}, {build}); {fix}")
        if device.index is not None and device.index >= n:
            raise ValueError(f"{what}: this machine has {n} CUDA GPU(s), cuda:0 to cuda:{n - 1}; "
                             f"pick one of those, or {fix}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{what} asks for Apple's MPS, which torch does not see here; {fix}")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{what}: kvlab runs on cpu, cuda or mps, not {device.type}; {fix}")
    return device


def load_default(device=None, dtype: torch.dtype = torch.float32):
    """``load`` of :func:`default_model` on ``pick_device()``. Returns ``(model, tok)``; the model keeps
    why it was chosen in ``kvlab_why`` (the banner shows it)."""
    device = device or pick_device()
    name, why = default_model()
    model, tok = load(name, device=device, dtype=dtype)
    model.kvlab_why = why
    return model, tok


