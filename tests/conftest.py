"""Test tiers: A (pure Python, always), B (`nvrtc`: compiles kernels, no GPU
needed), C (`gpu`: runs kernels). A tier's tests skip with a reason when its
requirement is missing, and fail instead when CUNORM_REQUIRE_GPU=1 (tier C) or
CUNORM_REQUIRE_NVRTC=1 (tier B) is set, so no run passes by skipping."""
import functools
import importlib.util
import os
from pathlib import Path

import pytest


def load_script(name: str):
    """scripts/NAME.py of this tree as a module (the scripts are not a package)."""
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def gpu_available() -> str | None:
    """None if a CUDA GPU is usable, else why not."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
        cupy.zeros(1).sum()  # a real launch: the driver and a context work
        return None
    except Exception as e:
        return f"no usable CUDA GPU ({type(e).__name__}: {e})"


@functools.lru_cache(maxsize=None)
def nvrtc_available() -> str | None:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return None
    except Exception as e:
        return f"NVRTC unavailable ({type(e).__name__}: {e})"


def _require(marker: str, why: str | None, env: str):
    if why is None:
        return
    if os.environ.get(env) == "1":
        pytest.fail(f"{marker} test cannot run: {why} ({env}=1 forbids skipping)")
    pytest.skip(f"{marker} test: {why}")


@pytest.fixture(autouse=True)
def _tiers(request):
    if request.node.get_closest_marker("gpu"):
        _require("gpu", gpu_available(), "CUNORM_REQUIRE_GPU")
    if request.node.get_closest_marker("nvrtc"):
        _require("nvrtc", nvrtc_available(), "CUNORM_REQUIRE_NVRTC")


def assert_results_ok(results):
    """Fails with a line per output of cunorm.check's results beyond its tolerance."""
    bad = [f"{r.case.label()} {r.output}: {r.error:.3e} > {r.tolerance:.0e}" for r in results if not r.ok]
    assert not bad, "\n".join(bad)


def bits(a):
    """A GPU array's bits as unsigned integers of 2 or 4 bytes (for same-bits comparisons of results)."""
    import cupy
    import numpy as np

    return cupy.asnumpy(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def backward_runner(case, rng):
    """run(traits, rows=slice(None)): the backward of check.Case `case` (LayerNorm's or RMSNorm's; fresh x,
    weight and dy, the statistics from the forward) on the rows `rows` of the batch (views of the same arrays),
    with `traits` forced: for the knobs' same-bits tests."""
    import cupy
    import numpy as np

    import cunorm
    from cunorm import check

    x, w, _, _ = check._inputs(case, rng)
    dy = cupy.asarray(rng.standard_normal(x.shape).astype(np.float32)).astype(x.dtype)
    if case.op == "rms_norm_backward":
        _, rstd = cunorm.rms_norm(x, w, return_stats=True)
        return lambda k, rows=slice(None): cunorm.rms_norm_backward(dy[rows], x[rows], rstd[rows], w, traits=k)
    _, mean, rstd = cunorm.layer_norm(x, w, w, return_stats=True)
    return lambda k, rows=slice(None): cunorm.layer_norm_backward(dy[rows], x[rows], mean[rows], rstd[rows], w,
                                                                  traits=k)


def launch_grids(launches) -> tuple:
    """The grids of the kernel launches the `launches` fixture recorded so far, which it then forgets: where two
    calls' backwards have the same grids, their column sums add the same partial rows in the same order."""
    grids = tuple(grid for kernel, grid, _ in launches if kernel is not None)
    launches.clear()
    return grids


def bits_and_grids(run, settings, launches) -> tuple[list, list]:
    """Each setting's outputs (`run(setting)` on poisoned allocations) as bits, and the grids its launches had: the
    knobs' same-bits tests compare the column sums only where two settings' grids are the same."""
    from cunorm import check

    launch_grids(launches)
    outs, grids = [], []
    for setting in settings:
        with check.poisoned_allocations():
            outs.append([bits(a) for a in run(setting)])
        grids.append(launch_grids(launches))
    return outs, grids


@pytest.fixture
def poisoned():
    """poisoned(shape, dtype="float32"): a CuPy output array filled with NaN, so that an element a call leaves
    unwritten fails its check."""
    import cupy

    return lambda shape, dtype="float32": cupy.full(shape, cupy.nan, dtype=dtype)


@pytest.fixture
def rng(request):
    import numpy as np

    # Fresh inputs every run; the seed is printed on failure to reproduce.
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch from here on, as (Kernel, grid, stream pointer); `.cooperative` says, launch by
    launch, whether it went through cuLaunchCooperativeKernel. Spies on the two driver calls every launch
    makes (`cunorm.launch._launch`, `_launch_cooperative`: `CallPlan.run` launches inline), naming each
    kernel by its function (the plan cache is emptied, so every launch comes from a plan built here)."""
    from cupy_backends.cuda.api import driver

    from cunorm import launch, plan

    class Seen(list):
        cooperative: list

    seen = Seen()
    seen.cooperative = []
    kernels = {}
    init = launch.Launch.__init__

    def register(self, kernel, *args, **kwargs):
        init(self, kernel, *args, **kwargs)
        kernels[self.function] = kernel

    def spy(cooperative: bool, real):
        def call(function, grid, *rest):  # rest: block, shared memory, stream (rest[6]), parameters
            seen.append((kernels.get(function), grid, rest[6]))
            seen.cooperative.append(cooperative)
            return real(function, grid, *rest)

        return call

    monkeypatch.setattr(launch.Launch, "__init__", register)
    monkeypatch.setattr(launch, "_launch", spy(False, driver.launchKernel))
    monkeypatch.setattr(launch, "_launch_cooperative", spy(True, driver.launchCooperativeKernel))
    plan.CALLS.clear()
    return seen
