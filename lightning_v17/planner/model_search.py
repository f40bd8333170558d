"""The largest model whose every tier fits (device per rank; host and NVMe per node) with a plan's layout held
fixed (``v17 plan --max-model``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_v17.planner.capacity import capacity_checks
from lightning_v17.planner.plan import ModelSpec, Plan, memory_for


@dataclass(frozen=True)
class MaxModel:
    """The largest model that fits per rank with the plan's layout held fixed."""

    params: int
    layers: int | None
    gpu_bytes: int
    bounded: bool = True  # False: the search's cap (10^15 parameters) still fits every tier
    #: the tier that stops the next size: "device", "host" or "nvme" (None when unbounded)
    limited_by: str | None = "device"


def max_model(plan: Plan) -> MaxModel | None:
    """Largest model of the plan's architecture whose device, host and NVMe bytes all fit, with the same layout.

    With a shape, the width (hidden, heads, ffn, vocab) is kept and the depth grows (bisection over layers,
    every tier's bytes are monotonic in L; pp stays, so a stage gets more layers). With ``params`` only, Ψ grows
    (model state + temporaries, no activations; resolution Ψ/1e6). Each size is checked as :attr:`Plan.fits` checks
    the plan (:func:`~lightning_v17.planner.capacity.capacity_checks`): per rank on the device, times the node's
    ranks on the host and the NVMe. Returns None if even the smallest model (one layer per stage, or 1 parameter)
    does not fit; with ``params`` only, a model of 10^15 parameters that still fits is reported ``bounded=False``.
    """
    lay, cluster = plan.layout, plan.cluster

    def check(model: ModelSpec) -> tuple[int, str | None]:
        tiers = memory_for(model, lay).tiers
        failed = [c.tier for c in capacity_checks(tiers, cluster, gpus=lay.gpus) if not c.fits]
        return tiers.gpu, (failed[0] if failed else None)

    if plan.model.shape is not None:
        base = plan.model.shape

        def at(layers: int) -> tuple[int, str | None]:
            return check(ModelSpec(shape=replace(base, layers=layers)))

        lo = lay.pp
        if at(lo)[1] is not None:
            return None
        hi = lo * 2
        while at(hi)[1] is None and hi < 10**6:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if at(mid)[1] is None else (lo, mid)
        shape = replace(base, layers=lo)
        return MaxModel(params=shape.num_params, layers=lo, gpu_bytes=at(lo)[0], limited_by=at(hi)[1])

    def at_p(params: int) -> tuple[int, str | None]:
        return check(ModelSpec(params=params))

    if at_p(1)[1] is not None:
        return None
    cap = 10**15
    if at_p(cap)[1] is None:
        return MaxModel(params=cap, layers=None, gpu_bytes=at_p(cap)[0], bounded=False, limited_by=None)
    lo, hi = 1, 2
    while at_p(hi)[1] is None:
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 10**6):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if at_p(mid)[1] is None else (lo, mid)
    return MaxModel(params=lo, layers=None, gpu_bytes=at_p(lo)[0], limited_by=at_p(hi)[1])


__all__ = ["MaxModel", "max_model"]
