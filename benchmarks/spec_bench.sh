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

if [ "$what" = all ] || [ "$what" = acceptance ]; then
    # Acceptance: tokens per verify step against budget (gamma 4) and against gamma (budget 256),
    # greedy and sampled, 4 prompts per context; then positions (re-indexed vs original) at gamma 4.
    common=(--corpus "$CORPUS" --batch 4 --context 1k,2k,4k,8k --drafters self-streaming,self-snapkv
            --modes greedy,sampling --max-tokens 64 --out $R/acceptance.json)
    magicdec bench "${common[@]}" --budget 64,128,256,512,1024 --gamma 4
    magicdec bench "${common[@]}" --budget 256 --gamma 1,2,3,5,6
    magicdec bench "${common[@]}" --budget 64,256,1024 --gamma 4 --positions reindex,original
fi

if [ "$what" = all ] || [ "$what" = throughput ]; then
    # Throughput: speculative against autoregressive on the same engine, side by side, 128 new tokens;
    # `auto` runs the planner's choice with the profile from `magicdec calibrate`.
    # Batches above 8 tile 8 distinct prefilled prompts (identical decode work, 1/4 of the prefill).
    common=(--corpus "$CORPUS" --drafters none,self-streaming,self-snapkv,auto --max-tokens 128
            --distinct-prompts 8 --out $R/throughput.json --budget 256 --gamma 1,2)
    magicdec bench "${common[@]}" --batch 1,8,32 --context 1k,4k,8k
    magicdec bench "${common[@]}" --batch 64 --context 1k,4k
fi
