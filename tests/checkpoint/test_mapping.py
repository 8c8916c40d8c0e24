"""Loading official-format checkpoints into the model (ds4jax.checkpoint.mapping) and the Orbax round trip."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ds4jax import config, model
from ds4jax.checkpoint import mapping, orbax_io
from ds4jax.checkpoint.safetensors_reader import CheckpointError, SafetensorsCheckpoint
from ds4jax.checkpoint.safetensors_writer import save_file
from ds4jax.quant import fp4_e2m1, fp8_e4m3

CFG = config.tiny()


@pytest.fixture(scope="module")
def tiny(module_seed):
  return model.init_random(CFG, seed=module_seed, dtype=jnp.float32)


@pytest.fixture
def ckpt_dir(tiny, tmp_path):
  mapping.save_checkpoint(tiny, tmp_path)
  return tmp_path


def rewrite(directory, edit):
  """Reads every tensor of directory/model.safetensors, lets `edit` change the dict, writes it back."""
  path = directory / "model.safetensors"
  with SafetensorsCheckpoint(path) as ck:
    tensors = {n: np.array(ck.read(n)) for n in ck.names()}
    names = {n: ck.spec(n).dtype for n in ck.names()}
  edit(tensors)
  save_file(path, tensors, {n: d for n, d in names.items() if n in tensors and d == "F8_E8M0"})


def flat(m):
  return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(m))}


def test_checkpoint_names_follow_the_official_layout():
  m = model.abstract_model(CFG)
  names = {n for p, _ in nnx.to_flat_state(nnx.state(m)) for n in mapping.checkpoint_names(p, CFG)}
  for n in ("embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale",
            "layers.0.hc_attn_fn", "layers.0.hc_ffn_scale", "layers.0.attn_norm.weight", "layers.0.attn.attn_sink",
            "layers.0.attn.wq_a.weight", "layers.0.attn.q_norm.weight", "layers.0.attn.kv_norm.weight",
            "layers.1.attn.compressor.ape", "layers.1.attn.compressor.norm.weight",
            "layers.1.attn.indexer.wq_b.weight", "layers.1.attn.indexer.weights_proj.weight",
            "layers.1.attn.indexer.compressor.wgate.weight", "layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.bias",
            "layers.2.ffn.experts.7.w2.weight", "layers.3.ffn.shared_experts.w3.weight"):
    assert n in names, n
  assert "layers.0.ffn.gate.bias" not in names and "layers.0.attn.compressor.ape" not in names
  assert "layers.2.attn.indexer.wq_b.weight" not in names  # HCA layers have no indexer


def test_float_checkpoint_round_trip_is_exact(tiny, ckpt_dir):
  loaded = mapping.load_checkpoint(ckpt_dir, dtype=jnp.float32, log=None)
  a, b = flat(tiny), flat(loaded)
  assert a.keys() == b.keys()
  for p in a:
    np.testing.assert_array_equal(a[p], b[p], err_msg=str(p))


def test_official_fp8_fp4_checkpoint_loads_the_dequantized_values(tiny, tmp_path):
  mapping.save_checkpoint(tiny, tmp_path, official_formats=True)
  with SafetensorsCheckpoint(tmp_path) as ck:
    assert ck.spec("layers.1.attn.wq_b.weight").dtype == "F8_E4M3"
    assert ck.spec("layers.1.attn.wq_b.scale").dtype == "F8_E8M0"
    assert ck.spec("layers.1.ffn.experts.3.w1.weight").dtype == "I8"
    assert ck.spec("layers.1.attn.compressor.wkv.weight").dtype == "F32"  # bf16/f32 in the real checkpoint
  loaded = flat(mapping.load_checkpoint(tmp_path, dtype=jnp.float32, log=None))
  orig = flat(tiny)
  want = np.asarray(fp8_e4m3.dequantize(*fp8_e4m3.quantize(orig[("layers", 1, "attn", "wq_b", "weight")])))
  np.testing.assert_array_equal(loaded[("layers", 1, "attn", "wq_b", "weight")], want)
  w1 = orig[("layers", 2, "ffn", "experts", "w1")]
  want = np.stack([np.asarray(fp4_e2m1.dequantize(*fp4_e2m1.quantize(e))) for e in w1])
  np.testing.assert_array_equal(loaded[("layers", 2, "ffn", "experts", "w1")], want)
  assert not np.array_equal(want, w1)  # it really went through 4 bits
  np.testing.assert_array_equal(loaded[("layers", 1, "attn", "compressor", "wkv", "weight")],
                                orig[("layers", 1, "attn", "compressor", "wkv", "weight")])


def test_mtp_tensors_are_ignored(tiny, ckpt_dir):
  rewrite(ckpt_dir, lambda t: t.update({"mtp.0.e_proj.weight": np.ones((4, 4), np.float32)}))
  mapping.load_checkpoint(ckpt_dir, dtype=jnp.float32, log=None)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("layers.2.attn.compressor.ape"), r"lacks 1 tensor.*layers\.2\.attn\.compressor\.ape"),
    (lambda t: t.pop("layers.3.ffn.experts.5.w3.weight"), r"layers\.3\.ffn\.experts\.5\.w3\.weight"),
    (lambda t: t.update({"layers.9.attn.wq_a.weight": np.ones((2, 2), np.float32)}),
     r"does not use.*layers\.9\.attn\.wq_a\.weight"),
    (lambda t: t.update({"layers.1.attn.wkv.weight": np.ones((160, 63), np.float32)}),
     r"layers\.1\.attn\.wkv\.weight: shape \(160, 63\) does not match the config's \(160, 64\)"),
    (lambda t: t.update({"layers.2.ffn.experts.1.w2.weight": np.ones((64, 31), np.float32)}),
     r"layers\.2\.ffn\.experts\.1\.w2\.weight: shape \(64, 31\) does not match the config's \(64, 32\)"),
    (lambda t: t.update({"layers.0.ffn.gate.tid2eid": t["layers.0.ffn.gate.tid2eid"].astype(np.float32)}),
     r"layers\.0\.ffn\.gate\.tid2eid: expected an integer tensor, got F32"),
    (lambda t: t.update({"layers.0.attn.attn_sink": np.arange(4, dtype=np.int32)}),
     r"layers\.0\.attn\.attn_sink: expected a floating-point or FP8/FP4 tensor, got I32"),
    (lambda t: t.update({"layers.0.ffn.gate.tid2eid": t["layers.0.ffn.gate.tid2eid"] + 8}),
     r"tid2eid: expert ids must lie in \[0, 8\)"),
    (lambda t: t.update({"norm.weight": np.ones((64,), np.bool_)}), r"norm\.weight: unsupported dtype BOOL"),
])
def test_checkpoint_errors_name_the_tensor(ckpt_dir, edit, message):
  rewrite(ckpt_dir, edit)
  with pytest.raises(CheckpointError, match=message):
    mapping.load_checkpoint(ckpt_dir, dtype=jnp.float32, log=None)


def test_fp8_without_scale_and_corrupted_scale_bytes(tiny, tmp_path):
  mapping.save_checkpoint(tiny, tmp_path, official_formats=True)
  rewrite(tmp_path, lambda t: t.pop("layers.0.attn.wo_b.scale"))
  with pytest.raises(CheckpointError, match=r"wo_b\.weight: stored as F8_E4M3 but its scale tensor"):
    mapping.load_checkpoint(tmp_path, dtype=jnp.float32, log=None)

  mapping.save_checkpoint(tiny, tmp_path, official_formats=True)

  def corrupt(t):
    t["layers.3.ffn.experts.2.w1.scale"][1, 0] = 0xFF

  rewrite(tmp_path, corrupt)
  with pytest.raises(ValueError, match=r"experts\.2\.w1\.scale: corrupted scale byte 0xFF at index \(1, 0\)"):
    mapping.load_checkpoint(tmp_path, dtype=jnp.float32, log=None)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_orbax_round_trip_needs_no_original_files(tiny, ckpt_dir, tmp_path_factory, dtype):
  m = mapping.load_checkpoint(ckpt_dir, dtype=dtype, log=None)
  target = tmp_path_factory.mktemp("orbax") / "v4"
  orbax_io.save(m, target)
  for f in os.listdir(ckpt_dir):
    os.remove(ckpt_dir / f)
  restored = orbax_io.restore(target)
  assert restored.cfg == CFG and restored.embed.dtype == dtype
  a, b = flat(m), flat(restored)
  for p in a:
    assert a[p].dtype == b[p].dtype, p
    np.testing.assert_array_equal(a[p], b[p], err_msg=str(p))


def test_orbax_restore_of_a_non_checkpoint(tmp_path):
  with pytest.raises(CheckpointError, match="not a ds4jax Orbax checkpoint"):
    orbax_io.restore(tmp_path)


def test_orbax_restore_of_a_damaged_checkpoint_is_one_checkpoint_error(tiny, tmp_path):
  """A description that is not JSON or does not match the saved arrays, and a missing state/, gave Orbax's, json's
  and the file system's own errors (and screens of asyncio tracebacks)."""
  orbax_io.save(tiny, tmp_path / "v4")
  described = tmp_path / "v4" / orbax_io.CONFIG_FILE
  saved = json.loads(described.read_text())
  described.write_text(json.dumps(saved | {"config": saved["config"] | {"moe_intermediate_size": 64}}))
  with pytest.raises(CheckpointError, match=r"v4/state does not hold the weights ds4jax_config.json "
                     r"describes: layers.0.ffn.experts.w1.value is \(8, 32, 64\) float32 there, \(8, 64, 64\) "
                     "float32 in the model$"):
    orbax_io.restore(tmp_path / "v4")
  described.write_text("{not json")
  with pytest.raises(CheckpointError, match=r"ds4jax_config.json: not a model description \(JSONDecodeError: "):
    orbax_io.restore(tmp_path / "v4")
  described.write_text(json.dumps(saved))
  assert orbax_io.restore(tmp_path / "v4").cfg == CFG
  shutil.rmtree(tmp_path / "v4" / orbax_io.STATE_DIR)
  with pytest.raises(CheckpointError, match="v4 is not a ds4jax Orbax checkpoint: state/ is missing"):
    orbax_io.restore(tmp_path / "v4")
