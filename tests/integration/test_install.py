"""Build the wheel, install it into a fresh target directory, and import the three package roots from it.

This catches package-dir mistakes (strategies/ and callbacks/ must land as lightning_v17.strategies/.callbacks)
that an editable install in the source tree would hide.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_installs_and_imports(tmp_path):
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir), str(ROOT)],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = wheel_dir.glob("lightning_v17-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)], check=True
    )
    code = (
        "import lightning_v17, lightning_v17.strategies as s, lightning_v17.callbacks as c, lightning_v17.planner;"
        "print(lightning_v17.__file__); print(s.__file__); print(c.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=env, capture_output=True, text=True)
    files = out.stdout.split()
    assert len(files) == 3
    for f in files:  # every root comes from the installed wheel, not from the source tree
        assert f.startswith(str(target)), f
    assert files[1].endswith("lightning_v17/strategies/__init__.py")
    assert files[2].endswith("lightning_v17/callbacks/__init__.py")


def test_folders_refuse_other_import_names():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("strategies", "callbacks"):
        r = subprocess.run(
            [sys.executable, "-c", f"import {name}"], cwd=ROOT, env=env, capture_output=True, text=True, check=False
        )
        assert r.returncode != 0 and f"lightning_v17.{name}" in r.stderr


def test_every_subpackage_is_listed_in_pyproject():
    """setuptools' explicit package list must name every folder with an __init__.py (else the wheel lacks it)."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(cfg["packages"]), cfg["package-dir"]
    found = set()
    for pkg, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts:
                continue
            found.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    # a sub-folder mapped by its own package-dir entry is found twice (once under its parent); that is fine
    assert found - listed == set(), f"add these to [tool.setuptools] packages in pyproject.toml: {found - listed}"


def test_make_test_collects_the_distributed_tests():
    """pytest's default norecursedirs contains "dist"; pyproject overrides it so tests/dist runs in `make test`.
    Collected from ``tests`` as `make test` does, with one file name as the test-file pattern: the recursion into
    tests/dist is what is checked, without importing every test module (``-o norecursedirs=dist`` fails it)."""
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "tests", "-o", "python_files=test_zero_parity.py"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    assert "tests/dist/test_zero_parity.py" in r.stdout, r.stdout[-2000:]
