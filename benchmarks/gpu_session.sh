#!/usr/bin/env bash
# The GPU checks in one device call of at most 8 minutes on a fresh machine: everything they read is
# in the repository (the model configs in benchmarks/configs), nothing is downloaded or installed.
# Sections, most valuable first, each under its own time limit (together 470 s, and at most 2 s each
# to stop one that outlives it), so that a hang in one leaves the others' numbers:
#   model       the default backend (afdc on a GPU: fused-MoE and routing kernels inside the model) on a
#               Qwen3-MoE- and a DeepSeek-V3-shaped model: kernels substituted, correctness, speed vs the monolith
#   interleave  an artifact under a compiling backend, FFN rank served over cuda-ipc, micro_batches=2:
#               Inductor's pieces interleaved on a CUDA stream per micro-batch, against m = 1 and the monolith
#   kernels     afdc's fused MoE and row kernels against the GPU's peak (bench_kernels.py)
#   transports  the exchange's round trip over shm and cuda-ipc (bench_runtime.py (a))
# A section that fails or runs out of time says so here and in its log, and the exit status is 1.
#   bash benchmarks/gpu_session.sh [--dry-run] [--plan] [section...]     (default: every section)
#   --dry-run   the same sections on the CPU at tiny sizes, no CUDA needed, 3x the limits (tests/test_gpu_session.py)
#   --plan      print each section's limit and command, run nothing
# Logs and JSON go to $OUT (default ./gpu-out): 7 files, within the 8 a device call returns. A
# section's limit can be changed with <SECTION>_S in the environment (e.g. MODEL_S=300).
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-gpu-out}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SECTIONS=(model interleave kernels transports)

dry=0 plan=0 chosen=()
for arg in "$@"; do
  case $arg in
    --dry-run) dry=1 ;;
    --plan) plan=1 ;;
    -*) echo "unknown option $arg"; exit 2 ;;
    *) chosen+=("$arg") ;;
  esac
done
[ ${#chosen[@]} -eq 0 ] && chosen=("${SECTIONS[@]}")

if [ $dry = 1 ]; then
  gpu=(--dry-run) kernels=(--smoke) transports=(--connectors shm --repeats 2)
else
  gpu=() kernels=(--repeats 10) transports=(--connectors shm cuda-ipc --repeats 100)
fi

section() {  # section NAME: sets limit (its default, in seconds) and cmd
  case $1 in
    model) limit=210 cmd=(python3 benchmarks/bench_gpu.py --only model --models moe deepseek "${gpu[@]}"
      --json "$OUT/model.json") ;;
    interleave) limit=130 cmd=(python3 benchmarks/bench_gpu.py --only interleave "${gpu[@]}"
      --json "$OUT/interleave.json") ;;
    kernels) limit=90 cmd=(python3 benchmarks/bench_kernels.py --configs benchmarks/configs
      --models qwen3-30b-a3b deepseek-v3 --skip-compile "${kernels[@]}" --json "$OUT/kernels.json") ;;
    transports) limit=40 cmd=(python3 benchmarks/bench_runtime.py --only a "${transports[@]}") ;;
    *) return 1 ;;
  esac
}

failed=()
[ $plan = 1 ] || mkdir -p "$OUT"
for name in "${chosen[@]}"; do
  section "$name" || { echo "unknown section $name (sections: ${SECTIONS[*]})"; exit 2; }
  [ $dry = 1 ] && limit=$((3 * limit))  # a CI machine's 2 shared cores start Python processes slower
  override=${name^^}_S
  limit=${!override:-$limit}
  if [ $plan = 1 ]; then
    echo "$name $limit ${cmd[*]}"
    continue
  fi
  echo "=== $name (limit ${limit}s): ${cmd[*]}"
  t0=$SECONDS
  timeout --kill-after=2 "$limit" "${cmd[@]}" > "$OUT/$name.log" 2>&1
  rc=$?
  took=$((SECONDS - t0))
  tail -n 40 "$OUT/$name.log"
  if [ $rc = 0 ]; then
    echo "=== $name: ok in ${took}s"
  else
    why="exit status $rc"
    { [ $rc = 124 ] || [ $rc = 137 ]; } && why="out of time after ${limit}s"
    echo "=== $name: FAILED ($why) in ${took}s; its log: $OUT/$name.log"
    failed+=("$name")
  fi
done
[ $plan = 1 ] && exit 0
if [ ${#failed[@]} -gt 0 ]; then
  echo "=== ${#failed[@]} of ${#chosen[@]} sections FAILED: ${failed[*]}"
  exit 1
fi
echo "=== all ${#chosen[@]} sections ok"
