"""``docs/layouts.md`` against what ``docs/gen_layouts.py`` makes of the tests' ``COMPOSES``/``PUBLISHED`` constants
and the composition rules, and the generator's own judgement on hand-made declarations and rules; nothing is spawned
and no test module is imported."""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path

import pytest

from lightning_v17.config.rules import RULES, Rule

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    name = "_v17_gen_layouts"
    if name not in sys.modules:  # dataclasses look their module up while the class is built
        spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "gen_layouts.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


gen = _generator()


def _rule(name: str, options: tuple[str, ...], violated) -> Rule:
    return Rule(name=name, options=options, violated=violated, message=lambda lay: f"{name} says no", fix="do not")


def _declared(**pairs: tuple[str, ...]):
    """``Declared`` from ``a__b=("tests/x.py",)``."""
    return gen.Declared({frozenset(k.split("__")): v for k, v in pairs.items()}, {})


@cache
def _page() -> str:
    return gen.render(gen.read_declarations(gen.test_files()), RULES)


def test_page_is_what_the_generator_writes() -> None:
    assert gen.PAGE.read_text() == _page(), f"docs/layouts.md is stale or edited by hand: run `{gen.REGENERATE}`"


def test_check_fails_on_a_page_edited_by_hand(tmp_path, monkeypatch, capsys) -> None:
    page = tmp_path / "layouts.md"
    monkeypatch.setattr(gen, "PAGE", page)
    monkeypatch.setattr(gen, "render", lambda *_: _page())  # rendered once, above
    assert gen.main(["--check"]) == 1  # missing
    assert gen.main([]) == 0
    assert gen.main(["--check"]) == 0
    page.write_text(page.read_text().replace("| ✓ |", "| ✗ |", 1))
    assert gen.main(["--check"]) == 1
    assert "docs/layouts.md differs" in capsys.readouterr().out


def test_declarations_are_parsed_never_imported(tmp_path) -> None:
    test = tmp_path / "tests" / "dist" / "test_x.py"
    test.parent.mkdir(parents=True)
    test.write_text('raise SystemExit("imported")\n#: doc\nCOMPOSES = (("pp", "zero3", "ep"), ["cp", "tp"])\n'
                    'PUBLISHED = {"a run": "pp2 x ep2"}\n')  # fmt: skip
    (tmp_path / "tests" / "test_none.py").write_text("X = 1\n")
    got = gen.read_declarations(gen.test_files(tmp_path), root=tmp_path)
    want = {frozenset(p) for p in (("pp", "zero3"), ("pp", "ep"), ("zero3", "ep"), ("cp", "tp"))}
    assert set(got.checks) == want
    assert all(files == ("tests/dist/test_x.py",) for files in got.checks.values())
    assert got.published == {"a run": ("pp2 x ep2", "tests/dist/test_x.py")}


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ('COMPOSES = (("pp", "zero4"),)', r"zero4.*not in the vocabulary"),
        ('COMPOSES = (("pp",),)', "two or more distinct keys"),
        ('COMPOSES = (("pp", "pp"),)', "two or more distinct keys"),
        ('COMPOSES = ("pp", "cp")', "two or more distinct keys"),
        ("COMPOSES = tuple(KEYS)", "must be a literal"),
        ('PUBLISHED = {"a": 2}', "PUBLISHED must be a dict"),
    ],
)
def test_malformed_declarations_are_refused_with_the_file_and_line(tmp_path, source: str, error: str) -> None:
    test = tmp_path / "tests" / "test_bad.py"
    test.parent.mkdir()
    test.write_text(f'"""doc"""\n{source}\n')
    with pytest.raises(ValueError, match=error) as err:
        gen.read_declarations([test], root=tmp_path)
    assert str(err.value).startswith("tests/test_bad.py:2:"), err.value


def test_a_pair_both_refused_and_declared_stops_the_generator() -> None:
    no_lp = _rule("lp_without_pp", ("pp", "TPPolicy.loss_parallel"),
                  lambda lay: lay.pp > 1 and lay.policy.tensor_parallel.loss_parallel)  # fmt: skip
    cells = gen.matrix(_declared(), [no_lp])
    assert cells[frozenset(("pp", "loss_parallel"))].symbol == "✗"
    with pytest.raises(ValueError, match=r"\('pp', 'loss_parallel'\) is refused by lp_without_pp.*tests/x.py"):
        gen.matrix(_declared(pp__loss_parallel=("tests/x.py",)), [no_lp])


def test_a_rule_refusing_some_values_says_which_and_leaves_the_rest_testable() -> None:
    rowwise = _rule("rowwise_without_pp", ("fp8", "pp"),
                    lambda lay: lay.pp > 1 and lay.policy.fp8 is not None and lay.policy.fp8.recipe.value == "rowwise")  # fmt: skip
    cell = gen.matrix(_declared(), [rowwise])[frozenset(("fp8", "pp"))]
    assert cell.symbol == "✗*" and not cell.refused
    assert [(r.rule, r.which) for r in cell.refusals] == [("rowwise_without_pp", "fp8='rowwise'")]
    tested = gen.matrix(_declared(fp8__pp=("tests/x.py",)), [rowwise])[frozenset(("fp8", "pp"))]
    assert tested.symbol == "✓*"
    assert "works: `tests/x.py`; refused for fp8='rowwise' (`rowwise_without_pp`)" in gen._verdict(tested)


def test_the_real_rules_land_on_their_pairs() -> None:
    cells = gen.matrix(_declared(), RULES)
    offload = cells[frozenset(("offload_params", "zero1"))]
    assert offload.refused and offload.refusals[0].rule == "offload_params_needs_stage_3"
    assert not cells[frozenset(("offload_params", "zero3"))].refusals
    fp8_tp = cells[frozenset(("fp8", "tp"))]
    assert [(r.rule, r.which) for r in fp8_tp.refusals] == [("fp8_rowwise_without_tp", "fp8='rowwise'")]
    assert cells[frozenset(("zero1", "zero2"))].symbol == "—"  # one ZeRO stage per layout
    assert cells[frozenset(("tp", "sp"))].flag  # sp is tp with a flag
    assert cells[frozenset(("moe_balance", "accumulation"))].refusals == ()  # neither is a strategy argument


def test_every_rule_is_placed_or_the_generator_says_what_to_map() -> None:
    never = _rule("never", ("pp", "cp"), lambda lay: False)
    with pytest.raises(ValueError, match=r"rule 'never' names \['cp', 'pp'\] and refuses no pair"):
        gen.matrix(_declared(), [never])
    unknown = _rule("unknown", ("pp", "EPPolicy.capacity"), lambda lay: False)
    with pytest.raises(ValueError, match=r"'EPPolicy.capacity': map it in OPTION_KEYS"):
        gen.matrix(_declared(), [unknown])
    alone = _rule("sp_needs_tp", ("TPPolicy.sequence_parallel", "tp"), lambda lay: False)  # sp is tp with a flag
    cells = gen.matrix(_declared(), [alone])
    assert [r.name for r in gen.one_option_rules(cells, [alone])] == ["sp_needs_tp"]


def test_one_option_twice_cannot_be_declared() -> None:
    with pytest.raises(ValueError, match=r"\('zero1', 'zero2'\), which set one option to two values"):
        gen.matrix(_declared(zero1__zero2=("tests/x.py",)), RULES)


def test_layout_of_reads_the_strategy_spelling() -> None:
    lay = gen.layout_of({"zero_stage": 1, "tp": {"size": 2, "sequence_parallel": True}, "pp": {"size": 2},
                         "dp_replicate": 2, "fp8": "rowwise"})  # fmt: skip
    assert (lay.stage, lay.tp, lay.pp, lay.cp, lay.ep, lay.dp_replicate) == (1, 2, 2, 1, 1, 2)
    assert lay.policy.tensor_parallel.sequence_parallel and lay.policy.fp8.recipe.value == "rowwise"
