"""Working memory of planned calls (the backward's partial sums), carved from
one block per (kind, device, stream) and reused: `scratch_pointer`."""
from __future__ import annotations

# A call's scratch is written and read only by its own kernels, queued on
# one stream, so the next call on that stream may have the same bytes (stream order). This takes a stream
# handle to name one stream: cudaStreamDestroy releases a handle once the stream's queued work is done, so
# a reused handle should not meet that work (inferred from the documentation, not promised by it), and the
# per-thread default stream (handle 2: one handle, a stream per thread) gets no arena. Nor does a stream
# capturing a CUDA graph: the graph keeps the address, so its blocks are kept for good (`_graph_blocks`;
# for every kind: whoever began the capture, torch's private graph pool or not, a freed block could be
# handed out again before a replay). Nor does a call above ARENA_BYTES (GPU-bound: a fresh allocation costs
# nothing there). An arena starts with CONTROL_BYTES of words that kernels keep at 0 between launches (the
# backward's grid-barrier ticket): zeroed once, when the arena is made, and never part of a call's scratch.
ARENA_BYTES = 4 << 20
CONTROL_BYTES = 256
MAX_ARENAS = 16
PER_THREAD_STREAM = 2  # cudaStreamPerThread
_arenas: dict = {}  # (kind, device, stream) -> (what keeps it alive, pointer, scratch bytes)
_graph_blocks: list = []  # working memory of captured launches: a replay may come at any time


def scratch_pointer(kind, device_id: int, stream: int, nbytes: int, control: bool) -> tuple:
    """(what keeps it alive until the launches are queued, pointer of `nbytes` of working memory, pointer
    of CONTROL_BYTES of zeros) for kernels queued on `stream`; `control`: whether the call needs the
    zeros (a fresh block's are then cleared on the stream). Call under `launch._launch_lock`."""
    capturing = _capturing(stream)
    if capturing or nbytes > ARENA_BYTES or stream == PER_THREAD_STREAM:
        keep, ptr = kind.raw(device_id, CONTROL_BYTES + nbytes)
        if control:
            _memset(ptr, 0, CONTROL_BYTES, stream)
        if capturing:
            _graph_blocks.append(keep)
        return keep, ptr + CONTROL_BYTES, ptr
    key = (kind, device_id, stream)
    arena = _arenas.get(key)
    if arena is None or arena[2] < nbytes:
        if arena is None and len(_arenas) >= MAX_ARENAS:
            del _arenas[next(iter(_arenas))]  # the oldest: freed in its stream's order
        size = max(nbytes, 64 << 10)
        keep, ptr = kind.raw(device_id, CONTROL_BYTES + size)
        _memset(ptr, 0, CONTROL_BYTES, stream)
        arena = _arenas[key] = (keep, ptr, size)
    return arena[0], arena[1] + CONTROL_BYTES, arena[1]


def _memset(*args):
    from cupy_backends.cuda.api.runtime import memsetAsync

    global _memset
    _memset = memsetAsync  # looked up once
    memsetAsync(*args)


def _capturing(stream: int) -> bool:
    from cupy_backends.cuda.api.runtime import streamIsCapturing

    def capturing(stream: int) -> bool:
        try:
            return streamIsCapturing(stream)
        except Exception:  # e.g. the legacy stream beside a global capture: no arena (the launch reports it)
            return True

    global _capturing
    _capturing = capturing  # looked up once
    return capturing(stream)


def forget():
    """Drops every arena (the next call on each stream makes a fresh one). Call under `launch._launch_lock`."""
    _arenas.clear()
