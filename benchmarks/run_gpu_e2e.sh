#!/usr/bin/env bash
# End-to-end tables on the lent GPU, in stages that each fit one device call (<= 600 s).
# Usage (device tool, repo root; carry .whl = liger-kernel / cut-cross-entropy wheels):
#   STAGE=main  bash benchmarks/run_gpu_e2e.sh   0.5B table with every contender + correctness + learning (~7.5 min
#                                                with Unsloth, ~5 min without)
#   STAGE=8b    bash benchmarks/run_gpu_e2e.sh   8B LoRA table (~5 min)
#   STAGE=sweep bash benchmarks/run_gpu_e2e.sh   model sweep, then the seq sweep of our two rows (~6 min)
#   STAGE=ab    bash benchmarks/run_gpu_e2e.sh   our switches side by side at 0.5B: SwiGLU product source, gate_up
#                                                recompute, LoRA groups (~3 min)
#   STAGE=attention bash benchmarks/run_gpu_e2e.sh   packed rows' attention kernels: the cuDNN-frontend probe, then our
#                                                graphed rows as dense rows / packed + cudnn / packed + flash (~6 min;
#                                                .whl must hold nvidia-cudnn-frontend)
# Unsloth rows need its wheels, which take two calls (one call carries at most 64 MiB and the machine
# keeps what a call installed only while it stays warm, ~30 s; ../shared/GPU.md):
#   call 1 (carry .whl_u1):  UNSLOTH_WHEELS=.whl_u1 STAGE=none bash benchmarks/run_gpu_e2e.sh
#   call 2 right after (carry .whl_u2 .whl):  UNSLOTH_WHEELS=.whl_u2 STAGE=main bash benchmarks/run_gpu_e2e.sh
# Results: $OUT/r (JSON + md + png + logs). Set CHRONICALS_GIT_SHA to the commit that runs: the machine's
# copied .git can point at an older HEAD than the files (report.git_sha prefers the variable).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CHRONICALS_GIT_SHA=${CHRONICALS_GIT_SHA:-unknown}
R=${OUT:-/tmp}/r; mkdir -p "$R"
for d in .whl ${UNSLOTH_WHEELS:-}; do
  ls "$d"/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site "$d"/*.whl
done
export PYTHONPATH=/tmp/site:src
bench() { timeout "$1" python3 -m chronicals.cli bench "${@:2}" --out "$R"; echo "exit $?"; }
case "${STAGE:-main}" in
  main)
    C=chronicals-full,chronicals-full-keep,chronicals-full-offer,chronicals-full-graphs,chronicals-lora,chronicals-lora-graphs,chronicals-lora-graphs-nogroup,hf-sdpa,hf-compile,hf-liger,hf-peft
    python3 -c "import unsloth" 2>/dev/null && C=$C,unsloth-full,unsloth-lora
    bench 580 --shape 0.5b --contenders "$C" --warmup 3 --steps 10 --timeout 240 --name bench_e2e_0.5b \
      > "$R/log_e2e_05b.txt" 2>&1; tail -40 "$R/log_e2e_05b.txt" ;;
  8b)
    C=chronicals-lora,chronicals-lora-graphs,chronicals-lora-graphs-nogroup,hf-peft-compile,hf-peft
    python3 -c "import unsloth" 2>/dev/null && C=$C,unsloth-lora
    bench 580 --shape 8b --contenders "$C" --warmup 2 --steps 5 --timeout 200 --no-learning --no-correctness \
      --name bench_e2e_8b > "$R/log_e2e_8b.txt" 2>&1; tail -20 "$R/log_e2e_8b.txt" ;;
  sweep)
    bench 200 --model-sweep --contenders chronicals-lora --warmup 2 --steps 4 --timeout 60 > "$R/log_modelsweep.txt" 2>&1
    bench 380 --seq-sweep --contenders chronicals-full,chronicals-lora-graphs --warmup 2 --steps 4 --timeout 60 \
      > "$R/log_seqsweep.txt" 2>&1; tail -30 "$R"/log_*sweep.txt ;;
  ab)
    C=chronicals-full,chronicals-full-offer,chronicals-full-gateup,chronicals-lora-graphs,chronicals-lora-graphs-gateup,chronicals-lora-graphs-gateup6,chronicals-lora-graphs-nogroup
    bench 300 --shape 0.5b --contenders "$C" --warmup 3 --steps 10 --timeout 120 --no-correctness --no-learning \
      --name bench_e2e_0.5b_ab > "$R/log_e2e_ab.txt" 2>&1; tail -12 "$R/log_e2e_ab.txt" ;;
  attention)
    (cd benchmarks && PYTHONPATH=/tmp/site:$PWD/../src timeout 150 python3 probe_attention_cudnn_fe.py \
      "$R/probe_attention_cudnn_fe_${CHRONICALS_GIT_SHA}.json") > "$R/log_probe_cudnn_fe.txt" 2>&1
    tail -30 "$R/log_probe_cudnn_fe.txt"
    C=chronicals-full-graphs,chronicals-lora-graphs
    for L in rows packed:cudnn packed:flash; do
      A=${L#*:}; [ "$A" = "$L" ] && A=auto
      bench 150 --shape 0.5b --contenders "$C" --layout "${L%%:*}" --attention "$A" --warmup 3 --steps 10 --timeout 70 \
        --no-correctness --no-learning --name "bench_e2e_0.5b_layout_${L/:/_}_${CHRONICALS_GIT_SHA}" \
        > "$R/log_layout_${L/:/_}.txt" 2>&1; grep -E "chronicals-|exit" "$R/log_layout_${L/:/_}.txt" | tail -4
    done ;;
  none) echo "wheels installed" ;;
  *) echo "STAGE must be main | 8b | sweep | ab | attention | none" >&2; exit 2 ;;
esac
