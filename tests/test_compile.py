"""Tier B: every dispatch entry compiles with NVRTC for sm_80 and sm_90, with
no spills and no stack frame (except the heuristic's documented last resorts
for rows no smaller CTA holds). Needs NVRTC, not a GPU."""
import functools
import itertools

import pytest

import cunorm
from cunorm import Traits, compile_only, dispatch, tables
from cunorm.compiler import parse_ptxas_log
from cunorm.heuristic import heuristic

pytestmark = pytest.mark.nvrtc


@functools.lru_cache(maxsize=None)
def spills(traits, arch: int) -> bool:
    """Whether `traits` compile for sm_<arch> with spills or a stack frame (each variant compiled once a session)."""
    return not compile_only(traits, arch).clean


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_cunorm_check_compile_only_passes(arch):
    """Exactly what `cunorm check --compile-only` compiles (every sweep, the
    command's own code): every variant compiles, no tuned entry spills for a
    dtype mix it serves (where one would, a replacement from dispatch.fallbacks
    runs, as on the GPU), and nothing is refused on sm_90. This is the command a fresh
    install runs, so CI fails where it would."""
    import json

    from click.testing import CliRunner

    from cunorm import cli

    res = CliRunner().invoke(cli.main, ["check", "--compile-only", "--arch", arch, "--json"])
    out = json.loads(res.stdout)
    bad = [f"{v.get('label', '')} {v['verdict']} {v.get('error', '')[:300]}" for v in out["variants"]
           if v["verdict"].startswith("failed")]
    assert res.exit_code == 0 and not bad and out["compiled"] > 500, "\n".join(bad[:20])
    assert all(v["verdict"] == "clean" for v in out["variants"] if v.get("source") == "tuned")
    if arch == "sm_90":
        assert out["refused"] == 0
    for v in out["variants"]:
        if "functions" in v:
            assert {f["name"] for f in v["functions"]} == set(v["kernels"]), v["label"]


@pytest.mark.parametrize("path", sorted(tables.SHIPPED_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_entry_compiles_clean_for_the_call_it_was_measured_on(path):
    """A shipped table's entries are picked only on their GPU model, which `cunorm check --compile-only`
    (no GPU) does not name; an entry that spilled for its own call would never run (dispatch replaces a
    spilling pick), so each compiles without local memory for its GPU's architecture."""
    from cunorm.search_space import Job

    table = tables.Table.from_json(path.read_text(), "shipped")
    bad = []
    for key, entry in table.entries.items():
        job = Job.of(entry["measured_n"], entry["dtype"], key.backward, key.rms, key.residual)
        t = dispatch.from_knobs(entry["knobs"], **job.call_fields())
        if spills(t, table.gpu.cc):
            bad.append(t.short())
    assert table.entries and not bad, "\n".join(bad)


def test_the_h200_entries_that_spill_with_fp32_weights_run_at_half_their_load_width(tmp_path, monkeypatch):
    """The two H200 calls version 79 found running spilling kernels (bf16 x, fp32 weights: LayerNorm forward
    262144, backward 196608; the entries spill and the heuristic's pick spills more) run the entry's shape at
    half its load width, which compiles clean (version 80 measured 0.600 and 0.473 of copy through dispatch,
    against the heuristic's 0.449 and 0.379)."""
    from cunorm.search_space import Job

    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path))
    tables.forget()
    try:
        [gpu] = [g for g in tables.shipped_gpus() if "H200" in g.name]
        for n, backward in ((262144, False), (196608, True)):
            call = Job.of(n, "bfloat16", backward).call_fields("float32")
            pick, origin = dispatch.choose(arch=90, gpu=gpu, **call)
            assert dispatch.measured(origin) and pick.bytes_per_ldg == 16 and spills(pick, 90)
            runs, why = dispatch.what_runs(90, lambda t: spills(t, 90), gpu=gpu, **call)
            assert runs == pick.replace(bytes_per_ldg=8) and why == f"{origin} {dispatch.HALF_LOADS}", (n, why)
            assert not spills(runs, 90) and spills(dispatch.fallback(90, **call), 90)
    finally:
        tables.forget()


@pytest.mark.parametrize("path", sorted(tables.SHIPPED_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_entry_runs_spill_free_with_every_weight_dtype(path, tmp_path, monkeypatch):
    """An entry serves every dtype mix of its key's element size, but was measured on one (2-byte keys on bf16 x, which
    is what this builds: fp16 x is not); the weights' dtype moves the registers most (entries held for bf16 weights
    have spilled with fp32 x). For each entry's measured call with each weight dtype (its own too: under another NVRTC
    than the one it was measured with, the entry itself may spill; CI runs this under CUDA 13's NVRTC as well), what
    runs on the entry's GPU (`dispatch.what_runs`: the table's pick, or the sm_90 literal or the heuristic where the
    entry does not fit such weights, or what replaces a pick that spills) compiles without local memory (version 79
    found two H200 calls whose every replacement then spilled; the pick at half its load width, a replacement since
    version 80, is clean for both). The user's own tables are kept out (an empty cache folder)."""
    from concurrent.futures import ThreadPoolExecutor

    from cunorm.search_space import Job

    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path))
    tables.forget()
    table = tables.Table.from_json(path.read_text(), "shipped")
    arch = table.gpu.cc

    def spilling(args) -> tuple | None:
        key, entry, weight = args
        op = ("rms_norm" if key.rms else "layer_norm") + ("_backward" if key.backward else "")
        dtype = entry["dtype"]
        job = Job.of(entry["measured_n"], dtype, key.backward, key.rms, key.residual)
        assert job.key == key, (job.key, key)
        t, origin = dispatch.what_runs(arch, lambda v: spills(v, arch), gpu=table.gpu, **job.call_fields(weight))
        found = (op, entry["measured_n"], dtype, key.residual, weight)
        return (*found, f"{origin}: {t.short()}") if spills(t, arch) else None

    todo = [(key, entry, weight) for key, entry in table.entries.items()
            for weight in ("float32", "bfloat16", "float16")]
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:  # NVRTC compiles side by side
            bad = [found for found in pool.map(spilling, todo) if found]
    finally:
        tables.forget()
    assert todo
    assert not bad, "\n".join(map(str, bad))


def test_heuristic_sample_compiles():
    for n in (8, 40, 200, 1000, 1160, 4104, 7168, 24584):
        for backward in (False, True):
            t = heuristic(hidden_size=n, input_dtype="float16", weight_dtype="float32",
                          output_dtype="bfloat16", backward=backward)
            assert compile_only(t, 90).clean, t.short()


def test_flag_variants_compile():
    base = Traits(hidden_size=4096, input_dtype="bfloat16", weight_dtype="bfloat16", output_dtype="bfloat16",
                  warps_n=4)
    for backward in (False, True):
        for has_weight in (False, True):
            for has_bias in (False, True):
                for cache in (False, True):
                    t = base.replace(backward=backward, has_weight=has_weight, has_bias=has_bias,
                                     cache_weights=cache)
                    assert compile_only(t, 90).clean, t.short()
    assert compile_only(base.replace(backward=True, smem_accumulators=True, warps_m=2, warps_n=4), 90).clean


@pytest.mark.parametrize("arch", [80, 90])
def test_register_sum_steps_compile_clean(arch):
    """Column sums of some load steps in registers, the rest in shared memory: one row a CTA, folded rows
    (WARPS_M = 2), general rows (folded, and one row a CTA), RMSNorm, a second weight, per-head weights and a
    cluster row, spill-free where registers allow."""
    base = Traits(hidden_size=4096, input_dtype="bfloat16", backward=True, warps_n=4, bytes_per_ldg=8, stages=1,
                  smem_accumulators=True)  # 8 load steps
    variants = [base, base.replace(warps_m=2), base.replace(hidden_size=4097, aligned_rows=False, warps_m=2),
                base.replace(rms=True, has_bias=False, stages=2),
                base.replace(hidden_size=2048, weight1_dtype="bfloat16", bias1_dtype="bfloat16"),
                base.replace(per_head=True, cache_weights=False), base.replace(hidden_size=4097, aligned_rows=False)]
    if arch >= 90:
        variants.append(base.replace(ctas_per_row=2, pushed_exchange=True))
    for t in variants:
        for steps in (1, t.ldgs // 2, t.ldgs - 1):
            v = t.replace(register_sum_steps=steps)
            assert compile_only(v, arch).clean, v.short()


@pytest.mark.parametrize("arch", [80, 90])
def test_unchecked_whole_steps_compile_clean_and_change_the_code(arch):
    """Whole load steps unchecked (WHOLE_STEPS agreeing with Traits.whole_steps): general rows forward and
    backward (one row a CTA, folded rows, 16-byte loads, staged, RMSNorm, a residual, fp32, fp64, per-head
    weights, dropout, the one-launch backward, the unstaged forward), aligned rows of a partial last step (also
    several rows a warp), and a cluster row; spill-free at these shapes, and the general kernel's machine code
    differs from the checked one's (the knob acts)."""
    fwd = Traits(hidden_size=4097, input_dtype="bfloat16", warps_n=4, bytes_per_ldg=8, stages=1, aligned_rows=False)
    bwd = fwd.replace(backward=True, smem_accumulators=True)
    variants = [fwd, fwd.replace(warps_m=2), fwd.replace(bytes_per_ldg=16, stages=2), fwd.replace(rms=True),
                fwd.replace(input_dtype="float32", has_residual=True, bytes_per_ldg=16),
                Traits(hidden_size=4097, input_dtype="float64", warps_n=8, bytes_per_ldg=16, stages=1,
                       aligned_rows=False),
                fwd.replace(per_head=True, cache_weights=False), fwd.replace(dropout=True, has_residual=True),
                fwd.replace(persistent=False, min_ctas_per_sm=2), bwd, bwd.replace(warps_m=2),
                bwd.replace(rms=True, has_bias=False, register_sum_steps=2), bwd.replace(grid_finalize=True),
                bwd.replace(hidden_size=2304, aligned_rows=True), fwd.replace(hidden_size=2304, aligned_rows=True),
                Traits(hidden_size=136, input_dtype="bfloat16", warps_n=1, lanes_per_row=8, bytes_per_ldg=16,
                       stages=1)]
    if arch >= 90:
        variants += [fwd.replace(hidden_size=16385, ctas_per_row=2, pushed_exchange=True),
                     bwd.replace(hidden_size=16385, ctas_per_row=2, warps_n=8, pushed_exchange=True)]
    for t in variants:
        assert 0 < t.whole_steps < t.ldgs, t.short()
        v = t.replace(unchecked_whole_steps=True)
        assert compile_only(v, arch).clean, v.short()
    from conftest import load_script

    digest = load_script("codegen_digest")
    for t in (fwd, bwd):  # the machine code itself, not the constant banks the new flag's value sits in
        checked, unchecked = (digest.text_sections(compile_only(u, arch).cubin)
                              for u in (t, t.replace(unchecked_whole_steps=True)))
        assert checked != unchecked, t.short()


@pytest.mark.parametrize("arch", [80, 90])
def test_sum_chains_compile_clean_and_change_the_code(arch):
    """A forward's row sums in 2 and 4 chains (SUM_CHAINS, checked against the traits' rule): LayerNorm and
    RMSNorm, general and aligned rows, staged and unstaged, fp32 and fp64, a residual, merged moments (two
    totals) on a cluster row; spill-free at these shapes, and each count's machine code its own (the knob acts)."""
    fwd = Traits(hidden_size=4097, input_dtype="bfloat16", warps_n=4, bytes_per_ldg=8, stages=1, aligned_rows=False)
    variants = [fwd, fwd.replace(rms=True, has_bias=False), fwd.replace(hidden_size=4096, aligned_rows=True),
                fwd.replace(bytes_per_ldg=16, stages=2, has_residual=True),
                fwd.replace(persistent=False, min_ctas_per_sm=2),
                Traits(hidden_size=4097, input_dtype="float32", warps_n=4, bytes_per_ldg=16, stages=1,
                       aligned_rows=False),
                Traits(hidden_size=1025, input_dtype="float64", warps_n=2, bytes_per_ldg=16, stages=1,
                       aligned_rows=False)]
    if arch >= 90:
        variants += [fwd.replace(hidden_size=32769, warps_n=8, ctas_per_row=4, pushed_exchange=True),
                     fwd.replace(hidden_size=16385, ctas_per_row=4, merged_moments=True)]
    from conftest import load_script

    digest = load_script("codegen_digest")
    for t in variants:
        codes = {digest.text_sections(compile_only(t, arch).cubin)}
        for chains in (c for c in (2, 4) if c <= t.elts_per_ldg):
            v = t.replace(sum_chains=chains)
            result = compile_only(v, arch)
            assert result.clean, v.short()
            codes.add(digest.text_sections(result.cubin))
        assert len(codes) == 1 + sum(c <= t.elts_per_ldg for c in (2, 4)), t.short()
    with pytest.raises(ValueError, match="sum_chains"):
        fwd.replace(backward=True, sum_chains=2)


def _unstaged_backwards(arch: int) -> list:
    """Unstaged backwards of the rows-ahead knobs' compile tests: LayerNorm and RMSNorm, aligned, folded and
    general rows, fp32 with dresidual, a second weight; on sm_90 cluster rows with pushed exchanges, bf16 and
    fp32 (32 elements a thread: a GATED kernel, two copies of the row loop)."""
    bwd = Traits(hidden_size=2048, input_dtype="bfloat16", backward=True, warps_n=4, bytes_per_ldg=16, stages=1)
    variants = [bwd, bwd.replace(rms=True, has_bias=False, hidden_size=4096, warps_m=2, bytes_per_ldg=8),
                bwd.replace(hidden_size=4097, aligned_rows=False, bytes_per_ldg=8, smem_accumulators=True),
                Traits(hidden_size=2048, input_dtype="float32", backward=True, warps_n=4, bytes_per_ldg=16,
                       stages=1, has_residual=True, residual_dtype="bfloat16"),
                bwd.replace(weight1_dtype="bfloat16", bias1_dtype="bfloat16", bytes_per_ldg=8)]
    if arch >= 90:
        variants.append(bwd.replace(hidden_size=10240, ctas_per_row=4, bytes_per_ldg=8, smem_accumulators=True,
                                    register_sum_steps=1, pushed_exchange=True))
        variants.append(Traits(hidden_size=16384, input_dtype="float32", backward=True, warps_n=4, ctas_per_row=4,
                               bytes_per_ldg=16, stages=1, smem_accumulators=True, pushed_exchange=True))
    return variants


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("knob, before, illegal", [
    ("register_ahead", {}, dict(stages=2, register_ahead=True)),  # a staged one
    ("stats_ahead", {"register_ahead": True}, dict(stats_ahead=True)),  # without rows ahead
])
def test_rows_ahead_knobs_compile_clean_and_change_the_code(arch, knob, before, illegal):
    """An unstaged backward with its next row loaded ahead into registers (REGISTER_AHEAD), and with the rows'
    statistics ahead too (STATS_AHEAD; each checked against the traits' rule), at `_unstaged_backwards`'
    shapes: spill-free, and machine code of its own (the knob acts)."""
    from conftest import load_script

    digest = load_script("codegen_digest")
    for t in (v.replace(**before) for v in _unstaged_backwards(arch)):
        knobbed = t.replace(**{knob: True})
        plain, result = compile_only(t, arch), compile_only(knobbed, arch)
        assert result.clean, knobbed.short()
        assert digest.text_sections(plain.cubin) != digest.text_sections(result.cubin), t.short()
    with pytest.raises(ValueError, match=knob):
        _unstaged_backwards(arch)[0].replace(**illegal)


def test_general_and_flag_sample_compiles():
    """The general kernel (odd sizes, offset views, odd row strides, broadcast weights, in place) and the
    flags (RMSNorm, residual, zero-centered), as `cunorm check` dispatches them: clean up to N = 65537."""
    from cunorm import check

    sample = [c for c in check.general_cases(sizes=(1, 7, 33, 4097, 65537)) + check.flag_cases(sizes=(7, 4097))
              if c.hidden_size in (1, 7, 33, 1000, 1001, 4096, 4097, 65537)][::3]
    compiled = set()
    for case in sample:
        t, _ = dispatch.choose(arch=90, **check.case_call(case))
        if t in compiled:
            continue
        compiled.add(t)
        assert compile_only(t, 90).clean, t.short()
    assert len(compiled) > 30
    assert any(not t.aligned_rows for t in compiled) and any(t.rms and t.has_residual for t in compiled)


def test_two_byte_weight_slots_compile():
    """A 16-bit weight or bias kept in shared-memory slots by a one-element (4-byte) load of fp32 x: each
    slot is a 32-bit word, as Traits.smem_bytes counts it (the kernel's static_assert checks the count)."""
    for kw in (dict(bias_dtype="bfloat16"), dict(weight_dtype="float16", has_residual=True),
               dict(weight_dtype="bfloat16", backward=True, from_output=True)):
        t = Traits(hidden_size=4097, input_dtype="float32", aligned_rows=False, **kw, warps_n=9, ctas_per_row=4,
                   bytes_per_ldg=4, stages=3, cache_weights=False)
        assert compile_only(t, 90).clean, t.short()


def test_cluster_traits_refuse_sm80():
    t = Traits(hidden_size=65536, input_dtype="bfloat16", warps_n=8, ctas_per_row=8)
    with pytest.raises(ValueError, match="clusters"):
        compile_only(t, 80)


def test_ptxas_log_parser():
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
           "ptxas info    : Function properties for k\n"
           "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 72 registers, used 1 barriers, 128 bytes smem\n")
    (f,) = parse_ptxas_log(log)
    assert (f.name, f.registers, f.stack_frame, f.spill_stores, f.smem_bytes) == ("k", 72, 8, 4, 128)
    assert f.spills


def test_compile_only_refuses_a_log_without_a_report(monkeypatch):
    """A compile answered from NVRTC's cache runs no ptxas; its empty report must not read as clean."""
    import re

    from cupy_backends.cuda.libs import nvrtc

    t = Traits(hidden_size=1024, input_dtype="bf16", backward=True)
    real_log = nvrtc.getProgramLog
    monkeypatch.setattr(nvrtc, "getProgramLog", lambda prog: "")
    with pytest.raises(cunorm.CompileError, match="no ptxas report for norm_bwd, norm_bwd_finalize; it holds none"):
        compile_only(t, 90)
    one_missing = r"ptxas info\s+: Compiling entry function 'norm_bwd' .*?(?=ptxas info\s+: Compiling entry|\Z)"
    monkeypatch.setattr(nvrtc, "getProgramLog", lambda prog: re.sub(one_missing, "", real_log(prog), flags=re.S))
    with pytest.raises(cunorm.CompileError, match="report for norm_bwd; it reports only norm_bwd_finalize"):
        compile_only(t, 90)


@pytest.mark.parametrize("version, bypassed", [((12, 8), False), ((12, 9), True), ((13, 0), True)])
def test_compile_only_bypasses_the_nvrtc_cache_where_there_is_one(version, bypassed, monkeypatch):
    """NVRTC 12.9+ answers a compile it has seen from the driver's cache (GPU hosts), with no ptxas report."""
    from cupy_backends.cuda.libs import nvrtc
    from cunorm import compiler

    # The real compile takes this NVRTC's own flag (no cache hit on a GPU host, no option an NVRTC before 12.9
    # lacks); what is checked is what compile_only chose for the faked version.
    compiler._uncached.cache_clear()
    real_flags = compiler._uncached()
    options, real_compile = [], nvrtc.compileProgram
    monkeypatch.setattr(nvrtc, "getVersion", lambda: version)

    def recording(prog, opts):
        options.append(list(opts))
        return real_compile(prog, [o for o in opts if o != "--no-cache"] + list(real_flags))

    monkeypatch.setattr(nvrtc, "compileProgram", recording)
    compiler._uncached.cache_clear()
    try:
        assert compile_only(Traits(hidden_size=1024, input_dtype="bf16"), 90).clean
    finally:
        compiler._uncached.cache_clear()
    assert len(options) == 1 and ("--no-cache" in options[0]) == bypassed


def test_compile_only_names_an_edited_source_that_lacks_a_kernel():
    from cunorm.source import _read

    with pytest.raises(ValueError, match="source: defines no extern \"C\" kernel norm_bwd, norm_bwd_finalize"):
        compile_only(Traits(hidden_size=1024, input_dtype="bf16", backward=True), 90, _read("norm_fwd.cu"))


def test_compile_only_takes_arch_names():
    t = Traits(hidden_size=1024, input_dtype="bf16")
    assert compile_only(t, "sm_80").arch == compile_only(t, 80).arch == 80
    with pytest.raises(ValueError, match="arch"):
        compile_only(t, "hopper")


def _edited_forward(change: str) -> str:
    """kernels/norm_fwd.cu with one visible edit (the output line rewritten)."""
    from cunorm.source import _read

    shipped = _read("norm_fwd.cu")
    line = "out[e] = HAS_BIAS ? scaled + bv.get(e) : scaled;"
    assert line in shipped
    return shipped.replace(line, change)


def test_an_edited_source_compiles_without_a_gpu():
    t = Traits(hidden_size=4096, input_dtype="bf16", warps_n=4)
    edited = _edited_forward("out[e] = 2.f * (HAS_BIAS ? scaled + bv.get(e) : scaled);  // edited")
    report = compile_only(t, 90, edited)
    assert report.clean and {f.name for f in report.functions} == {"norm_fwd"}
    assert "// edited" in cunorm.render(t, edited) and "// edited" not in cunorm.render(t)


def test_a_broken_source_shows_the_rendered_lines():
    from cunorm import CompileError

    t = Traits(hidden_size=4096, input_dtype="bf16", warps_n=4)
    with pytest.raises(CompileError) as e:
        compile_only(t, 90, _edited_forward("out[e] = not_a_name;"))
    message = str(e.value)
    assert "not_a_name" in message and "rendered text, line" in message
    number = int(message.split("rendered text, line ")[1].split(":")[0])
    assert cunorm.render(t, _edited_forward("out[e] = not_a_name;")).splitlines()[number - 1].strip().startswith(
        "out[e] = not_a_name")


def test_check_compile_only_takes_a_source(tmp_path):
    import json

    from click.testing import CliRunner

    from cunorm import cli

    good, bad = tmp_path / "fwd.cu", tmp_path / "broken.cu"
    good.write_text(_edited_forward("out[e] = 2.f * (HAS_BIAS ? scaled + bv.get(e) : scaled);"))
    bad.write_text(_edited_forward("out[e] = not_a_name;"))
    args = ["check", "--compile-only", "--sizes", "1024", "--dtypes", "bf16", "--sweep", "tuned", "--json"]
    res = CliRunner().invoke(cli.main, args + ["--source", str(good)])
    out = json.loads(res.stdout)
    assert res.exit_code == 0 and out["compiled"] == len(out["variants"]) > 0
    assert all("norm_fwd" == f["name"] for v in out["variants"] for f in v["functions"])  # the forwards only
    res = CliRunner().invoke(cli.main, args + ["--source", str(bad)])
    assert res.exit_code == 1 and json.loads(res.stdout)["failed"] > 0


def test_branch_variants_compile():
    """Dropout, a row scale and the keep mask (forward), dx0 (backward):
    aligned and general rows, with and without a residual, every input
    width, spill-free on sm_90 and sm_80 as dispatched for each (the tuned
    literal serves sm_90 only)."""
    cases = [dict(hidden_size=4096, input_dtype="bfloat16", dropout=True),
             dict(hidden_size=4096, input_dtype="bfloat16", dropout=True, dropout_mask=True, has_residual=True,
                  rowscale_dtype="float32"),
             dict(hidden_size=4097, input_dtype="float16", dropout=True, dropout_mask=True, has_residual=True,
                  residual_dtype="float32", rowscale_dtype="bfloat16", aligned_rows=False, bytes_per_ldg=2, stages=1),
             dict(hidden_size=1000, input_dtype="float64", rowscale_dtype="float64"),
             dict(hidden_size=8192, input_dtype="float32", dropout=True, rms=True, has_bias=False),
             # the backwards: dx0 beside dx, with the one-launch sum, from y, general rows
             dict(hidden_size=4096, input_dtype="bfloat16", backward=True, dropout=True, dx0_dtype="float32",
                  rowscale_dtype="float32", has_residual=True, grid_finalize=True),
             dict(hidden_size=1024, input_dtype="float16", backward=True, rowscale_dtype="float16", dx0_dtype="float16",
                  from_output=True),
             dict(hidden_size=4097, input_dtype="float32", backward=True, dropout=True, dx0_dtype="bfloat16",
                  rms=True, has_bias=False)]
    for kw in cases:
        for arch in (90, 80):
            t = dispatch.choose(arch=arch, **kw)[0] if "bytes_per_ldg" not in kw else Traits(**kw, warps_n=4)
            if arch == 80 and t.uses_cluster:
                continue
            assert compile_only(t, arch).clean, (arch, t.short())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_wide_backward_keeps_its_column_sums_in_shared_memory(dtype):
    """The heuristic's 2-byte backward at 131072 and 262144 (LayerNorm, RMSNorm, with and without dresidual):
    CTAs whose column sums fit shared memory, 8 a row at 131072 and a 16-CTA (non-portable) cluster at 262144
    (4 and 8 CTAs of 1024 threads held them in registers and spilled 1384-1564 bytes), compiled without
    spills; at 98304, where 4 CTAs' sums fit, the pick keeps 4 CTAs. With and without a bias: the column sums a
    call keeps can depend on it (version 56's trial moved the picks without a bias to spilling CTAs)."""
    for rms, residual, has_bias in itertools.product((False, True), repeat=3):
        call = dict(input_dtype=dtype, backward=True, rms=rms, has_residual=residual, has_bias=has_bias,
                    residual_dtype=dtype if residual else None)
        for n, ctas in ((131072, 8), (262144, 16)):
            t = heuristic(hidden_size=n, **call)
            assert t.ctas_per_row == ctas and t.smem_accumulators and compile_only(t, 90).clean, t.short()
        assert heuristic(hidden_size=98304, **call).ctas_per_row == 4


@pytest.mark.parametrize("dtype, residual", [("bfloat16", None), ("bfloat16", "float32"), ("float32", None),
                                             ("float64", None)])
def test_merged_moments_compile_clean_where_the_two_pass_shape_does(dtype, residual):
    """merged_moments adds two values to a row's CTA sums and one exchange's worth of registers: LayerNorm
    forwards of cluster rows that compile clean without it compile clean with it (aligned and general rows)."""
    checked = 0
    for n in (12288, 65537, 131072):
        call = dict(hidden_size=n, input_dtype=dtype, has_residual=residual is not None, residual_dtype=residual)
        for ctas in (2, 8):
            try:
                t = dispatch.choose(arch=90, tuned=False, **call)[0].replace(ctas_per_row=ctas, warps_m=1)
            except ValueError:
                continue
            if compile_only(t, 90).clean:
                assert compile_only(t.replace(merged_moments=True), 90).clean, t.short()
                checked += 1
    assert checked >= 2


def test_pushed_exchanges_compile_clean_where_the_barrier_exchange_does():
    """The tier-C sample of cluster rows with pushed exchanges (tests/test_gpu_pushed_exchange.py), both ways:
    legal on sm_90, and the pushed kernels spill-free wherever the barrier exchange's are (its mbarriers and
    peer addresses cost a few registers; slots a sender cost shared memory, not registers)."""
    from test_gpu_pushed_exchange import CASES

    from cunorm import check

    clean = 0
    for op, n, dtype, ctas, warps, knobs, fields in CASES:
        shape = dict(ctas_per_row=ctas, warps_n=warps, stages=1, cache_weights=False, **knobs)
        case = check.Case(op, n, 37, dtype, "float32" if dtype in ("float32", "float64") else "bfloat16", **fields)
        barrier = dispatch.from_knobs(shape, **check.case_call(case))
        barrier.check_arch(90)
        pushed = barrier.replace(pushed_exchange=True)
        assert "PUSHED_EXCHANGE=1" in pushed.short() and pushed.launches() == barrier.launches()
        if compile_only(barrier, 90).clean:
            assert compile_only(pushed, 90).clean, pushed.short()
            clean += 1
    assert clean == len(CASES), f"{clean} of {len(CASES)} spill-free with the barrier exchange"  # else vacuous


@pytest.mark.parametrize("op, n, dtype, knobs, fields", [
    ("layer_norm_backward", 4096, "bfloat16", dict(warps_n=16), {}),
    ("layer_norm_backward", 16384, "bfloat16", dict(warps_n=16, ctas_per_row=2, pushed_exchange=True), {}),
    ("rms_norm_backward", 65536, "bfloat16", dict(warps_n=16, ctas_per_row=8, pushed_exchange=True), {}),
    ("layer_norm_backward", 14336, "bfloat16", dict(warps_n=14, ctas_per_row=2, bytes_per_ldg=8,
                                                    pushed_exchange=True), {}),
    ("layer_norm_backward", 4096, "float32", dict(warps_m=2, warps_n=8), {}),  # REFINE_MEAN: three row sums
    ("layer_norm_backward", 1024, "float64", dict(warps_m=2, warps_n=4, stages=1), {}),
    ("layer_norm", 32768, "bfloat16", dict(warps_n=8, ctas_per_row=4, pushed_exchange=True, merged_moments=True), {}),
    ("rms_norm", 32768, "bfloat16", dict(warps_n=16, ctas_per_row=16, pushed_exchange=True), {}),
    ("rms_norm", 4096, "bfloat16", dict(warps_n=4, ctas_per_row=2, pushed_exchange=True),
     dict(out_dtype="float8_e4m3fn", scaling="row")),  # the row max's reducer too
    # an odd count of warp slots: ptxas pads them to the CTA slots' 16-byte alignment
    ("rms_norm_backward", 15360, "bfloat16", dict(warps_n=3, ctas_per_row=8, bytes_per_ldg=8, pushed_exchange=True),
     {}),
    ("rms_norm", 3072, "bfloat16", dict(warps_n=3, ctas_per_row=2, pushed_exchange=True),
     dict(out_dtype="float8_e4m3fn", scaling="row")),
])
def test_static_shared_memory_is_what_the_traits_count_at_most(op, n, dtype, knobs, fields):
    """Traits.static_smem_bytes (the rule's static part) bounds what ptxas reports for the main kernel, and
    equals it where every array of the reducers is used (pushed cluster rows of several warps)."""
    from cunorm import check

    case = check.Case(op, n, 37, dtype, dtype, has_bias=not op.startswith("rms"), **fields)
    t = dispatch.from_knobs(knobs, **check.case_call(case))
    main = next(f for f in compile_only(t, 90).functions if f.name in ("norm_fwd", "norm_bwd"))
    assert main.smem_bytes <= t.static_smem_bytes, t.short()
    if t.pushed_exchange and t.warps_n > 1:
        assert main.smem_bytes == t.static_smem_bytes, t.short()
