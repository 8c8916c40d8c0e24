"""A broken checkpoint gives one line naming the file and tensor (also from the command line); a model that would
not fit in device memory is refused before any tensor is read."""

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from ds4jax.checkpoint import mapping
from ds4jax.checkpoint.safetensors_reader import CheckpointError
from ds4jax.checkpoint.safetensors_writer import save_file
from ds4jax.layers import dense
from ds4jax.quant import fp8_e4m3

SAVED = Path(__file__).parent / "hf_saved"
REPO = Path(__file__).parents[2]


def header(path):
  """(data start, header) of a safetensors file, parsed here rather than by the reader under test."""
  raw = path.read_bytes()
  n = struct.unpack("<Q", raw[:8])[0]
  return 8 + n, json.loads(raw[8:8 + n])


def last_tensor(path):
  """The tensor whose bytes end the file: the one a truncation cuts."""
  _, h = header(path)
  h.pop("__metadata__", None)
  return max(h, key=lambda n: h[n]["data_offsets"][1])


def truncate(path, n_bytes=100):
  path.write_bytes(path.read_bytes()[:-n_bytes])


def copy_of(name, tmp_path):
  shutil.copytree(SAVED / name, tmp_path / name)
  return tmp_path / name


def load(path, policy="bf16"):
  return mapping.load_checkpoint(path, dtype=jnp.float32, log=None, policy=policy)


def one_line_error(path, policy="bf16"):
  with pytest.raises(CheckpointError) as e:
    load(path, policy)
  message = str(e.value)
  assert "\n" not in message
  return message


@pytest.mark.parametrize("name", ["official", "original_format"])
def test_truncated_file_names_file_and_tensor(tmp_path, name):
  d = copy_of(name, tmp_path)
  cut = last_tensor(d / "model.safetensors")
  truncate(d / "model.safetensors")
  message = one_line_error(d)
  assert f"{d / 'model.safetensors'}: tensor {cut!r}: data_offsets" in message and "truncated" in message


def test_corrupt_header_names_the_file(tmp_path):
  d = copy_of("official", tmp_path)
  raw = bytearray((d / "model.safetensors").read_bytes())
  raw[8:10] = b"\xff{"
  (d / "model.safetensors").write_bytes(bytes(raw))
  assert one_line_error(d).startswith(f"{d / 'model.safetensors'}: header is not valid UTF-8 JSON")


def rewrite(directory, edit):
  """Lets `edit` change the tensors of directory/model.safetensors ({name: array}, {name: dtype name})."""
  path = directory / "model.safetensors"
  tensors, dtype_names = safetensors.numpy.load_file(str(path)), {}
  edit(tensors, dtype_names)
  save_file(path, tensors, dtype_names)


def fp8_wq_b(directory, scale_dtype="F8_E8M0", code=None, scale_byte=None):
  """Stores layer 1's wq_b ([64, 16]: one 128x128 block) in FP8 with its UE8M0 scale, optionally corrupted: one code
  byte or one scale byte replaced, or the scale stored under another dtype."""
  def to_fp8(t, dtype_names):
    codes, scale = fp8_e4m3.quantize(t["layers.1.attn.wq_b.weight"])
    if code is not None:
      codes.view("uint8")[3, 5] = code
    if scale_byte is not None:
      scale[0, 0] = scale_byte
    t["layers.1.attn.wq_b.weight"], t["layers.1.attn.wq_b.scale"] = codes, scale
    dtype_names["layers.1.attn.wq_b.scale"] = scale_dtype

  rewrite(directory, to_fp8)


# bf16 decodes the stored FP8 tensor; dense=fp8_e4m3 copies it as it is: each path must refuse the corrupt bytes.
POLICIES = ["bf16", "dense=fp8_e4m3"]


@pytest.mark.parametrize("policy", POLICIES)
def test_corrupt_scale_byte_names_file_and_tensor(tmp_path, policy):
  """One FP8 weight whose UE8M0 scale holds a NaN byte (0xFF)."""
  d = copy_of("official", tmp_path)
  fp8_wq_b(d, scale_byte=0xFF)
  assert one_line_error(d, policy).startswith(f"{d / 'model.safetensors'}: layers.1.attn.wq_b.scale: corrupted "
                                              "scale byte 0xFF at index (0, 0)")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_fp8_nan_code_names_file_and_tensor(tmp_path, policy, code):
  """float8_e4m3fn has no inf: 0x7F and 0xFF are NaN, which no quantizer writes."""
  d = copy_of("official", tmp_path)
  fp8_wq_b(d, code=code)
  assert one_line_error(d, policy) == (f"{d / 'model.safetensors'}: layers.1.attn.wq_b.weight: NaN byte at index "
                                       "(3, 5)")


@pytest.mark.parametrize("policy", POLICIES)
def test_scale_of_another_dtype_names_file_and_tensor(tmp_path, policy):
  d = copy_of("official", tmp_path)
  fp8_wq_b(d, scale_dtype="I8")
  assert one_line_error(d, policy) == (f"{d / 'model.safetensors'}: layers.1.attn.wq_b.scale: scales must be "
                                       "F8_E8M0 (UE8M0 bytes), got I8")


def test_fp8_experts_of_different_shapes_name_the_tensor(tmp_path):
  """Layer 1's w1 experts stored in FP8, expert 1's scale one block wider than the others': copied as they are
  (gate_up=fp8_e4m3), the stack of experts is refused naming the tensor, where np.stack raised a bare ValueError."""
  d = copy_of("official", tmp_path)

  def to_fp8(t, dtype_names):
    for name in [n.removesuffix(".weight") for n in t if n.startswith("layers.1.ffn.experts.") and ".w1." in n]:
      wider = int(name.split(".")[4] == "1")  # expert 1
      codes, scale = fp8_e4m3.quantize(t[f"{name}.weight"])
      t[f"{name}.weight"], t[f"{name}.scale"] = codes, np.pad(scale, ((0, 0), (0, wider)))
      dtype_names[f"{name}.scale"] = "F8_E8M0"

  rewrite(d, to_fp8)
  assert one_line_error(d, "gate_up=fp8_e4m3") == (
      f"{d / 'model.safetensors'}: layers.1.ffn.experts.1.w1.weight: shape (8, 32) with scale (1, 2), where "
      "layers.1.ffn.experts.0.w1.weight has (8, 32) with (1, 1)")


@pytest.mark.parametrize("policy", POLICIES)
def test_fp8_weight_intact_loads_under_either_policy(tmp_path, policy):
  """The control of the three above: the same FP8 tensor, uncorrupted, loads and keeps its values."""
  d = copy_of("official", tmp_path)
  fp8_wq_b(d)
  weight = load(d, policy).layers[1].attn.wq_b.weight
  original = safetensors.numpy.load_file(str(SAVED / "official" / "model.safetensors"))["layers.1.attn.wq_b.weight"]
  want = fp8_e4m3.dequantize(*fp8_e4m3.quantize(original))
  assert float(jnp.abs(want).max()) > 0
  np.testing.assert_array_equal(np.asarray(dense(weight), np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("name, dtype, index, value", [
    ("layers.1.attn_norm.weight", np.float32, (5,), np.nan),
    ("embed.weight", jnp.bfloat16, (7, 3), -np.inf),  # a BF16 tensor
])
def test_non_finite_float_weight_names_file_and_tensor(tmp_path, name, dtype, index, value):
  """A NaN or inf in a float tensor loaded without complaint and gave NaN logits (generate printed NUL bytes)."""
  d = copy_of("official", tmp_path)

  def plant(t, _):
    a = t[name].astype(dtype)
    a[index] = value
    t[name] = a
  rewrite(d, plant)
  assert one_line_error(d) == f"{d / 'model.safetensors'}: {name}: {value} at index {index} (1 non-finite values)"


def test_shape_mismatch_names_file_and_tensor(tmp_path):
  d = copy_of("official", tmp_path)
  rewrite(d, lambda t, _: t.update({"layers.1.attn.wkv.weight": t["layers.1.attn.wkv.weight"][:, :31]}))
  assert one_line_error(d) == (f"{d / 'model.safetensors'}: layers.1.attn.wkv.weight: shape (32, 31) does not "
                               f"match the config's (32, 32)")


def test_command_line_prints_one_line_not_a_traceback(tmp_path):
  """Fails at load time, before any compile: a few seconds."""
  d = copy_of("original_format", tmp_path)
  cut = last_tensor(d / "model.safetensors")
  truncate(d / "model.safetensors")
  out = tmp_path / "qual.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}  # no notes on stderr
  run = subprocess.run([sys.executable, "-m", "experiments.prefill", f"--checkpoint={d}", "--lengths=16",
                        f"--out={out}"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
  assert run.returncode == 1, run.stderr
  lines = run.stderr.strip().splitlines()
  assert len(lines) == 1, run.stderr
  assert lines[0].startswith(f"prefill: {d / 'model.safetensors'}: tensor {cut!r}: data_offsets"), lines[0]
  assert not out.exists()


# --- fits in memory ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def need():
  """Bytes of the loaded model's arrays, counted on the arrays themselves."""
  m = load(SAVED / "official")
  return sum(x.nbytes for x in jax.tree.leaves(mapping.nnx.state(m)))


def with_stats(monkeypatch, **stats):
  monkeypatch.setattr(mapping, "_device_memory_stats", lambda: stats)


def test_memory_check_refuses_before_reading(monkeypatch, tmp_path, need):
  d = copy_of("official", tmp_path)
  truncate(d / "model.safetensors")  # so that any read would fail differently
  with_stats(monkeypatch, bytes_limit=need - 1)
  with pytest.raises(CheckpointError) as e:
    load(d)
  assert str(e.value).startswith(f"the weights need {need / 2**30:.4g} GiB but the device has "
                                 f"{(need - 1) / 2**30:.4g} GiB free (bytes_limit")
  with_stats(monkeypatch, bytes_limit=need + 10, bytes_in_use=11)
  with pytest.raises(CheckpointError, match="the weights need"):
    load(d)
  with_stats(monkeypatch, bytes_limit=need)  # exactly enough: loading starts (and meets the truncation)
  with pytest.raises(CheckpointError, match="truncated"):
    load(d)


def test_memory_check_passes_when_the_weights_fit(monkeypatch, need):
  assert 100_000 < need < 200_000  # the tiny fixture, f32
  with_stats(monkeypatch, bytes_limit=need + 10, bytes_in_use=10)
  load(SAVED / "official")
  with_stats(monkeypatch)  # a device without a limit (CPU reports None): no check
  load(SAVED / "official")


def test_memory_check_counts_quantized_storage(need):
  """With FP8 dense weights (codes + scales) and bf16 elsewhere the count follows what is allocated."""
  m = mapping.load_checkpoint(SAVED / "official", dtype=jnp.bfloat16, policy="dense=fp8_e4m3", log=None)
  allocated = sum(x.nbytes for x in jax.tree.leaves(mapping.nnx.state(m)))
  assert sum(mapping.weight_bytes(w) for _, w in mapping.weights(m)) == allocated < need / 2
  with pytest.raises(CheckpointError, match=f"need {allocated / 2**30:.4g} GiB"):
    mapping.check_fits(m, {"bytes_limit": allocated - 1})
  mapping.check_fits(m, {"bytes_limit": allocated})


def test_memory_check_on_a_mesh_counts_each_devices_share_of_the_experts(need):
  """expert=N: a device holds 1/N of the routed experts and the whole rest (ds4jax/mesh.py)."""
  m = mapping.load_checkpoint(SAVED / "official", dtype=jnp.float32, log=None)
  experts = sum(mapping.weight_bytes(w) for p, w in mapping.weights(m) if mapping.is_stacked(p))
  per_device = need - experts + experts // 2
  assert 0 < experts < need and experts % 2 == 0
  with pytest.raises(CheckpointError, match=rf"need {per_device / 2**30:.4g} GiB on each of the 2 devices \(routed "
                                            rf"experts {experts / 2**30:.4g} GiB split 2 ways, the rest whole\)"):
    mapping.check_fits(m, {"bytes_limit": per_device - 1}, expert_devices=2)
  mapping.check_fits(m, {"bytes_limit": per_device}, expert_devices=2)
  with pytest.raises(CheckpointError, match="but the device has"):
    mapping.check_fits(m, {"bytes_limit": per_device})
