"""Merges the JSON lines `python -m cunorm.tune --output FILE` wrote into cunorm/tuned.py.

    python scripts/tuned_literal.py RESULTS.jsonl [cunorm/tuned.py] [--note "4-byte inputs: H200, <date>"]

Entries for the same (direction, size, element bytes) are replaced; the rest stay.
A result measured on general rows (N not whole 16-byte vectors) goes into
TUNED_GENERAL under its aligned neighbour's size.
"""
import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cunorm import dispatch, dtypes  # noqa: E402

ROW = re.compile(r"^    \((True|False) *, +(\d+), (\d)\): (\([^)]*\)),  # ([0-9.]+) of copy$", re.M)
TABLES = ("TUNED", "TUNED_GENERAL")  # in the order they appear in the module


def table_span(text: str, name: str) -> tuple:
    """[start, end) of the rows of `name: dict = {` ... `}` in the module text."""
    start = text.index(f"\n{name}: dict = {{\n") + len(f"\n{name}: dict = {{\n")
    return start, text.index("\n}", start - 1) + 1


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("results")
    p.add_argument("module", nargs="?", default=str(ROOT / "cunorm" / "tuned.py"))
    p.add_argument("--note", default=None, help="a line to add to the module docstring")
    a = p.parse_args()
    text = Path(a.module).read_text()
    tables = {}
    for name in TABLES:
        start, end = table_span(text, name)
        tables[name] = {(bw == "True", int(n), int(size)): (knobs, frac)
                        for bw, n, size, knobs, frac in ROW.findall(text[start:end])}
    for line in Path(a.results).read_text().splitlines():
        r = json.loads(line)
        knobs = tuple(int(v) if isinstance(v, bool) else v for v in r["knobs"])
        n = dispatch.tuned_neighbour(r["n"], r["dtype"]) if r.get("general") else r["n"]
        tables["TUNED_GENERAL" if r.get("general") else "TUNED"][(r["backward"], n, dtypes.itemsize(r["dtype"]))] = (
            str(knobs), f"{r['fraction_of_copy']:.2f}")
    if a.note:
        text = text.replace('"""\n\nTUNED_ARCH', f'{a.note}\n"""\n\nTUNED_ARCH')
    for name in reversed(TABLES):  # the later table first, so the earlier one's span stays put
        start, end = table_span(text, name)
        body = "".join(f"    ({str(bw):<5}, {n:>5}, {size}): {knobs},  # {frac} of copy\n"
                       for (bw, n, size), (knobs, frac) in sorted(tables[name].items(),
                                                                  key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])))
        text = text[:start] + body + text[end:]
    Path(a.module).write_text(text)
    print(f"{a.module}: " + ", ".join(f"{name} {len(tables[name])} entries" for name in TABLES))


if __name__ == "__main__":
    main()
