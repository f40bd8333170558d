"""The tests' shorthand for V17Strategy: ``v17(**flat)`` takes the flat option names and builds the policies.

Many tests describe a strategy as one dict of options (``{"pp": 2, "zero_stage": 1, "microbatches": 4}``), a
table row. ``v17`` translates the flat names into the policy objects ``V17Strategy`` takes, and passes every other
argument (the axis sizes, ``zero_stage``, ``activation_checkpointing``, ``config``, ``timeout``, ...) as it is:

* ``bucket_mb``, ``wrap_classes``, ``reshard_after_forward``, ``overlap_comm``, ``prefetch_units``,
  ``optimizer_partition``, ``meta_init`` -> ``zero=ZeroPolicy(...)``, with ``zero_stage`` as its ``stage`` (default 3);
  ``zero_stage`` alone stays the shortcut, so that a DeepSpeed ``config=``'s ZeRO section still applies;
* ``offload_optimizer``, ``offload_params``, ``nvme_path``, ``offload_optimizer_ratio`` -> ``offload=OffloadPolicy``;
* ``pp_schedule``, ``microbatches``, ``virtual_stages``, ``pp_split_points`` -> ``pp=PipelinePolicy(size=pp, ...)``;
* ``tp_plan``, ``sequence_parallel``, ``vocab_parallel``, ``loss_parallel`` -> ``tp=TPPolicy(size=tp, ...)``;
* ``fp8`` (the recipe) with ``fp8_backend``, ``fp8_skip``, ``fp8_all_gather``, ``fp8_amax_history_len`` ->
  ``fp8=FP8Policy.from_options(...)``, which also refuses those options without a recipe.

Code outside the tests writes the policies itself (README, ``docs/``).
"""

from __future__ import annotations

from typing import Any

ZERO = {"bucket_mb": "bucket_mb", "wrap_classes": "wrap_classes", "reshard_after_forward": "reshard_after_forward",
        "overlap_comm": "overlap_comm", "prefetch_units": "prefetch_units", "optimizer_partition": "optimizer_partition",
        "meta_init": "meta_init"}  # fmt: skip
OFFLOAD = {"offload_optimizer": "optimizer", "offload_params": "params", "nvme_path": "nvme_path",
           "offload_optimizer_ratio": "optimizer_ratio"}  # fmt: skip
PIPELINE = {"pp_schedule": "schedule", "microbatches": "microbatches", "virtual_stages": "virtual_stages",
            "pp_split_points": "split_points"}  # fmt: skip
TP = {"tp_plan": "plan", "sequence_parallel": "sequence_parallel", "vocab_parallel": "vocab_parallel",
      "loss_parallel": "loss_parallel"}  # fmt: skip
FP8 = ("fp8_backend", "fp8_skip", "fp8_all_gather", "fp8_amax_history_len")


def policies(**flat: Any) -> dict[str, Any]:
    """The ``V17Strategy`` keyword arguments for ``flat`` (see the module docstring)."""
    from lightning_v17.config import FP8Policy, OffloadPolicy, PipelinePolicy, TPPolicy, ZeroPolicy

    kw = dict(flat)

    def take(names: dict[str, str], into: str) -> dict[str, Any]:
        picked = {field: kw.pop(name) for name, field in names.items() if name in kw}
        if picked and into in kw:
            raise TypeError(f"v17(): give {sorted(picked)} or {into}=, not both")
        return picked

    zero = take(ZERO, "zero")
    if zero:  # a None field means "not given", as the flat arguments had it
        stage = kw.pop("zero_stage", None)
        zero = {k: v for k, v in zero.items() if v is not None} | ({} if stage is None else {"stage": stage})
        kw["zero"] = ZeroPolicy(**zero)
    fields = take(OFFLOAD, "offload")
    if fields:
        kw["offload"] = OffloadPolicy(**fields)
    for names, axis, cls in ((PIPELINE, "pp", PipelinePolicy), (TP, "tp", TPPolicy)):
        fields = {field: kw.pop(name) for name, field in names.items() if name in kw}
        if fields:
            kw[axis] = cls(size=kw.get(axis, 1), **fields)
    if any(n in kw for n in FP8):
        options = {n[len("fp8_") :]: kw.pop(n) for n in FP8 if n in kw}
        kw["fp8"] = FP8Policy.from_options(kw.pop("fp8", None), **options)
    return kw


def v17(**flat: Any) -> Any:
    """``V17Strategy(**policies(**flat))``."""
    from lightning_v17 import V17Strategy

    return V17Strategy(**policies(**flat))
