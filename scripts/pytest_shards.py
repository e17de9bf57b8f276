"""The GPU tier's tests as parallel pytest processes, so that the tier fits one device call.

    python3 scripts/pytest_shards.py --shards 4 --out gpu-results [-- extra pytest args]

Collects the tests once (`-m gpu` by default), cuts the list into contiguous runs of whole test
functions (the parametrizations of one function share most of their kernels: kept in one process, each
kernel is compiled once, not once a process), deals the runs to the shards largest first, and runs the
shards side by side, each logging to OUT/tests-shardI.txt. Tests marked `big_memory` (tens of GB of GPU
memory each) run after the shards, in one process of their own (OUT/tests-alone.txt): beside the shards'
memory pools they could run out of memory. Exit status: non-zero if any shard failed or if the shards ran
fewer tests than were collected (a shard that ran nothing is not a pass).
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


def collect(marker: str, paths: list[str], extra: list[str], allow_empty: bool = False) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", marker, *paths, *extra], capture_output=True, text=True)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line]
    if done.returncode not in (0, 5) or not (ids or allow_empty):
        sys.exit(f"pytest_shards: collection failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return ids


def pytest(ids: list[str], extra: list[str], log_path: Path) -> subprocess.Popen:
    """A pytest process running `ids`, logging to `log_path`."""
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *extra, *ids]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    log.close()  # the child holds its own copy
    return proc


def failures(log: str) -> list[str]:
    """The FAILED / ERROR lines of a pytest log's short summary (-rfE), so that the tier's own output names
    what failed: a device call may bring back only some of the shards' logs."""
    return [line for line in log.splitlines() if line.startswith(("FAILED ", "ERROR "))]


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
    ids = collect(f"({args.marker}) and not big_memory", args.paths, args.extra)
    alone = collect(f"({args.marker}) and big_memory", args.paths, args.extra, allow_empty=True)
    shards = deal(ids, args.shards)
    t0 = time.monotonic()
    runs = []  # (label, tests, log, process)
    for i, shard in enumerate(shards):
        (args.out / f"tests-shard{i}.ids").write_text("\n".join(shard) + "\n")
        log = args.out / f"tests-shard{i}.txt"
        runs.append((f"shard {i}", len(shard), log, pytest(shard, args.extra, log)))
    status, total = 0, 0

    def finish(label, count, log, proc):
        nonlocal status, total
        rc = proc.wait()
        text = log.read_text()
        total += ran(text)
        tail = next((line for line in reversed(text.splitlines()) if line.strip()), "")
        print(f"{label}: {count} tests, exit {rc} after {time.monotonic() - t0:.0f} s: {tail}", flush=True)
        for line in failures(text):
            print(f"  {line}", flush=True)
        status = status or rc

    for run in runs:
        finish(*run)
    if alone:  # after the shards, whose memory pools are gone
        log = args.out / "tests-alone.txt"
        finish("big_memory, alone", len(alone), log, pytest(alone, args.extra, log))
    print(f"{len(ids) + len(alone)} collected, {total} ran in {len(shards)} shards"
          + (f" and {len(alone)} alone" if alone else ""))
    if total < len(ids) + len(alone):
        print("pytest_shards: fewer tests ran than were collected")
        status = status or 1
    return status


if __name__ == "__main__":
    sys.exit(main())
