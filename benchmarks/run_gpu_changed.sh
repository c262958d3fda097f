#!/usr/bin/env bash
# One GPU-machine call: only the test files changed since a git revision, on CUDA, in four processes at once (each
# capped at ${CAP:-420} s), with a summary of each printed last. For a session's new tests when the whole
# run_gpu_validate.sh (~9 min) does not fit the device time left.
# Usage (device tool, repo root, carry .whl with the gguf wheel; ../shared/GPU.md):
#   bash benchmarks/run_gpu_changed.sh REV        e.g. the sha the session started from
# The device's copy of the tree may lack .git: then make the list here and carry it (a path git ignores):
#   git diff --name-only REV HEAD -- 'tests/*.py' | grep /test_ > gpu_tmp/changed.txt
#   run (carry .whl gpu_tmp): bash benchmarks/run_gpu_changed.sh gpu_tmp/changed.txt
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src
if [ -f "$1" ]; then FILES=$(cat "$1"); else FILES=$(git diff --name-only "$1" HEAD -- 'tests/*.py' | grep /test_); fi
F=(); for f in $FILES; do [ -f "$f" ] && F+=("$f"); done
[ ${#F[@]} -gt 0 ] || { echo "no changed test files"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
L=${OUT:-/tmp}/logs; mkdir -p "$L"
P=(); for i in 0 1 2 3; do P[$i]=""; done
i=0; for f in "${F[@]}"; do P[$((i % 4))]+=" $f"; i=$((i+1)); done
t0=$(date +%s)
for i in 0 1 2 3; do
  [ -n "${P[$i]}" ] || continue
  { timeout "${CAP:-420}" python3 -m pytest -q -p no:cacheprovider ${P[$i]} > "$L/part$i.txt" 2>&1
    echo "part$i rc=$? ($(( $(date +%s) - t0 )) s)" >> "$L/part$i.txt"; } &
done
wait
for i in 0 1 2 3; do
  [ -f "$L/part$i.txt" ] || continue
  echo "### part$i:${P[$i]}" | cut -c1-300
  grep -E "^(ERROR|FAILED)|passed|failed|rc=" "$L/part$i.txt" | cut -c1-200 | tail -25
done
