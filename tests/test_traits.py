"""Tier A: Traits mirror the kernels' rules and derived quantities (the C++ traits' static_asserts)."""
import pytest

from cunorm import Traits, dispatch
from cunorm.traits import KNOBS


def test_derived_quantities_match_the_kernel_formulas():
    t = Traits(hidden_size=5120, input_dtype="bfloat16", weight_dtype="float32", output_dtype="bfloat16",
               warps_m=1, warps_n=4, ctas_per_row=1, bytes_per_ldg=16)
    assert t.threads_per_row == 128 and t.threads_per_cta == 128 and t.rows_per_cta == 1
    assert t.elts_per_ldg == 8 and t.vec_cols == 640 and t.vec_cols_per_ldg == 128
    assert t.ldgs == 5 and t.elts_per_thread == 40 and t.full_tiles
    fp32 = t.replace(input_dtype="float32", warps_n=8)
    assert fp32.elts_per_ldg == 4 and fp32.ldgs == 5 and fp32.full_tiles


@pytest.mark.parametrize("changes,rule", [
    (dict(warps_n=0), "WARPS_M and WARPS_N"),
    (dict(warps_m=8, warps_n=8), "1024 threads"),
    (dict(bytes_per_ldg=12), "BYTES_PER_LDG must be 2, 4, 8 or 16"),
    (dict(input_dtype="float32", bytes_per_ldg=2), "whole input elements"),
    (dict(hidden_size=1028), "multiple of the elements per load"),
    (dict(ctas_per_row=3), "CTAS_PER_ROW must be 1, 2, 4, 8"),
    (dict(ctas_per_row=2, warps_m=2), "WARPS_M == 1"),
    (dict(warps_m=16, warps_n=2), "WARPS_M < 16"),
    (dict(warps_n=1, hidden_size=8192), "register budget"),
    (dict(compute_dtype="float16"), "compute_dtype"),
    (dict(min_ctas_per_sm=0), "MIN_CTAS_PER_SM"),
    (dict(lanes_per_row=12), "LANES_PER_ROW must be 4, 8, 16 or 32"),
    (dict(lanes_per_row=16), "need WARPS_N == 1 and CTAS_PER_ROW == 1"),
    (dict(lanes_per_row=8, warps_n=1, hidden_size=64, aligned_rows=False), "need aligned rows"),
    (dict(lanes_per_row=8, warps_n=1, hidden_size=128, output_dtype="float8_e4m3fn", quant="group"),
     "a group's lanes within a row's"),
    (dict(smem_accumulators=True), "backward knob"),
    (dict(register_sum_steps=1), "register_sum_steps must be 0, or with smem_accumulators"),
    (dict(backward=True, hidden_size=4096, register_sum_steps=1), "or with smem_accumulators 1 .. ldgs - 1 \\(3\\)"),
    (dict(backward=True, hidden_size=4096, smem_accumulators=True, register_sum_steps=4), "1 .. ldgs - 1 \\(3\\)"),
    (dict(backward=True, hidden_size=4096, smem_accumulators=True, register_sum_steps=-1), "register_sum_steps"),
    (dict(merged_moments=True), "LayerNorm forwards of cluster rows"),
    (dict(merged_moments=True, ctas_per_row=2, rms=True), "LayerNorm forwards of cluster rows"),
    (dict(pushed_exchange=True), "pushed_exchange is a knob of cluster rows"),
    (dict(unchecked_whole_steps="yes"), "unchecked_whole_steps must be True or False"),
    (dict(sum_chains=3), "sum_chains must be 1, or for a forward 2 or 4"),
    (dict(sum_chains=0), "sum_chains must be 1"),
    (dict(sum_chains=True), "sum_chains must be 1"),
    (dict(sum_chains=2, backward=True), "for a forward"),
    (dict(sum_chains=4, input_dtype="float32", bytes_per_ldg=8), "at most elts_per_ldg \\(2\\)"),
    (dict(register_ahead="yes", backward=True, stages=1), "register_ahead must be True or False"),
    (dict(register_ahead=True, stages=1), "only for a backward with stages=1"),
    (dict(register_ahead=True, backward=True, stages=2), "only for a backward with stages=1"),
    (dict(stats_ahead="yes", register_ahead=True, backward=True, stages=1), "stats_ahead must be True or False"),
    (dict(stats_ahead=True, backward=True, stages=1), "only with register_ahead"),
    (dict(hidden_size=0), "positive"),
])
def test_illegal_traits_name_the_rule(changes, rule):
    base = dict(hidden_size=1024, input_dtype="bfloat16", weight_dtype="bfloat16", output_dtype="bfloat16",
                warps_n=4)
    with pytest.raises(ValueError, match=rule):
        Traits(**{**base, **changes})


def test_general_rows_may_hold_one_vector_more():
    """A shifted row touches one vector more than its length: the general
    kernel's budget is one vector larger, so that 65537 runs 65536's shape."""
    shape = dict(hidden_size=65537, input_dtype="bfloat16", warps_n=4, ctas_per_row=8, bytes_per_ldg=8)
    general = Traits(**shape, aligned_rows=False)
    assert general.ldgs == 17 and general.elts_per_thread == 68 == general.max_elts_per_thread
    assert Traits(**{**shape, "hidden_size": 65536}).elts_per_thread == 64
    with pytest.raises(ValueError, match="register budget of 64"):
        Traits(**{**shape, "hidden_size": 65536 + 1024 * 4})  # 17 aligned steps: over the budget
    with pytest.raises(ValueError, match="register budget of 68"):
        Traits(**{**shape, "hidden_size": 65536 + 1024 * 4 + 1}, aligned_rows=False)


def test_unsupported_dtype_is_rejected():
    with pytest.raises(ValueError, match="unsupported dtype"):
        Traits(hidden_size=1024, input_dtype="int8")


def test_clusters_need_sm90():
    t = Traits(hidden_size=16384, input_dtype="bfloat16", warps_n=8, ctas_per_row=2)
    t.check_arch(90)
    with pytest.raises(ValueError, match="clusters"):
        t.check_arch(80)


def test_traits_are_hashable_and_frozen():
    a = Traits(hidden_size=1024, input_dtype="bfloat16", warps_n=2)
    b = Traits(hidden_size=1024, input_dtype="bfloat16", warps_n=2)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(Exception):
        a.warps_n = 4
    assert set(a.knobs()) == set(KNOBS)


def test_grid_finalize_is_a_backward_flag_with_column_sums():
    """The one-launch backward: a flag of the backward with column sums only;
    its variant launches norm_bwd alone, and its source compiles out the
    finalize kernel (tier B checks the compiled kernels against launches())."""
    from cunorm import render

    t = Traits(hidden_size=4096, input_dtype="bfloat16", backward=True, warps_n=4)
    fused = t.replace(grid_finalize=True)
    assert set(t.launches()) == {"norm_bwd", "norm_bwd_finalize"} and set(fused.launches()) == {"norm_bwd"}
    assert "#define CN_GRID_FINALIZE 0" in render(t) and "#define CN_GRID_FINALIZE 1" in render(fused)
    assert "grid-finalize" in fused.short() and fused != t and hash(fused) != hash(t)
    for changes in (dict(backward=False), dict(has_weight=False, has_bias=False)):
        with pytest.raises(ValueError, match="GRID_FINALIZE needs column sums"):
            t.replace(grid_finalize=True, **changes)
    with pytest.raises(ValueError, match="GRID_FINALIZE needs CTAS_PER_ROW == 1"):
        t.replace(grid_finalize=True, ctas_per_row=2, warps_n=2)


def test_finalize_splits_narrow_rows_over_enough_ctas():
    """The finalize kernel's columns a CTA: lanes side by side along the row (4 to 32, dividing a warp)
    times 4 neighbours (1 where N % 4 != 0), narrow rows split finer so that its grid keeps at least
    FINALIZE_LEAST_CTAS CTAs where 4 lanes allow, and the kernel gets the lanes it was sized for (its
    static_assert checks the product)."""
    from cunorm import render
    from cunorm.traits import FINALIZE_LEAST_CTAS

    want = {128: 4, 1000: 4, 2048: 4, 4096: 8, 8192: 16, 16384: 32, 32768: 32, 4097: 32, 4095: 16, 1023: 4}
    for n, lanes in want.items():
        t = Traits(hidden_size=n, input_dtype="bfloat16", backward=True, warps_n=min(32, -(-n // 1024)),
                   bytes_per_ldg=16 if n % 8 == 0 else 2, aligned_rows=n % 8 == 0, stages=1)
        vec = 4 if n % 4 == 0 else 1
        assert (t.finalize_vec, t.finalize_col_lanes, t.finalize_cols_per_cta) == (vec, lanes, lanes * vec), n
        assert -(-n // t.finalize_cols_per_cta) >= FINALIZE_LEAST_CTAS or lanes == 4, n
        assert f"constexpr int FIN_COL_LANES = {lanes};" in render(t)


def test_several_rows_a_warp():
    """lanes_per_row < 32: a warp holds 32 / lanes rows; threads and shared memory count warps, not rows."""
    t = Traits(hidden_size=128, input_dtype="bfloat16", warps_m=4, lanes_per_row=8, stages=3)
    assert (t.rows_per_warp, t.rows_per_cta, t.threads_per_row, t.threads_per_cta) == (4, 16, 8, 128)
    assert t.ldgs == 2 and t.vec_cols_per_ldg == 8 and t.full_tiles
    assert t.stage_slots == 16 * 2 * 8 and t.smem_bytes == 3 * t.stage_slots * 16
    assert t.template_values()["LANES_PER_ROW"] == 8 and "LANES_PER_ROW=8" in t.short()
    whole = t.replace(lanes_per_row=32)
    assert "LANES_PER_ROW" not in whole.short() and whole.rows_per_cta == 4 and whole.threads_per_cta == 128
    # The tuned literal's tuples name the knobs before lanes_per_row and persistent: they keep 32 lanes and
    # a persistent grid.
    assert max(map(len, [*dispatch.TUNED.values(), *dispatch.TUNED_GENERAL.values()])) <= \
        KNOBS.index("lanes_per_row") < KNOBS.index("persistent")
    assert dispatch.from_knobs(dict(zip(KNOBS, (4, 1, 1, 16, 2, 1, 1, 0))), hidden_size=1024,
                               input_dtype="bfloat16").lanes_per_row == 32


def test_persistent_knob_rules():
    """persistent=False (a CTA per row group): a forward of one stage only; named in short() and rendered."""
    t = Traits(hidden_size=4096, input_dtype="bfloat16", warps_n=4, bytes_per_ldg=8, stages=1, persistent=False)
    assert "PERSISTENT=0" in t.short() and t.template_values()["PERSISTENT"] == "false"
    assert "PERSISTENT" not in t.replace(persistent=True).short()
    assert Traits(hidden_size=4096, input_dtype="bfloat16", warps_n=4).persistent  # the default
    with pytest.raises(ValueError, match="PERSISTENT = false"):
        t.replace(stages=2)
    with pytest.raises(ValueError, match="PERSISTENT = false"):
        t.replace(backward=True)


def test_half_precision_rows_are_not_refined():
    """bf16 and fp16 rows keep the unrefined kernels (they cannot hold offset data that needs it), fp32 and
    an fp32 residual beside bf16 x take the refined ones; RMSNorm, the backward from y and float64 x never do."""
    assert not Traits(hidden_size=4096, input_dtype="bfloat16").refine_mean
    assert not Traits(hidden_size=4096, input_dtype="float16", backward=True).refine_mean
    assert not Traits(hidden_size=4096, input_dtype="float16", has_residual=True, residual_dtype="float16").refine_mean
    assert Traits(hidden_size=4096, input_dtype="float32").refine_mean
    assert Traits(hidden_size=4096, input_dtype="float32", backward=True).refine_mean
    assert Traits(hidden_size=4096, input_dtype="bfloat16", has_residual=True, residual_dtype="float32").refine_mean
    assert not Traits(hidden_size=4096, input_dtype="float32", rms=True).refine_mean
    assert not Traits(hidden_size=4096, input_dtype="float32", backward=True, from_output=True).refine_mean
    assert not Traits(hidden_size=4096, input_dtype="float64").refine_mean
    # float64 x has float64 statistics, whatever is summed into it (REFINE_MEAN's static_assert refuses it)
    t = Traits(hidden_size=1000, input_dtype="float64", has_residual=True, residual_dtype="float32")
    assert not t.refine_mean and t.template_values()["REFINE_MEAN"] == "false"
    assert Traits(hidden_size=4096, input_dtype="float32").template_values()["REFINE_MEAN"] == "true"
    assert Traits(hidden_size=4096, input_dtype="float32", backward=True).template_values()["REFINE_MEAN"] == "true"


def test_the_shared_memory_rule_counts_the_static_scratch_too(monkeypatch):
    """The driver refuses a launch whose dynamic and static shared memory together pass the GPU's per-CTA
    limit: the rule counts both (a forced shape within a few hundred bytes of the limit gets the rule's error
    naming its knobs, not the driver's at load), on every arch."""
    from cunorm import traits_rules

    t = Traits(hidden_size=16384, input_dtype="bfloat16", backward=True, warps_n=16, ctas_per_row=2, stages=1,
               smem_accumulators=True, pushed_exchange=True)
    fits = t.replace(pushed_exchange=False, ctas_per_row=1, hidden_size=8192)
    # LayerNorm's two row sums (K = 2) in 2 x 1 x 16 warp slots and 2 x 2 CTA slots of fp32, two mbarriers
    assert t.row_sums == 2 and t.static_smem_bytes == (2 * 16 * 2 + 2 * 2 * 2) * 4 + 16
    assert t.smem_footprint == t.smem_bytes + t.static_smem_bytes
    assert t.replace(rms=True).row_sums == 1
    assert t.replace(pushed_exchange=False).static_smem_bytes < t.static_smem_bytes
    assert t.smem_bytes > 0 and fits.smem_bytes > 0
    monkeypatch.setitem(traits_rules.SMEM_LIMIT, 90, t.smem_bytes)  # the dynamic part alone fits exactly
    with pytest.raises(ValueError, match=r"WARPS_N=16 .*bytes of dynamic and up to \d+ of static shared memory"):
        t.replace(stages=1)
    monkeypatch.setitem(traits_rules.SMEM_LIMIT, 90, fits.smem_footprint)
    fits.replace(stages=1).check_arch(90)  # exactly at the limit: legal
    monkeypatch.setitem(traits_rules.SMEM_LIMIT, 80, fits.smem_footprint - 1)
    with pytest.raises(ValueError, match="of static shared memory exceed sm_80"):
        fits.check_arch(80)


@pytest.mark.parametrize("changes, whole", [
    (dict(hidden_size=4096, bytes_per_ldg=16, warps_n=4), 4),  # aligned, full tiles: every step
    (dict(hidden_size=2304, bytes_per_ldg=8, warps_n=4), 4),  # aligned, 576 vectors in steps of 128: 4 of 5
    (dict(hidden_size=384, bytes_per_ldg=16, warps_n=4), 0),  # aligned, one partial step
    (dict(hidden_size=4097, bytes_per_ldg=8, warps_n=4, aligned_rows=False), 8),  # 1025 vectors, steps of 128
    (dict(hidden_size=4095, bytes_per_ldg=8, warps_n=4, aligned_rows=False), 7),  # one short: see below
    (dict(hidden_size=8193, bytes_per_ldg=16, warps_n=9, aligned_rows=False), 3),  # 1024 vectors, steps of 288
    (dict(hidden_size=200, bytes_per_ldg=16, warps_n=1, lanes_per_row=8), 3),  # several rows a warp: 25 in 8s
])
def test_whole_steps_are_steps_every_thread_holds_row_elements_in(changes, whole):
    """`whole_steps` (mirrored by the kernel's WHOLE_STEPS, checked by a static_assert when compiled): load steps
    in which every thread's vector holds elements of the row for every shift (Coords::in_row, brute-forced over
    every thread's column and shift here), all steps with full tiles, and at most one step short of the exact
    count (shifted rows count the vectors ending by N // E: 4095 in 4-element vectors, steps of 128, is whole
    through step 8, counted as 7)."""
    t = Traits(input_dtype="bfloat16", **changes)
    assert t.whole_steps == whole
    e, per_step = t.elts_per_ldg, t.vec_cols_per_ldg
    shifts = range(e) if not t.aligned_rows else (0,)

    def in_row(vec, shift):  # Coords::in_row
        return vec < t.vec_cols if t.aligned_rows else vec * e < shift + t.hidden_size

    exact = next((it for it in range(t.ldgs) if not all(in_row(col + it * per_step, shift)
                                                          for col in range(per_step) for shift in shifts)), t.ldgs)
    assert exact - 1 <= t.whole_steps <= exact and (t.whole_steps == t.ldgs) == t.full_tiles
