#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4, CuTe DSL) on the lent GPU, for benchmarks/probe_attention_fa4.py. Its wheels
# (nvidia-cutlass-dsl-libs-cu13 alone is 92 MB) exceed one call's 64 MiB carry, so they travel as two halves of one
# .tar.xz in two calls on one warm machine (warm ~30 s after a call: start the second at once).
#   here:    STEP=prep bash benchmarks/run_gpu_fa4.sh      downloads the wheels (PyPI), unpacks them into one tree, xz,
#                                                          splits it into gpu_tmp/fa4a and gpu_tmp/fa4b (~3 min on 2 cores)
#   call 1 (carry gpu_tmp/fa4a, with any other work):  STEP=a bash benchmarks/run_gpu_fa4.sh   keeps half a in /tmp/fa4
#   call 2 (carry gpu_tmp/fa4b):                       STEP=b bash benchmarks/run_gpu_fa4.sh   joins, unpacks, probes
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
  b)
    cat /tmp/fa4/fa4part_aa gpu_tmp/fa4b/fa4part_ab > /tmp/fa4site.tar.xz && md5sum /tmp/fa4site.tar.xz
    mkdir -p /tmp/fa4site && tar -xJf /tmp/fa4site.tar.xz -C /tmp/fa4site
    export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:src
    python3 -c "import flash_attn.cute.interface; print('flash-attn-4 imports')"
    timeout "${CAP:-400}" python3 benchmarks/probe_attention_fa4.py "${OUT:-/tmp}/probe_attention_fa4.json" 2>&1 \
      | tee "${OUT:-/tmp}/log_probe_fa4.txt" | grep -v Warning | cut -c1-400 ;;
  *) echo "STEP must be prep | a | b" >&2; exit 2 ;;
esac
