#!/usr/bin/env bash
# GPU check (see benchmarks/gpu_check.py): bf16 hf extraction, vllm extraction when a CUDA vLLM is installed
# ($EAGLE3_VLLM_PYTHON, default .venv-vllm/bin/python), 2-process training; prints one markdown table.
# Run from the repository root on a CUDA machine: benchmarks/gpu_check.sh [--samples N] [--hidden-size H] [--layers L]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found: run this on a CUDA machine" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" benchmarks/gpu_check.py "$@"
