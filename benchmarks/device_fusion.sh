#!/usr/bin/env bash
# Issue 12 on the device machine (sessions 8-10): the GPU tests of static decode, then `hshare bench generate`
# at the Llama-2-7B shape with the layers' elementwise work fused (the default) and unfused
# (`compile_elementwise: false`, YAML copies of the presets), in one process.
#   bash benchmarks/device_fusion.sh [tests] [llama2] [llama3] [b8] [prefill] [profile] [gather]
# b8: the short-context row (B8, 1k prompts); prefill: where a sparse preset's prefill time goes
# (profile_decode.py --prefill); profile: the fused, replayed decode step's kernels; gather: the gather kernel's launch sweep, split counts included.
set -o pipefail
OUT=${OUT:-bench-results}
mkdir -p "$OUT" /tmp/unfused
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
for preset in dense hshare-1_2-1_2-1_2@512; do
  { cat configs/presets/$preset.yaml; echo "compile_elementwise: false"; } > /tmp/unfused/$preset.yaml
done
for what in "$@"; do
  case $what in
    tests)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_static_decode.py tests/test_prefill_metadata.py \
        tests/test_kernels_triton.py -k "static or labels or critical or prefill_metadata or heavy_topk or select_heavy" 2>&1 | tail -25 \
        | tee "$OUT/pytest_gpu_static.log" ;;
    llama2)
      timeout 300 hshare bench generate --out "$OUT" --shape llama2-7b --batch 16 --prompt 4096 --new-tokens 256 \
        --paths ${LLAMA2_PATHS:-static,dense,hshare-1_2-1_2-1_2@512,ds@512,/tmp/unfused/dense.yaml,/tmp/unfused/hshare-1_2-1_2-1_2@512.yaml} \
        2>&1 | tee -a "$OUT/bench_generate.log" ;;
    b8)
      timeout 200 hshare bench generate --out "$OUT" --shape llama2-7b --batch 8 --prompt 1024 --new-tokens 256 \
        --paths static,dense,ds@512,hshare-1_2-1_2-1_2@512 2>&1 | tee -a "$OUT/bench_generate.log" ;;
    prefill)
      timeout 200 python3 benchmarks/profile_decode.py --prefill --layers 8 --batch 16 --prompt 4096 \
        --paths unpatched,dense,ds@512,hshare-1_2-1_2-1_2@512 2>&1 | tee "$OUT/profile_prefill.log" ;;
    profile)
      timeout 200 python3 benchmarks/profile_decode.py --graphs --top 30 --layers 8 --batch 16 --prompt 4096 \
        --paths dense,hshare-1_2-1_2-1_2@512 2>&1 | tee "$OUT/profile_graphs.log" ;;
    gather)
      timeout 240 python3 benchmarks/tune_kernels.py gather 2>&1 | tee "$OUT/tune_gather.log" ;;
    llama3)
      timeout 200 hshare bench generate --out "$OUT" --shape llama3-8b --batch 16 --prompt 4096 --new-tokens 256 \
        --paths static,dense,hshare-1_2-1_2-1_2@512 2>&1 | tee -a "$OUT/bench_generate.log" ;;
  esac
done
