"""Host side of the paged KV cache: which device page holds which tokens (pure Python + numpy).

The device holds KV pages [num_pages, page_size, ...]; this module hands out page ids and never
touches KV data. It must be exact: a wrong mapping silently corrupts generations.

Invariants (enforced here, checked by tests/test_prefix_cache.py):
- NULL_PAGE (0) is never allocated; page tables are padded with it, so num_pages - 1 are usable.
- A usable page is free, held (refcount > 0: used by live sequences, possibly also published), or
  cached (published, refcount 0). Only cached pages are evictable; a held page never is.
- A published page is never written until it is evicted. A sequence writes only positions
  >= its `write_floor`, and every page from there on is its own (refcount 1, unpublished); the
  shared pages before the floor are read-only. A fully cached prompt still prefills its last token
  (the engine needs its logits); if that token's page is shared it is copied first (copy-on-write).
- Full pages are keyed by a chained hash h_i = H(domain | tag | namespace salt | h_{i-1} | count |
  int32 tokens), so a key names its whole prefix and namespaces never share pages. A hit is also
  checked against the stored tokens and parent key; a mismatch is a miss, counted as a collision.
- Lookups walk the chain from the root and stop at the first missing page, so a page whose parent
  was evicted (an orphan) is never returned; never touched again, it ages out. Pages are touched
  leaf to root within one operation, so on equal history a child is evicted before its parent.
- Eviction is LRU-2 (O'Neil et al., 1993) on a logical clock, so runs are deterministic.
- A session's trailing partial page is published under a per-session key and reused only by that
  session's next sequence, which takes it over (unpublishes it) and keeps writing into it; other
  sequences share full pages only. A session keeps only the partial page of its latest release.
- An operation that raises leaves every structure unchanged.
- A lower tier (glmjax/serve/host_tier.py) needs three hooks, all public: the `on_evict` callback
  sees every evicted page (its content and id) before the page can be handed out again;
  `lookup` reads the index by key without side effects; `insert_cached` publishes a page whose
  KV came back from elsewhere under its old key.
"""

import dataclasses
import hashlib
import heapq
import operator
from collections.abc import Callable, Iterable, Sequence

import numpy as np

NULL_PAGE = 0
ROOT_KEY = bytes(32)
_DOMAIN = b"glmjax-prefix-v1"
_FULL, _SESSION, _NAMESPACE = b"F", b"S", b"N"


class PoolExhausted(RuntimeError):
  """The pool cannot supply the pages asked for, even after evicting every cached page."""

  def __init__(self, asked: int, free: int, evictable: int):
    super().__init__(f"asked for {asked} pages; {free} free and {evictable} evictable")
    self.asked, self.free, self.evictable = asked, free, evictable


def as_tokens(tokens: Iterable[int]) -> tuple[int, ...]:
  """Validated token ids. Ids outside [0, 2^31) are refused: wrapping to int32 would alias keys."""
  toks = tuple(operator.index(t) for t in tokens)
  bad = [t for t in toks if not 0 <= t < 2**31]
  if bad:
    raise ValueError(f"token ids must lie in [0, 2^31), got {bad[:3]}")
  return toks


def _encode(values: Sequence[int]) -> bytes:
  """Count (uint32) then the values as int32, little-endian: one byte string per sequence."""
  return len(values).to_bytes(4, "little") + np.asarray(values, dtype="<i4").tobytes()


def _digest(tag: bytes, *fields: bytes) -> bytes:
  return hashlib.sha256(b"".join((_DOMAIN, tag, *fields))).digest()


def namespace_salt(namespace: str) -> bytes:
  """32-byte salt that separates one namespace's keys from every other's."""
  return _digest(_NAMESPACE, namespace.encode())


def page_key(salt: bytes, parent: bytes, tokens: Sequence[int]) -> bytes:
  """Key of a full page: names the namespace, the prefix (via `parent`) and the page's tokens."""
  return _digest(_FULL, salt, parent, _encode(tokens))


def session_key(salt: bytes, session: str) -> bytes:
  """Key under which a session's trailing partial page is published."""
  return _digest(_SESSION, salt, session.encode())


class LruK:
  """Eviction order over candidate pages by LRU-K: the oldest K-th most recent access goes first.

  Pages with fewer than K accesses have infinite backward K-distance and go before all others,
  oldest most-recent access first. A lazy heap keeps each eviction O(log n).
  """

  def __init__(self, k: int = 2):
    self._k = k
    self._clock = 0
    self._history: dict[int, list[int]] = {}
    self._candidates: set[int] = set()
    self._heap: list[tuple[tuple[int, int], int]] = []

  def __len__(self) -> int:
    return len(self._candidates)

  def priority(self, page: int) -> tuple[int, int]:
    """(K-th most recent access, or -1 for infinity; most recent access): smallest is evicted."""
    hist = self._history.get(page, [0])
    return (hist[0] if len(hist) == self._k else -1, hist[-1])

  def touch(self, page: int) -> None:
    self._clock += 1
    hist = self._history.setdefault(page, [])
    hist.append(self._clock)
    del hist[: -self._k]
    if page in self._candidates:
      self._push(page)

  def add(self, page: int) -> None:
    self._candidates.add(page)
    self._push(page)

  def discard(self, page: int) -> None:
    self._candidates.discard(page)

  def forget(self, page: int) -> None:
    """Drop the page and its history (its content is gone)."""
    self._candidates.discard(page)
    self._history.pop(page, None)

  def pop(self) -> int:
    """Remove and return the candidate to evict."""
    while self._heap:
      prio, page = heapq.heappop(self._heap)
      if page in self._candidates and prio == self.priority(page):  # skip stale entries
        self._candidates.remove(page)
        return page
    raise LookupError("no page to evict")

  def _push(self, page: int) -> None:
    if len(self._heap) > 4 * len(self._candidates) + 64:  # bound the stale entries
      self._heap = [(self.priority(p), p) for p in self._candidates]
      heapq.heapify(self._heap)
    heapq.heappush(self._heap, (self.priority(page), page))


class PagePool:
  """Page ids with reference counts; published pages with no reference are evicted by LRU-2."""

  def __init__(self, num_pages: int, page_size: int, on_evict: Callable[[int], None]):
    if page_size <= 0:
      raise ValueError(f"page_size must be positive, got {page_size}")
    if num_pages < 2:
      raise ValueError(f"num_pages must be >= 2 (page {NULL_PAGE} is reserved), got {num_pages}")
    self.num_pages, self.page_size = num_pages, page_size
    self._on_evict = on_evict
    self._refs = [0] * num_pages
    self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # pop() hands out 1, 2, ...
    self._published: set[int] = set()
    self.lru = LruK(k=2)

  @property
  def usable(self) -> int:
    return self.num_pages - 1

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_evictable(self) -> int:
    return len(self.lru)

  @property
  def num_in_use(self) -> int:
    return sum(r > 0 for r in self._refs)

  @property
  def num_published(self) -> int:
    return len(self._published)

  def refcount(self, page: int) -> int:
    return self._refs[page]

  def is_published(self, page: int) -> bool:
    return page in self._published

  def allocate(self, n: int) -> list[int]:
    """n fresh pages, each with refcount 1, evicting cached pages as needed; all or nothing."""
    if n > self.num_free + self.num_evictable:
      raise PoolExhausted(n, self.num_free, self.num_evictable)
    while self.num_free < n:
      page = self.lru.pop()
      self._published.remove(page)
      self.lru.forget(page)
      self._on_evict(page)
      self._free.append(page)
    pages = [self._free.pop() for _ in range(n)]
    for page in pages:
      self._refs[page] = 1
    return pages

  def incref(self, page: int) -> None:
    if self._refs[page] == 0:
      if page not in self._published:
        raise ValueError(f"page {page} is free: only held or cached pages can be shared")
      self.lru.discard(page)
    self._refs[page] += 1

  def decref(self, page: int) -> None:
    if self._refs[page] == 0:
      raise ValueError(f"page {page} is not referenced")
    self._refs[page] -= 1
    if self._refs[page] == 0:
      if page in self._published:
        self.lru.add(page)
      else:
        self._free.append(page)

  def publish(self, page: int) -> None:
    """Mark a held page as cached content (evictable once its last reference goes)."""
    if self._refs[page] == 0:
      raise ValueError(f"page {page} must be held to be published")
    self._published.add(page)

  def unpublish(self, page: int) -> None:
    self._published.remove(page)
    self.lru.forget(page)
    if self._refs[page] == 0:
      self._free.append(page)


@dataclasses.dataclass
class CacheStats:
  """Counters since construction, plus the two page gauges filled in by `PrefixCache.stats`."""

  lookups: int = 0
  hit_tokens: int = 0
  prefilled_tokens: int = 0  # prompt tokens not served from the cache
  evictions: int = 0
  collisions: int = 0
  pages_in_use: int = 0
  pages_cached: int = 0


@dataclasses.dataclass(eq=False)
class SequenceAlloc:
  """A live sequence's pages. The device prefills tokens[num_cached:] after applying `copies`."""

  tokens: list[int]  # tokens whose KV is (to be) on the device, position order
  pages: list[int]  # page i holds positions [i * page_size, (i + 1) * page_size)
  num_cached: int
  write_floor: int  # first position this sequence may write; pages from here on are its own
  copies: list[tuple[int, int]]  # (src, dst) page copies to apply before prefill
  namespace: str
  session: str | None
  _pinned: list[int] = dataclasses.field(repr=False)  # copy sources: held until release
  released: bool = False

  @property
  def length(self) -> int:
    return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class PageContent:
  """What a cached page holds, named without its KV; the check on every hit, wherever the KV lives.

  key: `page_key(salt, parent, tokens)` for a full page (page_size tokens), `session_key(salt,
  session)` for a session's partial page (fewer tokens). parent: the key of the full page before
  it, ROOT_KEY for the first.
  """

  key: bytes
  parent: bytes
  tokens: tuple[int, ...]

  def follows(self, parent: bytes, rest: Sequence[int]) -> bool:
    """Whether this page continues a prompt whose previous page has key `parent` and whose tokens
    from this page on start with `rest`. A key hit that fails it is a hash collision: a miss."""
    return self.parent == parent and tuple(rest[:len(self.tokens)]) == self.tokens


@dataclasses.dataclass(frozen=True)
class CachedPage:
  """A device page published in the prefix index, and the content it must hold."""

  content: PageContent
  page: int


class PrefixCache:
  """Prefix index over a PagePool: opens, grows, rolls back and releases sequences.

  on_evict, if given, is called once for every cached page the pool evicts (LRU-2 over published
  pages with no reference, so never for a held page), with the page's content and id. It runs
  inside the allocation that evicts the page, after the page left the index and before the
  allocation hands it out: the page's KV is intact until the caller writes into what it was
  given, so a listener that copies the KV out must do so before the next device write. It must
  not raise or call back into the cache. Pages leaving the index otherwise (a session's partial
  page taken over by its next sequence, or replaced by a newer one) are not evictions.
  """

  def __init__(self, num_pages: int, page_size: int, *,
               on_evict: Callable[[CachedPage], None] | None = None):
    self.pool = PagePool(num_pages, page_size, on_evict=self._evict)
    self.page_size = page_size
    self._on_evict = on_evict
    self._index: dict[bytes, CachedPage] = {}
    self._key_of: dict[int, bytes] = {}
    self._stats = CacheStats()

  @property
  def stats(self) -> CacheStats:
    return dataclasses.replace(
        self._stats, pages_in_use=self.pool.num_in_use, pages_cached=self.pool.num_published)

  def cached_pages(self) -> dict[int, tuple[int, ...]]:
    """Published page -> the tokens its content must hold (for checks and debugging)."""
    return {e.page: e.content.tokens for e in self._index.values()}

  def lookup(self, key: bytes) -> CachedPage | None:
    """The device page cached under `key` (a full page's or a session's key), or None.

    No side effects: no access is recorded for LRU-2, no statistic moves and no reference is
    taken, so an unreferenced page stays evictable. The caller confirms a hit with
    `content.follows(parent, rest)`, as open_sequence does: equal keys alone do not prove equal
    tokens.
    """
    return self._index.get(key)

  def insert_cached(self, content: PageContent, page: int, *, namespace: str = "",
                    session: str | None = None) -> None:
    """Publish `page` as the cached page of `content`, so that later lookups and open_sequence hit it.

    For KV restored from elsewhere (a host tier): the caller allocated `page` (pool.allocate)
    and holds its only reference, which it keeps; the page becomes evictable once the caller
    drops it (pool.decref), with no access history until a hit touches it. The KV must be written
    before any sequence reads the page. `content.key` must be the key that `namespace` gives
    it: `page_key(namespace_salt(namespace), content.parent, content.tokens)` for a full page of
    page_size tokens, or `session_key(namespace_salt(namespace), session)` for that session's
    partial page (1 to page_size - 1 tokens). Raises ValueError, changing nothing, on a token
    count that does not fit, a key that is not that key or is cached already, or a page that is
    not held by the caller alone.
    """
    toks, ps, pool = as_tokens(content.tokens), self.page_size, self.pool
    salt = namespace_salt(namespace)
    if session is not None and content.key == session_key(salt, session):
      if not 0 < len(toks) < ps:
        raise ValueError(f"session {session!r}'s partial page holds 1 to {ps - 1} tokens, got {len(toks)}")
    elif len(toks) != ps:
      raise ValueError(f"a full page holds {ps} tokens, got {len(toks)}")
    elif content.key != page_key(salt, content.parent, toks):
      raise ValueError(f"key mismatch: not the key of these tokens after this parent in namespace "
                       f"{namespace!r}" + ("" if session is None else f", nor session {session!r}'s key"))
    if content.key in self._index:
      raise ValueError(f"key already cached, on page {self._index[content.key].page}")
    if not NULL_PAGE < page < pool.num_pages:
      raise ValueError(f"page {page} outside the usable ids [1, {pool.num_pages})")
    if pool.refcount(page) != 1 or pool.is_published(page):
      raise ValueError(f"page {page} has refcount {pool.refcount(page)}"
                       f"{' and is published' if pool.is_published(page) else ''}: insert_cached takes "
                       f"a page its caller alone holds, fresh from pool.allocate")
    self._publish(CachedPage(PageContent(content.key, content.parent, toks), page))

  def open_sequence(self, tokens: Iterable[int], *, namespace: str = "",
                    session: str | None = None) -> SequenceAlloc:
    """Pages for `tokens`, reusing the longest cached prefix and, for a session, its partial page.

    At most len(tokens) - 1 tokens come from the cache: the engine needs the last one's logits.
    """
    toks, ps = as_tokens(tokens), self.page_size
    self._check_fits(len(toks))
    salt = namespace_salt(namespace)
    hits, parent, collisions = self._match(salt, toks)
    partial = self._match_partial(salt, session, parent, toks[len(hits) * ps:])
    taken = [partial.page] if partial else []
    cached = len(hits) * ps + (len(partial.content.tokens) if partial else 0)
    num_cached = min(cached, max(len(toks) - 1, 0))
    write_page = num_cached // ps
    # A cached page holding the write position (a fully cached prompt) is copied, not written.
    kept, pinned = hits[:write_page], hits[write_page:]
    num_fresh = self.pages_for(len(toks)) - len(kept) - len(taken)
    reused = kept + pinned + taken
    reserved = sum(self.pool.refcount(p) == 0 for p in reused)  # evictable now, held once opened
    if num_fresh > self.pool.num_free + self.pool.num_evictable - reserved:
      raise PoolExhausted(num_fresh, self.pool.num_free, self.pool.num_evictable - reserved)

    for page in reused:  # before allocating, so that allocation cannot evict them
      self.pool.incref(page)
    for page in taken:  # this sequence writes on into it
      self._unindex(page)
    fresh = self.pool.allocate(num_fresh)
    for page in reversed(hits):
      self.pool.lru.touch(page)
    self._stats.lookups += 1
    self._stats.collisions += collisions
    self._stats.hit_tokens += num_cached
    self._stats.prefilled_tokens += len(toks) - num_cached
    return SequenceAlloc(
        tokens=list(toks), pages=kept + taken + fresh, num_cached=num_cached,
        write_floor=write_page * ps, copies=[(src, fresh[0]) for src in pinned],
        namespace=namespace, session=session, _pinned=pinned)

  def extend(self, seq: SequenceAlloc, tokens: Iterable[int]) -> list[int]:
    """Append decode tokens (into reserved pages first); returns the newly allocated pages.
    PoolExhausted changes nothing."""
    toks = as_tokens(tokens)
    fresh = self.reserve(seq, len(toks))
    seq.tokens += toks
    return fresh

  def reserve(self, seq: SequenceAlloc, num_tokens: int) -> list[int]:
    """Pages for `num_tokens` more positions ahead of their tokens (a decode budget, so that the
    device can write them and `extend` cannot fail); returns the new pages. Reserved pages are
    in the page table, freed by `truncate` and `release` when no token reached them."""
    self._check_live(seq)
    self._check_fits(seq.length + num_tokens)
    fresh = self.pool.allocate(max(0, self.pages_for(seq.length + num_tokens) - len(seq.pages)))
    seq.pages += fresh
    return fresh

  def truncate(self, seq: SequenceAlloc, new_len: int) -> None:
    """Roll back to `new_len` tokens (rejected speculative tokens), freeing pages past it."""
    self._check_live(seq)
    if not seq.write_floor <= new_len <= seq.length:
      raise ValueError(
          f"truncate to {new_len} outside [write_floor {seq.write_floor}, length {seq.length}]")
    keep = self.pages_for(new_len)
    for page in seq.pages[keep:]:
      self.pool.decref(page)
    del seq.pages[keep:], seq.tokens[new_len:]

  def release(self, seq: SequenceAlloc) -> None:
    """Publish the sequence's full pages (and, for a session, its partial page); drop references."""
    self._check_live(seq)
    touched: list[int] = []
    salt = namespace_salt(seq.namespace)
    parent = self._publish_full_pages(seq, salt, touched)
    if seq.session is not None:
      skey = session_key(salt, seq.session)
      if skey in self._index:
        self._unindex(self._index[skey].page)
      tail = tuple(seq.tokens[seq.length // self.page_size * self.page_size:])
      if tail and parent is not None:
        tail_page = seq.pages[seq.length // self.page_size]
        self._publish(CachedPage(PageContent(skey, parent, tail), tail_page))
        touched.append(tail_page)
    for page in reversed(touched):  # leaf first: on equal history children go before parents
      self.pool.lru.touch(page)
    for page in seq.pages + seq._pinned:
      self.pool.decref(page)
    seq.released = True

  def page_table(self, seq: SequenceAlloc, width: int) -> tuple[np.ndarray, int]:
    """(int32 [width] page ids padded with NULL_PAGE, sequence length) for the device."""
    if len(seq.pages) > width:
      raise ValueError(f"page table width {width} < {len(seq.pages)} pages of the sequence")
    table = np.full(width, NULL_PAGE, dtype=np.int32)
    table[:len(seq.pages)] = seq.pages
    return table, seq.length

  def pages_for(self, num_tokens: int) -> int:
    """Pages that hold `num_tokens` positions."""
    return -(-num_tokens // self.page_size)

  def _match(self, salt: bytes, toks: tuple[int, ...]) -> tuple[list[int], bytes, int]:
    """Cached pages of the longest full-page prefix, the key of its last page, collisions met."""
    ps, pages, parent = self.page_size, [], ROOT_KEY
    for i in range(len(toks) // ps):
      chunk = toks[i * ps:(i + 1) * ps]
      entry = self._index.get(key := page_key(salt, parent, chunk))
      if entry is None:
        return pages, parent, 0
      if not entry.content.follows(parent, chunk):
        return pages, parent, 1
      pages.append(entry.page)
      parent = key
    return pages, parent, 0

  def _match_partial(self, salt: bytes, session: str | None, parent: bytes,
                     rest: tuple[int, ...]) -> CachedPage | None:
    """The session's partial page if it follows `parent` and `rest` starts with its tokens."""
    if session is None or (entry := self._index.get(session_key(salt, session))) is None:
      return None
    return entry if entry.content.follows(parent, rest) else None

  def _publish_full_pages(self, seq: SequenceAlloc, salt: bytes,
                          touched: list[int]) -> bytes | None:
    """Index the sequence's full pages not yet cached (appending them to `touched`).

    Returns the key of the last full page (ROOT_KEY if none), or None after a collision: the
    children of a collided key would be unreachable, so publishing stops there.
    """
    ps, parent = self.page_size, ROOT_KEY
    for i in range(seq.length // ps):
      chunk = tuple(seq.tokens[i * ps:(i + 1) * ps])
      key = page_key(salt, parent, chunk)
      entry = self._index.get(key)
      if entry is None:
        self._publish(CachedPage(PageContent(key, parent, chunk), seq.pages[i]))
        touched.append(seq.pages[i])
      elif not entry.content.follows(parent, chunk):
        self._stats.collisions += 1
        return None
      # else: this page, or an equal one that stays cached (ours is freed on decref)
      parent = key
    return parent

  def _publish(self, entry: CachedPage) -> None:
    self._index[entry.content.key] = entry
    self._key_of[entry.page] = entry.content.key
    self.pool.publish(entry.page)

  def _unindex(self, page: int) -> None:
    del self._index[self._key_of.pop(page)]
    self.pool.unpublish(page)

  def _evict(self, page: int) -> None:
    """The pool's eviction hook: drop the page from the index, then tell `on_evict`."""
    entry = self._index.pop(self._key_of.pop(page))
    self._stats.evictions += 1
    if self._on_evict is not None:
      self._on_evict(entry)

  def _check_fits(self, num_tokens: int) -> None:
    if (need := self.pages_for(num_tokens)) > self.pool.usable:
      raise ValueError(f"{num_tokens} tokens need {need} pages of {self.page_size}; "
                       f"the pool has only {self.pool.usable} usable")

  @staticmethod
  def _check_live(seq: SequenceAlloc) -> None:
    if seq.released:
      raise ValueError("sequence already released")
