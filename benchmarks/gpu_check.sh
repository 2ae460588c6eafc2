#!/usr/bin/env bash
# GPU readiness check, at most ~8 minutes: lossless greedy on a tiny model on CUDA, then decode / verify /
# draft step times at Llama-3.1-8B shapes (random bf16 weights). Writes ${OUT:-.}/gpu_check.json.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import magicdec" 2>/dev/null || python -m pip install -q --no-deps -e .
PYTHONUNBUFFERED=1 timeout 480 python benchmarks/gpu_check.py --out "${OUT:-.}/gpu_check.json" "$@"
