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
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's cunorm, not an installed one

from cunorm import check  # noqa: E402
from cunorm.compiler import CompileError, arch_number, compile_only  # noqa: E402


def digest(traits, arch: int) -> str:
    """sha256 of the cubin (the SASS and its metadata), or why it did not compile."""
    try:
        return hashlib.sha256(compile_only(traits, arch).cubin).hexdigest()[:16]
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
