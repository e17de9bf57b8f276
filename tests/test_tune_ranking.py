"""cunorm.tune's ranking on the stand-in GPU (tune_stand_in): the screening passes, the extras, cluster
rows' exchanges, sums in registers and unchecked whole steps, the second look, and which candidates reach
the final rounds and how they are read."""
import collections
import json
from types import SimpleNamespace

import pytest

from cunorm import bench, compiler, dispatch, search_space, tables, tune
from cunorm.compiler import CompileError
from tune_stand_in import (COPY, GPU, NBYTES, fake_ms, frozen, gpu, incumbent, measured_with,  # noqa: F401 (gpu)
                           op_of, run_tune, saved, screenings, seeds)

# The knobs a table entry's shape and extras leave out, at their defaults (as the tuner times such an entry).
_LATER_DEFAULTS = {"lanes_per_row": 32, "persistent": True, "merged_moments": False, "pushed_exchange": False,
                   "register_sum_steps": 0, "unchecked_whole_steps": False, "sum_chains": 1, "register_ahead": False,
                   "stats_ahead": False}


# -- cluster rows' exchanges --------------------------------------------------------------------------------

class _Pushed:
    """Stands for every knob set with pushed_exchange on (as StandIn.spills: they spill)."""

    def __contains__(self, knobs):
        return dict(knobs)["pushed_exchange"]


def test_a_pushed_shape_that_spills_is_timed_with_the_barrier_exchange(gpu):
    """Where pushed exchanges spill, a cluster row's shape is screened (and refined) with the barrier exchange
    instead of being dropped; and what spills is never timed."""
    gpu.spills = _Pushed()
    assert run_tune("--sizes", "65536", "--ops", "fwd,rms-bwd").exit_code == 0
    for key in saved().entries:
        timed = gpu.timed_knobs(key, 65536, "bfloat16")
        assert not any(dict(k)["pushed_exchange"] for k in timed), key
        screened = search_space.candidates(65536, "bfloat16", key.backward, rms=key.rms)
        assert sum(t.uses_cluster for t in screened) > 1
        assert {frozen(t.replace(pushed_exchange=False).knobs()) for t in screened} <= set(timed), key


def test_each_candidate_is_screened_once_or_twice_before_the_final_rounds(gpu):
    """A barrier shape standing in for a spilling pushed one, already there itself (dispatch's pick, a
    refinement's twin), is not screened again (but for the second look near the fastest): so FINALISTS
    distinct shapes reach the final rounds, and dispatch's pick beside them where it screened lower."""
    gpu.spills = _Pushed()
    rounds = 2
    picks = {op: incumbent(65536, op) for op in ("fwd", "rms-bwd")}  # before the run writes the user table
    seeded = {op: seeds(65536, op) for op in picks}
    assert run_tune("--sizes", "65536", "--ops", "fwd,rms-bwd", "--rounds", str(rounds)).exit_code == 0
    for key in saved().entries:
        op = op_of(key)
        counts = collections.Counter(k for o, n, d, k in gpu.timed if o == op)
        first_pass = {frozen(t.replace(pushed_exchange=False).knobs())  # pushed ones spill: their barrier twins
                      for t in [*search_space.candidates(65536, "bfloat16", key.backward, 90, key.rms),
                                *seeded["rms-bwd" if key.backward else "fwd"]]}
        expected = screenings(set(counts), first_pass)
        finals = {k for k, c in counts.items() if c > 2}
        for k, c in counts.items():  # screened once (twice near the fastest); a finalist, once a round too
            assert c == expected[k] + rounds * (k in finals), (key, k)
        pick = frozen(picks["rms-bwd" if key.backward else "fwd"].knobs())
        assert pick in finals, key  # dispatch's pick reached the final rounds
        assert len(finals - {pick}) in (tune.FINALISTS - 1, tune.FINALISTS), key


def test_a_pushed_pick_that_spilled_reaches_the_final_rounds_as_its_barrier_twin(gpu):
    """Where dispatch's pick is a pushed exchange that spilled, the barrier twin timed in its place
    (`_compiled`) is re-timed in the final rounds however it ranked; an incumbent never timed is not."""
    job = search_space.Job.of(65536, "bfloat16", True, True)
    pushed = search_space.with_pushed_exchange(incumbent(65536, "rms-bwd"))
    assert pushed.pushed_exchange
    twin, others = pushed.replace(pushed_exchange=False), search_space.candidates(65536, "bfloat16", True, rms=True)[:5]
    ranked = [(1.0, t) for t in others if t != twin] + [(9.0, twin)]
    timed = [t for _, t in tune.final_rounds(ranked, job.workload(), 2, lambda _: None, incumbent=pushed)]
    assert twin in timed and len(timed) == tune.FINALISTS + 1
    alone = [t for _, t in tune.final_rounds(ranked[:-1], job.workload(), 2, lambda _: None, incumbent=pushed)]
    assert len(alone) == tune.FINALISTS and twin not in alone


# -- the pieces --------------------------------------------------------------------------------------------------

def test_tune_ranks_every_shape_then_the_extras_of_the_fastest(gpu, capsys):
    ranked = tune.tune(1024, "bfloat16", backward=True)  # what examples/tour.ipynb calls
    assert [ms for ms, _ in ranked] == sorted(ms for ms, _ in ranked) and len(ranked) == len(set(gpu.timed))
    assert all(ms == fake_ms(t.knobs()) for ms, t in ranked)
    shapes = search_space.candidates(1024, "bfloat16", True)
    assert set(shapes) < {t for _, t in ranked} and any(t.stages != 2 for _, t in ranked)
    assert len({t for _, t in ranked}) == len(ranked)  # each ranked once
    counts = collections.Counter(k for *_, k in gpu.timed)
    assert counts == screenings(set(counts), {frozen(t.knobs()) for t in shapes})  # twice near the fastest only
    assert 1 < sum(c == 2 for c in counts.values()) < len(counts)
    out, err = capsys.readouterr()
    assert out == "" and "tuning bwd N=1024 bfloat16" in err


def test_extras_slower_than_every_shape_are_looked_at_again_against_the_shapes_fastest(gpu):
    """Where every extra is slower than the fastest shape, the extras' second look keeps the shapes' bar (not
    one of its own, which would time more of them twice)."""
    shapes = search_space.candidates(1024, "bfloat16", True)
    first_pass = {frozen(t.knobs()) for t in shapes}
    gpu.ms = lambda knobs: fake_ms(knobs) + (0.0 if frozen(knobs) in first_pass else 0.2)
    tune.tune(1024, "bfloat16", backward=True)
    counts = collections.Counter(k for *_, k in gpu.timed)
    assert counts == screenings(set(counts), first_pass, gpu.ms)
    extras = [k for k in counts if k not in first_pass]
    assert any(c == 1 for k, c in counts.items() if k in extras)  # an extra the shapes' bar leaves at one
    assert any(gpu.ms(dict(k)) <= min(gpu.ms(dict(e)) for e in extras) * (1 + tune.SECOND_LOOK) and counts[k] == 1
               for k in extras)  # ... that its own pass's bar would have timed twice


def test_candidates_that_fail_to_compile_or_launch_are_reported_not_timed(gpu, monkeypatch):
    def kernels_for(traits, device_id, source=None):
        if traits.warps_n == 2:
            raise CompileError("planted")
        return gpu.kernels_for(traits, device_id)

    def call(traits=None):
        if traits["warps_n"] == 16:
            raise RuntimeError("too many resources requested for launch")
        return 1.0 / traits["warps_n"]

    monkeypatch.setattr(compiler, "kernels_for", kernels_for)
    candidates, echoed, ticks = search_space.candidates(4096, "bfloat16", False), [], []
    timed = tune._time_all(candidates, SimpleNamespace(call=call), 0, ticks.append, echoed.append)
    assert {t.warps_n for _, t in timed} == {t.warps_n for t in candidates} - {2, 16}
    assert [ms for ms, _ in timed] == sorted(ms for ms, _ in timed) and sum(ticks) == len(candidates)
    assert echoed and all("RuntimeError: too many resources requested for launch" in line for line in echoed)


def test_backwards_with_shared_memory_sums_try_some_in_registers(gpu):
    """After the extras, the KEEP fastest backwards with shared-memory column sums are timed again with a
    quarter, half and three quarters of their load steps' sums in registers, and one of those can win."""
    def ms(knobs):
        return fake_ms(knobs) - 0.001 * knobs["smem_accumulators"] - 0.0002 * knobs["register_sum_steps"]

    gpu.ms = ms
    assert run_tune("--sizes", "4096", "--ops", "bwd", "--fresh").exit_code == 0
    key = search_space.Job.of(4096, "bfloat16", backward=True).key
    timed = [dict(k) for k in gpu.timed_knobs(key, 4096, "bfloat16")]
    with_steps = [k for k in timed if k["register_sum_steps"]]
    parents = {frozen({**k, "register_sum_steps": 0}) for k in with_steps}
    in_smem = sorted((k for k in timed if k["smem_accumulators"] and not k["register_sum_steps"]), key=ms)
    assert parents == {frozen(k) for k in in_smem[:tune.KEEP]}
    assert sorted(k["register_sum_steps"] for k in with_steps) == sorted(
        v.register_sum_steps for p in parents
        for v in search_space.register_sum_variants(dispatch.from_knobs(dict(p), **search_space.Job.of(
            4096, "bfloat16", backward=True).call_fields())))
    entry = saved().knobs(key)
    assert entry["smem_accumulators"] and entry["register_sum_steps"] == max(k["register_sum_steps"] for k in with_steps)


def test_general_rows_try_their_whole_steps_unchecked(gpu):
    """After the register-sums pass, the KEEP fastest of a general-rows key are timed again with their whole
    load steps unchecked, and one of those can win (the entry then holds the knob)."""
    gpu.ms = lambda knobs: fake_ms(knobs) - 0.0002 * knobs["unchecked_whole_steps"]
    assert run_tune("--sizes", "4097", "--ops", "fwd", "--fresh").exit_code == 0
    job = search_space.Job.of(4097, "bfloat16")
    timed = [dict(k) for k in gpu.timed_knobs(job.key, 4097, "bfloat16")]
    timed = [k for k in timed if k["sum_chains"] == 1]  # (the sum-chains pass comes after this one)
    unchecked = [k for k in timed if k["unchecked_whole_steps"]]
    parents = {frozen({**k, "unchecked_whole_steps": False}) for k in unchecked}
    checked = sorted((k for k in timed if not k["unchecked_whole_steps"]), key=fake_ms)
    assert parents == {frozen(k) for k in checked[:tune.KEEP]}
    assert saved().knobs(job.key) == {**checked[0], "unchecked_whole_steps": True}


def test_full_tiles_never_try_their_whole_steps_unchecked(gpu):
    """An aligned key whose candidates have full tiles (or no whole step) times no unchecked variant: the knob
    would compile the same code again."""
    gpu.ms = lambda knobs: fake_ms(knobs) - 0.0002 * knobs["unchecked_whole_steps"]
    assert run_tune("--sizes", "4096", "--ops", "fwd", "--fresh").exit_code == 0
    timed = gpu.timed_knobs(search_space.Job.of(4096, "bfloat16").key, 4096, "bfloat16")
    assert timed and not any(dict(k)["unchecked_whole_steps"] for k in timed)


def test_forwards_try_their_row_sums_in_more_chains(gpu):
    """Last, the KEEP fastest of a forward key are timed again with their row sums in 2 and 4 chains, and one
    of those can win (the entry then holds the knob); a backward key times none."""
    def ms(knobs):
        return fake_ms(knobs) - 0.0001 * knobs["unchecked_whole_steps"] - 0.0002 * (knobs["sum_chains"] == 2)

    gpu.ms = ms
    assert run_tune("--sizes", "4097", "--ops", "fwd,bwd", "--fresh").exit_code == 0
    job = search_space.Job.of(4097, "bfloat16")
    timed = [dict(k) for k in gpu.timed_knobs(job.key, 4097, "bfloat16")]
    chained = [k for k in timed if k["sum_chains"] != 1]
    one_chain = sorted((k for k in timed if k["sum_chains"] == 1), key=ms)
    parents = {frozen({**k, "sum_chains": 1}) for k in chained}
    assert parents == {frozen(k) for k in one_chain[:tune.KEEP]}
    assert {k["sum_chains"] for k in chained} == {2, 4}  # 8-byte bf16 loads: 4 elements, both counts
    assert saved().knobs(job.key) == {**one_chain[0], "sum_chains": 2}
    backward = search_space.Job.of(4097, "bfloat16", True)
    assert not any(dict(k)["sum_chains"] != 1 for k in gpu.timed_knobs(backward.key, 4097, "bfloat16"))


def test_backwards_try_their_unstaged_shapes_with_the_next_row_ahead(gpu):
    """Last, the AHEAD_KEEP fastest unstaged shapes of a backward key, and the AHEAD_SHAPES fastest shapes of
    the first round past the KEEP refined ones (unstaged: their extras are never tried), are timed again with
    their next row loaded ahead into registers, and one of those can win (the entry then holds the knob); a
    forward key times none."""
    def ms(knobs):
        return fake_ms(knobs) - 0.001 * knobs["register_ahead"]

    gpu.ms = ms
    seeded = seeds(4096, "bwd")  # before the run writes the user table
    assert run_tune("--sizes", "4096", "--ops", "fwd,bwd", "--fresh").exit_code == 0
    job = search_space.Job.of(4096, "bfloat16", True)
    timed = [dict(k) for k in gpu.timed_knobs(job.key, 4096, "bfloat16")]
    ahead = {frozen(k) for k in timed if k["register_ahead"] and not k["stats_ahead"]}
    unstaged = sorted((k for k in timed if not k["register_ahead"] and k["stages"] == 1),
                      key=ms)
    first_round = list(dict.fromkeys([*search_space.candidates(4096, "bfloat16", True, 90), *seeded]))
    first_round.sort(key=lambda t: ms(t.knobs()))
    screened = first_round[tune.KEEP:tune.KEEP + tune.AHEAD_SHAPES]
    assert any(t.stages > 1 for t in screened)  # shapes whose unstaged selves were never timed
    assert ahead == {frozen({**k, "register_ahead": True}) for k in unstaged[:tune.AHEAD_KEEP]} | {
        frozen(t.replace(stages=1, register_ahead=True).knobs()) for t in screened}
    best_plain = min((k for k in timed if not k["register_ahead"]), key=ms)
    best_ahead = min((k for k in timed if k["register_ahead"]), key=ms)
    assert saved().knobs(job.key) == min((best_plain, best_ahead), key=ms)
    forward = search_space.Job.of(4096, "bfloat16")
    assert not any(dict(k)["register_ahead"] for k in gpu.timed_knobs(forward.key, 4096, "bfloat16"))


def test_the_fastest_with_rows_ahead_try_their_statistics_ahead(gpu):
    """After the rows-ahead pass, the KEEP fastest traits with rows ahead are timed again with the rows'
    statistics ahead too (`stats_ahead`), and one of those can win; nothing else is timed with it."""
    def ms(knobs):
        return fake_ms(knobs) - 0.001 * knobs["register_ahead"] - 0.01 * knobs["stats_ahead"]

    gpu.ms = ms
    assert run_tune("--sizes", "4096", "--ops", "bwd", "--fresh").exit_code == 0
    job = search_space.Job.of(4096, "bfloat16", True)
    timed = [dict(k) for k in gpu.timed_knobs(job.key, 4096, "bfloat16")]
    held = {frozen(k) for k in timed if k["stats_ahead"]}
    ahead = sorted((k for k in timed if k["register_ahead"] and not k["stats_ahead"]), key=ms)
    assert held == {frozen({**k, "stats_ahead": True}) for k in ahead[:tune.KEEP]}
    assert saved().knobs(job.key) == min(timed, key=ms)
    assert saved().knobs(job.key)["stats_ahead"]


def _found_by(*args) -> list:
    """The "found_by" of each key a run with `args` records (--json), each also in the key's TUNE line."""
    res = run_tune(*args, "--fresh", "--json")
    assert res.exit_code == 0, res.output
    found = [json.loads(line)["found_by"] for line in res.stdout.splitlines()]
    assert [f"(found by: {f})" in line for f, line in zip(found, res.stderr.split("TUNE ")[1:])] == [True] * len(found)
    return found


def test_a_winner_names_the_pass_that_found_it(gpu):
    """The record and the TUNE line name the pass of the ranking that first timed the winner: the first round
    where a launch shape wins unchanged, its extras where one of those wins (the stand-in's fastest), the
    statistics-ahead pass where a knob only that pass turns on wins."""
    key = search_space.Job.of(1024, "bfloat16").key
    shapes = {frozen(t.knobs()) for t in search_space.candidates(1024, "bfloat16", False, 90)}
    assert _found_by("--sizes", "1024", "--ops", "fwd") == [tune.EXTRAS]
    assert frozen(saved().knobs(key)) not in shapes
    slowest = max(shapes, key=lambda k: fake_ms(dict(k)))
    gpu.ms = lambda knobs: fake_ms(knobs) - 0.5 * (frozen(knobs) == slowest)
    assert _found_by("--sizes", "1024", "--ops", "fwd") == [tune.FIRST_ROUND]
    assert frozen(saved().knobs(key)) == slowest
    gpu.ms = lambda knobs: fake_ms(knobs) - 0.01 * knobs["stats_ahead"]
    assert _found_by("--sizes", "4096", "--ops", "bwd") == [tune.STATS_AHEAD]
    assert _found_by("--sizes", "4096", "--ops", "bwd") == [tune.DISPATCH_SEED]  # what it saved runs it now


_SLOW_SHAPE = dict(warps_m=4, warps_n=1, ctas_per_row=1, bytes_per_ldg=8, stages=4, cache_weights=False,
                   min_ctas_per_sm=1, smem_accumulators=False, recompute=True)  # a forward no pass tries


@pytest.mark.parametrize("seed", ["dispatch", "sibling"])
def test_a_seed_that_wins_is_named_as_the_seed(gpu, seed):
    """A winner among the first round's seeds (not one of its launch shapes) is named as dispatch's pick or the
    other norm's."""
    knobs = _SLOW_SHAPE
    table = tables.new_table(GPU)
    key = search_space.Job.of(1024, "bfloat16", rms=seed == "sibling").key  # LayerNorm's, or RMSNorm's forward
    table.put(key, knobs, ms=1.0, fraction_of_copy=0.5, spread=[0.5, 0.5], dtype="bfloat16", measured_n=1024)
    tables.save(table)
    gpu.ms = lambda k: 0.5 if frozen({**knobs, **_LATER_DEFAULTS}) == frozen(k) else fake_ms(k)
    assert _found_by("--sizes", "1024", "--ops", "fwd") == [
        tune.DISPATCH_SEED if seed == "dispatch" else tune.SIBLING_SEED]


@pytest.mark.parametrize("ops", ["rms,fwd,bwd", "fwd,rms,bwd"])
def test_the_second_norm_of_a_run_meets_the_firsts_new_pick(gpu, monkeypatch, ops):
    """A run tuning both norms of a key seeds the second one's first round with the first one's pick of this
    run, named with the pass that found it, and seeds no other key (here RMSNorm's forward takes its table entry,
    fastest on the stand-in, which LayerNorm's forward never borrows; no pick before the run seeds it): at two
    sizes, LayerNorm's forward takes it where RMSNorm was tuned first, and only there."""
    table = tables.new_table(GPU)
    for n in (1024, 2048):
        table.put(search_space.Job.of(n, "bfloat16", rms=True).key, _SLOW_SHAPE, ms=1.0, fraction_of_copy=0.5,
                  spread=[0.5, 0.5], dtype="bfloat16", measured_n=n)
    tables.save(table)
    monkeypatch.setattr(tune, "sibling_pick", lambda *args: None)
    seeded, measure = {}, tune.measure
    monkeypatch.setattr(tune, "measure", lambda job, *args, seeds=None, **kwargs: (
        seeded.setdefault(job, dict(seeds)), measure(job, *args, seeds=seeds, **kwargs))[1])
    fast = frozen({**_SLOW_SHAPE, **_LATER_DEFAULTS})
    gpu.ms = lambda k: 0.5 if frozen(k) == fast else fake_ms(k)
    res = run_tune("--sizes", "1024,2048", "--ops", ops, "--fresh", "--json")
    assert res.exit_code == 0, res.output
    found = {(r["n"], r["rms"], r["backward"]): r["found_by"] for r in map(json.loads, res.stdout.splitlines())}
    new = f"{tune.NEW_SIBLING_SEED} ({tune.DISPATCH_SEED})"
    rms_first = ops.startswith("rms")
    for n in (1024, 2048):
        assert found[n, True, False] == tune.DISPATCH_SEED
        assert (found[n, False, False] == new) == rms_first
        assert (saved().knobs(search_space.Job.of(n, "bfloat16").key) == dict(fast)) == rms_first
    assert {(j.n, j.key.rms, j.key.backward) for j, s in seeded.items() if new in s.values()} == (
        {(1024, False, False), (2048, False, False)} if rms_first else set())


def test_the_other_norms_pick_of_this_run_keeps_the_name_of_the_same_pick_before_it(gpu):
    """Where the other norm's new pick is its pick before the run, LayerNorm's seed keeps that seed's name."""
    table = tables.new_table(GPU)
    table.put(search_space.Job.of(1024, "bfloat16", rms=True).key, _SLOW_SHAPE, ms=1.0, fraction_of_copy=0.5,
              spread=[0.5, 0.5], dtype="bfloat16", measured_n=1024)
    tables.save(table)
    gpu.ms = lambda k: 0.5 if frozen(k) == frozen({**_SLOW_SHAPE, **_LATER_DEFAULTS}) else fake_ms(k)
    assert _found_by("--sizes", "1024", "--ops", "rms,fwd") == [tune.DISPATCH_SEED, tune.SIBLING_SEED]


def test_a_barrier_twin_timed_for_a_pushed_candidate_is_named_as_that_candidate(gpu):
    """Where a seed's pushed exchange spills, its barrier twin is timed in its place, under the seed's name."""
    gpu.spills = _Pushed()
    job = search_space.Job.of(65536, "bfloat16", True)
    shapes = search_space.candidates(65536, "bfloat16", True, 90)
    pushed = next(t for t in shapes if t.pushed_exchange).replace(min_ctas_per_sm=3)
    seed = pushed.replace(pushed_exchange=False)
    assert pushed.pushed_exchange and seed not in shapes and pushed not in shapes
    found = {pushed: tune.SIBLING_SEED}
    tune.rank([*shapes, pushed], job.workload(), 0, 90, lambda _: None, print, found=found)
    assert found[seed] == tune.SIBLING_SEED  # not the first round's name, which every other shape's twin has
    assert set(found.values()) <= set(tune.PASSES) and not any(t.pushed_exchange for t in found if t != pushed)


def test_what_dispatch_runs_today_competes(gpu):
    """The incumbent (here a user-table entry: a slow launch shape with extras only the fastest shapes try)
    is timed beside the candidates, so a new entry is never one that loses to what it replaces."""
    key = search_space.Job.of(1024, "bfloat16").key
    incumbent = dict(warps_m=4, warps_n=1, ctas_per_row=1, bytes_per_ldg=8, stages=4, cache_weights=False,
                     min_ctas_per_sm=1, smem_accumulators=False, recompute=True)
    table = tables.new_table(GPU)
    table.put(key, incumbent, ms=1.0, fraction_of_copy=0.5, spread=[0.5, 0.5], dtype="bfloat16", measured_n=1024)
    tables.save(table)
    assert run_tune("--sizes", "1024", "--ops", "fwd", "--fresh").exit_code == 0
    # A table entry written before a knob existed (lanes_per_row, persistent, merged_moments, pushed_exchange,
    # register_sum_steps, unchecked_whole_steps, sum_chains, register_ahead here) is timed with that knob's default.
    assert frozen({**incumbent, **_LATER_DEFAULTS}) in gpu.timed_knobs(key, 1024, "bfloat16")


@pytest.mark.parametrize("op, sibling_op", [("fwd", "rms"), ("rms-bwd", "bwd")])
def test_the_other_norms_pick_competes_as_this_calls(gpu, op, sibling_op):
    """What runs the other norm's call at the same key (here its user-table entry: a slow launch shape with
    extras only the fastest shapes try) is timed in the first round too: the two norms' row shapes carry over
    (LayerNorm's backward 32768 on an H200 read 0.645 of copy with its pick, 0.809 with RMSNorm's shape)."""
    backward, rms = search_space.OPS[op]
    knobs = dict(warps_m=4, warps_n=1, ctas_per_row=1, bytes_per_ldg=8, stages=4, cache_weights=False,
                 min_ctas_per_sm=1, smem_accumulators=False, recompute=True)
    table = tables.new_table(GPU)
    sibling_key = search_space.Job.of(1024, "bfloat16", *search_space.OPS[sibling_op]).key
    table.put(sibling_key, knobs, ms=1.0, fraction_of_copy=0.5, spread=[0.5, 0.5], dtype="bfloat16",
              measured_n=1024)
    tables.save(table)
    key = search_space.Job.of(1024, "bfloat16", backward, rms).key
    assert frozen(dict(knobs, **_LATER_DEFAULTS)) not in {frozen(t.knobs()) for t in
                                                          search_space.candidates(1024, "bfloat16", backward, 90, rms)}
    assert run_tune("--sizes", "1024", "--ops", op, "--fresh").exit_code == 0
    assert frozen(dict(knobs, **_LATER_DEFAULTS)) in gpu.timed_knobs(key, 1024, "bfloat16")


def test_a_knob_the_other_norm_alone_has_leaves_its_pick_out(gpu):
    """LayerNorm's forward pick of cluster rows with merged moments (a knob RMSNorm lacks) is no seed for
    RMSNorm's forward: left out, and the key is tuned."""
    knobs = dict(warps_m=1, warps_n=4, ctas_per_row=4, bytes_per_ldg=16, stages=2, cache_weights=True,
                 min_ctas_per_sm=1, smem_accumulators=False, recompute=True, merged_moments=True)
    table = tables.new_table(GPU)
    table.put(search_space.Job.of(32768, "bfloat16").key, knobs, ms=1.0, fraction_of_copy=0.5, spread=[0.5, 0.5],
              dtype="bfloat16", measured_n=32768)
    tables.save(table)
    job = search_space.Job.of(32768, "bfloat16", rms=True)
    assert tune._incumbent(search_space.Job.of(32768, "bfloat16"), 90, GPU, 0)[0].merged_moments
    assert tune.sibling_pick(job, 90, GPU, 0) is None
    assert run_tune("--sizes", "32768", "--ops", "rms", "--fresh").exit_code == 0
    assert job.key in saved().entries


@pytest.mark.parametrize("times, ms, fraction, spread", [
    ([1.0, 4.0, 2.0], 2.0, 0.25, [0.125, 0.5]),  # the middle one, unsorted: means 2.33 ms, 0.29
    ([1.0, 4.0, 2.0, 10.0], 3.0, 0.1875, [0.05, 0.5]),  # the middle two's mean: means 4.25 ms, 0.23
])
def test_a_reading_is_the_median_ms_median_fraction_and_fraction_spread(times, ms, fraction, spread):
    """NBYTES at COPY bytes/s is 0.5 ms: a round's fraction is 0.5 / its ms. For an even count the median
    fraction (0.1875) is not the median ms's fraction (0.5 / 3.0)."""
    assert tune.reading(times, NBYTES, COPY) == {
        "ms": pytest.approx(ms), "fraction_of_copy": pytest.approx(fraction), "spread": pytest.approx(spread)}


def test_the_incumbents_reading_is_its_final_rounds(gpu):
    """Its screening reading (far slower) is not in it: median ms, median fraction and [min, max] of the final
    rounds alone (4 rounds: the median fraction is not the median ms's fraction)."""
    job = search_space.Job.of(1024, "bfloat16", True)
    shapes = search_space.candidates(1024, "bfloat16", True)
    mine = shapes[-1]
    readings = iter([50.0, 2.0, 2.4, 2.2, 3.0])  # the screening, then one a round
    gpu.ms = lambda knobs: next(readings) if knobs == mine.knobs() else fake_ms(knobs)
    entry = measured_with(job, shapes, mine)
    fraction = lambda ms: NBYTES / (ms * 1e-3) / COPY  # noqa: E731
    median = (fraction(2.2) + fraction(2.4)) / 2
    assert entry["knobs"] != mine.knobs() and entry["incumbent"] == {
        "knobs": mine.knobs(), "ms": pytest.approx(2.3), "fraction_of_copy": pytest.approx(median),
        "spread": pytest.approx([fraction(3.0), fraction(2.0)])}
    line = tune._tune_line(job, entry)
    assert line.endswith(f"; dispatch's pick before: {median:.3f} [{fraction(3.0):.3f}, {fraction(2.0):.3f}]")


def test_a_pushed_incumbent_is_reported_as_itself_and_as_its_twin_only_where_that_stood_in(gpu):
    """Its barrier twin among the finalists too, the pushed pick's own reading is reported; where the pushed pick
    spills and its twin is timed in its place, the pick's knobs with the twin's (timed_as) and the line says so;
    an incumbent that never compiled has no reading."""
    job = search_space.Job.of(65536, "bfloat16", True, True)
    pushed = search_space.with_pushed_exchange(incumbent(65536, "rms-bwd"))
    twin = pushed.replace(pushed_exchange=False)
    others = search_space.candidates(65536, "bfloat16", True, rms=True)[:5]
    assert pushed.pushed_exchange and twin not in others
    gpu.ms = lambda knobs: {frozen(pushed.knobs()): 0.5, frozen(twin.knobs()): 0.6}.get(frozen(knobs), fake_ms(knobs))
    entry = measured_with(job, others + [twin], pushed)
    assert entry["knobs"] == pushed.knobs() and entry["incumbent"]["knobs"] == pushed.knobs()
    assert "timed_as" not in entry["incumbent"] and entry["incumbent"]["ms"] == pytest.approx(0.5)
    assert tune._tune_line(job, entry).endswith("; dispatch's pick before: the same")
    gpu.spills = _Pushed()
    entry = measured_with(job, list(others), pushed)
    assert entry["knobs"] == twin.knobs() and entry["incumbent"]["knobs"] == pushed.knobs()
    assert entry["incumbent"]["timed_as"] == twin.knobs() and entry["incumbent"]["ms"] == pytest.approx(0.6)
    assert tune._tune_line(job, entry).endswith(" (timed as its barrier twin)")
    gpu.spills = {frozen(twin.knobs())}  # a barrier pick that spills: never timed
    entry = measured_with(job, list(others), twin)
    assert "incumbent" not in entry and "dispatch's pick" not in tune._tune_line(job, entry)


def test_a_slow_first_reading_near_the_fastest_is_taken_again(gpu):
    """A stall during the fastest shape's one screening timing (5% slower: below over a hundred readings) would
    keep it out of the final rounds; the second look near the fastest times it again and it wins."""
    shapes, case = search_space.candidates(1024, "bfloat16", True), search_space.Job.of(1024, "bfloat16", True).workload()
    best = tune.rank(shapes, case, 0, 90, lambda _: None, print)[0][1]  # a shape or an extra
    assert best != incumbent(1024, "bwd")  # not in the final rounds as what dispatch runs today
    slowed = []

    def stalled_once(knobs):
        if knobs == best.knobs() and not slowed:
            slowed.append(knobs)
            return fake_ms(knobs) * 1.05
        return fake_ms(knobs)

    gpu.ms = stalled_once
    ranked = tune.rank(shapes, case, 0, 90, lambda _: None, print)
    assert slowed and sum(ms < fake_ms(best.knobs()) * 1.05 for ms, _ in ranked) > tune.FINALISTS
    assert ranked[0] == (fake_ms(best.knobs()), best)
    slowed.clear()  # the run's screening stalls again
    assert run_tune("--sizes", "1024", "--ops", "bwd", "--rounds", "2").exit_code == 0
    assert saved().entries[search_space.Job.of(1024, "bfloat16", True).key]["knobs"] == best.knobs()


def test_the_second_look_bar_sorting_failures_and_budget(gpu, monkeypatch):
    """`_second_look` times again what lies within SECOND_LOOK of the faster of its list's first and `fastest`
    (the shapes' pass, for the extras), keeps each shape's faster reading, sorts again; a second timing that
    fails keeps the first reading and is reported; the budget is looked at before each."""
    a, b, c = (t for t in search_space.candidates(1024, "bfloat16", True)[:3])
    readings = {a: 1.2, b: 0.95, c: 9.0}  # a: slower the second time; b: faster
    again, said = [], []
    monkeypatch.setattr(bench, "median_ms", lambda fn, **kw: again.append(fn.keywords["traits"]) or
                        readings[next(t for t in (a, b, c) if t.knobs() == fn.keywords["traits"])])
    case = search_space.Job.of(1024, "bfloat16", True).workload()
    assert tune._second_look([(1.0, a), (1.05, b), (1.2, c)], case, said.append) == [(0.95, b), (1.0, a), (1.2, c)]
    assert again == [a.knobs(), b.knobs()]  # c: 1.2 > 1.1
    again.clear()
    assert tune._second_look([(1.0, a), (1.05, b), (1.2, c)], case, said.append, fastest=0.99) == [
        (0.95, b), (1.0, a), (1.2, c)]
    assert again == [a.knobs(), b.knobs()]
    again.clear()
    assert tune._second_look([(1.0, a), (1.05, b)], case, said.append, fastest=0.93) == [(1.0, a), (1.05, b)]
    assert again == [a.knobs()]  # the bar is 0.93 * 1.1: b is not timed again
    monkeypatch.setattr(bench, "median_ms", lambda fn, **kw: (_ for _ in ()).throw(RuntimeError("planted")))
    assert tune._second_look([(1.0, a)], case, said.append) == [(1.0, a)]
    assert len(said) == 1 and "second look: RuntimeError: planted" in said[0]
    monkeypatch.setattr(tune, "clock", lambda: 10.0)
    with pytest.raises(tune.OutOfTime):
        tune._second_look([(1.0, a)], case, said.append, deadline=5.0)


def test_what_dispatch_runs_today_reaches_the_final_rounds_however_it_screened(gpu):
    """One screening timing can rank the incumbent below the finalists (a noisy reading: PERFORMANCE.md version
    68, RMSNorm backward 3840); it is re-timed in the final rounds anyway, so a shape that only screened faster
    never replaces it."""
    key = search_space.Job.of(1024, "bfloat16").key
    incumbent = dict(warps_m=2, warps_n=4, ctas_per_row=1, bytes_per_ldg=16, stages=3, cache_weights=True,
                     min_ctas_per_sm=1, smem_accumulators=False, recompute=True)  # the stand-in's fastest
    table = tables.new_table(GPU)
    table.put(key, incumbent, ms=1.0, fraction_of_copy=0.5, spread=[0.5, 0.5], dtype="bfloat16", measured_n=1024)
    tables.save(table)
    screened = []

    def slow_first(knobs, real=fake_ms):  # the incumbent's first (screening) timing reads slowest of all
        mine = all(knobs[k] == v for k, v in incumbent.items())
        if mine and not screened:
            screened.append(knobs)
            return real(knobs) + 10.0
        return real(knobs)

    gpu.ms = slow_first
    rounds = 2
    res = run_tune("--sizes", "1024", "--ops", "fwd", "--fresh", "--rounds", str(rounds))
    assert res.exit_code == 0 and screened
    mine = frozen(screened[0])
    assert collections.Counter(k for o, n, d, k in gpu.timed)[mine] == 1 + rounds  # screened, then every round
    assert frozen(saved().entries[key]["knobs"]) == mine
    assert "; dispatch's pick before: the same" in res.stdout  # the TUNE lines: stdout without --json
