"""Lightning's own callbacks, tuner, utilities and Trainer flags under every V17 layout, on 2 gloo ranks: the matrix
behind ``docs/lightning-compat.md``.

Each feature runs as a few small Trainer runs of a tiny Llama (``tests/_compat_catalogue.py``) under
``V17Strategy(zero_stage=0..3)`` (dp=2), ``tp=2`` and ``pp=2``, and under the references: Lightning's ``"ddp"`` on
the same 2 ranks for the dp=2 layouts, one process on the global batch for tp, pp and the finetuning callbacks. Every
observable is compared at 1e-5 (``tests/_compat_matrix.py``). One spawn runs the references, one spawn each layout;
the module fixture runs them once and every test reads its results.

A cell passes with parity, a refusal at setup that names the feature, or n/a; a crash or a difference fails it, with
the traceback's last line or the observable that differs. ``test_verdicts_match_the_committed_page`` fails when the
measured verdicts differ from ``tests/lightning_compat.json`` (regenerate: ``python -m tests._compat_matrix --write``).
"""

from __future__ import annotations

import math

import pytest

from tests._compat_matrix import FEATURES, LAYOUTS, REGENERATE, load, run_matrix, signature, verdicts

pytestmark = pytest.mark.timeout(900)  # the first test runs the whole matrix (7 spawns)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict:
    raw = run_matrix(str(tmp_path_factory.mktemp("compat")))
    print("matrix wall seconds:", {k: round(v, 1) for k, v in raw["seconds"].items()})
    return {"raw": raw, "verdicts": verdicts(raw)}


def _ref(matrix: dict, case: str, kind: str = "ddp", rank: int = 0, rows: int = 4) -> dict:
    """A reference run's observables of ``case`` (its own feature), asserting that the reference itself ran."""
    ref = matrix["raw"]["reference"]
    if kind == "ddp":
        result = ref[rank]["ddp"][case]
    else:
        result = next(r["one"][(case, rows)] for r in ref if (case, rows) in r["one"])
    assert "ok" in result, f"the {kind} reference of {case} failed: {result.get('error')}"
    return result["ok"]


def test_references_exercise_each_feature(matrix):
    """What the references did, against values worked out by hand: a parity with a run in which the feature did
    nothing would prove nothing."""
    steps = {"fast_dev_run": 2, "overfit_batches": 4, "limit_batches": 2 * 3, "accumulate_grad_batches": 3,
             "detect_anomaly": 2, "grad_accum_scheduler": 4 + 4 // 2}  # fmt: skip
    for kind in ("ddp", "one"):
        for case, n in steps.items():
            assert _ref(matrix, case, kind)[case]["global_step"] == n, (kind, case)
        es = _ref(matrix, "early_stopping", kind)["early_stopping"]
        assert (es["stopped_epoch"], es["global_step"]) == (1, 4), (kind, es)  # 2 epochs of 2 steps, then stopped
        spike = _ref(matrix, "spike_detection", kind)["spike_detection"]
        assert spike["raised"] == "Training spike detected in batch 3" and spike["on_exception_ckpt"], (kind, spike)
        assert [int(x) for x in spike["skip"].strip("[] \n").split(",")] == [2, 3], (kind, spike)
        lr = _ref(matrix, "lr_find", kind)["lr_find"]
        assert len(lr["lr"]) == 6 and lr["left_behind"] == [], (kind, lr["left_behind"])
        ckpt = _ref(matrix, "model_checkpoint", kind)["model_checkpoint"]
        assert len(ckpt["best_k"]) == 2 and "last.ckpt" in ckpt["kept"] and len(ckpt["kept"]) == 3, (kind, ckpt)
        assert len(ckpt["resumed_losses"]) == 2, (kind, ckpt)  # resumed at step 4 of 6
        lrs = [row["lr-SGD"] for _, row in _ref(matrix, "lr_monitor", kind)["lr_monitor"]["lrs"]]
        assert all(math.isclose(a, 0.1 * 0.9**i, rel_tol=1e-9) for i, a in enumerate(lrs)) and len(lrs) == 3, lrs
        clip = _ref(matrix, "gradient_clipping_hook", kind)["gradient_clipping_hook"]["_pre_clip_norms"]
        assert clip[0] > 0.3 and clip[2] > 0.3, clip  # the even steps' norm clipping engaged
        probe = _ref(matrix, "unused_probe_adamw", kind)["unused_probe_adamw"]
        assert probe["probe_grad_is_none"], kind
        actions = _ref(matrix, "profiler_simple", kind)["profiler_simple"]["actions"]
        assert list(actions.values()) == [1, 3, 3, 3], (kind, actions)  # 1 epoch of 3 batches, steps, optimizer steps
        actions = _ref(matrix, "profiler_advanced", kind)["profiler_advanced"]["actions"]
        assert list(actions.values()) == [1, 1, 1, 1], (kind, actions)  # one report section per action
    throughput = {kind: _ref(matrix, "throughput_monitor", kind)["throughput_monitor"] for kind in ("ddp", "one")}
    assert throughput["ddp"]["global_samples_over_device"] == 2.0  # 2 data ranks
    assert throughput["one"]["global_samples_over_device"] == 1.0
    assert throughput["one"]["counts"] == {"samples": 16, "batches": 4}  # 4 steps of ROWS rows
    summary = _ref(matrix, "model_summary", "one")["model_summary"]["summary"]
    assert summary["total"] == sum(p.numel() for p in _ref(matrix, "model_summary", "one")["model_summary"]["params"]
                                   .values())  # fmt: skip
    assert _ref(matrix, "scale_batch_size", "one")["scale_batch_size"]["size"] == 4  # trials at 2 and 4: max_trials=2
    groups = _ref(matrix, "backbone_finetuning", "one", rows=8)["backbone_finetuning"]["groups"]
    assert len(groups) == 2, groups  # the backbone's group was added at epoch 1


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("feature", list(FEATURES))
def test_cell(matrix, feature, layout):
    v = matrix["verdicts"][feature][layout]
    assert v["status"] in ("parity", "refused", "n/a"), (
        f"{FEATURES[feature].title} under {LAYOUTS[layout][1]}: {v['detail']}"
        + "".join(f"\n  {p}" for p in v.get("problems", [])[1:])
        + "".join(f"\n  at {w}" for w in v.get("where", []))
    )


def test_verdicts_match_the_committed_page(matrix):
    committed = load()["cells"]
    stale = [
        f"{feature} / {layout}: committed {signature(committed[feature][layout])}, measured {signature(v)}"
        for feature, row in matrix["verdicts"].items()
        for layout, v in row.items()
        if signature(committed.get(feature, {}).get(layout, {"status": "missing"})) != signature(v)
    ]
    assert not stale, f"docs/lightning-compat.md is stale; regenerate with `{REGENERATE}`:\n" + "\n".join(stale)
