"""The one path from a call to loaded kernels, shared by every kernel family:
pick traits (dispatch, or the caller's `traits=`), check them against the GPU,
compile once (cached per signature and device); and the cache of whole call
plans (`launch.CallPlan`) by a key read off the call's arrays.

The call cache. A repeated call (same shapes, strides, dtypes, pointers
modulo KEY_ALIGNMENT and devices of every array, `out=` included, and the same
flags) skips validation, layout, dispatch and argument packing: it costs a
key, a dict lookup and `CallPlan.run`. Everything the first call checked is
determined by the key, except whether `out=` overlaps an input, which depends
on addresses and is checked on every call (`CallPlan.run`).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

from .compiler import device_arch, device_gpu, keeps_local_memory, kernels_for
from .kinds import KEY_ALIGNMENT, TorchKind, kind_of
from .source import check_source

PREVIEW_ARCH = 90  # the GPU that numpy calls check `traits=` for, and that explain previews for them
CALLS: dict = {}  # cache key -> launch.CallPlan
MAX_CALLS = 4096
_keyparts: dict = {}  # array type -> its kind's keypart, or None: not cached (numpy, other producers)
_torch_types: set = set()  # torch tensor classes seen: keyed inline, as TorchKind.keypart (a frame less each)


def call_key(values: tuple, flags: tuple) -> tuple:
    """(key, pointers) of a call whose arrays are `values` (None: absent,
    pointer 0);
    (None, None) when the call is not cacheable (numpy or other producers'
    arrays, knob values that are not hashable). `flags` ends with the
    caller's `traits=`."""
    knobs = flags[-1]
    if knobs is not None and isinstance(knobs, Mapping):  # traits= as a mapping of knobs: keyed by its items
        try:
            flags = (*flags[:-1], frozenset(knobs.items()))
            hash(flags)
        except TypeError:
            return None, None
    key, ptrs = [flags], []
    for a in values:
        if a is None:
            key.append(None)
            ptrs.append(0)
            continue
        if a.__class__ in _torch_types:  # TorchKind.keypart, inline
            p = a.data_ptr()
            key.append((a.shape, a.stride(), a.dtype, p % KEY_ALIGNMENT, a.get_device()))
            ptrs.append(p)
            continue
        try:
            part = _keyparts[a.__class__]
        except KeyError:
            kind = kind_of(a)
            part = _keyparts[a.__class__] = None if kind is None else kind.keypart
            if kind is TorchKind:
                _torch_types.add(a.__class__)
        if part is None:
            return None, None
        k, p = part(a)
        key.append(k)
        ptrs.append(p)
    return tuple(key), ptrs


def forget_choices():
    """Forgets every dispatch choice and plan (a tuned table changed): calls plan again."""
    _plan.cache_clear()
    choose_traits.cache_clear()
    CALLS.clear()


def remember(key, call):
    """Caches a call plan under `key` (None: not cacheable)."""
    if key is not None and len(CALLS) < MAX_CALLS:
        CALLS[key] = call


@functools.lru_cache(maxsize=4096)
def _plan(family, base: tuple, device_id: int, knobs: tuple | None, source: str | None):
    """Traits and loaded kernels for a call signature on a device, cached so
    that repeated calls skip dispatch and traits checks."""
    arch, gpu = device_arch(device_id), device_gpu(device_id) if knobs is None else None
    what_runs = getattr(family, "what_runs", None)
    if knobs is None and source is None and what_runs:
        # A pick that spills for this dtype mix on this GPU (a tuned entry, an unstaged forward) is replaced.
        traits = what_runs(arch, lambda t: keeps_local_memory(t, device_id), gpu=gpu, **dict(base))
    else:
        traits = choose_traits(family, base, arch, knobs, gpu)
    return traits, kernels_for(traits, device_id, None if source is None else check_source(traits, source))


@functools.lru_cache(maxsize=4096)
def choose_traits(family, base: tuple, arch: int, knobs: tuple | None, gpu=None):
    """The traits a call signature runs with on `arch` (nothing compiled);
    `gpu` (cunorm.tables.GPU) adds the tuned tables of that GPU model."""
    fields = dict(base)
    if knobs is None:
        return family.choose(arch=arch, gpu=gpu, **fields)
    build = getattr(family, "from_knobs", None)
    traits = build(dict(knobs), **fields) if build else family.traits_class(**fields, **dict(knobs))
    traits.check_arch(arch)
    return traits


def _knobs(family, traits, key: tuple, arch: int):
    """The caller's `traits=` as a sorted knob tuple (None: dispatch). A traits
    object must be the one the call would build from its knobs."""
    cls = family.traits_class
    if traits is None:
        return None
    if isinstance(traits, cls):
        knobs = tuple(sorted(traits.knobs().items()))
        built = choose_traits(family, key, arch, knobs)
        for field in dataclasses.fields(cls):
            have, want = getattr(traits, field.name), getattr(built, field.name)
            if have != want:
                raise ValueError(f"traits: {field.name}={have!r} does not match this call ({want!r})")
        return knobs
    if isinstance(traits, Mapping):
        unknown = set(traits) - set(cls.KNOBS)
        if unknown:
            raise ValueError(f"traits: unknown knobs {sorted(unknown)}; expected some of {list(cls.KNOBS)}")
        return tuple(sorted(traits.items()))
    raise TypeError(f"traits: expected a cunorm.{cls.__name__} or a mapping of knobs, got {type(traits).__name__}")


def resolve(family, traits, base: dict, device_id: int, source: str | None = None):
    """(traits, kernels) for a call. `family` names its `traits_class` (with a
    KNOBS tuple), `choose(arch=..., **base)` and optionally
    `from_knobs(knobs, **base)` and `what_runs(arch, spills, gpu=..., **base)` (dispatch's pick, or
    what replaces it where it compiles with spills); `traits` is None (dispatch), a traits object
    (must match the call) or a mapping of knobs; `source` an edited copy of
    the traits' kernel file, compiled in place of the shipped one."""
    key = tuple(sorted(base.items()))
    return _plan(family, key, device_id, _knobs(family, traits, key, device_arch(device_id)), source)


def resolve_traits(family, traits, base: dict, arch: int):
    """The traits `resolve` would pick on `arch`, without compiling."""
    key = tuple(sorted(base.items()))
    return choose_traits(family, key, arch, _knobs(family, traits, key, arch))


def on_device(device_id: int):
    """A context in which `device_id` is the current device (first calls: copies and compiles land there)."""
    import cupy

    return cupy.cuda.Device(device_id)
