"""The documentation as shipped: a short README, one page per feature, a benchmarks page rendered from committed
results, and no history in the product or the docs.

* ``docs/benchmarks.md`` must equal what ``bench/render.py`` makes of ``bench/results/*.json`` (rendered here to a
  string), and its plot must exist; every result names its bench, its command and its host.
* README.md, ``docs/`` (but ``docs/notes/``, which may hold history), ``lightning_v17/``, ``strategies/``,
  ``callbacks/`` and ``configs/`` name no work item ("issue 12"), no load average, no date (YYYY-MM-DD) and no
  session; the README and the docs cite no "seed §N" (a document that is not in the repo).
* Every path, link, anchor and ``lightning_v17.*`` name the README and the docs mention exists, so the pages follow
  the code when it moves; every ``V17Strategy`` argument and every policy field is listed on a docs page.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
#: the feature pages the README's table links to; each has usage, options, limits and the tests that prove it
FEATURE_PAGES = ("zero", "offload", "tensor-parallel", "pipeline", "fp8", "checkpoints", "resilience", "planner",
                 "cli-and-yaml", "own-model", "expert-parallel", "context-parallel")  # fmt: skip
PRODUCT = ("lightning_v17", "strategies", "callbacks", "configs")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".json", ".cfg", ".ini"}
HISTORY = {
    "a work item": re.compile(r"\bissues?\s*#?\s*\d+", re.IGNORECASE),
    "a load average": re.compile(r"load[ _-]?average", re.IGNORECASE),
    "a date": re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b"),
    "a session": re.compile(r"\bsessions?\b", re.IGNORECASE),
}
SEED = re.compile(r"seed\s*§", re.IGNORECASE)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"^(?:tests|bench|lightning_v17|strategies|callbacks|configs|docs)/[\w./-]*$")
DOTTED = re.compile(r"^lightning_v17(?:\.\w+)+$")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _render_module():
    spec = importlib.util.spec_from_file_location("_v17_bench_render", ROOT / "bench" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _doc_files() -> list[Path]:
    """The README and every page under docs/, notes included (for paths and links)."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def _shipped_docs() -> list[Path]:
    """The README and docs/ without docs/notes/ (for the history rules)."""
    return [p for p in _doc_files() if DOCS / "notes" not in p.parents]


def _code_tokens(path: Path) -> list[str]:
    """Whitespace-separated tokens of every inline code span, trailing punctuation stripped."""
    return [t.rstrip(".,;:)") for span in CODE_SPAN.findall(path.read_text()) for t in span.split()]


# ------------------------------------------------------------------------------------------------- benchmarks


def test_benchmarks_page_is_what_the_renderer_makes_of_the_committed_results() -> None:
    render = _render_module()
    text, panels = render.render(render.load_results(), all_benches=render.benches())
    committed = (DOCS / "benchmarks.md").read_text()
    assert committed == text, "docs/benchmarks.md is stale or edited by hand: run `python bench/render.py`"
    assert render.load_results(), "bench/results/ holds no committed result"
    assert panels, "the page has no plot of ratios against the anchors"
    png = DOCS / render.PLOT.name
    assert f"]({png.name})" in text
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, f"{png} is not the rendered plot"


def test_every_committed_result_names_its_bench_command_and_host() -> None:
    render = _render_module()
    names = set(render.benches())
    for stem, report in render.load_results().items():
        bench = render.bench_of(stem)
        assert bench in names, f"bench/results/{stem}.json: no bench/{bench}.py"
        host = report.get("host") or {}
        for key in ("command", "cpu_model", "cpu_capability", "torch"):
            assert host.get(key), f"bench/results/{stem}.json: host.{key} missing (write it with --json-out)"
        assert host["command"].startswith(f"python bench/{bench}.py"), host["command"]
        assert f"--json-out bench/results/{stem}.json" in host["command"], host["command"]


# --------------------------------------------------------------------------------------------- history and size


def _product_files() -> list[Path]:
    files = []
    for top in PRODUCT:
        files += [p for p in sorted((ROOT / top).rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES
                  and "__pycache__" not in p.parts]  # fmt: skip
    return files


def test_no_history_in_the_product_or_the_docs() -> None:
    found = []
    for path in [*_shipped_docs(), *_product_files()]:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for what, pattern in HISTORY.items():
                for m in pattern.finditer(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {what} ({m.group(0)!r})")
            if path.suffix == ".md" and SEED.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: a 'seed §' citation (cite the paper or upstream issue)")
    assert not found, "the product and its docs describe it as it is; history goes to commit messages:\n" + "\n".join(
        found
    )


def test_the_readme_is_a_short_user_guide() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for needed in ("pip install -e '.[all]'", "torch==2.13.0", "--no-build-isolation", "make run", "make test"):
        assert needed in text, needed
    for page in (*FEATURE_PAGES, "benchmarks", "lightning-compat"):  # the last two are generated
        assert f"(docs/{page}.md" in text, f"README does not link docs/{page}.md"


@pytest.mark.parametrize("page", FEATURE_PAGES)
def test_each_feature_page_has_usage_options_limits_and_tests(page: str) -> None:
    text = (DOCS / f"{page}.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    for section in ("Usage", "Options", "Limits", "Tests"):
        assert any(h[3:].startswith(section) for h in headings), f"docs/{page}.md has no '## {section}' section"
    tests = text.split("\n## Tests", 1)[1]
    assert re.search(r"`tests/\w+/[\w/]*", tests), f"docs/{page}.md names no test file"


# ---------------------------------------------------------------------------------- references that must exist


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


@cache
def _anchors(path: Path) -> frozenset[str]:
    return frozenset(_slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#"))


def test_every_path_and_link_in_the_docs_exists() -> None:
    missing = []
    for doc in _doc_files():
        for token in _code_tokens(doc):
            if REPO_PATH.match(token) and not (ROOT / token).exists():
                missing.append(f"{doc.relative_to(ROOT)}: `{token}`")
        for target in LINK.findall(doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                missing.append(f"{doc.relative_to(ROOT)}: link ({target})")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                missing.append(f"{doc.relative_to(ROOT)}: anchor ({target})")
    assert not missing, "the docs name things that do not exist:\n" + "\n".join(missing)


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_lightning_v17_name_in_the_docs_imports() -> None:
    names = sorted({t for doc in _doc_files() for t in _code_tokens(doc) if DOTTED.match(t)})
    assert names
    broken = []
    for name in names:
        try:
            _resolve(name)
        except (ImportError, AttributeError) as err:
            broken.append(f"{name}: {err}")
    assert not broken, "\n".join(broken)


def _table_cells(column: int | None) -> set[str]:
    """Backticked identifiers in the given column (None: any column) of the docs' tables."""
    names: set[str] = set()
    for doc in _doc_files():
        for line in doc.read_text().splitlines():
            if not line.startswith("|"):
                continue
            cells = line.strip().strip("|").split("|")
            for cell in cells if column is None else cells[column : column + 1]:
                names |= set(re.findall(r"`(\w+)`", cell))
    return names


def test_every_strategy_argument_and_policy_field_is_listed_on_a_docs_page() -> None:
    from lightning_v17.strategies import V17Strategy

    from lightning_v17 import config

    first_column = _table_cells(0)
    arguments = [n for n in inspect.signature(V17Strategy.__init__).parameters if n != "self"]
    unlisted = [f"V17Strategy({n}=)" for n in arguments if n not in first_column]
    any_column = _table_cells(None)
    for policy in (config.MeshSpec, config.ZeroPolicy, config.OffloadPolicy, config.PipelinePolicy,
                   config.TPPolicy, config.FP8Policy, config.LossScalePolicy):  # fmt: skip
        unlisted += [f"{policy.__name__}.{f.name}" for f in dataclasses.fields(policy) if f.name not in any_column]
    assert not unlisted, "options no docs page lists (one line each, in an options table):\n" + "\n".join(unlisted)

