"""A/B of a tuned table against what dispatch runs without it (the sm_90
literal in tuned.py, else the heuristic; where that spills for the call, what
replaces it: `tune.what_runs`), key by key, on this GPU: each key's
two kernels timed in the same interleaved rounds (CUDA events around a queue
of launches, as `cunorm tune` times them), as fractions of one copy's
bandwidth. `--keep OUT` writes the table with only the entries whose median
beats the alternative's: a shipped table holds what was measured better.
`--merge-into SHIPPED` updates an existing table instead: each key measured
here takes its kept entry, or leaves SHIPPED where it was not kept; SHIPPED's
other entries stay.

    python scripts/table_ab.py gpu-results/table.json --keep cunorm/shipped_tables/tuned-<slug>.json
    python scripts/table_ab.py gpu-results/table.json --merge-into cunorm/shipped_tables/tuned-<slug>.json
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's cunorm, not an installed one

from cunorm import bench, dispatch, search_space, tables, tune  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("table", help="a table written by cunorm tune on this GPU model")
    p.add_argument("--rounds", type=int, default=tune.ROUNDS + 2)
    p.add_argument("--keep", help="write the entries that beat the alternative here")
    p.add_argument("--merge-into", help="update this table: measured keys take their kept entry or leave it")
    p.add_argument("--json", help="write every key's numbers here")
    a = p.parse_args(argv)
    device_id, arch, gpu = tune.current_gpu()
    table = tables.Table.from_json(Path(a.table).read_text(), "candidate table")
    if table.gpu != gpu:
        print(f"the table is for {table.gpu}, this GPU is {gpu}", file=sys.stderr)
        return 2
    copy = bench.copy_bandwidth()
    kept, rows = dict(table.entries), []
    for key, entry in sorted(table.entries.items(), key=lambda kv: (kv[0].backward, kv[0].rms, kv[0].n)):
        job = search_space.Job.of(entry.get("measured_n", key.n), entry["dtype"], key.backward, key.rms, key.residual)
        call = job.call_fields()
        mine = dispatch.from_knobs(entry["knobs"], **call)
        other, origin = tune.what_runs(call, arch, gpu=None, device_id=device_id)  # without this GPU's tables
        row = {"key": job.label(), "other": origin}
        if mine == other:
            row["verdict"] = "same knobs"
        else:
            case = job.workload()
            timed = dict((t, times) for times, t in tune.final_rounds([(0, mine), (0, other)], case, a.rounds,
                                                                      lambda _: None, finalists=2))
            for name, t in (("table", mine), (origin, other)):
                side = tune.reading(timed[t], case.nbytes, copy)  # the numbers a tune entry holds
                row[name] = [side["fraction_of_copy"], *side["spread"]]
            (mine_med, mine_lo, mine_hi), (other_med, other_lo, other_hi) = row["table"], row[origin]
            row["verdict"] = ("table faster" if mine_lo > other_hi else f"{origin} faster" if other_lo > mine_hi
                              else "within noise")
            if not mine_med > other_med:  # kept only where its median is better
                del kept[key]
        rows.append(row)
        nums = "".join(f"  {n} {row[n][0]:.3f} [{row[n][1]:.3f}, {row[n][2]:.3f}]" for n in ("table", origin)
                       if n in row)
        print(f"{row['key']:28s}{nums}  {row['verdict']}", flush=True)
    print(f"{len(kept)} of {len(table.entries)} entries kept (a better median than, or the same knobs as, "
          f"sm_{arch} dispatch without the table)")
    if a.merge_into:
        target = tables.Table.from_json(Path(a.merge_into).read_text(), "merged table")
        if target.gpu != gpu:
            print(f"{a.merge_into} is for {target.gpu}, this GPU is {gpu}", file=sys.stderr)
            return 2
        target.merge(table, kept)
        Path(a.merge_into).write_text(target.to_json())
    if a.keep:
        table.entries = kept
        Path(a.keep).write_text(table.to_json())
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
