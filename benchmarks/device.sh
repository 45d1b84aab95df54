#!/usr/bin/env bash
# What is measured on the device machine (one GPU), in named parts run in the order given:
#   OUT=$OUT bash benchmarks/device.sh PART [PART ...]
# Every part installs nothing more than the checkout (done once here) and writes its log under $OUT.
#   suite      the whole fast test suite on the GPU, gpu_check.py, `hshare bench prefix` and `bench attention`
#   tests      the GPU tests of static decode, prefill metadata and the decode kernels
#   llama2     `hshare bench generate`, Llama-2-7B shape, B16, 4k prompts, 256 new (the paper's shape);
#              LLAMA2_PATHS overrides the paths, REPEATS the timed pairs per path (default 3)
#   unfused    the same shape, the presets with compile_elementwise: false beside the fused ones
#   llama3     Llama-3-8B shape, B16, 4k prompts
#   prefix     Llama-3-8B shape, 64 and 256 copies of one 4k prompt (the prefix held once), and StaticCache
#              at B32, the largest batch it fits (expandable segments)
#   b8         the short-context row: Llama-2-7B shape, B8, 1k prompts
#   prefill    where a sparse preset's prefill time goes (profile_decode.py --prefill, 8 layers)
#   profile    the replayed decode step's kernels (8 layers), and the same with the torch.topk twin
#   gather     the gather kernel's launch sweep (tune_kernels.py gather)
#   topk       the heavy top-k kernel alone, by warps (tune_kernels.py topk)
#   peak       what is allocated at the peak of a generate, by site: StaticCache against patched paths
#              (peak_memory.py; PEAK_ARGS overrides the shape, default B8 1k prompts)
#   long       long context, two runs of at most 270 s: Llama-3-8B shape B4 x 32k (one row in four padded,
#              as earlier 32k rows) and Llama-3.1-8B shape B1 x 128k, 128 new tokens, timed per step;
#              StaticCache in a process of its own, dense, the sparse presets at N_c 1024 / 2048 with the
#              dense fallback off, ds@1024 likewise, and 1/2-1/2-1/2@1024 as configured by default; each row
#              with its roofline (bytes a step must read, the floor at the bandwidth of a device copy
#              measured in the same run, the share reached) and peak memory (! where above StaticCache's).
#              LONG_PATHS overrides the paths
#   grid       the dense-fallback crossover, runs of at most 180 s and 300 s: rows {1, 4, 16, 64} x prompts
#              {1k, 4k, 16k, 32k, 128k}, MHA (Llama-2-7B shape) then GQA (Llama-3-8B shape), dense against
#              1/2-1/2-1/2@512 and @2048 with the fallback off, and what the default rule would run; 32 new
#              tokens timed per step after 7 warm steps, one generate per path and shape (a prefill each:
#              they dominate the time), no padding; shapes that cannot fit are skipped with what they
#              need. GRID_PATHS overrides the paths. Run it in a call of its own: with `long` it exceeds
#              a 10-minute command
# Several GPUs: benchmarks/device_multi_gpu.sh.
set -o pipefail
OUT=${OUT:-bench-results}
REPEATS=${REPEATS:-3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > "$OUT/gpu.txt"
LLAMA2=(--shape llama2-7b --batch 16 --prompt 4096 --new-tokens 256 --repeats "$REPEATS")
PROFILE=(--graphs --top 40 --layers 8 --batch 16 --prompt 4096 --paths dense,hshare-1_2-1_2-1_2@512,ds@512)

bench() {  # bench SECONDS ARGS...: `hshare bench generate ARGS` under a time limit, appended to one log
  timeout "$1" hshare bench generate --out "$OUT" "${@:2}" 2>&1 | grep -v Warning | tee -a "$OUT/bench_generate.log"
}
sweep() {  # sweep SECONDS ARGS...: `python3 -m hshare.bench.grid ARGS` under a time limit, appended to one log
  # (no path starts after SECONDS - 60: the last one finishes within the limit)
  timeout "$1" python3 -m hshare.bench.grid --out "$OUT" --time-limit "$(($1 - 60))" "${@:2}" 2>&1 \
    | grep -v Warning | tee -a "$OUT/bench_grid.log"
}
OFF=+dense_fallback_mib=0  # a path's override: sparse decode at every size
HS=hshare-1_2-1_2-1_2
LONG_PATHS=${LONG_PATHS:-static,dense,$HS@1024$OFF,$HS@2048$OFF,ds@1024$OFF,$HS@1024}
GRID_PATHS=${GRID_PATHS:-dense,$HS@512$OFF,$HS@2048$OFF}

for part in "$@"; do
  echo "== $part"
  case $part in
    suite)
      timeout 500 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests 2>&1 | tail -5 | tee "$OUT/pytest.log"
      python3 benchmarks/gpu_check.py 2>&1 | tee "$OUT/gpu_check.log"
      hshare bench prefix --out "$OUT" 2>&1 | tee "$OUT/bench_prefix.log"
      hshare bench attention --out "$OUT" 2>&1 | tee "$OUT/bench_attention.log" ;;
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_static_decode.py tests/test_prefill_metadata.py \
        tests/test_kernels_triton.py -k "static or labels or critical or prefill_metadata or heavy_topk or select_heavy" \
        2>&1 | tail -25 | tee "$OUT/pytest_gpu_static.log" ;;
    llama2)
      bench 500 "${LLAMA2[@]}" --paths "${LLAMA2_PATHS:-static,dense,hshare-1_2-1_2-1_2@512,ds@512}" ;;
    unfused)
      mkdir -p /tmp/unfused
      for preset in dense hshare-1_2-1_2-1_2@512; do  # the preset's fields with compile_elementwise off, as YAML
        python3 -c "import dataclasses, sys, yaml; from hshare.config import resolve_config
fields = dataclasses.asdict(resolve_config(sys.argv[1], compile_elementwise=False)); fields.pop('name')
print(yaml.safe_dump({k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}))" "$preset" \
          > "/tmp/unfused/$preset.yaml"
      done
      bench 500 "${LLAMA2[@]}" --paths \
        static,dense,hshare-1_2-1_2-1_2@512,/tmp/unfused/dense.yaml,/tmp/unfused/hshare-1_2-1_2-1_2@512.yaml ;;
    llama3)
      bench 400 --shape llama3-8b --batch 16 --prompt 4096 --new-tokens 256 --repeats "$REPEATS" \
        --paths static,dense,hshare-1_2-1_2-1_2@512 ;;
    prefix)
      bench 240 --shape llama3-8b --batch 64 --prompt 4096 --new-tokens 256 --shared --repeats "$REPEATS" \
        --paths dense,hshare-1_2-1_2-1_2@512
      bench 150 --shape llama3-8b --batch 256 --prompt 4096 --new-tokens 256 --shared --paths dense
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bench 240 --shape llama3-8b --batch 32 --prompt 4096 \
        --new-tokens 256 --shared --paths static ;;
    b8)
      bench 300 --shape llama2-7b --batch 8 --prompt 1024 --new-tokens 256 --repeats "$REPEATS" \
        --paths static,dense,ds@512,hshare-1_2-1_2-1_2@512 ;;
    prefill)
      timeout 200 python3 benchmarks/profile_decode.py --prefill --layers 8 --batch 16 --prompt 4096 \
        --paths unpatched,dense,ds@512,hshare-1_2-1_2-1_2@512 2>&1 | tee "$OUT/profile_prefill.log" ;;
    profile)
      timeout 200 python3 benchmarks/profile_decode.py "${PROFILE[@]}" > "$OUT/profile_graphs.log" 2>&1
      timeout 200 python3 - "${PROFILE[@]}" > "$OUT/profile_graphs_topk_twin.log" 2>&1 <<'PY'
import runpy, sys
import hshare.kernels.heavy_topk_triton as topk
topk.MAX_COLUMNS = 0  # every selection takes the twin (torch.topk)
sys.argv = ["profile_decode.py"] + sys.argv[1:]
runpy.run_path("benchmarks/profile_decode.py", run_name="__main__")
PY
      for log in profile_graphs profile_graphs_topk_twin; do
        echo "-- $log"; grep -E "GPU work|_heavy_topk|mbtopk|_score_heads|_gather_attention" "$OUT/$log.log" | cut -c1-110
      done ;;
    gather)
      timeout 240 python3 benchmarks/tune_kernels.py gather 2>&1 | tee "$OUT/tune_gather.log" ;;
    topk)
      timeout 240 python3 benchmarks/tune_kernels.py topk 2>&1 | tee "$OUT/tune_topk.log" ;;
    peak)
      timeout 300 python3 benchmarks/peak_memory.py ${PEAK_ARGS:---batch 8 --prompt 1024} \
        --paths static,dense,hshare-1_2-1_2-1_2@512 2>&1 | grep -v Warning | tee "$OUT/peak_memory.log" ;;
    long)
      sweep 270 --name long_llama3-8b_b4_p32k --shapes llama3-8b --rows 4 --prompts 32k --padded --new-tokens 128 \
        --paths "$LONG_PATHS"
      sweep 270 --name long_llama3.1-8b_b1_p128k --shapes llama3.1-8b --rows 1 --prompts 128k --new-tokens 128 \
        --paths "$LONG_PATHS" ;;
    grid)
      sweep 180 --name grid_mha_llama2-7b --shapes llama2-7b --rows 1,4,16,64 --prompts 1k,4k,16k,32k,128k \
        --new-tokens 32 --paths "$GRID_PATHS"
      sweep 300 --name grid_gqa_llama3-8b --shapes llama3-8b --rows 1,4,16,64 --prompts 1k,4k,16k,32k,128k \
        --new-tokens 32 --paths "$GRID_PATHS" ;;
    *)
      echo "unknown part '$part'; accepted: suite tests llama2 unfused llama3 prefix b8 prefill profile gather topk peak" \
        "long grid" >&2
      exit 2 ;;
  esac
done
