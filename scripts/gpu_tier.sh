#!/usr/bin/env bash
# The whole GPU tier in one call, on a GPU machine, from the repository root:
#   bash scripts/gpu_tier.sh [tests] [check] [sanitize] [racecheck] [bench] [host] [graph] [notebook] [sweep]
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
    # TEST_SHARDS parallel pytest processes, each test function's parametrizations in one (their kernels are
    # compiled once); TEST_SHARDS=1 runs them in one process. tests.txt holds the summary and every failure's
    # line; the shards' own logs come as one archive, tests-logs.tar.gz (a device call returns few files).
    tests) logs=$(mktemp -d "${TMPDIR:-/tmp}/cunorm-tests-logs.XXXXXX")  # one folder a tier
           run tests python3 scripts/pytest_shards.py --shards "${TEST_SHARDS:-4}" --out "$logs"
           tar -czf "$OUT/tests-logs.tar.gz" -C "$logs" . || status=1 ;;
    check) run check python3 -m cunorm.cli check ;;
    sanitize) run sanitize compute-sanitizer --tool memcheck --error-exitcode 99 python3 scripts/sanitize_sample.py ;;
    racecheck) run racecheck compute-sanitizer --tool racecheck --error-exitcode 99 python3 scripts/sanitize_sample.py ;;
    bench) run bench python3 -m cunorm.bench --output "$OUT/bench.json" ;;
    host) run host python3 -m cunorm.bench --host --output "$OUT/host.json" ;;
    graph) run graph python3 -m cunorm.bench --graph --output "$OUT/graph.json" ;;
    # Executes examples/tour.ipynb in place (outputs kept; copied to $OUT). nbclient and ipykernel come from
    # the `notebook` (or `test`) extra, or from wheels unpacked from .whl/ on a machine without a package index.
    notebook) site=${TMPDIR:-/tmp}/cunorm-notebook-site
              python3 -c "import nbclient, ipykernel" 2>/dev/null || { [ -d .whl ] &&  # wheels are zips
                for w in .whl/*.whl; do python3 -m zipfile -e "$w" "$site"; done && export PYTHONPATH=$PYTHONPATH:$site; }
              run notebook python3 scripts/run_notebook.py examples/tour.ipynb; cp examples/tour.ipynb "$OUT/" ;;
    # Every kernel variant under each compute-sanitizer tool. The kernels are compiled once, unsanitized, into
    # CuPy's disk cache; then every (tool, shard) pair runs as a process of its own, all side by side (the
    # tools' cost is mostly on the CPU). SWEEP_TOOLS="TOOL:K ..." splits TOOL's cases into K shards (the
    # default weighs the tools by their cost per case); SWEEP_SHARDS="1/6 4/6" runs only those parts, for
    # every tool named, from their SWEEP_START-th case on (resumes parts a time limit cut short);
    # SWEEP_ONLY=REGEX keeps the cases whose label matches (e.g. '^layer_norm_backward').
    # Logs: sweep-TOOL-iofk.txt.
    sweep) only=(); [ -n "${SWEEP_ONLY:-}" ] && only=(--only "$SWEEP_ONLY")
           run sweep-compile python3 scripts/sanitize_sweep.py --compile-only ${only[@]+"${only[@]}"}
           pids=()
           for spec in ${SWEEP_TOOLS:-memcheck:6 racecheck:4 initcheck:4 synccheck:1}; do
             tool=${spec%%:*}; k=${spec#*:}; [ "$k" = "$spec" ] && k=1
             # synccheck's automatic count of a block's mbarriers overflowed on pushed-exchange kernels (and
             # the run crashed); ours hold at most 4 (two RowReducers)
             tool_args=(); [ "$tool" = synccheck ] && tool_args=(--num-cuda-barriers 16)
             for part in ${SWEEP_SHARDS:-$(seq -f "%g/$k" 0 $((k - 1)))}; do
               ( status=0
                 run "sweep-$tool-${part/\//of}" compute-sanitizer --tool "$tool" ${tool_args[@]+"${tool_args[@]}"} --error-exitcode 99 \
                   python3 scripts/sanitize_sweep.py --shard "$part" ${SWEEP_START:+--start "$SWEEP_START"} ${only[@]+"${only[@]}"} > /dev/null
                 exit $status ) &
               pids+=($!)
             done
           done
           for pid in "${pids[@]}"; do wait "$pid" || status=1; done ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
cat "$OUT/summary.txt"
exit $status
