"""Lightning indexer of CSA layers as Pallas-Triton kernels (docs/model.md §6, docs/upstream.md §3)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas.indexer.config import Config, default_platform
from kernels_pallas.indexer.handoff import mask_from_topk, rows_from_mask, selected_rows
from kernels_pallas.indexer.reference import n_visible, scores_reference, sort_ids, topk_reference
from kernels_pallas.indexer.scoring import scores
from kernels_pallas.indexer.topk import topk

# V4-Flash indexer (ds4jax.config.v4_flash): index_n_heads 64, index_head_dim 128, index_topk 512, csa_ratio 4.
V4_FLASH_INDEXER = dict(n_heads=64, head_dim=128, k=512, ratio=4)

__all__ = ["Config", "V4_FLASH_INDEXER", "default_platform", "lowering_cases", "mask_from_topk", "n_visible",
           "rows_from_mask", "scores", "scores_reference", "selected_rows", "sort_ids", "topk", "topk_reference"]


def lowering_cases(platform: str) -> list[tuple[str, object, tuple]]:
  """(label, fn, args) at V4-Flash shapes with the config `Config.default(..., platform=platform)` ships:
  the production `topk` over the last 8192-query chunk of a 128K prefill (q_start traced, R = 30720), by a sort
  and by the radix-selection kernel (`indexer_radix_topk`), and a direct `scores` call on a 512-query chunk
  ending at 128K (R = 32768). bf16 q/keys, f32 w."""
  s = V4_FLASH_INDEXER
  Hi, c, k, ratio = s["n_heads"], s["head_dim"], s["k"], s["ratio"]
  sds = jax.ShapeDtypeStruct
  cases = []

  T, q_start = 8192, 122880 - 8192
  R = (q_start + T) // ratio
  cfg = Config.default(T, R, Hi, c, platform=platform)

  def topk_fn(q, w, keys, qs, cfg=cfg):
    return topk(q, w, keys, q_start=qs, k=k, ratio=ratio, config=cfg)

  args = (sds((T, Hi, c), jnp.bfloat16), sds((T, Hi), jnp.float32), sds((R, c), jnp.bfloat16), sds((), jnp.int32))
  cases.append((f"indexer topk {T} q @ {q_start} (R {R}) {platform}", topk_fn, args))

  def radix_topk_fn(q, w, keys, qs, cfg=dataclasses.replace(cfg, selection="radix")):
    return topk(q, w, keys, q_start=qs, k=k, ratio=ratio, config=cfg)

  cases.append((f"indexer radix topk {T} q @ {q_start} (R {R}) {platform}", radix_topk_fn, args))

  T2, q_start2 = 512, 131072 - 512
  R2 = (q_start2 + T2) // ratio
  cfg2 = Config.default(T2, R2, Hi, c, platform=platform)

  def scores_fn(q, w, keys, cfg=cfg2):
    return scores(q, w, keys, q_start=q_start2, ratio=ratio, config=cfg2)

  cases.append((f"indexer scores {T2} q @ {q_start2} (R {R2}) {platform}", scores_fn,
                (sds((T2, Hi, c), jnp.bfloat16), sds((T2, Hi), jnp.float32), sds((R2, c), jnp.bfloat16))))
  return cases
