"""Tier A: a built, non-editable install ships the kernels and finds them."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_and_finds_kernels(tmp_path):
    wheel_dir, site = tmp_path / "wheel", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheel_dir), str(ROOT)],
                   check=True)
    (wheel,) = wheel_dir.glob("cunorm-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                    str(wheel)], check=True)
    code = ("import cunorm, cunorm.source as r; "
            "t = cunorm.Traits(hidden_size=1024, backward=True, warps_n=2); "
            "src = cunorm.render(t); assert 'norm_bwd_finalize' in src; print(r.kernel_dir())")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": ""},
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_relative_to(site), out.stdout
