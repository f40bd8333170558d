"""The optimizer state of ZeRO stages 1-2 as DCP sees it: FQN keys, every per-parameter tensor a ``DTensor`` that
describes its global layout (FSDP2's ``Shard(0)`` over ``dp_shard``), so that a checkpoint reshards between stages,
world sizes and meshes (:class:`~lightning_v17.engine.zero.stages_0_2.ZeroEngine` inherits these methods)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.zero.layout import _local, _Param, _rows

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["ShardedOptimizerState"]


class ShardedOptimizerState:
    """Save, initialize and load a ZeRO-1/2 engine's sharded optimizer state (DCP's FQN-keyed layout).

    Mixed into :class:`~lightning_v17.engine.zero.stages_0_2.ZeroEngine`, whose attributes it reads: ``params`` and
    ``by_shard`` (the partition), ``rank``/``world``/``replicas``, ``shard_group``/``shard_mesh``, ``owner_mode``.
    """

    params: Sequence[_Param]
    by_shard: dict[int, _Param]
    rank: int
    world: int
    replicas: int
    shard_group: Any
    shard_mesh: Any
    owner_mode: bool
    expert_fqns: dict[int, str]
    expert_engine: Any

    def _engines(self) -> list[Any]:
        """This engine and the experts' (their rows over efsdp) when there is one."""
        return [self] + ([self.expert_engine] if self.expert_engine is not None else [])

    def _entry(self, p: torch.Tensor) -> tuple[Any, _Param] | None:
        """(the engine whose partition holds optimizer parameter ``p``, its entry), or None for an expert weight
        stepped whole (outside every partition)."""
        for eng in self._engines():
            e = eng.by_shard.get(id(p))
            if e is not None:
                return eng, e
        return None

    def _fqn_of(self, p: torch.Tensor) -> str:
        hit = self._entry(p)
        return hit[1].fqn if hit is not None else self.expert_fqns[id(p)]

    @torch.no_grad()
    def _gather_piece(self, e: _Param, t: torch.Tensor) -> torch.Tensor:
        """All-gather the dp_shard rows of ``t`` (this rank's shard of ``e``) into the whole local piece of ``e``'s
        parameter (the tensor-parallel shard when the parameter is a DTensor); collective over dp_shard."""
        piece_shape = _local(e.param).shape
        if self.world == 1:
            return t.reshape(piece_shape)
        seg = torch.zeros(e.padded_rows, e.row_numel, dtype=t.dtype, device=t.device)
        seg[: e.stop - e.start].copy_(t.reshape(e.stop - e.start, e.row_numel))
        out = torch.empty(self.world * e.padded_rows, e.row_numel, dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, seg, group=self.shard_group)
        return out[: e.rows].reshape(piece_shape)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """FQN-keyed optimizer state with every per-parameter tensor a ``DTensor`` describing its global layout.

        * Plain parameters: this rank's rows, ``Shard(0)`` over dp_shard (``Replicate`` over dp_replicate) -- the
          layout ``get_optimizer_state_dict`` reports for an FSDP2 model (stage 3), so DCP reshards between stages
          and world sizes.
        * Tensor-parallel (DTensor) parameters: the rows are a dim-0 chunk of the *TP-local* piece, which is not a
          plain placement on the (dp_shard, tp) mesh when TP also shards dim 0 (FSDP2 needs ``_StridedShard`` for
          that). Here the dp_shard rows are all-gathered back into the TP-local piece (a collective, at save time
          only) and described exactly like the parameter itself (its tp mesh and placements, replicated over dp);
          DCP then saves each TP piece once and reshards it to any tp / dp / stage.
        """
        sd = optimizer.state_dict()
        params = [p for group in optimizer.param_groups for p in group["params"]]  # state_dict's index order
        idx_to_fqn = {i: self._fqn_of(p) for i, p in enumerate(params)}
        state: dict[str, Any] = {}
        for idx, st in sd["state"].items():
            fqn = idx_to_fqn[idx]
            hit = self._entry(params[idx])
            if hit is None:  # an expert weight sharded over ep, stepped whole: its state is DTensors of that layout
                state[fqn] = dict(st)
                continue
            out = hit[0]._entry_state(hit[1], st)
            if out is not None:
                state[fqn] = out
        groups = [{**g, "params": [idx_to_fqn[j] for j in g["params"]]} for g in sd["param_groups"]]
        return {"state": state, "param_groups": groups}

    def _entry_state(self, e: _Param, st: dict[str, Any]) -> dict[str, Any] | None:
        """One parameter's optimizer state as :meth:`optimizer_state_dict` saves it (None: not saved here)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if self.owner_mode:
            # whole parameters, saved by their owner only (plain tensors, or the TP DTensor of a TP parameter);
            # DCP reads them back into any layout (rows, FSDP2 shards, another owner). The other ranks' empty
            # stand-ins hold no state but what _init_optim_state's zero-lr step gave them: not saved.
            return dict(st) if e.owner == self.rank else None
        placements = [Shard(0)] if self.replicas == 1 else [Replicate(), Shard(0)]
        tp_param = isinstance(e.param, DTensor)
        out = {}
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape == e.shard.shape:
                if tp_param:  # a tp (or ep) DTensor: the rows gathered into its local piece, described like it
                    v = DTensor.from_local(
                        self._gather_piece(e, v),
                        e.param.device_mesh,
                        e.param.placements,
                        run_check=False,
                        shape=e.param.shape,
                        stride=e.param.stride(),
                    )
                else:
                    v = DTensor.from_local(
                        v, self.shard_mesh, placements, run_check=False, shape=e.param.shape,
                        stride=e.param.stride(),
                    )  # fmt: skip
            out[k] = v
        return out

    def init_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Give an optimizer that has not stepped yet its state tensors (torch's ``_init_optim_state``: one step with
        zero gradients at lr 0), so that DCP has tensors to load into. With ``partition="params"`` the empty
        stand-ins of the parameters other ranks own are out of the groups meanwhile: nothing steps them, and an
        optimizer that divides by a parameter's size (``torch.optim.Adafactor``) cannot step an empty one."""
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        groups = [g["params"] for g in optimizer.param_groups]

        def stepped_here(p: torch.Tensor) -> bool:
            hit = self._entry(p)
            return hit is None or not hit[0].owner_mode or hit[1].owner == hit[0].rank

        try:
            for g in optimizer.param_groups:
                g["params"] = [p for p in g["params"] if stepped_here(p)]
            _init_optim_state(optimizer)
        finally:
            for g, params in zip(optimizer.param_groups, groups):
                g["params"] = params

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
        """Inverse of :meth:`optimizer_state_dict` (DTensors, or full plain tensors from a stage-0 checkpoint).

        The hyperparameters of each param group come from ``osd`` (by group index); which parameters the groups
        hold comes from ``optimizer`` itself: a checkpoint written at another pipeline split lists other FQNs there
        (DCP keeps one rank's copy of such non-tensor entries).
        """
        from torch.distributed.tensor import DTensor

        fqn_to_idx: dict[str, int] = {}
        own_groups: list[list[int]] = []
        i = 0
        for group in optimizer.param_groups:
            own_groups.append([])
            for p in group["params"]:
                fqn_to_idx[self._fqn_of(p)] = i
                own_groups[-1].append(i)
                i += 1
        by_fqn = {e.fqn: (eng, e) for eng in self._engines() for e in eng.params}
        state = {}
        for fqn, st in osd["state"].items():
            if fqn not in fqn_to_idx:
                continue  # another pipeline stage's parameter
            hit = by_fqn.get(fqn)
            if hit is None:  # an expert weight sharded over ep, stepped whole: DTensor states, loaded as they are
                state[fqn_to_idx[fqn]] = dict(st)
                continue
            eng, e = hit
            if eng.owner_mode:
                if e.owner == eng.rank:  # whole-parameter states, already in the template's layout
                    state[fqn_to_idx[fqn]] = dict(st)
                continue
            out = {}
            for k, v in st.items():
                if isinstance(v, DTensor):
                    v = v.to_local()
                    if v.shape != e.shard.shape and v.shape == _local(e.param).shape:
                        v = _rows(v)[e.start : e.stop].reshape(e.shard.shape)  # a gathered TP piece: keep my rows
                elif torch.is_tensor(v) and v.dim() > 0 and v.shape == e.param.shape:
                    v = _rows(v)[e.start : e.stop].reshape(e.shard.shape)
                out[k] = v
            state[fqn_to_idx[fqn]] = out
        saved = osd["param_groups"]
        if len(saved) != len(own_groups):
            raise V17ConfigError(
                f"the checkpoint's optimizer has {len(saved)} param groups but configure_optimizers builds "
                f"{len(own_groups)}; build the same param groups as the run that saved it"
            )
        groups = [{**g, "params": idx} for g, idx in zip(saved, own_groups)]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
