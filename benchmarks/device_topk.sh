#!/usr/bin/env bash
# Issue 12, session 10 on the device machine: the replayed decode step's kernels with the Triton
# heavy top-k and with its twin (torch.topk, forced by MAX_COLUMNS = 0), then `hshare bench generate`
# at the Llama-2-7B shape (B16, P4k, 256 new).   bash benchmarks/device_topk.sh [profile] [llama2]
set -o pipefail
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
PROFILE=(--graphs --top 40 --layers 8 --batch 16 --prompt 4096 --paths hshare-1_2-1_2-1_2@512,ds@512)
for what in "$@"; do
  case $what in
    profile)
      timeout 200 python3 benchmarks/profile_decode.py "${PROFILE[@]}" > "$OUT/profile_topk_kernel.log" 2>&1
      timeout 200 python3 - "${PROFILE[@]}" > "$OUT/profile_topk_twin.log" 2>&1 <<'PY'
import runpy, sys
import hshare.kernels.heavy_topk_triton as topk
topk.MAX_COLUMNS = 0  # every selection takes the twin (torch.topk)
sys.argv = ["profile_decode.py"] + sys.argv[1:]
runpy.run_path("benchmarks/profile_decode.py", run_name="__main__")
PY
      for log in kernel twin; do
        echo "== top-k: $log"; grep -E "GPU work|_heavy_topk|mbtopk|_score_heads|masked_fill|_gather_attention" "$OUT/profile_topk_$log.log" | cut -c1-110
      done ;;
    llama2)
      timeout 330 hshare bench generate --out "$OUT" --shape llama2-7b --batch 16 --prompt 4096 --new-tokens 256 \
        --paths ${LLAMA2_PATHS:-static,dense,hshare-1_2-1_2-1_2@512,ds@512} 2>&1 | tee -a "$OUT/bench_generate.log" | grep -v Warning ;;
  esac
done
