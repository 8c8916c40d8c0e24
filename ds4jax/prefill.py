"""Layer-major banded prefill (docs/upstream.md §2, upstream #684) with the layer state carried across bands.

    logits = prefill_logits(model, tokens, features)        # final position, f32 [vocab]

The prompt is cut into bands of `prefill_band_tokens` tokens (0 = one band). Each band runs through every layer
before the next band starts, so each expert's weights are read once per band; the streams of the band stay on the
device from layer to layer. What a layer needs from earlier bands (window KV tail, compressor tail, compressed rows,
indexer keys) is its `LayerCache` (ds4jax/layer_cache.py). Inside a layer, attention takes the band's queries in
chunks of `long_context_chunk` (ds4jax/attention.py), which bounds its masks and scores at 128K.

With `prefill_weights_stationary` the two loops swap: each layer runs every band before the next layer starts. The
streams of all bands stay on the device (64 KiB per token at V4-Flash's 4 x 4096 f32), one layer's cache at a time,
and experts that the MoE kernels read decoded (dequantize-then-matmul) are decoded once per layer, not once per band.
Each layer step computes the same thing in either order, so the logits are bit-identical. With
`prefill_moe_over_bands` too, a layer runs the attention half of its step (`Block.attend`) for every band, then the
MoE half (`Block.feed_forward`, which sees no positions) once over up to MOE_TOKENS tokens of consecutive bands: the
grouped kernels get more rows per expert per call. Each token's MoE is its own, so only how the matmuls are blocked
for more rows can change the bits (docs/upstream.md §2).

The last band is padded to the band size with token 0 at later positions: causal masks keep the padding out of
every real position, and one band shape means one compile per layer type (not per layer, not per band).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ds4jax import attention as attention_lib
from ds4jax import features as features_lib
from ds4jax import model as model_lib
from ds4jax import moe as moe_lib
from ds4jax.decisions import Decisions
from ds4jax.features import REFERENCE, Features

# Tokens per MoE call under prefill_moe_over_bands: bands are grouped (as evenly as whole bands allow) to at most
# this many. At V4-Flash's D 4096 and top-6 a call then holds ~8 GB of its own next to the weights: the joined
# streams and their output (2 GiB each in f32), x rows 1.6 GB, h 0.8 GB, f32 down outputs 3.2 GB.
MOE_TOKENS = 32768


def band_size(n_tokens: int, features: Features) -> int:
  """`prefill_band_tokens` (0 = the whole prompt), cut to the prompt and rounded up to whole query chunks."""
  band = min(features.prefill_band_tokens or n_tokens, n_tokens)
  chunk = features.long_context_chunk
  return -(-band // chunk) * chunk if chunk and chunk < band else band


def layer_features(features: Features, band: int) -> Features:
  """What a layer step sees: the band size lives outside it, and a chunk that spans the band is no chunk. Feature
  sets that differ only there (kill_prefill_band_tokens, or kill_long_context_chunk when the band is one chunk)
  then share one compiled program, as they run the same computation."""
  chunk = features.long_context_chunk
  chunk = chunk if chunk and chunk < band and band % chunk == 0 else 0  # a decode band (≤ 8 tokens) may not divide
  return dataclasses.replace(features, prefill_band_tokens=0, long_context_chunk=chunk,
                             prefill_weights_stationary=False, prefill_moe_over_bands=False)


def moe_groups(n_bands: int, B: int) -> list[range]:
  """The consecutive bands each MoE call of prefill_moe_over_bands takes: at most MOE_TOKENS tokens (at least one
  band) a call, the calls as even as whole bands allow, so there are at most two call shapes."""
  calls = -(-n_bands // max(1, MOE_TOKENS // B))
  sizes = [n_bands // calls + (k < n_bands % calls) for k in range(calls)]
  starts = np.cumsum([0] + sizes)
  return [range(starts[k], starts[k + 1]) for k in range(calls)]


def moe_over_bands(features: Features, n_bands: int) -> bool:
  """Whether prefill runs each layer's MoE over several bands at once."""
  return features.prefill_weights_stationary and features.prefill_moe_over_bands and n_bands > 1


def step_parts(block, features: Features, n_bands: int, abstract: bool = False):
  """(graphdef, state) of `block` as its layer steps take it. Weights stationary over several bands, with the MoE
  kernels reading decoded experts, the experts come decoded (once for all bands, in the matmul dtype; `abstract`:
  shapes only). One band gains nothing from it: the decode stays inside the step, as band-major runs it."""
  if not (features.prefill_weights_stationary and n_bands > 1 and moe_lib.decodes_experts(features)):
    return nnx.split(block)
  copy = nnx.merge(*nnx.split(block))  # new modules over the same arrays
  copy.ffn.experts.decode_quantized(features, abstract)
  return nnx.split(copy)


@functools.partial(jax.jit, static_argnames=("graphdef", "features", "record_scores"),
                   donate_argnames=("X", "cache"))
def _layer_step(graphdef, state, X, tokens, s0, cache, features: Features, pinned=None, record_scores=False):
  """One layer over one band. Layers of one type have equal graphdefs, so they share this compile."""
  return nnx.merge(graphdef, state).band(X, tokens, s0, cache, features, pinned, record_scores)


@functools.partial(jax.jit, static_argnames=("graphdef", "features"), donate_argnames=("X", "cache"))
def _attend_step(graphdef, state, X, s0, cache, features: Features, pinned_rows=None):
  """The attention half of one layer over one band (Block.attend): (streams, cache, index rows)."""
  X, cache, rows, _ = nnx.merge(graphdef, state).attend(X, s0, cache, features, pinned_rows)
  return X, cache, rows


@functools.partial(jax.jit, static_argnames=("graphdef", "features"), donate_argnames=("Xs",))
def _moe_step(graphdef, state, Xs, tokens, features: Features, pinned_route_ids=None):
  """The MoE half of one layer over consecutive bands at once (Block.feed_forward on their tokens joined): each
  band's streams and route ids."""
  B, n = Xs[0].shape[0], len(Xs)
  pin = None if pinned_route_ids is None else jnp.concatenate(pinned_route_ids)
  Y, route_ids, _ = nnx.merge(graphdef, state).feed_forward(jnp.concatenate(Xs), jnp.concatenate(tokens), features,
                                                           pin)
  return tuple(Y[k * B:(k + 1) * B] for k in range(n)), tuple(route_ids[k * B:(k + 1) * B] for k in range(n))


def layer_step(block, X: jnp.ndarray, tokens: jnp.ndarray, s0, cache, features: Features,
               pinned: Decisions | None = None, record_scores: bool = False):
  """One layer over one band of X.shape[0] tokens through the program `prefill` runs -> (streams, cache,
  Decisions). X and cache are donated (pass copies to keep them). `pinned` / `record_scores`: Block.band."""
  gdef, state = nnx.split(block)
  return _layer_step(gdef, state, X, tokens, jnp.int32(s0), cache, layer_features(features, X.shape[0]), pinned,
                     record_scores)


def _layer_over_bands(parts, cache, X: list, band_tokens: list, B: int, inner: Features,
                      groups: list[range] | None, pins: list[Decisions] | None, keep: bool) -> list[Decisions]:
  """One layer over every band, as the weights-stationary order runs it: band by band with the cache carried or,
  given `groups` (prefill_moe_over_bands), each band's attention and then the MoE once per group of bands. `X`
  (each band's streams) is updated in place; `cache` is donated. Returns each band's decisions where `keep`."""
  if groups is None:
    made = []
    for b in range(len(X)):
      X[b], cache, d = _layer_step(*parts, X[b], band_tokens[b], jnp.int32(b * B), cache, inner,
                                   None if pins is None else pins[b])
      made += [d] * keep  # (a CSA layer's index rows at 128K: ~250 MB, kept only when asked for)
    return made
  rows = []
  for b in range(len(X)):
    X[b], cache, r = _attend_step(*parts, X[b], jnp.int32(b * B), cache, inner,
                                  None if pins is None else pins[b].index_rows)
    rows.append(r if keep else None)
  del cache  # the layer's attention is done: its cache goes before the joined MoE's buffers come
  routes: list = [None] * len(X)
  for g in groups:
    ys, rs = _moe_step(*parts, tuple(X[c] for c in g), tuple(band_tokens[c] for c in g), inner,
                       None if pins is None else tuple(pins[c].route_ids for c in g))
    for c, y, r in zip(g, ys, rs):
      X[c], routes[c] = y, r
  return [Decisions(r, rows[b]) for b, r in enumerate(routes)] if keep else []


def layer_in_bands(block, X: jnp.ndarray, tokens, features: Features,
                   pinned: Decisions | None = None) -> tuple[jnp.ndarray, Decisions]:
  """One layer over a whole prompt's streams X [S, n, D] from position 0, through the programs `prefill` runs for
  that layer under `features`: its bands, the cache carried between them, decoded experts and the MoE over bands
  where those say (the weights-stationary order, which is bit-identical to the band-major one). -> (streams
  [S, n, D], the layer's decisions over the S tokens). X is donated. `pinned`: decisions over the S tokens to
  impose. The per-layer verdicts run layers this way, so they see what a layer carries between bands."""
  S = X.shape[0]
  B = band_size(S, features)
  n_bands = -(-S // B)
  padded = np.zeros(n_bands * B, np.int32)
  padded[:S] = np.asarray(tokens)
  if n_bands * B > S:  # later positions: causal masks keep them out of every real one
    X = jnp.pad(X, ((0, n_bands * B - S), (0, 0), (0, 0)))
  Xs = [X] if n_bands == 1 else [X[b * B:(b + 1) * B] for b in range(n_bands)]
  del X
  pins = None if pinned is None else [_band_of(pinned, b * B, B) for b in range(n_bands)]
  groups = moe_groups(n_bands, B) if moe_over_bands(features, n_bands) else None
  made = _layer_over_bands(step_parts(block, features, n_bands), block.attn.empty_cache(n_bands * B, B), Xs,
                           [jnp.asarray(padded[b * B:(b + 1) * B]) for b in range(n_bands)], B,
                           layer_features(features, B), groups, pins, keep=True)
  return jnp.concatenate(Xs)[:S], _joined(made, S)


@functools.partial(jax.jit, static_argnames=("hc_mult",))
def _embed(table, tokens, hc_mult: int):
  return model_lib.embed_streams(table, tokens, hc_mult)


@jax.jit
def _perturb(X, eps, key):
  """X * (1 + eps z), z ~ N(0, 1) per element: a relative perturbation of the input streams."""
  return X * (1 + eps * jax.random.normal(key, X.shape, X.dtype))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _logits(graphdef, state, X):
  return model_lib.output_logits(nnx.merge(graphdef, state), X)


def prefill(m: model_lib.DeepseekV4, tokens, features: Features = REFERENCE,
            progress: Callable[[str], None] | None = None, all_logits: bool = False,
            positions: Sequence[int] | None = None, input_noise: float = 0.0, noise_seed: int = 0,
            pinned: Sequence[Decisions] | None = None, decisions: list | None = None) -> jnp.ndarray:
  """Banded prefill of a prompt from position 0: f32 logits [S, vocab] if `all_logits`, [len(positions), vocab] at
  the given `positions`, else [vocab] of the final position.

  `pinned`: one Decisions per layer over the whole prompt (another run's, e.g. the exact path's), imposed band by
  band; a list passed as `decisions` receives this run's, one per layer over the whole prompt (docs/model.md §13).

  The model is causal, so the logits at position p - 1 are those of the p-token prefix: one run at full length also
  gives a prefix's final logits (the qualification's parity check where the exact path only fits a prefix).

  `input_noise` > 0 multiplies the embedded streams by (1 + input_noise z), z ~ N(0, 1) seeded by `noise_seed` and
  the band, in f32: how far the logits move when the input does. The qualification's noise floor uses 2^-24, one
  f32 rounding: about half the elements then move by one ulp and the rest round back to themselves.
  """
  t = model_lib.check_tokens(tokens, m.cfg)
  features_lib.check(features)
  S = t.shape[0]
  if all_logits and positions is not None:
    raise ValueError("all_logits gives every position's logits: pass positions only without it")
  want = [] if all_logits else [S - 1] if positions is None else [int(p) for p in positions]
  if any(not 0 <= p < S for p in want):
    raise ValueError(f"positions {want} must lie in [0, {S}) for a {S}-token prompt")
  moe_lib.check_kernels(m.cfg, m.policy, features)
  attention_lib.check_kernels(m.cfg, features)
  B = band_size(S, features)
  n_bands = -(-S // B)
  padded = np.zeros(n_bands * B, np.int32)
  padded[:S] = t
  inner = layer_features(features, B)
  # Host work (walking the NNX graph) is done lazily, right before each layer's dispatch, so that it overlaps the
  # device work of the layers before it: the whole model's graph split up front cost ~0.5 s per call on a 2-core
  # host with V4-Flash's structure, during which the device sat idle.
  layers = list(m.layers)
  L = len(layers)
  if pinned is not None and len(pinned) != L:
    raise ValueError(f"pinned holds {len(pinned)} layers' decisions; the model has {L}")
  band_tokens = [jnp.asarray(padded[b * B:(b + 1) * B]) for b in range(n_bands)]
  keep = decisions is not None
  made_by_band: list[list[Decisions]] = [[] for _ in layers]
  pins_of = lambda i, b: None if pinned is None else _band_of(pinned[i], b * B, B)
  out, t0 = {}, time.perf_counter()
  out_parts = []

  def embed(b):
    x = _embed(m.embed[...], band_tokens[b], m.cfg.hc_mult)
    if input_noise:
      x = _perturb(x, jnp.float32(input_noise), jax.random.fold_in(jax.random.key(noise_seed), b))
    return x

  def emit(b, x):
    """Band b's logits from its final streams x."""
    if not out_parts:
      out_parts.extend(nnx.split(m.output()))
    if all_logits:
      out[b] = _logits(*out_parts, x)
    for p in want:
      if b * B <= p < (b + 1) * B:
        out[p] = _logits(*out_parts, x[p - b * B:p - b * B + 1])[0]

  if features.prefill_weights_stationary:
    X = [embed(b) for b in range(n_bands)]
    groups = moe_groups(n_bands, B) if moe_over_bands(features, n_bands) else None
    for i, layer in enumerate(layers):
      made_by_band[i] = _layer_over_bands(step_parts(layer, features, n_bands),
                                          layer.attn.empty_cache(n_bands * B, B), X, band_tokens, B, inner, groups,
                                          None if pinned is None else [pins_of(i, b) for b in range(n_bands)], keep)
      if progress:
        jax.block_until_ready(X[-1])
        progress(f"layer {i + 1}/{L}: {n_bands} bands done, {time.perf_counter() - t0:.1f}s")
    for b in range(n_bands):
      emit(b, X[b])
      X[b] = None
  else:
    parts: list = [None] * L
    caches: list = [None] * L
    for b in range(n_bands):
      x = embed(b)
      for i, layer in enumerate(layers):
        if parts[i] is None:
          parts[i], caches[i] = step_parts(layer, features, n_bands), layer.attn.empty_cache(n_bands * B, B)
        x, caches[i], made = _layer_step(*parts[i], x, band_tokens[b], jnp.int32(b * B), caches[i], inner,
                                         pins_of(i, b))
        if keep:
          made_by_band[i].append(made)
      emit(b, x)
      if progress:
        jax.block_until_ready(x)
        progress(f"band {b + 1}/{n_bands}: tokens [{b * B}, {min(b * B + B, S)}) done, {time.perf_counter() - t0:.1f}s")
      del x  # before the next band's streams come
  if keep:
    decisions[:] = [_joined(bands, S) for bands in made_by_band]
  if all_logits:
    return jnp.concatenate([out[b] for b in range(n_bands)])[:S]
  return out[S - 1] if positions is None else jnp.stack([out[p] for p in want])


def _band_of(d: Decisions, s0: int, B: int) -> Decisions:
  """The decisions of tokens [s0, s0 + B) of a whole-prompt Decisions; positions past its end (the last band's
  padding) route to expert 0 and keep no row."""
  def part(a, fill):
    if a is None:
      return None
    a = a[s0:s0 + B]
    return jnp.pad(a, ((0, B - a.shape[0]), (0, 0)), constant_values=fill) if a.shape[0] < B else a
  return Decisions(part(d.route_ids, 0), part(d.index_rows, -1))


def _joined(bands: list[Decisions], S: int) -> Decisions:
  """One layer's per-band decisions as one over the prompt's S tokens (scores are not recorded here)."""
  index = None if bands[0].index_rows is None else jnp.concatenate([d.index_rows for d in bands])[:S]
  return Decisions(jnp.concatenate([d.route_ids for d in bands])[:S], index)


def logits_of_streams(m: model_lib.DeepseekV4, X: jnp.ndarray) -> jnp.ndarray:
  """[S, n, D] final streams -> [S, vocab] f32 logits, through the program `prefill` uses."""
  return _logits(*nnx.split(m.output()), X)


def precompile(m: model_lib.DeepseekV4, runs: Sequence[tuple[int, Features]], workers: int = 8,
               log: Callable[[str], None] | None = None, pinned: Sequence[tuple[int, Features]] = (),
               scored: Sequence[tuple[int, Features]] = (), seen: set | None = None) -> int:
  """Compiles every distinct layer program that `prefill` would run for each (prompt tokens, features) in `runs`,
  `workers` at a time, into jax's persistent compilation cache (jax_compilation_cache_dir must be set). The later
  prefills then load them instead of compiling them one after another.

  `pinned`: runs whose layer steps take imposed decisions (the exact path's, as the qualification's pinned parity and
  teacher-forced KL impose them), in the bands their features say; `scored`: runs that record their selection scores
  (the exact path in the qualification's verdict pass), one band from position 0 as that pass runs them. `seen`: the
  programs of earlier calls (a set this call adds to), which are not compiled again.

  Lowering (tracing) runs here, one program at a time; the XLA/Triton compiles run in threads (they release the
  GIL). Returns the number of programs compiled; one that fails to compile is logged and left to its prefill.
  """
  if not jax.config.jax_compilation_cache_dir:
    raise ValueError("precompile fills the persistent compilation cache: set jax_compilation_cache_dir first")
  lowered, seen = [], set() if seen is None else seen
  programs = ([(n, f, False, False, True) for n, f in runs] + [(n, f, True, False, True) for n, f in pinned]
              + [(n, f, False, True, False) for n, f in scored])
  for n_tokens, features, pin, record_scores, banded in programs:
    B = band_size(n_tokens, features) if banded else n_tokens
    n_bands = -(-n_tokens // B)
    inner = layer_features(features, B)
    toks = jnp.zeros((B,), jnp.int32)
    X = jax.ShapeDtypeStruct((B, m.cfg.hc_mult, m.cfg.hidden_size), jnp.float32)
    over_bands = banded and moe_over_bands(features, n_bands)
    for block in m.layers:
      gdef, state = step_parts(block, features, n_bands, abstract=True)
      cache = jax.eval_shape(lambda blk=block: blk.attn.empty_cache(n_bands * B, B))
      decisions = _pinned_shapes(block, X, features.device_class) if pin else None
      key = (gdef, inner, B, tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(cache)), pin, record_scores,
             over_bands)  # the layer_features strip the switch: one run with it and one without need both
      if key in seen:
        continue
      seen.add(key)
      if not over_bands:
        lowered.append(_layer_step.lower(gdef, state, X, toks, jnp.int32(0), cache, inner, decisions, record_scores))
        continue
      pins = dict(pinned_rows=decisions.index_rows) if pin else {}
      lowered.append(_attend_step.lower(gdef, state, X, jnp.int32(0), cache, inner, **pins))
      for n in sorted({len(g) for g in moe_groups(n_bands, B)}):
        if (gdef, inner, "moe", B, n, pin) not in seen:
          seen.add((gdef, inner, "moe", B, n, pin))
          pins = dict(pinned_route_ids=(decisions.route_ids,) * n) if pin else {}
          lowered.append(_moe_step.lower(gdef, state, (X,) * n, (toks,) * n, inner, **pins))
  return compile_in_threads(lowered, workers, log, "its first prefill compiles it")


def compile_in_threads(lowered: Sequence, workers: int, log: Callable[[str], None] | None = None,
                       fallback: str = "its first run compiles it") -> int:
  """Compiles lowered programs `workers` at a time (XLA compiles release the GIL) into the persistent compilation
  cache; returns how many compiled. One that fails (e.g. out of memory while autotuning) is logged and left to its
  first run, which compiles it again and reports the failure."""
  def compile_one(low):
    try:
      low.compile()
      return None
    except Exception as e:  # noqa: BLE001 -- see the docstring
      return f"{type(e).__name__}: {str(e)[:300]}"

  t0, failed = time.perf_counter(), 0
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    for i, error in enumerate(pool.map(compile_one, lowered)):
      failed += error is not None
      if log:
        log(f"precompiled {i + 1}/{len(lowered)} layer programs ({time.perf_counter() - t0:.0f}s)"
            + (f"; this one failed ({error}), {fallback}" if error else ""))
  return len(lowered) - failed


def _pinned_shapes(block, X: jax.ShapeDtypeStruct, device_cls: str) -> Decisions:
  """Shapes of the decisions a one-band step over streams X is pinned to: the exact path's, as it makes them."""
  exact = dataclasses.replace(REFERENCE, device_class=device_cls)
  gdef, state = nnx.split(block)
  B = X.shape[0]
  cache = jax.eval_shape(lambda: block.attn.empty_cache(B, B))
  made = _layer_step.eval_shape(gdef, state, X, jax.ShapeDtypeStruct((B,), jnp.int32), jnp.int32(0), cache,
                                layer_features(exact, B))[2]
  return Decisions(made.route_ids, made.index_rows)


def prefill_logits(m: model_lib.DeepseekV4, tokens, features: Features = REFERENCE,
                   progress: Callable[[str], None] | None = None,
                   positions: Sequence[int] | None = None, input_noise: float = 0.0) -> jnp.ndarray:
  """The final position's logits [vocab] in f32, or [len(positions), vocab] at `positions` (the qualification
  command's entry point)."""
  return prefill(m, tokens, features, progress, positions=positions, input_noise=input_noise)
