"""experiments/gfx1151_model.py: the gfx1151 performance model's work counts, its roofline arithmetic, and the
committed table regenerated from the committed traces."""

import dataclasses
import json

import pytest

from ds4jax import config
from ds4jax.quant import policy as quant_policy
from experiments import gfx1151_model as gm

POLICY = quant_policy.get("lucebox_mix")
RESULTS_JSON = gm.RESULTS / "gfx1151_model.json"
RESULTS_MD = gm.RESULTS / "gfx1151_model.md"


@pytest.fixture(scope="module")
def committed():
  return json.loads(RESULTS_JSON.read_text())


def test_classify_puts_the_traced_kernels_in_their_classes():
  cub = ("void cub::_V_300200_SM_750_800_900_1000_1100_1200::detail::radix_sort::DeviceSegmentedRadixSortKernel<"
         "cub::_V_300200_SM_750_800_900_1000_1100_1200::detail::radix::policy_hub<float, unsigned int, int>")
  f32 = "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x32x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4_execute"
  want = {"loop_convert_fusion": "mix_decode", "moe_gate_up": "moe_gate_up", "moe_down": "moe_down",
          "mla_stream_fast_exp": "mla", "indexer_scores": "indexer_scores", cub: "topk", "sort_16_1": "topk",
          "indexer_radix_select": "topk",
          f32: "f32_gemm", "nvjet_sm90_tss_176x128_64x5_1x2_h_bz_TNN": "dense_gemm",
          "gemm_fusion_dot_general_34": "dense_gemm", "moe_combine": "other", "triton_softmax_21": "other",
          "loop_convert_fusion_2": "other", "MemcpyD2D": "other"}
  assert {k: gm.classify(k) for k in want} == want
  run = next(r for r in json.loads((gm.RESULTS / gm.TRACES[8192]).read_text())["runs"] if r["variant"] == "flags")
  ms, _ = gm.h200_class_ms(run["kernels"])
  assert sum(ms.values()) == pytest.approx(run["device_ms"], abs=0.01)  # every traced ms lands in one class
  assert ms["mix_decode"] == pytest.approx(463.937) and ms["topk"] == pytest.approx(16.22)


def test_attention_indexer_and_moe_flops_of_a_tiny_config_match_a_hand_count():
  cfg = config.tiny()  # window, CSA (ratio 4, top-3), HCA (ratio 8), CSA; W 8, H 4, d 160, Hi 4 x 64
  T = 40
  keys = 0
  for kind in cfg.attention:  # the keys of every query, counted one by one
    for t in range(T):
      keys += min(t + 1, 8) + {"WINDOW": 0, "CSA": min(3, (t + 1) // 4), "HCA": (t + 1) // 8}[kind.name]
  indexer_rows = 2 * sum((t + 1) // 4 for t in range(T))  # two CSA layers score every visible row
  w = gm.class_work(cfg, quant_policy.get("bf16"), T, "gfx1151")  # FLOPs do not depend on the storage format
  assert w["mla"].flops == 4 * 4 * 160 * keys
  assert w["indexer_scores"].flops == 2 * 4 * 64 * indexer_rows
  assert w["moe_gate_up"].flops == 4 * T * 2 * 2 * 64 * 2 * 32 and w["moe_down"].flops == 4 * T * 2 * 2 * 32 * 64
  assert w["topk"].flops == 0 and w["topk"].bytes == 2 * (4 * indexer_rows // 2 + T * 3 * 4)


def test_weights_are_read_once_per_band_and_decoded_once_per_prompt():
  cfg = config.v4_flash()
  one, two = (gm.class_work(cfg, POLICY, n, "gfx1151", decode_ops_per_weight_tile=64.0) for n in (8192, 16384))
  for c in ("moe_gate_up", "moe_down", "mix_decode"):  # two equal bands: everything per band doubles
    assert dataclasses.astuple(two[c])[:3] == pytest.approx([2 * x for x in dataclasses.astuple(one[c])[:3]])
  h200 = [gm.class_work(cfg, POLICY, n, "h200") for n in (8192, 16384)]
  assert h200[0]["mix_decode"].bytes == h200[1]["mix_decode"].bytes > 0  # weights stationary: once per prompt
  # The MIX experts the kernels read: 2.5 bits gate/up and 3.5 bits down, plus codebooks: ~2.28 GB per layer.
  expert_gb = (one["moe_gate_up"].bytes + one["moe_down"].bytes) / 43 / 1e9
  activations = 8192 * 6 * ((4096 + 2048) * 2 + 2048 * 2 + 4096 * 4) / 1e9  # x, h in; h in, f32 out
  assert 2.28 < expert_gb - activations < 2.30
  # The indexer scores every visible row: 4x the rows at twice the tokens.
  assert two["indexer_scores"].flops / one["indexer_scores"].flops == pytest.approx(4.0, rel=1e-3)


def test_halving_gfx1151_bandwidth_slows_the_memory_bound_classes_by_two_and_no_others():
  slow = dataclasses.replace(gm.GFX1151, gb_per_s=gm.GFX1151.gb_per_s / 2)
  base, half = gm.build(date="x"), gm.build(gfx1151=slow, date="x")
  for e0, e1 in zip(base["lengths"], half["lengths"]):
    assert e1["tok_s"]["speed_of_light"] < e0["tok_s"]["speed_of_light"]
    assert e1["tok_s"]["optimistic"] == e0["tok_s"]["optimistic"]  # the measured roofs did not change
    for r0, r1 in zip(e0["classes"], e1["classes"]):
      for s in ("speed_of_light", "central"):
        ratio = r1["gfx1151_ms"][s] / r0["gfx1151_ms"][s] if r0["gfx1151_ms"][s] else 1.0
        if r0["gfx1151_roof"] == "memory":
          assert ratio == pytest.approx(2.0, rel=1e-3), (e0["tokens"], r0["class"], s)
        else:  # compute-bound: unchanged, or at most twice its memory time
          assert 1.0 - 1e-3 <= ratio <= 2.0 + 1e-3, (e0["tokens"], r0["class"], s)
  moe = next(r for r in half["lengths"][0]["classes"] if r["class"] == "moe_gate_up")
  assert moe["gfx1151_roof"] == "flops" and moe["gfx1151_ms"] == base["lengths"][0]["classes"][1]["gfx1151_ms"]


def test_the_transfer_rule_predicts_the_h200_at_other_lengths_within_ten_percent(committed):
  for check in gm.build(date="x")["h200_check"]:
    measured = check["measured_device_s"] or check["measured_wall_s"]
    assert check["predicted_device_s"] == pytest.approx(measured, rel=0.10), check


def test_committed_json_and_table_regenerate_from_the_committed_inputs(committed, tmp_path):
  record = json.loads(json.dumps(gm.build(date=committed["date"])))
  assert record == committed
  assert gm.markdown(committed) == RESULTS_MD.read_text()
  gm.main([], str(tmp_path / "m.json"), str(tmp_path / "m.md"))  # the entry point's own writes
  assert json.loads((tmp_path / "m.json").read_text())["lengths"] == committed["lengths"]
  tok_s = {e["tokens"]: e["tok_s"] for e in committed["lengths"]}
  assert set(tok_s) == {7680, 8192, 32768, 122879}
  for t in tok_s.values():  # the scenarios bracket in their stated order
    assert t["speed_of_light"] > t["optimistic"] > t["central"] > t["pessimistic"] > 0
