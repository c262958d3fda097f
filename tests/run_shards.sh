#!/usr/bin/env bash
# `make test`: the suite as two pytest processes side by side, one intra-op thread each.
#
# usage: tests/run_shards.sh PYTHON [pytest args...]   (TEST_SHARDS=1: one pytest over tests/, as before)
#
# Why: most of the suite is single-threaded Python (Triton's interpreter, tiny models), so on a 2-core machine
# (CI's) one pytest leaves a core idle. Measured on this project's 2-core sandbox at 2f65639: tests/ops beside
# tests/models + tests/data took 214 s with one thread each, 277 s with two threads each, against 387 s one after the
# other in the whole-suite run (786 s in all).
# Shard 1 is the trainer, model, LoRA and bench tests and the CLI's checkpoint tests (~390 s of the 761 s of test
# time in that run, with the 2-rank data-parallel tests); shard 2 is everything else (kernels, data, the rest of the
# CLI), so a new test file or folder lands in shard 2 and nothing is left out. At one thread each: shard 1 378 s and
# shard 2 470 s before test_cli_checkpoints (41 s) moved over, 430 s and 427 s after (make test 437 s). Shard 2's
# output is kept in a file and printed after shard 1's (or, when the run is interrupted, what it had printed).
set -u
py=${1:?usage: tests/run_shards.sh PYTHON [pytest args...]}
shift
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=1
if [ "${TEST_SHARDS:-2}" = 1 ]; then
  exec "$py" -m pytest "$@" tests
fi
one=(tests/train tests/models tests/lora tests/bench tests/test_cli_checkpoints.py)
log=$(mktemp "${TMPDIR:-/tmp}/chronicals-shard2.XXXXXX")
echo "shard 1: ${one[*]}; shard 2 (the rest) runs beside it, its output follows"
OMP_NUM_THREADS=1 "$py" -m pytest "$@" tests "${one[@]/#/--ignore=}" > "$log" 2>&1 &
two=$!
# both in the background: bash runs a trap only between commands, and `wait` is one it breaks off (a foreground
# pytest would finish first). Ctrl-C or a kill stops both shards, shows how far shard 2 got and removes its log.
OMP_NUM_THREADS=1 "$py" -m pytest "$@" "${one[@]}" &
first=$!
trap 'kill "$first" "$two" 2>/dev/null; echo "=== shard 2, interrupted:"; cat "$log"; rm -f "$log"; exit 130' INT TERM
wait "$first"
rc1=$?
wait "$two"
rc2=$?
echo "=== shard 2: tests/ less ${one[*]}"
cat "$log"
rm -f "$log"
echo "=== shard 1 exit $rc1, shard 2 exit $rc2"
# pytest's 5 is "no tests collected": a -k or -m given here may select tests of one shard only
if [ "$rc1" = 5 ] && [ "$rc2" = 5 ]; then exit 5; fi
[ "$rc1" = 0 -o "$rc1" = 5 ] && [ "$rc2" = 0 -o "$rc2" = 5 ]
