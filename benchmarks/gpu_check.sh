#!/usr/bin/env bash
# GPU readiness check, at most ~8 minutes: lossless greedy on tiny models on CUDA, then decode / verify /
# draft step times at Gemma 3 270M and Llama-3.1-8B shapes and engine rounds. Writes ${OUT:-.}/gpu_check.json.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this tree, nothing installed
PYTHONUNBUFFERED=1 timeout 480 python3 benchmarks/gpu_check.py --out "${OUT:-.}/gpu_check.json" "$@"
