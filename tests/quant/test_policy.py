"""Quantization policies: random quantized weights, start-up shape checks, the MoE layer under each policy,
checkpoint conversion, and the V4-Flash byte budget."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ds4jax import config, model, moe
from ds4jax.checkpoint import mapping
from ds4jax.layers import QuantizedWeight
from ds4jax.quant import formats
from ds4jax.quant import policy as quant_policy
from experiments import weight_bytes

CFG = config.tiny(hidden_size=128)  # ROCmFP2-MIX needs in % 128 == 0


@pytest.mark.parametrize("name", [n for n in formats.FORMATS if n != "bf16"])
def test_random_storage_is_a_valid_instance_near_the_target_std(name, seed):
  fmt = formats.get(name)
  shape = (2, 64, 256)
  arrays = quant_policy.random_storage(fmt, shape, jax.random.key(seed), std=0.05)
  fmt.check(**{k: np.asarray(v) for k, v in arrays.items()})  # host-side validation of every byte
  w = np.asarray(fmt.dequantize(**arrays))
  assert w.shape == shape and np.isfinite(w).all()
  assert 0.02 < w.std() < 0.12, w.std()
  assert len(np.unique(w)) > 3


def test_policy_that_cannot_store_a_tensor_fails_at_start_up():
  with pytest.raises(ValueError, match=r"lucebox_mix: ffn\.experts\.w1 \(gate_up\): input dim 64 .* multiple of 128"):
    model.abstract_model(config.tiny(), policy="lucebox_mix")
  with pytest.raises(ValueError, match="unknown quantization policy 'fp1'"):
    quant_policy.get("fp1")


@pytest.mark.parametrize("policy", ["official", "lucebox_mix"])
def test_model_stores_each_role_in_its_format(policy):
  m = model.abstract_model(CFG, policy=policy)
  pol = quant_policy.get(policy)
  assert m.layers[1].attn.wq_b.weight.format == pol.dense
  assert m.layers[1].attn.indexer.wq_b.weight.format == pol.dense
  assert m.layers[0].ffn.shared_experts.w2.weight.format == pol.dense
  assert m.layers[0].ffn.experts.w1.format == m.layers[0].ffn.experts.w3.format == pol.gate_up
  assert m.layers[0].ffn.experts.w2.format == pol.down
  assert isinstance(m.layers[1].attn.compressor.wkv.weight, nnx.Param)  # bf16 in every policy
  assert isinstance(m.head.weight, nnx.Param)


def moe_under(policy_name, layer, cfg, state):
  """The layer with its dense/expert weights converted to `policy_name` (same underlying f32 values)."""
  pol = quant_policy.get(policy_name)
  # The structure only (every array is set below): random quantized draws would cost more than the whole check.
  layer_q = nnx.eval_shape(lambda: moe.MoE(cfg, 1, rngs=nnx.Rngs(params=0), dtype=jnp.bfloat16, policy=pol))
  for path, w in mapping.weights(layer_q):
    value = np.asarray(state[path])
    if isinstance(w, QuantizedWeight):
      for name, array in quant_policy.quantize(formats.get(w.format), value).items():
        getattr(w, name).set_value(jnp.asarray(array))
    else:
      w.set_value(jnp.asarray(value).astype(w.dtype))
  return layer_q


def test_reference_moe_under_each_policy_against_bf16(rng, seed):
  """Relative error of the whole MoE layer (routed + shared) vs the same weights in f32."""
  layer = moe.MoE(CFG, 1, rngs=nnx.Rngs(params=seed), dtype=jnp.float32)
  state = {p: np.asarray(w[...]) for p, w in mapping.weights(layer)}
  x = jnp.asarray(rng.standard_normal((24, CFG.hidden_size)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 256, 24))
  ref = np.asarray(layer(x, tokens))
  errors = {}
  for name in quant_policy.POLICIES:
    y = np.asarray(moe_under(name, layer, CFG, state)(x, tokens))
    errors[name] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
  print("relative error of the MoE layer vs f32:", errors)
  # Measured on fresh random weights: bf16 ~4e-3, official (FP8 dense, FP4 experts) ~0.16,
  # lucebox_mix (FP4 dense, 2.5/3.5-bit MIX experts) ~0.34: the 2-bit gate/up dominates.
  assert 1e-4 < errors["bf16"] < 1e-2
  assert 0.05 < errors["official"] < 0.25
  assert errors["official"] < errors["lucebox_mix"] < 0.5


def test_converting_an_official_checkpoint(tmp_path, seed):
  """Official FP8/FP4 tensors load losslessly under `official`; `lucebox_mix` re-encodes the dequantized values."""
  m = model.init_random(CFG, seed, jnp.float32)
  mapping.save_checkpoint(m, tmp_path, official_formats=True)
  as_float = mapping.load_checkpoint(tmp_path, dtype=jnp.float32, log=None)
  official = mapping.load_checkpoint(tmp_path, dtype=jnp.float32, policy="official", log=None)
  mix = mapping.load_checkpoint(tmp_path, dtype=jnp.float32, policy="lucebox_mix", log=None)
  w_float = np.asarray(as_float.layers[2].ffn.experts.w1[...])
  np.testing.assert_array_equal(np.asarray(official.layers[2].ffn.experts.w1.dequantize()), w_float)
  np.testing.assert_array_equal(np.asarray(official.layers[1].attn.wq_b.weight.dequantize()),
                                np.asarray(as_float.layers[1].attn.wq_b.weight[...]))
  want = quant_policy.quantize(formats.get("rocmfp2_mix"), w_float)
  got = mix.layers[2].ffn.experts.w1.storage()
  for k in want:
    np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=k)


def test_v4_flash_lucebox_mix_fits_one_h200():
  total = {p: sum(weight_bytes.bytes_by_component(config.v4_flash(), quant_policy.get(p)).values())
           for p in quant_policy.POLICIES}
  print({p: f"{b / 1e9:.1f} GB" for p, b in total.items()})
  # bf16: 284.3B params x 2 bytes. lucebox_mix: experts at 2.5/3.5 bpw (+ codebooks), dense at 4.25 bpw.
  assert 560e9 < total["bf16"] < 575e9
  assert 100e9 < total["lucebox_mix"] < 110e9 < total["official"]
  assert total["lucebox_mix"] + 20e9 < 141e9  # room for a 128K cache and prefill activations


def test_custom_policy_spec():
  pol = quant_policy.get("dense=fp8_e4m3, down=rocmfp3")
  assert (pol.dense, pol.gate_up, pol.down) == ("fp8_e4m3", "bf16", "rocmfp3")
  with pytest.raises(ValueError, match="unknown role 'experts'"):
    quant_policy.get("experts=fp8_e4m3")
  with pytest.raises(ValueError, match="unknown weight format 'fp1'"):
    quant_policy.get("dense=fp1")

