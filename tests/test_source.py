"""Your own kernel source: an edited copy of kernels/norm_fwd.cu or
norm_bwd.cu run in place of the shipped one, through the op, `cunorm check
--source` and `cunorm bench --source`. Tier A checks the refusals; tier C
runs an edited kernel on the GPU."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

import cunorm
from cunorm import check, cli
from cunorm.source import _read

LINE = "out[e] = HAS_BIAS ? scaled + bv.get(e) : scaled;"
DOUBLED = _read("norm_fwd.cu").replace(LINE, "out[e] = 2.f * (HAS_BIAS ? scaled + bv.get(e) : scaled);  // y * 2")
SAME = _read("norm_fwd.cu").replace(LINE, LINE + "  // edited, same arithmetic")


def test_a_source_for_the_other_direction_is_refused():
    x = np.ones((4, 64), np.float32)
    with pytest.raises(ValueError, match="source: defines no extern \"C\" kernel norm_fwd"):
        cunorm.layer_norm(x, source=_read("norm_bwd.cu"))
    with pytest.raises(ValueError, match="norm_bwd"):
        cunorm.rms_norm_backward(x, x, np.ones(4, np.float32), source=SAME)
    with pytest.raises(TypeError, match="source: expected the text"):
        cunorm.layer_norm(x, source=b"bytes")
    assert check.source_ops(SAME) == ("layer_norm", "rms_norm")


def test_check_source_must_be_a_norm_kernel(tmp_path):
    other = tmp_path / "delta.cu"
    other.write_text(_read("attention_delta.cu"))
    res = CliRunner().invoke(cli.main, ["check", "--source", str(other)])
    assert res.exit_code == 2 and "neither norm_fwd nor norm_bwd" in res.output


@pytest.mark.gpu
def test_the_op_runs_the_edited_kernel(rng):
    import cupy

    x = cupy.asarray(rng.standard_normal((300, 4096)).astype(np.float32))
    w = cupy.asarray(rng.standard_normal(4096).astype(np.float32))
    shipped = cunorm.layer_norm(x, w, w)
    for _ in range(2):  # planned, then cached (the source is part of the key)
        doubled = cunorm.layer_norm(x, w, w, source=DOUBLED)
        assert cupy.array_equal(doubled, 2 * shipped)
    assert cupy.array_equal(cunorm.layer_norm(x, w, w), shipped)  # the shipped kernel is still the default
    assert cupy.array_equal(cunorm.layer_norm(x, w, w, source=SAME), shipped)


@pytest.mark.gpu
def test_check_and_bench_take_a_source(tmp_path):
    same, doubled = tmp_path / "same.cu", tmp_path / "doubled.cu"
    same.write_text(SAME)
    doubled.write_text(DOUBLED)
    args = ["check", "--sizes", "1024,4097", "--rows", "37", "--sweep", "tuned", "--sweep", "general"]
    res = CliRunner().invoke(cli.main, args + ["--source", str(same)])
    assert res.exit_code == 0, res.output
    assert "layer_norm_backward" not in res.output and "rms_norm " in res.output  # the forwards only
    res = CliRunner().invoke(cli.main, args + ["--source", str(doubled)])
    assert res.exit_code == 1 and "FAIL" in res.output
    res = CliRunner().invoke(cli.main, ["bench", "--source", str(same), "--sizes", "1024", "--rounds", "2",
                                        "--repeat", "4", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout[res.stdout.index("{"):])["rows"]
    assert {r["op"] for r in rows} == {"layer_norm fwd", "rms_norm fwd"}
    assert all(r["verdict"] in ("within noise", "edited faster", "edited slower") for r in rows)
