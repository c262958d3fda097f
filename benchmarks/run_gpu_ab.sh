#!/usr/bin/env bash
# One GPU-machine call: bench rows of this tree ("new") and of an older tree ("old") alternating, same machine, so a
# change's gain is read against a baseline measured minutes apart on the same card (cards differ by a few % between
# calls: README "Performance"). Rows stop starting once GUARD seconds (default 420) have gone, inside the 600 s a
# call may take; each row is capped at 240 s.
# Here, before the call (the device's copy of the tree may lack .git; gpu_tmp/ is a path git ignores here):
#   mkdir -p gpu_tmp/old && git archive REV src benchmarks | tar -x -C gpu_tmp/old
# Then (device tool, repo root, carry [".whl", "gpu_tmp"]; ../shared/GPU.md says how .whl is made):
#   SHA=$(git rev-parse --short HEAD) bash benchmarks/run_gpu_ab.sh NAME "0.5b:chronicals-lora-graphs 8b:chronicals-lora-graphs" [ROUNDS]
# Each round runs every shape:contender new then old; rounds after the first run only the first pair (the 8B rows
# take ~1 min each). TESTS="tests/ops/test_rope.py ..." runs those CUDA tests first. Results (the rows' JSON, markdown
# and PNG, and the logs) in one $OUT/NAME.tgz: a call brings back few files; the summary lines come last.
set -u
NAME=$1; ROWS=$2; ROUNDS=${3:-2}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CHRONICALS_AUTOTUNE=first
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
ROOT=$PWD; OLD=$ROOT/gpu_tmp/old; R=${OUT:-/tmp}/$NAME; L=$R/logs; mkdir -p "$L"; T0=$(date +%s)
[ -d "$OLD/src/chronicals" ] || { echo "no old tree at $OLD: git archive REV src benchmarks | tar -x -C gpu_tmp/old"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv | tee "$L/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee -a "$L/gpu.txt"
if [ -n "${TESTS:-}" ]; then
  PYTHONPATH=/tmp/site:src timeout 200 python3 -m pytest -q -p no:cacheprovider $TESTS > "$L/pytest.txt" 2>&1
  echo "tests rc=$? at $(( $(date +%s) - T0 )) s: $(tail -1 "$L/pytest.txt")"
fi
SUMMARY=()
row() {  # tree shape contender tag
  local dir=$ROOT; [ "$1" = old ] && dir=$OLD
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir/src CHRONICALS_GIT_SHA=${SHA:-unknown} timeout 240 python3 \
     benchmarks/bench_e2e.py --shape "$2" --contenders "$3" --no-correctness --no-learning --name "${NAME}_$4_$1" \
     --out "$R" > "$L/$4_$1.txt" 2>&1)
  local line; line=$(grep -E "^  $3 " "$L/$4_$1.txt" | head -1 | cut -c1-170)
  SUMMARY+=("$4 $1: ${line:-no row, see logs/$4_$1.txt} [$(( $(date +%s) - T0 )) s]"); echo "${SUMMARY[-1]}"
}
for ((i = 1; i <= ROUNDS; i++)); do
  n=0
  for spec in $ROWS; do
    n=$((n + 1)); [ "$i" -gt 1 ] && [ "$n" -gt 1 ] && break
    [ $(( $(date +%s) - T0 )) -lt "${GUARD:-420}" ] || break 2
    shape=${spec%%:*}; contender=${spec#*:}; tag=${shape/./}_$n.$i
    row new "$shape" "$contender" "$tag"; row old "$shape" "$contender" "$tag"
  done
done
printf '%s\n' "${SUMMARY[@]}" > "$L/summary.txt"
tar -czf "${OUT:-/tmp}/$NAME.tgz" -C "${OUT:-/tmp}" "$NAME" && rm -rf "$R"
echo "### summary"; printf '%s\n' "${SUMMARY[@]}"
