"""Where a kernel's instructions, stalls and excess memory traffic go, per SASS instruction, from an Nsight
Compute report's source page. Runs anywhere (no GPU): on the device, save the page as CSV, bring it back, then

    ncu --section SourceCounters --section WarpStateStats -o rep python3 scripts/profile_one.py fwd:8193 fwd:8192
    ncu --import rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python scripts/ncu_sass.py rep.csv --rows 8191,8192      # warp instructions a row, kernel by kernel

Prints, for each kernel of the report: the warp instructions executed by opcode (predicates and modifiers
dropped; per row with --rows), the stall reasons' shares of the warp samples, the L2 sectors its global
accesses asked for against ncu's ideal, and the instructions that cost the most excess sectors and stall
samples.
"""
import argparse
import collections
import csv
import io
import re
import sys

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"
SECTORS, IDEAL, EXCESS = ("L2 Theoretical Sectors Global", "L2 Theoretical Sectors Global Ideal",
                          "L2 Theoretical Sectors Global Excessive")
_PREDICATE = re.compile(r"^@!?U?P[T\d]+\s+")


def kernels(text: str) -> list:
    """[(name, rows)] of a source-page CSV: each kernel's table, a dict per SASS instruction."""
    out = []
    for chunk in text.split('"Kernel Name",')[1:]:
        name, _, table = chunk.partition("\n")
        rows = list(csv.reader(io.StringIO(table)))
        if not rows:
            continue
        head = rows[0]
        out.append((name.strip().strip(",").strip('"'),
                    [dict(zip(head, r)) for r in rows[1:] if len(r) == len(head)]))
    return out


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def opcode(source: str) -> str:
    """An instruction's base opcode: `@!P1 LDG.E.U16.CONSTANT R1, [R2]` -> LDG."""
    words = _PREDICATE.sub("", source.strip()).split()
    return words[0].split(".")[0] if words else "?"


def summary(rows: list) -> dict:
    """Totals of one kernel: executed by opcode, stall shares, global sectors (total, ideal, excess)."""
    by_opcode = collections.Counter()
    for r in rows:
        by_opcode[opcode(r.get("Source", ""))] += number(r.get(EXECUTED))
    stalls = collections.Counter()
    for column in (rows[0] if rows else {}):
        if column.startswith("stall_") and "Not Issued" not in column:
            stalls[column[len("stall_"):]] = sum(number(r.get(column)) for r in rows)
    samples = sum(stalls.values())
    return {"by_opcode": by_opcode,
            "stall_shares": {k: v / samples for k, v in stalls.most_common()} if samples else {},
            "sectors": tuple(sum(number(r.get(c)) for r in rows) for c in (SECTORS, IDEAL, EXCESS))}


def top(rows: list, column: str, count: int) -> list:
    """The `count` instructions with the most of `column` (those with none left out)."""
    return [r for r in sorted(rows, key=lambda r: -number(r.get(column)))[:count] if number(r.get(column)) > 0]


def report(text: str, rows_per_kernel=(), count: int = 8, opcodes: int = 20, out=sys.stdout) -> None:
    for k, (name, rows) in enumerate(kernels(text)):
        per = rows_per_kernel[k] if k < len(rows_per_kernel) else 1
        s = summary(rows)
        unit = f"a row ({per} rows)" if per > 1 else "in all"
        print(f"== kernel {k}: {name}; {len(rows)} instructions; warp instructions executed {unit}", file=out)
        for op, n in s["by_opcode"].most_common(opcodes):
            print(f"  {op:<10} {n / per:12.0f}", file=out)
        print(f"  {'total':<10} {sum(s['by_opcode'].values()) / per:12.0f}", file=out)
        if s["stall_shares"]:
            print("  stalls: " + ", ".join(f"{k} {v:.2f}" for k, v in s["stall_shares"].items() if v >= 0.02),
                  file=out)
        total, ideal, excess = s["sectors"]
        print(f"  L2 global sectors {total:.0f}, ideal {ideal:.0f}, excessive {excess:.0f}", file=out)
        for column, label in ((EXCESS, "excessive sectors"), (SAMPLES, "stall samples")):
            for r in top(rows, column, count):
                print(f"  {label:<17} {number(r.get(column)):10.0f}  executed {number(r.get(EXECUTED)):9.0f}  "
                      f"{r.get('Address', '')[-6:]}  {r.get('Source', '').strip()}", file=out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--rows", default="", help="rows each kernel ran, comma-separated in report order: "
                                                   "counts become per row")
    parser.add_argument("--top", type=int, default=8, help="instructions listed by excess sectors and by stalls")
    parser.add_argument("--opcodes", type=int, default=20, help="opcodes listed")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    if any(r < 1 for r in rows):
        parser.error("--rows: positive counts")
    with open(args.csv) as f:
        text = f.read()
    if not kernels(text):
        parser.error(f"{args.csv}: no kernel table (expected ncu --page source --csv output)")
    report(text, rows, args.top, args.opcodes)


if __name__ == "__main__":
    main()
