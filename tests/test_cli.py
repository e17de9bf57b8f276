"""Tier A: the CLI through click's CliRunner."""
import json

import pytest
from click.testing import CliRunner

from cunorm import cli


def test_list_json_covers_the_tuned_table():
    res = CliRunner().invoke(cli.main, ["list", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    from cunorm import dispatch

    assert {r["hidden_size"] for r in rows} == set(dispatch.TUNED_SIZES)
    assert {r["op"] for r in rows} == {"fwd", "bwd"}


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


@pytest.mark.parametrize("args", [["check", "--dtypes", "fp64"], ["check", "--op", "sideways"],
                                  ["check", "--sizes", "ten"], ["nonsense"]])
def test_usage_errors_exit_2(args):
    assert CliRunner().invoke(cli.main, args).exit_code == 2


@pytest.mark.nvrtc
def test_check_compile_only_json():
    res = CliRunner().invoke(cli.main, ["check", "--compile-only", "--sizes", "1024,1000", "--dtypes", "bf16",
                                        "--sweep", "tuned", "--op", "fwd", "--op", "bwd", "--op", "delta", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    # LayerNorm: sizes x weight dtypes x ops; attention_delta: sizes x alignment caps.
    assert out["failed"] == 0 and len(out["variants"]) == 2 * 2 * 2 + 2 * 2
    assert all(v["ok"] for v in out["variants"])


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

    def broken(traits, arch=90):
        raise compiler.CompileError("planted failure")

    monkeypatch.setattr(compiler, "compile_only", broken)
    res = CliRunner().invoke(cli.main, ["check", "--compile-only", "--sizes", "1024", "--dtypes", "fp32"])
    assert res.exit_code == 1 and "planted failure" in res.output
