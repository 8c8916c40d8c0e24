"""Grouped MoE kernels (kernels_pallas/moe) against the exact reference, in Pallas interpret mode on CPU and
compiled (Pallas-Triton) on a GPU: the same tests run on both (INTERPRET follows the default backend).

Parity follows Lucebox's grouped-MoE test (docs/upstream.md §7.1): token widths {2, 4, 8, 9, 16, 32, 48, 64}; for
widths >= 32 every 5th route is masked (−1) and a token with all routes masked must come out exactly +0.0 (sign
bit checked); every output finite. Tolerance NMSE <= 1e-6 for f32 compute (f32 or bf16 weights computed in f32).
The sweep gives each width one (adaptive_tile, compact_queue, persistent) combination and runs it with the fused
and the unfused combine, so every combination of the four Config booleans runs once (tile_order "n"; "item" runs
in the shared-expert and determinism tests and at random in the hypothesis test).
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ds4jax.features import float_min_max, pallas_calls
from ds4jax.metrics import nmse
from kernels_pallas.moe import Config, SharedExpert, api, down, gate_up, moe, moe_reference, plan, routing

INTERPRET = jax.default_backend() == "cpu"
LIMIT = 2.0
E, D, I = 16, 128, 64
BASE = Config(block_m=32, block_n=32, block_k=32, down_block_n=64, down_block_k=32, combine_block_t=16,
              combine_block_d=64, num_cores=2, programs_per_core=2, num_stages=2)
WIDTHS = (2, 4, 8, 9, 16, 32, 48, 64)
TOP_K = dict(zip(WIDTHS, (2, 3, 4, 5, 6, 6, 6, 6)))
COMBOS = dict(zip(WIDTHS, itertools.product([True, False], repeat=3)))  # (adaptive, compact, persistent)


def width_config(S: int, fused: bool = True) -> Config:
  adaptive, compact, persistent = COMBOS[S]
  return dataclasses.replace(BASE, adaptive_tile=adaptive, compact_queue=compact, persistent=persistent,
                             fused_combine=fused)


def make_problem(rng, S, K, *, E=E, D=D, I=I, w_dtype=np.float32, x_dtype=np.float32, mask_every=0,
                 all_masked=(), shared=False):
  """Random problem whose gate/up pre-activations exceed the clamp limit often enough to test both clamps."""
  x = rng.standard_normal((S, D)).astype(np.float32)
  ids = np.stack([rng.permutation(E)[:K] for _ in range(S)]).astype(np.int32)
  if mask_every:
    ids.reshape(-1)[mask_every - 1::mask_every] = -1
  ids[list(all_masked)] = -1
  w = rng.uniform(0.1, 1.0, (S, K)).astype(np.float32)
  w1 = 2.0 / np.sqrt(D) * rng.standard_normal((E, I, D))
  w3 = 2.0 / np.sqrt(D) * rng.standard_normal((E, I, D))
  w2 = 1.0 / np.sqrt(I) * rng.standard_normal((E, D, I))
  cast = lambda a, dt: jnp.asarray(np.asarray(a, np.float32)).astype(dt)
  p = dict(x=cast(x, x_dtype), route_weights=jnp.asarray(w), route_ids=jnp.asarray(ids),
           w1=cast(w1, w_dtype), w2=cast(w2, w_dtype), w3=cast(w3, w_dtype))
  if shared:
    p["shared"] = SharedExpert(*(cast(a, w_dtype) for a in (
        2.0 / np.sqrt(D) * rng.standard_normal((I, D)), 1.0 / np.sqrt(I) * rng.standard_normal((D, I)),
        2.0 / np.sqrt(D) * rng.standard_normal((I, D)))))
  return p


def run(p, config):
  return np.asarray(moe(**p, swiglu_limit=LIMIT, config=config, interpret=INTERPRET))


def reference(p):
  return np.asarray(moe_reference(**p, swiglu_limit=LIMIT))


def assert_parity(y, want, tol=1e-6):
  assert y.dtype == np.float32 and y.shape == want.shape
  assert np.isfinite(y).all()
  err = nmse(y, want)
  assert err <= tol, f"NMSE {err:.3e} > {tol:.0e}"


# ---- parity sweep ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("S", WIDTHS)
def test_parity_widths(rng, S):
  K = TOP_K[S]
  masked = S >= 32
  w_dtype = np.float32 if WIDTHS.index(S) % 2 == 0 else jnp.bfloat16  # bf16 weights, computed in f32
  p = make_problem(rng, S, K, w_dtype=w_dtype, mask_every=5 if masked else 0, all_masked=(3,) if masked else ())
  want = reference(p)
  ys = {}
  for fused in (True, False):
    cfg = width_config(S, fused)
    ys[fused] = y = run(p, cfg)
    assert_parity(y, want)
    if masked:  # the all-masked token: exactly +0.0, sign bit clear
      assert (y[3] == 0).all() and not np.signbit(y[3]).any()
  np.testing.assert_allclose(ys[True], ys[False], rtol=1e-5, atol=1e-5)


def test_all_routes_to_one_expert(rng):
  S = 64
  p = make_problem(rng, S, TOP_K[S])
  p["route_ids"] = jnp.full((S, TOP_K[S]), 7, jnp.int32)  # 384 rows, duplicates inside each token
  cfg = width_config(S)
  assert_parity(run(p, cfg), reference(p))


def test_a_non_finite_value_reaches_only_the_tokens_routed_to_it(rng):
  """A NaN weight of an expert no token takes, and a NaN in a token whose routes are all masked, leave every output
  finite, in the reference (once every token's row came out NaN: 0 · NaN) as in the kernels; a token routed to the
  NaN expert is NaN in both."""
  S = 16
  p = make_problem(rng, S, 2, all_masked=(5,))
  ids = np.asarray(p["route_ids"]).copy()
  ids[ids == 3] = 4  # no token takes expert 3
  ids[9, 0] = 6
  p["route_ids"] = jnp.asarray(ids)
  w1 = np.asarray(p["w1"]).copy()
  w1[3, 0, 0] = w1[6, 0, 0] = np.nan
  x = np.asarray(p["x"]).copy()
  x[5, 0] = np.nan
  p["w1"], p["x"] = jnp.asarray(w1), jnp.asarray(x)
  want, tokens_of_6 = reference(p), (ids == 6).any(axis=1)
  assert tokens_of_6.sum() >= 1 and np.isnan(want[tokens_of_6]).all() and np.isfinite(want[~tokens_of_6]).all()
  assert (want[5] == 0).all()
  for fused in (True, False):
    y = run(p, width_config(S, fused))
    # on the CPU the interpreter keeps a NaN through a min or max as XLA does: these would drop it compiled
    assert not float_min_max(lambda p: moe(**p, swiglu_limit=LIMIT, config=width_config(S, fused),
                                           interpret=INTERPRET), p)
    assert np.isnan(y[tokens_of_6]).all()
    np.testing.assert_allclose(y[~tokens_of_6], want[~tokens_of_6], rtol=1e-5, atol=1e-5)


def test_empty_experts_and_partial_row_tiles(rng):
  S = 48
  K = TOP_K[S]
  p = make_problem(rng, S, K)
  ids = rng.choice(np.array([2, 11]), size=(S, K)).astype(np.int32)
  ids[0] = 2
  ids[1] = 11
  p["route_ids"] = jnp.asarray(ids)
  cfg = width_config(S)
  bm = cfg.row_tile(S * K, E)
  sizes = np.bincount(ids.reshape(-1), minlength=E)
  assert (sizes == 0).sum() == E - 2 and (sizes[[2, 11]] % bm).any()  # 14 empty experts, a partial tile
  r = jax.tree.map(np.asarray, routing.route(p["route_ids"], E, bm))
  assert int(r.num_items[0]) == sum(-(-int(c) // bm) for c in sizes)  # no work item for an empty expert
  for fused in (True, False):
    assert_parity(run(p, width_config(S, fused)), reference(p))


@pytest.mark.parametrize("fused", [True, False])
def test_shared_expert(rng, fused):
  S = 9
  p = make_problem(rng, S, TOP_K[S], shared=True, all_masked=(4,))
  cfg = dataclasses.replace(width_config(S, fused), tile_order="item")
  want = reference(p)
  y = run(p, cfg)
  assert_parity(y, want)
  # A precomputed shared output is added as is; an all-masked token gets exactly its shared row.
  shared_out = want - np.asarray(moe_reference(**{**p, "shared": None}, swiglu_limit=LIMIT))
  y2 = run({**p, "shared": jnp.asarray(shared_out)}, cfg)
  assert_parity(y2, want)
  np.testing.assert_array_equal(y2[4], shared_out[4])


def test_bf16_activations_and_weights(rng):
  S = 16
  p = make_problem(rng, S, TOP_K[S], w_dtype=jnp.bfloat16, x_dtype=jnp.bfloat16)
  cfg = width_config(S)
  y = run(p, cfg)  # bf16 dots, f32 accumulation, bf16 h
  assert_parity(y, reference(p), tol=5e-4)  # the Lucebox MMQ tolerance


def test_fused_combine_is_deterministic(rng):
  S = 48
  p = make_problem(rng, S, TOP_K[S], mask_every=5)
  cfg = dataclasses.replace(width_config(S), tile_order="item")  # persistent, dense queue, item-fastest
  y = run(p, cfg)
  np.testing.assert_array_equal(y, run(p, cfg))
  assert_parity(y, reference(p))


# ---- stage kernels against their references ----------------------------------------------------------------------

def test_stages_match_stage_references(rng):
  S = 32  # the width-32 sweep case's shapes and config: the jitted stages are already compiled
  K = TOP_K[S]
  p = make_problem(rng, S, K, w_dtype=jnp.bfloat16, mask_every=5)
  cfg = width_config(S)
  kcfg = api._kernel_config(cfg)
  r = api._route(p["route_ids"], E, cfg.row_tile(S * K, E))
  n = int(r.num_rows[0])
  h = api._gate_up(p["x"], p["w1"], p["w3"], r, swiglu_limit=LIMIT, config=kcfg, interpret=INTERPRET)
  h_ref = gate_up.gate_up_reference(p["x"], p["w1"], p["w3"], r, swiglu_limit=LIMIT)
  assert_parity(np.asarray(h)[:n], np.asarray(h_ref)[:n])
  out = api._down(h, p["w2"], r, config=kcfg, interpret=INTERPRET)
  out_ref = down.down_reference(h, p["w2"], r)
  assert_parity(np.asarray(out)[:n], np.asarray(out_ref)[:n])
  y = api._combine(out, p["route_weights"], r, None, config=cfg, interpret=INTERPRET)
  y_xla = api._combine_xla(out, p["route_weights"], r, None)
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_xla), rtol=1e-6, atol=1e-6)
  assert_parity(np.asarray(y), reference(p))


# ---- a second weight format through the tile-loader interface ------------------------------------------------

def load_row_scaled_tile(refs, expert, n_start, k_start, *, block_n, block_k, dtype):
  codes_ref, scale_ref = refs
  codes = plt.load(codes_ref.at[expert, pl.ds(n_start, block_n), pl.ds(k_start, block_k)]).astype(jnp.float32)
  scale = plt.load(scale_ref.at[expert, pl.ds(n_start, block_n)])
  return (codes * scale[:, None]).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowScaled:
  """Test-only format: bf16 codes [E, N, K] times an f32 scale per output row [E, N], dequantized in-kernel."""
  codes: jax.Array
  scale: jax.Array
  k_multiple: int = dataclasses.field(default=16, metadata=dict(static=True))
  shape = property(lambda self: tuple(self.codes.shape))
  operands = property(lambda self: (self.codes, self.scale))
  compute_dtype = property(lambda self: jnp.dtype(jnp.float32))

  def loader(self):
    return load_row_scaled_tile

  def dequantize(self):
    return self.codes.astype(jnp.float32) * self.scale[..., None]


def test_pluggable_weight_format(rng):
  S = 16
  p = make_problem(rng, S, TOP_K[S])
  fmt = lambda w: RowScaled(jnp.asarray(w).astype(jnp.bfloat16),
                            jnp.asarray(rng.uniform(0.5, 2.0, w.shape[:2]), jnp.float32))
  p["w1"], p["w2"] = fmt(p["w1"]), fmt(p["w2"])  # w3 stays a plain f32 array: formats mix per matrix
  assert isinstance(p["w1"], api.ExpertWeights)
  cfg = width_config(S)
  assert_parity(run(p, cfg), reference(p))
  with pytest.raises(ValueError, match="block_k=32 must be a multiple of the format's 64-value block"):
    run({**p, "w1": dataclasses.replace(p["w1"], k_multiple=64)}, cfg)


# ---- random shapes and routings ----------------------------------------------------------------------------------

@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(S=st.integers(1, 24), K=st.integers(1, 4), E_=st.sampled_from([4, 8]), D_=st.sampled_from([32, 64]),
       I_=st.sampled_from([32, 64]), flags=st.tuples(*[st.booleans()] * 5), p_mask=st.sampled_from([0.0, 0.3]),
       seed=st.integers(0, 2**31 - 1))
def test_hypothesis_random_shapes(S, K, E_, D_, I_, flags, p_mask, seed):
  g = np.random.default_rng(seed)
  p = make_problem(g, S, K, E=E_, D=D_, I=I_)
  ids = g.integers(0, E_, (S, K)).astype(np.int32)  # duplicates inside a token allowed
  ids[g.uniform(size=(S, K)) < p_mask] = -1
  p["route_ids"] = jnp.asarray(ids)
  adaptive, compact, persistent, fused, n_order = flags
  cfg = Config(block_m=16, block_n=32, block_k=16, down_block_n=32, down_block_k=32, combine_block_t=8,
               combine_block_d=32, num_cores=1, programs_per_core=3, adaptive_tile=adaptive,
               compact_queue=compact, persistent=persistent, fused_combine=fused,
               tile_order="n" if n_order else "item")
  y = run(p, cfg)
  assert_parity(y, reference(p))
  dead = (ids < 0).all(axis=1)
  assert (y[dead] == 0).all() and not np.signbit(y[dead]).any()


# ---- the knobs change what runs ----------------------------------------------------------------------------------



@pytest.mark.parametrize("knob", ["baseline", "adaptive_tile", "compact_queue", "persistent", "fused_combine",
                                  "shared", "tile_order"])
def test_knobs_change_the_path(knob):
  S, K = 64, 6
  R = S * K
  sds = jax.ShapeDtypeStruct
  args = (sds((S, D), jnp.float32), sds((S, K), jnp.float32), sds((S, K), jnp.int32), sds((E, I, D), jnp.float32),
          sds((E, D, I), jnp.float32), sds((E, I, D), jnp.float32))
  on = dataclasses.replace(BASE, block_m=64, adaptive_tile=True, compact_queue=True, persistent=False,
                           fused_combine=True)
  if knob == "tile_order":
    cfg = dataclasses.replace(on, tile_order="item")
  elif knob in ("baseline", "shared"):
    cfg = on
  else:
    cfg = dataclasses.replace(on, **{knob: not getattr(on, knob)})
  shared = (sds((I, D), jnp.float32), sds((D, I), jnp.float32), sds((I, D), jnp.float32)) if knob == "shared" else ()
  calls = pallas_calls(lambda *a: moe(*a[:6], swiglu_limit=LIMIT, shared=SharedExpert(*a[6:]) if a[6:] else None,
                                      config=cfg, interpret=INTERPRET), *args, *shared)
  pl_ = plan(num_tokens=S, top_k=K, num_experts=E, hidden=D, intermediate=I, config=cfg,
             shared_intermediate=I if shared else None)
  names = [n for n, _ in calls]
  assert tuple(names) == pl_.kernels
  grids = dict(calls)
  suffix = "_persistent" if cfg.persistent else ""
  assert grids["moe_gate_up" + suffix] == pl_.gate_up_grid and grids["moe_down" + suffix] == pl_.down_grid
  P = cfg.programs()
  if knob == "baseline":  # R/E = 24 rows per expert → tile 32; compact list bound (R + E·31) // 32 = 27
    assert pl_.block_m == 32 and pl_.gate_up_grid == (I // 32, 27) and grids["moe_combine"] == (S // 16, D // 64)
    assert pl_.down_grid == (D // 64, 27)  # tile_order "n": the N tile is grid axis 0 (launched fastest)
  elif knob == "adaptive_tile":
    assert pl_.block_m == 64 and pl_.gate_up_grid == (I // 32, (R + E * 63) // 64)
  elif knob == "compact_queue":  # every expert x ceil(R / bm) tiles, most of them exit at once
    assert pl_.gate_up_grid == (I // 32, E * -(-R // 32)) and pl_.work_list == "dense"
  elif knob == "persistent":
    assert pl_.gate_up_grid == (P,) == pl_.down_grid and P == 4 and pl_.schedule == "persistent"
  elif knob == "fused_combine":
    assert "moe_combine" not in names and pl_.combine == "xla" and len(calls) == 2
  elif knob == "tile_order":  # items on grid axis 0
    assert pl_.gate_up_grid == (27, I // 32) and pl_.down_grid == (27, D // 64)
  elif knob == "shared":
    assert names[:2] == ["moe_shared_gate_up", "moe_shared_down"] and grids["moe_shared_gate_up"] == (I // 32, 1)


def test_lowers_to_triton_for_cuda_and_rocm():
  """The whole pipeline lowers through the Pallas-Triton GPU lowering (no GPU needed): catches unsupported
  primitives and non-power-of-two tensors before a device run."""
  from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
  S, K = 9, 3
  sds = jax.ShapeDtypeStruct
  args = (sds((S, D), jnp.bfloat16), sds((S, K), jnp.float32), sds((S, K), jnp.int32),
          sds((E, I, D), jnp.bfloat16), sds((E, D, I), jnp.bfloat16), sds((E, I, D), jnp.bfloat16))
  shared = (sds((I, D), jnp.bfloat16), sds((D, I), jnp.bfloat16), sds((I, D), jnp.bfloat16))
  for platform, kind in (("cuda", "NVIDIA H200"), ("rocm", "gfx1151")):
    for cfg in (dataclasses.replace(BASE, compute_dtype="float32"),
                dataclasses.replace(BASE, persistent=True, compact_queue=False)):
      mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind=kind, num_cores=None,
                                                                       platform=platform))
      f = jax.jit(lambda *a: moe(*a[:6], swiglu_limit=LIMIT, shared=SharedExpert(*a[6:]), config=cfg))
      with use_abstract_mesh(mesh):
        text = f.trace(*args, *shared).lower(lowering_platforms=(platform,)).as_text()
      assert text.count("__gpu$xla.gpu.triton") == 5, (platform, cfg)


# ---- clear errors before lowering --------------------------------------------------------------------------------

def test_errors(rng):
  p = make_problem(rng, 4, 2, D=64, I=32, E=4)
  cfg = Config(block_m=16, block_n=32, block_k=32, combine_block_d=64)

  def bad(match, config=cfg, **kw):
    with pytest.raises(ValueError, match=match):
      moe(**{**p, **kw}, swiglu_limit=LIMIT, config=config, interpret=INTERPRET)

  ids = np.asarray(p["route_ids"]).copy()
  ids[1, 1] = 4
  bad(r"route_ids\[1, 1\] = 4 is out of range", route_ids=jnp.asarray(ids))
  ids[1, 1] = -3
  bad(r"= -3 is out of range", route_ids=jnp.asarray(ids))
  bad(r"D=64 is not a multiple of block_k=128", config=dataclasses.replace(cfg, block_k=128))
  bad(r"I=32 is not a multiple of block_n=64", config=dataclasses.replace(cfg, block_n=64))
  bad(r"D=64 is not a multiple of down_block_n=128", config=dataclasses.replace(cfg, down_block_n=128))
  bad(r"I=32 is not a multiple of down_block_k=64", config=dataclasses.replace(cfg, down_block_k=64))
  bad(r"combine_block_d=128", config=dataclasses.replace(cfg, combine_block_d=128))
  bad(r"block_m=24: must be a power of two", config=dataclasses.replace(cfg, block_m=24))
  bad(r"block_n=8: must be a power of two >= 16", config=dataclasses.replace(cfg, block_n=8))
  bad(r"w1: unknown weight dtype int8", w1=p["w1"].astype(jnp.int8))
  bad(r"w2 shape \(4, 32, 64\) must be \[E, D, I\] = \(4, 64, 32\)", w2=jnp.swapaxes(p["w2"], 1, 2))
  bad(r"w1 \(4, 32, 64\) and w3 \(3, 32, 64\)", w3=p["w3"][:3])
  bad(r"route_weights shape \(4, 3\) must equal route_ids shape \(4, 2\)",
      route_weights=jnp.ones((4, 3), jnp.float32))
  bad(r"route_ids shape \(5, 2\) must be \[S, K\] with S = 4", route_ids=jnp.zeros((5, 2), jnp.int32),
      route_weights=jnp.ones((5, 2), jnp.float32))
  bad(r"x must be \[S, D\]", x=p["x"][None])
  bad(r"at least one token and one route each; got x \(0, 64\)", x=p["x"][:0], route_ids=p["route_ids"][:0],
      route_weights=p["route_weights"][:0])
  bad(r"shared must be None, a SharedExpert of weights, or its output \[S, D\]", shared=jnp.zeros((4, 32)))
  bad(r"shared expert shapes", shared=SharedExpert(jnp.zeros((32, 64)), jnp.zeros((32, 64)), jnp.zeros((32, 64))))
