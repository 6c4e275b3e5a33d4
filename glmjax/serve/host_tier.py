"""A host-memory tier under the device page pool: evicted KV pages are kept in numpy, not dropped.

When the device pool evicts a cached page, `TieredPrefixCache` records its content, and before
the next device write that could reuse the page, `flush` gathers the evicted pages (every layer's
arrays: latent values, FP8 scales, RoPE keys, indexer keys and their scales) into one batch and
starts its device-to-host copy; `HostTier.materialize` later turns it into per-page numpy arrays
(optionally zlib-compressed). A later lookup that misses on the device but hits here allocates
device pages, publishes them under their old keys (so the prefix index maps them again) and
`apply` writes their contents back; `HostTier.fetch` issues the host-to-device copy with
`jax.device_put`, which is asynchronous, so a fetch issued while a step runs overlaps with it.

The host tier is inclusive: a restored page stays on the host, so evicting it again costs no copy.
Host eviction is LRU-2 (accesses: the first store and every fetch); a pinned page (a waiting
request staged it for restore) is never dropped; a page that cannot fit is not stored.
"""

import dataclasses
import functools
import itertools
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.cache.paged import KVCache, LayerCache
from glmjax.cache.prefix_cache import (
    ROOT_KEY, CachedPage, LruK, PageContent, PoolExhausted, PrefixCache, SequenceAlloc, as_tokens,
    namespace_salt, page_key, session_key)

COMPRESSIONS = ("none", "zlib")


def bucket_pow2(n: int) -> int:
  """Next power of two >= n: page batches are padded to it so few programs are compiled."""
  return 1 << max(n - 1, 0).bit_length()


@jax.jit
def extract_pages(layers: tuple[LayerCache, ...], ids: jax.Array) -> list[jax.Array]:
  """Every page array of every layer at `ids` [n]: a list (leaf order of `layers`) of [n, ...]."""
  return [a[ids] for a in jax.tree.leaves(layers)]


@functools.partial(jax.jit, donate_argnames=("layers",))
def insert_pages(layers: tuple[LayerCache, ...], ids: jax.Array, data: list[jax.Array]) -> tuple[LayerCache, ...]:
  """Write `data` (as extract_pages returns it) into pages `ids` of every layer."""
  leaves, treedef = jax.tree.flatten(layers)
  return jax.tree.unflatten(treedef, [a.at[ids].set(d.astype(a.dtype)) for a, d in zip(leaves, data)])


def _padded(ids: list[int], n: int) -> jax.Array:
  """Page ids padded to n by repeating the first (a repeated write stores the same data)."""
  return jnp.asarray(list(ids) + [ids[0]] * (n - len(ids)), jnp.int32)


def copy_pages(cache: KVCache, src: list[int], dst: list[int]) -> KVCache:
  """Copy whole pages src[i] -> dst[i] (values and scales of every layer)."""
  n = bucket_pow2(len(src))
  data = extract_pages(cache.layers, _padded(src, n))
  return cache.replace(layers=insert_pages(cache.layers, _padded(dst, n), data))


@dataclasses.dataclass
class HostStats:
  stored_pages: int = 0        # pages copied in
  fetched_pages: int = 0       # pages copied back to the device
  evicted_pages: int = 0       # dropped by LRU-2 to make room
  refused_pages: int = 0       # not stored: no room even after evicting every unpinned page
  raw_bytes: int = 0           # bytes of the pages whose copy landed, uncompressed
  stored_bytes: int = 0        # the same pages as held (after compression)
  compress_s: float = 0.0
  decompress_s: float = 0.0


@dataclasses.dataclass(eq=False)
class _HostPage:
  item: PageContent
  id: int
  nbytes: int
  data: list[np.ndarray] | bytes | None = None  # None while its device-to-host copy is pending
  pins: int = 0


class HostTier:
  """Bounded host pool of KV pages keyed by prefix key; LRU-2 over unpinned pages.

  capacity_bytes bounds the bytes held (compressed size with compression="zlib").
  """

  def __init__(self, capacity_bytes: int, *, compression: str = "none"):
    if capacity_bytes < 0:
      raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
    if compression not in COMPRESSIONS:
      raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    self.capacity_bytes, self.compression = capacity_bytes, compression
    self.nbytes = 0
    self.stats = HostStats()
    self._pages: dict[bytes, _HostPage] = {}
    self._key_of: dict[int, bytes] = {}
    self._ids = itertools.count(1)
    self._lru = LruK(k=2)
    self._layout: list[tuple[tuple[int, ...], np.dtype]] | None = None  # per-page shape, dtype per leaf
    self._pending: list[tuple[list[jax.Array], list[tuple[_HostPage, int]]]] = []

  def __contains__(self, key: bytes) -> bool:
    return key in self._pages

  def __len__(self) -> int:
    return len(self._pages)

  def keys(self) -> set[bytes]:
    return set(self._pages)

  def item(self, key: bytes) -> PageContent | None:
    page = self._pages.get(key)
    return None if page is None else page.item

  def pins(self, key: bytes) -> int:
    return self._pages[key].pins

  def put_batch(self, items: list[PageContent], arrays: list[jax.Array]) -> None:
    """Store pages i < len(items) of a batch of page arrays (leaf order, [n >= len(items), ...]),
    making room by LRU-2. The copy to the host starts now and completes in `materialize`."""
    if self._layout is None:
      self._layout = [(tuple(a.shape[1:]), np.dtype(a.dtype)) for a in arrays]
    page_bytes = sum(a.nbytes // a.shape[0] for a in arrays)
    stored = []
    for i, item in enumerate(items):
      old = self._pages.get(item.key)
      if old is not None and (old.pins or old.item == item):
        continue  # this content is here already, or a staged restore still needs this version
      if old is not None:
        self._remove(old)
      if not self._make_room(page_bytes):
        self.stats.refused_pages += 1
        continue
      page = _HostPage(item, next(self._ids), page_bytes)
      self._pages[item.key], self._key_of[page.id] = page, item.key
      self.nbytes += page_bytes
      self._lru.add(page.id)
      self._lru.touch(page.id)
      stored.append((page, i))
      self.stats.stored_pages += 1
    if stored:
      for a in arrays:
        a.copy_to_host_async()
      self._pending.append((arrays, stored))

  def materialize(self) -> None:
    """Finish the pending device-to-host copies (blocks until the extraction has run)."""
    for arrays, stored in self._pending:
      host = [np.asarray(a) for a in arrays]
      for page, i in stored:
        if self._pages.get(page.item.key) is not page:
          continue  # evicted or replaced before its copy landed
        data = [h[i].copy() for h in host]
        self.stats.raw_bytes += page.nbytes
        if self.compression == "zlib":
          start = time.perf_counter()
          data = zlib.compress(b"".join(d.tobytes() for d in data), 1)
          self.stats.compress_s += time.perf_counter() - start
          self.nbytes += len(data) - page.nbytes
          page.nbytes = len(data)
        page.data = data
        self.stats.stored_bytes += page.nbytes
    self._pending = []
    self._make_room(0)  # a page that compressed badly may have pushed the total over

  def fetch(self, keys: list[bytes]) -> list[jax.Array]:
    """Device copies of the pages `keys` stacked per leaf ([n, ...], as insert_pages takes them),
    padded to a power of two with copies of the first page. Asynchronous; counts as an access."""
    self.materialize()
    pages = [self._pages[k] for k in keys]
    per_page = [self._arrays(p) for p in pages]
    per_page += [per_page[0]] * (bucket_pow2(len(pages)) - len(pages))
    for p in pages:
      self._lru.touch(p.id)
    self.stats.fetched_pages += len(pages)
    return jax.device_put([np.stack(leaf) for leaf in zip(*per_page)])

  def pin(self, keys: list[bytes]) -> None:
    for k in keys:
      page = self._pages[k]
      if page.pins == 0:
        self._lru.discard(page.id)
      page.pins += 1

  def unpin(self, keys: list[bytes]) -> None:
    for k in keys:
      page = self._pages[k]
      if page.pins == 0:
        raise ValueError("unpin of a host page that is not pinned")
      page.pins -= 1
      if page.pins == 0:
        self._lru.add(page.id)

  def _arrays(self, page: _HostPage) -> list[np.ndarray]:
    if not isinstance(page.data, bytes):
      return page.data
    start = time.perf_counter()
    raw, out, offset = zlib.decompress(page.data), [], 0
    for shape, dtype in self._layout:
      size = int(np.prod(shape)) * dtype.itemsize
      out.append(np.frombuffer(raw, dtype, offset=offset, count=size // dtype.itemsize).reshape(shape))
      offset += size
    self.stats.decompress_s += time.perf_counter() - start
    return out

  def _make_room(self, nbytes: int) -> bool:
    while self.nbytes + nbytes > self.capacity_bytes:
      if not len(self._lru):
        return False
      self._remove(self._pages[self._key_of[self._lru.pop()]])
      self.stats.evicted_pages += 1
    return True

  def _remove(self, page: _HostPage) -> None:
    del self._pages[page.item.key], self._key_of[page.id]
    self._lru.forget(page.id)
    self.nbytes -= page.nbytes


@dataclasses.dataclass
class Lookup:
  """Where a prompt's cached prefix lives: device pages (held by the lookup's caller while it
  restores) and host pages to restore, each with the first position it covers."""
  device: list[int]
  host: list[tuple[PageContent, int]]

  @property
  def host_keys(self) -> list[bytes]:
    return [item.key for item, _ in self.host]


@dataclasses.dataclass
class Restore:
  """Device pages just published for host pages; `apply` must write them before any read."""
  pages: list[int]
  host: list[tuple[PageContent, int]]


class TieredPrefixCache(PrefixCache):
  """PrefixCache whose evicted pages go to a HostTier and come back on a later prefix hit.

  Built on PrefixCache's public hooks alone: its eviction callback queues each evicted page for
  the host, `lookup` reads the device index while `locate` walks a prompt's chain, and
  `insert_cached` publishes restored pages under their old keys.
  """

  def __init__(self, num_pages: int, page_size: int, host: HostTier | None = None):
    super().__init__(num_pages, page_size, on_evict=None if host is None else self._queue_evicted)
    self.host = host
    self._evicted: list[CachedPage] = []

  def _queue_evicted(self, entry: CachedPage) -> None:
    if self.host.item(entry.content.key) != entry.content:  # else the host holds this content
      self._evicted.append(entry)

  def locate(self, tokens, *, namespace: str = "", session: str | None = None) -> Lookup:
    """Walk the prompt's prefix chain through both tiers (no side effects), as open_sequence
    will match it once the host pages are back: full pages, then the session's partial page."""
    toks, ps = as_tokens(tokens), self.page_size
    salt, parent = namespace_salt(namespace), ROOT_KEY
    found = Lookup([], [])

    def match(key: bytes, start: int) -> bool:
      # A full page holds page_size tokens, a partial page fewer: `follows` checks either.
      rest = toks[start:start + ps]
      if (entry := self.lookup(key)) is not None:
        if ok := entry.content.follows(parent, rest):
          found.device.append(entry.page)
        return ok
      item = None if self.host is None else self.host.item(key)
      if ok := item is not None and item.follows(parent, rest):
        found.host.append((item, start))
      return ok

    start = 0
    while start + ps <= len(toks) and match(key := page_key(salt, parent, toks[start:start + ps]), start):
      parent, start = key, start + ps
    if session is not None:
      match(session_key(salt, session), start)
    return found

  def demand(self, tokens, budget: int, *, namespace: str = "", session: str | None = None) -> int:
    """Pages that `open` takes from free + evictable ones (pages held by other sequences come
    free): an upper bound, exact but for the one page copied when the whole prompt is cached."""
    return self._demand(self.locate(tokens, namespace=namespace, session=session), len(tokens), budget)

  def open(self, tokens, budget: int, *, namespace: str = "",
           session: str | None = None) -> tuple[SequenceAlloc, Restore]:
    """open_sequence + reserve(budget), first restoring the prompt's host pages onto the device.

    Raises PoolExhausted, changing nothing, unless `demand` pages are free or evictable. The
    returned Restore must go through `apply` before the device reads its pages.
    """
    tokens = as_tokens(tokens)
    found = self.locate(tokens, namespace=namespace, session=session)
    need = self._demand(found, len(tokens), budget)
    if need > self.pool.num_free + self.pool.num_evictable:
      raise PoolExhausted(need, self.pool.num_free, self.pool.num_evictable)
    for page in found.device:  # so that allocating the restored pages cannot evict them
      self.pool.incref(page)
    pages = self.pool.allocate(len(found.host))
    for page, (item, _) in zip(pages, found.host):
      self.insert_cached(item, page, namespace=namespace, session=session)
    seq = self.open_sequence(tokens, namespace=namespace, session=session)
    self.reserve(seq, budget)
    for page in found.device + pages:
      self.pool.decref(page)
    return seq, Restore(pages, found.host)

  def apply(self, cache: KVCache, restore: Restore, data: list[jax.Array] | None = None) -> KVCache:
    """Bring the device cache up to date after `open`: copy the pages evicted meanwhile to the
    host, then write the restored pages (`data`: HostTier.fetch of their keys, staged ahead;
    fetched now when None). The restored pages are fetched first, so storing the evicted ones
    cannot push them out of the host tier; the gather of the evicted pages is dispatched before
    the insert, so it reads them before they are overwritten."""
    if restore.pages and data is None:
      data = self.host.fetch([item.key for item, _ in restore.host])
    self.flush(cache)
    if not restore.pages:
      return cache
    return cache.replace(layers=insert_pages(cache.layers, _padded(restore.pages, data[0].shape[0]), data))

  def flush(self, cache: KVCache) -> None:
    """Start copying the pages evicted since the last flush to the host; must run before any
    device write that may reuse them (the gather is dispatched first, so it reads them first)."""
    if not self._evicted:
      return
    pages = [e.page for e in self._evicted]
    self.host.put_batch([e.content for e in self._evicted],
                        extract_pages(cache.layers, _padded(pages, bucket_pow2(len(pages)))))
    self._evicted = []

  def _demand(self, found: Lookup, num_tokens: int, budget: int) -> int:
    held = sum(self.pool.refcount(p) > 0 for p in found.device)
    return self.pages_for(num_tokens + budget) + 1 - held
