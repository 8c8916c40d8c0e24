"""experiments/parity_by_switch.py: the variants it builds and its per-layer local errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax import config, features, model
from experiments import parity_by_switch as pbs

ALL = {s: features.CAPABILITIES["cpu_interpret"][s].supported and s not in ("moe_sparse_gate_up", "moe_persistent")
       for s in features.SWITCHES}


def test_variants_split_the_switches():
  v = pbs.variants(features.resolve("cpu_interpret", ALL))
  assert v["all_on"].bf16_matmul and not v["all_on_f32"].bf16_matmul
  assert v["reference_bf16"].on() == ["bf16_matmul"]
  assert v["attention_f32"].on() and all(not s.startswith("moe_") and s != "bf16_matmul"
                                         for s in v["attention_f32"].on())
  assert v["moe_f32"].on() and all(s.startswith("moe_") for s in v["moe_f32"].on())
  assert set(v["attention_f32"].on()) | set(v["moe_f32"].on()) == set(v["all_on_f32"].on())


def test_update_nmse_ignores_the_residual(rng):
  x = rng.normal(size=(8, 4)) * 100
  upd = rng.normal(size=(8, 4))
  nmse, max_abs = pbs.update_errors(*(jnp.asarray(a, jnp.float32) for a in (x + 1.1 * upd, x + upd, x)))
  assert nmse == pytest.approx(0.01, rel=1e-3) and max_abs == pytest.approx(0.1 * np.abs(upd).max(), rel=1e-3)
  # A layer whose exact update is zero: no error is 0, any error is inf (as the qualification's NMSE).
  same = jnp.asarray(x, jnp.float32)
  assert pbs.update_errors(same, same, same)[0] == 0.0
  assert pbs.update_errors(same + jnp.asarray(upd, jnp.float32), same, same)[0] == np.inf


def test_per_layer_errors_are_local(rng, seed):
  """f32 kernels: every layer's own error is tiny; bf16 operands: every layer's is real, and small where no discrete
  choice flips (a token whose expert choice flips under the rounding lifts a layer's error to ~1e-3..1e-2; seen in
  about 1 layer in 12 here, so only one small layer is required)."""
  m = model.init_random(config.tiny_sparse(), seed=seed, dtype=jnp.float32)
  ids = rng.integers(0, m.cfg.vocab_size, 37).astype(np.int32)
  v = pbs.variants(features.resolve("cpu_interpret", ALL))
  lines = []
  rows = pbs.per_layer(m, ids, features.REFERENCE, {k: v[k] for k in ("all_on_f32", "reference_bf16")},
                       lines.append)
  assert [r["layer"] for r in rows] == list(range(m.cfg.num_layers)) and len(lines) == m.cfg.num_layers
  assert [r["attention"] for r in rows] == [a.value for a in m.cfg.attention]
  bf16 = [r["variants"]["reference_bf16"]["update_nmse"] for r in rows]
  assert all(r["variants"]["all_on_f32"]["update_nmse"] < 1e-8 for r in rows)
  assert min(bf16) > 1e-12 and min(bf16) < 1e-3
