"""Public entry of the grouped MoE: `moe` (Pallas-Triton kernels, and a Mosaic GPU gate/up and down on sm_90); its
exact reference is reference.py.

    y[t] = shared(x[t]) + Σ_k w[t,k] · W2_e( silu(min(W1_e x_t, L)) · clip(W3_e x_t, −L, L) ),   e = ids[t,k]

Pipeline of `moe` (static shapes; each stage is a jit of its own, inlined under an outer jit):
  1. routing.route      XLA: stable sort of the S·K routes by expert, counts/offsets, compact work list.
  2. gate_up.gate_up    Pallas: grouped W1/W3 matmul + clamped SwiGLU → h [S·K, I] (sorted rows); with
                        `Config.gate_up_kernel` "wgmma" the Mosaic GPU kernel of gate_up_wgmma.py (sm_90).
  3. down.down          Pallas: grouped W2 matmul → out [S·K, D] f32 (sorted rows); with `Config.down_kernel`
                        "wgmma" the Mosaic GPU kernel of down_wgmma.py on FP3-MIX W2 (sm_90).
  4. down.combine       Pallas (fused_combine) or XLA: y[t] = shared[t] + Σ_k w[t,k] · out[row_of_route[t,k]].
The shared expert, when given as weights, runs through the same two grouped kernels as a single group.
`plan` returns the static decisions (row tile, work list, grids, kernel names) that `moe` builds, for inspection.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas.moe import _schedule
from kernels_pallas.moe import down as down_mod
from kernels_pallas.moe import down_wgmma
from kernels_pallas.moe import gate_up as gate_up_mod
from kernels_pallas.moe import gate_up_wgmma
from kernels_pallas.moe import routing as routing_mod
from kernels_pallas.moe.config import Config
from kernels_pallas.moe.weights import (DenseWeights, ExpertWeights, RingLayoutWeights, as_expert_weights,
                                        decoded_in_kernel, is_format)


F32 = jnp.float32


class SharedExpert(NamedTuple):
  """Shared-expert weights, [out, in] layout: w1/w3 [I_s, D] (gate/up), w2 [D, I_s] (down); each a float array or
  a one-expert `ExpertWeights` stack [1, out, in] (e.g. a quantized dense-role weight, `QuantizedExpertWeights`)."""
  w1: jax.Array
  w2: jax.Array
  w3: jax.Array


@dataclasses.dataclass(frozen=True)
class Plan:
  """What `moe` builds for given static shapes and config (grids are Pallas grids, axis 0 first)."""
  block_m: int
  work_list: str                 # "compact" | "dense"
  max_items: int                 # static length of the work list (= grid axis 0 unless persistent)
  schedule: str                  # "grid" | "persistent"
  gate_up_grid: tuple[int, ...]
  down_grid: tuple[int, ...]
  combine: str                   # "fused" | "xla"
  combine_grid: tuple[int, ...] | None
  kernels: tuple[str, ...]       # pallas_call names, in call order


def plan(*, num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, config: Config,
         shared_intermediate: int | None = None, interpret: bool = False) -> Plan:
  S, K, E, D, I = num_tokens, top_k, num_experts, hidden, intermediate
  R = S * K
  bm = config.row_tile(R, E)
  max_items = routing_mod.max_work_items(R, E, bm) if config.compact_queue else E * -(-R // bm)
  P = config.programs()
  grid = lambda items, n: _schedule.grid(persistent=config.persistent, max_items=items, n_tiles=n, num_programs=P,
                                         tile_order=config.tile_order)
  suffix = "_persistent" if config.persistent else ""
  kernels = []
  if shared_intermediate is not None:
    kernels += ["moe_shared_gate_up" + suffix, "moe_shared_down" + suffix]
  if config.gate_up_kernel == "wgmma":  # x's rows gathered (as plane_rows for FP2-MIX) by a Triton kernel first
    kernels += [gate_up_wgmma.GATHER_NAME, gate_up_wgmma.KERNEL_NAME]
  else:
    kernels.append("moe_gate_up" + suffix)
  kernels.append(down_wgmma.KERNEL_NAME if config.down_kernel == "wgmma" else "moe_down" + suffix)
  wgmma_grid = (_wgmma_programs(config.num_cores, interpret),)
  if config.fused_combine:
    kernels.append("moe_combine")
  return Plan(block_m=bm, work_list="compact" if config.compact_queue else "dense", max_items=max_items,
              schedule="persistent" if config.persistent else "grid",
              gate_up_grid=wgmma_grid if config.gate_up_kernel == "wgmma" else grid(max_items, I // config.block_n),
              down_grid=wgmma_grid if config.down_kernel == "wgmma" else grid(max_items, D // config.down_bn),
              combine="fused" if config.fused_combine else "xla",
              combine_grid=(-(-S // config.combine_block_t), D // config.combine_block_d)
              if config.fused_combine else None,
              kernels=tuple(kernels))


def _shared_shape(w) -> tuple[int, ...]:
  """[out, in] of a shared-expert weight: an array's shape, or a one-expert format's [1, out, in] without the 1."""
  if is_format(w):
    return tuple(w.shape[1:]) if w.shape[0] == 1 else tuple(w.shape)
  return tuple(jnp.shape(w))


def _check(x, route_weights, route_ids, w1: ExpertWeights, w2: ExpertWeights, w3: ExpertWeights, shared,
           config: Config):
  config.validate()
  if x.ndim != 2:
    raise ValueError(f"x must be [S, D], got shape {tuple(x.shape)}")
  if jnp.dtype(x.dtype) not in (jnp.dtype(F32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"x: unsupported dtype {x.dtype}; expected float32, bfloat16 or float16")
  S, D = x.shape
  if S == 0 or (route_ids.ndim == 2 and route_ids.shape[1] == 0):
    raise ValueError(f"the grouped MoE needs at least one token and one route each; got x {tuple(x.shape)}, "
                     f"route_ids {tuple(route_ids.shape)}")
  if route_ids.ndim != 2 or route_ids.shape[0] != S:
    raise ValueError(f"route_ids shape {tuple(route_ids.shape)} must be [S, K] with S = {S} "
                     f"(x shape {tuple(x.shape)})")
  if not jnp.issubdtype(route_ids.dtype, jnp.integer):
    raise ValueError(f"route_ids must be integers, got dtype {route_ids.dtype}")
  if tuple(route_weights.shape) != tuple(route_ids.shape):
    raise ValueError(f"route_weights shape {tuple(route_weights.shape)} must equal route_ids shape "
                     f"{tuple(route_ids.shape)}")
  E, I, Dw = w1.shape
  if tuple(w3.shape) != (E, I, Dw) or Dw != D:
    raise ValueError(f"w1 {tuple(w1.shape)} and w3 {tuple(w3.shape)} must both be [E, I, D] with D = {D} "
                     f"(x shape {tuple(x.shape)})")
  if tuple(w2.shape) != (E, D, I):
    raise ValueError(f"w2 shape {tuple(w2.shape)} must be [E, D, I] = {(E, D, I)} (w1 shape {tuple(w1.shape)})")
  bn, bk, dbn, dbk = config.block_n, config.block_k, config.down_bn, config.down_bk
  if D % bk:
    raise ValueError(f"hidden size D={D} is not a multiple of block_k={bk} (gate/up reduction)")
  if I % bn:
    raise ValueError(f"intermediate size I={I} is not a multiple of block_n={bn} (gate/up output)")
  if D % dbn:
    raise ValueError(f"hidden size D={D} is not a multiple of down_block_n={dbn} (down output)")
  if I % dbk:
    raise ValueError(f"intermediate size I={I} is not a multiple of down_block_k={dbk} (down reduction)")
  if config.gate_up_kernel == "wgmma":
    _check_wgmma(x, w1, w3)
  if config.down_kernel == "wgmma":
    _check_wgmma_down(x, w2)
  if config.fused_combine and D % config.combine_block_d:
    raise ValueError(f"hidden size D={D} is not a multiple of combine_block_d={config.combine_block_d}")
  if isinstance(shared, SharedExpert):
    s1, s2, s3 = (_shared_shape(a) for a in shared)
    Is = s1[0] if len(s1) == 2 else -1
    if len(s1) != 2 or s1 != s3 or s1[1] != D or tuple(s2) != (D, Is):
      raise ValueError(f"shared expert shapes w1 {s1}, w2 {s2}, w3 {s3} must be [I_s, D], [D, I_s], [I_s, D] "
                       f"with D = {D}")
    if Is % bn or Is % dbk:
      raise ValueError(f"shared intermediate size {Is} is not a multiple of block_n={bn} and down_block_k={dbk}")
  elif shared is not None and tuple(jnp.shape(shared)) != (S, D):
    raise ValueError(f"shared must be None, a SharedExpert of weights, or its output [S, D] = {(S, D)}; "
                     f"got shape {tuple(jnp.shape(shared))}")


def _check_wgmma(x, w1: ExpertWeights, w3: ExpertWeights) -> None:
  """What the Mosaic GPU gate/up takes (gate_up_wgmma.py): bf16 x, W1/W3 both bf16 or both FP2-MIX storage with
  D a multiple of 256 (one TMA row of meta bytes), I a multiple of 64."""
  kinds = {"dense bf16" if isinstance(w, DenseWeights) and w.w.dtype == jnp.bfloat16 else
           "rocmfp2_mix" if getattr(w, "fmt_name", None) == "rocmfp2_mix" else "other" for w in (w1, w3)}
  E, I, D = w1.shape
  mix = kinds == {"rocmfp2_mix"}
  if isinstance(w1, RingLayoutWeights) != isinstance(w3, RingLayoutWeights):
    raise ValueError("gate_up_kernel 'wgmma' takes W1 and W3 both as RingLayoutWeights or neither")
  if jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16) or len(kinds) != 1 or "other" in kinds:
    raise ValueError(f"gate_up_kernel 'wgmma' takes bf16 x with W1/W3 both bf16 or both rocmfp2_mix; got x "
                     f"{x.dtype}, w1 {getattr(w1, 'fmt_name', w1.compute_dtype)}, w3 "
                     f"{getattr(w3, 'fmt_name', w3.compute_dtype)}")
  if I % gate_up_wgmma.WGMMA_M or (mix and D % (gate_up_wgmma.META_BOX * 16)) or D % 64:
    raise ValueError(f"gate_up_kernel 'wgmma' needs I a multiple of {gate_up_wgmma.WGMMA_M} and D of "
                     f"{gate_up_wgmma.META_BOX * 16 if mix else 64}; got w1 [E, I, D] = {[E, I, D]}")


def _check_wgmma_down(x, w2: ExpertWeights) -> None:
  """What the Mosaic GPU down takes (down_wgmma.py): bf16 x (so bf16 h), W2 in rocmfp3_mix storage with I a multiple
  of 256 (a TMA row of meta bytes) and D of 128 (two 64-column N tiles per unit)."""
  E, D, I = w2.shape
  if jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16) or getattr(w2, "fmt_name", None) != "rocmfp3_mix":
    raise ValueError(f"down_kernel 'wgmma' takes bf16 x and rocmfp3_mix W2; got x {x.dtype}, w2 "
                     f"{getattr(w2, 'fmt_name', w2.compute_dtype)}")
  if I % 256 or D % 128:
    raise ValueError(f"down_kernel 'wgmma' needs I a multiple of 256 and D of 128; got w2 [E, D, I] = {[E, D, I]}")


def moe(x, route_weights, route_ids, w1, w2, w3, *, swiglu_limit: float, shared=None,
        config: Config | None = None, interpret: bool = False, validate_routes: bool = True) -> jax.Array:
  """Routed MoE (+ shared expert) → y [S, D] f32.

  x [S, D] f32/bf16; route_weights [S, K]; route_ids [S, K] int (−1 = masked route); w1/w3 [E, I, D], w2 [E, D, I]
  as float arrays or `ExpertWeights` formats; `shared` = None, `SharedExpert(w1, w2, w3)` or a precomputed
  shared output [S, D]. `config=None` picks `Config.default`. Expert ids are checked on the host when concrete
  and `validate_routes` (a device→host copy and sync; pass False in timed loops); under an outer jit an
  out-of-range id is treated as masked.
  """
  w1, w2, w3 = (as_expert_weights(w, n) for w, n in ((w1, "w1"), (w2, "w2"), (w3, "w3")))
  x, route_weights, route_ids = jnp.asarray(x), jnp.asarray(route_weights), jnp.asarray(route_ids)
  if isinstance(shared, (tuple, list)) and not isinstance(shared, SharedExpert):
    shared = SharedExpert(*shared)
  if config is None:
    S, D = x.shape
    config = Config.default(num_tokens=S, top_k=route_ids.shape[-1], num_experts=w1.shape[0], hidden=D,
                            intermediate=w1.shape[1], dtype=x.dtype,
                            decodes_weights=decoded_in_kernel(w1, w2, w3))
  _check(x, route_weights, route_ids, w1, w2, w3, shared, config)
  if validate_routes:
    routing_mod.check_routes(route_ids, w1.shape[0])
  return _moe(x, route_weights, route_ids.astype(jnp.int32), w1, w2, w3, shared,
              swiglu_limit=float(swiglu_limit), config=config, interpret=interpret)


def _kernel_config(config: Config) -> Config:
  """The config with the fields that gate_up/down ignore reset, so that eager calls whose configs differ only in
  the combine share the compiled grouped kernels."""
  return dataclasses.replace(config, fused_combine=True, combine_block_t=16, combine_block_d=128, adaptive_tile=False)


_route = jax.jit(routing_mod.route, static_argnums=(1, 2))
_single_group = functools.partial(jax.jit, static_argnums=(0, 1))(routing_mod.single_group)
_gate_up = jax.jit(gate_up_mod.gate_up, static_argnames=("swiglu_limit", "config", "interpret", "name"))
_down = jax.jit(down_mod.down, static_argnames=("config", "compute_dtype", "interpret", "name"))
_combine = jax.jit(down_mod.combine, static_argnames=("config", "interpret", "name"))
_combine_xla = jax.jit(down_mod.combine_xla)


def _down_wgmma_tiling(r, w2):
  return down_wgmma.default_tiling(-(-r.num_routes // w2.shape[0]))


@functools.partial(jax.jit, static_argnames=("swiglu_limit", "h_plane_rows", "num_cores", "interpret"))
def _gate_up_on_wgmma(x, w1, w3, r, *, swiglu_limit, h_plane_rows, num_cores, interpret):
  """The Mosaic GPU gate/up on `ExpertWeights` (FP2-MIX storage as it is, or bf16), at its measured tiling; h as the
  Mosaic down's plane_rows when `h_plane_rows` is given."""
  mix = not isinstance(w1, DenseWeights)
  ws = [gate_up_wgmma.mix_stack(w.storage) if mix else w.w for w in (w1, w3)]
  E, I, _ = w1.shape
  tiling = gate_up_wgmma.default_tiling(-(-r.num_routes // E), mix, I)
  return gate_up_wgmma.gate_up_wgmma(x, *ws, r, swiglu_limit=swiglu_limit, tiling=tiling, h_plane_rows=h_plane_rows,
                                     num_sms=_wgmma_programs(num_cores, interpret), interpret=interpret or None)


@functools.partial(jax.jit, static_argnames=("h_as_plane_rows", "num_cores", "interpret"))
def _down_on_wgmma(h, w2, r, *, h_as_plane_rows, num_cores, interpret):
  """The Mosaic GPU down on FP3-MIX storage as it is, at its measured tiling; h as rows or already as plane_rows."""
  return down_wgmma.down_wgmma(h, down_wgmma.mix3_stack(w2.storage), r, tiling=_down_wgmma_tiling(r, w2),
                               num_sms=_wgmma_programs(num_cores, interpret), h_as_plane_rows=h_as_plane_rows,
                               interpret=interpret or None)


def _wgmma_programs(num_cores: int | None, interpret: bool) -> int:
  """The Mosaic kernels' programs, one per SM (`Config.num_cores`, else the device's; the interpreter, which
  simulates every SM's warpgroups, gets 4)."""
  return 4 if interpret else num_cores or getattr(jax.devices()[0], "core_count", None) or 132


def _moe(x, route_weights, route_ids, w1, w2, w3, shared, *, swiglu_limit, config, interpret):
  """The pipeline. Each stage is its own jit (inlined under an outer jit; cached per stage when eager)."""
  S, K = route_ids.shape
  E = w1.shape[0]
  bm = config.row_tile(S * K, E)
  kcfg = _kernel_config(config)
  if isinstance(shared, SharedExpert):
    one = _single_group(S, config.block_m)
    s1, s2, s3 = (as_expert_weights(w, n, ndim=2) for w, n in zip(shared, ("shared.w1", "shared.w2", "shared.w3")))
    hs = _gate_up(x, s1, s3, one, swiglu_limit=swiglu_limit, config=kcfg, interpret=interpret,
                  name="moe_shared_gate_up")
    shared = _down(hs, s2, one, config=kcfg, interpret=interpret, name="moe_shared_down")
  elif shared is not None:
    shared = jnp.asarray(shared, F32)
  r = _route(route_ids, E, bm)
  # Both Mosaic kernels on FP2-MIX W1/W3: the gate/up writes h in the down's plane_rows order (no transpose between)
  h_plane_rows = None
  if config.gate_up_kernel == "wgmma" and config.down_kernel == "wgmma" and not isinstance(w1, DenseWeights):
    h_plane_rows = gate_up_wgmma.padded_rows(r.num_routes, _down_wgmma_tiling(r, w2).block_m)
  if config.gate_up_kernel == "wgmma":
    h = _gate_up_on_wgmma(x, w1, w3, r, swiglu_limit=swiglu_limit, h_plane_rows=h_plane_rows,
                          num_cores=config.num_cores, interpret=interpret)
  else:
    h = _gate_up(x, w1, w3, r, swiglu_limit=swiglu_limit, config=kcfg, interpret=interpret)
  if config.down_kernel == "wgmma":
    out = _down_on_wgmma(h, w2, r, h_as_plane_rows=h_plane_rows is not None, num_cores=config.num_cores,
                         interpret=interpret)
  else:
    out = _down(h, w2, r, config=kcfg, interpret=interpret)
  if config.fused_combine:
    return _combine(out, route_weights, r, shared, config=config, interpret=interpret)
  return _combine_xla(out, route_weights, r, shared)
