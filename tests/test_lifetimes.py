"""Device buffers outlive the work that reads them, and a failed load leaves nothing behind: upstream's review items
1 and 2 (docs/upstream.md §8), as they apply to a JAX program."""

import gc
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax import config, model, prefill
from ds4jax.checkpoint import mapping
from ds4jax.checkpoint.safetensors_reader import CheckpointError, SafetensorsCheckpoint
from ds4jax.checkpoint.safetensors_writer import save_file

GOLDEN = pathlib.Path(__file__).parent / "goldens" / "mixed"


def test_review_1_freeing_an_input_waits_for_queued_work():
  """Upstream freed buffers before the queued device work that read them had run. Here an array deleted right
  after a dispatch (before the result is ready) is released only when that work is done: the result is exact."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(512, 512)), jnp.float32)
  want = np.asarray(x) @ np.asarray(x).T
  chain = jax.jit(lambda a: [a @ a.T for _ in range(8)][-1])
  y = chain(x)  # asynchronous: likely still running
  x.delete()
  assert x.is_deleted()
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-3)


def test_review_1_a_donated_cache_is_consumed_not_reused():
  """Prefill donates each layer's cache to its step: the old buffer is gone after the call (reading it raises
  instead of returning stale values). Decode keeps its states alive instead: tests/test_decode.py."""
  m = model.init_random(config.tiny_window(), seed=0, dtype=jnp.float32)
  X = m.embed_streams(jnp.arange(1, 9))
  cache = m.layers[0].attn.empty_cache(8, 8)
  kv = cache.kv_tail
  prefill.layer_step(m.layers[0], X, jnp.arange(1, 9), 0, cache, prefill.REFERENCE)
  assert kv.is_deleted()
  with pytest.raises(RuntimeError, match="deleted"):
    np.asarray(kv)


def live_bytes() -> int:
  gc.collect()
  return sum(a.nbytes for a in jax.live_arrays())


def test_review_2_a_failed_load_leaves_no_model_and_no_buffers(tmp_path):
  """Upstream's failed drafter load left a half-built context allocated. A checkpoint whose last weight is broken
  fails after every other weight went to the device; afterwards no device buffer of it is alive."""
  with SafetensorsCheckpoint(GOLDEN) as ckpt:
    tensors = {n: np.array(ckpt.read(n)) for n in ckpt.names()}
  tensors["head.weight"] = tensors["head.weight"][:, :-1]  # loaded last: every other weight is on the device
  (tmp_path / "config.json").write_bytes((GOLDEN / "config.json").read_bytes())
  save_file(tmp_path / "model.safetensors", tensors)
  good = mapping.load_checkpoint(GOLDEN, dtype=jnp.float32, log=None)
  size = sum(np.asarray(v).nbytes for _, v in mapping.weights(good))
  del good
  before = live_bytes()
  with pytest.raises(CheckpointError, match="head.weight"):
    mapping.load_checkpoint(tmp_path, dtype=jnp.float32, log=None)
  assert live_bytes() == before
  kept = mapping.load_checkpoint(GOLDEN, dtype=jnp.float32, log=None)  # and a model that loads does stay
  assert live_bytes() >= before + size
  del kept
