"""Tier A: the renderer inlines our headers and fills every placeholder."""
import re
import string

import pytest

import cunorm
from cunorm import Traits, render
from cunorm.source import inline, kernel_dir


def test_rendered_source_is_complete():
    t = Traits(hidden_size=4096, input_dtype="bfloat16", weight_dtype="float32", output_dtype="float16", warps_n=4)
    src = cunorm.render(t)
    assert "${" not in src and not re.search(r"^#include", src, re.M)
    assert "typedef cn_bf16 input_t;" in src and "typedef float weight_t;" in src
    assert "typedef cn_half output_t;" in src and "constexpr int COLS = 4096;" in src
    assert src.count("struct Coords") == 1  # each header once


def test_backward_renders_its_kernels():
    src = render(Traits(hidden_size=1024, backward=True, warps_n=2))
    assert "norm_bwd(" in src and "norm_bwd_finalize(" in src


def test_every_placeholder_is_a_trait():
    t = Traits(hidden_size=1024)
    for name in ("norm_fwd.cu", "norm_bwd.cu"):
        text = inline(name)
        names = {m.group("named") or m.group("braced") for m in string.Template.pattern.finditer(text)
                 if m.group("named") or m.group("braced")}
        assert names <= set(t.template_values()), names - set(t.template_values())


def test_missing_trait_is_an_error():
    class Partial:
        source_file = "norm_fwd.cu"

        def template_values(self):
            return {"INPUT_T": "float"}

        def short(self):
            return "partial"

    with pytest.raises(ValueError, match="needs trait"):
        render(Partial())


def test_kernel_dir_holds_the_sources():
    assert {p.name for p in kernel_dir().glob("*.cu*")} >= {"cunorm_common.cuh", "norm_traits.cuh", "norm_rows.cuh",
                                                          "row_reducer.cuh", "column_sums.cuh", "norm_fwd.cu",
                                                          "norm_bwd.cu"}


def test_a_checkout_renders_its_own_kernels():
    """Imported from a checkout, cunorm renders the kernels/ beside it, not an
    installed copy's: an A/B between two trees must run each tree's kernels."""
    from pathlib import Path

    import cunorm

    checkout = Path(cunorm.__file__).resolve().parent.parent / "kernels"
    if not (checkout / "norm_fwd.cu").is_file():
        pytest.skip("cunorm is imported from an installed copy, not a checkout")
    assert kernel_dir() == checkout


@pytest.mark.nvrtc
def test_a_wrong_python_mirror_fails_to_compile(monkeypatch):
    """The kernels static_assert that Python's derived traits equal their own:
    a Python derivation that drifts from the C++ one is a compile error."""
    from cunorm import CompileError, compile_only

    t = Traits(hidden_size=12800, input_dtype="bfloat16", warps_n=13, backward=True, stages=2)
    compile_only(t, 90)  # the honest mirror compiles
    for key in ("LDGS", "SMEM_BYTES", "ELTS_PER_THREAD", "THREADS_PER_CTA", "FINALIZE_COLS_PER_CTA",
                "FINALIZE_COL_LANES"):
        values = t.template_values()
        monkeypatch.setattr(Traits, "template_values", lambda self, key=key, values=values: {**values,
                                                                                         key: values[key] + 1})
        with pytest.raises(CompileError, match="disagrees"):
            compile_only(t, 90)
        monkeypatch.undo()
