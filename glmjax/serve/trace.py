"""Serving traces and their replay: concurrent multi-round conversations plus one-shot requests.

A conversation has the seed13 shape (glmjax.workload: a long first prompt, then short appends per
round, `scale` dividing every count); a user thinks between rounds, so round r + 1 arrives a
think time after round r finished, its prompt the whole history (inputs and outputs) plus new
tokens. Short single-turn requests arrive as a Poisson stream. Times are in the clock's units
(steps for StepClock, seconds for WallClock).
"""

import dataclasses
import heapq
import itertools

import numpy as np

from glmjax.serve.scheduler import Request, Scheduler
from glmjax.workload import Workload


@dataclasses.dataclass(frozen=True)
class Conversation:
  session: str
  start: float                          # arrival of round 0
  rounds: tuple[tuple[int, ...], ...]   # new input tokens of each round
  think: tuple[float, ...]              # pause before round r + 1 after round r finished
  max_new_tokens: int
  priority: str


@dataclasses.dataclass(frozen=True)
class OneShot:
  id: str
  arrival: float
  prompt: tuple[int, ...]
  max_new_tokens: int
  priority: str


@dataclasses.dataclass(frozen=True)
class Trace:
  conversations: tuple[Conversation, ...]
  one_shots: tuple[OneShot, ...]


def make_trace(*, vocab: tuple[int, int], conversations: int = 8, workload: Workload = Workload(),
               scale: float = 1.0, rounds: int | None = None, think_time: float = 20.0,
               arrival_rate: float = 0.05, num_one_shots: int = 16, one_shot_prompt: int = 32,
               one_shot_new: int = 8, conversation_priority: str = "batch",
               one_shot_priority: str = "interactive", seed: int = 0) -> Trace:
  """Random trace: conversations start uniformly over one think time, think times are
  exponential (mean think_time), one-shots arrive at `arrival_rate` per unit with prompt lengths
  uniform in [one_shot_prompt / 2, 3 one_shot_prompt / 2]. Token ids are drawn from [vocab)."""
  if conversations < 0 or num_one_shots < 0 or think_time < 0 or arrival_rate <= 0:
    raise ValueError(f"need conversations >= 0 ({conversations}), num_one_shots >= 0 ({num_one_shots}), "
                     f"think_time >= 0 ({think_time}), arrival_rate > 0 ({arrival_rate})")
  rng = np.random.default_rng(seed)
  work = workload.scaled(scale, rounds)
  convs = tuple(
      Conversation(session=f"c{i}", start=float(rng.uniform(0, think_time)),
                   rounds=tuple(map(tuple, work.draw_tokens(rng, vocab))),
                   think=tuple(rng.exponential(think_time, work.rounds - 1).tolist()),
                   max_new_tokens=work.output_per_round, priority=conversation_priority)
      for i in range(conversations))
  arrivals = np.cumsum(rng.exponential(1 / arrival_rate, num_one_shots))
  lo, hi = max(1, one_shot_prompt // 2), max(1, one_shot_prompt * 3 // 2)
  shots = tuple(
      OneShot(id=f"q{i}", arrival=float(t), prompt=tuple(rng.integers(*vocab, rng.integers(lo, hi + 1)).tolist()),
              max_new_tokens=one_shot_new, priority=one_shot_priority)
      for i, t in enumerate(arrivals))
  return Trace(convs, shots)


def replay(scheduler: Scheduler, trace: Trace) -> list[Request]:
  """Feed the trace to the scheduler on its clock until every request has finished."""
  clock, serial = scheduler.clock, itertools.count()
  arrivals: list[tuple[float, int, Request]] = []
  rounds: dict[str, tuple[Conversation, int]] = {}

  def arrive(req: Request) -> None:
    heapq.heappush(arrivals, (req.arrival, next(serial), req))

  def conversation_round(conv: Conversation, r: int, history: list[int], t: float) -> None:
    req = Request(f"{conv.session}/r{r}", history + list(conv.rounds[r]), conv.max_new_tokens,
                  conv.priority, t, session=conv.session)
    rounds[req.id] = conv, r
    arrive(req)

  for conv in trace.conversations:
    conversation_round(conv, 0, [], conv.start)
  for shot in trace.one_shots:
    arrive(Request(shot.id, list(shot.prompt), shot.max_new_tokens, shot.priority, shot.arrival))
  while arrivals or not scheduler.idle:
    while arrivals and arrivals[0][0] <= clock.now():
      scheduler.submit(heapq.heappop(arrivals)[2])
    if scheduler.idle:
      clock.skip_to(arrivals[0][0])
      continue
    for req in scheduler.step():
      conv, r = rounds.get(req.id, (None, 0))
      if conv is not None and r + 1 < len(conv.rounds):
        conversation_round(conv, r + 1, req.prompt + req.output, clock.now() + conv.think[r])
  return scheduler.finished


def summarize(requests: list[Request]) -> dict:
  """Latency by priority class and prefix hits by tier (fractions of looked-up context tokens)."""
  looked = sum(r.lookup_tokens for r in requests)
  device = sum(r.device_hit_tokens for r in requests)
  host = sum(r.host_hit_tokens for r in requests)
  out = dict(requests=len(requests), lookup_tokens=looked,
             hit_rate_device=device / looked if looked else 0.0, hit_rate_host=host / looked if looked else 0.0,
             miss_rate=(looked - device - host) / looked if looked else 0.0,
             preemptions=sum(r.preemptions for r in requests))
  for name, group in [("all", requests)] + [(p, [r for r in requests if r.priority == p])
                                            for p in sorted({r.priority for r in requests})]:
    if group:
      ttft = np.array([r.ttft for r in group])
      out[name] = dict(n=len(group), ttft_mean=float(ttft.mean()), ttft_p50=float(np.median(ttft)),
                       ttft_p90=float(np.percentile(ttft, 90)),
                       queue_delay_mean=float(np.mean([r.queue_delay for r in group])),
                       time_per_output_token_mean=float(np.mean([r.time_per_output_token for r in group])))
  return out
