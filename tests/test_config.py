"""DeepseekV4Config: published presets, HF config.json parsing (both forms), validation, parameter counts."""

import dataclasses
import json
import pathlib
import re

import pytest

from ds4jax import config
from ds4jax.config import Attention, DeepseekV4Config, Routing, Yarn

GOLDENS = pathlib.Path(__file__).parent / "goldens"

# The published V4-Flash config.json (legacy form), as on the HF hub.
FLASH_HF_LEGACY = {
    "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "num_hash_layers": 3, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hidden_act": "silu", "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "num_nextn_predict_layers": 1, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 0,
    "eos_token_id": 1,
}


def test_flash_preset_has_the_published_numbers():
  c = config.v4_flash()
  assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.head_dim, c.rope_head_dim) == (
      129280, 4096, 43, 64, 512, 64)
  assert (c.q_lora_rank, c.o_groups, c.o_lora_rank, c.sliding_window) == (1024, 8, 1024, 128)
  assert (c.n_routed_experts, c.experts_per_token, c.moe_intermediate_size, c.routed_scaling_factor) == (
      256, 6, 2048, 1.5)
  assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.csa_ratio, c.hca_ratio) == (64, 128, 512, 4, 128)
  assert c.yarn == Yarn(16.0, 65536, 32.0, 1.0) and (c.rope_theta, c.compress_rope_theta) == (1e4, 1.6e5)
  # Layers 0-1 window only, then CSA on even and HCA on odd layers; hash routing on layers 0-2.
  assert c.attention[:2] == (Attention.WINDOW,) * 2
  assert all(c.attention[i] is (Attention.CSA if i % 2 == 0 else Attention.HCA) for i in range(2, 43))
  assert c.routing == (Routing.HASH,) * 3 + (Routing.TOPK,) * 40


def test_pro_preset_schedule():
  c = config.v4_pro()
  assert (c.num_layers, c.hidden_size, c.num_heads, c.q_lora_rank, c.o_groups, c.index_topk) == (
      61, 7168, 128, 1536, 16, 1024)
  assert (c.n_routed_experts, c.moe_intermediate_size, c.routed_scaling_factor) == (384, 3072, 2.5)
  assert c.attention[:2] == (Attention.HCA,) * 2 and c.attention.count(Attention.CSA) == 30


def test_parameter_counts_match_the_published_totals():
  flash, pro = config.v4_flash().param_counts(), config.v4_pro().param_counts()
  assert abs(flash["total"] / 1e9 - 284.3) < 0.05 and abs(flash["routed_experts"] / 1e9 - 277.0) < 0.05
  assert abs(flash["active_per_token"] / 1e9 - 13.8) < 0.05
  assert abs(pro["total"] / 1e9 - 1573) < 0.5 and abs(pro["active_per_token"] / 1e9 - 49.8) < 0.05


def test_legacy_hf_config_gives_the_flash_preset():
  assert DeepseekV4Config.from_hf_config(FLASH_HF_LEGACY, name="v4_flash") == config.v4_flash()


def test_hf_internal_form_round_trips():
  for cfg in (config.v4_flash(), config.tiny(), config.tiny_hca()):
    hf = json.loads(json.dumps(cfg.to_hf_config()))
    assert DeepseekV4Config.from_hf_config(hf, name=cfg.name) == cfg


@pytest.mark.parametrize("name", ["mixed", "csa_topk", "hca_hash"])
def test_hf_config_writes_the_rope_fraction_where_transformers_reads_it(name):
  """transformers takes each rope table's dims from rope_parameters[kind]["partial_rotary_factor"], 1.0 (the whole
  head) where it is missing: ours must say it where transformers' own config.json does."""
  raw = json.loads((GOLDENS / name / "config.json").read_text())
  ours = DeepseekV4Config.from_hf_config(raw).to_hf_config()
  assert raw["partial_rotary_factor"] < 1 and ours["partial_rotary_factor"] == raw["partial_rotary_factor"]
  for kind in ("main", "compress"):
    assert ours["rope_parameters"][kind]["partial_rotary_factor"] == raw["rope_parameters"][kind][
        "partial_rotary_factor"]


def test_hf_rope_dims_follow_transformers_order():
  """partial_rotary_factor first, then the legacy qk_rope_head_dim, else 64 / 512 of the head."""
  hf = config.tiny().to_hf_config()
  head = hf["head_dim"]
  dims = lambda **kw: DeepseekV4Config.from_hf_config({k: v for k, v in (hf | kw).items()
                                                       if v is not None}).rope_head_dim
  assert dims(partial_rotary_factor=0.25, qk_rope_head_dim=2) == head // 4
  assert dims(partial_rotary_factor=None, qk_rope_head_dim=2) == 2
  assert dims(partial_rotary_factor=None, qk_rope_head_dim=None) == head // 8


@pytest.mark.parametrize("name", ["mixed", "csa_topk", "hca_hash"])
def test_golden_config_json_parses(name):
  cfg = DeepseekV4Config.from_hf_config(GOLDENS / name)  # a directory holding HF's own config.json
  raw = json.loads((GOLDENS / name / "config.json").read_text())
  assert [a.value for a in cfg.attention] == raw["layer_types"]
  assert [r.value for r in cfg.routing] == raw["mlp_layer_types"]
  assert cfg.hca_ratio == raw["compress_rates"]["heavily_compressed_attention"]
  assert cfg.rope_head_dim == raw["qk_rope_head_dim"]
  assert cfg.yarn.factor == raw["rope_parameters"]["compress"]["factor"]


def test_dict_round_trip():
  cfg = config.tiny_csa()
  assert DeepseekV4Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_config_is_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.tiny().hidden_size = 3


@pytest.mark.parametrize("change, field", [
    (dict(hidden_size=0), "hidden_size"),
    (dict(rope_head_dim=33), "rope_head_dim"),
    (dict(rope_head_dim=256), "rope_head_dim"),
    (dict(o_groups=3), "o_groups"),
    (dict(experts_per_token=9), "experts_per_token"),
    (dict(index_head_dim=16), "index_head_dim"),
    (dict(routing=(Routing.HASH,)), "routing"),
    (dict(swiglu_limit=0.0), "swiglu_limit"),
    (dict(max_position_embeddings=0), "max_position_embeddings"),
    (dict(eos_token_id=256), "eos_token_id"),  # tiny's vocabulary is [0, 256)
    (dict(bos_token_id=-1), "bos_token_id"),
])
def test_inconsistent_configs_name_the_field(change, field):
  with pytest.raises(ValueError, match=rf"DeepseekV4Config\.{field}\b"):
    config.tiny(**change)


@pytest.mark.parametrize("change, message", [
    (dict(compress_ratios=[0, 4, 64] + [4] * 41), "compress_ratios"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(num_key_value_heads=8), "num_key_value_heads"),
    (dict(compress_ratios=None), "layer_types or compress_ratios"),
    (dict(compress_ratios=[0, 4]), "num_hidden_layers"),
])
def test_bad_hf_configs_are_rejected(change, message):
  with pytest.raises(ValueError, match=message):
    DeepseekV4Config.from_hf_config(FLASH_HF_LEGACY | change)


def test_unreadable_or_incomplete_config_files_are_one_value_error(tmp_path):
  """A missing file, bad JSON, a JSON list and a missing key each raised its own type (FileNotFoundError, KeyError,
  TypeError), which the entry points' one-line refusals did not catch."""
  path = tmp_path / "config.json"
  with pytest.raises(ValueError, match=f"^{re.escape(str(path))} does not exist$"):
    DeepseekV4Config.from_hf_config(tmp_path)
  for text, message in (("{not json", "cannot read a config"), ("[1, 2]", "a config is a JSON object, got a list"),
                        (json.dumps({k: v for k, v in FLASH_HF_LEGACY.items() if k != "head_dim"}), "no 'head_dim'"),
                        (json.dumps(FLASH_HF_LEGACY | {"routed_scaling_factor": None}), "TypeError: float()")):
    path.write_text(text)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: {re.escape(message)}"):
      DeepseekV4Config.from_hf_config(path)
  with pytest.raises(ValueError, match="^config.json: no 'hidden_size'"):
    DeepseekV4Config.from_hf_config({k: v for k, v in FLASH_HF_LEGACY.items() if k != "hidden_size"})


def test_unknown_preset():
  with pytest.raises(ValueError, match="unknown preset"):
    config.preset("v5")
