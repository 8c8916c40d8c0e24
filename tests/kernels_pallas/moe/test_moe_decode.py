"""The expert-stack decode kernel (kernels_pallas/moe/decode.py) against the canonical decode, bit for bit, on
adversarial bytes (every code pattern, invalid scale bytes, MIX experts in modes 0, 1 and 255, -0.0 levels): in
interpret mode on CPU and compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_moe_quantized import INTERPRET, adversarial_storage
from ds4jax import features
from ds4jax.quant import formats
from kernels_pallas.moe import decode
from kernels_pallas.moe.gate_up_wgmma import ring_layout
from kernels_pallas.moe.quantized_weights import HALF_BLOCK_FORMATS, QuantizedExpertWeights, half_views

SHAPE = (3, 64, 256)  # three experts: modes 0, 1 and 255
TILING = decode.Tiling(block_n=32, block_k=128, num_warps=4)


def bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize("fmt,dtype", [("rocmfp2_mix", "bfloat16"), ("rocmfp3_mix", "bfloat16"),
                                       ("rocmfp2_mix", "float32"), ("rocmfp3_mix", "float32"),
                                       ("fp4_e2m1", "bfloat16")])
def test_decode_is_bit_identical_to_the_canonical_decode(rng, fmt, dtype):
  st = adversarial_storage(fmt, SHAPE, rng)
  w = QuantizedExpertWeights.from_storage(fmt, st, SHAPE)
  want = formats.get(fmt).dequantize(**st).astype(dtype)
  got = decode.decode_stack(w, jnp.dtype(dtype), tiling=TILING, interpret=INTERPRET)
  assert got.dtype == want.dtype and got.shape == SHAPE
  assert np.count_nonzero(np.asarray(want, np.float32)) > want.size // 2  # mostly real values, not zeros
  if fmt == "rocmfp3_mix":
    assert np.any(bits(want) == np.array(0x8000 if dtype == "bfloat16" else 0x80000000, bits(want).dtype))  # -0.0
  np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.skipif(INTERPRET, reason="select='prmt4' is inline PTX: compiled CUDA kernels only")
@pytest.mark.parametrize("fmt", ["rocmfp2_mix", "rocmfp3_mix"])
def test_prmt_decode_is_bit_identical_to_the_canonical_decode(rng, fmt):
  st = adversarial_storage(fmt, SHAPE, rng)
  w = QuantizedExpertWeights.from_storage(fmt, st, SHAPE)
  want = formats.get(fmt).dequantize(**st).astype(jnp.bfloat16)
  got = decode.decode_stack(w, jnp.bfloat16, tiling=decode.Tiling(32, 128, 4, select="prmt4"))
  np.testing.assert_array_equal(bits(got), bits(want))
  shape = (2, 192, 256)  # three boxes along N
  st = adversarial_storage(fmt, shape, rng)
  w = QuantizedExpertWeights.from_storage(fmt, st, shape)
  want = formats.get(fmt).dequantize(**st).astype(jnp.bfloat16)
  got = decode.decode_stack(w, jnp.bfloat16, tiling=decode.Tiling(8, 128, 4, select="prmt4"), ring_layout=True)
  np.testing.assert_array_equal(bits(got), bits(ring_layout(want)))


@pytest.mark.parametrize("fmt", ["rocmfp2_mix", "rocmfp3_mix", "fp4_e2m1"])
def test_decode_writes_the_rings_layout(rng, fmt):
  """ring_layout: each tile's rows go to their 64 x 64 step boxes (a tile of 32 rows x 128 columns is half of two
  boxes; 192 rows are three boxes along N), the same bits as gate_up_wgmma.ring_layout of the canonical decode. A
  format the kernel does not write in boxes (FP4) is decoded, then laid out."""
  shape = (2, 192, 256)
  st = adversarial_storage(fmt, shape, rng)
  w = QuantizedExpertWeights.from_storage(fmt, st, shape)
  want = ring_layout(formats.get(fmt).dequantize(**st).astype(jnp.bfloat16))
  got = decode.decode_stack(w, jnp.bfloat16, tiling=TILING, ring_layout=True, interpret=INTERPRET)
  assert got.shape == (2, 3, 256, 64)
  np.testing.assert_array_equal(bits(got), bits(want))
  if fmt in HALF_BLOCK_FORMATS:
    with pytest.raises(ValueError, match="ring_layout takes N=192 and K=256 multiples of 64, and for a MIX"):
      decode.decode_stack(w, tiling=decode.Tiling(128, 128, 4), ring_layout=True, interpret=True)


def prmt(a, b, sel) -> np.ndarray:
  """PTX prmt.b32 (default mode), emulated: result byte i is byte (nibble i of sel) of the 8 bytes b:a."""
  table = np.stack([a, b], axis=-1).astype(np.uint32).view(np.uint8).reshape(*np.shape(a), 8)
  nib = (np.asarray(sel, np.uint32)[..., None] >> (4 * np.arange(4, dtype=np.uint32))) & 7
  return np.take_along_axis(table, nib.astype(np.int64), axis=-1).view(np.uint32)[..., 0]


def run_ptx(asm: str, ins: list[np.ndarray]) -> np.ndarray:
  """The inline asm of select='prmt4', run on numpy uint32 operands (the few opcodes it uses): operands $0, $1 are
  the output registers, then element e of input i is $(2 + 4i + e), groups of 4 along the last axis (one code
  byte's weights). Returns the bf16 bits, [..., n]."""
  u32 = lambda v: np.asarray(v).astype(np.uint32)
  ins = [u32(a).reshape(*a.shape[:-1], -1, 4) for a in ins]
  reg = {f"${2 + i * 4 + e}": a[..., e] for i, a in enumerate(ins) for e in range(4)}
  val = lambda t: reg[t] if t in reg else np.uint32(int(t))
  for stmt in asm.strip()[1:-1].split(";"):
    op, _, rest = stmt.strip().partition(" ")
    if not op or op == ".reg":
      continue
    d, *x = [t.strip() for t in rest.split(",")]
    f = {"and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b, "shl.b32": lambda a, b: a << b,
         "shr.b32": lambda a, b: a >> b, "mov.b32": lambda a: a, "add.u32": lambda a, b: a + b,
         "mul.lo.u32": lambda a, b: a * b, "mad.lo.u32": lambda a, b, c: a * b + c,
         "bfe.u32": lambda a, b, c: (a >> b) & ((1 << c) - 1), "prmt.b32": prmt}[op]
    reg[d] = u32(f(*(val(t) for t in x)))
  halves = [(reg[f"${k}"] >> s) & 0xFFFF for k in range(2) for s in (0, 16)]
  return np.stack(halves, axis=-1).reshape(*ins[0].shape[:-2], -1).astype(np.uint16)


@pytest.mark.parametrize("fmt", ["rocmfp2_mix", "rocmfp3_mix"])
def test_prmt_asm_picks_the_half_block_values(rng, fmt):
  # The inline PTX of select='prmt4', run by a small emulator on its jnp operands, against
  # dequantize_halves' bits (the asm text itself is what runs; the GPU test above checks Triton's grouping)
  st = adversarial_storage(fmt, SHAPE, rng)
  s = half_views(fmt, st)
  module = HALF_BLOCK_FORMATS[fmt]
  planes = [s[n] for n in module.HALF_VIEWS]
  want = bits(module.dequantize_halves(*planes, s["scales"], s["books"], s["mode"], jnp.bfloat16))
  asm, ins = decode.prmt_inputs(fmt, planes, s["scales"], s["books"], s["mode"])
  got = run_ptx(asm, [np.asarray(a) for a in ins])
  assert want.shape == ins[0].shape
  np.testing.assert_array_equal(got.reshape(want.shape), want)
  assert len(np.unique(want)) > 64  # many distinct values: a wrong byte order would show


@pytest.mark.parametrize("fmt,out_view", [("rocmfp2_mix", (4, 4)), ("rocmfp3_mix", (2, 2, 4)), ("fp4_e2m1", ())])
def test_mix_formats_run_the_half_block_kernel(rng, fmt, out_view):
  """The MIX formats take the half-block kernel (its output is a view of half-blocks), the others the tile loader
  ([E, N, K] as is): one pallas_call, one program per [block_n, block_k] tile."""
  w = QuantizedExpertWeights.from_storage(fmt, adversarial_storage(fmt, SHAPE, rng), SHAPE)
  run = lambda w: decode.decode_stack(w, jnp.bfloat16, tiling=TILING, interpret=True)
  name = f"moe_decode_{fmt}" if out_view else "moe_dequantize_tiles"
  assert features.pallas_calls(run, w) == [(name, (3, 2, 2))]
  (call,) = [e for e in features.traced_eqns(run, w) if e.primitive.name == "pallas_call"]
  assert call.outvars[0].aval.shape == ((3, 64, 16, *out_view) if out_view else SHAPE)


def test_default_select_is_prmt4_on_cuda_only(monkeypatch):
  assert decode.default_select("rocmfp2_mix", jnp.bfloat16, interpret=True) == "tree"
  monkeypatch.setattr(decode, "default_platform", lambda: "cuda")
  assert decode.default_select("rocmfp3_mix", jnp.bfloat16, interpret=False) == "prmt4"
  assert decode.default_tiling("rocmfp3_mix", (256, 4096, 2048), "prmt4") == decode.BEST_PRMT4
  for fmt, dtype, interpret in (("rocmfp2_mix", jnp.float32, False), ("fp4_e2m1", jnp.bfloat16, False),
                                ("rocmfp2_mix", jnp.bfloat16, True)):
    assert decode.default_select(fmt, dtype, interpret) == "tree"
  monkeypatch.setattr(decode, "default_platform", lambda: "rocm")
  assert decode.default_select("rocmfp2_mix", jnp.bfloat16, interpret=False) == "tree"


def test_decode_rejects_tiles_that_do_not_divide_the_stack(rng):
  st = adversarial_storage("rocmfp2_mix", SHAPE, rng)
  w = QuantizedExpertWeights.from_storage("rocmfp2_mix", st, SHAPE)
  with pytest.raises(ValueError, match="K=256 is not a multiple of block_k=512"):
    decode.decode_stack(w, tiling=decode.Tiling(32, 512, 4), interpret=True)
  with pytest.raises(ValueError, match="select='prmt4' runs inline PTX"):
    decode.decode_stack(w, tiling=decode.Tiling(32, 128, 4, select="prmt4"), interpret=True)
  with pytest.raises(ValueError, match="select must be"):
    decode.decode_stack(w, tiling=decode.Tiling(32, 128, 4, select="lut"), interpret=True)
