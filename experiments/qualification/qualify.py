"""One qualification call: start-up checks, the plan, the verdicts, the timed runs, the records.

For each length the configurations run in matrix order (all_off first: its cold run is a real cold run and its
logits are the exact path's). Before the first length that needs them, every configuration of the call is judged on
the verdict prefix, layer by layer in one pass (experiments/verdicts.py); lengths sharing the prefix share the verdict.
A configuration that fails at run time is recorded with its error and the others continue; results are rewritten
after every step, so nothing measured is lost when a later step fails.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import math
import os
from typing import Any, Callable

import numpy as np

from ds4jax import attention as attention_lib
from ds4jax import config as config_lib
from ds4jax import features as features_lib
from ds4jax import mesh as mesh_lib
from ds4jax import model as model_lib
from ds4jax import moe as moe_lib
from ds4jax.features import KNOBS, Features
from ds4jax.quant import policy as quant_policy
from experiments import mutations, processes, run_record, verdicts
from experiments.qualification import checks, inputs, report, store
from experiments.qualification.matrix import Configuration, configurations, exact_features, is_the_reference
from experiments.qualification.options import Options, StartupError, validate, verdict_band_tokens
from experiments.qualification.records import NOT_RUN, Record, Verdict
from experiments.qualification.runner import Clock, ModelRunner, Runner, time_configuration


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
  """What start-up resolved from the options, before the weights exist."""

  cfg: config_lib.DeepseekV4Config
  policy: quant_policy.QuantPolicy
  device_class: str
  # By length: a bound default (features.Capability.when, e.g. sm_90's fused MoE for one-band prompts) can make
  # all_on, and the matrix derived from it, differ between lengths.
  base: dict[int, Features]                 # all_on
  configs: dict[int, list[Configuration]]   # the whole matrix
  selected: dict[int, list[Configuration]]  # --configs (and the planted bugs)
  ids: np.ndarray
  source: dict[str, Any]
  prompt_sha: dict[int, str]
  existing: store.Results | None


def start_up(opts: Options) -> Setup:
  """Every check that needs no weights; raises StartupError/FeatureError."""
  validate(opts)
  cfg = inputs.model_config(opts)
  try:
    pol = quant_policy.get(opts.quant_policy)
    quant_policy.check_config(pol, cfg)
  except ValueError as e:
    raise StartupError(f"--quant_policy: {e}") from e
  too_long = [n for n in opts.lengths if n > cfg.max_position_embeddings]
  if too_long:
    raise StartupError(f"--lengths {too_long} exceed {cfg.name}'s max_position_embeddings="
                       f"{cfg.max_position_embeddings}")
  try:
    dev_cls = opts.device_class or features_lib.device_class()
  except ValueError as e:
    raise StartupError(str(e)) from e
  fits = model_lib.kernel_fits(cfg, pol)  # the bound defaults this model takes
  # FeatureError: an impossible combination
  base = {n: features_lib.resolve(dev_cls, opts.features, fits=fits, tokens=n) for n in opts.lengths}
  try:
    configs = {n: configurations(base[n], cfg, opts.mutations) for n in opts.lengths}
  except ValueError as e:  # a planted bug with no layer of its kind in the model
    raise StartupError(f"--mutations: {e}") from e
  names = list(dict.fromkeys(c.name for n in opts.lengths for c in configs[n] if not c.mutation))
  unknown = [c for c in opts.configs if c not in names]
  if unknown:
    raise StartupError(f"--configs: unknown configuration(s) {unknown}; valid here: {names}")
  ids, source = inputs.prompt_ids(opts, cfg)
  existing = None
  if opts.append and os.path.exists(opts.out):
    try:
      existing = store.load_results(opts.out)
    except StartupError as e:
      raise StartupError(f"--append: {e}") from e
    # Verdicts carry no mesh: a file whose calls ran on another mesh (even one that ended before any record) would
    # lend them to this one.
    meshes = {mesh_lib.normalize((i.get("options") or {}).get("mesh", "")) for i in existing.invocations}
    if meshes - {mesh_lib.normalize(opts.mesh)}:
      raise StartupError(f"--append: {opts.out} was made with --mesh {sorted(meshes)}, not {opts.mesh!r}: a sharded "
                         "run is another matched matrix; use another --out")
  selected = {n: [c for c in configs[n] if c.mutation or not opts.configs or c.name in opts.configs]
              for n in opts.lengths}
  for c in (c for n in opts.lengths for c in selected[n]):
    try:
      moe_lib.check_kernels(cfg, pol, c.features)
      attention_lib.check_kernels(cfg, c.features)
    except ValueError as e:
      raise StartupError(f"configuration {c.name}: {e}") from e
  return Setup(cfg=cfg, policy=pol, device_class=dev_cls, base=base, configs=configs, selected=selected, ids=ids,
               source=source, prompt_sha={n: inputs.sha256_array(ids[:n]) for n in opts.lengths}, existing=existing)


def predicted_cold_s(records: list[Record], n: int, conf: Configuration, ids: np.ndarray,
                      fingerprint: str) -> tuple[float, int] | None:
  """(cold seconds at n tokens, from length) if `conf` was too slow at a shorter length of this matched matrix:
  that cold run scaled linearly with length. It is a lower bound (attention grows faster than linearly) only for
  a cold run that loaded precompiled programs (compile time does not grow with length), so only those count."""
  slower = [r for r in records if r.config == conf.name and r.status == "too_slow" and r.length < n
            and r.timing.cold_loads_precompiled and r.features == conf.features.to_dict()
            and r.weights_fingerprint == fingerprint and r.prompt["sha256"] == inputs.sha256_array(ids[:r.length])]
  if not slower:
    return None
  r = max(slower, key=lambda r: r.length)
  return r.timing.cold_s * n / r.length, r.length


def _done_pairs(opts: Options, setup: Setup, fingerprint: str) -> set[tuple[int, str]]:
  """(length, config) pairs the results file already holds done for this matched matrix: OK with a verdict, or
  too_slow under a limit that would stop them again (not_run pairs are predicted anew each call). Refuses a mixed
  file."""
  done = set()
  for r in setup.existing.records if setup.existing else []:
    conf = {c.name: c for c in setup.configs.get(r.length, [])}.get(r.config)
    why = store.same_run(r, fingerprint, setup.prompt_sha, conf and conf.features.to_dict(), opts.mesh)
    if why and (r.status in ("ok", "too_slow") or {"weights fingerprint", "prompt ids", "mesh"} & set(why)):
      raise StartupError(
          f"{opts.out} holds a record for length {r.length} / {r.config} made with different "
          f"{', '.join(why)}: a matched matrix needs the same weights, prompt and features; use another --out")
    v_tokens = min(r.length, opts.verdict_tokens)
    same_verdict = r.verdict is not None and (r.verdict.tokens, r.verdict.band_tokens) == (
        v_tokens, verdict_band_tokens(opts, v_tokens))
    judged = r.result != NOT_RUN and same_verdict
    if judged and (r.status in ("ok", "not_timed")
                   or (r.status == "too_slow" and 0 < opts.max_cold_s < r.timing.cold_s)):
      done.add(r.key)
  return done


def _by_features(base: dict[int, Features]) -> dict[Features, list[int]]:
  """The lengths of each distinct all_on."""
  out: dict[Features, list[int]] = {}
  for n, f in base.items():
    out.setdefault(f, []).append(n)
  return out


def _log_plan(opts: Options, setup: Setup, plan, todo, log) -> None:
  lengths: dict[tuple[str, Features], list[int]] = {}  # a configuration's name may mean other features elsewhere
  for n in opts.lengths:
    for c in setup.selected[n]:
      lengths.setdefault((c.name, c.features), []).append(n)
  log(f"plan: lengths {list(opts.lengths)} x {len({name for name, _ in lengths})} configurations = {len(plan)} "
      f"runs; {len(plan) - len(todo)} already done in {opts.out} (skipped), {len(todo)} to run; "
      f"cold + {opts.warmups} warm-ups + {opts.repeats} timed runs each (planted bugs: judged only)")
  for (name, _), ns in lengths.items():
    c = next(c for c in setup.selected[ns[0]] if c.name == name)
    at = f" at {ns}" if len(ns) < len(opts.lengths) else ""
    extra = f" (also off: {', '.join(c.also_off)})" if c.also_off else ""
    bug = f" + planted bug {c.mutation} in layer {c.mutation_layer}" if c.mutation else ""
    log(f"  {c.name}{at}{extra}: on={c.features.on() or 'none'}{bug}")
  todo_keys = {(n, c.name) for n, c in todo}
  for n in opts.lengths:
    skipped = [c.name for c in setup.selected[n] if (n, c.name) not in todo_keys]
    if skipped:
      log(f"  length {n}: skipping {skipped} (already done)")
  prefix_lengths = [n for n in opts.lengths if opts.exact_max_tokens and n > opts.exact_max_tokens]
  log(f"verdicts on the first min(length, {opts.verdict_tokens}) tokens; final-position parity vs the exact path at "
      f"full length for {[n for n in opts.lengths if n not in prefix_lengths]}"
      + (f", on a {opts.parity_prefix_tokens}-token prefix for {prefix_lengths} (> --exact_max_tokens="
         f"{opts.exact_max_tokens})" if prefix_lengths else "")
      + f"; upstream's KL gate {opts.kl_gate} reported beside them")


class ExactFinal:
  """The exact path's final logits for one length: full length once, or a prefix where it does not fit."""

  def __init__(self, compute: Callable[[np.ndarray], np.ndarray], ids: np.ndarray, opts: Options, clock: Clock,
               prefixes: store.ExactPrefixes):
    self.compute, self.ids, self.clock, self.prefixes = compute, ids, clock, prefixes
    self.length, self.prefix = len(ids), min(opts.parity_prefix_tokens, len(ids))
    self.full: np.ndarray | None = None
    self.why_prefix: str | None = None
    self.error: str | None = None
    if opts.exact_max_tokens and self.length > opts.exact_max_tokens:
      self.fall_back(f"{self.length} tokens exceed --exact_max_tokens={opts.exact_max_tokens}")

  def fall_back(self, why: str) -> None:
    self.why_prefix = why
    self.clock.say(f"!!! EXACT PATH AT {self.length} TOKENS: {why}. Final-position parity at this length is checked "
                   f"on the first {self.prefix} tokens instead (config and exact path both run on that prefix). !!!")

  def offer(self, logits: np.ndarray) -> None:
    """The all_off configuration's own full-length logits are the exact path's."""
    if self.full is None and self.why_prefix is None:
      self.full = logits

  def offer_failure(self, e: BaseException) -> None:
    if self.full is None and self.why_prefix is None:
      if checks.is_oom(e):
        self.fall_back("out of memory (RESOURCE_EXHAUSTED)")
      else:
        self.error = checks.error_text(e)

  def reference(self) -> np.ndarray | None:
    """Full-length exact logits, or None when the prefix is what gets compared. Raises if the exact path failed."""
    if self.error:
      raise RuntimeError(f"exact path failed at {self.length} tokens: {self.error}")
    if self.full is None and self.why_prefix is None:
      self.clock.say(f"  exact path at {self.length} tokens (once, reused by every configuration)")
      try:
        self.full = self.compute(self.ids)
      except Exception as e:  # noqa: BLE001 -- OOM falls back to the prefix; anything else fails the parity
        self.offer_failure(e)
        return self.reference()
    return self.full

  def prefix_reference(self) -> np.ndarray:
    if self.prefix >= self.length:
      raise RuntimeError(f"exact path does not fit at {self.length} tokens and --parity_prefix_tokens="
                         f"{self.prefix} is not shorter")
    return self.prefixes.get(self.prefix)


def _prefix_parity(runner: Runner, m, ids, conf: Configuration, exact: ExactFinal, opts: Options,
                   out_p: np.ndarray | None, reason: str):
  """Final-position parity on the first exact.prefix tokens; `out_p`: the configuration's logits there if known."""
  ref_p = exact.prefix_reference()
  source = f"position {exact.prefix - 1} of this configuration's full-length cold run"
  t0 = runner.now()
  if out_p is None and conf.features == exact.prefixes.features:  # the exact path itself: its stored prefix logits
    out_p, source = ref_p, "the exact path's prefix logits (this configuration is the exact path)"
  elif out_p is None:
    out_p = runner.logits(m, ids[:exact.prefix], conf.features)
    source = f"a separate {exact.prefix}-token run of this configuration"
  return checks.final_parity(out_p, ref_p, opts.kl_gate, prefix_tokens=exact.prefix, prefix_reason=reason,
                             prefix_logits_from=source, prefix_run_s=runner.now() - t0,
                             prefix_logits_sha256=inputs.sha256_array(out_p))


def _run_one(runner: Runner, m, ids, conf: Configuration, exact: ExactFinal, opts: Options,
             clock: Clock) -> dict[str, Any]:
  """Times one configuration and checks its final position. Run-time failures are returned, not raised; one that
  runs out of memory at full length is still checked on the parity prefix."""
  rec: dict[str, Any] = dict(status="failed")
  is_exact = conf.features == exact.prefixes.features
  try:
    logits, out_p, rec["timing"] = time_configuration(runner, m, ids, conf.features, opts, clock,
                                                      exact.prefix if exact.why_prefix else None)
  except Exception as e:  # noqa: BLE001 -- an OOM or unsupported shape in one configuration must not stop the rest
    rec.update(error=checks.error_text(e), error_kind="oom" if checks.is_oom(e) else type(e).__name__)
    if is_exact:
      exact.offer_failure(e)
    if checks.is_oom(e) and exact.prefix < exact.length:
      clock.say(f"    out of memory at {exact.length} tokens: checking the final position on the first {exact.prefix}")
      try:
        rec["parity"] = _prefix_parity(runner, m, ids, conf, exact, opts, None,
                                       exact.why_prefix or "the full-length run ran out of memory")
      except Exception as e2:  # noqa: BLE001 -- the timing error stands; say why there is no parity either
        rec["error"] += f"; parity on the {exact.prefix}-token prefix: {checks.error_text(e2)}"
    return rec
  rec["logits_sha256"] = inputs.sha256_array(logits)
  if is_exact:
    exact.offer(logits)
  try:
    ref = exact.reference()
    if ref is not None:
      rec["parity"] = checks.final_parity(logits, ref, opts.kl_gate)
    else:  # out_p is None when the exact path fell back to a prefix after this configuration's cold run
      rec["parity"] = _prefix_parity(runner, m, ids, conf, exact, opts, out_p, exact.why_prefix)
  except Exception as e:  # noqa: BLE001 -- same: record and continue
    rec.update(error=f"parity: {checks.error_text(e)}", error_kind="parity_oom" if checks.is_oom(e) else "parity")
    return rec
  rec["status"] = "too_slow" if rec["timing"].too_slow else "ok"
  return rec


def _unjudged(results: store.Results, setup: Setup, v_tokens: int, configs: list[Configuration],
              fingerprint: str, band: int) -> list[Configuration]:
  """The configurations with no verdict on file for the first v_tokens prompt tokens (runs in bands of `band`)."""
  sha = inputs.sha256_array(setup.ids[:v_tokens])
  return [c for c in configs
          if results.verdict_for(v_tokens, c.features.to_dict(), c.mutation, fingerprint, sha, band) is None]


def _verdict_programs(opts: Options, setup: Setup, results: store.Results, todo, fingerprint: str):
  """(free, pinned, scored) runs of the verdict passes this call will make (ds4jax.prefill.precompile), in the
  verdicts' bands (--verdict_bands): scored, the exact path recording its scores (one band); pinned, each judged
  configuration, the bf16 reference math (where a bound needs it) and (for planted bugs) the exact path, pinned to
  the exact path's decisions, per layer and in the teacher-forced KL's prefills; free, the same configurations
  unpinned, and with planted bugs the exact path's one band (the layers no configuration judges)."""
  exact = exact_features(setup.device_class)
  bf16_reference = dataclasses.replace(exact, bf16_matmul=True)
  free, pinned, scored = [], [], []
  for v in sorted({min(n, opts.verdict_tokens) for n, _ in todo}):
    band = verdict_band_tokens(opts, v)
    judged = [c for c in _unjudged(results, setup, v, [c for _, c in todo], fingerprint, band)
              if not is_the_reference(c, v, band)]
    if not judged:
      continue
    scored.append((v, exact))
    fast = list(dict.fromkeys(c.features for c in judged if not c.mutation))
    bugs = [exact] * any(c.mutation for c in judged)
    kl = any(not c.mutation or c.mutation in mutations.CARRY for c in judged)
    on_file = _reference_kl(results, fingerprint, inputs.sha256_array(setup.ids[:v]), v, setup.device_class, band)
    reference = [bf16_reference] * (any(f.bf16_matmul for f in fast) or (kl and on_file is None))
    free += dict.fromkeys([(v, verdicts.banded_features(f, band)) for f in [*fast, *bugs]] + [(v, f) for f in bugs])
    pinned += [(v, verdicts.banded_features(f, band)) for f in dict.fromkeys([*fast, *reference, *bugs])]
  return free, pinned, scored


def _reference_kl(results: store.Results, fingerprint: str, sha: str, v_tokens: int, device_cls: str,
                  band: int) -> float | None:
  """The bf16 reference math's teacher-forced KL that a verdict on file measured on these weights, prompt tokens,
  bands and device class (the same prefill, pinned to the same exact-path decisions), or None."""
  for v in results.verdicts:
    kl = (v.teacher_forced or {}).get("reference_bf16_mean_kl")
    same = (v.weights_fingerprint, v.prompt_sha256, v.tokens, v.band_tokens) == (fingerprint, sha, v_tokens, band)
    if same and v.features and v.features.get("device_class") == device_cls and kl is not None and math.isfinite(kl):
      return float(kl)  # (a NaN on file would bound every later verdict: it is measured again)
  return None


def _judge(runner: Runner, m, setup: Setup, results: store.Results, v_tokens: int, configs: list[Configuration],
           fingerprint: str, clock: Clock, tried: set[tuple[int, str, Features]], save: Callable[[], None],
           band: int) -> None:
  """Judges the configurations without a verdict on the first v_tokens prompt tokens (and not tried in this
  process), in one pass; every verdict (or why it could not be taken) goes into `results.verdicts`. The per-layer
  verdicts are saved before the teacher-forced KL (checks.layers_only) and replaced by the whole verdict."""
  sha = inputs.sha256_array(setup.ids[:v_tokens])
  meta = lambda c: dict(tokens=v_tokens, config=c.name, features=c.features.to_dict(), mutation=c.mutation,
                        mutation_layer=c.mutation_layer, weights_fingerprint=fingerprint, prompt_sha256=sha,
                        band_tokens=band)
  todo = [c for c in _unjudged(results, setup, v_tokens, configs, fingerprint, band)
          if (v_tokens, c.name, c.features) not in tried]
  if not todo:
    return
  tried |= {(v_tokens, c.name, c.features) for c in todo}
  # The runner keys its judgements by name; all_on (and its kills) may stand for other features at other lengths.
  names = [c.name for c in todo]
  todo = [(c.name + (f"#{names[:i + 1].count(c.name)}" if names.count(c.name) > 1 else ""), c)  # (label, c)
          for i, c in enumerate(todo)]
  clock.say(f"verdicts on the first {v_tokens} tokens: {[lab for lab, _ in todo]} (one pass over the layers)")
  t0 = runner.now()
  partial: dict[str, verdicts.Judgement] = {}  # the per-layer judgements by label, saved before the teacher-forced KL
  saved: list[Verdict] = []

  def keep_layers(layers: dict[str, verdicts.Judgement]) -> None:
    partial.update({lab: layers[lab] for lab, _ in todo if lab in layers})
    saved.extend(checks.layers_only(partial[lab], **meta(c)) for lab, c in todo if lab in partial)
    results.verdicts.extend(saved)
    save()
    clock.say(f"  per-layer verdicts saved ({len(saved)}); the teacher-forced KL next")

  try:
    judged = runner.judge(m, setup.ids[:v_tokens], [dataclasses.replace(c, name=lab) for lab, c in todo],
                          log=lambda s: clock.say(f"  {s}"), on_layers=keep_layers,
                          reference_kl=_reference_kl(results, fingerprint, sha, v_tokens,
                                                     todo[0][1].features.device_class, band),
                          band_tokens=band)
  except Exception as e:  # noqa: BLE001 -- e.g. out of memory: every record says why it has no verdict
    judged = {lab: e for lab, _ in todo}
  results.verdicts = [v for v in results.verdicts if not any(v is s for s in saved)]
  wall = (runner.now() - t0) / len(todo)
  for lab, c in todo:
    j = judged[lab]
    if not isinstance(j, BaseException):
      v = checks.as_verdict(j, **meta(c), wall_s=wall)
    elif lab in partial:  # the KL failed: its per-layer verdicts stand beside why
      v = checks.layers_only(partial[lab], f"the teacher-forced KL failed: {checks.error_text(j)}", **meta(c),
                             wall_s=wall)
    else:
      v = checks.not_run(f"the verdict pass failed: {checks.error_text(j)}", **meta(c), wall_s=wall)
    if v.result != NOT_RUN:  # it supersedes the attempts on file that ended without a verdict
      key = lambda x: (x.config, x.tokens, x.features, x.mutation, x.weights_fingerprint, x.prompt_sha256)
      results.verdicts = [x for x in results.verdicts if x.result != NOT_RUN or key(x) != key(v)]
    results.verdicts.append(v)
    clock.say(f"  {lab}: {v.result}" + (f" ({'; '.join(v.reasons)[:300]})" if v.reasons else ""))


def run(opts: Options, *, model=None, log: Callable[[str], None] | None = None,
        runner: Runner | None = None) -> store.Results:
  """Runs the qualification matrix; returns the results (also written to opts.out, plus the .md table).

  `model` skips building the weights (tests, notebooks); it must match opts' preset/policy/dtype. `runner` runs the
  model (default ModelRunner; tests inject a stand-in). Raises StartupError/FeatureError before any prefill for a
  bad input; a configuration that fails at run time is recorded with its error and the others continue.
  """
  log = log or (lambda s: print(s, flush=True))
  runner = runner or ModelRunner()
  setup = start_up(opts)
  cfg, dev_cls = setup.cfg, setup.device_class
  env = run_record.environment()
  log(f"prefill qualification: {cfg.name} policy={setup.policy.name} dtype={opts.dtype} "
      f"{'checkpoint=' + opts.checkpoint if opts.checkpoint else 'random weights seed=' + str(opts.seed)}; "
      f"{env['device_kind']} ({dev_cls}), jax {env['jax']}, commit {env['git_commit'][:10]}")
  for base, ns in _by_features(setup.base).items():
    at = f" at {ns}" if len(ns) < len(opts.lengths) else ""
    log(f"all_on{at} switches: {base.on() or 'none'}; knobs: " + ", ".join(f"{k}={getattr(base, k)}" for k in KNOBS))
    log(features_lib.describe_states(base))
  t0 = runner.now()
  m = model if model is not None else inputs.build_model(opts, cfg, log)
  log(f"weights ready ({runner.now() - t0:.1f}s); fingerprinting them")
  gc.collect()
  gc.freeze()  # what exists now is never garbage: the collections between timed runs skip it (~0.2 s each in tests)
  try:
    return _run(opts, setup, m, env, log, runner, t_begin=t0)
  finally:
    gc.unfreeze()


def _run(opts: Options, setup: Setup, m, env: dict, log: Callable[[str], None], runner: Runner,
         t_begin: float) -> store.Results:
  fingerprint = inputs.weights_fingerprint(m)
  done = _done_pairs(opts, setup, fingerprint)
  if setup.existing is None and os.path.exists(opts.out):
    log(f"note: overwriting {opts.out} (pass --append to keep its records)")
  # A planted bug is judged on a verdict prefix, never timed: one record per prefix, at its first length.
  first_of_prefix = {min(opts.verdict_tokens, n): n for n in sorted(opts.lengths, reverse=True)}
  plan = [(n, c) for n in opts.lengths for c in sorted(setup.selected[n], key=lambda c: c.name != "all_off")
          if not c.mutation or first_of_prefix[min(opts.verdict_tokens, n)] == n]
  todo = [(n, c) for n, c in plan if (n, c.name) not in done]
  _log_plan(opts, setup, plan, todo, log)

  results = setup.existing or store.Results()
  options = json.loads(json.dumps(dataclasses.asdict(opts) | dict(features=dict(opts.features))))  # as on file
  results.invocations.append(dict(date=env["date"], env=env, options=options, plan=[[n, c.name] for n, c in todo]))
  common = dict(model=dict(name=setup.cfg.name, preset=opts.preset, checkpoint=opts.checkpoint,
                           policy=setup.policy.name, dtype=opts.dtype, seed=opts.seed if opts.checkpoint is None
                           else None), weights_fingerprint=fingerprint, options=options, env=env)
  save = lambda: store.save(opts.out, results)
  save()
  clock = Clock(sum(n for n, c in todo if not c.mutation), log, runner.now)
  exact_feats = exact_features(setup.device_class)
  prefixes = store.ExactPrefixes(setup.ids, exact_feats, fingerprint, store.exact_cache_path(opts.out),
                                 lambda ids, noise: runner.logits(m, ids, exact_feats, input_noise=noise), clock.say)
  results.invocations[-1]["exact_prefix_runs"] = prefixes.runs  # filled in as they happen

  def predicted_too_slow(n: int, conf: Configuration, full_exact: bool) -> tuple[float, int] | None:
    if not opts.max_cold_s or (conf.features == exact_feats and full_exact):
      return None  # the exact path's cold run is every configuration's reference: it runs anyway
    p = predicted_cold_s(results.records, n, conf, setup.ids, fingerprint)
    return p if p and p[0] > opts.max_cold_s else None

  timed = [(n, c) for n, c in todo if not c.mutation]
  to_compile = [(n, c) for n, c in timed if not predicted_too_slow(n, c, full_exact=True)]
  verdict_free, verdict_pinned, verdict_scored = _verdict_programs(opts, setup, results, todo, fingerprint)
  timed_runs = [(n, c.features) for n, c in to_compile]
  for n in sorted({n for n, _ in to_compile}):  # and the exact path each length will need
    p = min(opts.parity_prefix_tokens, n) if opts.exact_max_tokens and n > opts.exact_max_tokens else n
    if (p, exact_feats) not in timed_runs and not prefixes.has(p):
      timed_runs.append((p, exact_feats))
  compiled: set = set()  # the programs of both phases: one that both need is compiled once

  def precompile(runs, **verdict_runs) -> None:
    if not opts.precompile_workers or not (runs or verdict_runs.get("scored")):
      return
    t0 = runner.now()
    count = runner.precompile(m, runs, opts.precompile_workers, clock.say, **verdict_runs, seen=compiled)
    done = results.invocations[-1].get("precompile") or dict(programs=0, wall_s=0.0, workers=opts.precompile_workers)
    results.invocations[-1]["precompile"] = done | dict(programs=done["programs"] + count,
                                                        wall_s=done["wall_s"] + runner.now() - t0)
    save()

  # The verdict pass's programs first, the timed runs' after the verdicts: a call that ends while those compile has
  # saved its verdicts, and the next call compiles only what the timing needs.
  precompile(verdict_free, pinned=verdict_pinned, scored=verdict_scored)
  exact_by_len: dict[int, ExactFinal] = {}
  called: set[tuple[Features, int]] = set()  # (features, length) already run in this process
  floors_tried: set[int] = set()  # noise floors (by parity tokens) measured or attempted in this process
  judged: set[tuple[int, str, Features]] = set()  # (verdict tokens, config, features) judged or tried in this process
  for i, (n, conf) in enumerate(todo):
    if opts.stop_after_s and runner.now() - t_begin > opts.stop_after_s:
      left = [[k, c.name] for k, c in todo[i:]]
      results.invocations[-1]["not_started"] = left
      save()
      log(f"stopping: --stop_after_s={opts.stop_after_s:g} passed ({runner.now() - t_begin:.0f}s since the start); "
          f"{len(left)} runs not started: {', '.join(f'{k}/{c}' for k, c in left)}. Run again with --append to "
          f"continue.")
      break
    v_tokens = min(n, opts.verdict_tokens)
    # One verdict per feature set (and planted bug): a kill at one band can be another length's all_on.
    same_prefix: dict[tuple[Features, str | None], Configuration] = {}
    for k, c in todo:
      if min(k, opts.verdict_tokens) == v_tokens:
        same_prefix.setdefault((c.features, c.mutation), c)
    _judge(runner, m, setup, results, v_tokens, list(same_prefix.values()), fingerprint, clock, judged, save,
           verdict_band_tokens(opts, v_tokens))
    save()
    if not conf.mutation and timed_runs is not None:
      precompile(timed_runs)
      timed_runs = None
    if n not in exact_by_len:
      exact_by_len[n] = ExactFinal(lambda ids: runner.logits(m, ids, exact_feats), setup.ids[:n], opts, clock,
                                   prefixes)
    exact = exact_by_len[n]
    clock.say(f"{i + 1}/{len(todo)} length {n} {conf.name}: start ({clock.eta()})")
    t_start = runner.now()
    first_call = (conf.features, n) not in called and not (conf.features == exact_feats and exact.full is not None)
    predicted = predicted_too_slow(n, conf, full_exact=exact.why_prefix is None)
    if conf.mutation:
      result: dict[str, Any] = dict(status="not_timed")
    elif predicted:
      result = dict(status="not_run", error=(
          f"not run: its cold run would take >= {predicted[0]:.0f}s (too slow at {predicted[1]} tokens, scaled by "
          f"length) > --max_cold_s={opts.max_cold_s:g}"), error_kind="predicted_too_slow",
          predicted_cold_s=predicted[0])
    else:
      result = _run_one(runner, m, setup.ids[:n], conf, exact, opts, clock)
      called.add((conf.features, n))
    if result.get("timing"):
      result["timing"] = dataclasses.replace(result["timing"], cold_is_first_call=first_call,
                                             cold_loads_precompiled=bool(opts.precompile_workers))
    clock.done += 0 if conf.mutation else n
    band = verdict_band_tokens(opts, v_tokens)
    verdict = results.verdict_for(v_tokens, conf.features.to_dict(), conf.mutation, fingerprint,
                                  inputs.sha256_array(setup.ids[:v_tokens]), band)
    verdict = verdict or next(v for v in reversed(results.verdicts) if v.tokens == v_tokens
                              and v.features == conf.features.to_dict() and v.mutation == conf.mutation
                              and v.band_tokens == band)
    rec = Record(config=conf.name, length=n, killed=conf.killed, also_off=conf.also_off,
                 features=conf.features.to_dict(), switches_on=tuple(conf.features.on()),
                 switch_states=features_lib.switch_states(conf.features), mutation=conf.mutation,
                 prompt=dict(source=setup.source, length=n, sha256=setup.prompt_sha[n]), **common,
                 finished=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 wall_s=runner.now() - t_start, verdict=verdict, **result)
    results.put(rec)
    save()
    n_par = rec.parity.prefix_tokens or n if rec.parity else n
    _noise_floor(results, opts, setup, prefixes, exact, fingerprint, rec, n_par, floors_tried, clock)
    save()
    gc.collect()
    clock.say(f"{i + 1}/{len(todo)} length {n} {conf.name}: {report.outcome(rec)} ({clock.eta()})")
  log("")
  log(report.markdown_table(results))
  if processes.writes():  # other processes compute the same results and write nothing
    log(f"results: {opts.out} and {store.markdown_path(opts.out)}")
  log(f"verdicts: {report.summary_line(results)}")
  return results


def _noise_floor(results, opts, setup, prefixes, exact, fingerprint, rec, n_par, floors_tried, clock) -> None:
  """Measures the noise floor at n_par tokens unless a current one is on file (or was tried in this process)."""
  floor = results.noise_floor.get(str(n_par))
  current = (floor is not None and floor.input_noise == opts.noise_floor_eps and floor.kl is not None
             and floor.weights_fingerprint == fingerprint
             and floor.prompt_sha256 == inputs.sha256_array(setup.ids[:n_par]))
  if not opts.noise_floor_eps or not rec.parity or current or n_par in floors_tried:
    return
  floors_tried.add(n_par)  # a floor that failed is retried by the next call, not by every configuration
  ref = exact.prefix_reference if n_par < exact.length else exact.reference
  floor = results.noise_floor[str(n_par)] = checks.noise_floor(prefixes, n_par, ref, opts.noise_floor_eps,
                                                               opts.kl_gate)
  clock.say(f"  noise floor at {n_par} tokens (input noise {opts.noise_floor_eps:.1e}): " + (
      f"NMSE {floor.nmse:.2e} KL {floor.kl:.2e}" if floor.kl is not None else f"FAILED {floor.error[:200]}"))
