"""How the grouped kernels walk their work: one program per (item, N tile), or persistent programs that loop.

A work unit is (item i, N tile j). Items come from int32 arrays (`item_expert/start/end`, see routing.py) loaded
in the kernel (no scalar prefetch on Pallas-Triton). `tile_order` picks which index varies fastest in launch order
(grid axis 0 is CUDA's x, launched first):

* "item": programs running together share one N tile across consecutive items (mostly of one expert), so each
  weight tile is read once from HBM, but every activation row tile is re-read once per N tile.
* "n": programs running together cover all N tiles of a few items, so an activation tile is read once and then hit
  in L2; the weight tiles of an expert are still shared by its items, which run close together.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

I32 = jnp.int32


def grid(*, persistent: bool, max_items: int, n_tiles: int, num_programs: int,
         tile_order: str = "item") -> tuple[int, ...]:
  if persistent:
    return (num_programs,)
  return (max_items, n_tiles) if tile_order == "item" else (n_tiles, max_items)


def run(unit: Callable[[jax.Array, jax.Array], None], *, persistent: bool, num_items_ref, n_tiles: int,
        num_programs: int, tile_order: str = "item") -> None:
  """Calls `unit(i, j)` for the units this program owns.

  Non-persistent: the grid is (max_items, n_tiles) (or (n_tiles, max_items) for tile_order "n"), one unit per
  program; `unit` itself exits early for padding items (start >= end). Persistent: the grid is (num_programs,);
  program p handles units w = p, p + P, ... below num_items · n_tiles (a dynamic bound: padding items are never
  visited), with (i, j) = (w mod num_items, w div num_items) for "item" order, (w div n_tiles, w mod n_tiles)
  for "n" order.
  """
  if not persistent:
    if tile_order == "item":
      unit(pl.program_id(0), pl.program_id(1))
    else:
      unit(pl.program_id(1), pl.program_id(0))
    return
  p = pl.program_id(0)
  num_items = num_items_ref[0]
  total = num_items * n_tiles
  trips = jnp.maximum((total - p + num_programs - 1) // num_programs, 0)
  safe_items = jnp.maximum(num_items, 1)

  def body(it, carry):
    w = p + it * num_programs
    if tile_order == "item":
      unit(w % safe_items, w // safe_items)
    else:
      unit(w // n_tiles, w % n_tiles)
    return carry

  jax.lax.fori_loop(0, trips, body, jnp.int32(0))
