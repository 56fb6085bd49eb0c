#!/usr/bin/env bash
# The GPU checks in one device call of at most 8 minutes on a fresh machine: everything they read is
# in the repository (the model configs in benchmarks/configs) or carried beside it (.gpu-bundle, vLLM's
# Python and the serving wheels the image lacks: python benchmarks/gpu_bundle.py builds it; carry it).
# Nothing is downloaded. Sections, most valuable first, each under its own time limit (together 470 s,
# and at most 2 s each to stop one that outlives it), so that a hang in one leaves the others' numbers:
#   served      afdc served under vLLM on the GPU (bench_gpu_serve.py): a Qwen3-30B-A3B-shaped model cut
#               to 2 layers, 1A1F, as AFD (FFN rank over cuda-ipc) and monolithic, driven by vllm bench
#               serve at 1/16/64 in flight: token ids equal, tok/s and TPOT ratios; then AFD with the
#               attention decode step in CUDA graphs (--attention-graphs) at 1/64 in flight
#   model       the default backend (afdc on a GPU: fused-MoE and routing kernels inside the model) on a
#               Qwen3-MoE-shaped model: kernels substituted, correctness, speed vs the monolith
#   kernels     afdc's fused MoE and row kernels against the GPU's peak (bench_kernels.py)
#   transports  the exchange's round trip over shm and cuda-ipc (bench_runtime.py (a)), with MPS where it runs
#   transports-nomps  the same after the MPS daemon is stopped: two processes' kernels time-sliced
#   interleave  (by name only: its compile outlives its share of 8 minutes) an artifact under a compiling
#               backend, FFN rank over cuda-ipc, micro_batches=2, against m = 1 and the monolith
#   tune        (by name only, a call of its own) tune_fused_moe.py: the fused MoE tuned on this GPU for the
#               three shapes, bf16 and the shipped formats, into afdc/data/autotuned.json ($OUT/autotuned.json)
# The CUDA MPS control daemon is started first where the machine has it (not with --dry-run or
# --no-mps), so that an attention process and an FFN process share the GPU side by side; it is
# stopped before transports-nomps and at the end.
# A section that fails or runs out of time says so here and in its log, and the exit status is 1.
#   bash benchmarks/gpu_session.sh [--dry-run] [--plan] [--no-mps] [section...]     (default: every section)
#   --dry-run   the same sections on the CPU at tiny sizes, no CUDA needed, 3x the limits (tests/test_gpu_session.py)
#   --plan      print each section's limit and command, run nothing
# Logs and JSON go to $OUT (default ./gpu-out): 8 files at most, the most a device call returns. A
# section's limit can be changed with <SECTION>_S in the environment (e.g. MODEL_S=300; TRANSPORTS_NOMPS_S).
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-gpu-out}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SECTIONS=(served model kernels transports transports-nomps)

dry=0 plan=0 mps=1 chosen=()
for arg in "$@"; do
  case $arg in
    --dry-run) dry=1 mps=0 ;;
    --plan) plan=1 ;;
    --no-mps) mps=0 ;;
    -*) echo "unknown option $arg"; exit 2 ;;
    *) chosen+=("$arg") ;;
  esac
done
[ ${#chosen[@]} -eq 0 ] && chosen=("${SECTIONS[@]}")

if [ $dry = 1 ]; then
  gpu=(--dry-run) kernels=(--smoke) transports=(--connectors shm --repeats 2)
else
  gpu=() kernels=(--repeats 10) transports=(--connectors shm cuda-ipc --repeats 50)
fi

section() {  # section NAME: sets limit (its default, in seconds) and cmd
  case $1 in
    served) limit=250 cmd=(python3 benchmarks/bench_gpu_serve.py "${gpu[@]}" --json "$OUT/served.json") ;;
    model) limit=100 cmd=(python3 benchmarks/bench_gpu.py --only model --models moe "${gpu[@]}"
      --json "$OUT/model.json") ;;
    interleave) limit=130 cmd=(python3 benchmarks/bench_gpu.py --only interleave "${gpu[@]}"
      --json "$OUT/interleave.json") ;;
    kernels) limit=60 cmd=(python3 benchmarks/bench_kernels.py --configs benchmarks/configs
      --models qwen3-30b-a3b deepseek-v3 --skip-compile "${kernels[@]}" --json "$OUT/kernels.json") ;;
    tune) limit=420 cmd=(python3 benchmarks/tune_fused_moe.py --formats --table "$OUT/autotuned.json") ;;
    transports|transports-nomps) limit=30 cmd=(python3 benchmarks/bench_runtime.py --only a "${transports[@]}") ;;
    *) return 1 ;;
  esac
}

mps_daemon() {  # mps_daemon start|stop: the CUDA MPS control daemon, where this machine has it
  command -v nvidia-cuda-mps-control > /dev/null || { echo "=== MPS: no nvidia-cuda-mps-control here"; return 0; }
  if [ "$1" = start ]; then
    if nvidia-cuda-mps-control -d; then echo "=== MPS: control daemon started"; mps_on=1
    else echo "=== MPS: the control daemon did not start (kernels of two processes will be time-sliced)"; fi
  elif [ "${mps_on:-0}" = 1 ]; then
    echo quit | nvidia-cuda-mps-control && echo "=== MPS: control daemon stopped"; mps_on=0
  fi
}

failed=()
if [ $plan = 0 ]; then
  mkdir -p "$OUT"
  if [ $dry = 0 ] && [[ " ${chosen[*]} " == *" served "* ]] && ! python3 -c "import vllm" 2> /dev/null; then
    if [ -f .gpu-bundle/install.sh ]; then
      bash .gpu-bundle/install.sh && export PYTHONPATH=${AFDC_SITE:-/tmp/afdc-site}:$PYTHONPATH
    else
      echo "=== no vLLM here and no .gpu-bundle: run python benchmarks/gpu_bundle.py where PyPI is reachable and carry .gpu-bundle"
    fi
  fi
  [ $mps = 1 ] && mps_daemon start
fi
for name in "${chosen[@]}"; do
  [ "$name" = transports-nomps ] && [ $plan = 0 ] && mps_daemon stop
  section "$name" || { echo "unknown section $name (sections: ${SECTIONS[*]})"; exit 2; }
  [ $dry = 1 ] && limit=$((3 * limit))  # a CI machine's 2 shared cores start Python processes slower
  override=${name^^}_S override=${override//-/_}
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
mps_daemon stop
echo "=== summary"
python3 benchmarks/gpu_summary.py "$OUT"
if [ ${#failed[@]} -gt 0 ]; then
  echo "=== ${#failed[@]} of ${#chosen[@]} sections FAILED: ${failed[*]}"
  exit 1
fi
echo "=== all ${#chosen[@]} sections ok"
