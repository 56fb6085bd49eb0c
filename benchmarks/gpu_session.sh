#!/usr/bin/env bash
# One device call that runs what only a GPU can show, most important first, each step under its own
# time limit so that a hang in one leaves the others' numbers. Logs and JSON go to $OUT (or ./gpu-out).
#   bash benchmarks/gpu_session.sh [steps...]   steps: env served correct speed runtime kernels (default: all)
# The model configs for bench_kernels are read from $AFDC_CONFIGS (default ../shared/configs).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
CONFIGS=${AFDC_CONFIGS:-../shared/configs}
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(env served correct speed runtime kernels)
run() {  # run NAME SECONDS CMD...: its output to $OUT/NAME.log, its exit status said
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name: rc=$? in $((SECONDS - t0))s"
}

for step in "${steps[@]}"; do
  case $step in
    env) run env 60 bash -c 'nvidia-smi -L; python3 -c "import torch, transformers, triton; \
print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name())"; \
python3 -c "import afdc; print(\"afdc imports\")"' ;;
    served) run served "${SERVED_S:-200}" python3 benchmarks/bench_gpu.py --models moe --only graph artifact \
      --backends eager afdc --json "$OUT/served.json" ;;
    correct) run correct "${CORRECT_S:-150}" python3 benchmarks/bench_gpu.py --only correct \
      --models ${MODELS:-moe deepseek gpt-oss dense} --dtypes bf16 --backends afdc --plans 2A2F --json "$OUT/correct.json" ;;
    speed) run speed "${SPEED_S:-120}" python3 benchmarks/bench_gpu.py --only speed --models moe \
      --backends eager afdc --json "$OUT/speed.json" ;;
    runtime) run runtime "${RUNTIME_S:-90}" python3 benchmarks/bench_runtime.py --only a \
      --connectors shm cuda-ipc ;;
    kernels) run kernels "${KERNELS_S:-150}" python3 benchmarks/bench_kernels.py --configs "$CONFIGS" \
      --skip-compile --json "$OUT/kernels.json" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  tail -n 40 "$OUT/$step.log"
done
