"""Checkpoints written by transformers' save_pretrained (tests/checkpoint/hf_saved/, see its README.md).

One random model saved three ways: transformers' default naming, its module names (fused experts), and the
official names. All three must load to the same weights, bit for bit.
"""

import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from ds4jax.checkpoint import hf_names, mapping
from ds4jax.checkpoint.safetensors_reader import CheckpointError, SafetensorsCheckpoint

SAVED = Path(__file__).parent / "hf_saved"
HF_NAMINGS = ["original_format", "module_names"]


def flat(m):
  return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(m))}


@pytest.fixture(scope="module")
def official():
  return flat(mapping.load_checkpoint(SAVED / "official", dtype=jnp.float32, log=None))


def test_fixture_holds_what_transformers_writes():
  """The two namings of transformers 5.24 (not an assumption: these files were written by it)."""
  with SafetensorsCheckpoint(SAVED / "original_format") as ck:
    for n in ("model.embed_tokens.weight", "head.weight", "model.hc_head.hc_fn", "model.layers.0.attn.norm.weight",
              "model.layers.0.attn.indexer.compressor.ape", "model.layers.1.ffn.experts.3.w3.weight"):
      assert n in ck, n
  with SafetensorsCheckpoint(SAVED / "module_names") as ck:
    assert ck.spec("model.layers.0.mlp.experts.gate_up_proj").shape == (4, 16, 32)  # [E, 2I, D], 2I != D
    assert ck.spec("model.layers.0.mlp.experts.down_proj").shape == (4, 32, 8)  # [E, D, I]
    assert "lm_head.weight" in ck and "model.layers.1.self_attn.kv_norm.weight" in ck
  for d in ["official"] + HF_NAMINGS:
    with SafetensorsCheckpoint(SAVED / d) as ck:
      assert hf_names.is_hf_named(ck) == (d != "official")


@pytest.mark.parametrize("naming", HF_NAMINGS)
def test_hf_saved_checkpoint_loads_bit_for_bit(official, naming):
  got = flat(mapping.load_checkpoint(SAVED / naming, dtype=jnp.float32, log=None))
  assert got.keys() == official.keys() and len(got) == 68
  for p, want in official.items():
    assert got[p].dtype == want.dtype, p
    np.testing.assert_array_equal(got[p], want, err_msg=str(p))


def test_gate_and_up_halves_differ(official):
  """Else a swap of w1 and w3 in the translation would go unnoticed."""
  for layer in (0, 1):
    w1, w3 = official[("layers", layer, "ffn", "experts", "w1")], official[("layers", layer, "ffn", "experts", "w3")]
    assert w1.shape == w3.shape == (4, 8, 32) and np.abs(w1 - w3).min() > 0


@pytest.mark.parametrize("stored, official", [
    ("lm_head.weight", "head.weight"),
    ("model.hc_head.hc_scale", "hc_head_scale"),
    ("model.layers.3.ffn_hc.base", "layers.3.hc_ffn_base"),
    ("model.layers.3.self_attn.kv_norm.weight", "layers.3.attn.kv_norm.weight"),
    ("model.layers.3.self_attn.compressor.kv_norm.weight", "layers.3.attn.compressor.norm.weight"),
    ("model.layers.3.self_attn.compressor.indexer.position_bias", "layers.3.attn.indexer.compressor.ape"),
    ("model.layers.3.self_attn.compressor.indexer.q_b_proj.weight", "layers.3.attn.indexer.wq_b.weight"),
    ("model.layers.3.mlp.shared_experts.gate_proj.weight", "layers.3.ffn.shared_experts.w1.weight"),
    ("model.layers.3.self_attn.compressor.gate_proj.weight", "layers.3.attn.compressor.wgate.weight"),
    ("model.layers.3.mlp.gate.e_score_correction_bias", "layers.3.ffn.gate.bias"),
    # transformers' default naming
    ("model.layers.3.attn.norm.weight", "layers.3.attn.kv_norm.weight"),
    ("model.layers.3.attn.compressor.norm.weight", "layers.3.attn.compressor.norm.weight"),
    ("head.weight", "head.weight"),
])
def test_official_name(stored, official):
  """The renames that are easy to get wrong: context-dependent ones, and the two namings' differences."""
  assert hf_names.official_name(stored) == official


@pytest.fixture
def module_copy(tmp_path):
  shutil.copytree(SAVED / "module_names", tmp_path, dirs_exist_ok=True)
  return tmp_path


def rewrite(directory, edit):
  path = directory / "model.safetensors"
  tensors = safetensors.numpy.load_file(str(path))
  edit(tensors)
  safetensors.numpy.save_file(tensors, str(path))


GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.self_attn.kv_norm.weight"), r"lacks 1 tensor.*layers\.1\.attn\.kv_norm\.weight"),
    (lambda t: t.update({"model.layers.1.self_attn.kvnorm.weight": t.pop("model.layers.1.self_attn.kv_norm.weight")}),
     r"lacks 1 tensor\(s\) the model needs, e\.g\. \['layers\.1\.attn\.kv_norm\.weight'\]; it has 1 the model does "
     r"not name, e\.g\. \['.*model\.safetensors: model\.layers\.1\.self_attn\.kvnorm\.weight'\]$"),
    (lambda t: t.update({"model.layers.0.self_attn.extra.weight": np.ones(2, np.float32)}),
     r"model\.safetensors: model\.layers\.0\.self_attn\.extra\.weight'\] \(wrong config\?\)"),
    (lambda t: t.update({"head.weight": t["lm_head.weight"]}), r"lm_head\.weight.* both stand for head\.weight"),
    (lambda t: t.update({GATE_UP: t[GATE_UP][:, :-1]}), r"gate_up_proj: shape \(4, 15, 32\) is not \[experts, 2"),
    (lambda t: t.update({GATE_UP: t[GATE_UP][:3]}), r"lacks 2 tensor.*layers\.1\.ffn\.experts\.3\.w1\.weight"),
    (lambda t: t.update({GATE_UP: t[GATE_UP][:, :, :-1]}),
     r"gate_up_proj\[0, 0:8\] \(layers\.1\.ffn\.experts\.0\.w1\.weight\): shape \(8, 31\) does not match the "
     r"config's \(8, 32\)"),
])
def test_errors_name_the_stored_tensor(module_copy, edit, message):
  rewrite(module_copy, edit)
  with pytest.raises(CheckpointError, match=message):
    mapping.load_checkpoint(module_copy, dtype=jnp.float32, log=None)
