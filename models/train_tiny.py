"""Train ``kvlab-tiny``: a 4-layer GPT-2 trained on the King James Bible, on a CPU.

This script builds everything the book's ``kvlab-tiny`` model folder contains, from
nothing but two Debian packages:

1. **Corpus.** ``apt-get download bible-kjv bible-kjv-text`` (no root, no install), unpack
   both with ``dpkg-deb -x`` and run the unpacked ``bible`` program to print all 31,102
   verses. Verse references are stripped; the text is one verse per line, a blank line
   between chapters and ``<|endoftext|>`` between books. Every 20th chapter is held out
   as validation text (``heldout.txt``, shipped with the model).
2. **Tokenizer.** A byte-level BPE with 4,096 tokens trained on the training split only,
   ``<|endoftext|>`` being id 0 and serving as bos, eos and pad.
3. **Model.** ``transformers.GPT2LMHeadModel`` with 4 layers, 4 heads, width 256,
   512 positions and tied embeddings (about 4.3M parameters).
4. **Training.** AdamW (betas 0.9/0.95, weight decay 0.1 on matrices only), peak learning
   rate 2e-3, 50 warm-up steps then cosine decay to 10 %, gradient clipping at 1.0,
   bf16 autocast on the CPU (weights and optimizer state stay fp32), random 512-token
   crops, batch 8, and a fixed *step* budget so that a rerun is the same run step for step.
5. **Evaluation.** Perplexity on ``heldout.txt`` with the protocol the book uses
   (``kvlab.quality.window_loss``, shared with the tests): tokenize the whole file as one
   string, cut the ids into consecutive non-overlapping 512-token windows (the last
   partial window is dropped), run the model in fp32 and average the cross-entropy over
   all 511 predicted positions of every window; perplexity = exp(mean).
6. **Export.** ``save_pretrained`` in fp16 safetensors plus the tokenizer, ``heldout.txt``
   and ``metrics.json``. The fp16 folder is loaded back as fp32 and re-evaluated (this is
   the figure the tests check), and its greedy output is compared with the fp32 model's.

Reproduce the shipped model (1,800 steps: roughly 20-30 minutes on an idle 2-core CPU; the
shipped run took 47 minutes because other work shared the two cores)::

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python models/train_tiny.py

``OMP_WAIT_POLICY=PASSIVE`` matters on a small shared machine: with the default (active)
policy, idle OpenMP threads spin and a 2-thread run can slow down tenfold when anything
else runs at the same time. The script sets it itself when it is not set, but the
variable must be in place before torch is imported, so setting it in the shell is the
reliable way.

The same script trains chapter 10's draft model, ``kvlab-nano``: narrower and shallower, on the same
corpus and split, with kvlab-tiny's tokenizer reused rather than retrained (``--tokenizer``), so that
both models mean the same text by the same token id (see ``models/kvlab-nano/README.md``)::

    OMP_WAIT_POLICY=PASSIVE nice -n 10 .venv/bin/python models/train_tiny.py --tokenizer models/kvlab-tiny \
        --name kvlab-nano --layers 2 --heads 2 --width 128 --steps 600 --warmup 30 --out models/kvlab-nano

A quick end-to-end check of the whole pipeline (seconds, no network)::

    .venv/bin/python models/train_tiny.py --smoke --corpus SOME_FILE --out /tmp/tiny

``--corpus`` takes a file in the format the ``bible`` program prints (``Ge1:1 In the
beginning ...``: a book abbreviation, ``chapter:verse``, a space, the verse), so the
download step can be skipped.
"""

from __future__ import annotations

import os

# Must happen before torch (and its OpenMP runtime) is loaded.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import copy
import hashlib
import json
import math
import platform
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))   # the perplexity protocol lives in kvlab (importable without installing it)
from kvlab.quality import window_loss
WORK = REPO / "models" / "_work"
DEFAULT_OUT = REPO / "models" / "kvlab-tiny"
EOT = "<|endoftext|>"
VERSE_RE = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")
SAMPLE_PROMPTS = [
    "In the beginning",
    "And the LORD said unto Moses,",
    "Blessed are the",
    "The kingdom of heaven is like",
]


# ----------------------------------------------------------------------------------------
# 1. Corpus


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("$", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def fetch_bible(work: Path) -> tuple[Path, dict]:
    """Download and unpack the Debian packages, print every verse to ``work/kjv-raw.txt``."""
    work.mkdir(parents=True, exist_ok=True)
    raw = work / "kjv-raw.txt"
    debs = sorted(work.glob("bible-kjv*.deb"))
    if len(debs) < 2:
        run(["apt-get", "download", "bible-kjv", "bible-kjv-text"], cwd=work)
        debs = sorted(work.glob("bible-kjv*.deb"))
    root = work / "unpacked"
    for deb in debs:
        run(["dpkg-deb", "-x", str(deb), str(root)])
    packages = {}
    for deb in debs:
        fields = subprocess.run(
            ["dpkg-deb", "-f", str(deb), "Package", "Version"], check=True, capture_output=True, text=True
        ).stdout
        info = dict(line.split(": ", 1) for line in fields.strip().splitlines())
        packages[info["Package"]] = info["Version"]
    # -p: where to look for bible.data; -f: the flag toggles pretty-printing, which with
    # this build gives exactly one "Ref text" line per verse.
    out = run(
        [str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-f", "gen1:1-rev22:21"],
        capture_output=True,
        text=True,
    ).stdout
    raw.write_text(out, encoding="utf-8")
    return raw, packages


def parse_verses(raw_text: str) -> list[tuple[str, int, str]]:
    """``[(book, chapter, verse_text), ...]`` from the ``bible`` program's output."""
    verses = []
    for n, line in enumerate(raw_text.splitlines(), 1):
        if not line.strip():
            continue
        m = VERSE_RE.match(line)
        if m is None:
            raise ValueError(f"line {n} is not a verse: {line[:80]!r}")
        verses.append((m.group(1), int(m.group(2)), m.group(4).strip()))
    return verses


def format_corpus(verses, holdout_every: int = 20) -> tuple[str, str, str, int]:
    """Return (full, train, heldout) texts and the number of chapters.

    One verse per line, a blank line between chapters, ``<|endoftext|>`` on its own line
    between books. Chapter number k (0-based, counted across the whole Bible) goes to the
    held-out split when ``k % holdout_every == holdout_every - 1``; each split keeps the
    same layout (a book with no held-out chapter simply does not appear in it).
    """
    books: list[tuple[str, list[list[str]]]] = []  # [(book, [chapter lines])]
    last = None
    for book, chapter, text in verses:
        if last is None or last[0] != book:
            books.append((book, []))
        if last != (book, chapter):
            books[-1][1].append([])
        books[-1][1][-1].append(text)
        last = (book, chapter)

    def join(selected_books):
        parts = ["\n\n".join("\n".join(ch) for ch in chapters) for chapters in selected_books if chapters]
        return f"\n{EOT}\n".join(parts) + "\n"

    full, train, held = [], [], []
    k = 0
    for _, chapters in books:
        full.append(chapters)
        train.append([])
        held.append([])
        for ch in chapters:
            (held if k % holdout_every == holdout_every - 1 else train)[-1].append(ch)
            k += 1
    return join(full), join(train), join(held), k


# ----------------------------------------------------------------------------------------
# 2. Tokenizer


def train_tokenizer(train_text: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (as GPT-2) trained on the training split only; ``<|endoftext|>`` = id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Train on documents (books) so that no merge crosses the <|endoftext|> marker.
    tok.train_from_iterator((doc for doc in train_text.split(EOT) if doc.strip()), trainer=trainer)
    assert tok.token_to_id(EOT) == 0, "<|endoftext|> must be id 0"
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        unk_token=EOT,
        pad_token=EOT,
        model_max_length=512,
    )


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one string; ``<|endoftext|>`` in the text becomes id 0 and
    nothing else is added (this tokenizer has no post-processor)."""
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


# ----------------------------------------------------------------------------------------
# 3-5. Model, evaluation


def lr_at(step: int, args) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_frac`` at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def greedy(model, tokenizer, prompt: str, n: int = 40, use_cache: bool = True) -> list[int]:
    enc = tokenizer(prompt, return_tensors="pt")
    out = model.generate(
        **enc, max_new_tokens=n, do_sample=False, use_cache=use_cache, pad_token_id=0, eos_token_id=None
    )
    return out[0, enc["input_ids"].shape[1] :].tolist()


def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ----------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output model folder")
    p.add_argument("--work", type=Path, default=WORK, help="scratch folder (downloads, raw corpus)")
    p.add_argument("--corpus", type=Path, default=None, help="use this `bible`-format file instead of downloading")
    p.add_argument("--smoke", action="store_true", help="tiny end-to-end run (seconds) to test the pipeline")
    p.add_argument(
        "--tokenizer", type=Path, default=None,
        help="reuse this model folder's tokenizer instead of training one (a draft model must share its target's)",
    )
    p.add_argument("--name", default="kvlab-tiny", help="model name written to metrics.json")
    p.add_argument("--steps", type=int, default=1800, help="optimizer steps (the budget; not wall clock)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.0, help="resid/embd/attn dropout (GPT-2 uses 0.1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--holdout-every", type=int, default=20, help="hold out every N-th chapter")
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 instead of bf16 autocast")
    p.add_argument("--eval-every", type=int, default=200, help="quick validation estimate every N steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.batch, args.ctx, args.warmup = 5, 2, 64, 2
        args.vocab, args.layers, args.heads, args.width = 300, 2, 2, 64
        args.eval_every, args.holdout_every = 0, 4

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.time()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    # 1. Corpus -------------------------------------------------------------------------
    packages = {}
    if args.corpus is not None:
        raw_path = args.corpus
    else:
        raw_path, packages = fetch_bible(args.work)
    raw_text = raw_path.read_text(encoding="utf-8")
    verses = parse_verses(raw_text)
    full, train_text, held_text, n_chapters = format_corpus(verses, args.holdout_every)
    corpus_sha = hashlib.sha256(full.encode("utf-8")).hexdigest()
    (out / "heldout.txt").write_text(held_text, encoding="utf-8")
    print(
        f"corpus: {len(verses):,} verses, {n_chapters:,} chapters, {len(full.encode()):,} bytes "
        f"(sha256 {corpus_sha[:16]}...); train {len(train_text.encode()):,} B, held out {len(held_text.encode()):,} B",
        flush=True,
    )

    # 2. Tokenizer ----------------------------------------------------------------------
    t0 = time.time()
    if args.tokenizer is not None:   # the files as they are (a save would add the loader's flags)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(args.tokenizer / name, out / name)
    else:
        train_tokenizer(train_text, args.vocab).save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)  # from here on, use what ships
    train_ids = torch.tensor(encode(tokenizer, train_text), dtype=torch.long)
    held_ids = encode(tokenizer, held_text)
    print(
        f"tokenizer: {len(tokenizer):,} tokens in {time.time() - t0:.1f}s ({type(tokenizer).__name__}); "
        f"train {train_ids.numel():,} tokens ({len(train_text) / train_ids.numel():.2f} chars/token), "
        f"held out {len(held_ids):,} tokens",
        flush=True,
    )

    # 3. Model --------------------------------------------------------------------------
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=512,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=args.heads,
        activation_function="gelu_new",
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        resid_pdrop=args.dropout,
        embd_pdrop=args.dropout,
        attn_pdrop=args.dropout,
    )
    model = GPT2LMHeadModel(config)
    # On a 2-core CPU the plain ("eager") attention trains ~1.5x faster than SDPA at this
    # size; the saved folder does not pin an implementation, so loaders get their default.
    model.set_attn_implementation("eager")
    model.generation_config.pad_token_id = 0
    n_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    print(f"model: {n_params:,} parameters", flush=True)

    # 4. Training -----------------------------------------------------------------------
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.no_bf16)
    log = []
    model.train()
    t_train = time.time()
    bar = tqdm(range(args.steps), desc="train", mininterval=10, file=sys.stdout, dynamic_ncols=False, ncols=100)
    for step in bar:
        lr = lr_at(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, train_ids.numel() - args.ctx - 1, (args.batch,), generator=gen)
        x = torch.stack([train_ids[s : s + args.ctx] for s in starts.tolist()])
        with autocast:
            loss = model(input_ids=x, labels=x).loss  # HF shifts the labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        elapsed = time.time() - t_train
        tok_s = (step + 1) * args.batch * args.ctx / elapsed
        entry = {"step": step + 1, "loss": round(loss.item(), 4), "lr": lr, "grad_norm": round(grad_norm.item(), 3)}
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            vl, _ = window_loss(model, held_ids, max_windows=16)
            entry["val_loss_16win"] = round(vl, 4)
            tqdm.write(
                f"step {step + 1:5d} | loss {loss.item():.3f} | val(16 win) {vl:.3f} ppl {math.exp(vl):.1f} "
                f"| lr {lr:.2e} | {tok_s:,.0f} tok/s | {elapsed / 60:.1f} min",
                file=sys.stdout,
            )
            sys.stdout.flush()
        log.append(entry)
    bar.close()
    train_time = time.time() - t_train

    # 5. Evaluation (fp32) --------------------------------------------------------------
    model.eval()
    val_loss, n_val_windows = window_loss(model, held_ids, window=args.ctx)
    train_loss, n_train_windows = window_loss(model, train_ids, window=args.ctx, max_windows=48)
    print(f"fp32: val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f} | train loss {train_loss:.4f}", flush=True)

    # 6. Export in fp16, reload as fp32, re-evaluate and compare greedy output ----------
    copy.deepcopy(model).half().save_pretrained(out)
    reloaded = GPT2LMHeadModel.from_pretrained(out, dtype=torch.float32).eval()
    val16, _ = window_loss(reloaded, held_ids, window=args.ctx)
    train16, _ = window_loss(reloaded, train_ids, window=args.ctx, max_windows=48)
    greedy_match = {}
    samples = []
    for prompt in SAMPLE_PROMPTS:
        a = greedy(model, tokenizer, prompt)
        b = greedy(reloaded, tokenizer, prompt)
        greedy_match[prompt] = a == b
        torch.manual_seed(args.seed)
        enc = tokenizer(prompt, return_tensors="pt")
        s = reloaded.generate(
            **enc, max_new_tokens=60, do_sample=True, temperature=0.8, top_k=50, pad_token_id=0, eos_token_id=None
        )
        samples.append(
            {
                "prompt": prompt,
                "greedy_40": tokenizer.decode(b, skip_special_tokens=False),
                "sampled_60": tokenizer.decode(s[0, enc["input_ids"].shape[1] :], skip_special_tokens=False),
            }
        )
    print(f"fp16->fp32: val loss {val16:.4f} ppl {math.exp(val16):.2f}; greedy identical: {greedy_match}", flush=True)

    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.name != "metrics.json")
    metrics = {
        "model": args.name if not args.smoke else f"{args.name} (smoke test)",
        "tokenizer": "trained" if args.tokenizer is None else f"reused from {args.tokenizer.name}",
        "smoke": args.smoke,
        "steps": args.steps,
        "batch": args.batch,
        "context": args.ctx,
        "tokens_seen": args.steps * args.batch * args.ctx,
        "train_time_s": round(train_time, 1),
        "total_time_s": round(time.time() - t_start, 1),
        "tokens_per_s": round(args.steps * args.batch * args.ctx / train_time, 1),
        "threads": args.threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "seed": args.seed,
        "hyperparameters": {
            "lr": args.lr,
            "holdout_every": args.holdout_every,
            "min_lr_frac": args.min_lr_frac,
            "warmup": args.warmup,
            "weight_decay": args.weight_decay,
            "betas": [0.9, 0.95],
            "clip": args.clip,
            "dropout": args.dropout,
            "train_attn_implementation": "eager",
            "bf16_autocast": not args.no_bf16,
        },
        "parameters": n_params,
        "vocab_size": len(tokenizer),
        "corpus": {
            "source": "Debian bible-kjv + bible-kjv-text" if args.corpus is None else str(args.corpus),
            "debian_packages": packages,
            "sha256_raw_bible_output": hashlib.sha256(raw_text.encode("utf-8")).hexdigest(),
            "sha256_formatted_corpus": corpus_sha,
            "sha256_heldout": hashlib.sha256(held_text.encode("utf-8")).hexdigest(),
            "verses": len(verses),
            "chapters": n_chapters,
            "bytes": len(full.encode("utf-8")),
            "train_bytes": len(train_text.encode("utf-8")),
            "heldout_bytes": len(held_text.encode("utf-8")),
            "train_tokens": train_ids.numel(),
            "heldout_tokens": len(held_ids),
        },
        "eval_protocol": "heldout.txt tokenized as one string; consecutive non-overlapping 512-token windows "
        "(last partial dropped); fp32; mean CE over the 511 predicted positions of every window; ppl = exp(mean)",
        "fp32": {
            "val_loss": val_loss,
            "val_ppl": math.exp(val_loss),
            "val_windows": n_val_windows,
            "train_loss": train_loss,
            "train_ppl": math.exp(train_loss),
            "train_windows": n_train_windows,
        },
        "fp16_saved_loaded_as_fp32": {
            "val_loss": val16,
            "val_ppl": math.exp(val16),
            "train_loss": train16,
            "train_ppl": math.exp(train16),
        },
        "greedy_fp16_vs_fp32_identical": greedy_match,
        "folder_bytes": size,
        "samples": {"seed": args.seed, "temperature": 0.8, "top_k": 50, "weights": "fp16 saved, loaded as fp32", "items": samples},
        "log": log,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")
    print(f"saved {out} ({size / 1e6:.1f} MB) in {time.time() - t_start:.0f}s", flush=True)
    return metrics


if __name__ == "__main__":
    main()
