"""The axis sizes, owned by one object: :class:`ParallelDims` as given (``dp_shard`` may wait for the world size),
:class:`MeshSpec` once resolved against the world size (the DeviceMesh is built from it in ``lightning_v17.mesh``).

The strategy builds one ``ParallelDims`` from its arguments; the composition rules (``config/rules.py``), the planner
and ``engine/parallelize.py`` read the sizes from it (or from the ``MeshSpec`` it resolves to, which is a
``ParallelDims`` too), never from the policies or from a dict of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from lightning_v17.config.enums import Axis
from lightning_v17.config.errors import V17ConfigError

#: Mesh axis order, outermost first. tp is innermost so that its ranks are adjacent (same node, NVLink).
AXIS_ORDER: tuple[Axis, ...] = (Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP, Axis.TP)


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise V17ConfigError(f"{name}={value!r} must be a positive integer")


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of the parallel axes, given once (torchtitan's ``ParallelDims``): what the rules, the planner and
    ``parallelize`` read. ``dp_shard`` may be ``"auto"`` until the world size is known (:meth:`mesh`).

    Args:
        pp: pipeline-parallel stages.
        dp_replicate: replicated data-parallel groups (HSDP's outer axis).
        dp_shard: sharded data-parallel ranks, or ``"auto"`` (the world size over the other axes).
        cp: context-parallel size.
        tp: tensor-parallel size.
        ep: expert-parallel size, folded out of ``dp_shard`` (:class:`MeshSpec`).
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int | str = "auto"
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "dp_replicate", "cp", "tp", "ep"):
            _check_positive_int(name, getattr(self, name))
        if self.dp_shard == -1:
            object.__setattr__(self, "dp_shard", "auto")
        if self.dp_shard != "auto":
            if not isinstance(self.dp_shard, int) or isinstance(self.dp_shard, bool) or self.dp_shard < 1:
                raise V17ConfigError(f"dp_shard={self.dp_shard!r} must be a positive integer or 'auto'")
            if self.dp_shard % self.ep:
                raise V17ConfigError(
                    f"ep={self.ep} is folded out of the dp_shard={self.dp_shard} data-parallel ranks and must divide "
                    f"it; choose ep in {divisors(self.dp_shard)} or raise dp_shard"
                )

    def mesh(self, world_size: int) -> MeshSpec:
        """These sizes against ``world_size``: ``dp_shard="auto"`` resolved, the product checked.

        Raises:
            V17ConfigError: the fixed axes do not divide the world size, or the product differs from it.
        """
        return MeshSpec.resolve(world_size, pp=self.pp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard,
                                cp=self.cp, tp=self.tp, ep=self.ep)  # fmt: skip


@dataclass(frozen=True)
class MeshSpec(ParallelDims):
    """Sizes of the five mesh axes, resolved: a :class:`ParallelDims` whose ``dp_shard`` is a number. The product is
    the world size.

    Build it with concrete sizes, or let :meth:`resolve` (or :meth:`ParallelDims.mesh`) fill in ``dp_shard`` from the
    world size. The object is immutable: "auto" is resolved by the classmethod, never by mutation.

    Args:
        pp: pipeline-parallel stages (outermost axis).
        dp_replicate: replicated data-parallel groups (HSDP's outer axis; plain DDP when dp_shard is 1).
        dp_shard: sharded data-parallel group size (ZeRO/FSDP partitions over this axis).
        cp: context-parallel size: each row's sequence is split over cp ranks (``CPPolicy``); ZeRO shards over
            dp_shard x cp (torchtitan's ``dp_shard_cp``), and a cp group trains on one data-parallel rank's batch.
        tp: tensor-parallel size (innermost axis).
        ep: expert-parallel size: MoE layers' experts are sharded over ``ep`` ranks, folded out of ``dp_shard``
            (torchtitan's sparse mesh, Megatron-core's parallel folding): ``dp_shard = efsdp x ep`` with ``ep``
            innermost, each ep rank trains on its own batch, and the experts' replicas are the ``edp =
            dp_replicate x efsdp`` ranks. Not a factor of the world size. ``ep`` must divide ``dp_shard``.
    """

    dp_shard: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_positive_int(f.name, getattr(self, f.name))
        if self.dp_shard % self.ep:
            raise V17ConfigError(
                f"ep={self.ep} is folded out of the dp_shard={self.dp_shard} data-parallel ranks and must divide it; "
                f"choose ep in {divisors(self.dp_shard)} or raise dp_shard"
            )

    @property
    def efsdp(self) -> int:
        """The experts' ZeRO group: the ``dp_shard`` ranks that hold the same experts (``dp_shard / ep``)."""
        return self.dp_shard // self.ep

    @property
    def edp(self) -> int:
        """The ranks that hold the same experts, over which their gradients are reduced (``dp_replicate x efsdp``)."""
        return self.dp_replicate * self.efsdp

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Total data-parallel degree (replicate × shard)."""
        return self.dp_replicate * self.dp_shard

    def size(self, axis: Axis | str) -> int:
        return getattr(self, Axis(axis).value)

    def shape(self) -> tuple[int, ...]:
        """Mesh shape in :data:`AXIS_ORDER`, all five axes included (size-1 axes too)."""
        return tuple(self.size(a) for a in AXIS_ORDER)

    def active_axes(self) -> tuple[Axis, ...]:
        """Axes with size > 1, outermost first."""
        return tuple(a for a in AXIS_ORDER if self.size(a) > 1)

    @classmethod
    def resolve(
        cls,
        world_size: int,
        *,
        pp: int = 1,
        dp_replicate: int = 1,
        dp_shard: int | str = "auto",
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
    ) -> MeshSpec:
        """Resolve ``dp_shard="auto"`` (or -1) from the world size and check that the product matches.

        Raises:
            V17ConfigError: if the fixed axes do not divide the world size, or the product differs from it.
        """
        _check_positive_int("world_size", world_size)
        fixed = {"pp": pp, "dp_replicate": dp_replicate, "cp": cp, "tp": tp}
        for name, value in fixed.items():
            _check_positive_int(name, value)
        others = pp * dp_replicate * cp * tp
        if dp_shard in ("auto", -1, None):
            if world_size % others != 0:
                raise V17ConfigError(
                    f"cannot resolve dp_shard='auto': world size {world_size} is not divisible by "
                    f"pp*dp_replicate*cp*tp = {pp}*{dp_replicate}*{cp}*{tp} = {others}; "
                    f"change devices/num_nodes or the axis sizes so that they divide it"
                )
            dp_shard = world_size // others
        spec = cls(pp=pp, dp_replicate=dp_replicate, dp_shard=int(dp_shard), cp=cp, tp=tp, ep=ep)
        if spec.world_size != world_size:
            raise V17ConfigError(
                f"mesh pp={pp} x dp_replicate={dp_replicate} x dp_shard={dp_shard} x cp={cp} x tp={tp} = "
                f"{spec.world_size} does not equal the world size {world_size} (devices x num_nodes); "
                f"set dp_shard='auto' or change the sizes so their product is {world_size}"
            )
        return spec


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tp_divides(tp: int, **dims: int) -> None:
    """Raise a clear error unless ``tp`` divides every named model dimension (heads, kv_heads, ffn, ...).

    Example: ``check_tp_divides(3, num_attention_heads=8)`` raises
    "tp=3 must divide num_attention_heads=8; try tp in {1, 2, 4, 8}".
    """
    bad = {k: v for k, v in dims.items() if v % tp != 0}
    if not bad:
        return
    common = sorted(set.intersection(*(set(divisors(v)) for v in dims.values())))
    names = ", ".join(f"{k}={v}" for k, v in bad.items())
    raise V17ConfigError(f"tp={tp} must divide {names}; try tp in {{{', '.join(map(str, common))}}}")
