"""Expert load statistics, the router-collapse rule (lightning_v17/trackers/moe.py) and the callback's counting
(callbacks/moe.py, driven by hand without a Trainer), against values computed by hand.

The scheduled loads below are shared with tests/dist/test_moe_monitor.py: two layers of 4 experts, each forward of a
:class:`FakeMoE` reports the next entry of its rank's schedule, and ``EXPECTED`` is what one optimizer step of two
micro-batches on each of two ranks must log, worked out by hand:

* layer 0 (k=1): rank 0 reports [3,1,0,0] then [1,1,2,0] with 1 dropped each, rank 1 [2,2,0,0] then [0,2,2,0]:
  summed [6,6,4,0], routed 16, dropped 2; mean 4 -> imbalance 6/4, deviations (2,2,0,-4) -> std sqrt(24/4),
  cv sqrt(6)/4; one idle expert of 4; dropped 2/18; top token share 1 * 6 / 18;
* layer 1 (k=2): rank 0 [1,1,1,1] twice, rank 1 (its router forced onto expert 0) [4,2,1,1] then [4,1,2,1]:
  summed [10,5,5,4], routed 24; mean 6 -> imbalance 10/6, deviations (4,-1,-1,-2) -> cv sqrt(22/4)/6; top token
  share 2 * 10 / 24 = 5/6 (a collapse above 0.5), though expert 0 has only 10/24 of the assignments.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from lightning_v17.callbacks import ExpertLoadMonitor, RouterCollapseError, RouterCollapseWarning
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from lightning_v17.config import V17ConfigError
from lightning_v17.trackers import ExpertLoadTracker, load_stats

#: SCHEDULE[layer][rank]: the (load, dropped) that the rank's successive training forwards report, cycled
SCHEDULE = {
    0: {0: [([3, 1, 0, 0], 1), ([1, 1, 2, 0], 1)], 1: [([2, 2, 0, 0], 0), ([0, 2, 2, 0], 0)]},
    1: {0: [([1, 1, 1, 1], 0), ([1, 1, 1, 1], 0)], 1: [([4, 2, 1, 1], 0), ([4, 1, 2, 1], 0)]},
}
K = {0: 1, 1: 2}
L0 = {"imbalance": 1.5, "cv": math.sqrt(6) / 4, "idle_frac": 0.25, "top_share": 1 / 3, "dropped": 2.0,
      "dropped_frac": 2 / 18}  # fmt: skip
L1 = {"imbalance": 10 / 6, "cv": math.sqrt(5.5) / 6, "idle_frac": 0.0, "top_share": 5 / 6, "dropped": 0.0,
      "dropped_frac": 0.0}  # fmt: skip
EXPECTED = {
    **{f"moe/layer0/{k}": v for k, v in L0.items()}, **{f"moe/layer1/{k}": v for k, v in L1.items()},
    "moe/imbalance_max": 10 / 6, "moe/imbalance_mean": (1.5 + 10 / 6) / 2, "moe/cv_max": math.sqrt(6) / 4,
    "moe/cv_mean": (math.sqrt(6) / 4 + math.sqrt(5.5) / 6) / 2, "moe/idle_frac_max": 0.25,
    "moe/idle_frac_mean": 0.125, "moe/top_share_max": 5 / 6, "moe/dropped": 2.0, "moe/dropped_frac": 2 / 42,
}  # fmt: skip


class FakeMoE(torch.nn.Module):
    """A duck-typed MoE layer (``last_load``, ``last_dropped``, ``num_experts``, ``experts_per_token``): a Linear
    whose training forwards report the entries of ``schedule`` in turn. A forward recomputed in backward reports
    the *next* entry without consuming it, so counting a recompute changes the sums."""

    def __init__(self, schedule: list[tuple[list[int], int]], experts_per_token: int, width: int = 8) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.schedule, self.calls = schedule, 0
        self.num_experts, self.experts_per_token = 4, experts_per_token
        self.last_load = torch.zeros(4)
        self.last_dropped = torch.zeros((), dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        load, dropped = self.schedule[self.calls % len(self.schedule)]
        self.last_load, self.last_dropped = torch.tensor(load, dtype=torch.float32), torch.tensor(dropped)
        if self.training and torch._C._current_graph_task_id() == -1:
            self.calls += 1
        return self.proj(x)


class FakeNet(torch.nn.Module):
    """Two FakeMoE layers (``layers.0``, ``layers.1``); the second runs under activation checkpointing, its
    forward (hooks included) rerun in backward."""

    def __init__(self, schedules: dict[int, list], recompute: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(FakeMoE(schedules[i], K[i]) for i in (0, 1))
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        if not self.recompute:
            return self.layers[1](x)
        # the whole recompute, forward hooks included (by default torch stops it after the last saved tensor,
        # which can come before the hooks, as a reentrant checkpoint never does)
        with set_checkpoint_early_stop(False):
            return checkpoint(self.layers[1], x, use_reentrant=False)


# ------------------------------------------------------------------------------------------- pure statistics


def test_statistics_by_hand() -> None:
    s = load_stats([6, 6, 4, 0], dropped=2)
    got = {k: getattr(s, k) for k in L0}
    assert got == pytest.approx(L0) and (s.routed, s.top_expert) == (16.0, 0)
    assert load_stats(torch.tensor([6.0, 6.0, 4.0, 0.0]), torch.tensor(2)) == s  # tensors are taken as well
    even = load_stats([3, 3, 3, 3])
    assert (even.imbalance, even.cv, even.idle_frac, even.top_share) == (1.0, 0.0, 0.0, 0.25)


def test_top_share_counts_tokens_not_assignments() -> None:
    s = load_stats([10, 5, 5, 4], experts_per_token=2)
    assert {k: getattr(s, k) for k in L1} == pytest.approx(L1)
    assert max(s.load) / s.routed == pytest.approx(10 / 24)  # the assignment share stays below 1/k = 0.5
    assert load_stats([8, 8, 0, 0], experts_per_token=2).top_share == 1.0  # every token used expert 0 (and 1)


def test_layers_with_no_assignment() -> None:
    none = load_stats([0, 0, 0, 0])
    assert (none.imbalance, none.cv, none.idle_frac, none.top_share, none.dropped_frac) == (0.0, 0.0, 1.0, 0.0, 0.0)
    assert load_stats([0, 0], dropped=4).dropped_frac == 1.0


def test_report_aggregates_and_keys() -> None:
    loads = [[6, 6, 4, 0], [10, 5, 5, 4]]
    report = ExpertLoadTracker().observe(loads, [2, 0], experts_per_token=[1, 2], names=["a", "b"])
    assert report.metrics() == pytest.approx(EXPECTED)
    assert sorted(report.metrics(per_layer=False)) == sorted(k for k in EXPECTED if "/layer" not in k)
    assert report.names == ("a", "b") and report.collapsed == ()


def test_collapse_needs_patience_resets_and_is_reported_once_per_layer() -> None:
    t = ExpertLoadTracker(collapse_fraction=0.5, patience=3)
    bad, good, edge = [9, 1, 0, 0], [3, 3, 2, 2], [5, 3, 1, 1]  # token shares 0.9, 0.3 and exactly 0.5
    seen = [t.observe([lo], names=["a"]).collapsed for lo in (bad, bad, good, bad, edge, bad, bad, bad, bad)]
    assert [len(c) for c in seen] == [0, 0, 0, 0, 0, 0, 0, 1, 0]  # 0.5 is not "more than" 0.5: it resets too
    (event,) = seen[7]
    assert (event.index, event.name, event.expert, event.share, event.checks) == (0, "a", 0, 0.9, 3)
    two = ExpertLoadTracker(patience=2)
    reports = [two.observe([good, bad], names=["x", "y"]) for _ in range(3)]
    assert [[e.name for e in r.collapsed] for r in reports] == [[], ["y"], []] and two.flagged == {"y"}


def test_state_dict_continues_the_streaks() -> None:
    t = ExpertLoadTracker(patience=3)
    for _ in range(2):
        t.observe([[9, 1, 0, 0]], names=["a"])
    resumed = ExpertLoadTracker(patience=3)
    resumed.load_state_dict(t.state_dict())
    assert [e.name for e in resumed.observe([[9, 1, 0, 0]], names=["a"]).collapsed] == ["a"]
    again = ExpertLoadTracker(patience=1)
    again.load_state_dict(resumed.state_dict())
    assert again.observe([[9, 1, 0, 0]], names=["a"]).collapsed == ()  # reported before the restart


@pytest.mark.parametrize(("make", "match"), [
    (lambda: ExpertLoadMonitor(every_n_steps=0), "every_n_steps=0"),
    (lambda: ExpertLoadMonitor(every_n_steps=True), "every_n_steps=True"),
    (lambda: ExpertLoadMonitor(collapse_fraction=1.0), "collapse_fraction=1.0"),
    (lambda: ExpertLoadMonitor(collapse_fraction=0), "collapse_fraction=0"),
    (lambda: ExpertLoadMonitor(patience=0), "patience=0"),
    (lambda: ExpertLoadMonitor(raise_on_collapse="yes"), "raise_on_collapse='yes'"),
    (lambda: ExpertLoadMonitor(per_layer=1), "per_layer=1"),
    (lambda: load_stats([]), "load is empty"),
    (lambda: load_stats([1, -1]), "must be >= 0"),
    (lambda: load_stats([1], experts_per_token=0), "experts_per_token=0"),
    (lambda: ExpertLoadTracker().observe([[1, 2]], [0, 0]), "dropped has 2 entries for 1 layers"),
])  # fmt: skip
def test_bad_values_are_refused_with_the_option_named(make, match) -> None:
    with pytest.raises(V17ConfigError, match=match):
        make()


# ------------------------------------------------------------------------ the callback, without a Trainer


class _Module(torch.nn.Module):
    """A LightningModule stand-in: the model plus ``log_dict`` capture."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net, self.logged = net, []

    def log_dict(self, metrics: dict, **kwargs) -> None:
        self.logged.append(dict(metrics))


def _trainer(tp: int | None = None) -> SimpleNamespace:
    strategy = SimpleNamespace(root_device=torch.device("cpu"))
    if tp is not None:
        strategy.mesh = SimpleNamespace(spec=SimpleNamespace(tp=tp))
    return SimpleNamespace(strategy=strategy, global_step=0, log_every_n_steps=1, is_global_zero=True)


def _steps(monitor: ExpertLoadMonitor, trainer: SimpleNamespace, module: _Module, steps: int) -> None:
    """``steps`` optimizer steps of 4 micro-batches each (both ranks' two micro-batches, one after the other, so one
    process sees the sums of the 2-rank run), with an evaluation forward in between that must not count."""
    monitor.on_train_start(trainer, module)
    for _ in range(steps):
        for micro in range(4):
            module.net(torch.randn(2, 8)).sum().backward()
            trainer.global_step += micro == 3  # the optimizer steps after the 4th backward, before the hook
            monitor.on_train_batch_end(trainer, module, None, None, micro)
            if micro == 1:
                module.eval()
                module.net(torch.randn(2, 8))
                module.train()


#: layer 1 routes top-2 of 4 experts, where balance already gives each expert half of the tokens: the callback says so
EDGE = "ignore:ExpertLoadMonitor.collapse_fraction=0.5. cannot tell a collapse from balance"


def _both_ranks() -> dict[int, list]:
    return {i: SCHEDULE[i][0] + SCHEDULE[i][1] for i in (0, 1)}


@pytest.mark.filterwarnings(EDGE)
def test_callback_counts_every_micro_batch_once_and_logs_the_sums() -> None:
    monitor, trainer = ExpertLoadMonitor(every_n_steps=1), _trainer()
    module = _Module(FakeNet(_both_ranks()))
    _steps(monitor, trainer, module, steps=2)
    assert len(module.logged) == 2  # once per optimizer step, not per micro-batch
    for logged in module.logged:  # the counts restart at each step
        assert logged == pytest.approx(EXPECTED)
    assert monitor.last.names == ("net.layers.0", "net.layers.1")
    monitor.teardown(trainer, module, "fit")
    assert not module.net.layers[0]._forward_hooks


@pytest.mark.filterwarnings(EDGE)
def test_callback_checks_on_its_own_steps_and_divides_tensor_parallel_replicas() -> None:
    monitor, trainer = ExpertLoadMonitor(every_n_steps=2, per_layer=False), _trainer(tp=2)
    module = _Module(FakeNet(_both_ranks()))
    _steps(monitor, trainer, module, steps=4)
    assert len(module.logged) == 2  # steps 2 and 4
    assert module.logged[0]["moe/dropped"] == 1.0  # the counts of tp=2 ranks that routed the same tokens, halved
    assert module.logged[0]["moe/imbalance_max"] == pytest.approx(10 / 6) and "moe/layer0/cv" not in module.logged[0]


@pytest.mark.filterwarnings(EDGE)
def test_callback_warns_once_then_raises_when_asked() -> None:
    monitor, trainer = ExpertLoadMonitor(every_n_steps=1, patience=3), _trainer()
    module = _Module(FakeNet(_both_ranks()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(monitor, trainer, module, steps=5)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RouterCollapseWarning)]
    assert any("cannot tell a collapse from balance" in str(w.message) for w in caught)  # k/E = 0.5 in layer 1
    assert len(msgs) == 1, msgs
    for needed in ("layer 1 (net.layers.1)", "expert 0", "83%", "aux_loss_coef", "expert_bias_rate", "learning rate"):
        assert needed in msgs[0], msgs[0]
    loud, trainer = ExpertLoadMonitor(every_n_steps=1, patience=2, raise_on_collapse=True), _trainer()
    with pytest.raises(RouterCollapseError, match="net.layers.1") as err:
        _steps(loud, trainer, _Module(FakeNet(_both_ranks())), steps=3)
    assert trainer.global_step == 2 and err.value.report.collapsed[0].share == pytest.approx(5 / 6)


def test_layer_i_is_the_ith_module_in_natural_name_order() -> None:
    net = torch.nn.ModuleList(FakeMoE([([i + 1, 0, 0, 0], 0)], experts_per_token=1) for i in range(11))
    module, monitor, trainer = _Module(net), ExpertLoadMonitor(every_n_steps=1), _trainer()
    monitor.on_train_start(trainer, module)
    for layer in net:
        layer(torch.randn(2, 8))
    trainer.global_step = 1
    monitor.on_train_batch_end(trainer, module, None, None, 0)
    assert monitor.last.names == tuple(f"net.{i}" for i in range(11))  # net.10 last, not after net.1
    assert [s.routed for s in monitor.last.layers] == [float(i + 1) for i in range(11)]
