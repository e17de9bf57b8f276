"""Tier A: Traits mirror the kernels' rules; every dispatch entry is legal."""
import itertools
import math

import pytest

from cunorm import Traits, check, dispatch, dtypes
from cunorm.traits import KNOBS, LANES_PER_ROW


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


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_tuned_size_dispatches_to_legal_traits(dtype, backward):
    for n in dispatch.TUNED_SIZES:
        for wdt in {dtype, "float32"}:
            t, source = dispatch.choose(hidden_size=n, input_dtype=dtype, weight_dtype=wdt, output_dtype=dtype, backward=backward)
            assert t.hidden_size == n and t.input_dtype == dtype and t.weight_dtype == wdt
            tuned = dispatch.tuned_knobs(backward, n, dtype) is not None
            if tuned and wdt == dtype:  # the measured case must use its entry, not fall back silently
                assert source == "tuned", (n, dtype, backward)
                assert tuple(t.knobs().values())[:len(dispatch.TUNED[(backward, n, 2 if dtype != "float32" else 4)])] \
                    == tuple(int(v) for v in dispatch.TUNED[(backward, n, 2 if dtype != "float32" else 4)])


def test_tuned_table_entries_are_legal_for_their_dtypes():
    for (backward, n, itemsize), knobs in dispatch.TUNED.items():
        for dtype in {4: ("float32",), 2: ("bfloat16", "float16")}[itemsize]:
            Traits(hidden_size=n, input_dtype=dtype, weight_dtype=dtype, output_dtype=dtype, backward=backward,
                   **dict(zip(KNOBS, knobs))).check_arch(dispatch.TUNED_ARCH)
        assert n in dispatch.TUNED_SIZES


def test_general_tuned_entries_are_legal_and_used_beside_their_size():
    for (backward, n, itemsize), knobs in dispatch.TUNED_GENERAL.items():
        assert n in dispatch.TUNED_SIZES
        for dtype in {4: ("float32",), 2: ("bfloat16", "float16")}[itemsize]:
            for odd in (n + 1, n + dtypes.vector_elements(itemsize) - 1):  # contiguous rows of odd N: general
                t, source = dispatch.choose(hidden_size=odd, input_dtype=dtype, weight_dtype=dtype, output_dtype=dtype,
                                            backward=backward, aligned_vector=1)
                assert source == "tuned" and not t.aligned_rows, (odd, dtype, backward)
                assert tuple(t.knobs().values())[:len(knobs)] == tuple(int(v) for v in knobs)
        # Aligned rows of N itself keep the aligned entry; where the literal has none (plain forwards the
        # unstaged grid serves), the heuristic's.
        t, source = dispatch.choose(hidden_size=n, input_dtype="bfloat16", weight_dtype="bfloat16",
                                    output_dtype="bfloat16", backward=backward)
        assert t.aligned_rows
        if (backward, n, 2) in dispatch.TUNED:
            assert tuple(t.knobs().values())[:len(dispatch.TUNED[(backward, n, 2)])] == \
                tuple(int(v) for v in dispatch.TUNED[(backward, n, 2)])
        else:
            assert source == "heuristic" and not backward and not t.persistent


@pytest.mark.parametrize("backward", [False, True])
def test_heuristic_covers_every_multiple_of_8(backward):
    # Up to 65536 backward (the widest row 8 CTAs of 256 threads hold); forward goes further.
    for n in list(range(8, 4097, 8)) + [8200, 12296, 40008, 65528] + ([] if backward else [65544, 100_000]):
        for dtype in ("float32", "bfloat16"):
            t = dispatch.heuristic(hidden_size=n, input_dtype=dtype, weight_dtype=dtype, output_dtype=dtype,
                                   backward=backward)
            assert t.hidden_size == n
            t.check_arch(90)


@pytest.mark.parametrize("arch", [80, 86, 89])
@pytest.mark.parametrize("backward", [False, True])
def test_heuristic_respects_older_gpus_limits(arch, backward):
    """Every multiple of 8 gets traits that fit the GPU, or a clear refusal for rows too wide for one CTA."""
    for n in range(8, 16385, 8):
        for dtype, out in (("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("float32", "float32")):
            try:
                t = dispatch.heuristic(hidden_size=n, input_dtype=dtype, weight_dtype=dtype, output_dtype=out,
                                       backward=backward, arch=arch)
            except ValueError as e:
                assert "x: hidden size" in str(e) and n > 4096, (n, dtype, e)
                continue
            t.check_arch(arch)
            assert t.ctas_per_row == 1


def test_pre_ampere_gpus_are_refused_clearly():
    with pytest.raises(ValueError, match="sm_80 or newer"):
        Traits(hidden_size=1024, input_dtype="bfloat16", warps_n=2).check_arch(75)
    with pytest.raises(ValueError, match="sm_80 or newer"):
        dispatch.choose(hidden_size=1024, input_dtype="bfloat16", weight_dtype="bfloat16", output_dtype="bfloat16", arch=75)


def test_heuristic_without_clusters_uses_one_cta_per_row():
    t = dispatch.heuristic(hidden_size=16384, input_dtype="bfloat16", weight_dtype="bfloat16",
                           output_dtype="bfloat16", arch=80)
    assert t.ctas_per_row == 1


def test_kernels_compile_once_under_concurrent_requests(monkeypatch):
    """Threads asking for the same kernels at once share one compile."""
    import threading
    import time

    from cunorm import compiler

    calls = []

    def slow_load(traits, device_id, source=None):
        calls.append(traits)
        time.sleep(0.2)
        return {"k": object()}

    monkeypatch.setattr(compiler, "_load", slow_load)
    monkeypatch.setattr(compiler, "_cache", {})
    t = Traits(hidden_size=2048, input_dtype="bfloat16", warps_n=2)
    got = []
    threads = [threading.Thread(target=lambda: got.append(compiler.kernels_for(t, 0))) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(calls) == 1 and len(got) == 8 and all(g is got[0] for g in got)
    compiler.kernels_for(t.replace(warps_n=4), 0)
    assert len(calls) == 2


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


def test_one_launch_policy_and_its_capped_grid():
    """Which backwards sum their partial rows in one launch (few elements, no clusters, with
    column sums), and the grid they get: capped at `most` groups, raised to `least`, yet always
    a multiple of the shift period (general rows) and of the heads (weights
    per head), and never more than the rows or the resident CTAs."""
    from types import SimpleNamespace

    from cunorm import layout
    from cunorm.norm import plans

    t = Traits(hidden_size=4096, input_dtype="bfloat16", backward=True, warps_n=4)
    limit = plans.FUSE_ROW_ELEMENTS // 4096
    assert plans.one_launch(t, limit) and not plans.one_launch(t, limit + 1)
    assert not plans.one_launch(t.replace(has_weight=False, has_bias=False), 1)
    assert not plans.one_launch(t.replace(backward=False), 1)
    assert not plans.one_launch(t.replace(ctas_per_row=2, warps_n=2), 1)

    kernel = SimpleNamespace(resident_clusters=132)

    def prepared(rows, ld=4096, heads=1):
        x = layout.Rows("x", None, rows, ld, 0)
        return plans.Prepared({}, {"x": x}, 4096, rows, heads=heads)

    assert prepared(37).grid_groups(kernel, t) == 37
    assert prepared(37).grid_groups(kernel, t, most=8) == 8
    # One launch: at least `least` CTAs (those past the rows sum with the rest), `fused_parts` at most.
    assert [plans.fused_parts(t, r)[0] for r in (1, 37, 128, 256, 512, 1024)] == [32, 32, 64, 64, 128, 128]
    # Capped by the stream's block of working memory: fp32 sums of two quantities of 65536 columns fit 8
    # rows, four quantities (a second weight) of 4096 columns fit 64.
    wide = SimpleNamespace(parallel=False, compute_dtype="float32", hidden_size=65536)
    assert plans.fused_parts(wide, 1) == (8, 8)
    assert plans.fused_parts(t.replace(weight1_dtype="bfloat16"), 1024) == (64, 64)
    assert prepared(1).grid_groups(kernel, t, most=32, least=32) == 32
    assert prepared(37).grid_groups(kernel, t, most=32, least=32) == 32
    assert prepared(1).grid_groups(kernel, t, most=500, least=200) == 132  # resident CTAs still first
    assert prepared(1000).grid_groups(kernel, t, most=500) == 132  # resident CTAs first
    general = Traits(hidden_size=4097, input_dtype="bfloat16", backward=True, warps_n=4, bytes_per_ldg=16,
                     aligned_rows=False)
    period = layout.shift_period(4097, 64, general.elts_per_ldg)  # 8: rows shift by one element each
    assert period == 8
    assert prepared(64, ld=4097).grid_groups(kernel, general, most=4) == 8  # up to one whole period
    assert prepared(64, ld=4097).grid_groups(kernel, general, most=20) == 16
    per_head = t.replace(per_head=True, cache_weights=False, warps_m=2)
    groups = prepared(96, heads=12).grid_groups(kernel, per_head, most=5)
    assert groups % (12 // math.gcd(12, 2)) == 0 and groups == 6
    # Without a persistent grid: a group a CTA however many rows, up to the grid's size limit.
    unstaged = Traits(hidden_size=4096, input_dtype="bfloat16", warps_n=4, warps_m=4, stages=1, persistent=False)
    assert prepared(100_003).grid_groups(kernel, unstaged) == 25_001
    cluster = SimpleNamespace(resident_clusters=30)
    assert prepared(10**12).grid_groups(cluster, unstaged.replace(warps_m=1, ctas_per_row=2)) == (2**31 - 1) // 2
    shifted = Traits(hidden_size=4097, input_dtype="bfloat16", warps_n=4, bytes_per_ldg=16, aligned_rows=False,
                     stages=1, persistent=False)
    # General rows keep whole shift periods (8 here): 1000 groups, the first CTA also taking row 1000.
    assert prepared(1001, ld=4097).grid_groups(kernel, shifted) == 1000


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


@pytest.mark.parametrize("backward", [False, True])
def test_heuristic_shares_warps_between_short_rows(backward):
    """Rows shorter than a warp's loads (q/k heads of 64-256) share a warp; rows of 1024 and more, general rows
    and the tuned sizes keep whole warps; a staged CTA keeps at least 128 threads (the unstaged forward's
    shapes: test_heuristic_runs_short_rows_unstaged_sharing_warps)."""
    for n in (64, 128, 256):
        t = dispatch.heuristic(hidden_size=n, input_dtype="bfloat16", backward=backward, rms=True, row_axes=3,
                               per_head=True, has_bias=False, unstaged=False)
        assert t.lanes_per_row < 32 and t.threads_per_cta >= 128 and t.elts_per_ldg * t.lanes_per_row <= n * 4
        if not backward:
            assert dispatch.heuristic(hidden_size=n, input_dtype="bfloat16", rms=True, row_axes=3, per_head=True,
                                      has_bias=False).lanes_per_row < 32
    for n in (1024, 4096):
        assert dispatch.heuristic(hidden_size=n, input_dtype="bfloat16", backward=backward).lanes_per_row == 32
    assert dispatch.heuristic(hidden_size=100, input_dtype="bfloat16", aligned_rows=False,
                              backward=backward).lanes_per_row == 32
    for n in dispatch.TUNED_SIZES:
        assert dispatch.choose(hidden_size=n, input_dtype="bfloat16", backward=backward)[0].lanes_per_row == 32


@pytest.mark.parametrize("n,dtype,elts", [(4096, "bfloat16", 1), (4096, "float32", 1), (4097, "float32", 1),
                                          (1000, "bfloat16", 1), (4097, "float16", 1)])
@pytest.mark.parametrize("backward", [False, True])
def test_narrow_loads_aim_at_the_bytes_of_full_ones(n, dtype, elts, backward):
    """Loads under 8 bytes (odd layouts, batch-invariant mode) aim at the bytes a thread of 16-byte loads
    moves: one CTA a row up to N = 4096 (measured on rows 13 elements apart: 0.22-0.64 of copy with the
    clusters a 4-load target took, 0.67-0.88 now), never fewer than 8 loads a thread."""
    t = dispatch.heuristic(hidden_size=n, input_dtype=dtype, elts_per_ldg=elts, backward=backward)
    assert t.aligned_rows and t.elts_per_ldg == elts and t.ctas_per_row == 1 and t.ldgs >= 8


def test_late_dgamma_is_fp32_layernorm_backward_of_short_aligned_rows_and_keeps_its_occupancy():
    """late_dgamma (dgamma summed after the row reduction, for speed) holds for LayerNorm backwards of fp32 x
    in aligned rows of up to 16 elements a thread, and nowhere else; dispatch then caps their registers at
    128 (the CTAs an SM of 128 or 256 threads that the unmoved kernel has). The kernel's LATE_DGAMMA also
    holds for every REFINE_MEAN backward (its xhat is known only after the reduction), without that cap."""
    for n in (768, 1024, 4096, 8192, 16384, 32768):
        t = dispatch.choose(hidden_size=n, input_dtype="float32", backward=True)[0]
        assert t.late_dgamma and t.template_values()["LATE_DGAMMA"] == "true"
        if t.threads_per_cta in (128, 256):
            assert t.min_ctas_per_sm * t.threads_per_cta * 128 == 65536
    wide = dispatch.choose(hidden_size=65536, input_dtype="float32", backward=True)[0]
    assert wide.elts_per_thread > 16 and not wide.late_dgamma
    for call in (dict(input_dtype="bfloat16", backward=True), dict(input_dtype="float32", backward=True, rms=True),
                 dict(input_dtype="float32", backward=False), dict(input_dtype="float64", backward=True),
                 dict(input_dtype="float32", backward=True, hidden_size=4097)):  # 4097: general rows
        t = dispatch.choose(**{"hidden_size": 4096, **call})[0]
        assert not t.late_dgamma and t.dgamma_after_reduction == (t.backward and t.refine_mean)
        assert t.template_values()["LATE_DGAMMA"] == ("true" if t.dgamma_after_reduction else "false")
    general = dispatch.choose(hidden_size=4097, input_dtype="float32", backward=True)[0]
    assert general.refine_mean and general.template_values()["LATE_DGAMMA"] == "true"
    assert not general.late_dgamma  # so dispatch's late-dgamma register cap is not applied to it
    plain = dispatch.choose(hidden_size=4096, input_dtype="float32", backward=True)[0]
    for changes in (dict(dropout=True, dx0_dtype="float32"), dict(rowscale_dtype="float32", dx0_dtype="float32"),
                    dict(dx1_dtype="float32", dropout=True, dx0_dtype="float32"), dict(bytes_per_ldg=4)):
        t = plain.replace(**changes)  # with dropout, a row scale, x1's gradient, 4-byte vectors
        assert not t.late_dgamma, changes


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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_heuristic_runs_plain_forwards_unstaged(dtype):
    """Plain aligned forwards of 768-16384 (past 10 warps a row, powers of two, or 8 warps for 2-byte rows of
    at most 56 elements a thread on sm_90) get a CTA per row, 64 bytes of x a thread (32 with a residual),
    registers capped for 32 warps an SM (24 for those 8-warp rows; 48 registers for short 2-byte rows, 80 with
    weights wider than x); everything else keeps the persistent grid."""
    itemsize = dtypes.itemsize(dtype)
    for n in (768, 1024, 2048, 3072, 4096, 8192, 10240, 12288, 12800, 14336, 15360, 16384):
        warps = -(-n * itemsize // 64 // 32)
        served = warps <= 10 or warps & (warps - 1) == 0
        # Other 2-byte rows: 8 warps, 3 CTAs an SM, where whole 4-element vectors give at most 56 a thread.
        wide = not served and itemsize == 2 and n % 1024 == 0 and n // 256 <= 56
        for rms in (False, True):
            t = dispatch.heuristic(hidden_size=n, input_dtype=dtype, rms=rms, has_bias=not rms)
            assert t.persistent != (served or wide), (n, rms)
            if wide:
                assert (t.threads_per_cta, t.min_ctas_per_sm, t.elts_per_ldg, t.stages) == (256, 3, 4, 1)
                assert dispatch.heuristic(hidden_size=n, input_dtype=dtype, rms=rms, has_bias=not rms,
                                          arch=80).persistent  # sm_80: LayerNorm 14336 spilled
            elif served:
                threads = max(64, 32 * warps)
                regs = 48 if itemsize == 2 and n <= 16 * threads else 64
                assert (t.warps_m, t.threads_per_cta, t.stages, t.elts_per_ldg, t.ctas_per_row) == (1, threads, 1, 4, 1)
                assert t.min_ctas_per_sm == max(1, 65536 // (threads * regs)) and not t.cache_weights
    plain = dict(hidden_size=4096, input_dtype=dtype)
    wider = "float32" if itemsize == 2 else "float64"
    wide = dispatch.heuristic(**plain, weight_dtype=wider, bias_dtype=wider)
    assert not wide.persistent and wide.min_ctas_per_sm == 65536 // (wide.threads_per_cta * 80)
    # With a residual (two rows a thread): 32 bytes of x a thread, a 64-register cap.
    res = dispatch.heuristic(**plain, has_residual=True, residual_dtype=dtype)
    warps = -(-4096 * itemsize // 32 // 32)
    assert not res.persistent and res.threads_per_cta == 32 * warps == (4096 // res.elts_per_thread)
    assert res.min_ctas_per_sm == 65536 // (res.threads_per_cta * 64)
    wide_rows = dict(hidden_size=16384 if itemsize == 2 else 8192, has_residual=True, residual_dtype=dtype)
    assert dispatch.heuristic(**{**plain, **wide_rows}).persistent  # 32 warps a row with a residual: not served
    # fp8 outputs take the same shape.
    fp8 = dispatch.heuristic(**plain, has_residual=True, residual_dtype=dtype, output_dtype="float8_e4m3fn",
                             quant="row")
    assert not fp8.persistent and fp8.knobs() == res.knobs()
    for other in (dict(backward=True), dict(dropout=True),
                  dict(x1_dtype=dtype), dict(weight1_dtype=dtype), dict(aligned_rows=False),
                  dict(hidden_size=512, has_residual=True, residual_dtype=dtype), dict(hidden_size=32768),
                  dict(elts_per_ldg=2)):
        assert dispatch.heuristic(**{**plain, **other}).persistent, other


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_heuristic_runs_short_rows_unstaged_sharing_warps(dtype):
    """Rows under 768 elements without a residual: the fewest lanes holding 128 bytes of x a thread (32 on
    three-axis rows), 16-byte loads, two warps a CTA, 64 registers (128 past 64 bytes a thread)."""
    itemsize = dtypes.itemsize(dtype)
    vector = 16 // itemsize
    for n, axes in itertools.product((32, 64, 96, 128, 256, 384, 512, 640), (1, 3)):
        t = dispatch.heuristic(hidden_size=n, input_dtype=dtype, row_axes=axes)
        per_thread = (128 if axes == 1 else 32) // itemsize
        lanes = [k for k in LANES_PER_ROW if k * per_thread >= n and n % (k * vector) == 0]
        assert t.persistent == (not lanes), (n, axes)
        if lanes:
            held = n // lanes[0] * itemsize
            assert (t.lanes_per_row, t.warps_m, t.warps_n, t.elts_per_ldg, t.stages) == (lanes[0], 2, 1, vector, 1)
            assert t.min_ctas_per_sm == 65536 // (64 * (64 if held <= 64 else 128)) and not t.cache_weights
    # q/k heads of 128 bf16: 8 lanes of 16 elements; rows of a matrix: 4 lanes of 32.
    if dtype == "bfloat16":
        assert dispatch.heuristic(hidden_size=128, input_dtype=dtype, row_axes=3).lanes_per_row == 8
        assert dispatch.heuristic(hidden_size=128, input_dtype=dtype).lanes_per_row == 4
    # A residual, a ragged width (200: no lane count divides it in whole vectors) or narrow loads: staged.
    for other in (dict(has_residual=True, residual_dtype=dtype), dict(hidden_size=200),
                  dict(elts_per_ldg=vector // 2)):
        assert dispatch.heuristic(**{"hidden_size": 256, "input_dtype": dtype, **other}).persistent, other


def test_a_spilling_unstaged_pick_falls_back_to_the_staged_heuristic():
    call = dict(hidden_size=4096, input_dtype="bfloat16", weight_dtype="bfloat16", output_dtype="bfloat16")
    t, origin = dispatch.choose(arch=90, **call)
    assert origin == "heuristic" and not t.persistent and dispatch.may_fall_back(t, origin)
    plain = dispatch.fallback(90, **call)
    assert plain.persistent and plain == dispatch.heuristic(arch=90, unstaged=False, **call)
    persistent = dispatch.choose(arch=90, backward=True, **call)
    assert not dispatch.may_fall_back(persistent[0], "heuristic")
    # The checker's compile-only path replaces it as the GPU path does (plan._plan).
    case = check.Case("layer_norm", 4096, 3, "bfloat16", "bfloat16")
    picks = list(check.case_kernels([case], 90, spills=lambda traits: not traits.persistent))
    assert [(p.persistent, origin) for p, origin in picks] == [(True, "heuristic (the pick spills)")]


def test_a_spilling_measured_pick_tries_half_its_ctas_an_sm_before_the_heuristic(monkeypatch):
    """General rows borrow knobs measured on aligned rows; where they spill, the same shape at half the CTAs an
    SM (twice the registers a thread) comes first, then the staged heuristic. One function decides
    (`dispatch.without_spills`, through `dispatch.what_runs`), for the checker and for the GPU path (`plan._plan`,
    run here with its compiler stubbed: a kernel's local memory as the spill set says)."""
    from types import SimpleNamespace

    from cunorm import plan
    from cunorm.norm import plans

    case = check.Case("layer_norm_backward", 8193, 3, "bfloat16", "bfloat16")
    call = check.case_call(case)
    pick, origin = dispatch.choose(arch=90, **call)
    assert dispatch.measured(origin) and pick.persistent and pick.min_ctas_per_sm == 2 and not pick.aligned_rows
    half, half_origin = pick.replace(min_ctas_per_sm=1), f"{origin} {dispatch.HALF_CTAS}"
    plain = dispatch.fallback(90, **call)
    assert dispatch.fallbacks(pick, origin, 90, **call) == [(half, half_origin), (plain, dispatch.HEURISTIC_FALLBACK)]

    def checker_runs(spilling):  # the call's kernel (case_kernels adds the one-launch variant after it)
        return next(iter(check.case_kernels([case], 90, spills=spilling.__contains__)))

    monkeypatch.setattr(plan, "device_arch", lambda device_id: 90)
    monkeypatch.setattr(plan, "device_gpu", lambda device_id: None)

    def gpu_runs(spilling):
        monkeypatch.setattr(plan, "kernels_for", lambda t, device_id, source=None: {"k": SimpleNamespace()})
        monkeypatch.setattr(plan, "keeps_local_memory", lambda t, device_id: t in spilling)
        plan.forget_choices()
        try:
            return plan.resolve(plans.Family, None, call, 0)[0]
        finally:
            plan.forget_choices()

    for spilling, want in (({pick}, (half, half_origin)), ({pick, half}, (plain, dispatch.HEURISTIC_FALLBACK)),
                           ({pick, half, plain}, (plain, dispatch.HEURISTIC_FALLBACK)), (set(), (pick, origin))):
        assert checker_runs(spilling) == want and gpu_runs(spilling) == want[0], spilling
    # The heuristic's own staged pick has nothing to fall back to; the caller's knobs run as given.
    assert dispatch.fallbacks(plain, "heuristic", 90, **call) == [(plain, dispatch.HEURISTIC_FALLBACK)]
    assert dispatch.without_spills(pick, "caller", lambda t: True, 90, **call) == (pick, "caller")
    unstaged = dispatch.choose(arch=90, hidden_size=4096, input_dtype="bfloat16")[0]
    assert not unstaged.persistent and not dispatch.may_fall_back(unstaged, "caller")


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


def _sixteen_cta_backward_call() -> dict:
    """The call whose heuristic pick spans a 16-CTA cluster: RMSNorm's 2-byte backward at 262144."""
    return check.case_call(check.Case("rms_norm_backward", 262144, 3, "bfloat16", "bfloat16", has_bias=False))


def test_a_sixteen_cta_pick_this_gpu_holds_no_cluster_of_runs_within_portable_clusters(monkeypatch):
    """The heuristic's 2-byte backward at 262144 spans a 16-CTA (non-portable) cluster; on a GPU that holds
    none (the occupancy query finds no such cluster: ClusterNotResident where the kernels load), the GPU path
    runs the heuristic's pick within 8-CTA clusters, and says so; where one is resident, the pick runs."""
    from types import SimpleNamespace

    from cunorm import compiler, plan
    from cunorm.compiler import ClusterNotResident
    from cunorm.norm import plans

    call = _sixteen_cta_backward_call()
    pick, origin = dispatch.choose(arch=90, **call)
    assert pick.ctas_per_row == 16 and origin == dispatch.HEURISTIC
    portable = dispatch.fallback(90, **call)
    assert portable.ctas_per_row == 8

    def no_sixteen(t):
        if t.ctas_per_row > 8:
            raise ClusterNotResident("no 16-CTA cluster fits")
        return False

    assert dispatch.without_spills(pick, origin, no_sixteen, 90, **call) == (portable, dispatch.PORTABLE_FALLBACK)
    assert dispatch.without_spills(pick, origin, lambda t: False, 90, **call) == (pick, origin)
    monkeypatch.setattr(plan, "device_arch", lambda device_id: 90)
    monkeypatch.setattr(plan, "device_gpu", lambda device_id: None)

    def gpu_runs(resident: bool):
        def kernels_for(t, device_id, source=None):
            if t.ctas_per_row > 8 and not resident:
                raise ClusterNotResident("no 16-CTA cluster fits")
            return {"k": SimpleNamespace(local_bytes=0)}

        monkeypatch.setattr(plan, "kernels_for", kernels_for)
        monkeypatch.setattr(compiler, "kernels_for", kernels_for)  # what compiler.keeps_local_memory loads
        plan.forget_choices()
        try:
            return plan.resolve(plans.Family, None, call, 0)[0]
        finally:
            plan.forget_choices()

    assert gpu_runs(resident=False) == portable and gpu_runs(resident=True) == pick


def test_a_spilling_sixteen_cta_entry_whose_half_ctas_shape_is_not_resident_takes_the_portable_fallback():
    """A measured 16-CTA pick that spills tries its shape at half the CTAs an SM first (`fallbacks`); on a GPU
    that holds no 16-CTA cluster that shape raises ClusterNotResident too, and is passed over for the
    portable fallback (was: the exception escaped the call)."""
    from cunorm.compiler import ClusterNotResident

    call = _sixteen_cta_backward_call()
    pick = dispatch.choose(arch=90, **call)[0].replace(min_ctas_per_sm=2)
    assert pick.ctas_per_row == 16 and pick.persistent
    options = dispatch.fallbacks(pick, "a table", 90, **call)
    assert options[0][0].ctas_per_row == 16 and options[-1] == (dispatch.fallback(90, **call),
                                                                dispatch.HEURISTIC_FALLBACK)
    tried = []

    def spills(t):  # the pick loads (and spills) here; no other 16-CTA shape is resident
        tried.append(t)
        if t.ctas_per_row > 8 and t != pick:
            raise ClusterNotResident("no 16-CTA cluster fits")
        return t == pick

    assert dispatch.without_spills(pick, "a table", spills, 90, **call) == options[-1]
    assert tried == [pick, options[0][0], options[-1][0]]


def test_kernels_whose_cluster_is_not_resident_are_loaded_once(monkeypatch):
    """compiler.kernels_for remembers ClusterNotResident: a plan asks twice (the family's spill test, then
    dispatch's) and every later plan asks again; the kernels are compiled and queried once."""
    from cunorm import compiler

    loads = []

    def load(traits, device_id, source=None):
        loads.append(traits)
        raise compiler.ClusterNotResident("stand-in: no 16-CTA cluster fits")

    monkeypatch.setattr(compiler, "_load", load)
    monkeypatch.setattr(compiler, "_cache", {})
    monkeypatch.setattr(compiler, "_not_resident", {})
    t = Traits(hidden_size=262144, backward=True, input_dtype="bfloat16")
    for _ in range(3):
        with pytest.raises(compiler.ClusterNotResident, match="stand-in"):
            compiler.kernels_for(t, 0)
    assert loads == [t]
    with pytest.raises(compiler.ClusterNotResident):
        compiler.kernels_for(t, 1)  # another device asks for itself
    assert loads == [t, t]


def test_only_sixteen_cta_clusters_raise_cluster_not_resident(monkeypatch):
    """compiler._resident_clusters: no resident cluster of a non-portable size is ClusterNotResident (dispatch
    falls back), of a portable one a plain RuntimeError (a fault, not a GPU's shape)."""
    from types import SimpleNamespace

    from cunorm import compiler

    class Driver:
        def cuOccupancyMaxActiveClusters(self, count, fn, config):
            return 0  # CUDA_SUCCESS, count left at 0

    monkeypatch.setattr(compiler, "_driver", lambda: Driver())
    fn = SimpleNamespace(kernel=SimpleNamespace(ptr=1234))
    with pytest.raises(compiler.ClusterNotResident, match="16-CTA clusters"):
        compiler._resident_clusters(fn, 512, 1024, 16, 132)
    with pytest.raises(RuntimeError, match="8-CTA clusters") as e:
        compiler._resident_clusters(fn, 512, 1024, 8, 132)
    assert not isinstance(e.value, compiler.ClusterNotResident)


def test_sixteen_cta_clusters_only_for_backwards_whose_sums_then_fit():
    """The heuristic offers a 16-CTA cluster only to sm_90 backwards whose column sums fit 16 CTAs' shared
    memory and no portable cluster's: no forward takes one (8 CTAs hold every forward row up to 524288), nor
    a backward that 8 CTAs serve, nor a backward too wide for 16 CTAs' shared memory (its last resorts
    stay)."""
    for n in (131072, 196608, 262144, 393216, 524288):
        fwd = dispatch.heuristic(hidden_size=n, input_dtype="bfloat16")
        assert fwd.ctas_per_row <= 8, fwd.short()
    for n in (131072, 196608):
        assert dispatch.heuristic(hidden_size=n, input_dtype="bfloat16", backward=True).ctas_per_row <= 8
    wide = dispatch.heuristic(hidden_size=524288, input_dtype="bfloat16", backward=True)
    assert wide.ctas_per_row <= 8, wide.short()
    t = dispatch.heuristic(hidden_size=262144, input_dtype="bfloat16", backward=True, arch=100)
    assert t.ctas_per_row <= 8, t.short()


def test_a_sixteen_cta_kernel_is_allowed_its_cluster(monkeypatch):
    """compiler._allow_non_portable_cluster sets CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED (14) to 1
    on the loaded function (the driver refuses a 16-CTA cluster's occupancy query and launch without it)."""
    from types import SimpleNamespace

    from cunorm import compiler

    calls = []

    class Driver:
        def cuFuncSetAttribute(self, fn, attribute, value):
            calls.append((fn.value, attribute, value))
            return 0

    monkeypatch.setattr(compiler, "_driver", lambda: Driver())
    compiler._allow_non_portable_cluster(SimpleNamespace(kernel=SimpleNamespace(ptr=1234)))
    assert calls == [(1234, 14, 1)]


def test_the_shared_memory_rule_counts_the_static_scratch_too(monkeypatch):
    """The driver refuses a launch whose dynamic and static shared memory together pass the GPU's per-CTA
    limit: the rule counts both (a forced shape within a few hundred bytes of the limit gets the rule's error
    naming its knobs, not the driver's at load), on every arch."""
    from cunorm import traits as traits_module

    t = Traits(hidden_size=16384, input_dtype="bfloat16", backward=True, warps_n=16, ctas_per_row=2, stages=1,
               smem_accumulators=True, pushed_exchange=True)
    fits = t.replace(pushed_exchange=False, ctas_per_row=1, hidden_size=8192)
    # LayerNorm's two row sums (K = 2) in 2 x 1 x 16 warp slots and 2 x 2 CTA slots of fp32, two mbarriers
    assert t.row_sums == 2 and t.static_smem_bytes == (2 * 16 * 2 + 2 * 2 * 2) * 4 + 16
    assert t.smem_footprint == t.smem_bytes + t.static_smem_bytes
    assert t.replace(rms=True).row_sums == 1
    assert t.replace(pushed_exchange=False).static_smem_bytes < t.static_smem_bytes
    assert t.smem_bytes > 0 and fits.smem_bytes > 0
    monkeypatch.setitem(traits_module.SMEM_LIMIT, 90, t.smem_bytes)  # the dynamic part alone fits exactly
    with pytest.raises(ValueError, match=r"WARPS_N=16 .*bytes of dynamic and up to \d+ of static shared memory"):
        t.replace(stages=1)
    monkeypatch.setitem(traits_module.SMEM_LIMIT, 90, fits.smem_footprint)
    fits.replace(stages=1).check_arch(90)  # exactly at the limit: legal
    monkeypatch.setitem(traits_module.SMEM_LIMIT, 80, fits.smem_footprint - 1)
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


def test_keeps_local_memory_asks_every_loaded_kernel(monkeypatch):
    """compiler.keeps_local_memory (the GPU path's and the tuner's one spill test): local memory in any of a
    traits' loaded kernels (a spill or a stack frame), none in all."""
    from types import SimpleNamespace

    from cunorm import compiler

    loaded = {}
    monkeypatch.setattr(compiler, "kernels_for", lambda t, device_id: loaded)
    loaded.update(main=SimpleNamespace(local_bytes=0), finalize=SimpleNamespace(local_bytes=0))
    assert not compiler.keeps_local_memory(Traits(hidden_size=1024), 0)
    loaded["finalize"] = SimpleNamespace(local_bytes=8)
    assert compiler.keeps_local_memory(Traits(hidden_size=1024), 0)
