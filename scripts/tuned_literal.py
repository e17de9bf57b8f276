"""Prints dispatch.TUNED entries from the JSON lines `python -m cunorm.tune --json` wrote."""
import json
import sys

from cunorm import dtypes
from cunorm.traits import KNOBS

print("# " + ", ".join(k.upper() for k in KNOBS))
for line in open(sys.argv[1]):
    r = json.loads(line)
    knobs = tuple(int(v) if isinstance(v, bool) else v for v in r["knobs"])
    print(f"    ({r['backward']!s:<5}, {r['n']:>5}, {dtypes.itemsize(r['dtype'])}): {knobs},"
          f"  # {r['fraction_of_copy']:.2f} of copy")
