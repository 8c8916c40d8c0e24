"""The format registry (ds4jax.quant.formats)."""

import dataclasses
import math

import jax
import ml_dtypes
import numpy as np
import pytest

from ds4jax.layers import QuantizedWeight
from ds4jax.quant import formats
from rocmfp_oracle import gaussian_weight, relative_mse

# Relative MSE on [2, 64, 256] Gaussian weights (gaussian_weight), measured min-max over 12 seeds.
BOUNDS = {
    "bf16": 3.5e-6,  # 2.7e-6-2.8e-6
    "fp8_e4m3": 8e-4,  # 6.8e-4-7.2e-4
    "fp4_e2m1": 0.015,  # 0.0134-0.0137
    "rocmfp2": 0.100,  # 0.0886-0.0928 (more in test_rocmfp_formats)
    "rocmfp3": 0.033,  # 0.0292-0.0302
    "rocmfp2_mix": 0.092,  # 0.0807-0.0841
    "rocmfp3_mix": 0.022,  # 0.0191-0.0195
}
SIDE_BYTES = {"rocmfp2_mix": 2 * 4 * 2 + 1, "rocmfp3_mix": 2 * 8 * 2 + 1}  # two BF16 books + mode, per expert


def test_registry_names_and_get():
  assert list(formats.FORMATS) == list(BOUNDS)
  for name, fmt in formats.FORMATS.items():
    assert formats.get(name) is fmt and fmt.name == name
  with pytest.raises(ValueError, match="unknown weight format 'fp5'; valid formats: bf16, fp8_e4m3, fp4_e2m1, "
                     "rocmfp2, rocmfp3, rocmfp2_mix, rocmfp3_mix"):
    formats.get("fp5")
  with pytest.raises(dataclasses.FrozenInstanceError):
    formats.get("rocmfp2").block = 8


@pytest.mark.parametrize("name", BOUNDS)
def test_quantize_check_dequantize_nbytes(rng, name):
  fmt = formats.get(name)
  shape = (2, 64, 256)
  w = gaussian_weight(rng, shape)
  arrays = fmt.quantize(w)
  assert tuple(arrays) == fmt.arrays
  fmt.check(**arrays)
  storage = fmt.storage(shape)
  assert {n: (a.shape, a.dtype) for n, a in arrays.items()} == storage
  assert fmt.nbytes(shape) == sum(a.nbytes for a in arrays.values())
  n_experts = 2
  code_bytes = fmt.nbytes(shape) - SIDE_BYTES.get(name, 0) * n_experts
  assert code_bytes * 8 == pytest.approx(fmt.bits_per_weight * math.prod(shape), rel=1e-3)
  out = jax.jit(lambda a: fmt.dequantize(**a))(arrays)
  assert out.shape == shape and out.dtype == np.float32
  err = relative_mse(out, w)
  print(f"{name}: relative MSE {err:.3g}")
  assert err < BOUNDS[name]


@pytest.mark.parametrize("name", sorted(formats.FORMATS))
def test_every_encoder_refuses_non_finite_weights(rng, name):
  """bf16's encoder stored NaN and inf where every other format refused them."""
  w = gaussian_weight(rng, (2, 256))
  w[1, 7] = np.nan
  with pytest.raises(ValueError, match="(?i)non-finite|nan"):
    formats.get(name).quantize(w)
  if name == "bf16":  # finite in f32, past bf16's range: it was stored as inf
    with pytest.raises(ValueError, match=r"non-finite value at index \(0, 3\)"):
      formats.get(name).quantize(np.where(np.arange(256) == 3, 3.4e38, 1.0)[None].astype(np.float32))


def test_a_quantized_weight_refuses_storage_of_another_shape(rng):
  """QuantizedWeight("bf16", (7, 7), storage of a (128, 256) weight) dequantized to (128, 256) without complaint."""
  arrays = formats.get("rocmfp3").quantize(gaussian_weight(rng, (4, 64)))
  assert QuantizedWeight("rocmfp3", (4, 64), arrays).dequantize().shape == (4, 64)
  with pytest.raises(ValueError, match=r"^rocmfp3 storage of a \(8, 64\) weight is \{'codes_lo': \(8, 16\)"):
    QuantizedWeight("rocmfp3", (8, 64), arrays)
  with pytest.raises(ValueError, match=r"^bf16 storage of a \(7, 7\) weight is \{'weight': \(7, 7\)\}, got "
                                       r"\{'weight': \(128, 256\)\}"):
    QuantizedWeight("bf16", (7, 7), formats.get("bf16").quantize(gaussian_weight(rng, (128, 256))))


def test_array_names_are_checked(rng):
  fmt = formats.get("rocmfp3")
  arrays = fmt.quantize(gaussian_weight(rng, (4, 64)))
  with pytest.raises(TypeError, match=r"takes arrays \['codes_lo', 'codes_hi', 'scales'\], got \['codes_lo', "
                     r"'scales'\]"):
    fmt.dequantize(codes_lo=arrays["codes_lo"], scales=arrays["scales"])
  with pytest.raises(TypeError, match="takes arrays"):
    fmt.check(**arrays, books=None)


@pytest.mark.parametrize("name", ["fp4_e2m1", "rocmfp2", "rocmfp3", "rocmfp3_mix"])
def test_nbytes_rejects_in_not_multiple_of_block(name):
  with pytest.raises(ValueError, match="multiple of 32"):
    formats.get(name).nbytes((8, 48))


def test_nbytes_rejects_rocmfp2_mix_in_not_multiple_of_128():
  assert formats.get("rocmfp2_mix").nbytes((3, 8, 128)) == 3 * (8 * 128 * 5 // 16 + 17)
  with pytest.raises(ValueError, match="multiple of 128, got in = 96"):
    formats.get("rocmfp2_mix").nbytes((8, 96))


def test_wrapped_formats_check_their_bytes(rng):
  w = gaussian_weight(rng, (130, 260))  # fp8 tiles do not need whole blocks
  fp8 = formats.get("fp8_e4m3")
  arrays = fp8.quantize(w)
  fp8.check(**arrays)
  bad = arrays["weight"].copy()
  bad.view(np.uint8)[5, 7] = 0xFF
  with pytest.raises(ValueError, match=r"NaN byte at index \(5, 7\)"):
    fp8.check(weight=bad, scale=arrays["scale"])
  bad_scale = arrays["scale"].copy()
  bad_scale[1, 2] = 0xFF
  with pytest.raises(ValueError, match=r"corrupted scale byte 0xFF at index \(1, 2\)"):
    fp8.check(weight=arrays["weight"], scale=bad_scale)
  with pytest.raises(ValueError, match=r"scale must have shape \(2, 3\), got \(2, 2\)"):
    fp8.check(weight=arrays["weight"], scale=arrays["scale"][:, :2])

  fp4 = formats.get("fp4_e2m1")
  arrays = fp4.quantize(gaussian_weight(rng, (4, 64)))
  fp4.check(**arrays)
  with pytest.raises(ValueError, match=r"fp4_e2m1 scale must have shape \(4, 2\), got \(4, 1\)"):
    fp4.check(packed=arrays["packed"], scale=arrays["scale"][:, :1])

  bf16 = formats.get("bf16")
  weight = gaussian_weight(rng, (4, 8)).astype(ml_dtypes.bfloat16)
  bf16.check(weight=weight)
  weight[3, 1] = np.inf
  with pytest.raises(ValueError, match=r"non-finite value at index \(3, 1\)"):
    bf16.check(weight=weight)
  with pytest.raises(TypeError, match="must have dtype bfloat16, got float32"):
    bf16.check(weight=weight.astype(np.float32))
