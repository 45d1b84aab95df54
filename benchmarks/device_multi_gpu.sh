#!/usr/bin/env bash
# Issue 14, item 4: `hshare bench generate` on two GPUs (one host). Run from the repository root:
#   bash benchmarks/device_multi_gpu.sh [PART...]        (default: every PART below, in this order: ~30 min)
# Each PART ends inside 10 minutes (every bench run is stopped after $LIMIT s; its JSON is rewritten
# after every row, so a run cut short keeps the rows it measured) and leaves at most 8 files under
# $OUT: where device calls are limited to 10 minutes and 8 files back, run one PART a call, in the
# order below (the most wanted first), e.g. `OUT=$OUT bash benchmarks/device_multi_gpu.sh tp8b`.
#   tests      the 2-GPU tests: tensor parallelism against one process (NCCL), the TP bench, the bench smoke
#   tp8b       Llama-3-8B shape, tensor parallel over 2 GPUs (torchrun), B16, 8192-token prompts, 256 new:
#              unpatched, dense, ds@512, hshare-1_2-1_2-1_2@512, then transformers' compiled StaticCache
#   one8b      the same batch on one GPU (TP keeps the whole batch on every GPU: the same per-GPU batch),
#              for the speed-up of TP 2 over one GPU
#   tp70b      Llama-3-70B shape (80 layers, 8192 hidden, 64/8 heads; 141 GB of bf16 weights: 72 GB a GPU),
#              tensor parallel over 2 GPUs, B16, 8192-token prompts, 256 new (KV: 20.6 GiB a GPU), with
#              --dense-fallback-mib 0 (its per-layer KV, 264 MiB a rank, is under the default fallback: without
#              it the sparse presets would decode densely; `dense` and the unpatched paths do not read it)
#   devmap     Llama-3-8B shape split by accelerate's device_map over the 2 GPUs (layers 0-15 / 16-31):
#              unpatched, dense; the sparse presets' rows record hshare's refusal
#   fallback0  tp8b's and one8b's patched presets with --dense-fallback-mib 0: the per-layer KV at B16 P8192
#              (528 MiB on one GPU, 264 MiB a rank under TP 2) is below the 768 MiB default fallback, so the
#              default runs decode the sparse presets densely (their rows' decode_steps say so)
#   table      the short table of every result under $OUT (run by the parts above too)
# Results: $OUT/*.json (+ PNG), $OUT/fallback0/*.json, logs $OUT/<part>.log.
set -o pipefail
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
# NVLink multicast stays off on shared hosts (KINDS.md); the machine sets these, a fresh shell keeps them
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-540}   # seconds a bench run may take before it is stopped (its JSON keeps the rows done)
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
PRESETS=dense,ds@512,hshare-1_2-1_2-1_2@512
SHAPE8B=${SHAPE8B:-"--shape llama3-8b --batch 16 --prompt 8192 --new-tokens 256"}    # overridable for a dry run
SHAPE70B=${SHAPE70B:-"--shape llama3-70b --batch 16 --prompt 8192 --new-tokens 256"}

python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
if [ "$GPUS" -lt 2 ]; then echo "needs 2 GPUs, $GPUS visible"; exit 1; fi

tp2() {  # the bench under torchrun, one process a GPU
  timeout --signal=TERM "$LIMIT" python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    -m hshare.cli bench generate --tp 2 "$@"
}
one() {  # the bench on GPU 0 alone
  CUDA_VISIBLE_DEVICES=0 timeout --signal=TERM "$LIMIT" python3 -m hshare.cli bench generate "$@"
}

table() {
  python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

runs = {}
for path in sorted(Path(sys.argv[1]).rglob("bench_generate_*.json")):
    results = json.loads(path.read_text())
    rows = results["generate"]
    if not rows:
        continue
    first = rows[0]
    where = (results.get("placement") or {}).get("label") or "1 GPU"
    fallback = (results.get("overrides") or {}).get("dense_fallback_mib")
    key = (first["shape"], first["batch"], first["prompt"], first["new_tokens"], fallback)
    runs.setdefault(key, {})[where] = {r["path"]: r for r in rows}

for (shape, batch, prompt, new, fallback), placements in runs.items():
    print(f"\n{shape}, B{batch}, prompt {prompt}, {new} new"
          f"{f', dense_fallback_mib={fallback:g}' if fallback is not None else ''}")
    print(f"  {'placement':<18} {'path':<24} {'decode tok/s':>12} {'vs unpatched':>12} {'vs 1 GPU':>8} "
          f"{'prefill s':>9} {'peak GiB per GPU':>18} {'KV GiB':>7}  sparse steps / note")
    single = placements.get("1 GPU", {})
    for where, rows in placements.items():
        base = rows.get("unpatched")
        for path, r in rows.items():
            if r["error"]:
                print(f"  {where:<18} {path:<24} {r['error'][:150]}")
                continue
            vs = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base and not base["error"] else ""
            one = single.get(path)
            vs1 = f"{r['decode_tok_s'] / one['decode_tok_s']:.2f}x" \
                if where != "1 GPU" and one and not one["error"] and one["decode_tok_s"] else ""
            peaks = "/".join(f"{p:.1f}" for p in r.get("peak_gib_per_gpu") or [r["peak_gib"]])
            steps = r.get("decode_steps") or {}
            note = f"{steps['sparse']}/{steps['decode']}" if steps else ""
            if r.get("ranks_agree") is False:
                note += " RANKS DISAGREE"
            reason = (r.get("static_decode") or {}).get("reason")
            note += f" [{reason[:60]}]" if reason else ""
            print(f"  {where:<18} {path:<24} {r['decode_tok_s']:12.1f} {vs:>12} {vs1:>8} {r['prefill_s']:9.2f} "
                  f"{peaks:>18} {r['kv_gib']:7.2f}  {note}")
EOF
}

run_part() {
  case "$1" in
    tests)
      timeout --signal=TERM "$LIMIT" python3 -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py \
        tests/test_bench_multi_gpu.py tests/test_bench.py 2>&1 | tail -25 ;;
    tp8b) tp2 $SHAPE8B --paths unpatched,$PRESETS,static --out "$OUT" ;;
    one8b) one $SHAPE8B --paths unpatched,$PRESETS,static --out "$OUT" ;;
    tp70b) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True tp2 $SHAPE70B --paths unpatched,$PRESETS,static \
             --dense-fallback-mib 0 --out "$OUT" ;;
    devmap) CUDA_VISIBLE_DEVICES=0,1 timeout --signal=TERM "$LIMIT" python3 -m hshare.cli bench generate $SHAPE8B \
              --device-map split2 --paths unpatched,$PRESETS --out "$OUT" ;;
    fallback0)  # two runs of three paths, ~3 min each: LIMIT=270 keeps the part inside 10 minutes
      LIMIT=$(( LIMIT < 270 ? LIMIT : 270 ))
      tp2 $SHAPE8B --paths $PRESETS --dense-fallback-mib 0 --out "$OUT/fallback0"
      one $SHAPE8B --paths $PRESETS --dense-fallback-mib 0 --out "$OUT/fallback0" ;;
    table) table ;;
    *) echo "unknown part $1 (tests tp8b one8b tp70b devmap fallback0 table)"; return 2 ;;
  esac
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests tp8b one8b tp70b devmap fallback0)
for part in "${parts[@]}"; do
  echo "=== $part"
  run_part "$part" 2>&1 | tee "$OUT/$part.log"
done
[ "${parts[*]}" = table ] || table | tee "$OUT/table.txt"
