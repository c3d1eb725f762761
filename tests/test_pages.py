"""Page accounting: the chained page hash, PagePool's free/used/cached states with LRU eviction,
and a stateful model of how the scheduler uses a pool (share, grow, commit, finish, cancel,
evict, preempt) that checks the invariants after every call."""

import gc
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvmesh.services.kvcache.pages import PagePool, PageStats, page_hash


def assert_accounting(pool: PagePool) -> None:
    pool.check()
    s = pool.stats()
    assert s.free + s.used + s.cached == s.total


def filled(pool: PagePool, seq_id: str, tokens: list[int], prefix: list[int] | None = None) -> list[int]:
    """Opens `seq_id`, grows it to hold `tokens`, marks them all computed; returns its page table."""
    pool.open(seq_id, prefix or [])
    assert pool.grow(seq_id, len(tokens)) is not None
    pool.commit(seq_id, tokens, len(tokens))
    assert_accounting(pool)
    return list(pool.page_table(seq_id))


# -- page_hash -------------------------------------------------------------------------------


def test_page_hash_is_the_same_for_the_same_parent_and_tokens():
    parent = page_hash(None, [5, 6, 7, 8])
    assert page_hash(None, [5, 6, 7, 8]) == parent
    assert page_hash(parent, [1, 2, 3, 4]) == page_hash(parent, [1, 2, 3, 4])
    assert page_hash(parent, (1, 2, 3, 4)) == page_hash(parent, [1, 2, 3, 4])


def test_page_hash_is_the_same_in_another_process():
    code = (
        "from kvmesh.services.kvcache.pages import page_hash\n"
        "print(page_hash(page_hash(None, [1, 2]), [3, 4]).hex())"
    )
    env = {"PYTHONHASHSEED": "12345"}
    repo = Path(__file__).parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=repo)
    assert out.stdout.strip() == page_hash(page_hash(None, [1, 2]), [3, 4]).hex()


def test_page_hash_changes_when_any_token_changes():
    tokens = [11, 12, 13, 14]
    base = page_hash(None, tokens)
    for i in range(len(tokens)):
        changed = list(tokens)
        changed[i] += 1
        assert page_hash(None, changed) != base
    assert page_hash(None, tokens[::-1]) != base


def test_the_same_tokens_under_a_different_parent_hash_differently():
    tokens = [1, 2, 3, 4]
    first, second = page_hash(None, [9, 9, 9, 9]), page_hash(None, [9, 9, 9, 8])
    assert page_hash(first, tokens) != page_hash(second, tokens)
    assert page_hash(first, tokens) != page_hash(None, tokens)


def test_a_chain_depends_on_the_order_of_its_pages():
    a, b = [1, 2], [3, 4]
    assert page_hash(page_hash(None, a), b) != page_hash(page_hash(None, b), a)


# -- PagePool ------------------------------------------------------------------------------


def test_a_new_pool_is_all_free():
    pool = PagePool(8, page_size=4)
    assert pool.stats() == PageStats(total=8, free=8, used=0, cached=0)
    assert_accounting(pool)


def test_grow_allocates_only_the_pages_the_tokens_need():
    pool = PagePool(8, page_size=4)
    pool.open("a", [])
    assert len(pool.grow("a", 5)) == 2
    assert pool.grow("a", 8) == []
    assert len(pool.grow("a", 9)) == 1
    assert len(pool.page_table("a")) == 3 and pool.stats().used == 3
    assert_accounting(pool)


def test_grow_returns_none_and_changes_nothing_when_pages_run_short():
    pool = PagePool(4, page_size=4)
    filled(pool, "a", list(range(12)))  # 3 of 4 pages, hashed but in use
    pool.open("b", [])
    pool.grow("b", 2)
    stats, table_a, table_b = pool.stats(), list(pool.page_table("a")), list(pool.page_table("b"))
    assert pool.grow("b", 5) is None
    assert pool.stats() == stats
    assert pool.page_table("a") == table_a and pool.page_table("b") == table_b
    assert_accounting(pool)


def test_release_returns_uncommitted_pages_to_free():
    pool = PagePool(6, page_size=4)
    pool.open("a", [])
    pool.grow("a", 10)
    assert pool.stats().free == 3
    pool.release("a")
    assert (pool.stats().free, pool.stats().used, pool.stats().cached) == (6, 0, 0)
    assert_accounting(pool)


def test_releasing_an_unknown_sequence_changes_nothing():
    pool = PagePool(4, page_size=2)
    pool.release("nobody")
    assert pool.stats().free == 4


def test_opening_a_sequence_twice_is_an_error():
    pool = PagePool(4, page_size=2)
    pool.open("a", [])
    with pytest.raises(ValueError, match="already has a page table"):
        pool.open("a", [])


def test_committed_full_pages_are_cached_after_release_and_matched_again():
    pool = PagePool(8, page_size=4)
    tokens = list(range(100, 110))  # two full pages and a partial one
    table = filled(pool, "a", tokens)
    pool.release("a")
    s = pool.stats()
    assert (s.free, s.used, s.cached) == (6, 0, 2)  # the partial page holds nothing reusable
    assert pool.match_prefix(tokens) == table[:2]
    assert pool.match_prefix(tokens + [7, 7, 7]) == table[:2]
    assert_accounting(pool)


def test_match_prefix_leaves_the_last_prompt_token_uncovered():
    pool = PagePool(8, page_size=4)
    tokens = list(range(8))
    table = filled(pool, "a", tokens)
    pool.release("a")
    assert pool.match_prefix(tokens) == table[:1]  # exactly two pages of prompt: only one matches
    assert pool.match_prefix(tokens + [99]) == table
    assert pool.match_prefix(tokens[:4]) == []


def test_match_prefix_stops_at_the_first_page_that_differs():
    pool = PagePool(8, page_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    table = filled(pool, "a", tokens)
    assert pool.match_prefix([1, 2, 3, 9, 5, 6, 7]) == table[:1]
    assert pool.match_prefix([0, 2, 3, 4, 5, 6, 7]) == []


def test_match_prefix_finds_nothing_without_prefix_caching():
    pool = PagePool(8, page_size=2, enable_prefix_caching=False)
    tokens = [1, 2, 3, 4, 5]
    filled(pool, "a", tokens)
    pool.release("a")
    assert pool.match_prefix(tokens) == []
    assert (pool.stats().free, pool.stats().cached) == (8, 0)


def test_a_shared_prefix_page_counts_once_and_stays_in_use_until_its_last_sharer_releases():
    pool = PagePool(8, page_size=2)
    table_a = filled(pool, "a", [1, 2, 3, 4, 5])
    prefix = pool.match_prefix([1, 2, 3, 4, 6])
    assert prefix == table_a[:2]
    table_b = filled(pool, "b", [1, 2, 3, 4, 6], prefix)
    assert table_b[:2] == prefix
    assert pool.stats().used == 4  # a: 3 pages, b: 2 shared + 1 own
    pool.release("a")
    assert (pool.stats().used, pool.stats().cached) == (3, 0)  # a's own tail page (partial) is free
    pool.release("b")
    assert (pool.stats().used, pool.stats().cached) == (0, 2)
    assert_accounting(pool)


def test_reusing_a_cached_page_takes_it_out_of_the_cache():
    pool = PagePool(4, page_size=2)
    table = filled(pool, "a", [1, 2, 3])
    pool.release("a")
    assert pool.stats().cached == 1
    pool.open("b", pool.match_prefix([1, 2, 3]))
    assert pool.page_table("b") == table[:1]
    assert (pool.stats().used, pool.stats().cached) == (1, 0)
    assert_accounting(pool)


def test_cached_pages_are_evicted_only_when_no_free_page_remains():
    pool = PagePool(4, page_size=2)
    filled(pool, "a", [1, 2, 3, 4])
    pool.release("a")  # 2 cached, 2 free
    pool.open("b", [])
    for tokens, (free, cached) in [(2, (1, 2)), (4, (0, 2)), (6, (0, 1)), (8, (0, 0))]:
        assert pool.grow("b", tokens) is not None
        assert (pool.stats().free, pool.stats().cached) == (free, cached)
        assert_accounting(pool)
    assert pool.match_prefix([1, 2, 3, 4, 5]) == []


def test_eviction_takes_the_least_recently_used_cached_page():
    pool = PagePool(3, page_size=2)
    [page_a] = filled(pool, "a", [1, 2])
    pool.release("a")
    [page_c] = filled(pool, "c", [3, 4])
    pool.release("c")  # cached, oldest first: a, c
    pool.open("x", pool.match_prefix([1, 2, 9]))  # using a again makes it the most recent
    pool.release("x")
    pool.open("y", [])
    new = pool.grow("y", 4)  # the free page, then one eviction
    assert page_c in new and page_a not in new
    assert pool.match_prefix([1, 2, 9]) == [page_a]
    assert pool.match_prefix([3, 4, 9]) == []
    assert_accounting(pool)


def test_a_released_prefix_loses_its_tail_before_its_head():
    pool = PagePool(3, page_size=2)
    head, tail, _ = filled(pool, "a", [1, 2, 3, 4, 5])
    pool.release("a")
    pool.open("b", [])
    pool.grow("b", 4)  # the free page, then one eviction
    assert tail in pool.page_table("b")
    assert pool.match_prefix([1, 2, 3, 4, 5]) == [head]


# -- a stateful model of the pool's use ------------------------------------------------------

TOKENS = st.integers(0, 2)  # a small alphabet, so prompts share prefixes and pages collide


@dataclass
class Seq:
    tokens: list[int]
    prompt_len: int
    computed: int


class PagePoolMachine(RuleBasedStateMachine):
    """Sequences open with a prefix match, grow and compute in chunks, sample a token when level,
    and end by finishing, cancelling mid-prompt or preemption (release, then reopen). A model of
    each page's contents checks that a prefix hit holds exactly the tokens it is matched for and
    that no sequence writes into a page another sequence holds."""

    @initialize(num_pages=st.one_of(st.integers(4, 16), st.sampled_from([16, 1024, 4096, 10**6])),
                page_size=st.integers(2, 4))
    def make_pool(self, num_pages, page_size):
        self.pool = PagePool(num_pages, page_size)
        self.ps = page_size
        self.seqs: dict[str, Seq] = {}
        self.contents: dict[int, list[int | None]] = {}  # tokens written into each page
        self.next_id = 0
        self.ballast: set[int] = set()  # pages of the "ballast" sequence (see fill)

    # -- what the scheduler does, checked as it goes

    def _open(self, seq_id: str, tokens: list[int], prompt_len: int) -> None:
        stats = self.pool.stats()
        prefix = self.pool.match_prefix(tokens)
        assert len(prefix) <= (len(tokens) - 1) // self.ps  # the last token is never covered
        for i, page in enumerate(prefix):
            assert self.contents[page] == tokens[i * self.ps : (i + 1) * self.ps]
        self.pool.open(seq_id, prefix)
        assert self.pool.stats().free == stats.free  # sharing allocates nothing
        self.seqs[seq_id] = Seq(tokens, prompt_len, len(prefix) * self.ps)

    def _holders(self, page: int) -> int:
        return sum(page in self.pool.page_table(s) for s in self.seqs) + (page in self.ballast)

    def _compute(self, seq_id: str, n: int, next_token: int) -> bool:
        """Grows for n more tokens and computes them; False (nothing changed) when pages run short."""
        seq = self.seqs[seq_id]
        before = self.pool.stats()
        tables = {s: list(self.pool.page_table(s)) for s in self.seqs}
        new = self.pool.grow(seq_id, seq.computed + n)
        if new is None:
            assert self.pool.stats() == before
            assert {s: list(self.pool.page_table(s)) for s in self.seqs} == tables
            return False
        after = self.pool.stats()
        assert before.cached - after.cached == max(0, len(new) - before.free)  # evict only past the free pages
        assert all(self._holders(p) == 1 for p in new)
        for page in new:
            self.contents[page] = [None] * self.ps
        table = self.pool.page_table(seq_id)
        assert len(table) == self.pool.pages_needed(seq.computed + n)
        for pos in range(seq.computed, seq.computed + n):
            page = table[pos // self.ps]
            assert self._holders(page) == 1  # never write into a page someone else holds
            self.contents[page][pos % self.ps] = seq.tokens[pos]
        seq.computed += n
        self.pool.commit(seq_id, seq.tokens, seq.computed)
        if seq.computed == len(seq.tokens):
            seq.tokens.append(next_token)  # level: the step samples the next token
        return True

    def _new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def _pick(self, data, which) -> str:
        return data.draw(st.sampled_from(sorted(s for s, q in self.seqs.items() if which(q))))

    # -- rules

    @precondition(lambda self: len(self.seqs) < 6)
    @rule(tokens=st.lists(TOKENS, min_size=1, max_size=12))
    def open(self, tokens):
        self._open(self._new_id(), list(tokens), len(tokens))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def step(self, data):
        seq_id = self._pick(data, lambda q: True)
        seq = self.seqs[seq_id]
        n = data.draw(st.integers(1, len(seq.tokens) - seq.computed))
        self._compute(seq_id, n, data.draw(TOKENS))

    @precondition(lambda self: any(len(q.tokens) > q.prompt_len for q in self.seqs.values()))
    @rule(data=st.data())
    def finish(self, data):
        seq_id = self._pick(data, lambda q: len(q.tokens) > q.prompt_len)
        self.pool.release(seq_id)
        del self.seqs[seq_id]

    @precondition(lambda self: any(q.computed < q.prompt_len for q in self.seqs.values()))
    @rule(data=st.data())
    def cancel(self, data):
        seq_id = self._pick(data, lambda q: q.computed < q.prompt_len)
        self.pool.release(seq_id)
        del self.seqs[seq_id]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def preempt(self, data):
        seq_id = self._pick(data, lambda q: True)
        seq = self.seqs.pop(seq_id)
        self.pool.release(seq_id)
        self._open(seq_id, seq.tokens, seq.prompt_len)  # recompute from whatever is still cached

    @precondition(lambda self: not self.ballast and 16 < self.pool.num_pages <= 1024 and len(self.pool.free) > 8)
    @rule(room=st.integers(0, 8))
    def fill(self, room):
        """A sequence holding all but `room` free pages, so that a large pool evicts too (its pages
        are never computed and it takes no part in the other rules)."""
        self.pool.open("ballast", [])
        assert self.pool.grow("ballast", (len(self.pool.free) - room) * self.ps) is not None
        self.ballast = set(self.pool.page_table("ballast"))

    @precondition(lambda self: self.ballast)
    @rule()
    def drop_ballast(self):
        self.pool.release("ballast")
        self.ballast = set()

    @precondition(lambda self: len(self.seqs) < 6 and self.pool.num_pages <= 16)
    @rule(data=st.data())
    def evict(self, data):
        """A long prompt grown a page at a time until the pool evicts a cached page or runs out."""
        length = (self.pool.num_pages + 1) * self.ps  # more than the pool holds
        tokens = data.draw(st.lists(TOKENS, min_size=length, max_size=length))
        seq_id = self._new_id()
        self._open(seq_id, list(tokens), len(tokens))
        seq = self.seqs[seq_id]
        while seq.computed < seq.prompt_len:
            cached = self.pool.stats().cached
            if not self._compute(seq_id, min(self.ps, seq.prompt_len - seq.computed), 0):
                break
            if self.pool.stats().cached < cached:
                break

    # -- after every call

    @invariant()
    def accounting_holds(self):
        pool = self.pool
        pool.check()
        s = pool.stats()
        assert s.free + s.used + s.cached == s.total
        assert not any(page in pool.free for page in pool.cached)  # O(cached), not O(pool size)
        assert set(pool.tables) == set(self.seqs) | ({"ballast"} if self.ballast else set())
        for seq_id, seq in self.seqs.items():
            table = pool.page_table(seq_id)
            assert len(table) >= pool.pages_needed(seq.computed)
            for page in table:
                assert pool.refs[page] >= 1 and page not in pool.free and page not in pool.cached

    @invariant()
    def computed_tokens_are_in_the_pages(self):
        for seq_id, seq in self.seqs.items():
            table = self.pool.page_table(seq_id)
            for pos in range(seq.computed):
                assert self.contents[table[pos // self.ps]][pos % self.ps] == seq.tokens[pos]


TestPagePoolMachine = PagePoolMachine.TestCase
TestPagePoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- cost does not grow with the pool ----------------------------------------------------------


def lines_run(fn) -> int:
    """Python lines executed by fn(), in every function it calls: a count of operations that does
    not depend on how busy the machine is. The garbage collector is held off meanwhile: a
    finalizer of another test's garbage (a gRPC object's __del__) would count as fn's lines. (No
    collection first: with collection off, garbage waiting for one stays waiting, and a full
    collection per call was most of this module's time.)"""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return trace

    gc.disable()
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
        gc.enable()
    return count


SCRIPT = st.lists(st.tuples(st.sampled_from(["open", "grow", "release", "commit"]), st.integers(0, 15),
                            st.integers(1, 8)), min_size=1, max_size=40)


def run_script(num_pages: int, script) -> list[int]:
    """Runs the operations on a fragmented pool of `num_pages` pages; the lines each one took."""
    pool, ps, counts = PagePool(num_pages, page_size=4), 4, []
    for i in range(16):  # fragmentation: every other sequence's pages are given back
        filled(pool, f"f{i}", [i] * 9)
    for i in range(0, 16, 2):
        pool.release(f"f{i}")
    for op, seq, pages in script:
        seq_id, tokens = f"s{seq}", [seq % 3] * (pages * ps)
        if op == "open" and seq_id not in pool.tables:
            counts.append(lines_run(lambda: pool.open(seq_id, pool.match_prefix(tokens))))
        elif op == "grow" and seq_id in pool.tables:
            size = len(pool.page_table(seq_id)) * ps + pages * ps
            counts.append(lines_run(lambda: pool.grow(seq_id, size)))
        elif op == "commit" and seq_id in pool.tables:
            n = len(pool.page_table(seq_id)) * ps
            counts.append(lines_run(lambda: pool.commit(seq_id, [seq % 3] * n, n)))
        elif op == "release":
            counts.append(lines_run(lambda: pool.release(seq_id)))
    pool.check()
    return counts


@settings(max_examples=30, deadline=None)
@given(script=SCRIPT)
def test_every_operation_costs_the_same_in_a_pool_of_a_million_pages_as_in_one_of_a_thousand(script):
    small = run_script(1024, script)  # the script never needs more than 16 * 15 * 8 + 48 pages
    assert run_script(10**6, script) == small
    assert run_script(2**16, script) == small


@pytest.mark.parametrize("num_pages", [64, 4096, 65536])
def test_evicting_a_cached_page_costs_the_same_whatever_the_pool_size(num_pages):
    pool = PagePool(num_pages, page_size=2)
    filled(pool, "all", list(range(2 * num_pages)))
    pool.release("all")  # every page cached
    pool.open("new", [])
    cost = lines_run(lambda: pool.grow("new", 6))  # three evictions
    assert pool.stats().cached == num_pages - 3
    assert cost == EVICTION_COST.setdefault("grow 3", cost)


EVICTION_COST: dict[str, int] = {}


def test_a_pool_of_a_million_pages_is_as_cheap_to_make_as_a_small_one():
    assert lines_run(lambda: PagePool(10**6)) == lines_run(lambda: PagePool(16))

