"""Batched speculative decoding on the paged cache (chapter 10): rows accept different counts.

transformers refuses speculation for a batch larger than one: with one dense ``[batch, seq]`` cache,
rows that accept different numbers of drafts end at different lengths, and a single ``crop`` cannot
rewind them apart. On chapter 9's paged cache each sequence owns its block table, so each one is
rewound on its own (chapter 9's block manager, ``truncate``: the blocks after the kept tokens go
back to the free list). One ragged forward of chapter 9's runner verifies every row's pending token and drafts side by side;
each row then accepts, emits and rewinds by itself, and a finished row leaves the batch.
"""

from __future__ import annotations

import torch

from .paged import blocks_for
from .serving.block_manager import BlockManager
from .serving.runner import Runner
from .serving.sequence import Sequence
from .validate import check_context, check_prompt
from .speculative import check_draft, check_k


def _verify_rows(model, runner: Runner, blocks: BlockManager, seqs: dict, drafted: dict) -> dict:
    """One ragged target forward over every active row's ``[pending, drafts...]`` (logits at every
    token); accept per row, rewind per row. Returns ``{row: new tokens}``."""
    work = []
    for r, s in seqs.items():
        s.output += drafted[r]                          # tentatively: the forward computes them
        blocks.grow(s, s.num_tokens)
        work.append((s, 1 + len(drafted[r])))
    ids, view, _ = runner.prepare(work)
    choice = model(ids, cache=view)[0].argmax(dim=-1).tolist()     # [N]: each row's predictions in turn
    out, at = {}, 0
    for (s, n_run), r in zip(work, seqs):
        mine, d = choice[at:at + n_run], drafted[r]
        at += n_run
        n = 0
        while n < len(d) and d[n] == mine[n]:
            n += 1
        del s.output[len(s.output) - len(d) + n:]       # the rejected drafts go
        s.num_computed += 1 + n                         # the pending token and the accepted drafts
        blocks.truncate(s, s.num_computed)              # this row only: its own blocks
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
    blocks, runner = BlockManager(num_blocks, block_size, prefix_caching=False), Runner(model, num_blocks, block_size)
    seqs = {i: Sequence(i, tuple(p), max(max_new_tokens, 1)) for i, p in enumerate(prompts)}
    rows = {i: list(p) for i, p in enumerate(prompts)}
    ends = {i: len(p) + max_new_tokens for i, p in enumerate(prompts)}
    drafts = {i: make_draft() for i in rows}
    log = []
    if max_new_tokens:
        for s in seqs.values():
            blocks.allocate(s, s.num_tokens)
        work = [(s, s.num_tokens) for s in seqs.values()]
        for (s, n), t in zip(work, runner.run(work)):   # prefill every prompt, one forward
            s.num_computed += n
            s.output.append(t)
            rows[s.rid].append(t)
            check_draft(model, drafts[s.rid], ends[s.rid])
            drafts[s.rid].start(rows[s.rid], ends[s.rid], None)
    active = {i: r for i, r in rows.items() if len(r) < ends[i]}
    while active:
        drafted = {i: drafts[i].propose(r, min(k, ends[i] - len(r) - 1))[0] if ends[i] - len(r) > 1 else []
                   for i, r in active.items()}
        new = _verify_rows(model, runner, blocks, {i: seqs[i] for i in active}, drafted)
        log.append({i: len(t) - 1 for i, t in new.items()})
        for i, t in new.items():
            rows[i] += t
            seqs[i].output.append(t[-1])                # the model's own token after the accepted drafts
            drafts[i].accept(rows[i])
        for i in [i for i in active if len(rows[i]) >= ends[i]]:
            blocks.free(seqs[i])                        # a finished row's blocks go back at once
            del active[i]
    return [rows[i] for i in range(len(prompts))], log
