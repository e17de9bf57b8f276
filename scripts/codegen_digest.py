"""A digest of the machine code of every kernel variant the checker knows: run
it in two trees and diff the outputs to see which variants a change compiles
differently (a refactor or a new flag should leave today's variants alone).
No GPU needed: NVRTC compiles for the architecture given.

    python scripts/codegen_digest.py --arch sm_90 > after.txt      # in each tree, then
    diff before.txt after.txt                                      # the variants whose code changed
"""
import argparse
import hashlib
import os
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's cunorm, not an installed one

from cunorm import check  # noqa: E402
from cunorm.compiler import CompileError, arch_number, compile_only  # noqa: E402


def text_sections(cubin: bytes) -> bytes:
    """The kernels' machine code: the cubin's .text.* sections (name and bytes), in order. The rest of the
    ELF (symbol and string tables, constant banks) changes whenever the source declares one more constexpr
    (a new trait's flag), which leaves every kernel's code alone."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    names = headers[names_index][4]  # the section-name table's offset
    out = b""
    for name, _, _, _, offset, size in headers:
        label = cubin[names + name:cubin.index(b"\0", names + name)]
        if label.startswith(b".text."):
            out += label + cubin[offset:offset + size]
    return out


def digest(traits, arch: int) -> str:
    """sha256 of the kernels' machine code (`text_sections`), or why it did not compile."""
    try:
        return hashlib.sha256(text_sections(compile_only(traits, arch).cubin)).hexdigest()[:16]
    except (CompileError, ValueError) as e:
        return f"error: {str(e).splitlines()[0]}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--sizes", default=None, help="hidden sizes, comma-separated (default: the checker's)")
    a = p.parse_args(argv)
    arch = arch_number(a.arch)
    sizes = tuple(int(v) for v in a.sizes.split(",")) if a.sizes else None
    variants = sorted({t for t, _ in check.case_kernels(check.default_cases(sizes), arch)
                       if not isinstance(t, ValueError)}, key=repr)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        digests = list(pool.map(lambda t: digest(t, arch), variants))
    for t, d in zip(variants, digests):
        print(f"{d}  {t!r}")  # every field: two variants never share a line
    return 0


if __name__ == "__main__":
    sys.exit(main())
