"""DeepSeek-V4 architecture config: one frozen dataclass, published presets, HF config.json parsing."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Any, Mapping


class Attention(enum.Enum):
  """Key set of a layer, beyond its sliding window (docs/model.md §4)."""

  WINDOW = "sliding_attention"  # window only
  CSA = "compressed_sparse_attention"  # + ratio-4 compressed rows picked by the indexer
  HCA = "heavily_compressed_attention"  # + every complete ratio-128 compressed row


class Routing(enum.Enum):
  HASH = "hash_moe"  # experts = tid2eid[token id]
  TOPK = "moe"  # experts = top-k(score + bias)


@dataclasses.dataclass(frozen=True, slots=True)
class Yarn:
  """YaRN frequency scaling of compressed layers (DeepSeek-V3 form, no mscale)."""

  factor: float
  original_max_position_embeddings: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DeepseekV4Config:
  """Every architecture field of DeepSeek-V4. Names follow HF transformers where it has one."""

  vocab_size: int
  hidden_size: int
  attention: tuple[Attention, ...]  # one entry per layer; its length is the layer count
  routing: tuple[Routing, ...]  # one entry per layer
  # attention
  num_heads: int
  head_dim: int
  rope_head_dim: int  # RoPE acts on the LAST rope_head_dim dims of each head, interleaved
  q_lora_rank: int
  o_groups: int
  o_lora_rank: int
  sliding_window: int
  csa_ratio: int = 4
  hca_ratio: int = 128
  index_n_heads: int
  index_head_dim: int
  index_topk: int
  rope_theta: float = 10000.0
  compress_rope_theta: float = 160000.0
  yarn: Yarn | None = None  # applied on compressed layers only
  # MoE
  n_routed_experts: int
  experts_per_token: int
  moe_intermediate_size: int
  routed_scaling_factor: float
  swiglu_limit: float = 10.0
  # hyper-connections
  hc_mult: int = 4
  hc_sinkhorn_iters: int = 20
  hc_eps: float = 1e-6
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int = 1048576
  bos_token_id: int = 0
  eos_token_id: int = 1
  name: str = "custom"

  def __post_init__(self):
    def need(ok: bool, field: str, why: str):
      if not ok:
        raise ValueError(f"DeepseekV4Config.{field}: {why} (got {getattr(self, field)!r})")

    for f in ("vocab_size", "hidden_size", "num_heads", "head_dim", "q_lora_rank", "o_groups",
              "o_lora_rank", "sliding_window", "csa_ratio", "hca_ratio", "n_routed_experts",
              "experts_per_token", "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters",
              "max_position_embeddings"):
      need(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f, "must be a positive int")
    object.__setattr__(self, "attention", tuple(Attention(a) for a in self.attention))
    object.__setattr__(self, "routing", tuple(Routing(r) for r in self.routing))
    need(len(self.attention) > 0, "attention", "needs one entry per layer")
    need(len(self.routing) == len(self.attention), "routing",
         f"needs one entry per layer ({len(self.attention)} layers)")
    need(self.rope_head_dim > 0 and self.rope_head_dim % 2 == 0 and self.rope_head_dim <= self.head_dim,
         "rope_head_dim", f"must be even, positive and <= head_dim={self.head_dim}")
    need((self.num_heads * self.head_dim) % self.o_groups == 0, "o_groups",
         f"must divide num_heads*head_dim={self.num_heads * self.head_dim}")
    need(self.experts_per_token <= self.n_routed_experts, "experts_per_token",
         f"must be <= n_routed_experts={self.n_routed_experts}")
    if Attention.CSA in self.attention:
      for f in ("index_n_heads", "index_head_dim", "index_topk"):
        need(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f, "must be a positive int")
      need(self.index_head_dim >= self.rope_head_dim, "index_head_dim",
           f"must be >= rope_head_dim={self.rope_head_dim}")
    need(self.sliding_window >= 1, "sliding_window", "must be >= 1")
    need(self.swiglu_limit > 0, "swiglu_limit", "must be > 0")
    for f in ("bos_token_id", "eos_token_id"):  # else generation's default stop never fires
      need(isinstance(getattr(self, f), int) and 0 <= getattr(self, f) < self.vocab_size, f,
           f"must be a token id in [0, vocab_size={self.vocab_size})")

  # ---- derived ----
  @property
  def num_layers(self) -> int:
    return len(self.attention)

  def compress_ratio(self, layer: int) -> int:
    """0 for window-only layers, else the compressor's ratio m."""
    kind = self.attention[layer]
    return {Attention.WINDOW: 0, Attention.CSA: self.csa_ratio, Attention.HCA: self.hca_ratio}[kind]

  def replace(self, **changes) -> "DeepseekV4Config":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    """A JSON-able dict (ds4jax's own form, not HF's); `from_dict` inverts it."""
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["attention"] = [a.value for a in self.attention]
    d["routing"] = [r.value for r in self.routing]
    d["yarn"] = dataclasses.asdict(self.yarn) if self.yarn else None
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "DeepseekV4Config":
    d = dict(d)
    d["attention"] = tuple(Attention(a) for a in d["attention"])
    d["routing"] = tuple(Routing(r) for r in d["routing"])
    d["yarn"] = Yarn(**d["yarn"]) if d.get("yarn") else None
    return cls(**d)

  # ---- parameter counts ----
  def param_counts(self) -> dict[str, int]:
    """Parameter counts by component (weights only; tid2eid tables are int buffers, not counted)."""
    D, n, H, d = self.hidden_size, self.hc_mult, self.num_heads, self.head_dim
    I, E, V = self.moe_intermediate_size, self.n_routed_experts, self.vocab_size
    hc_site = (2 + n) * n * n * D + (2 + n) * n + 3
    attn = (self.q_lora_rank * D + self.q_lora_rank + H * d * self.q_lora_rank + d * D + d
            + self.o_groups * self.o_lora_rank * (H * d // self.o_groups)
            + D * self.o_groups * self.o_lora_rank + H)
    counts = dict(embed=V * D, head=V * D + D + n * n * D + n + 1, attention=0, compressor=0,
                  indexer=0, hyper_connections=0, norms=0, router=0, shared_experts=0,
                  routed_experts=0)
    for layer, kind in enumerate(self.attention):
      counts["norms"] += 2 * D
      counts["hyper_connections"] += 2 * hc_site
      counts["attention"] += attn
      if kind is not Attention.WINDOW:
        m, coff = self.compress_ratio(layer), (2 if kind is Attention.CSA else 1)
        counts["compressor"] += 2 * coff * d * D + m * coff * d + d
      if kind is Attention.CSA:
        ci, hi = self.index_head_dim, self.index_n_heads
        counts["indexer"] += hi * ci * self.q_lora_rank + hi * D + 2 * 2 * ci * D + 4 * 2 * ci + ci
      counts["router"] += E * D + (E if self.routing[layer] is Routing.TOPK else 0)
      counts["shared_experts"] += 3 * I * D
      counts["routed_experts"] += E * 3 * I * D
    counts["total"] = sum(counts.values())
    counts["active_per_token"] = (counts["total"] - counts["routed_experts"]
                                  + self.num_layers * self.experts_per_token * 3 * I * D)
    return counts

  # ---- HF config.json ----
  def to_hf_config(self) -> dict[str, Any]:
    """HF transformers' `config.json` form (its internal layer_types / rope_parameters schema)."""
    # transformers reads the rope dims from each sub-dict's partial_rotary_factor (1.0 where it is missing: RoPE over
    # the whole head), as its own config.json writes them
    partial = self.rope_head_dim / self.head_dim
    compress = {"rope_type": "default", "rope_theta": self.compress_rope_theta, "partial_rotary_factor": partial}
    if self.yarn:
      compress.update(rope_type="yarn", attention_factor=1.0, **dataclasses.asdict(self.yarn))
    return dict(
        model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], vocab_size=self.vocab_size,
        hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
        layer_types=[a.value for a in self.attention], mlp_layer_types=[r.value for r in self.routing],
        compress_rates={Attention.CSA.value: self.csa_ratio, Attention.HCA.value: self.hca_ratio},
        num_attention_heads=self.num_heads, num_key_value_heads=1, head_dim=self.head_dim,
        qk_rope_head_dim=self.rope_head_dim, q_lora_rank=self.q_lora_rank, o_groups=self.o_groups,
        o_lora_rank=self.o_lora_rank, sliding_window=self.sliding_window, index_n_heads=self.index_n_heads,
        index_head_dim=self.index_head_dim, index_topk=self.index_topk, rope_theta=self.rope_theta,
        compress_rope_theta=self.compress_rope_theta, partial_rotary_factor=partial,
        rope_parameters={"main": {"rope_type": "default", "rope_theta": self.rope_theta,
                                  "partial_rotary_factor": partial}, "compress": compress},
        n_routed_experts=self.n_routed_experts, n_shared_experts=1, num_experts_per_tok=self.experts_per_token,
        moe_intermediate_size=self.moe_intermediate_size, routed_scaling_factor=self.routed_scaling_factor,
        swiglu_limit=self.swiglu_limit, scoring_func="sqrtsoftplus", hc_mult=self.hc_mult,
        hc_sinkhorn_iters=self.hc_sinkhorn_iters, hc_eps=self.hc_eps, rms_norm_eps=self.rms_norm_eps,
        max_position_embeddings=self.max_position_embeddings, bos_token_id=self.bos_token_id,
        eos_token_id=self.eos_token_id, tie_word_embeddings=False, _name_or_path=self.name)

  @classmethod
  def from_hf_config(cls, cfg: Mapping[str, Any] | str | os.PathLike, **overrides) -> "DeepseekV4Config":
    """Builds a config from an HF `config.json` (a path or a dict).

    Accepts both HF's internal form (`layer_types`, `mlp_layer_types`, `rope_parameters`,
    `partial_rotary_factor`, `compress_rates`) and the legacy published form (`compress_ratios`,
    `num_hash_layers`, `rope_scaling`, `qk_rope_head_dim`, `compress_rate_hca`).
    """
    where = "config.json"
    if not isinstance(cfg, Mapping):
      where = os.fspath(cfg)
      if os.path.isdir(where):
        where = os.path.join(where, "config.json")
      if not os.path.exists(where):
        raise ValueError(f"{where} does not exist")
      try:
        with open(where) as f:
          cfg = json.load(f)
      except (OSError, ValueError) as e:  # missing, unreadable, not JSON
        raise ValueError(f"{where}: cannot read a config ({e})") from None
      if not isinstance(cfg, Mapping):
        raise ValueError(f"{where}: a config is a JSON object, got a {type(cfg).__name__}")
    try:
      return cls._from_hf_dict(dict(cfg), overrides)
    except KeyError as e:  # a key every DeepSeek-V4 config.json has
      raise ValueError(f"{where}: no {e.args[0]!r}") from None
    except (TypeError, IndexError, AttributeError) as e:  # a value of the wrong kind (null, a string, a list)
      raise ValueError(f"{where}: {type(e).__name__}: {e}") from None

  @classmethod
  def _from_hf_dict(cls, c: dict, overrides: dict) -> "DeepseekV4Config":
    if c.get("model_type", "deepseek_v4") != "deepseek_v4":
      raise ValueError(f"config.json model_type must be 'deepseek_v4', got {c['model_type']!r}")
    n_layers = c["num_hidden_layers"]
    rates = dict(c.get("compress_rates") or {})
    csa = rates.get(Attention.CSA.value, c.get("compress_rate_csa", 4))
    hca = rates.get(Attention.HCA.value, c.get("compress_rate_hca", 128))
    if c.get("layer_types") is not None:
      attention = [Attention(t) for t in c["layer_types"]]
    elif c.get("compress_ratios") is not None:
      by_ratio = {0: Attention.WINDOW, 4: Attention.CSA, 128: Attention.HCA}
      bad = [r for r in c["compress_ratios"] if r not in by_ratio]
      if bad:
        raise ValueError(f"config.json compress_ratios: values must be 0, 4 or 128, got {bad}")
      attention = [by_ratio[r] for r in c["compress_ratios"]]
    else:
      raise ValueError("config.json: needs layer_types or compress_ratios (HF's implicit default "
                       "schedule is not the published one)")
    if len(attention) < n_layers:
      raise ValueError(f"config.json: {len(attention)} layer types for num_hidden_layers={n_layers}")
    attention = attention[:n_layers]  # compress_ratios carries one extra entry for the MTP layer
    if c.get("mlp_layer_types") is not None:
      routing = [Routing(t) for t in c["mlp_layer_types"]][:n_layers]
    else:
      n_hash = c.get("num_hash_layers", 3)
      routing = [Routing.HASH] * min(n_hash, n_layers) + [Routing.TOPK] * max(0, n_layers - n_hash)
    head_dim = c["head_dim"]
    # transformers' order: partial_rotary_factor, else the legacy qk_rope_head_dim, else 64 / 512
    if c.get("partial_rotary_factor") is not None:
      rope_dim = int(head_dim * c["partial_rotary_factor"])
    elif c.get("qk_rope_head_dim") is not None:
      rope_dim = c["qk_rope_head_dim"]
    else:
      rope_dim = int(head_dim * 64 / 512)
    rope_theta = c.get("rope_theta", 10000.0)
    compress_theta = c.get("compress_rope_theta", 160000.0)
    rp = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling")
    if isinstance(rp.get("compress"), dict):
      scaling = rp["compress"]
      compress_theta = scaling.get("rope_theta", compress_theta)
      if isinstance(rp.get("main"), dict):
        rope_theta = rp["main"].get("rope_theta", rope_theta)
    elif scaling is None and rp:
      scaling = rp
    yarn = None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn":
      if scaling.get("attention_factor", 1.0) not in (None, 1.0) or scaling.get("mscale"):
        raise ValueError("config.json rope scaling: DeepSeek-V4 uses no YaRN mscale/attention_factor")
      yarn = Yarn(factor=float(scaling["factor"]),
                  original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                  beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1))
    if c.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
      raise ValueError(f"config.json scoring_func: only 'sqrtsoftplus' is DeepSeek-V4, got {c['scoring_func']!r}")
    if c.get("n_shared_experts", 1) != 1:
      raise ValueError(f"config.json n_shared_experts: DeepSeek-V4 has exactly 1, got {c['n_shared_experts']}")
    if c.get("num_key_value_heads", 1) != 1:
      raise ValueError(f"config.json num_key_value_heads: DeepSeek-V4 has one shared K=V head, "
                       f"got {c['num_key_value_heads']}")
    eos = c.get("eos_token_id", 1)
    fields = dict(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], attention=tuple(attention),
        routing=tuple(routing), num_heads=c["num_attention_heads"], head_dim=head_dim,
        rope_head_dim=rope_dim, q_lora_rank=c["q_lora_rank"], o_groups=c["o_groups"],
        o_lora_rank=c["o_lora_rank"], sliding_window=c["sliding_window"], csa_ratio=csa, hca_ratio=hca,
        index_n_heads=c.get("index_n_heads", 64), index_head_dim=c.get("index_head_dim", 128),
        index_topk=c.get("index_topk", 512), rope_theta=float(rope_theta),
        compress_rope_theta=float(compress_theta), yarn=yarn, n_routed_experts=c["n_routed_experts"],
        experts_per_token=c["num_experts_per_tok"], moe_intermediate_size=c["moe_intermediate_size"],
        routed_scaling_factor=float(c["routed_scaling_factor"]), swiglu_limit=float(c.get("swiglu_limit", 10.0)),
        hc_mult=c.get("hc_mult", 4), hc_sinkhorn_iters=c.get("hc_sinkhorn_iters", 20),
        hc_eps=float(c.get("hc_eps", 1e-6)), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=c.get("max_position_embeddings", 1048576),
        bos_token_id=c.get("bos_token_id", 0) or 0, eos_token_id=eos[0] if isinstance(eos, list) else eos,
        name=c.get("_name_or_path") or "hf")
    fields.update(overrides)
    return cls(**fields)


# ---- presets ----
_W, _C, _H = Attention.WINDOW, Attention.CSA, Attention.HCA
_FLASH_YARN = Yarn(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)


def _schedule(ratios: list[int], n_layers: int, n_hash: int):
  by_ratio = {0: _W, 4: _C, 128: _H}
  attention = tuple(by_ratio[r] for r in ratios[:n_layers])
  routing = tuple(Routing.HASH if i < n_hash else Routing.TOPK for i in range(n_layers))
  return attention, routing


def v4_flash(**overrides) -> DeepseekV4Config:
  """DeepSeek-V4-Flash, as published (43 layers, 256 experts, ~284B parameters)."""
  attention, routing = _schedule([0, 0] + [4, 128] * 20 + [4, 0], 43, 3)
  cfg = dict(name="v4_flash", vocab_size=129280, hidden_size=4096, attention=attention, routing=routing,
             num_heads=64, head_dim=512, rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
             sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512, yarn=_FLASH_YARN,
             n_routed_experts=256, experts_per_token=6, moe_intermediate_size=2048,
             routed_scaling_factor=1.5)
  return DeepseekV4Config(**(cfg | overrides))


def v4_pro(**overrides) -> DeepseekV4Config:
  """DeepSeek-V4-Pro, as published (61 layers, 384 experts, ~1.57T parameters)."""
  attention, routing = _schedule([128, 128] + [4, 128] * 29 + [4, 0], 61, 3)
  cfg = dict(name="v4_pro", vocab_size=129280, hidden_size=7168, attention=attention, routing=routing,
             num_heads=128, head_dim=512, rope_head_dim=64, q_lora_rank=1536, o_groups=16, o_lora_rank=1024,
             sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=1024, yarn=_FLASH_YARN,
             n_routed_experts=384, experts_per_token=6, moe_intermediate_size=3072,
             routed_scaling_factor=2.5)
  return DeepseekV4Config(**(cfg | overrides))


def _tiny(overrides: dict, **preset) -> DeepseekV4Config:
  """Small dims shared by the tiny presets (those of docs/model.md §11); `preset` then `overrides` win."""
  base = dict(vocab_size=256, hidden_size=64, num_heads=4, head_dim=160, rope_head_dim=32, q_lora_rank=32,
              o_groups=2, o_lora_rank=16, sliding_window=8, hca_ratio=8, index_n_heads=4, index_head_dim=64,
              index_topk=3, yarn=Yarn(factor=4.0, original_max_position_embeddings=32),
              max_position_embeddings=128, n_routed_experts=8, experts_per_token=2, moe_intermediate_size=32,
              routed_scaling_factor=1.5, swiglu_limit=1.0)
  return DeepseekV4Config(**(base | preset | overrides))


def tiny(**overrides) -> DeepseekV4Config:
  """4 layers [window, CSA, HCA(ratio 8), CSA], layer 0 hash-routed: every layer kind in one model."""
  return _tiny(overrides, name="tiny", attention=(_W, _C, _H, _C), routing=(Routing.HASH,) + (Routing.TOPK,) * 3)


def tiny_window(**overrides) -> DeepseekV4Config:
  """2 window-only layers, both hash-routed."""
  return _tiny(overrides, name="tiny_window", attention=(_W, _W), routing=(Routing.HASH, Routing.HASH))


def tiny_csa(**overrides) -> DeepseekV4Config:
  """3 CSA layers with top-k routing; index_topk 4 so the indexer really drops rows."""
  return _tiny(overrides, name="tiny_csa", attention=(_C, _C, _C), routing=(Routing.TOPK,) * 3, index_topk=4)


def tiny_hca(**overrides) -> DeepseekV4Config:
  """2 HCA layers (ratio 8) + 1 window layer; hash routing on the first two."""
  return _tiny(overrides, name="tiny_hca", attention=(_H, _H, _W), routing=(Routing.HASH, Routing.HASH, Routing.TOPK))


def tiny_sparse(**overrides) -> DeepseekV4Config:
  """`tiny` with the sizes the sparse-attention kernels take (power-of-two head_dim 128 and index_topk 4), so
  every fast path runs on it: window, CSA and HCA layers, hash and top-k MoE."""
  return tiny(**({"name": "tiny_sparse", "head_dim": 128, "index_topk": 4} | overrides))


PRESETS = {f.__name__: f for f in (v4_flash, v4_pro, tiny, tiny_window, tiny_csa, tiny_hca, tiny_sparse)}


def preset(name: str, **overrides) -> DeepseekV4Config:
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
  return PRESETS[name](**overrides)


def human(n: float) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.3f}M"

