"""cunorm.search_space: the keys `cunorm tune` measures and the candidate traits it screens per key (tier A: no
GPU, no compiler)."""
import itertools

import pytest

from cunorm import search_space
from cunorm.heuristic import cluster_offered, heuristic, late_dgamma_registers
from cunorm.traits_rules import ctas_for_registers


def test_plan_one_job_per_key_and_says_what_shares_one():
    jobs, notes = search_space.plan((1024, 4100, 4097), ("fwd",), (False, True), ("bfloat16", "float16", "float32"))
    keys = {(j.key.residual, j.key.n, j.key.input_bytes, j.key.general): (j.dtype, j.n) for j in jobs}
    assert keys == {(r, 1024, 2, False): ("bfloat16", 1024) for r in (False, True)} | {
        (r, 4096, 2, True): ("bfloat16", 4100) for r in (False, True)} | {  # 4097 shares 4100's general key
        (r, 1024, 4, False): ("float32", 1024) for r in (False, True)} | {
        (r, 4100, 4, False): ("float32", 4100) for r in (False, True)} | {  # whole 16-byte vectors of fp32
        (r, 4096, 4, True): ("float32", 4097) for r in (False, True)}
    assert len(jobs) == len(keys) and all(not j.key.backward and not j.key.rms for j in jobs)
    assert notes == ["float16 shares bfloat16's entries (2-byte inputs): measured as bfloat16",
                     "N=4097 shares N=4100's entries (bfloat16: the general rows beside N=4096)"]


def test_candidates_are_the_kernels_dispatch_would_run_for_the_key():
    general = search_space.candidates(4100, "bfloat16", False, residual=True)
    aligned = search_space.candidates(4096, "bfloat16", False)
    assert general and all(not t.aligned_rows and t.has_residual for t in general)
    assert {t.bytes_per_ldg for t in aligned} == {8, 16} and all(t.aligned_rows for t in aligned)
    assert {t.warps_n for t in search_space.candidates(4096, "bfloat16", True, warps_n=(3, 4))} == {3, 4}
    before_clusters = search_space.candidates(16384, "bfloat16", False, arch=80)
    assert before_clusters and not any(t.ctas_per_row > 1 for t in before_clusters)


@pytest.mark.parametrize("n,dtype,found", [(14336, "bfloat16", (2, 14)), (15360, "bfloat16", (8, 3)),
                                           (6144, "float32", (1, 12))])
def test_backward_rows_with_an_odd_factor_are_offered_warp_counts_that_split_them_evenly(n, dtype, found):
    """Beside the powers of two, a backward is screened on the WARPS_N that split its row into whole loads a
    thread at each CTA count (version 69's picks at 14336 and 15360 among them), and on no other; a forward,
    a row of 2^k elements and a given --warps-n get none."""
    screened = search_space.candidates(n, dtype, True)
    odd = [t for t in screened if t.warps_n & (t.warps_n - 1)]
    assert found in {(t.ctas_per_row, t.warps_n) for t in odd}
    assert all(t.full_tiles for t in odd)  # whole loads a thread: N / (load elements * threads a row) loads
    assert not any(t.warps_n & (t.warps_n - 1) for t in search_space.candidates(n, dtype, False))
    assert not any(t.warps_n & (t.warps_n - 1) for t in search_space.candidates(8192, dtype, True))
    assert {t.warps_n for t in search_space.candidates(n, dtype, True, warps_n=(4,))} == {4}


def test_sixteen_cta_candidates_are_those_dispatch_offers():
    """16-CTA (non-portable) clusters: tried for sm_90 backwards whose column sums then fit shared memory, as
    the heuristic offers them; never for forwards, other GPUs or rows whose sums would not fit."""
    wide = search_space.candidates(262144, "bfloat16", True)
    sixteen = [t for t in wide if t.ctas_per_row == 16]
    assert sixteen and all(cluster_offered(t, 90) for t in sixteen)
    pick = heuristic(hidden_size=262144, input_dtype="bfloat16", backward=True)  # 16 CTAs
    assert (16, pick.warps_n, pick.bytes_per_ldg) in {(t.ctas_per_row, t.warps_n, t.bytes_per_ldg) for t in wide}
    assert not any(t.ctas_per_row == 16 for t in search_space.candidates(262144, "bfloat16", False))
    assert not any(t.ctas_per_row == 16 for t in search_space.candidates(262144, "bfloat16", True, arch=100))
    assert not any(t.ctas_per_row == 16 for t in search_space.candidates(524288, "bfloat16", True))


def test_refinements_are_what_dispatch_runs_for_a_late_dgamma_backward():
    """A late-dgamma backward (fp32 LayerNorm, 16-byte vectors) keeps dispatch's register cap among the extras:
    an entry measured at one CTA an SM would run at two (the H100 table's 2048 with a residual did)."""
    from cunorm import dispatch

    shape = dispatch.choose(hidden_size=2048, input_dtype="float32", backward=True, has_residual=True,
                            residual_dtype="float32", tuned=False)[0]
    extras = search_space.refinements(shape)
    late = [t for t in extras if t.late_dgamma and t.threads_per_cta in (128, 256)]
    assert late and all(t.min_ctas_per_sm > 1 for t in late)  # one CTA an SM is what dispatch raises
    assert all(late_dgamma_registers(t) == t for t in extras) and len(set(extras)) == len(extras)


@pytest.mark.parametrize("n, warps, steps", [(12288, 8, [1, 3, 6, 9]), (2048, 4, [1, 2, 3]), (3072, 4, [1, 3, 4]),
                                              (1536, 4, [1, 2]), (1024, 4, [1])])
def test_register_sum_variants_move_one_step_and_a_quarter_half_and_three_quarters_of_the_steps(n, warps, steps):
    """A backward with shared-memory column sums is offered its first step's, and its first quarter, half and
    three quarters of load steps' sums in registers (as far as whole steps go); one with its sums in registers,
    a variant already, or a forward is offered none. A variant's extras are its all-in-shared-memory self's (an
    incumbent from the table may hold sums in registers)."""
    from cunorm.traits import Traits

    t = Traits(hidden_size=n, input_dtype="bfloat16", backward=True, warps_n=warps, bytes_per_ldg=8, stages=1,
               smem_accumulators=True)
    variants = search_space.register_sum_variants(t)
    assert [v.register_sum_steps for v in variants] == steps
    assert all(v == t.replace(register_sum_steps=v.register_sum_steps) for v in variants)
    assert search_space.register_sum_variants(t.replace(smem_accumulators=False)) == []
    assert search_space.register_sum_variants(variants[0]) == []
    assert search_space.register_sum_variants(Traits(hidden_size=n, input_dtype="bfloat16", warps_n=warps)) == []
    extras = search_space.refinements(variants[-1])
    assert extras == search_space.refinements(t) and any(not e.smem_accumulators for e in extras)


def test_layer_norm_cluster_forwards_are_refined_with_merged_moments_too():
    """Each refinement of a LayerNorm forward of cluster rows (staged or unstaged) is tried again with
    merged_moments; RMSNorm, backwards and one-CTA rows never."""
    from cunorm import dispatch

    for n, unstaged in ((65536, False), (131072, True)):
        shape = dispatch.choose(hidden_size=n, input_dtype="float32", tuned=False)[0]
        shape = shape.replace(persistent=False, stages=1) if unstaged else shape
        extras = search_space.refinements(shape)
        plain = [t for t in extras if not t.merged_moments]
        assert shape.ctas_per_row > 1 and plain
        assert sorted(t.short() for t in extras if t.merged_moments) == sorted(
            t.replace(merged_moments=True).short() for t in plain)
    for call in (dict(hidden_size=65536, rms=True), dict(hidden_size=65536, backward=True),
                 dict(hidden_size=4096)):
        shape = dispatch.choose(input_dtype="float32", tuned=False, **call)[0]
        assert not any(t.merged_moments for t in search_space.refinements(shape)), call


@pytest.mark.parametrize("pushed", [False, True])
def test_cluster_rows_are_refined_with_the_other_exchange_too(pushed):
    """Each refinement of a cluster row (forward or backward, staged or unstaged, merged moments or not) is
    tried again with the other exchange (pushed or barrier); one-CTA rows never."""
    from cunorm import dispatch

    for call, unstaged in ((dict(hidden_size=65536), False), (dict(hidden_size=131072), True),
                           (dict(hidden_size=65536, rms=True, backward=True), False)):
        shape = dispatch.choose(input_dtype="float32", tuned=False, **call)[0]
        shape = shape.replace(persistent=False, stages=1) if unstaged else shape
        extras = search_space.refinements(shape.replace(pushed_exchange=pushed))
        same = [t for t in extras if t.pushed_exchange == pushed]
        assert shape.ctas_per_row > 1 and same, call
        assert sorted(t.short() for t in extras if t.pushed_exchange != pushed) == sorted(
            t.replace(pushed_exchange=not pushed).short() for t in same), call
    shape = dispatch.choose(hidden_size=4096, input_dtype="float32", tuned=False)[0]
    assert shape.ctas_per_row == 1 and not any(t.pushed_exchange for t in search_space.refinements(shape))


def test_cluster_rows_are_screened_with_pushed_exchanges():
    """Every candidate shape of cluster rows (staged or unstaged, forward and backward) has pushed_exchange on,
    and no one-CTA shape has it."""
    for backward in (False, True):
        shapes = search_space.candidates(16384, "bfloat16", backward)
        assert any(t.ctas_per_row == 1 for t in shapes) and any(t.ctas_per_row > 1 for t in shapes)
        assert all(t.pushed_exchange == (t.ctas_per_row > 1) for t in shapes), backward


def test_forward_candidates_include_each_shape_unstaged_at_both_screening_caps():
    """Every forward shape, cluster shapes included, is also screened unstaged at each of
    UNSTAGED_SCREEN_CAPS with weights held and re-read (one cap and held weights alone dropped LayerNorm
    rows of 40-64 elements a thread as spills); the backward has no unstaged grid."""
    forward = search_space.candidates(15360, "bfloat16", False, warps_n=(12,))
    staged = [t for t in forward if t.persistent]
    unstaged = {t for t in forward if not t.persistent}
    assert staged and any(t.ctas_per_row > 1 for t in staged)
    for shape in staged:
        for cap, cache in itertools.product(search_space.UNSTAGED_SCREEN_CAPS, (False, True)):
            want = shape.replace(persistent=False, stages=1, cache_weights=cache,
                                 min_ctas_per_sm=ctas_for_registers(shape.threads_per_cta, cap))
            assert want in unstaged, want.short()
    assert any(t.ctas_per_row > 1 for t in unstaged)
    assert all(t.persistent for t in search_space.candidates(15360, "bfloat16", True, warps_n=(12,)))


def test_unchecked_whole_steps_are_offered_to_rows_without_full_tiles_only():
    """The variant with its whole load steps unchecked: offered to general rows and to aligned rows of a
    partial last step (with whole steps), the same traits but the knob; not to full tiles, to rows with no
    whole step, or to a variant already. A variant's extras are its checked self's."""
    from cunorm.traits import Traits

    general = Traits(hidden_size=4097, input_dtype="bfloat16", warps_n=4, bytes_per_ldg=8, aligned_rows=False)
    partial = Traits(hidden_size=2304, input_dtype="bfloat16", backward=True, warps_n=4, bytes_per_ldg=8)
    for t in (general, partial):
        (v,) = search_space.unchecked_whole_steps_variants(t)
        assert v == t.replace(unchecked_whole_steps=True) and not t.full_tiles
        assert search_space.unchecked_whole_steps_variants(v) == []
        assert search_space.refinements(v) == search_space.refinements(t)
    full = Traits(hidden_size=4096, input_dtype="bfloat16", warps_n=4, bytes_per_ldg=8)
    no_whole_step = Traits(hidden_size=384, input_dtype="bfloat16", warps_n=4, bytes_per_ldg=16)
    assert full.full_tiles and no_whole_step.whole_steps == 0
    assert search_space.unchecked_whole_steps_variants(full) == []
    assert search_space.unchecked_whole_steps_variants(no_whole_step) == []


def test_sum_chains_are_offered_to_forwards_up_to_a_vector():
    """A forward's row sums in 2 and 4 chains (as many as a vector's elements allow), the same traits but the
    knob; not to a backward or to a variant already. A variant's extras are its one-chain self's."""
    from cunorm.traits import Traits

    bf16 = Traits(hidden_size=32769, input_dtype="bfloat16", warps_n=8, ctas_per_row=4, bytes_per_ldg=8,
                  aligned_rows=False)
    assert search_space.sum_chains_variants(bf16) == [bf16.replace(sum_chains=2), bf16.replace(sum_chains=4)]
    fp32 = Traits(hidden_size=4097, input_dtype="float32", warps_n=4, bytes_per_ldg=8, aligned_rows=False)
    (two,) = search_space.sum_chains_variants(fp32)
    assert two == fp32.replace(sum_chains=2) and fp32.elts_per_ldg == 2
    assert search_space.sum_chains_variants(two) == []
    assert search_space.refinements(two) == search_space.refinements(fp32)
    assert search_space.sum_chains_variants(bf16.replace(backward=True)) == []


def test_rows_ahead_in_registers_are_offered_to_unstaged_persistent_backwards():
    """A backward with stages=1 (a persistent grid, as every backward's) again with its next row loaded into
    registers ahead (`register_ahead`), the same traits but the knob; not to a staged one, a forward or a
    variant already. A variant's extras are its plain self's."""
    from cunorm.traits import Traits

    bwd = Traits(hidden_size=10240, input_dtype="bfloat16", backward=True, warps_n=4, ctas_per_row=4,
                 bytes_per_ldg=8, stages=1, smem_accumulators=True, register_sum_steps=1, pushed_exchange=True)
    (ahead,) = search_space.register_ahead_variants(bwd)
    assert ahead == bwd.replace(register_ahead=True)
    assert search_space.register_ahead_variants(ahead) == []
    assert search_space.refinements(ahead) == search_space.refinements(bwd)
    assert search_space.register_ahead_variants(bwd.replace(stages=2)) == []
    fwd = Traits(hidden_size=4096, input_dtype="bfloat16", warps_n=4, bytes_per_ldg=16, stages=1)
    assert search_space.register_ahead_variants(fwd) == []


def test_statistics_ahead_are_offered_to_backwards_with_rows_ahead():
    """A backward with rows ahead in registers again with its rows' mean and rstd ahead too (`stats_ahead`),
    the same traits but the knob; not to one without rows ahead or a variant already. A variant's extras are
    its plain self's."""
    from cunorm.traits import Traits

    bwd = Traits(hidden_size=10240, input_dtype="bfloat16", backward=True, warps_n=4, ctas_per_row=4,
                 bytes_per_ldg=8, stages=1, smem_accumulators=True, pushed_exchange=True, register_ahead=True)
    (held,) = search_space.stats_ahead_variants(bwd)
    assert held == bwd.replace(stats_ahead=True)
    assert search_space.stats_ahead_variants(held) == []
    assert search_space.refinements(held) == search_space.refinements(bwd)
    assert search_space.stats_ahead_variants(bwd.replace(register_ahead=False)) == []
