"""Lightning's catalogue under each V17 layout: the verdicts, their JSON, and ``docs/lightning-compat.md``.

Regenerate both after a change that moves a verdict (it runs the matrix: about a minute on 2 idle cores)::

    .venv/bin/python -m tests._compat_matrix --write

``--render`` rewrites only the page, from the committed JSON. ``tests/dist/test_lightning_compat.py`` fails when the
measured verdicts differ from the committed JSON; ``tests/unit/test_lightning_compat_doc.py`` fails when the page
differs from what :func:`render` makes of the JSON. So neither can go stale.

A verdict is, per feature and layout:

* ``parity``: every observable within ``TOL`` of the reference's (``|a - b| / max(1, |b|)``: absolute below 1,
  relative above), every rank; ``bitwise`` where the feature demands it (``BITWISE``);
* ``refused``: a ``V17ConfigError`` or ``MisconfigurationException`` (or the very error Lightning's own ``"ddp"``
  raises for it) before the entry point's first batch, whose message names the feature;
* ``n/a``: the feature does not apply to the layout (``NOT_APPLICABLE`` says why);
* ``fails``: anything else: a crash (a failing cell), or an observable off the reference (which, and by how much).
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests._compat_cases import LAYOUTS as SIZES

ROOT = Path(__file__).resolve().parent.parent
JSON = Path(__file__).with_name("lightning_compat.json")
DOC = ROOT / "docs" / "lightning-compat.md"
TOL = 1e-5
REGENERATE = ".venv/bin/python -m tests._compat_matrix --write"

#: layout -> (column title, how a user writes it)
LAYOUTS = {
    "zero0": ("ZeRO-0, dp=2", "V17Strategy(zero_stage=0)"),
    "zero1": ("ZeRO-1, dp=2", "V17Strategy(zero_stage=1)"),
    "zero2": ("ZeRO-2, dp=2", "V17Strategy(zero_stage=2)"),
    "zero3": ("ZeRO-3, dp=2", "V17Strategy(zero_stage=3)"),
    "tp2": ("tp=2", "V17Strategy(tp=2, zero_stage=3)"),
    "pp2": ("pp=2", 'V17Strategy(pp=PipelinePolicy(size=2, schedule="1f1b", microbatches=2), zero_stage=1)'),
}

@dataclass(frozen=True)
class Feature:
    """A row: its title, what the case checks, the words one of which a refusal's message must contain, and (where
    Lightning itself refuses it) what to do instead."""

    title: str
    checks: str = ""
    names: tuple[str, ...] = ()
    instead: str = ""


F = Feature
FEATURES: dict[str, Feature] = {
    "backbone_finetuning": F("`BackboneFinetuning`", "frozen at setup, unfrozen at epoch 1 with "
                             "`optimizer.add_param_group`; against one process", ("BackboneFinetuning", "finetun")),
    "own_finetuning": F("`BaseFinetuning` subclass", "a user's own: the embedding frozen at setup, unfrozen at epoch "
                        "1; against one process", ("BaseFinetuning", "finetun")),
    "swa": F("`StochasticWeightAveraging`", "averaged from epoch 1, annealed over 1 epoch",
             ("StochasticWeightAveraging", "SWA")),
    "ema": F("`EMAWeightAveraging`", "decay 0.5, every step", ("EMAWeightAveraging", "WeightAveraging")),
    "model_checkpoint": F("`ModelCheckpoint`", "top-2 by the synced loss + last, every step; a new Trainer resumes "
                          "from last", ("ModelCheckpoint", "checkpoint")),
    "early_stopping": F("`EarlyStopping`", "on the synced val_loss: stops at epoch 1", ("EarlyStopping",)),
    "lr_monitor": F("`LearningRateMonitor`", "the LR logged every step", ("LearningRateMonitor",)),
    "grad_accum_scheduler": F("`GradientAccumulationScheduler`", "1 batch per step, 2 from epoch 1",
                              ("GradientAccumulationScheduler", "accumulat")),
    "model_summary": F("`ModelSummary`", "the parameter counts and sizes rank 0 prints", ("ModelSummary",)),
    "throughput_monitor": F("`ThroughputMonitor` (Lightning's)", "per-device counts; the global rate is the data "
                            "ranks' together", ("ThroughputMonitor",)),
    "spike_detection": F("`SpikeDetection` + `OnExceptionCheckpoint`", "a corrupt batch stops every rank; the "
                         "batches to skip are written and the state saved", ("SpikeDetection",)),
    "lr_find": F("`Tuner.lr_find`", "the same LRs, losses and suggestion; no `.lr_find_*.ckpt` left; a fit after",
                 ("lr_find", "learning rate finder")),
    "scale_batch_size": F("`Tuner.scale_batch_size`", "the same size; no `.scale_batch_size_*.ckpt` left; a fit "
                          "after", ("batch size", "scale_batch_size"), "Lightning refuses it under every distributed "
                          'strategy, `"ddp"` included: find the batch size on one device (`devices=1`) and use it '
                          "per data-parallel rank"),
    "grad_norm": F("`grad_norm(self, norm_type=2)`", "logged in `on_before_optimizer_step`: every parameter's norm "
                   "and the total, of the full model", ("grad_norm",)),
    "validate": F("`trainer.validate`", "after fit: the synced val_loss", ("validat",)),
    "test": F("`trainer.test`", "after fit: the synced test_loss", ("test",)),
    "predict": F("`trainer.predict`", "after fit: each rank's predictions", ("predict",)),
    "log_sync_dist": F("`self.log(..., sync_dist=True)`", "the train and validation means over the data ranks",
                       ("sync_dist",)),
    "all_gather": F("`self.all_gather`", "each rank's validation losses, gathered", ("all_gather",)),
    "manual_optimization": F("manual optimization", "every `zero_grad` form (`set_to_none=True/False`, before "
                             "backward and after `step`) and `self.clip_gradients`", ("manual optimization",)),
    "gradient_clipping_hook": F("`configure_gradient_clipping` overridden", "by norm on even steps, by value on odd "
                                "ones", ("configure_gradient_clipping", "clip")),
    "unused_probe_adamw": F("a head training never calls, AdamW", "its `.grad` stays None, so AdamW skips it (no "
                            "decay either); the rest bitwise as `ddp_find_unused_parameters_true`", ("probe",)),
    "fast_dev_run": F("`fast_dev_run=2`", names=("fast_dev_run",)),
    "overfit_batches": F("`overfit_batches=2`", names=("overfit_batches",)),
    "limit_batches": F("`limit_train_batches` / `limit_val_batches`", names=("limit_",)),
    "accumulate_grad_batches": F("`accumulate_grad_batches=2`", names=("accumulate_grad_batches", "accumulat")),
    "detect_anomaly": F("`detect_anomaly=True`", names=("detect_anomaly", "anomaly")),
    "profiler_simple": F('`profiler="simple"`', "the actions it records, per step", ("profiler",)),
    "profiler_advanced": F('`profiler="advanced"`', "the actions it profiles", ("profiler",)),
}  # fmt: skip

#: features that must match the reference bitwise on the dp=2 layouts (the same sums in the same order as ddp)
BITWISE = {"unused_probe_adamw"}

#: (feature, layout) -> why the feature does not apply there (one short phrase)
NOT_APPLICABLE: dict[tuple[str, str], str] = {
    ("model_summary", "pp2"): "each pipeline stage holds only its part of the model, so rank 0 summarizes stage 0's "
    "layers (V17Strategy warns at setup); `v17 plan` counts the whole model",
}


# ---------------------------------------------------------------------------------------------------- comparison
def compare(got: Any, want: Any, path: str = "") -> tuple[float, list[str], str]:
    """The largest difference ``|a - b| / max(1, |b|)`` between two observables, what does not match at all (a
    missing key, a shape, a string, a count), and where the largest difference is. Keys starting with "_" are facts of
    the run, not compared."""
    import torch

    where = path.rstrip(".") or "value"
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return math.inf, [f"{where}: {type(got).__name__} instead of a dict"], where
        want_keys = {k for k in want if not str(k).startswith("_")}
        got_keys = {k for k in got if not str(k).startswith("_")}
        problems = [f"{path}{k}: missing" for k in sorted(want_keys - got_keys, key=str)[:3]]
        problems += [f"{path}{k}: not in the reference" for k in sorted(got_keys - want_keys, key=str)[:3]]
        parts = [compare(got[k], want[k], f"{path}{k}.") for k in sorted(want_keys & got_keys, key=str)]
    elif isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            n = len(got) if isinstance(got, (list, tuple)) else type(got).__name__
            return math.inf, [f"{where}: {n} entries instead of {len(want)}"], where
        problems, parts = [], [compare(g, w, f"{path}{i}.") for i, (g, w) in enumerate(zip(got, want))]
    elif torch.is_tensor(want) or (isinstance(want, float) and not isinstance(want, bool)):
        g = torch.as_tensor(got, dtype=torch.float64) if isinstance(got, (int, float, torch.Tensor)) else None
        w = torch.as_tensor(want, dtype=torch.float64)
        if g is None or g.shape != w.shape:
            return math.inf, [f"{where}: {_short(got)} instead of shape {tuple(w.shape)}"], where
        if not torch.equal(torch.isnan(g), torch.isnan(w)):
            return math.inf, [f"{where}: NaN where the reference has none (or none where it has)"], where
        diff = ((g - w).abs() / w.abs().clamp_min(1.0)).nan_to_num(0.0)
        return (float(diff.max()) if diff.numel() else 0.0), [], where
    else:
        return (0.0, [], where) if got == want else (math.inf, [f"{where}: {_short(got)} instead of {_short(want)}"],
                                                      where)  # fmt: skip
    worst = max(parts, key=lambda p: p[0], default=(0.0, [], where))
    return worst[0], problems + [p for part in parts for p in part[1]], worst[2]


def _short(value: Any, n: int = 60) -> str:
    s = repr(value)
    return s if len(s) <= n else s[: n - 3] + "..."


# ---------------------------------------------------------------------------------------------------- verdicts
def _clean(message: str, limit: int = 240) -> str:
    """A message's first line without what differs between runs (temporary paths, addresses), cut at ``limit``."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    first = re.sub(r"/tmp/\S+", "<tmp>", first)
    first = re.sub(r"0x[0-9a-f]+", "0x..", first)
    return first if len(first) <= limit else first[: limit - 3] + "..."


def _refusal(feature: str, err: dict, ddp_err: dict | None) -> bool:
    names = FEATURES[feature].names
    named = any(n.lower() in err["message"].lower() for n in names)
    lightnings_own = ddp_err is not None and (ddp_err["type"], ddp_err["message"]) == (err["type"], err["message"])
    return err["batches"] == 0 and named and (err["config_error"] or lightnings_own)


def _observables(result: dict | None, feature: str) -> tuple[Any, dict | None]:
    """A rank's observables of ``feature`` and its error (the case's, or the feature's own), one of them None."""
    if result is None:
        return None, {"type": "NoResult", "message": "the rank returned no result (an earlier case broke the group)",
                      "batches": 0, "config_error": False, "tb": []}  # fmt: skip
    if "error" in result:
        return None, result["error"]
    obs = result["ok"].get(feature)
    if isinstance(obs, dict) and "__error__" in obs:
        return None, obs["__error__"]
    return obs, None


def judge(feature: str, layout: str, ranks: list[dict | None], refs: list[dict | None], ddp: list[dict | None],
          ) -> dict:  # fmt: skip
    """The verdict of one cell from the layout's per-rank results, the reference's (one per rank: the same one-process
    result for each, or ddp's rank r) and ddp's own (for Lightning's refusals).

    A ``fails`` verdict has a ``kind``: ``crash:<error type>``, ``mismatch:<first observable off>``,
    ``mismatch:tolerance`` or ``reference`` (the reference itself failed: the harness is wrong)."""
    if (feature, layout) in NOT_APPLICABLE:
        return {"status": "n/a", "detail": NOT_APPLICABLE[(feature, layout)]}
    ref_obs = [_observables(r, feature) for r in refs]
    for _obs, err in ref_obs:
        if err is not None and not _refusal(feature, err, err):
            return {"status": "fails", "kind": "reference",
                    "detail": f"the reference failed: {err['type']}: {_clean(err['message'])}"}  # fmt: skip
    ddp_err = _observables(ddp[0], feature)[1] if ddp and ddp[0] is not None else None
    got = [_observables(r, feature) for r in ranks]
    errors = [e for _, e in got if e is not None]
    if errors:
        err = errors[0]
        if len(errors) == len(got) and all(_refusal(feature, e, ddp_err) for e in errors):
            return {"status": "refused", "detail": _clean(err["message"], limit=2000)}  # the reason and the fix, whole
        # the rank that failed first is the one whose error is not a peer's timeout
        err = next((e for e in errors if "timeout" not in e["message"].lower()), err)
        where = [line.strip() for line in err.get("tb", []) if line.strip().startswith("File ")][-1:]
        return {"status": "fails", "kind": f"crash:{err['type']}", "where": where,
                "detail": f"crashes: {err['type']}: {_clean(err['message'])}"}  # fmt: skip
    if any(e is not None for _, e in ref_obs):  # the reference refused and the layout ran: nothing to compare with
        return {"status": "fails", "kind": "reference", "detail": "runs where the reference refuses it"}
    worst, problems, at = 0.0, [], ""
    for (obs, _), (want, _) in zip(got, ref_obs):
        d, p, w = compare(obs, want)
        worst, at, problems = max(worst, d), (w if d > worst else at), problems + p
    if problems:
        return {"status": "fails", "kind": "mismatch:" + problems[0].split(":")[0], "problems": problems[:6],
                "detail": f"differs from the reference: {problems[0]}"}  # fmt: skip
    if worst > TOL:
        return {"status": "fails", "kind": "mismatch:tolerance", "max_diff": worst,
                "detail": f"{at} differs from the reference by {worst:.1e} (tolerance {TOL:.0e})"}  # fmt: skip
    if feature in BITWISE and SIZES[layout][1] > 1 and worst != 0.0:
        return {"status": "fails", "kind": "mismatch:tolerance", "max_diff": worst,
                "detail": f"{at} is not bitwise as ddp's: differs by {worst:.1e}"}  # fmt: skip
    return {"status": "parity", "max_diff": worst}


def signature(verdict: dict) -> tuple:
    """What a new measurement must repeat of the committed verdict: the status, and a refusal's message (the user
    reads it), an n/a's reason, or how a cell fails (the error type, or the first observable off). Parity's difference
    is a measurement of the machine that generated the page, not part of it (bitwise is, where ``BITWISE`` asks)."""
    status = verdict["status"]
    if status == "parity":
        return (status,)
    if status == "fails":
        return status, verdict.get("kind", "")
    return status, verdict.get("detail", "")


def verdicts(raw: dict) -> dict[str, dict[str, dict]]:
    """``{feature: {layout: verdict}}`` from :func:`run_matrix`'s raw results."""
    from tests._compat_cases import ROWS
    from tests._compat_catalogue import CASES

    case_of = {f: c for c in CASES for f in _features(c)}
    ref = raw["reference"]
    one = {k: v for rank in ref for k, v in rank["one"].items()}
    out: dict[str, dict[str, dict]] = {}
    for feature in FEATURES:
        case = case_of[feature].__name__
        ddp = [rank["ddp"].get(case) for rank in ref]
        out[feature] = {}
        for layout in LAYOUTS:
            ranks = [r.get(case) for r in raw["layouts"][layout]]
            dp = SIZES[layout][1]
            if dp > 1 and case_of[feature].ddp:
                refs = ddp
            else:  # one process on the global batch: ROWS from each of the dp ranks
                refs = [one.get((case, ROWS * dp))] * len(ranks)
            out[feature][layout] = judge(feature, layout, ranks, refs, ddp)
    return out


def _features(case: Any) -> tuple[str, ...]:
    return case.features


# ---------------------------------------------------------------------------------------------------- running it
def run_matrix(tmp: str) -> dict:
    """The references (one spawn), then every layout (one spawn each; again from the next case after a case that
    broke the ranks' group, so that a hang costs one cell, not the column)."""
    import time

    from tests._compat_cases import run_reference
    from tests._dist import spawn

    t0 = time.perf_counter()
    raw: dict[str, Any] = {"reference": spawn(run_reference, args=(tmp,), init_process_group=False, timeout=300),
                           "layouts": {}, "seconds": {}}  # fmt: skip
    raw["seconds"]["reference"] = time.perf_counter() - t0
    for layout in LAYOUTS:
        t0 = time.perf_counter()
        raw["layouts"][layout] = _run_layout(layout, tmp)
        raw["seconds"][layout] = time.perf_counter() - t0
    return raw


def _run_layout(layout: str, tmp: str) -> list[dict]:
    from tests._compat_cases import run_layout
    from tests._compat_catalogue import CASES
    from tests._dist import spawn

    names = [c.__name__ for c in CASES]
    ranks: list[dict] = [{}, {}]
    start = 0
    while start < len(names):
        try:
            part = spawn(run_layout, args=(layout, tmp, start), init_process_group=False, timeout=240)
        except AssertionError as err:  # the spawn died or hung: the case it was running fails with its error
            running = Path(tmp, layout, "running")
            name = running.read_text() if running.exists() else names[start]
            lost = {"error": {"type": "SpawnFailed", "message": str(err)[-2000:], "batches": 0, "config_error": False,
                              "tb": []}}  # fmt: skip
            for r in ranks:
                r[name] = lost
            start = names.index(name) + 1
            continue
        done = [n for n in names[start:] if all(n in p for p in part)]
        for r, p in zip(ranks, part):
            r.update({n: p[n] for n in done})
        start += max(len(done), 1)
    return ranks


def load() -> dict:
    return json.loads(JSON.read_text())


def to_json(cells: dict[str, dict[str, dict]]) -> str:
    keep = ("status", "kind", "detail", "max_diff")
    slim = {f: {lay: {k: v[k] for k in keep if k in v} for lay, v in row.items()} for f, row in cells.items()}
    return json.dumps({"regenerate": REGENERATE, "tolerance": TOL, "cells": slim}, indent=1, sort_keys=False) + "\n"


# ---------------------------------------------------------------------------------------------------- the page
def render(committed: dict) -> str:
    """``docs/lightning-compat.md`` from the committed verdicts."""
    cells = committed["cells"]
    notes: list[str] = []

    def note(text: str) -> int:
        if text not in notes:
            notes.append(text)
        return notes.index(text) + 1

    rows = []
    for feature, row in FEATURES.items():
        title, instead = row.title, row.instead
        out = []
        for layout in LAYOUTS:
            v = cells[feature][layout]
            status, detail = v["status"], v.get("detail", "")
            if status == "parity":
                out.append("✓ bitwise" if v.get("max_diff", 0.0) == 0.0 else f"✓ {v['max_diff']:.0e}")
            elif status == "refused":
                out.append(f"refused [{note(detail + (f' ({instead})' if instead else ''))}]")
            elif status == "n/a":
                out.append(f"n/a [{note(detail)}]")
            else:
                out.append(f"✗ [{note('does not work yet: ' + detail)}]")
        rows.append(f"| {title} | " + " | ".join(out) + " |")
    head = "| Feature | " + " | ".join(t for t, _ in LAYOUTS.values()) + " |"
    rule = "|---|" + "---|" * len(LAYOUTS)
    layouts = "\n".join(f"* **{t}**: `{how}`" for t, how in LAYOUTS.values())
    checks = "\n".join(f"* {f.title}: {f.checks}" for f in FEATURES.values() if f.checks)
    listed = "\n".join(f"{i}. {text}" for i, text in enumerate(notes, 1))
    return f"""<!-- Generated from tests/lightning_compat.json by tests/_compat_matrix.py; do not edit by hand.
     Regenerate (runs the matrix): {REGENERATE} -->
# Lightning's callbacks, tuner and utilities under V17Strategy

Which of Lightning's own features work with which V17 layout, measured on 2 CPU ranks (gloo, fp32) by
`tests/dist/test_lightning_compat.py`: each feature runs as a small `Trainer` run of a tiny Llama under each layout
and under a reference, and every observable (the losses, every parameter after the run, and what the feature itself
produces: a suggestion, a logged norm, the kept checkpoints) is compared.

* **✓** parity with the reference; the number is the largest difference, `|a - b| / max(1, |b|)` (tolerance
  {TOL:.0e}), "bitwise" when there was none.
* **refused**: V17 (or Lightning itself) stops before the first step with an error that names the feature; the
  note gives the reason and what to do instead.
* **✗**: does not work yet; the note says how it fails. Do not rely on it with that layout.
* **n/a**: the feature does not apply to the layout.

References: Lightning's `"ddp"` on the same 2 ranks for the dp=2 columns (`"ddp_find_unused_parameters_true"`
where a parameter gets no gradient), one process on the global batch for tp and pp, and for the finetuning
callbacks everywhere (DDP's reducer leaves out what was frozen when it was built).

{layouts}

{head}
{rule}
{chr(10).join(rows)}

Notes:

{listed}

What each row checks:

{checks}
"""


def main(argv: list[str]) -> int:
    if "--write" in argv:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            raw = run_matrix(tmp)
        JSON.write_text(to_json(verdicts(raw)))
        print(json.dumps(raw["seconds"], indent=1))
    elif "--render" not in argv:
        print(__doc__)
        return 2
    DOC.write_text(render(load()))
    print(f"wrote {DOC.relative_to(ROOT)}" + (f" and {JSON.relative_to(ROOT)}" if "--write" in argv else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
