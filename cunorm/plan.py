"""The one path from a call signature to loaded kernels, shared by every
kernel family: pick traits (dispatch, or the caller's `traits=`), check them
against the GPU, compile once (cached per signature and device)."""
from __future__ import annotations

import functools
from collections.abc import Mapping

from .compiler import device_arch, kernels_for


@functools.lru_cache(maxsize=4096)
def _plan(family, base: tuple, device_id: int, knobs: tuple | None):
    """Traits and loaded kernels for a call signature on a device, cached so
    that repeated calls skip dispatch and traits checks."""
    fields = dict(base)
    arch = device_arch(device_id)
    if knobs is None:
        traits = family.choose(arch=arch, **fields)
    else:
        traits = family.traits_class(**fields, **dict(knobs))
        traits.check_arch(arch)
    return traits, kernels_for(traits, device_id)


def resolve(family, traits, base: dict, device_id: int):
    """(traits, kernels) for a call. `family` names its `traits_class` (with a
    KNOBS tuple) and `choose(arch=..., **base)`; `traits` is None (dispatch),
    a traits object (must match the call) or a mapping of knobs."""
    key = tuple(sorted(base.items()))
    cls = family.traits_class
    if traits is None:
        return _plan(family, key, device_id, None)
    if isinstance(traits, cls):
        for field, want in base.items():
            have = getattr(traits, field)
            if have != want:
                raise ValueError(f"traits: {field}={have!r} does not match this call ({want!r})")
        return _plan(family, key, device_id, tuple(sorted(traits.knobs().items())))
    if isinstance(traits, Mapping):
        unknown = set(traits) - set(cls.KNOBS)
        if unknown:
            raise ValueError(f"traits: unknown knobs {sorted(unknown)}; expected some of {list(cls.KNOBS)}")
        return _plan(family, key, device_id, tuple(sorted(traits.items())))
    raise TypeError(f"traits: expected a cunorm.{cls.__name__} or a mapping of knobs, got {type(traits).__name__}")
