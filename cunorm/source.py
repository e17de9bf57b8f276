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
    """The folder holding the .cu sources: the kernels/ beside this package
    when it is imported from a checkout (so that two trees side by side each
    run their own kernels, whatever is installed), else the installed package
    data `cunorm.kernels`."""
    checkout = Path(__file__).resolve().parent.parent / "kernels"
    if (checkout / "cunorm_common.cuh").is_file():
        return checkout
    try:
        from importlib.resources import files

        path = Path(str(files("cunorm.kernels")))
        if (path / "cunorm_common.cuh").is_file():
            return path
    except ModuleNotFoundError:
        pass
    raise FileNotFoundError(f"cunorm kernel sources not found (looked in {checkout} and cunorm.kernels)")


@functools.lru_cache(maxsize=None)
def _read(name: str) -> str:
    return (kernel_dir() / name).read_text()


def inline(name: str, text: str | None = None) -> str:
    """The file `name` (or `text`, an edited copy of it) with every #include
    of a kernels/ file replaced by that file's text (each file once, like
    #pragma once)."""
    seen: set[str] = set()

    def expand(file: str, body: str | None = None) -> str:
        seen.add(file)

        def replace(m: re.Match) -> str:
            inc = m.group(1)
            if not (kernel_dir() / inc).is_file():
                raise FileNotFoundError(f"{file} includes {inc!r}, which is not in {kernel_dir()}")
            if inc in seen:
                return f"// {inc}: already inlined above"
            return f"// ---- begin {inc} ----\n{expand(inc)}\n// ---- end {inc} ----"

        return _LOCAL_INCLUDE.sub(replace, _read(file) if body is None else body)

    return expand(name, text)


def render(traits, source: str | None = None) -> str:
    """The exact CUDA source compiled for `traits` (any cunorm traits object:
    it names its `source_file` and gives `template_values()`). `source`: the
    text of an edited copy of that file to render instead (its ${NAME}
    placeholders and #include lines work as in the shipped file)."""
    text = inline(traits.source_file, source)
    name = traits.source_file if source is None else f"an edited {traits.source_file}"
    try:
        body = string.Template(text).substitute(traits.template_values())
    except KeyError as e:
        raise ValueError(f"{name} needs trait {e.args[0]!r}, which {type(traits).__name__} does not provide") from None
    except ValueError as e:  # a stray "$" in the text
        raise ValueError(f"{name}: {e} (write a literal $ as $$)") from None
    return f"// cunorm: {name} rendered for {traits.short()}\n{body}"


def defined_kernels(text: str) -> set:
    """The extern "C" __global__ functions a source defines, by name."""
    return set(re.findall(r'extern\s+"C"\s+__global__\s+void(?:\s+__launch_bounds__\([^)]*\))?(?:\s+\w+)*?\s+(\w+)\s*\(',
                          text))


def check_source(traits, source: str) -> str:
    """`source` as text, checked to define the kernels `traits` launches; ValueError naming `source` otherwise."""
    if not isinstance(source, str):
        raise TypeError(f"source: expected the text of an edited kernel file, got {type(source).__name__}")
    missing = set(traits.launches()) - defined_kernels(source)
    if missing:
        raise ValueError(f"source: defines no extern \"C\" kernel {', '.join(sorted(missing))} (this call runs "
                         f"{traits.source_file}'s kernels: pass an edited copy of that file)")
    return source
