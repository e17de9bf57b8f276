"""Tier A: the examples run (the script on the CPU path) and the notebook is well formed."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_runs():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "attention_delta: (2, 128, 8)" in out.stdout
    err = float(out.stdout.split("relative L2 error vs float64:")[1].split()[0])
    assert err < 8e-3


def test_notebook_is_valid_and_compiles():
    nb = json.loads((ROOT / "examples" / "tour.ipynb").read_text())
    assert nb["nbformat"] == 4 and nb["cells"]
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            compile("".join(cell["source"]), "cell", "exec")


def test_train_torch_runs():
    """The torch example on the CPU (cunorm's ops take the reference path there)."""
    import pytest

    pytest.importorskip("torch", reason="torch is not installed (the torch example needs it)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_torch.py"), "--steps", "3", "--width", "32"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "replaced 5 norms" in out.stdout
    worst = float(out.stdout.split("largest relative difference over 3 steps:")[1].split()[0])
    assert worst < 1e-4


def test_notebook_was_run_on_a_gpu_and_keeps_its_outputs():
    """The committed notebook is the output of scripts/run_notebook.py on a GPU:
    every code cell ran once, top to bottom, none raised, no cell fell back to
    "needs a CUDA GPU", and the bandwidth plot is there as an image."""
    nb = json.loads((ROOT / "examples" / "tour.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
    outputs = [o for c in code for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    text = "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert "needs a CUDA GPU" not in text and ("H100" in text or "H200" in text)
    assert any("image/png" in o.get("data", {}) for o in outputs)


def test_the_notebooks_gpu_cells_still_fit_the_api():
    """The GPU cells ran when the notebook was executed; since then the functions they call must keep
    the names and keywords the cells use (the cells' calls, bound to the current signatures)."""
    import inspect

    from cunorm.bench import compare, median_ms, variants_of
    from cunorm.check import Case, run_case
    from cunorm.plot import plot_bandwidth
    from cunorm.tune import tune

    code = "\n".join("".join(c["source"]) for c in json.loads((ROOT / "examples" / "tour.ipynb").read_text())["cells"]
                     if c["cell_type"] == "code")
    for fn, args, kwargs in [
            (compare, ((768,), {}), dict(rounds=3, repeat=10, directions=("fwd",))),
            (variants_of, (), dict(source="text")),
            (run_case, (None,), dict(source="text")),
            (tune, (4096, "bfloat16"), dict(backward=True)),
            (plot_bandwidth, ({}, "x.png"), {}),
            (median_ms, (None,), {}),
            (Case, ("layer_norm", 1024, 37, "bfloat16", "float32"), dict(has_bias=True))]:
        assert fn.__name__ in code, fn.__name__
        inspect.signature(fn).bind(*args, **kwargs)
