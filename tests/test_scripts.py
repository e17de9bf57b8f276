"""Tier A: the GPU tier's scripts parse their arguments and list their work without a GPU."""
import pytest
from conftest import load_script as _script


def test_the_sanitizer_sweep_covers_every_op_at_few_rows_and_parses_its_shard():
    from cunorm import check

    pytest.importorskip("cupy", reason="the sweep imports CuPy at its top (to turn the pool off first)")
    sweep = _script("sanitize_sweep")
    cases = sweep.sweep_cases(rows=3)
    assert len(cases) == len(set(cases)) > 1000 and {c.rows for c in cases if not c.heads} == {3}
    # Per-head cases at the fewest whole [2, rows / (2 heads), heads] blocks: each has a leading shape.
    assert all(c.rows == 2 * c.heads and c.lead == (2, 1, c.heads) for c in cases if c.heads)
    assert {c.op for c in cases} == set(check.OPS)
    assert any(c.layout for c in cases) and any(c.hidden_size % 8 for c in cases)  # the general kernel too
    assert sweep.shard("1/4") == (1, 4)
    for bad in ("4/4", "x", "1/0", "-1/2"):
        with pytest.raises(Exception, match="expected"):
            sweep.shard(bad)


@pytest.mark.nvrtc
def test_the_codegen_digest_is_stable_and_tells_variants_apart():
    from cunorm import Traits

    digest = _script("codegen_digest")
    t = Traits(hidden_size=1024, input_dtype="bfloat16", warps_n=4)
    first = digest.digest(t, 90)
    assert len(first) == 16 and first == digest.digest(t, 90)
    assert first != digest.digest(t.replace(stages=3), 90) and first != digest.digest(t, 80)
    from cunorm import compile_only

    cubin = compile_only(t, 90).cubin
    code = digest.text_sections(cubin)  # the machine code alone, not the symbol tables
    assert code.startswith(b".text.norm_fwd") and 0 < len(code) < len(cubin)


def test_the_tier_shards_keep_each_test_function_whole_and_count_what_ran():
    shards = _script("pytest_shards")
    ids = [f"tests/t.py::f{i}[{j}]" for i in range(7) for j in range(i + 1)] + ["tests/t.py::plain"]
    dealt = shards.deal(ids, 3)
    assert sorted(sum(dealt, [])) == sorted(ids) and len(dealt) == 3
    owner = {shards.function_of(node): k for k, shard in enumerate(dealt) for node in shard}
    assert all(owner[shards.function_of(node)] == k for k, shard in enumerate(dealt) for node in shard)
    assert max(map(len, dealt)) - min(map(len, dealt)) <= 7  # within the largest function's size
    assert shards.deal(ids[:2], 4) == [[ids[0]], [ids[1]]]  # no empty shards
    assert shards.ran("..s.F\n2 passed, 1 skipped, 1 failed in 3.2s\n") == 4
    assert shards.ran("1 failed, 3 passed, 2 errors in 1.0s (0:00:01)") == 6
    assert shards.ran("collection interrupted") == 0


def test_the_tier_shards_run_big_memory_tests_alone_after_the_others(tmp_path, monkeypatch, capsys):
    """Tests marked big_memory are left out of the shards and run in one process after them; every
    collected test is counted, and a failure anywhere fails the run."""
    shards = _script("pytest_shards")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: g\n    big_memory: b\n")
    (tmp_path / "test_t.py").write_text(
        "import pathlib\nimport pytest\n"
        "pytestmark = pytest.mark.gpu\n"
        "def test_a(): pass\n"
        "def test_b(): pass\n"
        "@pytest.mark.big_memory\n"
        "def test_big():\n"
        "    # the others are done: their processes have written their logs\n"
        "    out = pathlib.Path(__file__).parent / 'out'\n"
        "    assert all('passed' in p.read_text() for p in out.glob('tests-shard*.txt'))\n")
    monkeypatch.chdir(tmp_path)
    assert shards.main(["--shards", "2", "--out", "out", "--paths", "."]) == 0
    printed = capsys.readouterr().out
    assert "3 collected, 3 ran in 2 shards and 1 alone" in printed
    assert "test_big" not in "".join(p.read_text() for p in (tmp_path / "out").glob("tests-shard*.ids"))
    assert "1 passed" in (tmp_path / "out" / "tests-alone.txt").read_text()
    (tmp_path / "test_t.py").write_text((tmp_path / "test_t.py").read_text().replace(
        "def test_big():", "def test_big():\n    assert False"))
    assert shards.main(["--shards", "2", "--out", "out", "--paths", "."]) != 0
    assert "  FAILED test_t.py::test_big" in capsys.readouterr().out  # the failure named in the output itself


def test_the_ncu_source_page_summary_counts_opcodes_stalls_and_excess_per_kernel(tmp_path, capsys):
    sass = _script("ncu_sass")
    head = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
            '"L2 Theoretical Sectors Global","L2 Theoretical Sectors Global Ideal",'
            '"L2 Theoretical Sectors Global Excessive","stall_long_sb","stall_wait","stall_wait (Not Issued)"')
    first = [head,
             '"0x10","@!P0  LDG.E.U16.CONSTANT R1, desc[UR6][R2.64]","5","1,000","160","40","120","4","1","9"',
             '"0x20","      STG.E.128 desc[UR6][R4.64], R8","1","1000","16","16","0","0","1","9"',
             '"0x30","@P1   FADD.FTZ R1, R2, R3","2","3000","0","0","0","0","2","9"',
             '"0x40","      FADD R1, R2, R3","0","1000","0","0","0","0","0","9"']
    second = [head, '"0x50","      EXIT","0","7","0","0","0","0","0","0"']
    text = '"Kernel Name","norm_fwd",\n' + "\n".join(first) + '\n"Kernel Name","norm_bwd",\n' + "\n".join(second)
    kernels = sass.kernels(text)
    assert [name for name, _ in kernels] == ["norm_fwd", "norm_bwd"] and len(kernels[0][1]) == 4
    s = sass.summary(kernels[0][1])
    assert s["by_opcode"] == {"LDG": 1000, "STG": 1000, "FADD": 4000}  # predicates and modifiers dropped
    assert s["stall_shares"] == {"long_sb": 0.5, "wait": 0.5}  # the "Not Issued" columns left out
    assert s["sectors"] == (176, 56, 120)
    assert [r["Address"] for r in sass.top(kernels[0][1], sass.EXCESS, 5)] == ["0x10"]  # none-excess rows left out
    path = tmp_path / "rep.csv"
    path.write_text(text)
    sass.main([str(path), "--rows", "100,7"])
    out = capsys.readouterr().out
    assert "warp instructions executed a row (100 rows)" in out and "FADD                 40" in out
    assert "total                60" in out and "excessive sectors" in out and "EXIT" in out
    (tmp_path / "empty.csv").write_text("not a report\n")
    for argv in ([str(tmp_path / "empty.csv")], [str(path), "--rows", "0"]):
        with pytest.raises(SystemExit):
            sass.main(argv)
