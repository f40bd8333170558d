"""Structure rules of the package (DESIGN.md "Layout"), read from the source: one folder per axis once an axis has
several files; no import cycle anywhere in the package; the engine knows no Lightning, no model family and no
checkpoint code; the ZeRO stage is decided in one place. Every import statement counts, including the ones inside
functions (only ``if TYPE_CHECKING:`` blocks, which never run, are left out)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "lightning_v17"
ENGINE = PKG / "engine"
#: installed as lightning_v17.strategies / lightning_v17.callbacks (pyproject's package-dir)
MAPPED = {"strategies": "lightning_v17.strategies", "callbacks": "lightning_v17.callbacks"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in MAPPED:
        parts = MAPPED[parts[0]].split(".") + parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = [*PKG.rglob("*.py"), *(ROOT / "strategies").rglob("*.py"), *(ROOT / "callbacks").rglob("*.py")]
    return {_module_name(p): p for p in files}


def _runtime_nodes(tree: ast.AST):
    """Every node except those inside ``if TYPE_CHECKING:`` (imports for annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _imports(path: Path) -> list[str]:
    out = []
    for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def _graph() -> dict[str, set[str]]:
    """module -> the package modules it imports; ``from pkg import submodule`` is an edge to the submodule only."""
    mods = _sources()
    graph = {}
    for name, path in mods.items():
        edges = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if sub in mods:
                        edges.add(sub)
                    elif node.module in mods:
                        edges.add(node.module)
        graph[name] = edges - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_one_folder_per_axis():
    for folder in ("zero", "offload", "tp", "pipeline", "fp8", "precision"):
        assert (ENGINE / folder / "__init__.py").is_file(), folder
    for folder in ("checkpoint", "resilience", "trackers", "config"):
        assert (PKG / folder / "__init__.py").is_file(), folder
    for name in ("errors", "enums", "mesh_spec", "policies", "fp8", "deepspeed", "schedules", "rules"):
        assert (PKG / "config" / f"{name}.py").is_file(), name
    flat = sorted(p.name for p in ENGINE.glob("*.py"))
    assert flat == ["__init__.py", "_dtensor.py", "collectives.py", "loss_norm.py", "parallelize.py", "recompute.py", "state.py"], flat
    assert not (PKG / "config.py").exists() and not (ENGINE / "trackers").exists()


def test_precision_holds_clipping_the_loss_scaler_and_the_dtypes():
    assert sorted(p.stem for p in (ENGINE / "precision").glob("*.py")) == ["__init__", "clip", "dtypes", "loss_scale"]


def test_no_product_file_past_600_lines():
    """The house style's file size (one concern per file, about 150-600 lines)."""
    files = [*PKG.rglob("*.py"), *(PKG.parent / "strategies").rglob("*.py"), *(PKG.parent / "callbacks").rglob("*.py")]
    long = {str(p.relative_to(PKG.parent)): n for p in files if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"split these files (one concern each): {long}"


def test_no_import_cycle_in_the_package():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles (imports inside functions included): {cycles}"


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import lightning_v17.b\n")
    b.write_text("def f():\n    from lightning_v17 import a\n")
    graph = {"lightning_v17.a": {"lightning_v17.b"}, "lightning_v17.b": set()}
    graph["lightning_v17.b"] = {i for i in _imports(b) if i in graph}  # the import inside f() is seen
    assert _cycles(graph) == [["lightning_v17.a", "lightning_v17.b"]]


def test_engine_imports_no_lightning_no_model_and_no_checkpoint():
    bad = {}
    for path in sorted(ENGINE.rglob("*.py")):
        for name in _imports(path):
            if name.startswith(("lightning_v17.models", "lightning_v17.checkpoint", "lightning.")) or name == "lightning":
                bad.setdefault(str(path.relative_to(ENGINE)), []).append(name)
    assert not bad, f"engine/ must import neither Lightning, lightning_v17.models nor lightning_v17.checkpoint: {bad}"


def test_the_rule_sees_imports_inside_functions(tmp_path):
    # The check itself must catch a lazy import like the one engine/tensor_parallel.py once had.
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from lightning_v17.models.llama import BLOCK_TP_PLAN\n    import lightning.pytorch\n")
    assert "lightning_v17.models.llama" in _imports(f) and "lightning.pytorch" in _imports(f)


#: a ZeRO-stage comparison: ``zero_stage == 3``, ``policy.zero.stage >= 2``, ``stage in (1, 2)``, ``stage != 3``
ZERO_STAGE_TEST = re.compile(
    r"\b(zero_stage|zero\.stage)\s*(==|!=|>=|<=|>|<|in\b|not in\b)|(?<!for )\bstage\s*(==|!=|>=|<=|in|not in)\s*\(?\s*[0-3]\b"
)


def test_the_zero_stage_is_decided_in_one_place():
    """Outside config/ and engine/zero/ nothing re-decides what a ZeRO stage means: ask ZeroPolicy/ZeroBackend."""
    found = []
    for folder in (PKG, ROOT / "strategies", ROOT / "callbacks"):
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(("lightning_v17/config/", "lightning_v17/engine/zero/")):
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if ZERO_STAGE_TEST.search(code) and not code.strip().startswith(("f\"", "\"", "'")):
                    found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "ZeRO-stage tests outside config/ and engine/zero/:\n" + "\n".join(found)


def test_the_stage_rule_catches_what_it_names():
    for code in ("if zero_stage == 3:", "x = policy.zero.stage >= 2", "if stage in (1, 2):", "stage != 3"):
        assert ZERO_STAGE_TEST.search(code), code
    for code in ("if stage == 'fit':", "return x if stage > 0 else None", "for stage in stages:"):
        assert not ZERO_STAGE_TEST.search(code), code
