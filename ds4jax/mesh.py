"""Where a model's weights live and its work runs on several devices of one host: the mesh spec, its checks, and
weight placement.

    spec = "expert=2"                         # "" = one device (no mesh)
    mesh.check(spec, cfg)                     # MeshError (a ValueError) naming what is wrong, before any weights
    m = mesh.place(model, spec)               # a new model over the same values: routed experts split, rest replicated

A spec is a list of mesh axes, `roles=N`, each with one or more roles joined by "+":
  expert   each device holds E/n of every layer's routed experts (every storage array of a quantized stack leads with
           the expert dimension: codes, scales, codebooks, mode) and runs the routes to them (ds4jax/moe.py).
  query    each band's attention (queries, indexer selection, attention kernel, output projection) runs on 1/n of
           the band's tokens per device, against the whole band's keys (ds4jax/attention.py); no weight is split.
"expert+query=2" is one axis of two devices that both split; "expert=2,query=2" is a 2 × 2 mesh of four devices.
Every weight that is not a routed expert is replicated. A placed model carries its spec on each `Experts` and
`Attention` module (a static attribute, so it is part of the layer programs' graphdef and keys their jit caches).
Why the model carries the spec rather than `Features` or jax's context mesh: where the weights live and where the
work runs cannot disagree then (a `Features.mesh` could ask for a split of weights that sit whole on one device, or
forget one that is split, and each call would silently gather or scatter every expert), and every entry point, the
banded prefill and decoding run sharded with no argument added anywhere. docs/mesh.md says what is sharded and why.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

EXPERT = "expert"
QUERY = "query"
SUPPORTED = (EXPERT, QUERY)
# Splits that are not built: named here so that a spec using one fails with a message that says why.
NOT_YET = {"head": "attention heads are not split; query=N splits each band's attention over N devices by queries "
                   "instead (the indexer sums over its heads, so a head split would all-reduce its [T, R] scores; "
                   "docs/mesh.md §1)"}


class MeshError(ValueError):
  """A mesh spec that is malformed, names an unsupported axis, or does not fit the model or the devices."""


def parse(spec: str) -> tuple[tuple[str, int], ...]:
  """"expert=2" -> (("expert", 2),); "query+expert=2,..." -> (("expert+query", 2), ...): the mesh axes, named by
  their roles in a fixed order; "" -> () (one device). Raises MeshError."""
  spec = (spec or "").strip()
  if not spec:
    return ()
  supported = ", ".join(f"{a}=N" for a in SUPPORTED) + f" (several roles on one axis: {EXPERT}+{QUERY}=N)"
  axes: dict[str, int] = {}
  seen: set[str] = set()
  for item in spec.split(","):
    name, eq, size = (s.strip() for s in item.partition("="))
    if not eq or not name or not size.isdigit() or int(size) < 1:
      raise MeshError(f"mesh spec {spec!r}: {item.strip()!r} is not axis=size with a positive integer size "
                      f"(e.g. {EXPERT}=2)")
    roles = [r.strip() for r in name.split("+")]
    for role in roles:
      if role in NOT_YET:
        raise MeshError(f"mesh spec {spec!r}: axis {role!r} is not supported yet: {NOT_YET[role]}; supported: "
                        f"{supported}")
      if role not in SUPPORTED:
        raise MeshError(f"mesh spec {spec!r}: unknown axis {role!r}; supported: {supported}")
      if role in seen:
        raise MeshError(f"mesh spec {spec!r}: axis {role!r} is given twice")
      seen.add(role)
    axes["+".join(sorted(roles, key=SUPPORTED.index))] = int(size)
  return tuple(axes.items())


def normalize(spec: str) -> str:
  """The spec as the model records it: "query + expert=2" -> "expert+query=2" (results compare these strings)."""
  return ",".join(f"{name}={size}" for name, size in parse(spec))


def axis_of(spec: str, role: str) -> tuple[str, int] | None:
  """(mesh axis name, devices) that `role` (EXPERT or QUERY) splits over, or None when the spec has no such role."""
  return next(((name, n) for name, n in parse(spec) if role in name.split("+")), None)


def expert_devices(spec: str) -> int:
  """Devices the routed experts are split over (1 without an expert axis)."""
  return (axis_of(spec, EXPERT) or ("", 1))[1]


def query_devices(spec: str) -> int:
  """Devices each band's attention queries are split over (1 without a query axis)."""
  return (axis_of(spec, QUERY) or ("", 1))[1]


def check(spec: str, cfg, n_devices: int | None = None) -> tuple[tuple[str, int], ...]:
  """The parsed spec, if it fits the model config `cfg` (E divisible by the expert axis) and the devices jax sees
  (`n_devices`, default jax.device_count()). Raises MeshError naming the rule."""
  axes = parse(spec)
  if not axes:
    return axes
  n = expert_devices(spec)
  E = cfg.n_routed_experts
  if E % n:
    raise MeshError(f"mesh spec {spec!r}: {cfg.name}'s {E} routed experts do not split evenly over {n} devices "
                    f"({EXPERT}=N needs N to divide {E})")
  have = jax.device_count() if n_devices is None else n_devices
  need = int(np.prod([size for _, size in axes]))
  if need > have:
    raise MeshError(f"mesh spec {spec!r} needs {need} devices; jax sees {have} (on the CPU, "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count={need} gives more)")
  if jax.process_count() > 1 and need != have:
    # build() takes the first devices jax lists: process 0's. The other processes would hold none of the mesh and
    # fail at their first read of a result.
    raise MeshError(f"mesh spec {spec!r} takes {need} of the {have} devices of {jax.process_count()} processes: "
                    "over several processes a mesh spans every device")
  return axes


@functools.lru_cache(maxsize=None)
def build(spec: str) -> Mesh:
  """The Mesh of a spec: its axes over the first devices jax lists, in order (the same spec gives the same Mesh,
  so the programs that use it are cached once)."""
  axes = parse(spec)
  if not axes:
    raise MeshError("an empty mesh spec means one device: there is no mesh to build")
  shape = tuple(size for _, size in axes)
  need = int(np.prod(shape))
  devices = jax.devices()
  if need > len(devices):
    raise MeshError(f"mesh spec {spec!r} needs {need} devices; jax sees {len(devices)}")
  return Mesh(np.asarray(devices[:need]).reshape(shape), tuple(name for name, _ in axes))


def expert_sharding(spec: str) -> NamedSharding:
  """Leading (expert) dimension split over the expert axis (replicated without one), the rest whole."""
  axis = axis_of(spec, EXPERT)
  return NamedSharding(build(spec), P(axis[0]) if axis else P())


def replicated(spec: str) -> NamedSharding:
  return NamedSharding(build(spec), P())


def is_expert_path(path: tuple) -> bool:
  """A routed-expert stack's parameter: under `layers.L.ffn.experts` (the official names' `ffn.experts.E.w1`, stacked;
  the shared expert is `ffn.shared_experts`)."""
  return any(path[i:i + 2] == ("ffn", "experts") for i in range(len(path) - 1))


def place(m, spec: str):
  """A new model over `m`'s values (m itself is left as it was) with its routed experts split over the spec's
  expert axis and every other weight replicated over the mesh; its `Experts` and `Attention` modules carry the
  spec, so the MoE runs each device's experts where they live and attention splits its queries over a query axis.
  "" returns `m`. The spec is checked against m.cfg first."""
  if not parse(spec):
    return m
  check(spec, m.cfg)
  graphdef, state = nnx.split(m)
  E = m.cfg.n_routed_experts
  split, whole = expert_sharding(spec), replicated(spec)
  placed = []
  for path, var in nnx.to_flat_state(state):
    value = var[...]
    if is_expert_path(tuple(path)) and value.shape[:1] != (E,):
      raise MeshError(f"{'.'.join(map(str, path))}: shape {value.shape} does not lead with the {E} experts")
    placed.append((path, var.replace(jax.device_put(value, split if is_expert_path(tuple(path)) else whole))))
  copy = nnx.merge(graphdef, nnx.from_flat_state(placed))  # new modules and variables: m keeps its own
  for path, module in nnx.iter_modules(copy):
    if _runs_on_mesh(path):
      module.mesh = normalize(spec)  # moe.Experts, attention.Attention: each splits its work by its role in it
  return copy


def _runs_on_mesh(path) -> bool:
  """A module that carries the mesh spec: a layer's routed experts or its attention."""
  return tuple(path)[-2:] == ("ffn", "experts") or tuple(path)[-1:] == ("attn",)


def spec_of(m) -> str:
  """The spec a model runs under: what its `Experts` and `Attention` modules carry ("" = one device). Results record
  this rather than the flag, so a model that was not placed cannot be reported as sharded."""
  specs = {module.mesh for path, module in nnx.iter_modules(m) if _runs_on_mesh(path)}
  if len(specs) > 1:
    raise MeshError(f"the model's layers run on different meshes: {sorted(specs)}")
  return specs.pop() if specs else ""


def describe(spec: str, cfg) -> str:
  """One start-up line: how the model is laid out over the devices."""
  if not parse(spec):
    return "mesh: none (one device)"
  n, nq = expert_devices(spec), query_devices(spec)
  experts = (f"{cfg.n_routed_experts // n} of {cfg.n_routed_experts} routed experts per device on {n} devices"
             if axis_of(spec, EXPERT) else "routed experts replicated")
  attention = (f"each band's attention split by queries over {nq} devices (a band of a length that {nq} does not "
               f"divide, such as a one-token decode step, runs whole on each)" if axis_of(spec, QUERY)
               else "attention replicated")
  return f"mesh {spec}: {experts}; {attention}; dense weights, router and shared expert replicated"
