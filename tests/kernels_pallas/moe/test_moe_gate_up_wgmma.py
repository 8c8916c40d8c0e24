"""The Mosaic GPU (sm_90) grouped gate/up against the exact reference: in Mosaic GPU's interpret mode on CPU (which
simulates the warpgroups, the TMA copies and their barriers) and compiled on an H100/H200; and its lowering for
sm_90 at V4-Flash shapes, offline.

The routes cover what the work list can hold: experts with more rows than one row tile (several items each), tiles
that start inside the previous expert's rows, 64-row blocks that hold no row of the expert (no wgmma is issued for
them), empty experts, masked routes (−1), and fewer SMs than units (each SM loops); both unit orders, separate and
interleaved W1/W3, clusters of one and two SMs, separate x and weight rings; FP2-MIX W1/W3 decoded in the kernel,
one per warpgroup.
The interpreter's race detector is on: a missing wait between the warpgroups shows up as a race or a barrier
error. bf16 operands, bf16 h: the tolerance is bf16's rounding of h
(NMSE ≤ 2e-5, measured ~3e-6).
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # the race detector's state
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from ds4jax import features
from ds4jax.metrics import nmse
from ds4jax.quant import formats, rocmfp2_mix, ue4m3
from kernels_pallas import moe as moe_api
from kernels_pallas.moe import QuantizedExpertWeights, dequantize_to_dense, gate_up, routing
from kernels_pallas.moe.gate_up_wgmma import (MIX_TILING, MIX_TILING_FEW_ROWS, RING_W64, RING_X4, ROW_ALIGN, MixStack,
                                              Tiling, aligned_items, as_plane_rows, decode_planes, default_tiling,
                                              expert_levels, gate_up_wgmma, gather_rows, interleave, mix_stack,
                                              padded_rows, prmt_selectors, ring_layout, rows_by_plane, sorted_rows,
                                              tile_by_step)

ON_GPU = jax.default_backend() == "gpu"
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                                                 platform="cuda"))
LIMIT = 3.0
E, D, I = 8, 128, 256


def interpret():
  """None on a GPU (compiled); on CPU the interpreter with its happens-before race detector on."""
  return None if ON_GPU else plgpu.InterpretGPUParams(detect_races=True)


def assert_no_races(out):
  """After the kernel has finished (dispatch is asynchronous: the detector fills in while the interpreter runs, and
  work dispatched beside a running interpreter can deadlock it on two cores)."""
  jax.block_until_ready(out)
  if not ON_GPU:
    assert not interpret_pallas_call.get_races().races_found


def problem(rng, S, K, *, mask_every=0, empty=(), inter=I, d=D):
  x = jnp.asarray(rng.standard_normal((S, d)), jnp.bfloat16)
  w1, w3 = (jnp.asarray(2.0 / np.sqrt(d) * rng.standard_normal((E, inter, d)), jnp.bfloat16) for _ in range(2))
  experts = np.setdiff1d(np.arange(E), empty)
  ids = np.stack([rng.permutation(experts)[:K] for _ in range(S)]).astype(np.int32)
  if mask_every:
    ids.reshape(-1)[mask_every - 1::mask_every] = -1
  return x, w1, w3, jnp.asarray(ids)


def check(x, w1, w3, ids, t: Tiling, num_sms: int, interleaved=False, step_tiled=False):
  """step_tiled: True (boxes of a slot's rows) or a layout function of one stack."""
  r = routing.route(ids, E, 32)  # the kernel builds its own work list; the routing's row tile does not matter
  ws = (interleave(w1, w3, t.block_n), None) if interleaved else (w1, w3)
  if step_tiled:
    tiled = step_tiled if callable(step_tiled) else lambda w: tile_by_step(w, t.block_n * (1 + interleaved), t.block_k)
    ws = tuple(w if w is None else tiled(w) for w in ws)
  h = gate_up_wgmma(x, *ws, r, swiglu_limit=LIMIT, tiling=t, num_sms=num_sms, interpret=interpret())
  assert_no_races(h)
  ref = gate_up.gate_up_reference(x, w1, w3, r, swiglu_limit=LIMIT)
  n = int(r.num_rows[0])
  assert float(jnp.mean(jnp.abs(ref[:n]))) > 0.1  # real values, both clamps reached below
  assert float(jnp.max(jnp.abs(ref[:n]))) >= 0.99 * LIMIT * LIMIT / (1 + np.exp(-LIMIT))
  err = nmse(h[:n].astype(jnp.float32), ref[:n])
  assert err <= 2e-5, err
  return r


@pytest.mark.parametrize("stages,order,interleaved,cluster", [(2, "n", False, 1), (3, "item", True, 2)])
def test_gate_up_wgmma_matches_reference(rng, stages, order, interleaved, cluster):
  # 80 tokens × top-3 over 7 experts (expert 5 empty, every 7th route masked): ~30 rows per expert, under one
  # warpgroup's 64, so the second warpgroup of every item stores nothing.
  x, w1, w3, ids = problem(rng, 80, 3, mask_every=7, empty=(5,))
  r = check(x, w1, w3, ids, Tiling(wg_rows=64, block_n=128, block_k=64, stages=stages, tile_order=order,
                                   cluster=cluster), num_sms=4, interleaved=interleaved)
  assert int(r.group_sizes[5]) == 0 and int(r.num_rows[0]) < 80 * 3


def test_gate_up_wgmma_several_items_per_expert(rng):
  # 300 tokens × top-4 over 8 experts: ~150 rows per expert. Row tile 128 (64 per warpgroup): a full item and a
  # second one that ends in the first warpgroup's half. Row tile 256 (two 64-row blocks per warpgroup): the second
  # warpgroup skips its empty last block.
  x, w1, w3, ids = problem(rng, 300, 4, inter=64)
  for t, items in ((Tiling(wg_rows=64, block_n=64, stages=2, skip_empty=False), 2 * E),
                   (Tiling(wg_rows=128, block_n=64, stages=2), E)):
    r = check(x, w1, w3, ids, t, num_sms=6)
    assert int(aligned_items(r, t.block_m).count[0]) == items


@pytest.mark.parametrize("interleaved,cluster,order", [(False, 1, "n"), (True, 2, "item")])
def test_gate_up_wgmma_reads_step_tiled_weights(rng, interleaved, cluster, order):
  # tile_by_step's layout: each step's W box one contiguous run. The same h as the reference; a wrong layout refused.
  x, w1, w3, ids = problem(rng, 80, 3, mask_every=7)
  t = Tiling(wg_rows=64, block_n=64, block_k=64, stages=2, cluster=cluster, tile_order=order)
  check(x, w1, w3, ids, t, num_sms=4, interleaved=interleaved, step_tiled=True)
  tiled = tile_by_step(w1, 64, 64)
  assert tiled.shape == (E, I // 64, D // 64 * 64, 64) and (tiled[3, 2, 64 + 5] == w1[3, 2 * 64 + 5, 64:128]).all()
  with pytest.raises(ValueError, match="step-tiled w1"):
    gate_up_wgmma(x, tile_by_step(w1, 32, 64), tile_by_step(w3, 32, 64), routing.route(ids, E, 32),
                  swiglu_limit=LIMIT, tiling=t, interpret=interpret())


def test_both_rings_read_ring_layout(rng):
  # RING_W64's 128-row N tiles from 64-row boxes: two copies per projection per step, into one slot (a wrong box
  # order swaps N tiles: h's columns move). The race detector checks the slot's barrier takes all four arrivals.
  x, w1, w3, ids = problem(rng, 200, 3, mask_every=7)
  assert I // RING_W64.block_n == 2 and ring_layout(w1).shape == (E, I // 64, D, 64)
  check(x, w1, w3, ids, dataclasses.replace(RING_W64, stages=3, x_stages=2), num_sms=3, step_tiled=ring_layout)


@pytest.mark.parametrize("x_stages,stages,in_flight,interleaved,step_tiled,copy_warp,carried_units", [
    (2, 3, 1, True, True, False, False), (1, 2, 0, False, False, True, True),
    (4, 4, 1, False, False, False, False)])  # the last: RING_X4 on dense stacks, as default_tiling picks it
def test_gate_up_wgmma_with_separate_x_and_weight_rings(rng, x_stages, stages, in_flight, interleaved, step_tiled,
                                                         copy_warp, carried_units):
  # _ring_kernel. Skewed routes (expert 0 ~340 rows, the others ~50-190), so with 128-row warpgroups a warpgroup
  # has 0, 1 or 2 non-empty 64-row blocks in an item (each count runs its own loop), and expert 0 two items. Two N
  # tiles; fewer SMs than units: each SM's rings run on across units. The wgmmas in flight and the late releases
  # are checked by the race detector with the wgmmas run as late as the GPU may (tests/async_wgmma.py).
  x, w1, w3, _ = problem(rng, 400, 3, inter=128)
  p = np.array([12, 4, 3, 2, 1, 1, 1, 1]) / 25
  ids = np.stack([rng.choice(E, 3, replace=False, p=p) for _ in range(400)]).astype(np.int32)
  ids.reshape(-1)[8::9] = -1
  t = Tiling(wg_rows=128, block_n=64, stages=stages, x_stages=x_stages, mma_in_flight=in_flight,
             copy_warp=copy_warp, carried_units=carried_units)
  r = check(x, w1, w3, jnp.asarray(ids), t, num_sms=3, interleaved=interleaved, step_tiled=step_tiled)
  items = aligned_items(r, t.block_m)
  n = int(items.count[0])
  rows = np.minimum(np.asarray(items.end - items.x_start)[:n, None], t.block_m) - [0, t.wg_rows]
  assert set(np.clip(-(-rows // 64), 0, 2).ravel()) == {0, 1, 2} and n > E
  for bad in (dict(cluster=2), dict(x_stages=stages + 1), dict(tile_order="item"), dict(x_stages=1, mma_in_flight=1),
              dict(x_stages=0, mma_in_flight=0, copy_warp=True), dict(x_stages=0, mma_in_flight=0, carried_units=True)):
    with pytest.raises(ValueError, match="separate x and weight rings"):
      gate_up_wgmma(x, w1, w3, r, swiglu_limit=LIMIT, tiling=dataclasses.replace(t, **bad), interpret=interpret())


def test_default_tiling_picks_a_ring_on_bf16_weights():
  # the H100 measurements in turns with torch._grouped_mm (BENCHMARKS.md, session 63): RING_X4 at about 192 rows per
  # expert (8192 tokens of V4-Flash), RING_W64 at 12, 48 and 768 (512, 2048, 32768 tokens) unless I is not a multiple
  # of its 128-column N tile; FP2-MIX weights keep their own tilings, MIX_TILING's cluster of two 64-column N tiles
  # where I is a multiple of 128. Whatever it picks fits every I that moe.check_kernels lets through (multiples of 64).
  assert default_tiling(192, False, 2048) == RING_X4 and RING_X4.x_stages
  assert [default_tiling(rows, False, 2048) for rows in (12, 48, 768)] == [RING_W64] * 3 and RING_W64.x_stages
  assert default_tiling(768, False, 192) == RING_X4
  assert default_tiling(768, True, 2048) == MIX_TILING and default_tiling(768, True, 192) == MIX_TILING_FEW_ROWS
  for rows, mix, inter in itertools.product((12, 48, 72, 192, 768), (False, True), (64, 128, 192, 256)):
    t = default_tiling(rows, mix, inter)
    assert inter % (t.block_n * t.cluster) == 0, (rows, mix, inter, t)


def test_gate_up_wgmma_keeps_a_nan_weight(rng):
  # A NaN in expert 2's W1 makes every h row of expert 2 NaN and leaves the others finite. Compiled, a min clamp of
  # the gate returned L for a NaN and hid it; the clamp is a select (gate_up.clamped_swiglu).
  x, w1, w3, ids = problem(rng, 40, 2, inter=64)
  r = routing.route(ids, E, 32)
  run = lambda x, w1, w3: gate_up_wgmma(x, w1, w3, r, swiglu_limit=LIMIT, tiling=Tiling(wg_rows=64, block_n=64),
                                        num_sms=4, interpret=interpret())
  assert not features.float_min_max(run, x, w1, w3)  # they keep a NaN in the interpreter, not compiled
  h = run(x, w1.at[2, :, 0].set(jnp.nan), w3)
  assert_no_races(h)
  h, lo, hi, n = np.asarray(h, np.float32), int(r.group_offsets[2]), int(r.group_offsets[3]), int(r.num_rows[0])
  assert hi > lo and np.isnan(h[lo:hi]).all()
  assert np.isfinite(np.delete(h[:n], np.s_[lo:hi], axis=0)).all()


@pytest.mark.parametrize("block_m", [16, 128])
def test_aligned_items_cover_each_row_once(rng, block_m):
  x, _, _, ids = problem(rng, 70, 3, mask_every=5, empty=(2,))
  r = routing.route(ids, E, 64)
  items = aligned_items(r, block_m)
  n, offsets = int(r.num_rows[0]), np.asarray(r.group_offsets)
  stored = np.zeros(n, int)
  for e, x_start, lo, end in zip(*(np.asarray(a)[:int(items.count[0])] for a in items[:4])):
    assert x_start % ROW_ALIGN == 0 and x_start <= lo < end and offsets[e] <= lo and end == offsets[e + 1]
    stored[lo:min(end, x_start + block_m)] += 1
  np.testing.assert_array_equal(stored, 1)
  assert items.expert.shape[0] >= int(items.count[0])
  xs = sorted_rows(x, r, block_m)
  assert xs.shape[0] % ROW_ALIGN == 0 and xs.shape[0] >= max(np.asarray(items.x_start)) + block_m
  np.testing.assert_array_equal(np.asarray(xs[:n]), np.asarray(x)[np.asarray(r.token_of_row)[:n]])


def test_aligned_items_lower_without_a_loop(rng):
  # on a GPU a while loop runs as a chain of small launches before every gate/up and down
  r = routing.route(problem(rng, 70, 3)[3], E, 64)
  assert "stablehlo.while" not in jax.jit(aligned_items, static_argnums=1).lower(r, 128).as_text()


def test_gate_up_wgmma_rejects_bad_input(rng):
  x, w1, w3, ids = problem(rng, 16, 2)
  r = routing.route(ids, E, 128)
  with pytest.raises(ValueError, match="tile_order"):
    gate_up_wgmma(x, w1, w3, r, swiglu_limit=LIMIT, tiling=Tiling(tile_order="m"))
  with pytest.raises(ValueError, match="profile_regions"):  # the profiler's region sets (experiments/profile_moe.py)
    gate_up_wgmma(x, w1, w3, r, swiglu_limit=LIMIT, tiling=Tiling(profile_regions="step"))
  with pytest.raises(ValueError, match="mma_in_flight=1 takes the separate x and weight rings"):  # it raced
    gate_up_wgmma(x, w1, w3, r, swiglu_limit=LIMIT, tiling=Tiling(wg_rows=64, mma_in_flight=1))
  with pytest.raises(ValueError, match="bf16/f16"):
    gate_up_wgmma(x.astype(jnp.float32), w1, w3, r, swiglu_limit=LIMIT)
  with pytest.raises(ValueError, match="or be MixStacks"):
    gate_up_wgmma(x, w1.astype(jnp.float32), w3, r, swiglu_limit=LIMIT)
  with pytest.raises(ValueError, match="h as plane_rows takes FP2-MIX weights"):  # the down's h is FP2-MIX's alone
    gate_up_wgmma(x, w1, w3, r, swiglu_limit=LIMIT, h_plane_rows=padded_rows(r.num_routes, 128))
  stack = mix_stack(mix_storage(rng, w1.shape))
  with pytest.raises(ValueError, match="with D a multiple of 256"):  # D = 128: a meta row shorter than a TMA row
    gate_up_wgmma(x, stack, stack, r, swiglu_limit=LIMIT, tiling=Tiling(block_n=64))
  x, w1, _, _ = problem(rng, 16, 2, d=256)
  stack = mix_stack(mix_storage(rng, w1.shape))
  with pytest.raises(ValueError, match="FP2-MIX weights need block_n=64"):
    gate_up_wgmma(x, stack, stack, r, swiglu_limit=LIMIT, tiling=Tiling(block_n=128))


@pytest.mark.parametrize("wg_rows,block_n,cluster,weights", [
    (128, 64, 1, "dense"), (64, 128, 2, "dense"), (128, 64, 2, "interleaved"), (128, 64, 1, "mix"),
    (128, 64, 2, "mix h plane_rows"), (128, 64, 1, "interleaved step-tiled"),
    (128, 64, 1, "interleaved step-tiled rings"),
    (64, 128, 1, "interleaved step-tiled rings"), (128, 64, 1, "interleaved step-tiled rings copy_warp carried"),
    (128, 64, 1, "dense rings"), (64, 128, 1, "dense rings"), (64, 128, 1, "ring_layout rings")])
def test_gate_up_wgmma_lowers_for_sm90_at_v4_flash_shapes(wg_rows, block_n, cluster, weights):
  # Offline (no GPU): Mosaic GPU's layout inference and its 227 KiB shared-memory check run in the lowering.
  S, K, E_, D_, I_ = 8192, 6, 256, 4096, 2048
  x = jax.ShapeDtypeStruct((S, D_), jnp.bfloat16)
  if weights.startswith("mix"):
    u8 = lambda k: jax.ShapeDtypeStruct((E_, I_, D_ // k), jnp.uint8)
    stack = MixStack(u8(4), u8(16), jax.ShapeDtypeStruct((E_, 2, 4), jnp.float32))
    ws = (stack, stack)
  elif weights == "interleaved":
    ws = (jax.ShapeDtypeStruct((E_, 2 * I_, D_), jnp.bfloat16), None)
  elif weights.startswith("interleaved step-tiled"):
    ws = (jax.ShapeDtypeStruct((E_, I_ // block_n, D_ // 64 * 2 * block_n, 64), jnp.bfloat16), None)
  elif weights.startswith("ring_layout"):  # two 64-row boxes per projection and step
    ws = (jax.ShapeDtypeStruct((E_, I_ // 64, D_, 64), jnp.bfloat16),) * 2
  else:
    ws = (jax.ShapeDtypeStruct((E_, I_, D_), jnp.bfloat16),) * 2
  r = jax.eval_shape(lambda i: routing.route(i, E_, 128), jax.ShapeDtypeStruct((S, K), jnp.int32))

  def lower(t):
    rows = padded_rows(S * K, 256) if weights == "mix h plane_rows" else None
    f = lambda x, a, b, r: gate_up_wgmma(x, a, b, r, swiglu_limit=10.0, tiling=t, h_plane_rows=rows)
    with use_abstract_mesh(H200):  # the row gather is a Pallas-Triton kernel: it lowers for a named GPU
      return jax.jit(f).trace(x, *ws, r).lower(lowering_platforms=("cuda",)).as_text()

  mix = weights.startswith("mix")
  t = Tiling(wg_rows=wg_rows, block_n=block_n, cluster=cluster, stages=3 if mix else 4, mma_rows=256 if mix else 64)
  if "rings" in weights:  # the measured best rings (BENCHMARKS.md, session 40): 224 and 208 KiB
    t = dataclasses.replace(t, x_stages=4 if wg_rows == 128 else 3, mma_in_flight=1, copy_warp="copy_warp" in weights,
                            carried_units="carried" in weights)
  text = lower(t)
  assert "mosaic_gpu" in text and "xla.gpu.triton" in text  # the kernel and the row gather in front of it
  with pytest.raises(ValueError, match="exceeds available shared memory"):
    lower(dataclasses.replace(t, stages=t.stages + 1 if mix else 6))


def mix_storage(rng, shape, *, flagged_uniform=False):
  """Random rocmfp2_mix storage [E, N, K]: random code bytes, meta bytes (UE4M3 0..0x7E, half of them selecting
  book 1) and strictly increasing bf16 books; expert 0 in mode 0 (uniform), whose meta bytes are plain UE4M3 (valid
  storage), or with `flagged_uniform` keep bit 7 too: invalid storage that the decode still defines (±0)."""
  E_, N, K_ = shape
  books = np.sort(rng.standard_normal((E_, 2, 4)), axis=-1) + np.arange(4) * 1e-2  # distinct in bf16
  st = dict(codes=rng.integers(0, 256, (E_, N, K_ // 4), dtype=np.uint8),
            scales=(rng.integers(0, 0x7F, (E_, N, K_ // 16)) | (rng.integers(0, 2, (E_, N, K_ // 16)) << 7)
                    ).astype(np.uint8),
            books=np.asarray(jnp.asarray(books, jnp.bfloat16)), mode=np.ones(E_, np.uint8))
  st["mode"][0] = 0
  if not flagged_uniform:
    st["scales"][0] &= 0x7F
    rocmfp2_mix.check(*(jnp.asarray(st[k]) for k in ("codes", "scales", "books", "mode")))
  return st


def test_decode_planes_is_the_canonical_decode(rng):
  st = mix_storage(rng, (3, 16, D), flagged_uniform=True)
  ms = mix_stack(st)
  dense = np.asarray(jnp.asarray(rocmfp2_mix.dequantize(*(st[k] for k in ("codes", "scales", "books", "mode"))))
                     .astype(jnp.bfloat16)).view(np.uint16)  # [E, N, K] bits
  for e in range(3):
    meta = jnp.repeat(ms.meta[e], 4, axis=-1)  # one per code byte
    planes = decode_planes(ms.codes[e], meta, ms.levels[e])
    got = np.stack([np.asarray(p).view(np.uint16) for p in planes], axis=-1).reshape(16, D)  # weight 4i + q
    np.testing.assert_array_equal(got, dense[e])
  assert np.any(dense[0] == 0x8000) and np.any(dense[0] == 0)  # the flagged uniform half-blocks: −0 and +0


@pytest.mark.parametrize("mode", [1, 0])
def test_decode_planes_every_byte_pair(mode):
  # every meta byte (0x7F and 0xFF included, which decode to 0) with every code byte, against ue4m3.decode and the
  # books picked the canonical way; in mode 0 the fixed levels, where a set bit 7 zeroes the scale
  meta, codes = (jnp.asarray(a, jnp.uint8) for a in np.meshgrid(np.arange(256), np.arange(256), indexing="ij"))
  books = np.array([[-1.5, -0.25, 0.375, 2.0], [-3.0, -0.5, 0.0, 1.25]], np.float32)
  fixed = np.asarray(rocmfp2_mix.fixed_level(jnp.arange(4)), np.float32)
  levels = expert_levels({"mode": np.array([mode]), "books": jnp.asarray(books, jnp.bfloat16)[None]}, fixed)[0]
  planes = decode_planes(codes, meta, [[levels[s, k] for k in range(4)] for s in range(2)])
  m = np.asarray(meta).astype(np.int32)
  scale = np.asarray(ue4m3.decode(jnp.asarray(m if mode == 0 else m & 0x7F)))
  for q, plane in enumerate(planes):
    code = (np.asarray(codes).astype(np.int32) >> (2 * q)) & 3
    level = fixed[code] if mode == 0 else np.where(m >= 0x80, books[1][code], books[0][code])
    want = (level * scale).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(plane).view(np.uint16), want.view(np.uint16))
  assert np.any(np.asarray(planes[0]).view(np.uint16) == 0x8000)  # −0 from a negative level times a zero scale


def test_prmt_selectors_pick_each_plane_of_a_byte_pair():
  # prmt on sm_90, emulated: result byte i is byte (selector nibble i) of the 8-byte table, value v in bytes 2v, 2v+1
  values = np.array([0x3F80, 0xBE01, 0x0000, 0x7F7F], np.uint16)  # distinct bytes: a swapped half would show
  table = values.view(np.uint8)
  pairs = np.arange(1 << 16, dtype=np.int32)  # byte 2c in bits 0-7, byte 2c + 1 in bits 8-15
  for q in range(4):
    sel = np.asarray(prmt_selectors(jnp.asarray(pairs), q))
    picked = np.stack([table[(sel >> (4 * i)) & 7] for i in range(4)], axis=-1).astype(np.uint16)
    np.testing.assert_array_equal(picked[:, 0] | picked[:, 1] << 8, values[(pairs >> (2 * q)) & 3])
    np.testing.assert_array_equal(picked[:, 2] | picked[:, 3] << 8, values[(pairs >> (8 + 2 * q)) & 3])
    assert np.all((sel >> 16) == 0) and np.all(((sel >> np.arange(0, 16, 4)[:, None]) & 8) == 0)  # no sign mode


def test_gather_rows_matches_sorted_rows(rng):
  # The Pallas gather the kernel's x comes from makes sorted_rows, or as_plane_rows of it (FP2-MIX): each 64-column
  # block holds the 16 columns of plane 0 (columns 4i), then of planes 1, 2, 3. D = 256: two column blocks of 128.
  x, _, _, ids = problem(rng, 24, 2, d=256, mask_every=5)
  r = routing.route(ids, E, 32)
  xs = np.asarray(sorted_rows(x, r, 128))
  assert xs.shape == (padded_rows(48, 128), 256)
  np.testing.assert_array_equal(np.asarray(gather_rows(x, r, 128, cols=128, interpret=not ON_GPU)), xs)
  xr = np.asarray(as_plane_rows(jnp.asarray(xs)))
  for q in range(4):
    np.testing.assert_array_equal(xr.reshape(-1, 4, 4, 16)[:, :, q], xs[:, q::4].reshape(-1, 4, 16))
  np.testing.assert_array_equal(
      np.asarray(gather_rows(x, r, 128, cols=128, plane_rows=True, interpret=not ON_GPU)), xr)


@pytest.mark.parametrize("d, plane_rows", [(768, True), (576, False)])
def test_gather_rows_tiles_any_hidden_size_the_kernels_take(rng, d, plane_rows):
  """The default column block is the largest power of two up to 512 that divides D: D 768 (FP2-MIX takes multiples
  of 256) and 576 (bf16 takes multiples of 64) gather, where a fixed block refused them (and a block of 192 would not
  compile: Triton blocks are powers of two)."""
  x, _, _, ids = problem(rng, 24, 2, d=d, mask_every=5)
  r = routing.route(ids, E, 32)
  want = sorted_rows(x, r, 128)
  want = np.asarray(as_plane_rows(want) if plane_rows else want)
  np.testing.assert_array_equal(np.asarray(gather_rows(x, r, 128, plane_rows=plane_rows, interpret=not ON_GPU)), want)


def test_rows_by_plane_makes_the_output_columns_plane_rows(rng):
  # weight rows in rows_by_plane's order give output columns in as_plane_rows' order, tile by tile: x · W^T with W's
  # rows reordered is as_plane_rows of x · W^T (exact: a permutation of the same sums)
  x, w = rng.integers(-9, 10, (5, 32)), rng.integers(-9, 10, (128, 32))
  np.testing.assert_array_equal(x @ np.asarray(rows_by_plane(jnp.asarray(w))).T,
                                np.asarray(as_plane_rows(jnp.asarray(x @ w.T))))


# Compiled, the planes come from decode_planes_prmt (meta read from shared memory); the interpreter runs decode_planes
@pytest.mark.parametrize("decode,cluster", [("64-row wgmmas", 1), ("128-row wgmmas", 2)])
def test_gate_up_wgmma_decodes_fp2_mix(rng, decode, cluster):
  # ~80 rows per expert (three experts routed, expert 0 among them), a 128-row tile: its second 64-row block is
  # partial. W1/W3 in FP2-MIX (expert 0 uniform), decoded in the kernel, one projection per warpgroup on all 128 rows,
  # two N tiles (with cluster 2, one per SM of a cluster, x multicast: `default_tiling`'s MIX_TILING). D = 512: two
  # meta tiles (256 weights each), each serving 4 K steps. Compared with the reference on the canonically decoded
  # weights rounded to bf16 (what the kernel multiplies), so the tolerance is the bf16 rounding of h.
  D_ = 512
  x, w1, w3, ids = problem(rng, 120, 2, inter=128, d=D_, empty=(2, 3, 4, 5, 6))
  st1, st3 = mix_storage(rng, w1.shape), mix_storage(rng, w3.shape)
  q1, q3 = (QuantizedExpertWeights.from_storage("rocmfp2_mix", st, (E, 128, D_)) for st in (st1, st3))
  r = routing.route(ids, E, 32)
  assert int(r.group_sizes[0]) > 64
  t = Tiling(wg_rows=64, block_n=64, stages=2, mma_rows=128 if "128" in decode else 64, cluster=cluster)
  h = gate_up_wgmma(x, mix_stack(st1), mix_stack(st3), r, swiglu_limit=LIMIT, tiling=t, num_sms=6,
                    interpret=interpret())
  assert_no_races(h)
  ref = gate_up.gate_up_reference(x, dequantize_to_dense(q1).w, dequantize_to_dense(q3).w, r, swiglu_limit=LIMIT)
  n = int(r.num_rows[0])
  assert float(jnp.mean(jnp.abs(ref[:n]))) > 0.1
  err = nmse(h[:n].astype(jnp.float32), ref[:n])
  assert err <= 2e-5, err


@pytest.mark.skipif(not ON_GPU, reason="the compiled decode (decode_planes_prmt); the interpreter runs decode_planes, "
                    "checked bit by bit above")
def test_compiled_decode_gives_every_weight(rng):
  # x rows one-hot, so h[r, n] = swiglu(W1[n, k], W3[n, k]) for row r's column k: a wrongly decoded weight shows in
  # its own output, where in a sum over K a small scale's weights (UE4M3 subnormals: 8 of 128 scales) hide under the
  # large ones. Every meta byte value in every expert (0x7F and 0xFF too, which zero the scale), expert 0 in mode 0;
  # a limit the values stay under. About 64 rows an expert × 128 outputs: ~8000 weights of W1 and of W3 an expert.
  D_, I_, limit = 512, 128, 1e6
  _, w1, _, ids = problem(rng, 256, 2, inter=I_, d=D_)
  st1, st3 = mix_storage(rng, w1.shape, flagged_uniform=True), mix_storage(rng, w1.shape, flagged_uniform=True)
  for st in (st1, st3):
    st["scales"] = rng.permuted(np.arange(st["scales"].size).reshape(st["scales"].shape) % 256, axis=-1
                                ).astype(np.uint8)
  x = jnp.asarray(np.eye(D_)[rng.integers(0, D_, 256)], jnp.bfloat16)
  r = routing.route(ids, E, 32)
  h = gate_up_wgmma(x, mix_stack(st1), mix_stack(st3), r, swiglu_limit=limit, tiling=MIX_TILING)
  w1, w3 = (rocmfp2_mix.dequantize(*(st[k] for k in ("codes", "scales", "books", "mode"))).astype(jnp.bfloat16)
            for st in (st1, st3))
  ref = gate_up.gate_up_reference(x, w1, w3, r, swiglu_limit=limit)
  n = int(r.num_rows[0])
  assert float(jnp.min(jnp.abs(ref[:n])[ref[:n] != 0])) < 1e-6 and float(jnp.max(jnp.abs(ref[:n]))) > 100
  np.testing.assert_allclose(np.asarray(h[:n], np.float32), np.asarray(ref[:n], np.float32), rtol=2**-7, atol=0)


def test_gate_up_wgmma_writes_h_in_the_down_plane_rows_order(rng):
  # With h_plane_rows, h comes as down_wgmma's plane_rows [rows, I] (each 64-column block holds columns 4i + q at
  # 16q + i): each unit decodes its W1/W3 rows in rows_by_plane's order. FP2-MIX, I = 512: eight N tiles, taken two
  # at a time by the two SMs of a cluster (x multicast, as the model's MIX_TILING), on 3 clusters. Two experts routed
  # (the others empty): two items of eight units, each decoded in the interpreter.
  D_, I_ = 256, 512
  x, w1, w3, ids = problem(rng, 40, 2, inter=I_, d=D_, empty=(1, 2, 3, 5, 6, 7))
  st1, st3 = mix_storage(rng, w1.shape), mix_storage(rng, w3.shape)
  q1, q3 = (QuantizedExpertWeights.from_storage("rocmfp2_mix", st, (E, I_, D_)) for st in (st1, st3))
  r = routing.route(ids, E, 32)
  rows = padded_rows(r.num_routes, 128)
  t = Tiling(wg_rows=64, block_n=64, stages=2, mma_rows=128, cluster=2)
  hp = gate_up_wgmma(x, mix_stack(st1), mix_stack(st3), r, swiglu_limit=LIMIT, tiling=t, num_sms=6,
                     h_plane_rows=rows, interpret=interpret())
  assert_no_races(hp)
  assert hp.shape == (rows, I_)
  ref = gate_up.gate_up_reference(x, dequantize_to_dense(q1).w, dequantize_to_dense(q3).w, r, swiglu_limit=LIMIT)
  n = int(r.num_rows[0])
  assert float(jnp.mean(jnp.abs(ref[:n]))) > 0.1
  err = nmse(hp[:n].astype(jnp.float32), as_plane_rows(ref[:n]))
  assert err <= 2e-5, err
  with pytest.raises(ValueError, match="h_plane_rows"):
    gate_up_wgmma(x, mix_stack(st1), mix_stack(st3), r, swiglu_limit=LIMIT, tiling=t, h_plane_rows=n - 1)


def test_moe_runs_it_for_gate_up_kernel_wgmma(rng):
  # api.moe with Config.gate_up_kernel "wgmma": this kernel on the FP2-MIX storage, the Triton down on bf16 W2; the
  # whole MoE against the exact reference on the same weights (bf16 operands). Then what it refuses, at the call.
  S, K, D_, I_ = 24, 2, 256, 64
  x = jnp.asarray(rng.standard_normal((S, D_)), jnp.bfloat16)
  w1, w2, w3 = (jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-1]), jnp.float32)
                for s in ((E, I_, D_), (E, D_, I_), (E, I_, D_)))
  q1, q3 = (QuantizedExpertWeights.from_storage("rocmfp2_mix", formats.get("rocmfp2_mix").quantize(w), w.shape)
            for w in (w1, w3))
  d2 = moe_api.DenseWeights(w2.astype(jnp.bfloat16))
  ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(S)]), jnp.int32)
  rw = jnp.asarray(rng.random((S, K)), jnp.float32)
  cfg = moe_api.Config.default(num_tokens=S, top_k=K, num_experts=E, hidden=D_, intermediate=I_,
                               platform="cuda" if ON_GPU else "cpu", gate_up_kernel="wgmma")
  run = lambda x, a=q1, b=q3: moe_api.moe(x, rw, ids, a, d2, b, swiglu_limit=LIMIT, config=cfg,
                                          interpret=not ON_GPU, validate_routes=False)
  calls = features.pallas_calls(run, x)
  plan = moe_api.plan(num_tokens=S, top_k=K, num_experts=E, hidden=D_, intermediate=I_, config=cfg,
                      interpret=not ON_GPU)
  assert tuple(n for n, _ in calls) == plan.kernels and plan.kernels[:2] == ("moe_gather_rows", "moe_gate_up_wgmma")
  assert calls[1][1] == plan.gate_up_grid
  # each finished before the next starts (an interpreted kernel beside other work can deadlock on two cores)
  ref = jax.block_until_ready(moe_api.moe_reference(x, rw, ids, q1, d2, q3,
                                                    swiglu_limit=LIMIT, operand_dtype=jnp.bfloat16))
  assert float(jnp.mean(jnp.abs(ref))) > 0.1
  err = nmse(jax.block_until_ready(run(x)), ref)
  assert err <= 1e-8, err
  with pytest.raises(ValueError, match="takes bf16 x"):
    run(x.astype(jnp.float32))
  q3_fp3 = QuantizedExpertWeights.from_storage("rocmfp3_mix", formats.get("rocmfp3_mix").quantize(w3), w3.shape)
  with pytest.raises(ValueError, match="both bf16 or both rocmfp2_mix"):
    run(x, q1, q3_fp3)
  # W1 / W3 as RingLayoutWeights (decoded beforehand as ring_layout): the logical [E, I, D], its canonical values;
  # read by this kernel only (the model runs it: tests/test_model_features.py), both stacks or neither
  b1, b3 = (moe_api.RingLayoutWeights(ring_layout(w.astype(jnp.bfloat16))) for w in (w1, w3))
  assert b1.shape == (E, I_, D_) and b1.w.shape == (E, I_ // 64, D_, 64)
  np.testing.assert_array_equal(b1.dequantize(), w1.astype(jnp.bfloat16).astype(jnp.float32))
  # the reference decodes them one expert at a time (a slice [I/64, D, 64]): the dense stacks' result
  dense_ref = moe_api.moe_reference(x, rw, ids, w1.astype(jnp.bfloat16), d2, w3.astype(jnp.bfloat16),
                                    swiglu_limit=LIMIT, operand_dtype=jnp.bfloat16)
  np.testing.assert_array_equal(moe_api.moe_reference(x, rw, ids, b1, d2, b3, swiglu_limit=LIMIT,
                                                      operand_dtype=jnp.bfloat16), dense_ref)
  with pytest.raises(ValueError, match=rf"ring_layout's \[E, N/64, K, 64\], got shape \({E}, {I_}, {D_}\)"):
    moe_api.RingLayoutWeights(w1).shape  # pylint: disable=expression-not-assigned  (a dense stack: no boxes)
  with pytest.raises(ValueError, match="both as RingLayoutWeights or neither"):
    run(x, b1, moe_api.DenseWeights(w3.astype(jnp.bfloat16)))
  triton = dataclasses.replace(cfg, gate_up_kernel="triton")
  with pytest.raises(ValueError, match="read by the Mosaic GPU gate/up only"):
    moe_api.moe(x, rw, ids, b1, d2, b3, swiglu_limit=LIMIT, config=triton, interpret=True, validate_routes=False)
