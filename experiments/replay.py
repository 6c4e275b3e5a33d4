"""The 13-round replay benchmark: prefix-cached multi-round decoding on one config.

  python -m experiments.replay --config=tiny --scale=200 --output=/tmp/replay.json
  python -m experiments.replay --config=mini --checkpoint=... --spec=mtp --num_draft=4

Prints a per-round table and a summary (measured prefix hit rate against the workload's
theoretical maximum) and writes JSON with per-round prompt/cached/prefilled tokens, time to first
token, decode tokens and tokens/s, the generated ids, and with --spec=mtp the acceptance length
(tokens per verify step), acceptance rate per draft position, verify steps, the average device step
(decode time / loop steps) and the host time to submit the decode program.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
from absl import app, flags
from tqdm import tqdm

from experiments import kernel_flags, study, write_json
from glmjax.engine.engine import Engine
from glmjax.engine.sampling import Sampling
from glmjax.engine.speculative import SpecConfig
from glmjax import parallel
from glmjax.data import load_corpus
from glmjax.runtime import ATTENTION_IMPLS, make_runtime
from glmjax.workload import WORKLOADS

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "tiny", "model config preset (configs/)")
flags.DEFINE_string("checkpoint", "", "HF checkpoint directory; random init when empty")
flags.DEFINE_enum("workload", "seed13", list(WORKLOADS), "replay workload")
flags.DEFINE_float("scale", 1.0, "divide every token count of the workload by this")
flags.DEFINE_integer("rounds", 0, "rounds to run (0: the workload's)")
flags.DEFINE_bool("prefix_cache", True, "reuse cached KV pages across rounds")
flags.DEFINE_enum("kv_dtype", "bf16", ["bf16", "fp32", "fp8"], "KV page storage")
flags.DEFINE_integer("page_size", 16, "tokens per KV page")
flags.DEFINE_integer("concurrency", 1, "conversations decoded together")
flags.DEFINE_integer("seed", 0, "PRNG seed (tokens and sampling)")
flags.DEFINE_enum("attention", "sparse", list(ATTENTION_IMPLS), "DSA attention implementation")
flags.DEFINE_string("index_share", "on", "on / off / an integer indexer frequency")
kernel_switches = kernel_flags.define()
flags.DEFINE_float("temperature", 0.0, "sampling temperature (0 = greedy)")
flags.DEFINE_enum("spec", "none", ["none", "mtp"], "speculative decoding with the MTP layer")
flags.DEFINE_integer("num_draft", 4, "MTP draft tokens per step (k; k + 1 verified)")
flags.DEFINE_integer("draft_branch", 1, "candidates per branching draft position (1 = chain)")
flags.DEFINE_integer("max_paths", 8, "cap on the draft tree's root-to-leaf paths")
flags.DEFINE_float("draft_threshold", 0.95, "stop drafting after a draft whose top probability is below this")
flags.DEFINE_bool("mtp_index_share", True, "later draft steps reuse the MTP indexer's step-0 top-k")
flags.DEFINE_float("acceptance_floor", 0.0, "single-token steps while the acceptance EMA is below this (0: never)")
flags.DEFINE_integer("probe_interval", 16, "single-token steps before drafting is probed again")
flags.DEFINE_integer("prefill_chunk", 512, "prefill chunk length")
flags.DEFINE_string("dtype", "bfloat16", "params and compute dtype")
flags.DEFINE_enum("text", "auto", ["auto", "random", "validation"],
                  "round inputs: random ids, or held-out stdlib text (glmjax.data); auto = text when the "
                  "checkpoint has a tokenizer.json")
flags.DEFINE_enum("weights", "bf16", ["bf16", "fp8", "nvfp4_experts", "nvfp4"],
                  "weight format: bf16, block FP8, NVFP4 routed experts, NVFP4 all linears but lm_head")
kernel_flags.define_matmul("xla")
flags.DEFINE_integer("tep", 1, "tensor-and-expert parallel degree (devices in the mesh)")
flags.DEFINE_string("coordinator_address", "", "multi-host: jax.distributed coordinator host:port")
flags.DEFINE_integer("num_processes", 1, "multi-host: number of processes")
flags.DEFINE_integer("process_id", 0, "multi-host: this process's id")
flags.DEFINE_string("output", "", "write the JSON report here")


def run(argv=None) -> dict:
  kernel_flags.apply_preset()
  if FLAGS.coordinator_address:
    parallel.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  dtype = jnp.dtype(FLAGS.dtype)
  policy = None if FLAGS.weights == "bf16" else FLAGS.weights
  config, params = study.load_params(FLAGS.config, FLAGS.checkpoint, dtype=dtype, policy=policy, seed=FLAGS.seed)
  work = WORKLOADS[FLAGS.workload].scaled(FLAGS.scale, FLAGS.rounds or None)
  index_share = FLAGS.index_share if FLAGS.index_share in ("on", "off") else int(FLAGS.index_share)
  runtime = make_runtime(config, attention=FLAGS.attention, index_share=index_share, matmul=FLAGS.matmul,
                         **kernel_switches())
  spec = None
  if FLAGS.spec == "mtp":
    spec = SpecConfig(num_draft=FLAGS.num_draft, branch=FLAGS.draft_branch, max_paths=FLAGS.max_paths,
                      threshold=FLAGS.draft_threshold, mtp_index_share=FLAGS.mtp_index_share,
                      acceptance_floor=FLAGS.acceptance_floor, probe_interval=FLAGS.probe_interval)
  draft = (spec or SpecConfig(num_draft=0)).shape
  longest = work.prompt_tokens(work.rounds - 1) + work.output_per_round + draft.num_draft
  pages_per_conv = -(-longest // FLAGS.page_size) + 1
  scratch = FLAGS.concurrency * (draft.paths - 1) * draft.span_pages(FLAGS.page_size)
  engine = Engine(config, params, runtime=runtime, num_pages=1 + FLAGS.concurrency * pages_per_conv * 2 + scratch,
                  page_size=FLAGS.page_size, max_batch=FLAGS.concurrency, max_seq_len=pages_per_conv * FLAGS.page_size,
                  kv_dtype=FLAGS.kv_dtype, prefix_cache=FLAGS.prefix_cache, prefill_chunk=FLAGS.prefill_chunk,
                  mtp_cache=spec is not None, mesh=parallel.make_mesh(FLAGS.tep) if FLAGS.tep > 1 else None)
  rng = np.random.default_rng(FLAGS.seed)
  sessions = [engine.open_session() for _ in range(FLAGS.concurrency)]
  if study.uses_text(FLAGS.text, FLAGS.checkpoint):
    corpus = load_corpus()
    inputs = [[corpus.sample_validation_text(rng, work.new_tokens(r)) for r in range(work.rounds)] for _ in sessions]
  else:
    inputs = [work.draw_tokens(rng, (2, config.vocab_size)) for _ in sessions]
  rounds = []
  for r in tqdm(range(work.rounds), desc="rounds"):
    stats = engine.run_round(sessions, [inp[r] for inp in inputs], work.output_per_round,
                             sampling=Sampling(FLAGS.temperature), seed=FLAGS.seed + r, ignore_eos=True,
                             spec=spec)
    for conv, st in enumerate(stats):
      rounds.append(dict(round=r, conversation=conv, prompt_tokens=st.prompt_tokens,
                         cached_tokens=st.cached_tokens, prefilled_tokens=st.prefilled_tokens,
                         ttft_s=st.ttft_s, decode_tokens=st.decode_tokens,
                         decode_tokens_per_s=st.decode_tokens_per_s, decode_steps=st.decode_steps,
                         step_s=st.step_s, dispatch_s=st.dispatch_s, verify_steps=st.verify_steps,
                         plain_steps=st.plain_steps, acceptance_length=st.acceptance_length,
                         acceptance_rate_per_position=st.acceptance_rate_per_position,
                         drafts_per_position=st.drafts_per_position, generated=st.output))
  prompt = sum(x["prompt_tokens"] for x in rounds)
  cached = sum(x["cached_tokens"] for x in rounds)
  theory = FLAGS.concurrency * sum(work.theoretical_max_hit_tokens(r) for r in range(work.rounds))
  later = [x for x in rounds if x["round"] > 0]
  verify = sum(x["verify_steps"] for x in rounds)
  drafted = np.sum([x["drafts_per_position"] for x in rounds], axis=0) if spec else np.zeros(0)
  accepted = np.sum([np.multiply(x["acceptance_rate_per_position"], x["drafts_per_position"]) for x in rounds],
                    axis=0) if spec else np.zeros(0)
  summary = dict(prompt_tokens=prompt, cached_tokens=cached, hit_rate=cached / prompt,
                 theoretical_max_hit_rate=theory / prompt,
                 decode_tokens_per_s=float(np.median([x["decode_tokens_per_s"] for x in rounds])),
                 ttft_round1_s=rounds[0]["ttft_s"],
                 ttft_later_median_s=float(np.median([x["ttft_s"] for x in later])) if later else None,
                 prefix_stats=dataclasses.asdict(engine.prefix.stats),
                 verify_steps=verify,
                 acceptance_length=sum(x["acceptance_length"] * x["verify_steps"]
                                       for x in rounds) / verify if verify else 0.0,
                 acceptance_rate_per_position=[float(a / d) if d else 0.0 for a, d in zip(accepted, drafted)],
                 step_s_median=float(np.median([x["step_s"] for x in rounds])),
                 dispatch_s_median=float(np.median([x["dispatch_s"] for x in rounds])))
  report = dict(flags={k: FLAGS[k].value for k in ("config", "checkpoint", "workload", "scale", "rounds",
                                                    "prefix_cache", "kv_dtype", "page_size", "concurrency",
                                                    "seed", "attention", "index_share", "temperature", "spec",
                                                    "num_draft", "draft_branch", "max_paths", "draft_threshold",
                                                    "mtp_index_share", "acceptance_floor", "probe_interval",
                                                    "weights", "matmul", "tep", "text")},
                workload=dataclasses.asdict(work), rounds=rounds, summary=summary)
  print(f"\n{'round':>5} {'conv':>4} {'prompt':>8} {'cached':>8} {'prefill':>8} {'ttft ms':>9} {'decode':>7}"
        f" {'tok/s':>9} {'step ms':>8} {'accept':>7}")
  for x in rounds:
    print(f"{x['round']:>5} {x['conversation']:>4} {x['prompt_tokens']:>8} {x['cached_tokens']:>8} "
          f"{x['prefilled_tokens']:>8} {x['ttft_s'] * 1e3:>9.1f} {x['decode_tokens']:>7}"
          f" {x['decode_tokens_per_s']:>9.1f} {x['step_s'] * 1e3:>8.2f} {x['acceptance_length']:>7.2f}")
  print(f"\nprefix hit rate {summary['hit_rate']:.2%} (theoretical max {summary['theoretical_max_hit_rate']:.2%}); "
        f"median decode {summary['decode_tokens_per_s']:.1f} tok/s; "
        f"TTFT round 1 {summary['ttft_round1_s'] * 1e3:.0f} ms, "
        f"later rounds median {(summary['ttft_later_median_s'] or 0) * 1e3:.0f} ms")
  if spec:
    print(f"MTP: acceptance length {summary['acceptance_length']:.2f} tokens per verify step over "
          f"{verify} steps; per position {', '.join(f'{a:.2f}' for a in summary['acceptance_rate_per_position'])}; "
          f"median step {summary['step_s_median'] * 1e3:.2f} ms, submit {summary['dispatch_s_median'] * 1e3:.2f} ms")
  write_json(FLAGS.output, report)
  return report


def main(argv):
  run(argv)


if __name__ == "__main__":
  app.run(main)
