"""One compile path: render -> NVRTC -> cached kernels.

On a GPU, kernels are compiled once per (traits, device) through
`cupy.RawModule` (CuPy also caches the cubin on disk, keyed by the rendered
source, options and architecture, so the cache never goes stale). Without a
GPU, `compile_only` drives NVRTC directly for an explicit architecture and
returns the cubin with ptxas's resource report (on a GPU host too: it keeps
NVRTC from answering from the driver's cache, which would skip ptxas).
"""
from __future__ import annotations

import ctypes
import functools
import re
import sys
import threading
from dataclasses import dataclass, field

from .source import check_source, render
from .traits_rules import PORTABLE_CLUSTER

# -default-device: the kernels hold no host code, and their generic lambdas
# (templated call operators, e.g. with_edges's) must compile as device code.
NVRTC_OPTIONS = ("-std=c++17", "-default-device")
# What cupy.RawModule adds to every NVRTC compile (fp32 subnormals flushed to zero): compile_only passes it
# too, so that its registers and spills are those of the kernels that run.
RAWMODULE_OPTIONS = ("-ftz=true",)


class CompileError(RuntimeError):
    """NVRTC rejected a rendered kernel, or its log holds no ptxas report for a kernel compile_only must
    report on; the message holds the log."""


@dataclass(frozen=True)
class FunctionReport:
    name: str
    registers: int
    stack_frame: int
    spill_stores: int
    spill_loads: int
    smem_bytes: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


@dataclass(frozen=True)
class CompileReport:
    arch: int
    cubin: bytes = field(repr=False)
    log: str = field(repr=False)
    functions: tuple  # of FunctionReport

    @property
    def clean(self) -> bool:
        """No spills and no stack frame in any kernel (and a report to say so)."""
        return bool(self.functions) and all(not f.spills and f.stack_frame == 0 for f in self.functions)


_FUNC = re.compile(r"Function properties for (\w+)\s*\n.*?(\d+) bytes stack frame, (\d+) bytes spill stores, "
                   r"(\d+) bytes spill loads.*?Used (\d+) registers(?:.*?(\d+) bytes smem)?", re.S)


def parse_ptxas_log(log: str) -> tuple:
    """FunctionReports from a `--ptxas-options=-v` log."""
    out = []
    for block in re.split(r"(?=ptxas info\s+: Compiling entry function)", log):
        m = _FUNC.search(block)
        if m:
            name, stack, st, ld, regs, smem = m.groups()
            out.append(FunctionReport(name, int(regs), int(stack), int(st), int(ld), int(smem or 0)))
    return tuple(out)


def arch_number(arch) -> int:
    """An architecture as a number: 90, "90", "sm_90" and "SM90" are all 90."""
    text = str(arch).strip().lower().removeprefix("sm_").removeprefix("sm")
    if not text.isdigit():
        raise ValueError(f"arch: {arch!r} is not an architecture like 90 or 'sm_90'")
    return int(text)


def _error_context(log: str, text: str, around: int = 2) -> str:
    """The rendered text's lines the NVRTC log points at ("file(LINE): error"),
    numbered as in the rendered text, with `around` lines either side: the
    errors' first, then the warnings'."""
    lines = text.splitlines()
    errors = sorted({int(n) for n in re.findall(r"\((\d+)\): error", log)})
    warnings = sorted({int(n) for n in re.findall(r"\((\d+)\): warning", log)} - set(errors))
    wanted = (errors + warnings)[:5]
    out = []
    for n in wanted:
        out.append(f"--- rendered text, line {n}:")
        for i in range(max(1, n - around), min(len(lines), n + around) + 1):
            out.append(f"{'>' if i == n else ' '}{i:6d}  {lines[i - 1]}")
    return "\n".join(out)


def compile_only(traits, arch: int | str = 90, source: str | None = None) -> CompileReport:
    """Compile `traits`'s kernels for sm_<arch> (90 or "sm_90") with NVRTC;
    needs no GPU. `source`: an edited copy of the traits' kernel file (ValueError
    if it lacks a kernel the traits launch). CompileError if NVRTC fails or its
    log holds no ptxas report for one of those kernels."""
    arch = arch_number(arch)
    traits.check_arch(arch)
    from cupy_backends.cuda.libs import nvrtc

    text = render(traits, source if source is None else check_source(traits, source))
    prog = nvrtc.createProgram(text, traits.source_file, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*NVRTC_OPTIONS, *RAWMODULE_OPTIONS, f"-arch=sm_{arch}", "--ptxas-options=-v",
                                        *_uncached()])
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise CompileError(f"{traits.short()} failed to compile for sm_{arch}: {e}\n{log}\n"
                               f"{_error_context(log, text)}") from None
        log = nvrtc.getProgramLog(prog)
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    functions = parse_ptxas_log(log)
    missing = sorted(set(traits.launches()) - {f.name for f in functions})
    if missing:  # an empty report would read as clean
        why = (f"it reports only {', '.join(f.name for f in functions)}" if functions else
               "it holds none (a compile answered from NVRTC's cache runs no ptxas)")
        raise CompileError(f"{traits.short()}: NVRTC's log for sm_{arch} holds no ptxas report for "
                           f"{', '.join(missing)}; {why}:\n{log[-1000:]}")
    return CompileReport(arch, cubin, log, functions)


@functools.cache
def _uncached() -> tuple:
    """NVRTC 12.9+ answers a compile it has seen from the driver's compute cache where a driver is loaded, and
    then runs no ptxas: the log holds no resource report. compile_only exists for that report."""
    from cupy_backends.cuda.libs import nvrtc

    return ("--no-cache",) if nvrtc.getVersion() >= (12, 9) else ()


@dataclass(frozen=True)
class Kernel:
    """A loaded kernel and what its launches need to know."""

    function: object  # cupy.RawKernel
    threads: int
    smem: int  # dynamic shared memory bytes per CTA
    blocks_per_sm: int  # occupancy at `threads` threads and `smem` bytes per CTA
    sm_count: int
    cluster: int  # CTAs per thread-block cluster (1: no cluster)
    # Clusters (CTAs when cluster == 1) that run at once: a one-wave grid holds
    # at most this many. Fewer than sm_count * blocks_per_sm / cluster where
    # a cluster's CTAs must share one GPC and some GPC's SMs are left over.
    resident_clusters: int
    local_bytes: int = 0  # local memory per thread: > 0 when the compiler spilled or kept a stack frame


_cache: dict = {}
_not_resident: dict = {}  # key -> why: kernels whose cluster no SM group here holds (loaded once, then refused)
_cache_lock = threading.Lock()
_key_locks: dict = {}


@functools.lru_cache(maxsize=None)
def device_arch(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).compute_capability)


@functools.lru_cache(maxsize=None)
def device_gpu(device_id: int):
    """The GPU model of `device_id` (cunorm.tables.GPU), which picks its tuned tables."""
    from .tables import GPU

    return GPU.of_device(device_id)


def cuda_version() -> int:
    """The CUDA runtime's version number (e.g. 12080 for 12.8), recorded with a tuned table."""
    import cupy

    return int(cupy.cuda.runtime.runtimeGetVersion())


def keeps_local_memory(traits, device_id: int) -> bool:
    """Whether `traits`' kernels, compiled and loaded on GPU `device_id` (cached: `kernels_for`), keep local
    memory: spills or a stack frame. Raises what compiling or loading raises (ClusterNotResident: no SM group
    here holds the cluster)."""
    return any(k.local_bytes for k in kernels_for(traits, device_id).values())


def kernels_for(traits, device_id: int, source: str | None = None) -> dict:
    """{name: Kernel} for `traits` (and an edited kernel file `source`, if
    given) on GPU `device_id`, compiled on first use. Threads asking for the
    same kernels at once compile them once. Kernels whose non-portable cluster
    this GPU holds none of raise ClusterNotResident, on every ask, compiled once."""
    key = (traits, device_id, source)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    with _cache_lock:
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:
        hit = _cache.get(key)
        if hit is None:
            why = _not_resident.get(key)
            if why is not None:
                raise ClusterNotResident(why)
            try:
                hit = _load(traits, device_id, source)
            except ClusterNotResident as e:
                _not_resident[key] = str(e)
                raise
            _cache[key] = hit
    return hit


def _load(traits, device_id: int, source: str | None = None) -> dict:
    import cupy

    traits.check_arch(device_arch(device_id))
    text = render(traits, source)
    with cupy.cuda.Device(device_id) as dev:
        module = cupy.RawModule(code=text, options=NVRTC_OPTIONS)
        sm_count = dev.attributes["MultiProcessorCount"]
        out = {}
        for name, (threads, smem, cluster) in traits.launches().items():
            try:
                fn = module.get_function(name)
            except cupy.cuda.compiler.CompileException as e:
                raise CompileError(f"{traits.short()} failed to compile: {e}\n{_error_context(str(e), text)}") from None
            if smem:  # static + dynamic above 48 KB must be asked for; asking is harmless below
                fn.max_dynamic_shared_size_bytes = smem
            if cluster > PORTABLE_CLUSTER:  # before the occupancy query and any launch
                _allow_non_portable_cluster(fn)
            blocks = _blocks_per_sm(fn, threads, smem)
            resident = sm_count * blocks if cluster == 1 else _resident_clusters(fn, threads, smem, cluster, sm_count)
            out[name] = Kernel(fn, threads, smem, blocks, sm_count, cluster, resident,
                               int(fn.attributes.get("local_size_bytes", 0)))
    return out


def _blocks_per_sm(fn, threads: int, smem: int) -> int:
    from cupy_backends.cuda.api import driver

    return max(1, driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, threads, smem))


class _LaunchConfig(ctypes.Structure):
    """The driver's CUlaunchConfig (CUDA 12 and 13)."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def _driver():
    return ctypes.CDLL("libcuda.so.1" if sys.platform != "win32" else "nvcuda.dll")


_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CUfunction_attribute


class ClusterNotResident(RuntimeError):
    """No cluster of a kernel's non-portable size fits this GPU (GPCs of fewer SMs, a MIG slice)."""


def _allow_non_portable_cluster(fn) -> None:
    status = _driver().cuFuncSetAttribute(ctypes.c_void_p(fn.kernel.ptr), _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
    if status != 0:
        raise RuntimeError(f"cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED) failed (CUresult {status})")


def _resident_clusters(fn, threads: int, smem: int, cluster: int, sm_count: int) -> int:
    """cuOccupancyMaxActiveClusters (CuPy does not wrap it) for a kernel with
    a compile-time cluster size."""
    count = ctypes.c_int(0)
    config = _LaunchConfig((cluster * sm_count, 1, 1), (threads, 1, 1), smem, None, None, 0)
    status = _driver().cuOccupancyMaxActiveClusters(ctypes.byref(count), ctypes.c_void_p(fn.kernel.ptr),
                                                     ctypes.byref(config))
    if status != 0 or count.value < 1:
        error = ClusterNotResident if cluster > PORTABLE_CLUSTER else RuntimeError
        raise error(f"cuOccupancyMaxActiveClusters failed (CUresult {status}, {count.value} clusters) for "
                           f"{cluster}-CTA clusters of {threads} threads and {smem} bytes of shared memory")
    return count.value
