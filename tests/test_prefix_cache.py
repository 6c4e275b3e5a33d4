"""Tests for the host-side paged KV cache: hashing, LRU-2, sessions, copy-on-write, rollback, and
the hooks a lower tier uses (eviction callback, lookup, insert_cached).

`Device` plays the accelerator: [num_pages, page_size] arrays written exactly as the API instructs.
Besides the token id, each slot holds a fingerprint of what real KV depends on (namespace and whole
prefix), so a page with the right tokens in the wrong context also fails the read-back.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glmjax.cache import prefix_cache as pc
from glmjax.cache.prefix_cache import (
    NULL_PAGE, ROOT_KEY, CachedPage, LruK, PageContent, PagePool, PoolExhausted, PrefixCache,
    SequenceAlloc, as_tokens, namespace_salt, page_key, session_key)


def context(seq: SequenceAlloc, pos: int) -> int:
  """Stand-in for the KV at `pos`: it depends on the namespace and every token up to `pos`."""
  return hash((seq.namespace, tuple(seq.tokens[:pos + 1])))


class Device:
  """Token ids and contexts standing in for KV pages; refuses writes into shared or cached pages."""

  def __init__(self, cache: PrefixCache):
    self.cache, self.ps = cache, cache.page_size
    self.kv = np.full((cache.pool.num_pages, cache.page_size), -1, dtype=np.int64)
    self.ctx = np.full((cache.pool.num_pages, cache.page_size), -1, dtype=np.int64)

  def _check_writable(self, seq: SequenceAlloc, page: int) -> None:
    pool = self.cache.pool
    assert page != NULL_PAGE
    assert pool.refcount(page) == 1 and not pool.is_published(page), f"page {page} is shared"
    assert page in seq.pages[seq.write_floor // self.ps:]

  def prefill(self, seq: SequenceAlloc) -> None:
    for src, dst in seq.copies:
      self._check_writable(seq, dst)
      self.kv[dst], self.ctx[dst] = self.kv[src], self.ctx[src]
    self.write(seq, seq.num_cached, seq.length)

  def write(self, seq: SequenceAlloc, start: int, stop: int) -> None:
    assert start >= seq.write_floor
    for pos in range(start, stop):
      page = seq.pages[pos // self.ps]
      self._check_writable(seq, page)
      self.kv[page, pos % self.ps] = seq.tokens[pos]
      self.ctx[page, pos % self.ps] = context(seq, pos)

  def read(self, seq: SequenceAlloc) -> list[int]:
    """The sequence's tokens read through its page table; asserts each slot's context too."""
    table, length = self.cache.page_table(seq, len(seq.pages) + 2)
    ctx = self.ctx[table].reshape(-1)[:length].tolist()
    assert ctx == [context(seq, pos) for pos in range(length)], "page holds another context"
    return self.kv[table].reshape(-1)[:length].tolist()

  def check_cached_content(self) -> None:
    for page, toks in self.cache.cached_pages().items():
      assert self.kv[page, :len(toks)].tolist() == list(toks), f"cached page {page} corrupted"
    assert (self.kv[NULL_PAGE] == -1).all(), "null page written"


def run(cache: PrefixCache, dev: Device, tokens, **kw) -> SequenceAlloc:
  seq = cache.open_sequence(tokens, **kw)
  dev.prefill(seq)
  assert dev.read(seq) == list(tokens)
  return seq


def extend(cache: PrefixCache, dev: Device, seq: SequenceAlloc, tokens) -> None:
  start = seq.length
  cache.extend(seq, tokens)
  dev.write(seq, start, seq.length)


def snapshot(cache: PrefixCache, live: list[SequenceAlloc]):
  pool = cache.pool
  return (cache.stats, cache.cached_pages(), [pool.refcount(p) for p in range(pool.num_pages)],
          pool.num_free, pool.num_evictable, [(s.pages[:], s.tokens[:]) for s in live])


# Hashing.

def test_namespaces_never_share_keys_or_pages():
  a, b = namespace_salt("a"), namespace_salt("b")
  assert page_key(a, ROOT_KEY, [1, 2]) != page_key(b, ROOT_KEY, [1, 2])
  cache = PrefixCache(8, 2)
  dev = Device(cache)
  cache.release(run(cache, dev, [1, 2, 3, 4], namespace="a"))
  assert cache.open_sequence([1, 2, 3, 4, 5], namespace="b").num_cached == 0
  assert cache.open_sequence([1, 2, 3, 4, 5], namespace="a").num_cached == 4


def test_keys_chain_the_whole_prefix():
  salt = namespace_salt("")
  first = page_key(salt, ROOT_KEY, [1, 2])
  assert page_key(salt, first, [3, 4]) != page_key(salt, page_key(salt, ROOT_KEY, [9, 9]), [3, 4])
  assert page_key(salt, first, [3, 4]) != page_key(salt, ROOT_KEY, [3, 4])


@pytest.mark.parametrize("x, y", [([0], [0, 0]), ([], [0]), ([1, 0], [256]), ([2, 1], [1, 2])])
def test_serialisation_is_unambiguous(x, y):
  salt = namespace_salt("")
  assert page_key(salt, ROOT_KEY, x) != page_key(salt, ROOT_KEY, y)


@pytest.mark.parametrize("bad", [[2**31], [-1], [2**32 + 5]])
def test_out_of_range_tokens_are_refused_not_wrapped(bad):
  with pytest.raises(ValueError, match="2\\^31"):
    as_tokens(bad)


def test_hash_collision_is_a_miss(monkeypatch):
  monkeypatch.setattr(pc, "page_key", lambda salt, parent, tokens: b"same" * 8)
  cache = PrefixCache(8, 2)
  dev = Device(cache)
  cache.release(run(cache, dev, [1, 2]))
  seq = run(cache, dev, [3, 4, 5])
  assert seq.num_cached == 0 and cache.stats.collisions == 1


# Eviction.

def test_lru_k_order_on_crafted_accesses():
  lru = LruK(k=2)
  for page in [1, 2, 3, 1, 2, 4]:  # clocks 1..6: 1 -> [1, 4], 2 -> [2, 5], 3 -> [3], 4 -> [6]
    lru.touch(page)
  for page in [1, 2, 3, 4]:
    lru.add(page)
  # Plain LRU would give 3, 1, 2, 4; LRU-2 takes the single-access pages first.
  assert [lru.pop() for _ in range(4)] == [3, 4, 1, 2]


def test_lru_2_keeps_a_reused_prefix_through_a_scan():
  cache = PrefixCache(5, 2)  # 4 usable pages
  dev = Device(cache)
  cache.release(run(cache, dev, [1, 2]))
  cache.release(run(cache, dev, [1, 2, 3]))  # second access of page [1, 2]
  cache.release(run(cache, dev, [5, 6]))
  cache.release(run(cache, dev, [7, 8]))
  held = run(cache, dev, [9, 9, 9, 9])  # one free page + one eviction: [5, 6] goes, not [1, 2]
  assert cache.stats.evictions == 1
  assert sorted(cache.cached_pages().values()) == [(1, 2), (7, 8)]
  assert cache.open_sequence([1, 2, 0]).num_cached == 2
  cache.release(held)


def test_referenced_pages_are_never_evicted():
  cache = PrefixCache(5, 2)
  dev = Device(cache)
  held = run(cache, dev, [1, 2, 3, 4])
  cache.release(run(cache, dev, [5, 6]))
  other = run(cache, dev, [7, 8, 9, 9])  # must evict [5, 6], never the held pages
  assert cache.stats.evictions == 1
  with pytest.raises(PoolExhausted):
    cache.open_sequence([0, 0])
  assert dev.read(held) == [1, 2, 3, 4] and dev.read(other) == [7, 8, 9, 9]


def test_null_page_is_never_allocated():
  pool = PagePool(6, 4, on_evict=lambda page: None)
  assert sorted(pool.allocate(5)) == [1, 2, 3, 4, 5]
  with pytest.raises(PoolExhausted, match="asked for 1 pages; 0 free and 0 evictable"):
    pool.allocate(1)


def test_pool_exhausted_leaves_state_unchanged():
  cache = PrefixCache(8, 2)  # 7 usable pages
  dev = Device(cache)
  cache.release(run(cache, dev, [1, 2, 3, 4]))
  live = [run(cache, dev, [1, 2, 3, 4, 5, 6]), run(cache, dev, [9, 9])]  # 4 pages held
  before = snapshot(cache, live)
  with pytest.raises(PoolExhausted, match="asked for 4 pages; 3 free and 0 evictable"):
    cache.open_sequence([1, 2] + [7] * 8)  # [1, 2] is cached: 4 more pages
  with pytest.raises(PoolExhausted, match="asked for 4 pages"):
    cache.extend(live[0], [0] * 8)
  assert snapshot(cache, live) == before


def test_pool_exhausted_counts_its_own_cached_prefix_as_unavailable():
  cache = PrefixCache(5, 2)  # 4 usable pages
  dev = Device(cache)
  cache.release(run(cache, dev, [1, 2, 3, 4]))
  live = [run(cache, dev, [9, 9])]  # 1 free page, 2 evictable that the next request would reuse
  before = snapshot(cache, live)
  with pytest.raises(PoolExhausted, match="asked for 2 pages; 1 free and 0 evictable"):
    cache.open_sequence([1, 2, 3, 4, 0, 0, 0, 0])
  assert snapshot(cache, live) == before


# Sessions and copy-on-write.

def test_session_continuation_reuses_its_partial_page():
  cache = PrefixCache(16, 4)
  dev = Device(cache)
  first = run(cache, dev, list(range(10)), session="s")
  extend(cache, dev, first, [50, 51, 52])  # decode: 13 tokens, the last page holds 1
  pages, history = first.pages[:], first.tokens[:]
  cache.release(first)
  second = run(cache, dev, history + [60, 61, 62, 63, 64], session="s")
  assert second.num_cached == len(history) == 13
  assert second.pages[:4] == pages and second.copies == []
  assert cache.stats.hit_tokens == 13 and cache.stats.prefilled_tokens == 10 + 5


def test_other_sessions_share_full_pages_only():
  cache = PrefixCache(16, 4)
  dev = Device(cache)
  first = run(cache, dev, list(range(10)), session="s")
  cache.release(first)
  for session in ["t", None]:  # both held, so neither publishes its third page
    assert run(cache, dev, list(range(12)), session=session).num_cached == 8


def test_fully_cached_prompt_copies_its_last_page():
  cache = PrefixCache(8, 4)
  dev = Device(cache)
  first = run(cache, dev, list(range(8)))
  shared = first.pages[:]
  cache.release(first)
  seq = run(cache, dev, list(range(8)))  # the last token is prefilled again for its logits
  assert seq.num_cached == 7 and seq.write_floor == 4
  assert seq.pages[0] == shared[0] and seq.copies == [(shared[1], seq.pages[1])]
  extend(cache, dev, seq, [8, 9])
  cache.release(seq)
  dev.check_cached_content()
  assert cache.stats.pages_in_use == 0


def test_session_partial_page_only_continues_its_own_prefix():
  cache = PrefixCache(8, 2)
  dev = Device(cache)
  cache.release(run(cache, dev, [1, 2, 3], session="s"))  # partial page [3] after [1, 2]
  assert run(cache, dev, [3, 5], session="s").num_cached == 0
  assert run(cache, dev, [1, 2, 3, 5], session="s").num_cached == 3


def test_a_session_keeps_only_its_latest_partial_page():
  cache = PrefixCache(8, 2)
  dev = Device(cache)
  forks = [run(cache, dev, [1, 2, 3], session="s"), run(cache, dev, [4, 5, 6], session="s")]
  for seq in forks:
    cache.release(seq)
  assert sorted(cache.cached_pages().values()) == [(1, 2), (4, 5), (6,)]
  assert cache.stats.pages_cached == 3 and cache.pool.num_free == cache.pool.usable - 3


def test_fully_cached_session_prompt_takes_its_partial_page():
  cache = PrefixCache(8, 4)
  dev = Device(cache)
  first = run(cache, dev, list(range(6)), session="s")
  cache.release(first)
  seq = run(cache, dev, list(range(6)), session="s")
  assert seq.num_cached == 5 and seq.copies == [] and seq.pages == first.pages


# Rollback, errors, page tables.

def test_truncate_rolls_back_speculative_tokens():
  cache = PrefixCache(8, 2)
  dev = Device(cache)
  cache.release(run(cache, dev, [1, 2, 3, 4]))
  seq = run(cache, dev, [1, 2, 3, 4, 5])
  free = cache.pool.num_free
  extend(cache, dev, seq, [6, 7, 8, 9])  # 4 draft tokens, 2 accepted
  cache.truncate(seq, 7)
  assert seq.tokens == [1, 2, 3, 4, 5, 6, 7] and len(seq.pages) == 4
  assert cache.pool.num_free == free - 1
  with pytest.raises(ValueError, match="write_floor 4"):
    cache.truncate(seq, 3)
  extend(cache, dev, seq, [10])
  assert dev.read(seq) == [1, 2, 3, 4, 5, 6, 7, 10]
  cache.release(seq)
  assert sorted(cache.cached_pages().values()) == [(1, 2), (3, 4), (5, 6), (7, 10)]
  dev.check_cached_content()


def test_errors_name_the_problem():
  with pytest.raises(ValueError, match="page_size must be positive"):
    PrefixCache(8, 0)
  cache = PrefixCache(4, 2)
  with pytest.raises(ValueError, match="7 tokens need 4 pages of 2; the pool has only 3 usable"):
    cache.open_sequence(range(7))
  seq = cache.open_sequence([])
  assert seq.pages == [] and seq.num_cached == 0
  with pytest.raises(ValueError, match="need 4 pages"):
    cache.extend(seq, range(7))
  cache.release(seq)
  with pytest.raises(ValueError, match="already released"):
    cache.release(seq)
  with pytest.raises(ValueError, match="already released"):
    cache.extend(seq, [1])


def test_page_table_is_padded_with_the_null_page():
  cache = PrefixCache(8, 4)
  seq = cache.open_sequence(range(6))
  table, length = cache.page_table(seq, 4)
  assert table.dtype == np.int32 and length == 6
  assert table.tolist() == seq.pages + [NULL_PAGE, NULL_PAGE]
  with pytest.raises(ValueError, match="width 1 < 2 pages"):
    cache.page_table(seq, 1)


# Differential test against the simulated device.

@settings(max_examples=100, deadline=None)
@given(st.data())
def test_random_workload_matches_the_device(data):
  ps = data.draw(st.integers(1, 4), label="page_size")
  evicted: list[CachedPage] = []

  def on_evict(entry: CachedPage) -> None:
    # Out of the index, unreferenced, and its content still on the device (nothing wrote it yet).
    assert cache.lookup(entry.content.key) is None and cache.pool.refcount(entry.page) == 0
    assert dev.kv[entry.page, :len(entry.content.tokens)].tolist() == list(entry.content.tokens)
    evicted.append(entry)

  cache = PrefixCache(data.draw(st.integers(5, 14), label="num_pages"), ps, on_evict=on_evict)
  dev = Device(cache)
  small = st.lists(st.integers(0, 1), max_size=4)
  bases = [data.draw(st.lists(st.integers(0, 1), min_size=2, max_size=10)) for _ in range(2)]
  live: list[SequenceAlloc] = []
  history: dict[tuple[str, str], list[int]] = {}
  for _ in range(data.draw(st.integers(1, 30), label="steps")):
    op = data.draw(st.sampled_from(["open", "extend", "truncate", "release", "release"]))
    before, cached, num_evicted = snapshot(cache, live), cache.cached_pages(), len(evicted)
    try:
      if op == "open" or not live:
        ns = data.draw(st.sampled_from(["a", "b"]))
        session = data.draw(st.sampled_from([None, "s", "t"]))
        if session and (ns, session) in history and data.draw(st.integers(0, 3)):
          prefix = history[ns, session]
        else:
          base = data.draw(st.sampled_from(bases))
          prefix = base[:len(base) - data.draw(st.integers(0, len(base)))]
        live.append(run(cache, dev, prefix + data.draw(small), namespace=ns, session=session))
      else:
        seq = data.draw(st.sampled_from(live))
        if op == "extend":
          extend(cache, dev, seq, data.draw(small))
        elif op == "truncate":
          cache.truncate(seq, data.draw(st.integers(seq.write_floor, seq.length)))
        else:
          cache.release(seq)
          live.remove(seq)
          if seq.session:
            history[seq.namespace, seq.session] = seq.tokens
    except (PoolExhausted, ValueError):
      assert snapshot(cache, live) == before
    # One callback per eviction, each for a page that was cached (with those tokens) before.
    new = evicted[num_evicted:]
    assert len(new) == cache.stats.evictions - before[0].evictions == len({e.page for e in new})
    assert all(cached.get(e.page) == e.content.tokens for e in new)
    check_consistent(cache, dev, live)
  for seq in live:
    cache.release(seq)
  pool = cache.pool
  assert cache.stats.pages_in_use == 0 and pool.num_free + pool.num_evictable == pool.usable
  dev.check_cached_content()


def check_consistent(cache: PrefixCache, dev: Device, live: list[SequenceAlloc]) -> None:
  dev.check_cached_content()
  holders = np.zeros(cache.pool.num_pages, dtype=int)
  for seq in live:
    assert dev.read(seq) == seq.tokens
    np.add.at(holders, seq.pages + [src for src, _ in seq.copies], 1)
  pool = cache.pool
  assert holders.tolist() == [pool.refcount(p) for p in range(pool.num_pages)]
  stats = cache.stats
  assert pool.num_free + pool.num_evictable + stats.pages_in_use == pool.usable
  assert stats.pages_cached == len(cache.cached_pages())


def test_reserved_pages_are_in_the_table_and_freed_unless_reached():
  cache = PrefixCache(num_pages=16, page_size=4)
  seq = cache.open_sequence(list(range(10)), session="a")
  assert len(seq.pages) == 3
  reserved = cache.reserve(seq, 9)                      # positions 10..18: pages 3 and 4
  assert len(reserved) == 2 and seq.length == 10
  table, length = cache.page_table(seq, 6)
  assert list(table[:5]) == seq.pages and length == 10
  assert cache.extend(seq, [20, 21, 22]) == []           # lands in reserved pages
  free_before = cache.pool.num_free
  cache.release(seq)                                     # 13 tokens: page 4 was never reached
  assert cache.pool.num_free == free_before + 1
  # The session's partial page is the one holding token 12, not the unreached reserved page.
  nxt = cache.open_sequence(list(range(10)) + [20, 21, 22, 5], session="a")
  assert nxt.num_cached == 13 and nxt.pages[3] == seq.pages[3]


# Hooks for a lower tier: eviction callback, lookup, insert_cached.

def chain(tokens, ps: int, namespace: str = "", session: str | None = None) -> list[PageContent]:
  """The contents a prompt's pages are cached under: full pages, then a session's partial page."""
  salt, parent, out = namespace_salt(namespace), ROOT_KEY, []
  for i in range(len(tokens) // ps):
    chunk = tuple(tokens[i * ps:(i + 1) * ps])
    out.append(PageContent(page_key(salt, parent, chunk), parent, chunk))
    parent = out[-1].key
  if session is not None and len(tokens) % ps:
    out.append(PageContent(session_key(salt, session), parent, tuple(tokens[len(tokens) // ps * ps:])))
  return out


@pytest.mark.parametrize("ps", [2, 3, 4])
def test_eviction_callback_reports_each_evicted_page_once_and_never_a_held_one(ps):
  rng = np.random.default_rng(ps)
  evicted: list[CachedPage] = []

  def on_evict(entry: CachedPage) -> None:
    assert dev.kv[entry.page, :len(entry.content.tokens)].tolist() == list(entry.content.tokens)
    evicted.append(entry)

  cache = PrefixCache(9, ps, on_evict=on_evict)  # 8 usable pages
  dev = Device(cache)
  kept, sess, plain = (rng.integers(0, 50, n).tolist() for n in (2 * ps, 2 * ps + 1, 2 * ps))
  seqs = [run(cache, dev, kept, namespace="n"), run(cache, dev, sess, namespace="n", session="s"),
          run(cache, dev, plain, namespace="n")]
  expected = chain(sess, ps, "n", "s") + chain(plain, ps, "n")   # what must go, and where it was
  placed = dict(zip((c.key for c in expected), seqs[1].pages + seqs[2].pages))
  for seq in seqs:
    cache.release(seq)                               # 7 pages cached, 1 free
  held = run(cache, dev, kept + [7], namespace="n")  # its 2 cached pages are referenced again
  assert evicted == [] and cache.stats.evictions == 0
  filler = run(cache, dev, rng.integers(100, 150, 5 * ps).tolist())  # takes all 5 unreferenced pages
  assert sorted(e.content.key for e in evicted) == sorted(c.key for c in expected)  # each once
  assert all(e.content in expected and e.page == placed[e.content.key] for e in evicted)
  assert not {e.page for e in evicted} & set(held.pages) and cache.stats.evictions == 5
  for seq in (held, filler):
    cache.release(seq)                               # releasing evicts nothing
  assert len(evicted) == 5 and dev.read(held) == kept + [7]


@pytest.mark.parametrize("ps,session", [(2, None), (3, "s"), (4, "s")])
def test_inserted_pages_are_hit_by_lookup_and_open_sequence_in_their_namespace_only(ps, session):
  """A host tier in miniature: evicted pages are kept with their device content, put back into
  fresh pages with insert_cached, and the prompt then hits them in its namespace, not in another."""
  rng = np.random.default_rng(ps)
  host: dict[bytes, tuple[PageContent, np.ndarray, np.ndarray]] = {}

  def keep(entry: CachedPage) -> None:
    host[entry.content.key] = entry.content, dev.kv[entry.page].copy(), dev.ctx[entry.page].copy()

  cache = PrefixCache(8, ps, on_evict=keep)  # 7 usable pages
  dev = Device(cache)
  prompt = rng.integers(0, 50, 2 * ps + 1).tolist()
  cache.release(run(cache, dev, prompt, namespace="a", session=session))
  cache.release(run(cache, dev, rng.integers(100, 150, 7 * ps).tolist()))  # pushes the prompt out
  contents = chain(prompt, ps, "a", session)
  assert [host[c.key][0] for c in contents] == contents
  assert all(cache.lookup(c.key) is None for c in contents)
  pages = cache.pool.allocate(len(contents))
  for content, page in zip(contents, pages):
    dev.kv[page], dev.ctx[page] = host[content.key][1:]
    cache.insert_cached(content, page, namespace="a", session=session)
    assert cache.lookup(content.key) == CachedPage(content, page)
  other = run(cache, dev, prompt + [7], namespace="b", session=session)
  assert other.num_cached == 0
  cache.release(other)
  for page in pages:                                 # the caller's references: now evictable
    cache.pool.decref(page)
  seq = run(cache, dev, prompt + [7], namespace="a", session=session)   # reads back every slot
  assert seq.num_cached == (len(prompt) if session else 2 * ps) and seq.pages[:len(pages)] == pages
  cache.release(seq)
  dev.check_cached_content()


@pytest.mark.parametrize("case,match", [
    ("short", "a full page holds 4 tokens, got 3"),
    ("full_partial", "session 's'.s partial page holds 1 to 3 tokens, got 4"),
    ("other_namespace", "key mismatch: .* namespace 'b'"),
    ("other_parent", "key mismatch"),
    ("cached", "key already cached, on page"),
    ("shared", "page .* has refcount 2: insert_cached takes a page its caller alone holds"),
    ("free", "has refcount 0"),
    ("published", "has refcount 1 and is published"),
    ("null", "page 0 outside the usable ids"),
])
def test_bad_insert_is_a_clear_value_error_and_changes_nothing(case, match):
  rng = np.random.default_rng(len(case))
  cache = PrefixCache(8, 4)
  dev = Device(cache)
  old, new = rng.integers(0, 50, 4).tolist(), tuple(rng.integers(100, 150, 4).tolist())
  cache.release(run(cache, dev, old))
  live = run(cache, dev, old + [1])                  # holds the cached page of `old`
  page = cache.pool.allocate(1)[0]
  salt = namespace_salt("")
  content, kw = PageContent(page_key(salt, ROOT_KEY, new), ROOT_KEY, new), {}
  if case == "short":
    content = PageContent(page_key(salt, ROOT_KEY, new[:3]), ROOT_KEY, new[:3])
  elif case == "full_partial":
    content, kw = PageContent(session_key(salt, "s"), ROOT_KEY, new), dict(session="s")
  elif case == "other_namespace":
    kw = dict(namespace="b")
  elif case == "other_parent":
    content = PageContent(content.key, chain(old, 4)[0].key, new)
  elif case == "cached":
    content = chain(old, 4)[0]
  elif case == "shared":
    cache.pool.incref(page)
  elif case == "free":
    cache.pool.decref(page)
  elif case == "published":
    page = live.pages[0]
  elif case == "null":
    page = NULL_PAGE
  before = snapshot(cache, [live])
  with pytest.raises(ValueError, match=match):
    cache.insert_cached(content, page, **kw)
  assert snapshot(cache, [live]) == before
