"""The jitted device programs: a prefill chunk, and a whole decode run as one `lax.while_loop`.

Both take params and the KVCache explicitly and return the new cache; the cache argument is
donated, so XLA updates the pages in place. The decode loop samples, appends and stops on device
(max tokens or EOS per sequence), so the host does not synchronise per token.

Loops are data (`LoopProgram`: init, cond and body built from the arguments) so that one body
runs two ways (`LoopCall.run`): as one `lax.while_loop` program (device_loop=True), or as the classic
host-driven baseline the device loop is measured against (device_loop=False): one jitted call of
the same body per step, the host reading the stop condition after each.
"""

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from glmjax.cache.paged import KVCache
from glmjax.config import ModelConfig
from glmjax.engine.sampling import Sampling, sample
from glmjax.model import CausalLM
from glmjax.runtime import Runtime


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """Everything static about the compiled steps (hashable: a jit static argument)."""
  config: ModelConfig
  runtime: Runtime
  dtype: str = "bfloat16"

  @property
  def model(self) -> CausalLM:
    dt = jnp.dtype(self.dtype)
    return CausalLM(self.config, dtype=dt, param_dtype=dt)


@dataclasses.dataclass(frozen=True)
class LoopProgram:
  """A while loop as a jit static argument: `build(consts, **static)` returns (init, cond, body)
  with init(carry) -> state, cond(state) -> bool scalar, body(state) -> state; `result(state)`
  picks the outputs. Both functions are module-level and `static` holds hashable (name, value)
  pairs, so equal programs share their compiled code."""
  build: Callable[..., tuple[Callable, Callable, Callable]]
  result: Callable[[Any], Any]
  static: tuple[tuple[str, Any], ...]

  @classmethod
  def of(cls, build: Callable, result: Callable, **static) -> "LoopProgram":
    return cls(build, result, tuple(sorted(static.items())))

  def parts(self, consts) -> tuple[Callable, Callable, Callable]:
    return self.build(consts, **dict(self.static))


@functools.partial(jax.jit, static_argnames=("program",), donate_argnames=("carry",))
def _device_loop(carry, consts, *, program: LoopProgram):
  init, cond, body = program.parts(consts)
  return jax.lax.while_loop(cond, body, init(carry))


@functools.partial(jax.jit, static_argnames=("program",), donate_argnames=("carry",))
def _host_init(carry, consts, *, program: LoopProgram):
  init, cond, _ = program.parts(consts)
  state = init(carry)
  return state, cond(state)


@functools.partial(jax.jit, static_argnames=("program",), donate_argnames=("state",))
def _host_step(state, consts, *, program: LoopProgram):
  _, cond, body = program.parts(consts)
  state = body(state)
  return state, cond(state)


@dataclasses.dataclass(frozen=True)
class LoopCall:
  """A loop with its arguments: `carry`, what it updates in place (donated: the caches), and
  `consts`, its read-only inputs (params, budgets, ...)."""
  program: LoopProgram
  carry: Any
  consts: Any

  def run(self, device_loop: bool = True):
    """Run the loop to its end -> the program's outputs.

    device_loop=True: one jitted `lax.while_loop` (traceable: callable inside another jit).
    device_loop=False: a jitted init, then one jitted body call per iteration driven from Python,
    which reads the stop condition back after each (a device-to-host sync per step), the classic
    baseline the device loop is measured against. Same body, same state: identical results.
    """
    if device_loop:
      state = _device_loop(self.carry, self.consts, program=self.program)
    else:
      state, going = _host_init(self.carry, self.consts, program=self.program)
      while bool(going):
        state, going = _host_step(state, self.consts, program=self.program)
    return self.program.result(state)

  def compile(self, device_loop: bool = True) -> jax.stages.Compiled:
    """The program `run(device_loop)` executes per call: the whole loop, or the one-step body
    (after init); `as_text()` gives its HLO, `memory_analysis()` its bytes. The carry may be
    shapes (`abstract()`): on one device the program a run compiled then comes from jit's cache."""
    if device_loop:
      return _device_loop.lower(self.carry, self.consts, program=self.program).compile()
    state, _ = jax.eval_shape(functools.partial(_host_init, program=self.program), self.carry, self.consts)
    return _host_step.lower(state, self.consts, program=self.program).compile()

  def abstract(self) -> "LoopCall":
    """This call with its carry as shapes (the arrays themselves are donated by `run`)."""
    shape = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
    return dataclasses.replace(self, carry=jax.tree.map(shape, self.carry))


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("cache",))
def prefill_chunk(params, cache: KVCache, tokens: jax.Array, positions: jax.Array, *, spec: StepSpec):
  """Write a chunk of tokens [B, C] at positions [B, C] (-1 = padding) into the cache.

  Returns (logits [B, V] fp32 at each sequence's last real token of the chunk, hidden [B, D] there,
  new cache with lengths advanced by the real tokens).
  """
  logits, hidden, cache = spec.model.apply({"params": params}, tokens, positions, cache=cache,
                                           runtime=spec.runtime)
  last = jnp.argmax(positions, axis=1)
  pick = lambda a: jnp.take_along_axis(a, last[:, None, None], axis=1)[:, 0]
  lengths = jnp.maximum(cache.lengths, jnp.max(positions, axis=1) + 1)
  return pick(logits), pick(hidden), cache.replace(lengths=lengths)


def _decode_parts(consts, *, spec: StepSpec, sampling: Sampling, max_new_tokens: int):
  """`decode`'s loop: the state is (cache, out, counts, stopped, step, key)."""
  params, eos_ids, budget = consts["params"], consts["eos_ids"], consts["budget"]

  def init(cache):
    first_tokens, active = consts["first_tokens"], consts["active"]
    b = first_tokens.shape[0]
    out = jnp.full((b, max_new_tokens), -1, jnp.int32).at[:, 0].set(jnp.where(active, first_tokens, -1))
    stopped = ~active | (budget <= 1) | jnp.isin(first_tokens, eos_ids)
    counts = jnp.where(active, 1, 0).astype(jnp.int32)
    return cache, out, counts, stopped, jnp.int32(1), consts["key"]

  def cond(state):
    _, _, _, stopped, step, _ = state
    return (step < max_new_tokens) & ~jnp.all(stopped)

  def body(state):
    cache, out, counts, stopped, step, key = state
    tokens = out[:, step - 1]
    positions = jnp.where(stopped, -1, cache.lengths)[:, None]
    logits, _, cache = spec.model.apply({"params": params}, tokens[:, None], positions, cache=cache,
                                        runtime=spec.runtime)
    key, sub = jax.random.split(key)
    new = sample(logits[:, 0], sub, sampling)
    running = ~stopped
    out = out.at[:, step].set(jnp.where(running, new, -1))
    lengths = cache.lengths + running.astype(jnp.int32)
    counts = counts + running.astype(jnp.int32)
    stopped = stopped | jnp.isin(new, eos_ids) | (counts >= budget)
    return cache.replace(lengths=lengths), out, counts, stopped, step + 1, key

  return init, cond, body


def _decode_result(state):
  cache, out, counts, _, steps, _ = state
  # The last emitted token of each sequence is not in the cache yet (it is the next input).
  return out, counts, steps, cache


def decode_call(params, cache: KVCache, first_tokens: jax.Array, active: jax.Array, key: jax.Array,
                eos_ids: jax.Array, budget: jax.Array, *, spec: StepSpec, sampling: Sampling,
                max_new_tokens: int) -> LoopCall:
  """`decode`'s loop and arguments, to run or compile."""
  program = LoopProgram.of(_decode_parts, _decode_result, spec=spec, sampling=sampling, max_new_tokens=max_new_tokens)
  return LoopCall(program, cache, dict(params=params, first_tokens=first_tokens, active=active, key=key,
                                       eos_ids=eos_ids, budget=budget))


def decode(params, cache: KVCache, first_tokens: jax.Array, active: jax.Array, key: jax.Array,
           eos_ids: jax.Array, budget: jax.Array, *, spec: StepSpec, sampling: Sampling,
           max_new_tokens: int, device_loop: bool = True):
  """Generate up to max_new_tokens per sequence.

  first_tokens [B]: each sequence's next input token (sampled from its prefill logits, not yet
  in the cache). active [B] bool: sequences taking part. eos_ids [E] int32 (empty = ignore EOS).
  budget [B] int32: tokens each sequence may emit (<= max_new_tokens). device_loop: one
  on-device loop, or one host-driven jitted step per token (`LoopCall.run`).
  Returns (tokens [B, max_new_tokens] int32 with -1 after each sequence stops, counts [B],
  steps run, new cache). Stopped sequences write nothing (their position is -1).
  """
  return decode_call(params, cache, first_tokens, active, key, eos_ids, budget, spec=spec, sampling=sampling,
                     max_new_tokens=max_new_tokens).run(device_loop)


# The one-program form, for callers that trace, lower or compile it.
decode_loop = jax.jit(functools.partial(decode, device_loop=True),
                      static_argnames=("spec", "sampling", "max_new_tokens"), donate_argnames=("cache",))
