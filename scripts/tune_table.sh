#!/usr/bin/env bash
# Tunes every size of the dispatch table on a GPU (bf16, which fp16 shares:
# the table is keyed by element size) and writes $OUT/tune.jsonl; paste the
# result into cunorm/dispatch.py's TUNED with scripts/tuned_literal.py.
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-results}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
sizes=$(python3 -c "from cunorm import dispatch; print(','.join(map(str, dispatch.TUNED_SIZES)))")
python3 -m cunorm.tune --sizes "${SIZES:-$sizes}" --dtype "${DTYPE:-bfloat16}" --top 1 --output "$OUT/tune.jsonl" \
  2>&1 | tee "$OUT/tune.txt" | grep TUNE
