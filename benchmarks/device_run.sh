#!/usr/bin/env bash
# Everything measured on the device machine in one call (see benchmarks/RESULTS.md):
#   install the checkout, run the test suite natively on the GPU, the CUDA generate checks and
#   both benchmarks; logs and JSON land in $OUT.
set -o pipefail
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider -m "not slow" tests 2>&1 | tail -5 | tee "$OUT/pytest.log"
PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py 2>&1 | tee "$OUT/gpu_check.log"
PYTHONUNBUFFERED=1 hshare bench prefix --out "$OUT" 2>&1 | tee "$OUT/bench_prefix.log"
PYTHONUNBUFFERED=1 hshare bench attention --out "$OUT" 2>&1 | tee "$OUT/bench_attention.log"
