#!/usr/bin/env bash
# Run the offload worker's GPU tests and the GPU transfer benchmark in one go (< 10 min).
#
#   scripts/gpu_check.sh [OUTPUT_DIR]        (default: $OUT, else out/gpu_check)
#
# Needs a CUDA machine whose python (or $PYTHON) has a CUDA build of torch; the machine
# may have no network. kvtier runs from src/ (no install step); only missing small
# dependencies are installed, into out/gpu-deps. Writes logs, a JUnit XML and the
# benchmark JSON to OUTPUT_DIR and ends with a summary; non-zero exit if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

OUT_DIR=${1:-${OUT:-out/gpu_check}}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

# Only what the GPU tests and the benchmark import. When something is missing, install it
# into out/gpu-deps (ignored by git) on PYTHONPATH, so the machine's own torch stays in use:
# a venv would not do, since one made from a venv's python (as CUDA images often have)
# sees only the base interpreter's packages. The install is bounded so that the whole
# check still fits in 10 minutes when no package index answers.
missing=""
for module in torch numpy xxhash pytest pytest_timeout; do
    "$PY" -c "import $module" 2>/dev/null || missing="$missing ${module//_/-}"
done
if [ -n "$missing" ]; then
    echo "missing:$missing; installing into out/gpu-deps (needs a package index)"
    export PYTHONPATH="$PWD/out/gpu-deps:$PYTHONPATH"
    # shellcheck disable=SC2086
    timeout 45 "$PY" -m pip install -q --target out/gpu-deps $missing \
        || echo "could not install:$missing"
fi

{
    echo "== machine"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    nproc
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), 'threads', torch.get_num_threads())"
} 2>&1 | tee "$OUT_DIR/machine.txt"

echo "== GPU tests"
timeout 300 "$PY" -m pytest -q -rs -p no:cacheprovider tests/transfer/test_worker_gpu.py \
    --junitxml "$OUT_DIR/gpu_tests.xml" 2>&1 | tee "$OUT_DIR/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== transfer benchmark (cuda)"
timeout 240 "$PY" benchmarks/bench_transfer.py --device cuda --reps 5 \
    --json "$OUT_DIR/bench_transfer_cuda.json" 2>&1 | tee "$OUT_DIR/bench_transfer_cuda.log"
bench_rc=${PIPESTATUS[0]}

echo "== summary"
{
    echo "gpu tests: rc=$tests_rc $(tail -n 1 "$OUT_DIR/gpu_tests.log")"
    echo "bench_transfer --device cuda: rc=$bench_rc $(grep '^bench_transfer: store/load' "$OUT_DIR/bench_transfer_cuda.log")"
} | tee "$OUT_DIR/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
