"""The `cunorm` command: check (the correctness checker), info, list, bench, tune.

This package holds the group and what its commands share; the commands live by
responsibility in checking.py, inventory.py and measuring.py.

One style throughout: `--json` is a flag that prints JSON to stdout; a file is
asked for with `--output FILE`. Exit codes: 0 pass, 1 fail, 2 usage, 3 no GPU."""
from __future__ import annotations

import json
import sys

import click

from .. import dtypes
from ..check import SHORT_NAMES

EXIT_FAIL, EXIT_NO_GPU = 1, 3
OP_NAMES = {**{name: op + ("_backward" if backward else "") for name, (op, backward) in SHORT_NAMES.items()},
            "delta": "attention_delta"}


def _csv(kind):
    def parse(ctx, param, value):
        if value is None:
            return None
        try:
            return tuple(kind(v) for v in value.split(",") if v.strip())
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return parse


def _dtype_list(value: str) -> str:
    try:
        return dtypes.name_of(value.strip())
    except ValueError:
        raise ValueError(f"unknown dtype {value!r}; expected fp32, fp16 or bf16") from None


def _arch(value: str) -> int:
    from ..compiler import arch_number

    try:
        return arch_number(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def gpu_missing(command: str, as_json: bool, hint: str = "") -> bool:
    """Whether there is no GPU; if so, says so (also as JSON on stdout with --json)."""
    if gpu_count():
        return False
    if as_json:
        print(json.dumps({"error": "no CUDA GPU found", "exit": EXIT_NO_GPU}))
    print(f"{command}: no CUDA GPU found" + (f" ({hint})" if hint else ""), file=sys.stderr)
    return True


def _gpu_of_arch(arch: int):
    """This machine's first GPU model (for its tuned tables) when it is of `arch`, else None."""
    if gpu_count() < 1:
        return None
    from ..compiler import device_arch, device_gpu

    return device_gpu(0) if device_arch(0) == arch else None


def gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver, no device, or no CuPy
        return 0


@click.group()
@click.version_option(package_name="cunorm")
def main():
    """cunorm: row-wise normalization kernels for CuPy."""


__all__ = ["main", "bench", "tune", "checking", "inventory", "measuring", "gpu_missing", "gpu_count", "EXIT_FAIL",
           "EXIT_NO_GPU"]

# The commands register themselves on `main` when imported (after the names they share, above).
from . import checking, inventory, measuring  # noqa: E402,F401
from .measuring import bench, tune  # noqa: E402,F401  (python -m cunorm.bench / cunorm.tune run these)
