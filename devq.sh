#!/bin/bash
# usage: bash devq.sh qual LENGTHS CONFIGS [extra flags] | bash devq.sh gen [extra flags]
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 JAX_COMPILATION_CACHE_DIR=/tmp/ds4jax_jit_cache DS4JAX_GIT_COMMIT=$(cat .commit)
mode=$1; shift
if [ "$mode" = qual ]; then
  lengths=$1; configs=$2; shift 2
  for f in qual_v4flash_h200_wave2b.json qual_v4flash_h200_wave2b.exact.npz; do
    [ -e $OUT/$f ] || cp experiments/results/$f $OUT/
  done
  python3 -u -m experiments.prefill --flagfile=qual.cfg --lengths=$lengths --configs=$configs --out=$OUT/qual_v4flash_h200_wave2b.json "$@" 2>&1 | grep -v "^W1\|libtpu" | tee $OUT/qual.log
elif [ "$mode" = next ]; then
  # session 18 plan (#19/#18): the unstaged MLA kernels at V4-Flash size (shared-memory fixes of 3d641eb), the next
  # MLA tiles, then verdicts incl. kill_mla_stream_f32_stage (cut by timeouts; the qual needs ~6 min for all_on)
  timeout 150 python3 -u -m experiments.bench_attention --contexts=8192 --repeats=5 --precision=bf16 --out=$OUT/attention_h200_kb64.json 2>&1 | grep -v "^W1\|libtpu" > $OUT/bench_attention.log
  timeout 120 python3 -u -m experiments.tune_attention --variants=default,kb32,kb64_dk64,kb64_dk256 --contexts=8192,131072 --out=$OUT/tune_attention.json 2>&1 | grep -v "^W1\|libtpu" > $OUT/tune.log
  cp experiments/results/qual_v4flash_h200_wave2b.exact.npz $OUT/qual_v4flash_h200_wave2c.exact.npz
  timeout ${QUAL_S:-300} python3 -u -m experiments.prefill --flagfile=qual.cfg --lengths=8192 --configs=all_on,kill_mla_stream_f32_stage --mutations= --out=$OUT/qual_v4flash_h200_wave2c.json 2>&1 | grep -v "^W1\|libtpu" > $OUT/qual.log
elif [ "$mode" = s18a ]; then
  # session 18: the decode kernel's tilings (#18), one more MLA tiling (#19), the MLA tests compiled
  timeout 200 python3 -u -m experiments.bench_decode --out=$OUT/decode_h200.json 2>&1 | grep -v "^W1\|libtpu" > $OUT/decode.log
  timeout 120 python3 -u -m experiments.tune_attention --variants=default,kb64_dk64 --contexts=8192,131072 --out=$OUT/tune_attention.json 2>&1 | grep -v "^W1\|libtpu" > $OUT/tune.log
  timeout 200 python3 -m pytest -q -x tests/kernels_pallas/moe/test_moe_decode.py tests/kernels_pallas/mla/test_mla.py -p no:cacheprovider 2>&1 | tail -30 > $OUT/gpu_tests.log
elif [ "$mode" = s18b ]; then
  # session 18: whole prefill with and without moe_decode_kernel (and the unstaged MLA kernel) at 8192 and 122879;
  # the MoE with the half-block loader; the whole prefill with the fused gate/up
  timeout 170 python3 -u -m experiments.trace_prefill --preset=v4_flash --quant_policy=lucebox_mix --tokens=8192 --repeats=3 --precompile_workers=12 --without=moe_decode_kernel,mla_stream_f32_stage --out=$OUT/trace_prefill_h200_8192.json 2>&1 | grep -v "^W1\|libtpu" > $OUT/trace8k.log
  timeout 180 python3 -u -m experiments.trace_prefill --preset=v4_flash --quant_policy=lucebox_mix --tokens=122879 --repeats=2 --trace=false --precompile_workers=12 --without=moe_decode_kernel --out=$OUT/trace_prefill_h200_122879.json 2>&1 | grep -v "^W1\|libtpu" > $OUT/trace128k.log
  timeout 100 python3 -u -m experiments.tune_moe --formats=rocmfp2_mix,rocmfp3_mix --tokens=8192,32768 --noparity 2>&1 | grep -v "^W1\|libtpu" > $OUT/tune_moe.log
  timeout 100 python3 -u -m experiments.trace_prefill --preset=v4_flash --quant_policy=lucebox_mix --tokens=8192 --repeats=3 --trace=false --precompile_workers=12 --moe_sparse_gate_up --out=$OUT/trace_prefill_h200_8192_sparse_gate_up.json 2>&1 | grep -v "^W1\|libtpu" > $OUT/trace8k_sparse.log
elif [ "$mode" = s18c ]; then
  # session 18: the qualification's all_on at 8192 (moe_decode_kernel on)
  cp experiments/results/qual_v4flash_h200_wave2b.exact.npz $OUT/qual_v4flash_h200_wave2c.exact.npz
  timeout ${QUAL_S:-420} python3 -u -m experiments.prefill --flagfile=qual.cfg --lengths=8192 --configs=all_on --mutations= --out=$OUT/qual_v4flash_h200_wave2c.json 2>&1 | grep -v "^W1\|libtpu" > $OUT/qual.log
elif [ "$mode" = radix ]; then
  # #19 item 2 at model scale: all_on (radix top-k, the sm_90 default now) and without it, one model, one process
  python3 -u -m experiments.trace_prefill --preset=v4_flash --quant_policy=lucebox_mix --tokens=${LENGTHS-8192,122879} --repeats=2 --trace=false --precompile_workers=12 --without=indexer_radix_topk --out=$OUT/trace_prefill_h200_radix.json "$@" 2>&1 | grep -v "^W1\|libtpu" | tee $OUT/radix.log
elif [ "$mode" = mesh1 ]; then
  # #22: all_on at 8192 timed on a mesh of one device and unsharded (trace_prefill, back to back), then the
  # qualification's verdicts on the mesh
  for spec in ${SPECS-expert=1 ""}; do
    python3 -u -m experiments.trace_prefill --preset=v4_flash --quant_policy=lucebox_mix --tokens=8192 --repeats=3 --trace=false --precompile_workers=12 --mesh=$spec --out=$OUT/trace_prefill_h200_8192_mesh${spec#expert=}.json 2>&1 | grep -v "^W1\|libtpu" | tee -a $OUT/trace_mesh.log
  done
  cp experiments/results/qual_v4flash_h200_wave2b.exact.npz $OUT/qual_v4flash_h200_mesh1.exact.npz
  [ -e experiments/results/qual_v4flash_h200_mesh1.json ] && cp experiments/results/qual_v4flash_h200_mesh1.json $OUT/
  [ -n "$SKIP_TRACE" ] || true
  timeout ${QUAL_S:-280} python3 -u -m experiments.prefill --flagfile=qual.cfg --lengths=8192 --configs=all_on --mesh=expert=1 --mutations= --out=$OUT/qual_v4flash_h200_mesh1.json "$@" 2>&1 | grep -v "^W1\|libtpu" | tee $OUT/qual_mesh1.log
else
  python3 -u -m experiments.bench_generate --preset=v4_flash --quant_policy=lucebox_mix --dtype=bf16 --precompile_workers=12 "$@" 2>&1 | grep -v "^W1\|libtpu" | tee $OUT/gen.log
fi
