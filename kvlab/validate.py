"""Input checks at the library's boundaries, one place for each rule.

Every public entry point checks its arguments here, before any work: token ids against the model's
vocabulary, lengths against its context (``n_positions``), counts as integers (``True`` is not 1).
Each error says what was wrong and how to fix it.
"""

from __future__ import annotations
import numbers
import operator
import torch
from . import configs   # (configs checks its counts here: imported as a module, used at call time)


def check_ids(input_ids, batched: bool = False,
              hint: str = "use tokenizer(text, return_tensors='pt').input_ids") -> None:
    """``input_ids`` must be a non-empty ``LongTensor [1, T]`` (``[B, T]`` when ``batched``)."""
    shape = "[batch, T]" if batched else "[1, T]"
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a torch.LongTensor of token ids, shape {shape}; {hint}")
    if input_ids.dim() != 2 or (not batched and input_ids.shape[0] != 1):
        raise ValueError(f"input_ids must have shape {shape}, got {list(input_ids.shape)}"
                         + ("" if batched else "; for several prompts see chapter 6 (batched generation)"))
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"the prompt is empty (shape {list(input_ids.shape)}): greedy generation needs at "
                         "least one token to condition on (start from the tokenizer's bos/eos token if you "
                         "want unconditional text)")


def check_vocab(model, input_ids: torch.Tensor) -> None:
    """Every id of ``input_ids`` must be a row of the model's embedding: ``0 <= id < vocab_size``."""
    vocab = configs.config_field(configs.config_of(model), "vocab_size")
    if vocab is None or input_ids.numel() == 0:
        return
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        where = (input_ids == bad).nonzero()[0].tolist()
        raise ValueError(f"token id {bad} at position {where} is outside the model's vocabulary "
                         f"[0, {vocab}); encode the text with this model's own tokenizer "
                         "(kvlab-tiny and GPT-2 have different vocabularies)")


def is_int(x) -> bool:
    """An integer that is not a bool (True is an int to Python, never a count or an id to us)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_context(total: int, limit: int | None, what: str,
                  fix: str = "shorten the prompt or ask for fewer tokens") -> None:
    """The one rule of GPT-2's context: ``total`` positions must fit its ``limit`` (``n_positions``).

    There is no position embedding beyond the context, so nothing is truncated for the caller: the
    error names what went past it (``what``) and how to fix it (``fix``)."""
    if limit is not None and total > limit:
        raise ValueError(f"{what} = {total} exceeds the model's context of {limit} positions "
                         f"(n_positions={limit}: GPT-2 has no position embedding beyond it); {fix}")


def check_budget(model, prompt_len: int, max_new_tokens: int, what: str = "prompt") -> None:
    """``max_new_tokens`` must be an int >= 0, and ``prompt_len + max_new_tokens`` fit the context."""
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int (a count of tokens), got "
                         f"{max_new_tokens!r}; pass e.g. max_new_tokens=20")
    check_context(prompt_len + max_new_tokens, configs.context_length(model),
                  f"{what} ({prompt_len} tokens) + max_new_tokens ({max_new_tokens})")


def check_inputs(model, input_ids, max_new_tokens: int, batched: bool = False) -> torch.Tensor:
    """Validate a prompt (``[1, T]``; ``[B, T]`` of equal-length prompts when ``batched``) and a token
    budget; return ``input_ids`` on the model's device."""
    check_ids(input_ids, batched)
    check_vocab(model, input_ids)
    check_budget(model, input_ids.shape[1], max_new_tokens)
    return input_ids.to(next(model.parameters()).device)


def check_prompt(prompt, vocab_size: int | None = None) -> list[int]:
    """A prompt given as token ids (a list, a tuple, a 1-D tensor or a ``[1, T]`` one) as a list of
    ints, refusing what a plain ``torch.tensor(prompt, dtype=torch.long)`` would silently coerce:
    float ids (``5.7`` would become ``5``), bools, an empty prompt, ids outside the vocabulary."""
    if isinstance(prompt, torch.Tensor):
        one_row = prompt.dim() == 1 or (prompt.dim() == 2 and prompt.shape[0] == 1)
        if prompt.dtype != torch.long or not one_row:
            raise ValueError(f"a prompt tensor must be a LongTensor of shape [T] or [1, T], got {prompt.dtype} "
                             f"{list(prompt.shape)}; use tokenizer(text).input_ids")
        prompt = prompt.flatten().tolist()
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (list, tuple)):
        raise ValueError(f"a prompt must be a list of int token ids, got {type(prompt).__name__}; "
                         "encode text first: tokenizer(text).input_ids")
    bad = next((x for x in prompt if not is_int(x)), None)
    if bad is not None:
        raise ValueError(f"token ids must be ints, got {bad!r} ({type(bad).__name__}) in the prompt; "
                         "nothing is rounded or truncated for you: pass tokenizer(text).input_ids")
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one token to condition on "
                         "(start from the tokenizer's bos/eos token for unconditional text)")
    for i, x in enumerate(prompt):
        check_token_id(x, vocab_size, f"token id at position {i}")
    return [int(x) for x in prompt]


def check_counts(**counts) -> None:
    """Each named value must be an int >= 0 (a count of tokens or positions)."""
    for what, n in counts.items():
        if not is_int(n) or n < 0:
            raise ValueError(f"{what} must be an int >= 0 (a count of tokens), got {n!r}")


def check_token_id(token_id, vocab_size: int | None = None, what: str = "eos_token_id") -> int:
    """One token id (an end-of-text id, say): an int in ``[0, vocab_size)``, not a list or a bool."""
    if not is_int(token_id):
        if isinstance(token_id, (list, tuple)):
            raise ValueError(f"{what} must be one int token id, got the {type(token_id).__name__} "
                             f"{token_id!r}; kvlab stops at a single id: pass e.g. tokenizer.eos_token_id")
        raise ValueError(f"{what} must be an int token id, got {token_id!r} ({type(token_id).__name__}); "
                         "pass e.g. tokenizer.eos_token_id")
    if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
        raise ValueError(f"{what} = {token_id} is outside the model's vocabulary [0, {vocab_size}); "
                         "use an id of this model's own tokenizer")
    return int(token_id)


def check_max_len(max_len, n_positions: int) -> int:
    """The length a preallocated/static cache is built for: ``None`` means the whole context
    (``n_positions``); otherwise an int with ``1 <= max_len <= n_positions``."""
    if max_len is None:
        return n_positions
    if not is_int(max_len) or max_len < 1:
        raise ValueError(f"max_len must be an int >= 1 (the prompt plus the new tokens the cache must "
                         f"hold), got {max_len!r}; pass max_len=None for the model's whole context "
                         f"({n_positions} positions)")
    check_context(max_len, n_positions, "max_len", "pass at most that")
    return int(max_len)


def check_int(value, what: str, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``, or a ValueError naming ``what``: the one integer rule.

    Ints and numpy ints only: 12.5 layers is a bug upstream, and ``True`` is not 1 (a bool passed as a
    count is almost always a flag in the wrong argument)."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
    return n


def check_count(value, what: str) -> int:
    return check_int(value, what, minimum=0)
