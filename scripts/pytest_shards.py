"""The GPU tier's tests as parallel pytest processes, so that the tier fits one device call.

    python3 scripts/pytest_shards.py --shards 4 --out gpu-results [-- extra pytest args]

Collects the tests once (`-m gpu` by default), cuts the list into contiguous runs of whole test
functions (the parametrizations of one function share most of their kernels: kept in one process, each
kernel is compiled once, not once a process), deals the runs to the shards largest first, and runs the
shards side by side, each logging to OUT/tests-shardI.txt. Exit status: non-zero if any shard failed or
if the shards ran fewer tests than were collected (a shard that ran nothing is not a pass).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path


def function_of(node_id: str) -> str:
    """A test's function: its node id without the parametrization."""
    return node_id.split("[", 1)[0]


def deal(node_ids: list[str], shards: int) -> list[list[str]]:
    """The node ids in `shards` lists: each function's tests together (in collection order), functions
    dealt largest first to the shard with the fewest tests so far."""
    groups: dict[str, list[str]] = {}
    for node in node_ids:
        groups.setdefault(function_of(node), []).append(node)
    out: list[list[str]] = [[] for _ in range(shards)]
    for group in sorted(groups.values(), key=len, reverse=True):
        min(out, key=len).extend(group)
    return [shard for shard in out if shard]


def collect(marker: str, paths: list[str], extra: list[str]) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", marker, *paths, *extra], capture_output=True, text=True)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line]
    if done.returncode not in (0, 5) or not ids:
        sys.exit(f"pytest_shards: collection failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return ids


_COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")


def ran(log: str) -> int:
    """How many tests a pytest log's summary line says ran (passed, failed, errors, skipped, xfail)."""
    lines = [line for line in log.splitlines() if " in " in line and _COUNTS.search(line)]
    return sum(int(n) for n, _ in _COUNTS.findall(lines[-1])) if lines else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("gpu-results"))
    parser.add_argument("--marker", default="gpu")
    parser.add_argument("--paths", nargs="*", default=["tests"])
    parser.add_argument("extra", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error("--shards: expected 1 or more")
    args.out.mkdir(parents=True, exist_ok=True)
    ids = collect(args.marker, args.paths, args.extra)
    shards = deal(ids, args.shards)
    t0 = time.monotonic()
    procs = []
    for i, shard in enumerate(shards):
        (args.out / f"tests-shard{i}.ids").write_text("\n".join(shard) + "\n")
        log = open(args.out / f"tests-shard{i}.txt", "w")
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args.extra, *shard]
        procs.append((i, len(shard), log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
    status, total = 0, 0
    for i, count, log, proc in procs:
        rc = proc.wait()
        log.close()
        text = (args.out / f"tests-shard{i}.txt").read_text()
        n = ran(text)
        total += n
        tail = next((line for line in reversed(text.splitlines()) if line.strip()), "")
        print(f"shard {i}: {count} tests, exit {rc} after {time.monotonic() - t0:.0f} s: {tail}", flush=True)
        status = status or rc
    print(f"{len(ids)} collected, {total} ran in {len(shards)} shards")
    if total < len(ids):
        print("pytest_shards: fewer tests ran than were collected")
        status = status or 1
    return status


if __name__ == "__main__":
    sys.exit(main())
