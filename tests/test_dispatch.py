"""Tier A: what dispatch picks: every tuned entry legal, the heuristic's shapes and policies."""
import itertools
import math

import pytest

from cunorm import Traits, dispatch, dtypes
from cunorm.heuristic import heuristic
from cunorm.traits import KNOBS
from cunorm.traits_rules import LANES_PER_ROW


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
            t = heuristic(hidden_size=n, input_dtype=dtype, weight_dtype=dtype, output_dtype=dtype,
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
                t = heuristic(hidden_size=n, input_dtype=dtype, weight_dtype=dtype, output_dtype=out,
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
    t = heuristic(hidden_size=16384, input_dtype="bfloat16", weight_dtype="bfloat16",
                  output_dtype="bfloat16", arch=80)
    assert t.ctas_per_row == 1


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


@pytest.mark.parametrize("backward", [False, True])
def test_heuristic_shares_warps_between_short_rows(backward):
    """Rows shorter than a warp's loads (q/k heads of 64-256) share a warp; rows of 1024 and more, general rows
    and the tuned sizes keep whole warps; a staged CTA keeps at least 128 threads (the unstaged forward's
    shapes: test_heuristic_runs_short_rows_unstaged_sharing_warps)."""
    for n in (64, 128, 256):
        t = heuristic(hidden_size=n, input_dtype="bfloat16", backward=backward, rms=True, row_axes=3,
                      per_head=True, has_bias=False, unstaged=False)
        assert t.lanes_per_row < 32 and t.threads_per_cta >= 128 and t.elts_per_ldg * t.lanes_per_row <= n * 4
        if not backward:
            assert heuristic(hidden_size=n, input_dtype="bfloat16", rms=True, row_axes=3, per_head=True,
                             has_bias=False).lanes_per_row < 32
    for n in (1024, 4096):
        assert heuristic(hidden_size=n, input_dtype="bfloat16", backward=backward).lanes_per_row == 32
    assert heuristic(hidden_size=100, input_dtype="bfloat16", aligned_rows=False,
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
    t = heuristic(hidden_size=n, input_dtype=dtype, elts_per_ldg=elts, backward=backward)
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
            t = heuristic(hidden_size=n, input_dtype=dtype, rms=rms, has_bias=not rms)
            assert t.persistent != (served or wide), (n, rms)
            if wide:
                assert (t.threads_per_cta, t.min_ctas_per_sm, t.elts_per_ldg, t.stages) == (256, 3, 4, 1)
                assert heuristic(hidden_size=n, input_dtype=dtype, rms=rms, has_bias=not rms,
                                 arch=80).persistent  # sm_80: LayerNorm 14336 spilled
            elif served:
                threads = max(64, 32 * warps)
                regs = 48 if itemsize == 2 and n <= 16 * threads else 64
                assert (t.warps_m, t.threads_per_cta, t.stages, t.elts_per_ldg, t.ctas_per_row) == (1, threads, 1, 4, 1)
                assert t.min_ctas_per_sm == max(1, 65536 // (threads * regs)) and not t.cache_weights
    plain = dict(hidden_size=4096, input_dtype=dtype)
    wider = "float32" if itemsize == 2 else "float64"
    wide = heuristic(**plain, weight_dtype=wider, bias_dtype=wider)
    assert not wide.persistent and wide.min_ctas_per_sm == 65536 // (wide.threads_per_cta * 80)
    # With a residual (two rows a thread): 32 bytes of x a thread, a 64-register cap.
    res = heuristic(**plain, has_residual=True, residual_dtype=dtype)
    warps = -(-4096 * itemsize // 32 // 32)
    assert not res.persistent and res.threads_per_cta == 32 * warps == (4096 // res.elts_per_thread)
    assert res.min_ctas_per_sm == 65536 // (res.threads_per_cta * 64)
    wide_rows = dict(hidden_size=16384 if itemsize == 2 else 8192, has_residual=True, residual_dtype=dtype)
    assert heuristic(**{**plain, **wide_rows}).persistent  # 32 warps a row with a residual: not served
    # fp8 outputs take the same shape.
    fp8 = heuristic(**plain, has_residual=True, residual_dtype=dtype, output_dtype="float8_e4m3fn",
                    quant="row")
    assert not fp8.persistent and fp8.knobs() == res.knobs()
    for other in (dict(backward=True), dict(dropout=True),
                  dict(x1_dtype=dtype), dict(weight1_dtype=dtype), dict(aligned_rows=False),
                  dict(hidden_size=512, has_residual=True, residual_dtype=dtype), dict(hidden_size=32768),
                  dict(elts_per_ldg=2)):
        assert heuristic(**{**plain, **other}).persistent, other


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_heuristic_runs_short_rows_unstaged_sharing_warps(dtype):
    """Rows under 768 elements without a residual: the fewest lanes holding 128 bytes of x a thread (32 on
    three-axis rows), 16-byte loads, two warps a CTA, 64 registers (128 past 64 bytes a thread)."""
    itemsize = dtypes.itemsize(dtype)
    vector = 16 // itemsize
    for n, axes in itertools.product((32, 64, 96, 128, 256, 384, 512, 640), (1, 3)):
        t = heuristic(hidden_size=n, input_dtype=dtype, row_axes=axes)
        per_thread = (128 if axes == 1 else 32) // itemsize
        lanes = [k for k in LANES_PER_ROW if k * per_thread >= n and n % (k * vector) == 0]
        assert t.persistent == (not lanes), (n, axes)
        if lanes:
            held = n // lanes[0] * itemsize
            assert (t.lanes_per_row, t.warps_m, t.warps_n, t.elts_per_ldg, t.stages) == (lanes[0], 2, 1, vector, 1)
            assert t.min_ctas_per_sm == 65536 // (64 * (64 if held <= 64 else 128)) and not t.cache_weights
    # q/k heads of 128 bf16: 8 lanes of 16 elements; rows of a matrix: 4 lanes of 32.
    if dtype == "bfloat16":
        assert heuristic(hidden_size=128, input_dtype=dtype, row_axes=3).lanes_per_row == 8
        assert heuristic(hidden_size=128, input_dtype=dtype).lanes_per_row == 4
    # A residual, a ragged width (200: no lane count divides it in whole vectors) or narrow loads: staged.
    for other in (dict(has_residual=True, residual_dtype=dtype), dict(hidden_size=200),
                  dict(elts_per_ldg=vector // 2)):
        assert heuristic(**{"hidden_size": 256, "input_dtype": dtype, **other}).persistent, other
