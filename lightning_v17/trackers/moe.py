"""Expert load statistics of mixture-of-experts layers and the router-collapse rule (pure Python, no process group).

The Lightning adapter (:class:`lightning_v17.callbacks.ExpertLoadMonitor`) sums each MoE layer's per-expert load of
one optimizer step over the data-parallel ranks and hands the summed vectors to :meth:`ExpertLoadTracker.observe`,
which returns an :class:`ExpertLoadReport`: per layer and over all layers, as Megatron-core's MoE logging does with
its per-layer token counts,

- ``imbalance`` = max load / mean load: 1.0 is perfect balance, E means every assignment went to one expert. It is
  1 + MaxVio, the balance measure of the auxiliary-loss-free balancing paper (Wang 2024, the method DeepSeek-V3 uses);
- ``cv``: the coefficient of variation of the loads (population standard deviation / mean), the quantity whose
  square Shazeer 2017 §4 penalises as the importance loss;
- ``idle_frac``: the fraction of experts that received no assignment;
- ``dropped`` and ``dropped_frac``: assignments dropped by an expert capacity limit (Switch, Fedus 2022 §2.2), and
  their fraction of all assignments (routed + dropped);
- ``top_share``: the fraction of the layer's *tokens* routed to its busiest expert, ``k * max load / (routed +
  dropped)`` for top-k routing. Every token makes k assignments to k distinct experts, so one expert can receive at
  most one k-th of the assignments but all of the tokens; the token share is what reaches 1.0 when a router
  collapses, whatever k.

Collapse rule: a layer whose ``top_share`` exceeds ``collapse_fraction`` in ``patience`` consecutive observations is
reported once (:class:`CollapseEvent`); an observation at or below the fraction resets its streak. Under a capacity
limit the busiest expert is capped at its capacity, so a collapse there shows as a high ``dropped_frac`` as well.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_v17.config.errors import V17ConfigError

__all__ = ["CollapseEvent", "ExpertLoadReport", "ExpertLoadStats", "ExpertLoadTracker", "load_stats"]


def _floats(values: Any) -> list[float]:
    """A load vector (list, tuple, or anything with ``tolist()`` such as a tensor) as a list of floats."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, (int, float)):
        values = [values]
    return [float(v) for v in values]


@dataclass(frozen=True)
class ExpertLoadStats:
    """One MoE layer's load over one observation (counts are (token, slot) assignments).

    Attributes:
        load: the assignments routed to each expert (after capacity dropping), E entries.
        dropped: the assignments dropped by the capacity limit.
        experts_per_token: k of the layer's top-k routing.
        routed: ``sum(load)``.
        imbalance: max load / mean load (1.0: balanced; 0.0 when nothing was routed).
        cv: population standard deviation of the loads / their mean (0.0 when nothing was routed).
        idle_frac: the fraction of the E experts with no assignment.
        dropped_frac: ``dropped / (routed + dropped)`` (0.0 when there was no assignment at all).
        top_expert: the index of the busiest expert (the first one on a tie).
        top_share: the fraction of the layer's tokens routed to ``top_expert``: ``k * max(load) / (routed +
            dropped)``, in [0, 1].
    """

    load: tuple[float, ...]
    dropped: float
    experts_per_token: int
    routed: float
    imbalance: float
    cv: float
    idle_frac: float
    dropped_frac: float
    top_expert: int
    top_share: float


def load_stats(load: Any, dropped: float = 0.0, *, experts_per_token: int = 1) -> ExpertLoadStats:
    """The statistics of one layer (see the module docstring for the definitions).

    Args:
        load: the per-expert routed assignments, E >= 1 non-negative numbers (a list, a tuple or a tensor).
        dropped: the assignments the capacity limit dropped.
        experts_per_token: the layer's k (top-k routing), >= 1.

    Raises:
        V17ConfigError: an empty or negative load vector, a negative ``dropped``, a ``experts_per_token`` < 1.
    """
    xs = _floats(load)
    dropped = float(dropped)
    if not xs:
        raise V17ConfigError("load is empty; pass one count per expert (num_experts >= 1)")
    if min(xs) < 0 or dropped < 0:
        raise V17ConfigError(f"load={xs} and dropped={dropped} are assignment counts and must be >= 0")
    if not isinstance(experts_per_token, int) or experts_per_token < 1:
        raise V17ConfigError(f"experts_per_token={experts_per_token!r} must be an integer >= 1")
    n, routed = len(xs), sum(xs)
    mean, peak = routed / n, max(xs)
    if routed > 0:
        imbalance = peak / mean
        cv = math.sqrt(sum((x - mean) ** 2 for x in xs) / n) / mean
    else:
        imbalance = cv = 0.0
    total = routed + dropped
    return ExpertLoadStats(
        load=tuple(xs), dropped=dropped, experts_per_token=experts_per_token, routed=routed, imbalance=imbalance,
        cv=cv, idle_frac=sum(1 for x in xs if x == 0) / n, dropped_frac=dropped / total if total else 0.0,
        top_expert=xs.index(peak), top_share=min(1.0, experts_per_token * peak / total) if total else 0.0,
    )  # fmt: skip


@dataclass(frozen=True)
class CollapseEvent:
    """A layer reported as collapsed: its busiest expert took more than ``collapse_fraction`` of its tokens in
    ``checks`` consecutive observations.

    Attributes:
        index: the layer's position in the observation.
        name: the layer's name (its module name when the callback reports it).
        expert: the busiest expert in the reporting observation.
        share: that expert's token share in the reporting observation.
        checks: the consecutive collapsed observations (the tracker's ``patience``).
    """

    index: int
    name: str
    expert: int
    share: float
    checks: int


@dataclass(frozen=True)
class ExpertLoadReport:
    """The statistics of every layer in one observation, their aggregates, and the layers it reported collapsed.

    Attributes:
        names: one name per layer.
        layers: one :class:`ExpertLoadStats` per layer, in the same order.
        collapsed: the layers this observation reported (each layer at most once per tracker).
    """

    names: tuple[str, ...]
    layers: tuple[ExpertLoadStats, ...]
    collapsed: tuple[CollapseEvent, ...] = ()

    @property
    def imbalance_max(self) -> float:
        return max(s.imbalance for s in self.layers)

    @property
    def imbalance_mean(self) -> float:
        return sum(s.imbalance for s in self.layers) / len(self.layers)

    @property
    def dropped(self) -> float:
        """Dropped assignments summed over the layers."""
        return sum(s.dropped for s in self.layers)

    @property
    def dropped_frac(self) -> float:
        """Dropped over all assignments of all layers (each layer weighted by its assignments)."""
        total = sum(s.routed + s.dropped for s in self.layers)
        return self.dropped / total if total else 0.0

    def metrics(self, prefix: str = "moe", *, per_layer: bool = True) -> dict[str, float]:
        """Flat logging keys: ``{prefix}/imbalance_max|imbalance_mean|cv_max|cv_mean|idle_frac_max|idle_frac_mean|
        top_share_max|dropped|dropped_frac`` over all layers and, with ``per_layer``, ``{prefix}/layer{i}/
        imbalance|cv|idle_frac|top_share|dropped|dropped_frac`` for layer i of the observation."""
        n = len(self.layers)
        out = {
            f"{prefix}/imbalance_max": self.imbalance_max,
            f"{prefix}/imbalance_mean": self.imbalance_mean,
            f"{prefix}/cv_max": max(s.cv for s in self.layers),
            f"{prefix}/cv_mean": sum(s.cv for s in self.layers) / n,
            f"{prefix}/idle_frac_max": max(s.idle_frac for s in self.layers),
            f"{prefix}/idle_frac_mean": sum(s.idle_frac for s in self.layers) / n,
            f"{prefix}/top_share_max": max(s.top_share for s in self.layers),
            f"{prefix}/dropped": self.dropped,
            f"{prefix}/dropped_frac": self.dropped_frac,
        }
        if per_layer:
            for i, s in enumerate(self.layers):
                for key in ("imbalance", "cv", "idle_frac", "top_share", "dropped", "dropped_frac"):
                    out[f"{prefix}/layer{i}/{key}"] = getattr(s, key)
        return out


@dataclass
class ExpertLoadTracker:
    """Computes each observation's :class:`ExpertLoadReport` and applies the collapse rule across observations.

    Args:
        collapse_fraction: a layer's observation counts as collapsed when its busiest expert takes more than this
            fraction of the layer's tokens (``top_share``), in (0, 1).
        patience: consecutive collapsed observations before the layer is reported (once per layer), >= 1.

    Attributes:
        flagged: the names of the layers reported so far.
    """

    collapse_fraction: float = 0.5
    patience: int = 3
    flagged: set[str] = field(default_factory=set)
    _streak: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        f = self.collapse_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1:
            raise V17ConfigError(
                f"collapse_fraction={f!r} must be in (0, 1): one expert can take at most all (1.0) of a layer's "
                "tokens; 0.5 flags an expert that gets more than half of them"
            )
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 1:
            raise V17ConfigError(f"patience={self.patience!r} must be an integer >= 1 (consecutive checks)")

    def observe(self, loads: Sequence[Any], dropped: Sequence[float] | None = None, *,
                experts_per_token: Sequence[int] | int = 1, names: Sequence[str] | None = None) -> ExpertLoadReport:  # fmt: skip
        """One observation of every layer: the statistics, then the collapse rule.

        Args:
            loads: one per-expert load vector per layer (lists or tensors; layers may have different E).
            dropped: the dropped assignments per layer (None: none dropped).
            experts_per_token: k per layer, or one k for all layers.
            names: one name per layer, the key of the collapse streaks (None: ``layer0``, ``layer1``, ...).

        Raises:
            V17ConfigError: no layer, or ``dropped``/``experts_per_token``/``names`` not one per layer.
        """
        n = len(loads)
        if n == 0:
            raise V17ConfigError("loads is empty: pass one load vector per MoE layer")
        dropped = [0.0] * n if dropped is None else _floats(dropped)
        ks = [experts_per_token] * n if isinstance(experts_per_token, int) else list(experts_per_token)
        names = tuple(f"layer{i}" for i in range(n)) if names is None else tuple(names)
        for what, seq in (("dropped", dropped), ("experts_per_token", ks), ("names", names)):
            if len(seq) != n:
                raise V17ConfigError(f"{what} has {len(seq)} entries for {n} layers; give one per layer")
        layers = tuple(load_stats(lo, d, experts_per_token=k) for lo, d, k in zip(loads, dropped, ks))
        events = []
        for i, (name, s) in enumerate(zip(names, layers)):
            streak = self._streak.get(name, 0) + 1 if s.top_share > self.collapse_fraction else 0
            self._streak[name] = streak
            if streak >= self.patience and name not in self.flagged:
                self.flagged.add(name)
                events.append(CollapseEvent(index=i, name=name, expert=s.top_expert, share=s.top_share,
                                            checks=streak))  # fmt: skip
        return ExpertLoadReport(names=names, layers=layers, collapsed=tuple(events))

    def state_dict(self) -> dict[str, Any]:
        """The collapse streaks and the reported layers (plain Python, for a checkpoint)."""
        return {"streak": dict(self._streak), "flagged": sorted(self.flagged)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: a resumed run continues the streaks and does not report a layer again."""
        self._streak = {str(k): int(v) for k, v in state.get("streak", {}).items()}
        self.flagged = {str(n) for n in state.get("flagged", ())}
