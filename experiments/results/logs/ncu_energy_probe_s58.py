# Kept as logs/ncu_energy_probe_s58.py (untracked devncu.py). Session 58 added LEAN=1 (the ring's weights made at
# random in its layout: no copies, so ncu's kernel replay runs), the energy loops (NVML, ENERGY_ROUNDS rotated
# rounds) and the `_cw` names (Tiling.copy_warp, logs/ring_copy_warp_s58.patch). Used by devq.sh s58a-s58e.
# session 53 (#18): the bf16 gate/up contenders at one token count, each called `calls` times (run under ncu to read
# the hardware counters of the matching launches; without ncu it prints the median of 10 timed calls)
import os, sys, statistics
import jax, jax.numpy as jnp
import torch
from experiments import bench_moe
from kernels_pallas.moe import api, gate_up, gate_up_wgmma, routing
from kernels_pallas.moe import config as moe_config
from kernels_pallas.moe import QuantizedExpertWeights
from ds4jax.quant import formats
from ds4jax.quant import policy as quant_policy

S = int(sys.argv[1]); kind = sys.argv[2]; calls = int(sys.argv[3]); names = sys.argv[4].split(",")
D, I, E, K = 4096, 2048, 256, 6
keys = jax.random.split(jax.random.key(0), 8)
w1 = (jax.random.normal(keys[0], (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
w3 = (jax.random.normal(keys[1], (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
x = jax.random.normal(keys[6], (S, D)).astype(jnp.bfloat16)
ids = bench_moe.route_ids(keys[7], S, E, K, kind)
cfg = moe_config.Config.default(num_tokens=S, top_k=K, num_experts=E, hidden=D, intermediate=I)
kcfg = api._kernel_config(cfg)
r = jax.jit(lambda i: routing.route(i, E, cfg.row_tile(S * K, E)))(ids)
fs = {}
if "triton" in names:
  fs["triton"] = (jax.jit(lambda x, a, b, r: gate_up.gate_up(x, a, b, r, swiglu_limit=10.0, config=kcfg)), (x, w1, w3, r))
for tname in [n for n in names if n.removesuffix("_cw") in bench_moe.WGMMA_TILINGS]:
  t, inter, tiled = bench_moe.WGMMA_TILINGS[tname.removesuffix("_cw")]
  if tname.endswith("_cw"):  # session 58: the copies issued by one warp
    import dataclasses; t = dataclasses.replace(t, copy_warp=True)
  if os.environ.get("LEAN") and inter and tiled:  # timing only: random weights made in the ring's layout (no copies)
    ws = ((jax.random.normal(keys[2], (E, I // t.block_n, D // 64 * 2 * t.block_n, 64)) * D**-0.5
           ).astype(jnp.bfloat16), None)
  else:
    ws = bench_moe.wgmma_weights(tname, w1, w3)
  xs = gate_up_wgmma.sorted_rows(x, r, t.block_m)
  fs[tname] = (jax.jit(lambda xs, a, b, r, t=t: gate_up_wgmma.gate_up_wgmma(
      xs, a, b, r, swiglu_limit=10.0, tiling=t, rows_sorted=True)), (xs, *ws, r))
if "mix_c2" in names:
  mix2 = formats.get("rocmfp2_mix")
  q1 = QuantizedExpertWeights.from_storage("rocmfp2_mix", quant_policy.random_storage(mix2, (E, I, D), keys[3], D**-0.5),
                                           (E, I, D))
  q3 = QuantizedExpertWeights.from_storage("rocmfp2_mix", quant_policy.random_storage(mix2, (E, I, D), keys[4], D**-0.5),
                                           (E, I, D))
  m1, m3 = (jax.jit(gate_up_wgmma.mix_stack)(q.storage) for q in (q1, q3))
  fs["mix_c2"] = (jax.jit(lambda x, a, b, r: gate_up_wgmma.gate_up_wgmma(
      x, a, b, r, swiglu_limit=10.0, tiling=gate_up_wgmma.MIX_TILING)), (x, m1, m3, r))
if "torch" in names:
  x_sorted = x[r.token_of_row]
  sizes = jnp.bincount(jnp.where(ids >= 0, ids, E).reshape(-1), length=E + 1)[:E].astype(jnp.int32)
  w13 = jnp.concatenate([w1, w3], axis=1).transpose(0, 2, 1)
  a, b = torch.from_dlpack(x_sorted), torch.from_dlpack(w13)
  offs = torch.from_dlpack(jnp.cumsum(sizes).astype(jnp.int32))
  fs["torch"] = (lambda: torch._grouped_mm(a, b, offs=offs), ())
if "triton" not in names:  # halve the memory ncu saves and restores around each replayed launch
  del w1, w3
jax.block_until_ready(r)
for name, (f, args) in fs.items():
  ts = []
  for i in range(calls):
    torch.cuda.synchronize(); jax.block_until_ready(x)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); out = f(*args); jax.block_until_ready(out) if name != "torch" else None; e.record()
    torch.cuda.synchronize()
    ts.append(s.elapsed_time(e))
  print(f"{S} {kind} {name}: median {statistics.median(ts[1:] or ts):.3f} ms over {len(ts) - 1} calls", flush=True)
if len(sys.argv) > 5:  # back to back for loop_s seconds each (nvidia-smi samples the clock meanwhile), one wait a batch
  import time, ctypes
  nvml = ctypes.CDLL("libnvidia-ml.so.1"); nvml.nvmlInit_v2()
  dev = ctypes.c_void_p(); nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev))
  def energy_mj():  # the board's energy counter since the driver loaded, mJ
    e = ctypes.c_ulonglong(); nvml.nvmlDeviceGetTotalEnergyConsumption(dev, ctypes.byref(e)); return e.value
  rounds = int(os.environ.get("ENERGY_ROUNDS", "1"))
  for rnd in range(rounds):
   for name, (f, args) in (list(fs.items())[rnd % len(fs):] + list(fs.items())[:rnd % len(fs)]):
    for _ in range(10):  # warm to the power limit, untimed
      out = f(*args)
    jax.block_until_ready(out) if name != "torch" else torch.cuda.synchronize()
    t0, count, e0 = time.perf_counter(), 0, energy_mj()
    print(f"loop start {name} {time.time():.3f}", flush=True)
    while time.perf_counter() - t0 < float(sys.argv[5]):
      for _ in range(5):
        out = f(*args)
      jax.block_until_ready(out) if name != "torch" else torch.cuda.synchronize()
      count += 5
    dt, de = time.perf_counter() - t0, energy_mj() - e0
    print(f"loop end {name} {time.time():.3f}: {1e3 * dt / count:.3f} ms a call back to back, "
          f"{de / count:.1f} mJ a call, {de / dt / 1e3:.0f} W (round {rnd})", flush=True)
