#!/usr/bin/env bash
# Proves .gpu-bundle on this CPU machine before a GPU session spends its minutes on it: a Python 3.12
# virtual environment with the GPU machine's versions (torch 2.11, the +cu130 build run on the CPU, as PyPI
# has no CPU build of it; transformers 5.17; triton 3.6) and the packages of its image that serving
# imports, no vLLM installed, then the bundle installed as the GPU run installs it (.gpu-bundle/install.sh),
# then benchmarks/bench_gpu_serve.py --dry-run: the demo compiled 1A1F and served by afdc up's Deployment,
# monolithic and AFD over shm, token ids against dm.generate's and each other.
#   bash benchmarks/gpu_bundle_proof.sh [VENV]      (default /tmp/afdc-gpu-proof; its first run downloads GBs)
# Needs python3.12 on PATH and .gpu-bundle built (python benchmarks/gpu_bundle.py).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-/tmp/afdc-gpu-proof}
[ -f .gpu-bundle/install.sh ] || { echo "no .gpu-bundle: run python benchmarks/gpu_bundle.py first"; exit 2; }
if [ ! -x "$venv/bin/python" ]; then
  python3.12 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # the image's versions, and the packages it has that a served run imports (benchmarks/gpu_image_packages.txt)
  "$venv/bin/pip" install -q torch==2.11.0 transformers==5.17.0 triton==3.6.0 "huggingface_hub>=1.5,<2" accelerate \
    safetensors click tqdm numpy requests aiohttp psutil prometheus-client tokenizers pyyaml sentencepiece tiktoken \
    uvloop msgpack jinja2 pillow regex filelock cloudpickle einops py-cpuinfo httpx anyio protobuf typing-extensions \
    setuptools wheel six
fi
if "$venv/bin/python" -c "import vllm" 2> /dev/null; then
  echo "$venv has vLLM installed: the proof needs an environment without it"; exit 2
fi
site=$venv/afdc-site
PYTHON=$venv/bin/python AFDC_SITE=$site bash .gpu-bundle/install.sh
PYTHONPATH=$site "$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
PYTHONPATH=$site "$venv/bin/python" benchmarks/bench_gpu_serve.py --dry-run --startup-timeout 600 "${@:2}"
