"""Tier A: dispatch's fallbacks (spilling picks, clusters a GPU does not hold) and the compiled kernels' cache."""
import pytest

from cunorm import Traits, check, dispatch
from cunorm.heuristic import heuristic


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


def test_a_spilling_unstaged_pick_falls_back_to_the_staged_heuristic():
    call = dict(hidden_size=4096, input_dtype="bfloat16", weight_dtype="bfloat16", output_dtype="bfloat16")
    t, origin = dispatch.choose(arch=90, **call)
    assert origin == "heuristic" and not t.persistent and dispatch.may_fall_back(t, origin)
    plain = dispatch.fallback(90, **call)
    assert plain.persistent and plain == heuristic(arch=90, unstaged=False, **call)
    persistent = dispatch.choose(arch=90, backward=True, **call)
    assert not dispatch.may_fall_back(persistent[0], "heuristic")
    # The checker's compile-only path replaces it as the GPU path does (plan._plan).
    case = check.Case("layer_norm", 4096, 3, "bfloat16", "bfloat16")
    picks = list(check.case_kernels([case], 90, spills=lambda traits: not traits.persistent))
    assert [(p.persistent, origin) for p, origin in picks] == [(True, "heuristic (the pick spills)")]


def test_a_spilling_measured_pick_tries_half_its_ctas_an_sm_and_half_its_loads_before_the_heuristic(monkeypatch):
    """General rows borrow knobs measured on aligned rows; where they spill, the same shape at half the CTAs an
    SM (twice the registers a thread) comes first, then at half its load width, then the staged heuristic.
    One function decides
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
    narrow, narrow_origin = pick.replace(bytes_per_ldg=pick.bytes_per_ldg // 2), f"{origin} {dispatch.HALF_LOADS}"
    assert narrow.bytes_per_ldg == 8 and narrow.ldgs > pick.ldgs
    plain = dispatch.fallback(90, **call)
    assert dispatch.fallbacks(pick, origin, 90, **call) == [(half, half_origin), (narrow, narrow_origin),
                                                            (plain, dispatch.HEURISTIC_FALLBACK)]

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

    for spilling, want in (({pick}, (half, half_origin)), ({pick, half}, (narrow, narrow_origin)),
                           ({pick, narrow}, (half, half_origin)),
                           ({pick, half, narrow}, (plain, dispatch.HEURISTIC_FALLBACK)),
                           ({pick, half, narrow, plain}, (plain, dispatch.HEURISTIC_FALLBACK)), (set(), (pick, origin))):
        assert checker_runs(spilling) == want and gpu_runs(spilling) == want[0], spilling
    # The heuristic's own staged pick has nothing to fall back to; the caller's knobs run as given.
    assert dispatch.fallbacks(plain, "heuristic", 90, **call) == [(plain, dispatch.HEURISTIC_FALLBACK)]
    assert dispatch.without_spills(pick, "caller", lambda t: True, 90, **call) == (pick, "caller")
    unstaged = dispatch.choose(arch=90, hidden_size=4096, input_dtype="bfloat16")[0]
    assert not unstaged.persistent and not dispatch.may_fall_back(unstaged, "caller")


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
    """A measured 16-CTA pick that spills tries its shape at half the CTAs an SM and at half its load width
    first (`fallbacks`); on a GPU that holds no 16-CTA cluster those shapes raise ClusterNotResident too, and
    are passed over for the portable fallback (was: the exception escaped the call)."""
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
    assert [why for _, why in options] == [f"a table {dispatch.HALF_CTAS}", f"a table {dispatch.HALF_LOADS}",
                                           dispatch.HEURISTIC_FALLBACK]
    assert options[1][0] == pick.replace(bytes_per_ldg=pick.bytes_per_ldg // 2) and options[1][0].ctas_per_row == 16
    assert tried == [pick] + [t for t, _ in options]


def test_a_spilling_pick_with_rows_ahead_tries_itself_without_them_first():
    """A measured pick with register_ahead that spills for a call (another weight dtype, general rows
    borrowing it) runs without the knob first: the same shape, a row's vectors fewer registers a thread; then
    the halves of its register budget and the heuristic, each as for any pick."""
    case = check.Case("layer_norm_backward", 4096, 3, "bfloat16", "float32")
    call = check.case_call(case)
    pick = dispatch.from_knobs(dict(warps_n=8, bytes_per_ldg=8, stages=1, smem_accumulators=True,
                                    min_ctas_per_sm=2, register_ahead=True), **call)
    options = dispatch.fallbacks(pick, "a table", 90, **call)
    assert options[0] == (pick.replace(register_ahead=False), f"a table {dispatch.NOT_AHEAD}")
    assert [why for _, why in options[1:]] == [f"a table {dispatch.HALF_CTAS}", f"a table {dispatch.HALF_LOADS}",
                                               dispatch.HEURISTIC_FALLBACK]
    assert all(t.register_ahead for t, _ in options[1:-1])
    spilling = {pick}
    assert dispatch.without_spills(pick, "a table", spilling.__contains__, 90, **call) == options[0]
    plain = pick.replace(register_ahead=False)
    assert dispatch.fallbacks(plain, "a table", 90, **call)[0][1] == f"a table {dispatch.HALF_CTAS}"


def test_a_spilling_pick_with_statistics_ahead_tries_itself_without_them_first():
    """A measured pick with stats_ahead that spills runs without its statistics ahead first (2 registers
    fewer), then without its rows ahead too (both knobs off: stats_ahead needs register_ahead), then as any
    pick."""
    case = check.Case("layer_norm_backward", 4096, 3, "bfloat16", "float32")
    call = check.case_call(case)
    pick = dispatch.from_knobs(dict(warps_n=8, bytes_per_ldg=8, stages=1, smem_accumulators=True,
                                    min_ctas_per_sm=2, register_ahead=True, stats_ahead=True), **call)
    options = dispatch.fallbacks(pick, "a table", 90, **call)
    assert options[:2] == [(pick.replace(stats_ahead=False), f"a table {dispatch.NOT_STATS_AHEAD}"),
                           (pick.replace(register_ahead=False, stats_ahead=False), f"a table {dispatch.NOT_AHEAD}")]
    assert [why for _, why in options[2:]] == [f"a table {dispatch.HALF_CTAS}", f"a table {dispatch.HALF_LOADS}",
                                               dispatch.HEURISTIC_FALLBACK]
    assert dispatch.without_spills(pick, "a table", {pick}.__contains__, 90, **call) == options[0]


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
        fwd = heuristic(hidden_size=n, input_dtype="bfloat16")
        assert fwd.ctas_per_row <= 8, fwd.short()
    for n in (131072, 196608):
        assert heuristic(hidden_size=n, input_dtype="bfloat16", backward=True).ctas_per_row <= 8
    wide = heuristic(hidden_size=524288, input_dtype="bfloat16", backward=True)
    assert wide.ctas_per_row <= 8, wide.short()
    t = heuristic(hidden_size=262144, input_dtype="bfloat16", backward=True, arch=100)
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
