"""The test tiers stay what their names say: ``tests/unit`` starts no process and no Trainer (it runs in one
interpreter, in about a minute), ``tests/integration`` holds the CLI, install, bench and torchrun tests, and no
``tests/dist`` file launches torchrun."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

#: what starts a process, a process group or a Lightning training loop
IMPURE = re.compile(
    r"\bimport subprocess\b|\bsubprocess\.|\bTrainer\(|\bspawn\(|from tests\._dist import|multiprocessing|mp\.Process"
    r"|\btorchrun\b.*--"
)


def _offenders(folder: str, pattern: re.Pattern[str]) -> list[str]:
    found = []
    for path in sorted((TESTS / folder).rglob("*.py")):
        if path == Path(__file__).resolve():
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code):
                found.append(f"{path.relative_to(TESTS.parent)}:{no}: {line.strip()}")
    return found


def test_unit_tests_start_no_process_and_no_trainer() -> None:
    bad = _offenders("unit", IMPURE)
    assert not bad, "move these tests to tests/integration (or tests/dist for a parity run):\n" + "\n".join(bad)


def test_torchrun_launches_live_in_integration() -> None:
    bad = _offenders("dist", re.compile(r"[\"']torchrun[\"']|torch\.distributed\.run"))
    assert not bad, "torchrun launches belong in tests/integration:\n" + "\n".join(bad)
