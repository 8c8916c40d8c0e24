"""The Hopper (sm_90) Mosaic GPU MLA kernel (kernels_pallas/mla/stream_wgmma.py) against the exact reference: its
key lists against the reference's key sets; the kernel in Mosaic GPU's interpreter on CPU (rows gathered by XLA,
the race detector on) and compiled on a GPU (rows gathered in the kernel); its lowering for sm_90 at V4-Flash
shapes, offline.

64 heads of dim 512 (the only shape it takes), bf16 q / KV. Precision "bf16" (bf16 softmax weights and output): the
bound is bf16's rounding (NMSE ≤ 2e-5, measured ~5e-6). Precision "split" (the weights in three bf16 parts, f32
output): NMSE ≤ 1e-12 (interpreter 2e-14 to 1.2e-13; two parts, as Triton's "split", give ~1e-11). Compiled on the
H200 the split path needs its short accumulator chains (stream_wgmma's docstring): with one chain each the same
problems measured 1.3e-12 to 1.8e-12."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # the race detector's state

from ds4jax.metrics import nmse
from kernels_pallas.mla.reference import selected_bias, sparse_mla_reference, visible_rows, window_bias
from kernels_pallas.mla.stream_wgmma import key_slots, sparse_mla_wgmma, split3

ON_GPU = jax.default_backend() == "gpu"
H, D, W = 64, 512, 128
FREQS = np.linspace(1.0, 1e-3, 32).astype(np.float32)
RATIO = {"csa": 4, "hca": 128, "window": 1}


def problem(rng, kind, T, q_start, k=64):
  """Inputs of one layer's band of T queries from q_start, raw rows from the first query's window start (which may
  lie before position 0), the compressed rows every query could see, and CSA indices (sorted, −1 padded, some of
  them not visible: the kernel must mask those)."""
  ratio = RATIO[kind]
  raw_start = q_start - (W - 1)
  N = T + W - 1
  R = max(1, (q_start + T) // ratio) if kind != "window" else 0
  x = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  idx = None
  if kind == "csa":
    idx = np.full((T, k), -1, np.int32)
    for t in range(T):
      pick = np.sort(rng.permutation(R)[:k - 8])  # a few of them beyond what query t sees
      idx[t, :pick.size] = pick
    idx = jnp.asarray(idx)
  args = (x(T, H, D), x(N, D), x(R, D) if R else None, jnp.asarray(rng.standard_normal(H), jnp.float32))
  return args, dict(q_start=q_start, raw_start=raw_start, kind=kind, ratio=ratio, window=W, inv_freq=FREQS,
                    indices=idx)


@pytest.mark.parametrize("kind,q_start", [("csa", 40), ("csa", 300), ("hca", 250), ("window", 3)])
def test_key_slots_are_the_reference_key_sets(rng, kind, q_start):
  (q, raw, comp, _), kw = problem(rng, kind, 6, q_start)
  T, N = q.shape[0], raw.shape[0]
  R = 0 if comp is None else comp.shape[0]
  slots = np.asarray(key_slots(T, q_start, kw["raw_start"], N, R, kind=kind, ratio=kw["ratio"], window=W,
                               indices=kw["indices"]))
  assert slots.shape[1] % 64 == 0
  p = jnp.asarray(q_start) + jnp.arange(T)
  bias = window_bias(p, kw["raw_start"] + jnp.arange(N), W)
  if kind != "window":
    vis = jnp.where(visible_rows(p, R, kw["ratio"]), 0.0, -jnp.inf)
    bias = jnp.concatenate([bias, vis + (selected_bias(kw["indices"], R) if kind == "csa" else 0.0)], axis=1)
  want = np.asarray(bias) == 0
  for t in range(T):
    live = slots[t][slots[t] >= 0]
    assert len(set(live.tolist())) == live.size  # no key twice (it would count twice in the softmax)
    np.testing.assert_array_equal(np.sort(live), np.flatnonzero(want[t]))
  assert (slots >= 0).sum() > T  # real key sets, not empty


BOUND = {"bf16": (jnp.bfloat16, 2e-5), "split": (jnp.float32, 1e-12)}


@pytest.mark.parametrize("precision", ["bf16", "split"])
@pytest.mark.parametrize("kind,q_start", [("csa", 300), ("hca", 250), ("window", 3)])
def test_stream_wgmma_matches_reference(rng, kind, q_start, precision):
  # 5 queries on 2 CTAs (3 and 2 queries each: the gathering warpgroup runs ahead into the next query, whose q
  # waits for the previous output): the window stages (some positions before 0 at q_start 3), then the compressed
  # rows (CSA: 64 slots, 8 empty and some not visible; HCA: every row, the unseen masked)
  args, kw = problem(rng, kind, 5, q_start)
  # finished before the race check and the reference: dispatch is asynchronous, the detector fills in while the
  # interpreter runs, and work dispatched beside a running interpreter deadlocked it on two cores (CI, 2026-12-04)
  out = jax.block_until_ready(sparse_mla_wgmma(*args, num_sms=2, precision=precision, interpret=not ON_GPU, **kw))
  if not ON_GPU:
    assert not interpret_pallas_call.get_races().races_found
  ref = sparse_mla_reference(*(None if a is None else a.astype(jnp.float32) for a in args[:3]), args[3], **kw)
  dtype, bound = BOUND[precision]
  assert out.dtype == dtype and float(jnp.mean(jnp.abs(ref))) > 0.02
  err = nmse(out.astype(jnp.float32), ref)
  print(f"{kind} q_start {q_start} {precision}: NMSE {err:.2e}")
  assert err <= bound, err


def test_stream_wgmma_sink_of_minus_inf_is_a_plain_softmax(rng):
  """A sink of −∞ is a plain softmax (docs/model.md §4). The online max starts at the sink, and the first key stage
  of a band's first queries is wholly before position 0: from −∞ that stage gave exp(−∞ − −∞) = NaN everywhere."""
  (q, raw, comp, _), kw = problem(rng, "window", 5, 3)
  sink = jnp.full((H,), -jnp.inf, jnp.float32)
  out = jax.block_until_ready(sparse_mla_wgmma(q, raw, comp, sink, num_sms=2, interpret=not ON_GPU, **kw))
  ref = sparse_mla_reference(q.astype(jnp.float32), raw.astype(jnp.float32), None, sink, **kw)
  assert bool(jnp.isfinite(ref).all()) and nmse(out.astype(jnp.float32), ref) <= 2e-5


def test_split3_parts_sum_to_p_exactly(rng):
  # softmax weights over many binades (down to ~1e-13), plus 1 and 0: the three bf16 parts carry all 24 bits
  p = jnp.asarray(rng.random((64, 64)) * np.exp2(-rng.integers(0, 44, (64, 64))), jnp.float32).at[0, :2].set([1, 0])
  parts = split3(p)
  assert all(a.dtype == jnp.bfloat16 for a in parts) and float(jnp.abs(parts[2]).max()) > 0
  total = parts[0].astype(jnp.float32) + parts[1].astype(jnp.float32) + parts[2].astype(jnp.float32)
  np.testing.assert_array_equal(np.asarray(total), np.asarray(p))


def test_stream_wgmma_masked_rows_do_not_reach_the_output(rng):
  # the first raw rows lie before position 0 (q_start 3): masked for every query, so NaN there must not matter.
  # A masked slot that reads any row (p = 0, but 0 × NaN = NaN) or memory outside the table fails this.
  args, kw = problem(rng, "window", 5, 3)
  q, raw, comp, sink = args
  dead = W - 1 - 3  # rows at positions < 0
  poisoned = raw.at[:dead].set(jnp.nan)
  out = jax.block_until_ready(sparse_mla_wgmma(q, poisoned, comp, sink, num_sms=2, interpret=not ON_GPU, **kw))
  ref = sparse_mla_reference(q.astype(jnp.float32), raw.astype(jnp.float32), None, sink, **kw)
  assert bool(jnp.isfinite(out).all())
  assert nmse(out.astype(jnp.float32), ref) <= 2e-5


@pytest.mark.parametrize("precision", ["bf16", "split"])
def test_stream_wgmma_lowers_for_sm90_at_v4_flash_shapes(precision):
  # the last 8192 queries of a 128K prompt on a CSA layer (top-512: 2 window + 8 selected stages of 64 keys):
  # Mosaic GPU's layout inference and its 227 KiB shared-memory check run in the lowering (split: the f32 output
  # stored from registers)
  T, k, q_start = 8192, 512, 122880 - 8192
  sds = jax.ShapeDtypeStruct

  def f(q, raw, comp, sink, idx):
    return sparse_mla_wgmma(q, raw, comp, sink, q_start=q_start, raw_start=q_start - (W - 1), kind="csa", ratio=4,
                            window=W, inv_freq=FREQS, indices=idx, precision=precision)

  args = (sds((T, H, D), jnp.bfloat16), sds((T + W - 1, D), jnp.bfloat16), sds((122880 // 4, D), jnp.bfloat16),
          sds((H,), jnp.float32), sds((T, k), jnp.int32))
  assert "mosaic_gpu" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_stream_wgmma_refuses_other_shapes(rng):
  (q, raw, comp, sink), kw = problem(rng, "csa", 2, 300)
  with pytest.raises(ValueError, match="64 heads of dim 512"):
    sparse_mla_wgmma(q[:, :16], raw, comp, sink[:16], **kw)
  with pytest.raises(ValueError, match="bf16 q / KV"):
    sparse_mla_wgmma(q.astype(jnp.float32), raw, comp, sink, **kw)
  with pytest.raises(ValueError, match="precision='tf32'"):
    sparse_mla_wgmma(q, raw, comp, sink, precision="tf32", **kw)
  with pytest.raises(ValueError, match="value_columns=64"):  # bf16's output leaves through q's buffer: one chunk
    sparse_mla_wgmma(q, raw, comp, sink, value_columns=64, **kw)
  with pytest.raises(ValueError, match="score_columns=32"):
    sparse_mla_wgmma(q, raw, comp, sink, precision="split", score_columns=32, **kw)
