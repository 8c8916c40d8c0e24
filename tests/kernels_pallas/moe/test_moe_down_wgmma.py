"""The Mosaic GPU (sm_90) grouped down on FP3-MIX W2 against the exact reference: in Mosaic GPU's interpret mode on
CPU (race detector on) and compiled on an H100/H200; its in-register decode's bit tricks emulated on CPU; and its
lowering for sm_90 at V4-Flash shapes, offline.

The reference multiplies bf16 h by the canonical decode rounded to bf16 (what the kernel multiplies) in f32, so
the only difference is the f32 summation order (NMSE ~1e-14; bound 1e-10, far under a wrong weight's ~1e-3).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # the race detector's state
from jax.experimental.pallas import mosaic_gpu as plgpu

from ds4jax import features
from ds4jax.metrics import nmse
from ds4jax.quant import formats, rocmfp3_mix
from kernels_pallas import moe as moe_api
from kernels_pallas.moe import QuantizedExpertWeights, routing
from kernels_pallas.moe.down import down_reference
from kernels_pallas.moe.down_wgmma import (HIGH_SELECTOR, TILING, TILING_FEW_ROWS, Mix3Stack, decode_planes3,
                                           down_wgmma, mix3_stack, plane_rows, spread_high_bits)
from kernels_pallas.moe.gate_up_wgmma import Tiling, prmt_selectors

ON_GPU = jax.default_backend() == "gpu"
E = 8
STORAGE = ("codes_lo", "codes_hi", "scales", "books", "mode")


def interpret():
  return None if ON_GPU else plgpu.InterpretGPUParams(detect_races=True)


def mix3_storage(rng, shape, *, flagged_uniform=False):
  """Random rocmfp3_mix storage [E, N, K]: random code bytes, meta bytes (UE4M3 0..0x7E, half of them selecting
  book 1), strictly increasing bf16 books; expert 0 in mode 0 (uniform), with `flagged_uniform` keeping bit 7 set
  there too (invalid storage that the decode still defines: ±0)."""
  E_, N, K = shape
  books = np.sort(rng.standard_normal((E_, 2, 8)), axis=-1) + np.arange(8) * 1e-2
  st = dict(codes_lo=rng.integers(0, 256, (E_, N, K // 4), dtype=np.uint8),
            codes_hi=rng.integers(0, 256, (E_, N, K // 8), dtype=np.uint8),
            scales=(rng.integers(0, 0x7F, (E_, N, K // 16)) | (rng.integers(0, 2, (E_, N, K // 16)) << 7)
                    ).astype(np.uint8),
            books=np.asarray(jnp.asarray(books, jnp.bfloat16)), mode=np.ones(E_, np.uint8))
  st["mode"][0] = 0
  if not flagged_uniform:
    st["scales"][0] &= 0x7F
    rocmfp3_mix.check(*(st[k] for k in STORAGE))
  return st


def dense_bf16(st) -> np.ndarray:
  return np.asarray(jnp.asarray(rocmfp3_mix.dequantize(*(st[k] for k in STORAGE))).astype(jnp.bfloat16))


def test_decode_planes3_is_the_canonical_decode(rng):
  K = 64
  st = mix3_storage(rng, (3, 16, K), flagged_uniform=True)
  ms = mix3_stack(st)
  dense = dense_bf16(st).view(np.uint16)
  for e in range(3):
    hi = np.repeat(np.asarray(ms.codes_hi[e]).astype(np.int32), 2, axis=1) >> (4 * (np.arange(K // 4) % 2))
    meta = jnp.repeat(ms.meta[e], 4, axis=-1)
    planes = decode_planes3(ms.codes_lo[e], jnp.asarray(hi), meta, ms.levels[e])
    got = np.stack([np.asarray(p).view(np.uint16) for p in planes], axis=-1).reshape(16, K)  # weight 4i + q
    np.testing.assert_array_equal(got, dense[e])
  assert np.any(dense[0] == 0x8000) and np.any(dense[0] == 0)  # mode 0: −0 (code 4, flagged) and +0


def prmt(a, b, sel):
  """PTX prmt.b32 (default mode) on numpy int arrays: result byte i is byte (nibble i of sel) & 7 of {b, a}, or
  that byte's sign replicated when the nibble's bit 3 is set."""
  a, b, sel = np.broadcast_arrays(a, b, sel)
  table = np.stack([(a >> 8 * j) & 0xFF for j in range(4)] + [(b >> 8 * j) & 0xFF for j in range(4)], -1)
  out = 0
  for i in range(4):
    nib = (sel >> 4 * i) & 0xF
    byte = np.take_along_axis(table, (nib & 7)[..., None], -1)[..., 0]
    byte = np.where(nib & 8, np.where(byte & 0x80, 0xFF, 0), byte)
    out = out | (byte.astype(np.int64) << 8 * i)
  return out


def test_the_eight_level_pick_of_a_byte_pair():
  # decode_planes3_prmt's steps, emulated: two prmts by the low bits, then the high bit's mask, for every code-byte
  # pair and high-bit byte, against values[low + 4 · high] of each plane's two weights
  values = np.array([0x3F80, 0xBE01, 0x0000, 0x7F7F, 0x8000, 0x4120, 0xC2FE, 0x0101], np.int64)  # distinct bytes
  table = [values[2 * h] | values[2 * h + 1] << 16 for h in range(4)]
  pairs, hb = (a.reshape(-1) for a in np.meshgrid(np.arange(1 << 16), np.arange(256), indexing="ij"))
  pairs, hb = pairs[::31], hb[::31]  # every pair and every high byte, not every combination (time)
  spread = spread_high_bits(hb)
  for q in range(4):
    sel = np.asarray(prmt_selectors(jnp.asarray(pairs, jnp.int32), q)).astype(np.int64)
    low, high = prmt(table[0], table[1], sel), prmt(table[2], table[3], sel)
    y = spread << (7 - q)
    mask = prmt(y, y, HIGH_SELECTOR)
    picked = (low & ~mask) | (high & mask)
    for half, byte in ((0, pairs & 0xFF), (1, pairs >> 8)):
      code = ((byte >> 2 * q) & 3) | (((hb >> (4 * half + q)) & 1) << 2)
      np.testing.assert_array_equal((picked >> 16 * half) & 0xFFFF, values[code])


def test_plane_rows(rng):
  h = jnp.asarray(rng.standard_normal((21, 128)), jnp.bfloat16)
  p = np.asarray(plane_rows(h, 128))
  assert p.shape == (24 + 128, 128)
  for q in range(4):  # in each 64-column block, plane q (columns 4i + q) at columns 16q + i
    np.testing.assert_array_equal(p[:21].reshape(21, 2, 4, 16)[:, :, q], np.asarray(h)[:, q::4].reshape(21, 2, 16))


def problem(rng, S, K, *, D, I, mask_every=0, empty=()):
  experts = np.setdiff1d(np.arange(E), empty)
  ids = np.stack([rng.permutation(experts)[:K] for _ in range(S)]).astype(np.int32)
  if mask_every:
    ids.reshape(-1)[mask_every - 1::mask_every] = -1
  r = routing.route(jnp.asarray(ids), E, 32)
  h = jnp.asarray(rng.standard_normal((S * K, I)), jnp.bfloat16)
  return h, mix3_storage(rng, (E, D, I)), r


@pytest.mark.parametrize("tiling", [Tiling(wg_rows=64, block_n=64, stages=2, mma_rows=64),
                                    Tiling(wg_rows=64, block_n=64, stages=3, mma_rows=128, tile_order="item"),
                                    TILING])  # the default: 256-row tiles and wgmmas
def test_down_wgmma_matches_reference(rng, tiling):
  # Three experts routed, ~130 rows each (every 7th route masked; expert 5 among the empty ones): items that start
  # inside the previous expert's rows, 64-row blocks with no row of the expert (skipped), several items per expert
  # with the 128-row tile. D = 256: two units per item (an N-tile pair each), on 3 SMs. I = 512: two meta tiles,
  # four high-bit tiles. h as plane_rows, one K-64 wgmma a step on the joined planes.
  D, I = 256, 512
  h, st, r = problem(rng, 150, 3, D=D, I=I, mask_every=7, empty=(1, 2, 3, 5, 6))
  out = jax.block_until_ready(down_wgmma(h, mix3_stack(st), r, tiling=tiling, num_sms=3, interpret=interpret()))
  if not ON_GPU:  # after the kernel has finished (test_moe_gate_up_wgmma.assert_no_races)
    assert not interpret_pallas_call.get_races().races_found
  ref = down_reference(h, jnp.asarray(dense_bf16(st)), r)
  n = int(r.num_rows[0])
  assert int(r.group_sizes[5]) == 0 and n < 150 * 3 and int(max(r.group_sizes)) > 128
  assert float(jnp.mean(jnp.abs(ref[:n]))) > 0.1
  err = nmse(out[:n], ref[:n])
  assert err <= 1e-10, err


def test_down_wgmma_rejects_bad_input(rng):
  h, st, r = problem(rng, 16, 2, D=128, I=256)
  w2 = mix3_stack(st)
  with pytest.raises(ValueError, match="Mix3Stack"):
    down_wgmma(h, jnp.zeros((E, 128, 256), jnp.bfloat16), r)
  with pytest.raises(ValueError, match="bf16 h"):
    down_wgmma(h.astype(jnp.float32), w2, r)
  t = Tiling(wg_rows=64, block_n=64, mma_rows=64)
  with pytest.raises(ValueError, match=r"h \[160, 256\] already as plane_rows"):  # one row short of the last copy
    down_wgmma(plane_rows(h, 128)[:-1], w2, r, tiling=t, h_as_plane_rows=True)
  with pytest.raises(ValueError, match=r"h \[32, 256\] in sorted rows"):  # plane_rows given as rows
    down_wgmma(plane_rows(h, 128), w2, r, tiling=t)
  with pytest.raises(ValueError, match="I a multiple of 256"):
    down_wgmma(h[:, :128], Mix3Stack(*(a[..., :k] for a, k in zip(w2[:3], (32, 16, 8))), *w2[3:]), r)
  with pytest.raises(ValueError, match="block_n 64"):
    down_wgmma(h, w2, r, tiling=Tiling(block_n=128))
  with pytest.raises(ValueError, match="profile_regions"):  # the profiler's region sets (experiments/profile_moe.py)
    down_wgmma(h, w2, r, tiling=Tiling(block_n=64, mma_rows=128, wg_rows=64, profile_regions="step"))


def test_down_wgmma_lowers_for_sm90_at_v4_flash_shapes():
  # Offline (no GPU): Mosaic GPU's layout inference and its 227 KiB shared-memory check run in the lowering.
  S, K, E_, D, I = 8192, 6, 256, 4096, 2048
  u8 = lambda k: jax.ShapeDtypeStruct((E_, D, I // k), jnp.uint8)
  w2 = Mix3Stack(u8(4), u8(8), u8(16), jax.ShapeDtypeStruct((E_, 2, 8), jnp.float32))
  h = jax.ShapeDtypeStruct((S * K, I), jnp.bfloat16)
  r = jax.eval_shape(lambda i: routing.route(i, E_, 128), jax.ShapeDtypeStruct((S, K), jnp.int32))
  def lower(t):
    return jax.jit(lambda h, w, r: down_wgmma(h, w, r, tiling=t)).trace(h, w2, r).lower(
        lowering_platforms=("cuda",)).as_text()

  for t in (TILING, TILING_FEW_ROWS):
    assert "mosaic_gpu" in lower(t)
  with pytest.raises(ValueError, match="exceeds available shared memory"):
    lower(dataclasses.replace(TILING, stages=6))


def test_moe_runs_it_for_down_kernel_wgmma(rng):
  # api.moe with Config.down_kernel "wgmma": the Triton gate/up on FP2-MIX W1/W3 (decoded in-kernel), this kernel on
  # the FP3-MIX storage; the whole MoE against the exact reference on the same weights (bf16 operands). Then what it
  # refuses, at the call.
  S, K, D, I = 24, 2, 128, 256
  x = jnp.asarray(rng.standard_normal((S, D)), jnp.bfloat16)
  w1, w2, w3 = (jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-1]), jnp.float32)
                for s in ((E, I, D), (E, D, I), (E, I, D)))
  q = lambda fmt, w: QuantizedExpertWeights.from_storage(fmt, formats.get(fmt).quantize(w), w.shape)
  q1, q2, q3 = q("rocmfp2_mix", w1), q("rocmfp3_mix", w2), q("rocmfp2_mix", w3)
  ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(S)]), jnp.int32)
  rw = jnp.asarray(rng.random((S, K)), jnp.float32)
  cfg = moe_api.Config.default(num_tokens=S, top_k=K, num_experts=E, hidden=D, intermediate=I,
                               platform="cuda" if ON_GPU else "cpu", down_kernel="wgmma")
  run = lambda x, w=q2: moe_api.moe(x, rw, ids, q1, w, q3, swiglu_limit=3.0, config=cfg, interpret=not ON_GPU,
                                    validate_routes=False)
  calls = features.pallas_calls(run, x)
  plan = moe_api.plan(num_tokens=S, top_k=K, num_experts=E, hidden=D, intermediate=I, config=cfg,
                      interpret=not ON_GPU)
  assert tuple(n for n, _ in calls) == plan.kernels and plan.kernels[1] == "moe_down_wgmma"
  assert calls[1][1] == plan.down_grid
  # each finished before the next starts (an interpreted kernel beside other work can deadlock on two cores)
  ref = jax.block_until_ready(moe_api.moe_reference(x, rw, ids, q1, q2, q3,
                                                    swiglu_limit=3.0, operand_dtype=jnp.bfloat16))
  assert float(jnp.mean(jnp.abs(ref))) > 0.1
  err = nmse(jax.block_until_ready(run(x)), ref)
  assert err <= 1e-8, err
  with pytest.raises(ValueError, match="takes bf16 x and rocmfp3_mix W2"):
    run(x, moe_api.DenseWeights(w2.astype(jnp.bfloat16)))
