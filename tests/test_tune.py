"""`cunorm tune` and cunorm.tune: tier A on a stand-in GPU whose calls report
their own time (and advance a stand-in clock), whose compiles report local
memory for planted knobs and whose float64 check fails for planted knobs;
the real code paths run around them. Tier C (marked gpu) runs a small tune."""
import collections
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from cunorm import bench, check, cli, compiler, dispatch, search_space, tables, tune
from cunorm.compiler import CompileError, Kernel

TUNE_OPTIONS = ("--sizes", "--ops", "--residual", "--dtypes", "--budget", "--rounds", "--output", "--fresh",
                "--warps-n", "--json")
GPU = tables.GPU("Stand-in GPU", 90, 132)
NBYTES, COPY = 10**9, 2e12  # the stand-in's bytes per call and copy bandwidth


def runner() -> CliRunner:
    """A runner whose result.stdout is stdout alone (click 8.1 mixes stderr in unless told not to)."""
    try:
        return CliRunner(mix_stderr=False)
    except TypeError:  # click 8.2+: always apart
        return CliRunner()


def fake_ms(knobs: dict) -> float:
    """The stand-in's milliseconds per call: fastest at WARPS_N=4, WARPS_M=2, one CTA a row, 16-byte loads
    and 3 stages, every knob weighing a little, so that candidates rarely tie."""
    return (1.0 + 0.1 * abs(math.log2(knobs["warps_n"]) - 2) + 0.05 * math.log2(knobs["ctas_per_row"])
            + 0.03 * abs(math.log2(knobs["warps_m"]) - 1) + 0.01 * (knobs["bytes_per_ldg"] != 16)
            + 0.003 * abs(knobs["stages"] - 3) + 0.0005 * knobs["stages"] + 0.001 * knobs["min_ctas_per_sm"]
            + 0.0003 * (not knobs["cache_weights"]) + 0.0001 * knobs["smem_accumulators"]
            + 0.00003 * (not knobs["recompute"]))


def frozen(knobs: dict) -> tuple:
    return tuple(sorted(knobs.items()))


def op_of(key: tables.Key) -> str:
    """The name bench.norm_cases gives the call a key is timed on."""
    return (f"{'rms_norm' if key.rms else 'layer_norm'}{'+residual' if key.residual else ''} "
            f"{'bwd' if key.backward else 'fwd'}")


class StandIn:
    """The stand-in GPU's state: the clock (a second per timed call), every timed call (op, N, dtype, knobs),
    every check (knobs), the planted knobs that spill or fail the check, and a size whose arrays are never
    made (the device is lost there)."""

    def __init__(self):
        self.now = 0.0
        self.ms = fake_ms  # (knobs) -> the call's milliseconds
        self.timed, self.checked = [], []
        self.spills = set()
        self.fails = lambda knobs: False
        self.lost_at = None

    def norm_cases(self, sizes, dtype, weight_dtype=None, ops=bench.PLAIN_OPS, directions=bench.DIRECTIONS,
                   native=False):
        for n in sizes:
            if n == self.lost_at:
                raise RuntimeError("the device is lost")
            for op in ops:
                for direction in directions:
                    def call(op=f"{op} {direction}", n=n, traits=None):
                        self.now += 1.0
                        self.timed.append((op, n, dtype, frozen(traits)))
                        return self.ms(traits)
                    yield bench.Case(f"{op} {direction}", n, NBYTES, call)

    def kernels_for(self, traits, device_id, source=None):
        local = 64 if frozen(traits.knobs()) in self.spills else 0
        return {"norm": Kernel(None, traits.threads_per_cta, 0, 1, GPU.sms, traits.ctas_per_row, GPU.sms, local)}

    def check_knobs(self, job, knobs):
        self.checked.append(frozen(knobs))
        return ["dx at 37 rows: rel-L2 1.0e-01 > 8e-03"] if self.fails(knobs) else []

    def timed_knobs(self, key: tables.Key, n: int, dtype: str) -> list:
        """The distinct knobs timed for a key, fastest first."""
        found = {k for op, m, d, k in self.timed if (op, m, d) == (op_of(key), n, dtype)}
        return sorted(found, key=lambda k: (fake_ms(dict(k)), k))


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """The stand-in GPU, its user table under tmp_path (CUNORM_CACHE_DIR)."""
    stand_in = StandIn()
    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.setattr(cli, "gpu_count", lambda: 1)
    monkeypatch.setattr(tune, "current_gpu", lambda: (0, 90, GPU))
    monkeypatch.setattr(tune, "clock", lambda: stand_in.now)
    monkeypatch.setattr(tune, "check_knobs", stand_in.check_knobs)
    monkeypatch.setattr(compiler, "kernels_for", stand_in.kernels_for)
    monkeypatch.setattr(compiler, "cuda_version", lambda: 12080)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: COPY)
    monkeypatch.setattr(bench, "median_ms", lambda fn, *args, **kwargs: fn())
    monkeypatch.setattr(bench, "norm_cases", stand_in.norm_cases)
    tables.forget()
    yield stand_in
    tables.forget()


def run_tune(*args):
    return runner().invoke(cli.main, ["tune", *args])


def saved(path=None) -> tables.Table:
    return tables.read(path or tables.user_path(GPU), GPU, "test")


# -- options ---------------------------------------------------------------------------------------------------

def test_help_lists_every_option_and_where_the_table_goes():
    res = run_tune("--help")
    assert res.exit_code == 0, res.output
    assert [o for o in TUNE_OPTIONS if o not in res.stdout] == []
    assert "CUNORM_CACHE_DIR" in res.stdout


@pytest.mark.parametrize("args", [["--sizes", "1024,0"], ["--sizes", ""], ["--ops", "fwd,sideways"],
                                  ["--residual", "maybe"], ["--dtypes", "fp8"], ["--dtypes", ""],
                                  ["--rounds", "0"], ["--budget", "0"], ["--warps-n", "four"]])
def test_what_does_not_parse_is_a_usage_error(args, monkeypatch):
    monkeypatch.setattr(cli, "gpu_count", lambda: 0)  # refused as usage (2) before the GPU is looked for (3)
    res = run_tune(*args)
    assert res.exit_code == 2, res.output


def test_without_gpu_exit_3_with_json(monkeypatch):
    monkeypatch.setattr(cli, "gpu_count", lambda: 0)
    res = run_tune("--ops", "rms", "--residual", "both", "--budget", "60", "--json")
    assert res.exit_code == cli.EXIT_NO_GPU
    assert json.loads(res.stdout) == {"error": "no CUDA GPU found", "exit": cli.EXIT_NO_GPU}


def test_ops_are_comma_separated_or_repeated(gpu):
    res = run_tune("--sizes", "1024", "--ops", "rms-bwd,fwd", "--ops", "fwd", "--json")
    assert res.exit_code == 0, res.output
    assert [(r["backward"], r["rms"]) for r in map(json.loads, res.stdout.splitlines())] == [(True, True),
                                                                                            (False, False)]


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


def incumbent(n: int, op: str):
    """The traits that run the stand-in's call today (`op` a short name; `tune.what_runs`): here dispatch's pick."""
    backward, rms = search_space.OPS[op]
    return tune._incumbent(search_space.Job.of(n, "bfloat16", backward, rms), 90, GPU, 0)[0]


def screenings(timed: set, shapes: set, ms=fake_ms) -> dict:
    """{knobs: how often screened} of the stand-in's timed knobs, `shapes` those of the first pass (the rest its
    extras): twice within SECOND_LOOK of the first pass's fastest, or for an extra of both passes' fastest."""
    first = min(ms(dict(k)) for k in timed & shapes)
    extras = min((ms(dict(k)) for k in timed - shapes), default=first)
    bar = {True: first * (1 + tune.SECOND_LOOK), False: min(first, extras) * (1 + tune.SECOND_LOOK)}
    return {k: 2 if ms(dict(k)) <= bar[k in shapes] else 1 for k in timed}


def test_each_candidate_is_screened_once_or_twice_before_the_final_rounds(gpu):
    """A barrier shape standing in for a spilling pushed one, already there itself (dispatch's pick, a
    refinement's twin), is not screened again (but for the second look near the fastest): so FINALISTS
    distinct shapes reach the final rounds, and dispatch's pick beside them where it screened lower."""
    gpu.spills = _Pushed()
    rounds = 2
    picks = {op: incumbent(65536, op) for op in ("fwd", "rms-bwd")}  # before the run writes the user table
    assert run_tune("--sizes", "65536", "--ops", "fwd,rms-bwd", "--rounds", str(rounds)).exit_code == 0
    for key in saved().entries:
        op = op_of(key)
        counts = collections.Counter(k for o, n, d, k in gpu.timed if o == op)
        pick_of_op = picks["rms-bwd" if key.backward else "fwd"]
        first_pass = {frozen(t.replace(pushed_exchange=False).knobs())  # pushed ones spill: their barrier twins
                      for t in [*search_space.candidates(65536, "bfloat16", key.backward, 90, key.rms), pick_of_op,
                                search_space.with_pushed_exchange(pick_of_op)]}
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


# -- a run -----------------------------------------------------------------------------------------------------

def test_a_run_writes_the_table_dispatch_reads(gpu):
    res = run_tune("--sizes", "1024,4100", "--ops", "fwd,rms-bwd", "--residual", "both", "--dtypes", "bf16,fp32",
                   "--rounds", "3")
    assert res.exit_code == 0, res.output
    jobs, _ = search_space.plan((1024, 4100), ("fwd", "rms-bwd"), (False, True), ("bfloat16", "float32"))
    table = saved()
    assert set(table.entries) == {j.key for j in jobs} and len(jobs) == 16
    assert tables.Key(False, False, True, 4096, 2, True) in table.entries  # bf16 4100: the general rows' entry
    for job in jobs:
        entry = table.entries[job.key]
        fastest = gpu.timed_knobs(job.key, job.n, job.dtype)[0]
        assert frozen(entry["knobs"]) == fastest
        assert entry["ms"] == pytest.approx(fake_ms(entry["knobs"]))
        assert entry["fraction_of_copy"] == pytest.approx(NBYTES / (entry["ms"] * 1e-3) / COPY)
        assert entry["spread"][0] <= entry["fraction_of_copy"] <= entry["spread"][1]
        assert (entry["dtype"], entry["measured_n"]) == (job.dtype, job.n)
        traits, origin = dispatch.choose(arch=90, gpu=GPU, **job.call_fields())
        assert origin.startswith("user table") and traits.knobs() == entry["knobs"], job.label()
    assert res.stdout.count("TUNE ") == 16 and "16 keys tuned into" in res.stdout


def test_a_rerun_skips_finished_keys_and_fresh_measures_them_again(gpu):
    assert run_tune("--sizes", "1024", "--ops", "fwd").exit_code == 0
    first = len(gpu.timed)
    gpu.timed.clear()
    res = run_tune("--sizes", "1024,4096", "--ops", "fwd")
    assert res.exit_code == 0 and "1 of 2 keys already in" in res.stdout
    assert gpu.timed and {n for _, n, _, _ in gpu.timed} == {4096}
    second, before = len(gpu.timed), tables.user_path(GPU).read_text()
    gpu.timed.clear()
    res = run_tune("--sizes", "1024,4096", "--ops", "fwd")
    assert res.exit_code == 0 and gpu.timed == [] and tables.user_path(GPU).read_text() == before
    res = run_tune("--sizes", "1024,4096", "--ops", "fwd", "--fresh")
    # Both keys again (the counts differ a little: each key's saved entry now competes as the incumbent).
    assert res.exit_code == 0 and {n for _, n, _, _ in gpu.timed} == {1024, 4096}
    assert len(gpu.timed) > max(first, second)
    gpu.timed.clear()
    res = run_tune("--sizes", "4096", "--ops", "bwd", "--fresh")  # other entries stay
    assert res.exit_code == 0 and {k.n for k in saved().entries} == {1024, 4096} and len(saved().entries) == 3


def test_the_budget_stops_the_run_and_the_table_holds_the_finished_keys(gpu, tmp_path):
    assert run_tune("--sizes", "1024", "--ops", "fwd", "--output", str(tmp_path / "alone.json")).exit_code == 0
    one_key = gpu.now  # seconds (calls) the first key takes
    gpu.now, budget = 0.0, one_key + 5
    gpu.timed.clear()
    res = run_tune("--sizes", "1024,4096,8192", "--ops", "fwd", "--budget", f"{budget:g}", "--json")
    assert res.exit_code == 0, res.output
    assert [k.n for k in saved().entries] == [1024]
    assert [json.loads(line)["n"] for line in res.stdout.splitlines()] == [1024]
    assert gpu.now <= budget + 1 and {n for _, n, _, _ in gpu.timed} == {1024, 4096}  # stopped inside 4096
    assert f"budget of {budget:g} s spent: 2 keys left, from fwd N=4096" in res.stderr
    gpu.timed.clear()
    assert run_tune("--sizes", "1024,4096,8192", "--ops", "fwd").exit_code == 0
    assert {k.n for k in saved().entries} == {1024, 4096, 8192} and 1024 not in {n for _, n, _, _ in gpu.timed}


def test_a_run_cut_short_keeps_the_keys_it_finished(gpu):
    gpu.lost_at = 4096
    res = run_tune("--sizes", "1024,4096", "--ops", "fwd")
    assert res.exit_code != 0 and "the device is lost" in str(res.exception)
    assert [k.n for k in saved().entries] == [1024]


def test_a_winner_that_spills_is_never_timed_or_saved(gpu):
    assert run_tune("--sizes", "4096", "--ops", "bwd").exit_code == 0
    key = search_space.Job.of(4096, "bfloat16", backward=True).key
    fastest = frozen(saved().entries[key]["knobs"])
    gpu.spills.add(fastest)
    gpu.timed.clear()
    assert run_tune("--sizes", "4096", "--ops", "bwd", "--fresh").exit_code == 0
    ranked = gpu.timed_knobs(key, 4096, "bfloat16")
    assert fastest not in ranked and frozen(saved().entries[key]["knobs"]) == ranked[0] != fastest


def test_a_winner_failing_the_check_gives_way_to_the_next_finalist(gpu):
    key = search_space.Job.of(4096, "bfloat16").key
    fastest = {}
    gpu.fails = lambda knobs: not fastest or frozen(knobs) == fastest["knobs"]
    res = run_tune("--sizes", "4096", "--ops", "fwd")  # every check fails: nothing is saved
    assert res.exit_code == cli.EXIT_FAIL and "no finalist passed" in res.stdout
    ranked = gpu.timed_knobs(key, 4096, "bfloat16")
    finalists = set(ranked[:tune.FINALISTS]) | {frozen(incumbent(4096, "fwd").knobs())}  # dispatch's pick too
    assert not tables.user_path(GPU).exists() and sorted(gpu.checked) == sorted(finalists)
    fastest["knobs"] = ranked[0]
    gpu.checked.clear()
    res = run_tune("--sizes", "4096", "--ops", "fwd")
    assert res.exit_code == 0, res.output
    assert gpu.checked == ranked[:2] and frozen(saved().entries[key]["knobs"]) == ranked[1]
    assert "fails the float64 check (dx at 37 rows" in res.stdout


def test_json_one_object_per_key_on_stdout_progress_on_stderr(gpu):
    res = run_tune("--sizes", "1024,4096", "--ops", "fwd,bwd", "--json")
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    path = str(tables.user_path(GPU))
    assert len(lines) == 4 and {r["table"] for r in lines} == {path}
    assert all(set(r) == {"backward", "rms", "residual", "n", "input_bytes", "general", "knobs", "ms",
                          "fraction_of_copy", "spread", "dtype", "measured_n", "table", "incumbent"} for r in lines)
    # what ran before: the sm_90 literal's backwards, the heuristic's forwards
    assert [(r["backward"], r["incumbent"]["origin"]) for r in lines] == [(False, "heuristic"), (True, "tuned")] * 2
    assert all(set(r["incumbent"]) == {"knobs", "ms", "fraction_of_copy", "spread", "origin"} for r in lines)
    entries = saved().entries
    for r in lines:
        key = tables.Key(**{k: r[k] for k in ("backward", "rms", "residual", "n", "input_bytes", "general")})
        assert entries[key]["knobs"] == r["knobs"] and entries[key]["ms"] == r["ms"]
    assert "tuning fwd N=1024 bfloat16 (key 1 of 4)" in res.stderr and res.stderr.count("TUNE ") == 4
    assert "tuning" not in res.stdout and "TUNE" not in res.stdout


def other_version() -> str:
    table = tables.new_table(GPU)
    table.cunorm = "0.0.1"
    table.put(search_space.Job.of(1024, "bfloat16").key, {"warps_n": 8})
    return table.to_json()


@pytest.mark.parametrize("old", ["{not json", lambda: other_version(),
                                 lambda: tables.new_table(tables.GPU("Other GPU", 80, 108)).to_json()])
def test_an_unusable_table_warns_once_and_is_kept_beside(old, gpu):
    old = old() if callable(old) else old
    path = tables.user_path(GPU)
    path.parent.mkdir(parents=True)
    path.write_text(old)
    res = run_tune("--sizes", "1024,4096", "--ops", "fwd")
    assert res.exit_code == 0, res.output
    assert res.stderr.count("warning") == 1 and f"{path} cannot be used" in res.stderr
    assert path.with_name(path.name + ".bak").read_text() == old
    assert {k.n for k in saved().entries} == {1024, 4096}
    assert len(gpu.timed) > 0


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


def host_rel_l2(out, ref, scale: float = 0.0) -> float:
    """check.rel_l2 on the host, for the numpy path."""
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape or not np.isfinite(out).all():
        return float("inf")
    return float(np.linalg.norm(out - ref)) / (max(float(np.linalg.norm(ref)), scale) or 1.0)


# Per (op, residual): the output the planted op gets wrong, by its place in what the op returns, and its name.
WRONG_OUTPUT = {("fwd", False): (0, "y"), ("fwd", True): (1, "residual_out"), ("rms", False): (1, "rstd"),
                ("rms", True): (2, "rstd"), ("bwd", False): (2, "dbias"), ("bwd", True): (0, "dx"),
                ("rms-bwd", False): (1, "dweight"), ("rms-bwd", True): (0, "dx")}


@pytest.mark.parametrize("op,residual", list(WRONG_OUTPUT))
def test_check_knobs_compares_every_output_with_the_reference(op, residual, monkeypatch):
    """On the numpy path the op is the reference, so a correct op passes; an op with one output off by 5%
    fails on that output alone."""
    import cunorm.norm

    monkeypatch.setattr(check, "rel_l2", host_rel_l2)
    job = search_space.Job.of(1000, "bfloat16", *search_space.OPS[op], residual)
    assert tune.check_knobs(job, {"warps_n": 4}, asarray=np.asarray) == []
    name = f"{'rms_norm' if job.key.rms else 'layer_norm'}{'_backward' if job.key.backward else ''}"
    right, (index, output) = getattr(cunorm.norm, name), WRONG_OUTPUT[op, residual]

    def wrong(*args, **kwargs):
        return tuple(v * 1.05 if i == index else v for i, v in enumerate(right(*args, **kwargs)))

    monkeypatch.setattr(cunorm.norm, name, wrong)
    failures = tune.check_knobs(job, {"warps_n": 4}, asarray=np.asarray)
    assert failures and all(f.startswith(f"{output} at ") for f in failures), failures


# -- tier C ------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("op", list(search_space.OPS))
def test_check_knobs_passes_dispatchs_knobs_on_the_gpu(op):
    job = search_space.Job.of(4097, "bfloat16", *search_space.OPS[op], residual=True)
    traits, _ = dispatch.choose(arch=compiler.device_arch(0), tuned=False, **job.call_fields())
    assert tune.check_knobs(job, traits.knobs()) == []


@pytest.mark.gpu
def test_a_small_tune_on_the_gpu_fills_the_table_dispatch_reads(tmp_path, monkeypatch):
    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path))
    res = runner().invoke(cli.main, ["tune", "--sizes", "1024", "--ops", "rms", "--rounds", "2", "--json"])
    assert res.exit_code == 0, res.output
    (line,) = [json.loads(line) for line in res.stdout.splitlines()]
    gpu = compiler.device_gpu(0)
    table = tables.read(line["table"], gpu, "test")
    job = search_space.Job.of(1024, "bfloat16", rms=True)
    assert table.entries[job.key]["knobs"] == line["knobs"] and 0 < line["fraction_of_copy"] < 1.5
    traits, origin = dispatch.choose(arch=compiler.device_arch(0), gpu=gpu, **job.call_fields())
    assert origin.startswith("user table") and traits.knobs() == line["knobs"]
    tables.forget()


def test_a_key_without_candidates_says_why_and_times_nothing(gpu):
    res = run_tune("--sizes", "1024", "--ops", "fwd", "--warps-n", "64")  # WARPS_N=64 is never legal
    assert res.exit_code == 1 and "no candidate traits to time" in res.output
    assert "float64" not in res.output and not gpu.timed and not tables.user_path(GPU).exists()


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
    # register_sum_steps, unchecked_whole_steps here) is timed with that knob's default.
    defaults = {"lanes_per_row": 32, "persistent": True, "merged_moments": False, "pushed_exchange": False,
                "register_sum_steps": 0, "unchecked_whole_steps": False}
    assert frozen({**incumbent, **defaults}) in gpu.timed_knobs(key, 1024, "bfloat16")


def test_a_new_entry_reports_what_it_replaced_from_the_same_rounds(gpu):
    """The incumbent's final-round reading rides along in the JSON record and the TUNE line (a re-tune's
    before and after from one run), and stays out of the table."""
    key = search_space.Job.of(1024, "bfloat16").key
    incumbent = dict(warps_m=4, warps_n=1, ctas_per_row=1, bytes_per_ldg=8, stages=4, cache_weights=False,
                     min_ctas_per_sm=1, smem_accumulators=False, recompute=True, lanes_per_row=32, persistent=True,
                     merged_moments=False, pushed_exchange=False, register_sum_steps=0, unchecked_whole_steps=False)
    table = tables.new_table(GPU)
    table.put(key, incumbent, ms=1.0, fraction_of_copy=0.5, spread=[0.5, 0.5], dtype="bfloat16", measured_n=1024)
    tables.save(table)
    res = run_tune("--sizes", "1024", "--ops", "fwd", "--fresh", "--json")
    assert res.exit_code == 0, res.output
    record = json.loads(res.stdout.splitlines()[0])
    before = record["incumbent"]
    assert before["knobs"] == incumbent and record["knobs"] != incumbent
    slow = NBYTES / (fake_ms(incumbent) * 1e-3) / COPY  # the stand-in reads the same every round
    assert before["fraction_of_copy"] == pytest.approx(slow) and before["spread"] == pytest.approx([slow, slow])
    assert before["ms"] == pytest.approx(fake_ms(incumbent)) and record["fraction_of_copy"] > slow
    assert f"; dispatch's pick before: {slow:.3f} [{slow:.3f}, {slow:.3f}]" in res.stderr
    assert "incumbent" not in saved().entries[key] and saved().entries[key]["knobs"] == record["knobs"]


def test_a_pick_that_spills_competes_as_what_replaces_it(gpu):
    """Where dispatch's pick compiles with spills for the call (general rows borrowing an aligned entry, say),
    what runs in its place (dispatch.without_spills: here the same shape at half its CTAs an SM) is timed in
    the final rounds and reported, with its origin, as the pick before; the pick itself is never timed."""
    job = search_space.Job.of(1024, "bfloat16", True)
    pick = dict(warps_m=4, warps_n=1, ctas_per_row=1, bytes_per_ldg=8, stages=1, cache_weights=False,
                min_ctas_per_sm=2, smem_accumulators=True, recompute=True, lanes_per_row=32, persistent=True,
                merged_moments=False, pushed_exchange=False, register_sum_steps=0, unchecked_whole_steps=False)
    table = tables.new_table(GPU)
    table.put(job.key, pick, ms=1.0, fraction_of_copy=0.5, spread=[0.5, 0.5], dtype="bfloat16", measured_n=1024)
    tables.save(table)
    gpu.spills = {frozen(pick)}
    runs_instead = {**pick, "min_ctas_per_sm": 1}
    res = run_tune("--sizes", "1024", "--ops", "bwd", "--fresh", "--json")
    assert res.exit_code == 0, res.output
    before = json.loads(res.stdout.splitlines()[0])["incumbent"]
    assert before["knobs"] == runs_instead and before["origin"].endswith(dispatch.HALF_CTAS)
    assert f"({before['origin']})" in res.stderr
    timings = [k for op, m, d, k in gpu.timed if (op, m) == (op_of(job.key), 1024)]
    assert timings.count(frozen(runs_instead)) >= tune.ROUNDS and frozen(pick) not in timings


def test_a_pick_that_does_not_compile_is_not_timed_and_the_key_is_tuned(gpu, monkeypatch):
    """A pick whose compile fails (the call fails today) stands as it is (`tune.what_runs`): never timed, no
    reading before, and the key is tuned all the same."""
    job = search_space.Job.of(1024, "bfloat16", True)
    broken = incumbent(1024, "bwd")
    stand_in_kernels = compiler.kernels_for

    def kernels_for(traits, device_id, source=None):
        if traits == broken:
            raise CompileError("planted")
        return stand_in_kernels(traits, device_id, source)

    monkeypatch.setattr(compiler, "kernels_for", kernels_for)
    assert tune.what_runs(job.call_fields(), 90, GPU, 0)[0] == broken
    res = run_tune("--sizes", "1024", "--ops", "bwd", "--json")
    assert res.exit_code == 0, res.output
    record = json.loads(res.stdout.splitlines()[0])
    assert "incumbent" not in record and record["incumbent_not_timed"]["knobs"] == broken.knobs()
    assert frozen(broken.knobs()) not in gpu.timed_knobs(job.key, 1024, "bfloat16")
    # the TUNE line says there is no reading before, and why, rather than leaving it out
    assert f"dispatch's pick before ({record['incumbent_not_timed']['origin']}): not timed" in res.stderr
    assert "incumbent_not_timed" not in saved().entries[job.key]


def measured_with(job, shapes: list, incumbent, rounds: int = 4) -> dict:
    """tune.measure's entry for `job` with dispatch's pick `incumbent` among `shapes`, as a run adds it."""
    shapes = shapes + [t for t in (incumbent,) if t not in shapes]
    return tune.measure(job, shapes, 0, 90, COPY, rounds, lambda _: None, print, incumbent=incumbent)


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
    runs_instead = dispatch.fallback(90, **call)  # the literal's pick is persistent at one CTA an SM: no half
    assert runs_instead != pick and row["other"] == dispatch.HEURISTIC_FALLBACK != origin
    timed = gpu.timed_knobs(search_space.Job.of(1024, "bfloat16", True).key, 1024, "bfloat16")
    assert frozen(runs_instead.knobs()) in timed and frozen(pick.knobs()) not in timed
