"""Lab 9 graders: a block allocator, a paged gather, serving a stream of requests through both, a
scheduler's decision and a prefix cache's lookup and eviction.

``check_block_allocator`` replays scripted scenarios (sequences growing across block boundaries,
forks, copy-on-write, frees while shared, a pool that runs out, also in the middle of a copy) against
a shadow of what every block table and reference count must be, and stops at the first operation
that breaks it, naming the mistake. Block ids are never compared with ours: any free-list order is
correct, and any integer type (numpy's too) is accepted as a block id, as the engine accepts it.
The scheduler and prefix-cache graders are in :mod:`kvlab.course.checks.lab09_serving`.
"""

from __future__ import annotations

import numbers

import torch

from ._common import GRADER_TEXTS, fail, grading_model, passed
from kvlab.gpt2 import GPT2
from kvlab.paged import BlockAllocator as Library
from kvlab.paged import BlockAllocator as RefAllocator
from kvlab.paged import paged_gather as library
from kvlab.serving import Engine
from kvlab.serving.reference import References

NAME_ALLOC, NAME_GATHER, NAME_GEN = "check_block_allocator", "check_paged_gather", "check_paged_generate"
_CONTRACT = ("allocate", "fork", "append_slot", "free", "block_table", "refcount", "num_free")


def _is_block_id(b) -> bool:
    return isinstance(b, numbers.Integral) and not isinstance(b, bool)


def library_copy(candidate, reference, names=()) -> bool:
    """True when the candidate is the library's own reference, or a subclass of it that writes none of
    ``names`` (every one of them, when ``names`` is empty): the learner handed in kvlab's answer."""
    if candidate is reference:
        return True
    if not (isinstance(candidate, type) and issubclass(candidate, reference)):
        return False
    own = {k for c in candidate.__mro__ if c is not reference and issubclass(c, reference) for k in vars(c)}
    return not (own & set(names)) if names else not any(callable(getattr(candidate, k, None)) for k in own)


def _ceil(n: int, bs: int) -> int:
    return -(-n // bs)


# ---------------------------------------------------------------------------------------------------
# check_block_allocator

# (what the scenario exercises, num_blocks, block_size, operations)
_SCENARIOS = [
    ("new sequences whose lengths sit around block boundaries", 14, 4,
     [("alloc", "a", 3), ("alloc", "b", 4), ("alloc", 7, 5), ("alloc", "d", 1), ("alloc", "e", 8),
      ("free", "b"), ("free", "a"), ("free", 7), ("free", "d"), ("free", "e")]),
    ("one sequence growing a token at a time across two block boundaries", 6, 4,
     [("alloc", "s", 2)] + [("append", "s")] * 7 + [("free", "s")]),
    ("a fork, then appends to the child and the parent (copy-on-write)", 10, 4,
     [("alloc", "p", 6), ("fork", "p", "c"), ("append", "c"), ("append", "c"), ("append", "p"),
      ("fork", "c", "d"), ("append", "d"), ("append", "c"), ("free", "p"), ("free", "c"), ("free", "d")]),
    ("a fork of a sequence whose blocks are all full", 8, 4,
     [("alloc", "p", 8), ("fork", "p", "c"), ("append", "c"), ("append", "p"), ("append", "c"),
      ("free", "c"), ("free", "p")]),
    ("a parent freed while two children share its blocks", 7, 3,
     [("alloc", "p", 7), ("fork", "p", "c"), ("fork", "p", "d"), ("free", "p"), ("alloc", "x", 9),
      ("append", "c"), ("free", "c"), ("append", "d"), ("free", "d"), ("free", "x"), ("alloc", "y", 21),
      ("free", "y")]),
    ("a pool that runs out", 5, 4,
     [("alloc", "a", 12), ("too_big", "b", 12), ("alloc", "b", 8), ("append_full", "a"), ("free", "a"),
      ("free", "b"), ("alloc", "c", 20), ("free", "c")]),
    ("blocks reused after frees", 3, 2,
     [("alloc", 1, 6), ("free", 1), ("alloc", 2, 5), ("append", 2), ("free", 2), ("alloc", 3, 2),
      ("fork", 3, 4), ("append", 4), ("free", 3), ("free", 4), ("alloc", 5, 6), ("free", 5)]),
    ("a copy-on-write that finds the pool empty, then succeeds once a block is free", 4, 4,
     [("alloc", "p", 6), ("fork", "p", "c"), ("alloc", "x", 8), ("append_full", "c"), ("free", "x"),
      ("append", "c"), ("append", "p"), ("free", "p"), ("free", "c")]),
]


def _num_free(a) -> int:
    n = a.num_free
    return int(n() if callable(n) else n)


class _Shadow:
    """What a correct allocator holds after each operation; ``verify`` compares it with the learner's."""

    def __init__(self, alloc, num_blocks, bs, title):
        self.a, self.nb, self.bs, self.title = alloc, num_blocks, bs, title
        self.tables: dict = {}
        self.lens: dict = {}

    def call(self, what, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001
            raise self.fail(f"{what} raised {type(e).__name__}: {e}") from e

    def fail(self, msg):
        return fail(NAME_ALLOC, f"scenario '{self.title}' (num_blocks={self.nb}, block_size={self.bs}): {msg}")

    def table(self, s) -> list:
        t = self.call(f"block_table({s!r})", self.a.block_table, s)
        if not isinstance(t, (list, tuple)) or not all(_is_block_id(b) for b in t):
            raise self.fail(f"block_table({s!r}) must be a list (or tuple) of integer block ids, got {t!r}")
        return [int(b) for b in t]

    def no_alias(self, s, returned, what) -> None:
        """A caller that changes a table it was handed must not change the allocator's own."""
        if not isinstance(returned, list) or not returned:
            return
        before = self.table(s)
        returned.append(-7)
        returned[0] = -7
        if self.table(s) != before:
            raise self.fail(f"{what} returned the allocator's own list: the caller set its first entry to -7 and "
                            f"appended -7, and block_table({s!r}) changed from {before} to {self.table(s)}: a caller "
                            "must get a table it may change without changing the allocator's own record")

    def users(self, block, but=None) -> list:
        return [s for s, t in self.tables.items() if block in t and s != but]

    def verify(self, op: str) -> None:
        """Every live table as expected, every refcount = number of tables holding it, no leak."""
        for s, t in self.tables.items():
            if self.table(s) != t:
                raise self.fail(f"after {op}, the block table of {s!r} is {self.table(s)}, expected {t}: "
                                "an operation on one sequence changed another's table (does fork give the "
                                "child its own copy of the list, or the parent's list object itself?)")
        used = {b for t in self.tables.values() for b in t}
        for b in sorted(used):
            want, got = len(self.users(b)), self.call(f"refcount({b})", self.a.refcount, b)
            if got < want and op.startswith("free"):
                raise self.fail(f"after {op}, refcount({b}) is {got} but {self.users(b)} still hold block {b}: "
                                "a block freed while shared; free() drops one reference per block and "
                                "recycles a block only when its count reaches 0")
            if got != want:
                raise self.fail(f"after {op}, refcount({b}) is {got} but {want} table(s) hold block {b} "
                                f"({self.users(b)}): every table that points at a block counts once")
        want, got = self.nb - len(used), _num_free(self.a)
        if got > want:
            raise self.fail(f"after {op}, num_free is {got} but only {want} blocks are unused: a block still "
                            "in a table was put back on the free list (freed while shared?)")
        if got < want:
            raise self.fail(f"after {op}, num_free is {got} but {want} blocks are unused: {want - got} block(s) "
                            "leaked (a block must return to the free list when its refcount drops to 0)")
        for b in range(self.nb):
            if b not in used and self.call(f"refcount({b})", self.a.refcount, b) != 0:
                raise self.fail(f"after {op}, refcount({b}) is {self.a.refcount(b)} but no table holds block {b}: "
                                "a free block's reference count is 0")


def _alloc(sh: _Shadow, s, n: int) -> None:
    got = ret = sh.call(f"allocate({s!r}, {n})", sh.a.allocate, s, n)
    op, need = f"allocate({s!r}, {n})", _ceil(n, sh.bs)
    if not isinstance(got, (list, tuple)):
        raise sh.fail(f"{op} must return the block table (a list of ints), got {got!r}")
    if len(got) != need:
        why = ("one block too many: the tokens fill the blocks exactly (off-by-one at a block boundary)"
               if len(got) == need + 1 else "too few: round up, the last block may be partly filled"
               if len(got) == n // sh.bs else "wrong count")
        raise sh.fail(f"{op} returned {len(got)} blocks; {n} tokens in blocks of {sh.bs} need {need}: {why}")
    if not all(_is_block_id(b) for b in got):
        raise sh.fail(f"{op} must return integer block ids, got {got!r}")
    got = [int(b) for b in got]
    for b in got:
        if sh.users(b) or list(got).count(b) > 1:
            raise sh.fail(f"{op} handed out block {b}, which {sh.users(b) or s!r} already holds: a block may be "
                          "given out again only after its refcount fell to 0")
    sh.tables[s], sh.lens[s] = list(got), n
    sh.verify(op)
    sh.no_alias(s, ret, op)
    sh.no_alias(s, sh.call(f"block_table({s!r})", sh.a.block_table, s), f"block_table({s!r})")


def _append(sh: _Shadow, s) -> None:
    n, old, bs = sh.lens[s], list(sh.tables[s]), sh.bs
    op = f"append_slot({s!r}) for token position {n}"
    res = sh.call(op, sh.a.append_slot, s)
    if not isinstance(res, (tuple, list)) or len(res) != 3:
        raise sh.fail(f"{op} must return (block, offset, copy_from), got {res!r}")
    block, offset, copy_from = res
    if not all(_is_block_id(x) for x in (block, offset)) or not (copy_from is None or _is_block_id(copy_from)):
        raise sh.fail(f"{op} must return integer (block, offset) and copy_from None or a block, got {res!r}")
    block, offset, copy_from = int(block), int(offset), None if copy_from is None else int(copy_from)
    new, boundary, shared = sh.table(s), n == len(old) * bs, bool(sh.users(old[-1], but=s)) if old else False
    if boundary and len(new) == len(old):
        raise sh.fail(f"{op}: its {len(old)} blocks of {bs} are full, yet no block was added (you returned "
                      f"block {block}, offset {offset}): off-by-one at a block boundary, token {n} is the first "
                      "slot of a NEW block")
    if not boundary and len(new) == len(old) + 1:
        raise sh.fail(f"{op}: a new block was added although the last one still has a free slot (offset "
                      f"{n % bs} of {bs}): off-by-one at a block boundary, the last slot of a block is usable")
    if not boundary and shared and block == old[-1]:
        raise sh.fail(f"{op}: append into a shared block without a copy: block {old[-1]} is also held by "
                      f"{sh.users(old[-1], but=s)}, so writing into it changes their cache too (copy-on-write: a "
                      "write to a shared block goes to a private copy, and the caller is told which block to copy)")
    if offset != n % bs:
        raise sh.fail(f"{op}: offset {offset}, expected {n % bs} (token {n}'s slot within its block of {bs})")
    if block != new[-1]:
        raise sh.fail(f"{op}: returned block {block} but the table now ends with {new[-1]}")
    fresh = boundary or shared
    if fresh and sh.users(block, but=s):
        raise sh.fail(f"{op}: block {block} is still held by {sh.users(block, but=s)}: handed out twice")
    want_copy = old[-1] if (shared and not boundary) else None
    if copy_from != want_copy:
        why = ("nothing to copy at a block boundary: the new block starts empty" if boundary else
               f"block {old[-1]} was shared, its first {n % bs} slots must be copied" if shared else
               "no other sequence holds the last block (refcount 1): write in place, no copy")
        raise sh.fail(f"{op}: copy_from={copy_from!r}, expected {want_copy!r} ({why})")
    sh.tables[s], sh.lens[s] = old[:-1] + [block] if not boundary else old + [block], n + 1
    sh.verify(op)


def _fork(sh: _Shadow, p, c) -> None:
    sh.call(f"fork({p!r}, {c!r})", sh.a.fork, p, c)
    sh.tables[c], sh.lens[c] = list(sh.tables[p]), sh.lens[p]
    sh.verify(f"fork({p!r}, {c!r})")


def _free(sh: _Shadow, s) -> None:
    sh.call(f"free({s!r})", sh.a.free, s)
    del sh.tables[s], sh.lens[s]
    sh.verify(f"free({s!r})")


def _must_raise(sh: _Shadow, op: str, fn, *args) -> None:
    before = _num_free(sh.a)
    try:
        got = fn(*args)
    except Exception:  # noqa: BLE001
        if _num_free(sh.a) != before:
            raise sh.fail(f"{op} raised (good) but num_free went from {before} to {_num_free(sh.a)}: check that "
                          "enough blocks are free BEFORE taking any, or the ones taken leak") from None
        for s, t in sh.tables.items():
            if sh.table(s) != t:
                raise sh.fail(f"{op} raised (good) but the table of {s!r} changed from {t} to {sh.table(s)}: a "
                              "failed call must change nothing (take the new block before touching the table)")
        for b in {b for t in sh.tables.values() for b in t}:
            if sh.a.refcount(b) != len(sh.users(b)):
                raise sh.fail(f"{op} raised (good) but refcount({b}) is now {sh.a.refcount(b)}, not "
                              f"{len(sh.users(b))}: a reference was dropped before the copy's new block was "
                              "taken; take the block first, then change the counts")
        return
    raise sh.fail(f"{op} needs a block more than the {before} free: it must raise an error (the pool is full), "
                  f"but it returned {got!r}")


def _run_op(sh: _Shadow, kind: str, *args) -> None:
    if kind == "alloc":
        _alloc(sh, *args)
    elif kind == "append":
        _append(sh, *args)
    elif kind == "fork":
        _fork(sh, *args)
    elif kind == "free":
        _free(sh, *args)
    elif kind == "too_big":
        _must_raise(sh, f"allocate({args[0]!r}, {args[1]})", sh.a.allocate, *args)
    elif kind == "append_full":
        _must_raise(sh, f"append_slot({args[0]!r}) with every block full", sh.a.append_slot, *args)
        sh.verify(f"the failed append_slot({args[0]!r})")


def check_block_allocator(BlockAllocator) -> None:
    """Grade ``BlockAllocator(num_blocks, block_size)`` on scripted scenarios against a shadow."""

    if library_copy(BlockAllocator, Library):
        raise fail(NAME_ALLOC, "you handed in kvlab.paged.BlockAllocator, the library's own allocator: write "
                               "your own class in the lab's cell and grade that")
    n_ops = 0
    for title, nb, bs, ops in _SCENARIOS:
        try:
            alloc = BlockAllocator(nb, bs)
        except Exception as e:  # noqa: BLE001
            raise fail(NAME_ALLOC, f"BlockAllocator({nb}, {bs}) raised {type(e).__name__}: {e}") from e
        sh = _Shadow(alloc, nb, bs, title)
        if _num_free(alloc) != nb:
            raise sh.fail(f"a new allocator must have num_free == num_blocks == {nb}, got {_num_free(alloc)}")
        for kind, *args in ops:
            _run_op(sh, kind, *args)
            n_ops += 1
    passed(NAME_ALLOC, f"{len(_SCENARIOS)} scenarios, {n_ops} operations: tables, refcounts, copy-on-write, "
                       "boundaries, frees while shared, a full pool (also mid-copy) all right, tables handed "
                       "out as copies, nothing leaked")


# ---------------------------------------------------------------------------------------------------
# check_paged_gather


def _reference_gather(pool, table, n):
    H, D = pool.shape[1], pool.shape[3]
    return pool[list(table)].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :n]


# Wrong gathers, to name the mistake when the output is wrong: (what it did, how to fix it)
_GATHER_MISTAKES = [
    (lambda p, t, n: _reference_gather(p, sorted(t), n),
     "the blocks were read in allocation order (sorted ids), not in the order of the block table: entry "
     "i of the table is the sequence's i-th block, whatever its id"),
    (lambda p, t, n: _reference_gather(p, list(range(len(t))), n),
     "you read the first blocks of the pool, not the sequence's: the block table says which blocks are its"),
    (lambda p, t, n: _reference_gather(p, list(t)[::-1], n), "the blocks were read in reverse table order"),
    (lambda p, t, n: p[list(t)].reshape(p.shape[1], -1, p.shape[3])[:, :n],
     "heads and blocks are mixed up: the sequence's blocks are [blocks, heads, block_size, head_dim], and "
     "merging blocks and slots into one sequence axis must keep each head's positions apart"),
]

# (num_blocks, heads, block_size, head_dim, block table, seq_len, dtype)
_GATHER_CASES = [
    (9, 2, 4, 8, [5, 1, 7, 0], 13, torch.float32),        # the first slot of the next block
    (9, 2, 4, 8, [5, 1, 7], 12, torch.float32),          # ends exactly at a block boundary
    (9, 2, 4, 8, [5, 1, 7], 11, torch.float32),          # the last slot of a block left empty
    (6, 3, 2, 4, (4, 2, 0), 1, torch.float32),            # a tuple, one token, spare blocks
    (12, 1, 8, 16, [11, 3, 8, 2], 27, torch.float64),
    (7, 4, 16, 8, [6], 5, torch.bfloat16),
]


def _gathered_right(out, pool, table, n) -> bool:
    want = pool[list(table)].permute(1, 0, 2, 3).reshape(pool.shape[1], -1, pool.shape[3])[:, :n]
    return isinstance(out, torch.Tensor) and out.shape == want.shape and out.dtype == want.dtype \
        and torch.equal(out, want)


def _tuple_as_index(paged_gather, pool, table, n, where, what) -> None:
    """A tuple table that fails where the same table as a list is right: pool[tuple] indexes one
    dimension per element (pool[(4, 2, 0)] is pool[4, 2, 0]), not a list of blocks."""
    if not isinstance(table, tuple):
        return
    try:
        right = _gathered_right(paged_gather(pool.clone(), list(table), n), pool, table, n)
    except Exception:  # noqa: BLE001
        return
    if right:
        raise fail(NAME_GATHER, f"{where}: with the table as a tuple your paged_gather {what}; with the same "
                                f"table as a list it is right. pool[{table!r}] indexes one dimension per "
                                f"element (pool[4, 2, 0]), not a list of blocks: a tuple of block ids does not "
                                "pick blocks the way a list or a tensor of them does")


def check_paged_gather(paged_gather) -> None:
    """Grade ``paged_gather(pool, block_table, seq_len) -> [heads, seq_len, head_dim]``."""

    if paged_gather is library:
        raise fail(NAME_GATHER, "you handed in kvlab.paged.paged_gather, the library's own: write your own "
                                "function in the lab's cell and grade that")
    g = torch.Generator().manual_seed(909)
    for nb, H, bs, D, table, n, dt in _GATHER_CASES:
        pool = torch.randn(nb, H, bs, D, generator=g).to(dt)
        saved = pool.clone()
        where = f"pool [{nb}, {H}, {bs}, {D}] {dt}, block_table={table!r}, seq_len={n}"
        try:
            out = paged_gather(pool, table, n)
        except Exception as e:  # noqa: BLE001
            _tuple_as_index(paged_gather, pool, table, n, where, f"raised {type(e).__name__}: {e}")
            raise fail(NAME_GATHER, f"{where}: paged_gather raised {type(e).__name__}: {e}") from e
        if isinstance(table, tuple) and not _gathered_right(out, pool, table, n):
            _tuple_as_index(paged_gather, pool, table, n, where, "gave wrong values")
        if not torch.equal(pool, saved):
            raise fail(NAME_GATHER, f"{where}: paged_gather modified the pool; only read it")
        _check_gathered(out, pool, table, n, where, paged_gather)
    _gather_on_meta(paged_gather)
    passed(NAME_GATHER, f"{len(_GATHER_CASES)} block tables (out of id order, at and around block boundaries, "
                        "a tuple, three dtypes) gathered exactly; a pool on device='meta' stays there")


def _gather_on_meta(paged_gather) -> None:
    """A pool on the meta device (shapes only): the gathered tensor must be on the pool's device, or
    the same code hands a GPU engine's attention a CPU tensor."""
    pool = torch.empty(6, 2, 4, 8, dtype=torch.float16, device="meta")
    where = "pool [6, 2, 4, 8] float16 on device='meta' (shapes only), block_table=[3, 0, 5], seq_len=10"
    try:
        out = paged_gather(pool, [3, 0, 5], 10)
    except Exception as e:  # noqa: BLE001 - the learner's error, named
        raise fail(NAME_GATHER, f"{where}: paged_gather raised {type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}. On a GPU the same happens: make "
                                "every tensor you create on the pool's device") from e
    if not isinstance(out, torch.Tensor) or out.device.type != "meta" or tuple(out.shape) != (2, 10, 8) \
            or out.dtype != torch.float16:
        got = (f"{list(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor)
               else type(out).__name__)
        raise fail(NAME_GATHER, f"{where}: expected [2, 10, 8] float16 on meta, got {got}: a tensor made without "
                                "the pool's device lands on the default one (a GPU engine would get a CPU tensor)")


# A second input on which every mistake of the table gives a result of its own (a table out of order,
# neither sorted nor reversed, not the pool's first blocks): a diagnosis is named only if it holds here too.
_CONFIRM = (10, 2, 3, 4, [7, 2, 9, 4], 11)


def _confirmed(wrong, paged_gather) -> bool:
    nb, H, bs, D, table, n = _CONFIRM
    pool = torch.randn(nb, H, bs, D, generator=torch.Generator().manual_seed(5))
    try:
        out = paged_gather(pool, list(table), n)
        return isinstance(out, torch.Tensor) and out.shape == (H, n, D) and torch.equal(out, wrong(pool, table, n))
    except Exception:  # noqa: BLE001
        return False


def _check_gathered(out, pool, table, n, where, paged_gather) -> None:
    H, bs, D = pool.shape[1], pool.shape[2], pool.shape[3]
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        raise fail(NAME_GATHER, f"{where}: return a tensor [heads, seq_len, head_dim], got "
                                f"{list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
    if out.shape[1] in (_ceil(n, bs) * bs, len(table) * bs) and out.shape[1] != n:
        raise fail(NAME_GATHER, f"{where}: {out.shape[1]} positions returned, every slot of the blocks: keep "
                                f"only the first seq_len={n} (the last block's tail is unused)")
    if list(out.shape) != [H, n, D]:
        raise fail(NAME_GATHER, f"{where}: expected shape {[H, n, D]}, got {list(out.shape)}"
                                + (" (off by one position)" if abs(out.shape[1] - n) == 1 else ""))
    if out.dtype != pool.dtype:
        raise fail(NAME_GATHER, f"{where}: dtype {out.dtype}, expected the pool's {pool.dtype}")
    if torch.equal(out, _reference_gather(pool, table, n)):
        return
    for wrong, why in _GATHER_MISTAKES:
        if torch.equal(out, wrong(pool, table, n)) and _confirmed(wrong, paged_gather):
            raise fail(NAME_GATHER, f"{where}: {why}")
    raise fail(NAME_GATHER, f"{where}: wrong values, and no single known mistake explains them: position p "
                            "of the sequence is in the block the table names for p's block number, at p's slot "
                            "within that block")


# ---------------------------------------------------------------------------------------------------
# check_paged_generate


def _workload(tok):
    """Requests with a shared prefix (not a whole number of blocks: copy-on-write happens) and without."""
    texts = [tok(t).input_ids for t in GRADER_TEXTS]
    prefix = texts[5][:10]
    reqs = [(texts[0], 9), (prefix + texts[1], 12), (texts[3], 5), (prefix + texts[3], 7), (texts[2], 14),
            (texts[4][:3], 6), (prefix + texts[4][:5], 10), (texts[1], 3)]
    return prefix, reqs


_NB = 12   # blocks: a pool that binds for this workload (preemptions happen)


def _serve(model, prefix, reqs, alloc_cls, gather):
    """The engine of chapter 9 on the learner's pieces: a pool that binds (preemption), a shared prefix
    (copy-on-write), free lists shuffled first (tables out of id order). Returns the engine."""

    eng = Engine(model, num_blocks=_NB, block_size=4, max_num_batched_tokens=12, max_num_seqs=3,
                 allocator_cls=alloc_cls, gather=gather)
    alloc = eng.blocks.a
    for i in range(_NB):
        alloc.allocate(("warm-up", i), 4)
    for i in torch.randperm(_NB, generator=torch.Generator().manual_seed(9)).tolist():
        alloc.free(("warm-up", i))
    if eng.blocks.num_free != _NB:
        raise fail(NAME_GEN, f"{_NB} one-block sequences allocated then freed, yet {eng.blocks.num_free} of {_NB} blocks are "
                             "free: blocks leaked (a block returns to the free list at refcount 0)")
    eng.add_prefix(prefix)
    for prompt, m in reqs:
        eng.submit(prompt, m)
    eng.run()
    return eng


def _fails(check, piece) -> str | None:
    """``check(piece)`` run quietly: None if it passes, else its message (without the check's name). A
    stub's NotImplementedError passes through, as from the check itself."""
    import contextlib
    import io

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            check(piece)
    except AssertionError as e:
        text = str(e).split(" FAILED: ", 1)[-1]
        return text if len(text) <= 400 else text[:400].rsplit(" ", 1)[0] + " ..."
    return None


def check_paged_generate(BlockAllocator, paged_gather) -> None:
    """The hand-built GPT-2 serves a stream of requests (chapter 9's engine: ragged steps, preemption, a
    shared prefix) through your ``BlockAllocator`` and ``paged_gather``; every request's tokens must equal
    that prompt alone, and no block may leak."""

    # The engine runs on the two pieces: a piece that fails its own check would fail here too, named by
    # whatever it broke downstream ("out of blocks"). Its own check names the mistake: send the learner there.
    for check, piece, what in ((check_block_allocator, BlockAllocator, "BlockAllocator"),
                               (check_paged_gather, paged_gather, "paged_gather")):
        problem = _fails(check, piece)
        if problem:
            end = "" if problem.endswith((".", "!", "?", ")")) else "."
            raise fail(NAME_GEN, f"your {what} does not pass {check.__name__} yet, which says: {problem}{end} "
                                 f"This check serves requests through it: pass {check.__name__} first")
    hf, tok = grading_model()
    model = GPT2.from_hf(hf)
    prefix, reqs = _workload(tok)
    try:
        eng = _serve(model, prefix, reqs, BlockAllocator, paged_gather)
    except (AssertionError, NotImplementedError):
        raise
    except Exception as e:  # noqa: BLE001
        raise fail(NAME_GEN, f"serving {len(reqs)} requests ({_NB} blocks of 4, at most 3 sequences and 12 tokens a "
                             f"step, a shared 10-token prefix) with your pieces raised {type(e).__name__}: {e}") from e
    refs = References(model)
    bad = [s for s in eng.seqs.values() if s.output != refs(s)]
    if bad:
        s = bad[0]
        why = f" ({s.error})" if s.error else ""
        detail = (f"request {s.rid} ({len(s.prompt)}-token prompt, {s.preemptions} preemption(s), status "
                  f"{s.status.value}{why}): its tokens differ from the prompt served alone")
        if not References(model).mismatches(_serve(model, prefix, reqs, RefAllocator, paged_gather)):
            raise fail(NAME_GEN, f"{detail}. With the library's allocator and your gather it is right, so the "
                                 "bug is in your BlockAllocator: run check_block_allocator")
        raise fail(NAME_GEN, f"{detail}. It stays wrong with the library's allocator, so look at your "
                             "paged_gather: run check_paged_gather")
    eng.close()
    if eng.blocks.num_free != _NB:
        raise fail(NAME_GEN, f"every request has finished and the prefix is released, yet only "
                             f"{eng.blocks.num_free} of {_NB} blocks are free: blocks leaked. Your gather only reads, so look "
                             "at your BlockAllocator: a free that misses a block, or a copy-on-write that takes a new "
                             "block without dropping the old one's reference (run check_block_allocator)")
    passed(NAME_GEN, f"{len(reqs)} requests through ragged steps ({eng.scheduler.preemptions} preemptions, "
                     f"{eng.blocks.copies} copy-on-write copies): every one equals its prompt served alone; "
                     "no block leaked")
