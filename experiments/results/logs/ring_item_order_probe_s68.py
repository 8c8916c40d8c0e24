"""Session 68 probe (#18): does the order of the ring's work list matter at 32768 Zipf? The items of a few giant
experts give compute-bound waves, those of the many small experts weight-bound ones (a wave of 132 units over ~8
small experts reads ~256 MB of weights). "mixed_k": the items of experts with fewer than k items spread evenly among
the others' (each small expert's items kept together). Every order writes the same h (each item its own rows)."""
import functools, json, os, sys
import jax, jax.numpy as jnp, numpy as np
from experiments import timing
from experiments.bench_moe import route_ids, torch_grouped_mm
from kernels_pallas import moe as moe_kernels
from kernels_pallas.moe import gate_up_wgmma as gw_mod, routing

S, E, K, D, I = (int(os.environ.get(k, v)) for k, v in dict(S=32768, E=256, K=6, D=4096, I=2048).items())
SMOKE = os.environ.get("SMOKE") == "1"  # CPU: the Mosaic GPU interpreter, 4 SMs
KIND = os.environ.get("KIND", "zipf")
ROUNDS = int(os.environ.get("ROUNDS", 40))
original = gw_mod.aligned_items


def mixed(k):
  def items_of(r, block_m):
    it = original(r, block_m)
    T = it.expert.shape[0]
    i = jnp.arange(T)
    valid = i < it.count[0]
    per_expert = jnp.zeros((r.num_experts,), jnp.int32).at[it.expert].add(valid.astype(jnp.int32))
    light = valid & (per_expert[it.expert] < k)
    heavy = valid & ~light
    H, L = jnp.maximum(heavy.sum(), 1), jnp.maximum(light.sum(), 1)
    h_rank = jnp.cumsum(heavy) - 1
    l_rank = jnp.cumsum(light) - 1
    # a light expert's items stay together: each takes its expert's first light rank
    first = jnp.full((r.num_experts,), T, jnp.int32).at[it.expert].min(jnp.where(light, l_rank, T).astype(jnp.int32))
    key = jnp.where(heavy, h_rank / H, jnp.where(light, first[it.expert] / L, 2.0 + i))
    order = jnp.lexsort((i, jnp.where(light, 0, 1), key))  # ties: light first, then the list's order
    return gw_mod.Items(it.expert[order], it.x_start[order], it.lo[order], it.end[order], it.count)
  return items_of


def main():
  keys = jax.random.split(jax.random.key(0), 8)
  w1 = (jax.random.normal(keys[0], (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
  w3 = (jax.random.normal(keys[1], (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
  x = jax.random.normal(keys[6], (S, D)).astype(jnp.bfloat16)
  ids = route_ids(keys[7], S, E, K, KIND)
  cfg = moe_kernels.Config.default(num_tokens=S, top_k=K, num_experts=E, hidden=D, intermediate=I)
  r = jax.jit(lambda i, bm=cfg.row_tile(S * K, E): routing.route(i, E, bm))(ids)
  t = gw_mod.default_tiling(-(-S * K // E), False, I)
  ws = tuple(jax.jit(gw_mod.ring_layout)(w) for w in (w1, w3))
  del w1, w3
  xs = gw_mod.sorted_rows(x, r, t.block_m)
  calls, outs = {}, {}
  smoke = dict(num_sms=4, interpret=True) if SMOKE else {}
  orders = {"default_ring_layout": original} | {f"mixed_{k}": mixed(k) for k in (3, 5, 9)}
  for name, fn in orders.items():
    gw_mod.aligned_items = fn
    f = jax.jit(lambda xs, a, b, r, t=t: gw_mod.gate_up_wgmma(xs, a, b, r, swiglu_limit=10.0, tiling=t,
                                                                 rows_sorted=True, **smoke)).lower(xs, *ws, r).compile()
    gw_mod.aligned_items = original
    outs[name] = np.asarray(f(xs, *ws, r)[:int(r.num_rows[0])].astype(jnp.float32))
    calls[name] = (functools.partial(f, xs, *ws, r), jax.block_until_ready)
  same = {n: bool(np.array_equal(o, outs["default_ring_layout"])) for n, o in outs.items()}
  print("bit-identical to the default order:", same, flush=True)
  sizes = jnp.bincount(ids.reshape(-1), length=E).astype(jnp.int32)
  out = {"tokens": S, "routing": KIND, "tiling": str(t), "bit_identical": same}
  try:
    kw1 = (jax.random.normal(keys[0], (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
    kw3 = (jax.random.normal(keys[1], (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
    w13 = jnp.concatenate([kw1, kw3], axis=1).transpose(0, 2, 1)
    del kw1, kw3
    x_sorted = x[r.token_of_row]
    tc = torch_grouped_mm(x_sorted, w13, sizes)
    if tc:
      calls = {"torch_grouped_mm_gate_up": tc} | calls
  except Exception as e:  # noqa: BLE001
    print("torch:", type(e).__name__, str(e)[:300], flush=True)
  names = list(calls)
  out |= timing.head_to_head(calls, names, ROUNDS)
  print(json.dumps({k: v for k, v in out.items() if k != "rounds_ms"}, indent=1), flush=True)
  if len(sys.argv) > 1:
    json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
  main()
