"""The two ways the indexer's picks reach sparse attention (docs/upstream.md §3, `DFLASH_DS4_DIRECT_INDEXER_TOPK`).

* direct path: the [T, k] int32 ids from `topk` (ascending, −1 tail) go straight to attention.
* mask path (upstream default): the ids become an additive [T, n_rows] 0/−inf mask (`mask_from_topk`,
  upstream `ggml_ds4_indexer_mask`); the attention kernel scans it and rebuilds the selected rows in ascending
  physical-row order (`rows_from_mask`, upstream `ds4_fa_indexed_rows_kernel`).

Both deliver the same ascending row list to attention, so attention reduces over the same rows in the same order
and its output is byte-identical; `selected_rows` is the switch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

I32 = jnp.int32


def mask_from_topk(indices, n_rows: int, dtype=jnp.float32) -> jax.Array:
  """[T, n_rows] additive mask: 0 at the rows listed in `indices` [T, k] (−1 = none), −inf elsewhere."""
  if indices.ndim != 2:
    raise ValueError(f"indices must be [T, k], got shape {tuple(indices.shape)}")
  T = indices.shape[0]
  safe = jnp.where((indices >= 0) & (indices < n_rows), indices, n_rows)  # −1 → a spill column, dropped
  hit = jnp.zeros((T, n_rows + 1), bool).at[jnp.arange(T)[:, None], safe].set(True)[:, :n_rows]
  return jnp.where(hit, 0.0, -jnp.inf).astype(dtype)


def rows_from_mask(mask, k: int) -> jax.Array:
  """int32 [T, k]: the rows whose mask entry is not −inf, ascending, then −1 (a scan of the mask, as upstream's
  attention kernel does). More than k selected rows in a query raises nothing (jit); the extra rows are dropped."""
  if mask.ndim != 2:
    raise ValueError(f"mask must be [T, n_rows], got shape {tuple(mask.shape)}")
  T, n = mask.shape
  sel = ~jnp.isneginf(mask)
  slot = jnp.cumsum(sel, axis=1, dtype=I32) - 1  # rank of each selected row in physical order
  slot = jnp.where(sel & (slot < k), slot, k)    # unselected / overflow → spill slot
  rows = jnp.broadcast_to(jnp.arange(n, dtype=I32), (T, n))
  out = jnp.full((T, k + 1), -1, I32).at[jnp.arange(T)[:, None], slot].set(rows, mode="drop")
  return out[:, :k]


def selected_rows(indices, n_rows: int, *, direct_indexer_topk: bool = True) -> jax.Array:
  """The row list attention consumes: `indices` itself (direct) or the mask path's rebuild (identical)."""
  if direct_indexer_topk:
    return indices
  return rows_from_mask(mask_from_topk(indices, n_rows), indices.shape[1])
