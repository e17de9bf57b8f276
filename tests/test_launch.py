"""Tier A: packed launch arguments (no GPU: the driver call is intercepted)."""
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

from cunorm import launch, scratch


@pytest.fixture
def launched(monkeypatch):
    """The parameter slots of every launch, as uint64 values, in order."""
    seen = []

    def fake(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        seen.append(SimpleNamespace(grid=gx, threads=bx, smem=smem, stream=stream, params=params))

    monkeypatch.setattr(launch, "_launch", fake)
    return seen


def _kernel(threads=128, smem=0):
    return SimpleNamespace(function=SimpleNamespace(kernel=SimpleNamespace(ptr=7)), threads=threads, smem=smem)


def _slot_values(k) -> list:
    """Each parameter's first slot (as uint64), found through the parameter array as the driver finds it."""
    base = k.slots.buffer_info()[0]
    s = np.frombuffer(k.slots, np.uint64)
    return [int(s[(int(p) - base) // 8]) for p in np.frombuffer(k._params, np.uint64)]


def test_per_call_slots_are_written_and_constants_kept(launched):
    args = [("ptr", "x"), ("ptr", "absent"), ("i64", -5), ("ptr", "y"), ("i32", 3), ("u32", 2**32 - 1),
            ("f32", 0.5), ("f32", "eps"), ("ptr", "z")]
    k = launch.Launch(_kernel(256, 1024), 40, args)
    k.bind({"x": 0, "y": 1, "z": 2, "eps": 3})
    for values in ([10, 20, 30, launch.f32_bits(1e-5)], [11, 21, 31, launch.f32_bits(2.0)]):
        k(values, stream=99)
        p = _slot_values(k)
        assert [p[0], p[1], p[3], p[8]] == [values[0], 0, values[1], values[2]]
        assert np.uint64(p[2]).view(np.int64) == -5
        assert p[4] == 3 and p[5] == 2**32 - 1
        assert np.uint32(p[6]).view(np.float32) == 0.5
        assert np.uint32(p[7]).view(np.float32) == np.float32(1e-5 if values[0] == 10 else 2.0)
    assert [(c.grid, c.threads, c.smem, c.stream) for c in launched] == [(40, 256, 1024, 99)] * 2
    # The slots a call writes come first, in the parameters' order: one run, one pack.
    assert [k.firsts[i] for i in (0, 3, 7, 8)] == [0, 1, 2, 3]
    assert sorted(k.firsts) == list(range(len(args)))


def test_call_plan_binds_outputs_scratch_and_scalars(launched, monkeypatch):
    """Positions: arguments, then outputs, then scratch, then scalars; a given
    out= stands for its output."""
    # Stream 3 is no CUDA stream: asking the runtime whether it captures faults on a GPU host (and raises,
    # hence True, without one); taken as capturing on both, so the scratch is a fresh block.
    monkeypatch.setattr(scratch, "_capturing", lambda stream: True)
    monkeypatch.setattr(scratch, "_graph_blocks", [])
    class Kind:
        @staticmethod
        def allocation(specs, anchor):
            return lambda device_id, objs: ([f"out{i}" for i in range(len(specs))], [1000 + i for i in range(len(specs))])

        @staticmethod
        def raw(device_id, nbytes):
            return None, 5000

        @staticmethod
        def stream(device_id):
            return 3

    k = launch.Launch(_kernel(), 1, [("ptr", "a"), ("ptr", "b"), ("ptr", "y"), ("ptr", "s1"), ("ptr", "s2"),
                                     ("f32", "eps")])
    monkey_device = launch._current_device
    launch._current_device = lambda: 0
    try:
        plan = launch.CallPlan(Kind, 0, ("a", "b"), (k,), outputs=[launch.Output("y", (4,), np.dtype("f4"))],
                               scratch=[("s1", 100), ("s2", 300)], scalars=("eps",),
                               result=lambda objs, made: made)
        assert plan.run(("A", None), [10, 0], (launch.f32_bits(1.0),)) == ["out0"]
    finally:
        launch._current_device = monkey_device
    p = _slot_values(k)
    first = 5000 + scratch.CONTROL_BYTES  # a fresh block (the stream is no CUDA stream here): control words first
    assert p[:5] == [10, 0, 1000, first, first + 256]
    assert np.uint32(p[5]).view(np.float32) == 1.0
    assert len(k._get(list(range(10)))) == 6  # every parameter written per call


def test_absent_arguments_are_constant_zeros(launched):
    """An argument the cache key holds as None is no per-call slot: its pointer stays 0 whatever a call
    passes there, and the others still land where they belong."""
    class Kind:
        @staticmethod
        def allocation(specs, anchor):
            return lambda device_id, objs: (["out0"], [1000])

        @staticmethod
        def stream(device_id):
            return 3

    k = launch.Launch(_kernel(), 1, [("ptr", "a"), ("ptr", "b"), ("ptr", "c"), ("ptr", "y")])
    monkey_device = launch._current_device
    launch._current_device = lambda: 0
    try:
        plan = launch.CallPlan(Kind, 0, ("a", "b", "c"), (k,), outputs=[launch.Output("y", (4,), np.dtype("f4"))],
                               result=lambda objs, made: made, absent=("b",))
        plan.run(("A", None, "C"), [10, 0, 30])
        assert _slot_values(k) == [10, 0, 30, 1000]
        plan.run(("A", None, "C"), [11, 99, 31])  # a stray pointer in an absent place is not read
        assert _slot_values(k) == [11, 0, 31, 1000]
    finally:
        launch._current_device = monkey_device
    assert len(k._get([0] * 4)) == 3  # a, c and y: b is a constant


def test_a_one_launch_plan_runs_its_own_closure_and_makes_its_one_output_through_output(launched, monkeypatch):
    """A plain plan of one launch runs a closure of its own (`CallPlan._one_launch_run`); where the call
    returns its one output (result None) and the kind has `output`, that output is made by it (not
    `allocation`) and returned as is; with a picker, `allocation` makes the outputs. Every call writes its
    own pointers and scalars (none where every parameter is a constant); another current device takes the
    general run; a dropped plan is freed at once (the closure holds it weakly)."""
    made = []

    class Kind:
        @staticmethod
        def allocation(specs, anchor, likes=None):
            return lambda device_id, objs: (made.append("allocation") or ["general"], [2000])

        @staticmethod
        def output(spec, anchor, like=None):
            assert spec[0] == (4,) and anchor == 0 and like is None

            def make(device_id, objs):
                made.append("output")
                return f"y{len(made)}", 1000 + len(made)

            return make

        @staticmethod
        def stream(device_id):
            return 3

    k = launch.Launch(_kernel(), 1, [("ptr", "a"), ("ptr", "y"), ("f32", "eps")])
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    plan = launch.CallPlan(Kind, 0, ("a",), (k,), outputs=[launch.Output("y", (4,), np.dtype("f4"))],
                           scalars=("eps",))
    assert not hasattr(plan.run, "__self__")  # the closure, not the bound general run
    assert plan.run(("A",), [10], (launch.f32_bits(1.0),)) == "y1"
    assert _slot_values(k)[:2] == [10, 1001] and np.uint32(_slot_values(k)[2]).view(np.float32) == 1.0
    assert plan.run(("A",), [11], (launch.f32_bits(2.0),)) == "y2"
    assert _slot_values(k)[:2] == [11, 1002] and np.uint32(_slot_values(k)[2]).view(np.float32) == 2.0
    assert made == ["output", "output"] and len(launched) == 2
    # A picker's result (several outputs, stats): the outputs come from `allocation`, the picker picks.
    picked = launch.CallPlan(Kind, 0, ("a",), (k,), outputs=[launch.Output("y", (4,), np.dtype("f4"))],
                             scalars=("eps",), result=lambda objs, made: ("picked", made[0]))
    assert picked.run(("A",), [13], (0,)) == ("picked", "general") and made[-1] == "allocation"
    assert _slot_values(k)[:2] == [13, 2000]
    # No per-call slot at all (every parameter a constant): launched as packed.
    fixed = launch.Launch(_kernel(), 1, [("i64", 7)])
    launch.CallPlan(Kind, 0, ("a",), (fixed,), outputs=[launch.Output("y", (4,), np.dtype("f4"))]).run(("A",), [14])
    assert _slot_values(fixed) == [7] and len(launched) == 4
    # The plan holds its closure, the closure only a weak reference to the plan: no cycle left for the collector.
    gone = weakref.ref(picked)
    del picked
    assert gone() is None
    general = []
    monkeypatch.setattr(launch.CallPlan, "run", lambda self, objs, ptrs, scalars=(): general.append(ptrs) or "g")
    plan = launch.CallPlan(Kind, 1, ("a",), (k,), outputs=[launch.Output("y", (4,), np.dtype("f4"))],
                           scalars=("eps",))
    assert plan.run(("A",), [12], (0,)) == "g" and general == [[12]] and len(launched) == 4


def test_scratch_arena_per_stream(monkeypatch):
    """Working memory comes from one block per (kind, device, stream), made
    (with its control words zeroed, once) on first use and grown when a call
    needs more; blocks above ARENA_BYTES, and any while the stream captures a
    graph, are fresh (their control words zeroed on the stream when asked)."""
    made, cleared = [], []

    class Kind:
        @staticmethod
        def raw(device_id, nbytes):
            made.append(nbytes)
            return f"block{len(made)}", 1000 * len(made)

    capturing = {7: False, 8: False, 9: True, scratch.PER_THREAD_STREAM: False}
    monkeypatch.setattr(scratch, "_capturing", lambda stream: capturing[stream])
    monkeypatch.setattr(scratch, "_memset", lambda ptr, value, size, stream: cleared.append((ptr, size, stream)))
    monkeypatch.setattr(scratch, "_arenas", {})
    c = scratch.CONTROL_BYTES
    assert scratch.scratch_pointer(Kind, 0, 7, 100, False) == ("block1", 1000 + c, 1000)
    assert scratch.scratch_pointer(Kind, 0, 7, 5000, True) == ("block1", 1000 + c, 1000)  # reused: no clearing
    assert scratch.scratch_pointer(Kind, 0, 8, 100, True) == ("block2", 2000 + c, 2000)  # another stream
    assert scratch.scratch_pointer(Kind, 0, 7, 100 << 10, True) == ("block3", 3000 + c, 3000)  # grown
    assert made == [c + (64 << 10), c + (64 << 10), c + (100 << 10)]
    assert cleared == [(1000, c, 7), (2000, c, 8), (3000, c, 7)]
    monkeypatch.setattr(scratch, "_graph_blocks", [])
    assert scratch.scratch_pointer(Kind, 0, 9, 100, True) == ("block4", 4000 + c, 4000)  # capturing: fresh, kept
    assert scratch._graph_blocks == ["block4"]
    assert scratch.scratch_pointer(Kind, 0, 7, scratch.ARENA_BYTES + 1, False) == ("block5", 5000 + c, 5000)
    # The per-thread default stream is one handle for a stream per thread: no arena.
    assert scratch.scratch_pointer(Kind, 0, scratch.PER_THREAD_STREAM, 100, True) == ("block6", 6000 + c, 6000)
    assert cleared[-2:] == [(4000, c, 9), (6000, c, scratch.PER_THREAD_STREAM)] and len(cleared) == 5
    assert len(scratch._arenas) == 2 and scratch._graph_blocks == ["block4"]


def test_a_row_axes_parameter_takes_six_slots(launched):
    """("axes", (s0, s1, s2, d1, d2)): a RowAxes struct (three i64; two u32 sizes and their dividers, four
    u32) in six slots; the next parameter starts after it, and per-call slots after it are still written."""
    k = launch.Launch(_kernel(), 1, [("ptr", "x"), ("axes", (3 * 8 * 128, 8 * 128, 128, 5, 8)), ("ptr", "y")])
    k.bind({"x": 0, "y": 1})
    k([10, 20], stream=0)
    s = np.frombuffer(k.slots, np.uint64)
    assert len(s) == 8 and list(s[:2]) == [10, 20]  # the per-call slots, then the struct's six
    assert list(s.view(np.int64)[2:5]) == [3 * 8 * 128, 8 * 128, 128]
    assert list(s.view(np.uint32)[10:16]) == [5, 8, *launch.divider(5)[:1], *launch.divider(8)[:1],
                                              launch.divider(5)[1], launch.divider(8)[1]]
    params = np.frombuffer(k._params, np.uint64)
    assert list(params - params[0]) == [0, 16, 8]


def _umulhi_divide(n: int, d: int) -> int:
    magic, shift = launch.divider(d)
    return (((n * magic) >> 32) + n) >> shift  # the sum stays below 2^32 for n < 2^31


def test_dividers_divide_every_row_index():
    """The kernels' three-axis row indices: (umulhi(n, magic) + n) >> shift == n // d for every n < 2^31,
    every d in [1, 2^31): exhaustive over small d and n, then edges and random draws."""
    import random

    rnd = random.Random(5)
    for d in range(1, 600):
        assert all(_umulhi_divide(n, d) == n // d for n in range(0, 3 * d + 5))
    for d in [2**k + e for k in range(1, 31) for e in (-1, 0, 1) if 2**k + e < 2**31] + [
            rnd.randrange(1, 2**31) for _ in range(2000)]:
        for n in [d - 1, d, d + 1, 2**31 - 1, 2**31 - 2, (2**31 - 1) // d * d, (2**31 - 1) // d * d - 1] + [
                rnd.randrange(2**31) for _ in range(50)]:
            if 0 <= n < 2**31:
                assert _umulhi_divide(n, d) == n // d, (n, d)
    for bad in (0, 2**31):
        with pytest.raises(ValueError, match="divider"):
            launch.divider(bad)


def test_out_exactly_an_allowed_input_skips_the_exact_check():
    """A cached call's out= check: an input named in `aliases` that is exactly out's view (same pointer,
    shape, strides, dtype) passes at once (in place, which the exact test allows); the same pointer with
    another view, or an input not named there, goes to the first call's exact test."""
    torch = pytest.importorskip("torch")

    class Kind:
        @staticmethod
        def allocation(specs, anchor):
            return lambda device_id, objs: ([], [])

    exact = []
    plan = launch.CallPlan(Kind, 0, ("x", "w", "out"), (), given_out=("out", "y"),
                           spans={"x": 4096, "w": 64, "out": 4096}, full_overlap_check=exact.append,
                           aliases=("x",), result=lambda objs, made: None)
    buf = torch.zeros(32, 32)
    x, w = buf[:, :], torch.zeros(16)
    ptr = x.data_ptr()
    plan._check_out((x, w, buf[:, :]), [ptr, w.data_ptr(), ptr])
    assert exact == []  # in place: no exact test
    plan._check_out((x, w, buf.view(16, 64)), [ptr, w.data_ptr(), ptr])  # same bytes, another view
    assert len(exact) == 1
    other = launch.CallPlan(Kind, 0, ("x", "w", "out"), (), given_out=("out", "y"),
                            spans={"x": 4096, "w": 64, "out": 4096}, full_overlap_check=exact.append,
                            result=lambda objs, made: None)
    other._check_out((x, w, buf[:, :]), [ptr, w.data_ptr(), ptr])  # x not allowed as out's alias
    assert len(exact) == 2
