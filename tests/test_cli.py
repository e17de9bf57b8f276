"""Tier A: the CLI through click's CliRunner."""
import json

import pytest
from click.testing import CliRunner

from cunorm import cli


def test_list_json_covers_the_tuned_table():
    res = CliRunner().invoke(cli.main, ["list", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    rows = out["rows"]
    from cunorm import dispatch

    assert out["arch"] == 90 and isinstance(out["tables"], list)
    assert {r["hidden_size"] for r in rows} == set(dispatch.TUNED_SIZES)
    assert {r["op"] for r in rows} == {"fwd", "bwd", "rms", "rms-bwd"}


def test_list_for_a_shipped_gpu_model_without_that_gpu():
    """`--gpu` names a shipped table's GPU by a part of its name; its entries show as that table's, RMSNorm's
    apart from LayerNorm's; a name that matches no model, or several, is a usage error listing them."""
    from cunorm import tables

    res = CliRunner().invoke(cli.main, ["list", "--gpu", "h100", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["gpu"]["name"] == "NVIDIA H100 80GB HBM3" and out["arch"] == 90
    source = {(r["hidden_size"], r["dtype"], r["op"]): r["source"] for r in out["rows"]}
    shipped = "shipped NVIDIA H100 80GB HBM3 table"
    assert source[(32768, "bfloat16", "rms")] == shipped and source[(32768, "bfloat16", "fwd")] == shipped
    h100 = next(g for g in tables.shipped_gpus() if "H100" in g.name)
    backward = {k.n for k in tables._shipped_table(h100).entries
                if k.backward and not k.rms and not k.residual and k.input_bytes == 2 and not k.general}
    listed = {n for n, dtype, op in source if (dtype, op) == ("bfloat16", "bwd")}
    assert backward & listed and listed - backward
    for n in listed:  # the rows the table holds, and only those, are its entries
        assert (source[(n, "bfloat16", "bwd")] == shipped) == (n in backward), n
    text = CliRunner().invoke(cli.main, ["list", "--gpu", "H100"]).output
    assert "unstaged" in text and "one wave" in text
    for model in ("nvidia", "a100"):
        bad = CliRunner().invoke(cli.main, ["list", "--gpu", model])
        assert bad.exit_code == 2 and all(g.name in bad.output for g in tables.shipped_gpus())


def test_list_table():
    res = CliRunner().invoke(cli.main, ["list", "--arch", "sm_80"])
    assert res.exit_code == 0 and "WARPS_N" in res.output


def test_info_json():
    res = CliRunner().invoke(cli.main, ["info", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["cunorm"] and "gpus" in out and out["kernels"].endswith("kernels")


def test_check_without_gpu_exits_3(monkeypatch):
    monkeypatch.setattr(cli, "gpu_count", lambda: 0)
    res = CliRunner().invoke(cli.main, ["check", "--sizes", "1024"])
    assert res.exit_code == 3


@pytest.mark.parametrize("args", [["check", "--dtypes", "fp8"], ["check", "--op", "sideways"],
                                  ["check", "--sizes", "ten"], ["nonsense"]])
def test_usage_errors_exit_2(args):
    assert CliRunner().invoke(cli.main, args).exit_code == 2


@pytest.mark.nvrtc
def test_check_compile_only_json():
    res = CliRunner().invoke(cli.main, ["check", "--compile-only", "--sizes", "1024,1000", "--dtypes", "bf16",
                                        "--sweep", "tuned", "--op", "fwd", "--op", "bwd", "--op", "delta", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    # LayerNorm: sizes x weight dtypes x ops, and the backward's one-launch variants (few rows);
    # attention_delta: sizes x alignment caps.
    assert out["failed"] == 0 and out["ok"] and len(out["variants"]) == 2 * 2 * 2 + 2 * 2 + 2 * 2
    assert sum(" grid-finalize " in v["label"] for v in out["variants"]) == 2 * 2
    assert out["compiled"] == len(out["variants"]) and out["refused"] == 0
    assert all(v["verdict"] == "clean" and v["spills"] is False for v in out["variants"])


@pytest.mark.nvrtc
def test_check_compile_only_covers_the_general_kernel():
    res = CliRunner().invoke(cli.main, ["check", "--compile-only", "--sizes", "4097", "--sweep", "general",
                                        "--op", "fwd", "--json"])
    assert res.exit_code == 0, res.output
    labels = [v["label"] for v in json.loads(res.stdout)["variants"]]
    assert any(" general " in label for label in labels) and all(v.startswith("N=") for v in labels)


@pytest.mark.nvrtc
def test_check_compile_only_reports_failure(monkeypatch):
    from cunorm import compiler

    def broken(traits, arch=90, source=None):
        raise compiler.CompileError("planted failure")

    monkeypatch.setattr(compiler, "compile_only", broken)
    res = CliRunner().invoke(cli.main, ["check", "--compile-only", "--sizes", "1024", "--dtypes", "fp32"])
    assert res.exit_code == 1 and "planted failure" in res.output


@pytest.mark.nvrtc
def test_compile_only_verdicts_say_what_was_compiled():
    """Nothing compiled is not a pass; refused variants and spills are counted
    as such, in the table and in the JSON."""
    res = CliRunner().invoke(cli.main, ["check", "--compile-only", "--arch", "sm_75", "--sizes", "4096", "--op",
                                        "fwd", "--sweep", "tuned", "--json"])
    out = json.loads(res.stdout)
    assert res.exit_code == 1 and out["compiled"] == 0 and out["refused"] == len(out["variants"]) > 0
    assert not out["ok"] and all(v["verdict"] == "refused" for v in out["variants"])
    res = CliRunner().invoke(cli.main, ["check", "--compile-only", "--arch", "sm_75", "--sizes", "4096", "--op",
                                        "fwd", "--sweep", "tuned"])
    assert res.exit_code == 1 and "0 compiled" in res.output and "nothing compiled" in res.output
    # sm_80 without clusters: N = 18432's backward spills (a heuristic last resort), N = 262144 is refused.
    res = CliRunner().invoke(cli.main, ["check", "--compile-only", "--arch", "sm_80", "--sizes", "18432,262144",
                                        "--dtypes", "bf16", "--op", "bwd", "--sweep", "tuned", "--json"])
    out = json.loads(res.stdout)
    spilled = [v for v in out["variants"] if v.get("spills")]
    assert out["spilled"] == len(spilled) > 0 and all(v["verdict"] == "spills" and v["spill_bytes"] > 0
                                                       for v in spilled)
    assert out["refused"] >= 1 and "262144" in json.dumps([v["error"] for v in out["variants"]
                                                            if v["verdict"] == "refused"])


def test_sizes_zero_is_a_usage_error():
    res = CliRunner().invoke(cli.main, ["check", "--compile-only", "--sizes", "0"])
    assert res.exit_code == 2 and "--sizes" in res.output


def test_options_narrow_every_sweep():
    from cunorm import check

    cases = check.default_cases((16384,), (37,), ("float16",), ("rms_norm_backward",))
    assert cases and {(c.hidden_size, c.dtype, c.op) for c in cases} == {(16384, "float16", "rms_norm_backward")}
    sweeps = {s: check.default_cases((16384,), (37,), ("float16",), ("rms_norm_backward",), sweeps=(s,))
              for s in check.SWEEPS}
    assert all(c.hidden_size == 16384 and c.dtype == "float16" for cs in sweeps.values() for c in cs)


def test_list_for_an_unsupported_arch_is_one_message():
    res = CliRunner().invoke(cli.main, ["list", "--arch", "sm_75"])
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1 and "sm_80" in res.output


@pytest.mark.parametrize("verb", ["bench", "tune"])
def test_bench_and_tune_without_gpu_say_so(verb, monkeypatch):
    monkeypatch.setattr(cli, "gpu_count", lambda: 0)
    res = CliRunner().invoke(cli.main, [verb])
    assert res.exit_code == 3 and "no CUDA GPU found" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(cli.main, [verb, "--json"])
    assert res.exit_code == 3 and json.loads(res.stdout.splitlines()[0])["error"] == "no CUDA GPU found"


def test_check_json_without_gpu_is_json(monkeypatch):
    monkeypatch.setattr(cli, "gpu_count", lambda: 0)
    res = CliRunner().invoke(cli.main, ["check", "--json", "--sizes", "1024"])
    assert res.exit_code == 3 and json.loads(res.stdout.splitlines()[0])["exit"] == 3


@pytest.mark.parametrize("module", ["cunorm", "cunorm.bench", "cunorm.tune"])
def test_modules_run_and_show_defaults(module):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    if module != "cunorm":
        assert f"Usage: python -m {module} [OPTIONS]" in out.stdout and "[default: " in out.stdout


def test_the_checker_asks_attention_delta_only_head_dims_it_takes():
    """`cunorm check --sizes` names the head dims too: each dtype pair gets those the op takes (half as wide
    for float64), so every case's kernel is legal (1025 with a float64 input once raised in the checker's
    compile step, before any case ran)."""
    from cunorm import check
    from cunorm.attention_delta import MAX_HEAD_DIM

    cases = check.default_cases((1024, 1025, 2048, 4096), (37,), ops=("attention_delta",), sweeps=("tuned",))
    pairs = {(c.hidden_size, c.dtype, c.weight_dtype) for c in cases}
    assert (1025, "float32", "float64") not in pairs and (1024, "float64", "float64") in pairs
    assert (2048, "bfloat16", "float32") in pairs and (1025, "float16", "float32") in pairs
    assert all(c.hidden_size <= MAX_HEAD_DIM for c in cases)
    kernels = list(check.case_kernels(cases, 90))
    assert kernels and not any(isinstance(t, Exception) for t, _ in kernels)
    # A case the op refuses, named directly, is reported unsupported (not raised from the compile step).
    ((refused, origin),) = check.case_kernels([check.Case("attention_delta", 1025, 37, "float64", "float32")], 90)
    assert isinstance(refused, ValueError) and origin == "unsupported"
