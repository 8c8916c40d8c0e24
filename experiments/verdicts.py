"""Per-layer verdicts of a configuration against the exact path: pinned parity and decision accounting.

For each layer, on the exact path's input streams X_l (nothing accumulated from earlier layers):

  pinned parity   the layer runs with its routing and indexer choices pinned to the exact path's; the NMSE of its
                  update (Y - X_l) against the exact update. PASS when it is at most BF16_FACTOR times the NMSE of
                  the reference math with bf16 operands, pinned the same way, and at most ABS_CAP; a configuration
                  on f32 operands is held to F32_BOUND instead.
  decisions       the layer runs unpinned; every routing or indexer choice that differs from the exact path's must
                  be a near-tie in the exact scores: the gap between what it dropped and what it took at most
                  NEAR_TIE_ULPS roundings of the configuration's operand precision at that token's score scale.
                  Any other flip FAILs, named by layer, position and gap; on a hash-routed layer (experts by token
                  id) every route flip does.

End to end, with every layer's choices pinned to the exact path's:

  teacher-forced KL  KL(exact || configuration) of the next-token distributions at every position of the prompt,
                  averaged (upstream's gate is such a mean, docs/upstream.md §7.4), through the configuration's own
                  banded prefill. PASS when at most KL_FACTOR times that of the reference math with bf16 operands.
                  Upstream's absolute gate (0.006) is reported beside it, as information.

`band_tokens` splits a prompt no longer than one band into bands of that size (banded_features) for the
configuration's runs and the bf16 reference math's, per layer and end to end, so that what runs only across bands
(the carried layer state, weights stationary, the MoE over bands, query chunks) is judged too; the exact path runs
one band.

A kernel that is wrong at some shape shows as a layer whose pinned error is far above the rounding of its operands;
a wrong indexer or router as flips that are not near-ties; a wrong carry between bands as a layer whose pinned error
is too large in bands, and as a teacher-forced KL above the reference's. `run_layer` is the configuration under test,
injectable (the mutation suite plants bugs there): run_layer(i, block, X, tokens, features, pinned) -> (Y, Decisions)
over the whole prompt in the bands `features` say, by default the prefill's own programs (layer_in_bands); end to
end a planted bug runs as its own model (`models`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Collection, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax import features as features_lib
from ds4jax import metrics
from ds4jax import prefill as prefill_lib
from ds4jax.config import Routing
from ds4jax.decisions import Decisions

BF16_FACTOR = 4.0
F32_BOUND = 1e-9       # f32 operands: rounding only (the kernels measure ~1e-13 in interpret mode)
ABS_CAP = 1e-3
NEAR_TIE_ULPS = 16
KL_FACTOR = 3.0
UPSTREAM_KL_GATE = 0.006  # upstream's absolute teacher-forced mean-KL gate: reported, not judged
KL_ROWS = 512          # positions per KL step on the device ([rows, vocab] f32 temporaries)
OPERAND_EPS = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8}


@dataclasses.dataclass(frozen=True)
class Flip:
  layer: int
  kind: str          # "route" | "index"
  position: int
  gap: float         # exact score of the best choice dropped minus that of the worst choice taken
  tolerance: float


@dataclasses.dataclass(frozen=True)
class LayerVerdict:
  layer: int
  attention: str
  routing: str
  update_nmse: float            # pinned
  bound: float                  # what update_nmse must not exceed
  reference_bf16_nmse: float | None
  route_flips: int
  index_flips: int
  bad_flips: tuple[Flip, ...]
  bands: int = 1                # bands the configuration ran the layer in

  @property
  def passed(self) -> bool:
    return self.update_nmse <= self.bound and not self.bad_flips


def default_run_layer(i, block, X, tokens, features, pinned):
  del i
  return prefill_lib.layer_in_bands(block, X, tokens, features, pinned)


@jax.jit
def _update_errors(out, ref, x_in):
  d = (out - ref).astype(jnp.float32)
  u = (ref - x_in).astype(jnp.float32)
  return jnp.sum(d * d), jnp.sum(u * u), jnp.max(jnp.abs(d))


def update_errors(out, ref, x_in) -> tuple[float, float]:
  """(NMSE of a layer's update (out - x_in) against the exact update (ref - x_in), max abs of out - ref), on the
  device: the differences of f32 streams are exact where they are close, so f32 sums suffice."""
  num, den, max_abs = _update_errors(out, ref, x_in)
  return metrics.nmse_of_sums(float(num), float(den)), float(max_abs)


def _members(ids: np.ndarray, width: int) -> np.ndarray:
  """[S, k] ids (-1 = none) -> [S, width] bool membership."""
  mask = np.zeros((ids.shape[0], width), bool)
  rows, cols = np.nonzero(ids >= 0)
  mask[rows, ids[rows, cols]] = True
  return mask


def flips(exact_ids, exact_scores, got_ids, eps: float, layer: int, kind: str,
          ties: bool = True) -> tuple[int, list[Flip]]:
  """(how many choices differ from the exact path's, the flips that are not near-ties in the exact scores).
  `ties` False: the exact path does not choose by these scores (hash routing picks by token id), so no difference
  is a tie. An id outside the scores (e.g. a kernel's "none" sentinel other than -1) is never a tie."""
  scores = np.asarray(exact_scores, np.float64)
  got_ids = np.asarray(got_ids)
  outside = (got_ids >= scores.shape[1]).any(axis=1)
  want = _members(np.asarray(exact_ids), scores.shape[1])
  got = _members(np.where(got_ids >= scores.shape[1], -1, got_ids), scores.shape[1])
  dropped, taken = want & ~got, got & ~want
  n = int(dropped.sum())
  bad = []
  for t in np.nonzero(dropped.any(axis=1) | taken.any(axis=1) | outside)[0]:
    s = scores[t]
    top = np.max(s[dropped[t]]) if dropped[t].any() else -np.inf
    low = np.min(s[taken[t]]) if taken[t].any() else np.inf
    # taking an invisible row (or an id past the scores) is never a tie, nor any difference where scores don't pick
    gap = float(top - low) if np.isfinite(low) and ties and not outside[t] else np.inf
    finite = s[np.isfinite(s)]
    tol = NEAR_TIE_ULPS * eps * (float(np.max(np.abs(finite))) if finite.size else 0.0)
    if not gap <= tol:
      bad.append(Flip(layer, kind, int(t), gap, tol))
  return n, bad


def _strip(d: Decisions) -> Decisions:
  return dataclasses.replace(d, route_scores=None, index_scores=None)


@dataclasses.dataclass(frozen=True)
class TeacherForced:
  tokens: int
  mean_kl: float                # over every position, decisions pinned
  max_kl: float
  worst_position: int
  reference_bf16_mean_kl: float
  bound: float                  # KL_FACTOR x the reference's
  upstream_gate: float = UPSTREAM_KL_GATE
  bands: int = 1                # bands the configuration's prefill took

  @property
  def passed(self) -> bool:
    return self.mean_kl <= self.bound  # NaN fails


@dataclasses.dataclass(frozen=True)
class Judgement:
  """Every verdict of one configuration on one prompt."""
  layers: tuple[LayerVerdict, ...]
  teacher_forced: TeacherForced | None

  @property
  def passed(self) -> bool:
    return all(v.passed for v in self.layers) and (self.teacher_forced is None or self.teacher_forced.passed)

  def reasons(self) -> list[str]:
    """Why it fails, one line per failed check (empty when it passes)."""
    out = []
    for v in self.layers:
      if not v.update_nmse <= v.bound:
        out.append(f"layer {v.layer} ({v.attention}, {v.routing}): pinned update NMSE {v.update_nmse:.2e} > bound "
                   f"{v.bound:.2e}{f' in {v.bands} bands' if v.bands > 1 else ''}")
      if v.bad_flips:
        f = v.bad_flips[0]
        kinds = " / ".join(f"{sum(g.kind == k for g in v.bad_flips)} {k}" for k in ("route", "index")
                           if any(g.kind == k for g in v.bad_flips))
        out.append(f"layer {v.layer}: {kinds} flips not near-ties (first, {f.kind}, at position {f.position}: gap "
                   f"{f.gap:.2e} > {f.tolerance:.2e})")
    t = self.teacher_forced
    if t is not None and not t.passed:
      out.append(f"teacher-forced KL {t.mean_kl:.2e} > {KL_FACTOR:g} x reference_bf16's {t.reference_bf16_mean_kl:.2e}")
    return out


def banded_features(features: features_lib.Features, band_tokens: int) -> features_lib.Features:
  """What a configuration runs in the verdicts: its features in bands of `band_tokens` where it runs in bands at all
  (0: its own band size; a configuration with prefill_band_tokens=0 stays one band, as it would run). Query chunks
  scale with the band: as many per verdict band as the configuration attends a band in; one that runs one band in
  chunks (the whole prompt, when longer than a chunk) attends the prefix in chunks of `band_tokens`. So the chunk
  loop it runs at long prompts is judged too."""
  if not band_tokens:
    return features
  band, chunk = features.prefill_band_tokens, features.long_context_chunk
  if chunk and not band:
    chunk = band_tokens
  elif chunk and chunk < band:
    per_band = band // chunk
    chunk = max(c for c in range(1, band_tokens // per_band + 1) if band_tokens % c == 0)  # whole chunks a band
  return dataclasses.replace(features, prefill_band_tokens=band_tokens if band else 0, long_context_chunk=chunk)


def n_bands(n_tokens: int, features: features_lib.Features) -> int:
  return -(-n_tokens // prefill_lib.band_size(n_tokens, features))


def _layer_pass(m, ids: np.ndarray, configs: Mapping[str, features_lib.Features], runners: Mapping[str, Callable],
                log: Callable[[str], None], only: Mapping[str, set[int]], band_tokens: int):
  """Layer by layer on the exact path's streams: every configuration's verdict at each judged layer (all, or those
  in `only[name]`), its runs in bands of `band_tokens` (banded_features). Returns (verdicts by configuration, the
  exact path's decisions per layer, its final streams, the error of each configuration whose run failed)."""
  dev_cls = next(iter(configs.values())).device_class
  exact = dataclasses.replace(features_lib.REFERENCE, device_class=dev_cls)
  bf16_reference = banded_features(dataclasses.replace(exact, bf16_matmul=True), band_tokens)
  toks = jnp.asarray(ids, jnp.int32)
  B = len(ids)
  X = m.embed_streams(toks)
  out: dict[str, list[LayerVerdict]] = {name: [] for name in configs}
  errors: dict[str, Exception] = {}  # a configuration whose run failed (e.g. out of memory) is judged no further
  pinned_all = []
  for i, block in enumerate(m.layers):
    here = {name: banded_features(c, band_tokens) for name, c in configs.items()
            if (name not in only or i in only[name]) and name not in errors}
    judged = bool(here)
    ref, _, want = prefill_lib.layer_step(block, jnp.copy(X), toks, 0, block.attn.empty_cache(B, B), exact,
                                          record_scores=judged)
    pinned = _strip(want)
    pinned_all.append(pinned)
    if not judged:
      X = ref
      continue
    ref_bf16 = None
    if any(c.bf16_matmul for c in here.values()):
      y, _ = prefill_lib.layer_in_bands(block, jnp.copy(X), toks, bf16_reference, pinned)
      ref_bf16, _ = update_errors(y, ref, X)
    for name, config in here.items():
      run_layer = runners.get(name, default_run_layer)
      try:
        got, _ = run_layer(i, block, jnp.copy(X), toks, config, pinned)
        _, free = run_layer(i, block, jnp.copy(X), toks, config, None)
      except Exception as e:  # noqa: BLE001 -- this configuration's verdict says why; the others go on
        errors[name] = e
        log(f"{name}: layer {i} failed: {type(e).__name__}: {str(e)[:300]}")
        continue
      nmse, _ = update_errors(got, ref, X)
      bound = min(BF16_FACTOR * ref_bf16, ABS_CAP) if config.bf16_matmul else F32_BOUND
      eps = OPERAND_EPS[jnp.dtype(config.matmul_dtype).name]
      n_route, bad = flips(want.route_ids, want.route_scores, free.route_ids, eps, i, "route",
                           ties=m.cfg.routing[i] == Routing.TOPK)
      n_index = 0
      if want.index_rows is not None:
        n_index, bad_index = flips(want.index_rows, want.index_scores, free.index_rows, eps, i, "index")
        bad += bad_index
      v = LayerVerdict(i, m.cfg.attention[i].value, m.cfg.routing[i].value, nmse, bound,
                       ref_bf16 if config.bf16_matmul else None, n_route, n_index, tuple(bad), n_bands(B, config))
      out[name].append(v)
      log(f"{name + ': ' if len(configs) > 1 else ''}layer {i:2d} {v.attention:6s} {v.routing:4s}: pinned update "
          f"NMSE {nmse:.1e} (bound {bound:.1e}), {n_route} route / {n_index} index flips, {len(bad)} not near-ties"
          f"{f' ({v.bands} bands)' if v.bands > 1 else ''}: {'PASS' if v.passed else 'FAIL'}")
    X = ref
  return out, pinned_all, X, errors


def layer_verdicts(m, ids: np.ndarray, config: features_lib.Features,
                   run_layer: Callable = default_run_layer, log: Callable[[str], None] = lambda s: None,
                   only: set[int] | None = None, band_tokens: int = 0) -> list[LayerVerdict]:
  """The verdict of every layer of `m` (or of the layers in `only`) for `config` on the prompt `ids` (in bands of
  `band_tokens`, banded_features)."""
  verdicts_by_name, _, _, errors = _layer_pass(m, ids, {"config": config}, {"config": run_layer}, log,
                                               {} if only is None else {"config": only}, band_tokens)
  if errors:
    raise errors["config"]
  return verdicts_by_name["config"]


@jax.jit
def _kl_rows(exact_logp, logits):
  lq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.maximum(jnp.sum(jnp.exp(exact_logp) * (exact_logp - lq), axis=-1), 0.0)


def kl_per_position(exact_logp: jnp.ndarray, logits: jnp.ndarray) -> np.ndarray:
  """KL(exact || q) at each position, [S] float64, on the device KL_ROWS positions at a time."""
  return np.concatenate([np.asarray(_kl_rows(exact_logp[s:s + KL_ROWS], logits[s:s + KL_ROWS]), np.float64)
                         for s in range(0, exact_logp.shape[0], KL_ROWS)])


def judge(m, ids: np.ndarray, configs: Mapping[str, features_lib.Features],
          runners: Mapping[str, Callable] | None = None, models: Mapping[str, object] | None = None,
          log: Callable[[str], None] = lambda s: None, only: Mapping[str, set[int]] | None = None,
          end_to_end: Collection[str] | None = None,
          on_layers: Callable[[dict[str, Judgement]], None] | None = None,
          reference_kl: float | None = None, band_tokens: int = 0) -> dict[str, Judgement | Exception]:
  """Every configuration's per-layer verdicts and teacher-forced KL on the prompt `ids`, sharing one exact pass.
  `runners` / `models`: a configuration's layer runner and model where they are not the defaults (planted bugs);
  `only`: the layers judged per configuration where not all (a planted bug's own layer); `end_to_end`: the
  configurations whose teacher-forced KL is measured (default all; each costs a prefill of its own). `on_layers`:
  called with the per-layer judgements (no KL yet) once the layer pass is done, before the KL prefills, so a caller
  can keep them if the KL never finishes. `reference_kl`: the bf16 reference math's mean teacher-forced KL on this
  model and prompt where already measured (a prefill saved), else None. `band_tokens`: the band size of the
  configurations' runs, per layer and end to end (banded_features; 0 = each configuration's own). A configuration
  whose own run fails (its layer runs or its KL prefill) gets the exception instead of a judgement; the others are
  judged on."""
  runners, models, only = runners or {}, models or {}, only or {}
  layers, pinned, X, errors = _layer_pass(m, ids, configs, runners, log, only, band_tokens)
  tf: dict[str, TeacherForced | None] = dict.fromkeys(configs)
  end_to_end = [n for n in (configs if end_to_end is None else end_to_end) if n in configs and n not in errors]
  if on_layers is not None and end_to_end:
    on_layers({name: Judgement(tuple(layers[name]), None) for name in configs if name not in errors})
  if end_to_end:
    exact_logp = jax.nn.log_softmax(prefill_lib.logits_of_streams(m, X), axis=-1)
    del X
    dev_cls = next(iter(configs.values())).device_class
    bf16_reference = dataclasses.replace(features_lib.REFERENCE, device_class=dev_cls, bf16_matmul=True)

    def mean_kl(model, features):
      features = banded_features(features, band_tokens)
      logits = prefill_lib.prefill(model, ids, features, all_logits=True, pinned=pinned)
      kl = kl_per_position(exact_logp, logits)
      return kl, float(np.mean(kl))

    bands = lambda f: n_bands(len(ids), banded_features(f, band_tokens))

    on_file = reference_kl is not None
    ref_kl = reference_kl if on_file else mean_kl(m, bf16_reference)[1]
    log(f"teacher-forced KL of the reference math with bf16 operands: {ref_kl:.2e} (mean of {len(ids)} positions"
        f"{'; on file' if on_file else f'; {bands(bf16_reference)} band(s)'})")
    for name in end_to_end:
      try:
        kl, mean = mean_kl(models.get(name, m), configs[name])
      except Exception as e:  # noqa: BLE001 -- e.g. out of memory in this configuration's prefill alone
        errors[name] = e
        log(f"{name}: teacher-forced KL failed: {type(e).__name__}: {str(e)[:300]}")
        continue
      worst_at = int(np.nanargmax(kl)) if np.isfinite(kl).any() else 0
      tf[name] = TeacherForced(len(ids), mean, float(np.max(kl)), worst_at, ref_kl, KL_FACTOR * ref_kl,
                               bands=bands(configs[name]))
      log(f"{name}: teacher-forced KL {mean:.2e} in {tf[name].bands} band(s) (bound {KL_FACTOR * ref_kl:.2e}; worst "
          f"position {worst_at}: {kl[worst_at]:.2e}): {'PASS' if tf[name].passed else 'FAIL'}")
  return {name: errors.get(name) or Judgement(tuple(layers[name]), tf[name]) for name in configs}


def worst(verdicts: list[LayerVerdict]) -> LayerVerdict:
  """The layer closest to (or furthest over) its bound, a failing one first."""
  return max(verdicts, key=lambda v: (not v.passed, v.update_nmse / v.bound if v.bound else np.inf))
