#!/bin/bash
# The GPU benchmark in parts, each at most ~6.5 minutes of work, so that a part and the
# machine's start-up fit the 8 minutes budgeted per part (device time: 15 min a session).
#
#   bash scripts/gpu_bench.sh PART OUT_DIR
#
# PART: tests | fp32-a | fp32-b | fp32-c | bf16 | pointnet-32 | profile | max-n-pointnet |
# max-n-resnet18.
# Each writes OUT_DIR/<name>.json (saved after every N and every largest-N probe, so a
# part cut by its time limit keeps what it measured) and OUT_DIR/<name>.log.
# Contenders: the suite's (serial, concurrent, concurrent-mps, torch.func, hand-fused,
# hftc; hftc+compile at N = 8 of the small workloads) plus hftc+step (the whole-step
# graph) where this checkout has it. Sizes: the N the issue's targets name (1, 2, 8, 32).
#
# Plan (15 min of device time a session, start-up included). The H200 lease of
# 2026-11-27 started in about 30 s and ran three calls back to back on the warm machine
# (462 s + 300 s of commands): chain the calls, set BUDGET_S to fit what `status` says is
# left, and give the machine back after the last.
#   done 2026-11-27 (H200): tests, fp32-a, fp32-b (PointNet N = 32 cut by the limit)
#   next: tests (the four fixed failures, the new conv-lowering test, half-type optimizer
#         steps on CUDA), fp32-c, profile
#   then: pointnet-32, max-n-pointnet, max-n-resnet18; then bf16
# One part per `run` call, e.g. with timeout_s 590:
#   BUDGET_S=200 bash scripts/gpu_bench.sh tests $OUT; BUDGET_S=360 bash scripts/gpu_bench.sh fp32-c $OUT
#
# Then merge every part's JSON, on any machine, with one command:
#   bash scripts/gpu_bench.sh merge DIR...   # the folder(s) the parts came back to
# which writes the card's blocks of docs/BENCHMARKS.md (fp32 and bf16: cuda and cuda-bf16
# for an H100, cuda-h200 and cuda-h200-bf16 for an H200) and their plots
# (docs/bench_BLOCK_*.png), with the card, its driver, torch's version, each part's exact
# command and commit. Runs of one card only; a workload that two parts (or leases) ran has
# each N from the later run. The README's and the guides' numbers follow, or nothing is
# written where one would be lost: name the earlier lease's folder too, e.g.
#   bash scripts/gpu_bench.sh merge benchmarks/results/cuda-h200 $NEW_DIR
#
# DEVICE=cpu BUDGET_S=120 bash scripts/gpu_bench.sh max-n-pointnet /tmp/x  tries a part's
# logic on a CPU (every part was tried so, BUDGET_S=90, on 2026-12-07), and
# BLOCK=try bash scripts/gpu_bench.sh merge /tmp/x  its merge (in a copy of the checkout).
set -u
part=${1:?part: tests, fp32-a, fp32-b, fp32-c, bf16, pointnet-32, profile, max-n-pointnet, max-n-resnet18 or merge}
out=${2:-${OUT:-benchmarks/results/cuda}}
python=${PYTHON:-python3}
device=${DEVICE:-cuda}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HFTC_CACHE_DIR=${HFTC_CACHE_DIR:-/tmp/hftc-cache}

if [[ $part == merge ]]; then
  # Every part's JSON of the folders, fp32 and bf16 apart, each into the block of its card
  # and precision (report --block auto: cuda for the H100, cuda-h200 for the H200, ...).
  shift
  (($#)) || set -- "$out"
  fp32=() bf16=() status=0
  for d in "$@"; do
    [[ -d $d ]] || { echo "merge: no folder $d" >&2; status=1; continue; }
    for f in "$d"/*.json; do
      [[ -e $f ]] || continue
      case $(basename "$f") in bf16-*) bf16+=("$f") ;; *) fp32+=("$f") ;; esac
    done
  done
  ((${#fp32[@]} + ${#bf16[@]})) || { echo "merge: no results JSON in $*" >&2; exit 1; }
  # BLOCK=NAME: into NAME and NAME-bf16 instead (a DEVICE=cpu try-out, on a copy of docs/).
  report() {  # block, then the JSON files
    local block=$1
    shift
    "$python" -m hftc.bench.report "$@" --docs docs/BENCHMARKS.md --block "$block" --plots docs
  }
  block=${BLOCK:-auto} bf16_block=auto
  [[ $block == auto ]] || bf16_block=$block-bf16
  if ((${#fp32[@]})); then report "$block" "${fp32[@]}" || status=1; fi
  if ((${#bf16[@]})); then report "$bf16_block" "${bf16[@]}" || status=1; fi
  exit $status
fi
mkdir -p "$out"
start=$SECONDS
budget=${BUDGET_S:-390}  # the part's seconds of work (6.5 min)

# hftc+step where the checkout has it (the step helper adds it to hftc/bench/contenders.py).
contenders=$("$python" - <<'EOF'
from hftc.bench.contenders import CONTENDERS
from hftc.bench.suite import default_contenders
import os
device = os.environ.get("DEVICE", "cuda")
names = default_contenders(device) + [c for c in ("hftc+step",) if c in CONTENDERS]
print(",".join(dict.fromkeys(names)))
EOF
) || contenders=""

# The part's seconds left, at least 1 (`timeout 0` would mean no limit at all).
left() { local s=$((budget - (SECONDS - start))); echo $((s > 1 ? s : 1)); }

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
  timeout -k 10 "$limit" "$python" -m hftc bench --device "$device" --max-n '' \
    ${contenders:+--contenders "$contenders"} --out "$out/$name.json" "$@" \
    > "$out/$name.log" 2>&1
  echo "exit $?"
  grep -E "^  N=|failed|^    N=|-> N =" "$out/$name.log" | cut -c1-300
}

case $part in
  tests)
    tests=(tests/test_cuda.py tests/test_optim.py::test_cuda_matches_stock
           tests/test_optim.py::test_cuda_half_precision_parameters_step_as_stock_bit_for_bit
           tests/test_bench.py::test_gpu_suite_end_to_end
           tests/test_optim_mixed.py::test_mixed_classes_with_fused_adam)
    # The whole-step graph, the capturable optimizers and the sync-free GradScaler.
    for f in tests/test_step.py tests/test_step_order.py tests/test_cuda_step.py tests/test_optim_capturable.py \
             tests/test_utils_amp.py; do [[ -e $f ]] && tests+=("$f"); done
    # 16 processes where pytest-xdist is installed (the GPU machines have it), else one.
    xdist=()
    "$python" -c "import xdist" 2>/dev/null && xdist=(-n 16)
    timeout -k 10 "$(left)" "$python" -m pytest -v -p no:cacheprovider ${xdist[@]+"${xdist[@]}"} \
      "${tests[@]}" -rfE --durations=20 \
      > "$out/tests.log" 2>&1
    echo "exit $?"
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -30 ;;
  fp32-a)
    bench mlp 210 --workloads mlp --sizes 1,2,8,32,64 --compile-sizes 8
    bench lenet5 170 --workloads lenet5 --sizes 1,2,8,32 --compile-sizes 8 ;;
  fp32-b)
    bench transformer 180 --workloads transformer --sizes 1,2,8,32 --compile-sizes 8
    bench pointnet 200 --workloads pointnet --sizes 1,2,8,32 --compile-sizes 8 ;;
  fp32-c)
    bench resnet18 210 --workloads resnet18 --sizes 1,2,8,16 --compile-sizes ''
    bench mobilenet_v2 170 --workloads mobilenet_v2 --sizes 1,2,8 --compile-sizes '' ;;
  pointnet-32)
    # PointNet again (autotune's pointwise_per_sample candidate is newer than the H200
    # run) and its N = 32, which fp32-b's limit cut.
    bench pointnet-32 330 --workloads pointnet --sizes 2,8,32 --compile-sizes '' ;;
  profile)
    # The kernels of PointNet's and the Transformer's steps at N = 8, hftc and serial:
    # where the fused step loses to N processes under MPS (scripts/gpu_profile.py).
    timeout -k 10 "$(left)" "$python" scripts/gpu_profile.py --device "$device" "$out" > "$out/profile.log" 2>&1
    echo "exit $?"
    grep -E " ms a step" "$out/profile.txt" ;;
  bf16)
    # torch.func's cells read "failed" on PointNet, ResNet-18 and MobileNetV2: stock
    # vmap(grad(functional_call)) of a BatchNorm model under autocast raises "expected
    # scalar type BFloat16 but found Float" (torch 2.13 on the CPU, without hftc).
    bench bf16-mlp 60 --precision bf16 --workloads mlp --sizes 1,8,32 --compile-sizes ''
    bench bf16-lenet5 55 --precision bf16 --workloads lenet5 --sizes 1,8,32 --compile-sizes ''
    bench bf16-transformer 65 --precision bf16 --workloads transformer --sizes 1,8,32 \
      --compile-sizes ''
    bench bf16-pointnet 65 --precision bf16 --workloads pointnet --sizes 1,8,32 \
      --compile-sizes ''
    bench bf16-resnet18 70 --precision bf16 --workloads resnet18 --sizes 1,8,16 \
      --compile-sizes ''
    bench bf16-mobilenet_v2 60 --precision bf16 --workloads mobilenet_v2 --sizes 1,8 \
      --compile-sizes '' ;;
  max-n-pointnet | max-n-resnet18)
    # The largest N that fits the card, without and with activation checkpointing
    # (hftc+ckpt: how much further N goes), each search bounded (--max-n-budget: a search
    # cut short reports the largest N seen to fit, as a lower bound).
    w=${part#max-n-}
    for c in hftc hftc+ckpt; do
      have=$(left)
      ((have > 190)) && have=190
      # The search stops itself 45 s before the call's limit: the bench's start-up (CUDA,
      # the forkserver, the peak matmul, the FLOP count on the CPU: ResNet-18's 426 GFLOP
      # step on one thread), the probe in flight when the budget ends, the save. (30 s:
      # on the CPU, DEVICE=cpu BUDGET_S=90, the limit killed ResNet-18's search first.)
      bench "max-n-$w-${c/+/-}" 190 --workloads "$w" --sizes '' --contenders hftc \
        --max-n "$w:$c" --max-n-budget $((have > 75 ? have - 45 : 30))
    done ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
echo "=== [$((SECONDS - start)) s] done"
