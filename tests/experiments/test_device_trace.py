"""Kernel time from a profiler trace (experiments/device_trace.py), on a trace written the way JAX writes one."""

import gzip
import os
import subprocess
import sys
import json

import pytest

from ds4jax import config
from experiments import device_trace


def meta(kind, pid, name, tid=None):
  e = dict(ph="M", name=kind, pid=pid, args=dict(name=name))
  return e | (dict(tid=tid) if tid is not None else {})


def kernel(name, dur_us, pid=2, tid=7):
  return dict(ph="X", name=name, pid=pid, tid=tid, ts=0, dur=dur_us)


EVENTS = [
    meta("process_name", 1, "/host:CPU"), meta("thread_name", 1, "python", 1),
    meta("process_name", 2, "/device:GPU:0"), meta("thread_name", 2, "Stream #13(Compute)", 7),
    meta("thread_name", 2, "XLA Ops", 8),
    kernel("loop_convert_fusion.12", 4000), kernel("loop_convert_fusion.7", 2500), kernel("moe_gate_up", 1500),
    kernel("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n", 500),
    kernel("dot.3", 9000, tid=8),              # an XLA op span over kernels: not a kernel, not counted again
    kernel("PjitFunction(_layer_step)", 90000, pid=1, tid=1),  # host work
]


def test_kernels_are_summed_by_name_on_the_device_streams_only():
  k = device_trace.kernel_times(EVENTS)
  assert list(k) == ["loop_convert_fusion", "moe_gate_up", "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n"]
  assert k["loop_convert_fusion"] == dict(ms=6.5, count=2) and k["moe_gate_up"] == dict(ms=1.5, count=1)
  s = device_trace.summary(k, top=2)
  assert s["device_ms"] == 8.5
  assert [r["kernel"] for r in s["kernels"]] == ["loop_convert_fusion", "moe_gate_up", "other"]
  assert s["kernels"][0]["share"] == pytest.approx(6.5 / 8.5, abs=1e-4) and s["kernels"][2]["ms"] == 0.5


def test_without_stream_threads_every_device_thread_counts():
  events = [meta("process_name", 2, "/device:GPU:0"), meta("thread_name", 2, "Compute", 3), kernel("k", 1000, tid=3)]
  assert device_trace.kernel_times(events) == {"k": dict(ms=1.0, count=1)}


def test_read_trace_finds_the_one_trace_file(tmp_path):
  run = tmp_path / "plugins" / "profile" / "2026_12_01"
  run.mkdir(parents=True)
  with gzip.open(run / "vm.trace.json.gz", "wt") as f:
    json.dump(dict(traceEvents=EVENTS), f)
  (run / "perfetto_trace.json.gz").write_bytes(b"")  # the Perfetto copy: not read
  assert device_trace.read_trace(str(tmp_path)) == EVENTS
  with pytest.raises(RuntimeError, match="expected one"):
    device_trace.read_trace(str(tmp_path / "plugins" / "nothing"))


def test_trace_prefill_times_each_feature_set_and_records_it(tmp_path):
  """The entry point on a CPU: one run per feature set (the flags', then each --without), written to --out; on a
  mesh of one device (the sharded MoE's code path); the preset's first layer only (--layers)."""
  out = tmp_path / "trace.json"
  subprocess.run([sys.executable, "-m", "experiments.trace_prefill", "--preset=tiny_window", "--quant_policy=bf16",
                  "--tokens=16", "--repeats=1", "--prefill_band_tokens=8", "--prefill_weights_stationary",
                  "--without=prefill_weights_stationary", "--mesh=expert=1", "--layers=1", f"--out={out}"], check=True,
                 capture_output=True,
                 env={**os.environ, "JAX_PLATFORMS": "cpu"})
  record = json.loads(out.read_text())
  assert record["variants"] == {"flags": ["prefill_weights_stationary"], "without_prefill_weights_stationary": []}
  assert record["mesh"] == "expert=1" and record["layers"] == 1 < config.tiny_window().num_layers
  runs = {r["variant"]: r for r in record["runs"]}
  assert set(runs) == {"flags", "without_prefill_weights_stationary"}
  for r in runs.values():
    assert r["tokens"] == 16 and r["tok_s"] > 0 and "error" not in r and "device_ms" in r  # traced (CPU: no kernels)
    assert r["switches_on"] == record["variants"][r["variant"]]
