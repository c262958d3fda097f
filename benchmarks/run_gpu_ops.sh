#!/usr/bin/env bash
# One GPU-machine call: check and time every fused op against its contenders, then pack the results.
# Usage (device tool, repo root, carry .whl with liger-kernel/cut-cross-entropy wheels):
#   bash benchmarks/run_gpu_ops.sh            -> $OUT/ops_results.tgz and logs
set -u
export PYTHONUNBUFFERED=1 CHRONICALS_GIT_SHA=${CHRONICALS_GIT_SHA:-unknown}
RES=/tmp/chronicals_results; mkdir -p "$RES"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:src
else
  export PYTHONPATH=src
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv
for s in ${OPS:-rms_norm swiglu rope linear_cross_entropy attention}; do
  echo "=== bench_$s"
  timeout "${PER_SCRIPT_S:-150}" python3 "benchmarks/bench_$s.py" --out "$RES" > "$RES/log_$s.txt" 2>&1
  echo "exit $?"; tail -n "${TAIL:-25}" "$RES/log_$s.txt"
done
if [ -n "${PYTEST_CUDA:-}" ]; then
  timeout 120 python3 -m pytest -q -x $PYTEST_CUDA > "$RES/log_pytest_cuda.txt" 2>&1; echo "pytest exit $?"
  tail -n 15 "$RES/log_pytest_cuda.txt"
fi
tar czf "${OUT:-/tmp}/ops_results.tgz" -C "$RES" .
