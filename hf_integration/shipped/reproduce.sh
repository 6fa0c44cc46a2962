#!/usr/bin/env bash
# Reproduce the shipped model from scratch on this machine's Python standard library:
# a byte-level BPE tokenizer and an SDAR backbone (block 16), then a 3-layer MRP head on the frozen backbone
# (stage 1: K = 2 unroll; stages 2 and 3 continue the head with a K = 3 unroll, each with a new data order and
# a lower peak learning rate), then copy the export and the training logs into
# hf_integration/shipped/sdar-stdlib-mrp/.
#   bash hf_integration/shipped/reproduce.sh [WORK_DIR]      (CPU: about 3 hours on 2 cores)
# BACKBONE_STEPS, MRP_STEPS and MRP_STAGE_STEPS (stages 2 and 3) override the step counts (a GPU affords more).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
WORK="${1:-$ROOT/runs/stdlib}"
DEST="${DEST:-$ROOT/hf_integration/shipped/sdar-stdlib-mrp}"  # DEST=... writes elsewhere
cd "$ROOT"
python -m training.cli backbone --stdlib --out "$WORK/backbone" --vocab-size 2048 --block-size 16 \
  --hidden-size 128 --intermediate-size 384 --num-layers 4 --num-heads 4 --num-kv-heads 2 --head-dim 32 \
  --seq-len 256 --micro-batch-size 8 --max-steps "${BACKBONE_STEPS:-6000}" --lr 2e-3 --warmup-steps 100 --log-every 50 \
  --eval-every 300 --save-every 300 --no-progress --max-position-embeddings 2048 --tie-word-embeddings
python -m training.cli mrp --model "$WORK/backbone" --stdlib --out "$WORK/mrp" --mrp-layers 3 --unroll-k 2 \
  --seq-len 256 --micro-batch-size 8 --max-steps "${MRP_STEPS:-1000}" --lr 1e-3 --warmup-steps 40 --log-every 20 \
  --eval-every 100 --save-every 100 --no-progress
prev="$WORK/mrp"
for stage in "2 5e-4" "3 3e-4"; do  # stage, peak learning rate (the stage number seeds the data order)
  set -- $stage
  python -m training.cli mrp --model "$prev" --stdlib --out "$WORK/mrp$1" --unroll-k 3 \
    --seq-len 256 --micro-batch-size 8 --max-steps "${MRP_STAGE_STEPS:-1200}" --lr "$2" --warmup-steps 20 \
    --log-every 20 --eval-every 100 --save-every 100 --seed $(($1 - 1)) --no-progress
  prev="$WORK/mrp$1"
done
rm -rf "$DEST" && mkdir -p "$DEST"
cp "$WORK/mrp3"/*.json "$WORK/mrp3"/*.py "$WORK/mrp3/model.safetensors" "$DEST/"
cp "$WORK/backbone/metrics.jsonl" "$DEST/training_log_backbone.jsonl"
cp "$WORK/mrp/metrics.jsonl" "$DEST/training_log_mrp.jsonl"
cp "$WORK/mrp2/metrics.jsonl" "$DEST/training_log_mrp_stage2.jsonl"
cp "$WORK/mrp3/metrics.jsonl" "$DEST/training_log_mrp_stage3.jsonl"
echo "shipped model written to $DEST"
