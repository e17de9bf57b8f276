"""`cunorm tune` and cunorm.tune, the command and a run: options, what a run saves and reports, the
float64 check of candidates; tier A on the stand-in GPU (tune_stand_in), tier C (marked gpu) a small
tune. How candidates are ranked: test_tune_ranking."""
import json

import numpy as np
import pytest

from cunorm import check, cli, compiler, dispatch, search_space, tables, tune
from cunorm.compiler import CompileError
from tune_stand_in import (COPY, GPU, NBYTES, TUNE_OPTIONS, fake_ms, frozen, gpu, incumbent,  # noqa: F401 (gpu: the fixture)
                           op_of, run_tune, runner, saved)


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
                          "fraction_of_copy", "spread", "dtype", "measured_n", "table", "incumbent", "found_by"}
               for r in lines)
    assert all(r["found_by"] in tune.PASSES for r in lines)
    # what ran before: the sm_90 literal's backwards, the heuristic's forwards
    assert [(r["backward"], r["incumbent"]["origin"]) for r in lines] == [(False, "heuristic"), (True, "tuned")] * 2
    assert all(set(r["incumbent"]) == {"knobs", "ms", "fraction_of_copy", "spread", "origin"} for r in lines)
    entries = saved().entries
    for r in lines:
        key = tables.Key(**{k: r[k] for k in ("backward", "rms", "residual", "n", "input_bytes", "general")})
        assert entries[key]["knobs"] == r["knobs"] and entries[key]["ms"] == r["ms"]
        assert "found_by" not in entries[key]  # the run's record, not the table's
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

    from cunorm.check import runs

    monkeypatch.setattr(runs, "rel_l2", host_rel_l2)
    job = search_space.Job.of(1000, "bfloat16", *search_space.OPS[op], residual)
    assert check.check_knobs(job, {"warps_n": 4}, asarray=np.asarray) == []
    name = f"{'rms_norm' if job.key.rms else 'layer_norm'}{'_backward' if job.key.backward else ''}"
    right, (index, output) = getattr(cunorm.norm, name), WRONG_OUTPUT[op, residual]

    def wrong(*args, **kwargs):
        return tuple(v * 1.05 if i == index else v for i, v in enumerate(right(*args, **kwargs)))

    monkeypatch.setattr(cunorm.norm, name, wrong)
    failures = check.check_knobs(job, {"warps_n": 4}, asarray=np.asarray)
    assert failures and all(f.startswith(f"{output} at ") for f in failures), failures


# -- tier C ------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("op", list(search_space.OPS))
def test_check_knobs_passes_dispatchs_knobs_on_the_gpu(op):
    job = search_space.Job.of(4097, "bfloat16", *search_space.OPS[op], residual=True)
    traits, _ = dispatch.choose(arch=compiler.device_arch(0), tuned=False, **job.call_fields())
    assert check.check_knobs(job, traits.knobs()) == []


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


def test_a_new_entry_reports_what_it_replaced_from_the_same_rounds(gpu):
    """The incumbent's final-round reading rides along in the JSON record and the TUNE line (a re-tune's
    before and after from one run), and stays out of the table."""
    key = search_space.Job.of(1024, "bfloat16").key
    incumbent = dict(warps_m=4, warps_n=1, ctas_per_row=1, bytes_per_ldg=8, stages=4, cache_weights=False,
                     min_ctas_per_sm=1, smem_accumulators=False, recompute=True, lanes_per_row=32, persistent=True,
                     merged_moments=False, pushed_exchange=False, register_sum_steps=0, unchecked_whole_steps=False,
                     sum_chains=1, register_ahead=False, stats_ahead=False)
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
                merged_moments=False, pushed_exchange=False, register_sum_steps=0, unchecked_whole_steps=False,
                sum_chains=1, register_ahead=False, stats_ahead=False)
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
