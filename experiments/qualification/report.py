"""The results as people read them: one flat row per record, the summary line, the markdown table, the log line."""

from __future__ import annotations

import re
from typing import Any, Iterable

from ds4jax import features as features_lib
from ds4jax.features import KNOBS, SWITCHES
from experiments.qualification.records import FAIL, MEASURED, PASS, Record


def _order(name: str) -> tuple[int, int]:
  if name == "all_on":
    return (0, 0)
  if name == "all_off":
    return (3, 0)
  if name.startswith("mutant_"):
    return (4, 0)
  names = [f"kill_{s}" for s in SWITCHES] + [f"kill_{k}" for k in KNOBS]
  return (1 if name in names else 2, names.index(name) if name in names else 0)


def summary_rows(results_or_records) -> list[dict[str, Any]]:
  """One flat dict per record, sorted by length then matrix order, with the speedup over all_off and the verdict."""
  records: Iterable[Record] = getattr(results_or_records, "records", results_or_records)
  base = {r.length: r.timing.tokens_per_s for r in records if r.config == "all_off" and r.status == "ok"}
  rows = []
  for r in sorted(records, key=lambda r: (r.length, _order(r.config), r.config)):
    t, p, v = r.timing, r.parity, r.verdict
    tps = t.tokens_per_s if t else None
    tf = (v.teacher_forced or {}) if v else {}
    worst = (v.worst_layer or {}) if v else {}
    rows.append(dict(
        length=r.length, config=r.config, killed=list(r.killed), also_off=list(r.also_off), status=r.status,
        tokens_per_s=tps, speedup_vs_all_off=tps / base[r.length] if tps and r.length in base else None,
        cold_s=t.cold_s if t else None, cold_tokens_per_s=t.cold_tokens_per_s if t else None,
        median_s=t.median_s if t else None,
        lowered_only=sorted(k for k, st in (r.switch_states or {}).items() if st == features_lib.LOWERED),
        verdict=r.result, verdict_reasons=list(v.reasons) if v else ["no verdict: the configuration did not run"],
        verdict_tokens=v.tokens if v else None,
        worst_layer=worst.get("layer"), worst_layer_nmse=worst.get("update_nmse"), worst_layer_bound=worst.get("bound"),
        tf_kl=tf.get("mean_kl"), tf_kl_bound=tf.get("bound"), tf_kl_reference_bf16=tf.get("reference_bf16_mean_kl"),
        tf_kl_bands=tf.get("bands", 1) if tf else None,
        tf_kl_within_upstream_gate=tf["mean_kl"] <= tf["upstream_gate"] if tf else None,
        nmse=p.nmse if p else None, max_abs=p.max_abs if p else None, top1_agree=p.top1_agree if p else None,
        kl=p.kl if p else None, prefix_tokens=p.prefix_tokens if p else None,
        error=r.error, error_kind=r.error_kind))
  return rows


def verdict_counts(results) -> dict[str, int]:
  """Configurations: how many records PASS, FAIL or have no verdict ("not run"). Planted bugs (mutant_*): how many
  are caught (FAIL), missed (PASS: the qualification would not see that bug) or not run."""
  counts = dict(passed=0, failed=0, not_run=0, caught=0, missed=0, bugs_not_run=0, crashed=0)
  for r in results.records:
    if r.mutation:
      counts[{FAIL: "caught", PASS: "missed"}.get(r.result, "bugs_not_run")] += 1
    else:
      counts[{PASS: "passed", FAIL: "failed"}.get(r.result, "not_run")] += 1
      counts["crashed"] += crashed(r)
  return counts


def crashed(r) -> bool:
  """A record whose run raised an error other than running out of memory (or a cold run predicted too slow):
  the configuration cannot run, which the qualification must not pass over."""
  return r.status == "failed" and r.error_kind not in ("oom", "parity_oom", "predicted_too_slow")


def summary_line(results) -> str:
  """`N pass, M fail, K not run` over the configurations' records, then the planted bugs caught, if any."""
  c = verdict_counts(results)
  bugs = c["caught"] + c["missed"] + c["bugs_not_run"]
  return (f"{c['passed']} pass, {c['failed']} fail, {c['not_run']} not run"
          + (f" ({c['crashed']} crashed)" if c["crashed"] else "")
          + (f"; planted bugs: {c['caught']} of {bugs} caught" + (f", {c['missed']} MISSED" if c["missed"] else "")
             + (f", {c['bugs_not_run']} not run" if c["bugs_not_run"] else "") if bugs else ""))


def failed(results) -> bool:
  """Whether a script should see a failure: a configuration FAILs or crashes, or a planted bug passes."""
  c = verdict_counts(results)
  return bool(c["failed"] or c["missed"] or c["crashed"])


def error_summary(error: str | None, kind: str | None) -> str:
  """One short line for the table: the allocation that failed for an out-of-memory error (XLA's GEMM autotuner
  reports it inside a NOT_FOUND or 'failed to get configs' error), else the error's first line."""
  text = error or "failed"
  if kind in ("oom", "parity_oom"):
    want = re.search(r"allocate ([0-9.]+ ?(?:[KMGT]i?B|bytes))", text)
    wanted = f" (wanted {want.group(1)})" if want else ""
    return ("parity: " if kind == "parity_oom" else "") + "out of memory" + wanted
  return "error: " + text.splitlines()[0][:80]


def _fmt(x, spec: str) -> str:
  return "-" if x is None else format(x, spec)


def _timing_cell(row: dict[str, Any]) -> str:
  if row["status"] == "ok":
    return "timed"
  if row["status"] == "too_slow":
    return f"too slow to time (cold run only: {row['cold_tokens_per_s']:.1f} tok/s)"
  if row["status"] == "not_timed":
    return "judged only (planted bug)"
  if row["status"] == "not_run":
    return (row["error"] or "not run").replace("|", "/")
  return error_summary(row["error"], row["error_kind"]).replace("|", "/")


def _unrecorded_verdicts(results) -> list[str]:
  """Lines for verdicts whose configuration has no record yet (a call that ended after the verdict pass, before the
  timed runs): the verdict is in the JSON, and the table says so too."""
  recorded = {r.config for r in results.records}
  latest = {}
  for v in results.verdicts:
    if v.config not in recorded and v.result != "not run":
      latest[(v.config, v.tokens)] = v
  lines = []
  for (config, tokens), v in sorted(latest.items()):
    worst = v.worst_layer or {}
    tf = v.teacher_forced or {}
    lines.append(f"- {config}: **{v.result}** on the first {tokens} tokens"
                 + (f", worst layer {worst['layer']} {worst['update_nmse']:.1e} / {worst['bound']:.1e}"
                    if worst else "")
                 + (f", teacher-forced KL {tf['mean_kl']:.1e} / {tf['bound']:.1e}" if "mean_kl" in tf else "")
                 + ("; " + "; ".join(v.reasons)[:160] if v.reasons else ""))
  return (["", "Verdicts taken, not yet timed (no record; the run ended before its timed runs):"] + lines
          if lines else [])


def markdown_table(results) -> str:
  """The results as a markdown table (with the run's device, versions, model and prompt above it)."""
  records = results.records
  lines = []
  if records:
    r0 = records[-1]
    env, mdl = r0.env, r0.model
    lines += [f"Prefill qualification: {mdl['name']} ({mdl['policy']}, {mdl['dtype']}"
              f"{', ' + mdl['checkpoint'] if mdl.get('checkpoint') else ', random weights seed ' + str(mdl['seed'])}), "
              f"weights {r0.weights_fingerprint[:12]}, prompt {r0.prompt['source']['kind']}; "
              f"{env['device_kind']} ({r0.features['device_class']})"
              f"{', mesh ' + r0.options['mesh'] if (r0.options or {}).get('mesh') else ''}, jax {env['jax']}, "
              f"commit {env['git_commit'][:10]}{' (dirty)' if env.get('git_dirty') else ''}.", ""]
  lines += ["| length | config | tok/s | speedup vs all_off | cold s | verdict (tokens) | worst layer NMSE / bound "
            "| teacher-forced KL / bound | final-position KL | timing |",
            "|---:|---|---:|---:|---:|---|---:|---:|---:|---|"]
  rows = summary_rows(results)
  lowered = sorted({s for row in rows for s in row["lowered_only"]})
  if lowered:  # before the table header
    lines[-2:-2] = [f"**Switches only lowered for this device, never run on it before** (marked †; a first run, "
                    f"not a qualified one): {', '.join(lowered)}.", ""]
  for row in rows:
    name = row["config"] + (f" (also off: {', '.join(row['also_off'])})" if row["also_off"] else "")
    name += " †" if row["lowered_only"] else ""
    verdict = row["verdict"] + (f" ({row['verdict_tokens']})" if row["verdict_tokens"] else "")
    if row["verdict"] != PASS:
      verdict += ": " + "; ".join(row["verdict_reasons"])[:160].replace("|", "/")
    worst = ("-" if row["worst_layer"] is None else
             f"{row['worst_layer_nmse']:.1e} / {row['worst_layer_bound']:.1e} (layer {row['worst_layer']})")
    tf = "-" if row["tf_kl"] is None else f"{row['tf_kl']:.1e} / {row['tf_kl_bound']:.1e}" + (
        f" ({row['tf_kl_bands']} bands)" if row["tf_kl_bands"] > 1 else "")
    final = "-" if row["kl"] is None else (f"{row['kl']:.1e}" + (f" (prefix {row['prefix_tokens']})"
                                                                  if row["prefix_tokens"] else ""))
    lines.append(f"| {row['length']} | {name} | {_fmt(row['tokens_per_s'], '.1f')} | "
                 f"{_fmt(row['speedup_vs_all_off'], '.2f')} | {_fmt(row['cold_s'], '.1f')} | {verdict} | {worst} | "
                 f"{tf} | {final} | {_timing_cell(row)} |")
  lines += _unrecorded_verdicts(results)
  lines += ["", "verdict: each layer on the exact path's input streams with its routing and indexer choices pinned "
            "(update NMSE within 4x the bf16-operand reference math, or 1e-9 on f32 operands), every unpinned "
            "choice that differs a near-tie, and the teacher-forced KL over every position (choices pinned) within "
            "3x the bf16-operand reference math's. Final-position KL: unpinned, one position (information; "
            "upstream's gate is 0.006)."]
  floors = results.noise_floor
  if floors:
    lines += ["", "noise floor (final position): the exact path against itself with its embedded streams multiplied "
              "by (1 + eps z), z ~ N(0, 1) (" + "; ".join(f"{n} tokens: eps {f.input_noise:.1e}, " + (
                  f"NMSE {f.nmse:.2e}, KL {f.kl:.2e}" if f.kl is not None else f"failed: {f.error[:80]}")
                  for n, f in sorted(floors.items(), key=lambda kv: int(kv[0]))) + ")."]
  return "\n".join(lines) + "\n"


def outcome(rec: Record) -> str:
  """One log line for a finished record."""
  v = rec.verdict
  verdict = f"verdict {rec.result}" + (f" ({'; '.join(v.reasons)[:300]})" if v and v.reasons else "")
  p, t = rec.parity, rec.timing
  parity = p and (f"final position: NMSE {p.nmse:.2e} top-1 {'yes' if p.top1_agree else 'no'} KL {p.kl:.2e}"
                  + (f" (prefix {p.prefix_tokens})" if p.prefix_tokens else ""))
  if rec.status == "not_timed":
    return verdict
  if rec.status not in MEASURED:
    return f"FAILED {(rec.error or '')[:300]}; {verdict}" + (f"; {parity}" if parity else "")
  speed = (f"too slow to time (cold {t.cold_s:.1f}s, {t.cold_tokens_per_s:.1f} tok/s)" if t.too_slow else
           f"ok {t.tokens_per_s:.1f} tok/s (cold {t.cold_s:.1f}s, median {t.median_s:.3f}s)")
  return f"{speed}; {verdict}; {parity}"
