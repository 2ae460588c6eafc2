#!/usr/bin/env bash
# The speculative-decoding benchmarks of benchmarks/README.md (default model, fp32, this machine).
# Each `magicdec bench` call resumes: rerunning skips the points already in its JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
# Threads for torch (default: all cores); set MAGICDEC_THREADS=1 when sharing the machine.
[ -n "${MAGICDEC_THREADS:-}" ] && export OMP_NUM_THREADS=$MAGICDEC_THREADS
CORPUS=${MAGICDEC_DATA:-../shared/data/pg19_dev.jsonl}
R=benchmarks/results
what=${1:-all}

if [ "$what" = all ] || [ "$what" = throughput ]; then
    # Throughput: speculative against autoregressive on the same engine, side by side, 128 new tokens;
    # `auto` runs the planner's choice with the profile from `magicdec calibrate`. Batches above 8 tile
    # 8 distinct prefilled prompts (identical decode work, 1/4 of the prefill), one prefill per context.
    # 8192-token prompts run at 8064 (8192 - 128 new tokens). benchmarks/validate_planner.py reads it.
    magicdec bench --corpus "$CORPUS" --drafters none,self-streaming,self-snapkv,auto --max-tokens 128 \
        --distinct-prompts 8 --budget 128,256,512 --gamma 1,2,3,4 --batch 32,8,1 --context 8192,4096,1024 \
        --out $R/throughput.json
    python benchmarks/validate_planner.py
fi

if [ "$what" = all ] || [ "$what" = acceptance ]; then
    # Acceptance: tokens per verify step against budget (gamma 4), greedy and sampled, 4 prompts per
    # context; then positions (re-indexed vs original) at budget 256. (Acceptance against gamma at
    # budgets 128-512 is in the throughput sweep.)
    common=(--corpus "$CORPUS" --batch 4 --drafters self-streaming,self-snapkv --modes greedy,sampling
            --max-tokens 64 --gamma 4 --out $R/acceptance.json)
    magicdec bench "${common[@]}" --context 1k,2k,4k,8k --budget 64,128,256,512,1024
    magicdec bench "${common[@]}" --context 1k,8k --budget 256 --positions reindex,original
fi

if [ "$what" = all ] || [ "$what" = auto ]; then
    # The planner's choice against plain decoding, greedy and sampled (temperature 0.7, top-p 0.9).
    magicdec bench --corpus "$CORPUS" --drafters none,auto --max-tokens 128 --distinct-prompts 8 \
        --batch 32,8,1 --context 8192,4096,1024 --modes greedy,sampling --out $R/auto.json
fi
