"""ROCmFP2-MIX / ROCmFP3-MIX (ds4jax.quant.rocmfp2_mix, rocmfp3_mix, rocmfp_mix): codebooks, modes, fitting."""

import jax
import ml_dtypes
import numpy as np
import pytest

from ds4jax.quant import rocmfp2, rocmfp2_mix, rocmfp3, rocmfp3_mix, rocmfp_mix
from rocmfp_oracle import assert_bits_equal, heavy_weight, relative_mse

BF16 = ml_dtypes.bfloat16
fp2_mix_jit = jax.jit(rocmfp2_mix.dequantize)
fp3_mix_jit = jax.jit(rocmfp3_mix.dequantize)

# Same qs bytes as test_rocmfp2: codes per element (LSB pair first).
QS2 = [0xE4, 0x1B, 0x00, 0xFF, 0x55, 0xAA, 0x27, 0xD8]
CODES2 = [0, 1, 2, 3, 3, 2, 1, 0, 0, 0, 0, 0, 3, 3, 3, 3, 1, 1, 1, 1, 2, 2, 2, 2, 3, 1, 2, 0, 0, 2, 1, 3]
# Same qs bytes as test_rocmfp3: codes 0..7 four times.
QS3 = [0x88, 0xC6, 0xFA] * 4


def fp2_mix_block_arrays(meta_rows, books, mode):
  """4 copies of the QS2 block along `in` (in = 128, as FP2-MIX requires) for each expert's meta row."""
  blocks = np.array([[[QS2 + m] * 4] for m in meta_rows], np.uint8)  # [E, 1, 4, 10]
  codes, scales = rocmfp2_mix.from_blocks(blocks)
  return codes, scales, np.array(books, np.float32).astype(BF16), np.array(mode, np.uint8)


def test_fp2_mix_hand_blocks():
  # Expert 0, mode 1: book 0 = [-1.5, -0.25, 0.5, 3], book 1 = [-2, 0, 0.125, 1].
  #   meta 0x40: book 0, scale 1.0; meta 0xC8 = select | 0x48: book 1, scale 2.0.
  # Expert 1, mode 0 (uniform): the same codes decode as code - 1 with meta bytes 0x40 (1.0), 0x48 (2.0), like ROCmFP2.
  books = [[[-1.5, -0.25, 0.5, 3.0], [-2.0, 0.0, 0.125, 1.0]], [[-1, 0, 1, 2], [-2, -1, 0, 1]]]
  codes, scales, books, mode = fp2_mix_block_arrays([[0x40, 0xC8], [0x40, 0x48]], books, [1, 0])
  expert0 = [-1.5, -0.25, 0.5, 3.0, 3.0, 0.5, -0.25, -1.5, -1.5, -1.5, -1.5, -1.5, 3.0, 3.0, 3.0, 3.0,
             0.0, 0.0, 0.0, 0.0, 0.25, 0.25, 0.25, 0.25, 2.0, 0.0, 0.25, -4.0, -4.0, 0.25, 0.0, 2.0]
  expert1 = [-1, 0, 1, 2, 2, 1, 0, -1, -1, -1, -1, -1, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 4, 0, 2, -2, -2, 2, 0, 4]
  expected = np.array([[expert0 * 4], [expert1 * 4]], np.float32)  # [2, 1, 128]
  assert_bits_equal(fp2_mix_jit(codes, scales, books, mode), expected)
  rocmfp2_mix.check(codes, scales, books, mode)
  # Mode 0 matches plain ROCmFP2 on the same bytes (no fp2s bit there).
  assert_bits_equal(rocmfp2.dequantize(codes[1], scales[1]), expected[1])


def test_fp2_mix_mode0_select_bit_is_invalid():
  books = [[[-1, 0, 1, 2], [-2, -1, 0, 1]]]
  codes, scales, books, mode = fp2_mix_block_arrays([[0x40, 0xC8]], books, [0])
  out = np.asarray(fp2_mix_jit(codes, scales, books, mode))
  # Upstream decodes the invalid half-blocks to 0 (level · 0, so -0.0 for level -1).
  assert np.all(out.reshape(4, 32)[:, 16:] == 0) and not np.all(out.reshape(4, 32)[:, :16] == 0)
  with pytest.raises(ValueError, match=r"invalid meta byte 0xC8 at index \(0, 0, 1\).*mode 0 \(uniform\)"):
    rocmfp2_mix.check(codes, scales, books, mode)
  mode[...] = 7  # any nonzero mode reads books, and then bit 7 is the select bit
  rocmfp2_mix.check(codes, scales, books, mode)


def test_fp3_mix_hand_blocks():
  # Expert 0, mode 3 (nonzero): the code indexes the book directly (no sign rule).
  #   meta 0x40: book 0 × 1.0; meta 0xB8 = select | 0x38: book 1 × 0.5.
  # Expert 1, mode 0: ROCmFP3's sign/magnitude rule, meta 0x40 (1.0), 0x38 (0.5).
  book0 = [-3.0, -1.0, -0.5, -0.125, 0.125, 0.5, 1.0, 3.0]
  book1 = [-8.0, -4.0, -2.0, -1.0, 0.0, 1.0, 2.0, 4.0]
  blocks = np.array([[[QS3 + [0x40, 0xB8]]], [[QS3 + [0x40, 0x38]]]], np.uint8)  # [2 experts, 1 row, 1 block, 14]
  codes_lo, codes_hi, scales = rocmfp3_mix.from_blocks(blocks)
  books = np.array([[book0, book1], [book0, book1]], np.float32).astype(BF16)
  mode = np.array([3, 0], np.uint8)
  expert0 = book0 * 2 + [-4.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0] * 2
  expert1 = [0.0, 1.0, 2.0, 4.0, -0.0, -1.0, -2.0, -4.0] * 2 + [0.0, 0.5, 1.0, 2.0, -0.0, -0.5, -1.0, -2.0] * 2
  expected = np.array([[expert0], [expert1]], np.float32)
  assert_bits_equal(fp3_mix_jit(codes_lo, codes_hi, scales, books, mode), expected)
  rocmfp3_mix.check(codes_lo, codes_hi, scales, books, mode)
  assert_bits_equal(rocmfp3.dequantize(codes_lo[1], codes_hi[1], scales[1]), expected[1])


def test_two_dim_weight_has_scalar_mode(rng):
  codes, scales, books, mode = rocmfp2_mix.quantize(rng.standard_normal((4, 128)).astype(np.float32))
  assert books.shape == (2, 4) and books.dtype == BF16 and mode.shape == () and mode == 1
  rocmfp2_mix.check(codes, scales, books, mode)


@pytest.mark.parametrize("bad, message", [
    ([[-1.0, 0.5, 0.25, 1.0], [-2, -1, 0, 1]], r"book at index \(1, 0\) .* is not strictly increasing"),
    ([[-1.0, 0.5, 0.5, 1.0], [-2, -1, 0, 1]], r"book at index \(1, 0\) .* is not strictly increasing"),
    ([[-1, 0, 1, 2], [-2, -1, 0, np.nan]], r"book at index \(1, 1\) .* has a non-finite level"),
    ([[-np.inf, 0, 1, 2], [-2, -1, 0, 1]], r"book at index \(1, 0\) .* has a non-finite level"),
    ([[-1, 0, 1, 2], [-2, -1, 0, 2.0**-110]], r"book at index \(1, 1\) .* outside \[2\^-100, 2\^100\]"),
])
def test_rejects_bad_books(rng, bad, message):
  codes, scales, books, mode = rocmfp2_mix.quantize(rng.standard_normal((2, 3, 128)).astype(np.float32), uniform=True)
  mode[...] = 1  # the placeholder books are valid books too
  rocmfp2_mix.check(codes, scales, books, mode)
  books = books.copy()
  books[1] = np.array(bad, np.float32).astype(BF16)
  with pytest.raises(ValueError, match=message):
    rocmfp2_mix.check(codes, scales, books, mode)
  with pytest.raises(ValueError, match=message):
    rocmfp2_mix.quantize(rng.standard_normal((2, 3, 128)).astype(np.float32), books=books)


def test_rejects_bad_side_arrays(rng):
  codes_lo, codes_hi, scales, books, mode = rocmfp3_mix.quantize(rng.standard_normal((3, 2, 64)).astype(np.float32))
  rocmfp3_mix.check(codes_lo, codes_hi, scales, books, mode)
  with pytest.raises(TypeError, match="books must be bfloat16"):
    fp3_mix_jit(codes_lo, codes_hi, scales, books.view(np.uint16), mode)
  with pytest.raises(ValueError, match=r"books must have shape \(3, 2, 8\).*got \(3, 2, 4\)"):
    rocmfp3_mix.dequantize(codes_lo, codes_hi, scales, books[..., :4], mode)
  with pytest.raises(ValueError, match=r"mode must have the weight's leading shape \(3,\), got \(3, 1\)"):
    rocmfp3_mix.dequantize(codes_lo, codes_hi, scales, books, mode[:, None])
  with pytest.raises(TypeError, match="mode must be uint8"):
    rocmfp3_mix.dequantize(codes_lo, codes_hi, scales, books, mode.astype(np.int32))
  with pytest.raises(TypeError, match=r"books must have dtype bfloat16, got float32"):
    rocmfp3_mix.check(codes_lo, codes_hi, scales, books.astype(np.float32), mode)
  bad = scales.copy()
  bad[2, 1, 3] = 0xFF  # book 1, low bits 0x7F
  with pytest.raises(ValueError, match=r"invalid meta byte 0xFF at index \(2, 1, 3\).*low 7 bits are 0x7F"):
    rocmfp3_mix.check(codes_lo, codes_hi, bad, books, mode)


def test_fp2_mix_needs_in_multiple_of_128(rng):
  with pytest.raises(ValueError, match="ROCmFP2-MIX needs `in` to be a positive multiple of 128, got in = 96"):
    rocmfp2_mix.quantize(rng.standard_normal((4, 96)).astype(np.float32))
  codes, scales = rocmfp2.quantize(rng.standard_normal((4, 96)).astype(np.float32))
  books = np.array([[-1, 0, 1, 2], [-2, -1, 0, 1]], np.float32).astype(BF16)
  with pytest.raises(ValueError, match="multiple of 128, got in = 96"):
    rocmfp2_mix.check(codes, scales, books, np.uint8(1))
  rocmfp3_mix.quantize(rng.standard_normal((4, 96)).astype(np.float32))  # FP3-MIX only needs whole blocks


def test_to_bf16_book_is_valid_and_strict():
  book = rocmfp_mix.to_bf16_book([0.0, 1e-35, 1.0, 1.0 + 1e-6, -3.0])
  v = book.astype(np.float64)
  assert book.dtype == BF16 and np.all(np.diff(v) > 0)
  np.testing.assert_array_equal(v, [-3.0, 0.0, 2.0**-100, 1.0, 1.0 + 2.0**-7])
  rocmfp_mix.check_books(book[None], "test")


@pytest.mark.parametrize("module, plain", [(rocmfp2_mix, rocmfp2), (rocmfp3_mix, rocmfp3)])
def test_mix_beats_plain_at_equal_bits_on_heavy_tails(rng, module, plain):
  # Same 2.5 / 3.5 bits per weight (plus 17 / 33 bytes per expert). The fit starts from the plain format's levels,
  # so it cannot lose; on Student-t(3) weights it gains clearly. Ratio MIX / plain relative MSE over 40 seeds:
  # FP2 0.80-0.86, FP3 0.54-0.63 (on Gaussian weights: 0.89-0.93 and 0.64-0.67).
  w = heavy_weight(rng, (2, 64, 256))
  mix = relative_mse(module.dequantize(*module.quantize(w)), w)
  base = relative_mse(plain.dequantize(*plain.quantize(w)), w)
  assert mix < 0.92 * base if module is rocmfp2_mix else mix < 0.7 * base, (mix, base)


@pytest.mark.parametrize("module", [rocmfp2_mix, rocmfp3_mix])
def test_given_books_are_used_and_requantize_is_exact(rng, module):
  w = heavy_weight(rng, (2, 8, 128))
  arrays = module.quantize(w)
  back = np.asarray(module.dequantize(*arrays))
  again = module.quantize(back, books=arrays[-2])  # the fitted books, given back
  np.testing.assert_array_equal(again[-2], arrays[-2])
  assert_bits_equal(module.dequantize(*again), back)  # every half-block is exactly representable


@pytest.mark.parametrize("module", [rocmfp2_mix, rocmfp3_mix])
def test_uniform_mode_matches_plain_format(rng, module):
  w = heavy_weight(rng, (2, 8, 128))
  arrays = module.quantize(w, uniform=True)
  assert np.all(arrays[-1] == 0)
  module.check(*arrays)
  plain = rocmfp2.quantize(w, fp2s=False) if module is rocmfp2_mix else rocmfp3.quantize(w)
  n_planes = len(plain)
  for got, want in zip(arrays[:n_planes], plain):  # same codes and scale bytes as the plain encoder
    np.testing.assert_array_equal(got, want)
