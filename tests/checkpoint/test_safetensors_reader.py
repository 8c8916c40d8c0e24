"""The torch-free safetensors reader (ds4jax.checkpoint.safetensors_reader)."""

import json
import struct

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from ds4jax.checkpoint.safetensors_reader import CheckpointError, SafetensorsCheckpoint, SafetensorsFile, TensorSpec
from ds4jax.quant import fp8_e4m3


def write_safetensors(path, tensors, metadata=None):
  """Hand-written safetensors file. tensors: {name: (dtype name, shape, raw bytes)} in data order.

  Mirrors the format (u64 LE header length, JSON header, packed data) so that the test does not depend on the
  library for dtypes it lacks (BF16, F8_*). Returns the header dict for tests that want to corrupt it.
  """
  header, data, offset = {}, b"", 0
  for name, (dtype, shape, raw) in tensors.items():
    header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
    data += raw
    offset += len(raw)
  if metadata is not None:
    header["__metadata__"] = metadata
  write_raw(path, header, data)
  return header


def write_raw(path, header, data, header_pad=True):
  text = json.dumps(header).encode()
  if header_pad:
    text += b" " * (-len(text) % 8)  # the reference writer pads the header to 8 bytes with spaces
  path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def arr(dtype_name, a):
  return dtype_name, a.shape, a.tobytes()


def random_tensors(rng):
  """One tensor of each dtype, random (never all-zero)."""
  return {
      "f32": rng.standard_normal((3, 5)).astype(np.float32),
      "f16": rng.standard_normal((4,)).astype(np.float16),
      "i8": rng.integers(-128, 128, size=(2, 3, 4), dtype=np.int8),
      "u8": rng.integers(1, 256, size=(7,), dtype=np.uint8),
      "i32": rng.integers(-2**31, 2**31, size=(2, 2), dtype=np.int32),
      "i64": rng.integers(-2**62, 2**62, size=(129, 6), dtype=np.int64),
      "bool": rng.integers(0, 2, size=(3, 3)).astype(bool),
  }


# --- reading ----------------------------------------------------------------------------------------------------------


def test_reads_library_written_file(tmp_path, rng):
  tensors = random_tensors(rng)
  path = tmp_path / "x.safetensors"
  safetensors.numpy.save_file(tensors, str(path), metadata={"format": "np"})
  with SafetensorsCheckpoint(path) as ckpt:
    assert ckpt.names() == sorted(tensors)
    assert ckpt.metadata == {"format": "np"}
    assert "i64" in ckpt and "nope" not in ckpt and len(ckpt) == len(tensors)
    for name, a in tensors.items():
      shape, dtype = ckpt.spec(name)
      assert shape == a.shape
      got = ckpt.read(name)
      assert got.dtype == a.dtype, name
      np.testing.assert_array_equal(got, a)
      assert not got.flags.writeable  # a view into the read-only mapping
    assert ckpt.spec("i64") == TensorSpec((129, 6), "I64")
    assert ckpt.spec("bool").dtype == "BOOL"


def test_reads_hand_written_bf16_fp8_e8m0(tmp_path, rng):
  bf16 = rng.standard_normal((6, 10)).astype(ml_dtypes.bfloat16)
  w = rng.standard_normal((130, 257)).astype(np.float32)
  codes, scale = fp8_e4m3.quantize(w)  # float8_e4m3fn [130, 257], uint8 [2, 3]
  path = tmp_path / "h.safetensors"
  write_safetensors(path, {"emb": arr("BF16", bf16), "w.weight": arr("F8_E4M3", codes),
                           "w.scale": ("F8_E8M0", scale.shape, scale.tobytes()),
                           "sink": arr("F32", rng.standard_normal(64).astype(np.float32))})
  with SafetensorsFile(path) as f:
    assert f.spec("w.weight") == ((130, 257), "F8_E4M3")
    assert f.spec("w.scale") == ((2, 3), "F8_E8M0")
    got_bf16 = f.read("emb")
    assert got_bf16.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got_bf16.view(np.uint16), bf16.view(np.uint16))
    got_codes, got_scale = f.read("w.weight"), f.read("w.scale")
    assert got_codes.dtype == ml_dtypes.float8_e4m3fn and got_scale.dtype == np.uint8  # raw UE8M0 bytes
    np.testing.assert_array_equal(got_codes.view(np.uint8), codes.view(np.uint8))
    np.testing.assert_array_equal(got_scale, scale)
    dequantize = jax.jit(fp8_e4m3.dequantize)
    np.testing.assert_array_equal(np.asarray(dequantize(got_codes, got_scale)), np.asarray(dequantize(codes, scale)))


def test_hand_writer_agrees_with_library(tmp_path, rng):
  a = rng.standard_normal((4, 3)).astype(np.float32)
  b = rng.integers(-9, 9, size=(5,), dtype=np.int64)
  path = tmp_path / "h.safetensors"
  write_safetensors(path, {"a": arr("F32", a), "b": arr("I64", b)})
  loaded = safetensors.numpy.load_file(str(path))
  np.testing.assert_array_equal(loaded["a"], a)
  np.testing.assert_array_equal(loaded["b"], b)


def test_scalar_and_empty_tensors(tmp_path, rng):
  x = np.float32(rng.standard_normal())
  path = tmp_path / "s.safetensors"
  write_safetensors(path, {"empty": ("F32", (0, 4), b""), "scalar": ("F32", (), x.tobytes())})
  with SafetensorsCheckpoint(path) as ckpt:
    assert ckpt.read("empty").shape == (0, 4)
    assert ckpt.read("scalar").shape == () and ckpt.read("scalar") == x


def test_directory_with_model_safetensors(tmp_path, rng):
  tensors = random_tensors(rng)
  safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
  with SafetensorsCheckpoint(tmp_path) as ckpt:
    np.testing.assert_array_equal(ckpt.read("i8"), tensors["i8"])


def make_sharded(tmp_path, rng):
  """Two shards + index; returns {name: array}."""
  t = random_tensors(rng)
  shards = {"model-00001-of-00002.safetensors": ["f32", "i8", "i64"],
            "model-00002-of-00002.safetensors": ["f16", "u8", "i32", "bool"]}
  for shard, names in shards.items():
    safetensors.numpy.save_file({n: t[n] for n in names}, str(tmp_path / shard))
  index = {"metadata": {"total_size": 123}, "weight_map": {n: s for s, ns in shards.items() for n in ns}}
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  return t


def test_sharded_checkpoint(tmp_path, rng):
  t = make_sharded(tmp_path, rng)
  for path in (tmp_path, tmp_path / "model.safetensors.index.json"):
    with SafetensorsCheckpoint(path) as ckpt:
      assert ckpt.names() == sorted(t) and list(ckpt) == sorted(t)
      assert ckpt.metadata == {"total_size": 123}
      assert [p.name for p in ckpt.files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
      ckpt.validate()
      for name, a in t.items():
        np.testing.assert_array_equal(ckpt.read(name), a)
        assert ckpt.spec(name).shape == a.shape


# --- errors -----------------------------------------------------------------------------------------------------------


def test_missing_paths(tmp_path):
  with pytest.raises(CheckpointError, match="does not exist"):
    SafetensorsCheckpoint(tmp_path / "nope.safetensors")
  (tmp_path / "other.safetensors").write_bytes(b"")
  with pytest.raises(CheckpointError, match=r"neither model.safetensors.index.json nor model.safetensors.*other"):
    SafetensorsCheckpoint(tmp_path)


def test_missing_shard(tmp_path, rng):
  make_sharded(tmp_path, rng)
  (tmp_path / "model-00002-of-00002.safetensors").unlink()
  with pytest.raises(CheckpointError, match=r"shard 'model-00002-of-00002.safetensors' is listed in the index"):
    SafetensorsCheckpoint(tmp_path)


def test_tensor_in_index_but_not_in_shard(tmp_path, rng):
  make_sharded(tmp_path, rng)
  index_path = tmp_path / "model.safetensors.index.json"
  index = json.loads(index_path.read_text())
  index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
  index_path.write_text(json.dumps(index))
  ckpt = SafetensorsCheckpoint(tmp_path)
  assert "ghost" in ckpt
  ckpt.read("f32")  # the rest stays readable
  with pytest.raises(CheckpointError, match=r"'ghost'.*places it in shard 'model-00001-of-00002.safetensors'"):
    ckpt.read("ghost")
  with pytest.raises(CheckpointError, match="'ghost'"):
    ckpt.validate()


def test_bad_index(tmp_path):
  (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
  with pytest.raises(CheckpointError, match="weight_map"):
    SafetensorsCheckpoint(tmp_path)
  (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ')
  with pytest.raises(CheckpointError, match="cannot read the shard index"):
    SafetensorsCheckpoint(tmp_path)


def test_unknown_tensor_name(tmp_path, rng):
  safetensors.numpy.save_file(random_tensors(rng), str(tmp_path / "model.safetensors"))
  with pytest.raises(CheckpointError, match="no tensor named 'layers.0.nope'"):
    SafetensorsCheckpoint(tmp_path).read("layers.0.nope")


def test_truncated_file(tmp_path, rng):
  path = tmp_path / "t.safetensors"
  safetensors.numpy.save_file(random_tensors(rng), str(path))
  raw = path.read_bytes()
  path.write_bytes(raw[:-3])
  with pytest.raises(CheckpointError, match=rf"{path.name}: tensor .* the file is truncated"):
    SafetensorsCheckpoint(path)
  path.write_bytes(raw[:5])
  with pytest.raises(CheckpointError, match="too short"):
    SafetensorsCheckpoint(path)


def test_header_length_beyond_file(tmp_path, rng):
  path = tmp_path / "t.safetensors"
  safetensors.numpy.save_file(random_tensors(rng), str(path))
  raw = bytearray(path.read_bytes())
  raw[:8] = struct.pack("<Q", len(raw))  # one header byte too many
  path.write_bytes(bytes(raw))
  with pytest.raises(CheckpointError, match=r"header length \d+ runs past the end of the file"):
    SafetensorsCheckpoint(path)


def test_corrupt_header_json(tmp_path, rng):
  path = tmp_path / "t.safetensors"
  safetensors.numpy.save_file(random_tensors(rng), str(path))
  raw = bytearray(path.read_bytes())
  raw[8:12] = b"\xff\x00{["  # garbage at the start of the JSON
  path.write_bytes(bytes(raw))
  with pytest.raises(CheckpointError, match="header is not valid UTF-8 JSON"):
    SafetensorsCheckpoint(path)
  write_raw(path, [1, 2], b"")
  with pytest.raises(CheckpointError, match="must be a JSON object"):
    SafetensorsCheckpoint(path)


def test_offsets_inconsistent_with_shape(tmp_path, rng):
  a = rng.standard_normal((3, 4)).astype(np.float32)
  path = tmp_path / "t.safetensors"
  header = {"a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 44]}}  # needs 48
  write_raw(path, header, a.tobytes())
  with pytest.raises(CheckpointError, match=r"'a': data_offsets \[0, 44\] span 44 bytes, but shape \[3, 4\] of F32 "
                                            r"needs 48"):
    SafetensorsCheckpoint(path)
  header["a"]["data_offsets"] = [8, 4]
  write_raw(path, header, a.tobytes())
  with pytest.raises(CheckpointError, match="0 <= begin <= end"):
    SafetensorsCheckpoint(path)


def test_offsets_out_of_range(tmp_path, rng):
  a = rng.standard_normal((3, 4)).astype(np.float32)
  path = tmp_path / "t.safetensors"
  header = {"a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [16, 64]}}  # 48 bytes, but only 48 in the file
  write_raw(path, header, a.tobytes())
  with pytest.raises(CheckpointError, match=r"'a': data_offsets \[16, 64\] reach past the 48 data bytes"):
    SafetensorsCheckpoint(path)


def test_overlapping_tensors(tmp_path, rng):
  a = rng.standard_normal((4,)).astype(np.float32)
  path = tmp_path / "t.safetensors"
  header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
  write_raw(path, header, a.tobytes())
  with pytest.raises(CheckpointError, match="'a' and 'b' overlap"):
    SafetensorsCheckpoint(path)


def test_unknown_dtype(tmp_path, rng):
  path = tmp_path / "t.safetensors"
  write_safetensors(path, {"ok": arr("F32", rng.standard_normal(2).astype(np.float32)),
                           "odd": ("F4_WAT", (4,), rng.bytes(2))})
  with pytest.raises(CheckpointError, match=r"t.safetensors: tensor 'odd': unknown dtype 'F4_WAT'"):
    SafetensorsCheckpoint(path)


def test_malformed_entries(tmp_path):
  path = tmp_path / "t.safetensors"
  for entry, message in [({"dtype": "F32", "shape": [2]}, "must have dtype, shape and data_offsets"),
                         ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "non-negative ints"),
                         ({"dtype": "F32", "shape": [2], "data_offsets": [0]}, r"\[begin, end\]")]:
    write_raw(path, {"a": entry}, b"\x01" * 8)
    with pytest.raises(CheckpointError, match=message):
      SafetensorsCheckpoint(path)


def test_read_after_close(tmp_path, rng):
  path = tmp_path / "t.safetensors"
  safetensors.numpy.save_file(random_tensors(rng), str(path))
  ckpt = SafetensorsCheckpoint(path)
  kept = ckpt.read("f32")
  ckpt.close()
  assert np.all(np.isfinite(kept))  # arrays read earlier stay valid
  with pytest.raises(CheckpointError, match="after close"):
    ckpt.read("f32")


def test_checkpoint_error_is_value_error():
  assert issubclass(CheckpointError, ValueError)
