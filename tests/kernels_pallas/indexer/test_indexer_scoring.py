"""Indexer scoring kernel (kernels_pallas/indexer/scoring.py) against the f32 reference, interpreted on CPU and
compiled on a GPU (INTERPRET follows the default backend)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.mla.reference import visible_rows
from ds4jax.features import float_min_max, pallas_calls
from kernels_pallas.indexer import Config, lowering_cases, scores, scores_reference
from indexer_inputs import INTERPRET, make_inputs


def cfg(bq=16, br=16, **kw):
  return Config(block_q=bq, block_r=br, num_warps=4, num_stages=1, **kw)


def assert_scores_close(got, want, rtol=2e-6):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == np.float32
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))  # same visibility pattern
  vis = np.isfinite(want)
  assert np.isfinite(got[vis]).all()
  if vis.any():
    scale = np.abs(want[vis]).max()
    err = np.abs(got[vis] - want[vis]).max()
    assert err <= rtol * scale, (err, scale)


@pytest.mark.parametrize("T,Hi,c,R,q_start,bq,br", [
    (40, 3, 32, 50, 0, 16, 32),        # from position 0: the first 3 queries see nothing; T, R not tile multiples
    (64, 4, 16, 40, 95, 32, 16),       # q_start+1 on a ratio boundary (96); rows run out before the last query
    (37, 2, 24, 128, 400, 16, 64),     # head_dim 24: padded to 32 in-tile; wholly invisible row tiles exit early
    (5, 2, 16, 32751, 131000, 16, 512),  # a short query tile deep in a 128K prefill
])
def test_scores_match_reference_f32(T, Hi, c, R, q_start, bq, br):
  q, w, keys = make_inputs(T * 7 + R, T, Hi, c, R)
  got = scores(q, w, keys, q_start=q_start, config=cfg(bq, br), interpret=INTERPRET)
  want = scores_reference(q, w, keys, q_start=q_start)
  assert_scores_close(got, want)
  # visibility is the attention reference's visible_rows at the absolute positions
  vis = visible_rows(q_start + jnp.arange(T), R, 4)
  np.testing.assert_array_equal(np.isfinite(np.asarray(got)), np.asarray(vis))


def test_a_nan_key_makes_its_scores_nan():
  """A NaN in key row 5 makes every score of row 5 NaN, as in the reference, and no other. Compiled, a relu written
  as max(q·k, 0) turned the NaN into 0: a corrupt key would have been scored (and maybe picked) silently."""
  T, Hi, c, R = 40, 3, 32, 50
  q, w, keys = make_inputs(3, T, Hi, c, R)
  run = lambda q, w, keys: scores(q, w, keys, q_start=400, config=cfg(16, 32), interpret=INTERPRET)
  assert not float_min_max(run, q, w, keys)  # they keep a NaN in the interpreter, not compiled
  got = np.asarray(run(q, w, keys.at[5, 7].set(jnp.nan)))
  keys = keys.at[5, 7].set(jnp.nan)
  want = np.asarray(scores_reference(q, w, keys, q_start=400))
  assert np.isnan(want[:, 5]).all() and np.isnan(got[:, 5]).all()
  others = np.delete(np.arange(R), 5)
  assert_scores_close(got[:, others], want[:, others])


def test_scores_ratio_and_bf16_queries():
  """ratio 2 and bf16 inputs with f32 dots: exact products of the bf16 values (reference upcasts the same)."""
  T, Hi, c, R = 33, 3, 32, 30
  q, w, keys = make_inputs(1, T, Hi, c, R, dtype=jnp.bfloat16)
  got = scores(q, w, keys, q_start=7, ratio=2, config=cfg(16, 16), interpret=INTERPRET)
  assert_scores_close(got, scores_reference(q, w, keys, q_start=7, ratio=2))


def test_scores_bf16_compute():
  """bf16 dots (the GPU default): f32 inputs rounded once; error at bf16 level, visibility unchanged."""
  T, Hi, c, R = 48, 4, 64, 80
  q, w, keys = make_inputs(2, T, Hi, c, R)
  got = scores(q, w, keys, q_start=150, config=cfg(16, 32, compute_dtype="bfloat16"), interpret=INTERPRET)
  want = scores_reference(q, w, keys, q_start=150)
  assert_scores_close(got, want, rtol=2e-2)
  with pytest.raises(AssertionError):  # and it really is not the f32 path
    assert_scores_close(got, want, rtol=1e-6)


def test_scores_traced_q_start_one_compile():
  """q_start as a traced int32 scalar: chunks at different offsets reuse one compiled kernel."""
  T, Hi, c, R = 32, 2, 16, 64
  q, w, keys = make_inputs(3, T, Hi, c, R)
  f = jax.jit(lambda q, w, k, s: scores(q, w, k, q_start=s, config=cfg(16, 32), interpret=INTERPRET))
  for s in (0, 61, 200):
    assert_scores_close(f(q, w, keys, jnp.int32(s)), scores_reference(q, w, keys, q_start=s))
  assert f._cache_size() == 1


def test_scores_grid_and_default_config():
  """Row tiles on grid axis 0 (fastest launch axis), query tiles on axis 1; config=None works."""
  q, w, keys = make_inputs(4, 40, 2, 16, 50)
  calls = pallas_calls(lambda q, w, k: scores(q, w, k, q_start=0, config=cfg(16, 32), interpret=INTERPRET),
                       q, w, keys)
  assert calls == [("indexer_scores", (2, 3))]
  got = scores(q, w, keys, q_start=9, interpret=INTERPRET)
  # The default config computes bf16 dots on a GPU (f32 in interpret mode).
  assert_scores_close(got, scores_reference(q, w, keys, q_start=9), rtol=2e-6 if INTERPRET else 2e-2)


def test_scores_empty():
  q, w, keys = make_inputs(5, 4, 2, 16, 0)
  out = scores(q, w, keys, q_start=0, interpret=INTERPRET)
  assert out.shape == (4, 0)


@pytest.mark.parametrize("bad", ["q_rank", "w_T", "w_Hi", "c", "int_keys", "ratio", "neg_start", "float_start"])
def test_scores_rejects_bad_inputs(bad):
  q, w, keys = make_inputs(6, 8, 2, 16, 16)
  kw = dict(q_start=0)
  if bad == "q_rank":
    q = q.reshape(8, 32)
  elif bad == "w_T":
    w = w[:7]
  elif bad == "w_Hi":
    w = jnp.concatenate([w, w], axis=1)
  elif bad == "c":
    keys = keys[:, :8]
  elif bad == "int_keys":
    keys = keys.astype(jnp.int32)
  elif bad == "ratio":
    kw["ratio"] = 0
  elif bad == "neg_start":
    kw["q_start"] = -1
  elif bad == "float_start":
    kw["q_start"] = jnp.float32(3.0)
  with pytest.raises(ValueError):
    scores(q, w, keys, interpret=INTERPRET, **kw)


@pytest.mark.parametrize("field,value", [("block_q", 24), ("block_r", 8), ("num_warps", 3),
                                         ("compute_dtype", "int8"), ("query_block", 0)])
def test_config_validate(field, value):
  with pytest.raises(ValueError, match=field):
    Config(**{field: value}).validate()


def test_config_default_platforms():
  cuda = Config.default(8192, 30720, 64, 128, platform="cuda")
  rocm = Config.default(8192, 30720, 64, 128, platform="rocm")
  cpu = Config.default(100, 40, 4, 32, platform="cpu")
  assert (cuda.block_q, cuda.block_r, cuda.compute_dtype) == (128, 128, "bfloat16")
  assert (rocm.block_q, rocm.block_r, rocm.num_stages, rocm.compute_dtype) == (128, 64, 1, "bfloat16")
  assert (cpu.block_q, cpu.block_r, cpu.compute_dtype) == (32, 32, "float32")
  assert cpu.query_block % cpu.block_q == 0 and cpu.query_block >= 100
  with pytest.raises(ValueError, match="platform"):
    Config.default(8, 8, 2, 16, platform="tpu")


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_lowering_cases_lower(platform):
  """The V4-Flash lowering cases trace and lower for an abstract GPU to one scoring kernel each, followed by the
  radix-selection kernel in the radix case (the gfx1151/sm_90 compile itself runs in
  tests/kernels_pallas/test_lowering_gfx1151.py)."""
  from kernels_pallas import lowering  # pylint: disable=import-outside-toplevel
  cases = lowering_cases(platform)
  assert len(cases) == 3
  for label, fn, args in cases:
    kernels = lowering.lower_kernels(fn, args, platform)
    radix = ["indexer_radix_select"] if "radix" in label else []
    assert [k.name for k in kernels] == ["indexer_scores", *radix], label
    assert "tt.dot" in kernels[0].ttir
