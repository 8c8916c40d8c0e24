"""Layer-major banded prefill (lucebox-stack.md §1.2, upstream #684) with the layer state carried across bands.

    logits = prefill_logits(model, tokens, features)        # final position, f32 [vocab]

The prompt is cut into bands of `prefill_band_tokens` tokens (0 = one band). Each band runs through every layer
before the next band starts, so each expert's weights are read once per band; the streams of the band stay on the
device from layer to layer. What a layer needs from earlier bands (window KV tail, compressor tail, compressed rows,
indexer keys) is its `LayerCache` (ds4jax/layer_cache.py). Inside a layer, attention takes the band's queries in
chunks of `long_context_chunk` (ds4jax/attention.py), which bounds its masks and scores at 128K.

The last band is padded to the band size with token 0 at later positions: causal masks keep the padding out of
every real position, and one band shape means one compile per layer type (not per layer, not per band).
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ds4jax import model as model_lib
from ds4jax.features import REFERENCE, Features



def band_size(n_tokens: int, features: Features) -> int:
  """`prefill_band_tokens` (0 = the whole prompt), cut to the prompt and rounded up to whole query chunks."""
  band = min(features.prefill_band_tokens or n_tokens, n_tokens)
  chunk = features.long_context_chunk
  return -(-band // chunk) * chunk if chunk and chunk < band else band


@functools.partial(jax.jit, static_argnames=("graphdef", "features"), donate_argnames=("X", "cache"))
def _layer_step(graphdef, state, X, tokens, s0, cache, features: Features):
  """One layer over one band. Layers of one type have equal graphdefs, so they share this compile."""
  return nnx.merge(graphdef, state).band(X, tokens, s0, cache, features)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _embed(graphdef, state, tokens):
  return nnx.merge(graphdef, state).embed_streams(tokens)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _logits(graphdef, state, X):
  return nnx.merge(graphdef, state).logits(X)


def prefill(m: model_lib.DeepseekV4, tokens, features: Features = REFERENCE,
            progress: Callable[[str], None] | None = None, all_logits: bool = False) -> jnp.ndarray:
  """Banded prefill of a prompt from position 0: f32 [S, vocab] logits if `all_logits`, else [vocab] of the
  final position."""
  t = model_lib.check_tokens(tokens, m.cfg)
  S = t.shape[0]
  B = band_size(S, features)
  n_bands = -(-S // B)
  padded = np.zeros(n_bands * B, np.int32)
  padded[:S] = t
  # Embedding and head: the rest of the model without its layers (split once; the layers are split per layer).
  layers = list(m.layers)
  outer_def, outer_state = nnx.split(m)
  caches = [block.attn.empty_cache(n_bands * B, B) for block in layers]
  parts = [nnx.split(block) for block in layers]
  out, t0 = [], time.perf_counter()
  for b in range(n_bands):
    s0 = b * B
    toks = jnp.asarray(padded[s0:s0 + B])
    X = _embed(outer_def, outer_state, toks)
    for i, (gdef, state) in enumerate(parts):
      X, caches[i] = _layer_step(gdef, state, X, toks, jnp.int32(s0), caches[i], features)
    if all_logits:
      out.append(_logits(outer_def, outer_state, X))
    elif b == n_bands - 1:
      last = (S - 1) - s0
      out.append(_logits(outer_def, outer_state, X[last:last + 1])[0])
    if progress:
      jax.block_until_ready(X)
      progress(f"band {b + 1}/{n_bands}: tokens [{s0}, {min(s0 + B, S)}) done, {time.perf_counter() - t0:.1f}s")
  return jnp.concatenate(out)[:S] if all_logits else out[0]


def prefill_logits(m: model_lib.DeepseekV4, tokens, features: Features = REFERENCE,
                   progress: Callable[[str], None] | None = None) -> jnp.ndarray:
  """The final position's logits [vocab] in f32 (the qualification command's entry point)."""
  return prefill(m, tokens, features, progress)
