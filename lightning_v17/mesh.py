"""MeshSpec -> torch DeviceMesh, and the runtime object that holds it.

``MeshSpec`` (config.py) is the frozen, validated description. :class:`MeshRuntime` is the live state built in
``Strategy.setup_environment`` once the process group exists; reading it before then raises a clear error.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_v17.config import AXIS_ORDER, Axis, MeshSpec, V17ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Every root DeviceMesh built here (the dense one and the experts' sparse one), for :func:`destroy_process_groups`.
_ROOTS: weakref.WeakSet = weakref.WeakSet()


def build_device_mesh(spec: MeshSpec, *, device_type: str) -> DeviceMesh:
    """Build one DeviceMesh with all five axes in :data:`AXIS_ORDER` (pp outermost, tp innermost).

    Size-1 axes are kept so that every axis name can always be looked up (``mesh["tp"]`` works with tp=1).
    The flattened ``"dp"`` axis (dp_replicate × dp_shard) is created too, for data loading and loss reduction,
    and ``"dp_shard_cp"`` for ZeRO when cp > 1 (torchtitan's convention), with ``"dp_cp"`` (dp_replicate × dp_shard
    × cp, the ranks whose gradients are averaged) and, under HSDP, the 2-D ``"dp_replicate_dp_shard_cp"``
    (:func:`zero_mesh`); with ep > 1 the experts' ``"ep"`` and ``"edp"`` axes (:func:`_expert_meshes`).

    Args:
        spec: the validated mesh sizes; their product must equal the initialized world size.
        device_type: "cpu" or "cuda".
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("build_device_mesh needs an initialized process group; call it from setup_environment")
    world = dist.get_world_size()
    if spec.world_size != world:
        raise V17ConfigError(
            f"mesh {dict(zip([a.value for a in AXIS_ORDER], spec.shape()))} has {spec.world_size} ranks "
            f"but the world size is {world}; make the product of the axis sizes equal devices x num_nodes"
        )
    names = tuple(a.value for a in AXIS_ORDER)
    mesh = init_device_mesh(device_type, spec.shape(), mesh_dim_names=names)
    _ROOTS.add(mesh)
    # Keep the flattened meshes ourselves: torch deprecates slicing a flattened dim from the root mesh
    # ("Users need to bookkeep the flattened mesh directly"); submesh() reads them from here.
    flat = {
        "dp": mesh[(Axis.DP_REPLICATE.value, Axis.DP_SHARD.value)]._flatten("dp"),
        "dp_shard_cp": mesh[(Axis.DP_SHARD.value, Axis.CP.value)]._flatten("dp_shard_cp"),
    }
    mesh._v17_flat = flat  # type: ignore[attr-defined]
    if spec.cp > 1 and spec.dp_replicate > 1:
        # HSDP beside cp (torchtitan's dp_replicate x dp_shard_cp): the gradients are averaged over every dp x cp
        # rank ("dp_cp"), and ZeRO shards over dp_shard_cp and replicates over dp_replicate. The 2-D mesh is the
        # dp_replicate axis next to the flattened one, with the groups both already have.
        axes = (Axis.DP_REPLICATE.value, Axis.DP_SHARD.value, Axis.CP.value)
        flat["dp_cp"] = mesh[axes]._flatten("dp_cp")
        flat["dp_replicate_dp_shard_cp"] = DeviceMesh._concatenate([mesh[Axis.DP_REPLICATE.value], flat["dp_shard_cp"]])
    elif spec.cp > 1:
        flat["dp_cp"] = flat["dp_shard_cp"]  # the same ranks: no second group
    if spec.ep > 1:
        mesh._v17_flat.update(_expert_meshes(spec, device_type))  # type: ignore[attr-defined]
    return mesh


def _expert_meshes(spec: MeshSpec, device_type: str) -> dict[str, DeviceMesh]:
    """The sparse mesh of expert parallelism: ``dp_shard`` unflattened into (``efsdp``, ``ep``), ep innermost (the
    same rank order as the dense mesh, so an ep group is ``ep`` consecutive dp_shard ranks); its ``ep`` axis and the
    flattened expert-data-parallel axis ``edp``: the ranks that hold the same experts, ``dp_replicate x efsdp``, and
    with cp > 1 ``x cp`` (Megatron-core folds the experts over dp x cp: the cp ranks of one row hold the same experts
    and route other tokens, so the experts' gradients are summed over them too; each cp rank dispatches over the ep
    group of its own cp index). With cp > 1 and efsdp > 1 also ``efsdp_cp``, the ranks ZeRO shards the experts over
    (:func:`expert_shard_mesh`)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (spec.pp, spec.dp_replicate, spec.efsdp, spec.ep, spec.cp, spec.tp)
    names = ("pp", "dp_replicate", "efsdp", "ep", "cp", "tp")
    sparse = init_device_mesh(device_type, shape, mesh_dim_names=names)
    _ROOTS.add(sparse)
    edp_axes = ("dp_replicate", "efsdp", "cp") if spec.cp > 1 else ("dp_replicate", "efsdp")
    out = {"ep": sparse["ep"], "edp": sparse[edp_axes]._flatten("edp"), "sparse": sparse}
    if spec.cp > 1 and spec.efsdp > 1:
        out["efsdp_cp"] = sparse[("efsdp", "cp")]._flatten("efsdp_cp")
    return out


def expert_shard_mesh(mesh: DeviceMesh, *, offloaded: bool = False) -> DeviceMesh | None:
    """The mesh ZeRO shards the experts over: ``efsdp`` of the sparse mesh (``(dp_replicate, efsdp)`` for HSDP; with
    cp > 1 the flattened ``efsdp x cp``), or None when no rank shares an ep rank's experts within ``dp_shard`` (ep =
    1, or efsdp = 1: ep = dp_shard; the experts' gradients are then reduced over ``edp`` by ``engine/ep``).

    Args:
        offloaded: the parameters are offloaded (``OffloadPolicy(params=...)``, ZeRO-3), which moves FSDP2 units'
            shards: the experts need units of their own even at efsdp = 1, over the one-rank ``efsdp`` axis
            (``(dp_replicate, efsdp)`` for HSDP, where the replicas reduce them; ``cp`` under cp)."""
    from torch.distributed.device_mesh import DeviceMesh

    flat = getattr(mesh, "_v17_flat", None) or {}
    sparse = flat.get("sparse")
    if sparse is None or (sparse["efsdp"].size() == 1 and not offloaded):
        return None
    if sparse["cp"].size() == 1:
        return sparse["dp_replicate", "efsdp"] if sparse["dp_replicate"].size() > 1 else sparse["efsdp"]
    shard = flat["efsdp_cp"] if sparse["efsdp"].size() > 1 else sparse["cp"]  # efsdp x cp
    return DeviceMesh._concatenate([sparse["dp_replicate"], shard]) if sparse["dp_replicate"].size() > 1 else shard


def zero_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ZeRO works over: ``dp_shard`` (``dp_shard_cp`` with cp > 1, torchtitan's: the cp ranks hold the
    same parameters and their gradients are averaged with the data-parallel ones), or under HSDP the 2-D
    (``dp_replicate``, that axis): FSDP2 shards over its last dim and replicates over its first, and stages 1-2
    partition over the last."""
    cp = mesh["cp"].size() > 1
    if mesh["dp_replicate"].size() == 1:
        return submesh(mesh, "dp_shard_cp") if cp else mesh["dp_shard"]
    return submesh(mesh, "dp_replicate_dp_shard_cp") if cp else mesh["dp_replicate", "dp_shard"]


def submesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh[name]``, where the flattened axes ("dp", "dp_shard_cp") come from :func:`build_device_mesh`'s own
    bookkeeping (no deprecated slice of a flattened dim from the root mesh)."""
    flat = getattr(mesh, "_v17_flat", None) or {}
    return flat[name] if name in flat else mesh[name]


def destroy_process_groups() -> None:
    """Destroy every process group and let go of the ones the meshes built here still hold, so that each gloo
    group's destructor runs now and joins its worker threads.

    ``destroy_process_group()`` only forgets the groups; a DeviceMesh keeps its own references (its root's
    ``_pg_registry``), and DTensor's sharding caches keep the meshes alive to the end of the process, so without this
    the gloo workers of the mesh's groups outlive the interpreter (measured: 21 gloo threads left after
    ``destroy_process_group()`` in a tp=2 job, none after this). Call it once the groups are no longer used: at exit.
    """
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for mesh in list(_ROOTS):
        registry = getattr(mesh, "_pg_registry", None)  # torch's private registry; absent in other releases
        if isinstance(registry, dict):
            registry.clear()
    gc.collect()  # the groups referenced only from reference cycles (a Trainer and its module) go now, not at exit


@dataclass
class MeshRuntime:
    """Live distributed state: the spec plus the DeviceMesh built from it."""

    spec: MeshSpec
    device_mesh: DeviceMesh

    def __getitem__(self, axis: str | Axis) -> DeviceMesh:
        return submesh(self.device_mesh, str(axis))

    def rank(self, axis: str | Axis) -> int:
        return self[axis].get_local_rank()

    def group(self, axis: str | Axis):
        return self[axis].get_group()

    @property
    def zero_axis(self) -> str:
        """The axis ZeRO partitions over: ``dp_shard``, or ``dp_shard_cp`` with cp > 1 (the cp ranks' gradients
        are reduced with the data-parallel ones)."""
        return "dp_shard_cp" if self.spec.cp > 1 else "dp_shard"

    @property
    def replica_axis(self) -> str:
        """The ranks that hold whole replicas at stages 0-2: ``dp``, or ``dp_cp`` (dp_replicate x dp_shard x cp)
        with cp > 1."""
        return "dp_cp" if self.spec.cp > 1 else "dp"


class UnsetMesh:
    """Placeholder until ``setup_environment`` runs: any use raises an error that says so."""

    def __getattr__(self, name: str):
        raise RuntimeError(
            "the device mesh is not built yet: it exists after Trainer.fit/validate/test has called "
            "strategy.setup_environment(); do not read strategy.mesh in __init__ or configure_* hooks called earlier"
        )
