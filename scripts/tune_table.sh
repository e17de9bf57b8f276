#!/usr/bin/env bash
# Tunes every size of the dispatch table on this GPU, LayerNorm and RMSNorm, forward and backward, with and
# without a residual, 2- and 4-byte inputs, and writes the table to $OUT/table.json. To use it on this
# machine, copy it to the user table (`cunorm list` names it); to ship it for this GPU model, copy it to
# cunorm/shipped_tables/tuned-<GPU slug>.json (the name `cunorm list` shows in its first line), write it with
# `python scripts/table_ab.py $OUT/table.json --keep ...` (a new table) or `--merge-into ...` (an existing one),
# which keep only the entries measured faster than dispatch without them.
# Then the general rows (odd N, offset views) beside the sizes most used: each key N + 1 fills the general-rows
# entry of its aligned neighbour, which such rows take before any aligned entry (aligned entries often do not
# fit the general kernel: PERFORMANCE.md versions 44-45). GENERAL_SIZES='' skips them.
# Resumable: run it again after an interruption; BUDGET=SECONDS stops it cleanly (each pass gets it).
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-results}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
tune_pass() {  # tune_pass SIZES [BUDGET]: every op, both residual variants, 2- and 4-byte inputs
  python3 -m cunorm.tune --sizes "$1" --ops fwd,bwd,rms,rms-bwd --residual both --dtypes bf16,fp32 \
    ${2:+--budget "$2"} --output "$OUT/table.json" --json 2>> "$OUT/tune.txt" | tee -a "$OUT/tune.jsonl"
}
: > "$OUT/tune.txt"; : > "$OUT/tune.jsonl"
sizes=$(python3 -c "from cunorm import dispatch; print(','.join(map(str, dispatch.TUNED_SIZES)))")
tune_pass "${SIZES:-$sizes}" "${BUDGET:-}"
status=$?
general=${GENERAL_SIZES-1025,4097,8193,16385,32769,65537}
left=${BUDGET:+$((BUDGET - SECONDS))}  # the general pass gets what the aligned one left of BUDGET
if [ -n "$general" ] && [ "${left:-1}" -gt 0 ]; then
  tune_pass "$general" "$left"
  status=$((status | $?))
fi
exit $status
