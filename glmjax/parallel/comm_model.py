"""Communication model of TEP=N decode: the collectives of one step, as the code issues them, each
timed as latency + bytes / link bandwidth, added to a measured per-rank step time.

Collectives of one model pass over `tokens` tokens (expert_parallel.py's docstring; counted in the
compiled decode HLO by tests/test_multidevice_sharding.py):
- per decoder layer, 2 all-reduces of [tokens, hidden] in the compute dtype: after attention's
  row-parallel o_proj, and after the MLP (row-parallel down_proj) or the MoE (the shard_map psum);
- per pass, 1 all-reduce of [tokens, hidden] for the vocab-split embedding lookup, and greedy
  sampling over the vocab-split logits: 2 all-gathers of [tokens, N] (each device's best logit, fp32,
  and its index, int32).
A speculative step = one verification pass of the main model over draft_steps + 1 tokens per
sequence, plus draft_steps MTP passes of 1 token per sequence (the MTP layer is one decoder layer).
An MTP pass chooses its draft instead of sampling greedily (speculative._draft): 1 all-gather of
[tokens, N] fp32 (each device's best logit, glmjax.engine.sampling.top_k), 1 all-reduce of the
chosen index, int32 [tokens], and 3 all-reduces of [tokens] fp32 for the draft's confidence
(softmax's max and sum, then the largest probability; in the GLM-5 TEP=2 program compiled on
the CPU, XLA merged two of them).

Link, NVLink 4 on the H200: 900 GB/s per GPU, both directions together (NVIDIA H200 datasheet,
"NVLink: 900GB/s"), so 450 GB/s each way. A ring all-reduce sends and receives 2 (N-1)/N of the
message per GPU, an all-gather (N-1)/N of its result.
Latency per collective: an assumption, not measured here (no multi-GPU run yet). A small NCCL
all-reduce on 8 GPUs of one host takes about 8-15 us; one-shot custom all-reduce kernels (SGLang,
vLLM, TensorRT-LLM) reach about 5 us. Messages of a decode step are a few KB to ~100 KB, so the
latency, not the bandwidth, sets their time.
"""

import dataclasses

from glmjax.config import ModelConfig

NVLINK4_BANDWIDTH = 450e9  # B/s per direction per GPU (half of the datasheet's 900 GB/s)
DEFAULT_LATENCY = 10e-6    # s per collective (assumption, see the module docstring)


@dataclasses.dataclass(frozen=True)
class Link:
  bandwidth: float = NVLINK4_BANDWIDTH  # B/s, one direction, per GPU
  latency: float = DEFAULT_LATENCY      # s, fixed cost of one collective

  def __post_init__(self):
    if self.bandwidth <= 0 or self.latency < 0:
      raise ValueError(f"need bandwidth > 0 and latency >= 0, got {self.bandwidth}, {self.latency}")


@dataclasses.dataclass(frozen=True)
class Collective:
  """`count` identical collectives of one step; `nbytes` is the size of one result."""
  kind: str    # "all-reduce" | "all-gather"
  nbytes: int
  count: int
  where: str

  def seconds(self, tep: int, link: Link) -> float:
    """Time of one: latency + its transfer."""
    return link.latency + self.transfer_seconds(tep, link)

  def transfer_seconds(self, tep: int, link: Link) -> float:
    """The bytes each GPU sends (ring algorithm) at the link bandwidth."""
    share = (tep - 1) / tep * (2 if self.kind == "all-reduce" else 1)
    return share * self.nbytes / link.bandwidth


def pass_collectives(config: ModelConfig, *, tokens: int, layers: int, tep: int, act_bytes: int,
                     label: str, draft: bool = False) -> list[Collective]:
  """The collectives of one model pass over `tokens` tokens through `layers` decoder layers; a
  draft pass chooses a draft (module docstring) where the others sample greedily."""
  hidden = tokens * config.hidden_size * act_bytes
  choice = ([Collective("all-gather", tokens * tep * 4, 1, f"{label}: the draft's candidates (best logit a device)"),
             Collective("all-reduce", tokens * 4, 4, f"{label}: the draft's index and confidence (max, sum, max)")]
            if draft else [Collective("all-gather", tokens * tep * 4, 2, f"{label}: greedy sampling (max, argmax)")])
  return [
    Collective("all-reduce", hidden, 2 * layers, f"{label}: o_proj and MLP/MoE, 2 per layer"),
    Collective("all-reduce", hidden, 1, f"{label}: embedding lookup"),
    *choice,
  ]


def step_collectives(config: ModelConfig, *, tep: int, batch: int = 1, draft_steps: int = 0,
                     act_bytes: int = 2) -> list[Collective]:
  """Collectives of one decode step: the verification pass over draft_steps + 1 tokens per
  sequence, then draft_steps chained MTP passes (1 token per sequence each)."""
  if batch < 1 or draft_steps < 0 or tep < 1:
    raise ValueError(f"need batch >= 1, draft_steps >= 0, tep >= 1, got {batch}, {draft_steps}, {tep}")
  out = pass_collectives(config, tokens=batch * (draft_steps + 1), layers=config.num_hidden_layers,
                         tep=tep, act_bytes=act_bytes, label="verify")
  if draft_steps:
    out += [dataclasses.replace(c, count=c.count * draft_steps)
            for c in pass_collectives(config, tokens=batch, layers=1, tep=tep, act_bytes=act_bytes,
                                      label=f"{draft_steps} MTP draft passes", draft=True)]
  return out


def project(config: ModelConfig, *, rank_step_s: float, tep: int, link: Link, accept_length: float = 1.0,
            batch: int = 1, draft_steps: int = 0, act_bytes: int = 2) -> dict:
  """Projected TEP step: the per-rank step time (measured on one device, collectives excluded)
  plus the step's collectives, with no overlap between them; tokens/s per sequence at
  `accept_length` tokens emitted per step."""
  if rank_step_s <= 0:
    raise ValueError(f"rank_step_s must be positive, got {rank_step_s}")
  if not 1 <= accept_length <= draft_steps + 1:
    raise ValueError(f"accept_length {accept_length} must be in [1, draft_steps + 1 = {draft_steps + 1}]")
  collectives = step_collectives(config, tep=tep, batch=batch, draft_steps=draft_steps, act_bytes=act_bytes)
  comm = sum(c.count * c.seconds(tep, link) for c in collectives)
  step = rank_step_s + comm
  return dict(tep=tep, latency_us=link.latency * 1e6, bandwidth_gbs=link.bandwidth / 1e9,
              collectives=sum(c.count for c in collectives), comm_ms=comm * 1e3,
              rank_step_ms=rank_step_s * 1e3, step_ms=step * 1e3, accept_length=accept_length,
              tokens_per_s=accept_length / step, comm_share=comm / step,
              detail=[dataclasses.asdict(c) | dict(us_each=c.seconds(tep, link) * 1e6) for c in collectives])
