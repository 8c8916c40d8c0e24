"""The results file (one JSON document, rewritten after every configuration, with a markdown table beside it) and
the exact path's prefix logits kept between bounded calls (an .npz beside it)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Mapping

import numpy as np

from ds4jax import features as features_lib
from ds4jax import mesh as mesh_lib
from experiments import processes, run_record
from experiments.qualification import report
from experiments.qualification.inputs import sha256_array
from experiments.qualification.options import StartupError
from experiments.qualification.records import (FAIL, SCHEMA, NoiseFloor, Record, Verdict, record_from_json, to_json,
                                                verdict_from_json)


@dataclasses.dataclass(kw_only=True)
class Results:
  """A results file: every record, the calls that made them, the noise floor per parity length."""
  records: list[Record] = dataclasses.field(default_factory=list)
  invocations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  noise_floor: dict[str, NoiseFloor] = dataclasses.field(default_factory=dict)
  verdicts: list[Verdict] = dataclasses.field(default_factory=list)  # every verdict taken, kept as soon as taken

  def verdict_for(self, tokens: int, features: dict, mutation: str | None, fingerprint: str,
                  prompt_sha: str, band_tokens: int = 0) -> Verdict | None:
    """A PASS or FAIL verdict already taken on the same prompt prefix, weights, features, planted bug and
    verdict bands."""
    for v in reversed(self.verdicts):
      if (v.tokens, v.features, v.mutation, v.weights_fingerprint, v.prompt_sha256, v.band_tokens) == (
          tokens, features, mutation, fingerprint, prompt_sha, band_tokens) and v.result != "not run":
        return v
    return None

  def put(self, rec: Record) -> None:
    """Adds `rec`, replacing the record of the same (length, config)."""
    self.records = [r for r in self.records if r.key != rec.key] + [rec]

  def to_json(self) -> dict[str, Any]:
    return dict(schema=SCHEMA, records=[to_json(r) for r in self.records], invocations=self.invocations,
                noise_floor={n: to_json(f) for n, f in self.noise_floor.items()},
                verdicts=[to_json(v) for v in self.verdicts])


def markdown_path(out: str) -> str:
  return os.path.splitext(out)[0] + ".md"


def exact_cache_path(out: str) -> str:
  """Where the exact path's prefix logits are kept between bounded calls."""
  return os.path.splitext(out)[0] + ".exact.npz"


def load_results(path: str) -> Results:
  """A results file (for notebooks: pandas.DataFrame(report.summary_rows(load_results(path))) gives one flat row
  per (length, config))."""
  try:
    with open(path) as f:
      doc = json.load(f)
  except (OSError, ValueError) as e:  # missing, unreadable, not JSON
    raise StartupError(f"{path} cannot be read: {e}") from None
  if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("records"), list):
    raise StartupError(f"{path} is not a prefill qualification results file (schema {SCHEMA})")
  try:
    out = Results(records=[record_from_json(r) for r in doc["records"]], invocations=doc.get("invocations", []),
                  noise_floor={n: NoiseFloor(**f) for n, f in doc.get("noise_floor", {}).items()},
                  verdicts=[verdict_from_json(v) for v in doc.get("verdicts", [])])
  except StartupError:
    raise
  except (KeyError, TypeError, ValueError, AttributeError) as e:  # a record edited or cut by hand
    raise StartupError(f"{path}: a record does not parse ({type(e).__name__}: {e})") from None
  keys = [r.key for r in out.records]
  twice = sorted({k for k in keys if keys.count(k) > 1})
  if twice:
    raise StartupError(f"{path} holds {twice[0]} twice; fix the file by hand")
  return out


def save(out: str, results: Results) -> None:
  """Writes the results and their table (process 0 only: every process of a multi-process run holds the same)."""
  if not processes.writes():
    return
  run_record.write_json(out, results.to_json())
  with open(markdown_path(out), "w") as f:
    f.write(report.markdown_table(results))


def same_run(r: Record, fingerprint: str, prompt_sha: Mapping[int, str], features: dict | None,
             mesh: str = "") -> list[str]:
  """Why an existing record does not belong to this run's matched matrix (empty list: it does). A sharded run
  (--mesh) is not the unsharded one: same weights and features, other programs and collectives."""
  why = []
  if r.weights_fingerprint != fingerprint:
    why.append("weights fingerprint")
  if mesh_lib.normalize((r.options or {}).get("mesh", "")) != mesh_lib.normalize(mesh):  # one spelling per mesh
    why.append("mesh")
  if r.length in prompt_sha and r.prompt.get("sha256") != prompt_sha[r.length]:
    why.append("prompt ids")
  if features is not None and r.features != features:
    why.append("features")
  return why


def rank(r: Record) -> int:
  """What a record measured: OK (timed and checked) > too_slow (cold run and parity) > failed with prefix parity
  or a verdict > failed or not run."""
  return {"ok": 3, "too_slow": 2}.get(r.status, 1 if (r.parity or (r.verdict and r.verdict.result != "not run"))
                                      else 0)


def merge_results(out: str, sources: list[str]) -> Results:
  """Merges results files of one matched matrix (e.g. bounded calls run side by side, one per GPU) into `out`
  (created if missing) and rewrites its .md table; returns the merged results.

  A (length, config) record from a source replaces the one in `out` unless that one measured more (`rank`), or as
  much and FAILed where this one does not (a FAIL is never merged away). Records must share the weights
  fingerprint and the mesh, and per length the prompt ids and per (length, config) the features (all_on may stand
  for other features at another length); invocations and noise floors are kept once each. Raises StartupError on a
  mixed set, before writing."""
  doc = load_results(out) if os.path.exists(out) else Results()
  by_key = {r.key: r for r in doc.records}
  fingerprint = next(iter(by_key.values())).weights_fingerprint if by_key else None
  prompt_sha = {r.length: r.prompt["sha256"] for r in by_key.values()}
  features = {k: r.features for k, r in by_key.items()}
  mesh = (next(iter(by_key.values())).options or {}).get("mesh", "") if by_key else None
  for path in sources:
    src = load_results(path)
    for r in src.records:
      fingerprint = fingerprint or r.weights_fingerprint
      mesh = (r.options or {}).get("mesh", "") if mesh is None else mesh
      why = same_run(r, fingerprint, prompt_sha, features.get(r.key), mesh)
      if why:
        raise StartupError(f"{path}: record {r.key} differs from the records merged so far in {', '.join(why)}: "
                           "not one matched matrix")
      old = by_key.get(r.key)
      if old is None or rank(r) > rank(old) or (rank(r) == rank(old) and (old.result != FAIL or r.result == FAIL)):
        by_key[r.key] = r
      prompt_sha.setdefault(r.length, r.prompt["sha256"])
      features.setdefault(r.key, r.features)
    doc.invocations += [i for i in src.invocations if i not in doc.invocations]
    for n, floor in src.noise_floor.items():
      doc.noise_floor.setdefault(n, floor)
    doc.verdicts += [v for v in src.verdicts if v not in doc.verdicts]
  doc.records = list(by_key.values())
  save(out, doc)
  return doc


class ExactPrefixes:
  """The exact path's final logits on prompt prefixes, computed once per prefix length and shared by every length
  (all lengths use prefixes of the same ids), and the same with the input streams perturbed (the noise floor). Kept
  in `path` (an .npz next to the results) with the weights fingerprint, the prefix ids' hash and the exact features,
  so a later bounded call reuses them. `compute(ids, input_noise)` runs the exact path (the runner's)."""

  def __init__(self, ids: np.ndarray, features, fingerprint: str, path: str | None,
               compute: Callable[[np.ndarray, float], np.ndarray], say: Callable[[str], None]):
    self.ids, self.features, self.fingerprint, self.path = ids, features, fingerprint, path
    self.compute, self.say = compute, say
    self.computed: dict[str, tuple[dict[str, Any], np.ndarray]] = {}  # array name -> (meta, logits)
    self.runs: list[dict[str, Any]] = []  # what this invocation computed or loaded (recorded in the invocation)

  def _meta(self, n: int, noise: float = 0.0) -> dict[str, Any]:
    meta = dict(tokens=n, weights_fingerprint=self.fingerprint, prompt_sha256=sha256_array(self.ids[:n]),
                features=self.features.to_dict())
    return meta | (dict(input_noise=noise, noise_seed=0) if noise else {})

  @staticmethod
  def _name(n: int, noise: float = 0.0) -> str:
    return f"logits_{n}" if not noise else f"perturbed_{n}_{noise:.6e}"

  def _stored(self) -> dict[str, tuple[dict[str, Any], np.ndarray]]:
    """Entries of the file made with these weights, prompt and features."""
    if not self.path or not os.path.exists(self.path):
      return {}
    out = {}
    with np.load(self.path) as z:
      for meta in json.loads(str(z["meta"])):
        # A switch added after the file was written did not exist then, so that path was off.
        meta["features"] = {s: False for s in features_lib.SWITCHES} | meta["features"]
        n, noise = meta["tokens"], meta.get("input_noise", 0.0)
        if meta == self._meta(n, noise):
          out[self._name(n, noise)] = (meta, np.asarray(z[self._name(n, noise)]))
    return out

  def _lookup(self, n: int, noise: float) -> tuple[dict[str, Any], np.ndarray] | None:
    """Computed or stored logits made exactly so (the meta holds the exact eps: names round it)."""
    name = self._name(n, noise)
    hit = self.computed.get(name) or self._stored().get(name)
    return hit if hit is not None and hit[0] == self._meta(n, noise) else None

  def has(self, n: int, noise: float = 0.0) -> bool:
    """Whether the logits are at hand without running the exact path."""
    return self._lookup(n, noise) is not None

  def _save(self) -> None:
    if not self.path or not processes.writes():
      return
    keep = self._stored() | self.computed
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    tmp = self.path + ".tmp.npz"
    np.savez(tmp, meta=json.dumps([m for m, _ in keep.values()]), **{k: a for k, (_, a) in keep.items()})
    os.replace(tmp, self.path)

  def _get(self, n: int, noise: float) -> np.ndarray:
    if not 1 <= n <= len(self.ids):  # ids[:n] would be a shorter prompt stored under the wrong length
      raise StartupError(f"a {n}-token prefix lies outside the {len(self.ids)}-token prompt")
    name = self._name(n, noise)
    what = f"exact path on the {n}-token prefix" + (f" with input noise {noise:.2e}" if noise else "")
    hit = self.computed.get(name)
    if hit is None or hit[0] != self._meta(n, noise):
      cached = self._lookup(n, noise)
      if cached is not None:
        self.say(f"  {what}: loaded from {self.path}")
        self.computed[name] = cached
        self.runs.append(dict(tokens=n, input_noise=noise, source=self.path, logits_sha256=sha256_array(cached[1])))
      else:
        self.say(f"  {what} (once, reused by every length and configuration)")
        t0 = time.perf_counter()
        self.computed[name] = (self._meta(n, noise), self.compute(self.ids[:n], noise))
        self.runs.append(dict(tokens=n, input_noise=noise, source="computed", wall_s=time.perf_counter() - t0,
                              logits_sha256=sha256_array(self.computed[name][1])))
        self.say(f"  done in {self.runs[-1]['wall_s']:.1f}s")
        self._save()
    return self.computed[name][1]

  def get(self, n: int) -> np.ndarray:
    return self._get(n, 0.0)

  def perturbed(self, n: int, noise: float) -> np.ndarray:
    """The exact path with its embedded streams multiplied by (1 + noise z) (prefill's input_noise)."""
    return self._get(n, noise)
