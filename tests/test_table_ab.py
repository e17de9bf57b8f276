"""scripts/table_ab.py on the stand-in GPU (tune_stand_in): an A/B of a table's entries against dispatch's picks."""
import collections
import json

import pytest

from cunorm import dispatch, search_space
from tune_stand_in import COPY, NBYTES, fake_ms, frozen, gpu, run_tune  # noqa: F401 (gpu: the fixture)


def table_ab_script():
    """scripts/table_ab.py as a module."""
    from conftest import load_script

    return load_script("table_ab")


def test_table_ab_rows_are_the_median_and_spread_of_each_sides_rounds(gpu, tmp_path):
    """scripts/table_ab.py on the stand-in: each side's row is [median, min, max] of its rounds' fractions of
    copy (5 distinct rounds: neither a mean nor a swapped spread passes)."""
    table_ab = table_ab_script()
    table_path, rows_path = tmp_path / "table.json", tmp_path / "rows.json"
    assert run_tune("--sizes", "1024", "--ops", "fwd", "--output", str(table_path)).exit_code == 0
    [entry] = json.loads(table_path.read_text())["entries"]
    factors = iter([1.0, 1.3, 0.9, 1.1, 1.6, 1.2, 0.8, 1.05, 1.4, 1.25])  # the 10 timings' noise, interleaved
    times = collections.defaultdict(list)

    def noisy(knobs):
        times[frozen(knobs)].append(fake_ms(knobs) * next(factors))
        return times[frozen(knobs)][-1]

    gpu.ms = noisy
    assert table_ab.main([str(table_path), "--rounds", "5", "--json", str(rows_path)]) == 0
    [row] = json.loads(rows_path.read_text())
    assert row["verdict"] != "same knobs" and len(times) == 2
    table_times = times.pop(frozen(entry["knobs"]))
    [other_times] = times.values()
    for name, ms in (("table", table_times), (row["other"], other_times)):
        fractions = sorted(NBYTES / (m * 1e-3) / COPY for m in ms)
        assert row[name] == pytest.approx([fractions[2], fractions[0], fractions[4]]), name


def test_table_ab_times_what_replaces_a_pick_that_spills(gpu, tmp_path):
    """Where dispatch's pick without the table spills for the call, the table's entry is timed against what runs
    in its place (tune.what_runs), not against the spilling pick forced."""
    table_path, rows_path = tmp_path / "table.json", tmp_path / "rows.json"
    assert run_tune("--sizes", "1024", "--ops", "bwd", "--output", str(table_path)).exit_code == 0
    call = search_space.Job.of(1024, "bfloat16", True).call_fields()
    pick, origin = dispatch.choose(arch=90, gpu=None, **call)
    gpu.spills, gpu.timed = {frozen(pick.knobs())}, []
    assert table_ab_script().main([str(table_path), "--rounds", "3", "--json", str(rows_path)]) == 0
    [row] = json.loads(rows_path.read_text())
    # the literal's pick is persistent at one CTA an SM: its first replacement is its shape at half its loads
    runs_instead, why = dispatch.fallbacks(pick, origin, 90, **call)[0]
    assert runs_instead == pick.replace(bytes_per_ldg=pick.bytes_per_ldg // 2)
    assert row["other"] == why == f"{origin} {dispatch.HALF_LOADS}"
    timed = gpu.timed_knobs(search_space.Job.of(1024, "bfloat16", True).key, 1024, "bfloat16")
    assert frozen(runs_instead.knobs()) in timed and frozen(pick.knobs()) not in timed
