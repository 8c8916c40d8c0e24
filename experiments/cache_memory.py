"""Memory of the decode state (ds4jax/decode.py) per layer and in total, at a few context lengths.

    python -m experiments.cache_memory [--preset=v4_flash] [--lengths=8192,32768,131072]

Counts the arrays `decode.empty_state` allocates (shapes only: nothing is allocated) with f32 caches (the default)
and with `cache_dtype=bfloat16`, which stores every cached row in bf16 but keeps the compressor's input tail in f32
(docs/decode.md §1). A layer kind's caches are equal, so the table shows one row per kind.
"""

from __future__ import annotations

import collections
import sys

import jax
import jax.numpy as jnp
from absl import app, flags

from ds4jax import config, decode, layer_cache


def define_flags() -> None:
  """Defined only when run as a command: tests import this module beside other entry points' flags."""
  flags.DEFINE_string("preset", "v4_flash", "Model preset.")
  flags.DEFINE_list("lengths", ["8192", "32768", "131072"], "Context capacities (positions).")


def layer_arrays(cfg, layer: int, capacity: int) -> dict[str, tuple[int, ...]]:
  """The shapes of one layer's decode state at `capacity` positions."""
  rows = decode.cache_rows(cfg, layer, capacity, decode.MAX_VERIFY)
  shapes = jax.eval_shape(lambda: layer_cache.empty(cfg, layer, capacity, 1, rows=rows))
  return {k: tuple(v.shape) for k, v in vars(shapes).items() if v is not None}


def layer_bytes(cfg, capacity: int, cache_dtype=jnp.float32) -> list[int]:
  """Bytes of each layer's decode state, as `decode.empty_state` allocates it with that cache dtype."""
  caches = jax.eval_shape(lambda: decode.empty_caches(cfg, capacity, decode.MAX_VERIFY, cache_dtype))
  return [sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(c)) for c in caches]


def elements(cfg, capacity: int) -> list[tuple[str, int]]:
  """(layer kind, elements) for every layer."""
  return [(cfg.attention[i].value, sum(_prod(s) for s in layer_arrays(cfg, i, capacity).values()))
          for i in range(cfg.num_layers)]


def _prod(shape) -> int:
  n = 1
  for x in shape:
    n *= x
  return n


def table(cfg, capacities) -> str:
  lines = [f"{cfg.name}: decode state (ds4jax/decode.py), MiB", "",
           "| positions | layer kind | layers | arrays (one layer) | one layer f32 | one layer bf16 |",
           "|---:|---|---:|---|---:|---:|"]
  totals = []
  for cap in capacities:
    f32, bf16 = layer_bytes(cfg, cap), layer_bytes(cfg, cap, jnp.bfloat16)
    per_kind = collections.OrderedDict()
    for i in range(cfg.num_layers):
      per_kind.setdefault(cfg.attention[i].value, [i, 0])[1] += 1
    for kind, (i, count) in per_kind.items():
      arrays = ", ".join(f"{k} {list(s)}" for k, s in layer_arrays(cfg, i, cap).items())
      lines.append(f"| {cap} | {kind} | {count} | {arrays} | {f32[i] / 2**20:.2f} | {bf16[i] / 2**20:.2f} |")
    totals.append(f"{cap} positions: {sum(f32) / 2**20:.1f} MiB in f32, {sum(bf16) / 2**20:.1f} MiB in bf16 "
                  f"({cfg.num_layers} layers)")
  return "\n".join(lines + [""] + totals)


def main(argv):
  del argv
  if not all(x.isdigit() and int(x) > 0 for x in flags.FLAGS.lengths):
    sys.exit(f"cache_memory: --lengths must be positive integers, got {flags.FLAGS.lengths}")
  print(table(config.preset(flags.FLAGS.preset), [int(x) for x in flags.FLAGS.lengths]))


if __name__ == "__main__":
  define_flags()
  app.run(main)
