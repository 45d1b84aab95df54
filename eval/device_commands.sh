#!/usr/bin/env bash
# The evaluation runs of eval/RESULTS.md, after `bash eval/device_eval.sh setup` on the device
# machine. Results go to /tmp/res (kept while the machine stays warm: sweeps resume there) and are
# packed into $OUT/res.tgz. Usage: bash eval/device_commands.sh fidelity|gsm8k|multi_news|ablation
set -o pipefail
RES=/tmp/res
# a fresh machine resumes from the results an earlier call brought back (carried as .gpures/res.tgz)
[ ! -d $RES ] && [ -f .gpures/res.tgz ] && tar xzf .gpures/res.tgz -C /tmp
mkdir -p $RES
D=$HSHARE_DATA_DIR
case "$1" in
  fidelity)  # two commands so that each length group is written as soon as it is done
    for lengths in 2k 1k,4k 8000; do
      timeout ${FID_TIMEOUT:-180} hshare fidelity --text $D/text/war_and_peace.txt --lengths $lengths \
        --configs sweep:paper,sweep:ablation --windows 4 --batch 4 --steps 64 --dtype float32 --device cuda \
        --out $RES/fidelity-$lengths 2>&1 | grep -v "it/s\|s/it" | tail -40
    done ;;
  gsm8k)
    hshare sweep --configs paper-128 --tasks gsm8k --limit ${LIMIT:-256} --batch-size 128 --dtype float32 \
      --device cuda --data-dir $D --out $RES/gsm8k 2>&1 | grep -v "it/s\|s/it" | tail -30 ;;
  multi_news)
    hshare sweep --configs paper --tasks longbench_multi_news --limit ${LIMIT:-64} --batch-size 64 \
      --dtype float32 --device cuda --data-dir $D --out $RES/multi_news 2>&1 | grep -v "it/s\|s/it" | tail -30 ;;
  ablation)
    hshare sweep --configs ablation --tasks longbench_multi_news --limit ${LIMIT:-64} --batch-size 64 \
      --dtype float32 --device cuda --data-dir $D --out $RES/ablation 2>&1 | grep -v "it/s\|s/it" | tail -30 ;;
esac
tar czf $OUT/res.tgz --exclude='*/tasks/*' -C /tmp res
