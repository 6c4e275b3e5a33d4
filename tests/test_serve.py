"""Serving many requests: memory-safe admission, priorities, exact outputs, the host KV tier.

Most tests share one geometry (fp32 pages of 4 tokens, 24 usable, 2 slots, chunks of 8), so the
four step programs ([1|2, 1|8]) compile once for the file.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glmjax
from glmjax.cache.paged import init_cache
from glmjax.cache.prefix_cache import ROOT_KEY, PageContent, namespace_salt, page_key
from glmjax.serve.host_tier import HostTier
from glmjax.serve.scheduler import Request, Scheduler
from glmjax.serve.trace import OneShot, Trace, make_trace, replay, summarize
from glmjax.workload import Workload

PAGE = 4


def make(fixture, **kw) -> Scheduler:
  config, params = fixture
  kw = dict(dict(num_pages=25, max_batch=2, kv_dtype="fp32", prefill_chunk=8, token_budget=12), **kw)
  return Scheduler(config, params, page_size=PAGE, max_seq_len=64, ignore_eos=True, **kw)


def alone(fixture, prompt, max_new) -> list[int]:
  config, params = fixture
  return glmjax.generate(config, params, np.asarray([prompt]), max_new, ignore_eos=True,
                         page_size=PAGE)[0, -max_new:].tolist()


def page_bytes(config, kv_dtype="fp32") -> int:
  cache = init_cache(config, num_pages=2, page_size=PAGE, batch=1, max_pages=1, kv_dtype=kv_dtype)
  return sum(a.nbytes // 2 for a in jax.tree.leaves(cache.layers))


def host_arrays(rng, n):
  """A batch of n fake pages in two leaves of different dtypes."""
  return [jnp.asarray(rng.standard_normal((n, PAGE, 8)), jnp.float32),
          jnp.asarray(rng.standard_normal((n, PAGE, 2)), jnp.bfloat16)]


@pytest.mark.parametrize("seed", [3, 4])
def test_full_host_tier_evicts_by_lru2_and_never_drops_a_pinned_page(seed):
  rng = np.random.default_rng(seed)
  items = [PageContent(bytes([i]) * 32, ROOT_KEY, tuple(range(i, i + PAGE))) for i in range(6)]
  a, b, c, d, e, f = (it.key for it in items)
  arrays = host_arrays(rng, 6)
  host = HostTier(3 * sum(x.nbytes // 6 for x in arrays))
  host.put_batch(items[:3], [x[:3] for x in arrays])
  back = host.fetch([a, c])                      # A and C: two accesses each, B: one
  for got, want in zip(back, arrays):
    np.testing.assert_array_equal(np.asarray(got[:2]), np.asarray(want[np.array([0, 2])]))
  host.pin([a, c])
  host.put_batch(items[3:4], [x[3:4] for x in arrays])   # B (the only unpinned page) goes
  assert host.keys() == {a, c, d}
  host.put_batch(items[4:5], [x[4:5] for x in arrays])   # D goes; pinned A and C never do
  assert host.keys() == {a, c, e} and host.stats.evicted_pages == 2
  host.pin([e])
  host.put_batch(items[5:6], [x[5:6] for x in arrays])   # everything pinned: F is refused
  assert host.keys() == {a, c, e} and host.stats.refused_pages == 1
  host.unpin([a, c, e])
  host.fetch([e])                                 # E: two accesses, later than A's and C's
  host.put_batch(items[5:6], [x[5:6] for x in arrays])   # LRU-2: the oldest second-last access
  assert host.keys() == {c, e, f}
  back = host.fetch([c, e, f])
  for got, want in zip(back, arrays):
    np.testing.assert_array_equal(np.asarray(got[:3]), np.asarray(want[np.array([2, 4, 5])]))
  with pytest.raises(ValueError, match="not pinned"):
    host.unpin([c])


@pytest.mark.parametrize("host_pages", [0, 6])
def test_no_admitted_request_fails_for_lack_of_pages(fixture_fp32, host_pages):
  """A burst of requests (some sharing a prefix, both classes) through a pool that rarely holds
  two of them: admission waits for room and preempts, no step ever runs out of pages."""
  rng = np.random.default_rng(host_pages)
  shared = rng.integers(2, 512, 12).tolist()
  shots = []
  for i in range(14):
    prompt = (shared if i % 3 == 0 else []) + rng.integers(2, 512, int(rng.integers(18, 40))).tolist()
    shots.append(OneShot(f"q{i}", float(rng.exponential(1.0) * i), tuple(prompt[:48]),
                         int(rng.integers(1, 16)), "interactive" if i % 4 == 1 else "batch"))
  host = HostTier(host_pages * page_bytes(fixture_fp32[0])) if host_pages else None  # it fills too
  sched = make(fixture_fp32, host_tier=host)
  done = replay(sched, Trace((), tuple(shots)))
  assert sorted(r.id for r in done) == sorted(s.id for s in shots)
  assert all(len(r.output) == r.max_new_tokens for r in done)
  pool = sched.prefix.pool
  assert pool.num_free + pool.num_evictable == pool.usable          # every page given back
  # The pool, not only the slots, held requests back, and preemption happened.
  assert sum(t["waits_for"] == "pages" for t in sched.timeline) >= 3
  assert sum(r.preemptions for r in done) > 0 and sched.prefix.stats.evictions > 0
  if host:
    assert host.stats.evicted_pages > 0 and all(host.pins(k) == 0 for k in host.keys())


@pytest.mark.parametrize("priority", [True, False])
def test_interactive_request_behind_batch_work_gets_its_first_token_first(fixture_fp32, priority):
  """Three long batch prompts arrive at 0, an interactive one at 1. With priorities it preempts
  the newest batch request and is served first; strictly by arrival it waits. Either way every
  output equals the request run alone (the preempted one resumes from its released pages)."""
  rng = np.random.default_rng(7)
  prompts = [rng.integers(2, 512, 40).tolist() for _ in range(4)]
  shots = [OneShot(f"b{i}", 0.0, tuple(p), 4, "batch") for i, p in enumerate(prompts[:3])]
  shots.append(OneShot("i0", 1.0, tuple(prompts[3]), 4, "interactive"))
  sched = make(fixture_fp32, priority=priority)
  done = {r.id: r for r in replay(sched, Trace((), tuple(shots)))}
  first_batch = min(done[f"b{i}"].first_token for i in range(3))
  if priority:
    assert done["i0"].first_token < first_batch
    assert done["b1"].preemptions == 1 and done["b1"].device_hit_tokens >= PAGE
  else:
    assert done["i0"].first_token > first_batch
    assert sum(r.preemptions for r in done.values()) == 0
  assert {t["batch"] for t in sched.timeline} == {1, 2}               # the batch follows the load
  for shot in shots:
    assert done[shot.id].output == alone(fixture_fp32, list(shot.prompt), 4), shot.id


@pytest.mark.parametrize("kv_dtype,compression,staged", [
    ("bf16", "none", True), ("bf16", "zlib", False), ("fp8", "zlib", True), ("fp8", "none", False)])
def test_restored_pages_give_exactly_the_logits_of_pages_never_evicted(fixture_fp32, kv_dtype, compression,
                                                                       staged):
  """A prefix is cached, two fillers push it out of a 16-page pool into the host tier, and a
  request extending it is served from the restored pages (fetched while a filler runs when
  `staged`): its first-token logits equal those of the same request whose pages never left."""
  rng = np.random.default_rng(11)
  prefix, tail = rng.integers(2, 512, 16).tolist(), rng.integers(2, 512, 5).tolist()
  fillers = [rng.integers(2, 512, 48).tolist() for _ in range(2)]
  logits = {}
  for evict in (False, True):
    host = HostTier(10**6, compression=compression)
    sched = make(fixture_fp32, num_pages=17, kv_dtype=kv_dtype, host_tier=host, record_logits=True)
    first = Request("p", prefix, 1)
    sched.submit(first)
    while not sched.idle:
      sched.step()
    if evict:
      for i, filler in enumerate(fillers):
        sched.submit(Request(f"f{i}", filler, 1))
        if i == 0 or not staged:
          while not sched.idle:
            sched.step()
    hit = Request("hit", prefix + tail, 1, arrival=sched.clock.now())
    sched.submit(hit)
    while not sched.idle:
      sched.step()
    logits[evict] = hit.first_logits
    if evict:
      assert hit.host_hit_tokens == len(prefix) and hit.device_hit_tokens == 0
      assert (hit.admitted > hit.arrival) == staged            # waited behind the filler
      key = page_key(namespace_salt(""), ROOT_KEY, prefix[:PAGE])
      assert key in host and host.pins(key) == 0
    else:
      assert hit.device_hit_tokens == len(prefix) and hit.host_hit_tokens == 0
  np.testing.assert_array_equal(logits[True], logits[False])


def test_host_tier_raises_hit_rate_and_lowers_ttft_for_conversations(fixture_fp32):
  """Eight 4-round conversations whose KV (about 8 x 15 pages) far exceeds the 24-page pool,
  replayed twice from the same configuration: eviction only, then with a host tier. Either way
  every round's output equals the round run alone, whether its prefix was recomputed, kept on
  the device or restored from the host (full pages and the session's partial page)."""
  trace = make_trace(vocab=(2, 512), conversations=8, workload=Workload(4, 24, 6, 4), think_time=12.0,
                     num_one_shots=0, seed=5)
  results, expected = {}, {}
  for host in (None, HostTier(10**7)):
    sched = make(fixture_fp32, host_tier=host)
    done = replay(sched, trace)
    for r in done:
      key = tuple(r.prompt)
      if key not in expected:   # both runs see the same prompts as long as the outputs agree
        expected[key] = alone(fixture_fp32, r.prompt, r.max_new_tokens)
      assert r.output == expected[key], (host is not None, r.id)
    results[host is not None] = summarize(done), sched
  (off, _), (on, sched) = results[False], results[True]
  assert off["hit_rate_host"] == 0 and on["hit_rate_host"] > 0
  assert on["hit_rate_device"] + on["hit_rate_host"] > off["hit_rate_device"] + 0.1
  assert on["all"]["ttft_mean"] < off["all"]["ttft_mean"]
  assert sched.prefix.host.stats.fetched_pages > 0
  # Nothing a conversation computed is lost: a later round recomputes only its new tokens and
  # the previous round's last output (the session's partial page comes back from the host too).
  for r in sched.finished:
    if not r.id.endswith("/r0"):
      assert r.lookup_tokens - r.device_hit_tokens - r.host_hit_tokens == 6 + 1, r.id



def test_compile_programs_changes_nothing(fixture_fp32):
  """Scheduler.compile_programs (run before serving so that no TTFT includes a compile) leaves
  every page but the null one (padding's write target, never read) bit for bit as it was, and the
  replay after it gives every request its alone output."""
  sched = make(fixture_fp32, host_tier=HostTier(10**7))
  before = [np.asarray(a) for a in jax.tree.leaves(sched.cache.layers)]
  sched.compile_programs()
  for a, b in zip(before, jax.tree.leaves(sched.cache.layers), strict=True):
    np.testing.assert_array_equal(a[1:], np.asarray(b)[1:])
  trace = make_trace(vocab=(2, 512), conversations=3, workload=Workload(3, 24, 6, 4), think_time=12.0,
                     num_one_shots=2, seed=7)
  done = replay(sched, trace)
  assert sched.prefix.host.stats.fetched_pages > 0
  for r in done:
    assert r.output == alone(fixture_fp32, r.prompt, r.max_new_tokens), r.id


def test_wall_clock_starts_at_its_first_reading():
  """Time spent between building a scheduler and serving (compiling its programs) is not
  counted into any request's arrival or TTFT; skipped idle time is."""
  import time
  from glmjax.serve.scheduler import WallClock
  clock = WallClock()
  time.sleep(0.05)
  assert clock.now() < 0.04
  clock.skip_to(5.0)
  assert 5.0 <= clock.now() < 5.04
