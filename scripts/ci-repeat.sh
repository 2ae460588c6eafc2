#!/usr/bin/env bash
# Run the test suite N times (default 3), each time as CI does: a fresh clone of the committed HEAD, `bash .ci/run`.
# Each run shuffles the tests' order with its own seed (pytest-randomly, given through PYTEST_ADDOPTS), so a test that
# depends on another's order or state fails here. Prints each run's summary and every failing test id with the seed
# that reproduces it; exits non-zero if any run failed. Logs stay in the printed folder.
#
#   bash scripts/ci-repeat.sh 3
#   PYTEST_ADDOPTS="-p randomly --randomly-seed=SEED" python -m pytest -q -n 2 tests   # replay one run's order
set -uo pipefail
n=${1:-3}
[[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "usage: $0 [N >= 1]" >&2; exit 2; }
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
logs=$(mktemp -d /tmp/ci-repeat.XXXXXX)
# CI's clone has the shared data beside it, as this checkout does (../shared)
[ -d "$repo/../shared" ] && ln -s "$(cd "$repo/../shared" && pwd)" "$logs/shared"
echo "ci-repeat: $n runs of $(git -C "$repo" rev-parse --short HEAD) on $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; logs in $logs"
failed=0
for i in $(seq 1 "$n"); do
    clone="$logs/clone$i"
    seed=$RANDOM$RANDOM
    git clone -q "$repo" "$clone"
    start=$(date +%s)
    (cd "$clone" && CI=true PYTEST_ADDOPTS="-p randomly --randomly-seed=$seed" bash .ci/run) > "$logs/run$i.log" 2>&1
    status=$?
    summary=$(grep -E '^=*.* (passed|failed|error)' "$logs/run$i.log" | tail -1 | tr -d '=' | xargs)
    echo "run $i (seed $seed): exit $status in $(( $(date +%s) - start )) s: ${summary:-no summary, see $logs/run$i.log}"
    grep -E '^(FAILED|ERROR) ' "$logs/run$i.log" | sed 's/^/    /'
    [ "$status" -eq 0 ] || failed=$((failed + 1))
    rm -rf "$clone"
done
# .ci/run installed each clone in editable mode: point the installation back at this checkout.
python -m pip install -q --no-deps -e "$repo" >/dev/null 2>&1 || echo "ci-repeat: reinstall with: pip install -e $repo" >&2
echo "ci-repeat: $failed of $n runs failed"
[ "$failed" -eq 0 ]
