#!/usr/bin/env bash
# The whole GPU tier in one call, on a GPU machine, from the repository root:
#   bash scripts/gpu_tier.sh [tests] [check] [sanitize] [racecheck] [bench] [host] [graph]
#   (default: tests check sanitize bench host)
# Results go under $OUT (default ./gpu-results). Exit status: non-zero if any step failed.
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-results}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUNORM_REQUIRE_GPU=1
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests check sanitize bench host)
status=0
run() {  # run NAME CMD...: log to $OUT/NAME.txt, remember failure
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.txt"; local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
}
python3 -m cunorm.cli info | tee "$OUT/info.txt"
for step in "${steps[@]}"; do
  case $step in
    tests) run tests python3 -m pytest -q -rs -m gpu tests -p no:cacheprovider ;;
    check) run check python3 -m cunorm.cli check ;;
    sanitize) run sanitize compute-sanitizer --tool memcheck --error-exitcode 99 python3 scripts/sanitize_sample.py ;;
    racecheck) run racecheck compute-sanitizer --tool racecheck --error-exitcode 99 python3 scripts/sanitize_sample.py ;;
    bench) run bench python3 -m cunorm.bench --output "$OUT/bench.json" ;;
    host) run host python3 -m cunorm.bench --host --output "$OUT/host.json" ;;
    graph) run graph python3 -m cunorm.bench --graph --output "$OUT/graph.json" ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
cat "$OUT/summary.txt"
exit $status
