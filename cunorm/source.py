"""Kernel source rendering: kernels/*.cu with our headers inlined and the
traits substituted (stdlib string.Template: a missing trait is an error)."""
from __future__ import annotations

import functools
import re
import string
from pathlib import Path

_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.MULTILINE)


@functools.lru_cache(maxsize=None)
def kernel_dir() -> Path:
    """The folder holding the .cu sources: the installed package data
    `cunorm.kernels`, or the repository's kernels/ when run from a checkout."""
    try:
        from importlib.resources import files

        path = Path(str(files("cunorm.kernels")))
        if (path / "cunorm_common.cuh").is_file():
            return path
    except ModuleNotFoundError:
        pass
    path = Path(__file__).resolve().parent.parent / "kernels"
    if not (path / "cunorm_common.cuh").is_file():
        raise FileNotFoundError(f"cunorm kernel sources not found (looked in cunorm.kernels and {path})")
    return path


@functools.lru_cache(maxsize=None)
def _read(name: str) -> str:
    return (kernel_dir() / name).read_text()


def inline(name: str) -> str:
    """The file `name` with every #include of a kernels/ file replaced by that
    file's text (each file once, like #pragma once)."""
    seen: set[str] = set()

    def expand(file: str) -> str:
        seen.add(file)

        def replace(m: re.Match) -> str:
            inc = m.group(1)
            if not (kernel_dir() / inc).is_file():
                raise FileNotFoundError(f"{file} includes {inc!r}, which is not in {kernel_dir()}")
            if inc in seen:
                return f"// {inc}: already inlined above"
            return f"// ---- begin {inc} ----\n{expand(inc)}\n// ---- end {inc} ----"

        return _LOCAL_INCLUDE.sub(replace, _read(file))

    return expand(name)


def render(traits) -> str:
    """The exact CUDA source compiled for `traits` (any cunorm traits object:
    it names its `source_file` and gives `template_values()`)."""
    text = inline(traits.source_file)
    try:
        body = string.Template(text).substitute(traits.template_values())
    except KeyError as e:
        raise ValueError(f"{traits.source_file} needs trait {e.args[0]!r}, which {type(traits).__name__} "
                         f"does not provide") from None
    return f"// cunorm: {traits.source_file} rendered for {traits.short()}\n{body}"
