"""Tier A: `cunorm bench` without a GPU: its options, kernel variants
(--traits, --source) timed on a stand-in GPU whose calls report their own
time, and the bandwidth plot (cunorm.plot). `cunorm tune`: test_tune.py, test_tune_ranking.py."""
import itertools
import json
import sys
import weakref

import pytest
from click.testing import CliRunner

from cunorm import bench, cli, plot
from cunorm.source import _read

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BENCH_OPTIONS = ("--sizes", "--head-dims", "--dtype", "--weight-dtype", "--repeat", "--no-extras", "--host", "--graph",
                 "--kernel-time",
                 "--source", "--traits", "--rounds", "--plot", "--from-json", "--json", "--output")


def runner() -> CliRunner:
    """A runner whose result.stdout is stdout alone (click 8.1 mixes stderr in unless told not to)."""
    try:
        return CliRunner(mix_stderr=False)
    except TypeError:  # click 8.2+: always apart
        return CliRunner()


def test_help_lists_every_option():
    res = runner().invoke(cli.main, ["bench", "--help"])
    assert res.exit_code == 0, res.output
    assert [o for o in BENCH_OPTIONS if o not in res.stdout] == []


@pytest.mark.parametrize("value,says", [("warps_x=4", "unknown knob 'warps_x'"), ("warps_n", "expected knob=value"),
                                        ("=4", "expected knob=value"), ("warps_n=4,,stages=3", "expected knob=value"),
                                        ("warps_n=four", "warps_n=four: expected an integer"),
                                        ("cache_weights=maybe", "cache_weights=maybe: expected 0 or 1")])
def test_traits_refuses_unknown_knobs_and_malformed_values(value, says, monkeypatch):
    monkeypatch.setattr(cli, "gpu_count", lambda: 0)  # refused as usage (2) before the GPU is looked for (3)
    res = runner().invoke(cli.main, ["bench", "--traits", "warps_n=8", "--traits", value])
    assert res.exit_code == 2 and "Invalid value for '--traits'" in res.output and says in res.output


@pytest.mark.parametrize("args", [["bench", "--host", "--graph"], ["bench", "--host", "--traits", "warps_n=4"],
                                  ["bench", "--graph", "--source", __file__], ["bench", "--from-json", __file__],
                                  ["bench", "--plot", "bandwidth.pdf"], ["bench", "--host", "--plot", "bandwidth.png"],
                                  ["bench", "--sizes", "0"], ["bench", "--kernel-time", "--host"],
                                  ["bench", "--kernel-time", "--graph"]])
def test_what_does_not_combine_or_parse_is_a_usage_error(args, monkeypatch):
    monkeypatch.setattr(cli, "gpu_count", lambda: 0)
    res = runner().invoke(cli.main, args)
    assert res.exit_code == 2, res.output


@pytest.mark.parametrize("args", [["bench", "--traits", "warps_n=4,stages=3"], ["bench", "--plot", "bandwidth.png"]])
def test_new_options_without_gpu_exit_3_with_json(args, monkeypatch):
    monkeypatch.setattr(cli, "gpu_count", lambda: 0)
    res = runner().invoke(cli.main, [*args, "--json"])
    assert res.exit_code == cli.EXIT_NO_GPU
    assert json.loads(res.stdout) == {"error": "no CUDA GPU found", "exit": cli.EXIT_NO_GPU}


# A stand-in GPU: each call returns the milliseconds it "takes", which the
# stand-in median_ms reports. Forced warps_n=64 is illegal below N = 4096.
TUNED_MS, FAST_MS, TORCH_MS = 1.0, 0.5, 2.0


def fake_norm_cases(sizes, dtype, weight_dtype=None, ops=bench.PLAIN_OPS, directions=bench.DIRECTIONS, native=False,
                    only=None):
    for n in sizes:
        for op in ops:
            for direction in directions:
                if only is not None and (op, direction) not in only:
                    continue
                def call(n=n, traits=None, source=None):
                    if traits and traits.get("warps_n") == 64 and n < 4096:
                        raise ValueError(f"illegal traits N={n} WARPS_N=64: planted")
                    return FAST_MS if traits and traits.get("warps_n") == 8 else TUNED_MS
                yield bench.Case(f"{op} {direction}", n, 10**9, call, (lambda: TORCH_MS) if native else None)


@pytest.fixture
def stand_in_gpu(monkeypatch):
    monkeypatch.setattr(cli, "gpu_count", lambda: 1)
    monkeypatch.setattr(bench, "gpu_name", lambda: "Stand-in GPU")
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 2e12)
    monkeypatch.setattr(bench, "median_ms", lambda fn, repeat: fn())
    monkeypatch.setattr(bench, "norm_cases", fake_norm_cases)


def test_traits_variants_beside_tuned_and_torch(stand_in_gpu, tmp_path):
    png, saved = tmp_path / "bandwidth.png", tmp_path / "results.json"
    res = runner().invoke(cli.main, ["bench", "--traits", "warps_n=8", "--traits", "warps_n=64", "--traits",
                                     " warps_n=8 ", "--sizes", "1024,4096", "--rounds", "2", "--json",
                                     "--output", str(saved), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)  # the table and the progress bar went to stderr
    assert out == json.loads(saved.read_text()) and png.read_bytes().startswith(PNG_MAGIC)
    assert out["variants"] == ["tuned", "warps_n=8", "warps_n=64"]
    assert len(out["rows"]) == 2 * 2 * 2  # sizes x (LayerNorm, RMSNorm) x (fwd, bwd)
    for row in out["rows"]:
        v = row["variants"]
        assert list(v) == ["tuned", "warps_n=8", "warps_n=64", "torch"]
        assert v["tuned"]["us"] == pytest.approx(TUNED_MS * 1e3) and "verdict" not in v["tuned"]
        assert v["tuned"]["fraction_of_copy"] == pytest.approx(10**9 / (TUNED_MS * 1e-3) / 2e12)
        assert v["warps_n=8"]["verdict"] == "faster" and v["torch"]["verdict"] == "slower"
        if row["n"] == 1024:
            assert "planted" in v["warps_n=64"]["skipped"]
            assert row["verdict"] == "warps_n=8 faster; warps_n=64 skipped"
        else:
            assert v["warps_n=64"]["verdict"] == "within noise" and row["verdict"] == "warps_n=8 faster"
    assert "timing variants" in res.stderr and "skipped: ValueError: illegal traits N=1024" in res.stderr


def test_table_on_stdout_progress_on_stderr(stand_in_gpu):
    res = runner().invoke(cli.main, ["bench", "--traits", "warps_n=8", "--sizes", "4096", "--rounds", "1"])
    assert res.exit_code == 0, res.output
    assert "layer_norm fwd" in res.stdout and "warps_n=8" in res.stdout and "timing variants" not in res.stdout
    assert "timing variants" in res.stderr


def test_source_times_the_direction_it_serves(stand_in_gpu, tmp_path):
    edited = tmp_path / "norm_fwd.cu"
    edited.write_text(_read("norm_fwd.cu") + "\n// edited\n")
    res = runner().invoke(cli.main, ["bench", "--source", str(edited), "--traits", "warps_n=8", "--sizes", "4096",
                                     "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["rows"]
    assert {r["op"] for r in rows} == {"layer_norm fwd", "rms_norm fwd"}
    assert all(list(r["variants"])[:3] == ["tuned", "edited", "warps_n=8"] for r in rows)
    assert all(r["verdict"] == "warps_n=8 faster" and r["variants"]["edited"]["verdict"] == "within noise"
               for r in rows)


def test_variants_pass_the_shipped_file_beside_an_edited_one():
    edited = _read("norm_bwd.cu") + "\n// edited\n"
    variants = bench.variants_of(edited, {"stages=3": {"stages": 3}})
    assert variants == {"tuned": {"source": _read("norm_bwd.cu")}, "edited": {"source": edited},
                        "stages=3": {"source": _read("norm_bwd.cu"), "traits": {"stages": 3}}}
    plain = bench.variants_of(traits={"warps_n=4": {"warps_n": 4}})
    assert plain == {"tuned": {}, "warps_n=4": {"traits": {"warps_n": 4}}}
    assert bench.served_directions(edited) == ("bwd",)


# Results as bench returns or writes them: the bandwidth table, a compare and --graph.
TABLE = {"gpu": "Stand-in GPU", "copy_gbps": 3000.0, "dtype": "bfloat16", "rows": [
    {"op": "layer_norm fwd", "n": n, "fraction_of_copy": f} for n, f in ((4096, 0.85), (1024, 0.8), (65536, 0.7))
] + [{"op": "attention_delta", "n": 128, "fraction_of_copy": 0.95}]}
COMPARED = {"gpu": "Stand-in GPU", "copy_gbps": 3000.0, "variants": ["tuned", "warps_n=64"], "rows": [
    {"op": "rms_norm bwd", "n": 1024, "verdict": "warps_n=64 skipped",
     "variants": {"tuned": {"fraction_of_copy": 0.8, "fraction_min": 0.78, "fraction_max": 0.82, "us": 100.0},
                  "warps_n=64": {"skipped": "ValueError: illegal"}}},
    {"op": "rms_norm bwd", "n": 8192, "verdict": "within noise",
     "variants": {"tuned": {"fraction_of_copy": 0.9, "fraction_min": 0.88, "fraction_max": 0.91, "us": 90.0},
                  "warps_n=64": {"fraction_of_copy": 0.89, "fraction_min": 0.87, "fraction_max": 1.2, "us": 91.0,
                                 "verdict": "within noise"}}}]}
GRAPH = {"gpu": "Stand-in GPU", "rows": [{"op": "layer_norm fwd", "n": 1024, "api": 0.8, "graph": 0.82}]}


def test_series_one_line_per_op_and_variant():
    assert plot.series(TABLE) == {("layer_norm fwd", None): [(1024, 0.8, 0.8, 0.8), (4096, 0.85, 0.85, 0.85),
                                                             (65536, 0.7, 0.7, 0.7)]}  # delta's x is K, not N
    assert plot.series(COMPARED) == {("rms_norm bwd", "tuned"): [(1024, 0.8, 0.78, 0.82), (8192, 0.9, 0.88, 0.91)],
                                     ("rms_norm bwd", "warps_n=64"): [(8192, 0.89, 0.87, 1.2)]}
    assert list(plot.series(GRAPH)) == [("layer_norm fwd", "API"), ("layer_norm fwd", "graph replay")]
    rounds = {"rows": [{"op": "layer_norm fwd", "n": 1024, "fraction_of_copy": 0.8, "fraction_min": 0.7,
                        "fraction_max": 0.85}]}  # a sweep of several rounds: its spread is drawn too
    assert plot.series(rounds) == {("layer_norm fwd", None): [(1024, 0.8, 0.7, 0.85)]}


@pytest.mark.parametrize("results", [TABLE, COMPARED, GRAPH])
def test_plot_bandwidth_writes_png_and_svg(results, tmp_path):
    png, svg = tmp_path / "bandwidth.png", tmp_path / "bandwidth.svg"
    plot.plot_bandwidth(results, str(png))
    plot.plot_bandwidth(results, str(svg))
    assert png.stat().st_size > 1000 and png.read_bytes().startswith(PNG_MAGIC)
    assert svg.stat().st_size > 1000 and b"<svg" in svg.read_bytes()[:1000]


def test_plot_refuses_what_it_cannot_draw(tmp_path):
    with pytest.raises(ValueError, match="nothing to plot"):
        plot.plot_bandwidth({"rows": [{"op": "layer_norm", "shape": [1, 4096], "us": 9.0}]}, str(tmp_path / "a.png"))
    with pytest.raises(ValueError, match="expected a .png or .svg"):
        plot.plot_bandwidth(TABLE, str(tmp_path / "a.jpg"))


def test_plot_a_saved_run_without_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "gpu_count", lambda: 0)
    saved, svg = tmp_path / "results.json", tmp_path / "bandwidth.svg"
    saved.write_text(json.dumps(COMPARED))
    res = runner().invoke(cli.main, ["bench", "--from-json", str(saved), "--plot", str(svg)])
    assert res.exit_code == 0, res.output
    assert b"<svg" in svg.read_bytes()[:1000]
    saved.write_text(json.dumps({"gpu": "Stand-in GPU", "rows": [{"op": "rms_norm", "shape": [1, 4096], "us": 9.0}]}))
    res = runner().invoke(cli.main, ["bench", "--from-json", str(saved), "--plot", str(svg)])
    assert res.exit_code == 1 and "nothing to plot" in res.output


def test_without_matplotlib_the_install_hint(tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure"):  # None in sys.modules: that import fails
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r'pip install "cunorm\[plot\]"'):
        plot.plot_bandwidth(TABLE, str(tmp_path / "bandwidth.png"))
    saved, png = tmp_path / "results.json", tmp_path / "bandwidth.png"
    saved.write_text(json.dumps(TABLE))
    monkeypatch.setattr(cli, "gpu_count", lambda: 0)
    for args in (["--from-json", str(saved)], []):  # a sweep is refused before it starts, GPU or not
        res = runner().invoke(cli.main, ["bench", *args, "--plot", str(png)])
        assert res.exit_code == 1 and 'pip install "cunorm[plot]"' in res.output and not png.exists()


def test_ops_pick_the_ops_and_directions_timed(stand_in_gpu):
    res = runner().invoke(cli.main, ["bench", "--traits", "warps_n=8", "--ops", "rms-bwd", "--ops", "fwd+residual",
                                     "--sizes", "4096", "--rounds", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert [r["op"] for r in json.loads(res.stdout)["rows"]] == ["rms_norm bwd", "layer_norm+residual fwd"]
    res = runner().invoke(cli.main, ["bench", "--ops", "fwd,layer_norm"])
    assert res.exit_code == 2 and "--ops" in res.output and "'layer_norm'" in res.output
    res = runner().invoke(cli.main, ["bench", "--ops", "fwd", "--host"])
    assert res.exit_code == 2 and "--ops" in res.output


def test_op_pairs_cover_every_name():
    assert bench.op_pairs(["bwd+residual", "delta"]) == {("layer_norm+residual", "bwd")}
    assert len(bench.op_pairs()) == 8 and {op for op, _ in bench.op_pairs()} == set(bench.NORM_OPS)


@pytest.mark.parametrize("saved", [{"rows": [{"x": 1}]}, {"rows": 5},
                                   {"rows": [{"op": "layer_norm fwd", "n": 8, "variants": {"tuned": {}}}]}])
def test_a_foreign_json_to_plot_is_a_usage_error(saved, tmp_path):
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(saved))
    res = runner().invoke(cli.main, ["bench", "--from-json", str(path), "--plot", str(tmp_path / "p.png")])
    assert res.exit_code == 2 and "--from-json" in res.output and "Traceback" not in res.output


def test_a_source_and_ops_of_the_other_direction_are_refused(tmp_path):
    from cunorm.source import _read

    path = tmp_path / "my_norm_fwd.cu"
    path.write_text(_read("norm_fwd.cu"))
    res = runner().invoke(cli.main, ["bench", "--source", str(path), "--ops", "bwd,rms-bwd"])
    assert res.exit_code == 2 and "leaves nothing to time" in res.output


def test_kernel_time_times_variants_and_the_sweep_with_the_kernel_timer(stand_in_gpu, monkeypatch):
    """--kernel-time: compare() and the bandwidth sweep take kernel_ms (here a stand-in reporting a quarter of
    the call's time), and say so in the header and the JSON."""
    monkeypatch.setattr(bench, "kernel_ms", lambda fn, repeat: fn() / 4)
    res = runner().invoke(cli.main, ["bench", "--kernel-time", "--traits", "warps_n=8", "--sizes", "1024",
                                     "--rounds", "1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["timing"] == "kernel" and "kernel time" in res.stderr
    assert out["rows"][0]["variants"]["tuned"]["us"] == pytest.approx(TUNED_MS * 1e3 / 4)
    res = runner().invoke(cli.main, ["bench", "--traits", "warps_n=8", "--sizes", "1024", "--rounds", "1", "--json"])
    assert json.loads(res.stdout)["timing"] == "api"


class _SizeArrays:
    """Stands for the arrays of one size a stand-in sweep case holds (counted alive through a WeakSet)."""


def test_sweep_rounds_report_the_median_and_spread_of_whole_sweeps(stand_in_gpu, monkeypatch):
    """--rounds K without variants runs the bandwidth sweep K times over, each size's arrays made afresh each
    round and never more than two sizes' alive, and reports each row's median [min, max]; rows are the cases
    of a round, so a size named in --sizes and among the odd sizes stays two rows."""
    alive, seen_alive, lengths = weakref.WeakSet(), [], []

    def sweep_cases(sizes, dtype, weight_dtype=None, ops=bench.PLAIN_OPS, layout="", as_array=None,
                    directions=bench.DIRECTIONS, native=False, only=None):
        for n in sizes:
            arrays = _SizeArrays()
            alive.add(arrays)
            for op in ops:
                for direction in directions:
                    if only is None or (op, direction) in only:
                        def call(arrays=arrays):
                            seen_alive.append(len(alive))
                            return TUNED_MS
                        yield bench.Case(f"{op}{' ' + layout if layout else ''} {direction}", n, 10**9, call)

    calls = itertools.count()
    reading = lambda k: 1.0 + 0.5 * (k % 7)  # noqa: E731 - the k-th timing's factor: rows differ, rounds too
    monkeypatch.setattr(bench, "kernel_ms", lambda fn, repeat: fn() * reading(next(calls)))
    monkeypatch.setattr(bench, "norm_cases", sweep_cases)
    real_progress = bench.progress
    monkeypatch.setattr(bench, "progress", lambda length, *a: lengths.append(length) or real_progress(length, *a))
    res = runner().invoke(cli.main, ["bench", "--kernel-time", "--sizes", "1024,4097", "--ops", "fwd,rms-bwd",
                                     "--rounds", "3", "--json"])
    assert res.exit_code == 0, res.output
    out, per_round = json.loads(res.stdout), 10  # (2 sizes + 1 strided + 2 odd) x 2 ops
    assert out["rounds"] == 3 and lengths == [per_round * 3] and max(seen_alive) <= 2
    assert [(r["op"], r["n"]) for r in out["rows"]].count(("layer_norm fwd", 4097)) == 2
    assert len(out["rows"]) == per_round and out["rows"][4]["op"] == "layer_norm stride+64 fwd"
    full = 10**9 / (TUNED_MS * 1e-3) / 2e12  # the stand-in's fraction at 1 ms
    for i, row in enumerate(out["rows"]):
        ms = sorted(TUNED_MS * reading(r * per_round + i) for r in range(3))
        assert row["ms"] == pytest.approx(ms[1]) and row["gbps"] == pytest.approx(10**9 / (ms[1] * 1e-3) / 1e9)
        assert (row["fraction_min"], row["fraction_of_copy"], row["fraction_max"]) == pytest.approx(
            (full / ms[2], full / ms[1], full / ms[0]))
    first = out["rows"][0]
    assert "median [min, max] of 3 rounds" in res.stderr
    assert f"{first['fraction_of_copy']:>7.3f}  [{first['fraction_min']:.3f}, {first['fraction_max']:.3f}]" in res.stderr


def test_one_sweep_round_prints_each_row_as_it_is_timed(stand_in_gpu, monkeypatch):
    """The default (one round): the old line for each row, printed before the next case is timed (here the
    second timing fails), and no spread."""
    timings = []

    def kernel_ms(fn, repeat):
        timings.append(fn)
        if len(timings) == 2:
            raise RuntimeError("planted: the second case's timing")
        return fn()

    monkeypatch.setattr(bench, "kernel_ms", kernel_ms)
    res = runner().invoke(cli.main, ["bench", "--kernel-time", "--sizes", "1024", "--ops", "fwd,bwd", "--no-extras"])
    assert isinstance(res.exception, RuntimeError)
    assert "layer_norm fwd                         1024   1.0000    1000   0.500\n" in res.stdout
    assert "[" not in res.stdout.split("of copy")[1] and "rounds" not in res.stdout
    for mode in ("--host", "--graph"):
        res = runner().invoke(cli.main, ["bench", mode, "--rounds", "2"])
        assert res.exit_code == 2 and "--rounds" in res.output

