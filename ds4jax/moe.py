"""MoE of every layer (docs/model.md §7): sqrt-softplus router, hash or top-k routing, clamped SwiGLU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ds4jax import mesh as mesh_lib
from ds4jax.config import DeepseekV4Config, Routing
from ds4jax.features import REFERENCE, Features
from ds4jax.layers import F32, RESIDUAL_GAIN, Linear, QuantizedWeight, dense, make_weight, matmul_t, normal
from ds4jax.quant import formats
from ds4jax.quant.policy import POLICIES, QuantPolicy
from kernels_pallas import moe as moe_kernels
from kernels_pallas.moe.reference import moe_reference, swiglu_expert


class Buffer(nnx.Variable):
  """A non-trainable array that is part of the checkpoint (the hash routing table)."""


class Router(nnx.Module):
  """`ffn.gate`: scores every expert; picks by tid2eid (hash layers) or top-k of score + bias."""

  def __init__(self, cfg: DeepseekV4Config, layer: int, *, rngs: nnx.Rngs, dtype=F32):
    self.routing, self.k, self.scale = cfg.routing[layer], cfg.experts_per_token, cfg.routed_scaling_factor
    E = cfg.n_routed_experts
    self.weight = normal(rngs, (E, cfg.hidden_size), cfg.hidden_size ** -0.5, dtype)
    topk = self.routing is Routing.TOPK
    self.bias = normal(rngs, (E,), 0.02, F32) if topk else None  # used for selection only
    # Hash table with distinct experts per token: the top-k of a random key per (token, expert).
    self.tid2eid = None if topk else Buffer(
        jax.lax.top_k(jax.random.uniform(rngs.params(), (cfg.vocab_size, E)), self.k)[1].astype(jnp.int32))

  def scores(self, x: jnp.ndarray) -> jnp.ndarray:
    """[S, E] f32 affinities sqrt(softplus(x . w_e)). An f32 matmul under bf16_matmul too: both references compute
    the router logits in f32 (docs/model.md §7), and they pick the experts."""
    return jnp.sqrt(jax.nn.softplus(matmul_t(x, self.weight[...])))

  def selection_scores(self, x: jnp.ndarray) -> jnp.ndarray:
    """[S, E] what top-k routing ranks: the affinities plus the bias (hash layers: the affinities)."""
    return self.scores(x) + (0.0 if self.bias is None else self.bias[...])

  def __call__(self, x: jnp.ndarray, tokens: jnp.ndarray, pinned_ids: jnp.ndarray | None = None):
    """Returns (weights [S, k] f32, expert ids [S, k] int32). `pinned_ids` replaces the choice (not the weights'
    values: those are this path's affinities at the pinned experts)."""
    score = self.scores(x)  # [S, E]
    if pinned_ids is not None:
      idx = pinned_ids
    elif self.routing is Routing.HASH:
      idx = self.tid2eid[...][tokens]
    else:
      idx = jax.lax.top_k(score + self.bias[...], self.k)[1]
    w = jnp.take_along_axis(score, idx, axis=-1)
    return w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20) * self.scale, idx.astype(jnp.int32)


class Experts(nnx.Module):
  """The routed experts, stacked: w1/w3 [E, I, D] (gate/up), w2 [E, D, I] (down).

  `mesh` is the model's mesh spec ("" = one device holds them all). `ds4jax.mesh.place` sets it; on a spec with an
  expert axis the stacks are split over it and the routed experts run where they live (`routed`), otherwise they
  are replicated and run whole on every device."""

  def __init__(self, cfg: DeepseekV4Config, *, rngs: nnx.Rngs, dtype=F32, policy: QuantPolicy = POLICIES["bf16"],
               mesh: str = ""):
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    self.limit, self.n_experts, self.intermediate, self.hidden = cfg.swiglu_limit, E, I, D
    where = dict(sharding=mesh_lib.expert_sharding(mesh)) if mesh else {}  # each device draws its own experts
    self.w1 = make_weight(rngs, (E, I, D), D ** -0.5, dtype, policy.gate_up, **where)
    self.w2 = make_weight(rngs, (E, D, I), RESIDUAL_GAIN * I ** -0.5, dtype, policy.down, **where)  # the residual
    self.w3 = make_weight(rngs, (E, I, D), D ** -0.5, dtype, policy.gate_up, **where)
    self.mesh = mesh

  def stacks(self) -> tuple:
    """(w1, w2, w3) as pytrees of arrays that all lead with the expert dimension: a float stack, or a quantized
    stack's storage arrays by name (what `ds4jax.mesh.place` splits and `routed` hands each device a slice of)."""
    return tuple(w.storage() if isinstance(w, QuantizedWeight) else w[...] for w in (self.w1, self.w2, self.w3))

  def as_formats(self, stacks: tuple) -> tuple:
    """`stacks` (all experts, or one device's slice of them) as the reference takes them: float arrays as they are,
    quantized storage as `QuantizedExpertWeights` of as many experts as it holds."""
    return tuple(_quantized(w, s) if isinstance(w, QuantizedWeight) else s
                 for w, s in zip((self.w1, self.w2, self.w3), stacks))

  def kernel_weights(self, dtype, features: Features, stacks: tuple | None = None) -> tuple:
    """(w1, w2, w3) as the kernels' `ExpertWeights`: quantized storage as is where the kernels decode it
    (`moe_sparse_gate_up`), or dense stacks in `dtype` (a quantized stack decoded first, `decode_stack`:
    "dequantize-then-matmul"; `decoded_beforehand`). With the MoE kernels off nothing is decoded (the reference
    path decodes itself). `stacks`: a slice of `stacks()` (one device's experts); default all of them."""
    first = decoded_beforehand(features)

    def one(name, w, s):
      if not isinstance(w, QuantizedWeight):
        if s.ndim == 4:  # decoded beforehand as ring_layout (decode_quantized)
          return moe_kernels.RingLayoutWeights(s)
        return moe_kernels.DenseWeights(s if dtype == F32 else s.astype(dtype))  # f32 operands: the stored dtype
      if name not in first:
        return _quantized(w, s)
      ring = ring_laid(name, features)
      stack = decode_stack(w.format, s, w.logical_shape[1:], dtype, features, ring)
      return (moe_kernels.RingLayoutWeights if ring else moe_kernels.DenseWeights)(stack)
    return tuple(one(n, w, s) for n, w, s in zip(("w1", "w2", "w3"), (self.w1, self.w2, self.w3),
                                                   self.stacks() if stacks is None else stacks))

  def decode_quantized(self, features: Features, abstract: bool = False) -> None:
    """Replaces the quantized stacks the kernels read decoded (`decoded_beforehand`: all three, or W2 alone under
    `moe_wgmma_gate_up` without `moe_wgmma_down`) by their dense decode in the matmul dtype, in place (call it on a
    copy): the decode `kernel_weights` would otherwise repeat on every call, done once (the weights-stationary prefill
    does this per layer, ds4jax/prefill.py). `abstract`: shapes only, for compiling ahead. On a mesh each device decodes
    the experts it holds."""
    names = [n for n in decoded_beforehand(features) if isinstance(getattr(self, n), QuantizedWeight)]
    ws = [getattr(self, n) for n in names]
    dtype = features.matmul_dtype
    where = mesh_lib.expert_sharding(self.mesh) if self.mesh else None
    rings = tuple(ring_laid(n, features) for n in names)
    if abstract:
      dense = [jax.ShapeDtypeStruct(ring_shape(w.logical_shape) if ring else w.logical_shape, dtype, sharding=where)
               for w, ring in zip(ws, rings)]
    else:  # one program for all of them, as when the decode sits inside the layer step (XLA fuses them alike)
      decode = functools.partial(_decoded, tuple(w.format for w in ws), tuple(w.logical_shape[1:] for w in ws),
                                 rings, features=features)
      storages = tuple(w.storage() for w in ws)
      axis = mesh_lib.axis_of(self.mesh, mesh_lib.EXPERT) if self.mesh else None
      if axis is not None:  # the kernel decodes what it is given: run it where each device's experts live
        decode = jax.shard_map(decode, mesh=mesh_lib.build(self.mesh), in_specs=P(axis[0]), out_specs=P(axis[0]),
                               check_vma=False)
      dense = decode(storages)
      dense = dense if where is None else [jax.device_put(d, where) for d in dense]
    for name, value in zip(names, dense):
      setattr(self, name, nnx.Param(value))

  def routed(self, run, x: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray, shared=None) -> jnp.ndarray:
    """`run(stacks, x, weights, ids, shared)` -> [S, D] f32 over the routed experts `stacks` (and `shared`): on all
    of them, or, on a mesh with an expert axis, on each device's own experts (`on_local_experts`), the shared
    expert's output [S, D] added once, after the devices' sum."""
    if mesh_lib.axis_of(self.mesh, mesh_lib.EXPERT) is None:
      return run(self.stacks(), x, weights, idx, shared)
    y = on_local_experts(self.mesh, lambda s, x, w, i: run(s, x, w, i, None), self.stacks(), x, weights, idx)
    return y if shared is None else y + jnp.asarray(shared, F32)

  def __call__(self, x: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray, shared=None,
               operand_dtype=F32) -> jnp.ndarray:
    """y[t] = shared[t] + sum_k weights[t,k] * E_{idx[t,k]}(x[t]), by the exact reference
    (kernels_pallas/moe/reference.py: every expert on every token, quantized experts decoded one at a time)."""
    def run(stacks, x, w, ids, shared):
      return moe_reference(x, w, ids, *self.as_formats(stacks), swiglu_limit=self.limit, shared=shared,
                           operand_dtype=operand_dtype)
    return self.routed(run, x, weights, idx, shared)


def _quantized(w: QuantizedWeight, storage: dict) -> moe_kernels.QuantizedExpertWeights:
  """A quantized stack's storage (all experts, or one device's slice) as the kernels' and the reference's format."""
  n = storage[next(iter(storage))].shape[0]
  return moe_kernels.QuantizedExpertWeights.from_storage(w.format, storage, (n, *w.logical_shape[1:]))


def local_routes(weights, idx, first, count) -> tuple[jnp.ndarray, jnp.ndarray]:
  """The routes [S, K] as a device holding experts [first, first + count) sees them: ids made local (id - first),
  routes to experts it does not hold masked (id -1, weight 0), so that they contribute nothing there."""
  ids = idx - first
  mine = (ids >= 0) & (ids < count)
  return jnp.where(mine, weights, 0.0), jnp.where(mine, ids, -1)


def on_local_experts(spec: str, run, stacks: tuple, x, weights, idx) -> jnp.ndarray:
  """Expert parallelism over the expert axis of the mesh `spec` (ds4jax/mesh.py): inside `jax.shard_map` device d
  holds experts [d·E/n, (d+1)·E/n) of `stacks` (split on their leading dimension) and runs
  `run(its stacks, x, weights, ids)` on the routes as it sees them (`local_routes`). The devices' [S, D] f32 outputs
  are summed (psum). x, weights, idx and the result are replicated.

  check_vma=False: the reference's scan carry and the Pallas calls are not written for shard_map's varying-axis
  types (a zero carry starts invariant and turns varying); the one cross-device value is the psum's, replicated by
  construction."""
  axis = mesh_lib.axis_of(spec, mesh_lib.EXPERT)[0]

  def local(stacks, x, weights, idx):
    per_device = jax.tree.leaves(stacks)[0].shape[0]
    first = jax.lax.axis_index(axis) * per_device
    return jax.lax.psum(run(stacks, x, *local_routes(weights, idx, first, per_device)), axis)

  return jax.shard_map(local, mesh=mesh_lib.build(spec), in_specs=(P(axis), P(), P(), P()),
                       out_specs=P(), check_vma=False)(stacks, x, weights, idx)


def decode_stack(fmt: str, storage: dict, shape, dtype, features: Features, ring: bool = False) -> jax.Array:
  """A quantized stack (storage of [n, *shape]) decoded to dense `dtype`: by the Pallas kernel under
  `moe_decode_kernel` (kernels_pallas/moe/decode.py), else by XLA's canonical decode. The same bits either way;
  with `ring` laid out as moe_kernels.ring_layout (the decode kernel writes the MIX formats' boxes itself, XLA's decode
  fuses the transpose in)."""
  if features.moe_decode_kernel:
    n = storage[next(iter(storage))].shape[0]
    w = moe_kernels.QuantizedExpertWeights.from_storage(fmt, storage, (n, *shape))
    return moe_kernels.decode_stack(w, dtype, ring_layout=ring, interpret=features.interpret)
  dense = formats.get(fmt).dequantize(**storage).astype(dtype)  # the cast fuses in
  return moe_kernels.ring_layout(dense) if ring else dense


def ring_laid(name: str, features: Features) -> bool:
  """Whether the stack `name` is decoded beforehand as ring_layout: W1 / W3 for the Mosaic gate/up
  (`moe_wgmma_gate_up` without `moe_sparse_gate_up`), in bf16. Its rings read that layout fastest and the decode
  writes it at no cost (BENCHMARKS.md, session 65)."""
  return (name in ("w1", "w3") and name in decoded_beforehand(features) and features.moe_wgmma_gate_up
          and features.matmul_dtype == jnp.bfloat16)


def ring_shape(shape) -> tuple:
  """ring_layout's shape of a stack [E, N, K]: [E, N/64, K, 64]."""
  E, N, K = shape
  return (E, N // moe_kernels.RING_BOX, K, moe_kernels.RING_BOX)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), static_argnames=("features",))
def _decoded(fmts: tuple[str, ...], shapes: tuple, rings: tuple[bool, ...], storages: tuple[dict, ...], *,
             features: Features) -> list:
  """`decode_stack` of each stack, in the matmul dtype (ring_layout where `rings` says), as one program."""
  return [decode_stack(f, s, shape, features.matmul_dtype, features, ring)
          for f, shape, ring, s in zip(fmts, shapes, rings, storages)]


def decoded_beforehand(features: Features) -> tuple[str, ...]:
  """The expert stacks the MoE kernels read decoded beforehand (dequantize-then-matmul): all three without
  `moe_sparse_gate_up`; under `moe_wgmma_gate_up` W2 (the Mosaic GPU gate/up decodes W1/W3 itself, and the
  Triton down that would decode W2 in-kernel is ~3x slower than decoding it once: BENCHMARKS.md) unless
  `moe_wgmma_down` decodes it in its kernel; else none."""
  if not features.moe_kernels:
    return ()
  if not features.moe_sparse_gate_up:
    return ("w1", "w2", "w3")
  return ("w2",) if features.moe_wgmma_gate_up and not features.moe_wgmma_down else ()


def decodes_experts(features: Features) -> bool:
  """The MoE kernels read some expert stack decoded beforehand (`decoded_beforehand`)."""
  return bool(decoded_beforehand(features))


MIN_BLOCK = 16  # the MoE kernels' smallest block (kernels_pallas/moe/config.py)


def check_kernels(cfg: DeepseekV4Config, policy: QuantPolicy, features: Features) -> None:
  """Start-up check of the MoE switches against the model (ValueError naming what does not fit;
  kernels_pallas/moe/api.py checks the same at the call). Every MoE kernel takes D and I multiples of 16 (its
  smallest block). `moe_wgmma_gate_up` takes rocmfp2_mix or bf16 gate/up experts (any format without
  `moe_sparse_gate_up`: decoded to bf16 beforehand), D a multiple of 256 (rocmfp2_mix) or 64 (bf16) and I of 64;
  `moe_wgmma_down` rocmfp3_mix down experts, I a multiple of 256 and D of 128."""
  D, I = cfg.hidden_size, cfg.moe_intermediate_size
  if features.moe_kernels and (D % MIN_BLOCK or I % MIN_BLOCK):
    switches = " ".join(f"--{s}" for s in features.on() if s.startswith("moe_"))
    raise ValueError(f"{switches}: the MoE kernels need hidden_size and moe_intermediate_size multiples of "
                     f"{MIN_BLOCK} (their smallest block); {cfg.name} has {D} and {I}")
  if features.moe_wgmma_down:
    if policy.down != "rocmfp3_mix":
      raise ValueError(f"--moe_wgmma_down decodes rocmfp3_mix down experts; quant policy {policy.name} stores them "
                       f"as {policy.down}")
    if I % 256 or D % 128:
      raise ValueError(f"--moe_wgmma_down needs moe_intermediate_size a multiple of 256 and hidden_size of 128; "
                       f"{cfg.name} has {I} and {D}")
  if not features.moe_wgmma_gate_up:
    return
  fmt = policy.gate_up if features.moe_sparse_gate_up else "bf16"  # else decoded beforehand (decoded_beforehand)
  if fmt not in ("rocmfp2_mix", "bf16"):
    raise ValueError(f"--moe_wgmma_gate_up decodes rocmfp2_mix (or reads bf16) gate/up experts; quant policy "
                     f"{policy.name} stores them as {fmt}")
  d_multiple = 256 if fmt == "rocmfp2_mix" else 64  # a TMA row of meta bytes covers 256 weights
  if D % d_multiple or I % 64:
    what = fmt if features.moe_sparse_gate_up else f"{policy.gate_up} decoded to bf16"
    raise ValueError(f"--moe_wgmma_gate_up on {what} experts needs hidden_size a multiple of {d_multiple} and "
                     f"moe_intermediate_size of 64; {cfg.name} has {D} and {I}")


def model_fits(cfg: DeepseekV4Config, policy: QuantPolicy) -> frozenset[str]:
  """The MoE switches whose sm_90 defaults (features.Capability.when, MODEL) `cfg` under `policy` takes: the Mosaic
  GPU gate/up on FP2-MIX experts (with moe_sparse_gate_up, which decodes them in it), and beside it the down on FP3-MIX
  ones: the formats whose whole prefill was measured (lucebox_mix). bf16 experts run them only when asked."""
  def takes(switch: str) -> bool:
    try:
      check_kernels(cfg, policy, Features(**{switch: True, "moe_sparse_gate_up": True}))  # the fused defaults
    except ValueError:
      return False
    return True

  if policy.gate_up != "rocmfp2_mix" or not takes("moe_wgmma_gate_up"):
    return frozenset()
  down = {"moe_wgmma_down"} if takes("moe_wgmma_down") else set()
  return frozenset({"moe_sparse_gate_up", "moe_wgmma_gate_up"} | down)


class SharedExpert(nnx.Module):

  def __init__(self, cfg: DeepseekV4Config, *, rngs: nnx.Rngs, dtype=F32, policy: QuantPolicy = POLICIES["bf16"]):
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    self.limit = cfg.swiglu_limit
    q = dict(rngs=rngs, dtype=dtype, fmt=policy.dense)
    self.w1 = Linear(D, I, **q)
    self.w2 = Linear(I, D, gain=RESIDUAL_GAIN, **q)
    self.w3 = Linear(D, I, **q)

  def __call__(self, x: jnp.ndarray, operand_dtype=F32) -> jnp.ndarray:
    return swiglu_expert(x, *(dense(w.weight) for w in (self.w1, self.w2, self.w3)), self.limit, operand_dtype)


class MoE(nnx.Module):

  def __init__(self, cfg: DeepseekV4Config, layer: int, *, rngs: nnx.Rngs, dtype=F32,
               policy: QuantPolicy = POLICIES["bf16"], mesh: str = ""):
    self.gate = Router(cfg, layer, rngs=rngs, dtype=dtype)
    self.experts = Experts(cfg, rngs=rngs, dtype=dtype, policy=policy, mesh=mesh)
    self.shared_experts = SharedExpert(cfg, rngs=rngs, dtype=dtype, policy=policy)

  def __call__(self, x: jnp.ndarray, tokens: jnp.ndarray, features: Features = REFERENCE) -> jnp.ndarray:
    return self.route_and_mix(x, tokens, features)[0]

  def route_and_mix(self, x: jnp.ndarray, tokens: jnp.ndarray, features: Features = REFERENCE,
                    pinned_ids: jnp.ndarray | None = None) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(output [S, D], the expert ids [S, k] it routed to); `pinned_ids` imposes the ids (decisions.py)."""
    weights, idx = self.gate(x, tokens, pinned_ids)  # routing stays f32 (bf16 scores could pick other experts)
    dt = features.matmul_dtype
    shared = self.shared_experts(x, dt)
    if not features.moe_kernels:
      return self.experts(x, weights, idx, shared, dt), idx
    return routed_with_kernels(self.experts, x, weights, idx, shared, features), idx


def kernel_config(features: Features, x: jnp.ndarray, experts: Experts, top_k: int,
                  num_experts: int | None = None, decodes_weights: bool = False) -> moe_kernels.Config:
  """The grouped-MoE kernel knobs that the feature switches select (`num_experts`: the experts the kernels see,
  one device's on a mesh; default all; `decodes_weights`: quantized stacks decoded in the kernels)."""
  E, I, D = num_experts or experts.n_experts, experts.intermediate, experts.hidden
  forced = dict(block_m=features.moe_tile_rows, adaptive_tile=False) if features.moe_tile_rows else {}
  return moe_kernels.Config.default(
      num_tokens=x.shape[0], top_k=top_k, num_experts=E, hidden=D, intermediate=I, dtype=x.dtype,
      platform=features.platform, decodes_weights=decodes_weights,
      **(dict(adaptive_tile=features.moe_adaptive_tile, compact_queue=features.moe_compact_queue,
              persistent=features.moe_persistent, programs_per_core=features.moe_programs_per_core,
              fused_combine=features.moe_fused_combine,
              gate_up_kernel="wgmma" if features.moe_wgmma_gate_up else "triton",
              down_kernel="wgmma" if features.moe_wgmma_down else "triton") | forced))


def routed_with_kernels(experts: Experts, x, weights, idx, shared, features: Features) -> jnp.ndarray:
  """Routed experts + `shared` through the Pallas grouped-MoE kernels (kernels_pallas/moe).

  `moe_sparse_gate_up` feeds the quantized storage to the kernels, which dequantize each tile in-kernel (with
  `moe_wgmma_gate_up`: W1/W3 to the Mosaic GPU gate/up; `moe_wgmma_down`: W2 to the Mosaic GPU down, else W2
  decoded first for the Triton down under `moe_wgmma_gate_up`); without it the
  stacked weights are dequantized first (`decode_stack`: the same bits) and the kernels read bf16/f32
  ("dequantize-then-matmul"; `decoded_beforehand`). f32 operands make exact IEEE f32 dots; bf16
  (`bf16_matmul`) tensor-core dots. On a mesh each device runs the kernels on its own experts (`Experts.routed`).
  """
  x = x.astype(features.matmul_dtype)

  def run(stacks, x, w, ids, shared):
    ws = experts.kernel_weights(x.dtype, features, stacks)
    mosaic = [features.moe_wgmma_gate_up, features.moe_wgmma_down, features.moe_wgmma_gate_up]
    triton_reads = [w for w, m in zip(ws, mosaic) if not m]  # the Triton kernels' weights pick their tiles
    return moe_kernels.moe(x, w, ids, *ws, swiglu_limit=experts.limit, shared=shared,
                           config=kernel_config(features, x, experts, ids.shape[1], ws[0].shape[0],
                                                moe_kernels.decoded_in_kernel(*triton_reads)),
                           interpret=features.interpret, validate_routes=False)
  return experts.routed(run, x, weights, idx, shared)
