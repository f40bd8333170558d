"""What V17Strategy (the Trainer's) and V17FabricStrategy share once the engine has run: the live mesh, the result of
the one ``parallelize`` call and the devices, as one mixin placed ahead of each one's Lightning base class."""

from __future__ import annotations

from typing import Any

import torch

from lightning_v17.engine.parallelize import Parallelized
from lightning_v17.engine.zero.backend import ZeroBackend
from lightning_v17.mesh import MeshRuntime, UnsetMesh


class EngineState:
    """The mesh and the engine's result. The strategy sets ``_mesh`` in ``setup_environment`` and ``_parallel`` when
    it parallelizes the model; ``_setup_call`` names that call in the error read before it."""

    _mesh: MeshRuntime | UnsetMesh
    _parallel: Parallelized | None
    _setup_call = "setup"
    parallel_devices: list[torch.device] | None
    local_rank: int

    @property
    def mesh(self) -> MeshRuntime:
        """The live mesh. Reading it before ``setup_environment`` raises (see :class:`~lightning_v17.mesh.UnsetMesh`)."""
        if isinstance(self._mesh, UnsetMesh):
            _ = self._mesh.spec  # raises the explanatory error
        return self._mesh  # type: ignore[return-value]

    @property
    def parallel(self) -> Parallelized | None:
        """What ``parallelize`` did to the model (None before the model is set up)."""
        return self._parallel

    @property
    def zero(self) -> ZeroBackend:
        """The applied ZeRO stage: ask it what is sharded, how to sync, how to save the optimizer."""
        if self._parallel is None:
            raise RuntimeError(f"strategy.zero exists after {self._setup_call} has parallelized the model")
        return self._parallel.zero

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """A sampler's replicas are the data-parallel ranks (tp, cp and pp ranks of one replica read the same rows)."""
        dp = self.mesh["dp"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}
