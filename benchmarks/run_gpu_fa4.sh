#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4, CuTe DSL) on the lent GPU, for benchmarks/probe_attention_fa4.py. Its wheels
# (nvidia-cutlass-dsl-libs-cu13 alone is 92 MB) exceed one call's 64 MiB carry, so they travel as two halves of one
# .tar.xz in two calls on one warm machine (warm ~30 s after a call: start the second at once).
#   here:    STEP=prep bash benchmarks/run_gpu_fa4.sh      downloads the wheels (PyPI), unpacks them into one tree, xz,
#                                                          splits it into gpu_tmp/fa4a and gpu_tmp/fa4b (~3 min on 2 cores)
#   call 1 (carry gpu_tmp/fa4a, with any other work):  STEP=a bash benchmarks/run_gpu_fa4.sh   keeps half a in /tmp/fa4
#   call 2 (carry gpu_tmp/fa4b):                       STEP=b bash benchmarks/run_gpu_fa4.sh   joins, unpacks, runs
#   later calls on that warm machine (no carry):       STEP=c bash benchmarks/run_gpu_fa4.sh   runs
# what b and c run: FA4_RUN, space-separated, of probe (the default; probe_attention_fa4.py) | tests (model.attention=
# fa4's CUDA tests) | ab05 (the 0.5B graphed step, default kernels against fa4, dense and packed rows) | ab8b (8B LoRA)
# Session 62 carried flash-attn-4 4.0.0b40 and nvidia-cutlass-dsl 4.8.1 without nvidia-cutlass-dsl-libs-core, which
# holds the `cutlass` Python package: "No module named 'cutlass'" (logs/log_probe_fa4_import_session62.txt). The list
# below has it, with cuda-bindings, cuda-pathfinder and protobuf (their requirements; with them `import cutlass.cute`
# ran on a CPU host under Python 3.12).
set -eu
case "${STEP:-}" in
  prep)
    D=/tmp/fa4dl; S=/tmp/fa4site; rm -rf "$D" "$S"; mkdir -p "$D" "$S" gpu_tmp/fa4a gpu_tmp/fa4b
    pip download -q --pre --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d "$D" \
      flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
      nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 "apache-tvm-ffi>=0.1.11,<0.2" \
      torch-c-dlpack-ext "quack-kernels>=0.5.3" einops "cuda-bindings>=13,<14" cuda-pathfinder protobuf
    for w in "$D"/*.whl; do (cd "$S" && unzip -q -o "$w"); done
    tar -cf - -C "$S" . | xz -T2 -6 > /tmp/fa4site.tar.xz
    half=$(( $(stat -c %s /tmp/fa4site.tar.xz) / 2 + 1 ))
    split -b "$half" /tmp/fa4site.tar.xz /tmp/fa4part_
    mv /tmp/fa4part_aa gpu_tmp/fa4a/; mv /tmp/fa4part_ab gpu_tmp/fa4b/; md5sum /tmp/fa4site.tar.xz; ls -la gpu_tmp/fa4?/ ;;
  a) mkdir -p /tmp/fa4 && cp gpu_tmp/fa4a/fa4part_aa /tmp/fa4/ && echo "half a kept in /tmp/fa4" ;;
  b|c)  # b joins and unpacks the halves; c reuses the tree b left on this warm machine (no carry)
    if [ "$STEP" = b ]; then
      cat /tmp/fa4/fa4part_aa gpu_tmp/fa4b/fa4part_ab > /tmp/fa4site.tar.xz && md5sum /tmp/fa4site.tar.xz
      mkdir -p /tmp/fa4site && tar -xJf /tmp/fa4site.tar.xz -C /tmp/fa4site
    fi
    [ -d /tmp/fa4site/flash_attn ] || { echo "no /tmp/fa4site here: STEP=a, then STEP=b on one warm machine" >&2
                                        exit 2; }
    export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:src
    export CHRONICALS_GIT_SHA=${CHRONICALS_GIT_SHA:-unknown} HF_HUB_OFFLINE=1
    # FA4's compiled kernels on disk: each bench worker is a new process, which otherwise compiles them again (9-12 s
    # a shape on the H100); read when flash_attn.cute is imported
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
    python3 -c "import flash_attn.cute.interface; print('flash-attn-4 imports')"
    O=${OUT:-/tmp}; R=$O/r; mkdir -p "$R"
    bench() { timeout "$1" python3 -m chronicals.cli bench "${@:2}" --warmup 3 --steps 10 --no-correctness \
      --no-learning --out "$R"; echo "exit $?"; }
    for run in ${FA4_RUN:-probe}; do case "$run" in
      probe)  # FA4 against cuDNN and FA2, per layer (wall and kernel ms)
        timeout "${CAP:-400}" python3 benchmarks/probe_attention_fa4.py "$O/probe_attention_fa4.json" 2>&1 \
          | tee "$O/log_probe_fa4.txt" | grep -v Warning | cut -c1-400 ;;
      tests)  # model.attention=fa4 against float64 and in train() with CUDA graphs (~2 min with its compiles)
        timeout 300 python3 -m pytest -q -p no:cacheprovider -k fa4 tests/ops/test_attention_fa4.py \
          tests/ops/test_attention.py tests/train/test_attention_kernels_train.py 2>&1 | tail -25 ;;
      ab05)  # the 0.5B step, graphed, FA4 against the default kernels: dense rows, then packed rows (~4 min)
        C=chronicals-full-graphs,chronicals-lora-graphs
        for L in rows packed; do for A in auto fa4; do
          bench 150 --shape 0.5b --contenders "$C" --layout $L --attention $A --timeout 120 \
            --name "bench_fa4_0.5b_${L}_${A}_${CHRONICALS_GIT_SHA}" > "$R/log_fa4_05b_${L}_$A.txt" 2>&1
          grep -E "chronicals-|exit" "$R/log_fa4_05b_${L}_$A.txt" | tail -3
        done; done ;;
      ab8b)  # the 8B LoRA step, graphed, dense rows (~3 min)
        for A in auto fa4; do
          bench 170 --shape 8b --contenders chronicals-lora-graphs --attention $A --timeout 150 \
            --name "bench_fa4_8b_rows_${A}_${CHRONICALS_GIT_SHA}" > "$R/log_fa4_8b_$A.txt" 2>&1
          grep -E "chronicals-|exit" "$R/log_fa4_8b_$A.txt" | tail -2
        done ;;
      *) echo "FA4_RUN takes probe | tests | ab05 | ab8b (space-separated)" >&2; exit 2 ;;
    esac; done ;;
  *) echo "STEP must be prep | a | b | c" >&2; exit 2 ;;
esac
