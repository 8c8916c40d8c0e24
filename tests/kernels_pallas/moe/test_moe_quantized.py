"""Quantized expert weights in the grouped MoE kernels (kernels_pallas/moe/quantized_weights.py), in Pallas interpret
mode on CPU and compiled on a GPU (INTERPRET follows the default backend, as in test_moe_kernels.py).

Parity grid: every quantized registry format × token widths {2, 4, 8, 9, 16, 32, 48, 64} compiled (interpreted, 3
widths per format in rotation, every width on two or three formats: `grid`), fused and unfused combine on each,
against `moe_reference` on the SAME weights dequantized to f32 by the format's canonical
`formats.get(f).dequantize(**storage)`. Activations are f32, so the kernels multiply the exact dequantized weights in
f32: NMSE ≤ 5e-4 is required (the Lucebox MMQ bound); measured ~1e-13. (bf16 weights, `DenseWeights`, take no tile
decode: test_moe_kernels.py's parity widths run them at 1e-6, every queue config, both combines.)
Widths >= 32 mask every 5th route and all routes of token 3; a token with all routes masked must come out exactly
+0.0 (sign bit clear). Dims follow test_moe_kernels.py: E 16, D 128, I 64 (I 128 for rocmfp2_mix, whose `in` must be
a multiple of 128). Storage follows `policy.random_storage` (random codes, one target scale), drawn in numpy, with
the scale bytes jittered per block (so the tiles meet different scales) and, for the MIX formats, expert 1 in mode 0.

Cost: an interpret-mode kernel compiles in ~0.7 s on CPU, so 6 formats × 8 widths of their own shapes would compile
96 gate/up + down kernels. Instead each width runs in a padded token BUCKET with 6 route slots: the width's S tokens
carry its top-k routes, the other slots and tokens are masked (−1), and every padding token must come out exactly
+0.0 as well. Two QUEUES: the adaptive/compact grid with tile order "n", and the persistent dense queue with a fixed
row tile and tile order "item". Compiled on a GPU, widths ≤ 16 run in a bucket of 17 tokens on the compact queue and
wider ones in a bucket of 64 on the persistent queue, so every format meets both. In interpret mode every width runs
in one bucket of 65 tokens on the one queue its format is given (each queue gets an FP8/FP4, a plain ROCmFP and a MIX
format): one compile per format instead of two, ~1 s each. The kernels call a format's tile loader with the same
(expert, n0, k0, block_n, block_k) whatever the queue (gate_up.py, down.py), so interpret mode runs the same loader
code under either. Either way every width, both combines, the special routings and the dequantize-then-matmul
comparison reuse the format's compiled shapes. The buckets (17, 65) are odd on purpose: partial row tiles and a partial
combine token tile in every case. The shape logic across true widths (row tiles, work lists, grids, all Config
booleans) is format-independent and covered by test_moe_kernels.py.

Also: all routes to one expert / empty experts with partial row tiles; the fused path against dequantize-then-matmul
(bit-equal where the dequantized values are bf16-exact); bf16 activations; the official and lucebox_mix policies
(formats mixed per matrix, quantized shared expert); the kernel-side tile loader bit-identical to the jnp decode on
adversarial bytes; Triton lowering of every format for sm_90 and gfx1151; construction and block errors.
"""

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import test_moe_kernels as base
from ds4jax.quant import formats, fp4_e2m1, rocmfp2_mix, rocmfp3_mix, ue4m3, ue8m0
from ds4jax.metrics import nmse
from kernels_pallas.moe import Config, api, moe, moe_reference
from kernels_pallas.moe import quantized_weights as qw
from kernels_pallas.moe.weights import DenseWeights

INTERPRET = base.INTERPRET
LIMIT = base.LIMIT
E, D = base.E, base.D
FORMATS = ("bf16",) + qw.QUANTIZED_FORMATS
TOL = {f: 1e-6 if f == "bf16" else 5e-4 for f in FORMATS}
SLOTS = 6  # route slots per token in every bucket (max top-k of the widths)
QUEUES = {
    "compact": dataclasses.replace(base.BASE, adaptive_tile=True, compact_queue=True, persistent=False,
                                   tile_order="n"),
    "persistent": dataclasses.replace(base.BASE, adaptive_tile=False, compact_queue=False, persistent=True,
                                      tile_order="item"),
}
# Interpret mode: each format's one queue (see the module docstring); formats not listed (bf16) take "compact".
INTERPRET_QUEUE = {"fp8_e4m3": "persistent", "fp4_e2m1": "compact", "rocmfp2": "persistent", "rocmfp3": "compact",
                   "rocmfp2_mix": "compact", "rocmfp3_mix": "persistent"}
assert set(INTERPRET_QUEUE) == set(qw.QUANTIZED_FORMATS) and set(INTERPRET_QUEUE.values()) == set(QUEUES)


def bucket(S: int) -> int:
  if INTERPRET:
    return 65
  return 17 if S <= 16 else 64


def config(fmt: str, S: int, fused: bool = True) -> Config:
  if INTERPRET:
    queue = INTERPRET_QUEUE.get(fmt, "compact")
  else:
    queue = "compact" if S <= 16 else "persistent"
  return dataclasses.replace(QUEUES[queue], fused_combine=fused)


def inter_dim(fmt: str) -> int:
  return 128 if fmt == "rocmfp2_mix" else base.I


# RMS of each format's levels under uniformly random codes (as in policy.random_storage), to aim at a std.
LEVEL_RMS = {
    "fp4_e2m1": float(np.sqrt(np.mean(np.square(fp4_e2m1.E2M1_VALUES)))),
    "rocmfp2": float(np.sqrt(np.mean(np.square([-1, 0, 1, 2])))),
    "rocmfp3": float(np.sqrt(np.mean(np.square([0, 1, 2, 4])))),
    "rocmfp2_mix": float(np.sqrt(np.mean(np.square(rocmfp2_mix.INIT_BOOKS)))),
    "rocmfp3_mix": float(np.sqrt(np.mean(np.square(rocmfp3_mix.INIT_BOOKS)))),
}
FP8_CODE_STD = 32.0


def random_storage(fmt: str, shape, std: float, g: np.random.Generator) -> dict:
  """Valid random storage of a weight of `shape` aimed at `std`, drawn with numpy (jax.random's compile costs
  seconds per shape on CPU): policy.random_storage's recipe (random codes, books jittered around the MIX init
  books), but scale bytes jittered per block (×½ … ×2) so every tile meets different scales, the fp2s / book-select
  bit random, and for MIX expert 1 in mode 0 (the uniform fallback: meta bit 7 clear)."""
  layout = formats.get(fmt).storage(shape)
  rbytes = lambda shp: g.integers(0, 256, shp).astype(np.uint8)
  if fmt == "bf16":
    return {"weight": (std * g.standard_normal(shape)).astype(ml_dtypes.bfloat16)}
  if fmt == "fp8_e4m3":
    codes = np.clip(FP8_CODE_STD * g.standard_normal(shape), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    sshape = layout["scale"][0]
    scale = ue8m0.BIAS + round(np.log2(std / FP8_CODE_STD)) + g.integers(-1, 2, sshape)
    return {"weight": codes, "scale": scale.astype(np.uint8)}
  if fmt == "fp4_e2m1":
    sshape = layout["scale"][0]
    scale = ue8m0.BIAS + round(np.log2(std / LEVEL_RMS[fmt])) + g.integers(-1, 2, sshape)
    return {"packed": rbytes(layout["packed"][0]).view(np.int8), "scale": scale.astype(np.uint8)}
  st = {n: rbytes(s) for n, (s, _) in layout.items() if n.startswith("codes")}
  sshape = layout["scales"][0]
  low = np.clip(int(ue4m3.nearest_byte(std / LEVEL_RMS[fmt])) + g.integers(-8, 9, sshape), 0, ue4m3.MAX_BYTE)
  hi = rbytes(sshape) & (0 if fmt == "rocmfp3" else 0x80)
  if fmt.endswith("_mix"):
    init = rocmfp2_mix.INIT_BOOKS if fmt == "rocmfp2_mix" else rocmfp3_mix.INIT_BOOKS
    books_shape, mode_shape = layout["books"][0], layout["mode"][0]
    st["books"] = (init + g.uniform(-0.2, 0.2, books_shape)).astype(ml_dtypes.bfloat16)
    st["mode"] = np.ones(mode_shape, np.uint8)
    st["mode"][1] = 0
    hi[1] = 0
  st["scales"] = (low | hi).astype(np.uint8)
  return st


@functools.cache
def _dequantize(fmt: str):
  """The canonical dequantize, jitted (one compile per shape instead of op-by-op dispatch)."""
  return jax.jit(lambda st: formats.get(fmt).dequantize(**st))


@functools.cache
def weights(fmt: str):
  """(w1, w2, w3) as kernel weights and as their canonical f32 dequantization, fixed per format."""
  I = inter_dim(fmt)
  g = np.random.default_rng(zlib.crc32(fmt.encode()))
  out, ref = [], []
  for shape, std in (((E, I, D), 2 / D**0.5), ((E, D, I), 1 / I**0.5), ((E, I, D), 2 / D**0.5)):
    st = random_storage(fmt, shape, std, g)
    formats.get(fmt).check(**st)  # valid storage
    st = {n: jnp.asarray(a) for n, a in st.items()}
    out.append(qw.expert_weights(fmt, st, shape))
    ref.append(DenseWeights(_dequantize(fmt)(st)))
  return tuple(out), tuple(ref)


def problem(rng, fmt, S, K, **kw):
  """A test_moe_kernels problem of S tokens and K route slots with this format's weights; and the same problem with
  the canonical f32 dequantization of those weights, for the reference."""
  p = base.make_problem(rng, S, K, I=inter_dim(fmt), **kw)
  (p["w1"], p["w2"], p["w3"]), ref_w = weights(fmt)
  return p, {**p, **dict(zip(("w1", "w2", "w3"), ref_w))}


def width_problem(rng, fmt, S):
  """Width S in its bucket: S real tokens with the width's top-k routes (every 5th masked and token 3 all masked
  for S >= 32), padding slots and tokens masked. Returns (p, p_ref, dead) with `dead` the all-masked tokens."""
  P, K = bucket(S), base.TOP_K[S]
  p, p_ref = problem(rng, fmt, P, SLOTS)
  ids = np.asarray(p["route_ids"]).copy()
  real = ids[:S, :K].copy()
  if S >= 32:
    real.reshape(-1)[4::5] = -1
    real[3] = -1
  ids[:] = -1
  ids[:S, :K] = real
  p["route_ids"] = p_ref["route_ids"] = jnp.asarray(ids)
  return p, p_ref, (ids < 0).all(axis=1)


_reference = jax.jit(moe_reference, static_argnames=("swiglu_limit",))


def reference(p_ref):
  return np.asarray(_reference(**p_ref, swiglu_limit=LIMIT))


def check(y, want, fmt, what=""):
  assert y.dtype == np.float32 and y.shape == want.shape
  assert np.isfinite(y).all(), what
  err = nmse(y, want)
  assert err <= TOL[fmt], f"{fmt} {what}: NMSE {err:.3e} > {TOL[fmt]:.0e}"
  return err


# ---- parity grid: format × width × combine -------------------------------------------------------------------

def grid() -> list[tuple[str, int]]:
  """Compiled: every format × every width. Interpreted, where a format's widths all run one compiled bucket and each
  costs ~0.5 s of interpretation alone: format i takes widths i, i + 3 and i + 6 (mod 8), so every width runs on two
  or three formats and every format meets a masked width (≥ 32)."""
  n = len(base.WIDTHS)
  return [(f, S) for i, f in enumerate(qw.QUANTIZED_FORMATS) for j, S in enumerate(base.WIDTHS)
          if not INTERPRET or j in {i % n, (i + 3) % n, (i + 6) % n}]


def test_the_interpreted_grid_covers_every_format_and_width():
  g = grid()
  assert {f for f, _ in g} == set(qw.QUANTIZED_FORMATS) and {S for _, S in g} == set(base.WIDTHS)
  assert all(any(S >= 32 for f2, S in g if f2 == f) for f in qw.QUANTIZED_FORMATS)  # a masked width each


@pytest.mark.parametrize("fmt, S", grid())
def test_parity_grid(rng, fmt, S):
  """Both combines on one problem (the kernels of a bucket compile once): each against the reference, and the two
  within f32 summation order of each other."""
  p, p_ref, dead = width_problem(rng, fmt, S)
  want = reference(p_ref)
  outs = {fused: base.run(p, config(fmt, S, fused)) for fused in (False, True)}
  for fused, y in outs.items():
    err = check(y, want, fmt, f"S={S} fused={fused}")
    print(f"{fmt} S={S} fused={fused}: NMSE {err:.2e}")
    assert (y[dead] == 0).all() and not np.signbit(y[dead]).any()  # exactly +0.0 (no shared expert)
  assert dead[S:].all() and dead[:S].sum() == (S >= 32)  # padding tokens, and token 3 of a masked width
  np.testing.assert_allclose(outs[False], outs[True], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", qw.QUANTIZED_FORMATS)
def test_special_routings(rng, fmt):
  """All routes to one expert, and 14 empty experts with partial row tiles, on the widest bucket's shapes."""
  S = bucket(64)
  p, p_ref = problem(rng, fmt, S, SLOTS)
  p["route_ids"] = p_ref["route_ids"] = jnp.full((S, SLOTS), 7, jnp.int32)  # S·6 rows, duplicates in each token
  for fused in (True, False):
    check(base.run(p, config(fmt, S, fused)), reference(p_ref), fmt, f"one expert fused={fused}")

  p, p_ref = problem(rng, fmt, S, SLOTS)
  ids = rng.choice(np.array([2, 11]), size=(S, SLOTS)).astype(np.int32)
  ids[0], ids[1] = 2, 11
  ids[5, :3] = -1  # S·6 - 3 rows: an odd count, so a partial row tile
  p["route_ids"] = p_ref["route_ids"] = jnp.asarray(ids)
  bm = config(fmt, S).row_tile(S * SLOTS, E)
  sizes = np.bincount(ids[ids >= 0], minlength=E)
  assert (sizes == 0).sum() == E - 2 and (sizes[[2, 11]] % bm).any()  # empty experts, a partial row tile
  for fused in (True, False):
    check(base.run(p, config(fmt, S, fused)), reference(p_ref), fmt, f"two experts fused={fused}")


def test_cuda_default_for_in_kernel_decoded_weights_takes_rows_of_256():
  """Each decoded weight tile serves a row tile, so in-kernel decoding on CUDA takes row tiles of up to 256 (measured
  faster on an H200); bf16 weights, f32 operands, ROCm and short prompts keep their tiles."""
  v4 = dict(top_k=6, num_experts=256, hidden=4096, intermediate=2048)
  quantized = Config.default(num_tokens=8192, decodes_weights=True, **v4)
  assert (quantized.block_m, quantized.block_n, quantized.num_warps) == (256, 64, 8)
  assert quantized.row_tile(8192 * 6, 256) == 256 and quantized.row_tile(2048 * 6, 256) == 64
  bf16 = Config.default(num_tokens=8192, **v4)
  assert (bf16.block_m, bf16.block_n, bf16.row_tile(8192 * 6, 256)) == (128, 128, 128)
  for kw in (dict(platform="rocm"), dict(dtype=jnp.float32), dict(num_tokens=2048)):
    args = dict(num_tokens=8192) | kw
    assert Config.default(decodes_weights=True, **v4, **args) == Config.default(**v4, **args), kw


def test_row_tile_of_256(rng):
  """384 rows on one expert in row tiles of 256 (a full tile and a partial one), gate/up tiles 64 wide: the tiling
  the CUDA default picks for in-kernel decoded weights at long prompts."""
  fmt, S = "rocmfp2_mix", 64
  p, p_ref = problem(rng, fmt, S, SLOTS)
  p["route_ids"] = p_ref["route_ids"] = jnp.full((S, SLOTS), 7, jnp.int32)
  cfg = dataclasses.replace(QUEUES["persistent"], block_m=256, block_n=64)
  assert cfg.row_tile(S * SLOTS, E) == 256
  check(base.run(p, cfg), reference(p_ref), fmt, "row tile 256")


# ---- the fused quantized path against dequantize-then-matmul -------------------------------------------------

@pytest.mark.parametrize("fmt", qw.QUANTIZED_FORMATS)
def test_fused_dequant_equals_dequantize_then_matmul(rng, fmt):
  S = 9
  p, p_ref, _ = width_problem(rng, fmt, S)
  cfg = config(fmt, S)
  y = base.run(p, cfg)
  ws = [p[n] for n in ("w1", "w2", "w3")]
  dense = [qw.dequantize_to_dense(w) for w in ws]  # bf16, in XLA
  for d, w_ref in zip(dense, (p_ref[n] for n in ("w1", "w2", "w3"))):
    assert d.w.dtype == jnp.bfloat16
    if qw.BF16_EXACT[fmt]:  # every dequantized value is a bf16 value
      np.testing.assert_array_equal(np.asarray(d.w, np.float32), np.asarray(w_ref.w))
  y_dense = base.run({**p, **dict(zip(("w1", "w2", "w3"), dense))}, cfg)
  if qw.BF16_EXACT[fmt]:
    np.testing.assert_array_equal(y, y_dense)
  else:  # MIX levels·scales need up to 12 bits: bf16 rounds them (NMSE ~1e-5 seen, up to 1.01e-5 in CI);
    # f32 dequantization is exact
    assert nmse(y_dense, y) <= 5e-5
    y_f32 = base.run({**p, **{n: qw.dequantize_to_dense(w, jnp.float32) for n, w in zip(("w1", "w2", "w3"), ws)}},
                     cfg)
    np.testing.assert_array_equal(y, y_f32)
  check(y_dense, reference(p_ref), fmt, "dequantize-then-matmul")


@pytest.mark.parametrize("fmt", qw.QUANTIZED_FORMATS)
def test_bf16_activations(rng, fmt):
  """The fast path: bf16 activations, so the loader casts the dequantized tile to bf16 and the dots run in bf16
  (f32 accumulation, bf16 h). Against the exact f32 reference: the Lucebox MMQ tolerance."""
  S = 16
  p, p_ref, dead = width_problem(rng, fmt, S)
  p["x"] = p["x"].astype(jnp.bfloat16)
  p_ref["x"] = p["x"]
  y = base.run(p, config(fmt, S))
  err = check(y, reference(p_ref), fmt, "bf16 activations")
  assert err > 0 and (y[dead] == 0).all() and not np.signbit(y[dead]).any()
  print(f"{fmt} bf16 activations: NMSE {err:.2e}")


@pytest.mark.parametrize("policy", ["official", "lucebox_mix"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_policies_with_quantized_shared_expert(rng, policy, fused):
  """The ds4jax quantization policies as the model runs them: formats mixed per matrix (official: FP4 experts;
  lucebox_mix: ROCmFP2-MIX gate/up, ROCmFP3-MIX down) and the shared expert in the dense-role format (FP8 / FP4),
  given as one-expert stacks [1, out, in]."""
  from ds4jax.quant import policy as quant_policy  # pylint: disable=import-outside-toplevel
  pol = quant_policy.get(policy)
  S, I, Is = 9, base.I, base.I
  p, p_ref, dead = width_problem(rng, "bf16", S)
  g = np.random.default_rng(zlib.crc32(policy.encode()))
  roles = (("w1", pol.gate_up, (E, I, D), 2 / D**0.5), ("w2", pol.down, (E, D, I), 1 / I**0.5),
           ("w3", pol.gate_up, (E, I, D), 2 / D**0.5))
  for name, fmt, shape, std in roles:
    st = {n: jnp.asarray(a) for n, a in random_storage(fmt, shape, std, g).items()}
    p[name], p_ref[name] = qw.expert_weights(fmt, st, shape), DenseWeights(_dequantize(fmt)(st))
  shared, shared_ref = [], []
  for shape, std in (((1, Is, D), 2 / D**0.5), ((1, D, Is), 1 / Is**0.5), ((1, Is, D), 2 / D**0.5)):
    st = {n: jnp.asarray(a) for n, a in random_storage(pol.dense, shape, std, g).items()}
    shared.append(qw.expert_weights(pol.dense, st, shape))
    shared_ref.append(_dequantize(pol.dense)(st)[0])
  p["shared"], p_ref["shared"] = api.SharedExpert(*shared), tuple(shared_ref)
  want = reference(p_ref)
  y = base.run(p, config("bf16", S, fused))
  err = check(y, want, "fp4_e2m1", f"policy {policy} fused={fused}")
  print(f"policy {policy} fused={fused}: NMSE {err:.2e}")
  assert np.abs(want[dead]).min() > 0  # dead tokens get exactly their shared-expert row, here nonzero
  shared_only = reference({**p_ref, "route_ids": jnp.full_like(p_ref["route_ids"], -1)})
  np.testing.assert_allclose(y[dead], shared_only[dead], rtol=1e-5, atol=1e-5)  # f32 sums in another order


# ---- the kernel's in-tile dequantization is the jnp one, bit for bit ----------------------------------------

def adversarial_storage(fmt: str, shape, g: np.random.Generator) -> dict:
  """Storage with every code byte pattern and per-block random scale bytes: invalid ROCmFP scale bytes (decode to
  0), fp2s / book-select bits, MIX experts in modes 0, 1 and 255, fp4 -0 nibbles. UE8M0 bytes stay in [16, 240] and
  fp8 codes avoid NaN, so every product is a normal float32 or zero (no flush-to-zero differences on a GPU)."""
  layout = formats.get(fmt).storage(shape)
  st = {}
  for name, (shp, dt) in layout.items():
    if name == "books":  # sorted random BF16 levels (the decode selects, whatever the values)
      st[name] = jnp.asarray(np.sort(g.uniform(-4, 4, shp), axis=-1).astype(ml_dtypes.bfloat16))
    elif name == "mode":
      st[name] = jnp.asarray(np.resize(np.array([0, 1, 255], np.uint8), shp))
    elif (fmt, name) in (("fp8_e4m3", "scale"), ("fp4_e2m1", "scale")):
      st[name] = jnp.asarray(g.integers(16, 241, shp), jnp.uint8)
    elif fmt == "fp8_e4m3":
      b = g.integers(0, 256, shp).astype(np.uint8)
      b[(b & 0x7F) == 0x7F] = 0x00
      st[name] = jnp.asarray(b.view(ml_dtypes.float8_e4m3fn))
    else:
      st[name] = jnp.asarray(g.integers(0, 256, shp).astype(np.uint8).view(dt))
  return st


@pytest.mark.parametrize("fmt", qw.QUANTIZED_FORMATS)
def test_tile_loader_is_bit_identical(rng, fmt):
  shape = (2, 256, 256)  # two experts: the expert stride is exercised; each adds ~1 s of interpret-mode grid
  st = adversarial_storage(fmt, shape, rng)
  w = qw.QuantizedExpertWeights.from_storage(fmt, st, shape)
  want = np.asarray(_dequantize(fmt)(st)).view(np.uint32)
  blocks = [(16, 32), (128, 64)]
  if fmt == "fp8_e4m3":  # tiles spanning several 128×128 scale blocks along N, along K, and along both
    blocks += [(256, 32), (32, 256), (256, 128)]
  for bn, bk in blocks:
    got = np.asarray(qw.dequantize_tiles(w, block_n=bn, block_k=bk, interpret=INTERPRET)).view(np.uint32)
    mismatch = np.argwhere(got != want)
    assert mismatch.size == 0, f"{fmt} tiles {bn}x{bk}: {len(mismatch)} weights differ, first at {mismatch[0]}"


# ---- every format's kernels lower through Pallas-Triton for the H200 (sm_90) and gfx1151 --------------------

@pytest.mark.parametrize("fmt", qw.QUANTIZED_FORMATS)
@pytest.mark.parametrize("platform, kind", [("cuda", "NVIDIA H200"), ("rocm", "gfx1151")])
def test_lowers_to_triton(fmt, platform, kind):
  from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
  S, K = 9, 3
  I = inter_dim(fmt)
  sds = jax.ShapeDtypeStruct
  fmt_ = formats.get(fmt)

  def stack(shape):
    return qw.QuantizedExpertWeights.from_storage(
        fmt, {n: sds(s, d) for n, (s, d) in fmt_.storage(shape).items()}, shape)

  args = (sds((S, D), jnp.bfloat16), sds((S, K), jnp.float32), sds((S, K), jnp.int32),
          stack((E, I, D)), stack((E, D, I)), stack((E, I, D)))
  # bf16 dots (the fast path) with the default schedule; exact f32 dots with the persistent one.
  cfgs = {"cuda": dataclasses.replace(base.BASE, block_n=64, block_k=64, down_block_n=128, down_block_k=64,
                                      block_m=64, num_stages=3),
          "rocm": dataclasses.replace(base.BASE, persistent=True, compute_dtype="float32", num_stages=1)}
  cfg = cfgs[platform]
  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind=kind, num_cores=None,
                                                                   platform=platform))
  f = jax.jit(lambda *a: moe(*a, swiglu_limit=LIMIT, config=cfg))
  with use_abstract_mesh(mesh):
    text = f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 3, (platform, fmt)  # gate_up, down, combine


# ---- construction and wrapper-time errors ------------------------------------------------------------------

def test_storage_and_block_errors():
  shape = (4, 64, 128)
  zeros = lambda f, shp: {n: jnp.zeros(s, d) for n, (s, d) in formats.get(f).storage(shp).items()}
  st = {f: zeros(f, shape) for f in FORMATS}

  def bad(match, fmt, arrays, shp=shape):
    with pytest.raises(ValueError, match=match):
      qw.QuantizedExpertWeights.from_storage(fmt, arrays, shp)

  bad(r"unknown quantized weight format 'fp3'; valid formats: fp8_e4m3, fp4_e2m1", "fp3", st["rocmfp3"])
  bad(r"format 'bf16' is not quantized", "bf16", st["bf16"])
  bad(r"rocmfp3 expert stack \(4, 64, 128\) takes storage arrays \['codes_lo', 'codes_hi', 'scales'\]",
      "rocmfp3", {**st["rocmfp3"], "books": st["rocmfp3"]["scales"]})
  bad(r"rocmfp3 expert stack \(4, 64, 128\): array 'codes_hi' must be uint8 \(4, 64, 16\), got uint8 \(4, 64, 32\)",
      "rocmfp3", {**st["rocmfp3"], "codes_hi": st["rocmfp3"]["codes_lo"]})
  bad(r"fp4_e2m1 expert stack \(4, 64, 128\): array 'scale' must be uint8 \(4, 64, 4\), got int8",
      "fp4_e2m1", {**st["fp4_e2m1"], "scale": st["fp4_e2m1"]["scale"].view(jnp.int8)})
  bad(r"fp8_e4m3 expert stack \(4, 64, 128\): array 'scale' must be uint8 \(4, 1, 1\), got uint8 \(4, 64, 1\)",
      "fp8_e4m3", {**st["fp8_e4m3"], "scale": jnp.zeros((4, 64, 1), jnp.uint8)})
  bad(r"fp8_e4m3 expert stack \(4, 64, 128\): array 'weight' must be float8_e4m3fn .*got bfloat16",
      "fp8_e4m3", {**st["fp8_e4m3"], "weight": st["bf16"]["weight"]})
  bad(r"rocmfp2_mix expert stack \(4, 64, 64\): ROCmFP2-MIX needs `in` to be a positive multiple of 128",
      "rocmfp2_mix", {}, (4, 64, 64))
  bad(r"logical shape must be a positive \[E, N, K\] expert stack, got \(64, 128\)", "rocmfp2", st["rocmfp2"],
      (64, 128))
  bad(r"rocmfp2 expert stack \(4, 64, 256\): array 'codes' must be uint8 \(4, 64, 64\), got uint8 \(4, 64, 32\)",
      "rocmfp2", st["rocmfp2"], (4, 64, 256))
  fp4 = {**st["fp4_e2m1"], "packed": st["fp4_e2m1"]["packed"].view(jnp.uint8)}  # uint8 packing is accepted too
  assert qw.QuantizedExpertWeights.from_storage("fp4_e2m1", fp4, shape).shape == shape
  with pytest.raises(ValueError, match=r"bf16 expert stack \(4, 64, 128\): array 'weight' must be bfloat16"):
    qw.expert_weights("bf16", {"weight": st["bf16"]["weight"].astype(jnp.float32)}, shape)

  w = qw.QuantizedExpertWeights.from_storage("rocmfp3", st["rocmfp3"], shape)
  with pytest.raises(ValueError, match=r"rocmfp3 expert stack \[E, N, K\] = \[4, 64, 128\]: block_k=16 must be "
                                       r"a multiple of the format's 32-value block"):
    w.check_blocks(32, 16)
  with pytest.raises(ValueError, match=r"K=128 is not a multiple of block_k=256"):
    w.check_blocks(32, 256)
  with pytest.raises(ValueError, match=r"N=64 is not a multiple of block_n=128"):
    w.check_blocks(128, 32)
  with pytest.raises(ValueError, match=r"must be powers of two"):
    w.check_blocks(48, 32)
  w.check_blocks(64, 128)
  qw.QuantizedExpertWeights.from_storage("fp8_e4m3", st["fp8_e4m3"], shape).check_blocks(16, 16)  # fp8: any pow2

  # Through `moe`: the quantized block rule is checked before anything is built.
  p = base.make_problem(np.random.default_rng(0), 4, 2, E=4, D=128, I=64)
  p["w1"] = p["w3"] = w
  p["w2"] = qw.QuantizedExpertWeights.from_storage("rocmfp3", zeros("rocmfp3", (4, 128, 64)), (4, 128, 64))
  cfg = Config(block_m=16, block_n=32, block_k=16, down_block_k=32, combine_block_d=64)
  with pytest.raises(ValueError, match=r"w1: block_k=16 must be a multiple of the format's 32-value block"):
    moe(**p, swiglu_limit=LIMIT, config=cfg, interpret=INTERPRET)
  with pytest.raises(ValueError, match=r"w2: down block_k=16 must be a multiple of the format's 32-value block"):
    api._down(jnp.zeros((8, 64), jnp.float32), p["w2"], api._route(p["route_ids"], 4, 16),
              config=dataclasses.replace(cfg, down_block_k=16), interpret=INTERPRET)
