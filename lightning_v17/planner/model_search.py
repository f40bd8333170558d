"""The largest model that fits one rank's usable memory with a plan's layout held fixed (``v17 plan --max-model``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_v17.planner.plan import ModelSpec, Plan, memory_for


@dataclass(frozen=True)
class MaxModel:
    """The largest model that fits per rank with the plan's layout held fixed."""

    params: int
    layers: int | None
    gpu_bytes: int
    bounded: bool = True  # False: nothing that grows with the model stays on the device (all offloaded)


def max_model(plan: Plan) -> MaxModel | None:
    """Largest model of the plan's architecture that fits one rank's memory with the same layout.

    With a shape, the width (hidden, heads, ffn, vocab) is kept and the depth grows (bisection over layers,
    memory is monotonic in L; pp stays, so a stage gets more layers). With ``params`` only, Ψ grows (model state +
    temporaries, no activations). Returns None if even the smallest model (one layer per stage, or 1 parameter)
    does not fit; with ``params`` only, offloading can leave nothing on the device that grows with Ψ, and then
    the result is ``bounded=False`` (device memory sets no limit).
    """
    budget = plan.cluster.usable_memory_bytes
    lay = plan.layout
    if plan.model.shape is not None:
        base = plan.model.shape

        def gpu_bytes(layers: int) -> int:
            return memory_for(ModelSpec(shape=replace(base, layers=layers)), lay).tiers.gpu

        lo = lay.pp
        if gpu_bytes(lo) > budget:
            return None
        hi = lo * 2
        while gpu_bytes(hi) <= budget and hi < 10**6:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if gpu_bytes(mid) <= budget else (lo, mid)
        shape = replace(base, layers=lo)
        return MaxModel(params=shape.num_params, layers=lo, gpu_bytes=gpu_bytes(lo))

    def gpu_bytes_p(params: int) -> int:
        return memory_for(ModelSpec(params=params), lay).tiers.gpu

    if gpu_bytes_p(1) > budget:
        return None
    cap = 10**15
    if gpu_bytes_p(cap) <= budget:
        return MaxModel(params=cap, layers=None, gpu_bytes=gpu_bytes_p(cap), bounded=False)
    lo, hi = 1, 2
    while gpu_bytes_p(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 10**6):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if gpu_bytes_p(mid) <= budget else (lo, mid)
    return MaxModel(params=lo, layers=None, gpu_bytes=gpu_bytes_p(lo))


__all__ = ["MaxModel", "max_model"]
