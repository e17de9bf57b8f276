"""Tier A: per-GPU tuned tables (cunorm.tables) and how dispatch, explain and
`cunorm list` use them, with a stand-in GPU model."""
import json
import warnings

import pytest
from click.testing import CliRunner

import cunorm
from cunorm import cli, dispatch, tables
from cunorm.tables import GPU, Key, Table

H200 = GPU("NVIDIA H200", 90, 132)
CALL = dict(hidden_size=4096, input_dtype="bfloat16", weight_dtype="bfloat16", output_dtype="bfloat16")
KNOBS = dict(warps_m=1, warps_n=2, ctas_per_row=1, bytes_per_ldg=16, stages=1, cache_weights=True,
             min_ctas_per_sm=1)


REAL_SHIPPED_DIR = tables.SHIPPED_DIR


@pytest.fixture(autouse=True)
def literal_entry(monkeypatch):
    """A forward entry of the sm_90 literal at CALL's size (the shipped literal leaves plain forwards of such
    sizes to the heuristic's unstaged grid): the tests below are about which table wins, not its contents."""
    monkeypatch.setitem(dispatch.TUNED, (False, 4096, 2), (4, 4, 1, 8, 2, 1, 1, 0))


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """A fresh user cache folder, and no shipped tables (the tests below plant their own)."""
    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(tables, "SHIPPED_DIR", tmp_path / "no-shipped-tables")
    tables.forget()
    yield tmp_path
    tables.forget()


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """An empty folder of shipped tables, in place of cunorm/shipped_tables."""
    folder = tmp_path / "shipped"
    folder.mkdir()
    monkeypatch.setattr(tables, "SHIPPED_DIR", folder)
    return folder


def _save(entries: dict, gpu=H200) -> Table:
    t = Table(gpu, cunorm.__version__, 12080, {})
    for key, knobs in entries.items():
        t.put(key, knobs, ms=0.1, fraction_of_copy=0.9, spread=[0.89, 0.91])
    tables.save(t)
    return t


def test_a_user_table_entry_wins_over_the_literal_for_its_gpu_only():
    _save({Key(False, False, False, 4096, 2): KNOBS})
    t, origin = dispatch.choose(arch=90, gpu=H200, **CALL)
    assert origin.startswith("user table") and str(tables.user_path(H200)) in origin
    assert (t.warps_n, t.stages) == (2, 1)
    assert dispatch.choose(arch=90, gpu=GPU("NVIDIA H100 80GB HBM3", 90, 132), **CALL)[1] == "tuned"
    assert dispatch.choose(arch=90, **CALL)[1] == "tuned"


def test_keys_separate_rmsnorm_residual_direction_and_width():
    _save({Key(False, True, True, 4096, 2): KNOBS})
    assert dispatch.choose(arch=90, gpu=H200, rms=True, has_bias=False, has_residual=True, residual_dtype="bfloat16",
                           **CALL)[1].startswith("user table")
    assert dispatch.choose(arch=90, gpu=H200, rms=True, has_bias=False, **CALL)[1] == "tuned"
    assert dispatch.choose(arch=90, gpu=H200, **CALL)[1] == "tuned"
    fp32 = {**CALL, "input_dtype": "float32", "weight_dtype": "float32", "output_dtype": "float32"}
    assert dispatch.choose(arch=90, gpu=H200, rms=True, has_bias=False, has_residual=True, residual_dtype="float32",
                           **fp32)[1] == "heuristic"


def test_general_rows_take_their_aligned_neighbours_entry():
    _save({Key(True, False, False, 2048, 2): {**KNOBS, "bytes_per_ldg": 16}})
    t, origin = dispatch.choose(arch=90, gpu=H200, backward=True, **{**CALL, "hidden_size": 2049})
    assert origin.startswith("user table") and not t.aligned_rows


def test_general_rows_prefer_a_general_entry_of_any_source_to_an_aligned_one():
    """At 4097 the literal's general-rows entry (measured at 4097) wins over a table's aligned 4096 entry; a
    table's own general entry wins over both."""
    assert (True, 4096, 2) in dispatch.TUNED_GENERAL
    _save({Key(True, False, False, 4096, 2): {**KNOBS, "bytes_per_ldg": 16}})
    general = {**CALL, "hidden_size": 4097}
    assert dispatch.choose(arch=90, gpu=H200, backward=True, **general)[1] == dispatch.TUNED_LITERAL
    assert dispatch.choose(arch=90, gpu=H200, backward=True, **CALL)[1].startswith("user table")
    tables.forget()
    _save({Key(True, False, False, 4096, 2, True): {**KNOBS, "bytes_per_ldg": 8}})
    t, origin = dispatch.choose(arch=90, gpu=H200, backward=True, **general)
    assert origin.startswith("user table") and t.bytes_per_ldg == 8 and not t.aligned_rows


def test_an_entry_illegal_for_the_call_falls_through():
    _save({Key(False, False, False, 4096, 2): {**KNOBS, "warps_n": 32, "warps_m": 2}})  # 2048 threads
    assert dispatch.choose(arch=90, gpu=H200, **CALL)[1] == "tuned"


@pytest.mark.parametrize("spoil", ["version", "gpu", "corrupt"])
def test_an_unusable_user_table_is_ignored_with_one_warning(spoil):
    _save({Key(False, False, False, 4096, 2): KNOBS})
    path = tables.user_path(H200)
    raw = json.loads(path.read_text())
    if spoil == "version":
        raw["cunorm"] = "0.0.1"
        path.write_text(json.dumps(raw))
    elif spoil == "gpu":
        raw["gpu"]["sms"] = 114
        path.write_text(json.dumps(raw))
    else:
        path.write_text("{not json")
    tables.forget()
    with pytest.warns(RuntimeWarning, match="ignoring the tuned table"):
        assert dispatch.choose(arch=90, gpu=H200, **CALL)[1] == "tuned"
    tables.forget()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per file and process
        assert dispatch.choose(arch=90, gpu=H200, **CALL)[1] == "tuned"


@pytest.mark.parametrize("other", [dict(hidden_size=8193), dict(weight_dtype="float32"),
                                   dict(output_dtype="float8_e4m3fn", quant="row"), dict(dropout=True)],
                         ids=["general rows", "fp32 weights", "fp8 row scaling", "dropout"])
def test_an_unstaged_entry_serves_only_the_kind_of_call_it_was_measured_on(other):
    """A measured unstaged grid (plain aligned rows, weights as wide as x) does not serve general rows, wider
    weights, fp8 scaling or a branch: such picks ran slower or spilled (and then took the heuristic's)."""
    _save({Key(False, False, False, 8192, 2): {**KNOBS, "warps_n": 8, "persistent": False, "stages": 1}})
    plain = {**CALL, "hidden_size": 8192}
    assert dispatch.choose(arch=90, gpu=H200, **plain)[1].startswith("user table")
    t, origin = dispatch.choose(arch=90, gpu=H200, **{**plain, **other})
    assert not origin.startswith("user table")


def test_a_literal_pick_saved_as_an_entry_reads_back():
    """The sm_90 literal writes its flags as 0 and 1; a tuner run whose winner is the literal's pick saves that
    pick's knobs(), and a table reads flags as true or false only (such a user table was ignored)."""
    t, origin = dispatch.choose(arch=90, backward=True, **{**CALL, "hidden_size": 32768})
    assert origin == dispatch.TUNED_LITERAL
    assert all(type(t.knobs()[k]) is bool for k, v in tables.KNOB_DEFAULTS.items() if type(v) is bool)
    saved = _save({Key(True, False, False, 32768, 2): t.knobs()})
    assert tables.read(tables.user_path(H200), H200, "x").entries == saved.entries


def test_a_run_merges_into_a_table_key_by_key():
    a, b, c = (Key(True, False, False, n, 2) for n in (1024, 2048, 4096))
    target = Table(H200, cunorm.__version__, 12000, {a: {"knobs": KNOBS}, b: {"knobs": KNOBS}})
    run = Table(H200, cunorm.__version__, 13020, {b: {"knobs": {**KNOBS, "warps_n": 4}}, c: {"knobs": KNOBS}})
    target.merge(run, kept={c})  # b measured, not kept: dispatch without it was as fast
    assert target.entries == {a: {"knobs": KNOBS}, c: {"knobs": KNOBS}} and target.cuda == 13020
    with pytest.raises(tables.TableError, match="cunorm 0.0.9"):
        target.merge(Table(H200, "0.0.9", 13020, {}), kept=set())


def test_a_table_round_trips_and_refuses_unknown_knobs():
    t = _save({Key(True, True, False, 8192, 4, True): KNOBS})
    back = tables.read(tables.user_path(H200), H200, "x")
    assert back.entries == t.entries and back.gpu == H200
    bad = json.loads(t.to_json())
    bad["entries"][0]["knobs"]["warp_n"] = 4
    with pytest.raises(tables.TableError, match="knobs"):
        Table.from_json(json.dumps(bad))


def test_a_shipped_table_serves_its_model_after_the_users(shipped):
    t = Table(H200, cunorm.__version__, 12080, {})
    t.put(Key(False, False, False, 4096, 2), {**KNOBS, "warps_n": 4})
    (shipped / f"tuned-{H200.slug()}.json").write_text(t.to_json())
    tables.forget()
    t, origin = dispatch.choose(arch=90, gpu=H200, **CALL)
    assert origin == "shipped NVIDIA H200 table" and t.warps_n == 4
    _save({Key(False, False, False, 4096, 2): KNOBS})
    assert dispatch.choose(arch=90, gpu=H200, **CALL)[1].startswith("user table")


def test_list_names_where_each_entry_came_from(monkeypatch):
    _save({Key(False, False, False, 4096, 2): KNOBS})
    monkeypatch.setattr(cli, "_gpu_of_arch", lambda arch: H200)
    out = json.loads(CliRunner().invoke(cli.main, ["list", "--json"]).stdout)
    assert out["gpu"]["name"] == "NVIDIA H200" and out["tables"][0].startswith("user table")
    sources = {(r["hidden_size"], r["dtype"], r["op"]): r["source"] for r in out["rows"]}
    assert sources[(4096, "bfloat16", "fwd")].startswith("user table")
    assert sources[(4096, "float16", "fwd")].startswith("user table")  # keyed by element bytes
    assert sources[(4096, "bfloat16", "bwd")] == "tuned" and sources[(4096, "float32", "fwd")] == "heuristic"
    text = CliRunner().invoke(cli.main, ["list"]).output
    assert "NVIDIA H200" in text and "user table" in text.splitlines()[0]


@pytest.mark.parametrize("field, value", [("knobs.warps_n", "4"), ("knobs.warps_n", 4.0), ("knobs.cache_weights", "false"),
                                          ("knobs.cache_weights", 1), ("n", "4096"), ("general", "yes"),
                                          ("input_bytes", -2)])
def test_a_table_with_a_value_of_the_wrong_type_is_refused(field, value):
    t = Table(H200, cunorm.__version__, 12080, {})
    t.put(Key(False, False, False, 4096, 2), KNOBS)
    raw = json.loads(t.to_json())
    entry = raw["entries"][0]
    if field.startswith("knobs."):
        entry["knobs"][field.split(".")[1]] = value
    else:
        entry[field] = value
    with pytest.raises(tables.TableError, match="must be"):
        Table.from_json(json.dumps(raw))


def test_an_unusable_shipped_table_is_skipped_with_a_warning_not_an_error(shipped):
    """A cunorm upgrade must not turn a shipped table of the previous version into a failure of every call."""
    t = Table(H200, "0.0.9", 12080, {})
    t.put(Key(False, False, False, 4096, 2), {**KNOBS, "warps_n": 4})
    (shipped / f"tuned-{H200.slug()}.json").write_text(t.to_json())
    tables.forget()
    with pytest.warns(RuntimeWarning, match="measured with cunorm 0.0.9"):
        assert dispatch.choose(arch=90, gpu=H200, **CALL)[1] == "tuned"


def test_saving_a_table_replans_calls_already_planned():
    from cunorm import plan

    from cunorm.norm.plans import Family

    plan.CALLS["stand-in"] = object()
    plan.choose_traits(Family, tuple(sorted(CALL.items())), 90, None, H200)
    assert plan.choose_traits.cache_info().currsize >= 1
    _save({Key(False, False, False, 4096, 2): KNOBS})
    assert "stand-in" not in plan.CALLS and plan.choose_traits.cache_info().currsize == 0


def test_no_home_folder_means_no_user_table_not_a_failure(monkeypatch):
    from pathlib import Path

    monkeypatch.delenv(tables.ENV_DIR, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(RuntimeError("no home"))))
    tables.forget()
    assert dispatch.choose(arch=90, gpu=H200, **CALL)[1] == "tuned"


@pytest.mark.parametrize("path", sorted(REAL_SHIPPED_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_table_is_usable_and_every_entry_legal(path, monkeypatch):
    """The tables in cunorm/shipped_tables: named for their GPU, read by this cunorm version, and every entry's
    knobs legal for the contiguous call of its key (dispatch would otherwise skip it silently)."""
    from cunorm.search_space import Job

    raw = Table.from_json(path.read_text(), "shipped")
    assert path.name == f"tuned-{raw.gpu.slug()}.json"
    monkeypatch.setattr(tables, "SHIPPED_DIR", REAL_SHIPPED_DIR)
    tables.forget()
    table = tables.read(path, raw.gpu, "shipped")
    assert table.entries
    for key, entry in table.entries.items():
        job = Job.of(entry["measured_n"], entry["dtype"], key.backward, key.rms, key.residual)
        assert job.key == key
        traits, origin = dispatch.choose(arch=raw.gpu.cc, gpu=raw.gpu, **job.call_fields())
        assert origin == f"shipped {raw.gpu.name} table" and traits.knobs() == {**traits.knobs(), **entry["knobs"]}
