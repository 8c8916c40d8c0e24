"""experiments/cache_memory.py: the decode state's bytes, against the shapes docs/decode.md derives by hand. (That they
are the bytes a real State holds after decoding: tests/test_decode.py, bf16 caches.)"""

import jax.numpy as jnp

from ds4jax import config
from experiments import cache_memory


def test_v4_flash_at_128k():
  cfg = config.v4_flash()
  cap = 131072
  csa = cache_memory.layer_arrays(cfg, 2, cap)
  hca = cache_memory.layer_arrays(cfg, 3, cap)
  # One row per 4 (CSA) / 128 (HCA) positions, plus the window in progress and the next (a band's scratch rows).
  assert csa == dict(kv_tail=(127, 512), x_tail=(8, 4096), rows=(cap // 4 + 2, 512), index_rows=(cap // 4 + 2, 128))
  assert hca == dict(kv_tail=(127, 512), x_tail=(256, 4096), rows=(cap // 128 + 1, 512))
  assert cache_memory.layer_arrays(cfg, 0, cap) == dict(kv_tail=(127, 512))
  n = sum(e for _, e in cache_memory.elements(cfg, cap))
  by_hand = 2 * 127 * 512 + 21 * (127 * 512 + 8 * 4096 + 32770 * 640) + 20 * (127 * 512 + 256 * 4096 + 1025 * 512)
  assert n == by_hand
  x_tails = 21 * 8 * 4096 + 20 * 256 * 4096  # kept in f32 by a bf16 state (docs/decode.md §1)
  bf16 = 2 * (by_hand - x_tails) + 4 * x_tails
  assert sum(cache_memory.layer_bytes(cfg, cap)) == 4 * by_hand
  assert sum(cache_memory.layer_bytes(cfg, cap, jnp.bfloat16)) == bf16
  text = cache_memory.table(cfg, [cap])
  assert f"131072 positions: {4 * by_hand / 2**20:.1f} MiB in f32, {bf16 / 2**20:.1f} MiB in bf16" in text
  assert "| 131072 | heavily_compressed_attention | 20 | " in text and "| 6.25 | 5.12 |" in text
