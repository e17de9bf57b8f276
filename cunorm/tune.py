"""Tuning: measure candidate traits on this GPU and write the winners into its
tuned table (cunorm.tables), the table dispatch consults first. The command
is `cunorm tune` (cunorm/cli/measuring.py).

Each key of the table (cunorm.tables.Key: direction, LayerNorm or RMSNorm,
residual, hidden size, input element bytes, general rows) is measured in
three steps:
1. rank: every launch shape (`candidates`) and what dispatch runs for the
   call today, then the extras on the KEEP fastest shapes (`refinements`),
   each compiled (kernels with local memory, i.e. spills, are dropped; a
   cluster row's pushed exchange that spills is timed with the barrier
   one instead) and timed once;
2. finals: the FINALISTS fastest re-timed in `rounds` interleaved rounds, so
   that drift hits them alike, and what dispatch runs today beside them
   however it screened (one timing can drop it: version 68 of
   docs/PERFORMANCE.md); the best median wins;
3. check: the winner runs against the float64 reference with its knobs
   forced; one that fails gives way to the next finalist.
The table is saved after every key: a run that stops (--budget, or killed)
goes on where it stopped when run again.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from . import dtypes, tables
from .check import SHORT_NAMES
from .traits import CTAS_PER_ROW_CHOICES, Traits, ctas_for_registers

SHAPES = dict(ctas_per_row=CTAS_PER_ROW_CHOICES, warps_n=(1, 2, 4, 8, 16, 32), warps_m=(1, 2, 4, 8), bytes_per_ldg=(16, 8),
              lanes_per_row=(32, 16, 8, 4))
EXTRAS = dict(stages=(1, 2, 3, 4), min_ctas_per_sm=(1, 2), cache_weights=(True, False),
              smem_accumulators=(False, True), recompute=(True, False))
SIZES = (1024, 4096, 8192, 16384)  # what `cunorm tune` tunes by default
OPS = {name: (backward, op == "rms_norm") for name, (op, backward) in SHORT_NAMES.items()}  # (backward, rms)
RESIDUAL = {"no": (False,), "yes": (True,), "both": (False, True)}  # residual variants per --residual
REPEAT = 6  # timed batches per measurement (bench.median_ms)
KEEP = 2  # shapes whose extras are tried
FINALISTS = 3
ROUNDS = 5
CHECK_ELEMENTS = 2**24  # the float64 check's rows (check.DEFAULT_ROWS) are capped at this many elements
clock = time.monotonic  # the budget's clock


class OutOfTime(Exception):
    """The budget ran out while a key was measured: that key is dropped, the finished ones are saved."""


@dataclasses.dataclass(frozen=True)
class Job:
    """One key to measure and the call it is measured on: inputs, weights and
    bias of `dtype`, rows of `n`. A general key holds its aligned neighbour's
    size (what dispatch looks up), `n` the size asked for."""

    key: tables.Key
    dtype: str
    n: int

    @classmethod
    def of(cls, n: int, dtype: str, backward: bool = False, rms: bool = False, residual: bool = False) -> "Job":
        from .dispatch import tuned_neighbour

        nbytes = dtypes.itemsize(dtype)
        general = n % dtypes.vector_elements(nbytes) != 0
        return cls(tables.Key(backward, rms, residual, tuned_neighbour(n, dtype), nbytes, general), dtype, n)

    def label(self) -> str:
        k = self.key
        op = f"{'rms-' if k.rms else ''}{'bwd' if k.backward else 'fwd'}{'+residual' if k.residual else ''}"
        return f"{op} N={self.n} {self.dtype}"

    def call_fields(self) -> dict:
        """The dispatch fields of the timed call (contiguous rows), as the op derives them."""
        from .check import Case, case_call

        op = f"{'rms_norm' if self.key.rms else 'layer_norm'}{'_backward' if self.key.backward else ''}"
        return case_call(Case(op, self.n, 1, self.dtype, self.dtype, has_bias=not self.key.rms,
                              residual_dtype=self.dtype if self.key.residual else None))

    def workload(self):
        """The timed call, a bench.Case on M*N = bench.ELEMENTS: `call(traits=knobs)` runs it with knobs forced."""
        from . import bench

        op = f"{'rms_norm' if self.key.rms else 'layer_norm'}{'+residual' if self.key.residual else ''}"
        return next(bench.norm_cases((self.n,), self.dtype, ops=(op,),
                                     directions=("bwd" if self.key.backward else "fwd",)))


def plan(sizes=SIZES, ops=tuple(OPS), residuals=(False,), dtype_names=("bfloat16",)) -> tuple:
    """(jobs, notes): a Job per distinct key, and a note for each request that
    shares another's key: dtypes of one element size (the first named is
    measured) and general sizes beside one aligned neighbour (the first)."""
    measured, notes = {}, []
    for name in dtype_names:
        first = measured.setdefault(dtypes.itemsize(name), name)
        if first != name:
            notes.append(f"{name} shares {first}'s entries ({dtypes.itemsize(name)}-byte inputs): measured as {first}")
    jobs, first_size = {}, {}
    for dtype in measured.values():
        for n in sizes:
            for (backward, rms), residual in itertools.product((OPS[o] for o in ops), residuals):
                job = Job.of(n, dtype, backward, rms, residual)
                jobs.setdefault(job.key, job)
            key = Job.of(n, dtype).key
            first = first_size.setdefault((key.n, key.general, dtype), n)
            if first != n:
                notes.append(f"N={n} shares N={first}'s entries ({dtype}: the general rows beside N={key.n})")
    return list(jobs.values()), notes


def _legal(call: dict, arch: int, **knobs) -> Traits | None:
    from .dispatch import from_knobs

    try:
        t = from_knobs(knobs, **call)
        t.check_arch(arch)
    except ValueError:
        return None
    # Skip shapes that leave most of a CTA idle or hold too few elements per thread.
    if t.threads_per_cta < 64 or t.elts_per_thread < 8 or t.ldgs * t.vec_cols_per_ldg > 2 * t.vec_cols:
        return None
    return t


def candidates(hidden_size: int, dtype: str, backward: bool, arch: int = 90, rms: bool = False,
               residual: bool = False, warps_n=None) -> list:
    """Phase 1: launch shapes (CTAs per row, warps, load width; `warps_n`
    replaces SHAPES' WARPS_N values) with default extras, as the op builds
    them for contiguous rows: the general kernel where the load width does
    not divide N. Cluster rows are screened with pushed exchanges. A
    backward (`warps_n` not given) is also screened on the other WARPS_N up
    to SHAPES' largest that split its rows into whole loads a thread
    (`Traits.full_tiles`): rows of N = k * 2^j elements with an odd k
    (LayerNorm backward 14336 = 7 * 2048 on 2 CTAs of 14 warps, 15360 on 8
    of 3: +0.07-0.10 of copy on an H100, PERFORMANCE.md version 69), about
    twice the shapes there; a general key's rows never split so. Not the
    forward: its rows of 12-15 warps lost (version 41), and it screens each
    shape five ways."""
    from .dispatch import cluster_offered

    job = Job.of(hidden_size, dtype, backward, rms, residual)
    call = job.call_fields()
    out = []
    powers = warps_n or SHAPES["warps_n"]
    warp_counts = range(1, max(powers) + 1) if backward and not warps_n else powers
    for ctas, wn, wm, bpl, lanes in itertools.product(SHAPES["ctas_per_row"], warp_counts, SHAPES["warps_m"],
                                                      SHAPES["bytes_per_ldg"], SHAPES["lanes_per_row"]):
        if (ctas > 1 and wm > 1) or (lanes < 32 and (ctas > 1 or wn > 1)):  # several rows a warp: one warp wide
            continue
        t = _legal(call, arch, ctas_per_row=ctas, warps_n=wn, warps_m=wm, bytes_per_ldg=bpl, lanes_per_row=lanes)
        if t is not None and wn not in powers and not t.full_tiles:
            continue  # a warp count beyond the powers of two only where the row splits evenly
        if t is not None and not cluster_offered(t, arch):
            continue  # as dispatch offers 16-CTA clusters (a GPU holding none fails to load them: dropped)
        # A general key serves calls dispatch runs on the general kernel: a load width dividing N runs the
        # aligned one, whose knobs dispatch would not take for them.
        if t is not None and not (job.key.general and t.aligned_rows):
            t = _pushed(t)
            out.append(t)
            if not backward:  # the forward's shapes also unstaged (screening caps, weights held or not)
                out += _unstaged(t, UNSTAGED_SCREEN_CAPS, arch, caches=(False, True))
    return out


UNSTAGED_CAPS = (48, 64, 80, 128)  # registers a thread, an unstaged forward's refinements
# An unstaged shape is screened at two caps, with weights held in registers and re-read: a row of 40-64
# elements a thread spills under 64 registers, or with its weights held (and is dropped there), but not under
# 96 (2-3 CTAs an SM) or re-reading them, where it can rank among the KEEP refined (H100: LayerNorm 12800 and
# 15360 were missed without).
UNSTAGED_SCREEN_CAPS = (64, 96)


def _unstaged(shape: Traits, caps, arch: int, caches) -> list:
    """A forward shape without a persistent grid (a CTA a row group, rows straight into registers), its
    registers capped at each of `caps` (fewer registers: more CTAs an SM to overlap the rows' latencies),
    its weights held in registers or re-read as each of `caches` says."""
    out = []
    for cap, cache in itertools.product(caps, caches):
        try:
            t = shape.replace(persistent=False, stages=1, cache_weights=cache,
                              min_ctas_per_sm=ctas_for_registers(shape.threads_per_cta, cap))
            t.check_arch(arch)
        except ValueError:
            continue
        if t not in out:
            out.append(t)
    return out


def _extras(backward: bool):
    """The extras' combinations (EXTRAS order) worth trying in a direction."""
    for stages, min_ctas, cache, smem_acc, recompute in itertools.product(*EXTRAS.values()):
        if backward or not (smem_acc or not recompute):  # both knobs only change the backward
            yield stages, min_ctas, cache, smem_acc, recompute


def refinements(shape: Traits, arch: int = 90) -> list:
    """Phase 1, on a fast shape: the extras (stages, register cap, weight caching, shared-memory sums); an
    unstaged forward's: its register caps, with weights held or re-read; a LayerNorm forward of cluster rows
    each of them with merged moments too; every refinement of cluster rows with the other exchange too."""
    if not shape.persistent:
        unstaged = _unstaged(shape, UNSTAGED_CAPS, arch, caches=(False, True))
        return _with_pushed_exchanges(_with_merged_moments(unstaged))
    from .dispatch import _late_dgamma_registers

    out = []
    for values in _extras(shape.backward):
        try:
            # as dispatch runs it: a late-dgamma backward keeps its register cap (the table entry measured
            # one CTA an SM where dispatch ran two, LayerNorm fp32 2048 with a residual)
            t = _late_dgamma_registers(shape.replace(**dict(zip(EXTRAS, values))))
            t.check_arch(arch)
        except ValueError:
            continue
        if t.register_cap >= 64 and t not in out:  # a cap below 64 registers only spills
            out.append(t)
    return _with_pushed_exchanges(_with_merged_moments(out))


def _with_merged_moments(refined: list) -> list:
    """The refinements, and those of LayerNorm forwards of cluster rows again with merged moments."""
    out = list(refined)
    for t in refined:
        try:
            out.append(t.replace(merged_moments=True))
        except ValueError:  # not such a forward
            pass
    return out


def _pushed(shape: Traits) -> Traits:
    """A cluster row's shape with pushed exchanges: how cluster rows are screened, as the pushed exchange was
    faster than the barrier one for 20 of the 21 picks measured in version 61 (H200 and H100, bf16,
    16384-131072); the barrier one stays a refinement (the loss: an unstaged RMSNorm forward at 65536)."""
    return shape.replace(pushed_exchange=True) if shape.uses_cluster else shape


def _with_pushed_exchanges(refined: list) -> list:
    """The refinements, and those of cluster rows again with the other exchange (barrier or pushed)."""
    return list(refined) + [t.replace(pushed_exchange=not t.pushed_exchange) for t in refined if t.uses_cluster]


def _incumbent(job: Job, arch: int, gpu) -> Traits | None:
    """What dispatch picks for the job's call on this GPU today (its tables, the literal, the heuristic)."""
    from .dispatch import choose

    try:
        return choose(arch=arch, gpu=gpu, **job.call_fields())[0]
    except ValueError:
        return None


def compiles_clean(traits: Traits, device_id: int) -> bool:
    """Whether `traits` compile (CuPy caches them) to kernels without local
    memory: a kernel that spills or keeps a stack frame is never a candidate
    (dispatch would replace it, `plan._plan`)."""
    from .compiler import kernels_for

    try:
        kernels = kernels_for(traits, device_id)
    except Exception:  # fails to compile or load: not a candidate
        return False
    return not any(k.local_bytes for k in kernels.values())


def _check_time(deadline: float | None):
    if deadline is not None and clock() >= deadline:
        raise OutOfTime


def _compiled(traits_list, device_id: int, skip=frozenset()) -> list:
    """The candidates that compile clean (compiled in parallel), in order, each once and none of `skip`. A
    cluster row whose pushed exchange spills or fails to compile (NVRTC before 12.1) stands in with the
    barrier exchange, unless that one is there already."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=16) as pool:
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


def _time_all(traits_list, case, device_id: int, tick, echo, deadline=None, skip=frozenset()) -> list:
    """[(ms, traits)] fastest first for the candidates `_compiled` keeps (a spilling pushed exchange
    replaced by the barrier one), each timed once; `tick(1)` per candidate."""
    from . import bench

    clean = _compiled(traits_list, device_id, skip)
    tick(len(traits_list) - len(clean))
    timed = []
    for t in clean:
        _check_time(deadline)
        try:
            timed.append((bench.median_ms(functools.partial(case.call, traits=t.knobs()), repeat=REPEAT,
                                          warmup=2, batch=5), t))
        except Exception as e:  # a candidate that fails to launch is reported, not fatal
            echo(f"  {t.short()}: {type(e).__name__}: {str(e).splitlines()[0]}")
        tick(1)
    timed.sort(key=lambda p: p[0])
    return timed


def rank(shapes, case, device_id: int, arch: int, tick, echo, deadline=None, keep: int = KEEP) -> list:
    """[(ms, traits)] fastest first: every shape, then the extras on the `keep` fastest; each traits once."""
    ranked = _time_all(shapes, case, device_id, tick, echo, deadline)
    extras = [t for _, shape in ranked[:keep] for t in refinements(shape, arch)]
    timed = _time_all(extras, case, device_id, tick, echo, deadline, skip={t for _, t in ranked})
    return sorted(ranked + timed, key=lambda p: p[0])


def _steps(shapes: list, backward: bool, keep: int, finalists: int, rounds: int) -> int:
    """Progress steps of a key, about: shapes, extras, final rounds and checks, the incumbent's beside the
    finalists' (the bar is filled at the key's end; cluster rows' extras are also tried with the other
    exchange, not counted here)."""
    return len(shapes) + keep * len(list(_extras(backward))) + (finalists + 1) * (rounds + 1)


def current_gpu() -> tuple:
    """(device id, architecture, tables.GPU) of CuPy's current device: what is measured, and whose table it fills."""
    import cupy

    from .compiler import device_arch, device_gpu

    device_id = cupy.cuda.Device().id
    return device_id, device_arch(device_id), device_gpu(device_id)


def tune(hidden_size: int, dtype: str = "bfloat16", backward: bool = False, keep: int = KEEP, rms: bool = False,
         residual: bool = False, warps_n=None, out=sys.stdout) -> list:
    """[(ms, traits)] sorted fastest first: every shape timed once, then the
    extras on the `keep` fastest shapes (the ranking step of `cunorm tune`;
    nothing is written)."""
    from .bench import progress

    device_id, arch, _ = current_gpu()
    job = Job.of(hidden_size, dtype, backward, rms, residual)
    shapes = candidates(hidden_size, dtype, backward, arch, rms, residual, warps_n)
    with progress(_steps(shapes, backward, keep, 0, 0), f"tuning {job.label()}", out) as (bar, echo):
        return rank(shapes, job.workload(), device_id, arch, bar.update, echo, keep=keep)


def final_rounds(ranked: list, case, rounds: int, tick, deadline=None, finalists: int = FINALISTS,
                 incumbent: Traits | None = None) -> list:
    """[(times, traits)] of the `finalists` fastest of `ranked`, and of
    `incumbent` (or the barrier twin that stood in for its spilling pushed
    exchange) where it was ranked lower, each timed once a round, the rounds
    interleaved so that drift hits them alike; best median first. An
    incumbent that did not compile clean or launch is not in `ranked`, and
    not timed."""
    from . import bench

    times = {t: [] for _, t in ranked[:finalists]}
    timed = {t for _, t in ranked}
    if incumbent is not None:
        twins = [incumbent, incumbent.replace(pushed_exchange=False)] if incumbent.pushed_exchange else [incumbent]
        for t in twins:
            if t in timed:
                times.setdefault(t, [])
                break
    for _ in range(rounds):
        for t, ms in times.items():
            _check_time(deadline)
            ms.append(bench.median_ms(functools.partial(case.call, traits=t.knobs()), repeat=REPEAT, warmup=2,
                                      batch=5))
            tick(1)
    return sorted(((ms, t) for t, ms in times.items()), key=lambda p: float(np.median(p[0])))


def check_knobs(job: Job, knobs: dict, seed: int = 0, asarray=None) -> list:
    """What fails the float64 check when the job's op runs with `knobs`
    forced: a line per output beyond check.TOLERANCE (empty: it passes).
    check.run_case checks dispatch's own choice; this feeds inputs of the
    same kind (rows offset from zero, allocations poisoned with NaN) through
    `traits=` and compares with cunorm.reference, at the checker's row counts.
    `asarray` moves the host-drawn inputs to the op: cupy.asarray by default;
    numpy.asarray runs the op's numpy path."""
    from . import reference
    from .check import DEFAULT_ROWS, TOLERANCE, dx_scale_of, poisoned_allocations, rel_l2, tolerance
    from .norm import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward

    if asarray is None:
        import cupy

        asarray = cupy.asarray
    k, n, eps = job.key, job.n, 1e-5
    gen = np.random.default_rng(seed)

    def draw(*shape, scale=1.0, shift=0.0):
        wide = np.float64 if job.dtype == "float64" else np.float32  # fp64 inputs use all their bits
        return asarray((gen.standard_normal(shape, dtype=wide) * scale + shift).astype(
            dtypes.numpy_dtype(job.dtype)))

    failures = []
    for m in sorted({min(r, max(1, CHECK_ELEMENTS // n)) for r in DEFAULT_ROWS}):
        # Rows far from zero mean, so that a one-pass variance would show.
        x = draw(m, n, shift=gen.uniform(1, 3, (m, 1)).astype(np.float32))
        w, b = draw(n, scale=0.5, shift=1.0), None if k.rms else draw(n, scale=0.5)
        res = draw(m, n) if k.residual else None
        scales = {}
        if k.backward:
            dy = draw(m, n)
            stats = reference.rms_norm(x, w, eps)[1:] if k.rms else reference.layer_norm(x, w, None, eps)[1:]
            rounded = [asarray(s.astype(dtypes.compute_dtype(job.dtype))) for s in stats]  # as a forward returns
            with poisoned_allocations():
                got = (rms_norm_backward(dy, x, *rounded, w, dresidual=res, traits=knobs) if k.rms else
                       layer_norm_backward(dy, x, *rounded, w, dresidual=res, traits=knobs))
            refs = (reference.rms_norm_backward(dy, x, *stats, w, dresidual=res) if k.rms else
                    reference.layer_norm_backward(dy, x, *stats, w, dresidual=res))
            names = ("dx", "dweight", "dbias")
            # dx is a difference of terms of size |rstd * dy * w|: judged against them, as the checker does.
            scales["dx"] = dx_scale_of(dy, w, False, stats[-1])
        else:
            h = reference.add_residual(x, res)
            with poisoned_allocations():
                got = (rms_norm(x, w, eps, residual=res, return_stats=True, traits=knobs) if k.rms else
                       layer_norm(x, w, b, eps, residual=res, return_stats=True, traits=knobs))
            y, *stats = reference.rms_norm(h, w, eps) if k.rms else reference.layer_norm(h, w, b, eps)
            refs = (y, *([h] if k.residual else []), *stats)
            names = ("y", *(["residual_out"] if k.residual else []), *(["rstd"] if k.rms else ["mean", "rstd"]))
        for name, value, ref in zip(names, got, refs):
            tol = TOLERANCE[dtypes.compute_dtype(job.dtype)] if name in ("mean", "rstd") else tolerance(job.dtype,
                                                                                                       job.dtype)
            error = rel_l2(value, ref, scales.get(name, 0.0))
            if not error <= tol:  # NaN fails too
                failures.append(f"{name} at {m} rows: rel-L2 {error:.1e} > {tol:.0e}")
    return failures


def measure(job: Job, shapes: list, device_id: int, arch: int, copy: float, rounds: int, tick, echo,
            deadline=None, finalists: int = FINALISTS, incumbent: Traits | None = None) -> dict | None:
    """A key's entry: the knobs of the finalist (`incumbent`, what dispatch
    picks today, among them wherever it was timed) with the best median that
    passes the float64 check, with its median ms and fraction of `copy` (bytes/s of a
    copy), and the fraction's spread [min, max] over the rounds; None when
    no finalist passes."""
    case = job.workload()
    ranked = rank(shapes, case, device_id, arch, tick, echo, deadline)
    for times, t in final_rounds(ranked, case, rounds, tick, deadline, finalists, incumbent):
        failures = check_knobs(job, t.knobs())
        tick(1)
        if failures:
            echo(f"  {t.short()}: fails the float64 check ({'; '.join(failures)}): the next finalist instead")
            continue
        fractions = [case.nbytes / (ms * 1e-3) / copy for ms in times]
        return {"knobs": t.knobs(), "ms": float(np.median(times)), "fraction_of_copy": float(np.median(fractions)),
                "spread": [min(fractions), max(fractions)], "dtype": job.dtype, "measured_n": job.n}
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
    """A key's result, its knobs spelled as `cunorm bench --traits` takes them."""
    knobs = ",".join(f"{k}={int(v)}" for k, v in record["knobs"].items())
    lo, hi = record["spread"]
    return (f"TUNE {job.label()}: {record['fraction_of_copy']:.3f} [{lo:.3f}, {hi:.3f}] of copy, "
            f"{record['ms']:.4f} ms, {knobs}")


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
    incumbents = {j: _incumbent(j, arch, gpu) for j in todo}
    for j in todo:  # what dispatch picks today competes too, up to the final rounds (where it compiles clean)
        incumbent = incumbents[j]
        for t in [incumbent, _pushed(incumbent)] if incumbent is not None else []:  # and pushed exchanges
            if shapes[j] and t not in shapes[j]:
                shapes[j].append(t)
    for job in [j for j in todo if not shapes[j]]:  # nothing to time: say why, not "failed the check"
        todo.remove(job)
        summary["failed"].append(job.label())
        print(f"TUNE {job.label()}: no candidate traits to time (rows of fewer than a vector per thread, or none "
              f"with the WARPS_N values given); dispatch's heuristic serves it", file=out)
    steps = {j: _steps(shapes[j], j.key.backward, KEEP, FINALISTS, rounds) for j in todo}
    copy = bench.copy_bandwidth() if todo else 0.0
    with bench.progress(sum(steps.values()), f"tuning {len(todo)} keys", out) as (bar, echo):
        for i, job in enumerate(todo):
            bar.label = f"tuning {job.label()} (key {i + 1} of {len(todo)})"
            end = bar.pos + steps[job]
            try:
                _check_time(deadline)
                entry = measure(job, shapes[job], device_id, arch, copy, rounds, bar.update, echo, deadline,
                                incumbent=incumbents[job])
            except OutOfTime:
                summary["left"] = [j.label() for j in todo[i:]]
                break
            bar.update(end - bar.pos)  # the steps a key did not need (extras, finalists) at most
            if entry is None:
                summary["failed"].append(job.label())
                echo(f"TUNE {job.label()}: no finalist passed the float64 check; nothing saved")
                continue
            table.put(job.key, entry["knobs"], **{k: v for k, v in entry.items() if k != "knobs"})
            tables.save(table, path)
            record = {**dataclasses.asdict(job.key), **entry, "table": str(path)}
            summary["tuned"].append(record)
            echo(_tune_line(job, record))
            if as_json:
                print(json.dumps(record), flush=True)
    print(f"{len(summary['tuned'])} keys tuned into {path}; {len(summary['skipped'])} skipped, "
          f"{len(summary['failed'])} failed", file=out)
    if summary["left"]:
        print(f"budget of {budget:g} s spent: {len(summary['left'])} keys left, from {summary['left'][0]} (run "
              f"again to go on)", file=out)
    return summary


if __name__ == "__main__":
    from .cli import tune as command

    command(prog_name="python -m cunorm.tune")
