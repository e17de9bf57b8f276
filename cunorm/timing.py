"""How cunorm's tools take a time: CUDA events around back-to-back calls
(median_ms: what a caller sees, the host's cost included where it exceeds the
kernels'), events around a queue of calls held back by a spinning kernel
(kernel_ms: the kernels alone), CUDA-graph replay (graph_ms), the host's
per-call cost (per_call_us), the same-run copy every bandwidth is a fraction
of (copy_bandwidth), and the progress bar their sweeps show (progress)."""
from __future__ import annotations

import contextlib
import sys

import numpy as np


@contextlib.contextmanager
def progress(length: int, label: str, out=sys.stdout):
    """A progress bar on stderr (never stdout, which --json keeps for JSON)
    over `length` steps. Yields (bar, echo): `bar.update(k)` advances it and
    `echo(line)` prints a line of the table to `out`. On a terminal, echo
    clears the bar's line first so that the table line does not land inside
    the bar; the bar redraws below it on its next step."""
    import click

    with click.progressbar(length=length, label=label, file=sys.stderr) as bar:
        def echo(line: str):
            if sys.stderr.isatty():
                sys.stderr.write("\r\033[K")
                sys.stderr.flush()
            print(line, file=out, flush=True)

        yield bar, echo


def gpu_name() -> str:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()


def median_ms(fn, repeat: int = 50, warmup: int = 5, batch: int = 10) -> float:
    """Milliseconds per call: the median over `repeat` batches of the mean of
    `batch` back-to-back calls, timed with CUDA events after `warmup` calls.
    One call is queued before the start event, so the GPU is already busy when
    timing starts; back-to-back calls then overlap each call's host work with
    the previous call's kernels. What is timed is the GPU's time per call, host
    overhead included only where it exceeds the kernels' time."""
    import cupy

    for _ in range(warmup):
        fn()
    times = []
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(repeat):
        fn()
        start.record()
        for _ in range(batch):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / batch)
    return float(np.median(times))


_SPIN_SOURCE = r"""
extern "C" __global__ void cunorm_spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
"""
_spin_kernels: dict = {}  # device -> the loaded spin kernel


def _spin(ms: float):
    """Queues one thread spinning for about `ms` milliseconds on the current stream."""
    import cupy

    dev = cupy.cuda.Device()
    kernel = _spin_kernels.get(dev.id)
    if kernel is None:
        kernel = _spin_kernels[dev.id] = cupy.RawKernel(_SPIN_SOURCE, "cunorm_spin")
    kernel((1,), (1,), (np.int64(ms * dev.attributes["ClockRate"]),))  # ClockRate: kHz


def kernel_ms(fn, repeat: int = 50, warmup: int = 5, batch: int = 10) -> float:
    """Milliseconds per call of the kernels alone: the median over `repeat`
    batches of the mean of `batch` back-to-back calls, timed with CUDA events
    around calls queued while a spinning kernel holds the stream, so that the
    GPU runs them back to back however long the host takes to issue them. A
    batch whose start event had passed before the last call was queued (the
    spin too short) is timed again with a longer spin."""
    import time

    import cupy

    for _ in range(warmup):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    t = time.perf_counter()
    for _ in range(batch):
        fn()
    hold = 2e3 * (time.perf_counter() - t) + 0.5  # ms: twice the host's time for a batch
    times = []
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    while len(times) < repeat:
        cupy.cuda.get_current_stream().synchronize()
        _spin(hold)
        start.record()
        for _ in range(batch):
            fn()
        stop.record()
        if start.done:  # the GPU caught up with the host: not the kernels' time
            stop.synchronize()
            hold *= 2
            if hold > 1e4:
                raise RuntimeError("kernel_ms: the host issues calls more slowly than a 10 s spin")
            continue
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / batch)
    return float(np.median(times))


def copy_bandwidth(nbytes: int = 2**30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus written."""
    import cupy

    src = cupy.empty(nbytes, dtype=np.uint8)
    src[...] = 1
    dst = cupy.empty_like(src)
    ms = median_ms(lambda: cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes,
                                                          cupy.cuda.runtime.memcpyDeviceToDevice,
                                                          cupy.cuda.get_current_stream().ptr))
    return 2 * nbytes / (ms * 1e-3)


def per_call_us(fns: dict, repeat: int = 7, seconds: float = 0.05) -> dict:
    """Microseconds per call of each function, called back to back and
    synchronized at the end (the host's cost where it exceeds the GPU's):
    {name: (median, min, max)} over `repeat` rounds, the functions
    interleaved within each round so that drift hits them alike."""
    import time

    import cupy

    sync = cupy.cuda.runtime.deviceSynchronize
    counts = {}
    for name, fn in fns.items():  # warm up, and size each batch to about `seconds`
        for _ in range(20):
            fn()
        sync()
        t = time.perf_counter()
        for _ in range(20):
            fn()
        sync()
        counts[name] = max(20, int(seconds / max((time.perf_counter() - t) / 20, 1e-7)))
    rounds = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            n = counts[name]
            sync()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            rounds[name].append((time.perf_counter() - t) / n * 1e6)
    return {name: (float(np.median(v)), min(v), max(v)) for name, v in rounds.items()}


def graph_ms(fn, repeat: int = 20) -> float:
    """Milliseconds per call of `fn` replayed from a CUDA graph (torch's
    capture: outputs come from the graph's private pool), timed with events."""
    import torch

    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        g.replay()
    for _ in range(repeat):
        g.replay()
        start.record()
        for _ in range(10):
            g.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 10)
    return float(np.median(times))
