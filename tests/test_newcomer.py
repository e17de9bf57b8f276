"""Tier A: what a newcomer meets without a GPU: the numpy path validates like
the GPU path, explain previews a GPU, dtype names, defaults, inf rows, and
the packaging."""
import warnings

import numpy as np
import pytest

import cunorm
from cunorm import dtypes


@pytest.mark.parametrize("traits,match", [({"warps_n": 64}, "illegal traits"), ({"warp_n": 4}, "unknown knobs"),
                                          (cunorm.Traits(hidden_size=4096, warps_n=4), "hidden_size=4096")])
def test_numpy_path_checks_traits_for_the_call(traits, match):
    x = np.ones((4, 1024), np.float32)
    with pytest.raises(ValueError, match=match):
        cunorm.layer_norm(x, traits=traits)
    with pytest.raises(ValueError, match=match):
        cunorm.rms_norm_backward(x, x, np.ones(4, np.float32), traits=traits)
    assert cunorm.layer_norm(x, traits={"warps_n": 4}).shape == x.shape  # legal knobs: the reference runs


def test_numpy_path_refuses_overlapping_out():
    buf = np.ones((5, 64), np.float32)
    with pytest.raises(ValueError, match="out: shares memory with x"):
        cunorm.layer_norm(buf[:4], out=buf[1:])
    assert cunorm.layer_norm(buf[:4], out=buf[:4]) is not None  # exactly x: in place
    with pytest.raises(ValueError, match="illegal traits"):
        cunorm.attention_delta(np.ones((3, 64), np.float32), np.ones((3, 64), np.float32),
                               traits={"threads_per_row": 3})


def test_explain_previews_a_gpu_for_numpy_inputs():
    x = np.ones((8, 4096), dtypes.BFLOAT16)
    e = cunorm.explain(cunorm.layer_norm, x)
    assert e.path == "reference" and e.traits is not None and e.arch == 90 and e.traits.aligned_rows
    e80 = cunorm.explain("layer_norm_backward", x, x, np.ones(8, np.float32), np.ones(8, np.float32), arch="sm_80")
    assert e80.arch == 80 and e80.traits.ctas_per_row == 1 and "sm_80" in str(e80)
    general = cunorm.explain(cunorm.rms_norm, np.ones((8, 4097), np.float32))
    assert not general.traits.aligned_rows and "general kernel" in str(general)
    d = cunorm.explain(cunorm.attention_delta, np.ones((2, 3, 64), np.float16), np.ones((2, 3, 64), np.float16))
    assert d.op == "attention_delta" and d.traits.head_dim == 64 and d.path == "reference"


def test_dtype_names_are_the_same_everywhere():
    x = np.ones((2, 16), np.float32)
    assert cunorm.layer_norm(x, out_dtype="bf16").dtype == dtypes.BFLOAT16
    assert cunorm.layer_norm(x, out_dtype="fp16").dtype == np.float16
    assert cunorm.Traits(hidden_size=1024, input_dtype="bf16").input_dtype == "bfloat16"
    _, h = cunorm.rms_norm(x, residual=x, residual_dtype="half")
    assert h.dtype == np.float16


def test_default_traits_are_legal_and_follow_the_input():
    t = cunorm.Traits(hidden_size=4096)
    assert t.elts_per_thread <= t.max_elts_per_thread
    t = cunorm.Traits(hidden_size=4096, input_dtype="bfloat16")
    assert t.output_dtype == t.weight_dtype == t.bias_dtype == "bfloat16"
    assert "bfloat16/bfloat16->bfloat16" in cunorm.render(t).splitlines()[0]
    assert cunorm.Traits(hidden_size=4096, warps_n=4).stages == 2  # knobs given: the rest take KNOB_DEFAULTS


@pytest.mark.parametrize("op", [cunorm.layer_norm, cunorm.rms_norm])
def test_a_row_holding_inf_or_nan_is_all_nan_without_warnings(op):
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    x[1, 3], x[2, 0] = np.inf, np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, *stats = op(x, np.ones(32, np.float32), return_stats=True)
    assert np.isnan(y[1:3]).all() and np.isfinite(y[[0, 3]]).all()
    for s in stats:
        assert np.isnan(s[1:3]).all() and np.isfinite(s[[0, 3]]).all()


def test_sdist_ships_examples_and_license(tmp_path):
    import subprocess
    import sys
    import tarfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(tmp_path), str(root)],
                   check=True, capture_output=True)
    (sdist,) = tmp_path.glob("cunorm-*.tar.gz")
    names = tarfile.open(sdist).getnames()
    for wanted in ("LICENSE", "examples/quickstart.py", "examples/tour.ipynb", "examples/train_torch.py",
                   "tests/test_examples.py"):
        assert any(n.endswith(wanted) for n in names), wanted
