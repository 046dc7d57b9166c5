#!/bin/bash
# The GPU benchmark in parts that each fit a 10-minute command (the lent GPU machines).
#
#   bash scripts/gpu_bench.sh tests|fp32-small|fp32-large|bf16 [OUT_DIR]
#
# Run each part on the GPU machine (python3 with a CUDA torch; PYTHONPATH is set here),
# bring OUT_DIR's JSON files back, then merge them on any machine:
#
#   .venv/bin/python -m hftc.bench.report DIR/{mlp,lenet5,pointnet,resnet18,mobilenet_v2,transformer}.json \
#       --docs docs/BENCHMARKS.md --block cuda --plots docs --stem bench_cuda
#   .venv/bin/python -m hftc.bench.report DIR/bf16-*.json \
#       --docs docs/BENCHMARKS.md --block cuda-bf16 --plots docs --stem bench_cuda-bf16
#
# Time limits per workload come from the H100 run of 2026-11-22 (docs/BENCHMARKS.md):
# a workload cut by its limit keeps the sizes it finished (the JSON is saved after each).
set -u
part=${1:?part: tests, fp32-small, fp32-large or bf16}
out=${2:-${OUT:-benchmarks/results/cuda}}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HFTC_CACHE_DIR=${HFTC_CACHE_DIR:-/tmp/hftc-cache}
start=$SECONDS

bench() {  # name, seconds, then bench arguments
  local name=$1 limit=$2
  shift 2
  echo "=== [$((SECONDS - start)) s] $name (limit ${limit} s)"
  timeout "$limit" python3 -m hftc bench --device cuda --max-n '' --out "$out/$name.json" "$@" \
    > "$out/$name.log" 2>&1
  echo "exit $?"
  grep -E "^  N=|failed" "$out/$name.log" | cut -c1-300
}

case $part in
  tests)
    python3 -m pytest -q -p no:cacheprovider -n 16 tests/test_cuda.py \
      tests/test_optim.py::test_cuda_matches_stock tests/test_bench.py::test_gpu_suite_end_to_end \
      -rfE > "$out/tests.log" 2>&1
    echo "exit $?"
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -30
    bench mlp 360 --workloads mlp ;;
  fp32-small)
    bench lenet5 200 --workloads lenet5
    bench pointnet 340 --workloads pointnet --sizes 1,2,4,8,16 ;;
  fp32-large)
    bench resnet18 190 --workloads resnet18 --sizes 1,2,4,8,16 --compile-sizes ''
    bench mobilenet_v2 180 --workloads mobilenet_v2 --sizes 1,2,4,8 --compile-sizes ''
    bench transformer 170 --workloads transformer --sizes 1,2,4,8,16 ;;
  bf16)
    bench bf16-mlp 150 --precision bf16 --workloads mlp --sizes 1,4,16,32 --compile-sizes ''
    bench bf16-resnet18 200 --precision bf16 --workloads resnet18 --sizes 1,4,8 --compile-sizes ''
    bench bf16-transformer 180 --precision bf16 --workloads transformer --sizes 1,4,16 \
      --compile-sizes '' ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
echo "=== [$((SECONDS - start)) s] done"
