"""Decoding the MIX experts to bf16 in XLA: what every layer does once per band when `moe_sparse_gate_up` is off.

    python -m experiments.bench_decode --out=experiments/results/decode_h200.json [--smoke]

On the H200 the lucebox_mix MoE at 8192 tokens takes 17.5 ms per layer against 6.7 ms with bf16 experts
(BENCHMARKS.md), and the qualification pays ~0.45 s per band that does not scale with its tokens. This times the
decode of one V4-Flash layer's routed experts (gate and up: rocmfp2_mix [256, 2048, 4096]; down: rocmfp3_mix
[256, 4096, 2048]) three ways:

  canonical   the format's own dequantize (a where chain over the 2K book levels, as the Pallas kernels run it)
  lookup      one gather per weight from a per-expert table of level x scale [E, 256 meta bytes, K codes]. The
              table holds the canonical decode's own products, so the result is bit-identical (checked here).
              XLA only: Pallas-Triton lowers no gathers.
  write       the unpacked codes cast to bf16: the same output write with almost no arithmetic (the floor)

`--smoke` runs small shapes on any device (the CPU check of the script). Results are rewritten after every weight.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from ds4jax.quant import bitplanes, rocmfp2, rocmfp2_mix, rocmfp3, rocmfp3_mix, ue4m3
from ds4jax.quant.rocmfp_layout import HALF
from experiments import run_record, timing

_OUT = flags.DEFINE_string("out", None, "Results JSON.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed runs per variant (median).")
_SMOKE = flags.DEFINE_boolean("smoke", False, "Small shapes (checks the script on a CPU).")

# name -> (format module, uniform-mode level of a code, unpack codes, weight shape at V4-Flash, smoke shape)
WEIGHTS = {
    "gate_up (rocmfp2_mix)": (rocmfp2_mix, lambda c: rocmfp2.levels(c, False),
                              lambda s: bitplanes.unpack(s["codes"], 2), (256, 2048, 4096), (4, 64, 256)),
    "down (rocmfp3_mix)": (rocmfp3_mix, rocmfp3.levels,
                           lambda s: rocmfp3.unpack_codes(s["codes_lo"], s["codes_hi"]), (256, 4096, 2048),
                           (4, 256, 128)),
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


def lookup_table(books, mode, uniform_level) -> jnp.ndarray:
  """f32 [E, 256, K]: the value of code k under meta byte m in expert e, as the canonical decode computes it
  (level and scale chosen first, then one multiply)."""
  k = books.shape[-1]
  meta = jnp.arange(256, dtype=jnp.int32)
  book_level = books.astype(jnp.float32)[:, meta >> 7, :]                       # [E, 256, K]
  mix = book_level * ue4m3.decode(meta & 0x7F)[None, :, None]
  uniform = uniform_level(jnp.arange(k, dtype=jnp.int32))[None, None, :] * ue4m3.decode(meta)[None, :, None]
  return jnp.where((mode != 0)[:, None, None], mix, uniform)


def lookup_decode(codes, scales, table) -> jnp.ndarray:
  """f32 W [E, out, in] from int codes [E, out, in], meta bytes [E, out, in/16] and `lookup_table`: one gather."""
  E, k = table.shape[0], table.shape[-1]
  meta = bitplanes.repeat_last(scales.astype(jnp.int32), HALF)
  expert = jax.lax.broadcasted_iota(jnp.int32, codes.shape, 0)
  idx = (expert * 256 + meta) * k + codes
  return table.reshape(E * 256 * k).at[idx].get(mode="promise_in_bounds")


def variants(fmt, uniform_level, unpack):
  return dict(
      canonical=jax.jit(lambda s: fmt.dequantize(**s).astype(jnp.bfloat16)),
      lookup=jax.jit(lambda s: lookup_decode(unpack(s), s["scales"],
                                             lookup_table(s["books"], s["mode"], uniform_level)).astype(jnp.bfloat16)),
      write=jax.jit(lambda s: unpack(s).astype(jnp.bfloat16)))


def bit_identical(fmt, uniform_level, unpack, storage) -> bool:
  """The lookup decode's f32 bits equal the canonical decode's, every weight."""
  same = jax.jit(lambda s: jnp.array_equal(
      jax.lax.bitcast_convert_type(fmt.dequantize(**s), jnp.uint32),
      jax.lax.bitcast_convert_type(lookup_decode(unpack(s), s["scales"],
                                                 lookup_table(s["books"], s["mode"], uniform_level)), jnp.uint32)))
  return bool(same(storage))


def main(argv):
  del argv
  out = dict(env=run_record.environment(), smoke=_SMOKE.value, repeats=_REPEATS.value, weights={})
  for i, (name, (fmt, uniform_level, unpack, shape, smoke_shape)) in enumerate(WEIGHTS.items()):
    shape = smoke_shape if _SMOKE.value else shape
    storage = random_storage(jax.random.key(i), fmt, shape)
    rec = dict(shape=list(shape), bf16_bytes=2 * int(np.prod(shape)),
               storage_bytes=sum(int(a.size) * a.dtype.itemsize for a in storage.values()),
               bit_identical=bit_identical(fmt, uniform_level, unpack, storage), ms={})
    for vname, f in variants(fmt, uniform_level, unpack).items():
      rec["ms"][vname] = timing.timeit(f, storage, n=_REPEATS.value)
    rec["write_TB_per_s"] = {v: rec["bf16_bytes"] / (ms * 1e-3) / 1e12 for v, ms in rec["ms"].items()}
    out["weights"][name] = rec
    print(f"{name} {shape}: " + ", ".join(f"{v} {ms:.2f} ms" for v, ms in rec["ms"].items())
          + f"; lookup bit-identical: {rec['bit_identical']}", flush=True)
    if _OUT.value:
      run_record.write_json(_OUT.value, out)


if __name__ == "__main__":
  app.run(main)
