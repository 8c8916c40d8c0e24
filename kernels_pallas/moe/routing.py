"""On-device, static-shape routing metadata for the grouped MoE kernels (plain XLA, no Pallas).

The S·K (token, slot) routes are sorted by expert (stable, so rows of one expert keep token order); masked routes
(id −1, and ids outside [0, E), which jit cannot reject — see `check_routes`) go to the tail and are dropped.
Expert e owns sorted rows [offsets[e], offsets[e+1]). The row space has the static size R = S·K; rows at or after
`num_rows` are never computed or read.

Work items: each expert with c rows contributes ceil(c / block_m) row tiles (expert, row_start, row_end = the
expert's end). The compact list holds only those, in expert order, padded to the static maximum
`max_work_items(R, E, block_m)` with invalid items (expert −1, start = end = 0) — an empty expert costs nothing.
`dense_work_items` builds the non-compact alternative (every expert × the worst-case tile count, empty ones having
start >= end), for the `compact_queue=False` baseline. The kernels treat start >= end as "exit at once".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

I32 = jnp.int32


def max_work_items(num_routes: int, num_experts: int, block_m: int) -> int:
  """Static bound on sum_e ceil(c_e / bm) given sum_e c_e <= R and at most min(E, R) non-empty experts:
  each non-empty expert pads its last tile by at most bm − 1 rows."""
  nonempty = min(num_experts, num_routes)
  return max(1, (num_routes + nonempty * (block_m - 1)) // block_m)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
  """Routing metadata; every array is int32 and lives on device. A pytree (block_m, num_experts, top_k static).

  route_of_row   [R]     flat route (t·K + k) held by sorted row r (masked routes fill the tail).
  token_of_row   [R]     token of sorted row r (0 for rows >= num_rows, so gathers stay in bounds).
  row_of_route   [S, K]  inverse permutation: sorted row of route (t, k), −1 for a masked route.
  group_sizes    [E]     rows per expert.
  group_offsets  [E+1]   exclusive prefix sum of group_sizes; group_offsets[E] = num_rows.
  item_expert    [T]     compact work list: expert of item i (−1 for padding items)
  item_start     [T]     first sorted row of the item's tile
  item_end       [T]     end of the item's expert (rows >= item_end are masked); 0 for padding
  num_items      [1]     number of valid items (a prefix of the list)
  num_rows       [1]     number of unmasked routes
  """

  route_of_row: jax.Array
  token_of_row: jax.Array
  row_of_route: jax.Array
  group_sizes: jax.Array
  group_offsets: jax.Array
  item_expert: jax.Array
  item_start: jax.Array
  item_end: jax.Array
  num_items: jax.Array
  num_rows: jax.Array
  block_m: int = dataclasses.field(metadata=dict(static=True))
  num_experts: int = dataclasses.field(metadata=dict(static=True))
  top_k: int = dataclasses.field(metadata=dict(static=True))

  @property
  def num_routes(self) -> int:
    return self.route_of_row.shape[0]

  @property
  def max_items(self) -> int:
    return self.item_expert.shape[0]


def check_routes(route_ids, num_experts: int) -> None:
  """Host-side validation (jit cannot raise): ids must be in [0, E) or −1 (masked). No-op for tracers."""
  if isinstance(route_ids, jax.core.Tracer):
    return
  ids = np.asarray(route_ids)
  if ids.ndim != 2:
    raise ValueError(f"route_ids must be [S, K], got shape {ids.shape}")
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"route_ids must be integers, got dtype {ids.dtype}")
  bad = (ids < -1) | (ids >= num_experts)
  if bad.any():
    t, k = (int(v) for v in np.argwhere(bad)[0])
    raise ValueError(f"route_ids[{t}, {k}] = {int(ids[t, k])} is out of range: expert ids must be in "
                     f"[0, {num_experts}) or -1 (masked); {int(bad.sum())} bad route(s)")


def route(route_ids: jax.Array, num_experts: int, block_m: int) -> Routing:
  """Sorts routes by expert and builds the compact work list. Pure jnp, jit-friendly, static shapes."""
  S, K = route_ids.shape
  E, R = num_experts, S * K
  flat = route_ids.reshape(R).astype(I32)
  valid = (flat >= 0) & (flat < E)
  key = jnp.where(valid, flat, E)                                   # masked → bucket E, sorted last
  order = jnp.argsort(key, stable=True).astype(I32)                 # sorted row → flat route
  counts = jnp.zeros((E + 1,), I32).at[key].add(1)
  group_sizes = counts[:E]
  group_offsets = jnp.concatenate([jnp.zeros((1,), I32), jnp.cumsum(group_sizes, dtype=I32)])
  num_rows = group_offsets[E]
  rows = jnp.arange(R, dtype=I32)
  row_of_route = jnp.zeros((R,), I32).at[order].set(rows)
  row_of_route = jnp.where(valid, row_of_route, -1).reshape(S, K)
  token_of_row = jnp.where(rows < num_rows, order // K, 0)

  tiles = (group_sizes + block_m - 1) // block_m
  tile_ends = jnp.cumsum(tiles, dtype=I32)                          # inclusive
  num_items = tile_ends[E - 1]
  T = max_work_items(R, E, block_m)
  i = jnp.arange(T, dtype=I32)
  # expert whose tile range holds item i; compare_all fuses (the default 'scan' is a while loop of small launches)
  e = jnp.searchsorted(tile_ends, i, side="right", method="compare_all").astype(I32)
  item_ok = i < num_items
  e_c = jnp.minimum(e, E - 1)
  tile_in_expert = i - (tile_ends[e_c] - tiles[e_c])
  start = group_offsets[e_c] + tile_in_expert * block_m
  end = group_offsets[e_c + 1]
  return Routing(
      route_of_row=order, token_of_row=token_of_row, row_of_route=row_of_route,
      group_sizes=group_sizes, group_offsets=group_offsets,
      item_expert=jnp.where(item_ok, e_c, -1), item_start=jnp.where(item_ok, start, 0),
      item_end=jnp.where(item_ok, end, 0), num_items=num_items.reshape(1), num_rows=num_rows.reshape(1),
      block_m=block_m, num_experts=E, top_k=K)


def dense_work_items(r: Routing) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The non-compact work list: every expert × ceil(R / block_m) tiles (the most one expert can hold), expert
  major. Items past an expert's rows have start >= end and exit at once. Returns (expert, start, end, count[1])."""
  E, bm = r.num_experts, r.block_m
  per_expert = -(-r.num_routes // bm)
  e = jnp.repeat(jnp.arange(E, dtype=I32), per_expert)
  t = jnp.tile(jnp.arange(per_expert, dtype=I32), E)
  start = r.group_offsets[e] + t * bm
  end = r.group_offsets[e + 1]
  return e, start, end, jnp.full((1,), E * per_expert, I32)


def single_group(num_tokens: int, block_m: int) -> Routing:
  """Identity routing of S tokens to one expert (the shared expert runs through the same grouped kernels)."""
  return route(jnp.zeros((num_tokens, 1), I32), 1, block_m)


def routing_reference(route_ids, num_experts: int, block_m: int) -> dict:
  """Numpy version of the metadata (per-expert row lists and tile items), for tests."""
  ids = np.asarray(route_ids)
  S, K = ids.shape
  flat = ids.reshape(-1)
  rows_of = [np.flatnonzero(flat == e) for e in range(num_experts)]
  items, start = [], 0
  for e, routes in enumerate(rows_of):
    for t0 in range(0, len(routes), block_m):
      items.append((e, start + t0, start + len(routes)))
    start += len(routes)
  return dict(rows_of=rows_of, sizes=np.array([len(r) for r in rows_of]), items=items, num_rows=start)
