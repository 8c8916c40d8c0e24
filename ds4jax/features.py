"""Prefill optimizations as separately killable switches, with per-device defaults from a capability table.

Each optimization is one absl flag (defined by experiments/flags.py for the entry points) and
one field of the frozen `Features` that the model receives. Library code and tests never read FLAGS.

    flag (ds4jax)          upstream switch (Lucebox)                      what it selects
    bf16_matmul            (ggml: matmuls take f16 / q8_1 activations)    bf16 matmul operands, f32 accumulation
    moe_sparse_gate_up     DFLASH_DS4_MIX_MMQ_PREFILL (#673)              fused quantized gate/up Pallas kernel vs dequantize-then-matmul
    moe_wgmma_gate_up      (ds4jax, sm_90)                                that gate/up as a Mosaic GPU kernel (TMA + async wgmma)
    moe_wgmma_down         (ds4jax, sm_90)                                the down as a Mosaic GPU kernel decoding FP3-MIX W2
    moe_adaptive_tile      GGML_CUDA_MMQ_MOE_ADAPTIVE_X                   MoE row tile follows the rows per expert
    moe_tile_rows          GGML_CUDA_MMQ_X                                force a MoE row tile (0 = heuristic)
    moe_compact_queue      (AMD llama.cpp #63 compacted MoE tiling)       grid over real (expert, tile) work items only
    moe_persistent         GGML_CUDA_MMQ_MOE_PERSISTENT                   fixed programs loop over the work queue
    moe_programs_per_core  GGML_CUDA_MMQ_MOE_PERSISTENT_BLOCKS_PER_CU     persistent programs per core
    moe_fused_combine      DFLASH_MOE_FUSED_COMBINE                       weight + sum the top-k outputs + shared expert in one kernel
    moe_decode_kernel      (ds4jax)                                       quantized experts decoded by a Pallas kernel before the MoE kernels
    indexer_score_kernel   GGML_DS4_INDEXER_M32                           tiled Pallas indexer scoring + query-blocked top-k
    indexer_radix_topk     GGML_DS4_TOPK_BLOCK_RADIX                      exact radix-selection top-k kernel instead of a sort
    direct_indexer_topk    DFLASH_DS4_DIRECT_INDEXER_TOPK                 top-k indices go straight into attention (no dense mask)
    mla_stream_topk        GGML_CUDA_MLA_STREAM_TOPK                      streaming sparse MLA attention kernel
    mla_stream_f32_stage   GGML_CUDA_MLA_STREAM_F32_STAGE                 stage each KV row in f32 once for all heads
    mla_stream_fast_exp    GGML_CUDA_MLA_STREAM_FAST_EXP                  exp2 with log2(e) folded into the scale
    mla_wgmma              (ds4jax, sm_90)                                the streaming MLA as a Mosaic GPU kernel (64 heads a CTA)
    long_context_chunk     DFLASH_DS4_LONG_CONTEXT_CHUNK                  attention query chunk inside a band (bounds masks at 128K)
    prefill_band_tokens    (#684 layer-major bands, cap 10240)            tokens per layer-major band (ds4jax/prefill.py)
    prefill_weights_stationary  (ds4jax)                                  each layer runs every band before the next layer
    prefill_moe_over_bands  (ds4jax)                                      with it, a layer's MoE runs over several bands
"""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, Mapping

import jax
import jax.extend
import jax.numpy as jnp

# Boolean switches: name -> (upstream name, help, switches it requires).
SWITCHES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # Not an upstream switch: ggml always rounds matmul activations (f16 for cuBLAS, q8_1 for MMQ). Here the exact
    # f32 path is the reference, so the rounding is one more killable optimization.
    "bf16_matmul": ("ggml f16 / q8_1 matmul activations",
                    "Attention and expert matmuls (projections, MoE, indexer and MLA kernels) take bf16 operands with "
                    "f32 accumulation; norms, softmax, routing, hyper-connections and the residual streams stay f32.",
                    ()),
    "moe_sparse_gate_up": ("DFLASH_DS4_MIX_MMQ_PREFILL", "Fused quantized MoE gate/up + clamped SwiGLU kernel.", ()),
    # Not an upstream switch: on sm_90 Triton makes every MMA wait on a tile decoded in registers, so the fused gate/up
    # is also written in Mosaic GPU (kernels_pallas/moe/gate_up_wgmma.py). Without moe_wgmma_down, W2 is decoded
    # beforehand (once per prompt under prefill_weights_stationary) and the Triton down reads bf16. Without
    # moe_sparse_gate_up it reads W1/W3 decoded beforehand, laid out in the step boxes its rings read fastest
    # (ds4jax/moe.py: ring_laid).
    "moe_wgmma_gate_up": ("ds4jax: Mosaic GPU sparse gate/up",
                          "sm_90: the sparse gate/up runs as a Pallas Mosaic GPU kernel (a TMA warpgroup feeding async "
                          "wgmmas) instead of the Pallas-Triton one, on FP2-MIX W1/W3 under moe_sparse_gate_up, else "
                          "on W1/W3 decoded to bf16 beforehand; the down projection reads W2 decoded beforehand unless "
                          "moe_wgmma_down.", ("bf16_matmul",)),
    # Its down counterpart (kernels_pallas/moe/down_wgmma.py): the same kernel structure on FP3-MIX W2.
    "moe_wgmma_down": ("ds4jax: Mosaic GPU sparse down",
                       "sm_90: the down projection runs as a Pallas Mosaic GPU kernel that decodes FP3-MIX W2 in "
                       "registers next to its wgmmas, instead of the Pallas-Triton down (on W2 decoded beforehand "
                       "under moe_wgmma_gate_up, else decoding FP3-MIX tiles itself).",
                       ("moe_sparse_gate_up", "bf16_matmul")),
    "moe_adaptive_tile": ("GGML_CUDA_MMQ_MOE_ADAPTIVE_X", "MoE row tile follows the rows per expert.", ()),
    "moe_compact_queue": ("AMD llama.cpp PR #63", "MoE grid over real (expert, row-tile) items only.", ()),
    "moe_persistent": ("GGML_CUDA_MMQ_MOE_PERSISTENT", "Fixed MoE programs loop over the compact queue.",
                       ("moe_compact_queue",)),
    "moe_fused_combine": ("DFLASH_MOE_FUSED_COMBINE",
                          "Weighted top-k combine + shared add in one kernel after the down projection.", ()),
    # Not an upstream switch: upstream's MMQ reads quantized experts directly. Here dequantize-then-matmul decodes
    # them first, and XLA's canonical decode (level and scale chosen per weight) is ALU-bound on the H200.
    "moe_decode_kernel": ("ds4jax: Pallas expert decode",
                          "Quantized experts are decoded to bf16 by a Pallas kernel before the MoE kernels (MIX "
                          "formats: each half-block's values made once, one select tree per weight) instead of XLA's "
                          "canonical decode; the same bits. Under moe_sparse_gate_up nothing is decoded beforehand, "
                          "except W2 under moe_wgmma_gate_up without moe_wgmma_down.",
                          ()),
    "indexer_score_kernel": ("GGML_DS4_INDEXER_M32", "Tiled Pallas indexer scoring kernel with query-blocked top-k.",
                             ()),
    "indexer_radix_topk": ("GGML_DS4_TOPK_BLOCK_RADIX",
                           "The indexer's top-k by an exact radix-selection kernel (the same ids) instead of a sort.",
                           ("indexer_score_kernel",)),
    # Only the streaming kernel consumes an index list; the dense reference always masks.
    "direct_indexer_topk": ("DFLASH_DS4_DIRECT_INDEXER_TOPK", "Top-k indices straight into attention, no dense mask.",
                            ("mla_stream_topk",)),
    "mla_stream_topk": ("GGML_CUDA_MLA_STREAM_TOPK", "Streaming sparse MLA attention kernel.", ()),
    "mla_stream_f32_stage": ("GGML_CUDA_MLA_STREAM_F32_STAGE", "Stage KV rows in f32 once for all heads.",
                             ("mla_stream_topk",)),
    "mla_stream_fast_exp": ("GGML_CUDA_MLA_STREAM_FAST_EXP", "exp2 with log2(e) folded into the softmax scale.",
                            ("mla_stream_topk", "mla_stream_f32_stage")),
    # Not an upstream switch: the Triton streaming kernel spends its time in each stage's fixed cost, so sm_90 also
    # has it in Mosaic GPU (kernels_pallas/mla/stream_wgmma.py, docs/mla_mosaic.md). It stages each row once for all
    # heads and uses exp2, as the two switches it requires ask.
    "mla_wgmma": ("ds4jax: Mosaic GPU streaming MLA",
                  "sm_90: the streaming MLA runs as a Pallas Mosaic GPU kernel: a query's 64 heads in one CTA, its "
                  "selected KV rows gathered once by cp.async, two warpgroups with half the value columns each "
                  "(V4-Flash's 64 heads of dim 512 only).",
                  ("mla_stream_topk", "mla_stream_f32_stage", "mla_stream_fast_exp", "bf16_matmul")),
    # Not an upstream switch: upstream's MMQ reads quantized experts directly, so re-reading them per band is cheap
    # there. Here, without moe_sparse_gate_up (or for W2 under moe_wgmma_gate_up without moe_wgmma_down), every band
    # decodes a layer's experts to bf16 again (docs/upstream.md §2).
    "prefill_weights_stationary": ("ds4jax: weights-stationary bands",
                                   "Each layer runs every band before the next layer starts (the streams of all "
                                   "bands stay on the device), so its experts are decoded once per prompt instead "
                                   "of once per band.", ()),
    # Not an upstream switch: the grouped MoE kernels do more per row on more rows (on the H200 the bf16 gate/up
    # takes 13.4 ms over 32768 tokens in bench_moe, and 4 x 4.0 ms over the 32768 prefill's bands), and under
    # weights stationary only the attention of the later bands stands between a layer's MoE calls.
    "prefill_moe_over_bands": ("ds4jax: MoE over several bands",
                               "Under weights stationary, each layer runs the attention of every band, then its MoE "
                               "once over the tokens of several consecutive bands (up to prefill.MOE_TOKENS) instead "
                               "of once per band.", ("prefill_weights_stationary",)),
}
# Integer knobs: name -> (upstream name, help, default).
KNOBS: dict[str, tuple[str, str, int]] = {
    "moe_tile_rows": ("GGML_CUDA_MMQ_X", "Force the MoE row tile (0 = heuristic).", 0),
    "moe_programs_per_core": ("GGML_CUDA_MMQ_MOE_PERSISTENT_BLOCKS_PER_CU", "Persistent MoE programs per core.", 32),
    "long_context_chunk": ("DFLASH_DS4_LONG_CONTEXT_CHUNK",
                           "Attention takes a band's queries in chunks of this many tokens (0 = the whole band).",
                           8192),
    "prefill_band_tokens": ("#684 layer-major band",
                            "Tokens per layer-major prefill band, state carried across bands (0 = one band).", 8192),
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Features:
  """The resolved feature set the model runs with. All False is the exact reference path."""

  bf16_matmul: bool = False
  moe_sparse_gate_up: bool = False
  moe_wgmma_gate_up: bool = False
  moe_wgmma_down: bool = False
  moe_adaptive_tile: bool = False
  moe_compact_queue: bool = False
  moe_persistent: bool = False
  moe_fused_combine: bool = False
  moe_decode_kernel: bool = False
  indexer_score_kernel: bool = False
  indexer_radix_topk: bool = False
  direct_indexer_topk: bool = False
  mla_stream_topk: bool = False
  mla_stream_f32_stage: bool = False
  mla_stream_fast_exp: bool = False
  mla_wgmma: bool = False
  prefill_weights_stationary: bool = False
  prefill_moe_over_bands: bool = False
  moe_tile_rows: int = 0
  moe_programs_per_core: int = 32
  long_context_chunk: int = 8192
  prefill_band_tokens: int = 8192
  device_class: str = "cpu_interpret"

  @property
  def interpret(self) -> bool:
    """Pallas kernels run in interpret mode on the CPU."""
    return self.device_class == "cpu_interpret"

  @property
  def platform(self) -> str:
    """The kernels' config heuristics key: "cpu" (interpret mode), "rocm" or "cuda"."""
    if self.interpret:
      return "cpu"
    return "rocm" if self.device_class in ("gfx1151", "rdna35_other", "rocm_other") else "cuda"

  @property
  def matmul_dtype(self):
    """The operand dtype of the attention and expert matmuls: bfloat16 under `bf16_matmul`, else float32 (exact).
    Accumulation and outputs stay f32 (except the streaming MLA's output, stored in it: the same bits as its f32
    output cast for the output projection); norms, routing, hyper-connections and the head never see it."""
    return jnp.bfloat16 if self.bf16_matmul else jnp.float32

  @property
  def moe_kernels(self) -> bool:
    """Any MoE switch on: the MoE runs through the Pallas grouped kernels instead of the dense reference."""
    return any(getattr(self, s) for s in SWITCHES if s.startswith("moe_"))

  def on(self) -> list[str]:
    return [s for s in SWITCHES if getattr(self, s)]

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


REFERENCE = Features()  # everything off: the exact path


# ---- the capability table ----
DEVICE_CLASSES = ("gfx1151", "rdna35_other", "rocm_other", "sm_90", "cpu_interpret")


# How far a switch's path is qualified on a device class. Only `ran` has recorded parity and timing on that hardware;
# `lowered` means every kernel it selects passes the offline lowering and compile check for the device (no spills,
# LDS within budget, WMMA for the dots: docs/lowering.md), so it may be run, but a run is a first run, not a
# qualified one. Start-up prints the state of every switch in use and the results record it.
UNSUPPORTED, LOWERED, RAN = "unsupported", "lowered", "ran"


# Conditions a table default can be bound to (Capability.when); `resolve` says how each is met.
MODEL, ONE_BAND = "model", "one_band"


@dataclasses.dataclass(frozen=True, slots=True)
class Capability:
  state: str      # UNSUPPORTED | LOWERED | RAN
  default: bool
  when: frozenset[str] = frozenset()  # the default holds only where these conditions are met (MODEL, ONE_BAND)

  @property
  def supported(self) -> bool:
    return self.state != UNSUPPORTED


def _row(ran: set[str], default_on: set[str], lowered: set[str] = frozenset(),
         when: Mapping[str, Collection[str]] | None = None) -> dict[str, Capability]:
  assert default_on <= ran | lowered and not ran & lowered, (default_on - ran - lowered, ran & lowered)
  assert set(when or {}) <= default_on
  state = lambda s: RAN if s in ran else LOWERED if s in lowered else UNSUPPORTED
  return {s: Capability(state(s), s in default_on, frozenset((when or {}).get(s, ()))) for s in SWITCHES}


# Only what works is advertised: every switch marked ran here is exercised by a test on that device class
# (interpret mode for the CPU, a GPU run for sm_90); every switch marked lowered passes the offline lowering check
# for it (tests/kernels_pallas/test_lowering_gfx1151.py, tests/test_features.py).
# A gfx1151-only default is keyed to "gfx1151", never to all RDNA3.5 (upstream review item 6).
_MOE = {"moe_sparse_gate_up", "moe_adaptive_tile", "moe_compact_queue", "moe_persistent", "moe_fused_combine"}
# Mosaic GPU: sm_90 (and its CPU interpreter) only; Mosaic GPU has no ROCm backend. Their kernels need D and I
# multiples of 256 (a TMA row of meta bytes), which the tiny test models are not: tests run them on their own.
WGMMA_SWITCHES = ("moe_wgmma_gate_up", "moe_wgmma_down", "mla_wgmma")
# sm_90's bound defaults (Capability.when). The Mosaic GPU kernels take some models only (the MLA: 64 heads of dim
# 512; the MoE: FP2/FP3-MIX experts, D and I multiples of 256), so their defaults hold where the caller says the
# model fits (`resolve`'s `fits`) and the defaults run every model; an explicit on for a model that does not fit fails
# at the start-up check (attention.check_kernels, moe.check_kernels). The fused MIX MoE decodes its experts for every
# band, where weights stationary decodes them once per prompt: it wins at one band and loses at four, so it is on
# only where the prompt is one band (`tokens`).
_MOE_ONE_BAND = {"moe_sparse_gate_up", "moe_wgmma_gate_up", "moe_wgmma_down"}
_SM90_WHEN = {"mla_wgmma": {MODEL}} | {s: {MODEL, ONE_BAND} for s in _MOE_ONE_BAND}
_WGMMA = set(WGMMA_SWITCHES)
_DECODE = {"moe_decode_kernel"}  # ran on the H200; not in gfx1151's lowering check (its gate/up reads quantized tiles)
_ATTENTION = {"indexer_score_kernel", "indexer_radix_topk", "direct_indexer_topk", "mla_stream_topk",
              "mla_stream_f32_stage", "mla_stream_fast_exp"}
_MOE_RAN_ON_H200 = _MOE | _ATTENTION  # bf16 and quantized (in-kernel dequantization) kernels ran compiled with parity
_PRECISION = {"bf16_matmul"}
_SCHEDULE = {"prefill_weights_stationary"}  # the order of the layer steps only: no kernel of its own
_MOE_OVER_BANDS = {"prefill_moe_over_bands"}  # existing kernels on more rows
CAPABILITIES: dict[str, dict[str, Capability]] = {
    # gfx1151: every kernel config lowers and compiles for it offline with bf16 operands (what bf16_matmul feeds
    # them), spill-free and within LDS; nothing has run on the hardware. Defaults: upstream's gfx1151 sparse-prefill
    # set as #685 qualified it (docs/upstream.md §1): bf16 operands, the fused MIX gate/up (MMQ), adaptive tiles,
    # the persistent compact queue, fused combine, the indexer kernel, streaming MLA with f32 stage and fast exp,
    # the direct top-k handoff; 8192-token bands and chunks (the knobs' defaults). Weights stationary is ds4jax's
    # own and gains little where the gate/up reads quantized tiles directly, so it stays off. XLA's own ROCm
    # pipeline (deviceless, docs/lowering.md §5) spills one VGPR in the V4-Flash CSA fast-exp MLA kernel that the
    # gating Triton check compiles at 255 VGPRs without spills: recorded, not gating.
    "gfx1151": _row(set(), (_MOE | _ATTENTION | _PRECISION),
                    lowered=_MOE | _ATTENTION | _PRECISION | _SCHEDULE | _MOE_OVER_BANDS),
    "rdna35_other": _row(set(), set()),
    "rocm_other": _row(set(), set()),
    # Defaults: persistent is experimental (as upstream). The Pallas-Triton fused quantized gate/up is slower than
    # decode-then-matmul on the H200 (rocmfp2_mix MoE with the half-block loader: 15.3 vs 11.9 ms at 8192 tokens,
    # 48.4 vs 27.0 at 32768, tune_moe), because the in-tile MIX decode is ALU-bound there while HBM is not the
    # bottleneck it is on gfx1151; so moe_sparse_gate_up is on only with the Mosaic GPU kernels (bound with them).
    # The qualification at one band: all_on (fused MoE) 10976 vs 9450 tok/s at 8192 without the three fused-MoE
    # switches (kill_moe_sparse_gate_up at a59cb5b, when it also turned off moe_wgmma_gate_up; BENCHMARKS.md).
    # bf16_matmul is on by default: f32 operands make the MoE kernels run IEEE f32 dots (no tensor cores) and the
    # projections HIGHEST-precision f32 GEMMs; V4-Flash all_on at 8192 tokens ran at 90 tok/s that way.
    # prefill_weights_stationary: all_on V4-Flash (lucebox_mix) 7558 vs 5757 tok/s at 32768 tokens and 6142 vs
    # 4685 at 122879; one band is the same program either way (trace_prefill, BENCHMARKS.md).
    # indexer_radix_topk: one CSA layer's top-k at 128K context 5.8 vs 19.1 ms (sort), at 8K 0.75 vs 1.15 ms, the
    # same ids (bench_attention, BENCHMARKS.md).
    # moe_wgmma_gate_up (with moe_sparse_gate_up) is on for one-band prompts only (_SM90_WHEN): all_on V4-Flash
    # (lucebox_mix) 9755 vs 9186 tok/s at 8192 tokens (one band), but 9915 vs 10291 at 32768, where the
    # once-per-prompt decode serves four bands (trace_prefill, c24545e, BENCHMARKS.md).
    # moe_wgmma_down (with moe_wgmma_gate_up) likewise: all_on V4-Flash 10130 vs 9745 tok/s at 8192 tokens, but
    # 9729 vs 10003 at 32768, where W2's once-per-prompt decode serves four bands (trace_prefill, 47a5e97).
    # With x and h as plane_rows (3f88194) the three forced on won at 32768 too, 10811 vs 10669 tok/s (+1.3%, one
    # call); at 122879 (15 bands, 02677e5) they lose, 9135 vs 9436 tok/s (-3.2%), so the one-band rule stands.
    # moe_decode_kernel: one V4-Flash layer's MIX experts decoded in 6.3 vs 13.7 ms (XLA), the same bits
    # (bench_decode); all_on V4-Flash at 8192 tokens 7849 vs 6633 tok/s, at 122879 8141 vs 8006 (trace_prefill).
    # mla_wgmma is on for the models it fits: V4-Flash runs faster with it at every length measured (the defaults:
    # 9199 vs 8938 tok/s at 8192, 9252 vs 9009 at 122879; ab9b394) and passes its qualification at 8192 (with the
    # MoE Mosaic switches; 89529b8).
    # prefill_moe_over_bands ran on the H200: all_on V4-Flash 10926 vs 10698 tok/s at 32768 tokens, 9568 vs 9434 at
    # 122879; one layer's MoE over 16384 rows against two bands within 1.8e-8 NMSE (BENCHMARKS.md). One band is the
    # same program either way; the qualification's multi-band all_on records are taken with it (wave2e).
    "sm_90": _row(_MOE_RAN_ON_H200 | _WGMMA | _DECODE | _PRECISION | _SCHEDULE | _MOE_OVER_BANDS,
                  (_MOE_RAN_ON_H200 | _DECODE | _PRECISION | _SCHEDULE | _MOE_OVER_BANDS | _WGMMA) - {"moe_persistent"},
                  when=_SM90_WHEN),
    # Interpret mode is for parity, not speed, so the exact path is the default.
    "cpu_interpret": _row(_MOE | _WGMMA | _DECODE | _ATTENTION | _PRECISION | _SCHEDULE | _MOE_OVER_BANDS, set()),
}


def switch_states(features: Features) -> dict[str, str]:
  """The capability state (ran / lowered) of every switch `features` turns on, on its device class."""
  row = CAPABILITIES[features.device_class]
  return {s: row[s].state for s in features.on()}


def describe_states(features: Features) -> str:
  """One start-up line: which switches in use ran on this device class and which are only lowered for it."""
  states = switch_states(features)
  ran = [s for s, st in states.items() if st == RAN]
  lowered = [s for s, st in states.items() if st == LOWERED]
  out = f"switch states on {features.device_class}: ran {ran or 'none'}"
  if lowered:
    out += (f"; LOWERED ONLY (compile offline for this device, never ran on it: a first run, not a qualified one) "
            f"{lowered}")
  return out


def device_class(device: jax.Device | None = None) -> str:
  """Maps a jax device to a row of the capability table."""
  device = device or jax.devices()[0]
  if device.platform == "cpu":
    return "cpu_interpret"
  arch = str(getattr(device, "compute_capability", "") or "")
  if arch.startswith("gfx"):
    if arch == "gfx1151":
      return "gfx1151"
    return "rdna35_other" if arch.startswith("gfx115") else "rocm_other"
  if device.platform in ("cuda", "gpu") and arch.startswith("9."):
    return "sm_90"
  raise ValueError(f"device {device.device_kind!r} (platform {device.platform}, arch {arch!r}) has no row in the "
                   f"capability table {DEVICE_CLASSES}; add one before running on it")


class FeatureError(ValueError):
  """An impossible or unsupported feature combination, reported at start-up."""


# Requirements that hold on one device class only. On gfx1151 the MoE and attention kernels lowered with bf16
# operands, what bf16_matmul feeds them; with f32 activations the MoE kernels spill (216 VGPRs in the gate/up) and
# the streaming MLA kernel keeps its bf16 precision on ROCm (kernels_pallas/mla/config.py): not a kill of bf16.
DEVICE_REQUIRES: dict[str, dict[str, tuple[str, ...]]] = {"gfx1151": dict.fromkeys(_MOE | _ATTENTION, ("bf16_matmul",))}


def requires(switch: str, device_cls: str) -> tuple[str, ...]:
  """The switches `switch` needs on `device_cls`: its own (SWITCHES) and the device's (DEVICE_REQUIRES)."""
  return tuple(SWITCHES[switch][2]) + DEVICE_REQUIRES.get(device_cls, {}).get(switch, ())


def one_band(tokens: int | None, band_tokens: int) -> bool:
  """Whether a prompt of `tokens` runs as one band of `band_tokens` (0 = one band); None (not known): no."""
  return tokens is not None and (not band_tokens or tokens <= band_tokens)


def check(f: Features) -> Features:
  """`f` as `resolve` would give it, or FeatureError: a feature set built by hand (Features(...) or a replace) is
  held to the table's rules too (its device class, requirements and knobs), so no switch runs without what it
  requires. A switch with nothing to act on in a given model traces the program it would without it (e.g.
  moe_decode_kernel on bf16 experts, indexer_score_kernel on a model without CSA layers)."""
  return resolve(f.device_class, {k: getattr(f, k) for k in list(SWITCHES) + list(KNOBS)})


def resolve(device_cls: str, overrides: Mapping[str, Any] | None = None, *, fits: Collection[str] = (),
            tokens: int | None = None) -> Features:
  """Table defaults for `device_cls`, then `overrides` (None values = keep the default); then checks. A default bound
  to conditions (Capability.when) holds only where they are met: MODEL where `fits` (the switches whose kernels take
  the model: attention.model_fits | moe.model_fits) names it, ONE_BAND where the prompt of `tokens` is one band of
  the resolved prefill_band_tokens (None: the length is not known, so not met).

  Raises FeatureError naming the switch when one is unsupported on the device or misses a dependency.
  Nothing ever falls back silently.
  """
  if device_cls not in CAPABILITIES:
    raise FeatureError(f"unknown device class {device_cls!r}; known: {DEVICE_CLASSES}")
  row = CAPABILITIES[device_cls]
  for k in overrides or {}:
    if k not in SWITCHES and k not in KNOBS:
      raise FeatureError(f"unknown feature {k!r}; known: {sorted(SWITCHES) + sorted(KNOBS)}")
  given = {k: v for k, v in (overrides or {}).items() if v is not None}
  band = given.get("prefill_band_tokens", KNOBS["prefill_band_tokens"][2])
  met = {MODEL: lambda s: s in fits, ONE_BAND: lambda s: isinstance(band, int) and one_band(tokens, band)}
  values: dict[str, Any] = {s: cap.default and all(met[c](s) for c in cap.when) for s, cap in row.items()}
  values.update({k: default for k, (_, _, default) in KNOBS.items()})
  values.update(given)
  errors = [f"--{s} must be True or False, got {values[s]!r}" for s in SWITCHES if not isinstance(values[s], bool)]
  for s, (upstream, _, _) in SWITCHES.items():
    if not values[s]:
      continue
    if not row[s].supported:
      errors.append(f"--{s} ({upstream}) is not supported on {device_cls} (see ds4jax/features.py CAPABILITIES)")
    missing = [r for r in requires(s, device_cls) if not values[r]]
    if missing:
      on = f" on {device_cls}" if set(missing) - set(SWITCHES[s][2]) else ""
      errors.append(f"--{s} requires " + ", ".join(f"--{r}" for r in missing) + on)
  for k in KNOBS:
    if not isinstance(values[k], int) or isinstance(values[k], bool) or values[k] < 0:
      errors.append(f"--{k} must be a non-negative integer, got {values[k]!r}")
  rows = values["moe_tile_rows"]
  if rows and (rows & (rows - 1) or rows < 16):
    errors.append(f"--moe_tile_rows must be a power of two >= 16 (Pallas-Triton tiles), got {rows}")
  if values["moe_programs_per_core"] < 1:
    errors.append(f"--moe_programs_per_core must be at least 1, got {values['moe_programs_per_core']}")
  band, chunk = values["prefill_band_tokens"], values["long_context_chunk"]
  if band and chunk and chunk < band and band % chunk:
    errors.append(f"--prefill_band_tokens={band} must be a multiple of --long_context_chunk={chunk} "
                  "(attention takes each band's queries in whole chunks)")
  if errors:
    raise FeatureError("invalid feature set: " + "; ".join(errors))
  return Features(device_class=device_cls, **values)


def traced_eqns(fn, *args) -> list:
  """Every equation `fn(*args)` traces to, nested jaxprs (loops, conditionals, shard_map, pjit) included, in order."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      found.append(eqn)
      for v in eqn.params.values():
        for sub in v if isinstance(v, (tuple, list)) else [v]:
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jax.extend.core.Jaxpr):
            walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def float_min_max(fn, *args) -> list[str]:
  """The min / max / clamp on floating values that `fn(*args)` traces to. Compiled in a Pallas kernel (Triton,
  Mosaic GPU) they return the other operand for a NaN, where XLA and the interpreter keep the NaN: a kernel written
  with them hides a NaN on the GPU alone, so its clamps are selects, and tests see these on the CPU."""
  return [e.primitive.name for e in traced_eqns(fn, *args) if e.primitive.name in ("max", "min", "clamp")
          and any(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in e.outvars)]


def pallas_calls(fn, *args) -> list[tuple[str, tuple[int, ...]]]:
  """(name, grid) of every Pallas kernel that `fn(*args)` would run, in order: how tests see which path ran. A
  Mosaic GPU kernel (`plgpu.kernel`) traces to an mpmd_map over its mesh, whose grid is its programs."""
  found = []
  for e in traced_eqns(fn, *args):
    if e.primitive.name == "pallas_call":
      found.append((e.params["name"], tuple(e.params["grid_mapping"].grid)))
    elif e.primitive.name == "mpmd_map" and hasattr(e.params["meshes"][0], "grid"):  # not a nested warp map
      found.append((e.params["name"], tuple(e.params["meshes"][0].grid)))
  return found

