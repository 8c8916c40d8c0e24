"""The reference model's public API: input validation, random init, abstract shapes, all-position logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ds4jax import config, model
from ds4jax.moe import Buffer


@pytest.fixture(scope="module")
def tiny_model(module_seed):
  return model.init_random(config.tiny(), seed=module_seed, dtype=jnp.float32)


@pytest.mark.parametrize("tokens, message", [
    ([], "non-empty 1-D"),
    ([[1, 2], [3, 4]], "non-empty 1-D"),
    ([1.0, 2.0], "integers"),
    ([3, 256, 4], r"token id 256 at position 1 is outside the vocabulary \[0, 256\)"),
    ([-1], "token id -1 at position 0"),
])
def test_bad_prompts_are_rejected(tiny_model, tokens, message):
  with pytest.raises(ValueError, match=message):
    model.forward(tiny_model, tokens)


def test_too_long_prompt_is_rejected():
  cfg = config.tiny()
  with pytest.raises(ValueError, match="max_position_embeddings=128"):
    model.check_tokens(np.zeros(129, np.int32), cfg)


def test_prefix_logits_do_not_depend_on_later_tokens(tiny_model, rng):
  """Causality across every layer kind: the first positions' logits ignore what follows."""
  tokens = rng.integers(2, 256, 40)
  other = tokens.copy()
  other[25:] = rng.integers(2, 256, 15)
  a, b = np.asarray(model.forward(tiny_model, tokens)), np.asarray(model.forward(tiny_model, other))
  np.testing.assert_array_equal(a[:25], b[:25])
  assert np.abs(a[25:] - b[25:]).max() > 1e-3


def test_random_init_is_seeded_and_lives_on_the_default_device(seed):
  cfg = config.tiny_window()
  a, b = model.init_random(cfg, seed), model.init_random(cfg, seed)
  c = model.init_random(cfg, seed + 1)
  la, lb, lc = (jax.tree.leaves(nnx.state(x)) for x in (a, b, c))
  assert all(bool((x == y).all()) for x, y in zip(la, lb))
  assert not bool((la[0] == lc[0]).all())
  assert all(x.devices() == {jax.devices()[0]} for x in la)
  assert a.embed.dtype == jnp.bfloat16 and a.layers[0].hc_attn.fn.dtype == jnp.float32


def test_hash_tables_hold_distinct_experts(seed):
  m = model.init_random(config.tiny_window(), seed)
  table = np.asarray(m.layers[0].ffn.gate.tid2eid[...])
  assert table.shape == (256, 2) and table.min() >= 0 and table.max() < 8
  assert (np.sort(table, axis=1)[:, 1:] != np.sort(table, axis=1)[:, :-1]).all()


@pytest.mark.parametrize("preset", ["v4_flash", "v4_pro"])
def test_abstract_full_model_has_the_counted_parameters(preset):
  """The NNX structure of the full models (no memory) agrees with the config's parameter count."""
  cfg = config.preset(preset)
  m = model.abstract_model(cfg)
  n = sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  assert n == cfg.param_counts()["total"]
  tables = jax.tree.leaves(nnx.state(m, Buffer))
  assert len(tables) == 3 and tables[0].shape == (129280, 6)
