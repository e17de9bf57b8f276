"""Executes a notebook in place, keeping its outputs (the `notebook` step of
scripts/gpu_tier.sh): nbclient with the python3 kernel, run from the
repository root so that `import cunorm` finds the checkout.

    python3 scripts/run_notebook.py examples/tour.ipynb
"""
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def main(path: str) -> int:
    nb = nbformat.read(path, as_version=4)
    root = Path(__file__).resolve().parent.parent
    # allow_errors: every cell runs and the notebook is written with its error outputs, counted below.
    NotebookClient(nb, timeout=900, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(root)}}).execute()
    nbformat.write(nb, path)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    print(f"{path}: {sum(c.cell_type == 'code' for c in nb.cells)} code cells run, {len(errors)} errors")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "examples/tour.ipynb"))
