"""Lab 11 graders: the mistakes the issue lists (evicted sinks, off-by-one windows, positions of the slot,
a chunk that loses keys, pooled queries, heads repeated in the wrong order) are rejected with a message
naming them; unusual correct solutions pass; the library's own answer is refused."""

import pytest
import torch

from kvlab.cache import EMPTY, Cache
from kvlab.course.checks import check_gqa_conversion, check_sink_window_cache, check_window_prediction
from kvlab.window import SinkWindowKVCache

from utils import expect_rejected, hands_over_code, one_step_removed, own_copy


# ---------------------------------------------------------------------------------------------------
# The sink + window cache


class Window(Cache):
    """A learner's correct cache: held + new keys, each query's window marked in key_pos, evict after."""

    keep_extra = 0          # 1: keep `window` tokens instead of `window - 1` (also correct)

    def __init__(self, n_layer, window, sinks=0):
        self.n_layer, self.window, self.sinks = n_layer, window, sinks
        self.reset()

    def reset(self):
        self.k, self.v, self.pos, self._len = [None] * self.n_layer, [None] * self.n_layer, None, 0

    def rewind(self, length):
        raise ValueError("not supported")

    @property
    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def positions_of_keys(self, pos, new):
        return pos

    def visible_to(self, kp, q):
        return (kp < self.sinks) | (kp > q - self.window)

    def kept(self, pos, last):
        return (pos < self.sinks) | (pos > last - self.window + 1 - self.keep_extra)

    def store(self, layer, k, v, positions):
        held = positions[:, :0] if self.pos is None else self.pos
        pos = torch.cat([held, positions], dim=1)
        if self.k[layer] is not None:
            k, v = torch.cat([self.k[layer], k], 2), torch.cat([self.v[layer], v], 2)
        q, kp = positions[:, :, None], pos[:, None, :]
        key_pos = torch.where(self.visible_to(kp, q), self.positions_of_keys(kp, positions), EMPTY)
        keep = self.kept(pos[0], positions[0, -1])
        self.k[layer], self.v[layer] = k[:, :, keep], v[:, :, keep]
        if layer == self.n_layer - 1:
            self.pos, self._len = pos[:, keep], self._len + positions.shape[1]
        return self.answer(k, v, key_pos, keep)

    def answer(self, k, v, key_pos, keep):
        return k, v, key_pos


class KeepsWindow(Window):
    keep_extra = 1


class Reversed(Window):
    """Returns the keys newest first, with a hidden padding slot: any order, extra hidden slots are fine."""

    def answer(self, k, v, key_pos, keep):
        pad = torch.zeros_like(k[:, :, :1])
        flip = lambda t: torch.cat([t.flip(2), pad], 2)   # noqa: E731
        return flip(k), flip(v), torch.cat([key_pos.flip(-1), torch.full_like(key_pos[..., :1], EMPTY)], -1)


class EvictsSinks(Window):
    def visible_to(self, kp, q):
        return kp > q - self.window

    def kept(self, pos, last):
        return pos > last - self.window + 1


class WindowTooWide(Window):
    def visible_to(self, kp, q):
        return (kp < self.sinks) | (kp >= q - self.window)

    def kept(self, pos, last):
        return (pos < self.sinks) | (pos >= last - self.window + 1)


class WindowTooNarrow(Window):
    def visible_to(self, kp, q):
        return (kp < self.sinks) | (kp > q - self.window + 1)


class SlotPositions(Window):
    def positions_of_keys(self, kp, new):
        return torch.arange(kp.shape[-1]).expand_as(kp)          # the slot, not the token's position


class EvictsBeforeAttending(Window):
    """Evicts before attending, keeping the sinks and the last `window` of held + new: right for a decode
    step, but the first queries of a chunk lose keys their window needs."""

    def store(self, layer, k, v, positions):
        held = positions[:, :0] if self.pos is None else self.pos
        pos = torch.cat([held, positions], dim=1)
        keys, values, key_pos = super().store(layer, k, v, positions)
        sel = (pos[0] < self.sinks) | (pos[0] > positions[0, -1] - self.window)
        return keys[:, :, sel], values[:, :, sel], key_pos[..., sel]


class WholeChunk(Window):
    """Chapter 3's behaviour: the window applies to what is kept, a chunk sees itself whole."""

    def visible_to(self, kp, q):
        first = q[:, :1]
        return (kp < self.sinks) | (kp > first - self.window) | (kp >= first)


class Library(SinkWindowKVCache):
    pass


def test_correct_caches_pass(capsys):
    for cls in (Window, KeepsWindow, Reversed):
        check_sink_window_cache(cls)
    assert capsys.readouterr().out.count("PASSED check_sink_window_cache") == 3


@pytest.mark.parametrize("cls, needles", [
    (EvictsSinks, ["sinks were evicted"]),
    (WindowTooWide, ["off-by-one", "positions, the query's own included"]),
    (WindowTooNarrow, ["off-by-one", "of its window"]),
    (SlotPositions, ["its slot in your cache, not its position"]),
    (EvictsBeforeAttending, ["window - 1 tokens before it plus its own k"]),
    (WholeChunk, ["outside its window", "EMPTY"]),
    (Library, ["built on kvlab.window.SinkWindowKVCache", "write it yourself"]),
    (SinkWindowKVCache, ["built on kvlab.window.SinkWindowKVCache", "write it yourself"]),
])
def test_wrong_caches_are_named(cls, needles):
    expect_rejected(check_sink_window_cache, cls, *needles)


def test_a_cache_that_holds_everything_is_refused():
    class HoldsAll(Window):
        def kept(self, pos, last):
            return torch.ones_like(pos, dtype=torch.bool)
    expect_rejected(check_sink_window_cache, HoldsAll, "more than sinks + window")


# ---------------------------------------------------------------------------------------------------
# The GQA conversion


def pool(weight, bias, n_head, n_kv_head):
    if n_head % n_kv_head:
        raise ValueError(f"{n_kv_head} does not divide {n_head}")
    C = weight.shape[1]
    D, G = C // n_head, n_head // n_kv_head
    out = []
    for part in (1, 2):
        w, b = weight[part * C:(part + 1) * C], bias[part * C:(part + 1) * C]
        out += [w.reshape(n_kv_head, G, D, C).mean(1).reshape(-1, C), b.reshape(n_kv_head, G, D).mean(1).flatten()]
    return tuple(out)


def pool_einsum(weight, bias, n_head, n_kv_head):
    """Unusual but correct: an averaging matrix, in float64."""
    if n_head % n_kv_head:
        raise ValueError("bad group count")
    C, D = weight.shape[1], weight.shape[1] // n_head
    avg = torch.kron(torch.eye(n_kv_head, dtype=torch.float64),
                     torch.full((1, n_head // n_kv_head), n_kv_head / n_head, dtype=torch.float64))
    P = torch.kron(avg, torch.eye(D, dtype=torch.float64)).to(weight.dtype)   # [n_kv*D, H*D]
    return P @ weight[C:2 * C], P @ bias[C:2 * C], P @ weight[2 * C:], P @ bias[2 * C:]


def repeat(x, group):
    B, n, S, D = x.shape
    return x[:, :, None].expand(B, n, group, S, D).reshape(B, n * group, S, D)


def repeat_interleave(x, group):
    return x.repeat_interleave(group, dim=1)


def test_correct_conversions_pass(capsys):
    check_gqa_conversion(pool, repeat)
    check_gqa_conversion(pool_einsum, repeat_interleave)
    assert capsys.readouterr().out.count("PASSED check_gqa_conversion") == 2


def pools_queries(weight, bias, n_head, n_kv_head):
    C = weight.shape[1]
    k = pool(torch.cat([weight[C:2 * C], weight[:C], weight[2 * C:]]), torch.cat([bias[C:2 * C], bias[:C], bias[2 * C:]]),
             n_head, n_kv_head)
    return k


def first_head(weight, bias, n_head, n_kv_head):
    C = weight.shape[1]
    D, G = C // n_head, n_head // n_kv_head
    return tuple(t for part in (1, 2) for t in (
        weight[part * C:(part + 1) * C].reshape(n_kv_head, G, D, C)[:, 0].reshape(-1, C),
        bias[part * C:(part + 1) * C].reshape(n_kv_head, G, D)[:, 0].flatten()))


def strided(weight, bias, n_head, n_kv_head):
    C = weight.shape[1]
    D, G = C // n_head, n_head // n_kv_head
    return tuple(t for part in (1, 2) for t in (
        weight[part * C:(part + 1) * C].reshape(G, n_kv_head, D, C).mean(0).reshape(-1, C),
        bias[part * C:(part + 1) * C].reshape(G, n_kv_head, D).mean(0).flatten()))


def no_check(weight, bias, n_head, n_kv_head):
    return pool(weight, bias, n_head, n_kv_head) if n_head % n_kv_head == 0 else pool(weight, bias, n_head, 1)


def in_place(weight, bias, n_head, n_kv_head):
    out = pool(weight, bias, n_head, n_kv_head)
    weight.mul_(1.0).add_(0.0)
    weight[0, 0] += 1
    return out


def tiled(x, group):
    return x.repeat(1, group, 1, 1)


@pytest.mark.parametrize("pool_fn, repeat_fn, needles", [
    (pools_queries, repeat, ["pooled the query rows"]),
    (first_head, repeat, ["first head", "mean pooling"]),
    (strided, repeat, ["consecutive heads"]),
    (no_check, repeat, ["must raise ValueError"]),
    (in_place, repeat, ["in place"]),
    (pool, tiled, ["heads tiled", "consecutive query heads"]),
])
def test_wrong_conversions_are_named(pool_fn, repeat_fn, needles):
    message = expect_rejected(lambda f: check_gqa_conversion(*f), (pool_fn, repeat_fn), *needles)
    assert not hands_over_code(message), message        # the mistake and the rule, not the fixing line


def test_library_conversion_refused():
    from kvlab import gqa
    expect_rejected(lambda f: check_gqa_conversion(*f), (pool, gqa.repeat_kv), "library's own")


# ---------------------------------------------------------------------------------------------------
# The prediction


ROWS = [{"window": w, "sinks": s, "ppl change": c} for s, cs in ((0, (0.2, 0.05, 0.012, 0.004)), (4, (0.1, 0.03, 0.009, 0.002)))
        for w, c in zip((16, 32, 64, 128), cs)]


def test_prediction_within_a_step_passes_and_far_fails(capsys):
    check_window_prediction({0: 128, 4: 64}, ROWS)
    check_window_prediction({0: 64, 4: 128}, ROWS)            # one grid step off: passes
    assert capsys.readouterr().out.count("PASSED") == 2
    check = lambda p: check_window_prediction(p, ROWS)   # noqa: E731
    expect_rejected(check, {0: 16, 4: 64}, "you predicted 16, your run says 128")
    expect_rejected(check, {0: 100}, "predict one of the windows you ran")
    expect_rejected(check, {8: 64}, "no row with sinks=8")
    expect_rejected(check, [64], "must be a dict")


class ForwardsToTheLibrary:
    """Composition: every method hands on to the library's sink + window cache."""

    def __init__(self, n_layer, window, sinks=0):
        self.inner = SinkWindowKVCache(n_layer, window, sinks)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_the_library_one_step_removed_is_refused_by_what_runs(capsys):
    """Issue 34, kind 1, in lab 11: a cache forwarding to the library's, and the library's repeat_kv
    without its name, are refused by what ran; the learner's own copy of the library's cache passes."""
    from kvlab import gqa

    expect_rejected(check_sink_window_cache, ForwardsToTheLibrary, "ran kvlab.window.SinkWindowKVCache",
                    "write it yourself")
    for how, impl in one_step_removed(gqa.repeat_kv).items():
        expect_rejected(lambda r: check_gqa_conversion(pool, r), impl, "ran kvlab.gqa.repeat_kv", "write it yourself")
    check_sink_window_cache(own_copy(SinkWindowKVCache))
    assert "PASSED check_sink_window_cache" in capsys.readouterr().out
