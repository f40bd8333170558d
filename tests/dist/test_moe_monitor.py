"""``ExpertLoadMonitor`` under a real Trainer on 2 gloo ranks; one spawn, three runs per rank.

* Lightning ``"ddp"``, the duck-typed :class:`~tests.unit.test_moe_monitor.FakeMoE` layers whose loads are scheduled
  per rank (rank 1's router of layer 1 forced onto expert 0), 2 micro-batches per step, the second layer under
  activation checkpointing: every logged value of every step equals the hand-computed ``EXPECTED`` of both ranks'
  loads summed, on both ranks; the collapse of layer 1 is warned once, by rank 0, after 3 checks.
* the same with ``every_n_steps=None`` and ``Trainer(log_every_n_steps=2)``, ``raise_on_collapse=True``: the logger
  gets the values only on even steps (one step's counts, not two), and both ranks raise at the second check.
* ``V17Strategy(zero_stage=1, ep=2, activation_checkpointing="full")`` and the reference MoE LlamaLM (2 MoE blocks,
  8 experts, top-2), rank 1's router of the second block forced onto expert 0 by its selection bias: the logged
  imbalance of each block is max / mean of both ranks' recorded loads summed, each block routed exactly
  2 ranks x 2 rows x 32 tokens x k=2 = 256 assignments per step, and the forced block, only it, is reported
  collapsed. (Here torch's non-reentrant checkpoint stops recomputing once it has the saved tensors it needs,
  before the MoE's forward hook runs; the fake run's recompute does run the hook, so it is the one that proves a
  recomputed forward is not counted.)
"""

from __future__ import annotations

import pytest

from tests._dist import spawn
from tests.unit.test_moe_monitor import EXPECTED, SCHEDULE

SEQ, ROWS, STEPS = 32, 2, 4


def _rows_logger():
    from lightning.pytorch.loggers import Logger

    class Rows(Logger):
        """What reaches a logger: (step, the ``moe/`` metrics) per ``log_metrics`` call."""

        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int, dict[str, float]]] = []

        @property
        def name(self) -> str:
            return "rows"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, params, *args, **kwargs) -> None:
            pass

        def log_metrics(self, metrics, step=None) -> None:
            moe = {k: float(v) for k, v in metrics.items() if k.startswith("moe/")}
            if moe:
                self.rows.append((step, moe))

    return Rows()


def _fit_fake(rank: int, monitor, max_steps: int, log_every_n_steps: int) -> dict:
    import warnings

    import lightning as L
    import torch

    from tests.unit.test_moe_monitor import FakeNet

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = FakeNet({i: SCHEDULE[i][rank] for i in (0, 1)})

        def training_step(self, batch, batch_idx):
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(64, 8, generator=torch.Generator().manual_seed(0)),
                                               batch_size=2)  # fmt: skip

    logger = _rows_logger()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=max_steps, accumulate_grad_batches=2,
                        log_every_n_steps=log_every_n_steps, logger=logger, callbacks=[monitor],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    raised = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(Module())
        except Exception as err:  # noqa: BLE001 - the raising run returns what it raised
            raised = f"{type(err).__name__}: {err}"
    return {"rows": logger.rows, "raised": raised, "step": trainer.global_step,
            "warnings": [str(w.message) for w in caught if "ExpertLoadMonitor" in str(w.message)]}  # fmt: skip


def _fit_real(rank: int) -> dict:
    import warnings

    import lightning as L
    import torch
    from lightning_v17.callbacks import ExpertLoadMonitor
    from lightning_v17.strategies import V17Strategy

    from lightning_v17.data import PackedDataModule
    from lightning_v17.models import LlamaLM, moe_layers

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1000)
    docs = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(8, 40, (120,), generator=g)]
    loads: list[list[list[float]]] = []

    class Forced(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            if rank == 1:  # this rank's second MoE block always selects expert 0 (the bias only selects)
                moe_layers(pl_module)[1].expert_bias[0] = 1e3

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loads.append([m.last_load.tolist() for m in moe_layers(pl_module)])

    monitor = ExpertLoadMonitor(every_n_steps=1, patience=3)
    module = LlamaLM(model="tiny-moe", model_overrides={"layers": 2, "dense_layers": 0, "num_experts": 8},
                     warmup_steps=0, lr=1e-3, max_steps=STEPS)  # fmt: skip
    logger = _rows_logger()
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=STEPS, log_every_n_steps=1, logger=logger,
                        strategy=V17Strategy(zero_stage=1, ep=2, activation_checkpointing="full"),
                        callbacks=[Forced(), monitor], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=PackedDataModule(docs, seq_len=SEQ, batch_size=ROWS, seed=0))
    return {"rows": logger.rows, "loads": loads, "routed": [s.routed for s in monitor.last.layers],
            "names": list(monitor.last.names),
            "warnings": [str(w.message) for w in caught if "ExpertLoadMonitor" in str(w.message)]}  # fmt: skip


def _worker(rank: int, world_size: int) -> dict:
    import torch
    from lightning_v17.callbacks import ExpertLoadMonitor

    torch.set_num_threads(1)
    return {
        "fake": _fit_fake(rank, ExpertLoadMonitor(every_n_steps=1, patience=3), max_steps=5, log_every_n_steps=1),
        "raise": _fit_fake(
            rank, ExpertLoadMonitor(patience=2, raise_on_collapse=True), max_steps=8, log_every_n_steps=2
        ),
        "real": _fit_real(rank),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return spawn(_worker, world_size=2, init_process_group=False, timeout=300)


def test_logged_values_are_the_hand_computed_sums_of_both_ranks(runs) -> None:
    for rank, got in enumerate(r["fake"] for r in runs):
        assert [step for step, _ in got["rows"]] == [0, 1, 2, 3, 4], rank  # Lightning's logger step = global_step - 1
        for step, row in got["rows"]:
            assert row == pytest.approx(EXPECTED), (rank, step)
        assert got["raised"] is None and got["step"] == 5


def test_a_collapsed_router_is_warned_once_by_rank_zero(runs) -> None:
    r0, r1 = (r["fake"] for r in runs)
    collapsed = [w for w in r0["warnings"] if "has collapsed" in w]
    assert len(collapsed) == 1, r0["warnings"]
    assert "layer 1 (net.layers.1)" in collapsed[0] and "83%" in collapsed[0]
    assert "up to step 3" in collapsed[0]  # patience=3 checks: steps 1, 2, 3
    # layer 1 routes top-2 of 4 experts: balanced, every expert already gets half of the tokens (k/E)
    (edge,) = [w for w in r0["warnings"] if "cannot tell a collapse from balance" in w]
    assert "1 MoE layer(s), e.g. net.layers.1" in edge and "50%" in edge
    assert r1["warnings"] == []


def test_default_period_follows_log_every_n_steps_and_raise_stops_every_rank(runs) -> None:
    for rank, got in enumerate(r["raise"] for r in runs):
        assert [step for step, _ in got["rows"]] == [1], rank  # the check of step 2; step 4's raised before logging
        assert got["rows"][0][1] == pytest.approx(EXPECTED)  # step 1's counts were dropped, not added in
        assert got["raised"].startswith("RouterCollapseError") and "net.layers.1" in got["raised"], got["raised"]
        assert got["step"] == 4, rank


def test_real_moe_under_v17_ep(runs) -> None:
    r0, r1 = (r["real"] for r in runs)
    assert len(r0["rows"]) == STEPS and len(r0["loads"]) == STEPS == len(r1["loads"])
    assert r0["loads"] != r1["loads"]  # the ranks routed different tokens: the sum is what must be logged
    for (_, row), l0, l1 in zip(r0["rows"], r0["loads"], r1["loads"]):
        for i, (a, b) in enumerate(zip(l0, l1)):
            total = [x + y for x, y in zip(a, b)]
            assert row[f"moe/layer{i}/imbalance"] == pytest.approx(max(total) / (sum(total) / len(total)))
            assert row[f"moe/layer{i}/top_share"] == pytest.approx(2 * max(total) / sum(total))
    assert r0["routed"] == [2 * ROWS * SEQ * 2] * 2  # each token once per slot
    collapsed = [w for w in r0["warnings"] if "has collapsed" in w]
    assert len(collapsed) == 1 and f"layer 1 ({r0['names'][1]})" in collapsed[0], (r0["warnings"], r0["names"])
