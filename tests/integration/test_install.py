"""lightning-v17 installs as a library.

The wheel: built, installed into a fresh target directory, its three package roots imported from it (this catches
package-dir mistakes, strategies/ and callbacks/ must land as lightning_v17.strategies/.callbacks, that an editable
install in the source tree would hide); installed with its requirements into a fresh venv that already has torch,
where pip must keep that torch. Without the optional backends (deepspeed, bitsandbytes, torchao) the package imports
and plans, and a feature that needs one names the extra that installs it.
"""

import json
import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(sysconfig.get_paths()["purelib"])  # the dev venv's site-packages (torch, lightning, pip, ...)
OPTIONAL = {"deepspeed": "deepspeed", "bitsandbytes": "bnb", "torchao": "torchao"}  # backend -> extra, by hand


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    wheel_dir = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir),
         str(ROOT)],
        check=True,
        cwd=wheel_dir,
    )  # fmt: skip
    (whl,) = wheel_dir.glob("lightning_v17-*.whl")
    return whl


def test_wheel_installs_and_imports(tmp_path, wheel):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)], check=True
    )
    code = (
        "import lightning_v17, lightning_v17.strategies as s, lightning_v17.callbacks as c, lightning_v17.planner;"
        "print(lightning_v17.__file__); print(s.__file__); print(c.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=tmp_path, env=env, capture_output=True, text=True
    )
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


# ------------------------------------------------------------------------------------------- ranges, pins and extras
def test_optional_backends_are_extras_and_the_make_pins_lie_in_the_ranges():
    """The library states ranges; `make venv` pins (constraints.txt). Every pin must satisfy the range pyproject
    states for that package (the lower bounds are the tested versions), and the optional backends are extras only."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    extras = {e: [Requirement(r) for r in reqs] for e, reqs in project["optional-dependencies"].items()}
    assert not set(OPTIONAL) & set(deps), "deepspeed, bitsandbytes and torchao must be extras, not dependencies"
    for backend, extra in OPTIONAL.items():
        assert [r.name for r in extras[extra]] == [backend]
    assert [(r.name, r.extras) for r in extras["all"]] == [("lightning-v17", {*OPTIONAL.values(), "ft"})]
    ft = {r.name: r for r in extras["ft"]}  # torchft and its OpenTelemetry: an extra of its own, pinned as well
    ranges = {**deps, **{r.name: r for e in OPTIONAL.values() for r in extras[e]}, **ft}
    pins = [Requirement(line) for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]  # fmt: skip
    assert {p.name for p in pins} == {"torch", "lightning", *OPTIONAL, *ft}
    for pin in pins:
        (spec,) = pin.specifier
        assert spec.operator == "==", f"constraints.txt must pin exactly: {pin}"
        supported = ranges[pin.name].specifier
        assert supported.contains(spec.version), f"pyproject's {pin.name}{supported} excludes the tested {spec.version}"
        assert not supported.contains("999"), f"{pin.name}{supported} needs an upper bound"
    # the Makefile installs through the pins
    makefile = (ROOT / "Makefile").read_text()
    assert "-c constraints.txt -e '.[test,all]'" in makefile and "--no-build-isolation deepspeed" in makefile


def _fresh_venv_with_torch(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A new venv (no pip of its own) that sees the dev venv's packages, torch and lightning included, as installed:
    a .pth file puts a folder of links to them on its path. The links leave out lightning-v17's own (editable)
    install and the dev venv's .pth files, so the venv starts without lightning-v17. Returns its python and an
    environment in which pip has no index, no find-links and no config: nothing outside the venv to install from."""
    shadow = tmp_path / "shadow-site"
    shadow.mkdir()
    for entry in SITE.iterdir():
        if entry.name.startswith(("lightning_v17", "__editable__")) or entry.suffix == ".pth":
            continue
        (shadow / entry.name).symlink_to(entry)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True,
        text=True,
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "dev_site.pth").write_text(f"{shadow}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return py, env


def _pip(py: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([py, "-m", "pip", *args], env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _installed_by(report: Path) -> list[str]:
    return [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]


def test_wheel_installs_beside_the_users_torch(tmp_path, wheel):
    """pip installs lightning-v17 with its requirements (and, in a dry run, with every extra) into a venv that has
    torch 2.13 and Lightning 2.6 already, without any index to download from: it must install lightning-v17 and
    nothing else, keep that torch (version and files), and the installed package must import and plan."""
    py, env = _fresh_venv_with_torch(tmp_path)
    listed = {d["name"].lower(): d["version"] for d in json.loads(_pip(py, env, "list", "--format=json").stdout)}
    import lightning
    import torch

    assert listed["torch"] == torch.__version__ and listed["lightning"] == lightning.__version__, listed
    assert "lightning-v17" not in listed and not set(OPTIONAL) - set(listed), listed  # the backends are there too
    where = "import importlib.util; print(importlib.util.find_spec('torch').origin)"  # without importing it
    torch_file = subprocess.run([py, "-c", where], env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert torch_file == str(tmp_path / "shadow-site" / "torch" / "__init__.py")

    # every extra resolves against what is installed (the lower bounds are the tested versions)
    _pip(py, env, "install", "--no-index", "--dry-run", "-q", "--report", str(tmp_path / "all.json"), f"{wheel}[all]")
    assert _installed_by(tmp_path / "all.json") == ["lightning-v17"]
    _pip(py, env, "install", "--no-index", "-q", "--report", str(tmp_path / "install.json"), str(wheel))
    assert _installed_by(tmp_path / "install.json") == ["lightning-v17"]

    after = {d["name"].lower(): d["version"] for d in json.loads(_pip(py, env, "list", "--format=json").stdout)}
    assert after == {**listed, "lightning-v17": "0.1.0"}
    code = (
        "import lightning_v17, lightning_v17.strategies as s, torch;"
        "print(lightning_v17.__file__, s.V17Strategy.__name__, torch.__version__, torch.__file__)"
    )
    out = subprocess.run([py, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    v17_file, strategy, torch_version, torch_file_after = out.split()
    assert v17_file.startswith(str(tmp_path / "venv")) and strategy == "V17Strategy", out
    assert (torch_version, torch_file_after) == (torch.__version__, torch_file), out
    plan = subprocess.run([py.parent / "v17", "plan", "--model", "tiny"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, check=False)  # fmt: skip
    assert plan.returncode == 0 and "recommendation:" in plan.stdout, plan.stdout[-2000:] + plan.stderr[-2000:]


# -------------------------------------------------------------------------------- without the optional backends
# Hides the backends from the import system and from importlib.metadata, as if they had never been installed:
# PathFinder, the finder of everything on sys.path, is replaced by one that does not find them.
_HIDE = """
import importlib.machinery, sys

HIDDEN = {hidden!r}
_PF = importlib.machinery.PathFinder


class _WithoutBackends:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return None if name.partition(".")[0] in HIDDEN else _PF.find_spec(name, path, target)

    @staticmethod
    def find_distributions(context=None):
        from importlib.metadata import DistributionFinder

        for dist in _PF.find_distributions(context or DistributionFinder.Context()):
            if (dist.metadata["Name"] or "").lower() not in HIDDEN:
                yield dist

    @staticmethod
    def invalidate_caches():
        _PF.invalidate_caches()


sys.meta_path[:] = [_WithoutBackends if f is _PF else f for f in sys.meta_path]
"""

_WITHOUT_BACKENDS = """
import importlib.metadata, importlib.util, json, sys, warnings

HIDDEN = {hidden!r}
out = {{"found": [m for m in HIDDEN if importlib.util.find_spec(m) is not None]}}
for m in HIDDEN:
    try:
        importlib.metadata.version(m)
        out["found"].append(m + " (metadata)")
    except importlib.metadata.PackageNotFoundError:
        pass
import lightning_v17, lightning_v17.strategies, lightning_v17.callbacks, lightning_v17.optim, lightning_v17.checkpoint
import lightning_v17.engine.fp8, lightning_v17.engine.offload
import torch
from lightning_v17 import V17Strategy
from lightning_v17.optim import Adam8bit, CPUAdam, Lion

out["delayed_fp8"] = type(V17Strategy(fp8="delayed")).__name__  # ours: needs no torchao
# CPU-Adam falls back to fused AdamW, with a warning that names the extra; it must step as AdamW does
w0 = torch.linspace(-1, 1, 8)
p, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt = CPUAdam([p], lr=0.1)
out["cpu_adam"] = [opt.backend, " ".join(str(w.message) for w in caught if "CPUAdam" in str(w.message))]
ref_opt = torch.optim.AdamW([ref], lr=0.1)
for step in range(3):
    p.grad = ref.grad = torch.full((8,), float(step) - 0.5) * w0
    opt.step()
    ref_opt.step()
out["cpu_adam_matches_adamw"] = torch.equal(p, ref) and not torch.equal(p, w0)
features = {{
    "Adam8bit": lambda: Adam8bit([p]),
    "Adam8bit(backend='torchao')": lambda: Adam8bit([p], backend="torchao"),
    "Lion": lambda: Lion([p]),
    "V17Strategy(fp8='tensorwise')": lambda: V17Strategy(fp8="tensorwise"),
}}
for name, build in features.items():
    try:
        build()
        out[name] = "built"
    except ImportError as err:
        out[name] = str(err)
out["imported"] = sorted(m for m in sys.modules if m.partition(".")[0] in HIDDEN)
print(json.dumps(out))
"""


def test_without_the_optional_backends_it_imports_plans_and_names_the_extra(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_HIDE.format(hidden=set(OPTIONAL)))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    code = _WITHOUT_BACKENDS.format(hidden=set(OPTIONAL))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out.pop("found") == [], "the backends were not hidden"
    assert out.pop("imported") == []
    assert out.pop("delayed_fp8") == "V17Strategy"
    backend, warning = out.pop("cpu_adam")
    assert backend == "torch" and "pip install 'lightning-v17[deepspeed]'" in warning, warning
    assert out.pop("cpu_adam_matches_adamw") is True
    needs = {"Adam8bit": "bitsandbytes", "Adam8bit(backend='torchao')": "torchao", "Lion": "bitsandbytes",
             "V17Strategy(fp8='tensorwise')": "torchao"}  # fmt: skip
    assert set(out) == set(needs)
    for feature, backend in needs.items():
        msg = out[feature]
        assert f"needs {backend}, which is not installed" in msg and f"'lightning-v17[{OPTIONAL[backend]}]'" in msg, (
            feature, msg,
        )  # fmt: skip

    plan = subprocess.run([Path(sys.executable).parent / "v17", "plan", "--model", "tiny"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert plan.returncode == 0 and "recommendation:" in plan.stdout, plan.stdout[-2000:] + plan.stderr[-2000:]

