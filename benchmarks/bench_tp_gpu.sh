#!/usr/bin/env bash
# Tensor parallelism on a multi-GPU machine (not run yet: written for a node of 8 GPUs), at most ~10 minutes:
# Llama-3.1-8B's shape with placeholder bf16 weights, batch 32 x 8k context, TP = 1, 2, 4 and 8 over NCCL,
# plain decoding and self-speculation (StreamingLLM, budget 512, gamma 3), with the all-reduce measured
# between the node's GPUs and the planner's prediction beside each run (profile: $HARDWARE, default h100).
# Writes ${OUT:-.}/tp-gpu.json. Fewer GPUs: RUNS=1:1,2:1 bash benchmarks/bench_tp_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import magicdec" 2>/dev/null || python -m pip install -q --no-deps -e .
PYTHONUNBUFFERED=1 timeout 600 python benchmarks/bench_tp.py --device cuda --shape llama-3.1-8b \
    --runs "${RUNS:-1:1,2:1,4:1,8:1}" --batch 32 --context 8192 --max-tokens 32 --budget 512 --gamma 3 \
    --hardware "${HARDWARE:-h100}" --out "${OUT:-.}/tp-gpu.json" "$@"
