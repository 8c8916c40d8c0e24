"""Decode and q-wide verification on the prefill's layer steps (docs/decode.md).

    state = start(model, prompt, features, capacity=...)   # prefill; state.logits: next-token logits [vocab]
    logits, state = extend(model, state, tokens)            # q tokens at [state.length, +q) -> [q, vocab]
    state = start(model, prompt, cache_dtype=jnp.bfloat16)  # caches stored in bf16 (docs/decode.md §1)
    tokens = generate(model, prompt, 16, features)          # greedy
    outcome = verify(model, state, draft)                   # accept the longest draft prefix greedy agrees with

A decode step is a band of one token (a verification step, a band of q) through the same layer code and kernels
as a prefill band, on the same per-layer state (ds4jax/layer_cache.py). A `State` is immutable: extending it makes
a new one and leaves the old one usable, so a rejected draft is rolled back by keeping the old state and replaying
the accepted tokens on it. Nothing is overwritten in place, which is why upstream's ring-slot preservation has no
counterpart here (docs/decode.md §3).

A state holds the model it was started with, split once into each layer's jitted program and weight arrays: a
step walks no module graph on the host. Continuing a state takes that same model object (docs/decode.md §1).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ds4jax import attention as attention_lib
from ds4jax import features as features_lib
from ds4jax import layer_cache
from ds4jax import model as model_lib
from ds4jax import moe as moe_lib
from ds4jax import prefill as prefill_lib
from ds4jax.config import Attention
from ds4jax.features import REFERENCE, Features
from ds4jax.layer_cache import LayerCache
from ds4jax.layers import QuantizedWeight

MAX_VERIFY = 8  # widest draft a state is sized for (upstream verifies 2-5)


@dataclasses.dataclass(frozen=True, eq=False)
class Weights:
  """The model a state was started with, split once. A decode step dispatches each layer's program on its weight
  arrays and walks no module graph: `nnx.split` of every layer per token, and hashing its graphdef as a static jit
  argument, cost more host time than the tiny model's step itself."""
  model: model_lib.DeepseekV4  # identity only: the caches were computed with these weights
  layers: tuple[tuple[Callable, list], ...]  # (program, weight arrays) per layer
  output: tuple[Callable, list]  # the same for the modules after the layers
  embed: jax.Array

  @classmethod
  def of(cls, m: model_lib.DeepseekV4) -> Weights:
    def split(module, program):
      graphdef, state = nnx.split(module)
      leaves, treedef = jax.tree.flatten(state)
      return program(graphdef, treedef), leaves
    return cls(m, tuple(split(b, _layer_program) for b in m.layers), split(m.output(), _logits_program),
               m.embed[...])


@dataclasses.dataclass(frozen=True)
class State:
  """Everything a prompt of `length` tokens leaves behind: each layer's cache, sized for `capacity` positions,
  and the logits of its last position (what the next token is chosen from)."""
  length: int
  capacity: int
  widest: int  # the widest band its compressed rows have room for (decode.cache_rows)
  caches: tuple[LayerCache, ...]
  logits: jax.Array  # [vocab] f32
  features: Features
  weights: Weights

  @property
  def cache_dtype(self):
    return self.caches[0].kv_tail.dtype


def cache_rows(cfg, layer: int, capacity: int, widest: int) -> int:
  """Compressed rows a layer must hold when bands of up to `widest` tokens may start anywhere below capacity."""
  if cfg.attention[layer] is Attention.WINDOW:
    return 0
  m = cfg.compress_ratio(layer)
  return max(layer_cache.row_capacity(capacity, b, m) for b in range(1, min(widest, capacity) + 1))


CACHE_DTYPES = (jnp.float32, jnp.bfloat16)


def empty_caches(cfg, capacity: int, widest: int, cache_dtype=jnp.float32) -> tuple[LayerCache, ...]:
  """Every layer's cache before position 0 (what `empty_state` allocates; experiments/cache_memory.py counts it)."""
  if not 0 < capacity <= cfg.max_position_embeddings:
    raise ValueError(f"capacity {capacity} must lie in (0, max_position_embeddings={cfg.max_position_embeddings}]")
  if jnp.dtype(cache_dtype) not in [jnp.dtype(d) for d in CACHE_DTYPES]:
    raise ValueError(f"cache_dtype {jnp.dtype(cache_dtype).name} must be float32 or bfloat16")
  return tuple(layer_cache.empty(cfg, i, capacity, 1, rows=cache_rows(cfg, i, capacity, widest), dtype=cache_dtype)
               for i in range(cfg.num_layers))


def empty_state(m: model_lib.DeepseekV4, capacity: int, widest: int, features: Features = REFERENCE,
                cache_dtype=jnp.float32) -> State:
  """The state before position 0. `cache_dtype` bfloat16 stores the cached rows in bf16 (docs/decode.md §1)."""
  caches = empty_caches(m.cfg, capacity, widest, cache_dtype)
  return State(0, capacity, widest, caches, jnp.zeros((m.cfg.vocab_size,), jnp.float32), features, Weights.of(m))


@functools.cache
def _layer_program(graphdef, treedef) -> Callable:
  """One layer over one band, a jitted function per distinct layer structure (layers of one kind share it, and so
  do all states). Unlike prefill's step it does not donate the cache: the caller's State keeps it."""
  @functools.partial(jax.jit, static_argnames=("features",))
  def step(leaves, X, tokens, s0, cache, features: Features):
    X, cache, _ = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)).band(X, tokens, s0, cache, features)
    return X, cache
  return step


@functools.cache
def _logits_program(graphdef, treedef) -> Callable:
  @jax.jit
  def logits(leaves, X):
    out = model_lib.output_logits(nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), X)
    return out, out[-1]
  return logits


@functools.partial(jax.jit, static_argnames=("hc_mult",))
def _embed(table, tokens, hc_mult: int):
  return model_lib.embed_streams(table, tokens, hc_mult)


@jax.jit
def _choices(last, logits):
  """Greedy's choice after each position: argmax of [last; logits] -> [q + 1]."""
  return jnp.argmax(jnp.concatenate([last[None], logits]), axis=-1)


_argmax_jit = jax.jit(jnp.argmax)


def _argmax(logits: jax.Array) -> int:
  return int(_argmax_jit(logits))


def _weights(m: model_lib.DeepseekV4, state: State) -> Weights:
  if state.weights.model is not m:
    raise ValueError("this state was started with another model object, and its caches hold that model's keys; "
                     "start a new state (decode.start) with this model to decode with it")
  return state.weights


def _band(m: model_lib.DeepseekV4, state: State, tokens: np.ndarray) -> tuple[jax.Array, State]:
  """Tokens at positions [state.length, +len(tokens)) as one band through every layer -> ([q, vocab], state)."""
  w = _weights(m, state)
  q = tokens.shape[0]
  inner = prefill_lib.layer_features(state.features, q)
  toks = jax.device_put(tokens)
  s0 = np.int32(state.length)
  X = _embed(w.embed, toks, m.cfg.hc_mult)
  caches = []
  for (step, weights), cache in zip(w.layers, state.caches):
    X, cache = step(weights, X, toks, s0, cache, inner)
    caches.append(cache)
  program, weights = w.output
  logits, last = program(weights, X)
  return logits, dataclasses.replace(state, length=state.length + q, caches=tuple(caches), logits=last)


def _check_room(state: State, q: int) -> None:
  if q > state.widest:
    raise ValueError(f"a band of {q} tokens is wider than the state was made for ({state.widest}; pass widest= "
                     f"to start)")
  if state.length + q > state.capacity:
    raise ValueError(f"{q} more tokens at position {state.length} exceed the state's capacity of "
                     f"{state.capacity} positions (pass a larger capacity to start)")


def extend(m: model_lib.DeepseekV4, state: State, tokens) -> tuple[jax.Array, State]:
  """Appends tokens (1 = a decode step, q = a verification band) -> (their logits [q, vocab] f32, new state)."""
  t = model_lib.check_tokens(tokens, m.cfg)
  _check_room(state, t.shape[0])
  return _band(m, state, t)


def start(m: model_lib.DeepseekV4, prompt, features: Features = REFERENCE, capacity: int | None = None,
          widest: int = MAX_VERIFY, offset: int = 0, cache_dtype=jnp.float32) -> State:
  """Prefills `prompt` into a state with room for `capacity` positions (default: the model's maximum).

  `offset` > 0 puts the prompt at positions [offset, offset + len) after an all-zero state (what nothing before
  it leaves): long positions without a long prompt, for tests.

  The prompt goes in bands of `prefill_band_tokens`, the last one cut to what is left (prefill pads it instead,
  and padding would leave its tokens in the caches of the positions decode goes on to fill); a band longer than
  `long_context_chunk` is a whole number of chunks.

  `cache_dtype` bfloat16 stores the cached rows in bf16 (docs/decode.md §1). The state keeps `m`: continue it with
  that model object.
  """
  t = model_lib.check_tokens(prompt, m.cfg)
  features_lib.check(features)
  moe_lib.check_kernels(m.cfg, m.policy, features)
  attention_lib.check_kernels(m.cfg, features)
  capacity = capacity or m.cfg.max_position_embeddings
  bands = prompt_bands(t.shape[0], features)
  state = dataclasses.replace(empty_state(m, capacity, max([widest, *bands]), features, cache_dtype), length=offset)
  if offset + t.shape[0] > capacity:
    raise ValueError(f"a prompt of {t.shape[0]} tokens at position {offset} exceeds the capacity of {capacity} "
                     f"positions")
  done = 0
  for b in bands:
    _, state = _band(m, state, t[done:done + b])
    done += b
  return state


def precompile(m: model_lib.DeepseekV4, state: State, widths: Sequence[int], workers: int = 8) -> int:
  """Compiles the layer programs that bands of each width in `widths` run on `state`'s caches, `workers` at a time,
  into jax's persistent compilation cache (jax_compilation_cache_dir must be set): a decode then loads them instead
  of compiling one after another (as prefill.precompile does for prefills). Returns the programs compiled; one that
  fails to compile (e.g. out of memory while autotuning) is left to its first band."""
  if not jax.config.jax_compilation_cache_dir:
    raise ValueError("precompile fills the persistent compilation cache: set jax_compilation_cache_dir first")
  w = _weights(m, state)
  lowered, seen = [], set()
  for q in widths:
    inner = prefill_lib.layer_features(state.features, q)
    toks = jax.ShapeDtypeStruct((q,), jnp.int32)
    X = jax.eval_shape(functools.partial(_embed, hc_mult=m.cfg.hc_mult), w.embed, toks)
    for (step, weights), cache in zip(w.layers, state.caches):
      key = (step, q, tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(cache)))
      if key not in seen:
        seen.add(key)
        lowered.append(step.lower(weights, X, toks, np.int32(0), cache, inner))
  return prefill_lib.compile_in_threads(lowered, workers, fallback="its first band compiles it")


def decodes_every_expert(m: model_lib.DeepseekV4, features: Features) -> bool:
  """Whether every band, a one-token step included, dequantizes routed expert stacks of every layer before the MoE
  kernels (`moe_lib.decoded_beforehand`: all three with `moe_sparse_gate_up` off). On V4-Flash that is 80-86% of a
  step (docs/decode.md §6)."""
  return any(isinstance(getattr(b.ffn.experts, n), QuantizedWeight)
             for b in m.layers for n in moe_lib.decoded_beforehand(features))


def prompt_bands(n: int, features: Features) -> list[int]:
  """Band widths a prompt of n tokens is prefilled in: full bands, then the rest cut to whole chunks, then the
  last partial chunk."""
  B = prefill_lib.band_size(n, features)
  full, rest = divmod(n, B)
  chunk = features.long_context_chunk
  tail = [rest - rest % chunk, rest % chunk] if chunk and rest > chunk else [rest]
  return [B] * full + [b for b in tail if b]


def generate(m: model_lib.DeepseekV4, prompt, n_new: int, features: Features = REFERENCE,
             cache_dtype=jnp.float32) -> np.ndarray:
  """Greedy continuation: the n_new token ids after `prompt`, one decode step each."""
  t = model_lib.check_tokens(prompt, m.cfg)
  return greedy(m, start(m, t, features, t.shape[0] + n_new, widest=1, cache_dtype=cache_dtype), n_new)


def greedy(m: model_lib.DeepseekV4, state: State, n_new: int, progress=None,
           stop: Collection[int] = ()) -> np.ndarray:
  """n_new greedy tokens from a state, one decode step each (the last one chosen, not decoded); fewer when a token
  of `stop` (e.g. the EOS id) is chosen: it ends the continuation, included."""
  out = []
  for _ in range(n_new):
    out.append(_argmax(state.logits))
    done = len(out) == n_new or out[-1] in stop
    if not done:
      _, state = extend(m, state, [out[-1]])
    if progress:
      progress(len(out), len(out) - 1, 0, 0)
    if done:
      break
  return np.asarray(out, np.int32)


def ngram_draft(context: Sequence[int], q: int, n: int = 3) -> list[int]:
  """Up to q tokens that followed the latest earlier occurrence of the context's last n tokens (self-speculation:
  text repeats itself); [] if they never occurred before."""
  c = list(context)
  if len(c) <= n:
    return []
  tail = c[-n:]
  for i in range(len(c) - n - 1, -1, -1):
    if c[i:i + n] == tail:
      return c[i + n:i + n + q]
  return []


class NgramIndex:
  """`ngram_draft` over a growing context, each n-gram's latest earlier end kept as the context grows: a draft costs
  O(q), where scanning the context costs O(length) (~50 ms of Python per band after a 128K-token prompt)."""

  def __init__(self, context: Sequence[int], n: int = 3):
    self.n, self.tokens, self._ends = n, [], {}
    self.extend(context)

  def extend(self, tokens: Sequence[int]) -> None:
    for t in tokens:
      L = len(self.tokens)
      if L >= self.n:  # the n-gram ending at L is now an earlier occurrence for every later suffix
        self._ends[tuple(self.tokens[L - self.n:L])] = L
      self.tokens.append(int(t))

  def draft(self, q: int) -> list[int]:
    if len(self.tokens) <= self.n:
      return []
    end = self._ends.get(tuple(self.tokens[-self.n:]))
    return [] if end is None else self.tokens[end:end + q]


@dataclasses.dataclass(frozen=True)
class Speculation:
  tokens: np.ndarray   # the continuation, equal to `generate`'s
  bands: int           # verification bands run
  drafted: int         # drafted tokens offered
  accepted: int        # drafted tokens accepted


def speculate(m: model_lib.DeepseekV4, state: State, context: Sequence[int], n_new: int, ngram: int = 3,
              widths: tuple[int, int] = (2, 5), progress=None, drafter=None,
              stop: Collection[int] = ()) -> Speculation:
  """n_new greedy tokens from a state (reached by `context`) with self-speculative verification: each band is the
  pending token (greedy's choice, so always accepted) followed by an n-gram draft, q adaptive within `widths` (one
  wider after a fully accepted draft, back to the narrowest after a rejection). The tokens equal `greedy`'s; fewer
  bands run when drafts hit. The state needs room for n_new + widths[1] more positions. `drafter(context, k)`
  replaces the n-gram lookup (at most k tokens). A token of `stop` ends the continuation, as in `greedy`."""
  lo, hi = widths
  if not 2 <= lo <= hi <= MAX_VERIFY:
    raise ValueError(f"draft widths {widths} must satisfy 2 <= min <= max <= MAX_VERIFY={MAX_VERIFY}")
  index, out = NgramIndex(context, ngram), []
  pending = _argmax(state.logits)
  q, bands, drafted, accepted = lo, 0, 0, 0
  while True:
    out.append(pending)
    index.extend([pending])
    if len(out) >= n_new or out[-1] in stop:
      if progress:
        progress(min(len(out), n_new), bands, drafted, accepted)
      break
    draft = [int(t) for t in (drafter(index.tokens, q - 1) if drafter else index.draft(q - 1))][:q - 1]
    v = verify(m, state, [pending] + draft)
    if not v.accepted:  # pending is argmax(state.logits), as verify chooses it: a rejection is a bug, not a tie
      raise RuntimeError(f"verification rejected the pending token {pending} at length {state.length}")
    bands, drafted, accepted = bands + 1, drafted + len(draft), accepted + v.accepted - 1
    took = draft[:v.accepted - 1]
    ended = next((i for i, t in enumerate(took) if t in stop), None)  # an accepted draft token may end it
    if ended is not None:
      out += took[:ended + 1]
      if progress:
        progress(min(len(out), n_new), bands, drafted, accepted)
      break
    out += took
    index.extend(took)
    state, pending = v.state, v.next_token
    q = min(q + 1, hi) if draft and v.accepted == len(draft) + 1 else lo
    if progress and len(out) < n_new:
      progress(len(out), bands, drafted, accepted)
  return Speculation(np.asarray(out[:n_new], np.int32), bands, drafted, accepted)


@dataclasses.dataclass(frozen=True)
class Verified:
  """One verification step: `accepted` draft tokens matched greedy decoding; `next_token` is greedy's choice after
  them (the correction, or the bonus token when the whole draft was accepted); `state` has decoded exactly the
  accepted tokens, not `next_token`."""
  accepted: int
  next_token: int
  state: State


def verify(m: model_lib.DeepseekV4, state: State, draft: Sequence[int]) -> Verified:
  """Checks a draft of q tokens in one band. The longest prefix equal to greedy's choices is accepted; on a
  rejection the band's state is dropped and the accepted prefix replayed on the old one."""
  d = model_lib.check_tokens(draft, m.cfg)
  q = d.shape[0]
  if q > MAX_VERIFY:
    raise ValueError(f"a draft of {q} tokens exceeds MAX_VERIFY={MAX_VERIFY}")
  _check_room(state, q)
  logits, after = _band(m, state, d)
  greedy = np.asarray(_choices(state.logits, logits))  # [q + 1]
  accepted = int(np.argmin(np.append(d == greedy[:q], False)))  # first mismatch
  if accepted == q:
    return Verified(q, int(greedy[q]), after)
  if not accepted:
    return Verified(0, int(greedy[0]), state)
  kept = _band(m, state, d[:accepted])[1]
  # The next token is the replayed state's choice, not the wide band's: the next band's first token is checked
  # against these logits, and a near-tie that the two bands round apart would have it rejected.
  return Verified(accepted, _argmax(kept.logits), kept)


def valid_view(cfg, state: State) -> dict[str, np.ndarray]:
  """The parts of a state that positions below state.length determine (what two ways of reaching the same
  length must agree on): compressed rows of complete windows, the raw KV tail, the compressor's tail. Rows of the
  window in progress are scratch, rewritten before any query can see them. In f32, whatever the cache dtype."""
  P, out = state.length, {}
  f32 = lambda a: np.asarray(a).astype(np.float32)
  for i, c in enumerate(state.caches):
    out[f"{i}.kv_tail"] = f32(c.kv_tail)
    if c.rows is not None:
      done = P // cfg.compress_ratio(i)
      out[f"{i}.rows"] = f32(c.rows[:done])
      out[f"{i}.x_tail"] = f32(c.x_tail[:max(0, min(2 * cfg.compress_ratio(i), P - _tail_start(cfg, i, P)))])
      if c.index_rows is not None:
        out[f"{i}.index_rows"] = f32(c.index_rows[:done])
  out["logits"] = f32(state.logits)
  return out


def _tail_start(cfg, layer: int, P: int) -> int:
  m = cfg.compress_ratio(layer)
  return (P // m) * m - m
