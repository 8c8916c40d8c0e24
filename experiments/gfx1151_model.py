"""A performance model of the all_on V4-Flash prefill on gfx1151 (Strix Halo), built from the H200 kernel traces.

    python -m experiments.gfx1151_model [--out_json=experiments/results/gfx1151_model.json]
                                        [--out_md=experiments/results/gfx1151_model.md]

docs/performance_model.md explains the model, its assumptions and the sources of every hardware number. In short:

1. Every kernel of the H200 traces (`experiments/results/trace_prefill_h200_*.json`, all_on = the "flags" variant)
   is put in a kernel class (`classify`).
2. Each class's FLOPs, DRAM bytes and vector (VALU) work per prefill are computed from the V4-Flash config, the
   `lucebox_mix` storage formats and the token count (`class_work`), for the program each device runs: the H200's
   (MIX experts decoded to bf16 once per layer, then bf16 MoE kernels) and gfx1151's (the MoE kernels read the MIX
   bytes directly, as upstream's MMQ does, and decode them in-kernel).
3. On the H200, each class reaches a fraction of its roofline: roofline time / traced time (`h200_efficiency`).
4. The gfx1151 time of a class is its gfx1151 roofline time, divided by that fraction in the scenarios that carry
   the H200's efficiency (`SCENARIOS`); the prefill time is the sum over classes (kernels run one after another).

7680 tokens have no trace: they take the 8192 trace's efficiencies, applied to 7680's FLOPs and bytes. 122879 has
no kernel trace (only its wall time): it takes the 32768 trace's efficiencies, and the H200 time they predict is
checked against the measured wall time (`h200_check`).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import pathlib
import re
from typing import Mapping

import numpy as np
from absl import app, flags

from ds4jax import config as config_lib
from ds4jax.quant import policy as quant_policy

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "experiments" / "results"
TRACES = {8192: "trace_prefill_h200_8192.json", 32768: "trace_prefill_h200_32768.json",
          122879: "trace_prefill_h200_122879.json"}
MOE_BENCH = "moe_bench_h200_2026-11-30.json"
LOWERING = "lowering_gfx1151.json"
LENGTHS = (7680, 8192, 32768, 122879)
# Which trace's efficiencies each length takes (the nearest traced length with kernels).
EFFICIENCY_FROM = {7680: 8192, 8192: 8192, 32768: 32768, 122879: 32768}
BAND_TOKENS = 8192  # ds4jax's and upstream's (#684 "sparse Q8192", #685 LONG_CONTEXT_CHUNK=8192) band
# Upstream's published gfx1151 prefill (docs/upstream.md; PR #684 and the #667 run quoted in PR #685).
UPSTREAM_TOK_S = {7680: (254.921, "Luce-Org/lucebox PR #684: warm midpoint, one 7,680-token sparse band"),
                  122879: (142.82, "Luce-Org/lucebox PR #667, quoted in PR #685: independent 122,879-token run")}
GB = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class Device:
  """The roofs of one device. `valu_tera_lane_ops`: 32-bit vector lane operations per second, 1e12 (the in-kernel
  MIX decode is integer and f32 vector work, not matrix work)."""
  name: str
  bf16_tflops: float  # dense bf16 matrix peak (tensor cores / WMMA)
  f32_tflops: float  # f32 FMA peak on the vector units (the f32 GEMMs have no matrix path)
  valu_tera_lane_ops: float
  gb_per_s: float  # DRAM bandwidth
  sources: tuple[str, ...]

  def times_s(self, work: "Work") -> dict[str, float]:
    """Seconds at each roof: DRAM bytes, matrix (or f32 vector) FLOPs, VALU lane ops."""
    peak = self.f32_tflops if work.f32 else self.bf16_tflops
    return dict(memory=work.bytes / (self.gb_per_s * GB), flops=work.flops / (peak * 1e12),
                valu=work.valu_ops / (self.valu_tera_lane_ops * 1e12))

  def roofline_s(self, work: "Work") -> float:
    """max(bytes / bandwidth, FLOPs / peak + VALU ops / lane rate). The matrix and vector terms add: RDNA 3's WMMA
    issues on the same SIMDs as the vector ALU work (docs/performance_model.md §3)."""
    t = self.times_s(work)
    return max(t["memory"], t["flops"] + t["valu"])

  def roof(self, work: "Work") -> str:
    """Which roof bounds `work`: "memory", "flops" or "valu" (the larger of the two compute terms)."""
    t = self.times_s(work)
    if not any(t.values()):
      return "none"
    return "memory" if t["memory"] >= t["flops"] + t["valu"] else max(("flops", "valu"), key=t.get)


_H200_SOURCES = (
    "dense bf16 989 TFLOP/s (1,979 with 2:4 sparsity) and HBM3e 4.8 TB/s: NVIDIA's H200 SXM figures, as "
    "experiments/results_tables.py `H200` uses them; e.g. https://itkb.uw.cz/2026/06/nvidia-h200-vs-b300-precisions-"
    "cores.html",
    "f32 66.9 TFLOP/s = 16,896 CUDA cores x 2 x 1.98 GHz boost; 33.5e12 lane-ops/s = 16,896 x 1.98 GHz: "
    "https://hmc-tech.com/gpu/nvidia-h100-vs-nvidia-h200-sxm-vs-nvidia-gb200",
)
H200 = Device(name="NVIDIA H200 SXM (vendor figures)", bf16_tflops=989.0, f32_tflops=66.9,
              valu_tera_lane_ops=16896 * 1.98e9 / 1e12, gb_per_s=4800.0, sources=_H200_SOURCES)

GFX1151_CUS, GFX1151_GHZ = 40, 2.9
WMMA_FLOPS_PER_CLOCK_PER_CU = 512  # RDNA 3 fp16/bf16 (GPUOpen's RDNA 4 matrix-core article, RX 7900 XTX column)
VALU_LANES_PER_CU = 64  # 2 SIMD32 per CU, one wave32 instruction each per clock (no VOPD dual issue counted)
_GFX1151_SOURCES = (
    "40 RDNA 3.5 CUs at up to 2.9 GHz, 256-bit LPDDR5X-8000 (256 GB/s): https://www.svethardware.cz/amd-predstavuje-"
    "ryzen-ai-max-strix-halo-s-az-16-jadry-a-gpu-se-40-cu/61477 and https://whylucian.github.io/softab/docs/hardware-"
    "specs.html",
    "RDNA 3 WMMA: 512 fp16/bf16 FLOPs per clock per CU: https://gpuopen.com/learn/using_matrix_core_amd_rdna4 ; "
    "512 x 40 x 2.9e9 = 59.4 TFLOP/s, as https://llm-tracker.info/_TOORG/Strix-Halo derives it",
    "f32 14.85 TFLOP/s (vector, no dual issue): https://fpsbench.com/compare/gpu/amd-radeon-8060s-vs-amd-radeon-"
    "rx-7600m",
    "LDS 64 KiB per workgroup: docs/lowering.md §4 (the offline lowering check gates on it)",
)
GFX1151 = Device(name="gfx1151 / Radeon 8060S (vendor figures)",
                 bf16_tflops=WMMA_FLOPS_PER_CLOCK_PER_CU * GFX1151_CUS * GFX1151_GHZ / 1e3,
                 f32_tflops=2 * VALU_LANES_PER_CU * GFX1151_CUS * GFX1151_GHZ / 1e3,
                 valu_tera_lane_ops=VALU_LANES_PER_CU * GFX1151_CUS * GFX1151_GHZ / 1e3,
                 gb_per_s=256 * 8000 / 8 / 1e3, sources=_GFX1151_SOURCES)  # 256-bit bus x 8000 MT/s
GFX1151_MEASURED = dataclasses.replace(
    GFX1151, name="gfx1151 / Radeon 8060S (best measured)", bf16_tflops=36.9, gb_per_s=212.0,
    sources=("rocm_bandwidth_test ~212 GB/s; mamf-finder with hipBLASLt 36.9 bf16 TFLOP/s (without it 5.1): "
             "https://llm-tracker.info/_TOORG/Strix-Halo (lhl's Strix Halo notes); ~215 GB/s also at "
             "https://whylucian.github.io/softab/docs/hardware-specs.html",
             "f32 and VALU rates: not measured; the vendor figures stand in"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scenario:
  """How a class's gfx1151 time follows from its work. `h200_efficiency`: divide the roofline time by the fraction
  of its roofline the class reaches on the H200. `decode_lanes_per_sm`: the H200 lane rate the fused MIX decode's
  measured time is converted to operations at (128 = every op at the f32 rate; 64 = Hopper's integer rate, half as
  many operations for the same time)."""
  name: str
  device: Device
  h200_efficiency: bool
  decode_lanes_per_sm: int
  what: str


SCENARIOS = (
    Scenario(name="speed_of_light", device=GFX1151, h200_efficiency=False, decode_lanes_per_sm=64,
             what="every class at its gfx1151 roofline from the vendor figures (the fused MIX decode at its "
                  "calibrated work, counted at Hopper's integer rate)"),
    Scenario(name="optimistic", device=GFX1151_MEASURED, h200_efficiency=False, decode_lanes_per_sm=64,
             what="every class at the best measured gfx1151 bandwidth and bf16 GEMM rate"),
    Scenario(name="central", device=GFX1151, h200_efficiency=True, decode_lanes_per_sm=128,
             what="every class at the fraction of its vendor roofline that it reaches on the H200"),
    Scenario(name="pessimistic", device=GFX1151_MEASURED, h200_efficiency=True, decode_lanes_per_sm=128,
             what="that fraction taken of the best measured gfx1151 roofs instead of the vendor ones"),
)
CENTRAL = "central"


# ---- kernel classes ----
CLASSES = ("mix_decode", "moe_gate_up", "moe_down", "mla", "indexer_scores", "topk", "dense_gemm", "f32_gemm",
           "other")
CLASS_WHAT = {
    "mix_decode": "MIX experts decoded to bf16 (H200: XLA pass once per layer; gfx1151: VALU work inside the MoE)",
    "moe_gate_up": "routed experts gate/up + SwiGLU (Pallas)",
    "moe_down": "routed experts down (Pallas)",
    "mla": "sparse MLA attention, streaming kernel (CSA, HCA and window layers)",
    "indexer_scores": "lightning indexer scores (Pallas, CSA layers)",
    "topk": "indexer top-512 selection (XLA sort / cub radix sort)",
    "dense_gemm": "bf16 projections: attention, shared expert, compressors, indexer, head",
    "f32_gemm": "f32 GEMMs: hyper-connection mixes and the router",
    "other": "elementwise and the rest: norms, RoPE, HC pre/merge, compressor pooling, MoE combine, copies",
}
# First match wins; the f32 GEMM before the bf16 GEMMs (cuBLAS's f32 kernels are also "xmma_gemm").
_PATTERNS = (
    ("mix_decode", r"^loop_convert_fusion$"),
    ("moe_gate_up", r"^moe_(sparse_)?gate_up"),
    ("moe_down", r"^moe_down"),
    ("mla", r"^mla_"),
    ("indexer_scores", r"^indexer_scores"),
    ("topk", r"RadixSort|radix_sort|^sort_|top_?k|^indexer_radix_select"),
    ("f32_gemm", r"gemm_f32f32|f32f32_f32"),
    ("dense_gemm", r"^nvjet_|^gemm_fusion|cutlass|xmma_gemm|^cublas"),
)


def classify(kernel: str) -> str:
  """The kernel class of a traced kernel name (device_trace's names: cut at the first dot)."""
  for cls, pattern in _PATTERNS:
    if re.search(pattern, kernel):
      return cls
  return "other"


def h200_class_ms(kernels: list[Mapping]) -> tuple[dict[str, float], dict[str, list[str]]]:
  """Traced device ms per class, and the kernels (with their ms) each class holds."""
  ms = {c: 0.0 for c in CLASSES}
  names: dict[str, list[str]] = {c: [] for c in CLASSES}
  for k in kernels:
    cls = classify(k["kernel"])
    ms[cls] += k["ms"]
    names[cls].append(f"{k['kernel'][:60]} {k['ms']:.1f} ms")
  return ms, names


# ---- work per class ----
@dataclasses.dataclass(frozen=True, kw_only=True)
class Work:
  flops: float = 0.0  # matrix FLOPs (2 per multiply-add), useful ones only
  bytes: float = 0.0  # DRAM bytes: weights per band, activations once in and once out
  valu_ops: float = 0.0  # vector lane operations outside the matrix units (the fused MIX decode)
  f32: bool = False  # the FLOPs run on the f32 vector units
  cache_bytes: float = 0.0  # re-reads served by L2/MALL: not in the roofline, reported (docs/performance_model.md §2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tiling:
  """The tile shapes that set how often work repeats: MoE weights are decoded once per row tile of `moe_block_m`
  routed rows per expert (kernels_pallas/moe config), MLA rows are gathered once per `mla_heads_per_program`
  heads (kernels_pallas/mla config)."""
  moe_block_m: int = 128
  mla_heads_per_program: int = 16


def band_sizes(tokens: int, band: int = BAND_TOKENS) -> list[int]:
  return [min(band, tokens - s) for s in range(0, tokens, band)]


def experts_touched(cfg, band_tokens: int) -> float:
  """Expected experts with at least one route in a band under uniform routing: E (1 - (1 - K/E)^S)."""
  E, K = cfg.n_routed_experts, cfg.experts_per_token
  return E * (1.0 - (1.0 - K / E) ** band_tokens)


def row_tiles(cfg, band_tokens: int, block_m: int) -> int:
  """Row tiles per expert of a band: ceil(S K / E / block_m), routes spread evenly."""
  return math.ceil(band_tokens * cfg.experts_per_token / cfg.n_routed_experts / block_m)


def key_sums(cfg, tokens: int) -> dict[str, float]:
  """Sums over the queries t = 0 … T-1 of one layer's attended keys (docs/model.md §4.1) and indexer rows (§6)."""
  t1 = np.arange(1, tokens + 1, dtype=np.int64)  # t + 1
  window = np.minimum(t1, cfg.sliding_window)
  csa_rows = t1 // cfg.csa_ratio
  return dict(window=float(window.sum()), csa=float((window + np.minimum(csa_rows, cfg.index_topk)).sum()),
              hca=float((window + t1 // cfg.hca_ratio).sum()), csa_visible=float(csa_rows.sum()))


def _kinds(cfg) -> dict[str, int]:
  names = {"window": "WINDOW", "csa": "CSA", "hca": "HCA"}
  return {k: sum(a.name == v for a in cfg.attention) for k, v in names.items()}


def dense_gemms(cfg, pol) -> dict[str, list[tuple[int, int, int, float]]]:
  """Per layer kind, the bf16 projections as (multiply-adds per token, input and output elements per token, weight
  bytes): the quantized 'dense' role in its policy format (ds4jax/quant/policy.py `role_shapes`), compressors and
  indexer weights_proj in bf16. wo_a is grouped: each of its G groups reads H d / G of the H d inputs."""
  D, c, ci, Hi = cfg.hidden_size, cfg.head_dim, cfg.index_head_dim, cfg.index_n_heads
  fmt = pol.format_of("dense")
  inputs = {"attn.wo_a": cfg.num_heads * cfg.head_dim}
  quantized = {name: (shape[0] * shape[1], inputs.get(name, shape[1]), shape[0], fmt.nbytes(shape))
               for name, shape in quant_policy.role_shapes(cfg)["dense"]}
  bf16 = lambda k, n: (k * n, k, n, 2 * k * n)
  common = [v for name, v in quantized.items() if name != "attn.indexer.wq_b"]
  csa = common + [bf16(D, 2 * c), bf16(D, 2 * c), quantized["attn.indexer.wq_b"], bf16(D, Hi), bf16(D, 2 * ci),
                  bf16(D, 2 * ci)]
  hca = common + [bf16(D, c), bf16(D, c)]
  return dict(window=common, csa=csa, hca=hca)


def class_work(cfg, pol, tokens: int, program: str, tiling: Tiling = Tiling(),
               decode_ops_per_weight_tile: float = 0.0) -> dict[str, Work]:
  """FLOPs, DRAM bytes and VALU ops of each class for one prefill of `tokens` tokens in bands of BAND_TOKENS.

  program: "h200" (the traced one: MIX experts decoded to bf16 once per layer and prompt, the MoE kernels read bf16
  weights), "gfx1151" (the MoE kernels read the MIX bytes and decode each weight once per row tile on the vector
  units, `decode_ops_per_weight_tile` lane ops each) or "gfx1151_decode_pass" (gfx1151 running the H200's program).
  Formulas: docs/performance_model.md §2."""
  if program not in ("h200", "gfx1151", "gfx1151_decode_pass"):
    raise ValueError(f"unknown program {program!r}")
  T, L = tokens, cfg.num_layers
  D, I, E, K = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.experts_per_token
  H, d, n = cfg.num_heads, cfg.head_dim, cfg.hc_mult
  Hi, ci, k_top = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
  kinds, keys, bands = _kinds(cfg), key_sums(cfg, T), band_sizes(T)
  fused = program == "gfx1151"

  # Routed experts: per band, every touched expert's weights once; MIX bytes (codes, scales, books, mode) when the
  # kernels read MIX, bf16 after a decode pass.
  shapes = {role: dict(quant_policy.role_shapes(cfg)[role]) for role in ("gate_up", "down")}
  mix_gate_up = sum(pol.format_of("gate_up").nbytes(s) for s in shapes["gate_up"].values()) / E
  mix_down = sum(pol.format_of("down").nbytes(s) for s in shapes["down"].values()) / E
  bf16_bytes = {"gate_up": 2 * 2 * I * D, "down": 2 * I * D}
  expert_bytes = {"gate_up": mix_gate_up, "down": mix_down} if fused else bf16_bytes
  touched = sum(experts_touched(cfg, s) for s in bands)  # expert reads per layer, summed over bands
  work = {
      "moe_gate_up": Work(flops=L * T * K * 2 * D * 2 * I,
                          bytes=L * (touched * expert_bytes["gate_up"] + T * K * (D + I) * 2)),
      "moe_down": Work(flops=L * T * K * 2 * I * D,
                       bytes=L * (touched * expert_bytes["down"] + T * K * I * 2 + T * K * D * 4)),
  }
  if fused:
    weight_tiles = sum(experts_touched(cfg, s) * 3 * I * D * row_tiles(cfg, s, tiling.moe_block_m) for s in bands)
    work["mix_decode"] = Work(valu_ops=L * weight_tiles * decode_ops_per_weight_tile)
  else:  # once per layer and prompt (prefill_weights_stationary): read MIX, write bf16
    work["mix_decode"] = Work(bytes=L * E * (mix_gate_up + mix_down + 3 * I * D * 2))

  # Attention: QK and PV over each query's keys, 4 H d FLOPs per key; q in bf16, the output in f32, the raw and
  # compressed rows and the indexer ids once.
  csa_rows, hca_rows = T // cfg.csa_ratio, T // cfg.hca_ratio
  mla_keys = kinds["window"] * keys["window"] + kinds["csa"] * keys["csa"] + kinds["hca"] * keys["hca"]
  # Each program stages its query's rows for `mla_heads_per_program` heads: every row is gathered H / that times.
  work["mla"] = Work(flops=4 * H * d * mla_keys,
                     bytes=L * (T * H * d * (2 + 4) + T * d * 2) + kinds["csa"] * (csa_rows * d * 2 + T * k_top * 4)
                     + kinds["hca"] * hca_rows * d * 2,
                     cache_bytes=mla_keys * d * 2 * H / tiling.mla_heads_per_program)
  # Indexer: every visible compressed row scored by every head, f32 scores written; the top-k reads them back.
  vis = keys["csa_visible"]
  work["indexer_scores"] = Work(flops=kinds["csa"] * 2 * Hi * ci * vis,
                                bytes=kinds["csa"] * (T * Hi * (ci * 2 + 4) + csa_rows * ci * 2 + vis * 4))
  work["topk"] = Work(bytes=kinds["csa"] * (vis * 4 + T * k_top * 4))

  gemms = dense_gemms(cfg, pol)
  flops = bytes_ = 0.0
  for kind, count in kinds.items():
    flops += count * T * sum(2 * macs for macs, _, _, _ in gemms[kind])
    weights = sum(w for *_, w in gemms[kind])
    bytes_ += count * (len(bands) * weights + T * sum(2 * (i + o) for _, i, o, _ in gemms[kind]))
  head = 2 * cfg.vocab_size * D  # logits of the last position only: its weight read once
  work["dense_gemm"] = Work(flops=flops + 2 * cfg.vocab_size * D, bytes=bytes_ + head)

  hc_out = (2 + n) * n
  work["f32_gemm"] = Work(
      flops=L * T * (2 * 2 * n * D * hc_out + 2 * D * E), f32=True,
      bytes=L * (T * (2 * (n * D + hc_out) * 4 + (D + E) * 4) + len(bands) * (2 * hc_out * n * D * 4 + E * D * 2)))

  # Elementwise, per token and layer: the HC sites' pre-mix and merge over the f32 streams, the two norms, q/kv norm
  # + RoPE, the attention output's inverse RoPE and cast, the compressors' pooling, the MoE combine.
  hc = 2 * (3 * n * D * 4 + 2 * D * 4)
  norms = 2 * D * (4 + 2)
  rope = 2 * (H * d + d) * 2 + H * d * (4 + 2)
  combine = K * D * 4 + D * 4
  pooling = kinds["csa"] * (4 * d + 4 * ci) * 2 + kinds["hca"] * 2 * d * 2
  work["other"] = Work(bytes=T * (L * (hc + norms + rope + combine) + pooling))
  return {c: work[c] for c in CLASSES}


# ---- H200 efficiency and the predictions ----
def decode_calibration(moe_bench: Mapping, cfg, tiling: Tiling, tokens: int = BAND_TOKENS) -> dict:
  """The fused MIX decode's cost on the H200, from bench_moe at `tokens`: whole MIX MoE with in-kernel decode minus
  the whole bf16 MoE, per weight and row tile, in H200 lane operations at the f32 rate (128 per SM per clock); and
  the gate/up kernel's share of it (rocmfp2_mix gate/up minus bf16 gate/up)."""
  runs = {r["contender"]: r["seconds"] for r in moe_bench["runs"]
          if r["tokens"] == tokens and r["routing"] == "uniform" and r.get("seconds")}
  decode = runs["ours_mix_moe (rocmfp2_mix gate/up, rocmfp3_mix down)"] - runs["ours_bf16_moe"]
  gate_up = runs["ours_rocmfp2_mix_gate_up"] - runs["ours_bf16_gate_up"]
  tiles = row_tiles(cfg, tokens, tiling.moe_block_m)
  weight_tiles = experts_touched(cfg, tokens) * 3 * cfg.moe_intermediate_size * cfg.hidden_size * tiles
  return dict(tokens=tokens, fused_mix_moe_ms=1e3 * runs["ours_mix_moe (rocmfp2_mix gate/up, rocmfp3_mix down)"],
              bf16_moe_ms=1e3 * runs["ours_bf16_moe"], decode_ms=1e3 * decode, row_tiles=tiles,
              ops_per_weight_tile_f32_rate=decode * H200.valu_tera_lane_ops * 1e12 / weight_tiles,
              gate_up_share=gate_up / decode)


def h200_efficiency(work: Mapping[str, Work], ms: Mapping[str, float]) -> dict[str, float | None]:
  """Per class: H200 roofline time / traced time (None where the trace has no time for the class)."""
  return {c: (H200.roofline_s(work[c]) / (ms[c] / 1e3) if ms.get(c) else None) for c in CLASSES}


def predict_ms(work: Mapping[str, Work], scenario: Scenario, efficiency: Mapping[str, float | None]
               ) -> dict[str, float]:
  """gfx1151 ms per class under `scenario`. The fused decode's VALU ops come from the H200 calibration, converted at
  the scenario's lane rate; it already carries the H200 kernel's efficiency, so no fraction divides it."""
  out = {}
  for c in CLASSES:
    w = work[c]
    if c == "mix_decode" and w.valu_ops:
      w = dataclasses.replace(w, valu_ops=w.valu_ops * scenario.decode_lanes_per_sm / 128)
      out[c] = 1e3 * scenario.device.roofline_s(w)
      continue
    t = scenario.device.roofline_s(w)
    if scenario.h200_efficiency and t:
      t /= efficiency[c]
    out[c] = 1e3 * t
  return out


def _sha256(path: pathlib.Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _round(x, digits: int = 4):
  """`digits` significant digits, so the file does not depend on float noise (ints and None stay)."""
  if x is None or isinstance(x, int):
    return x
  return float(f"{x:.{digits}g}") if x else 0.0


def _flags_run(doc: Mapping, tokens: int) -> Mapping:
  """The all_on run of a trace file (variant "flags": the feature set the flags gave, the sm_90 defaults)."""
  return next(r for r in doc["runs"] if r["tokens"] == tokens and r["variant"] == "flags")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inputs:
  """The measured inputs of the model, read from experiments/results."""
  traces: Mapping[int, Mapping]  # tokens -> trace_prefill JSON
  moe_bench: Mapping
  lowering: Mapping
  digests: Mapping[str, dict]  # file -> sha256, date, commit

  @classmethod
  def read(cls, results_dir: pathlib.Path = RESULTS) -> "Inputs":
    load = lambda name: json.loads((results_dir / name).read_text())
    traces = {n: load(f) for n, f in TRACES.items()}
    docs = {TRACES[n]: d for n, d in traces.items()} | {MOE_BENCH: load(MOE_BENCH), LOWERING: load(LOWERING)}
    digests = {f: dict(sha256=_sha256(results_dir / f), date=d.get("date") or d.get("env", {}).get("date"),
                       git_commit=d.get("git_commit") or d.get("code_commit") or d.get("env", {}).get("git_commit"))
               for f, d in docs.items()}
    return cls(traces=traces, moe_bench=docs[MOE_BENCH], lowering=docs[LOWERING], digests=digests)

  def tiling(self, platform: str) -> Tiling:
    """The shipped kernel tiles of `platform` ("rocm" or "cuda") at 8192 tokens, as the lowering check recorded."""
    configs = self.lowering["configs"]
    mla = next(v[0] for k, v in configs.items() if k.startswith(f"{platform} mla csa stream f32stage"))
    return Tiling(moe_block_m=configs[f"moe {platform} 8192"]["block_m"],
                  mla_heads_per_program=mla["heads_per_program"])

  def gfx1151_kernels(self) -> dict[str, dict]:
    """LDS, registers, occupancy and WMMA count of the gfx1151 kernels the model times (MIX MoE at 8192 tokens,
    indexer, CSA streaming MLA), from the offline lowering check."""
    out = {}
    for r in self.lowering["rows"]:
      moe = (r["kernel"], r.get("format")) in {("moe_gate_up", "rocmfp2_mix"), ("moe_down", "rocmfp3_mix")}
      if r["target"] == "gfx1151" and ((moe and r.get("tokens") == 8192) or r["case"].startswith(
          ("indexer topk", "mla csa stream f32stage fastexp bf16"))):
        st = r["stats"]
        out[r["kernel"]] = dict(case=r["case"], config=r["config"], lds_bytes=st["lds_bytes"], vgpr=st["vgpr"],
                                occupancy=st["occupancy"], wmma=st["wmma"])
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trace:
  """One traced all_on prefill: device ms per class, the kernels of each class, each class's fraction of roofline."""
  tokens: int
  ms: Mapping[str, float]
  kernels: Mapping[str, list[str]]
  efficiency: Mapping[str, float | None]


def traces(inputs: Inputs, cfg, pol) -> dict[int, Trace]:
  out = {}
  for n, doc in inputs.traces.items():
    run = _flags_run(doc, n)
    if run.get("kernels"):  # 122879 was timed without the profiler
      ms, names = h200_class_ms(run["kernels"])
      out[n] = Trace(tokens=n, ms=ms, kernels=names, efficiency=h200_efficiency(class_work(cfg, pol, n, "h200"), ms))
  return out


def kernel_ms(class_ms: Mapping[str, float], gate_up_share: float) -> dict[str, float]:
  """gfx1151 ms per kernel: the classes, with the MIX decode folded into the two MoE kernels that run it (split as
  on the H200) and the elementwise class left out (it is many small kernels, none of which can bound alone)."""
  out = {c: v for c, v in class_ms.items() if c not in ("mix_decode", "other")}
  out["moe_gate_up"] += gate_up_share * class_ms["mix_decode"]
  out["moe_down"] += (1 - gate_up_share) * class_ms["mix_decode"]
  return out


def length_entry(cfg, pol, tokens: int, trace: Trace, traced: bool, scenarios: tuple[Scenario, ...],
                 tiling: Tiling, decode_ops: float, gate_up_share: float) -> dict:
  """Everything the model says about one prompt length: per class its work, its H200 figures and its gfx1151 time
  per scenario; the totals, tok/s and bounding class per scenario; the comparison with upstream."""
  eff = trace.efficiency
  h200_work = class_work(cfg, pol, tokens, "h200")
  gfx_work = class_work(cfg, pol, tokens, "gfx1151", tiling, decode_ops)
  central = next(s for s in scenarios if s.name == CENTRAL)
  ms = {s.name: predict_ms(gfx_work, s, eff) for s in scenarios}
  decode_pass = predict_ms(class_work(cfg, pol, tokens, "gfx1151_decode_pass", tiling), central, eff)
  kernels = {s: kernel_ms(v, gate_up_share) for s, v in ms.items()}
  rows = []
  for c in CLASSES:
    hw, gw = h200_work[c], gfx_work[c]
    t = trace.ms[c] / 1e3 if traced else (H200.roofline_s(hw) / eff[c] if eff[c] else 0.0)
    rows.append({"class": c, "what": CLASS_WHAT[c], "h200_kernels": trace.kernels[c][:6],
                 "flops": _round(gw.flops), "bytes_gfx1151": _round(gw.bytes), "valu_ops_gfx1151": _round(gw.valu_ops),
                 "cache_bytes_gfx1151": _round(gw.cache_bytes), "flops_h200": _round(hw.flops),
                 "bytes_h200": _round(hw.bytes), "h200_ms": _round(1e3 * t),
                 "h200_ms_source": "trace" if traced else f"{trace.tokens} trace's fraction of roofline",
                 "h200_tflops": _round(hw.flops / t / 1e12) if t else None,
                 "h200_gb_per_s": _round(hw.bytes / t / GB) if t else None,
                 "h200_roofline_fraction": _round(eff[c]), "gfx1151_roof": GFX1151.roof(gw),
                 "gfx1151_ms": {s: _round(v[c]) for s, v in ms.items()},
                 "gfx1151_decode_pass_ms": _round(decode_pass[c])})
  total = {s: sum(v.values()) / 1e3 for s, v in ms.items()}
  bound = {s: max(v, key=v.get) for s, v in ms.items()}
  entry = dict(tokens=tokens, bands=len(band_sizes(tokens)), efficiency_from_trace=TRACES[trace.tokens],
               total_s={s: _round(v) for s, v in total.items()},
               tok_s={s: _round(tokens / v) for s, v in total.items()}, bound=bound,
               bound_share={s: _round(ms[s][bound[s]] / 1e3 / total[s], 3) for s in total},
               kernels_ms={s: {k: _round(v) for k, v in kv.items()} for s, kv in kernels.items()},
               bound_kernel={s: max(kv, key=kv.get) for s, kv in kernels.items()},
               bound_kernel_share={s: _round(max(kv.values()) / 1e3 / total[s], 3) for s, kv in kernels.items()},
               decode_pass_central=dict(total_s=_round(sum(decode_pass.values()) / 1e3),
                                        tok_s=_round(tokens / (sum(decode_pass.values()) / 1e3))),
               classes=rows)
  if tokens in UPSTREAM_TOK_S:
    tps, source = UPSTREAM_TOK_S[tokens]
    entry["upstream"] = dict(tok_s=tps, total_s=_round(tokens / tps), source=source,
                             central_over_upstream=_round(entry["tok_s"][CENTRAL] / tps, 3),
                             speed_of_light_fraction=_round(total["speed_of_light"] / (tokens / tps), 3))
  return entry


def h200_check(inputs: Inputs, cfg, pol, traced: Mapping[int, Trace]) -> list[dict]:
  """The model's transfer rule tried on the H200 itself: one trace's fractions of roofline applied to another
  length's work, against that length's measured device (or wall) time."""
  out = []
  for tokens, src in ((32768, 8192), (122879, 32768)):
    work, eff = class_work(cfg, pol, tokens, "h200"), traced[src].efficiency
    predicted = sum(H200.roofline_s(work[c]) / eff[c] for c in CLASSES if eff[c])
    run = _flags_run(inputs.traces[tokens], tokens)
    out.append(dict(tokens=tokens, efficiency_from=TRACES[src], predicted_device_s=_round(predicted),
                    measured_device_s=_round(run["device_ms"] / 1e3) if run.get("device_ms") else None,
                    measured_wall_s=_round(tokens / run["tok_s"])))
  return out


def build(results_dir: pathlib.Path = RESULTS, cfg=None, policy: str = "lucebox_mix", gfx1151: Device | None = None,
          date: str | None = None) -> dict:
  """The model's results record (what `main` writes). `gfx1151` replaces the vendor gfx1151 roofs in the scenarios
  that use them (a planted change, for tests); `cfg` defaults to V4-Flash; `date` to now."""
  cfg = cfg or config_lib.v4_flash()
  pol = quant_policy.get(policy)
  inputs = Inputs.read(results_dir)
  tiling, cuda_tiling = inputs.tiling("rocm"), inputs.tiling("cuda")
  calibration = decode_calibration(inputs.moe_bench, cfg, cuda_tiling)
  ops = calibration["ops_per_weight_tile_f32_rate"]
  scenarios = tuple(dataclasses.replace(s, device=gfx1151) if gfx1151 and s.device is GFX1151 else s
                    for s in SCENARIOS)
  traced = traces(inputs, cfg, pol)
  lengths = [length_entry(cfg, pol, n, traced[EFFICIENCY_FROM[n]], n in traced, scenarios, tiling, ops,
                          calibration["gate_up_share"]) for n in LENGTHS]
  return dict(
      model="gfx1151_prefill_performance",
      what="predicted all_on V4-Flash prefill on gfx1151 (Strix Halo) per kernel class (experiments/gfx1151_model.py)",
      date=date or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      command="python -m experiments.gfx1151_model", doc="docs/performance_model.md", preset=cfg.name,
      quant_policy=policy, band_tokens=BAND_TOKENS, inputs=inputs.digests,
      tiling=dict(gfx1151=dataclasses.asdict(tiling), h200_moe_block_m=cuda_tiling.moe_block_m),
      devices={d.name: dataclasses.asdict(d) for d in (H200, GFX1151, GFX1151_MEASURED)},
      scenarios={s.name: dict(device=s.device.name, h200_efficiency=s.h200_efficiency,
                              decode_lanes_per_sm=s.decode_lanes_per_sm, what=s.what) for s in scenarios},
      assumptions=list(ASSUMPTIONS), decode_calibration={k: _round(v) for k, v in calibration.items()},
      gfx1151_kernels=inputs.gfx1151_kernels(), lengths=lengths, h200_check=h200_check(inputs, cfg, pol, traced))


ASSUMPTIONS = (
    "Kernels run one after another: the prefill time is the sum of the class times (the H200 traces show the device "
    "busy 95-98% of the wall time); host work and launch gaps are not modelled.",
    "Each traced kernel belongs to one class by its name (`classify`); loop_convert_fusion is the MIX decode.",
    "Bytes are compulsory DRAM traffic: weights once per band (bands of 8192), activations once in and once out; "
    "gathered attention rows and re-read weight tiles are assumed to hit L2/MALL.",
    "FLOPs are useful ones (no tile padding, no masked keys); attention counts 4 H d per attended key.",
    "Routing is uniform: every expert is hit in a band of 8192, each with S K / E rows.",
    "gfx1151 runs upstream's kind of MoE: the kernels read the MIX bytes (no bf16 decode pass) and decode each weight "
    "once per row tile on the vector ALUs; that decode's cost is the H200's measured fused-decode time "
    "(bench_moe, 8192 tokens) converted to lane operations, and it adds to the WMMA time (same SIMDs).",
    "The central scenario carries each class's H200 fraction of roofline to gfx1151 unchanged, also where the class "
    "changes sides of the ridge (e.g. the MoE: near the ridge on the H200 with bf16 weights, compute-bound on "
    "gfx1151 with 2-3-bit weights).",
    "7680 tokens take the 8192 trace's efficiencies; 122879 takes the 32768 trace's (it has no kernel trace).",
    "The GPU holds 2.9 GHz; sustained clocks under a 120 W limit may be lower, which scales every compute roof.",
)


# ---- markdown ----
def _si(x: float | None, unit: str = "") -> str:
  """3 significant digits with an SI prefix: 1.25 TB, 66.5 T."""
  if x is None:
    return "—"
  for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(x) >= scale:
      return f"{x / scale:.3g} {prefix}{unit}"
  return f"{x:.3g} {unit}".strip()


def _time(ms: float) -> str:
  return f"{ms / 1e3:.2f} s" if ms >= 1e3 else f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


def _num(x: float | None) -> str:
  return "—" if not x else f"{x:,.0f}" if x >= 10 else f"{x:.2g}"


def _pct(x: float | None) -> str:
  return "—" if x is None else f"{100 * x:.1f}%" if x < 0.1 else f"{100 * x:.0f}%"


def headline(record: Mapping) -> list[str]:
  """The summary table: predicted tok/s per scenario at each length, upstream's figure, the bounding class."""
  names = list(record["scenarios"])
  out = ["| tokens | " + " | ".join(f"{s} tok/s" for s in names) + " | upstream tok/s (gfx1151) | bounding kernel "
         "(central, share of the prefill) | bounding class (central) | central with a bf16 decode pass |",
         "|---:|" + "---:|" * len(names) + "---:|---|---|---:|"]
  for e in record["lengths"]:
    upstream = f"{e['upstream']['tok_s']:.1f}" if "upstream" in e else "—"
    out.append(f"| {e['tokens']} | " + " | ".join(f"{e['tok_s'][s]:,.0f}" for s in names)
               + f" | {upstream} | {e['bound_kernel'][CENTRAL]} ({_pct(e['bound_kernel_share'][CENTRAL])}) "
               f"| {e['bound'][CENTRAL]} ({_pct(e['bound_share'][CENTRAL])}) "
               f"| {e['decode_pass_central']['tok_s']:,.0f} |")
  return out


def kernel_table(record: Mapping, scenario: str = CENTRAL) -> list[str]:
  """gfx1151 time per kernel and length under one scenario (the MIX decode inside the MoE kernels)."""
  lengths = record["lengths"]
  label = {"moe_gate_up": "moe_gate_up (+ its MIX decode)", "moe_down": "moe_down (+ its MIX decode)"}
  out = [f"| kernel, {scenario} | " + " | ".join(f"{e['tokens']}" for e in lengths) + " |",
         "|---|" + "---:|" * len(lengths)]
  for k in lengths[0]["kernels_ms"][scenario]:
    out.append(f"| {label.get(k, k)} | " + " | ".join(_time(e["kernels_ms"][scenario][k]) for e in lengths) + " |")
  other = [next(r for r in e["classes"] if r["class"] == "other")["gfx1151_ms"][scenario] for e in lengths]
  out.append("| elementwise and the rest (many kernels) | " + " | ".join(_time(x) for x in other) + " |")
  out.append("| **total** | " + " | ".join(f"**{e['total_s'][scenario]:.1f} s**" for e in lengths) + " |")
  return out


def class_table(entry: Mapping, names: list[str]) -> list[str]:
  out = ["| class | FLOPs | gfx1151 bytes | VALU ops | gfx1151 roof | H200 ms | H200 TFLOP/s | H200 GB/s | H200 "
         "fraction of roofline | gfx1151 " + " / ".join(names) + " |",
         "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
  for r in entry["classes"]:
    star = "" if r["h200_ms_source"] == "trace" else "*"
    out.append(f"| {r['class']} | {_si(r['flops'])} | {_si(r['bytes_gfx1151'], 'B')} | {_si(r['valu_ops_gfx1151'])} "
               f"| {r['gfx1151_roof']} | {_time(r['h200_ms'])}{star} | {_num(r['h200_tflops'])} "
               f"| {_num(r['h200_gb_per_s'])} | {_pct(r['h200_roofline_fraction'])} | "
               + " / ".join(_time(r["gfx1151_ms"][s]) for s in names) + " |")
  return out


def markdown(record: Mapping) -> str:
  names = list(record["scenarios"])
  cal = record["decode_calibration"]
  out = ["# Performance model of the all_on V4-Flash prefill on gfx1151 (Strix Halo)", "",
         f"`{record['command']}` ({record['date']}); the model and its assumptions: `{record['doc']}`. "
         f"{record['preset']}, `{record['quant_policy']}`, bands of {record['band_tokens']}. FLOPs and bytes per "
         "kernel class from the config, each class's fraction of roofline from the H200 traces. Scenarios: "
         + "; ".join(f"**{k}**: {v['what']}" for k, v in record["scenarios"].items()) + ".", ""]
  out += headline(record)
  out += ["", "Per kernel (central scenario):", ""] + kernel_table(record)
  out += ["", "Per kernel class: the gfx1151 work (the MoE reads MIX bytes; the MIX decode is VALU work inside it), "
          "what the class achieves on the H200, and its gfx1151 time per scenario (" + " / ".join(names) + "). H200 "
          "FLOP/s and bytes/s are the H200 program's (bf16 expert weights after the decode pass).", ""]
  for e in record["lengths"]:
    out += [f"**{e['tokens']} tokens**, {e['bands']} band{'s' if e['bands'] > 1 else ''}, H200 efficiencies from "
            f"`{e['efficiency_from_trace']}`; central total {e['total_s'][CENTRAL]:.1f} s.", ""]
    out += class_table(e, names) + [""]
  out += ["\\* not traced at this length: the work at this length over the nearest trace's fraction of roofline.", "",
          "Upstream's published gfx1151 prefill against the model:", "",
          "| tokens | upstream tok/s | upstream s | model central / upstream | upstream's fraction of speed of light "
          "| source |", "|---:|---:|---:|---:|---:|---|"]
  for e in record["lengths"]:
    if "upstream" in e:
      u = e["upstream"]
      out.append(f"| {e['tokens']} | {u['tok_s']} | {u['total_s']:.1f} | {u['central_over_upstream']:.2f}× "
                 f"| {_pct(u['speed_of_light_fraction'])} | {u['source']} |")
  out += ["", "Self-check on the H200 (one trace's efficiencies carried to another length):", "",
          "| tokens | efficiencies from | predicted device s | measured device s | measured wall s |",
          "|---:|---|---:|---:|---:|"]
  for c in record["h200_check"]:
    dev = f"{c['measured_device_s']:.2f}" if c["measured_device_s"] else "not traced"
    out.append(f"| {c['tokens']} | `{c['efficiency_from']}` | {c['predicted_device_s']:.2f} | {dev} "
               f"| {c['measured_wall_s']:.2f} |")
  out += ["", f"Fused MIX decode, calibrated on the H200 (`{MOE_BENCH}`, {cal['tokens']} tokens, uniform routing): "
          f"whole MIX MoE with in-kernel decode {cal['fused_mix_moe_ms']:.2f} ms − whole bf16 MoE "
          f"{cal['bf16_moe_ms']:.2f} ms = {cal['decode_ms']:.2f} ms per layer, {cal['row_tiles']} row tiles per "
          f"expert: {cal['ops_per_weight_tile_f32_rate']:.0f} lane operations per weight and row tile at the f32 "
          f"rate; {_pct(cal['gate_up_share'])} of it in the gate/up kernel (rocmfp2_mix gate/up − bf16 gate/up).",
          "", "gfx1151 kernel configs (offline lowering check, `lowering_gfx1151.json`):", "",
          "| kernel | case | config | LDS B | VGPR | occupancy | WMMA |", "|---|---|---|---:|---:|---:|---:|"]
  for k, v in record["gfx1151_kernels"].items():
    out.append(f"| {k} | {v['case']} | {v['config']} | {v['lds_bytes']} | {v['vgpr']} | {v['occupancy']} "
               f"| {v['wmma']} |")
  out += ["", "Hardware limits:", "", "| device | bf16 TFLOP/s | f32 TFLOP/s | VALU Tlane-op/s | GB/s |",
          "|---|---:|---:|---:|---:|"]
  for d in record["devices"].values():
    out.append(f"| {d['name']} | {d['bf16_tflops']:.1f} | {d['f32_tflops']:.2f} | {d['valu_tera_lane_ops']:.2f} "
               f"| {d['gb_per_s']:.0f} |")
  out += ["", "Sources:", ""] + [f"- {src}" for d in record["devices"].values() for src in d["sources"]] + [""]
  return "\n".join(out)


def main(argv, out_json: str, out_md: str) -> None:
  del argv
  record = build()
  with open(out_json, "w") as f:
    json.dump(record, f, indent=1)
    f.write("\n")
  text = markdown(record)
  with open(out_md, "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":  # flags only as a program: tests import this module
  _OUT_JSON = flags.DEFINE_string("out_json", str(RESULTS / "gfx1151_model.json"), "Results JSON.")
  _OUT_MD = flags.DEFINE_string("out_md", str(RESULTS / "gfx1151_model.md"), "Markdown table.")
  app.run(lambda argv: main(argv, _OUT_JSON.value, _OUT_MD.value))
