#!/usr/bin/env bash
# Issue 12 on the device machine: install, the GPU tests of static decode, then `hshare bench generate`.
#   bash benchmarks/device_static.sh [tests|bench|all] [bench args...]
set -o pipefail
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
what=${1:-all}; shift || true
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -p no:cacheprovider -x tests/test_gpu_static_decode.py 2>&1 | tail -25 | tee "$OUT/pytest_gpu_static.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  PYTHONUNBUFFERED=1 hshare bench generate --out "$OUT" "$@" 2>&1 | tee -a "$OUT/bench_generate.log"
fi
