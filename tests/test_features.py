"""Feature switches and the device capability table (no GPU needed)."""

import types

import pytest

from ds4jax import attention, config, features, model
from ds4jax.features import CAPABILITIES, FeatureError, SWITCHES
from experiments.qualification import matrix


def fake_device(platform, arch, kind="fake"):
  return types.SimpleNamespace(platform=platform, compute_capability=arch, device_kind=kind)


@pytest.mark.parametrize("platform, arch, want", [
    ("rocm", "gfx1151", "gfx1151"),
    ("rocm", "gfx1150", "rdna35_other"),
    ("rocm", "gfx1152", "rdna35_other"),
    ("rocm", "gfx942", "rocm_other"),
    ("gpu", "gfx1100", "rocm_other"),
    ("cuda", "9.0", "sm_90"),
    ("cpu", None, "cpu_interpret"),
])
def test_device_classes(platform, arch, want):
  assert features.device_class(fake_device(platform, arch)) == want


def test_unknown_gpu_is_refused():
  with pytest.raises(ValueError, match="no row in the capability table"):
    features.device_class(fake_device("cuda", "8.0", "A100"))


def test_every_device_class_has_every_switch():
  for cls in features.DEVICE_CLASSES:
    assert set(CAPABILITIES[cls]) == set(SWITCHES)
    for s, cap in CAPABILITIES[cls].items():
      assert cap.supported or not cap.default, f"{cls}: {s} is on by default but unsupported"


def test_review_6_gfx1151_defaults_do_not_leak_to_other_rdna35():
  """A gfx1151-only default must not apply to gfx1150 (upstream review item 6)."""
  g51, g50 = CAPABILITIES["gfx1151"], CAPABILITIES["rdna35_other"]
  for s in SWITCHES:
    if g51[s].default and not g50[s].supported:
      assert features.resolve("rdna35_other").__getattribute__(s) is False


def test_capability_states():
  """gfx1151 advertises upstream's sparse-prefill set as lowered only (nothing ran there), and neither ds4jax's expert
  decode kernel (its gate/up reads the quantized tiles) nor the Mosaic GPU kernels (no ROCm backend); sm_90 and the
  CPU ran what they advertise (the Mosaic GPU MLA on sm_90 too, on by default where the model fits), but for the MoE
  over several bands, lowered only on sm_90; other RDNA3.5 and ROCm devices advertise nothing."""
  states = lambda cls: {s: cap.state for s, cap in CAPABILITIES[cls].items()}
  not_lowered = {"moe_decode_kernel", *features.WGMMA_SWITCHES}
  assert {s for s, st in states("gfx1151").items() if st != features.LOWERED} == not_lowered
  assert {states("gfx1151")[s] for s in not_lowered} == {features.UNSUPPORTED}
  assert set(states("rdna35_other").values()) == set(states("rocm_other").values()) == {features.UNSUPPORTED}
  assert features.RAN in set(states("sm_90").values())
  # Nothing is lowered only on sm_90; the MoE over several bands ran there and is on (one band: the same program).
  assert not {s for s, st in states("sm_90").items() if st == features.LOWERED}
  assert states("sm_90")["prefill_moe_over_bands"] == features.RAN
  assert CAPABILITIES["sm_90"]["prefill_moe_over_bands"].default
  assert states("sm_90")["mla_wgmma"] == features.RAN and CAPABILITIES["sm_90"]["mla_wgmma"].default
  g51 = features.resolve("gfx1151")
  assert g51.on() == ["bf16_matmul", "moe_sparse_gate_up", "moe_adaptive_tile", "moe_compact_queue", "moe_persistent",
                      "moe_fused_combine", "indexer_score_kernel", "indexer_radix_topk", "direct_indexer_topk",
                      "mla_stream_topk", "mla_stream_f32_stage", "mla_stream_fast_exp"]
  assert (g51.long_context_chunk, g51.prefill_band_tokens) == (8192, 8192)
  assert features.resolve("rdna35_other").on() == []
  with pytest.raises(FeatureError, match="not supported on rdna35_other"):
    features.resolve("rdna35_other", {"moe_sparse_gate_up": True})
  assert features.switch_states(g51) == dict.fromkeys(g51.on(), features.LOWERED)
  line = features.describe_states(g51)
  assert "ran none" in line and "LOWERED ONLY" in line and "mla_stream_fast_exp" in line
  assert "LOWERED" not in features.describe_states(features.resolve("sm_90"))
  over = features.resolve("sm_90", {"prefill_moe_over_bands": True})
  assert "LOWERED" not in features.describe_states(over) and "prefill_moe_over_bands" in features.describe_states(over)


def test_every_switch_lowered_for_gfx1151_runs_only_kernels_that_pass_the_lowering_check():
  """The Pallas kernels that gfx1151's defaults, and the qualification's kills that change kernels, launch
  (traced with gfx1151's configs on an abstract model) each passed the offline gfx1151 check on record
  (experiments/results/lowering_gfx1151.json, `python -m experiments.lower_gfx1151`)."""
  import json  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from ds4jax import config, model  # pylint: disable=import-outside-toplevel

  record = json.loads((pathlib.Path(__file__).parents[1] / "experiments/results/lowering_gfx1151.json").read_text())
  passed = {r["kernel"] for r in record["rows"] if r["target"] == "gfx1151" and not r["violations"]}
  failed = {r["kernel"] for r in record["rows"] if r["target"] == "gfx1151" and r["violations"]}
  m = model.abstract_model(config.tiny_sparse(hidden_size=128, moe_intermediate_size=128), policy="lucebox_mix")
  gdef, state = nnx.split(m)
  base = features.resolve("gfx1151")
  launched = set()
  # The kills that swap kernels: the compact queue (and persistent with it), the f32 stage, fast exp.
  for f in [base] + [features.resolve("gfx1151", {s: False}) for s in ("moe_persistent", "mla_stream_fast_exp")] + [
      features.resolve("gfx1151", {"mla_stream_f32_stage": False, "mla_stream_fast_exp": False})]:
    calls = features.pallas_calls(lambda st, t, f=f: nnx.merge(gdef, st)(t, features=f), state,
                                  jax.ShapeDtypeStruct((40,), jnp.int32))
    launched |= {name for name, _ in calls}
  assert {"moe_gate_up_persistent", "mla_stream_fast_exp", "mla_stream_topk", "indexer_scores"} <= launched
  assert launched <= passed - failed, f"not lowered for gfx1151: {sorted(launched - (passed - failed))}"


def test_bound_defaults_follow_the_model_and_the_prompt():
  """sm_90's Mosaic GPU defaults hold only where the caller says the model fits (mla_wgmma: 64 heads of dim 512; the
  MoE: FP2/FP3-MIX experts), and the fused MoE's only where the prompt is one band: the defaults run every model,
  and an explicit on is kept for the model's start-up check to refuse."""
  v4, tiny = config.v4_flash(), config.tiny()
  moe = {"moe_sparse_gate_up", "moe_wgmma_gate_up", "moe_wgmma_down"}
  assert {s for s, c in features.CAPABILITIES["sm_90"].items() if c.when} == moe | {"mla_wgmma"}
  fits = model.kernel_fits(v4, "lucebox_mix")
  assert fits == moe | {"mla_wgmma"} and attention.model_fits(tiny) == set()
  assert model.kernel_fits(v4, "bf16") == {"mla_wgmma"}  # bf16 experts: the Mosaic MoE only when asked
  assert model.kernel_fits(tiny, "lucebox_mix") == set()  # D 64: no TMA row of meta bytes
  on = lambda **kw: set(features.resolve("sm_90", **kw).on())
  assert moe | {"mla_wgmma"} <= on(fits=fits, tokens=8192)
  assert "mla_wgmma" in on(fits=fits, tokens=8193) and not moe & on(fits=fits, tokens=8193)  # two bands
  assert not moe & on(fits=fits) and "mla_wgmma" in on(fits=fits)  # the length not known
  assert moe <= set(features.resolve("sm_90", {"prefill_band_tokens": 0}, fits=fits, tokens=122879).on())
  assert moe <= set(features.resolve("sm_90", {"prefill_band_tokens": 16384}, fits=fits, tokens=16384).on())
  assert not ({"mla_wgmma"} | moe) & on(fits=model.kernel_fits(tiny, "lucebox_mix"), tokens=64)
  assert not features.resolve("sm_90").mla_wgmma  # the model unknown: off
  explicit = features.resolve("sm_90", {"mla_wgmma": True})
  with pytest.raises(ValueError, match="mla_wgmma needs 64 heads of dim 512"):
    attention.check_kernels(tiny, explicit)
  attention.check_kernels(v4, explicit)
  assert not ({"mla_wgmma"} | moe) & set(features.resolve("cpu_interpret", fits=fits, tokens=64).on())
  assert "moe_sparse_gate_up" in features.resolve("gfx1151", tokens=122879).on()  # bound on sm_90 only
  with pytest.raises(FeatureError, match="mla_wgmma requires --mla_stream_fast_exp"):
    features.resolve("sm_90", {"mla_stream_fast_exp": False}, fits={"mla_wgmma"})
  assert features.one_band(8192, 8192) and features.one_band(10**6, 0) and not features.one_band(None, 0)


def test_reference_is_all_off():
  f = features.resolve("cpu_interpret", {s: False for s in SWITCHES})
  assert f.on() == [] and f.interpret


@pytest.mark.parametrize("overrides, message", [
    (dict(mla_stream_fast_exp=True), r"--mla_stream_fast_exp requires --mla_stream_topk, --mla_stream_f32_stage"),
    (dict(mla_stream_f32_stage=True), r"--mla_stream_f32_stage requires --mla_stream_topk"),
    (dict(moe_persistent=True), r"--moe_persistent requires --moe_compact_queue"),
    (dict(moe_tile_rows=48), "power of two"),
    (dict(moe_tile_rows=8), r"--moe_tile_rows must be a power of two >= 16 \(Pallas-Triton tiles\), got 8"),
    (dict(moe_programs_per_core=0), "--moe_programs_per_core must be at least 1, got 0"),
    (dict(long_context_chunk=-1), "non-negative"),
    (dict(bogus=True), "unknown feature 'bogus'"),
    (dict(bf16_matmul="no"), "--bf16_matmul must be True or False, got 'no'"),  # a non-empty string was on
    (dict(moe_tile_rows=True), r"--moe_tile_rows must be a non-negative integer, got True"),
])
def test_impossible_combinations_fail_with_a_clear_message(overrides, message):
  with pytest.raises(FeatureError, match=message):
    features.resolve("cpu_interpret", overrides)


def test_attention_kernels_that_cannot_take_the_model_are_refused_before_tracing():
  """The streaming MLA kernels take a head dim that is a power of two in [64, 512] and the indexer kernel a
  power-of-two top-k: a model without them (tiny: head dim 160, index_topk 3) is refused in one line at start-up,
  where every configuration used to crash inside its first prefill."""
  tiny = config.tiny()
  on = lambda *s: features.resolve("cpu_interpret", {x: x in s for x in SWITCHES})
  with pytest.raises(ValueError, match="^--mla_stream_topk needs a head dim that is a power of two in \\[64, 512\\]; "
                                       "tiny has 160$"):
    attention.check_kernels(tiny, on("mla_stream_topk"))
  with pytest.raises(ValueError, match="^--indexer_score_kernel needs index_topk a power of two; tiny has 3$"):
    attention.check_kernels(tiny, on("indexer_score_kernel"))
  attention.check_kernels(tiny, on())
  attention.check_kernels(config.tiny_sparse(), on("mla_stream_topk", "indexer_score_kernel"))


def test_gfx1151_kernels_need_bf16_operands():
  """On gfx1151 the MoE and attention kernels lowered with bf16 operands only (f32 activations spill; the MLA kernel
  keeps bf16 precision on ROCm): without bf16_matmul they are refused at start-up, and the qualification's
  kill_bf16_matmul there turns them off with it. Elsewhere f32 operands take every kernel."""
  with pytest.raises(FeatureError, match=r"--moe_compact_queue requires --bf16_matmul on gfx1151"):
    features.resolve("gfx1151", {"bf16_matmul": False})
  kill = {c.name: c for c in matrix.configurations(features.resolve("gfx1151"))}["kill_bf16_matmul"]
  assert kill.features.on() == [] and {"moe_compact_queue", "mla_stream_topk"} <= set(kill.also_off)
  assert features.resolve("cpu_interpret", {"bf16_matmul": False, "moe_compact_queue": True}).moe_compact_queue


def test_unsupported_switch_is_an_error_not_a_fallback():
  unsupported = [s for s, cap in CAPABILITIES["rocm_other"].items() if not cap.supported]
  assert unsupported, "nothing to check"
  with pytest.raises(FeatureError, match=rf"--{unsupported[0]} .* is not supported on rocm_other"):
    features.resolve("rocm_other", {unsupported[0]: True})


def test_readme_maps_every_flag_to_its_upstream_name():
  """The README's switch table lists each flag with its upstream name (the flag help says the same)."""
  import pathlib  # pylint: disable=import-outside-toplevel
  readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  for name, (upstream, _, *_) in {**features.SWITCHES, **features.KNOBS}.items():
    assert f"| `--{name}` | `{upstream}` |" in readme, name
