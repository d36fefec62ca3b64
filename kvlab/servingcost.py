"""What a ragged step costs, part by part (chapter 9): the price of paging against chapter 3's
contiguous step, the gather inside it, the two ways to attend a prompt chunk, the chunk-size cost
model from chapter 7's floor, and the prefill two identical prompts pay when they arrive together.
The engine (:mod:`kvlab.serving`) measures nothing; this does, beside :mod:`kvlab.servingbench`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .configs import kv_dims
from .paged import blocks_for
from .ragged import causal_chunk
from .roofline import forward_floor
from .serving import Engine
from .servingbench import prepared_steps
from .timing import Budget, compare


def ragged_vs_contiguous(model, rows: int, context: int, repeats: int = 5, budget: Budget | None = None) -> dict:
    """Interleaved timings of one decode step of ``rows`` sequences holding ``context`` tokens each
    (equal lengths): the engine's ragged step on the paged pool with its keys read in place
    (:class:`kvlab.ragged.PagedDecode`: the C++ loop on a CPU) and with the gather (every key copied
    out of the blocks first), chapter 3's batched step on a contiguous :class:`~kvlab.cache.PreallocatedCache`
    (rewound after each run, so every run is the same step; its greedy tokens picked, as the ragged
    step picks them), and the gather alone (every layer's keys
    and values copied out, as the gathering step copies them). The first call of the paged step,
    which compiles, is made before the timing. ``budget`` (a :class:`kvlab.timing.Budget`) may cut the
    rounds; its note says how many."""
    runner, decode, _ = prepared_steps(model, rows, context, 1, paged=True)
    copying = prepared_steps(model, rows, context, 1, paged=False)
    cache = model.new_cache(rows, context + 1)
    ids = torch.randint(1, model.config.vocab_size, (rows, context + 1), device=runner.device)
    with torch.no_grad():
        model(ids[:, :context], cache)
    _, view, _ = runner.prepare(decode)
    segs = view.segments
    (L, (_, tables)), = segs.decode.items()
    runner.run(decode)                       # compiles the paged kernel for these shapes (not timed)

    def contiguous():          # a step gives its next tokens, as the ragged one does: the argmax is in it
        with torch.no_grad():
            model(ids[:, context:], cache, last_only=True)[:, -1].argmax(-1).tolist()
        cache.rewind(context)

    def gather():
        for layer in range(runner.keys.shape[0]):
            segs.keys(runner.keys[layer], tables, L, 0), segs.keys(runner.values[layer], tables, L, 1)

    fns = {"ragged step, keys read in place": lambda: runner.run(decode),
           "ragged step, keys gathered": lambda: copying[0].run(copying[1]),
           "contiguous step (chapter 3)": contiguous, "the gather alone": gather}
    return compare(fns, warmup=2, repeats=repeats, progress=False, budget=budget)


def gather_bytes(model, rows: int, context: int) -> int:
    """Bytes one decode step's gather writes (it reads as many): the keys and values of exactly the
    slots attention reads (the unused tail of a last block is not copied), every layer, for ``rows``
    sequences holding ``context + 1`` tokens each (whatever the block size)."""
    n_layer, heads, head_dim = kv_dims(model.config)
    slots = rows * (context + 1)
    return 2 * n_layer * slots * heads * head_dim * next(model.parameters()).element_size()


def chunk_attention_timings(sizes, heads: int, head_dim: int, seconds: float, repeats: int = 5, device="cpu"):
    """Per ``(chunk, cached prefix)`` of ``sizes`` (cheapest first), interleaved timings of one prompt
    chunk's attention: one fused masked call (the engine's default; it scores the masked future half
    of the chunk's square) against :func:`kvlab.ragged.causal_chunk` (the visible pairs only).
    ``(rows, budget)``: the budget (``seconds``) may leave the largest sizes out, and says so."""
    budget, rows = Budget(seconds, "the chunk-attention timings"), []
    g = torch.Generator().manual_seed(0)
    for n, start in budget.points(sizes, size=lambda s: s[0] * (s[0] + s[1])):
        q, k, v = (torch.randn(1, heads, m, head_dim, generator=g).to(device) for m in (n, start + n, start + n))
        key_pos = torch.arange(start + n, device=device)
        mask = key_pos[None, :] <= torch.arange(start, start + n, device=device)[:, None]
        t = compare({"one masked call": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                     "visible pairs only": lambda: causal_chunk(q, k, v, start)}, warmup=1, repeats=repeats,
                    progress=False)
        rows.append(dict(chunk=n, prefix=start, masked=n * (n - 1) // 2, visible=n * start + n * (n + 1) // 2, **t))
    return rows, budget


def chunk_cost_model(model, budgets, decoders: int, decode_ctx: int, long_prompt: int, bandwidth: float,
                     flops: float) -> list[dict]:
    """Chapter 7's floor (:func:`kvlab.roofline.forward_floor`) of :func:`kvlab.servingbench.chunk_sweep`'s
    scenario, per token budget (None: the prompt in one step): ``decoders`` sequences of about
    ``decode_ctx`` tokens decode one token a step (decode-first), and a ``long_prompt``-token prompt
    fills the rest of each step. Predicted stall: the floor of the widest step (what a decoder waits
    for); predicted TTFT: the sum of the floors of the steps that carry the prompt."""
    out = []
    for b in budgets:
        chunk = long_prompt if b is None else max(b - decoders, 1)
        floors, done = [], 0
        while done < long_prompt:
            n = min(chunk, long_prompt - done)
            pairs = decoders * decode_ctx + n * done + n * (n + 1) // 2
            floors.append(forward_floor(model, decoders + n, decoders + (done + n == long_prompt),
                                        decoders * decode_ctx + done, pairs, bandwidth, flops))
            done += n
        out.append(dict(budget=b, steps=len(floors), stall=max(floors), ttft=sum(floors)))
    return out


def identical_prompts(model, prompt_len: int, block_size: int = 16, seed: int = 0) -> dict:
    """Prompt tokens computed and prefix-cache hits when a second request with the same
    ``prompt_len``-token prompt arrives in the same step as the first ("together"), and when it
    arrives once the first has run its prefill ("one after the other"); prefix caching on in both.
    This engine registers a block's key once the block is computed; vLLM registers it when the block
    is scheduled, so its second copy would find the first's blocks in the same step."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, model.config.vocab_size, (prompt_len,), generator=g).tolist()
    out = {}
    for name, together in (("together", True), ("one after the other", False)):
        eng = Engine(model, num_blocks=4 * blocks_for(prompt_len + 2, block_size), block_size=block_size,
                     max_num_batched_tokens=2 * prompt_len + 2)
        eng.submit(prompt, 2)
        if not together:
            eng.step()                        # the first request's prefill runs alone
        eng.submit(prompt, 2, arrival=eng.clock.now())
        eng.run()
        out[name] = dict(computed=sum(t["prefill_tokens"] for t in eng.trace.steps), hits=eng.blocks.hits,
                         hit_tokens=eng.blocks.hit_tokens, engine=eng)
    return out
