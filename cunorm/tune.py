"""Tuning: measure candidate traits on this GPU and write the winners into its
tuned table (cunorm.tables), the table dispatch consults first. The command
is `cunorm tune` (cunorm/cli/measuring.py).

Each key of the table (cunorm.tables.Key: direction, LayerNorm or RMSNorm,
residual, hidden size, input element bytes, general rows) is measured in
three steps:
1. rank: every launch shape (`search_space.candidates`), what dispatch runs for the
   call today and for the other norm's call of the key (`sibling_pick`; and that
   call's pick of this run, where the run tuned it first), then the
   extras on the KEEP fastest shapes (`search_space.refinements`),
   then the KEEP fastest backwards with shared-memory column sums with some of
   them in registers (`search_space.register_sum_variants`), then the other knobs'
   passes (`rank`: whole steps unchecked, sum chains, rows ahead in registers), each compiled
   (kernels with local memory, i.e. spills, are dropped; a cluster row's
   pushed exchange that spills is timed with the barrier one instead) and
   timed once; those within SECOND_LOOK of the fastest
   are timed again after their pass and keep their faster reading (a stall
   slows a reading, nothing speeds one up; two H200 runs of RMSNorm
   backward 32768 picked shapes reading 0.879 and 0.815, version 62);
2. finals: the FINALISTS fastest re-timed in `rounds` interleaved rounds, so
   that drift hits them alike, and what runs the call today (`_incumbent`) beside them
   however it screened (one timing can drop it: version 68 of
   docs/PERFORMANCE.md); the best median wins;
3. check: the winner runs against the float64 reference with its knobs
   forced; one that fails gives way to the next finalist. The run's record
   names the pass of step 1 that first timed it (`found_by`).
The table is saved after every key: a run that stops (--budget, or killed)
goes on where it stopped when run again.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from . import tables
from .check import check_knobs
from .search_space import (OPS, REGISTER_SUM_SHARES, SIZES, SUM_CHAIN_COUNTS, Job, candidates, extra_combinations,
                           plan, refinements, register_ahead_variants, register_sum_variants, screened_ahead_variants,
                           stats_ahead_variants, sum_chains_variants, unchecked_whole_steps_variants,
                           with_pushed_exchange)
from .traits import Traits

REPEAT = 6  # timed batches per measurement (bench.median_ms)
KEEP = 2  # shapes whose extras are tried
# Unstaged backward shapes tried with their next row ahead in registers (register_ahead_variants): the H200's
# re-tune with 12 in place of 4 found shapes with the knob 0.05-0.10 of copy faster at LayerNorm backward 3840 /
# 6144 / 16384 and RMSNorm backward 12800 / 14336 (PERFORMANCE.md version 84).
AHEAD_KEEP = 12
# The first round's fastest shapes past the `keep` refined ones, also tried unstaged with their next row ahead:
# their extras are never tried, so without this the knob meets only the `keep` fastest shapes' unstaged
# extras (the H200's LayerNorm backward 12288 never met a cluster row with it; version 85's tune with this pass
# still kept its pick there, while cluster keys took new picks with the knob: PERFORMANCE.md version 85).
AHEAD_SHAPES = 4
SECOND_LOOK = 0.10  # shapes screened within this fraction of the fastest are timed twice
FINALISTS = 3
ROUNDS = 5
COMPILE_THREADS = 16  # candidates (and dispatch's picks) compiled side by side
# Where a winner was first timed (a key's "found_by"): which pass of `rank` pays for itself is the tuner's own
# question (PERFORMANCE.md versions 85-86 could not say which pass found the picks that moved most).
FIRST_ROUND, EXTRAS, REGISTER_SUMS = "first round", "extras", "register sums"
DISPATCH_SEED, SIBLING_SEED = "first round: dispatch's pick", "first round: the other norm's pick"
NEW_SIBLING_SEED = "first round: the other norm's pick of this run"
UNCHECKED, CHAINS, STATS_AHEAD = "unchecked whole steps", "sum chains", "stats ahead"
ROWS_AHEAD, SHAPES_AHEAD = "rows ahead", "rows ahead: first-round shapes"
# NEW_SIBLING_SEED is followed by the pass that found that pick, in parentheses.
PASSES = (FIRST_ROUND, DISPATCH_SEED, SIBLING_SEED, NEW_SIBLING_SEED, EXTRAS, REGISTER_SUMS, UNCHECKED, CHAINS,
          ROWS_AHEAD, SHAPES_AHEAD, STATS_AHEAD)
clock = time.monotonic  # the budget's clock


class OutOfTime(Exception):
    """The budget ran out while a key was measured: that key is dropped, the finished ones are saved."""


def what_runs(call: dict, arch: int, gpu, device_id: int) -> tuple:
    """(traits, origin) that run `call` (dispatch's fields) on this device today: dispatch's pick (`gpu`'s tables,
    the literal, the heuristic), or, where that compiles with spills for the call, what replaces it as on the GPU
    path (`dispatch.what_runs`, `plan._plan`; general rows often borrow an aligned entry that spills on the
    general kernel: version 73 of docs/PERFORMANCE.md). A ValueError where no traits are legal for the call."""
    from . import dispatch
    from .compiler import CompileError, keeps_local_memory

    try:
        return dispatch.what_runs(arch, lambda t: keeps_local_memory(t, device_id), gpu, **call)
    except CompileError:  # the call fails today: its pick stands (`_compiled` drops it: nothing is timed for it)
        return dispatch.choose(arch=arch, gpu=gpu, **call)


def _incumbent(job: Job, arch: int, gpu, device_id: int) -> tuple:
    """(traits, origin) that run the job's call on this GPU today (`what_runs`), or (None, None)."""
    try:
        return what_runs(job.call_fields(), arch, gpu, device_id)
    except ValueError:
        return None, None


def the_other_norms(job: Job) -> Job:
    """The other norm's call of `job`'s key (RMSNorm's for LayerNorm's and back; same direction, N, dtype and
    residual)."""
    return Job.of(job.n, job.dtype, job.key.backward, not job.key.rms, job.key.residual)


def as_call_of(knobs: dict, job: Job, arch: int) -> Traits | None:
    """`knobs` as traits of `job`'s call where they are legal there, else None (e.g. a knob of the other norm
    alone: merged moments)."""
    from .dispatch import from_knobs

    try:
        t = from_knobs(knobs, **job.call_fields())
        t.check_arch(arch)
    except ValueError:
        return None
    return t


def sibling_pick(job: Job, arch: int, gpu, device_id: int) -> Traits | None:
    """What runs the other norm's call of `job`'s key today (`the_other_norms`), as traits of `job`'s call
    (`as_call_of`): a seed for the first round. The two backwards share their loop, so a row shape fast for one
    is worth timing for the other, and the first round's default extras may bury it (the H200's LayerNorm
    backward 32768 read 0.645 of copy with its pick, 0.809 with RMSNorm's shape, PERFORMANCE.md version 85). It
    is the pick before the run; a run tuning both norms also seeds the second with the first's new pick (`run`).
    None where there is none to have."""
    try:
        picked, _ = _incumbent(the_other_norms(job), arch, gpu, device_id)  # compiles it: a call no one asked to tune
    except Exception:  # a driver error compiling it: an optional seed must not stop the tune
        return None
    return None if picked is None else as_call_of(picked.knobs(), job, arch)


def compiles_clean(traits: Traits, device_id: int) -> bool:
    """Whether `traits` compile to kernels without local memory (`compiler.keeps_local_memory`): a kernel that
    spills or keeps a stack frame is never a candidate (dispatch would replace it, `plan._plan`)."""
    from .compiler import keeps_local_memory

    try:
        return not keeps_local_memory(traits, device_id)
    except Exception:  # fails to compile or load: not a candidate
        return False


def _check_time(deadline: float | None):
    if deadline is not None and clock() >= deadline:
        raise OutOfTime


def _compiled(traits_list, device_id: int, skip=frozenset()) -> list:
    """The candidates that compile clean (compiled in parallel), in order, each once and none of `skip`. A
    cluster row whose pushed exchange spills or fails to compile (NVRTC before 12.1) stands in with the
    barrier exchange, unless that one is there already."""
    with ThreadPoolExecutor(max_workers=COMPILE_THREADS) as pool:
        clean = dict(zip(traits_list, pool.map(lambda t: compiles_clean(t, device_id), traits_list)))
        barrier = [t.replace(pushed_exchange=False) for t, ok in clean.items() if not ok and t.pushed_exchange]
        barrier_clean = dict(zip(barrier, pool.map(lambda t: compiles_clean(t, device_id), barrier)))
    out, seen = [], set(skip)
    for t in traits_list:
        if not clean[t] and t.pushed_exchange:
            t = t.replace(pushed_exchange=False)
        if (clean.get(t) or barrier_clean.get(t)) and t not in seen:
            out.append(t)
            seen.add(t)
    return out


def _time_once(case, traits: Traits) -> float:
    """One timing of `case` with `traits` forced: ms a call (bench.median_ms of REPEAT batches)."""
    from . import bench

    return bench.median_ms(functools.partial(case.call, traits=traits.knobs()), repeat=REPEAT, warmup=2, batch=5)


def _time_all(traits_list, case, device_id: int, tick, echo, deadline=None, skip=frozenset(),
              fastest: float | None = None) -> list:
    """[(ms, traits)] fastest first for the candidates `_compiled` keeps (a spilling pushed exchange
    replaced by the barrier one), each timed once, those near the fastest (of these, or `fastest` ms where
    faster) twice (`_second_look`); `tick(1)` per candidate."""
    clean = _compiled(traits_list, device_id, skip)
    tick(len(traits_list) - len(clean))
    timed = []
    for t in clean:
        _check_time(deadline)
        try:
            timed.append((_time_once(case, t), t))
        except Exception as e:  # a candidate that fails to launch is reported, not fatal
            echo(f"  {t.short()}: {type(e).__name__}: {str(e).splitlines()[0]}")
        tick(1)
    timed.sort(key=lambda p: p[0])
    return _second_look(timed, case, echo, deadline, fastest)


def _second_look(timed: list, case, echo, deadline=None, fastest: float | None = None) -> list:
    """`timed` ([(ms, traits)] fastest first) with the shapes within SECOND_LOOK of the fastest (of them, or
    `fastest` ms where faster: the shapes' pass before the extras' pass) timed once
    more, after the whole pass (so a stall of the first pass does not hit both readings), each keeping its
    faster reading (the first where the second fails to launch: reported); fastest first. Not counted in the
    progress bar (`_steps` cannot know how many)."""
    if not timed:
        return timed
    bar = (timed[0][0] if fastest is None else min(fastest, timed[0][0])) * (1 + SECOND_LOOK)
    again = []
    for ms, t in timed:
        if ms <= bar:
            _check_time(deadline)
            try:
                ms = min(ms, _time_once(case, t))
            except Exception as e:  # as in the first pass: reported, not fatal
                echo(f"  {t.short()}: second look: {type(e).__name__}: {str(e).splitlines()[0]}")
        again.append((ms, t))
    return sorted(again, key=lambda p: p[0])


def rank(shapes, case, device_id: int, arch: int, tick, echo, deadline=None, keep: int = KEEP,
         found: dict | None = None) -> list:
    """[(ms, traits)] fastest first: every shape, then the extras on the `keep` fastest, then the `keep`
    fastest with shared-memory column sums (as their all-in-shared-memory selves) with some sums in registers
    (`register_sum_variants`), then the `keep` fastest with their whole load steps unchecked
    (`unchecked_whole_steps_variants`: rows without full tiles), then a forward's `keep` fastest with their
    row sums in more chains (`sum_chains_variants`), then a backward's AHEAD_KEEP fastest unstaged shapes, and
    the AHEAD_SHAPES fastest shapes of the first round past the `keep` unstaged, with their next row loaded
    ahead into registers (`register_ahead_variants`: the knob reorders unstaged shapes, so more of them than
    `keep`), then the `keep` fastest of those with the row's statistics ahead too (`stats_ahead_variants`);
    each traits timed once, or twice within SECOND_LOOK of the fastest so far (`_second_look`).
    `found`, where given, gets the pass that first timed each traits (FIRST_ROUND ... STATS_AHEAD; a barrier
    twin timed in place of a pushed candidate as that candidate, unless it is a candidate itself); first-round
    traits it names already (the seeds: DISPATCH_SEED, SIBLING_SEED, NEW_SIBLING_SEED) keep their names."""
    found = {} if found is None else found

    def note(timed: list, passes: dict) -> list:  # passes: {candidate: its pass}
        stood_for = {t.replace(pushed_exchange=False): t for t in passes if t.pushed_exchange}
        for _, t in timed:
            if t not in found:
                found[t] = passes[t] if t in passes else passes[stood_for[t]]
        return timed

    ranked = note(_time_all(shapes, case, device_id, tick, echo, deadline),
                  {t: found.get(t, FIRST_ROUND) for t in shapes})
    unrefined = [v for _, t in ranked[keep:keep + AHEAD_SHAPES] for v in screened_ahead_variants(t)]

    def add(candidates: list, name: str, others: dict | None = None) -> list:  # others: {candidate: its pass}
        timed = _time_all(candidates, case, device_id, tick, echo, deadline, skip={t for _, t in ranked},
                          fastest=ranked[0][0] if ranked else None)
        return sorted(ranked + note(timed, {**dict.fromkeys(candidates, name), **(others or {})}),
                      key=lambda p: p[0])

    ranked = add([t for _, shape in ranked[:keep] for t in refinements(shape, arch)], EXTRAS)
    in_smem = list(dict.fromkeys(t.replace(register_sum_steps=0) for _, t in ranked if t.smem_accumulators))
    ranked = add([v for t in in_smem[:keep] for v in register_sum_variants(t)], REGISTER_SUMS)
    ranked = add([v for _, t in ranked[:keep] for v in unchecked_whole_steps_variants(t)], UNCHECKED)
    ranked = add([v for _, t in ranked[:keep] for v in sum_chains_variants(t)], CHAINS)
    unstaged = [t for _, t in ranked if register_ahead_variants(t)]
    ahead = [v for t in unstaged[:AHEAD_KEEP] for v in register_ahead_variants(t)]
    ranked = add(list(dict.fromkeys(ahead + unrefined)), SHAPES_AHEAD, dict.fromkeys(ahead, ROWS_AHEAD))
    with_rows_ahead = [t for _, t in ranked if stats_ahead_variants(t)]
    return add([v for t in with_rows_ahead[:keep] for v in stats_ahead_variants(t)], STATS_AHEAD)


def _steps(shapes: list, backward: bool, keep: int, finalists: int, rounds: int) -> int:
    """Progress steps of a key, about: shapes, extras, final rounds and checks, the incumbent's beside the
    finalists' (the bar is filled at the key's end; cluster rows' extras are also tried with the other
    exchange, not counted here)."""
    incumbent = 1 if finalists else 0  # the ranking step alone (`tune`) has no final rounds
    register_sums = keep * (1 + len(REGISTER_SUM_SHARES)) if backward else 0  # register_sum_variants, at most
    unchecked = keep  # unchecked_whole_steps_variants, at most
    chains = 0 if backward else keep * len(SUM_CHAIN_COUNTS)  # sum_chains_variants, at most
    ahead = AHEAD_KEEP + AHEAD_SHAPES + keep if backward else 0  # register_ahead_variants, stats_ahead_variants
    return (len(shapes) + keep * len(list(extra_combinations(backward))) + register_sums + unchecked + chains
            + ahead + (finalists + incumbent) * (rounds + 1))


def current_gpu() -> tuple:
    """(device id, architecture, tables.GPU) of CuPy's current device: what is measured, and whose table it fills."""
    import cupy

    from .compiler import device_arch, device_gpu

    device_id = cupy.cuda.Device().id
    return device_id, device_arch(device_id), device_gpu(device_id)


def tune(hidden_size: int, dtype: str = "bfloat16", backward: bool = False, keep: int = KEEP, rms: bool = False,
         residual: bool = False, warps_n=None, out=sys.stdout) -> list:
    """[(ms, traits)] sorted fastest first: every shape timed once, then the
    extras on the `keep` fastest shapes, those within SECOND_LOOK of the fastest
    of their pass twice (the ranking step of `cunorm tune`; nothing is written)."""
    from .bench import progress

    device_id, arch, _ = current_gpu()
    job = Job.of(hidden_size, dtype, backward, rms, residual)
    shapes = candidates(hidden_size, dtype, backward, arch, rms, residual, warps_n)
    with progress(_steps(shapes, backward, keep, 0, 0), f"tuning {job.label()}", out) as (bar, echo):
        return rank(shapes, job.workload(), device_id, arch, bar.update, echo, keep=keep)


def _timed_as(incumbent: Traits | None) -> list:
    """What stands for `incumbent` in the timings, in order of preference: itself, then (a pushed one) its
    barrier twin, which `_compiled` times in place of one that spills."""
    if incumbent is None:
        return []
    return [incumbent, incumbent.replace(pushed_exchange=False)] if incumbent.pushed_exchange else [incumbent]


def final_rounds(ranked: list, case, rounds: int, tick, deadline=None, finalists: int = FINALISTS,
                 incumbent: Traits | None = None) -> list:
    """[(times, traits)] of the `finalists` fastest of `ranked`, and of
    `incumbent` (or, where a pushed incumbent is not in `ranked`, its barrier
    twin: what `_compiled` times in place of one that spills) where it was
    ranked lower, each timed once a round, the rounds
    interleaved so that drift hits them alike; best median first. An
    incumbent that did not compile clean or launch is not in `ranked`, and
    not timed."""
    times = {t: [] for _, t in ranked[:finalists]}
    timed = {t for _, t in ranked}
    for t in _timed_as(incumbent):
        if t in timed:
            times.setdefault(t, [])
            break
    for _ in range(rounds):
        for t, ms in times.items():
            _check_time(deadline)
            ms.append(_time_once(case, t))
            tick(1)
    return sorted(((ms, t) for t, ms in times.items()), key=lambda p: float(np.median(p[0])))


def reading(times: list, nbytes: int, copy_bandwidth: float) -> dict:
    """Final rounds' `times` (ms per call moving `nbytes`) as a table entry
    reads them: median ms, median fraction of `copy_bandwidth` (bytes/s) and
    the fraction's spread [min, max]. The median fraction is taken over the
    rounds' fractions, not from the median ms (they differ for an even count)."""
    fractions = [nbytes / (ms * 1e-3) / copy_bandwidth for ms in times]
    return {"ms": float(np.median(times)), "fraction_of_copy": float(np.median(fractions)),
            "spread": [min(fractions), max(fractions)]}


def measure(job: Job, shapes: list, device_id: int, arch: int, copy: float, rounds: int, tick, echo,
            deadline=None, finalists: int = FINALISTS, incumbent: Traits | None = None,
            seeds: dict | None = None) -> dict | None:
    """A key's entry: the knobs of the finalist (`incumbent`, what runs the
    call today, among them wherever it was timed) with the best median that
    passes the float64 check, with its median ms and fraction of `copy` (bytes/s of a
    copy), and the fraction's spread [min, max] over the rounds; None when
    no finalist passes. Where the incumbent was timed in the final rounds,
    the entry's "incumbent" holds its knobs and reading from the same rounds
    (what the new entry gains over it; not for the table), and "timed_as"
    the barrier twin's knobs where that was timed in its place. "found_by": the pass of `rank` that first timed
    the winner (`seeds`: {traits of `shapes`: DISPATCH_SEED, SIBLING_SEED or NEW_SIBLING_SEED and the pass that
    found that pick} name the seeds' first round)."""
    case = job.workload()
    found = dict(seeds or {})
    ranked = rank(shapes, case, device_id, arch, tick, echo, deadline, found=found)
    finals = final_rounds(ranked, case, rounds, tick, deadline, finalists, incumbent)
    times_of = {t: times for times, t in finals}
    before = next((t for t in _timed_as(incumbent) if t in times_of), None)
    for times, t in finals:
        failures = check_knobs(job, t.knobs())
        tick(1)
        if failures:
            echo(f"  {t.short()}: fails the float64 check ({'; '.join(failures)}): the next finalist instead")
            continue
        entry = {"knobs": t.knobs(), **reading(times, case.nbytes, copy), "dtype": job.dtype, "measured_n": job.n,
                 "found_by": found[t]}
        if before is not None:
            entry["incumbent"] = {"knobs": incumbent.knobs(), **reading(times_of[before], case.nbytes, copy),
                                  **({} if before == incumbent else {"timed_as": before.knobs()})}
        return entry
    return None


def open_table(path: Path, gpu) -> tables.Table:
    """The table at `path` to add to, or a new one where there is none. One
    that cannot be used here (unreadable, malformed, another GPU or cunorm
    version) is moved aside to PATH.bak, with one warning."""
    if not path.exists():
        return tables.new_table(gpu)
    try:
        return tables.read(path, gpu, f"user table {path}")
    except tables.TableError as e:
        backup = path.with_name(path.name + ".bak")
        os.replace(path, backup)  # moved, not copied: dispatch would warn about it again meanwhile
        print(f"cunorm tune: warning: {path} cannot be used ({e}); starting a new table (the old file is now "
              f"{backup})", file=sys.stderr)
        return tables.new_table(gpu)


def _tune_line(job: Job, record: dict) -> str:
    """A key's result, its knobs spelled as `cunorm bench --traits` takes them, the pass that found them, and
    what ran the call before in the same final rounds (where it was timed there; else that it was not), with its
    origin (a run's records name it: dispatch's table, or what replaced a pick that spills)."""
    knobs = ",".join(f"{k}={int(v)}" for k, v in record["knobs"].items())
    lo, hi = record["spread"]
    found = f" (found by: {record['found_by']})" if "found_by" in record else ""
    line = (f"TUNE {job.label()}: {record['fraction_of_copy']:.3f} [{lo:.3f}, {hi:.3f}] of copy, "
            f"{record['ms']:.4f} ms, {knobs}{found}")
    before = record.get("incumbent")
    if before is None:
        untimed = record.get("incumbent_not_timed")
        return line if untimed is None else (
            line + f"; dispatch's pick before ({untimed['origin']}): not timed, it did not compile without local "
                   f"memory or did not launch here")
    if before["knobs"] == record["knobs"]:
        return line + "; dispatch's pick before: the same"
    lo, hi = before["spread"]
    stand_in = " (timed as its barrier twin)" if "timed_as" in before else ""
    origin = f" ({before['origin']})" if "origin" in before else ""
    return line + f"; dispatch's pick before: {before['fraction_of_copy']:.3f} [{lo:.3f}, {hi:.3f}]{stand_in}{origin}"


def run(sizes=SIZES, ops=tuple(OPS), residuals=(False,), dtype_names=("bfloat16",), output=None,
        rounds: int = ROUNDS, budget: float | None = None, fresh: bool = False, warps_n=None,
        as_json: bool = False, out=sys.stdout) -> dict:
    """Measures every key of `sizes` x `ops` (OPS names) x `residuals` x
    `dtype_names` on the current GPU and saves each, once measured, to the
    table at `output` (default: this GPU's user table, which dispatch
    reads). Keys already there are skipped unless `fresh`. `budget`:
    seconds, after which the run stops and drops the key being measured.
    Per key, a TUNE line to `out` and with `as_json` a JSON object on stdout.
    Returns the path, the entries saved and the keys skipped, failed (no
    finalist passed the check) and left (the budget ran out)."""
    from . import bench

    deadline = None if budget is None else clock() + budget
    device_id, arch, gpu = current_gpu()
    path = Path(output) if output else tables.user_path(gpu)
    table = open_table(path, gpu)
    jobs, notes = plan(sizes, ops, residuals, dtype_names)
    for note in notes:
        print(note, file=out)
    todo = [j for j in jobs if fresh or j.key not in table.entries]
    summary = {"table": str(path), "tuned": [], "skipped": [j.label() for j in jobs if j not in todo], "failed": [],
               "left": []}
    if summary["skipped"]:
        print(f"{len(summary['skipped'])} of {len(jobs)} keys already in {path}: skipped (--fresh measures them "
              f"again)", file=out)
    shapes = {j: candidates(j.n, j.dtype, j.key.backward, arch, j.key.rms, j.key.residual, warps_n) for j in todo}
    # Each compiles dispatch's pick (and, where that spills, its replacements).
    with ThreadPoolExecutor(max_workers=COMPILE_THREADS) as pool:
        incumbents = dict(zip(todo, pool.map(lambda j: _incumbent(j, arch, gpu, device_id), todo)))
        siblings = dict(zip(todo, pool.map(lambda j: sibling_pick(j, arch, gpu, device_id), todo)))
    seeds = {j: {} for j in todo}  # the seeds not among the shapes anyway, named for a winner's "found_by"

    def seed(j: Job, pick: Traits | None, name: str):  # into j's first round, with pushed exchanges too
        for t in () if pick is None else (pick, with_pushed_exchange(pick)):
            if shapes[j] and t not in shapes[j]:
                shapes[j].append(t)
                seeds[j][t] = name

    for j in todo:  # what runs the call today competes too, up to the final rounds (where it compiles clean)
        seed(j, incumbents[j][0], DISPATCH_SEED)
        seed(j, siblings[j], SIBLING_SEED)  # and the other norm's, as this call's
    for job in [j for j in todo if not shapes[j]]:  # nothing to time: say why, not "failed the check"
        todo.remove(job)
        summary["failed"].append(job.label())
        print(f"TUNE {job.label()}: no candidate traits to time (rows of fewer than a vector per thread, or none "
              f"with the WARPS_N values given); dispatch's heuristic serves it", file=out)
    # (about: a seed of this run's pick, added later, is 2 steps more; the key's end fills the bar to its share)
    steps = {j: _steps(shapes[j], j.key.backward, KEEP, FINALISTS, rounds) for j in todo}
    copy = bench.copy_bandwidth() if todo else 0.0
    with bench.progress(sum(steps.values()), f"tuning {len(todo)} keys", out) as (bar, echo):
        for i, job in enumerate(todo):
            bar.label = f"tuning {job.label()} (key {i + 1} of {len(todo)})"
            end = bar.pos + steps[job]
            try:
                _check_time(deadline)
                incumbent, origin = incumbents[job]
                entry = measure(job, shapes[job], device_id, arch, copy, rounds, bar.update, echo, deadline,
                                incumbent=incumbent, seeds=seeds[job])
            except OutOfTime:
                summary["left"] = [j.label() for j in todo[i:]]
                break
            bar.update(end - bar.pos)  # the steps a key did not need (extras, finalists) at most
            if entry is None:
                summary["failed"].append(job.label())
                echo(f"TUNE {job.label()}: no finalist passed the float64 check; nothing saved")
                continue
            if "incumbent" in entry:
                entry["incumbent"]["origin"] = origin  # its table, or what replaced a pick that spills
            elif incumbent is not None:  # it did not compile clean or launch here: no reading, said so
                entry["incumbent_not_timed"] = {"knobs": incumbent.knobs(), "origin": origin}
            run_only = ("knobs", "incumbent", "incumbent_not_timed", "found_by")  # a run's record, not the table's
            table.put(job.key, entry["knobs"], **{k: v for k, v in entry.items() if k not in run_only})
            tables.save(table, path)
            record = {**dataclasses.asdict(job.key), **entry, "table": str(path)}
            summary["tuned"].append(record)
            echo(_tune_line(job, record))
            if as_json:
                print(json.dumps(record), flush=True)
            other = the_other_norms(job)
            if other in todo[i + 1:]:  # still to come: it meets this run's pick too (the old one may be far slower)
                seed(other, as_call_of(entry["knobs"], other, arch), f"{NEW_SIBLING_SEED} ({entry['found_by']})")
    print(f"{len(summary['tuned'])} keys tuned into {path}; {len(summary['skipped'])} skipped, "
          f"{len(summary['failed'])} failed", file=out)
    if summary["left"]:
        print(f"budget of {budget:g} s spent: {len(summary['left'])} keys left, from {summary['left'][0]} (run "
              f"again to go on)", file=out)
    return summary


if __name__ == "__main__":
    from .cli import tune as command

    command(prog_name="python -m cunorm.tune")
