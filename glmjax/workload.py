"""The seed's 13-round agentic replay: one long first prompt, then short appends per round.

Defaults (NOTES.md): 13 rounds, a first prompt of 72,842 tokens, 973 new input tokens and about
220 output tokens per round, so that with outputs reused from cache the rounds read 1.04M input
tokens of which about 92% come from the cache. `scale` divides every token count (for the CPU)
and keeps the structure.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Workload:
  rounds: int = 13
  first_prompt: int = 72_842
  new_per_round: int = 973
  output_per_round: int = 220

  def scaled(self, scale: float, rounds: int | None = None) -> "Workload":
    if scale <= 0:
      raise ValueError(f"scale must be positive, got {scale}")
    shrink = lambda n: max(1, round(n / scale))
    return Workload(rounds or self.rounds, shrink(self.first_prompt), shrink(self.new_per_round),
                    shrink(self.output_per_round))

  def new_tokens(self, round_index: int) -> int:
    return self.first_prompt if round_index == 0 else self.new_per_round

  def prompt_tokens(self, round_index: int) -> int:
    """Context length of a round: all earlier inputs and outputs plus this round's new tokens."""
    return self.first_prompt + round_index * (self.new_per_round + self.output_per_round)

  def theoretical_max_hit_tokens(self, round_index: int) -> int:
    """Tokens of a round's prompt whose KV an earlier round computed: all but the new tokens and
    the previous round's last output (sampled, never fed through the model)."""
    return 0 if round_index == 0 else self.prompt_tokens(round_index) - self.new_per_round - 1

  def draw_tokens(self, rng: np.random.Generator, vocab: tuple[int, int]) -> list[list[int]]:
    """Random new-token lists per round, ids in [vocab[0], vocab[1])."""
    return [rng.integers(vocab[0], vocab[1], self.new_tokens(r)).tolist() for r in range(self.rounds)]


WORKLOADS = {"seed13": Workload()}
