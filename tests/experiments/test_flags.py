"""experiments/flags.py: the shared flags map onto Features and a QuantPolicy."""

from absl import flags

from ds4jax import config
from ds4jax.quant import policy as quant_policy
from experiments import flags as flags_lib


def test_flags_map_to_features():
  fv = flags.FlagValues()
  flags_lib.define_feature_flags(fv)
  fv(["prog", "--nomoe_fused_combine", "--prefill_band_tokens=4096"])
  f = flags_lib.features_from_flags(fv, "cpu_interpret")
  assert f.prefill_band_tokens == 4096 and not f.moe_fused_combine
  assert "GGML_CUDA_MLA_STREAM_FAST_EXP" in fv["mla_stream_fast_exp"].help


def test_model_bound_default_needs_the_model():
  # sm_90's mla_wgmma default: on for V4-Flash's head shape, off for a model it does not fit or an unknown one;
  # --nomla_wgmma wins over the fit
  fv = flags.FlagValues()
  flags_lib.define_feature_flags(fv)
  fv(["prog"])
  on = lambda cfg: flags_lib.features_from_flags(fv, "sm_90", cfg=cfg).mla_wgmma
  assert on(config.v4_flash()) and not on(config.tiny()) and not on(None)
  # the fused MoE's: with the policy whose experts its kernels take, and a prompt of one band
  moe = lambda **kw: flags_lib.features_from_flags(fv, "sm_90", cfg=config.v4_flash(), **kw).moe_wgmma_down
  assert moe(policy="lucebox_mix", tokens=8192)
  assert not moe(policy="lucebox_mix", tokens=32768) and not moe(policy="lucebox_mix") and not moe(tokens=8192)
  fv(["prog", "--nomla_wgmma", "--prefill_band_tokens=0"])
  assert not on(config.v4_flash()) and moe(policy="lucebox_mix", tokens=32768)


def test_quant_policy_flag():
  fv = flags.FlagValues()
  flags_lib.define_quant_policy_flag(fv)
  fv(["prog", "--quant_policy=lucebox_mix"])
  assert quant_policy.get(fv.quant_policy) is quant_policy.POLICIES["lucebox_mix"]
