"""What one attention layer carries from a prefill band to the next (and, later, to decode).

    kv_tail     [W-1, d]    rotated raw KV rows of positions [s0 - W + 1, s0): the window of the next band's first query
    x_tail      [2m, D]     attention input of positions [a - m, a + m), a = s0 // m · m: the window in progress and
                            the one before it (compressor.extend)            — compressed layers only
    rows        [R, d]      compressed rows, row w at index w (rows not yet complete are garbage, invisible by position)
    index_rows  [R, ci]     the indexer's compressed keys, same layout        — CSA layers only

Shapes are static for a given (prompt capacity, band size), so every band of a layer reuses one compiled step.
Positions before 0 hold zeros and are masked by position, never by value.

Prefill keeps every array in f32. A decode state may store kv_tail, rows and index_rows in bf16 (`dtype`); x_tail,
the compressor's input for windows not yet pooled, stays f32 so that a row is pooled from exact inputs and rounded
once, when it is stored (docs/decode.md §1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ds4jax.config import Attention, DeepseekV4Config

F32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
  kv_tail: jax.Array
  x_tail: jax.Array | None = None
  rows: jax.Array | None = None
  index_rows: jax.Array | None = None


def row_capacity(capacity: int, band: int, ratio: int) -> int:
  """Rows a layer must hold for bands of `band` tokens over `capacity` positions (capacity % band == 0).

  The last band starts at capacity - band and pools windows from (its start // ratio) on, 2 + band // ratio of
  them at most (compressor.pool on 3·ratio + band rows), so nothing ever writes past this.
  """
  last_start = capacity - band
  return last_start // ratio + (3 * ratio + band) // ratio - 1


def empty(cfg: DeepseekV4Config, layer: int, capacity: int, band: int, rows: int | None = None,
          dtype=F32) -> LayerCache:
  """The state before position 0, for a prompt padded to `capacity` positions processed in bands of `band`
  (`rows`: that many compressed rows instead, for bands of several widths: ds4jax/decode.py; `dtype`: of the
  cached KV rows and indexer keys)."""
  if capacity % band:
    raise ValueError(f"capacity {capacity} must be a multiple of the band size {band}")
  kind, d = cfg.attention[layer], cfg.head_dim
  kv_tail = jnp.zeros((cfg.sliding_window - 1, d), dtype)
  if kind is Attention.WINDOW:
    return LayerCache(kv_tail)
  m = cfg.compress_ratio(layer)
  R = row_capacity(capacity, band, m) if rows is None else rows
  return LayerCache(kv_tail, x_tail=jnp.zeros((2 * m, cfg.hidden_size), F32), rows=jnp.zeros((R, d), dtype),
                    index_rows=jnp.zeros((R, cfg.index_head_dim), dtype) if kind is Attention.CSA else None)
