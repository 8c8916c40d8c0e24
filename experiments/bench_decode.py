"""Decoding the MIX experts to bf16: what every layer does before the MoE kernels when `moe_sparse_gate_up` is off
(once per band, or once per prompt with `prefill_weights_stationary`).

    python -m experiments.bench_decode --out=experiments/results/decode_h200.json [--smoke]
    python -m experiments.bench_decode --sass [--out=F.json]     # offline, no GPU: SASS instructions per weight

Times the decode of one V4-Flash layer's routed experts (gate and up: rocmfp2_mix [256, 2048, 4096]; down:
rocmfp3_mix [256, 4096, 2048]):

  canonical   the format's own dequantize in XLA (level and scale chosen per weight)
  halves      the format's `dequantize_halves` in XLA (each half-block's K values made once, a select tree per
              weight: the arithmetic of the kernels below)
  tiles_*     the Pallas kernel `dequantize_tiles` (the grouped kernels' tile loader alone), one [bn, bk] tile per
              program, at its best tiling of 2026-12-01
  kernel_*    `kernels_pallas.moe.decode.decode_stack` (what `moe_decode_kernel` runs): the half-block decode in its
              reshape-free view, at a few tilings and warp counts
  write       the unpacked codes cast to bf16: the same output write with almost no arithmetic

`--sass` times nothing: it compiles the decode kernel of each format for sm_90 at the default tiling with each
`Tiling.select` ("tree", "prmt4") through Triton's ptxas (`kernels_pallas.lowering.sass_cuda`, the
`lowering` extra) and counts the SASS instructions a thread issues per weight, the most frequent opcodes with them.
A static count: where the decode is issue-bound it predicts the ratio of times, not the times.

(The 2026-12-01 file also has `per_half` and `lookup`, XLA experiments replaced by `halves`.)
Every variant's bf16 output is checked bit for bit against the canonical one. `--smoke` runs small shapes on any
device (the CPU check of the script; the Pallas variant then runs in interpret mode). Results are rewritten after
every weight.
"""

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from ds4jax.quant import bitplanes, rocmfp2_mix, rocmfp3, rocmfp3_mix
from experiments import run_record, timing
from kernels_pallas import lowering
from kernels_pallas.moe import decode, gate_up_wgmma, quantized_weights

_OUT = run_record.define_out_flag()
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed runs per variant (median).", lower_bound=1)
_SMOKE = flags.DEFINE_boolean("smoke", False, "Small shapes (checks the script on a CPU).")
_SASS = flags.DEFINE_boolean("sass", False, "Offline: count each select's SASS instructions per weight (no GPU).")
_ONLY = flags.DEFINE_list("only", [], "Time only the variants whose names start with one of these (all if empty; "
                          "the canonical decode always runs, as the bits to match).")

# name -> (format module, unpack codes, weight shape at V4-Flash, smoke shape)
WEIGHTS = {
    "gate_up (rocmfp2_mix)": (rocmfp2_mix, lambda s: bitplanes.unpack(s["codes"], 2), (256, 2048, 4096),
                              (4, 64, 256)),
    "down (rocmfp3_mix)": (rocmfp3_mix, lambda s: rocmfp3.unpack_codes(s["codes_lo"], s["codes_hi"]),
                           (256, 4096, 2048), (4, 256, 128)),
}


def random_storage(key, fmt, shape) -> dict[str, jnp.ndarray]:
  """Random bytes in every storage array (invalid scale bytes included: they decode to 0), sorted books, and
  experts in both modes (codebook and uniform)."""
  out = {}
  for i, (name, s) in enumerate(fmt.storage_shapes(shape).items()):
    k = jax.random.fold_in(key, i)
    if name == "books":
      out[name] = jnp.sort(jax.random.normal(k, s), axis=-1).astype(jnp.bfloat16)
    elif name == "mode":
      out[name] = (jnp.arange(s[0]) % 3 != 0).astype(jnp.uint8)  # every third expert uniform
    else:
      out[name] = jax.random.randint(k, s, 0, 256).astype(jnp.uint8)
  return out


def same_bits(a, b) -> bool:
  """Equal bit patterns (so -0.0 differs from 0.0), any float dtype."""
  a, b = jnp.asarray(a), jnp.asarray(b)
  u = {2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
  return a.dtype == b.dtype and bool(jnp.array_equal(jax.lax.bitcast_convert_type(a, u),
                                                       jax.lax.bitcast_convert_type(b, u)))


TILES = (64, 256, 8)  # (bn, bk, warps) of dequantize_tiles
KERNEL_TILINGS = ((64, 256, 8), (32, 256, 4), (32, 512, 8), (16, 256, 2), (16, 512, 4), (16, 1024, 8), (8, 512, 2),
                  (8, 256, 1), (16, 512, 2), (32, 512, 4), (32, 1024, 8))  # (bn, bk, warps)
# The byte-permute pick (decode.Tiling.select "prmt4"; inline PTX, so CUDA only, not in --smoke)
PRMT_TILINGS = ((8, 512, 2), (16, 512, 2), (16, 512, 4), (8, 1024, 4))


def variants(fmt_name, fmt, unpack, shape, smoke: bool):
  bf16 = jnp.bfloat16
  module = quantized_weights.HALF_BLOCK_FORMATS[fmt_name]
  out = dict(
      canonical=jax.jit(lambda s: fmt.dequantize(**s).astype(bf16)),
      halves=jax.jit(lambda s: module.dequantize_halves(**quantized_weights.half_views(fmt_name, s),
                                                        dtype=bf16).reshape(shape)))
  as_weights = lambda s: quantized_weights.QuantizedExpertWeights.from_storage(fmt_name, s, shape)
  bn, bk, warps = (16, 128, 4) if smoke else TILES
  out[f"tiles_{bn}x{bk}_w{warps}"] = lambda s, bn=bn, bk=bk, warps=warps: quantized_weights.dequantize_tiles(
      as_weights(s), block_n=bn, block_k=bk, dtype=bf16, num_warps=warps, interpret=smoke)
  for bn, bk, warps in ((16, 128, 4),) if smoke else KERNEL_TILINGS:
    tiling = decode.Tiling(bn, bk, warps)
    out[f"kernel_{bn}x{bk}_w{warps}"] = lambda s, t=tiling: decode.decode_stack(as_weights(s), bf16, tiling=t,
                                                                                 interpret=smoke)
  for bn, bk, warps in () if smoke or jax.default_backend() != "gpu" else PRMT_TILINGS:
    tiling = decode.Tiling(bn, bk, warps, select="prmt4")
    out[f"kernel_prmt4_{bn}x{bk}_w{warps}"] = lambda s, t=tiling: decode.decode_stack(as_weights(s), bf16, tiling=t)
    # written as gate_up_wgmma.ring_layout (the Mosaic gate/up's rings read it fastest; session 65)
    out[f"kernel_prmt4_ring_{bn}x{bk}_w{warps}"] = lambda s, t=tiling: decode.decode_stack(
        as_weights(s), bf16, tiling=t, ring_layout=True)
  out["write"] = jax.jit(lambda s: unpack(s).astype(bf16))
  return out


def sass_counts() -> list[dict]:
  """Per format and select: the default tiling's decode kernel compiled for sm_90, SASS instructions per weight."""
  records = []
  for name, (fmt, _, shape, _) in WEIGHTS.items():
    fmt_name = fmt.__name__.rsplit(".", 1)[-1]
    storage = {n: jax.ShapeDtypeStruct(s, jnp.uint8 if n != "books" else jnp.bfloat16)
               for n, s in fmt.storage_shapes(shape).items()}
    for select in ("tree", "prmt4"):
      t = dataclasses.replace(decode.default_tiling(fmt_name, shape), select=select)
      f = lambda s, t=t, fmt_name=fmt_name: decode.decode_stack(
          quantized_weights.QuantizedExpertWeights.from_storage(fmt_name, s, shape), jnp.bfloat16, tiling=t)
      (k,) = lowering.lower_kernels(f, (storage,), "cuda")
      sass = lowering.sass_cuda(k.ttir, 90, k.num_warps, k.num_stages)
      ops = [re.sub(r"^(@!?U?P\w+\s+)", "", x.split("*/", 1)[1].strip()).split(" ")[0].split(".")[0].rstrip(";")
             for x in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]+\*/", x)]
      per_thread = t.block_n * t.block_k / (32 * t.num_warps)
      records.append(dict(weight=name, select=select, tiling=dataclasses.asdict(t), instructions=len(ops),
                          per_weight=round(len(ops) / per_thread, 2),
                          top_opcodes=dict(collections.Counter(ops).most_common(8))))
      print(f"{name} {select}: {len(ops)} instructions, {records[-1]['per_weight']} a weight", flush=True)
  return records


def main(argv):
  del argv
  if _SASS.value:
    out = dict(kind="sass_decode", env=run_record.environment(), records=sass_counts())
    if _OUT.value:
      run_record.write_json(_OUT.value, out)
    return
  out = dict(env=run_record.environment(), smoke=_SMOKE.value, repeats=_REPEATS.value, weights={})
  for i, (name, (fmt, unpack, shape, smoke_shape)) in enumerate(WEIGHTS.items()):
    fmt_name = fmt.__name__.rsplit(".", 1)[-1]  # the registry name is the module's
    shape = smoke_shape if _SMOKE.value else shape
    storage = random_storage(jax.random.key(i), fmt, shape)
    rec = dict(shape=list(shape), bf16_bytes=2 * int(np.prod(shape)),
               storage_bytes=sum(int(a.size) * a.dtype.itemsize for a in storage.values()), bit_identical={}, ms={})
    fns = variants(fmt_name, fmt, unpack, shape, _SMOKE.value)
    want = fns["canonical"](storage)
    for vname, f in fns.items():
      if _ONLY.value and vname != "canonical" and not any(vname.startswith(o) for o in _ONLY.value):
        continue
      try:
        if vname != "write":
          rec["bit_identical"][vname] = same_bits(f(storage), gate_up_wgmma.ring_layout(want) if "_ring_" in vname
                                                  else want)
        rec["ms"][vname] = timing.timeit(f, storage, n=_REPEATS.value)
      except Exception as e:  # noqa: BLE001 -- one tiling that does not compile must not stop the sweep
        rec.setdefault("errors", {})[vname] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"{name} {vname}: FAILED {rec['errors'][vname]}", flush=True)
        continue
      print(f"{name} {vname}: {rec['ms'][vname]:.2f} ms, bit-identical {rec['bit_identical'].get(vname)}",
            flush=True)
    rec["write_TB_per_s"] = {v: rec["bf16_bytes"] / (ms * 1e-3) / 1e12 for v, ms in rec["ms"].items()}
    out["weights"][name] = rec
    if _OUT.value:
      run_record.write_json(_OUT.value, out)


if __name__ == "__main__":
  app.run(main)
