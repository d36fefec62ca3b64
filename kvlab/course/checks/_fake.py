"""A fake language model that follows the one-forward contract (``forward(input_ids, cache, positions)``,
``cache.update(layer, k, v, positions) -> keys, values, key_pos``): lab 9's graders and the tests use it
to check serving bookkeeping in milliseconds (one real-model run per grader confirms the rest).

Its next token is a function of every token it can see and their positions, so a key taken from another
sequence, a stale block, a lost token or a wrong position changes the output: the greedy continuation
of ``tokens`` is ``(sum((p + 1) * t for p, t in enumerate(tokens)) + 7) % vocab``.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn


class FakeLM(nn.Module):
    def __init__(self, vocab=97, n_positions=128, n_layer=2, n_head=2, head_dim=4, poison=None):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab, n_positions=n_positions, n_layer=n_layer, n_head=n_head,
                                      n_embd=n_head * head_dim, head_dim=head_dim)
        self.dummy = nn.Parameter(torch.zeros(1))
        self.poison, self.calls = poison, []

    def forward(self, input_ids, cache=None, positions=None, select=None):
        B, T = input_ids.shape
        self.calls.append(T)
        if self.poison is not None and bool((input_ids == self.poison).any()):
            raise ValueError(f"poisoned token {self.poison}")
        if positions is None:
            positions = torch.arange(T)[None].expand(B, T) if cache is None else cache.next_positions(B, T)
        cfg = self.config
        k = torch.zeros(B, cfg.n_head, T, cfg.head_dim)
        k[..., 0], k[..., 1] = input_ids.float()[:, None], positions.float()[:, None]
        for layer in range(cfg.n_layer):
            if cache is None:
                keys, values, key_pos = k, k, positions[:, None, :].expand(B, T, T)
            else:
                keys, values, key_pos = cache.update(layer, k, k.clone(), positions)   # the one interface
                if hasattr(key_pos, "dense"):      # a ragged step's segments, as one masked attention sees them
                    keys, values, key_pos = key_pos.dense(keys, values)
        mask = (key_pos >= 0) & (key_pos <= positions[..., None])            # [B, T, S]
        weight = values[:, 0, :, 0] * (values[:, 0, :, 1] + 1)               # [B, S]
        score = (mask * weight[:, None, :]).sum(-1).round().long()           # [B, T]
        logits = torch.nn.functional.one_hot((score + 7) % cfg.vocab_size, cfg.vocab_size).float()
        return logits if select is None else logits[:, select]


def fake_reference(prompt, max_new_tokens, vocab=97, eos=None):
    toks, out = list(prompt), []
    for _ in range(max_new_tokens):
        t = (sum((p + 1) * x for p, x in enumerate(toks)) + 7) % vocab
        toks.append(t)
        out.append(t)
        if t == eos:
            break
    return out
