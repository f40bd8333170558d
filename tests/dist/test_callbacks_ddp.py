"""V17 callbacks under Lightning's own ``"ddp"`` strategy on 2 real gloo ranks.

All checks share one spawn (one set of imports); each rank builds several small ``lightning.Trainer`` runs in turn.
Expected values come from the design outline's algorithm written out by hand here, never from the code under test.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

from tests._dist import spawn

BASE_LR = 0.1
LR_DECAY = 0.9  # LambdaLR: lr = BASE_LR * LR_DECAY ** (scheduler steps), so the LR exposes every scheduler step
CLIP = 0.05  # gradient_clip_val of run A: small enough to clip some steps


def _lightning():
    import lightning as L

    return L


def _make_module(inf_at: dict[int, int] | None = None, nan_loss: bool = False, seq: int = 8):
    L = _lightning()

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
            self._batch_idx = -1

        def training_step(self, batch, batch_idx):
            self._batch_idx = batch_idx
            x = batch["x"]
            loss = (self.net(x).float() - x).pow(2).mean()
            if nan_loss:
                loss = loss * float("nan")
            return loss

        def on_after_backward(self) -> None:
            # Poison ONE rank's gradient after DDP's all-reduce finished, so only the scaler's own collective can
            # tell the other rank.
            if inf_at and inf_at.get(self._batch_idx) == self.global_rank:
                grad = self.net[0].weight.grad
                local = grad.to_local() if hasattr(grad, "to_local") else grad  # ZeRO-3: this rank's DTensor shard
                with torch.no_grad():
                    local[0, 0] = float("inf")

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=BASE_LR)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: LR_DECAY**step)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            xs = torch.randn(256, seq, 16, generator=g)
            return torch.utils.data.DataLoader([{"x": x} for x in xs], batch_size=4)

    return Tiny()


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank calls it at the same point), else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _recorder(track_clip: bool = True):
    L = _lightning()

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.rows: list[dict] = []
            self.batches_started = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.batches_started += 1
            self._pre = None

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if not track_clip:
                return
            # grads as Lightning's clipping will see them (after the scaler's unscale_), the LR of this step, weights
            grads = [p.grad.detach().double() for p in pl_module.parameters() if p.grad is not None]
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
            flat = torch.cat([p.detach().double().flatten() for p in pl_module.parameters()])
            self._pre = (norm, optimizer.param_groups[0]["lr"], flat)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            from lightning_v17.callbacks import DynamicLossScaling

            dls = next((c for c in trainer.callbacks if isinstance(c, DynamicLossScaling)), None)
            w = _full(pl_module.net[0].weight)
            self.rows.append(
                {
                    "global_step": trainer.global_step,
                    "lr": trainer.optimizers[0].param_groups[0]["lr"],
                    "scale": dls.tracker.scale if dls else None,
                    "skipped": dls.tracker.skipped_steps if dls else None,
                    "wsum": float(w.detach().double().sum()),
                    "clip": self._clip_record(trainer, pl_module),
                }
            )

        def _clip_record(self, trainer, pl_module):
            if self._pre is None:
                return None
            norm, lr, before = self._pre
            after = torch.cat([p.detach().double().flatten() for p in pl_module.parameters()])
            return {"norm": norm, "lr": lr, "update_norm": float(torch.linalg.vector_norm(after - before))}

    return Recorder()


def _fp16_plugin():
    # Lightning turns precision="16-mixed" into bf16-mixed on CPU; fp16 AMP on CPU needs the plugin passed explicitly.
    from lightning.pytorch.plugins.precision import MixedPrecision

    return MixedPrecision(precision="16-mixed", device="cpu")


def _trainer(callbacks, max_steps, **kw):
    L = _lightning()
    precision = kw.pop("precision", "16-mixed")
    if precision == "16-mixed":
        kw["plugins"] = [_fp16_plugin()]
    else:
        kw["precision"] = precision
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=kw.pop("strategy", "ddp"),
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=True,
        **kw,
    )


def _loss_scaling_runs(rank: int, tmp: str) -> dict:
    from lightning_v17.callbacks import DynamicLossScaling, LossScaleError

    out: dict = {}
    # Run A: inf on rank 0 only at batch 2; growth_interval=3.
    dls = DynamicLossScaling(init_scale=1024.0, growth_interval=3, max_consecutive_skips=4)
    rec = _recorder()
    trainer = _trainer([dls, rec], max_steps=6, gradient_clip_val=CLIP)
    trainer.fit(_make_module(inf_at={2: 0}))
    out["A"] = rec.rows
    ckpt = os.path.join(tmp, "dls.ckpt")
    trainer.save_checkpoint(ckpt)
    out["A_state"] = dict(dls.tracker.state_dict())

    # Run B: resume from A's checkpoint; the counters must continue exactly.
    dls_b = DynamicLossScaling(init_scale=1024.0, growth_interval=3, max_consecutive_skips=4)
    rec_b = _recorder()
    trainer_b = _trainer([dls_b, rec_b], max_steps=9)
    trainer_b.fit(_make_module(), ckpt_path=ckpt)
    out["B"] = rec_b.rows
    out["B_state"] = dict(dls_b.tracker.state_dict())

    # Run C: a loss that is NaN every step must raise within max_consecutive_skips steps, naming the cause.
    dls_c = DynamicLossScaling(init_scale=2.0**16, max_consecutive_skips=4)
    rec_c = _recorder()
    trainer_c = _trainer([dls_c, rec_c], max_steps=50)
    try:
        trainer_c.fit(_make_module(nan_loss=True))
        out["C_error"] = None
    except LossScaleError as err:
        out["C_error"] = str(err)
    out["C_batches"] = rec_c.batches_started
    out["C_global_step"] = trainer_c.global_step
    return out


SEQ = 64
MICRO_BATCH = 4


def _token_loader(vocab: int, n: int = 512):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (n, SEQ + 1), generator=g)
    rows = [{"input_ids": r[:-1].clone(), "labels": r[1:].clone()} for r in ids]
    return torch.utils.data.DataLoader(rows, batch_size=MICRO_BATCH)


def _monitor_run(rank: int) -> dict:
    """Run D: the tiny reference Llama in fp32 under ddp with ThroughputMonitor, MemoryBuckets and a balanced
    StragglerDetector."""
    from lightning_v17.callbacks import MemoryBuckets, StragglerDetector, ThroughputMonitor

    from lightning_v17.models import LlamaLM

    L = _lightning()

    class BlockingSaver(L.Callback):
        """Stands in for a checkpoint callback: blocks the loop every 10th batch and exposes the cumulative blocked
        seconds under the ThroughputMonitor contract (``checkpoint_blocking_s``)."""

        checkpoint_blocking_s = 0.0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx % 10 == 9:
                t0 = time.perf_counter()
                time.sleep(0.05)
                self.checkpoint_blocking_s += time.perf_counter() - t0

    seen_reports = []
    saver = BlockingSaver()
    tput = ThroughputMonitor(log_every_n_steps=10)
    mem = MemoryBuckets(every_n_steps=10)
    strag = StragglerDetector(every_n_steps=10, action=seen_reports.append)
    model = LlamaLM(model="tiny", model_overrides={"max_seq_len": SEQ}, warmup_steps=0)
    trainer = _trainer([tput, mem, strag, saver], max_steps=42, precision="32-true")
    trainer.fit(model, train_dataloaders=_token_loader(model.config.vocab_size))
    num_params = sum(p.numel() for p in model.parameters())
    last = tput.last
    return {
        "num_params": num_params,
        "flops_per_token": tput.tracker.flops_per_token,
        "flops_source": tput.flops_source,
        "peak": tput.resolved_peak_flops_per_s,
        "peak_source": tput.peak_source,
        "tput": None if last is None else last.__dict__,
        "tput_windows": len(tput.history),
        "ckpt_s_seen": sum(h.checkpoint_share * h.seconds for h in tput.history),
        "ckpt_s_total": saver.checkpoint_blocking_s,
        "measured": mem.measured.__dict__,
        "planned": mem.planned.__dict__,
        "act_ws": mem.act_ws_peak_bytes,
        "chart": mem.chart(),
        "straggler_windows": len(strag.reports),
        "straggler_flags": [r.flagged for r in strag.reports if r.flagged],
        "straggler_max_ratio": max(x.ratio for r in strag.reports for x in r.ranks),
        "straggler_action_calls": len(seen_reports),
        "straggler_table": strag.reports[-1].table(),
    }


def _v17_zero3():
    from lightning_v17 import V17Strategy

    return V17Strategy(zero_stage=3)


def _straggler_run(rank: int, strategy: object = "ddp") -> dict:
    """Run E: rank 1 sleeps 50 ms per batch (test-only knob); action="raise" must fire in window `patience`."""
    from lightning_v17.callbacks import StragglerDetected, StragglerDetector
    from lightning_v17.callbacks.straggler import TEST_SLEEP_ENV

    os.environ[TEST_SLEEP_ENV] = "1:0.05"
    try:
        strag = StragglerDetector(every_n_steps=5, patience=2, action="raise", warmup_steps=2)
        rec = _recorder()
        trainer = _trainer([strag, rec], max_steps=40, precision="32-true", strategy=strategy)
        try:
            trainer.fit(_make_module())
            return {"raised": None}
        except StragglerDetected as err:
            return {
                "raised": list(err.ranks),
                "hosts": list(err.hosts),
                "window": err.report.window,
                "batches": rec.batches_started,
                "message": str(err),
                "ratios": [x.ratio for x in err.report.ranks],
            }
    finally:
        del os.environ[TEST_SLEEP_ENV]


def _worker(rank: int, world_size: int, tmp: str) -> dict:
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    return {
        "loss_scaling": _loss_scaling_runs(rank, tmp),
        "monitors": _monitor_run(rank),
        "straggler": _straggler_run(rank),
        "straggler_v17": _straggler_run(rank, _v17_zero3()),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("cb_ddp"))
    return spawn(_worker, world_size=2, args=(tmp,), init_process_group=False, timeout=240)


def _lr(global_step: int) -> float:
    return BASE_LR * LR_DECAY**global_step


def test_loss_scaling_inf_on_one_rank_skips_everywhere(results):
    for rank, res in enumerate(results):
        rows = res["loss_scaling"]["A"]
        # batch: 0 1 2(inf on rank 0) 3 4 5 6 -- hand-applied design §13.2 with growth_interval=3, S0=1024.
        assert [r["global_step"] for r in rows] == [1, 2, 2, 3, 4, 5, 6], rank
        assert [r["scale"] for r in rows] == [1024, 1024, 512, 512, 512, 1024, 1024], rank
        assert [r["skipped"] for r in rows] == [0, 0, 1, 1, 1, 1, 1], rank
        # the skipped batch changed neither the weights nor the LR
        assert rows[2]["wsum"] == rows[1]["wsum"], rank
        assert rows[3]["wsum"] != rows[2]["wsum"], rank
        for r in rows:  # LR advanced once per *applied* step only (tolerance: float64 rounding)
            assert math.isclose(r["lr"], _lr(r["global_step"]), rel_tol=1e-12), (rank, r)
    # both ranks hold identical weights after the skip (no rank stepped alone)
    assert [r["wsum"] for r in results[0]["loss_scaling"]["A"]] == [r["wsum"] for r in results[1]["loss_scaling"]["A"]]


def test_loss_scaling_unscales_before_clipping(results):
    """SGD without momentum: |w_after - w_before| = lr * min(|g|, clip) with |g| the *unscaled* norm. Had clipping
    seen scaled grads (S=1024 times larger) the update would be lr * clip / S or the norm would be S times off."""
    clipped = 0
    for res in results:
        for r in res["loss_scaling"]["A"]:
            c = r["clip"]
            if r["skipped"] and c["update_norm"] == 0.0:
                continue  # the skipped step moved nothing (checked above)
            expected = c["lr"] * min(c["norm"], CLIP)
            # tolerance: clip_grad_norm_'s +1e-6 in its coefficient and fp32 weights: 1e-4 relative
            assert math.isclose(c["update_norm"], expected, rel_tol=1e-4), c
            clipped += c["norm"] > CLIP
    assert clipped > 0, "no step was clipped: lower CLIP so the test exercises clipping"


def test_loss_scaling_resume_continues_exactly(results):
    for rank, res in enumerate(results):
        ls = res["loss_scaling"]
        assert ls["A_state"] == {
            "scale": 1024.0,
            "good_steps": 1,
            "hysteresis_left": 1,
            "total_steps": 7,
            "skipped_steps": 1,
            "consecutive_skips": 0,
        }, rank
        rows = ls["B"]
        # resumed at global_step 6 with n_ok=1: two more clean steps reach n_ok=3 -> scale doubles at step 8.
        assert [r["global_step"] for r in rows] == [7, 8, 9], rank
        assert [r["scale"] for r in rows] == [1024, 2048, 2048], rank
        for r in rows:
            assert math.isclose(r["lr"], _lr(r["global_step"]), rel_tol=1e-12), (rank, r)
        assert ls["B_state"]["total_steps"] == 10 and ls["B_state"]["skipped_steps"] == 1, rank


def test_loss_scaling_persistent_nan_raises_clear_error(results):
    for rank, res in enumerate(results):
        ls = res["loss_scaling"]
        assert ls["C_error"] is not None, f"rank {rank}: persistent NaN did not raise"
        assert "consecutive" in ls["C_error"] and "loss itself is NaN" in ls["C_error"], ls["C_error"]
        assert ls["C_batches"] == 4, rank  # max_consecutive_skips=4
        assert ls["C_global_step"] == 0, rank


def test_throughput_mfu_under_ddp(results):
    from lightning_v17.planner.model import get_preset

    for rank, res in enumerate(results):
        m = res["monitors"]
        assert m["flops_source"] == "planner:flops_per_token(shape)" and m["peak_source"] == "cpu-matmul-probe:float32"
        # FLOPs/token by hand for tiny at seq 64 (Narayanan Eq. 3 generalized, as the README states):
        # 3 * [L * (2 * W_block + 4 * s * h) + 2 * V * h], W_block = 2h^2 + 2h*h_kv + 3 h ffn
        t = get_preset("tiny")
        h_kv = t.hidden * t.kv_heads // t.heads
        w_block = 2 * t.hidden**2 + 2 * t.hidden * h_kv + 3 * t.hidden * t.ffn
        expected = 3 * (t.layers * (2 * w_block + 4 * SEQ * t.hidden) + 2 * t.vocab * t.hidden)
        assert m["flops_per_token"] == expected
        s = m["tput"]
        assert m["tput_windows"] == 4  # 42 batches - 2 warm-up = 40 timed = 4 windows of 10
        assert s["tokens_per_s"] > 0 and math.isclose(s["samples_per_s"] * SEQ, s["tokens_per_s"], rel_tol=1e-9)
        assert math.isclose(s["flops_per_s"], s["tokens_per_s"] * expected, rel_tol=1e-9)
        assert math.isclose(s["mfu"], s["flops_per_s"] / m["peak"], rel_tol=1e-9)
        assert 0.005 < s["mfu"] < 1.0, s  # a real, not degenerate, utilization
        shares = s["data_wait_share"] + s["fwd_bwd_share"] + s["optimizer_share"] + s["checkpoint_share"]
        assert math.isclose(shares, 1.0, rel_tol=1e-9) and s["fwd_bwd_share"] > 0.3, s
        # the saver blocked after batches 9, 19, 29, 39; each block is booked to the next batch's sample (10, 20, 30,
        # 40), all inside the 4 timed windows (batches 2-41), so the monitor's checkpoint time is the saver's total
        assert m["ckpt_s_total"] >= 4 * 0.05
        assert math.isclose(m["ckpt_s_seen"], m["ckpt_s_total"], rel_tol=1e-9), m
        print(
            f"rank {rank}: tiny Llama (seq {SEQ}) MFU {s['mfu']:.3f}, {s['tokens_per_s']:.0f} tokens/s, "
            f"{s['flops_per_s'] / 1e9:.2f} GFLOP/s of peak {m['peak'] / 1e9:.1f}"
        )


def test_memory_buckets_match_planner_under_ddp(results):
    for rank, res in enumerate(results):
        m = res["monitors"]
        n = m["num_params"]
        # ZeRO stage 0 (DDP), fp32 AdamW by hand: 4 B params, 4 B grads, 8 B moments per parameter
        assert m["planned"] == {"param": 4 * n, "grad": 4 * n, "optimizer": 8 * n, "total": 16 * n}
        for bucket in ("param", "grad", "optimizer"):
            assert abs(m["measured"][bucket] - m["planned"][bucket]) <= 0.05 * m["planned"][bucket], (bucket, m)
        assert m["act_ws"] >= 0
        assert "planned" in m["chart"] and "measured" in m["chart"]
    print(results[0]["monitors"]["chart"])


def test_straggler_balanced_run_flags_nobody(results):
    for res in results:
        m = res["monitors"]
        assert m["straggler_windows"] == 3  # (42 batches - 5 warm-up) // 10
        assert m["straggler_flags"] == [] and m["straggler_action_calls"] == 0, m["straggler_table"]
        print(f"balanced run: max ratio to the other rank {m['straggler_max_ratio']:.2f} (threshold 1.2)")


@pytest.mark.parametrize("run", ["straggler", "straggler_v17"])
def test_straggler_injected_sleep_flagged_within_patience(results, run):
    """Under Lightning's "ddp" and under V17Strategy(zero_stage=3)."""
    for rank, res in enumerate(results):
        st = res[run]
        assert st["raised"] == [1], st  # both ranks raise together: same gathered data, same decision
        assert st["window"] == 2, st  # patience=2: flagged in the 2nd window, not later
        assert st["batches"] == 2 + 2 * 5, st  # 2 warm-up batches + 2 windows of 5
        assert st["ratios"][1] > 1.2 > st["ratios"][0]
        assert "rank" in st["message"] and "host" in st["message"]
