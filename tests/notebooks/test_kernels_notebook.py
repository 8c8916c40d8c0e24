"""notebooks/kernels.ipynb, headless on the committed results, with its live kernel run small."""

import json
import re

from experiments import results_tables as rt


def test_on_the_committed_results(run_notebook):
  out = run_notebook("kernels", live_tokens=32)
  assert out.images == 6
  runs = json.loads((rt.RESULTS_DIR / "moe_bench_h200_2026-11-30.json").read_text())["runs"]
  at = {(r["contender"], r["tokens"], r["routing"]): r for r in runs}
  ours, torch = at[("ours_bf16_gate_up", 8192, "uniform")], at[("torch_grouped_mm_gate_up", 8192, "uniform")]
  assert (f"8192 tokens {ours['tflops']:.0f} TF/s ({ours['fraction_of_dense_gemm']:.0%} of the dense GEMM, "
          f"{ours['tflops'] / torch['tflops']:.0%} of torch._grouped_mm)") in out.markdown
  assert "8192 tokens 397 TF/s (52% of the dense GEMM, 72% of torch._grouped_mm)" in out.markdown
  assert "1.255× the grouped baseline at 8192" in out.markdown
  # The committed profile of one prefill is drawn beside the split of the measured prefill by the benchmarks.
  trace = json.loads((rt.RESULTS_DIR / "trace_prefill_h200_8192.json").read_text())
  top = next(r for r in trace["runs"] if r["variant"] == "flags")["kernels"][0]
  assert f"The profile's largest kernels: {top['kernel']} {top['ms']:.0f} ms ({top['share']:.0%})" in out.markdown
  assert "No profile of a prefill is committed" not in out.markdown
  wave2b = json.loads((rt.RESULTS_DIR / "qual_v4flash_h200_wave2b.json").read_text())
  on = next(r for r in wave2b["records"] if r["config"] == "all_on" and r["length"] == 8192)
  assert f"Of all_on's {1e3 * on['timing']['median_s']:.0f} ms at 8192 tokens" in out.markdown
  assert "Of all_on's 1263 ms at 8192 tokens" in out.markdown
  assert "0 VGPR" in out.markdown and "with 255" in out.markdown
  live = re.search(r"32 tokens, 8 experts, top-2, D 64, I 32, f32: NMSE (\S+) against", out.markdown)
  assert float(live.group(1)) < 1e-10 and "`moe_gate_up`" in out.markdown
