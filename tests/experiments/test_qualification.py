"""The qualification command (experiments/prefill.py + experiments/qualification.py), run in-process.

Most tests swap ds4jax.prefill.prefill_logits for a cheap deterministic stand-in (so the matrix, records, append
and failure handling are tested without compiling the model per configuration); one test runs the real prefill
on a small preset end to end. Options are built directly or from a fresh absl FlagValues, never from FLAGS.
"""

import json
import math
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags

from ds4jax import config, features, model
from ds4jax import prefill as prefill_lib
from ds4jax.features import FeatureError
from experiments import qualification as q

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ON = {"moe_compact_queue": True, "moe_persistent": True, "moe_fused_combine": True}
HEX64 = set("0123456789abcdef")


@pytest.fixture(scope="module")
def tiny_model():
  return model.init_random(config.tiny_window(), seed=0, dtype=jnp.float32)


class FakePrefill:
  """Deterministic final logits from the prompt ids; the switches perturb them by known amounts:
  moe_compact_queue a little (passes the KL gate), moe_fused_combine a lot (fails it). Counts its calls."""

  def __init__(self, fail=None, noise_gain=1e-3, noisy_fail=None):
    self.calls = []
    self.fail = fail  # (features, n_tokens) -> exception to raise, or None
    self.noise_gain = noise_gain  # how far the logits move under one f32 rounding of the input (the noise floor)
    self.noisy_fail = noisy_fail  # exception for the perturbed (noise floor) run, or None
    self.noisy_calls = []

  def __call__(self, m, tokens, feats, progress=None, positions=None, input_noise=0.0):
    tokens = np.asarray(tokens)
    if input_noise:
      self.noisy_calls.append((feats, len(tokens), input_noise))
      if self.noisy_fail:
        raise self.noisy_fail
      v = np.arange(256, dtype=np.float64)
      gain = self.noise_gain * input_noise / 2.0 ** -24
      return jnp.asarray(np.asarray(self.logits(tokens, feats), np.float64) + gain * np.cos(7 * v), jnp.float32)
    self.calls.append((feats, len(tokens)))
    if progress:
      progress(f"fake prefill of {len(tokens)} tokens")
    if self.fail and (e := self.fail(feats, len(tokens))) is not None:
      raise e
    if positions is not None:  # causal: position p sees the (p + 1)-token prefix
      return jnp.stack([self.logits(tokens[:p + 1], feats) for p in positions])
    return self.logits(tokens, feats)

  @staticmethod
  def logits(tokens, feats):
    v = np.arange(256, dtype=np.float64)
    logits = 3 * np.sin(0.37 * v + 0.01 * float(tokens.sum()) + len(tokens))
    if feats.moe_compact_queue:
      logits = logits + 1e-3 * np.cos(v)
    if feats.moe_fused_combine:
      logits = logits + 2.0 * np.cos(3 * v)
    return jnp.asarray(logits, jnp.float32)


def options(tmp_path, **kw) -> q.Options:
  base = dict(preset="tiny_window", lengths=(32,), warmups=1, min_warmups=0, repeats=2, out=str(tmp_path / "r.json"),
              features=ON, device_class="cpu_interpret", parity_prefix_tokens=16)
  return q.Options(**(base | kw))


def run(opts, m, fake, monkeypatch, log=None):
  monkeypatch.setattr(prefill_lib, "prefill_logits", fake)
  lines = []
  doc = q.run(opts, model=m, log=lines.append if log is None else log)
  return doc, lines


def by_key(doc):
  return {(r["length"], r["config"]): r for r in doc["records"]}


# ---- metrics ----
def test_parity_metrics_on_hand_made_inputs():
  m = q.parity_metrics([0.0, 1.0, 5.0], [0.0, 1.0, 4.0], kl_gate=1.0)
  assert m["max_abs"] == 1.0 and m["top1_agree"] and m["top1"] == 2 and m["pass"]
  assert m["nmse"] == pytest.approx(1 / 17)
  m = q.parity_metrics([9.0, 1.0, 0.0], [0.0, 1.0, 4.0], kl_gate=0.006)
  assert not m["top1_agree"] and m["kl"] > 1 and not m["pass"]
  m = q.parity_metrics([np.nan, 1.0, 0.0], [0.0, 1.0, 4.0])
  assert not m["finite"] and not m["pass"]


# ---- the matrix ----
def test_matrix_kills_dependents_and_knobs():
  base = features.resolve("cpu_interpret", ON | {"long_context_chunk": 0})
  confs = {c.name: c for c in q.matrix(base)}
  assert list(confs) == ["all_on", "kill_moe_compact_queue", "kill_moe_persistent", "kill_moe_fused_combine",
                         "kill_prefill_band_tokens", "all_off"]  # chunk already 0: nothing to kill
  k = confs["kill_moe_compact_queue"]
  assert k.killed == ("moe_compact_queue",) and k.also_off == ("moe_persistent",)
  assert k.features.on() == ["moe_fused_combine"]
  assert confs["kill_moe_persistent"].also_off == () and confs["kill_moe_persistent"].features.moe_compact_queue
  assert confs["kill_prefill_band_tokens"].features.prefill_band_tokens == 0
  assert confs["all_on"].features == base
  assert confs["all_off"].features == features.Features(device_class="cpu_interpret")
  assert q.exact_features("cpu_interpret") == confs["all_off"].features
  assert q._dependents("mla_stream_topk") == ["direct_indexer_topk", "mla_stream_f32_stage", "mla_stream_fast_exp"]


# ---- full runs (stand-in prefill) ----
def test_full_matrix_writes_every_configuration(tmp_path, tiny_model, monkeypatch):
  fake = FakePrefill()
  opts = options(tmp_path, lengths=(24, 32))
  doc, lines = run(opts, tiny_model, fake, monkeypatch)
  names = [c.name for c in q.matrix(features.resolve("cpu_interpret", ON))]
  on_disk = q.load_results(opts.out)
  assert on_disk == json.loads(json.dumps(doc))
  recs = by_key(on_disk)
  assert sorted(recs) == sorted((n, c) for n in (24, 32) for c in names)
  for (n, name), r in recs.items():
    t = r["timing"]
    assert r["status"] == "ok" and r["error"] is None
    assert len(t["warmup_s"]) == 1 and len(t["run_s"]) == 2 and t["deterministic"]
    assert all(math.isfinite(x) and x > 0 for x in [t["cold_s"], t["median_s"], t["tokens_per_s"], *t["run_s"]])
    assert t["tokens_per_s"] == pytest.approx(n / t["median_s"])
    assert r["features"] == next(c for c in q.matrix(features.resolve("cpu_interpret", ON))
                                 if c.name == name).features.to_dict()
    for h in (r["logits_sha256"], r["weights_fingerprint"], r["prompt"]["sha256"]):
      assert len(h) == 64 and set(h) <= HEX64
    assert r["env"]["jax"] and r["env"]["git_commit"] and r["model"]["name"] == "tiny_window"
    assert r["parity"]["prefix_tokens"] is None
  for n in (24, 32):
    off = recs[(n, "all_off")]["parity"]
    assert off["nmse"] == 0.0 and off["kl"] == 0.0 and off["max_abs"] == 0.0 and off["pass"]
    assert recs[(n, "kill_moe_fused_combine")]["parity"]["pass"]  # the big perturbation is off there
    assert not recs[(n, "all_on")]["parity"]["pass"]              # ... and on here: KL above the gate
    assert 0 < recs[(n, "kill_moe_fused_combine")]["parity"]["nmse"] < 1e-6
    assert recs[(n, "kill_moe_compact_queue")]["also_off"] == ["moe_persistent"]
  assert len({r["weights_fingerprint"] for r in doc["records"]}) == 1
  assert recs[(24, "all_on")]["prompt"]["sha256"] != recs[(32, "all_on")]["prompt"]["sha256"]
  # The exact path at full length is all_off's own cold run: no extra exact call.
  assert sum(1 for f, n in fake.calls if f == q.exact_features("cpu_interpret")) == 2 * (1 + 1 + 2)
  md = open(q.markdown_path(opts.out)).read()
  assert md.count("| 24 |") == len(names) and md.count("| 32 |") == len(names)
  assert "FAIL" in md and "also off: moe_persistent" in md
  assert any("plan: lengths [24, 32] x 7 configurations" in s for s in lines)
  rows = q.summary_rows(doc)
  assert [r["speedup_vs_all_off"] for r in rows if r["config"] == "all_off"] == [1.0, 1.0]


def test_bounded_runs_append_each_pair_exactly_once(tmp_path, tiny_model, monkeypatch):
  fake = FakePrefill()
  first, _ = run(options(tmp_path, configs=("all_on", "all_off")), tiny_model, fake, monkeypatch)
  assert sorted(by_key(first)) == [(32, "all_off"), (32, "all_on")]
  kept = by_key(first)[(32, "all_on")]["finished"], by_key(first)[(32, "all_on")]["timing"]
  second, _ = run(options(tmp_path, configs=("all_on", "kill_moe_persistent", "all_off"), append=True),
                  tiny_model, fake, monkeypatch)
  assert sorted(by_key(second)) == [(32, "all_off"), (32, "all_on"), (32, "kill_moe_persistent")]
  assert second["invocations"][-1]["plan"] == [[32, "kill_moe_persistent"]]
  assert (by_key(second)[(32, "all_on")]["finished"], by_key(second)[(32, "all_on")]["timing"]) == kept
  third, _ = run(options(tmp_path, append=True), tiny_model, fake, monkeypatch)
  keys = [(r["length"], r["config"]) for r in third["records"]]
  assert len(keys) == len(set(keys)) == 7
  fake.calls.clear()
  fourth, lines = run(options(tmp_path, append=True), tiny_model, fake, monkeypatch)
  assert fake.calls == [] and len(fourth["records"]) == 7 and fourth["invocations"][-1]["plan"] == []
  assert any("7 already done" in s for s in lines)
  assert len(q.load_results(options(tmp_path).out)["invocations"]) == 4


def test_append_refuses_a_different_matrix(tmp_path, tiny_model, monkeypatch):
  run(options(tmp_path, configs=("all_off",)), tiny_model, FakePrefill(), monkeypatch)
  with pytest.raises(q.StartupError, match="different prompt ids"):
    run(options(tmp_path, configs=("all_off",), seed=1, append=True), tiny_model, FakePrefill(), monkeypatch)
  run(options(tmp_path, configs=("all_on",), append=True), tiny_model, FakePrefill(), monkeypatch)  # same matrix
  with pytest.raises(q.StartupError, match="different features"):
    run(options(tmp_path, configs=("all_on",), features={"moe_compact_queue": True}, append=True), tiny_model,
        FakePrefill(), monkeypatch)


def test_failing_configuration_is_recorded_then_retried(tmp_path, tiny_model, monkeypatch):
  def oom_without_fused_combine(f, n):  # only kill_moe_fused_combine has persistent on and fused combine off
    if f.moe_persistent and not f.moe_fused_combine:
      return RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123 bytes")
    return None

  doc, lines = run(options(tmp_path), tiny_model, FakePrefill(oom_without_fused_combine), monkeypatch)
  recs = by_key(doc)
  bad = recs[(32, "kill_moe_fused_combine")]
  assert bad["status"] == "failed" and bad["error_kind"] == "oom" and "RESOURCE_EXHAUSTED" in bad["error"]
  assert bad["timing"] is None and bad["parity"] is None
  assert all(r["status"] == "ok" for k, r in recs.items() if k[1] != "kill_moe_fused_combine") and len(recs) == 7
  assert "| out of memory (wanted 123 bytes) |" in open(q.markdown_path(options(tmp_path).out)).read()
  fake = FakePrefill()
  again, _ = run(options(tmp_path, append=True), tiny_model, fake, monkeypatch)
  assert again["invocations"][-1]["plan"] == [[32, "kill_moe_fused_combine"]]
  keys = [(r["length"], r["config"]) for r in again["records"]]
  assert len(keys) == len(set(keys)) == 7 and by_key(again)[(32, "kill_moe_fused_combine")]["status"] == "ok"


def test_prefix_parity_beyond_exact_max_tokens(tmp_path, tiny_model, monkeypatch):
  fake = FakePrefill()
  doc, lines = run(options(tmp_path, exact_max_tokens=20, parity_prefix_tokens=16, configs=("all_on", "all_off",
                                                                                             "kill_moe_fused_combine")),
                   tiny_model, fake, monkeypatch)
  for r in doc["records"]:
    p = r["parity"]
    assert r["status"] == "ok" and p["prefix_tokens"] == 16 and "exact_max_tokens=20" in p["prefix_reason"]
  assert by_key(doc)[(32, "all_off")]["parity"]["nmse"] == 0.0
  assert by_key(doc)[(32, "kill_moe_fused_combine")]["parity"]["pass"]
  assert not by_key(doc)[(32, "all_on")]["parity"]["pass"]
  exact = q.exact_features("cpu_interpret")
  # The exact prefix runs once; each configuration's prefix logits come from its own full-length cold run.
  assert [n for f, n in fake.calls if n == 16] == [16] and [f for f, n in fake.calls if n == 16] == [exact]
  assert all("full-length cold run" in r["parity"]["prefix_logits_from"] for r in doc["records"])
  assert any("EXACT PATH AT 32 TOKENS" in s for s in lines)
  assert "(prefix 16)" in open(q.markdown_path(options(tmp_path).out)).read()
  # A later bounded call (another length, the same prompt and weights) reuses the stored exact prefix logits.
  fake.calls.clear()
  more, lines = run(options(tmp_path, lengths=(24, 32), exact_max_tokens=20, parity_prefix_tokens=16, append=True,
                            configs=("all_on", "all_off", "kill_moe_fused_combine")), tiny_model, fake, monkeypatch)
  assert [n for f, n in fake.calls if n == 16] == [] and sorted({n for _, n in fake.calls}) == [24]
  assert any("loaded from" in s for s in lines) and more["invocations"][-1]["exact_prefix_runs"][0]["tokens"] == 16
  assert by_key(more)[(24, "kill_moe_fused_combine")]["parity"]["pass"]
  assert by_key(more)[(24, "all_off")]["parity"]["nmse"] == 0.0
  # Other weights or prompt ids never reuse them.
  # pylint: disable-next=protected-access
  stale = q._ExactPrefixes(tiny_model, np.arange(40, dtype=np.int32), exact, "other-fingerprint",
                           q.exact_cache_path(options(tmp_path).out), q._Clock(1, lambda s: None))
  assert stale.stored() == {}


def test_prefix_parity_when_the_exact_path_runs_out_of_memory(tmp_path, tiny_model, monkeypatch):
  exact = q.exact_features("cpu_interpret")
  fake = FakePrefill(lambda f, n: RuntimeError("RESOURCE_EXHAUSTED: oom") if f == exact and n > 16 else None)
  doc, lines = run(options(tmp_path, configs=("all_on", "all_off")), tiny_model, fake, monkeypatch)
  recs = by_key(doc)
  assert recs[(32, "all_off")]["status"] == "failed" and recs[(32, "all_off")]["error_kind"] == "oom"
  on = recs[(32, "all_on")]
  assert on["status"] == "ok" and on["parity"]["prefix_tokens"] == 16
  assert "out of memory" in on["parity"]["prefix_reason"]
  assert any("EXACT PATH AT 32 TOKENS: out of memory" in s for s in lines)
  # all_off is the exact path: its prefix parity is the stored exact prefix itself, with no run of its own.
  off = recs[(32, "all_off")]["parity"]
  assert off["nmse"] == 0.0 and off["kl"] == 0.0 and off["prefix_tokens"] == 16 and "exact path" in off[
      "prefix_logits_from"]
  assert [n for f, n in fake.calls if f == exact] == [32, 16]  # the failed full length, then the exact prefix once


def test_out_of_memory_at_full_length_still_checks_the_prefix(tmp_path, tiny_model, monkeypatch):
  """A configuration that runs out of memory at full length is timed nowhere but checked on the parity prefix;
  another failure (not memory) is not, and a prefix that fails too says so in the error."""
  def fail(f, n):
    switches = (f.moe_compact_queue, f.moe_persistent, f.moe_fused_combine)
    if switches == (True, False, True) and n > 16:  # kill_moe_persistent: fits only on the prefix
      return RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 5.00GiB")
    if switches == (True, True, False):  # kill_moe_fused_combine: out of memory at every length
      return RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.00GiB")
    if switches == (False, False, True) and n > 16:  # kill_moe_compact_queue: not a memory error
      return ValueError("unsupported shape")
    return None

  fake = FakePrefill(fail)
  doc, lines = run(options(tmp_path), tiny_model, fake, monkeypatch)
  recs = by_key(doc)
  fits = recs[(32, "kill_moe_persistent")]
  assert fits["status"] == "failed" and fits["error_kind"] == "oom" and fits["timing"] is None
  p = fits["parity"]
  assert p["prefix_tokens"] == 16 and "ran out of memory" in p["prefix_reason"]
  assert "separate 16-token run" in p["prefix_logits_from"]
  ids = q.prompt_ids(options(tmp_path), config.tiny_window())[0][:16]
  conf = {c.name: c for c in q.matrix(features.resolve("cpu_interpret", ON))}["kill_moe_persistent"]
  want = q.parity_metrics(FakePrefill.logits(ids, conf.features),
                          FakePrefill.logits(ids, q.exact_features("cpu_interpret")), 0.006)
  assert want["kl"] > 0.01 and p["kl"] == pytest.approx(want["kl"], rel=1e-6)
  never = recs[(32, "kill_moe_fused_combine")]
  assert never["parity"] is None
  assert "; parity on the 16-token prefix: RuntimeError: RESOURCE_EXHAUSTED" in never["error"]
  other = recs[(32, "kill_moe_compact_queue")]
  assert other["error_kind"] == "ValueError" and other["parity"] is None
  assert not [n for f, n in fake.calls if n == 16 and not f.moe_compact_queue and f.moe_fused_combine]
  table = open(q.markdown_path(options(tmp_path).out)).read()
  row = next(line for line in table.splitlines() if "| kill_moe_persistent |" in line)
  assert "| out of memory (wanted 5.00GiB); parity " in row and row.endswith("(prefix 16) |")
  assert f"| {want['kl']:.2e} |" in row
  assert "| out of memory (wanted 9.00GiB) |" in table
  assert any("FAILED" in s and "; parity: NMSE" in s for s in lines)
  # A failed record with parity outranks one without in a merge; both are retried by --append.
  assert q._rank(fits) == 1 and q._rank(never) == 0 and q._rank(recs[(32, "all_on")]) == 3
  again, _ = run(options(tmp_path, append=True), tiny_model, FakePrefill(), monkeypatch)
  assert sorted(map(tuple, again["invocations"][-1]["plan"])) == [
      (32, "kill_moe_compact_queue"), (32, "kill_moe_fused_combine"), (32, "kill_moe_persistent")]


def test_table_names_out_of_memory_inside_autotuner_errors():
  autotuner = ("JaxRuntimeError: NOT_FOUND: All configs failed during profiling or were excluded from selection.\n"
               "Failures (17):\nEXECUTION FAILED: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
               "32.27GiB with allocator GPU_0_bfc on device 0.")
  assert q.is_oom(RuntimeError(autotuner))
  assert q._error_summary(autotuner, "oom") == "out of memory (wanted 32.27GiB)"
  assert q._error_summary("RESOURCE_EXHAUSTED: no size here", "parity_oom") == "parity: out of memory"
  assert q._error_summary("ValueError: bad shape\nmore", "ValueError") == "error: ValueError: bad shape"


class VirtualTime:
  """Stands in for the qualification's `time` module: a clock that only the fake prefill moves, by 10 s per 16
  tokens for configurations without the compact queue (kill_moe_compact_queue and all_off), 0.01 s otherwise."""

  def __init__(self):
    self.now = 0.0

  def perf_counter(self):
    return self.now

  def cost(self, f, n):
    self.now += 10.0 * n / 16 if not f.moe_compact_queue else 0.01


def slow_setup(monkeypatch):
  clock, compiled = VirtualTime(), []
  monkeypatch.setattr(q, "time", clock)
  monkeypatch.setattr(q, "use_persistent_cache", lambda: "unused")
  monkeypatch.setattr(prefill_lib, "precompile", lambda m, runs, workers, log: compiled.append(runs) or len(runs))
  return clock, FakePrefill(clock.cost), compiled


def test_too_slow_configuration_keeps_its_cold_run_and_parity(tmp_path, tiny_model, monkeypatch):
  clock, fake, _ = slow_setup(monkeypatch)
  doc, lines = run(options(tmp_path, max_cold_s=15), tiny_model, fake, monkeypatch)
  recs = by_key(doc)
  assert {k[1] for k, r in recs.items() if r["status"] == "too_slow"} == {"kill_moe_compact_queue", "all_off"}
  assert all(r["status"] == "ok" and len(r["timing"]["run_s"]) == 2 for k, r in recs.items()
             if r["status"] != "too_slow") and len(recs) == 7
  for name in ("kill_moe_compact_queue", "all_off"):
    t = recs[(32, name)]["timing"]
    assert t["too_slow"] and t["cold_s"] == 20 and t["run_s"] == t["warmup_s"] == [] and t["tokens_per_s"] is None
    assert t["cold_tokens_per_s"] == 32 / 20
  assert sum(not f.moe_compact_queue for f, _ in fake.calls) == 2  # one cold run each, no warm-ups or timed runs
  assert recs[(32, "all_off")]["parity"]["kl"] == 0  # the exact path's own logits
  rows = {r["config"]: r for r in q.summary_rows(doc)}  # fused combine (still on) fails the gate: parity is checked
  assert rows["kill_moe_compact_queue"]["verdict"] == "FAIL" and rows["all_off"]["verdict"] == "pass"
  assert rows["all_on"]["speedup_vs_all_off"] is None
  assert "| FAIL; too slow to time (cold run only: 1.6 tok/s) |" in open(q.markdown_path(options(tmp_path).out)).read()
  assert any("too slow to time (cold 20.0s" in s for s in lines)
  fake.calls.clear()  # the same limit would stop them again: kept
  again, _ = run(options(tmp_path, max_cold_s=15, append=True), tiny_model, fake, monkeypatch)
  assert fake.calls == [] and again["invocations"][-1]["plan"] == []
  third, _ = run(options(tmp_path, max_cold_s=0, append=True), tiny_model, fake, monkeypatch)  # no limit: retried
  assert third["invocations"][-1]["plan"] == [[32, "all_off"], [32, "kill_moe_compact_queue"]]
  assert all(r["status"] == "ok" for r in third["records"]) and len(third["records"]) == 7


def test_too_slow_at_a_short_length_is_not_run_at_a_longer_one(tmp_path, tiny_model, monkeypatch):
  clock, fake, compiled = slow_setup(monkeypatch)
  opts = dict(lengths=(16, 32), configs=("all_on", "kill_moe_compact_queue", "all_off"), parity_prefix_tokens=8,
              precompile_workers=1)
  doc, _ = run(options(tmp_path, max_cold_s=5, **opts), tiny_model, fake, monkeypatch)
  recs = by_key(doc)
  assert recs[(16, "kill_moe_compact_queue")]["status"] == "too_slow"
  skipped = recs[(32, "kill_moe_compact_queue")]
  assert skipped["status"] == "not_run" and skipped["timing"] is None and skipped["parity"] is None
  assert skipped["predicted_cold_s"] == 20 and "would take >= 20s (too slow at 16 tokens" in skipped["error"]
  killed = [n for f, n in fake.calls if not f.moe_compact_queue and f.moe_fused_combine]  # not the exact path
  assert killed == [16]  # never run at 32
  # all_off is the exact path at full length, every configuration's reference: it runs (cold only) even so
  assert recs[(32, "all_off")]["status"] == "too_slow" and recs[(32, "all_off")]["timing"]["cold_s"] == 20
  assert [n for f, n in fake.calls if not f.moe_compact_queue and not f.moe_fused_combine] == [16, 32]
  assert recs[(16, "all_on")]["status"] == recs[(32, "all_on")]["status"] == "ok"
  assert "| not run: its cold run would take >= 20s" in open(q.markdown_path(options(tmp_path).out)).read()
  fake.calls.clear()
  compiled.clear()  # same limit: the not_run pair is predicted again from the file, neither run nor compiled
  again, _ = run(options(tmp_path, max_cold_s=5, append=True, **opts), tiny_model, fake, monkeypatch)
  assert again["invocations"][-1]["plan"] == [[32, "kill_moe_compact_queue"]] and fake.calls == [] == compiled
  assert by_key(again)[(32, "kill_moe_compact_queue")]["status"] == "not_run"
  third, _ = run(options(tmp_path, max_cold_s=15, append=True, **opts), tiny_model, fake, monkeypatch)
  assert third["invocations"][-1]["plan"] == [[16, "all_off"], [16, "kill_moe_compact_queue"],
                                              [32, "kill_moe_compact_queue"]]
  recs = by_key(third)  # 16 now times fine, so nothing predicts 32: it runs, and is too slow itself
  assert recs[(16, "kill_moe_compact_queue")]["status"] == "ok"
  assert recs[(32, "kill_moe_compact_queue")]["status"] == "too_slow"


def test_prediction_uses_only_this_matrix_and_precompiled_cold_runs():
  ids = np.arange(64)
  conf = q.Configuration(name="kill_x", features=features.resolve("cpu_interpret", ON))
  good = dict(config="kill_x", status="too_slow", length=16, features=conf.features.to_dict(), weights_fingerprint="w",
              prompt=dict(sha256=q.sha256_array(ids[:16])), timing=dict(cold_s=8.0, cold_loads_precompiled=True))
  assert q._predicted_cold_s([good], 64, conf, ids, "w") == (32.0, 16)
  assert q._predicted_cold_s([good], 16, conf, ids, "w") is None  # only shorter lengths
  for bad in (dict(features=dict(good["features"], moe_fused_combine=False)), dict(weights_fingerprint="v"),
              dict(prompt=dict(sha256=q.sha256_array(ids[1:17]))), dict(config="kill_y"), dict(status="ok"),
              dict(timing=dict(cold_s=8.0, cold_loads_precompiled=False))):
    assert q._predicted_cold_s([good | bad], 64, conf, ids, "w") is None, bad


def test_merge_results_of_side_by_side_calls(tmp_path, tiny_model, monkeypatch):
  a, b, main = (str(tmp_path / f"{x}.json") for x in ("gpu0", "gpu1", "main"))
  run(options(tmp_path, configs=("all_on", "all_off"), out=main), tiny_model, FakePrefill(), monkeypatch)
  for path in (a, b):  # each call starts from a copy of the main file, as on a two-GPU host
    shutil.copy(main, path)
  run(options(tmp_path, configs=("kill_moe_persistent",), out=a, append=True), tiny_model, FakePrefill(), monkeypatch)
  oom = FakePrefill(lambda f, n: RuntimeError("RESOURCE_EXHAUSTED: Out of memory") if f.moe_compact_queue else None)
  run(options(tmp_path, configs=("all_on", "kill_moe_fused_combine"), out=b), tiny_model, oom, monkeypatch)
  assert by_key(q.load_results(b))[(32, "all_on")]["status"] == "failed"
  kept = by_key(q.load_results(main))[(32, "all_on")]
  doc = q.merge_results(main, [a, b])
  recs = by_key(doc)
  assert sorted(recs) == [(32, "all_off"), (32, "all_on"), (32, "kill_moe_fused_combine"), (32, "kill_moe_persistent")]
  assert recs[(32, "all_on")] == kept  # a failed record never replaces an OK one
  assert recs[(32, "kill_moe_fused_combine")]["status"] == "failed"
  assert len(doc["invocations"]) == 3  # main's first call, a's and b's; the copied one once
  assert q.load_results(main) == doc and "| kill_moe_persistent |" in open(q.markdown_path(main)).read()
  bad = q.load_results(a)
  bad["records"][-1]["weights_fingerprint"] = "0" * 64
  with open(a, "w") as f:
    json.dump(bad, f)
  with pytest.raises(q.StartupError, match="differs from the records merged so far in weights fingerprint"):
    q.merge_results(main, [a])
  assert q.load_results(main) == doc  # nothing written


# ---- start-up errors ----
@pytest.mark.parametrize("kw, error, match", [
    (dict(configs=("all_on", "kill_everything")), q.StartupError, r"unknown configuration\(s\) \['kill_everything'\]"),
    (dict(features={"moe_persistent": True}), FeatureError, "--moe_persistent requires --moe_compact_queue"),
    (dict(features={"mla_stream_topk": True}, device_class="gfx1151"), FeatureError, "not supported on gfx1151"),
    (dict(warmups=1, min_warmups=2), q.StartupError, "--warmups must be >= 2"),
    (dict(lengths=(32, 32)), q.StartupError, "more than once"),
    (dict(max_cold_s=-1.0), q.StartupError, "--max_cold_s must be >= 0"),
    (dict(lengths=(129,)), q.StartupError, "max_position_embeddings=128"),
    (dict(preset=None), q.StartupError, "exactly one of --preset"),
    (dict(preset="tiny_huge"), q.StartupError, "unknown preset"),
    (dict(quant_policy="lucebox_mix"), q.StartupError, "not a multiple of 128"),
    (dict(exact_max_tokens=8, parity_prefix_tokens=16), q.StartupError, "exceeds --exact_max_tokens"),
    (dict(prompt_file="/nonexistent/prompt.txt"), q.StartupError, "does not exist"),
])
def test_startup_errors_come_before_any_work(tmp_path, tiny_model, monkeypatch, kw, error, match):
  fake = FakePrefill()
  with pytest.raises(error, match=match):
    run(options(tmp_path, **kw), tiny_model, fake, monkeypatch)
  assert fake.calls == [] and not os.path.exists(options(tmp_path).out)


# ---- inputs ----
def test_prompt_file_through_tokenizers(tmp_path, tiny_model, monkeypatch):
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import models, pre_tokenizers  # pylint: disable=import-outside-toplevel

  vocab = {f"w{i}": i for i in range(200)} | {"[UNK]": 200}
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "tokenizer.json"))
  words = [f"w{(7 * i) % 200}" for i in range(40)]
  (tmp_path / "prompt.txt").write_text(" ".join(words))
  doc, _ = run(options(tmp_path, prompt_file=str(tmp_path / "prompt.txt"), tokenizer=str(tmp_path / "tokenizer.json"),
                       configs=("all_off",)), tiny_model, FakePrefill(), monkeypatch)
  r = doc["records"][0]
  ids = np.array([(7 * i) % 200 for i in range(32)], np.int32)
  assert r["prompt"]["sha256"] == q.sha256_array(ids) and r["prompt"]["source"]["kind"] == "file"
  assert r["prompt"]["source"]["tokens_available"] == 40
  with pytest.raises(q.StartupError, match="gives 40 tokens"):
    run(options(tmp_path, prompt_file=str(tmp_path / "prompt.txt"), tokenizer=str(tmp_path / "tokenizer.json"),
                lengths=(41,)), tiny_model, FakePrefill(), monkeypatch)
  with pytest.raises(q.StartupError, match="needs --tokenizer"):
    run(options(tmp_path, prompt_file=str(tmp_path / "prompt.txt")), tiny_model, FakePrefill(), monkeypatch)


def test_synthetic_prompt_is_seeded_and_shared_by_lengths():
  cfg = config.tiny_window()
  a, src = q.prompt_ids(q.Options(preset="tiny_window", lengths=(16, 40), seed=3), cfg)
  b, _ = q.prompt_ids(q.Options(preset="tiny_window", lengths=(40,), seed=3), cfg)
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(a, np.random.default_rng(3).integers(0, cfg.vocab_size, 40))
  assert a.dtype == np.int32 and src == dict(kind="synthetic", seed=3, vocab_size=cfg.vocab_size)


def test_weights_fingerprint_sees_every_byte(tiny_model):
  before = q.weights_fingerprint(tiny_model)
  assert before == q.weights_fingerprint(tiny_model)
  w = tiny_model.embed[...]
  try:
    tiny_model.embed.set_value(w.at[5, 7].add(0.5))  # not in the strided sample: the bit sum catches it
    assert q.weights_fingerprint(tiny_model) != before
  finally:
    tiny_model.embed.set_value(w)
  assert q.weights_fingerprint(tiny_model) == before
  other = model.init_random(config.tiny_window(), seed=1, dtype=jnp.float32)
  assert q.weights_fingerprint(other) != before


# ---- flags and the shipped flagfiles ----
def parse(argv):
  fv = flags.FlagValues()
  q.define_flags(fv)
  fv(["prefill", *argv])
  return q.options_from_flags(fv)


def test_flags_map_onto_options():
  o = parse(["--preset=tiny", "--lengths=8,16", "--configs=all_on,all_off", "--moe_compact_queue",
             "--long_context_chunk=0", "--append", "--kl_gate=0.01"])
  assert o.lengths == (8, 16) and o.configs == ("all_on", "all_off") and o.append and o.kl_gate == 0.01
  assert o.features["moe_compact_queue"] is True and o.features["long_context_chunk"] == 0
  assert o.features["moe_fused_combine"] is None  # None = the capability table's default
  assert o.warmups == 2 and o.repeats == 3 and o.min_warmups == 2 and o.out.startswith("/tmp/")
  with pytest.raises(q.StartupError, match="--lengths must be integers"):
    parse(["--lengths=8k"])


def test_qual_cfg():
  o = parse([f"--flagfile={REPO}/qual.cfg"])
  assert (o.preset, o.quant_policy, o.dtype) == ("v4_flash", "lucebox_mix", "bf16")
  assert o.lengths == (8192, 32768, 122879) and o.warmups >= 2 and o.repeats >= 3 and o.append
  assert o.out == "experiments/results/qual_v4flash_h200.json"
  assert 0 < o.parity_prefix_tokens <= o.exact_max_tokens < 8192
  q._validate(o)
  cfg = q._model_config(o)
  q.quant_policy.check_config(q.quant_policy.get(o.quant_policy), cfg)
  assert max(o.lengths) <= cfg.max_position_embeddings


def test_smoke_cfg():
  o = parse([f"--flagfile={REPO}/experiments/qual_smoke.cfg"])
  q._validate(o)
  assert o.out.startswith("/tmp/") and not o.append and o.warmups == 2 and o.repeats == 3
  cfg = q._model_config(o)
  assert max(o.lengths) <= cfg.max_position_embeddings and min(o.lengths) > cfg.sliding_window
  base = features.resolve("cpu_interpret", o.features)
  assert base.on(), "the smoke must turn switches on (on the CPU they all default off)"
  assert any(c.also_off for c in q.matrix(base))


# ---- the real prefill, end to end ----
def test_real_prefill_end_to_end(tmp_path):
  """Builds the weights itself (no model injection) and runs the real ds4jax.prefill on the MoE kernels."""
  opts = options(tmp_path, lengths=(20,), warmups=0, repeats=1, precompile_workers=2,
                 features={"moe_compact_queue": True, "long_context_chunk": 0, "prefill_band_tokens": 0})
  doc = q.run(opts, log=lambda s: None)
  recs = by_key(doc)
  pre = doc["invocations"][-1]["precompile"]
  # tiny_window has one layer type; kill_moe_compact_queue runs the exact path's program (all switches off, and
  # at 20 tokens the band/chunk knobs change nothing), so 3 configurations need 2 programs.
  assert pre["programs"] == 2
  assert all(r["timing"]["cold_loads_precompiled"] for r in recs.values())
  assert sorted(recs) == [(20, "all_off"), (20, "all_on"), (20, "kill_moe_compact_queue")]
  assert all(r["status"] == "ok" and r["parity"]["pass"] for r in recs.values())
  assert recs[(20, "all_off")]["parity"]["nmse"] == 0.0
  assert 0 <= recs[(20, "all_on")]["parity"]["nmse"] < 1e-10
  assert recs[(20, "all_on")]["model"] == dict(name="tiny_window", preset="tiny_window", checkpoint=None,
                                                policy="bf16", dtype="bf16", seed=0)


def test_exact_prefix_store_creates_its_directory(tmp_path, tiny_model, monkeypatch):
  """parity_by_switch stores the exact logits before anything else is written next to --out."""
  monkeypatch.setattr(prefill_lib, "prefill_logits", FakePrefill())
  path = str(tmp_path / "new" / "dir" / "r.exact.npz")
  ids = np.arange(1, 33, dtype=np.int32)
  store = q._ExactPrefixes(tiny_model, ids, q.exact_features("cpu_interpret"), "fp",  # pylint: disable=protected-access
                           path, q._Clock(1, lambda s: None))  # pylint: disable=protected-access
  got = store.get(16)
  assert os.path.exists(path) and np.array_equal(store.stored()[16], got)


def test_noise_floor_is_measured_once_and_sorts_failures(tmp_path, tiny_model, monkeypatch):
  """The exact path with perturbed input, against itself: once per parity length, stored, shown in the table. A KL
  above the gate is 'unresolved' only when the floor is above it too and the KL is within FLOOR_FACTOR of it."""
  exact = q.exact_features("cpu_interpret")
  confs = ("all_on", "all_off", "kill_moe_fused_combine")
  fake = FakePrefill(noise_gain=1.0)  # floor KL ~0.23 > gate; all_on's KL ~0.87 is within 10x of it
  doc, lines = run(options(tmp_path, lengths=(24, 32), exact_max_tokens=20, configs=confs), tiny_model, fake,
                   monkeypatch)
  floor = doc["noise_floor"]["16"]
  assert list(doc["noise_floor"]) == ["16"] and floor["input_noise"] == 2.0 ** -24 and floor["tokens"] == 16
  assert 0.1 < floor["kl"] < 0.5 and 0 < floor["nmse"] < 1 and not math.isnan(floor["max_abs"])
  assert fake.noisy_calls == [(exact, 16, 2.0 ** -24)]
  rows = {(r["length"], r["config"]): r for r in q.summary_rows(doc)}
  assert rows[(32, "all_on")]["verdict"] == "unresolved" and rows[(24, "all_on")]["verdict"] == "unresolved"
  assert rows[(32, "all_on")]["floor_kl"] == floor["kl"] and not by_key(doc)[(32, "all_on")]["parity"]["pass"]
  assert rows[(32, "kill_moe_fused_combine")]["verdict"] == "pass" and rows[(32, "all_off")]["verdict"] == "pass"
  md = open(q.markdown_path(doc_path := options(tmp_path).out)).read()
  assert "unresolved" in md and "FAIL" not in md and f"{floor['kl']:.2e}" in md
  assert any("noise floor at 16 tokens" in s for s in lines)
  # A later call reuses the stored perturbed logits; a different eps runs the exact path again.
  fake.noisy_calls.clear()
  del doc["noise_floor"]
  with open(doc_path, "w") as f:
    json.dump(doc, f)
  again, _ = run(options(tmp_path, lengths=(32,), exact_max_tokens=20, configs=("kill_moe_compact_queue",),
                         append=True), tiny_model, fake, monkeypatch)
  assert fake.noisy_calls == [] and again["noise_floor"]["16"]["kl"] == floor["kl"]
  # With a low floor the same KL is a plain failure: too far above the floor.
  low = FakePrefill(noise_gain=0.2)  # floor KL ~0.01: above the gate, but all_on's 0.87 is > 10x that
  doc, _ = run(options(tmp_path, lengths=(32,), exact_max_tokens=20, configs=confs, noise_floor_eps=2.0 ** -23),
               tiny_model, low, monkeypatch)
  rows = {r["config"]: r for r in q.summary_rows(doc)}
  assert low.noisy_calls == [(exact, 16, 2.0 ** -23)] and 0.006 < doc["noise_floor"]["16"]["kl"] < 0.087
  assert rows["all_on"]["verdict"] == "FAIL" and rows["kill_moe_fused_combine"]["verdict"] == "pass"


def test_no_noise_floor_when_eps_is_zero(tmp_path, tiny_model, monkeypatch):
  fake = FakePrefill()
  doc, lines = run(options(tmp_path, configs=("all_on", "all_off"), noise_floor_eps=0.0), tiny_model, fake,
                   monkeypatch)
  assert fake.noisy_calls == [] and doc.get("noise_floor", {}) == {}
  assert {r["config"]: r["verdict"] for r in q.summary_rows(doc)} == dict(all_off="pass", all_on="FAIL")
  assert q.verdict_counts(doc) == dict(passed=1, failed=1, unresolved=0, not_run=0)
  assert lines[-1] == "verdicts: 1 pass, 1 fail, 0 not run"


def test_noise_floor_at_full_length_and_when_it_fails(tmp_path, tiny_model, monkeypatch):
  """Without a prefix the floor is taken at each full length against all_off's logits. A floor that fails is
  recorded with its error (verdicts fall back to pass/FAIL) and retried by the next call; a floor of another prompt
  prefix is not reused."""
  exact = q.exact_features("cpu_interpret")
  fake = FakePrefill(noise_gain=1.0, noisy_fail=RuntimeError("RESOURCE_EXHAUSTED: out of memory"))
  doc, lines = run(options(tmp_path, lengths=(24,), configs=("all_on", "all_off")), tiny_model, fake, monkeypatch)
  floor = doc["noise_floor"]["24"]
  assert "RESOURCE_EXHAUSTED" in floor["error"] and "kl" not in floor and fake.noisy_calls == [(exact, 24, 2.0 ** -24)]
  assert {r["config"]: r["verdict"] for r in q.summary_rows(doc)} == dict(all_off="pass", all_on="FAIL")
  assert "failed: RuntimeError" in open(q.markdown_path(options(tmp_path).out)).read()
  assert any("noise floor at 24 tokens" in s and "FAILED" in s for s in lines)
  # The next call retries it (all_on is done; the floor is taken after the first record of this call).
  fake.noisy_fail, fake.noisy_calls = None, []
  doc, _ = run(options(tmp_path, lengths=(24,), configs=("all_on", "all_off", "kill_moe_fused_combine"), append=True),
               tiny_model, fake, monkeypatch)
  floor = doc["noise_floor"]["24"]
  assert fake.noisy_calls == [(exact, 24, 2.0 ** -24)] and floor["tokens"] == 24 and 0.1 < floor["kl"] < 0.5
  assert floor["prompt_sha256"] == by_key(doc)[(24, "all_on")]["prompt"]["sha256"]
  assert {r["config"]: r["verdict"] for r in q.summary_rows(doc)}["all_on"] == "unresolved"
  # A floor on file for another prompt prefix is measured again, not reused.
  doc["noise_floor"]["24"]["prompt_sha256"] = "0" * 64
  doc["records"] = [r for r in doc["records"] if r["config"] != "kill_moe_fused_combine"]
  with open(options(tmp_path).out, "w") as f:
    json.dump(doc, f)
  fake.noisy_calls = []
  doc, lines = run(options(tmp_path, lengths=(24,), configs=("kill_moe_fused_combine",), append=True), tiny_model,
                   fake, monkeypatch)
  # (re-measured from the perturbed logits in the .npz store, which is keyed by the real prompt ids)
  assert doc["noise_floor"]["24"]["prompt_sha256"] == by_key(doc)[(24, "all_on")]["prompt"]["sha256"]
  assert fake.noisy_calls == [] and any("input noise" in s and "loaded from" in s for s in lines)


def test_startup_rejects_a_noise_floor_below_one_rounding(tmp_path, tiny_model, monkeypatch):
  with pytest.raises(q.StartupError, match="noise_floor_eps"):
    run(options(tmp_path, noise_floor_eps=2.0 ** -26), tiny_model, FakePrefill(), monkeypatch)
