"""Planted bugs: configurations that compute one layer subtly wrong, which the verdicts must FAIL.

Each mutation takes a layer's block and returns a changed copy (the model itself is untouched); `run_layer` turns
it into the runner `verdicts.layer_verdicts` injects, mutating the chosen layers only. The bugs are in the exact
math, the kind a kernel or a port gets wrong: an attention sink dropped, one expert's output scale one UE8M0 step
off, the window off by one, the indexer keeping k - 1 rows, the routed scaling factor dropped from the combine
weights, the compressor's per-slot gate bias dropped, a hash-routed layer routed by its scores; and two in what a
layer carries from band to band (CARRY: the window's KV rows, the compressed rows), which a run of one band from
position 0 cannot show: the verdicts judge those with their runs in bands (--verdict_bands >= 2), at their own layer
and end to end.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Callable

import jax.numpy as jnp
from flax import nnx

from ds4jax.config import Attention, Routing
from ds4jax.layers import QuantizedWeight
from experiments import verdicts


def dropped_sink(block):
  b = nnx.clone(block)
  b.attn.attn_sink[...] = jnp.full_like(b.attn.attn_sink[...], -1e30)  # the sink takes no mass
  return b


def expert_scale_step(block):
  """Expert 0's down projection doubled: one step of its UE8M0 scale."""
  b = nnx.clone(block)
  w2 = b.ffn.experts.w2
  if isinstance(w2, QuantizedWeight):
    raise ValueError("expert_scale_step mutates plain weights; quantized experts would need their scale bytes")
  w2[...] = w2[...].at[0].multiply(2)
  return b


def window_off_by_one(block):
  b = nnx.clone(block)
  b.attn.cfg = dataclasses.replace(b.attn.cfg, sliding_window=b.attn.cfg.sliding_window - 1)
  return b


def index_topk_minus_one(block):
  b = nnx.clone(block)
  if b.attn.indexer is None:
    raise ValueError("index_topk_minus_one needs a CSA layer")
  b.attn.indexer.topk -= 1
  return b


def routed_scale_dropped(block):
  b = nnx.clone(block)
  b.ffn.gate.scale = 1.0  # combine weights no longer multiplied by routed_scaling_factor
  return b


def compressor_bias_dropped(block):
  b = nnx.clone(block)
  if b.attn.compressor is None:
    raise ValueError("compressor_bias_dropped needs a compressed (CSA or HCA) layer")
  b.attn.compressor.ape[...] = jnp.zeros_like(b.attn.compressor.ape[...])
  return b


@functools.cache
def hash_routed_by_score(block):
  """A hash-routed layer picks its experts by the top k of its router's scores, as a top-k layer does, not by the
  token's id (a port that treats every layer alike). The pinned runs impose the exact path's experts, so only the
  decision accounting can see it."""
  b = nnx.clone(block)
  if b.ffn.gate.routing is not Routing.HASH:
    raise ValueError("hash_routed_by_score needs a hash-routed layer")
  b.ffn.gate.routing = Routing.TOPK
  b.ffn.gate.bias = nnx.data(nnx.Param(jnp.zeros_like(b.ffn.gate.weight[...][:, 0])))  # was None (static)
  return b


def _forgetting(attention_cls, fields: tuple[str, ...]):
  """`attention_cls` whose band receives its carried cache with `fields` zeroed."""
  class Forgetting(attention_cls):
    def band(self, x, s0, cache, *args, **kwargs):
      lost = {f: jnp.zeros_like(getattr(cache, f)) for f in fields if getattr(cache, f) is not None}
      return super().band(x, s0, dataclasses.replace(cache, **lost), *args, **kwargs)

  Forgetting.__name__ = Forgetting.__qualname__ = f"{attention_cls.__name__}Forgetting_{'_'.join(fields)}"
  return Forgetting


def _forget(block, *fields: str):
  b = nnx.clone(block)
  b.attn.__class__ = _forgetting(type(b.attn), fields)
  return b


def kv_tail_dropped(block):
  """The window's KV rows carried from the previous band are lost: a band's first queries see zero keys and values
  where the previous band's last W - 1 positions were. The first band carries zeros anyway, so only a later band
  shows it."""
  return _forget(block, "kv_tail")


def compressed_rows_dropped(block):
  """The compressed rows (and the indexer's keys) of earlier bands are lost: a band's queries see zero rows where
  the earlier bands' windows were pooled."""
  if block.attn.compressor is None:
    raise ValueError("compressed_rows_dropped needs a compressed (CSA or HCA) layer")
  return _forget(block, "rows", "index_rows")


MUTATIONS: dict[str, Callable] = {f.__name__: f for f in (
    dropped_sink, expert_scale_step, window_off_by_one, index_topk_minus_one, routed_scale_dropped,
    compressor_bias_dropped, hash_routed_by_score, kv_tail_dropped, compressed_rows_dropped)}
# Bugs in what a layer carries between bands: invisible in one band, judged in bands (per layer and end to end).
CARRY = {"kv_tail_dropped", "compressed_rows_dropped"}
# The layer kinds a bug lives in (absent: any layer).
NEEDS = dict(index_topk_minus_one={Attention.CSA}, compressor_bias_dropped={Attention.CSA, Attention.HCA},
             compressed_rows_dropped={Attention.CSA, Attention.HCA})


ROUTING_NEEDS = dict(hash_routed_by_score=Routing.HASH)


def default_layer(cfg, name: str) -> int:
  """The first layer of `cfg` whose kind (attention and routing) the bug `name` lives in."""
  kinds, routing = NEEDS.get(name), ROUTING_NEEDS.get(name)
  for i, k in enumerate(cfg.attention):
    if (kinds is None or k in kinds) and (routing is None or cfg.routing[i] is routing):
      return i
  need = [x.value for x in kinds or ()] + ([routing.value] if routing else [])
  raise ValueError(f"the planted bug {name} needs a layer of kind {need}; {cfg.name} has none")


def mutated_model(m, mutation: Callable, layers: set[int]):
  """`m` with the blocks in `layers` replaced by mutated copies; every other weight is shared, not copied (the full
  V4-Flash has no room for a second one)."""
  out = copy.copy(m)
  out.layers = nnx.List([mutation(b) if i in layers else b for i, b in enumerate(m.layers)])
  return out


def replacing(blocks: dict) -> Callable:
  """A `layer_verdicts` runner that runs `blocks[i]` in place of layer i's block where given."""
  def run(i, block, X, tokens, features, pinned):
    return verdicts.default_run_layer(i, blocks.get(i, block), X, tokens, features, pinned)

  return run


def run_layer(mutation: Callable, layers: set[int]) -> Callable:
  """A `layer_verdicts` runner that runs the mutated copy of the blocks in `layers` (each mutated once, when first
  run)."""
  mutated = {}

  def run(i, block, X, tokens, features, pinned):
    if i in layers and i not in mutated:
      mutated[i] = mutation(block)
    return replacing(mutated)(i, block, X, tokens, features, pinned)

  return run
