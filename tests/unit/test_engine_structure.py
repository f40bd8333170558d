"""Structure rules of the engine (DESIGN.md "Layout"), read from the source: the engine knows no model by name and no
Lightning; every import statement counts, including the ones inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "lightning_v17" / "engine"


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def test_engine_files_exist():
    names = {p.name for p in ENGINE.rglob("*.py")}
    assert {"parallelize.py", "zero_backend.py", "pipeline.py", "tensor_parallel.py", "zero.py"} <= names


def test_engine_imports_no_model_module_and_no_lightning():
    bad = {}
    for path in sorted(ENGINE.rglob("*.py")):
        for name in _imports(path):
            if name.startswith(("lightning_v17.models", "lightning.")) or name == "lightning":
                bad.setdefault(str(path.relative_to(ENGINE)), []).append(name)
    assert not bad, f"engine/ must import neither lightning_v17.models nor Lightning: {bad}"


def test_the_rule_sees_imports_inside_functions(tmp_path):
    # The check itself must catch a lazy import like the one engine/tensor_parallel.py once had.
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from lightning_v17.models.llama import BLOCK_TP_PLAN\n    import lightning.pytorch\n")
    assert "lightning_v17.models.llama" in _imports(f) and "lightning.pytorch" in _imports(f)
