"""Merges the JSON lines `python -m cunorm.tune --json` wrote into cunorm/tuned.py.

    python scripts/tuned_literal.py RESULTS.jsonl [cunorm/tuned.py] [--note "4-byte inputs: H200, <date>"]

Entries for the same (direction, size, element bytes) are replaced; the rest stay.
"""
import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cunorm import dtypes  # noqa: E402

ROW = re.compile(r"^    \((True|False) *, +(\d+), (\d)\): (\([^)]*\)),  # ([0-9.]+) of copy$", re.M)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("results")
    p.add_argument("module", nargs="?", default=str(ROOT / "cunorm" / "tuned.py"))
    p.add_argument("--note", default=None, help="a line to add to the module docstring")
    a = p.parse_args()
    text = Path(a.module).read_text()
    rows = {(bw == "True", int(n), int(size)): (knobs, frac) for bw, n, size, knobs, frac in ROW.findall(text)}
    for line in Path(a.results).read_text().splitlines():
        r = json.loads(line)
        knobs = tuple(int(v) if isinstance(v, bool) else v for v in r["knobs"])
        rows[(r["backward"], r["n"], dtypes.itemsize(r["dtype"]))] = (str(knobs), f"{r['fraction_of_copy']:.2f}")
    head = text[:text.index("TUNED: dict = {")]
    if a.note:
        head = head.replace('"""\n\nTUNED_ARCH', f'{a.note}\n"""\n\nTUNED_ARCH')
    body = [f"    ({str(bw):<5}, {n:>5}, {size}): {knobs},  # {frac} of copy"
            for (bw, n, size), (knobs, frac) in sorted(rows.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0]))]
    Path(a.module).write_text(head + "TUNED: dict = {\n" + "\n".join(body) + "\n}\n")
    print(f"{a.module}: {len(rows)} entries")


if __name__ == "__main__":
    main()
