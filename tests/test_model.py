"""The reference model's public API: input validation, random init, abstract shapes, all-position logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ds4jax import config, layers, model
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
  """Causality across every layer kind: the first positions' logits ignore what follows. (45 tokens: the program of
  tests/test_prefill.py's reference forward, in a full run loaded from the shared compilation cache.)"""
  tokens = rng.integers(2, 256, 45)
  other = tokens.copy()
  other[25:] = rng.integers(2, 256, 20)
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


def init_statistics(m, tokens) -> tuple[np.ndarray, float, float]:
  """(update / stream per layer, mean next-token entropy in nats, mean max probability) of a forward pass."""
  logits, streams = model.forward(m, tokens, return_streams=True)
  X = np.asarray(streams, np.float64)
  ratios = np.array([np.linalg.norm(X[i + 1] - X[i]) / np.linalg.norm(X[i]) for i in range(len(X) - 1)])
  logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32)), np.float64)
  p = np.exp(logp)
  return ratios, float(np.mean(-(p * logp).sum(-1))), float(np.mean(p.max(-1)))


def conditioned(ratios, entropy, max_p, vocab) -> bool:
  """docs/model.md §12: each layer's update 0.1-0.3 of the stream; a peaked next-token distribution."""
  return bool((ratios > 0.1).all() and (ratios < 0.3).all() and entropy < 0.6 * np.log(vocab) and max_p > 25 / vocab)


def test_random_init_is_conditioned_like_a_trained_model(tiny_model, rng):
  """tiny has every layer kind (window, CSA, HCA; hash and top-k MoE). Negative control: the earlier init's head
  (std 0.02: near-uniform logits) or its residual writes (std 0.02: updates well under 0.1 of the stream) fail."""
  m = nnx.clone(tiny_model)
  tokens = rng.integers(0, m.cfg.vocab_size, 32)
  ratios, entropy, max_p = init_statistics(m, tokens)
  print(f"tiny: update/stream {np.round(ratios, 3)}, entropy {entropy:.2f} of {np.log(m.cfg.vocab_size):.2f}, "
        f"max p {max_p:.3f}")
  assert conditioned(ratios, entropy, max_p, m.cfg.vocab_size)
  head = m.head.weight[...]
  m.head.weight[...] = head * (0.02 / (model.LOGIT_STD / m.cfg.hidden_size ** 0.5))
  assert not conditioned(*init_statistics(m, tokens), m.cfg.vocab_size)
  m.head.weight[...] = head
  for block in m.layers:  # the residual writes at the old std 0.02 instead of RESIDUAL_GAIN / sqrt(fan_in)
    for w in (block.attn.wo_b.weight, block.ffn.experts.w2, block.ffn.shared_experts.w2.weight):
      w[...] = w[...] * (0.02 / (layers.RESIDUAL_GAIN / w[...].shape[-1] ** 0.5))
  assert not conditioned(*init_statistics(m, tokens), m.cfg.vocab_size)
