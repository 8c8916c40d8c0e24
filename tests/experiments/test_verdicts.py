"""experiments/verdicts.py: per-layer pinned parity and decision accounting pass the real paths and fail every
planted bug of experiments/mutations.py (the tiny_sparse model: window, CSA, HCA, CSA layers)."""

import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax import config, features, model
from experiments import mutations, verdicts

DEVICE = "cpu_interpret"
SUPPORTED = [s for s, cap in features.CAPABILITIES[DEVICE].items() if cap.supported]


@pytest.fixture(scope="module")
def tiny(module_seed):
  m = model.init_random(config.tiny_sparse(), seed=module_seed, dtype=jnp.float32)
  return m, np.random.default_rng(module_seed).integers(0, m.cfg.vocab_size, 32)


def exact():
  return features.resolve(DEVICE, {s: False for s in features.SWITCHES})


def test_flips_are_near_ties_or_named():
  scores = np.array([[3.0, 2.0, 1.0, 0.999999, -np.inf]])
  want = np.array([[0, 1, 2]])
  n, bad = verdicts.flips(want, scores, np.array([[0, 1, 3]]), 2.0 ** -8, 7, "route")
  assert n == 1 and bad == []  # 1.0 vs 0.999999: within 16 bf16 roundings of the scale 3
  n, bad = verdicts.flips(want, scores, np.array([[1, 2, 3]]), 2.0 ** -8, 7, "route")
  assert n == 1 and len(bad) == 1 and bad[0].gap == pytest.approx(3.0 - 0.999999) and bad[0].layer == 7
  n, bad = verdicts.flips(want, scores, np.array([[0, 1, 4]]), 2.0 ** -8, 7, "index")  # an invisible row
  assert n == 1 and bad[0].gap == np.inf and bad[0].kind == "index"
  n, bad = verdicts.flips(want, scores, np.array([[0, 1, -1]]), 2.0 ** -8, 7, "index")  # a row left out
  assert n == 1 and bad[0].gap == np.inf
  assert verdicts.flips(want, scores, np.array([[2, 0, 1]]), 2.0 ** -24, 0, "route") == (0, [])  # order is free


def test_update_nmse_ignores_the_residual(rng):
  x = rng.normal(size=(8, 4)) * 100
  upd = rng.normal(size=(8, 4))
  nmse, max_abs = verdicts.update_errors(*(jnp.asarray(a, jnp.float32) for a in (x + 1.1 * upd, x + upd, x)))
  assert nmse == pytest.approx(0.01, rel=1e-3) and max_abs == pytest.approx(0.1 * np.abs(upd).max(), rel=1e-3)
  # A layer whose exact update is zero: no error is 0, any error is inf (as the qualification's NMSE).
  same = jnp.asarray(x, jnp.float32)
  assert verdicts.update_errors(same, same, same)[0] == 0.0
  assert verdicts.update_errors(same + jnp.asarray(upd, jnp.float32), same, same)[0] == np.inf


def test_every_fast_path_passes(tiny):
  """Every CPU-advertised switch at once, bf16 operands (the device default): each layer within 4x the bf16
  reference math, every flip a near-tie. A CSA layer: the indexer, sparse MLA and MoE kernels at once (each
  kernel's parity on every layer kind, on f32 operands, is tests/test_model_features.py's)."""
  m, ids = tiny
  cfg = features.resolve(DEVICE, {s: s in SUPPORTED for s in features.SWITCHES})
  lines = []
  out = verdicts.layer_verdicts(m, ids, cfg, log=lines.append, only={1})
  print("\n".join(lines))
  assert [v.layer for v in out] == [1] and all(v.passed for v in out), lines
  assert all(v.reference_bf16_nmse > 1e-9 and v.bound <= verdicts.ABS_CAP for v in out)


# (mutation, layer): a layer of the kind the bug lives in
PLANTED = [("dropped_sink", 0), ("expert_scale_step", 1), ("window_off_by_one", 0), ("index_topk_minus_one", 3),
           ("routed_scale_dropped", 2), ("compressor_bias_dropped", 2)]


def test_planted_covers_every_mutation():
  assert sorted(name for name, _ in PLANTED) == sorted(mutations.MUTATIONS)


@pytest.mark.parametrize("name, layer", PLANTED)
def test_every_planted_bug_fails(tiny, name, layer):
  m, ids = tiny
  run = mutations.run_layer(mutations.MUTATIONS[name], {layer})
  lines = []
  out = verdicts.layer_verdicts(m, ids, exact(), run_layer=run, log=lines.append, only={layer})
  print("\n".join(lines))
  assert [v.layer for v in out] == [layer] and not out[0].passed, lines
