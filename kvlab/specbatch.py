"""Batched speculative decoding on the paged cache (chapter 10): rows accept different counts.

transformers refuses speculation for a batch larger than one: with one dense ``[batch, seq]`` cache,
rows that accept different numbers of drafts end at different lengths, and a single ``crop`` cannot
rewind them apart. On chapter 9's paged cache each sequence owns its block table, so each one is
rewound on its own (``PagedPool.rewind(seq_id, length)``: the blocks after the kept tokens go back
to the free list). One ragged forward verifies every row's pending token and drafts side by side;
each row then accepts, emits and rewinds by itself, and a finished row leaves the batch.
"""

from __future__ import annotations

import torch

from .paged import blocks_for
from .paged_cache import PagedPool
from .validate import check_context, check_prompt
from .speculative import check_draft, check_k


def _verify_rows(model, cache: PagedPool, rows: dict, drafted: dict) -> dict:
    """One ragged target forward over every active row's ``[pending, drafts...]``; accept per row,
    rewind per row. Returns ``{row: new tokens}``."""
    ids = list(rows)
    chunks = [[rows[r][-1], *drafted[r]] for r in ids]
    cache.begin_step(ids, [len(c) for c in chunks])
    x = torch.tensor([[t for c in chunks for t in c]], device=model.wte.weight.device)
    choice = model(x, cache)[0].argmax(dim=-1).tolist()     # [N]: each row's predictions in turn
    out, at = {}, 0
    for r, c in zip(ids, chunks):
        mine, d = choice[at:at + len(c)], drafted[r]
        at += len(c)
        n = 0
        while n < len(d) and d[n] == mine[n]:
            n += 1
        cache.rewind(r, len(rows[r]) + n)            # this row only: its own blocks
        out[r] = d[:n] + [mine[n]]
    return out


@torch.no_grad()
def batched_speculative_generate(model, prompts, max_new_tokens: int, make_draft, k: int = 4,
                                 block_size: int = 16):
    """Greedy speculative decoding of several prompts (any lengths) in one batch on a paged cache.
    ``make_draft()`` builds one draft per row (each keeps its own state). Returns a list of token
    lists, prompt included, each equal to that prompt decoded alone. Also returns the per-step
    accepted counts per row, ``[{row: n}, ...]``, to show the rows diverge."""
    k = check_k(k)
    prompts = [check_prompt(p, model.config.vocab_size) for p in prompts]
    if not prompts:
        raise ValueError("batched_speculative_generate needs at least one prompt")
    check_context(max(len(p) for p in prompts) + max_new_tokens, model.config.n_positions,
                  "the longest prompt + max_new_tokens")
    num_blocks = sum(blocks_for(len(p) + max_new_tokens, block_size) for p in prompts)
    cache = PagedPool.for_model(model, num_blocks, block_size)
    rows = {i: list(p) for i, p in enumerate(prompts)}
    ends = {i: len(p) + max_new_tokens for i, p in enumerate(prompts)}
    drafts = {i: make_draft() for i in rows}
    log = []
    if max_new_tokens:
        cache.begin_step(list(rows), [len(p) for p in prompts])   # prefill every prompt, one forward
        x = torch.tensor([[t for p in prompts for t in p]], device=model.wte.weight.device)
        last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        for i, t in enumerate(model(x, cache, select=last)[0].argmax(-1).tolist()):
            rows[i].append(t)
            check_draft(model, drafts[i], ends[i])
            drafts[i].start(rows[i], ends[i], None)
    active = {i: r for i, r in rows.items() if len(r) < ends[i]}
    while active:
        drafted = {i: drafts[i].propose(r, min(k, ends[i] - len(r) - 1))[0] if ends[i] - len(r) > 1 else []
                   for i, r in active.items()}
        new = _verify_rows(model, cache, active, drafted)
        log.append({i: len(t) - 1 for i, t in new.items()})
        for i, t in new.items():
            rows[i] += t
            drafts[i].accept(rows[i])
        for i in [i for i in active if len(rows[i]) >= ends[i]]:
            cache.free(i)                              # a finished row's blocks go back at once
            del active[i]
    return [rows[i] for i in range(len(prompts))], log
