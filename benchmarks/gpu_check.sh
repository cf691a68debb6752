#!/usr/bin/env bash
# GPU checks, one markdown table each. Run from anywhere, after `make install install-vllm` on the CUDA machine:
#   benchmarks/gpu_check.sh [--samples N] [--hidden-size H] [--layers L]   the tiny verifier (gpu_check.py): bf16 hf
#       extraction, vllm extraction when a CUDA vLLM is installed, 2-process training
#   benchmarks/gpu_check.sh --real [--quick] [--data DIR] [--json FILE]  SmolLM2-135M-Instruct end to end on one GPU:
#       generation in the CUDA vLLM, hidden states hf and vllm, the recipe's training, acceptance on all 164 HumanEval
#       problems and the batch-1 speed-up, beside the 2-core CPU recipe's figures (gpu_check_real.py)
#   ACCEL=cpu benchmarks/gpu_check.sh --real                           the same script's dry path on the CPU: tiny
#       verifier, fake servers, tiny sizes (make test runs it: tests/integration/test_gpu_check_dry.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ " $* " == *" --real "* ]]; then
    args=()
    for arg in "$@"; do [[ "$arg" == "--real" ]] || args+=("$arg"); done
    if [[ "${ACCEL:-}" == "cpu" ]]; then
        exec "$PYTHON" benchmarks/gpu_check_real.py --dry "${args[@]}"
    fi
    command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found: run this on a CUDA machine (ACCEL=cpu: the dry path)" >&2; exit 2; }
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    exec "$PYTHON" benchmarks/gpu_check_real.py "${args[@]}"
fi
command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found: run this on a CUDA machine" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
exec "$PYTHON" benchmarks/gpu_check.py "$@"
