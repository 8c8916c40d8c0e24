"""Results JSON -> pandas tables, so the notebooks (notebooks/README.md) hold no parsing.

`load(path)` recognises what wrote a results file and returns its `Tables`: the file's kind, what the run was
(`meta`: device, versions, shapes) and its DataFrames by name (`KINDS` lists them per kind). A file of an unknown
schema version, or one no experiment writes, is refused with a ValueError naming the file and what was expected.

The qualification's `ds4jax.prefill_qualification/2` files are read through `experiments.qualification.load_results`.
Wave 1's `/1` file (no verdicts) is read as throughput-only records: the same columns, the verdict columns empty.

Below the readers, tables derived from several files for the notebooks' figures: each switch's effect, what the
matrix is missing, a roofline of the H200 microbenchmarks and the breakdown of one prefill they add up to.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any, Callable, Mapping

import pandas as pd

from ds4jax import config as config_lib
from ds4jax.quant import formats
from experiments.qualification import records as qual_records
from experiments.qualification import store as qual_store
from experiments.qualification.matrix import KILLABLE_KNOBS

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "experiments" / "results"
QUALIFICATION_V1 = "ds4jax.prefill_qualification/1"
QUALIFICATION_SCHEMAS = (QUALIFICATION_V1, qual_records.SCHEMA)
GIB = 2.0 ** 30

# kind -> the DataFrames its Tables hold.
KINDS: dict[str, tuple[str, ...]] = {
    "qualification": ("records", "layers", "verdicts", "noise_floor"),
    "band_sweep": ("records",),
    "bench_moe": ("runs", "head_to_head"),
    "bench_attention": ("timings", "accuracy", "speedups"),
    "bench_decode": ("decode",),
    "bench_generate": ("lengths", "kernels"),
    "generate": ("runs",),
    "bench_reference": ("runs",),
    "lowering_gfx1151": ("kernels",),
    "compile_gfx1151": ("programs", "kernels"),
    "init_stats": ("layers", "summary"),
    "layer_verdicts": ("layers",),
    "parity_by_switch": ("variants",),
    "per_layer_parity": ("layers", "noise_floor"),
    "trace_prefill": ("runs", "kernels"),
    "gfx1151_model": ("predictions", "classes"),
    "profile_moe": ("runs", "regions"),
}


@dataclasses.dataclass(frozen=True)
class Tables:
  """The tables of one results file; `tables.records` is `tables.frames["records"]`."""
  kind: str
  path: str
  meta: Mapping[str, Any]
  frames: Mapping[str, pd.DataFrame]

  def __getattr__(self, name: str) -> pd.DataFrame:
    frames = self.__dict__.get("frames", {})
    if name in frames:
      return frames[name]
    raise AttributeError(f"{self.kind} tables have no {name!r}; they hold {sorted(frames)}")


def resolve(path) -> pathlib.Path:
  """A path as given, or relative to the repository root (notebooks run from notebooks/ or from the root)."""
  p = pathlib.Path(path)
  return p if p.is_absolute() or p.exists() else REPO_ROOT / p


def kind_of(doc: Any, path: str = "<document>") -> str:
  """Which experiment wrote `doc`, from its schema or its keys (most results files carry no schema field)."""
  if not isinstance(doc, dict):
    raise ValueError(f"{path}: a results file is a JSON object; this one is a {type(doc).__name__}")
  if "schema" in doc:
    if doc["schema"] in QUALIFICATION_SCHEMAS:
      return "qualification"
    raise ValueError(f"{path}: schema {doc['schema']!r} is not one this loader reads (expected one of "
                     f"{', '.join(QUALIFICATION_SCHEMAS)}); update experiments/results_tables.py for it")
  benchmarks = {"moe": "bench_moe", "sparse_mla": "bench_attention", "reference_prefill": "bench_reference"}
  if "benchmark" in doc:
    if doc["benchmark"] in benchmarks:
      return benchmarks[doc["benchmark"]]
    raise ValueError(f"{path}: benchmark {doc['benchmark']!r} is not one this loader reads (expected one of "
                     f"{sorted(benchmarks)})")
  if "check" in doc:
    if doc["check"] in ("lowering_gfx1151", "compile_gfx1151"):
      return doc["check"]
    raise ValueError(f"{path}: check {doc['check']!r} is not one this loader reads (expected 'lowering_gfx1151' "
                     "or 'compile_gfx1151')")
  if doc.get("model") == "gfx1151_prefill_performance":
    return "gfx1151_model"
  by_keys = [("band_sweep", ("what", "records")), ("trace_prefill", ("what", "variants", "runs")),
             ("bench_decode", ("weights", "repeats")), ("init_stats", ("update_over_stream", "entropy")),
             ("layer_verdicts", ("bounds", "configuration", "mutations")), ("per_layer_parity", ("per_layer",)),
             ("parity_by_switch", ("variants", "exact_logits_sha256")),
             ("bench_generate", ("lengths", "capacity", "new_tokens")),
             ("generate", ("decode_tok_per_s", "prompt_tokens", "speculate")),
             ("profile_moe", ("profile_space", "skip_steps", "runs"))]
  for kind, keys in by_keys:
    if all(k in doc for k in keys):
      return kind
  raise ValueError(f"{path}: not a results file this loader recognises (top-level keys {sorted(doc)[:12]}); "
                   f"expected a 'schema' of {', '.join(QUALIFICATION_SCHEMAS)}, a 'benchmark' of "
                   f"{sorted(benchmarks)}, check 'lowering_gfx1151', or the keys of one of "
                   f"{[k for k, _ in by_keys]}")


def read(path) -> tuple[str, dict]:
  p = resolve(path)
  try:
    with open(p) as f:
      doc = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{p}: not JSON ({e})") from e
  return kind_of(doc, str(p)), doc


def load(path, expect: str | None = None) -> Tables:
  """The tables of one results file; `expect` (a key of KINDS) refuses a file of another kind."""
  kind, doc = read(path)
  p = str(resolve(path))
  if expect is not None and kind != expect:
    raise ValueError(f"{p} is a {kind} results file, not {expect}")
  try:
    meta, frames = _READERS[kind](p, doc)
  except (KeyError, TypeError, AttributeError) as e:  # recognised by its keys, but not as its writer writes it
    raise ValueError(f"{p}: a {kind} results file that this loader cannot read ({type(e).__name__}: {e})") from e
  return Tables(kind=kind, path=p, meta=meta, frames=frames)


def load_dir(directory=RESULTS_DIR) -> dict[str, Tables]:
  """Every results JSON in `directory`, by file name (raises on any file it does not recognise)."""
  return {p.name: load(p) for p in sorted(resolve(directory).glob("*.json"))}


# ---- the qualification (schema /2 through the qualification package; /1 and the band sweep by hand) ----
RECORD_COLUMNS = ("length", "config", "mutation", "killed", "also_off", "switches_on", "status", "error_kind", "error",
                  "tokens_per_s", "median_s", "cold_s", "cold_tokens_per_s", "peak_gib", "band_tokens", "verdict",
                  "verdict_tokens", "verdict_reasons", "worst_layer", "worst_layer_nmse", "worst_layer_bound",
                  "worst_layer_reference_bf16", "route_flips", "index_flips", "bad_flips", "tf_kl", "tf_kl_bound",
                  "tf_kl_reference_bf16", "tf_kl_bands", "upstream_gate", "final_kl", "final_nmse", "final_top1_agree",
                  "final_prefix_tokens", "features", "git_commit", "weights_fingerprint", "finished")
LAYER_COLUMNS = ("config", "features", "mutation", "verdict_tokens", "result", "layer", "attention", "routing", "bands",
                 "update_nmse", "bound", "reference_bf16_nmse", "nmse_over_bound", "nmse_over_reference",
                 "route_flips", "index_flips", "n_bad_flips", "passed")
VERDICT_COLUMNS = ("config", "features", "mutation", "mutation_layer", "result", "tokens", "band_tokens", "reasons",
                   "worst_layer", "worst_layer_nmse", "worst_layer_bound", "route_flips", "index_flips", "bad_flips",
                   "tf_kl", "tf_max_kl", "tf_kl_bound", "tf_kl_reference_bf16", "tf_kl_bands", "upstream_gate",
                   "wall_s")


def _frame(rows: list[dict], columns: tuple[str, ...]) -> pd.DataFrame:
  return pd.DataFrame([{c: r.get(c) for c in columns} for r in rows], columns=list(columns))


def _get(d: Mapping | None, key: str):
  return None if d is None else d.get(key)


def _record_row(r: Mapping[str, Any], judged: bool = True) -> dict[str, Any]:
  """One record (a plain JSON dict, of either schema) as a flat row; `judged`: the file takes verdicts (/2), so a
  record without one is "not run" (in a /1 file the verdict columns stay empty)."""
  t, p, v = r.get("timing") or {}, r.get("parity") or {}, r.get("verdict") or {}
  worst, tf, layers = v.get("worst_layer") or {}, v.get("teacher_forced") or {}, v.get("layers") or ()
  peak = t.get("peak_device_bytes_process")
  return dict(
      length=r["length"], config=r["config"], mutation=r.get("mutation"), killed=tuple(r.get("killed") or ()),
      also_off=tuple(r.get("also_off") or ()), switches_on=tuple(r.get("switches_on") or ()), status=r["status"],
      error_kind=r.get("error_kind"), error=r.get("error"), tokens_per_s=t.get("tokens_per_s"),
      median_s=t.get("median_s"), cold_s=t.get("cold_s"), cold_tokens_per_s=t.get("cold_tokens_per_s"),
      peak_gib=peak / GIB if peak else None, band_tokens=(r.get("features") or {}).get("prefill_band_tokens"),
      verdict=v.get("result", qual_records.NOT_RUN if judged else None), verdict_tokens=v.get("tokens"),
      verdict_reasons="; ".join(v.get("reasons") or ()), worst_layer=worst.get("layer"),
      worst_layer_nmse=worst.get("update_nmse"), worst_layer_bound=worst.get("bound"),
      worst_layer_reference_bf16=worst.get("reference_bf16_nmse"),
      route_flips=sum(x["route_flips"] for x in layers) if layers else None,
      index_flips=sum(x["index_flips"] for x in layers) if layers else None,
      bad_flips=sum(x["n_bad_flips"] for x in layers) if layers else None,
      tf_kl=tf.get("mean_kl"), tf_kl_bound=tf.get("bound"), tf_kl_reference_bf16=tf.get("reference_bf16_mean_kl"),
      tf_kl_bands=tf.get("bands", 1) if tf else None, upstream_gate=tf.get("upstream_gate", p.get("kl_gate")),
      final_kl=p.get("kl"), final_nmse=p.get("nmse"),
      final_top1_agree=p.get("top1_agree"), final_prefix_tokens=p.get("prefix_tokens"),
      features=r.get("features"), git_commit=(r.get("env") or {}).get("git_commit"),
      weights_fingerprint=r.get("weights_fingerprint"), finished=r.get("finished"))


def _features(v: Mapping[str, Any]) -> str | None:
  """A verdict's switches that are on (and its knobs that are set, as name=value), "+"-joined; None where it does
  not list them."""
  f = v.get("features")
  if f is None:
    return None
  items = f.items() if isinstance(f, Mapping) else ((k, True) for k in f)
  return "+".join(k if x is True else f"{k}={x}" for k, x in sorted(items) if x not in (False, None, 0, ""))


def _verdict_rows(v: Mapping[str, Any]) -> tuple[dict, list[dict]]:
  """A verdict as one summary row and one row per judged layer."""
  tf, worst, layers = v.get("teacher_forced") or {}, v.get("worst_layer") or {}, v.get("layers") or ()
  feats = _features(v)
  head = dict(config=v.get("config"), features=feats, mutation=v.get("mutation"),
              mutation_layer=v.get("mutation_layer"), result=v["result"], tokens=v["tokens"],
              band_tokens=v.get("band_tokens", 0),
              reasons="; ".join(v.get("reasons") or ()),
              worst_layer=worst.get("layer"), worst_layer_nmse=worst.get("update_nmse"),
              worst_layer_bound=worst.get("bound"),
              route_flips=sum(x["route_flips"] for x in layers), index_flips=sum(x["index_flips"] for x in layers),
              bad_flips=sum(x["n_bad_flips"] for x in layers), tf_kl=tf.get("mean_kl"), tf_max_kl=tf.get("max_kl"),
              tf_kl_bound=tf.get("bound"), tf_kl_reference_bf16=tf.get("reference_bf16_mean_kl"),
              tf_kl_bands=tf.get("bands", 1) if tf else None, upstream_gate=tf.get("upstream_gate"),
              wall_s=v.get("wall_s"))
  rows = []
  for x in layers:
    ref = x.get("reference_bf16_nmse")
    rows.append(dict(config=v.get("config"), features=feats, mutation=v.get("mutation"), verdict_tokens=v["tokens"],
                     result=v["result"], layer=x["layer"], attention=x["attention"], routing=x["routing"],
                     bands=x.get("bands", 1), update_nmse=x["update_nmse"], bound=x["bound"], reference_bf16_nmse=ref,
                     nmse_over_bound=x["update_nmse"] / x["bound"] if x["bound"] else None,
                     nmse_over_reference=x["update_nmse"] / ref if ref else None, route_flips=x["route_flips"],
                     index_flips=x["index_flips"], n_bad_flips=x["n_bad_flips"], passed=x["passed"]))
  return head, rows


def _qualification(path: str, doc: dict) -> tuple[dict, dict[str, pd.DataFrame]]:
  if doc["schema"] == QUALIFICATION_V1:  # wave 1: plain records, final-position parity only
    recs = doc.get("records", [])
  else:  # typed: load_results checks every field and refuses a (length, config) held twice
    recs = [qual_records.to_json(r) for r in qual_store.load_results(path).records]
  rows = [_record_row(r, judged=doc["schema"] != QUALIFICATION_V1) for r in recs]
  rows.sort(key=lambda r: (r["length"], _matrix_order(r["config"]), r["config"]))
  heads, layer_rows, seen = [], [], set()
  # lengths sharing a verdict prefix share the verdict: one row per (name, switches); then the verdicts saved before
  # any timing (a planted bug's, or a configuration whose timing was cut), newest first, as the qualification takes
  # them. all_on can name different switches at different lengths (sm_90's one-band defaults): a row each.
  saved = list(reversed(doc.get("verdicts", [])))
  for v in [r["verdict"] | dict(config=r["config"]) for r in recs if r.get("verdict")] + saved:
    key = (v["config"], _features(v), v["tokens"], v.get("mutation"))
    if key not in seen:
      seen.add(key)
      head, layers = _verdict_rows(v)
      heads.append(head)
      layer_rows += layers
  floors = [dict(tokens=f["tokens"], input_noise=f["input_noise"], nmse=f.get("nmse"), kl=f.get("kl"),
                 top1_agree=f.get("top1_agree"), error=f.get("error"))
            for f in doc.get("noise_floor", {}).values()]
  last = recs[-1] if recs else {}
  meta = dict(schema=doc["schema"], model=last.get("model"), env=last.get("env"),
              device=_get(last.get("env"), "device_kind"), invocations=len(doc.get("invocations", [])),
              has_verdicts=doc["schema"] != QUALIFICATION_V1)
  return meta, dict(records=_frame(rows, RECORD_COLUMNS), layers=_frame(layer_rows, LAYER_COLUMNS),
                    verdicts=_frame(heads, VERDICT_COLUMNS),
                    noise_floor=pd.DataFrame(floors, columns=["tokens", "input_noise", "nmse", "kl", "top1_agree",
                                                              "error"]))


def _matrix_order(config: str) -> int:
  return 0 if config == "all_on" else 2 if config == "all_off" else 3 if config.startswith("mutant_") else 1


def _band_sweep(path: str, doc: dict):
  rows = [_record_row(r, judged=False) for r in doc["records"]]
  for row in rows:
    row["bands"] = math.ceil(row["length"] / row["band_tokens"]) if row["band_tokens"] else 1
  frame = pd.DataFrame(rows, columns=list(RECORD_COLUMNS) + ["bands"]).sort_values(["band_tokens", "finished"])
  return dict(what=doc["what"], env=doc["records"][0].get("env") if doc["records"] else None), dict(
      records=frame.reset_index(drop=True))


# ---- benchmarks ----
def _bench_moe(path: str, doc: dict):
  runs = pd.DataFrame(doc["runs"])
  for c in ("seconds", "tflops", "fraction_of_dense_gemm", "error"):
    if c not in runs:
      runs[c] = None
  runs["ms"] = runs["seconds"] * 1e3
  # The second baseline: torch's grouped GEMM on the same sorted rows, measured in the same run.
  torch = runs[runs.contender == "torch_grouped_mm_gate_up"].set_index(["tokens", "routing"])["tflops"]
  runs["fraction_of_torch_grouped_mm"] = [
      t / torch.get((s, r)) if pd.notna(t) and pd.notna(torch.get((s, r))) else None
      for t, s, r in zip(runs.tflops, runs.tokens, runs.routing)]
  meta = dict(env=doc["env"], dims=doc["dims"], smoke=doc.get("smoke"), code_commit=doc.get("code_commit"))
  # --head_to_head: one row per contender and cell, its rate against the base taken round by round
  pairs = [dict(tokens=h["tokens"], routing=h["routing"], base=h["base"], contender=c, median_ms=ms,
                **{f"rate_{k}": v for k, v in h["rate_vs_base"].get(c, {}).items()})
           for h in doc.get("head_to_head", []) if "error" not in h for c, ms in h["median_ms"].items()]
  return meta, dict(runs=runs, head_to_head=pd.DataFrame(pairs, columns=[
      "tokens", "routing", "base", "contender", "median_ms", "rate_median", "rate_low", "rate_high",
      "rate_faster_rounds", "rate_rounds"]))


def _bench_attention(path: str, doc: dict):
  runs = pd.DataFrame(doc["runs"])
  for c in ("ms", "kernel", "error", "nmse_vs_precise", "max_abs_vs_precise", "nmse_vs_dense_reference", "ratio",
            "indexer_share", "compiled_bytes"):
    if c not in runs:
      runs[c] = None
  base = ["context", "q_start", "queries", "raw_rows", "comp_rows", "contender"]
  timed = runs.ms.notna() | runs.error.notna()
  accuracy = runs.nmse_vs_precise.notna() | runs.nmse_vs_dense_reference.notna()
  meta = dict(env=doc["env"], dims=doc["dims"], queries=doc["queries"], config=doc.get("config"),
              smoke=doc.get("smoke"), code_commit=doc.get("code_commit"))
  return meta, dict(
      timings=runs[timed][base + ["kernel", "ms", "indexer_share", "compiled_bytes", "error"]].reset_index(drop=True),
      accuracy=runs[accuracy][base + ["nmse_vs_precise", "max_abs_vs_precise",
                                      "nmse_vs_dense_reference"]].reset_index(drop=True),
      speedups=runs[runs.ratio.notna()][base + ["ratio"]].reset_index(drop=True))


def _bench_decode(path: str, doc: dict):
  rows = []
  for name, w in doc["weights"].items():
    for variant, ms in w["ms"].items():
      same = w.get("bit_identical")  # per variant; the first files held the lookup variant's alone
      rows.append(dict(weight=name, shape=tuple(w["shape"]), storage_bytes=w["storage_bytes"],
                       bf16_bytes=w["bf16_bytes"], variant=variant, ms=ms,
                       bit_identical=same.get(variant) if isinstance(same, dict) else same,
                       write_TB_per_s=w["write_TB_per_s"][variant]))
  return dict(env=doc["env"], repeats=doc["repeats"], smoke=doc.get("smoke")), dict(decode=pd.DataFrame(rows))


def _bench_generate(path: str, doc: dict):
  """One row per prompt length (band times by width q; greedy ms per step and speculative ms per token, over the
  tokens after the first, which the prompt's logits give); the traced kernels, if any."""
  def per_step(run: dict) -> tuple[float, float]:  # (ms, tok/s); files before 2026-12-02 hold n_new / seconds
    if "ms_per_step" in run:
      return run["ms_per_step"], run["tok_per_s"]
    seconds, steps = doc["new_tokens"] / run["tok_per_s"], doc["new_tokens"] - 1
    return 1e3 * seconds / steps, steps / seconds

  rows, kernels = [], []
  for n, r in doc["lengths"].items():
    trace = r.get("trace") or {}
    (g_ms, g_rate), (s_ms, s_rate) = per_step(r["greedy"]), per_step(r["speculate"])
    rows.append(dict(prompt_tokens=int(n), prefill_s=r["prefill_s"],
                     **{f"band_ms_q{q}": ms for q, ms in r["band_ms"].items()},
                     greedy_ms_per_step=g_ms, greedy_tok_per_s=g_rate, speculate_ms_per_token=s_ms,
                     speculate_tok_per_s=s_rate, bands=r["speculate"]["bands"], drafted=r["speculate"]["drafted"],
                     accepted=r["speculate"]["accepted"], same_as_greedy=r["speculate"]["same_as_greedy"],
                     device_ms_per_step=trace.get("device_ms_per_step")))
    kernels += [dict(prompt_tokens=int(n), **k, ms_per_step=k["ms"] / trace["steps"]) for k in trace.get("kernels", [])]
  meta = {k: v for k, v in doc.items() if k != "lengths"}
  return meta, dict(lengths=pd.DataFrame(rows), kernels=pd.DataFrame(kernels))


def _generate(path: str, doc: dict):
  meta = {k: doc[k] for k in ("env", "model", "checkpoint", "features") if k in doc}
  row = {k: v for k, v in doc.items() if k not in ("env", "features", "tokens")}
  return meta, dict(runs=pd.DataFrame([row]))


def _bench_reference(path: str, doc: dict):
  runs = pd.DataFrame([{k: v for k, v in r.items() if k != "seconds"} for r in doc["runs"]])
  meta = {k: v for k, v in doc.items() if k not in ("runs", "benchmark")}
  return meta, dict(runs=runs)


def _lowering(path: str, doc: dict):
  rows = [dict(target=r["target"], gating=r["gating"], kernel=r["kernel"], family=r["family"], case=r["case"],
               format=r["format"], tokens=r["tokens"], config=r["config"],
               **{k: r["stats"].get(k) for k in ("lds_bytes", "vgpr", "sgpr", "vgpr_spills", "sgpr_spills",
                                                  "scratch_bytes", "occupancy", "wmma", "smem_bytes", "registers")},
               violations="; ".join(r["violations"])) for r in doc["rows"]]
  meta = dict(env=doc["env"], triton=doc.get("triton"), gating_arch=doc.get("gating_arch"),
              lds_limit=doc.get("lds_limit"), targets=doc.get("targets"), failing=len(doc.get("failing", [])))
  return meta, dict(kernels=pd.DataFrame(rows))


def _compile(path: str, doc: dict):
  """Whole programs compiled by XLA's ROCm compiler without a device (experiments/compile_gfx1151.py): one row per
  program, and one per kernel it launches."""
  programs, kernels = [], []
  for p in doc["programs"]:
    ks = p.get("kernels") or []
    programs.append(dict(program=p["label"], compile_s=p.get("compile_s"), pallas_calls=p.get("pallas_calls"),
                         launches=p.get("launches"), kernels=len(ks), code_bytes=sum(k["code_bytes"] for k in ks),
                         max_vgpr=max((k["vgpr"] for k in ks), default=None),
                         max_lds=max((k["lds"] for k in ks), default=None),
                         vgpr_spills=sum(k["vgpr_spills"] for k in ks)))
    kernels += [dict(program=p["label"], **{k: v for k, v in kern.items() if k != "grid"}) for kern in ks]
  meta = dict(env=doc["env"], target_config=doc.get("target_config"))
  return meta, dict(programs=pd.DataFrame(programs), kernels=pd.DataFrame(kernels))


# ---- model statistics and verdicts outside the qualification ----
ENV_KEYS = ("date", "device_kind", "platform", "device_count", "jax", "jaxlib", "python", "host", "git_commit",
            "git_dirty")


def _init_stats(path: str, doc: dict):
  layers = pd.DataFrame(dict(layer=range(len(doc["update_over_stream"])), update_over_stream=doc["update_over_stream"]))
  summary = pd.DataFrame([{k: doc[k] for k in ("preset", "quant_policy", "tokens", "seed", "entropy", "log_vocab",
                                               "max_probability", "uniform_probability")}])
  return {k: doc.get(k) for k in ENV_KEYS}, dict(layers=layers, summary=summary)


def _layer_verdicts(path: str, doc: dict):
  def row(run, x):
    ref = x.get("reference_bf16_nmse")
    return dict(run=run, tokens=doc["tokens"], layer=x["layer"], attention=x["attention"], routing=x["routing"],
                update_nmse=x["update_nmse"], bound=x["bound"], reference_bf16_nmse=ref,
                nmse_over_bound=x["update_nmse"] / x["bound"], route_flips=x["route_flips"],
                index_flips=x["index_flips"], n_bad_flips=x["n_bad_flips"], passed=x["passed"])
  rows = [row("configuration", x) for x in doc["configuration"]["layers"]]
  rows += [row(name, x) for name, x in doc["mutations"].items()]
  meta = {k: doc.get(k) for k in ENV_KEYS} | dict(preset=doc["preset"], quant_policy=doc["quant_policy"],
                                                   tokens=doc["tokens"], bounds=doc["bounds"],
                                                   features=doc["configuration"]["features"])
  return meta, dict(layers=pd.DataFrame(rows))


def _parity_by_switch(path: str, doc: dict):
  rows = [dict(variant=name, switches_on=tuple(v.get("switches_on", ())), cold_s=v.get("cold_s"),
               **{k: v["parity"].get(k) for k in ("nmse", "max_abs", "kl", "top1_agree")})
          for name, v in doc["variants"].items()]
  return dict(env=doc["env"], tokens=doc["tokens"]), dict(variants=pd.DataFrame(rows))


def _per_layer_parity(path: str, doc: dict):
  rows = [dict(layer=x["layer"], attention=x["attention"], routing=x["routing"], variant=name, **v)
          for x in doc["per_layer"] for name, v in x["variants"].items()]
  floor = pd.DataFrame([doc["noise_floor"]]) if doc.get("noise_floor") else pd.DataFrame()
  return dict(env=doc["env"], tokens=doc["tokens"]), dict(layers=pd.DataFrame(rows), noise_floor=floor)


TRACE_RUN_COLUMNS = ["tokens", "variant", "switches_on", "tok_s", "cold_s", "device_ms", "traced_wall_ms", "peak_bytes",
                     "error"]


def _trace_prefill(path: str, doc: dict):
  """One row per (length, feature set) run, and its kernels (experiments/trace_prefill.py)."""
  runs, kernels = [], []
  for e in doc["runs"]:
    key = dict(tokens=e["tokens"], variant=e["variant"])
    on = e.get("switches_on", doc["variants"].get(e["variant"], ()))  # files before 2026-12-04: one set a variant
    runs.append(key | dict(switches_on=tuple(on),
                           **{k: e.get(k) for k in TRACE_RUN_COLUMNS[3:]}))
    kernels += [key | k for k in e.get("kernels", [])]
  meta = {k: doc.get(k) for k in ENV_KEYS} | dict(what=doc["what"], preset=doc.get("preset"),
                                                   quant_policy=doc.get("quant_policy"), variants=doc["variants"])
  return meta, dict(runs=pd.DataFrame(runs, columns=TRACE_RUN_COLUMNS),
                    kernels=pd.DataFrame(kernels, columns=["tokens", "variant", "kernel", "ms", "count", "share"]))


def _gfx1151_model(path: str, doc: dict):
  """Predicted gfx1151 prefill per (length, scenario), and per kernel class (experiments/gfx1151_model.py)."""
  predictions, classes = [], []
  for e in doc["lengths"]:
    upstream = (e.get("upstream") or {}).get("tok_s")
    for s, tok_s in e["tok_s"].items():
      predictions.append(dict(tokens=e["tokens"], scenario=s, tok_s=tok_s, total_s=e["total_s"][s],
                              bound=e["bound"][s], upstream_tok_s=upstream))
      classes += [dict(tokens=e["tokens"], scenario=s, kernel_class=r["class"], gfx1151_ms=r["gfx1151_ms"][s],
                       gfx1151_roof=r["gfx1151_roof"], flops=r["flops"], bytes=r["bytes_gfx1151"],
                       h200_ms=r["h200_ms"], h200_roofline_fraction=r["h200_roofline_fraction"])
                  for r in e["classes"]]
  meta = dict(date=doc["date"], what=doc["what"], preset=doc["preset"], quant_policy=doc["quant_policy"],
              scenarios=doc["scenarios"], devices=doc["devices"])
  return meta, dict(predictions=pd.DataFrame(predictions), classes=pd.DataFrame(classes))


def _profile_moe(path: str, doc: dict):
  """One row per profiled kernel call (ms, unit figures, the clock), and one per (call, region) with its cycles
  (experiments/profile_moe.py; files before the spread was recorded have medians only)."""
  key_cols = ["tokens", "routing", "variant", "stages"]
  runs, regions = [], []
  for e in doc["runs"]:
    key = {k: e.get(k) for k in key_cols}
    runs.append(key | dict(items=e.get("items"), ms=e.get("ms"), clock_ghz=e.get("clock_ghz"), error=e.get("error"),
                           **{f"unit_{k}": v for k, v in (e.get("units") or {}).items()}))
    regions += [key | dict(region=name, median=c["median"], mean=c.get("mean"), p10=c.get("p10"), p90=c.get("p90"),
                           n=c["n"]) for name, c in (e.get("cycles") or {}).items()]
  meta = {k: doc.get(k) for k in ENV_KEYS} | dict(what=doc.get("what"), profile_space=doc["profile_space"],
                                                   skip_steps=doc["skip_steps"], code_commit=doc.get("code_commit"))
  return meta, dict(runs=pd.DataFrame(runs), regions=pd.DataFrame(
      regions, columns=key_cols + ["region", "median", "mean", "p10", "p90", "n"]))


_READERS: dict[str, Callable[[str, dict], tuple[dict, dict[str, pd.DataFrame]]]] = {
    "qualification": _qualification, "band_sweep": _band_sweep, "bench_moe": _bench_moe,
    "bench_attention": _bench_attention, "bench_decode": _bench_decode, "bench_reference": _bench_reference,
    "bench_generate": _bench_generate, "generate": _generate,
    "lowering_gfx1151": _lowering, "compile_gfx1151": _compile, "init_stats": _init_stats,
    "layer_verdicts": _layer_verdicts,
    "parity_by_switch": _parity_by_switch, "per_layer_parity": _per_layer_parity, "trace_prefill": _trace_prefill,
    "gfx1151_model": _gfx1151_model, "profile_moe": _profile_moe}
assert set(_READERS) == set(KINDS)


# ---- derived tables for the figures ----
def flagfile_lengths(path) -> tuple[int, ...]:
  """The --lengths a flagfile plans (the last given), e.g. qual.cfg's: what the matrix should hold."""
  lengths: tuple[int, ...] = ()
  for line in resolve(path).read_text().splitlines():
    if line.strip().startswith("--lengths="):
      lengths = tuple(int(n) for n in line.strip().split("=", 1)[1].split(",") if n)
  return lengths


def _all_on(records: pd.DataFrame) -> pd.Series | None:
  on = records[records.config == "all_on"]
  return None if on.empty else on.iloc[0]


def _same_programs(knob: str, length: int, features: Mapping[str, Any]) -> bool:
  """Whether killing a chunk/band knob leaves all_on's programs unchanged at `length`: a band that already spans
  the prompt, or a chunk that spans the band (ds4jax/prefill.py `band_size`, `layer_features`)."""
  band = min(features.get("prefill_band_tokens") or length, length)
  chunk = features.get("long_context_chunk") or 0
  return (knob == "prefill_band_tokens" and band >= length and (not chunk or chunk >= length)) or (
      knob == "long_context_chunk" and (not chunk or chunk >= band))


def switch_effects(records: pd.DataFrame) -> pd.DataFrame:
  """Per length, each kill against all_on: tok/s and change_pct = 100 (kill / all_on - 1), negative where the switch
  buys speed. A kill without a timing (out of memory, not run) keeps its status and has no change. `same_programs`:
  the kill runs all_on's very programs at that length (a knob that changes nothing there), so its change is timing
  noise: `noise_pct` is the largest of those at the length. `beyond_noise`: |change| above twice that (at least
  0.5%; 1% where no kill measures the noise)."""
  rows = []
  for length, group in records.groupby("length"):
    on = group[group.config == "all_on"]
    if on.empty or pd.isna(on.iloc[0].tokens_per_s):
      continue
    base, feats = on.iloc[0].tokens_per_s, on.iloc[0].features or {}
    for r in group[group.config.str.startswith("kill_")].itertuples():
      tps = r.tokens_per_s if pd.notna(r.tokens_per_s) else None
      switch = r.config.removeprefix("kill_")
      rows.append(dict(length=length, config=r.config, switch=switch, also_off=r.also_off, status=r.status,
                       error_kind=r.error_kind, tokens_per_s=tps, all_on_tokens_per_s=base,
                       change_pct=100.0 * (tps / base - 1.0) if tps else None,
                       same_programs=_same_programs(switch, length, feats)))
  out = pd.DataFrame(rows, columns=["length", "config", "switch", "also_off", "status", "error_kind", "tokens_per_s",
                                    "all_on_tokens_per_s", "change_pct", "same_programs"])
  if out.empty:  # no kill timed against an all_on (a matrix of all_on and all_off only)
    return out.assign(noise_pct=pd.Series(dtype=float), beyond_noise=pd.Series(dtype=bool))
  noise = out[out.same_programs].groupby("length").change_pct.apply(lambda c: c.abs().max())
  out["noise_pct"] = out.length.map(noise)
  floor = (2 * out.noise_pct).clip(lower=0.5).fillna(1.0)
  out["beyond_noise"] = (out.change_pct.abs() > floor) & ~out.same_programs
  return out


def matrix_gaps(records: pd.DataFrame, planned_lengths=()) -> pd.DataFrame:
  """(length, config) pairs of the planned matrix with no record: the lengths planned (e.g. `flagfile_lengths`) or
  recorded, times all_on, one kill per switch all_on has on and per non-zero chunk/band knob, and all_off. all_on is
  the length's own where recorded (the defaults may differ by length: ds4jax.features.Capability.when), else the
  first one recorded."""
  first = _all_on(records)
  if first is None:
    return pd.DataFrame(columns=["length", "config"])
  own = {r.length: r for _, r in records[records.config == "all_on"].iterrows()}

  def configs(on) -> list[str]:
    feats = on.features or {}
    return (["all_on"] + [f"kill_{s}" for s in on.switches_on]
            + [f"kill_{k}" for k in KILLABLE_KNOBS if feats.get(k)] + ["all_off"])

  have = set(zip(records.length, records.config))
  lengths = sorted(set(planned_lengths) | set(records.length))
  return pd.DataFrame([dict(length=n, config=c) for n in lengths for c in configs(own.get(n, first))
                       if (n, c) not in have], columns=["length", "config"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Peaks:
  """A device's roofline: dense bf16 tensor-core peak and memory bandwidth."""
  name: str
  tflops: float
  tb_per_s: float

  @property
  def ridge(self) -> float:
    """FLOPs per byte where the compute roof meets the bandwidth roof."""
    return self.tflops / self.tb_per_s


H200 = Peaks(name="H200 SXM (vendor figures: dense bf16, HBM3e)", tflops=989.0, tb_per_s=4.8)
ROOFLINE_COLUMNS = ["kernel", "contender", "size", "flops", "bytes", "intensity", "tflops", "ms"]


def moe_roofline(moe: Tables, routing: str = "uniform") -> pd.DataFrame:
  """FLOPs and compulsory bytes of each timed MoE contender (one row per token count).

  Bytes count each operand read once and each output written once: every expert's weights (all 256 are hit at
  these token counts), x in bf16, h out in bf16; the whole MoE adds the down weights and an f32 output. MIX weights
  count their storage bits (ds4jax/quant/formats.py `bits_per_weight`). A kernel that reads a weight tile twice moves
  more than this, so its point sits left of where its real traffic would put it."""
  d = moe.meta["dims"]
  D, I, E, K = d["D"], d["I"], d["E"], d["K"]
  mix2, mix3 = formats.get("rocmfp2_mix").bits_per_weight / 8, formats.get("rocmfp3_mix").bits_per_weight / 8
  up_w, down_w = E * 2 * I * D, E * D * I  # weights of gate+up, of down

  def traffic(contender: str, S: int) -> tuple[str, float] | None:
    R = S * K
    models = {
        "dense_bf16_gemm": ("dense bf16 GEMM", 2 * (R * D + D * 2 * I + R * 2 * I)),
        "ours_bf16_gate_up": ("moe_gate_up bf16", 2 * (up_w + S * D + R * I)),
        "ours_rocmfp2_mix_gate_up": ("moe_gate_up rocmfp2_mix", mix2 * up_w + 2 * (S * D + R * I)),
        "torch_grouped_mm_gate_up": ("torch._grouped_mm", 2 * (up_w + R * D + R * 2 * I)),
        "jax_ragged_dot_gate_up": ("lax.ragged_dot", 2 * (up_w + R * D + R * 2 * I)),
        "ours_bf16_moe": ("whole MoE bf16", 2 * (up_w + down_w + S * D) + 4 * S * D),
        "ours_mix_moe (rocmfp2_mix gate/up, rocmfp3_mix down)": (
            "whole MoE MIX, fused decode", mix2 * up_w + mix3 * down_w + 2 * S * D + 4 * S * D)}
    return models.get(contender)

  rows = []
  for r in moe.runs[(moe.runs.routing == routing) & moe.runs.tflops.notna()].itertuples():
    model = traffic(r.contender, r.tokens)
    if model:
      flops = r.tflops * 1e12 * r.seconds
      rows.append(dict(kernel=model[0], contender=r.contender, size=r.tokens, flops=flops, bytes=model[1],
                       intensity=flops / model[1], tflops=r.tflops, ms=r.ms))
  return pd.DataFrame(rows, columns=ROOFLINE_COLUMNS)


MLA_KERNELS = {"grouped": "mla_grouped", "stream": "mla_stream_topk", "stream_f32_stage": "mla_stream_f32_stage",
               "stream_f32_stage_fast_exp": "mla_stream_fast_exp"}


def attention_roofline(attention: Tables) -> pd.DataFrame:
  """FLOPs and compulsory bytes of the sparse MLA kernels and the indexer, per context.

  MLA: each query attends window + top-k keys over head dim D for every head, QK and PV: 4 T H D (W + k) FLOPs;
  bytes: q in bf16, the output in f32, the raw and compressed KV rows once, the indices; the grouped baseline adds
  its scores' round trip through HBM (f32, written and read back). Indexer: 2 T h d R FLOPs for the scores, reading
  its q and the compressed keys in bf16 and writing and re-reading the [T, R] f32 scores for the top-k."""
  d = attention.meta["dims"]
  H, D, W, k = d["H"], d["D"], d["window"], d["k"]
  rows = []
  for r in attention.timings[attention.timings.ms.notna()].itertuples():
    if r.contender in MLA_KERNELS:
      flops = 4 * r.queries * H * D * (W + k)
      nbytes = 2 * r.queries * H * D + 4 * r.queries * H * D + 2 * (r.raw_rows + r.comp_rows) * D + 4 * r.queries * k
      if r.contender == "grouped":
        nbytes += 2 * 4 * r.queries * H * (W + k)
      name = MLA_KERNELS[r.contender]
    elif r.contender == "indexer_topk":
      h, dd = d["index_heads"], d["index_dim"]
      flops = 2 * r.queries * h * dd * r.comp_rows
      nbytes = 2 * (r.queries * h * dd + r.comp_rows * dd) + 2 * 4 * r.queries * r.comp_rows + 4 * r.queries * k
      name = "indexer scores + top-k"
    else:
      continue
    rows.append(dict(kernel=name, contender=r.contender, size=r.context, flops=flops, bytes=nbytes,
                     intensity=flops / nbytes, tflops=flops / (r.ms * 1e-3) / 1e12, ms=r.ms))
  return pd.DataFrame(rows, columns=ROOFLINE_COLUMNS)


MIX_MOE = "ours_mix_moe dequantize-then-matmul (moe_sparse_gate_up off)"


def prefill_breakdown(records: pd.DataFrame, moe: Tables, attention: Tables, cfg=None, length: int = 8192,
                      routing: str = "uniform") -> pd.DataFrame:
  """The measured all_on prefill time at `length` (one band), split by what the microbenchmarks time at the same
  shapes: per layer the MoE as all_on runs it (MIX experts decoded to bf16, then the bf16 grouped MoE: gate/up, and
  routing + down + combine), per CSA layer the indexer and the streaming MLA kernel. What they do not time (HCA and
  window attention, projections, compressors, hyper-connections, norms, the head, host work) is the remainder.
  An estimate assembled from separate runs, not a profile of the prefill."""
  cfg = cfg or config_lib.v4_flash()
  rec = records[(records.config == "all_on") & (records.length == length)]
  if rec.empty or pd.isna(rec.iloc[0].median_s):
    raise ValueError(f"no timed all_on record at {length} tokens")
  if rec.iloc[0].band_tokens and rec.iloc[0].band_tokens < length:
    raise ValueError(f"all_on ran {length} tokens in bands of {rec.iloc[0].band_tokens}; the microbenchmarks time "
                     "one band from position 0, so only a one-band length can be split this way")
  runs = moe.runs[(moe.runs.tokens == length) & (moe.runs.routing == routing)].set_index("contender")["ms"]
  att = attention.timings[attention.timings.context == length].set_index("contender")["ms"]
  for name, table in ((("ours_bf16_gate_up", "ours_bf16_moe", MIX_MOE), runs),
                      (("indexer_topk", "stream_f32_stage_fast_exp"), att)):
    missing = [n for n in name if n not in table or pd.isna(table[n])]
    if missing:
      raise ValueError(f"the microbenchmarks have no timing of {missing} at {length} tokens")
  n_layers = cfg.num_layers
  n_csa = sum(a.value == "compressed_sparse_attention" for a in cfg.attention)
  parts = [("MoE gate/up (Pallas)", "bench_moe", runs["ours_bf16_gate_up"], n_layers),
           ("MoE routing + down + combine", "bench_moe", runs["ours_bf16_moe"] - runs["ours_bf16_gate_up"], n_layers),
           ("MIX experts decoded to bf16 (XLA)", "bench_moe", runs[MIX_MOE] - runs["ours_bf16_moe"], n_layers),
           ("indexer scores + top-k (CSA layers)", "bench_attention", att["indexer_topk"], n_csa),
           ("sparse MLA stream kernel (CSA layers)", "bench_attention", att["stream_f32_stage_fast_exp"], n_csa)]
  total = 1e3 * rec.iloc[0].median_s
  rows = [dict(part=p, source=s, ms_per_layer=ms, layers=n, ms=ms * n) for p, s, ms, n in parts]
  rows.append(dict(part="not attributed (HCA/window attention, projections, compressors, hyper-connections, norms, "
                   "head, host)", source="remainder", ms_per_layer=None, layers=None,
                   ms=total - sum(r["ms"] for r in rows)))
  out = pd.DataFrame(rows)
  out["share"] = out.ms / total
  return out
