"""Memory of the decode state (ds4jax/decode.py) per layer and in total, at a few context lengths.

    python -m experiments.cache_memory [--preset=v4_flash] [--lengths=8192,32768,131072]

Counts the arrays `decode.empty_state` allocates (shapes only: nothing is allocated), in f32 as ds4jax keeps them
and in bf16 as a cache stored in bf16 would. A layer kind's caches are equal, so the table shows one row per kind.
"""

from __future__ import annotations

import collections

import jax
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
    per_kind = collections.OrderedDict()
    for i, (kind, n) in enumerate(elements(cfg, cap)):
      per_kind.setdefault(kind, [n, 0, layer_arrays(cfg, i, cap)])[1] += 1
    for kind, (n, count, shapes) in per_kind.items():
      arrays = ", ".join(f"{k} {list(s)}" for k, s in shapes.items())
      lines.append(f"| {cap} | {kind} | {count} | {arrays} | {4 * n / 2**20:.2f} | {2 * n / 2**20:.2f} |")
    total = sum(n for _, n in elements(cfg, cap))
    totals.append(f"{cap} positions: {4 * total / 2**20:.1f} MiB in f32, {2 * total / 2**20:.1f} MiB in bf16 "
                  f"({cfg.num_layers} layers)")
  return "\n".join(lines + [""] + totals)


def main(argv):
  del argv
  print(table(config.preset(flags.FLAGS.preset), [int(x) for x in flags.FLAGS.lengths]))


if __name__ == "__main__":
  define_flags()
  app.run(main)
