#!/usr/bin/env bash
# Issue 18's verification on a GPU machine, from the repository root, in under 10 minutes:
#   1. the CUDA tests (`pytest -m cuda`): greedy float32 and bfloat16 output against transformers
#      on the same device, the Triton kernels against the reference at realistic shapes, the
#      memory budget, NVML;
#   2. bench/gpu_check.py: a ~1B Llama-shaped random checkpoint in bfloat16, output tok/s at 64 and
#      256 concurrent sequences and single-stream decode as a fraction of the HBM roofline.
# It needs torch with CUDA, triton, transformers, safetensors, tokenizers, numpy, pytest and
# nvidia-ml-py, nothing else of kvmesh's services (docs/gpu.md says how to bring missing wheels).
#   bash bench/gpu_check.sh [gpu_check.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
$PY -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")'
$PY -m pytest -q -m cuda -p no:cacheprovider tests/test_triton_kernels.py tests/test_gpu.py
$PY bench/gpu_check.py "$@"
