"""Per-layer verdicts of a configuration against the exact path: pinned parity and decision accounting.

For each layer, on the exact path's input streams X_l (nothing accumulated from earlier layers):

  pinned parity   the layer runs with its routing and indexer choices pinned to the exact path's; the NMSE of its
                  update (Y - X_l) against the exact update. PASS when it is at most BF16_FACTOR times the NMSE of
                  the reference math with bf16 operands, pinned the same way, and at most ABS_CAP; a configuration
                  on f32 operands is held to F32_BOUND instead.
  decisions       the layer runs unpinned; every routing or indexer choice that differs from the exact path's must
                  be a near-tie in the exact scores: the gap between what it dropped and what it took at most
                  NEAR_TIE_ULPS roundings of the configuration's operand precision at that token's score scale.
                  Any other flip FAILs, named by layer, position and gap.

A kernel that is wrong at some shape shows as a layer whose pinned error is far above the rounding of its operands;
a wrong indexer or router as flips that are not near-ties. `run_layer` is the configuration under test, injectable
(the mutation suite plants bugs there): run_layer(i, block, X, tokens, cache, features, pinned) -> (Y, cache,
Decisions), by default the prefill's own layer program.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax import features as features_lib
from ds4jax import metrics
from ds4jax import prefill as prefill_lib
from ds4jax.decisions import Decisions

BF16_FACTOR = 4.0
F32_BOUND = 1e-9       # f32 operands: rounding only (the kernels measure ~1e-13 in interpret mode)
ABS_CAP = 1e-3
NEAR_TIE_ULPS = 16
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

  @property
  def passed(self) -> bool:
    return self.update_nmse <= self.bound and not self.bad_flips


def default_run_layer(i, block, X, tokens, cache, features, pinned):
  del i
  return prefill_lib.layer_step(block, X, tokens, 0, cache, features, pinned)


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


def flips(exact_ids, exact_scores, got_ids, eps: float, layer: int, kind: str) -> tuple[int, list[Flip]]:
  """(how many choices differ from the exact path's, the flips that are not near-ties in the exact scores)."""
  scores = np.asarray(exact_scores, np.float64)
  want, got = _members(np.asarray(exact_ids), scores.shape[1]), _members(np.asarray(got_ids), scores.shape[1])
  dropped, taken = want & ~got, got & ~want
  n = int(dropped.sum())
  bad = []
  for t in np.nonzero(dropped.any(axis=1) | taken.any(axis=1))[0]:
    s = scores[t]
    top = np.max(s[dropped[t]]) if dropped[t].any() else -np.inf
    low = np.min(s[taken[t]]) if taken[t].any() else np.inf
    gap = float(top - low) if np.isfinite(low) else np.inf  # taking an invisible row is never a tie
    finite = s[np.isfinite(s)]
    tol = NEAR_TIE_ULPS * eps * (float(np.max(np.abs(finite))) if finite.size else 0.0)
    if not gap <= tol:
      bad.append(Flip(layer, kind, int(t), gap, tol))
  return n, bad


def _strip(d: Decisions) -> Decisions:
  return dataclasses.replace(d, route_scores=None, index_scores=None)


def layer_verdicts(m, ids: np.ndarray, config: features_lib.Features,
                   run_layer: Callable = default_run_layer, log: Callable[[str], None] = lambda s: None,
                   only: set[int] | None = None) -> list[LayerVerdict]:
  """The verdict of every layer of `m` (or of the layers in `only`) for `config` on the prompt `ids` (one band
  from position 0)."""
  exact = dataclasses.replace(features_lib.REFERENCE, device_class=config.device_class)
  bf16_reference = dataclasses.replace(exact, bf16_matmul=True)
  eps = OPERAND_EPS[jnp.dtype(config.matmul_dtype).name]
  toks = jnp.asarray(ids, jnp.int32)
  B = len(ids)
  X = m.embed_streams(toks)
  out = []
  for i, block in enumerate(m.layers):
    cache = lambda blk=block: blk.attn.empty_cache(B, B)
    judged = only is None or i in only
    ref, _, want = prefill_lib.layer_step(block, jnp.copy(X), toks, 0, cache(), exact, record_scores=judged)
    if not judged:
      X = ref
      continue
    pinned = _strip(want)
    got, _, _ = run_layer(i, block, jnp.copy(X), toks, cache(), config, pinned)
    nmse, _ = update_errors(got, ref, X)
    ref_bf16 = None
    if config.bf16_matmul:
      y, _, _ = prefill_lib.layer_step(block, jnp.copy(X), toks, 0, cache(), bf16_reference, pinned)
      ref_bf16, _ = update_errors(y, ref, X)
      bound = min(BF16_FACTOR * ref_bf16, ABS_CAP)
    else:
      bound = F32_BOUND
    _, _, free = run_layer(i, block, jnp.copy(X), toks, cache(), config, None)
    n_route, bad = flips(want.route_ids, want.route_scores, free.route_ids, eps, i, "route")
    n_index = 0
    if want.index_rows is not None:
      n_index, bad_index = flips(want.index_rows, want.index_scores, free.index_rows, eps, i, "index")
      bad += bad_index
    v = LayerVerdict(i, m.cfg.attention[i].value, m.cfg.routing[i].value, nmse, bound, ref_bf16, n_route, n_index,
                     tuple(bad))
    out.append(v)
    log(f"layer {i:2d} {v.attention:6s} {v.routing:4s}: pinned update NMSE {nmse:.1e} (bound {bound:.1e}), "
        f"{n_route} route / {n_index} index flips, {len(bad)} not near-ties: {'PASS' if v.passed else 'FAIL'}")
    X = ref
  return out


def worst(verdicts: list[LayerVerdict]) -> LayerVerdict:
  """The layer closest to (or furthest over) its bound, a failing one first."""
  return max(verdicts, key=lambda v: (not v.passed, v.update_nmse / v.bound if v.bound else np.inf))
