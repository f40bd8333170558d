"""``docs/lightning-compat.md`` against the committed verdicts it is rendered from, and the matrix's own judgement
(what counts as parity, as a refusal, as a failure), on hand-made results; no process is spawned."""

from __future__ import annotations

import pytest
import torch

from tests._compat_matrix import DOC, FEATURES, LAYOUTS, REGENERATE, TOL, compare, judge, load, render


def test_page_is_what_the_committed_verdicts_render():
    assert DOC.read_text() == render(load()), f"docs/lightning-compat.md is stale; regenerate with `{REGENERATE}`"


def test_every_cell_has_a_verdict_and_every_feature_a_case():
    from tests._compat_catalogue import CASES

    cells = load()["cells"]
    assert sorted(cells) == sorted(FEATURES)
    for feature, row in cells.items():
        assert sorted(row) == sorted(LAYOUTS), feature
        assert all(v["status"] in ("parity", "refused", "n/a", "fails") for v in row.values()), feature
    produced = [f for case in CASES for f in case.features]
    assert sorted(produced) == sorted(FEATURES)  # each feature exactly once


def test_compare_is_absolute_below_one_and_relative_above():
    # fp32 tensors: 0.5 + 2e-5 rounds to within 1e-3 of it
    assert compare({"w": torch.tensor([0.5])}, {"w": torch.tensor([0.5 + 2 * TOL])})[0] == pytest.approx(2 * TOL, rel=1e-2)
    # a loss of 4 may differ by 4x as much in absolute terms
    assert compare([4.0 + 2 * TOL], [4.0])[0] == pytest.approx(TOL / 2)
    assert compare({"n": 3}, {"n": 3}) == (0.0, [], "n")
    # the largest difference is located
    assert compare({"a": 1.0, "b": [2.0, 3.5]}, {"a": 1.0, "b": [2.0, 3.0]})[2] == "b.1"


@pytest.mark.parametrize(
    ("got", "want", "problem"),
    [
        ({"a": 1.0}, {"a": 1.0, "b": 2.0}, "b: missing"),
        ({"a": [1.0]}, {"a": [1.0, 2.0]}, "a: 1 entries instead of 2"),
        ({"s": 2}, {"s": 3}, "s: 2 instead of 3"),
        ({"t": torch.zeros(2)}, {"t": torch.zeros(3)}, "t: "),
        ({"x": float("nan")}, {"x": 1.0}, "x: NaN"),
    ],
)
def test_compare_names_what_does_not_match(got, want, problem):
    _diff, problems, _where = compare(got, want)
    assert problems and problems[0].startswith(problem), problems


def test_compare_skips_facts_of_the_run():
    assert compare({"_norms": [1.0], "a": 1.0}, {"_norms": [2.0], "a": 1.0})[:2] == (0.0, [])


def _ok(obs: dict) -> dict:
    return {"ok": {"swa": obs}}


def _err(message: str, *, batches: int = 0, config_error: bool = True, kind: str = "V17ConfigError") -> dict:
    return {"error": {"type": kind, "message": message, "batches": batches, "config_error": config_error, "tb": []}}


def test_judge_parity_bitwise_and_tolerance():
    ref = [_ok({"w": torch.ones(2)})] * 2
    assert judge("swa", "zero1", ref, ref, ref) == {"status": "parity", "max_diff": 0.0}
    off = [_ok({"w": torch.ones(2) + 2 * TOL})] * 2
    v = judge("swa", "zero1", off, ref, ref)
    assert v["status"] == "fails" and v["kind"] == "mismatch:tolerance"
    # a feature that must be bitwise fails at any difference on the dp=2 layouts, not on tp
    tiny = [{"ok": {"unused_probe_adamw": {"w": torch.ones(2) + TOL / 10}}}] * 2
    exact = [{"ok": {"unused_probe_adamw": {"w": torch.ones(2)}}}] * 2
    assert judge("unused_probe_adamw", "zero2", tiny, exact, exact)["status"] == "fails"
    assert judge("unused_probe_adamw", "tp2", tiny, exact, exact)["status"] == "parity"


def test_judge_refusal_needs_a_config_error_before_the_first_batch_naming_the_feature():
    ref = [_ok({"w": torch.ones(2)})] * 2
    named = "StochasticWeightAveraging needs whole parameters; use zero_stage=1"
    assert judge("swa", "zero3", [_err(named)] * 2, ref, ref) == {"status": "refused", "detail": named}
    assert judge("swa", "zero3", [_err(named, batches=1)] * 2, ref, ref)["kind"] == "crash:V17ConfigError"
    assert judge("swa", "zero3", [_err("zero_stage=3 is not supported")] * 2, ref, ref)["status"] == "fails"
    not_config = _err(named, config_error=False, kind="RuntimeError")
    assert judge("swa", "zero3", [not_config] * 2, ref, ref)["kind"] == "crash:RuntimeError"


def test_judge_takes_lightnings_own_refusal_and_blames_the_rank_that_failed_first():
    lightning = _err("Tuning the batch size is currently not supported", config_error=False, kind="ValueError")
    one = [{"ok": {"scale_batch_size": {"size": 4}}}] * 2
    v = judge("scale_batch_size", "tp2", [lightning] * 2, one, [lightning] * 2)
    assert v["status"] == "refused"
    timeout = _err("Application timeout caused pair closure", batches=3, config_error=False, kind="RuntimeError")
    alone = _err("'NoneType' object has no attribute 'modules'", batches=3, config_error=False, kind="AttributeError")
    v = judge("swa", "pp2", [timeout, alone], [_ok({"w": 1.0})] * 2, [_ok({"w": 1.0})] * 2)
    assert v["kind"] == "crash:AttributeError", v
