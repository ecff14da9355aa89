#!/usr/bin/env bash
# Run GPU tests and benchmarks on a 2-GPU machine in two parallel lanes (one per GPU), then the
# two-GPU tests. Results land in $OUT (JSON per benchmark, one combined log).
# Usage: OUT=/tmp/out bash dev/bench/run_all_gpu.sh [memory] [chunking] [prefetch] [dual_sage_tests]
set -u
OUT=${OUT:-/tmp/h3_out}
mkdir -p "$OUT" /tmp/h3_logs
want() { [ $# -eq 0 ] && return 0; for w in "${SELECTED[@]}"; do [ "$w" = "$1" ] && return 0; done; return 1; }
SELECTED=("$@")
[ ${#SELECTED[@]} -eq 0 ] && SELECTED=(memory chunking prefetch dual_sage_tests)
PYTEST="python -m pytest -q -p no:cacheprovider -o addopts=--strict-markers"

lane0() {  # GPU0: chunking (per-process memory cap makes this a 32 GiB card)
  if want chunking; then
    CUDA_VISIBLE_DEVICES=0 timeout 150 $PYTEST -m gpu tests/test_chunking_gpu.py
    CUDA_VISIBLE_DEVICES=0 timeout 300 python dev/bench/bench_chunking.py --out "$OUT/chunking.json"
  fi
}
lane1() {  # GPU1: memory model check, then the prefetcher
  if want memory; then
    CUDA_VISIBLE_DEVICES=1 timeout 200 python dev/bench/bench_memory_model.py --out "$OUT/memory_model.json"
  fi
  if want prefetch; then
    CUDA_VISIBLE_DEVICES=1 timeout 150 $PYTEST -m "gpu or multi_gpu" tests/test_offload_gpu.py
    CUDA_VISIBLE_DEVICES=1 timeout 330 python dev/bench/bench_prefetch.py --out "$OUT"
  fi
}
lane0 > /tmp/h3_logs/lane0.log 2>&1 &
lane1 > /tmp/h3_logs/lane1.log 2>&1 &
wait
if want dual_sage_tests; then
  timeout 120 $PYTEST -m "gpu or multi_gpu" tests/test_dual_sage_gpu.py tests/test_offload_gpu.py \
    > /tmp/h3_logs/both.log 2>&1
fi
for f in /tmp/h3_logs/*.log; do echo "=== $f"; cat "$f"; done > "$OUT/all.log"
for f in /tmp/h3_logs/*.log; do echo "=== $f"; tail -n 25 "$f"; done
