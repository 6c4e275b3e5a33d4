"""Many requests at once: concurrent 13-round conversations plus a Poisson stream of one-shots
through the continuous-batching scheduler, with or without a host tier for evicted KV pages.

  python -m experiments.serve_replay --config=tiny --scale=100 --conversations=8 --num_pages=256 \\
      --host_tier_gb=0.01 --output=/tmp/serve.json    # --host_tier_gb=0: evicted pages are dropped

Prints a per-request table (queueing delay, TTFT, time per output token, prefix tokens served by
the device / host tier / recomputed) and a summary per priority class; writes the JSON report
and, beside it, a PNG of device and host pool occupancy over time. Times are in steps with
--clock=steps (deterministic), in seconds with --clock=wall.
"""

import dataclasses
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags

import glmjax
from configs import get_model_config
from glmjax.engine.sampling import Sampling
from glmjax.model import init_params
from glmjax.runtime import ATTENTION_IMPLS, make_runtime
from glmjax.serve.host_tier import COMPRESSIONS, HostTier
from glmjax.serve.scheduler import PRIORITIES, Scheduler, StepClock, WallClock
from glmjax.serve.trace import make_trace, replay, summarize
from glmjax.workload import WORKLOADS

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "tiny", "model config preset (configs/)")
flags.DEFINE_string("checkpoint", "", "HF checkpoint directory; random init when empty")
flags.DEFINE_string("dtype", "bfloat16", "params and compute dtype")
flags.DEFINE_enum("attention", "sparse", list(ATTENTION_IMPLS), "DSA attention implementation")
flags.DEFINE_enum("workload", "seed13", list(WORKLOADS), "conversation shape")
flags.DEFINE_float("scale", 100.0, "divide every token count of the conversation workload by this")
flags.DEFINE_integer("rounds", 0, "rounds per conversation (0: the workload's)")
flags.DEFINE_integer("conversations", 8, "concurrent multi-round conversations")
flags.DEFINE_float("think_time", 30.0, "mean pause between a conversation's rounds (clock units)")
flags.DEFINE_integer("one_shots", 16, "short single-turn requests")
flags.DEFINE_float("arrival_rate", 0.05, "one-shot arrivals per clock unit (Poisson)")
flags.DEFINE_integer("one_shot_prompt", 64, "mean one-shot prompt length")
flags.DEFINE_integer("one_shot_new", 16, "one-shot output tokens")
flags.DEFINE_enum("conversation_priority", "batch", list(PRIORITIES), "class of conversation rounds")
flags.DEFINE_enum("one_shot_priority", "interactive", list(PRIORITIES), "class of one-shots")
flags.DEFINE_enum("priority", "on", ["on", "off"], "serve by class then arrival (on) or by arrival only")
flags.DEFINE_integer("max_batch", 4, "most requests served at once")
flags.DEFINE_integer("token_budget", 256, "real tokens per step, all rows together")
flags.DEFINE_integer("prefill_chunk", 64, "widest prefill row of a step")
flags.DEFINE_integer("page_size", 16, "tokens per KV page")
flags.DEFINE_integer("num_pages", 256, "device KV pages (page 0 is the null page)")
flags.DEFINE_enum("kv_dtype", "bf16", ["bf16", "fp32", "fp8"], "KV page storage")
flags.DEFINE_float("host_tier_gb", 0.0, "host memory for evicted pages (0: evicted pages are dropped)")
flags.DEFINE_enum("host_compression", "none", list(COMPRESSIONS), "compress pages held on the host")
flags.DEFINE_enum("clock", "steps", ["steps", "wall"], "time unit: model steps or seconds")
flags.DEFINE_bool("warmup", False, "compile every program serving can call before the replay "
                  "(Scheduler.compile_programs; use with --clock=wall: else TTFT counts XLA compiles)")
flags.DEFINE_float("temperature", 0.0, "sampling temperature (0 = greedy)")
flags.DEFINE_integer("seed", 0, "PRNG seed (trace, params, sampling)")
flags.DEFINE_string("output", "", "write the JSON report here (and the occupancy plot beside it, .png)")


def plot(timeline: list[dict], path: pathlib.Path, unit: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  t = [x["time"] for x in timeline]
  fig, (dev, host, load) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
  # Step-wise: the clock skips idle gaps, which straight segments would draw as ramps.
  dev.stackplot(t, [x["device_held"] for x in timeline], [x["device_cached"] for x in timeline],
                [x["device_free"] for x in timeline], labels=["held", "cached (evictable)", "free"], step="post")
  dev.set_ylabel("device pages")
  dev.legend(loc="upper right")
  host.plot(t, [x["host_pages"] for x in timeline], drawstyle="steps-post")
  host.set_ylabel("host pages")
  load.plot(t, [x["running"] for x in timeline], label="running", drawstyle="steps-post")
  load.plot(t, [x["waiting"] for x in timeline], label="waiting", drawstyle="steps-post")
  load.set_ylabel("requests")
  load.set_xlabel(unit)
  load.legend(loc="upper right")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def run(argv=None) -> dict:
  config = get_model_config(FLAGS.config)
  dtype = jnp.dtype(FLAGS.dtype)
  if FLAGS.checkpoint:
    config, params = glmjax.load_pretrained(FLAGS.checkpoint, dtype=dtype)
  else:
    params = init_params(config, jax.random.key(FLAGS.seed), param_dtype=dtype)
  trace = make_trace(vocab=(2, config.vocab_size), conversations=FLAGS.conversations,
                     workload=WORKLOADS[FLAGS.workload], scale=FLAGS.scale, rounds=FLAGS.rounds or None,
                     think_time=FLAGS.think_time, arrival_rate=FLAGS.arrival_rate,
                     num_one_shots=FLAGS.one_shots, one_shot_prompt=FLAGS.one_shot_prompt,
                     one_shot_new=FLAGS.one_shot_new, conversation_priority=FLAGS.conversation_priority,
                     one_shot_priority=FLAGS.one_shot_priority, seed=FLAGS.seed)
  longest = max([sum(map(len, c.rounds)) + len(c.rounds) * c.max_new_tokens for c in trace.conversations] +
                [len(s.prompt) + s.max_new_tokens for s in trace.one_shots])
  host = (HostTier(int(FLAGS.host_tier_gb * 2**30), compression=FLAGS.host_compression)
          if FLAGS.host_tier_gb > 0 else None)
  clock = StepClock() if FLAGS.clock == "steps" else WallClock()
  sched = Scheduler(config, params, num_pages=FLAGS.num_pages, page_size=FLAGS.page_size,
                    max_batch=FLAGS.max_batch, max_seq_len=-(-longest // FLAGS.page_size) * FLAGS.page_size,
                    kv_dtype=FLAGS.kv_dtype, prefill_chunk=FLAGS.prefill_chunk, token_budget=FLAGS.token_budget,
                    priority=FLAGS.priority == "on", host_tier=host,
                    runtime=make_runtime(config, attention=FLAGS.attention),
                    sampling=Sampling(FLAGS.temperature), seed=FLAGS.seed, ignore_eos=True, clock=clock)
  if FLAGS.warmup:
    sched.compile_programs()
  elif FLAGS.clock == "wall":
    print("note: --clock=wall without --warmup: the first requests' TTFT includes XLA compiles", flush=True)
  start = time.perf_counter()
  done = replay(sched, trace)
  wall_s = time.perf_counter() - start
  unit = "steps" if FLAGS.clock == "steps" else "s"

  requests = [dict(id=r.id, priority=r.priority, prompt_tokens=len(r.prompt), output_tokens=len(r.output),
                   device_hit_tokens=r.device_hit_tokens, host_hit_tokens=r.host_hit_tokens,
                   miss_tokens=r.lookup_tokens - r.device_hit_tokens - r.host_hit_tokens,
                   arrival=r.arrival, queue_delay=r.queue_delay, ttft=r.ttft,
                   time_per_output_token=r.time_per_output_token, preemptions=r.preemptions)
              for r in sorted(done, key=lambda r: r.arrival)]
  summary = dict(summarize(done), unit=unit, steps=sched.steps, wall_s=wall_s,
                 prefix_stats=dataclasses.asdict(sched.prefix.stats))
  if host is not None:
    hs = host.stats
    summary["host"] = dict(dataclasses.asdict(hs), capacity_bytes=host.capacity_bytes, held_bytes=host.nbytes,
                           compression_ratio=hs.raw_bytes / hs.stored_bytes if hs.stored_bytes else None)

  print(f"\n{'request':>10} {'class':>11} {'prompt':>7} {'out':>5} {'device':>7} {'host':>6} {'miss':>6} "
        f"{'queue':>7} {'ttft':>7} {'tpot':>6} {'pre':>3}")
  for x in requests:
    print(f"{x['id']:>10} {x['priority']:>11} {x['prompt_tokens']:>7} {x['output_tokens']:>5} "
          f"{x['device_hit_tokens']:>7} {x['host_hit_tokens']:>6} {x['miss_tokens']:>6} {x['queue_delay']:>7.3g} "
          f"{x['ttft']:>7.3g} {x['time_per_output_token']:>6.3g} {x['preemptions']:>3}")
  print(f"\n{len(done)} requests in {sched.steps} steps ({wall_s:.1f} s); prefix tokens from device "
        f"{summary['hit_rate_device']:.1%}, host {summary['hit_rate_host']:.1%}, "
        f"recomputed {summary['miss_rate']:.1%}; {summary['preemptions']} preemptions")
  for name in ("all",) + PRIORITIES:
    if name in summary:
      s = summary[name]
      print(f"{name:>11}: n={s['n']} TTFT mean {s['ttft_mean']:.3g} p50 {s['ttft_p50']:.3g} p90 {s['ttft_p90']:.3g} "
            f"{unit}; queue {s['queue_delay_mean']:.3g}; per output token {s['time_per_output_token_mean']:.3g}")
  if host is not None:
    h = summary["host"]
    print(f"host tier: {h['stored_pages']} pages stored ({h['raw_bytes'] / 2**20:.1f} MiB raw, "
          f"{h['stored_bytes'] / 2**20:.1f} MiB held, compress {h['compress_s'] * 1e3:.0f} ms, "
          f"decompress {h['decompress_s'] * 1e3:.0f} ms), {h['fetched_pages']} restored, "
          f"{h['evicted_pages']} evicted, {h['refused_pages']} refused")

  report = dict(flags={f.name: f.value for f in FLAGS.get_flags_for_module(sys.modules[__name__])},
                summary=summary, requests=requests, timeline=sched.timeline)
  if FLAGS.output:
    out = pathlib.Path(FLAGS.output)
    out.write_text(json.dumps(report, indent=1))
    plot(sched.timeline, out.with_suffix(".png"), unit)
  return report


def main(argv):
  run(argv)


if __name__ == "__main__":
  app.run(main)
