"""experiments/results_tables.py: every committed results file into tables whose numbers are the file's, and a clear
refusal of what it cannot read."""

import json
import math
import shutil

import pandas as pd
import pytest

from ds4jax import config
from experiments import results_tables as rt

KINDS = {
    "attention_h200_2026-11-30.json": "bench_attention",
    "decode_h200_2026-11-30.json": "bench_decode",
    "init_stats_v4flash_h200.json": "init_stats",
    "layer_verdicts_mutation_topk_v4flash_h200_3072.json": "layer_verdicts",
    "layer_verdicts_mutations_v4flash_h200_1024.json": "layer_verdicts",
    "layer_verdicts_v4flash_h200_1024.json": "layer_verdicts",
    "lowering_gfx1151.json": "lowering_gfx1151",
    "moe_bench_h200_2026-11-30.json": "bench_moe",
    "prefill_band_sweep_122879_h200.json": "band_sweep",
    "qual_v4flash_h200.json": "qualification",
    "qual_v4flash_h200_parity_by_switch.json": "parity_by_switch",
    "qual_v4flash_h200_parity_by_switch_rerun.json": "parity_by_switch",
    "qual_v4flash_h200_per_layer.json": "per_layer_parity",
    "qual_v4flash_h200_wave2.json": "qualification",
    "qual_v4flash_h200_wave2b.json": "qualification",
    "reference_prefill_v4flash4L_h200.json": "bench_reference",
    "trace_prefill_h200_8192.json": "trace_prefill",
    "trace_prefill_h200_122879.json": "trace_prefill",
    "decode_h200_2026-12-01.json": "bench_decode",
    "attention_h200_2026-12-01_cuda_tiles_bf16.json": "bench_attention",
    "generate_v4flash_h200_text.json": "bench_generate",
    "generate_tiny_stdlib_cpu.json": "generate",
    "moe_profile_h200_s35.json": "profile_moe",
}
WAVE2 = "qual_v4flash_h200_wave2.json"


def raw(name):
  return json.loads((rt.RESULTS_DIR / name).read_text())


@pytest.fixture(scope="module")
def tables():
  return rt.load_dir()


def record(doc, length, config_name):
  return next(r for r in doc["records"] if r["length"] == length and r["config"] == config_name)


def test_every_committed_file_is_read(tables):
  for name, kind in KINDS.items():  # a file added later must load too: load_dir raised on none of them
    assert tables[name].kind == kind, name
  for t in tables.values():
    assert set(t.frames) == set(rt.KINDS[t.kind])
    main = t.frames[rt.KINDS[t.kind][0]]  # the others may be empty (an untraced run has no kernels)
    verdicts_only = t.kind == "qualification" and len(t.frames["verdicts"])  # its timing was cut
    assert len(main) or verdicts_only, t.path
  bands = tables["qual_v4flash_h200_verdict_bands_a4dbb65.json"].frames["verdicts"]
  assert sorted(bands.result) == ["FAIL", "FAIL", "PASS"]


def test_profile_figures_carry_the_files_numbers(tables):
  name = "moe_profile_h200_s35.json"
  t, doc = tables[name], raw(name)
  step = t.regions.set_index(["tokens", "variant", "region"]).loc[(8192, "mix:lhs_w128_s3_r256", "step")]
  assert step["median"] == doc["runs"][0]["cycles"]["step"]["median"] == 1461.0
  run = t.runs.set_index(["tokens", "variant"]).loc[(32768, "bf16:w128_n64_s4_i")]
  assert run.ms == 12.974 and run.unit_units == 198.0 and run.clock_ghz == 1.201


def test_decode_figures_carry_the_files_numbers(tables):
  name = "generate_v4flash_h200_text.json"
  t, doc = tables[name], raw(name)
  row = t.lengths.set_index("prompt_tokens").loc[131072]
  want = doc["lengths"]["131072"]
  assert row.band_ms_q1 == want["band_ms"]["1"] == pytest.approx(71.717806, rel=1e-6)
  assert row.band_ms_q5 == want["band_ms"]["5"]
  # This file holds n_new / seconds; the table counts the 63 steps after the first token, which the prompt gives.
  assert row.greedy_tok_per_s == pytest.approx(want["greedy"]["tok_per_s"] * 63 / 64)
  assert row.greedy_ms_per_step == pytest.approx(1e3 / row.greedy_tok_per_s) == pytest.approx(92.1, abs=0.05)
  assert row.device_ms_per_step == want["trace"]["device_ms_per_step"] and row.same_as_greedy
  moe = t.kernels.set_index("kernel").loc["moe_gate_up"]
  assert moe.ms_per_step == pytest.approx(37.866 / 4) and t.meta["prompt"]["kind"] == "file"
  assert math.isnan(t.lengths.set_index("prompt_tokens").loc[8192].device_ms_per_step)  # traced at 131072 only
  tiny = tables["generate_tiny_stdlib_cpu.json"].runs.iloc[0]
  assert (tiny.drafted, tiny.accepted, tiny.same_as_greedy) == (28, 19, True)


def test_qualification_records_and_verdicts_carry_the_files_numbers(tables):
  q, doc = tables[WAVE2], raw(WAVE2)
  on, want = q.records.set_index("config").loc["all_on"], record(doc, 8192, "all_on")
  assert on.tokens_per_s == want["timing"]["tokens_per_s"] == pytest.approx(5342.256229845101)
  assert on.verdict == "PASS" and on.worst_layer == want["verdict"]["worst_layer"]["layer"]
  assert on.tf_kl == want["verdict"]["teacher_forced"]["mean_kl"]
  assert on.route_flips == sum(x["route_flips"] for x in want["verdict"]["layers"]) == 203
  assert on.index_flips == 26384 and on.bad_flips == 0
  assert len(q.records) == len(doc["records"]) and q.records.config.iloc[0] == "all_on"
  layers = q.layers[q.layers.config == "all_on"]
  assert list(layers.layer) == list(range(43))
  x = want["verdict"]["layers"][7]
  row = layers.set_index("layer").loc[7]
  assert row.nmse_over_bound == x["update_nmse"] / x["bound"]
  assert row.nmse_over_reference == x["update_nmse"] / x["reference_bf16_nmse"]
  assert set(q.layers.bands) == {1} and set(q.verdicts.band_tokens) == {0}  # judged before verdicts in bands
  bugs = q.verdicts[q.verdicts.mutation.notna()].set_index("mutation")
  assert set(bugs.result) == {"FAIL"} and bugs.loc["index_topk_minus_one"].bad_flips == 2049
  assert q.noise_floor.kl.iloc[0] == doc["noise_floor"]["4096"]["kl"]
  oom = q.records.set_index("config").loc["all_off"]
  assert oom.status == "failed" and oom.error_kind == "oom" and math.isnan(oom.tokens_per_s)


def test_schema_1_reads_as_throughput_only(tables):
  w1, doc = tables["qual_v4flash_h200.json"], raw("qual_v4flash_h200.json")
  assert w1.meta["schema"] == rt.QUALIFICATION_V1 and not w1.meta["has_verdicts"]
  assert w1.layers.empty and w1.verdicts.empty and w1.records.verdict.isna().all()
  on = w1.records[w1.records.config == "all_on"].set_index("length").tokens_per_s
  assert dict(on) == {n: record(doc, n, "all_on")["timing"]["tokens_per_s"] for n in (8192, 32768, 122879)}
  assert on[122879] == pytest.approx(3801.0229507199706)


def test_band_sweep_and_benchmarks(tables):
  sweep = tables["prefill_band_sweep_122879_h200.json"].records
  assert sweep.set_index("band_tokens").bands.to_dict() == {8192: 15, 16384: 8, 32768: 4, 49152: 3, 65536: 2}
  assert sweep.tokens_per_s.max() == max(r["timing"]["tokens_per_s"] for r in raw(
      "prefill_band_sweep_122879_h200.json")["records"])
  moe = tables["moe_bench_h200_2026-11-30.json"].runs.set_index(["contender", "tokens", "routing"])
  ours, torch = moe.loc[("ours_bf16_gate_up", 8192, "uniform")], moe.loc[("torch_grouped_mm_gate_up", 8192, "uniform")]
  assert (ours.ms == pytest.approx(4.158591, abs=1e-6)
          and ours.fraction_of_torch_grouped_mm == ours.tflops / torch.tflops)
  assert moe.loc[("jax_ragged_dot_gate_up", 8192, "uniform")].error.startswith("JaxRuntimeError")
  att = tables["attention_h200_2026-11-30.json"]
  fast = att.timings.set_index(["contender", "context"]).loc[("stream_f32_stage_fast_exp", 8192)]
  assert fast.kernel == "mla_stream_fast_exp" and fast.ms == pytest.approx(15.62341, abs=1e-5)
  assert list(att.speedups.ratio.round(3)) == [1.255, 1.261]
  decode = tables["decode_h200_2026-11-30.json"].decode.set_index(["weight", "variant"])
  assert decode.loc[("down (rocmfp3_mix)", "lookup")].ms == raw("decode_h200_2026-11-30.json")[
      "weights"]["down (rocmfp3_mix)"]["ms"]["lookup"]
  reference = tables["reference_prefill_v4flash4L_h200.json"].runs.set_index("tokens")
  assert reference.loc[4096].tokens_per_second == pytest.approx(863.838, abs=1e-3)
  assert reference.loc[8192].error.startswith("JaxRuntimeError: RESOURCE_EXHAUSTED")


def test_lowering_and_model_statistics(tables):
  low = tables["lowering_gfx1151.json"]
  gfx = low.kernels[low.kernels.target == "gfx1151"]
  assert len(low.kernels) == len(raw("lowering_gfx1151.json")["rows"]) and gfx.vgpr.max() == 255
  assert gfx.vgpr_spills.sum() == 0 and low.meta["lds_limit"] == 65536
  stats = tables["init_stats_v4flash_h200.json"]
  assert len(stats.layers) == 43 and stats.summary.entropy.iloc[0] == pytest.approx(7.340439796447754)
  verdicts = tables["layer_verdicts_v4flash_h200_1024.json"].layers
  assert (verdicts.run == "configuration").sum() == 43 and not verdicts.set_index("run").loc["dropped_sink"].passed
  by_switch = tables["qual_v4flash_h200_parity_by_switch_rerun.json"].variants.set_index("variant")
  assert by_switch.loc["all_on_f32"].kl == pytest.approx(0.04829796766218594)
  per_layer = tables["qual_v4flash_h200_per_layer.json"].layers
  assert len(per_layer) == 43 * 3 and set(per_layer.variant) == {"all_on", "all_on_f32", "reference_bf16"}


def test_prefill_traces_are_read():
  """The committed traces: one run per (length, feature set), the kernels of each, the numbers of the file."""
  t = rt.load("experiments/results/trace_prefill_h200_32768.json", expect="trace_prefill")
  runs = t.runs.set_index("variant")
  doc = raw("trace_prefill_h200_32768.json")
  assert runs.loc["flags"].tok_s == doc["runs"][0]["tok_s"] and runs.loc["flags"].tokens == 32768
  assert "prefill_weights_stationary" in runs.loc["flags"].switches_on
  assert "prefill_weights_stationary" not in runs.loc["without_prefill_weights_stationary"].switches_on
  mine = t.kernels[t.kernels.variant == "flags"]
  assert mine.ms.iloc[0] == doc["runs"][0]["kernels"][0]["ms"] and mine.ms.is_monotonic_decreasing is not None
  long = rt.load("experiments/results/trace_prefill_h200_122879.json").runs  # timed only (--notrace)
  assert long.tok_s.notna().all() and long.device_ms.isna().all()


def test_the_newest_saved_verdict_is_shown(tmp_path):
  """A configuration judged twice with no timing record (one call cut, another on other code): the table shows the
  newest verdict, as the qualification takes it, not the first one saved."""
  doc = raw("qual_v4flash_h200_verdict_bands_a4dbb65.json")
  older = dict(doc["verdicts"][0], result="FAIL", band_tokens=0)
  doc["verdicts"].insert(0, older)
  (tmp_path / "q.json").write_text(json.dumps(doc))
  v = rt.load(tmp_path / "q.json", expect="qualification").frames["verdicts"].set_index("config")
  assert len(v) == 3 and (v.loc["all_on", "result"], v.loc["all_on", "band_tokens"]) == ("PASS", 2048)


def test_all_on_judged_with_other_switches_at_another_length_is_its_own_row(tables):
  """wave2d judged all_on twice on the one 4096-token prefix: with sm_90's one-band MoE switches (its 8192 record)
  and without them (32768, 122879). The verdict table keeps both, told apart by their switches."""
  v = tables["qual_v4flash_h200_wave2d.json"].frames["verdicts"]
  on = v[v.config == "all_on"]
  assert len(on) == 2 and on.features.nunique() == 2
  fused = on[on.features.str.contains("moe_wgmma_gate_up")]
  assert len(fused) == 1 and "moe_sparse_gate_up" in fused.features.iloc[0].split("+")
  layers = tables["qual_v4flash_h200_wave2d.json"].frames["layers"]
  assert (layers[layers.config == "all_on"].groupby("features").layer.count() == 43).all()


def test_a_failed_trace_run_keeps_its_error(tmp_path):
  doc = dict(date="2026-12-01", device_kind="NVIDIA H200", git_commit="abc", variants={"flags": ["bf16_matmul"]},
             what="prefill device time by kernel (experiments/trace_prefill.py)", preset="v4_flash",
             runs=[dict(tokens=8192, variant="flags", cold_s=40.0, wall_s=[1.5], tok_s=5400.0, traced_wall_ms=1600.0,
                        peak_bytes=1, device_ms=1450.0,
                        kernels=[dict(kernel="moe_gate_up", ms=180.0, count=43, share=0.124),
                                 dict(kernel="other", ms=1270.0, count=900, share=0.876)]),
                   dict(tokens=122879, variant="flags", error="XlaRuntimeError: RESOURCE_EXHAUSTED")])
  (tmp_path / "trace.json").write_text(json.dumps(doc))
  t = rt.load(tmp_path / "trace.json", expect="trace_prefill")
  assert t.runs.tok_s.iloc[0] == 5400.0 and list(t.kernels.kernel) == ["moe_gate_up", "other"]
  assert t.runs.error.iloc[1].startswith("XlaRuntimeError") and pd.isna(t.runs.tok_s.iloc[1])


def test_head_to_head_rows_carry_the_round_by_round_rates(tmp_path):
  h = dict(tokens=8192, routing="zipf", contenders=["torch", "ring"], base="torch",
           rounds_ms={"torch": [4.0, 4.4], "ring": [3.9, 4.5]}, median_ms={"torch": 4.2, "ring": 4.2},
           rate_vs_base={"ring": dict(median=1.0145, low=0.978, high=1.026, faster_rounds=1, rounds=2)})
  doc = dict(benchmark="moe", env={}, dims={},
             runs=[dict(tokens=8192, routing="zipf", contender="torch", seconds=4e-3)],
             head_to_head=[h, dict(tokens=32768, routing="zipf", contenders=["torch", "ring"], error="not measured")])
  (tmp_path / "moe.json").write_text(json.dumps(doc))
  pairs = rt.load(tmp_path / "moe.json", expect="bench_moe").head_to_head.set_index("contender")
  assert list(pairs.index) == ["torch", "ring"] and (pairs.tokens == 8192).all()  # the failed cell has no rows
  assert pairs.loc["ring"].rate_median == 1.0145 and pairs.loc["ring"].rate_faster_rounds == 1
  assert pd.isna(pairs.loc["torch"].rate_median) and pairs.loc["torch"].median_ms == 4.2


def test_refuses_what_it_cannot_read(tmp_path):
  doc = raw(WAVE2)
  doc["schema"] = "ds4jax.prefill_qualification/3"
  (tmp_path / "future.json").write_text(json.dumps(doc))
  with pytest.raises(ValueError, match=r"future\.json: schema 'ds4jax.prefill_qualification/3' is not one this "
                     r"loader reads \(expected one of ds4jax.prefill_qualification/1, "
                     r"ds4jax.prefill_qualification/2\)"):
    rt.load(tmp_path / "future.json")
  (tmp_path / "other.json").write_text(json.dumps({"tokens": 3, "loss": 1.5}))
  with pytest.raises(ValueError, match=r"other\.json: not a results file this loader recognises \(top-level keys "
                     r"\['loss', 'tokens'\]\); expected a 'schema' of"):
    rt.load(tmp_path / "other.json")
  (tmp_path / "bench.json").write_text(json.dumps({"benchmark": "rope", "runs": []}))
  with pytest.raises(ValueError, match=r"bench\.json: benchmark 'rope' is not one this loader reads"):
    rt.load(tmp_path / "bench.json")
  (tmp_path / "moe.json").write_text(json.dumps({"benchmark": "moe", "runs": []}))
  with pytest.raises(ValueError, match=r"moe\.json: a bench_moe results file that this loader cannot read"):
    rt.load(tmp_path / "moe.json")
  (tmp_path / "list.json").write_text("[1, 2]")
  with pytest.raises(ValueError, match=r"list\.json: a results file is a JSON object; this one is a list"):
    rt.load(tmp_path / "list.json")
  (tmp_path / "broken.json").write_text("{")
  with pytest.raises(ValueError, match=r"broken\.json: not JSON"):
    rt.load(tmp_path / "broken.json")
  with pytest.raises(ValueError, match=r"lowering_gfx1151\.json is a lowering_gfx1151 results file, not bench_moe"):
    rt.load(rt.RESULTS_DIR / "lowering_gfx1151.json", expect="bench_moe")
  mixed = tmp_path / "mixed"
  mixed.mkdir()
  shutil.copy(rt.RESULTS_DIR / "init_stats_v4flash_h200.json", mixed)
  shutil.copy(tmp_path / "other.json", mixed)
  with pytest.raises(ValueError, match=r"other\.json: not a results file"):  # one unknown file: the folder is refused
    rt.load_dir(mixed)


def test_switch_effects_and_what_the_matrix_misses(tables):
  q, doc = tables[WAVE2], raw(WAVE2)
  effects = rt.switch_effects(q.records).set_index("config")
  base = record(doc, 8192, "all_on")["timing"]["tokens_per_s"]
  compact = record(doc, 8192, "kill_moe_compact_queue")["timing"]["tokens_per_s"]
  assert effects.loc["kill_moe_compact_queue"].change_pct == pytest.approx(100 * (compact / base - 1))
  assert effects.loc["kill_moe_compact_queue"].change_pct == pytest.approx(-17.83, abs=0.01)
  assert set(effects.index[effects.same_programs]) == {"kill_long_context_chunk", "kill_prefill_band_tokens"}
  assert effects.noise_pct.iloc[0] == pytest.approx(0.1321, abs=1e-4)
  assert set(effects.index[effects.beyond_noise]) == {"kill_moe_compact_queue", "kill_indexer_score_kernel",
                                                      "kill_mla_stream_f32_stage", "kill_direct_indexer_topk"}
  assert math.isnan(effects.loc["kill_mla_stream_topk"].change_pct)
  no_kills = rt.switch_effects(q.records[q.records.config.isin(["all_on", "all_off"])])  # a matrix without kills
  assert no_kills.empty and {"noise_pct", "beyond_noise"} <= set(no_kills.columns)
  assert rt.flagfile_lengths("qual.cfg") == (8192, 32768, 122879)
  gaps = set(map(tuple, rt.matrix_gaps(q.records, rt.flagfile_lengths("qual.cfg")).itertuples(index=False)))
  assert (8192, "kill_bf16_matmul") in gaps and (32768, "all_on") in gaps and (122879, "all_off") in gaps
  assert not {g for g in gaps if g[0] == 8192} - {(8192, "kill_bf16_matmul")}
  # wave 2d: all_on at 8192 has the fused MoE (one band), at 32768 and 122879 not; each length's matrix is its own
  d = rt.load("experiments/results/qual_v4flash_h200_wave2d.json").records
  gaps = set(map(tuple, rt.matrix_gaps(d, rt.flagfile_lengths("qual.cfg")).itertuples(index=False)))
  assert (8192, "kill_moe_wgmma_gate_up") in gaps and (8192, "kill_moe_sparse_gate_up") not in gaps
  assert not {g for g in gaps if g[1].startswith("kill_moe_wgmma") and g[0] != 8192}
  assert (32768, "kill_mla_wgmma") in gaps and (122879, "kill_moe_decode_kernel") in gaps


def test_roofline_and_prefill_breakdown(tables):
  moe, att, q = (tables[n] for n in ("moe_bench_h200_2026-11-30.json", "attention_h200_2026-11-30.json", WAVE2))
  points = rt.moe_roofline(moe).set_index(["contender", "size"])
  ours = points.loc[("ours_bf16_gate_up", 8192)]
  assert ours.flops == pytest.approx(2 * 8192 * 6 * 4096 * 2 * 2048)
  assert ours.bytes == 2 * (256 * 2 * 2048 * 4096 + 8192 * 4096 + 8192 * 6 * 2048)
  assert ours.intensity == ours.flops / ours.bytes
  mla = rt.attention_roofline(att).set_index(["contender", "size"]).loc[("stream_f32_stage_fast_exp", 8192)]
  assert mla.flops == 4 * 8192 * 64 * 512 * (128 + 512) and mla.tflops == pytest.approx(43.98, abs=0.01)
  assert rt.H200.ridge == pytest.approx(989.0 / 4.8)
  split = rt.prefill_breakdown(q.records, moe, att)
  assert split.ms.sum() == pytest.approx(1e3 * record(raw(WAVE2), 8192, "all_on")["timing"]["median_s"])
  n_csa = sum(a.value == "compressed_sparse_attention" for a in config.v4_flash().attention)
  assert n_csa == 21 and split.ms.iloc[4] == pytest.approx(21 * 15.62341, abs=1e-4)
  assert split.ms.iloc[:3].sum() == pytest.approx(43 * moe.runs.set_index(["contender", "tokens", "routing"]).loc[
      (rt.MIX_MOE, 8192, "uniform")].ms)
  with pytest.raises(ValueError, match="no timed all_on record at 32768 tokens"):
    rt.prefill_breakdown(q.records, moe, att, length=32768)
