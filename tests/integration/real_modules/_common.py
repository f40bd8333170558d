"""Shared pieces of the real-user tier: modules shaped as users write them, trained under V17 and under Lightning's
own ``"ddp"`` inside the same pair of spawned ranks, compared per step (losses) and at the end (parameters).

A worker (module-level, so the forkserver can pickle it) calls :func:`train` once per strategy and returns the
records; the test calls :func:`assert_matches` on the ranks' results. Several strategies run one after another in one
process pair to keep the tier inside its time budget: the spawn, not the steps, is the cost on 2 cores.

Tolerances (the acceptance bar): per-step loss within 1e-4 relative of ddp's, final parameters within 1e-5 absolute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

LOSS_RTOL = 1e-4
PARAM_ATOL = 1e-5


def full_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as one full plain CPU tensor (DTensor shards all-gathered; every rank calls this in the same
    order, so the collectives match). Keys are the module's own ``named_parameters()`` names."""
    out = {}
    for name, p in module.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.to("cpu", copy=True)
    return out


def recorder():
    """A Callback recording, per training step, the module's ``recorded_losses`` (manual optimization: the module
    appends them itself) or the returned loss (automatic optimization)."""
    import lightning as L

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.losses: list[Any] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            rec = getattr(pl_module, "recorded_losses", None)
            if rec is not None:
                self.losses.append(tuple(float(x) for x in rec))
                rec.clear()
            else:
                self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    return Recorder()


def train(
    make_module: Callable[[], Any],
    strategy: Any,
    data: Sequence[Any],
    *,
    batch_size: int,
    steps: int = 6,
    devices: int = 2,
    seed: int = 1,
    params: bool = True,
    inspect: Callable[[Any, Any], Any] | None = None,
    **trainer_kw: Any,
) -> dict[str, Any]:
    """Fit ``make_module()`` for ``steps`` steps under ``strategy`` on this rank; return ``{"losses", "params",
    "extra"}``: per-step losses on this rank, the full parameters after training, and ``inspect(module, trainer)``
    (any picklable value: what a test checks of the trained module or its optimizer, collectives allowed)."""
    import lightning as L
    from torch.utils.data import DataLoader

    L.seed_everything(seed, verbose=False)
    module = make_module()
    rec = recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False, callbacks=[rec],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        **trainer_kw,
    )  # fmt: skip
    trainer.fit(module, DataLoader(list(data), batch_size=batch_size, shuffle=False))
    out: dict[str, Any] = {"losses": rec.losses}
    if params:
        out["params"] = full_parameters(module)
    if inspect is not None:
        out["extra"] = inspect(module, trainer)
    return out


def _mean(per_rank: list[list[Any]]) -> list[Any]:
    """Per-step mean over ranks (the data-parallel mean); tuples (several losses a step) element-wise."""
    steps = []
    for i in range(len(per_rank[0])):
        vals = [r[i] for r in per_rank]
        if isinstance(vals[0], tuple):
            steps.append(tuple(sum(v[j] for v in vals) / len(vals) for j in range(len(vals[0]))))
        else:
            steps.append(sum(vals) / len(vals))
    return steps


def _flat(xs: list[Any]) -> list[float]:
    return [y for x in xs for y in (x if isinstance(x, tuple) else (x,))]


def loss_error(ranks: list[dict[str, Any]], name: str, ref: str = "ddp") -> float:
    """Max relative per-step error of run ``name``'s rank-mean losses against run ``ref``'s."""
    got, want = _flat(_mean([r[name]["losses"] for r in ranks])), _flat(_mean([r[ref]["losses"] for r in ranks]))
    assert len(got) == len(want) and got, (name, got, want)
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))


def param_error(ranks: list[dict[str, Any]], name: str, ref: str = "ddp") -> float:
    """Max absolute difference of run ``name``'s final parameters against run ``ref``'s (rank 0's full copies)."""
    got, want = ranks[0][name]["params"], ranks[0][ref]["params"]
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def assert_matches(ranks: list[dict[str, Any]], names: Sequence[str], ref: str = "ddp", *,
                   loss_rtol: float = LOSS_RTOL, param_atol: float = PARAM_ATOL) -> dict[str, tuple[float, float]]:
    """Every run in ``names`` matches run ``ref``: losses within ``loss_rtol`` relative per step, parameters within
    ``param_atol``. Returns the measured errors ``{name: (loss, param)}`` for the closing figures."""
    errors = {}
    for name in names:
        errors[name] = (loss_error(ranks, name, ref), param_error(ranks, name, ref) if "params" in ranks[0][ref] else 0.0)
    bad = {k: v for k, v in errors.items() if v[0] > loss_rtol or v[1] > param_atol}
    assert not bad, f"against {ref} (loss rtol {loss_rtol}, param atol {param_atol}): {errors}"
    return errors
