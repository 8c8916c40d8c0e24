"""Quantization policy: which weight format each tensor role is stored in.

Roles:
  dense    attention wq_a/wq_b/wkv/wo_a/wo_b, indexer wq_b, shared expert w1/w2/w3
           (the tensors the official checkpoint stores in FP8)
  gate_up  routed experts w1 (gate) and w3 (up)
  down     routed experts w2
Everything else (embedding, head, compressors, router, indexer weights_proj, norms, HC) stays bf16/f32.

Policies:
  bf16         every role bf16
  official     dense FP8 E4M3 (128x128 UE8M0 blocks), experts FP4 E2M1 (per-32 UE8M0): the published checkpoint
  lucebox_mix  gate/up ROCmFP2-MIX, down ROCmFP3-MIX, dense 4-bit. Upstream's dense format (ROCmFP4_FAST) is
               not documented, so the official FP4 E2M1 layout stands in for it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ds4jax.quant import formats, rocmfp2_mix, rocmfp3_mix, ue4m3, ue8m0


@dataclasses.dataclass(frozen=True, slots=True)
class QuantPolicy:
  name: str
  dense: str
  gate_up: str
  down: str

  def format_of(self, role: str) -> formats.Format:
    return formats.get(getattr(self, role))


POLICIES = {
    "bf16": QuantPolicy("bf16", dense="bf16", gate_up="bf16", down="bf16"),
    "official": QuantPolicy("official", dense="fp8_e4m3", gate_up="fp4_e2m1", down="fp4_e2m1"),
    "lucebox_mix": QuantPolicy("lucebox_mix", dense="fp4_e2m1", gate_up="rocmfp2_mix", down="rocmfp3_mix"),
}


def get(spec: str) -> QuantPolicy:
  """A named policy, or a custom one written `dense=FMT,gate_up=FMT,down=FMT` (unnamed roles stay bf16)."""
  if spec in POLICIES:
    return POLICIES[spec]
  if "=" not in spec:
    raise ValueError(f"unknown quantization policy {spec!r}; choose one of {sorted(POLICIES)} "
                     "or write dense=FMT,gate_up=FMT,down=FMT")
  roles = {"dense": "bf16", "gate_up": "bf16", "down": "bf16"}
  for item in spec.split(","):
    role, _, fmt = item.partition("=")
    if role.strip() not in roles:
      raise ValueError(f"quantization policy {spec!r}: unknown role {role.strip()!r}; roles are {list(roles)}")
    roles[role.strip()] = formats.get(fmt.strip()).name  # raises with the valid format names
  return QuantPolicy(spec, **roles)


def check_shape(fmt: formats.Format, shape: tuple[int, ...], what: str) -> None:
  """Start-up check that a weight of `shape` can be stored in `fmt` (names the tensor and the rule)."""
  if shape[-1] % fmt.in_multiple:
    raise ValueError(f"{what}: input dim {shape[-1]} of shape {shape} is not a multiple of {fmt.in_multiple}, "
                     f"which format {fmt.name} needs")


# Root-mean-square of each format's levels under uniformly random codes, to aim random weights at a std.
_LEVEL_RMS = {
    "fp4_e2m1": math.sqrt(np.mean(np.square([0, .5, 1, 1.5, 2, 3, 4, 6]))),
    "rocmfp2": math.sqrt(np.mean(np.square([-1, 0, 1, 2]))),
    "rocmfp2_mix": math.sqrt(np.mean(np.square(rocmfp2_mix.INIT_BOOKS))),
    "rocmfp3": math.sqrt(np.mean(np.square([0, 1, 2, 4]))),
    "rocmfp3_mix": math.sqrt(np.mean(np.square(rocmfp3_mix.INIT_BOOKS))),
}
_INIT_BOOKS = {"rocmfp2_mix": rocmfp2_mix.INIT_BOOKS, "rocmfp3_mix": rocmfp3_mix.INIT_BOOKS}
_FP8_CODE_STD = 32.0  # random fp8 codes ~ N(0, 32^2): well inside +-448, with all 3 mantissa bits in use


def random_storage(fmt: formats.Format, shape: tuple[int, ...], key: jax.Array, std: float) -> dict[str, jax.Array]:
  """Storage arrays of a random weight of `shape` in `fmt`, drawn on the default device.

  Every array is a valid instance of the format (random codes, fixed scale aimed at `std`, sorted
  random codebooks), so random weights exercise exactly the decode the real ones use.
  """
  layout = fmt.storage(shape)
  keys = dict(zip(layout, jax.random.split(key, len(layout))))

  def random_bytes(name):
    return jax.random.bits(keys[name], layout[name][0], jnp.uint8)

  if fmt.name == "bf16":
    return {"weight": (std * jax.random.normal(keys["weight"], shape, jnp.float32)).astype(jnp.bfloat16)}
  if fmt.name == "fp8_e4m3":
    codes = jnp.clip(_FP8_CODE_STD * jax.random.normal(keys["weight"], shape, jnp.float32), -448, 448)
    scale = ue8m0.BIAS + round(math.log2(std / _FP8_CODE_STD))
    return {"weight": codes.astype(ml_dtypes.float8_e4m3fn), "scale": jnp.full(layout["scale"][0], scale, jnp.uint8)}
  out = {}
  if fmt.name == "fp4_e2m1":
    out["packed"] = random_bytes("packed").view(jnp.int8)
    out["scale"] = jnp.full(layout["scale"][0], ue8m0.BIAS + round(math.log2(std / _LEVEL_RMS[fmt.name])), jnp.uint8)
    return out
  # ROCmFP families: random code bytes, one UE4M3 scale byte; bit 7 is the codebook select (MIX) or the
  # fp2s negation (plain ROCmFP2), and invalid on plain ROCmFP3.
  scale = int(ue4m3.nearest_byte(std / _LEVEL_RMS[fmt.name]))
  for name in layout:
    if name.startswith("codes"):
      out[name] = random_bytes(name)
  bit7 = random_bytes("scales") & (0x80 if fmt.name != "rocmfp3" else 0)
  out["scales"] = jnp.uint8(scale) | bit7
  if "books" in layout:
    book_shape = layout["books"][0]
    init = jnp.asarray(_INIT_BOOKS[fmt.name], jnp.float32)
    # Jitter each level by less than a quarter of the smallest gap, so books stay strictly increasing.
    jitter = jax.random.uniform(keys["books"], book_shape, jnp.float32, -0.2, 0.2)
    out["books"] = (init + jitter).astype(jnp.bfloat16)
    out["mode"] = jnp.ones(layout["mode"][0], jnp.uint8)
  return out


def quantize(fmt: formats.Format, w: np.ndarray) -> dict[str, np.ndarray]:
  """Host encoder for checkpoint conversion: float weights [..., out, in] -> storage arrays (validated)."""
  arrays = fmt.quantize(np.asarray(w, np.float32))
  fmt.check(**arrays)
  return arrays


def role_shapes(cfg) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
  """Every (tensor, shape) of each quantized role in one layer of `cfg` (names as in the checkpoint)."""
  D, H, d, G = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.o_groups
  I, E, q = cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.q_lora_rank
  dense = [("attn.wq_a", (q, D)), ("attn.wq_b", (H * d, q)), ("attn.wkv", (d, D)),
           ("attn.wo_a", (G * cfg.o_lora_rank, H * d // G)), ("attn.wo_b", (D, G * cfg.o_lora_rank)),
           ("ffn.shared_experts.w1", (I, D)), ("ffn.shared_experts.w2", (D, I)), ("ffn.shared_experts.w3", (I, D))]
  if any(a.value == "compressed_sparse_attention" for a in cfg.attention):
    dense.append(("attn.indexer.wq_b", (cfg.index_n_heads * cfg.index_head_dim, q)))
  return {"dense": dense, "gate_up": [("ffn.experts.w1", (E, I, D)), ("ffn.experts.w3", (E, I, D))],
          "down": [("ffn.experts.w2", (E, D, I))]}


def check_config(pol: QuantPolicy, cfg) -> None:
  """Start-up check that every tensor of `cfg` can be stored under `pol`; the error names tensor and format."""
  for role, tensors in role_shapes(cfg).items():
    fmt = pol.format_of(role)
    for name, shape in tensors:
      check_shape(fmt, shape, f"policy {pol.name}: {name} ({role})")
