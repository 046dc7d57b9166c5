#!/bin/bash
# The GPU benchmark in parts, each at most ~6.5 minutes of work, so that a part and the
# machine's start-up fit the 8 minutes budgeted per part (device time: 15 min a session).
#
#   bash scripts/gpu_bench.sh PART OUT_DIR
#
# PART: tests | fp32-small | fp32-large | bf16 | max-n. Each writes OUT_DIR/<name>.json
# (saved after every N and every largest-N probe, so a part cut by its time limit keeps
# what it measured) and OUT_DIR/<name>.log. Contenders: the suite's (serial, concurrent,
# concurrent-mps, torch.func, hand-fused, hftc, hftc+compile at its compile sizes) plus
# hftc+step (the whole-step graph) where this checkout has it.
#
# Plan (device time is 15 min a session: two parts each; run them in this order):
#   session 1: tests (is everything right on the device?), then fp32-small
#   session 2: fp32-large, then max-n
#   session 3: bf16
# A session runs one part per `run` call, e.g. (the JSON comes back under $OUT):
#   bash scripts/gpu_bench.sh tests $OUT
#
# Then merge every part's JSON, on any machine, with one command:
#   bash scripts/gpu_bench.sh merge DIR     # DIR: the folder(s) the parts came back to
# which writes the cuda and cuda-bf16 blocks of docs/BENCHMARKS.md and their plots, with
# the card, its driver, torch's version and each part's exact command.
#
# Time limits per workload come from the H100 run of 2026-11-22 (docs/BENCHMARKS.md).
set -u
part=${1:?part: tests, fp32-small, fp32-large, bf16, max-n or merge}
out=${2:-${OUT:-benchmarks/results/cuda}}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HFTC_CACHE_DIR=${HFTC_CACHE_DIR:-/tmp/hftc-cache}
start=$SECONDS
budget=${BUDGET_S:-390}  # the part's seconds of work (6.5 min)

# hftc+step where the checkout has it (the step helper adds it to hftc/bench/contenders.py).
contenders=$("$python" - <<'EOF'
from hftc.bench.contenders import CONTENDERS
from hftc.bench.suite import default_contenders
print(",".join(default_contenders("cuda") + [c for c in ("hftc+step",) if c in CONTENDERS]))
EOF
) || contenders=""

left() { echo $((budget - (SECONDS - start))); }

bench() {  # name, seconds (cut to what the part has left), then bench arguments
  local name=$1 limit=$2
  shift 2
  local have
  have=$(left)
  ((have < limit)) && limit=$have
  if ((limit < 20)); then
    echo "=== $name skipped: the part's ${budget} s are spent"
    return
  fi
  echo "=== [$((SECONDS - start)) s] $name (limit ${limit} s)"
  timeout -k 10 "$limit" "$python" -m hftc bench --device cuda --max-n '' \
    ${contenders:+--contenders "$contenders"} --out "$out/$name.json" "$@" \
    > "$out/$name.log" 2>&1
  echo "exit $?"
  grep -E "^  N=|failed|^    N=|-> N =" "$out/$name.log" | cut -c1-300
}

case $part in
  tests)
    tests=(tests/test_cuda.py tests/test_optim.py::test_cuda_matches_stock
           tests/test_bench.py::test_gpu_suite_end_to_end tests/test_activation_checkpoint.py)
    # The whole-step graph's CUDA cases, where the step helper's tests exist.
    for f in tests/test_step*.py; do [[ -e $f ]] && tests+=("$f"); done
    timeout -k 10 300 "$python" -m pytest -q -p no:cacheprovider -n 16 "${tests[@]}" -rfE \
      > "$out/tests.log" 2>&1
    echo "exit $?"
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -30
    bench mlp 80 --workloads mlp --sizes 1,8,32 --compile-sizes '' ;;
  fp32-small)
    bench mlp 110 --workloads mlp --sizes 1,2,4,8,16,32,64 --compile-sizes 32
    bench lenet5 110 --workloads lenet5 --sizes 1,2,4,8,16,32 --compile-sizes ''
    bench transformer 160 --workloads transformer --sizes 1,2,4,8,16,32 --compile-sizes '' ;;
  fp32-large)
    bench pointnet 150 --workloads pointnet --sizes 1,2,4,8,16,32 --compile-sizes ''
    bench resnet18 130 --workloads resnet18 --sizes 1,2,4,8,16 --compile-sizes ''
    bench mobilenet_v2 100 --workloads mobilenet_v2 --sizes 1,4,8,16 --compile-sizes '' ;;
  bf16)
    bench bf16-mlp 70 --precision bf16 --workloads mlp --sizes 1,8,32 --compile-sizes ''
    bench bf16-lenet5 60 --precision bf16 --workloads lenet5 --sizes 1,8,32 --compile-sizes ''
    bench bf16-transformer 90 --precision bf16 --workloads transformer --sizes 1,8,32 \
      --compile-sizes ''
    bench bf16-pointnet 60 --precision bf16 --workloads pointnet --sizes 1,8,32 \
      --compile-sizes ''
    bench bf16-resnet18 60 --precision bf16 --workloads resnet18 --sizes 1,8,16 \
      --compile-sizes ''
    bench bf16-mobilenet_v2 50 --precision bf16 --workloads mobilenet_v2 --sizes 1,8 \
      --compile-sizes '' ;;
  max-n)
    # The largest N that fits the card, with and without activation checkpointing
    # (hftc+ckpt): each search bounded (--max-n-budget), then how fast hftc+ckpt steps.
    for w in pointnet resnet18; do
      for c in hftc hftc+ckpt; do
        bench "max-n-$w-${c/+/-}" 95 --workloads "$w" --sizes '' --contenders hftc \
          --max-n "$w:$c" --max-n-budget 80
      done
    done ;;
  merge)
    shift
    dirs=("$@")
    fp32=() bf16=()
    for d in "${dirs[@]}"; do
      for f in "$d"/*.json; do
        [[ -e $f ]] || continue
        case $(basename "$f") in bf16-*) bf16+=("$f") ;; *) fp32+=("$f") ;; esac
      done
    done
    ((${#fp32[@]})) && "$python" -m hftc.bench.report "${fp32[@]}" --docs docs/BENCHMARKS.md \
      --block cuda --plots docs --stem bench_cuda
    ((${#bf16[@]})) && "$python" -m hftc.bench.report "${bf16[@]}" --docs docs/BENCHMARKS.md \
      --block cuda-bf16 --plots docs --stem bench_cuda-bf16
    exit 0 ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
echo "=== [$((SECONDS - start)) s] done"
