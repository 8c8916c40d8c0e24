"""The MoE issue's benchmark: grouped gate/up and down at V4-Flash shapes against the baselines, in one run.

    python -m experiments.bench_moe --out=experiments/results/moe_h200.json [--tokens=512,2048,8192,32768]

Per (tokens, routing): our bf16 gate/up and whole MoE, our rocmfp2_mix gate/up and rocmfp3_mix down
(quantized tiles dequantized in-kernel), `jax.lax.ragged_dot` gate/up (where memory allows),
`torch._grouped_mm` gate/up (when torch with CUDA is importable), our sm_90 Mosaic GPU gate/up at a few tilings (on
a GPU; timed with the row gather it needs, the gathers alone (XLA's and the Pallas one it runs), and "presorted":
the kernel alone on rows sorted before, as torch is timed; and on rocmfp2_mix weights decoded in the kernel), the
decode kernel followed by our bf16 gate/up (what the model runs on sm_90); our bf16 down, W2 decoded then our bf16
down, and the sm_90 Mosaic GPU FP3-MIX down at a few tilings (with XLA's plane_rows of h timed alone); and a dense
bf16 GEMM with the same FLOPs as the gate/up, all in one run.
Every number is also given as a fraction of that dense GEMM. Each contender has two times: `seconds`, the median
wall time of one call waited for (ours) or between CUDA events (torch), and `pipelined_seconds`, taken the same way
for all (timing.pipelined: calls back to back, host dispatch hidden), the one to compare ours with torch by.
`--only=prefix,...` runs a subset of the contenders (`contenders()` lists them all; a pattern that matches none is
refused before any work). `--head_to_head=base,a,b,...` (exact names) times those contenders
again after a (tokens, routing)'s other measurements, in alternating rounds (timing.head_to_head), and records each
one's rate against the first, round by round, under "head_to_head": back to back at the power limit a contender's
time also depends on the one before it, and in turns they share that state.
`--smoke` runs tiny shapes in interpret mode on a CPU, to check the script itself.
Results are rewritten after every measurement, so a crash or OOM loses nothing already measured.
"""

import dataclasses
import functools
import statistics
import sys

import jax
import jax.numpy as jnp
from absl import app, flags

from ds4jax.metrics import nmse
from ds4jax.quant import formats
from ds4jax.quant import policy as quant_policy
from experiments import run_record, timing
from kernels_pallas import moe as moe_kernels
from kernels_pallas.moe import api, decode, down, down_wgmma, gate_up, gate_up_wgmma, routing

_TOKENS = flags.DEFINE_list("tokens", ["512", "2048", "8192", "32768"], "Token counts.")
ROUTINGS = ("uniform", "zipf")
_ROUTINGS = flags.DEFINE_list("routings", list(ROUTINGS), "Routing distributions.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed runs per measurement (median).", lower_bound=1)
_OUT = run_record.define_out_flag()
_SMOKE = flags.DEFINE_boolean("smoke", False, "Tiny shapes, interpret mode (CPU check of the script).")
_ONLY = flags.DEFINE_list("only", [], "Run only the contenders whose names start with one of these (all if empty); "
                          "one ending in '$' names a contender exactly.")
_HEAD_TO_HEAD = flags.DEFINE_list("head_to_head", [], "Exact contender names, the base first (e.g. "
                                  "torch_grouped_mm_gate_up): timed again in alternating rounds after each (tokens, "
                                  "routing), each one's rate against the base recorded round by round.")
_ROUNDS = flags.DEFINE_integer("rounds", 15, "Rounds of --head_to_head (each: every contender, one batch of 5).")

# Each entry kills (or turns on, for the experimental persistent queue) one MoE switch of the default config.
ABLATIONS = {"moe_adaptive_tile off": dict(adaptive_tile=False), "moe_compact_queue off": dict(compact_queue=False),
             "moe_persistent on": dict(persistent=True), "moe_fused_combine off": dict(fused_combine=False)}
# The sm_90 Mosaic GPU gate/up (gate_up_wgmma.py) at a few tilings, on separate W1/W3 stacks or on one interleaved
# stack ("_i": one wgmma per step for both; the interleaved copy is made before timing, as torch's w13 is), and
# "_t": that stack stored step by step (tile_by_step: each step's weight box one contiguous 16 KB, where a strided box
# reads 128 pieces of 128 bytes; made before timing too). It runs where a Hopper GPU is (not in --smoke).
_T = gate_up_wgmma.Tiling
WGMMA_TILINGS = {  # name: (tiling, interleaved, step-tiled: True, False or "ring")
    "w128_n64_s4": (_T(wg_rows=128, block_n=64), False, False),
    "w128_n64_s4_i": (_T(wg_rows=128, block_n=64), True, False),
    "w128_n64_s4_i_t": (_T(wg_rows=128, block_n=64), True, True),
    "w128_n64_s4_i_c2": (_T(wg_rows=128, block_n=64, cluster=2), True, False),
    "w128_n64_s4_i_t_c2": (_T(wg_rows=128, block_n=64, cluster=2), True, True),
    "w64_n128_s4_noskip_c2": (_T(wg_rows=64, block_n=128, skip_empty=False, cluster=2), False, False),
    # "_x": separate rings for x (x_stages slots) and the weights (stages slots), wgmmas in flight one step (session 40
    # probe, presorted rows: w64_n128 10.7 ms at 32768 tokens uniform, against 11.8 for w128_n64_s4_i)
    "w128_n64_i_t_x4": (_T(wg_rows=128, block_n=64, x_stages=4, mma_in_flight=1), True, True),
    "w64_n128_i_t_x3": (_T(wg_rows=64, block_n=128, x_stages=3, mma_in_flight=1), True, True),
    "w64_n128_x3": (_T(wg_rows=64, block_n=128, x_stages=3, mma_in_flight=1), False, False),  # the model's layout
    # "ring": separate W1 / W3 stacks in gate_up_wgmma.ring_layout (64-row step boxes), which both rings read
    "x4_ring_layout": (gate_up_wgmma.RING_X4, False, "ring"),
    "w64_ring_layout": (gate_up_wgmma.RING_W64, False, "ring"),
}
# "default": what api.moe runs on bf16 W1/W3 (gate_up_wgmma.default_tiling at the mean rows per expert, dense stacks);
# "default_ring_layout": the same tiling on ring_layout's stacks

# Also measured and dropped: (c9ea423) the x4 and w64_n128 rings with K steps of 128 and two slots per ring (H100,
# presorted: 5.19 and 5.99 against 3.51 ms for x4 at 8192 uniform, 17.96 and 18.43 against 10.83 ms for w64_n128 at
# 32768 uniform; slower in every cell but w64_n128's at 512 and 2048 tokens, within 3%); (c5bb9c6) the rings in
# clusters of two SMs sharing x (H100: at most 5% faster at 8192 tokens, 4-7% slower at 32768; its x slots' cluster
# barrier could complete with the peer SM's releases of a later step, since with wgmmas in flight a release comes a step
# late: the interpreter deadlocked in CI); (fab9549) w64_n128 interleaved, one m64n256 wgmma per warpgroup as torch's
# 128x256 tile (8192 tokens: 4.6-5.3 ms against 3.6-3.9 for w128_n64); (cadd0d7) the rings in clusters of two SMs that
# split a 2·block_m-row item and multicast each weight tile, torch's 2 x 1 cluster (H100, presorted: w64_n128 4.13
# against 4.42 ms at 8192 uniform, 1-6% slower at 8192 Zipf and 32768; w128_n64 6.2 against 3.8 ms at 8192, its second
# SM mostly idle); (02677e5) w128_n64 with more weight copies in flight than x copies, x_stages 3 / stages 6 and 2 / 8
# (H200, presorted, 8192 uniform: 4.25 and 6.63 against 3.85 ms; slower in every cell: x's copies, not the weights',
# must run ahead); (session 57, in turns with torch on an H100) x4 with the weights as the wgmma's left operand, one
# projection per warpgroup (0.82-0.94 against x4's 0.89-0.98 of torch's rate), and the rings' units dealt to the SMs by
# cost (x4 level at 8192 uniform, 0.974 against 0.976; w64_n128 10-20% slower); (ead3341, session 65) the two rings
# behind a lax.cond on how much each pads the routes, x4 where its 256-row items pad at most 1.1x w64's (H100, rate
# against torch at 8192 uniform / Zipf: 0.976 / 1.023 on dense stacks against the default's 1.002 / 0.967, 1.021 /
# 1.059 on ring_layout against 1.039 / 1.007): the conditional's host round trip cost ~2.5% where x4 ran anyway.
# The same kernel on rocmfp2_mix W1/W3 decoded in its compute warpgroups, one projection each, the decoded tile as
# the wgmma's register operand (mma_rows rows of x per wgmma). Decoding into shared-memory planes (per warpgroup or
# shared between the two; or, at fab9549, with the wgmmas in flight while the next step decodes: 6.8 vs 5.1 ms at
# 8192 tokens) was slower and was removed, as were mma_in_flight 1 (ptxas serializes the wgmmas),
# issuing the warpgroups' wgmmas in turn (8.42 vs 5.22 ms at 8192 tokens) and two or four K blocks per pipeline step
# (no faster). Compiled, the planes are made by byte permutes (at e1e8cbf: 6.31 -> 5.22 ms at 8192 tokens). Since
# session 52 x comes as plane_rows, one K-64 wgmma a step (H100, lhs_w128_s3_r256_c2: 4.49 against 5.06 ms with x as
# 4 planes of 32-byte rows at 8192 uniform, 13.6 against 16.8 at 32768 Zipf).
WGMMA_MIX_TILINGS = {
    "lhs_w128_s3_r256": _T(wg_rows=128, block_n=64, stages=3, mma_rows=256),
    "lhs_w128_s3_r64": _T(wg_rows=128, block_n=64, stages=3),
    "lhs_w64_s3_r128": _T(wg_rows=64, block_n=64, stages=3, mma_rows=128),
    "lhs_w128_s3_r256_c2": _T(wg_rows=128, block_n=64, stages=3, mma_rows=256, cluster=2),
}
# Also measured and dropped (2a804c4): a third warpgroup issuing the copies and decoding both tiles into shared-memory
# planes, the other two only issuing wgmmas (8192 tokens: 5.85 against 5.17 ms); (6a99a1b) 384-row tiles, three
# 128-row wgmmas per decoded step, gate/up and down: 192 accumulator registers a thread, and ptxas spills 150-250
# bytes (H100, 8192 tokens: 8.8 against 5.9 ms); (61ec2ad) "narrow" items, gate/up and down: an item whose rows end
# within 64 or 128 rows of its tile ran a pipeline of that wgmma width, its decode unchanged (H100: the gate/up -3% at
# 8192 Zipf, +3% at 32768 Zipf, within 2% elsewhere; the down -5% at 8192 Zipf, +12% at 8192 uniform).
# (e3db26e) the gate/up over separate x and weight rings, each step decoded while the previous step's wgmmas ran (two
# plane sets in registers; ptxas kept the wgmmas async): H100, 8192 uniform 5.11-5.44 ms against 4.49-4.90 for c2,
# 32768 16.8-17.6 against 16.1-17.0; the same rings without wgmmas in flight 4.85-5.37 / 16.2-17.0; (e6a4f2d) x
# multicast to clusters of four SMs: 7.6 ms at 8192 uniform, 26 at 32768 (c2: 4.5, 16.2); (a37cf74) those rings in
# clusters of two sharing x, 3 x slots: -5% / -4% / -1% / +3% against c2 (32768 uniform, 8192 Zipf, 32768 Zipf,
# 8192 uniform).
# The Mosaic GPU down on rocmfp3_mix W2 (down_wgmma.py), the same structure with one stack, each warpgroup its own
# N tile; against what the model runs under moe_wgmma_gate_up (W2 decoded by the decode kernel, then the Triton down).
# h as plane_rows since session 52 (H100, w128_s2_r256: 3.29 against 3.89 ms with h as 4 planes at 8192 uniform).
WGMMA_DOWN_TILINGS = {
    "w128_s4_r256": _T(wg_rows=128, block_n=64, stages=4, mma_rows=256),
    "w128_s2_r256": _T(wg_rows=128, block_n=64, stages=2, mma_rows=256),
    "w128_s5_r256": _T(wg_rows=128, block_n=64, stages=5, mma_rows=256),
    "w128_s4_r128": _T(wg_rows=128, block_n=64, stages=4, mma_rows=128),
    "w64_s4_r128": _T(wg_rows=64, block_n=64, stages=4, mma_rows=128),
    "w64_s4_r64": _T(wg_rows=64, block_n=64, stages=4, mma_rows=64),
}
FLASH = dict(D=4096, I=2048, E=256, K=6)
SMOKE = dict(D=128, I=64, E=8, K=2)


_MATCHED = set()  # the --only patterns that picked a contender


def contenders() -> list[str]:
  """Every contender a run may measure, on some device: --only's patterns are checked against it before any work (a
  typo found at the end of a GPU run cost the run)."""
  wgmma_bf16 = [f"ours_wgmma_bf16_gate_up {t}{presorted}" for t in [*WGMMA_TILINGS, "default", "default_ring_layout"]
                for presorted in ("", " presorted")]
  wgmma_mix = [f"ours_wgmma_rocmfp2_mix_gate_up {t}{h}" for t in WGMMA_MIX_TILINGS for h in ("", " h_plane_rows")]
  return ["dense_bf16_gemm", "ours_bf16_gate_up", "ours_rocmfp2_mix_gate_up",
          "ours_rocmfp2_mix decode kernel + bf16 gate_up", *wgmma_bf16, "wgmma sorted_rows", "wgmma gather_rows",
          "wgmma gather_rows plane_rows", *wgmma_mix, "ours_bf16_down", "ours_rocmfp3_mix decode kernel + bf16 down",
          "wgmma plane_rows", *(f"ours_wgmma_rocmfp3_mix_down {t}" for t in WGMMA_DOWN_TILINGS), "ours_bf16_moe",
          "ours_mix_moe (rocmfp2_mix gate/up, rocmfp3_mix down)",
          "ours_mix_moe dequantize-then-matmul (moe_sparse_gate_up off)", "ours_mix_moe wgmma gate/up + down",
          "ours_bf16_moe wgmma gate/up", *(f"ours_bf16_moe {switch}" for switch in ABLATIONS),
          "jax_ragged_dot_gate_up", "torch_grouped_mm_gate_up"]


def picks(pattern: str, name: str) -> bool:
  """Whether one --only pattern picks `name` (a prefix; ending in '$', the whole name)."""
  return name == pattern[:-1] if pattern.endswith("$") else name.startswith(pattern)


def wanted(name: str) -> bool:
  """Whether --only picks the contender `name` (one of `contenders()`: a name missing there is this file's bug)."""
  if name not in contenders():
    raise AssertionError(f"bench_moe: contender {name!r} is missing from contenders()")
  picked = {o for o in _ONLY.value if picks(o, name)}
  _MATCHED.update(picked)
  return not _ONLY.value or bool(picked)


def wgmma_weights(entry: tuple, w1, w3) -> tuple:
  """(w1, w3) in the layout of a WGMMA_TILINGS entry (copies made before timing, as weights stationary)."""
  t, interleaved, step_tiled = entry
  if step_tiled == "ring":
    return tuple(jax.jit(gate_up_wgmma.ring_layout)(w) for w in (w1, w3))
  ws = (jax.jit(gate_up_wgmma.interleave, static_argnums=2)(w1, w3, t.block_n), None) if interleaved else (w1, w3)
  if step_tiled:
    ws = tuple(w if w is None else jax.jit(gate_up_wgmma.tile_by_step, static_argnums=(1, 2))(
        w, t.block_n * (1 + interleaved), t.block_k) for w in ws)
  return ws


def route_ids(key, S, E, K, kind):
  """[S, K] distinct expert ids per token: uniform, or Zipf(1) popularity over experts (skewed load)."""
  logits = jnp.zeros((E,)) if kind == "uniform" else -jnp.log(jnp.arange(1, E + 1, dtype=jnp.float32))
  gumbel = jax.random.gumbel(key, (S, E))
  return jax.lax.top_k(logits[None, :] + gumbel, K)[1].astype(jnp.int32)


def timeit(f, *args, n):
  """Median seconds of n warm calls (the kernels' own tuning sweep's timer, which returns ms)."""
  return timing.timeit(f, *args, n=n) / 1e3


def pipelined_seconds(call, wait) -> dict:
  """{"pipelined_seconds": timing.pipelined's figure}, the same measure for every contender (torch's too); or
  {"pipelined_error": ...} (its n results in flight at once may not fit where one call's did)."""
  try:
    return dict(pipelined_seconds=timing.pipelined(call, wait) / 1e3)
  except Exception as e:  # noqa: BLE001
    return dict(pipelined_error=f"{type(e).__name__}: {str(e)[:300]}")


def torch_grouped_mm(x_sorted, w13, group_sizes):
  """torch._grouped_mm on the same sorted rows as (call, wait): a call of no arguments and a wait for its result;
  None where torch/CUDA is missing."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
    if not torch.cuda.is_available():
      return None
  except ImportError:
    return None
  a = torch.from_dlpack(x_sorted)
  b = torch.from_dlpack(w13)  # [E, D, 2I]
  offs = torch.from_dlpack(jnp.cumsum(group_sizes).astype(jnp.int32))
  return (lambda: torch._grouped_mm(a, b, offs=offs)), (lambda _: torch.cuda.synchronize())


def torch_seconds(f, wait, n):
  """(median seconds of one call of f between CUDA events, the pipelined_seconds dict)."""
  import torch  # pylint: disable=import-outside-toplevel
  f()
  torch.cuda.synchronize()
  ts = []
  for _ in range(n):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    f()
    end.record()
    torch.cuda.synchronize()
    ts.append(start.elapsed_time(end) / 1e3)
  return statistics.median(ts), pipelined_seconds(f, wait)


def main(argv):
  del argv
  bad = [k for k in _ROUTINGS.value if k not in ROUTINGS]
  if bad:
    raise app.UsageError(f"--routings: unknown {bad}; known: {list(ROUTINGS)}")
  if not _SMOKE.value and not all(t.isdigit() and int(t) > 0 for t in _TOKENS.value):
    raise app.UsageError(f"--tokens must be positive integers, got {_TOKENS.value}")
  if unknown := [o for o in _ONLY.value if not any(picks(o, name) for name in contenders())]:
    raise app.UsageError(f"--only: {unknown} match no contender (bench_moe.contenders() lists them)")
  versus = _HEAD_TO_HEAD.value
  if versus and (len(versus) < 2 or len(set(versus)) < len(versus)
                 or not all(n in contenders() and wanted(n) for n in versus)):
    raise app.UsageError(f"--head_to_head takes two or more distinct contender names, each run (see --only); got "
                         f"{versus} with --only={_ONLY.value}")
  _MATCHED.clear()  # what the check above matched was not run
  if _ROUNDS.value < 1:
    raise app.UsageError(f"--rounds must be positive, got {_ROUNDS.value}")
  dims = SMOKE if _SMOKE.value else FLASH
  D, I, E, K = dims["D"], dims["I"], dims["E"], dims["K"]
  interpret = _SMOKE.value
  n = 2 if _SMOKE.value else _REPEATS.value
  tokens = [16, 64] if _SMOKE.value else [int(t) for t in _TOKENS.value]
  record = dict(benchmark="moe", env=run_record.environment(), dims=dims, smoke=_SMOKE.value, runs=[],
                head_to_head=[])

  save = run_record.appender(_OUT.value, record)

  keys = jax.random.split(jax.random.key(0), 8)
  w1 = (jax.random.normal(keys[0], (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
  w3 = (jax.random.normal(keys[1], (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
  w2 = (jax.random.normal(keys[2], (E, D, I)) * I**-0.5).astype(jnp.bfloat16)
  mix2, mix3 = formats.get("rocmfp2_mix"), formats.get("rocmfp3_mix")
  q1 = moe_kernels.QuantizedExpertWeights.from_storage(
      "rocmfp2_mix", quant_policy.random_storage(mix2, (E, I, D), keys[3], D**-0.5), (E, I, D))
  q3 = moe_kernels.QuantizedExpertWeights.from_storage(
      "rocmfp2_mix", quant_policy.random_storage(mix2, (E, I, D), keys[4], D**-0.5), (E, I, D))
  q2 = moe_kernels.QuantizedExpertWeights.from_storage(
      "rocmfp3_mix", quant_policy.random_storage(mix3, (E, D, I), keys[5], I**-0.5), (E, D, I))

  for S in tokens:
    for kind in _ROUTINGS.value:
      x = jax.random.normal(keys[6], (S, D)).astype(jnp.bfloat16)
      ids = route_ids(keys[7], S, E, K, kind)
      rw = jnp.full((S, K), 1.0 / K, jnp.float32)
      gate_up_flops = 2 * S * K * D * 2 * I
      base = dict(tokens=S, routing=kind, gate_up_flops=gate_up_flops)
      cfg = moe_kernels.Config.default(num_tokens=S, top_k=K, num_experts=E, hidden=D, intermediate=I)
      kcfg = api._kernel_config(cfg)  # pylint: disable=protected-access
      record.setdefault("configs", {})[str(S)] = dataclasses.asdict(cfg)  # the defaults each ablation starts from
      r = jax.jit(lambda i, bm=cfg.row_tile(S * K, E): routing.route(i, E, bm))(ids)
      kept = {}  # the --head_to_head contenders measured here: name -> (call, wait)

      def measure(name, f, *args, flops=gate_up_flops, **extra):
        if not wanted(name):
          return
        try:
          jf = jax.jit(f)
          sec = timeit(jf, *args, n=n)
        except Exception as e:  # noqa: BLE001 -- an OOM in one contender must not stop the others
          save(base | dict(contender=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
          return
        call = lambda: jf(*args)  # noqa: E731
        save(base | dict(contender=name, seconds=sec, tflops=flops / sec / 1e12, **extra) | pipelined_seconds(
            call, jax.block_until_ready))
        if name in versus:
          kept[name] = (call, jax.block_until_ready)

      dense_a = jnp.ones((S * K, D), jnp.bfloat16)
      dense_b = jnp.ones((D, 2 * I), jnp.bfloat16)
      measure("dense_bf16_gemm", lambda a, b: a @ b, dense_a, dense_b)
      # Weights are jit arguments, never closed-over constants (a 4 GB constant crashes XLA's compile).
      gu = lambda x, a, b, r: gate_up.gate_up(x, a, b, r, swiglu_limit=10.0, config=kcfg, interpret=interpret)
      measure("ours_bf16_gate_up", gu, x, w1, w3, r)
      measure("ours_rocmfp2_mix_gate_up", gu, x, q1, q3, r)
      # what the model runs today on sm_90 (moe_decode_kernel, weights stationary): each stack decoded by the decode
      # kernel, then the bf16 gate/up; the bar a fused MIX gate/up has to clear
      dq = lambda w: decode.decode_stack(w, interpret=interpret)
      measure("ours_rocmfp2_mix decode kernel + bf16 gate_up", lambda x, a, b, r: gu(x, dq(a), dq(b), r), x, q1, q3, r)
      if not _SMOKE.value and jax.default_backend() == "gpu":
        h_triton = jax.jit(gu)(x, w1, w3, r)
        picked = gate_up_wgmma.default_tiling(-(-S * K // E), False, I)
        defaults = {"default": (picked, False, False), "default_ring_layout": (picked, False, "ring")}
        ring_ws = None  # one ring_layout copy for every contender that reads it (GPU memory)
        for tname, entry in {**WGMMA_TILINGS, **defaults}.items():
          t = entry[0]
          name = f"ours_wgmma_bf16_gate_up {tname}"
          if not (wanted(name) or wanted(name + " presorted")):
            continue
          if entry[2] == "ring":
            ring_ws = ws = ring_ws or wgmma_weights(entry, w1, w3)
          else:
            ws = wgmma_weights(entry, w1, w3)
          gw = lambda x, a, b, r, rows_sorted=False, t=t: gate_up_wgmma.gate_up_wgmma(
              x, a, b, r, swiglu_limit=10.0, tiling=t, rows_sorted=rows_sorted)
          try:  # parity against our Triton gate/up on the valid rows (both bf16 h, f32 accumulation)
            rows = int(r.num_rows[0])
            diff = float(nmse(jax.jit(gw)(x, *ws, r)[:rows].astype(jnp.float32),
                              h_triton[:rows].astype(jnp.float32)))
          except Exception as e:  # noqa: BLE001 -- a tiling that does not compile must not stop the others
            save(base | dict(contender=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
          measure(name, gw, x, *ws, r, nmse_vs_triton=diff)
          # the kernel alone, as torch is timed: rows sorted before
          xs = gate_up_wgmma.sorted_rows(x, r, t.block_m)
          measure(name + " presorted", functools.partial(gw, rows_sorted=True), xs, *ws, r)
          del ws, xs
        measure("wgmma sorted_rows", lambda x, r: gate_up_wgmma.sorted_rows(x, r, 128), x, r)
        # x's rows for the Mosaic gate/up: XLA's gather against the Pallas one it runs (bf16; FP2-MIX: plane_rows)
        measure("wgmma gather_rows", lambda x, r: gate_up_wgmma.gather_rows(x, r, 256), x, r)
        measure("wgmma gather_rows plane_rows", lambda x, r: gate_up_wgmma.gather_rows(x, r, 256, plane_rows=True),
                x, r)
        m1, m3 = (jax.jit(gate_up_wgmma.mix_stack)(q.storage) for q in (q1, q3))  # made once, as weights stationary
        h_mix = jax.jit(gu)(x, q1, q3, r)
        for tname, t in WGMMA_MIX_TILINGS.items():
          name = f"ours_wgmma_rocmfp2_mix_gate_up {tname}"
          if not wanted(name):
            continue
          gm = lambda x, a, b, r, t=t: gate_up_wgmma.gate_up_wgmma(x, a, b, r, swiglu_limit=10.0, tiling=t)
          try:  # against our Triton fused MIX gate/up (same decoded bf16 weights, another K order)
            rows = int(r.num_rows[0])
            diff = float(nmse(jax.jit(gm)(x, m1, m3, r)[:rows].astype(jnp.float32),
                              h_mix[:rows].astype(jnp.float32)))
          except Exception as e:  # noqa: BLE001
            save(base | dict(contender=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
          measure(name, gm, x, m1, m3, r, nmse_vs_triton=diff)
          if wanted(name + " h_plane_rows"):  # as the model runs it before the Mosaic down (rows_by_plane's loads)
            hp = gate_up_wgmma.padded_rows(r.num_routes, 256)
            measure(name + " h_plane_rows", lambda x, a, b, r, t=t: gate_up_wgmma.gate_up_wgmma(
                x, a, b, r, swiglu_limit=10.0, tiling=t, h_plane_rows=hp), x, m1, m3, r)
        del m1, m3, h_mix

      down_flops = gate_up_flops // 2
      h = jax.random.normal(keys[6], (S * K, I)).astype(jnp.bfloat16)
      dn = lambda h, w, r: down.down(h, w, r, config=kcfg, interpret=interpret)
      measure("ours_bf16_down", dn, h, w2, r, flops=down_flops)
      measure("ours_rocmfp3_mix decode kernel + bf16 down", lambda h, w, r: dn(h, dq(w), r), h, q2, r,
              flops=down_flops)
      if not _SMOKE.value and jax.default_backend() == "gpu":
        m2 = jax.jit(down_wgmma.mix3_stack)(q2.storage)
        out_triton = jax.jit(dn)(h, q2, r)  # the fused Triton down on the same decoded weights
        measure("wgmma plane_rows", lambda h: down_wgmma.plane_rows(h, 256), h)  # in the timings below
        for tname, t in WGMMA_DOWN_TILINGS.items():
          name = f"ours_wgmma_rocmfp3_mix_down {tname}"
          if not wanted(name):
            continue
          dw = lambda h, w, r, t=t: down_wgmma.down_wgmma(h, w, r, tiling=t)
          try:
            rows = int(r.num_rows[0])
            diff = float(nmse(jax.jit(dw)(h, m2, r)[:rows], out_triton[:rows]))
          except Exception as e:  # noqa: BLE001
            save(base | dict(contender=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
          measure(name, dw, h, m2, r, flops=down_flops, nmse_vs_triton=diff)
        del m2, out_triton

      def full_moe(c=cfg, dequantize_first=False):
        def f(x, w, i, a, b, d):
          if dequantize_first:  # what the model runs with moe_sparse_gate_up off: XLA dequantizes every call
            a, b, d = (moe_kernels.dequantize_to_dense(q) for q in (a, b, d))
          return moe_kernels.moe(x, w, i, a, b, d, swiglu_limit=10.0, config=c, interpret=interpret,
                                 validate_routes=False)
        return f

      moe_flops = gate_up_flops * 3 // 2
      measure("ours_bf16_moe", full_moe(), x, rw, ids, w1, w2, w3, flops=moe_flops)
      measure("ours_mix_moe (rocmfp2_mix gate/up, rocmfp3_mix down)", full_moe(), x, rw, ids, q1, q2, q3,
              flops=moe_flops)
      measure("ours_mix_moe dequantize-then-matmul (moe_sparse_gate_up off)", full_moe(dequantize_first=True),
              x, rw, ids, q1, q2, q3, flops=moe_flops)
      if not _SMOKE.value and jax.default_backend() == "gpu":  # the model's MoE under moe_wgmma_gate_up and _down
        measure("ours_mix_moe wgmma gate/up + down", full_moe(dataclasses.replace(cfg, gate_up_kernel="wgmma",
                                                                                  down_kernel="wgmma")),
                x, rw, ids, q1, q2, q3, flops=moe_flops)
        # under moe_wgmma_gate_up without moe_sparse_gate_up: W1/W3 decoded beforehand, the Mosaic gate/up's ring
        measure("ours_bf16_moe wgmma gate/up", full_moe(dataclasses.replace(cfg, gate_up_kernel="wgmma")),
                x, rw, ids, w1, w2, w3, flops=moe_flops)
      for switch, change in ABLATIONS.items():  # one switch changed at a time, whole bf16 MoE, same inputs
        measure(f"ours_bf16_moe {switch}", full_moe(dataclasses.replace(cfg, **change)), x, rw, ids, w1, w2, w3,
                flops=moe_flops)
      x_sorted = x[r.token_of_row]
      sizes = jnp.bincount(jnp.where(ids >= 0, ids, E).reshape(-1), length=E + 1)[:E].astype(jnp.int32)
      w13 = jnp.concatenate([w1, w3], axis=1).transpose(0, 2, 1)  # [E, D, 2I]
      measure("jax_ragged_dot_gate_up", lambda a, b, g: jax.lax.ragged_dot(a, b, g), x_sorted, w13, sizes)
      if not _SMOKE.value and wanted("torch_grouped_mm_gate_up"):
        try:  # session 63: an H100 ran out of memory here beside the kept contenders' weight copies
          torch_call = torch_grouped_mm(x_sorted, w13, sizes)
          timed, error = torch_call and torch_seconds(*torch_call, n), "no torch"
        except Exception as e:  # noqa: BLE001 -- record it and go on to the next case
          torch_call, timed, error = None, None, f"{type(e).__name__}: {str(e)[:300]}"
        save(base | dict(contender="torch_grouped_mm_gate_up") | (
            dict(seconds=timed[0], tflops=gate_up_flops / timed[0] / 1e12, **timed[1]) if timed
            else dict(error=error)))
        if torch_call and "torch_grouped_mm_gate_up" in versus:
          kept["torch_grouped_mm_gate_up"] = torch_call
      dense = next((x["tflops"] for x in record["runs"] if x.get("contender") == "dense_bf16_gemm"
                    and x["tokens"] == S and x["routing"] == kind and "tflops" in x), None)
      for x_ in record["runs"]:
        if x_["tokens"] == S and x_["routing"] == kind and "tflops" in x_ and dense:
          x_["fraction_of_dense_gemm"] = x_["tflops"] / dense
      if versus:
        record["head_to_head"].append(base | timing.head_to_head(kept, versus, _ROUNDS.value))
        print(record["head_to_head"][-1], flush=True)
      kept.clear()
      if _OUT.value:
        run_record.write_json(_OUT.value, record)
  if unmatched := [o for o in _ONLY.value if o not in _MATCHED]:  # its contenders do not run here (not a GPU)
    sys.exit(f"bench_moe: --only: {unmatched} matched no contender that ran on this device")


if __name__ == "__main__":
  app.run(main)
